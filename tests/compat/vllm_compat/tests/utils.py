"""RemoteOpenAIServer stand-in: starts `cenote serve` through the project's ServerProcess.

The vLLM model a test names is mapped to a local stand-in (see MODELS); of the test's
`vllm serve` flags only those cenote has (--max-model-len, --chat-template, --hf-overrides, --max-logprobs,
--max-num-seqs) are passed on; every server runs fp32 on 2 threads (CPU)."""

from pathlib import Path

import openai
from tests_cenote.server_fixture import ServerProcess  # noqa: E402  (see conftest)

HERE = Path(__file__).resolve().parent.parent
MODELS_DIR = HERE / "models"
ROCM_EXTRA_ARGS: list[str] = []


def _smollm2() -> str:
    from tests_cenote.smollm2 import find_smollm2_gguf

    return str(find_smollm2_gguf())


# served name the tests use -> `cenote serve` model argument (None: the default all-MiniLM-L6-v2)
MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": None,
    "cross-encoder": str(MODELS_DIR / "cross-encoder"),
    "classifier": str(MODELS_DIR / "classifier"),
    "SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2",
}
_KEPT_WITH_VALUE = {
    "--max-model-len",
    "--chat-template",
    "--hf-overrides",
    "--hf_overrides",
    "--max-logprobs",
    "--max-num-seqs",
}
_DROPPED_WITH_VALUE = {
    "--dtype",
    "--runner",
    "--lora-modules",
    "--max-lora-rank",
    "--max-cpu-loras",
    "--seed",
    "--tokenizer-mode",
    "--reasoning-parser",
}


def translate_args(vllm_args: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(vllm_args):
        arg = vllm_args[i]
        name, eq, value = arg.partition("=")
        if name in _KEPT_WITH_VALUE:
            if not eq:
                i += 1
                value = vllm_args[i]
            out += [name.replace("_", "-"), value]
        elif name in _DROPPED_WITH_VALUE:
            if not eq:
                i += 1
        i += 1
    return out


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict=None,
        seed=0,
        auto_port=True,
        max_wait_seconds=None,
        **kwargs,
    ) -> None:
        target = MODELS[model]
        if target == "smollm2":
            target = _smollm2()
        args = [] if target is None else [target]
        translated = translate_args(vllm_serve_args)
        if target is None and "--max-model-len" in translated:
            at = translated.index("--max-model-len")
            if int(translated[at + 1]) > 256:  # above MiniLM's own limit (vLLM's e5 / bge have 512)
                del translated[at : at + 2]
        args += ["--dtype", "float32", "--num-threads", "2", *translated]
        print("cenote serve", " ".join(args))
        self.server = ServerProcess(*args, timeout_s=max_wait_seconds or 240)
        self.host, self.port = "127.0.0.1", self.server.port

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.stop()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )
