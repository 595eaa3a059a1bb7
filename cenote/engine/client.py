"""Engine clients: how a front end runs processed requests (``InputProcessor.process``) on an
engine core and reads their outputs — ``add`` / ``abort`` / ``outputs``.

- ``InProcessClient`` (here): the core in this process, the offline ``LLM``'s loop;
  ``outputs()`` runs one engine step.
- ``AsyncEngineClient`` (``async_client.py``): the core in its own process (the server);
  ``outputs(request_id)`` streams one request's outputs.
- ``DataParallelEngineClient`` (``dp_client.py``): N such cores behind the same surface.

Each owns an ``OutputProcessor``; which outputs a generation request gets is its params'
``output_kind``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from tokenizers import Tokenizer
from tqdm.auto import tqdm

from cenote.engine.capabilities import ModelCapabilities
from cenote.engine.core import EngineCore, refused_output
from cenote.engine.heap import old_objects_set_aside
from cenote.engine.input_processor import ParentRequest, assign_group
from cenote.engine.output_processor import (
    OutputProcessor,
    RequestFailure,
    UserOutput,
    as_exception,
)

_TQDM_MIN_REQUESTS = 64  # shorter jobs get no progress bar


class EngineClient(Protocol):
    """What every front end needs from an engine, wherever its core runs."""

    @property
    def capabilities(self) -> ModelCapabilities | None: ...

    def add(self, requests: Sequence[ParentRequest]) -> None:
        """Start running ``requests`` (all of them, or none when one is refused)."""

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop and forget user requests (finished or unknown ids are ignored)."""


class SyncClient(EngineClient, Protocol):
    def outputs(self) -> list[UserOutput]:
        """Run the engine one step; the user outputs it produced."""


class AsyncClient(EngineClient, Protocol):
    def outputs(self, request_id: str) -> AsyncIterator[UserOutput]:
        """The outputs of one added request until it finishes (its failure raises); leaving
        early aborts it."""


class InProcessClient:
    """The engine core in this process, stepped by whoever reads ``outputs()``."""

    def __init__(self, engine: EngineCore, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.output_processor = OutputProcessor(tokenizer)
        self.output_processor.label_names = engine.capabilities.label_names
        self.num_draft_tokens = 0  # speculative decoding, since start: tokens drafted
        self.num_accepted_tokens = 0  # of those, accepted

    @property
    def capabilities(self) -> ModelCapabilities:
        return self.engine.capabilities

    def add(self, requests: Sequence[ParentRequest]) -> None:
        """``requests`` as one call (the scheduler shares its queues among calls); all or none:
        a request the core refuses (``RequestRejectedError``) leaves none of ``requests``
        behind."""
        assign_group(requests, generation=False)
        added: list[str] = []
        try:
            for request in requests:
                self.output_processor.add_request(request)
                added.append(request.request_id)
                for child in request.children:
                    try:
                        self.engine.add_request(child)
                    except Exception as e:  # as the core process reports it to the server
                        error = refused_output(child.request_id, e).error
                        assert error is not None
                        raise as_exception(error, request.request_id) from e
        except BaseException:
            self.abort(added)
            raise

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.engine.abort_requests(self.output_processor.abort(request_id))

    def outputs(self) -> list[UserOutput]:
        step = self.engine.step()
        if step.stats is not None:
            self.num_draft_tokens += step.stats.num_draft_tokens
            self.num_accepted_tokens += step.stats.num_accepted_tokens
        outputs, to_abort = self.output_processor.process_outputs(step.outputs)
        if to_abort:
            self.engine.abort_requests(to_abort)
        return outputs

    def run(self, requests: Sequence[ParentRequest], use_tqdm: bool = False) -> list[UserOutput]:
        """Add ``requests``, step until all finished; their final outputs in the same order."""
        with old_objects_set_aside():
            self.add(requests)
            return self._step_until([r.request_id for r in requests], use_tqdm)

    def run_in_parts(
        self,
        request_ids: list[str],
        parts: Sequence[Callable[[], Sequence[ParentRequest]]],
        use_tqdm: bool = False,
    ) -> list[UserOutput]:
        """``run`` of requests that ``parts`` make (each part: a call returning its requests;
        ``request_ids``: all of theirs, in order), made one after the other on a worker thread
        while the engine steps the parts already added. Tokenization releases the GIL, so on a
        GPU, where the host's cores are not the compute, the prompts' tokenization hides behind
        the steps instead of coming before them. A part that cannot be made (an invalid prompt)
        aborts the requests added before it and raises its error, as ``run`` raises it before
        any runs."""
        with ThreadPoolExecutor(1, thread_name_prefix="cenote-inputs") as maker:
            made = deque(maker.submit(part) for part in parts)

            def add_ready() -> None:
                # a part is added once made; when the engine has nothing else, wait for it;
                # the parts are one call (one share of the scheduler's queues)
                while made and (made[0].done() or not self.engine.has_unfinished_requests()):
                    part = made.popleft().result()
                    assign_group(
                        part, group_id=request_ids[0] if request_ids else None, generation=False
                    )
                    self.add(part)

            try:
                with old_objects_set_aside():
                    return self._step_until(request_ids, use_tqdm, add_ready)
            finally:
                for future in made:
                    future.cancel()

    def wait(self, request_ids: list[str], use_tqdm: bool = False) -> list[UserOutput]:
        """Step until every request of ``request_ids`` finished; their final outputs in that
        order. A failed request raises its error, and the others are aborted."""
        unknown = [r for r in request_ids if r not in self.output_processor.states]
        if unknown:  # it would never finish: stepping an idle engine forever
            raise ValueError(f"requests not running (finished or never added): {unknown[:5]}")
        return self._step_until(request_ids, use_tqdm)

    def _step_until(
        self,
        request_ids: list[str],
        use_tqdm: bool,
        before_step: Callable[[], None] | None = None,
    ) -> list[UserOutput]:
        pending = set(request_ids)
        finished: dict[str, UserOutput] = {}
        bar = tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm or len(request_ids) < _TQDM_MIN_REQUESTS,
        )
        try:
            while pending:
                if before_step is not None:
                    before_step()
                for output in self.outputs():
                    if isinstance(output, RequestFailure):
                        raise output.error
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self.abort(pending)
            raise
        finally:
            bar.close()
        return [finished[request_id] for request_id in request_ids]

    @property
    def num_unfinished(self) -> int:
        return self.output_processor.num_unfinished


async def run_async(client: AsyncClient, requests: Sequence[ParentRequest]) -> list[UserOutput]:
    """Add ``requests`` and wait for each one's final output; results in the same order. A
    failure raises; leaving early (cancelled) aborts every request still running."""
    client.add(requests)
    try:
        return [await final_output(client, request.request_id) for request in requests]
    finally:
        client.abort([r.request_id for r in requests])


async def final_output(client: AsyncClient, request_id: str) -> UserOutput:
    """The last output of an added request: its finished result."""
    last = None
    async for output in client.outputs(request_id):
        last = output
    assert last is not None and last.finished
    return last
