"""Binary embedding decoding as vLLM documents it (dtype + byte order of a flat buffer)."""

import sys

import numpy as np
import torch

# dtype -> (torch dtype, numpy view dtype); vLLM 0.33 also lists fp8_e4m3 / fp8_e5m2
EMBED_DTYPES = {
    "float32": (torch.float32, np.float32),
    "float16": (torch.float16, np.float16),
    "bfloat16": (torch.bfloat16, np.float16),
    "fp8_e4m3": (torch.float8_e4m3fn, np.uint8),
    "fp8_e5m2": (torch.float8_e5m2, np.uint8),
}
ENDIANNESS = ("native", "big", "little")


def binary2tensor(binary, shape, embed_dtype, endianness):
    torch_dtype, view_dtype = EMBED_DTYPES[embed_dtype]
    array = np.frombuffer(binary, dtype=view_dtype).reshape(shape)
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return torch.from_numpy(array.copy()).view(torch_dtype)
