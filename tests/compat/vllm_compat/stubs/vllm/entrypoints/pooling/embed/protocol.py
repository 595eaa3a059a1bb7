from vllm._responses import EmbeddingResponse, EmbeddingResponseData  # noqa
