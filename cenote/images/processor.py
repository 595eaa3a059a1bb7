"""A folder's image preprocessing (``preprocessor_config.json``), as transformers' PIL image
processors do it: RGB, resize (shortest edge keeping the aspect ratio, or a fixed height x width)
with PIL's filter, center crop, rescale, normalize with the folder's mean and std. Runs in the
front (the server's thread pool, the offline input processing), never on the engine loop."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from PIL.Image import Image

PREPROCESSOR_FILE = "preprocessor_config.json"
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' CLIP defaults
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


@dataclass(frozen=True)
class ImageProcessor:
    """One image -> ``[3, height, width]`` fp32 pixel values for the vision tower."""

    shortest_edge: int | None  # resize keeping the aspect ratio (CLIP); or
    resize_to: tuple[int, int] | None  # resize to (height, width) (SigLIP)
    crop: tuple[int, int] | None  # center crop (height, width), after the resize
    resample: int  # PIL resampling filter
    rescale_factor: float | None  # e.g. 1/255; None: no rescale
    mean: tuple[float, ...] | None  # None: no normalization
    std: tuple[float, ...] | None

    @classmethod
    def from_folder(cls, folder: Path, image_size: int) -> ImageProcessor:
        """The folder's ``preprocessor_config.json``; without one, CLIP's defaults at the
        vision tower's ``image_size``."""
        path = folder / PREPROCESSOR_FILE
        config: dict[str, Any] = {}
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        return cls.from_config(config, image_size)

    @classmethod
    def from_config(cls, config: dict[str, Any], image_size: int) -> ImageProcessor:
        size = (
            config.get("size", {"shortest_edge": image_size})
            if config.get("do_resize", True)
            else None
        )
        if isinstance(size, int):
            size = {"shortest_edge": size}
        shortest_edge = resize_to = None
        if size is not None:
            if "shortest_edge" in size:
                shortest_edge = int(size["shortest_edge"])
            elif "height" in size and "width" in size:
                resize_to = (int(size["height"]), int(size["width"]))
            else:
                raise ValueError(f"{PREPROCESSOR_FILE}: size {size} is not supported")
        crop = None
        if config.get("do_center_crop", not config):
            crop_size = config.get("crop_size", {"height": image_size, "width": image_size})
            if isinstance(crop_size, int):
                crop_size = {"height": crop_size, "width": crop_size}
            crop = (int(crop_size["height"]), int(crop_size["width"]))
            if shortest_edge is not None and max(crop) > shortest_edge:
                raise ValueError(
                    f"{PREPROCESSOR_FILE}: a center crop {crop} larger than the resized shortest "
                    f"edge ({shortest_edge}) is not supported"
                )
        normalize = config.get("do_normalize", True)
        return cls(
            shortest_edge=shortest_edge,
            resize_to=resize_to,
            crop=crop,
            resample=int(config.get("resample", _BICUBIC)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255))
            if config.get("do_rescale", True)
            else None,
            mean=tuple(config.get("image_mean", _OPENAI_CLIP_MEAN)) if normalize else None,
            std=tuple(config.get("image_std", _OPENAI_CLIP_STD)) if normalize else None,
        )

    def __call__(self, image: Image) -> torch.Tensor:
        # 1) RGB  2) resize  3) center crop  4) rescale  5) normalize
        image = image.convert("RGB")
        size = self._resized_size(image.width, image.height)
        if size is not None:
            image = image.resize(size, resample=self.resample)  # PIL takes (width, height)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        x = pixels.view(image.height, image.width, 3).permute(2, 0, 1)  # [3, height, width]
        if self.crop is not None:
            x = _center_crop(x, *self.crop)
        if self.rescale_factor is not None:
            x = (x.to(torch.float64) * self.rescale_factor).to(torch.float32)
        else:
            x = x.to(torch.float32)
        if self.mean is not None and self.std is not None:
            mean = torch.tensor(self.mean, dtype=torch.float32).view(-1, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32).view(-1, 1, 1)
            x = (x - mean) / std
        return x.contiguous()

    def _resized_size(self, width: int, height: int) -> tuple[int, int] | None:
        """(width, height) after the resize; None: no resize."""
        if self.resize_to is not None:
            return self.resize_to[1], self.resize_to[0]
        if self.shortest_edge is None:
            return None
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)


def _center_crop(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    top = (x.shape[1] - height) // 2
    left = (x.shape[2] - width) // 2
    return x[:, top : top + height, left : left + width]
