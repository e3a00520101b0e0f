"""Stable Diffusion 3.5: the `sd3` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "sd3",
    "kit.families.sd3.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="stabilityai/stable-diffusion-3.5-medium",
)
