"""The served models: ``GET /v1/models`` and ``/v1/models/{model}`` (OpenAI's cards, with each
model's tasks, engine cores and load status), and the admin routes of ``--models-dir`` models,
as llama.cpp's router has them: ``POST /models/load`` and ``POST /models/unload`` with
``{"model": NAME}``.

Every card has llama.cpp's ``status``: ``{"value": "loaded" | "loading" | "unloading" |
"unloaded" | "failed"}`` (with ``reason`` when failed); a ``--models-dir`` model that is not
loaded has no ``max_model_len`` (null) and no tasks yet.

The admin routes sit behind ``--api-key`` like every route but ``/health``. Load: 200 once the
model is loaded (at once if it is), 503 when it fails (naming the cause) or takes longer than
``--model-load-timeout``. Unload: 200 once unloaded (after the requests in flight finish), 409
for a model that is not loaded, 400 for a ``--model`` one (always loaded). An unknown name is a
404 listing the served ones.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest
from cenote.server.on_demand import OnDemandModel, OnDemandModels
from cenote.server.protocol import _Body
from cenote.server.responses import ModelCard, ModelList, ModelStatusResponse, schema
from cenote.server.served_models import ServedModels, get_served
from cenote.server.state import ServerState

router = APIRouter(route_class=JSONRoute)


class ModelAdminRequest(_Body):
    """POST /models/load and /models/unload (llama.cpp's body)."""

    model: str  # a --models-dir model's name


@router.get("/v1/models", responses=schema(ModelList, 401))
async def list_models(raw_request: Request) -> JSONResponse:
    served = get_served(raw_request)
    cards = [
        card
        for state in served.states.values()
        for card in (
            _model_card(state),
            *(_adapter_card(state, name) for name in state.adapters),
        )
    ]
    if served.on_demand is not None:
        cards += [_on_demand_card(model) for model in served.on_demand.models.values()]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}", responses=schema(ModelCard, 401, 404))
async def retrieve_model(model: str, raw_request: Request) -> JSONResponse:
    served = get_served(raw_request)
    if served.on_demand is not None and model in served.on_demand.models:
        return JSONResponse(_on_demand_card(served.on_demand.models[model]))
    state = served.named(model)  # 404 unless a model or a served adapter
    if state.check_model(model) is not None:
        return JSONResponse(_adapter_card(state, model))
    return JSONResponse(_model_card(state))


@router.post("/models/load", responses=schema(ModelStatusResponse, 400, 401, 404, 413, 503))
async def load_model(body: ModelAdminRequest, raw_request: Request) -> JSONResponse:
    """Load a ``--models-dir`` model now (a failed one is tried again)."""
    served = get_served(raw_request)
    on_demand = _on_demand_of(served, body.model, "load")
    await on_demand.load(body.model)
    return JSONResponse({"model": body.model, "status": "loaded"})


@router.post("/models/unload", responses=schema(ModelStatusResponse, 400, 401, 404, 409, 413, 503))
async def unload_model(body: ModelAdminRequest, raw_request: Request) -> JSONResponse:
    """Unload a ``--models-dir`` model once its requests in flight have finished."""
    served = get_served(raw_request)
    on_demand = _on_demand_of(served, body.model, "unload")
    await on_demand.unload(body.model)
    return JSONResponse({"model": body.model, "status": "unloaded"})


def _on_demand_of(served: ServedModels, name: str, verb: str) -> OnDemandModels:
    """The on-demand models holding ``name``; 404 for an unknown name, 400 for a model that is
    always loaded."""
    on_demand = served.on_demand
    if on_demand is not None and name in on_demand.models:
        return on_demand
    served.named(name)  # 404 listing the served names when there is no such model
    raise BadRequest(
        f"the model {name!r:.200} is served by --model and always loaded; only --models-dir "
        f"models {verb}",
        param="model",
    )


# ---- cards ------------------------------------------------------------------------------------


def _adapter_card(state: ServerState, name: str) -> dict[str, Any]:
    """A served LoRA adapter: its base model is its ``parent`` (vLLM's card)."""
    return {**_model_card(state), "id": name, "root": name, "parent": state.model_name}


def _model_card(state: ServerState) -> dict[str, Any]:
    cores = [
        {"num_threads": threads, "cpu_ids": list(cpu_ids)}
        for threads, cpu_ids in state.client.threads_by_core
    ]
    reason = state.client.dead_reason
    status = {"value": "failed", "reason": reason} if reason is not None else {"value": "loaded"}
    if reason is None and state.input_processor is None:
        status = {"value": "loading"}
    return {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "cenote",
        "root": state.model_name,  # the served name: no path of this machine
        "parent": None,
        "max_model_len": state.model_config.max_model_len,
        "supported_tasks": list(state.supported_tasks),
        "engine_cores": cores,  # each engine core's torch threads and CPUs, once started
        "status": status,
    }


def _on_demand_card(model: OnDemandModel) -> dict[str, Any]:
    if model.status == "loaded" and model.state is not None:
        return _model_card(model.state)
    status: dict[str, Any] = {"value": model.status}
    if model.status == "failed":
        status["reason"] = model.error
    return {
        "id": model.name, "object": "model", "created": 0, "owned_by": "cenote",
        "root": model.name, "parent": None, "max_model_len": None, "supported_tasks": [],
        "engine_cores": [], "status": status,
    }  # fmt: skip
