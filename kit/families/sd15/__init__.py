"""Stable Diffusion 1.5: the `sd15` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "sd15",
    "kit.families.sd15.family",
    bucket_step=64,
    native_resolution=512,
    hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5",
)
