"""LTX-2 (video with sound): the `ltx2` family's folder (its class in `family.py`).

Importing this package is cheap: `FACTS` are what scans and bucket plans read without torch.
"""

from kit.families.facts import FamilyInfo

FACTS = FamilyInfo(
    "ltx2",
    "kit.families.ltx2.family",
    # The VAE compresses 32x in space (LTX2Pipeline refuses sides not divisible by 32) and 8x in
    # time after the first frame (8k+1 frames), with 1x1x1 transformer patches.
    bucket_step=32,
    native_resolution=512,
    hub_id="Lightricks/LTX-2",
    video=True,
    frame_stride=8,
    audio=True,
)
