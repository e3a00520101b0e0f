"""Wan 2.1 / 2.2 (video): the `wan` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "wan",
    "kit.families.wan.family",
    bucket_step=16,
    native_resolution=480,
    hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    video=True,
    frame_stride=4,
)
