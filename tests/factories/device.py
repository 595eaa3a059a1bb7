"""The device the parity tests run cenote on: ``CENOTE_TEST_DEVICE`` (default cpu), so the same
tests check a GPU unchanged (``CENOTE_TEST_DEVICE=cuda``); references stay fp32 on the host."""

from __future__ import annotations

import os
from typing import Any

TEST_DEVICE = os.environ.get("CENOTE_TEST_DEVICE", "cpu")
NUM_THREADS = 2  # the CI box has 2 cores; every engine and reference uses the same count


def engine_options() -> dict[str, Any]:
    """``LLM`` options placing the engine on ``TEST_DEVICE`` (CPU threads only on the CPU)."""
    if TEST_DEVICE == "cpu":
        return {"device": "cpu", "num_threads": NUM_THREADS}
    return {"device": TEST_DEVICE}
