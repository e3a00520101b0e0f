"""Qwen-Image 2.1: the `qwen_image21` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "qwen_image21",
    "kit.families.qwen_image21.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="Qwen/Qwen-Image-2.1",
    control_images=10,
    image_alpha=True,
)
