"""How many tokens to draft for one request next, from how many of its last drafts were kept."""

from __future__ import annotations

from dataclasses import dataclass

# a draft entirely rejected pauses drafting for 2, 4, ... up to this many steps
_MAX_PAUSE_STEPS = 32


@dataclass
class DraftPacing:
    """Acceptance-adaptive draft length of one request.

    A verified step costs more than a plain decode step (more rows through every layer, no
    one-token decode path), so text that does not repeat itself must stop being drafted for.
    A fully accepted draft restores the longest length; a partly accepted one shrinks the next
    to one past what was kept; a draft with nothing accepted pauses drafting for 2, 4, 8, ...
    (at most ``_MAX_PAUSE_STEPS``) steps, and a later accepted token resets the pause.
    """

    max_num_tokens: int  # the configured num_speculative_tokens
    num_tokens: int = 0  # length of the next draft; set from max_num_tokens
    num_misses: int = 0  # drafts in a row with no token accepted
    num_paused_steps: int = 0  # steps left without drafting

    def __post_init__(self) -> None:
        if self.num_tokens == 0:
            self.num_tokens = self.max_num_tokens

    def next_length(self) -> int:
        """Tokens to draft this step (0: plain decode); counts down a pause."""
        if self.num_paused_steps > 0:
            self.num_paused_steps -= 1
            return 0
        return self.num_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """The outcome of a verified draft."""
        if num_drafted <= 0:
            return
        if num_accepted >= num_drafted:
            self.num_tokens = self.max_num_tokens
            self.num_misses = 0
        elif num_accepted > 0:
            self.num_tokens = min(self.max_num_tokens, num_accepted + 1)
            self.num_misses = 0
        else:
            self.num_misses += 1
            self.num_tokens = 1
            self.num_paused_steps = min(1 << self.num_misses, _MAX_PAUSE_STEPS)
