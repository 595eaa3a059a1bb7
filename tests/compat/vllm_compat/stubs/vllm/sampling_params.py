from vllm._unit_only import SamplingParams  # noqa
