"""Z-Image: the `zimage` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "zimage",
    "kit.families.zimage.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="Tongyi-MAI/Z-Image-Turbo",
)
