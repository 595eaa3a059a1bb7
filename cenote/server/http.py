"""uvicorn's h11 protocol with connection admission: deadlines, a per-address cap, a busy cap.

uvicorn counts every open socket against ``limit_concurrency``, so sockets that never send a byte
deny service to everyone, ``/health`` included; and every byte received resets its idle timer, so
a client that sends one header line per second holds a connection for ever. Here:

- a new connection must send its first byte within ``first_byte_timeout_s``, and each request
  must arrive whole within ``read_timeout_s`` of its first byte (or of the previous response);
  a slower client is disconnected;
- one client address may hold ``max_connections_per_client`` open connections; more are answered
  503 at once and closed, and never count against other clients;
- ``max_connections`` bounds the *busy* connections (a request being received or answered);
  past it requests are answered 503, except ``/health`` and ``/metrics``, so a load balancer
  still sees a live server. Idle sockets never count.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import h11
import msgspec
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from cenote.server.errors import Unavailable, api_error_response

logger = logging.getLogger(__name__)

_ALWAYS_ANSWERED = frozenset({"/health", "/metrics"})  # past the busy cap too
_LINGER_S = 1.0  # a refused connection is read (and dropped) this long so its 503 arrives
_WARN_EVERY_S = 10.0  # one log line per kind of refusal per this long, with the count


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    read_timeout_s: float  # a whole request, from its first byte
    first_byte_timeout_s: float  # a new connection's first byte
    max_connections: int  # busy connections (a request being received or answered)
    max_connections_per_client: int  # open connections of one client address, idle included

    def __post_init__(self) -> None:
        for name in ("read_timeout_s", "first_byte_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("max_connections", "max_connections_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")


def _flag(name: str) -> str:
    return name.removesuffix("_s").replace("_", "-")


class ConnectionLedger:
    """What one server's connections share: open connections by address, busy ones."""

    def __init__(self) -> None:
        self.num_open: collections.Counter[str] = collections.Counter()  # by client address
        self.num_busy = 0
        self._warned: dict[str, tuple[float, int]] = {}  # kind -> (last logged, suppressed)

    def warn(self, kind: str, message: str) -> None:
        """Log ``message`` at most once per ``_WARN_EVERY_S`` for ``kind`` (a flood of refused
        connections must not flood the log)."""
        now = time.monotonic()
        last, suppressed = self._warned.get(kind, (-_WARN_EVERY_S, 0))
        if now - last < _WARN_EVERY_S:
            self._warned[kind] = (last, suppressed + 1)
            return
        more = f" ({suppressed} more like it since the last report)" if suppressed else ""
        logger.warning("%s%s", message, more)
        self._warned[kind] = (now, 0)


class AdmittingH11Protocol(H11Protocol):
    limits: ConnectionLimits  # set per server by ``connection_protocol``
    ledger: ConnectionLedger

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._address = self.client[0] if self.client else ""
        self._counted = self._busy = self._refused = False
        self._seen_byte = False
        open_here = self.ledger.num_open[self._address]
        limit = self.limits.max_connections_per_client
        if open_here >= limit:
            self._refuse(
                f"{self._address} has {open_here} connections open, the limit per client "
                f"address is {limit} (--max-connections-per-client)"
            )
            return
        self.ledger.num_open[self._address] += 1
        self._counted = True
        self._app, self.app = self.app, self._admit
        self._arm(self.limits.first_byte_timeout_s, self._first_byte_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped: closing with unread data would reset the 503 away
        if not self._seen_byte:
            self._seen_byte = True
            self._arm(self.limits.read_timeout_s, self._read_timed_out)
        self._set_busy(True)
        super().data_received(data)
        if self._deadline is not None and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE):
            self._deadline.cancel()  # the whole request has arrived
            self._deadline = None

    def on_response_complete(self) -> None:
        self._set_busy(False)
        super().on_response_complete()  # runs a pipelined request that is already here
        if self.conn.their_state is h11.SEND_BODY or self.conn.trailing_data[0]:
            self._set_busy(True)
        self._arm(self.limits.read_timeout_s, self._read_timed_out)  # the next request's

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._set_busy(False)
        if self._counted:
            self._counted = False
            self.ledger.num_open[self._address] -= 1
            if not self.ledger.num_open[self._address]:
                del self.ledger.num_open[self._address]
        super().connection_lost(exc)

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, or a 503 when more connections are busy than ``max_connections``."""
        busy, limit = self.ledger.num_busy, self.limits.max_connections
        if scope["type"] != "http" or busy <= limit or scope["path"] in _ALWAYS_ANSWERED:
            await self._app(scope, receive, send)
            return
        message = (
            f"the server is busy: {busy} connections have a request in progress, the limit "
            f"is {limit} (--max-connections)"
        )
        self.ledger.warn("busy", f"answered 503: {message}")
        error = Unavailable(message, headers={"Retry-After": "1"})
        await api_error_response(error)(scope, receive, send)

    def _set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            self.ledger.num_busy += 1 if busy else -1

    def _refuse(self, message: str) -> None:
        """Answer 503 before any request and close: the client learns why, nothing is counted."""
        self._refused = True
        self.ledger.warn("per-client", f"connection refused: {message}")
        error = {"message": message, "type": "service_unavailable", "param": None, "code": 503}
        body = msgspec.json.encode({"error": error})
        head = (
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client's own close then ends the connection
        self._arm(_LINGER_S, self.transport.close)

    def _arm(self, delay_s: float, callback: Callable[[], object]) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(delay_s, callback)

    def _first_byte_timed_out(self) -> None:
        self._deadline = None
        if self._seen_byte or self.transport.is_closing():
            return
        logger.debug(
            "%s: nothing received within %g s; connection closed",
            self._address or "client", self.limits.first_byte_timeout_s,
        )  # fmt: skip
        self.transport.close()

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE) or self.transport.is_closing():
            return
        self.ledger.warn(
            "slow",
            f"{self._address or 'client'}: request not received within "
            f"{self.limits.read_timeout_s:g} s; connection closed",
        )
        self.transport.close()


def connection_protocol(limits: ConnectionLimits) -> type[AdmittingH11Protocol]:
    """The protocol class for one server (uvicorn instantiates it per connection)."""
    attributes = {"limits": limits, "ledger": ConnectionLedger()}
    return type("AdmittingH11Protocol", (AdmittingH11Protocol,), attributes)
