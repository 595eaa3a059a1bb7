"""Poolers without a model: hidden states and pooling metadata built by hand, every result checked
against plain torch (CLS / MEAN / LAST / ALL / STEP, Dense projection, matryoshka truncation,
normalization, activations, SPLADE), and what each pooler declares it reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cenote.pooling.heads import DenseProjector, EmbeddingHead
from cenote.pooling.interface import PoolingRequirements
from cenote.pooling.metadata import PoolingMetadata
from cenote.pooling.pooler import ClassifierPooler, DispatchPooler, EmbeddingPooler
from cenote.pooling.sparse import SparsePooler
from cenote.pooling_params import PoolingParams

HIDDEN = 8
PROMPT_LENS = [3, 1, 5]
ATOL = 1e-6


def _hidden(lens: list[int] = PROMPT_LENS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(sum(lens), HIDDEN, generator=generator).to(dtype)  # [num_tokens, hidden]


def _metadata(params: list[PoolingParams], lens: list[int] = PROMPT_LENS) -> PoolingMetadata:
    start_loc = [0]
    for n in lens:
        start_loc.append(start_loc[-1] + n)
    prompts = [[10 + i + j for j in range(n)] for i, n in enumerate(lens)]
    return PoolingMetadata(start_loc=start_loc, pooling_params=params, prompt_token_ids=prompts)


def _rows(hidden: torch.Tensor, lens: list[int] = PROMPT_LENS) -> list[torch.Tensor]:
    return list(hidden.float().split(lens))  # [prompt_len, hidden] per request


def _hand_pool(rows: torch.Tensor, method: str) -> torch.Tensor:
    return {"cls": rows[0], "mean": rows.mean(dim=0), "last": rows[-1]}[method]


def _embedder(method: str, normalize: bool = False, **kwargs) -> EmbeddingPooler:
    return EmbeddingPooler(
        method, EmbeddingHead(None, default_normalize=normalize), HIDDEN, **kwargs
    )


def _params(task: str, n: int = len(PROMPT_LENS), **kwargs) -> list[PoolingParams]:
    return [PoolingParams(task=task, **kwargs) for _ in range(n)]


# ---- embeddings -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["cls", "mean", "last"])
def test_sequence_methods_match_hand_pooling(method: str) -> None:
    hidden = _hidden()
    outputs = _embedder(method)(hidden, _metadata(_params("embed")))
    for out, rows in zip(outputs, _rows(hidden), strict=True):
        torch.testing.assert_close(out, _hand_pool(rows, method), atol=ATOL, rtol=0)


def test_mean_accumulates_in_fp32_for_bf16_hidden_states() -> None:
    hidden = _hidden(dtype=torch.bfloat16)
    (out, *_) = _embedder("mean")(hidden, _metadata(_params("embed")))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, hidden[:3].float().mean(dim=0), atol=ATOL, rtol=0)


def test_all_returns_every_row_of_each_prompt() -> None:
    hidden = _hidden()
    outputs = _embedder("cls")(hidden, _metadata(_params("token_embed")))
    for out, rows in zip(outputs, _rows(hidden), strict=True):
        torch.testing.assert_close(out, rows, atol=0, rtol=0)


def test_normalize_default_and_per_request() -> None:
    hidden = _hidden()
    params = [
        PoolingParams(task="embed"),
        PoolingParams(task="embed", normalize=False),
        PoolingParams(task="embed", normalize=True),
    ]
    outputs = _embedder("mean", normalize=True)(hidden, _metadata(params))
    expected = [rows.mean(dim=0) for rows in _rows(hidden)]
    torch.testing.assert_close(outputs[0], F.normalize(expected[0], dim=-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[1], expected[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[2], F.normalize(expected[2], dim=-1), atol=ATOL, rtol=0)
    assert outputs[0].norm().item() == pytest.approx(1.0)


def test_matryoshka_truncates_before_normalizing() -> None:
    hidden = _hidden()
    params = [PoolingParams(task="embed", dimensions=3), *_params("token_embed", 2, dimensions=2)]
    outputs = _embedder("last", normalize=True)(hidden, _metadata(params))
    rows = _rows(hidden)
    torch.testing.assert_close(outputs[0], F.normalize(rows[0][-1, :3], dim=-1), atol=ATOL, rtol=0)
    for out, expected in zip(outputs[1:], rows[1:], strict=True):
        torch.testing.assert_close(out, F.normalize(expected[:, :2], dim=-1), atol=ATOL, rtol=0)


def test_dense_projector_then_truncate_then_normalize() -> None:
    torch.manual_seed(1)
    first, second = torch.nn.Linear(HIDDEN, 6), torch.nn.Linear(6, 4, bias=False)
    head = EmbeddingHead(DenseProjector([(first, "tanh"), (second, None)]), default_normalize=True)
    pooler = EmbeddingPooler("cls", head, output_size=4)
    hidden = _hidden()
    outputs = pooler(hidden, _metadata(_params("embed", dimensions=3)))
    with torch.no_grad():
        for out, rows in zip(outputs, _rows(hidden), strict=True):
            projected = second(torch.tanh(first(rows[0])))
            torch.testing.assert_close(out, F.normalize(projected[:3], dim=-1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", ["cls", "mean"])
def test_include_prompt_false_skips_the_instruction(method: str) -> None:
    """sentence-transformers' include_prompt=false: the instruction's rows are left out (all of
    a prompt that is only instruction: CLS falls back to row 0, MEAN to zeros)."""
    hidden = _hidden()
    params = [
        PoolingParams(task="embed", instruction_length=2),
        PoolingParams(task="embed", instruction_length=1),
        PoolingParams(task="embed"),
    ]
    outputs = _embedder(method, include_prompt=False)(hidden, _metadata(params))
    rows = _rows(hidden)
    torch.testing.assert_close(outputs[0], _hand_pool(rows[0][2:], method), atol=ATOL, rtol=0)
    fallback = rows[1][0] if method == "cls" else torch.zeros(HIDDEN)
    torch.testing.assert_close(outputs[1], fallback, atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[2], _hand_pool(rows[2], method), atol=ATOL, rtol=0)


def test_embedding_pooler_refuses_token_methods() -> None:
    with pytest.raises(ValueError, match="embedding pooling must be one of"):
        _embedder("step")


# ---- classification ---------------------------------------------------------------------------

NUM_LABELS = 3


def _score_head() -> torch.nn.Linear:
    torch.manual_seed(2)
    return torch.nn.Linear(HIDDEN, NUM_LABELS)


@pytest.mark.parametrize(
    ("activation", "expected"),
    [
        ("softmax", lambda s: s.softmax(dim=-1)),
        ("sigmoid", torch.sigmoid),
        ("identity", lambda s: s),
    ],
)
@pytest.mark.parametrize("method", ["cls", "mean", "last"])
def test_classify_pools_scores_and_activates(method, activation, expected) -> None:
    head = _score_head()
    pooler = ClassifierPooler(method, head, activation, NUM_LABELS)
    hidden = _hidden()
    params = [*_params("classify", 2), PoolingParams(task="classify", use_activation=False)]
    outputs = pooler(hidden, _metadata(params))
    with torch.no_grad():
        scores = [head(_hand_pool(rows, method)) for rows in _rows(hidden)]
    torch.testing.assert_close(outputs[0], expected(scores[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[1], expected(scores[1]), atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[2], scores[2], atol=ATOL, rtol=0)  # raw scores


def test_token_classify_every_row_and_returned_columns() -> None:
    head = _score_head()
    pooler = ClassifierPooler("cls", head, "softmax", NUM_LABELS)
    hidden = _hidden()
    params = [
        PoolingParams(task="token_classify"),
        PoolingParams(task="token_classify", returned_token_ids=[2, 0]),
        PoolingParams(task="token_classify", use_activation=False),
    ]
    outputs = pooler(hidden, _metadata(params))
    with torch.no_grad():
        scores = [head(rows) for rows in _rows(hidden)]  # [prompt_len, num_labels]
    torch.testing.assert_close(outputs[0], scores[0].softmax(dim=-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[1], scores[1][:, [2, 0]].softmax(dim=-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[2], scores[2], atol=ATOL, rtol=0)


def test_step_rows_from_the_request_else_the_model_default() -> None:
    """STEP: rows whose token is the step tag (the request's, else the pooler's default)."""
    head = _score_head()
    pooler = ClassifierPooler(None, head, "softmax", NUM_LABELS, step_tag_id=13)
    hidden = _hidden()
    metadata = _metadata(
        [PoolingParams(task="token_classify"), *_params("token_classify", 2, step_tag_id=15)]
    )
    outputs = pooler(hidden, metadata)
    rows = _rows(hidden)
    with torch.no_grad():
        # prompt 0 is [10, 11, 12]: no 13; prompt 2 is [12 .. 16]: 15 at row 3
        assert outputs[0].shape == (0, NUM_LABELS)
        assert outputs[1].shape == (0, NUM_LABELS)
        torch.testing.assert_close(outputs[2], head(rows[2][3:4]).softmax(-1), atol=ATOL, rtol=0)
    assert pooler.get_supported_tasks() == ("token_classify",)


def test_classifier_pooler_refuses_token_methods() -> None:
    with pytest.raises(ValueError, match="classifier pooling must be one of"):
        ClassifierPooler("all", _score_head(), "softmax", NUM_LABELS)


# ---- sparse -----------------------------------------------------------------------------------

VOCAB = 11


@pytest.mark.parametrize("strategy", ["max", "sum"])
@pytest.mark.parametrize("activation", ["relu", "log1p_relu"])
def test_sparse_pooling_and_top_k(strategy: str, activation: str) -> None:
    torch.manual_seed(3)
    mlm = torch.nn.Linear(HIDDEN, VOCAB)
    pooler = SparsePooler(mlm, strategy, activation, VOCAB, default_max_active_dims=4)
    hidden = _hidden()
    params = [
        PoolingParams(task="embed_sparse"),
        PoolingParams(task="embed_sparse", max_active_dims=2),
        PoolingParams(task="embed_sparse", max_active_dims=VOCAB),
    ]
    with torch.no_grad():
        outputs = pooler(hidden, _metadata(params))
        for out, rows, k in zip(outputs, _rows(hidden), (4, 2, VOCAB), strict=True):
            x = torch.log1p(torch.relu(mlm(rows)))
            if activation == "log1p_relu":
                x = torch.log1p(x)
            weights = x.amax(dim=0) if strategy == "max" else x.sum(dim=0)
            kept = torch.zeros(VOCAB)
            top = weights.topk(k).indices
            kept[top] = weights[top]
            torch.testing.assert_close(out, kept, atol=ATOL, rtol=0)
            assert int((out != 0).sum()) <= k


def test_sparse_pooler_refuses_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="sparse pooling is max or sum"):
        SparsePooler(torch.nn.Linear(HIDDEN, VOCAB), "mean", "relu", VOCAB)


# ---- dispatch and declared requirements --------------------------------------------------------


def test_dispatch_routes_each_request_to_its_task_pooler() -> None:
    embedder, head = _embedder("mean", normalize=True), _score_head()
    classifier = ClassifierPooler("last", head, "sigmoid", NUM_LABELS)
    pooler = DispatchPooler({"embed": embedder, "token_embed": embedder, "classify": classifier})
    hidden = _hidden()
    params = [
        PoolingParams(task="classify"),
        PoolingParams(task="embed"),
        PoolingParams(task="token_embed", normalize=False),
    ]
    outputs = pooler(hidden, _metadata(params))
    rows = _rows(hidden)
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], head(rows[0][-1]).sigmoid(), atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[1], F.normalize(rows[1].mean(0), dim=-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[2], rows[2], atol=ATOL, rtol=0)
    assert pooler.embedding_size == HIDDEN and pooler.num_labels == NUM_LABELS


def test_dispatch_pools_a_multi_task_request_by_each_of_its_tasks() -> None:
    """A request asking several tasks (one pooler serving two of them) beside single-task ones:
    its result is a task -> tensor map, in the order asked, each equal to its task asked alone;
    options go to the tasks they fit (``dimensions``: embeddings, not the classifier)."""
    embedder, head = _embedder("mean", normalize=True), _score_head()
    classifier = ClassifierPooler("last", head, "sigmoid", NUM_LABELS)
    pooler = DispatchPooler({"embed": embedder, "token_embed": embedder, "classify": classifier})
    hidden = _hidden()
    multi = PoolingParams(task=("token_embed", "classify", "embed"), normalize=False)
    params = [PoolingParams(task="embed"), multi, PoolingParams(task="classify")]
    outputs = pooler(hidden, _metadata(params))
    assert isinstance(outputs[1], dict) and list(outputs[1]) == list(multi.tasks)
    for task in multi.tasks:
        alone = pooler(hidden, _metadata([params[0], multi.for_task(task), params[2]]))
        torch.testing.assert_close(outputs[1][task], alone[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(outputs[0], pooler(hidden, _metadata(_params("embed")))[0])
    rows = _rows(hidden)
    with torch.no_grad():
        torch.testing.assert_close(outputs[2], head(rows[2][-1]).sigmoid(), atol=ATOL, rtol=0)
    assert multi.for_task("classify").dimensions is None
    assert PoolingParams(task=("embed", "classify"), dimensions=4).for_task("embed").dimensions == 4


@pytest.mark.parametrize(
    ("method", "embed_cacheable"), [("last", True), ("mean", False), ("cls", False)]
)
def test_poolers_declare_what_they_read(method: str, embed_cacheable: bool) -> None:
    """Only last-token pooling may skip rows (prefix cache); everything else needs every row
    of the prompt from the first."""
    classifier = ClassifierPooler(method, _score_head(), "softmax", NUM_LABELS)
    sparse = SparsePooler(torch.nn.Linear(HIDDEN, VOCAB), "max", "relu", VOCAB)
    embedder = _embedder(method)
    pooler = DispatchPooler(
        {
            "embed": embedder,
            "token_embed": embedder,
            "classify": classifier,
            "token_classify": classifier,
            "embed_sparse": sparse,
        }
    )
    expected = {
        "embed": embed_cacheable,
        "classify": embed_cacheable,
        "token_embed": False,
        "token_classify": False,
        "embed_sparse": False,
    }
    for task, cacheable in expected.items():
        requirements = pooler.requirements(task)
        assert requirements == PoolingRequirements(last_token_only=cacheable), task
        assert requirements.prefix_cache_safe == cacheable
        assert requirements.whole_prompt != cacheable


def test_moving_the_dispatch_pooler_moves_every_head() -> None:
    """The engine moves the pooler to the model's device with one ``.to``: the heads' weights
    (a Dense projector here) must follow; the dtype stands for the device on a CPU machine."""
    dense = DenseProjector([(torch.nn.Linear(4, 3), None)])
    embed = EmbeddingPooler("mean", EmbeddingHead(dense, default_normalize=True), output_size=3)
    pooler = DispatchPooler({"embed": embed, "token_embed": embed}).to(torch.float64)
    assert all(p.dtype == torch.float64 for p in dense.parameters())
    assert pooler.poolers["embed"] is embed
