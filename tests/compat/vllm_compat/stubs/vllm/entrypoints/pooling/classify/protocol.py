from vllm._responses import ClassificationResponse, ClassificationData  # noqa
