"""The models one server serves, by name: several engines behind one front door.

Each model is a ``ServerState`` (its engine core processes, tokenizer, input processor, bounds
and metrics); ``ServedModels`` routes a request to one of them by its body's ``model`` field:

- a served name: that model; an unknown one: 404 listing the served names;
- no ``model`` (and the routes whose bodies have none: TEI's ``/embed``, ``/predict``,
  ``/rerank``...; ``/tokenize`` without one): the first model, in the order given, that serves
  the route's task (rerank / score: a cross-encoder first, else any model that scores), else the
  first model (whose answer then says the task is not supported). With one model this is
  exactly the single-model server.

A model whose engine fails to start, or dies later, answers 503 naming it and the cause; the
others keep serving and ``/health`` says "degraded". Only when every engine is gone is the
server dead (it exits, as a single-model server does).

The models of ``--models-dir`` (``on_demand.OnDemandModels``) are served by name beside them:
``route`` loads one on its first request; a request that names no model may go to one that is
loaded. With such models the server is never dead: each loads, fails and unloads on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import Request

from cenote.server.errors import APIError, BadRequest, ModelNotFound, Unavailable
from cenote.server.metrics import MetricFamilies
from cenote.server.on_demand import OnDemandModels
from cenote.server.state import ServerOptions, ServerState

logger = logging.getLogger(__name__)

SCORE_TASK = "score"  # the routing task of rerank / score routes: a model that compares texts
_PROBLEMS = ("dead", "hung", "degraded", "failed")  # /health entries that make it "degraded"


class ServedModels:
    """Every served model by name (the first is the default) and what they share: the server
    options, the metrics registry, readiness. ``states``: the models always loaded (``--model``,
    ``--config``); ``on_demand``: those of ``--models-dir``."""

    def __init__(
        self,
        states: Sequence[ServerState],
        options: ServerOptions | None = None,
        metrics: MetricFamilies | None = None,
        on_demand: OnDemandModels | None = None,
    ) -> None:
        if not states and (on_demand is None or not on_demand.models):
            raise ValueError("a server needs at least one model")
        self.states = {state.model_name: state for state in states}
        if len(self.states) != len(states):
            names = [state.model_name for state in states]
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"two models are served as {repeated}: give each its own name")
        self.on_demand = on_demand
        self.default: ServerState | None = states[0] if states else None
        if options is None or metrics is None:  # the first model's (on-demand: give both)
            assert self.default is not None, "on-demand models need the server's options"
            options = options if options is not None else self.default.options
            metrics = metrics if metrics is not None else self.default.metrics.families
        self.options = options
        self.metrics = metrics
        self.on_all_dead: Callable[[str], None] | None = None  # every engine is gone
        for state in states:
            state.on_engine_dead = self._engine_died

    @property
    def names(self) -> list[str]:
        """Every name served: ``--model`` models, their adapters, ``--models-dir`` models."""
        names = [name for base, state in self.states.items() for name in (base, *state.adapters)]
        return names + list(self.on_demand.models if self.on_demand is not None else ())

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every model's engine at once (each on its own CPU share); one that fails is
        marked dead with its cause and the others serve."""
        await asyncio.gather(*(self._start(state) for state in self.states.values()))
        if self.on_demand is not None:
            self.on_demand.start()

    async def _start(self, state: ServerState) -> None:
        try:
            await state.start()
        except Exception as e:
            logger.error("model %r failed to start: %s", state.model_name, e)
            state.client.mark_dead(str(e))
            return
        logger.info(
            "model %r ready; supported tasks: %s; engine cores (threads, CPUs): %s",
            state.model_name, ", ".join(state.supported_tasks), state.client.threads_by_core,
        )  # fmt: skip

    async def shutdown(self) -> None:
        for state in self.states.values():
            await state.client.shutdown()
        if self.on_demand is not None:
            await self.on_demand.shutdown()

    def _engine_died(self, reason: str) -> None:
        alive = [s for s in self.states.values() if s.client.dead_reason is None]
        if not alive and self.on_demand is None and self.on_all_dead is not None:
            self.on_all_dead(reason)

    @property
    def any_dead(self) -> bool:
        return any(state.client.dead_reason is not None for state in self.states.values())

    # ---- readiness --------------------------------------------------------------------------

    def not_serving(self) -> APIError | None:
        """Why no request can be served yet (starting, or every engine gone); None when some
        model can be asked."""
        if len(self.states) == 1 and self.on_demand is None:
            state = self.default
            assert state is not None
            if state.ready:
                return None
            reason = state.client.dead_reason
            if reason is not None:
                return Unavailable(f"the engine is not running: {reason}")
            return Unavailable("the server is starting; the model is not loaded yet")
        states = self.states.values()
        if any(s.input_processor is None and s.client.dead_reason is None for s in states):
            return Unavailable("the server is starting; the models are not all loaded yet")
        if self.on_demand is None and all(s.client.dead_reason is not None for s in states):
            reasons = "; ".join(f"{s.model_name}: {s.client.dead_reason}" for s in states)
            return Unavailable(f"no model's engine is running ({reasons})")
        return None

    # ---- routing ----------------------------------------------------------------------------

    async def route(self, model: str | None = None, task: str | None = None) -> ServerState:
        """The model a request names (``model``; a ``--models-dir`` one is loaded first), else
        the first loaded one that serves ``task``; an on-demand model is held by the request
        until its response is sent (``on_demand.current_leases``)."""
        on_demand = self.on_demand
        if on_demand is not None and model is not None and model in on_demand.models:
            return await on_demand.acquire(model)
        state = self.get(model, task)
        if on_demand is not None and model is None:
            owner = on_demand.owner(state)
            if owner is not None:  # a request naming no model may land on a loaded on-demand one
                on_demand.lease(owner)
        return state

    def get(self, model: str | None = None, task: str | None = None) -> ServerState:
        """The model a request names (``model``; not a ``--models-dir`` one), else the first
        that serves ``task``."""
        state = self._default_for(task) if model is None else self.named(model)
        if (len(self.states) > 1 or self.on_demand is not None) and not state.ready:
            reason = state.client.dead_reason or "it is still loading"
            raise Unavailable(f"the model {state.model_name!r} is not available: {reason}")
        return state

    def named(self, model: str) -> ServerState:
        """The model served as ``model``, or the base of the LoRA adapter served as ``model``
        (its ``check_model`` then names the adapter); 404 naming the served ones when there is
        neither."""
        state = self.states.get(model)
        if state is not None:
            return state
        for base in self.states.values():
            if model in base.adapters:
                return base
        served = ", ".join(repr(name) for name in self.names)
        raise ModelNotFound(
            f"the model {model!r:.200} does not exist; this server serves {served}",
            param="model",
        )

    # ---- LoRA adapters added and removed at run time ------------------------------------------

    async def load_adapter(self, name: str, path: str) -> None:
        """``POST /v1/load_lora_adapter``: serve adapter ``name`` on the default (first) model,
        as vLLM puts runtime adapters on its first base; 400 for a name already served."""
        if not name or not path:
            raise BadRequest("both 'lora_name' and 'lora_path' must be given", param="lora_name")
        if name in self.states:
            raise BadRequest(
                f"{name!r:.200} is the name of a served model; give the adapter another name",
                param="lora_name",
            )
        if any(name in state.adapters for state in self.states.values()):
            raise BadRequest(
                f"the LoRA adapter {name!r:.200} has already been loaded", param="lora_name"
            )
        if self.on_demand is not None and name in self.on_demand.models:
            raise BadRequest(
                f"{name!r:.200} is the name of a served model; give the adapter another name",
                param="lora_name",
            )
        if self.default is None:
            raise BadRequest(
                "runtime LoRA adapters go on the first --model model; this server has none "
                "(its models are loaded on demand from --models-dir)",
                param="lora_name",
            )
        await self.default.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``: stop serving adapter ``name`` (404 if unknown)."""
        state = next((s for s in self.states.values() if name in s.adapters), self.default)
        if state is None:
            raise ModelNotFound(f"the LoRA adapter {name!r:.200} cannot be found; loaded: none")
        state.unload_adapter(name)

    def _default_for(self, task: str | None) -> ServerState:
        """The model of a request that names none: the first (of the ``--model`` ones, then
        the loaded ``--models-dir`` ones) that serves ``task``, else the first model."""
        loaded = self.on_demand.loaded_states() if self.on_demand is not None else []
        if self.default is not None and (task is None or (len(self.states) == 1 and not loaded)):
            return self.default
        states = [s for s in self.states.values() if s.ready] + loaded
        fallback = self.default or (states[0] if states else None)
        if fallback is None:
            raise BadRequest(
                "the request names no model and none is loaded: name one in 'model' (this "
                f"server serves {', '.join(repr(name) for name in self.names)})",
                param="model",
            )
        if task is None:
            return fallback
        if task == SCORE_TASK:
            for wanted in ("cross_encoder", None):
                for state in states:
                    score_type = _score_type(state)
                    if score_type is not None and wanted in (None, score_type):
                        return state
            return fallback
        return next((s for s in states if task in s.supported_tasks), fallback)

    # ---- what the small routes answer -------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        """(status code, body) of ``/health`` for several models: 200 "ok" when every model
        serves, 200 "degraded" naming those that do not, 503 while starting or when none
        serves."""
        error = self.not_serving()
        if error is not None:
            return 503, {"message": error.message}
        models: dict[str, Any] = {}
        for name, state in self.states.items():
            problem = state.health_problem()
            models[name] = {"status": "ok"} if problem is None else problem
        on_demand = self.on_demand.models if self.on_demand is not None else {}
        for name, model in on_demand.items():
            loaded = model.state if model.status == "loaded" else None
            problem = loaded.health_problem() if loaded is not None else None
            if problem is not None:
                models[name] = problem
            elif model.status == "failed":
                models[name] = {"status": "failed", "reason": model.error}
            else:  # loaded, or not loaded by choice: nothing is wrong
                models[name] = {"status": "ok" if model.status == "loaded" else model.status}
        degraded = any(entry["status"] in _PROBLEMS for entry in models.values())
        return 200, {"status": "degraded" if degraded else "ok", "models": models}


def _score_type(state: ServerState) -> str | None:
    capabilities = state.client.capabilities
    return capabilities.score_type if capabilities is not None else None


async def get_state(
    request: Request, model: str | None = None, task: str | None = None
) -> ServerState:
    """The model ``request`` is for: the one its body names (``model``), else the first that
    serves ``task`` (``ServedModels.route``: 404 for an unknown name, 503 for a model that is
    not running; a ``--models-dir`` model is loaded first)."""
    return await get_served(request).route(model, task)


def get_served(request: Request) -> ServedModels:
    served: ServedModels = request.app.state.cenote
    return served
