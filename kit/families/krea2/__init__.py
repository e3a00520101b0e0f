"""Krea 2: the `krea2` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "krea2",
    "kit.families.krea2.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="krea/Krea-2-Raw",
)
