"""T5-style relative position bias (T5 / mT5 encoders, MPNet): a learned value per head and
bucket of ``key position - query position``, added to the attention scores of every layer
through ``Attention``'s ``mask_fn``. Buckets are bidirectional (half of them for keys after
the query): exact for small distances, log-spaced up to ``max_distance``, as Mesh TensorFlow
and transformers compute them."""

from __future__ import annotations

import math

import torch

from cenote.models.layers.attention import EncoderMaskFn
from cenote.models.layers.embedding import Embedding


def relative_position_bucket(
    relative_position: torch.Tensor, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bidirectional T5 buckets of ``key - query`` distances."""
    num_buckets //= 2
    buckets = (relative_position > 0).to(torch.long) * num_buckets
    distance = relative_position.abs()
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (
        torch.log(distance.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(Embedding):
    """The table ``[table_size, heads]`` (checkpoints' ``relative_attention_bias.weight``),
    indexed by ``num_buckets`` buckets (MPNet's table may be larger than what it indexes)."""

    def __init__(self, table_size: int, num_heads: int, num_buckets: int, max_distance: int):
        super().__init__(table_size, num_heads)
        self.num_buckets = num_buckets
        self.max_distance = max_distance

    def bias(self, length: int) -> torch.Tensor:
        """``[heads, length, length]`` bias of one request of ``length`` tokens."""
        positions = torch.arange(length, device=self.weight.device)
        relative = positions[None, :] - positions[:, None]  # key - query
        buckets = relative_position_bucket(relative, self.num_buckets, self.max_distance)
        return self(buckets).permute(2, 0, 1)

    def mask_fn(self, dtype: torch.dtype) -> EncoderMaskFn:
        """The bias as the layers of one step read it: one per request length, in ``dtype``,
        computed by the first layer that needs it."""
        biases: dict[int, torch.Tensor] = {}

        def mask_fn(rows: slice, num_requests: int, length: int) -> torch.Tensor:
            if length not in biases:
                biases[length] = self.bias(length).to(dtype)
            return biases[length]  # [heads, length, length], broadcast over the requests

        return mask_fn
