"""The wire between the front process and the engine-core process: msgspec messages over zmq.

Requests and outputs are the engine's own typed messages (``cenote.messages``), encoded
with msgspec; tensors travel as raw bytes + dtype + shape in a msgpack extension.
"""

from __future__ import annotations

import msgspec
import torch

from cenote.engine.capabilities import ModelCapabilities
from cenote.messages import EngineCoreOutputs, EngineCoreRequest

_TENSOR_EXT = 1  # msgpack extension code of a tensor


class AddRequests(msgspec.Struct, tag=True):
    """Front -> core: new requests (one HTTP request may carry many prompts)."""

    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag=True):
    """Front -> core: forget these requests (client gone, stop string hit)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    """Front -> core: finish the loop and exit."""


CoreInput = AddRequests | AbortRequests | Shutdown


class Ready(msgspec.Struct, tag=True):
    """Core -> front, once: the model is loaded; what it can do."""

    capabilities: ModelCapabilities
    num_threads: int  # torch threads the core computes with
    cpu_ids: tuple[int, ...]  # CPUs the core process may run on (its affinity)


class StepOutputs(msgspec.Struct, tag=True):
    """Core -> front: what a step (or an abort) produced."""

    outputs: EngineCoreOutputs
    queue_times: list[float]  # seconds waited by requests first scheduled in this step


class CoreFailed(msgspec.Struct, tag=True):
    """Core -> front, last words: the loop raised."""

    message: str


class Heartbeat(msgspec.Struct, tag=True):
    """Core -> front, while idle and during a long step: the core is alive (outputs say so too)."""


CoreMessage = Ready | StepOutputs | CoreFailed | Heartbeat


def _encode_tensor(obj: object) -> msgspec.msgpack.Ext:
    if not isinstance(obj, torch.Tensor):
        raise NotImplementedError(f"cannot encode {type(obj).__name__}")
    tensor = obj.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    raw = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return msgspec.msgpack.Ext(
        _TENSOR_EXT, msgspec.msgpack.encode((dtype, list(tensor.shape), raw))
    )


def _decode_ext(code: int, data: memoryview) -> torch.Tensor:
    if code != _TENSOR_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    dtype_name, shape, raw = msgspec.msgpack.decode(data)
    dtype = getattr(torch, dtype_name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _decode_custom(expected: type, obj: object) -> object:
    if expected is torch.Tensor and isinstance(obj, torch.Tensor):
        return obj
    raise NotImplementedError(f"cannot decode {expected}")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_encode_tensor)


def input_decoder() -> msgspec.msgpack.Decoder[CoreInput]:
    return msgspec.msgpack.Decoder(CoreInput, ext_hook=_decode_ext, dec_hook=_decode_custom)


def output_decoder() -> msgspec.msgpack.Decoder[CoreMessage]:
    return msgspec.msgpack.Decoder(CoreMessage, ext_hook=_decode_ext, dec_hook=_decode_custom)
