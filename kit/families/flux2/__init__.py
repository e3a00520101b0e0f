"""FLUX.2: the `flux2` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "flux2",
    "kit.families.flux2.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="black-forest-labs/FLUX.2-dev",
    control_images=10,  # optional reference images (flux2.MAX_REFERENCES)
)
