"""cenote on a Ray cluster: callable classes for ``ray.data.Dataset.map_batches``, one cenote
engine per actor (``pip install 'cenote[ray]'``).

    import ray, cenote.ray
    ds = ray.data.read_parquet("s3://bucket/passages/")
    ds = ds.map_batches(
        cenote.ray.Embedder, fn_constructor_kwargs={"model": "/models/minilm"},
        concurrency=4, num_cpus=8, batch_size=512,
    )

``model`` and the other constructor options are ``LLM``'s: a hub id (``BAAI/bge-small-en-v1.5``,
``revision=``) is read from each node's own Hugging Face cache (download it on every node).
Each class reads its input column(s) from a numpy batch and returns the batch with its output
columns added (``drop_columns`` leaves inputs out). An engine uses as many torch threads as Ray
gave its actor CPUs. Rows come back in their input order within a batch; set
``DataContext.get_current().execution_options.preserve_order = True`` to keep dataset order.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import numpy as np

from cenote.errors import CenoteError

DEFAULT_GCS_PORT = 6379


class ClusterUnreachableError(CenoteError, ConnectionError):
    """The Ray address given does not answer."""


def connect(address: str | None = None, timeout_s: float = 5.0, **init_kwargs: Any) -> None:
    """Join the Ray cluster at ``address`` (``host:port``, ``ray://host:port`` or ``auto``), or
    start a local one when ``address`` is None. An address that does not answer within
    ``timeout_s`` raises ``ClusterUnreachableError`` naming it, instead of Ray's long retries."""
    import ray

    if ray.is_initialized():
        return
    init_kwargs.setdefault("include_dashboard", False)
    init_kwargs.setdefault("log_to_driver", False)
    if address is None:
        ray.init(**init_kwargs)
        return
    if address != "auto":
        _check_answers(address, timeout_s)
    try:
        ray.init(address=address, **init_kwargs)
    except ConnectionError as e:
        raise ClusterUnreachableError(f"cannot join the Ray cluster at {address!r}: {e}") from e


def _check_answers(address: str, timeout_s: float) -> None:
    host_port = address.removeprefix("ray://")
    host, _, port = host_port.rpartition(":")
    if not host:
        host, port = host_port, str(DEFAULT_GCS_PORT)
    if not port.isdigit():
        raise ClusterUnreachableError(f"the Ray address {address!r} is not host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ClusterUnreachableError(
            f"the Ray cluster at {address!r} does not answer ({e.strerror or e}); start one with "
            f"`ray start --head --port {port}` or pass the address `ray start` printed"
        ) from e


class _EngineWorker:
    """One ``LLM`` per actor, with as many threads as Ray gave this actor CPUs."""

    def __init__(
        self, model: str | None, drop_columns: Sequence[str], llm_kwargs: dict[str, Any]
    ) -> None:
        from cenote.llm import LLM

        llm_kwargs.setdefault("num_threads", _assigned_cpus())
        self.llm = LLM(model, **llm_kwargs)
        self.drop_columns = set(drop_columns)

    def _with(self, batch: dict[str, np.ndarray], **columns: np.ndarray) -> dict[str, np.ndarray]:
        kept = {k: v for k, v in batch.items() if k not in self.drop_columns}
        return {**kept, **columns}


class Embedder(_EngineWorker):
    """``text_column`` -> ``output_column`` (``[n, dim]`` float32) and ``num_tokens``. A
    ``row`` column, when present, names the row of a passage the engine refuses."""

    def __init__(
        self,
        model: str | None = None,
        *,
        text_column: str = "text",
        output_column: str = "embedding",
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        drop_columns: Sequence[str] = (),
        **llm_kwargs: Any,
    ) -> None:
        super().__init__(model, drop_columns, llm_kwargs)
        self.text_column, self.output_column = text_column, output_column
        self.truncate_prompt_tokens, self.dimensions = truncate_prompt_tokens, dimensions

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from cenote.apps.corpus.embedder import embed_passages

        embeddings, num_tokens = embed_passages(
            self.llm, batch[self.text_column].tolist(), _rows(batch),
            self.truncate_prompt_tokens, self.dimensions,
        )  # fmt: skip
        return self._with(batch, **{self.output_column: embeddings, "num_tokens": num_tokens})


class Classifier(_EngineWorker):
    """``text_column`` -> ``probs`` (``[n, num_labels]`` float32) and ``label``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        text_column: str = "text",
        truncate_prompt_tokens: int | None = None,
        drop_columns: Sequence[str] = (),
        **llm_kwargs: Any,
    ) -> None:
        super().__init__(model, drop_columns, llm_kwargs)
        self.text_column, self.truncate_prompt_tokens = text_column, truncate_prompt_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.llm.classify(
            batch[self.text_column].tolist(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            use_tqdm=False,
        )
        probs = np.stack([out.outputs.data.float().numpy() for out in outputs])
        labels = np.array([out.outputs.label for out in outputs])
        return self._with(batch, probs=probs.astype(np.float32, copy=False), label=labels)


class Scorer(_EngineWorker):
    """(``text_1_column``, ``text_2_column``) pairs -> ``score`` (float32): cross-encoder,
    bi-encoder cosine or MaxSim, as ``LLM.score``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        text_1_column: str = "text_1",
        text_2_column: str = "text_2",
        truncate_prompt_tokens: int | None = None,
        drop_columns: Sequence[str] = (),
        **llm_kwargs: Any,
    ) -> None:
        super().__init__(model, drop_columns, llm_kwargs)
        self.columns = (text_1_column, text_2_column)
        self.truncate_prompt_tokens = truncate_prompt_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        queries, documents = (batch[c].tolist() for c in self.columns)
        outputs = self.llm.score(
            queries, documents, truncate_prompt_tokens=self.truncate_prompt_tokens, use_tqdm=False
        )
        scores = np.array([out.outputs.score for out in outputs], dtype=np.float32)
        return self._with(batch, score=scores)


class Generator(_EngineWorker):
    """``prompt_column`` -> ``generated_text`` and ``num_generated_tokens`` (the first of the
    ``n`` completions); ``sampling_params`` are ``SamplingParams`` fields."""

    def __init__(
        self,
        model: str | None = None,
        *,
        prompt_column: str = "prompt",
        sampling_params: dict[str, Any] | None = None,
        drop_columns: Sequence[str] = (),
        **llm_kwargs: Any,
    ) -> None:
        from cenote.sampling_params import SamplingParams

        super().__init__(model, drop_columns, llm_kwargs)
        self.prompt_column = prompt_column
        self.sampling_params = SamplingParams(**(sampling_params or {}))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.llm.generate(
            batch[self.prompt_column].tolist(), self.sampling_params, use_tqdm=False
        )
        texts = np.array([out.outputs[0].text for out in outputs], dtype=object)
        counts = np.array([len(out.outputs[0].token_ids) for out in outputs], dtype=np.int32)
        return self._with(batch, generated_text=texts, num_generated_tokens=counts)


def _rows(batch: dict[str, np.ndarray]) -> list[int] | None:
    """The corpus rows of a batch (``cenote embed --ray`` sends them along), if any."""
    rows = batch.get("row")
    return None if rows is None else [int(row) for row in rows]


def _assigned_cpus() -> int | None:
    """The CPUs Ray reserved for the calling actor; None outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return None
    resources = ray.get_runtime_context().get_assigned_resources()  # type: ignore[no-untyped-call]
    cpus = resources.get("CPU")
    return max(1, int(cpus)) if cpus else None
