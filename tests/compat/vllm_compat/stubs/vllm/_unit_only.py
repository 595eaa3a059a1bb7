"""vLLM's Python request classes, used only by the unit tests in the copied files (no server):
touching one skips the test."""

import pytest

REASON = "unit test of vLLM's own Python request classes (no server involved)"


class _UnitOnly:
    def __init__(self, *args, **kwargs):
        pytest.skip(REASON)

    @classmethod
    def model_validate(cls, *args, **kwargs):
        pytest.skip(REASON)


class ChatCompletionRequest(_UnitOnly):
    pass


class BatchChatCompletionRequest(_UnitOnly):
    pass


class CompletionRequest(_UnitOnly):
    pass


class SamplingParams(_UnitOnly):
    pass


class VLLMValidationError(Exception):
    pass
