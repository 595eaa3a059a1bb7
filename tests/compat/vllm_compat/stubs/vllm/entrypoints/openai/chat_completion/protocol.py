from vllm._unit_only import BatchChatCompletionRequest, ChatCompletionRequest  # noqa
