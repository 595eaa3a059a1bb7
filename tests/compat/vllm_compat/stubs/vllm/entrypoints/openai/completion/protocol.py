from vllm._unit_only import CompletionRequest  # noqa
