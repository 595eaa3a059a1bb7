from vllm._responses import RerankResponse, ScoreResponse  # noqa
