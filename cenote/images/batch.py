"""The pixel values of one step's image requests, as the runner hands them to a vision tower."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageBatch:
    """Image requests of a step: their rows in the flat batch are placeholders (one per image
    token, so the scheduler counts them as it counts text tokens); the tower reads the pixels."""

    pixel_values: torch.Tensor  # [num_images, channels, height, width] fp32, preprocessed
    request_indices: list[int]  # [num_images] each image's request, in the step's batch order
