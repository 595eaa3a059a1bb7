"""N-gram prompt lookup: the draft is what followed an earlier occurrence of the sequence's end."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from cenote.config import SpeculativeConfig
from cenote.spec_decode.proposer import DraftQuery


class NgramProposer:
    """Proposes draft tokens from the request's own prompt and output, no model involved.

    For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` tokens
    are looked up earlier in the sequence; at the latest earlier match, the tokens that followed
    it (up to the asked number) are the draft. The longest suffix that matches wins: a longer
    context predicts its continuation better. The latest match wins over earlier ones: text
    being quoted or edited continues where it was last seen.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens to follow ``token_ids`` (empty: no match)."""
        length = len(token_ids)
        if num_tokens <= 0 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [length]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # windows starting at 0 .. length - n - 1: each is followed by at least one token
            windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
            starts = np.flatnonzero(windows[:, 0] == suffix[0])
            if starts.size == 0:
                continue
            matches = starts[(windows[starts] == suffix).all(axis=1)]
            if matches.size == 0:
                continue
            follow = int(matches[-1]) + n
            return [int(t) for t in tokens[follow : follow + num_tokens]]
        return []

    def propose_batch(self, queries: list[DraftQuery]) -> list[list[int]]:
        """``propose`` for each request (no state across steps)."""
        return [self.propose(q.token_ids, q.num_tokens) for q in queries]

    def release(self, request_id: str) -> None:
        """Nothing held per request."""
