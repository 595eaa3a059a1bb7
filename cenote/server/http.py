"""uvicorn's h11 protocol with a deadline for reading each request (slow clients).

uvicorn times out idle keep-alive connections, but every byte received resets that timer: a client
that sends one header line per second holds its connection (and a slot) for ever. Here each
request must arrive whole, headers and body, within ``read_timeout_s`` of its first byte (or of
the previous response); a client that is slower is disconnected.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class DeadlineH11Protocol(H11Protocol):
    read_timeout_s: float = 30.0  # set per server by ``with_read_timeout``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm_read_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._read_deadline is not None and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE):
            self._read_deadline.cancel()  # the whole request has arrived
            self._read_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_read_deadline()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE) or self.transport.is_closing():
            return
        logger.warning(
            "%s: request not received within %g s; connection closed",
            "{}:{}".format(*self.client) if self.client else "client",
            self.read_timeout_s,
        )
        self.transport.close()


def with_read_timeout(read_timeout_s: float) -> type[DeadlineH11Protocol]:
    """The protocol class for one server (uvicorn instantiates it per connection)."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"read_timeout_s": read_timeout_s})
