from vllm._unit_only import VLLMValidationError  # noqa
