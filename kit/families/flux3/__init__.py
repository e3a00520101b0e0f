"""FLUX.3 (klein base and step-distilled klein): the `flux3` family's folder (its class in
`family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "flux3",
    "kit.families.flux3.family",
    bucket_step=64,
    native_resolution=1024,
    hub_id="black-forest-labs/flux-3-image-klein-base",
    control_images=10,  # optional reference images (the prompt upsampler's "at most 10")
)
