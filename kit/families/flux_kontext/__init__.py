"""FLUX.1 Kontext (edit): the `flux_kontext` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "flux_kontext",
    "kit.families.flux_kontext.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="black-forest-labs/FLUX.1-Kontext-dev",
    control_images=1,
    needs_control=True,
)
