"""Models served on demand (``cenote serve --models-dir DIR``): loaded by their first request,
unloaded when idle or to make room.

Each model of DIR is an ``OnDemandModel`` whose status moves unloaded -> loading -> loaded ->
unloading -> unloaded (or loading -> failed); ``OnDemandModels`` holds them and the rules:

- A request for a model that is not loaded starts its load and waits for it, at most
  ``--model-load-timeout`` seconds (then 503 naming the model and the timeout; the load goes
  on). Concurrent requests for one model share one load.
- At most ``--max-loaded-models`` hold memory at once (loading and unloading ones count). A load
  first unloads the least recently used idle model (no request in flight nor waiting for it);
  when every loaded model is busy, the load waits for one to become idle, up to the timeout:
  the bound is a promise about memory, so it is never passed.
- ``--idle-unload-seconds``: a loaded model that has had no request for that long is unloaded.
- Unloading never cuts a request: the model takes no new request (those wait for the unload,
  then load it again), waits for the ones in flight, then shuts its engine core down (the
  process exits and its memory goes back to the OS) and drops the front's copies (tokenizer,
  config, embedding cache).
- A model that fails to load stays failed: its requests get 503 naming the cause, until
  ``POST /models/load`` tries again.

A request holds a lease on its model from routing to the end of its response (streams
included): ``current_leases`` is the front door's list for the request, released once the
response is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cenote.engine.heap import release_freed_memory
from cenote.server.errors import APIError, Conflict, Unavailable

if TYPE_CHECKING:
    from cenote.server.state import ServerState

logger = logging.getLogger(__name__)

Status = Literal["unloaded", "loading", "loaded", "unloading", "failed"]

# the on-demand models the current HTTP request holds (set by the front door for each request)
current_leases: ContextVar[list[OnDemandModel] | None] = ContextVar(
    "cenote_on_demand_leases", default=None
)


@dataclass(frozen=True)
class LoadPolicy:
    """When models load and unload (the server options of the same names)."""

    max_loaded_models: int | None  # models holding memory at once; None: no bound
    idle_unload_seconds: float | None  # unload a model unused this long; None: never
    load_timeout_s: float  # how long a request waits for its model to load


# builds a model's ServerState (engine config, tokenizer) from (name, path, CPU slot); blocking
StateFactory = Callable[[str, str, int], "ServerState"]


class OnDemandModel:
    """One model of the models folder: where it is, its status, the requests using it."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        self.status: Status = "unloaded"
        self.state: ServerState | None = None  # while loading (once built) and loaded
        self.error: str | None = None  # why the last load failed
        self.num_in_flight = 0  # requests holding a lease on it
        self.num_waiting = 0  # requests waiting for it to load
        self.last_used = time.monotonic()  # the last request's start or end
        self.slot: int | None = None  # its CPU share's index, while it holds memory
        self.transition: asyncio.Task[APIError | None] | None = None  # the load or unload

    @property
    def idle(self) -> bool:
        """Loaded, and no request holds it or waits for it: it may be unloaded."""
        return self.status == "loaded" and self.num_in_flight == 0 and self.num_waiting == 0


class OnDemandModels:
    """The models of ``--models-dir`` and the rules that load and unload them (module doc)."""

    def __init__(
        self, models: Sequence[tuple[str, str]], policy: LoadPolicy, make_state: StateFactory
    ) -> None:
        self.models = {name: OnDemandModel(name, path) for name, path in models}
        self.policy = policy
        self.num_slots = min(policy.max_loaded_models or len(models), len(models))
        self._make_state = make_state
        self._changed = asyncio.Event()  # set (and replaced) whenever a lease or status changes
        self._reaper: asyncio.Task[None] | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self.policy.idle_unload_seconds is not None:
            self._reaper = asyncio.get_running_loop().create_task(self._unload_idle())

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for model in self.models.values():
            if model.transition is not None and not model.transition.done():
                model.transition.cancel()
                with contextlib.suppress(BaseException):
                    await model.transition
            if model.state is not None:
                await model.state.close()
                model.state = None

    # ---- requests ---------------------------------------------------------------------------

    async def acquire(self, name: str) -> ServerState:
        """The loaded model ``name`` for the current request (a lease on it until the response
        is sent), loading it first if needed; 503 when it fails or takes longer than the
        timeout."""
        model = self.models[name]
        state = await self._wait_loaded(model, retry_failed=False)
        self.lease(model)
        return state

    def lease(self, model: OnDemandModel) -> None:
        """The current request holds ``model`` until the front door releases it."""
        model.last_used = time.monotonic()
        leases = current_leases.get()
        if leases is not None:  # only requests through the front door run on the model
            model.num_in_flight += 1
            leases.append(model)

    def release(self, leases: Sequence[OnDemandModel]) -> None:
        for model in leases:
            model.num_in_flight -= 1
            model.last_used = time.monotonic()
        if leases:
            self._notify()

    def owner(self, state: ServerState) -> OnDemandModel | None:
        """The on-demand model whose state ``state`` is (None: a ``--model`` model)."""
        return next((m for m in self.models.values() if m.state is state), None)

    def loaded_states(self) -> list[ServerState]:
        return [m.state for m in self.models.values() if m.status == "loaded" and m.state]

    # ---- admin ------------------------------------------------------------------------------

    async def load(self, name: str) -> None:
        """``POST /models/load``: load ``name`` now (a failed one is tried again)."""
        await self._wait_loaded(self.models[name], retry_failed=True)

    async def unload(self, name: str) -> None:
        """``POST /models/unload``: unload ``name`` once its requests have finished."""
        model = self.models[name]
        if model.status == "loaded":
            self._begin_unload(model, "asked by POST /models/unload")
        elif model.status != "unloading":
            raise Conflict(f"the model {name!r} is not loaded (it is {model.status})")
        assert model.transition is not None
        await asyncio.shield(model.transition)

    # ---- loading ----------------------------------------------------------------------------

    async def _wait_loaded(self, model: OnDemandModel, retry_failed: bool) -> ServerState:
        timeout = self.policy.load_timeout_s
        deadline = time.monotonic() + timeout
        if retry_failed and model.status == "failed":
            model.status = "unloaded"
        model.num_waiting += 1
        try:
            while True:
                if model.status == "loaded":
                    assert model.state is not None
                    reason = model.state.client.dead_reason
                    if reason is None:
                        return model.state
                    await self._fail(model, f"its engine core died: {reason}")
                if model.status == "failed":
                    raise Unavailable(
                        f"the model {model.name!r} failed to load: {model.error}; POST "
                        "/models/load tries again",
                        headers={"Retry-After": "1"},
                    )
                if model.status == "unloaded":
                    self._begin_load(model)
                assert model.transition is not None
                remaining = deadline - time.monotonic()
                try:
                    refusal = await asyncio.wait_for(asyncio.shield(model.transition), remaining)
                except TimeoutError:
                    raise Unavailable(
                        f"the model {model.name!r} did not load within {timeout:g} s "
                        f"(--model-load-timeout); it is {model.status}: try again later",
                        headers={"Retry-After": "5"},
                    ) from None
                if refusal is not None:
                    raise refusal
        finally:
            model.num_waiting -= 1
            self._notify()

    def _begin_load(self, model: OnDemandModel) -> None:
        model.status, model.error = "loading", None
        model.transition = asyncio.get_running_loop().create_task(self._load(model))

    async def _load(self, model: OnDemandModel) -> APIError | None:
        """Load ``model``: room, then its state and engine core. Returns the refusal its
        waiters get when no room is made in time (None: loaded, or failed with a reason)."""
        started = time.monotonic()
        logger.info("loading model %r from %s on demand", model.name, model.path)
        # 1) room: a free slot, else the least recently used idle model unloaded
        refusal = await self._make_room(model, started + self.policy.load_timeout_s)
        if refusal is not None:
            model.status = "unloaded"
            self._notify()
            return refusal
        assert model.slot is not None
        # 2) config and tokenizer (blocking reads: a thread), then the engine core
        try:
            model.state = await asyncio.to_thread(
                self._make_state, model.name, model.path, model.slot
            )
            await model.state.start()
        except Exception as e:
            await self._fail(model, str(e) or type(e).__name__)
            return None
        model.status, model.last_used = "loaded", time.monotonic()
        self._notify()
        logger.info("model %r loaded in %.1f s", model.name, time.monotonic() - started)
        return None

    async def _make_room(self, model: OnDemandModel, deadline: float) -> APIError | None:
        while True:
            changed = self._changed
            used = {m.slot for m in self.models.values() if m.slot is not None}
            free = [slot for slot in range(self.num_slots) if slot not in used]
            if free:
                model.slot = free[0]
                return None
            idle = [m for m in self.models.values() if m.idle]
            if idle:
                victim = min(idle, key=lambda m: m.last_used)
                limit = self.policy.max_loaded_models
                self._begin_unload(
                    victim, f"least recently used, to make room for {model.name!r} "
                    f"(--max-loaded-models {limit})"
                )  # fmt: skip
                assert victim.transition is not None
                await asyncio.shield(victim.transition)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                holding = ", ".join(
                    repr(m.name) for m in self.models.values() if m.slot is not None
                )
                return Unavailable(
                    f"the model {model.name!r} cannot be loaded: {self.num_slots} models are "
                    f"loaded ({holding}; --max-loaded-models) and none became idle within "
                    f"{self.policy.load_timeout_s:g} s (--model-load-timeout): try again later",
                    headers={"Retry-After": "5"},
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def _fail(self, model: OnDemandModel, reason: str) -> None:
        logger.error("model %r failed to load: %s", model.name, reason)
        model.status, model.error = "failed", reason
        await _close(model)
        model.slot = None
        self._notify()

    # ---- unloading --------------------------------------------------------------------------

    def _begin_unload(self, model: OnDemandModel, why: str) -> None:
        model.status = "unloading"
        model.transition = asyncio.get_running_loop().create_task(self._unload(model, why))

    async def _unload(self, model: OnDemandModel, why: str) -> APIError | None:
        logger.info(
            "unloading model %r (%s)%s", model.name, why,
            f"; waiting for {model.num_in_flight} request(s) in flight" if model.num_in_flight else "",
        )  # fmt: skip
        while model.num_in_flight:  # never cut a request
            changed = self._changed
            await changed.wait()
        await _close(model)
        model.status, model.slot = "unloaded", None
        self._notify()
        logger.info("model %r unloaded", model.name)
        return None

    async def _unload_idle(self) -> None:
        seconds = self.policy.idle_unload_seconds
        assert seconds is not None
        while True:
            await asyncio.sleep(min(max(seconds / 4, 0.05), 5.0))
            now = time.monotonic()
            for model in self.models.values():
                if model.idle and now - model.last_used >= seconds:
                    self._begin_unload(model, f"no request for {seconds:g} s")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


async def _close(model: OnDemandModel) -> None:
    """Shut ``model``'s engine core down (the process exits: its memory goes back to the OS)
    and drop the front's copies: collected at once (the state and its client refer to each
    other) and the freed heap handed back too."""
    state, model.state = model.state, None
    if state is None:
        return
    await state.close()
    del state
    await asyncio.sleep(0)  # the cancelled output task lets go of the client
    gc.collect()
    release_freed_memory()
