"""The `bytes` encoding's metadata items and decoding, as vLLM documents them."""

import math
from dataclasses import dataclass

from vllm.utils.serial_utils import EMBED_DTYPES, binary2tensor


@dataclass
class MetadataItem:
    index: int
    embed_dtype: str
    endianness: str
    start: int
    end: int
    shape: tuple


def build_metadata_items(embed_dtype, endianness, shape, n_request):
    num_bytes = EMBED_DTYPES[embed_dtype][1]().itemsize
    size = math.prod(shape)
    return [
        MetadataItem(
            i, embed_dtype, endianness, i * size * num_bytes, (i + 1) * size * num_bytes, shape
        )
        for i in range(n_request)
    ]


def decode_pooling_output(items, body):
    return [
        binary2tensor(
            body[item.start : item.end], tuple(item.shape), item.embed_dtype, item.endianness
        )
        for item in sorted(items, key=lambda item: item.index)
    ]
