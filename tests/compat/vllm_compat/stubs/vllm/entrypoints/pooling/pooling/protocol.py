from vllm._responses import PoolingResponse, PoolingResponseData  # noqa
