"""A family's plain facts: what scans, bucket plans and the planner read without torch.

Each family folder's `__init__` holds one `FamilyInfo` as `FACTS`; importing it costs nothing,
so the data commands learn every family without importing its module (or torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

CLIP_KEYS = (
    "num_frames",
    "frame_stride",
    "frame_start",
    "frame_sampling",
    "frame_windows",
    "window_stride",
    "condition_frame",
)
"""The data keys that only a family training on clips (`video`) reads: set on a family of
images they would do nothing, so they are refused there."""


class FamilyFacts(Protocol):
    """What the data path reads of a family: a `FamilyInfo`, or a loaded `Family` itself."""

    name: str
    bucket_step: int
    native_resolution: int
    hub_id: str
    video: bool
    audio: bool
    image_alpha: bool
    control_images: int
    needs_control: bool

    def frame_count(self, available: int) -> int: ...


@dataclass(frozen=True)
class FamilyInfo:
    """A family's plain facts, known without importing its module (or torch)."""

    name: str
    """The `model_family` value that selects this family."""
    module: str
    """The module whose import registers the family's class."""
    bucket_step: int = 64
    """Bucket sides are multiples of this (the class's `bucket_step`)."""
    native_resolution: int = 512
    """The side, in pixels, the released base model was trained at."""
    hub_id: str = ""
    """The hub repository of the maintained base model in diffusers layout."""
    video: bool = False
    """True when the family trains on clips (and so the scan reads them)."""
    control_images: int = 0
    """How many control (reference) images a training pair may have (the class's
    `control_images`): 0 for a family that takes none."""
    needs_control: bool = False
    """Whether every dataset must have its controls (an edit model; the class's `needs_control`)."""
    audio: bool = False
    """True when the family trains on a clip's sound too (LTX-2): the data path reads each video
    file's audio track for the frames it takes and hands it to the family's `encode_sound`."""
    image_alpha: bool = False
    """True when the family's VAE reads RGBA (the class's `image_alpha`): an image with
    transparency trains with its alpha channel, not laid on `alpha_background`, and the bucket
    report names the images that carry one."""
    frame_stride: int = 1
    """A clip's frame count is `frame_stride · k + 1`: a VAE that compresses time by 4 (Wan)
    takes 4k+1 frames; 1 accepts any count."""

    def frame_count(self, available: int) -> int:
        """The most frames (≤ `available`) a clip may have; 0 when none fits."""
        if self.frame_stride <= 1:
            return available
        if available <= 0:
            return 0
        return (available - 1) // self.frame_stride * self.frame_stride + 1
