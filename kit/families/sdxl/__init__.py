"""Stable Diffusion XL: the `sdxl` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "sdxl",
    "kit.families.sdxl.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="stabilityai/stable-diffusion-xl-base-1.0",
)
