"""Qwen-Image-Edit: the `qwen_image_edit` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "qwen_image_edit",
    "kit.families.qwen_image_edit.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="Qwen/Qwen-Image-Edit",
    control_images=3,
    needs_control=True,
)
