"""Batch jobs inside the server: one background task runs the batches one at a time, oldest
first, each line sent through the server's own route for its url (an in-process ASGI call:
the same validation, bounds, model routing and response body as an HTTP client gets), at
most ``--batch-concurrency`` lines at a time and at ``BATCH_PRIORITY``, so the scheduler
(policy "priority" whenever ``--batch-dir`` is set) takes interactive requests first.

A batch: 1) validating: the file-level check (no custom_id twice; else ``failed``),
2) in_progress: every line without a stored result, each result committed alone
(``BatchStore.record``), 3) finalizing: output and error files written, ``completed``.
A restart picks up the oldest unfinished batch at its stage; a cancel stops launching lines,
aborts those in flight (their engine requests too) and keeps what finished (``cancelled``).
A line the server answers 429 or 503 (overloaded, a model loading or restarting) is sent
again, for up to ``_RETRY_S`` seconds, before its error is written.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import msgspec
from starlette.types import ASGIApp, Message

from cenote.server.batch_lines import (
    LineError,
    custom_id_of,
    error_line,
    error_of,
    parse_line,
    success_line,
)
from cenote.server.batch_reader import BatchFileError, RawLine, check_custom_ids, read_lines
from cenote.server.batch_store import Batch, BatchStore

logger = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_PRIORITY = 1 << 20  # a batch line's request priority; interactive ones default to 0
_RETRY_S = 600.0  # how long a line answered 429 / 503 is sent again
_LINES_READ = 64  # input lines read from disk at a time


class BatchJobs:
    """The job runner; ``store`` is only touched from ``self.db`` (one thread)."""

    def __init__(
        self,
        store: BatchStore,
        app: ASGIApp,
        concurrency: int,
        max_line_bytes: int,
        api_key: str | None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"batch_concurrency must be >= 1, got {concurrency}")
        self.store = store
        self.app = app
        self.concurrency = concurrency
        self.max_line_bytes = max_line_bytes
        self.api_key = api_key
        self._db = ThreadPoolExecutor(1, "cenote-batch-db")
        self._wake = asyncio.Event()
        self._claim = asyncio.Lock()  # picking a job and cancelling one never interleave
        self._current: str | None = None  # the batch being run
        self._cancelled = False  # the current batch was cancelled
        self._lines: set[asyncio.Task[None]] = set()  # its lines in flight
        self._task: asyncio.Task[None] | None = None
        self._encoder = msgspec.json.Encoder()

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a ``BatchStore`` method on the store's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._db, functools.partial(fn, *args, **kwargs))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_forever(), name="cenote-batch-jobs")

    async def stop(self) -> None:
        """Stop at once: lines in flight are aborted and run again after a restart."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.db(self.store.close)
        self._db.shutdown()

    def wake(self) -> None:
        """A batch was created: run it when its turn comes."""
        self._wake.set()

    async def cancel(self, batch_id: str) -> bool:
        """Move a validating / in-progress batch to cancelling (False: it is past that); the
        running one stops, a waiting one is finalized here."""
        async with self._claim:
            moved = await self.db(
                self.store.move, batch_id, "cancelling", only_from=("validating", "in_progress")
            )
            if not moved:
                return False
            if batch_id == self._current:
                self._cancelled = True
                for task in self._lines:
                    task.cancel()
            else:
                await self.db(self.store.finalize, batch_id, "cancelled")
        return True

    # ---- the loop -----------------------------------------------------------------------------

    async def _run_forever(self) -> None:
        while True:
            self._wake.clear()
            async with self._claim:
                batch = await self.db(self.store.next_unfinished)
                self._current = None if batch is None else batch.id
                self._cancelled = False
            if batch is None:
                await self._wake.wait()
                continue
            try:
                await self._run(batch)
            except Exception as e:  # a bug: the batch fails, the server and other batches go on
                logger.exception("batch %s failed", batch.id)
                error = {"code": "internal_error", "message": f"{type(e).__name__}: {e}",
                         "param": None, "line": None}  # fmt: skip
                await self.db(self.store.fail, batch.id, [error])

    async def _run(self, batch: Batch) -> None:
        """The batch from its stage on: 1) validate, 2) run its lines, 3) finalize."""
        if batch.status == "cancelling":  # cancelled before a restart
            await self.db(self.store.finalize, batch.id, "cancelled")
            return
        if batch.status == "validating":
            problem = await asyncio.to_thread(self._validate, batch)  # reads the whole file
            if problem is not None:
                await self.db(self.store.fail, batch.id, [problem])
                logger.info("batch %s failed: %s", batch.id, problem["message"])
                return
            moved = await self.db(
                self.store.move, batch.id, "in_progress", only_from=("validating",)
            )
            if not moved:  # cancelled while validating
                await self.db(self.store.finalize, batch.id, "cancelled")
                return
        if batch.status in ("validating", "in_progress"):
            logger.info("batch %s: %d lines to %s", batch.id, batch.total, batch.endpoint)
            ended = await self._run_lines(batch)
            if ended is not None:
                await self.db(self.store.finalize, batch.id, ended)
                logger.info("batch %s %s", batch.id, ended)
                return
            await self.db(self.store.move, batch.id, "finalizing", only_from=("in_progress",))
        final = "cancelled" if self._cancelled else "completed"
        await self.db(self.store.finalize, batch.id, final)
        logger.info("batch %s %s", batch.id, final)

    def _validate(self, batch: Batch) -> dict[str, Any] | None:
        path = self.store.file_path(batch.input_file_id)
        if not path.is_file():
            message = f"the input file {batch.input_file_id} was deleted before the batch ran"
            return {"code": "missing_file", "message": message, "param": "input_file_id",
                    "line": None}  # fmt: skip
        try:
            check_custom_ids(path, self.max_line_bytes)
        except BatchFileError as e:
            message = str(e).replace(str(path), f"the input file {batch.input_file_id}")
            return {"code": "duplicate_custom_id", "message": message, "param": None,
                    "line": None}  # fmt: skip
        return None

    async def _run_lines(self, batch: Batch) -> Literal["cancelled", "expired"] | None:
        """Every line without a result, ``concurrency`` at a time; how the run ended early,
        if it did."""
        done = await self.db(self.store.done_lines, batch.id)
        lines = read_lines(self.store.file_path(batch.input_file_id), self.max_line_bytes)
        slots = asyncio.Semaphore(self.concurrency)
        ended: Literal["cancelled", "expired"] | None = None
        try:
            while ended is None:
                chunk = await asyncio.to_thread(lambda: list(itertools.islice(lines, _LINES_READ)))
                if not chunk:
                    break
                for raw in chunk:
                    if raw.number in done:
                        continue
                    await slots.acquire()
                    if self._cancelled or time.time() > batch.expires_at:
                        slots.release()
                        ended = "cancelled" if self._cancelled else "expired"
                        break
                    task = asyncio.create_task(self._line(batch, raw))
                    self._lines.add(task)
                    task.add_done_callback(self._lines.discard)
                    task.add_done_callback(lambda _: slots.release())
            await asyncio.gather(*self._lines, return_exceptions=True)
        finally:
            for task in self._lines:  # the server stops: lines in flight run again later
                task.cancel()
            lines.close()
        return "cancelled" if self._cancelled else ended

    # ---- one line -----------------------------------------------------------------------------

    async def _line(self, batch: Batch, raw: RawLine) -> None:
        try:
            result = await self._result(batch, raw)
        except Exception as e:  # a bug: this line's error, never a line without a result
            logger.exception("batch %s line %d", batch.id, raw.number)
            result = error_line(custom_id_of(raw.data), error_of(raw.number, e))
        data = self._encoder.encode(result)
        await self.db(self.store.record, batch.id, raw.number, result["error"] is None, data)

    async def _result(self, batch: Batch, raw: RawLine) -> dict[str, Any]:
        """The line's output line: the route's answer, or the line's error."""
        if raw.too_long:
            error = LineError(
                f"line {raw.number} has {raw.num_bytes} bytes, more than the limit of "
                f"{self.max_line_bytes} (--max-body-bytes)",
                status=413,
            )
            return error_line(None, error)
        try:
            record = _record(raw)
            if isinstance(record, dict) and record.get("url", batch.endpoint) != batch.endpoint:
                raise LineError(
                    f"line {raw.number}: url {record['url']!r:.100} is not the batch's endpoint "
                    f"{batch.endpoint!r}; every line of a batch goes to its endpoint"
                )
            line = parse_line(raw.number, raw.data)
            body = _routed_body(raw)
        except Exception as e:
            return error_line(custom_id_of(raw.data), error_of(raw.number, e))
        status, content_type, payload = await self._send(line.url, body)
        if status == 200 and content_type.startswith("application/json"):
            # the answer's bytes as they are: parsing and encoding again would hold the
            # event loop interactive requests share (milliseconds for an embeddings body)
            body_json = msgspec.Raw(payload) if b"\n" not in payload else json.loads(payload)
            return success_line(line.custom_id, body_json)
        if status == 200:
            error = LineError(
                f"line {raw.number}: the route answered {content_type}; a batch line must ask "
                "for a JSON answer (encoding_format float or base64)"
            )
        else:
            error = _route_error(raw.number, status, payload)
        return error_line(line.custom_id, error)

    async def _send(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        """POST ``body`` to the route; sent again while it answers 429 / 503."""
        deadline, wait_s = time.monotonic() + _RETRY_S, 0.25
        while True:
            status, content_type, payload = await self._call(path, body)
            if status not in (429, 503) or time.monotonic() > deadline:
                return status, content_type, payload
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, 5.0)

    async def _call(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        """One in-process ASGI request through the whole app (auth, bounds, metrics)."""
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        if self.api_key:
            headers.append((b"authorization", f"Bearer {self.api_key}".encode()))
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": headers, "client": ("127.0.0.1", 0),
            "server": ("cenote-batch", 0),
        }  # fmt: skip
        answered = asyncio.Event()
        sent = False
        status, content_type, parts = 500, "", []

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status, content_type
            if message["type"] == "http.response.start":
                status = message["status"]
                for key, value in message.get("headers", []):
                    if key.lower() == b"content-type":
                        content_type = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    answered.set()

        try:
            await self.app(scope, receive, send)
        except Exception as e:  # the app answered 500 and re-raised (its handler logged it)
            message = f"internal error: {type(e).__name__}"
            payload = {"error": {"message": message, "type": "internal_server_error"}}
            return 500, "application/json", json.dumps(payload).encode()
        finally:
            answered.set()
        return status, content_type, b"".join(parts)


def _record(raw: RawLine) -> Any:
    """The line as JSON; None when it is not (``parse_line`` then says why)."""
    try:
        return msgspec.json.decode(raw.data)
    except (msgspec.DecodeError, RecursionError):
        return None


def _routed_body(raw: RawLine) -> bytes:
    """The line's body as its route gets it: at ``BATCH_PRIORITY``, never streamed."""
    body = msgspec.json.decode(raw.data)["body"]  # an object: parse_line checked it
    if body.get("stream"):
        raise LineError(f"line {raw.number}: stream is not available in a batch")
    body["priority"] = BATCH_PRIORITY
    return msgspec.json.encode(body)


def _route_error(number: int, status: int, payload: bytes) -> LineError:
    """The route's error answer as the line's error."""
    try:
        error = json.loads(payload)["error"]
        message, type_ = str(error["message"]), str(error["type"])
    except (ValueError, KeyError, TypeError):
        message, type_ = payload[:500].decode("utf-8", "replace"), "internal_server_error"
    return LineError(f"line {number}: {message}", status=status, type_=type_)
