"""FLUX.1: the `flux` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "flux",
    "kit.families.flux.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="black-forest-labs/FLUX.1-dev",
)
