"""LoRA adapters added and removed while the server runs, in vLLM's shapes: ``POST
/v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
``{"lora_name"}``, each answering 200 with a plain-text sentence. Mounted only with
``--enable-lora-runtime-updating`` (without it both are 404, as vLLM's are unmounted).

A loaded adapter goes on the default (first) model; its folder is read and checked against
that base off the event loop (``ServerState.load_adapter``) and a bad one is a 400 naming the
problem, a path that is no folder a 404 (vLLM's "No adapter found"), a name already served a
400. Unloading refuses new requests naming it (404) at once; requests already running under
it finish under it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from cenote.server.body import JSONRoute
from cenote.server.protocol import _Body
from cenote.server.responses import schema
from cenote.server.served_models import get_served

router = APIRouter(route_class=JSONRoute)


class LoadLoRAAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str  # the name a request's ``model`` then gives
    lora_path: str  # a PEFT adapter folder on the server's machine


class UnloadLoRAAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body; its ``lora_int_id`` is not taken)."""

    lora_name: str


@router.post(
    "/v1/load_lora_adapter", response_class=PlainTextResponse, responses=schema(None, 400, 401, 404)
)
async def load_lora_adapter(
    body: LoadLoRAAdapterRequest, raw_request: Request
) -> PlainTextResponse:
    await get_served(raw_request).load_adapter(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses=schema(None, 400, 401, 404),
)
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, raw_request: Request
) -> PlainTextResponse:
    get_served(raw_request).unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
