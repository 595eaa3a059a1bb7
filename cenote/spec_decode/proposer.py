"""What the scheduler asks of a draft proposer: drafts for a batch of decoding requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class DraftQuery:
    """One decoding request's ask for drafts."""

    request_id: str
    token_ids: list[int]  # prompt + output so far; a fresh list the proposer may keep and extend
    num_tokens: int  # drafts wanted, at most (the proposer may return fewer)


class Proposer(Protocol):
    """Draft tokens for the next step's requests; ``release`` once a request leaves (finished,
    aborted or preempted), so a proposer with per-request state frees it."""

    def propose_batch(self, queries: list[DraftQuery]) -> list[list[int]]: ...

    def release(self, request_id: str) -> None: ...
