"""ColBERT (colbert-ai ``HF_ColBERT`` folders: BERT under ``bert.`` + ``linear``) vs a reference
built here from transformers' BertModel and the linear layer, encoding texts as colbert-ai's
QueryTokenizer / DocTokenizer and scoring as its ``colbert_score``: queries ``[CLS] [Q] ... [SEP]``
padded with [MASK] to query_maxlen (the [MASK]s hidden from attention unless
attend_to_mask_tokens), documents ``[CLS] [D] ... [SEP]`` cut to doc_maxlen with punctuation
left out of MaxSim. Tiny random weights, fp32."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import NUM_THREADS
from factories.encoder_zoo import TEXTS
from factories.seeded import perturb
from factories.vocab import RETRIEVAL_BERT_SPECIALS, VOCAB_SIZE, write_retrieval_tokenizer
from safetensors.torch import save_file

from cenote import LLM, PoolingParams

ATOL = 1e-4  # DESIGN.md §3: fp32 vs the transformers-built reference
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
QUERY_MAXLEN, DOC_MAXLEN, DIM = 12, 16, 16
QUERIES = ["the cat sat", "a dog ?", "query " * 20]  # the last is cut to query_maxlen
DOCUMENTS = [*TEXTS, "cat , dog . mat ! the ?"]  # some over doc_maxlen; punctuation


class Reference:
    """colbert-ai's encoding and scoring over transformers' BertModel + ``linear``."""

    def __init__(self, folder: Path, bert, linear: torch.Tensor, attend_to_mask_tokens: bool):
        self.tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
        self.bert, self.linear = bert, linear
        self.attend_to_mask_tokens = attend_to_mask_tokens
        vocab = self.tokenizer.get_vocab()
        self.q_id, self.d_id = vocab["[unused0]"], vocab["[unused1]"]
        self.skiplist = {
            self.tokenizer.encode(symbol, add_special_tokens=False)[0]
            for symbol in string.punctuation
        }

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state[0]
        return hidden @ self.linear.T  # [len, dim]

    def query(self, text: str) -> tuple[list[int], torch.Tensor]:
        enc = self.tokenizer(
            [". " + text], padding="max_length", truncation=True, max_length=QUERY_MAXLEN,
            return_tensors="pt",
        )  # fmt: skip
        ids, mask = enc["input_ids"], enc["attention_mask"]
        ids[:, 1] = self.q_id
        ids[ids == self.tokenizer.pad_token_id] = self.tokenizer.mask_token_id
        if self.attend_to_mask_tokens:
            mask[ids == self.tokenizer.mask_token_id] = 1
        return ids[0].tolist(), F.normalize(self._encode(ids, mask), dim=-1)

    def document(self, text: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(
            [". " + text], truncation=True, max_length=DOC_MAXLEN, return_tensors="pt"
        )
        ids = enc["input_ids"]
        ids[:, 1] = self.d_id
        keep = torch.tensor([t not in self.skiplist for t in ids[0].tolist()])
        vectors = self._encode(ids, enc["attention_mask"]) * keep.unsqueeze(1)
        return ids[0].tolist(), F.normalize(vectors, dim=-1), keep

    def score(self, query: str, document: str) -> float:
        _, q = self.query(query)
        _, d, keep = self.document(document)
        scores = d @ q.T  # [doc_len, query_len]
        scores[~keep] = -9999
        return scores.max(dim=0).values.sum().item()


def save_colbert(folder: Path, attend_to_mask_tokens: bool, seed: int = 0):
    """An HF_ColBERT folder as colbert-ai saves it; returns (BertModel, linear weight)."""
    config = transformers.BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    bert = perturb(transformers.BertModel(config, add_pooling_layer=False), seed)
    torch.manual_seed(seed + 1)
    linear = torch.randn(DIM, 32) * 32**-0.5
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"bert.{name}": t.contiguous() for name, t in bert.state_dict().items()}
    save_file({**tensors, "linear.weight": linear}, folder / "model.safetensors")
    config.architectures = ["HF_ColBERT"]
    config.save_pretrained(folder)
    write_retrieval_tokenizer(folder, RETRIEVAL_BERT_SPECIALS, token_types=True)
    metadata = {
        "query_token_id": "[unused0]",
        "doc_token_id": "[unused1]",
        "query_token": "[Q]",
        "doc_token": "[D]",
        "query_maxlen": QUERY_MAXLEN,
        "doc_maxlen": DOC_MAXLEN,
        "dim": DIM,
        "similarity": "cosine",
        "interaction": "colbert",
        "attend_to_mask_tokens": attend_to_mask_tokens,
        "mask_punctuation": True,
    }
    (folder / "artifact.metadata").write_text(json.dumps(metadata))
    return bert, linear


@pytest.fixture(scope="module", params=[False, True], ids=["mask-hidden", "mask-attended"])
def colbert(request, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("colbert")
    bert, linear = save_colbert(folder, attend_to_mask_tokens=request.param)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    return folder, llm, Reference(folder, bert, linear, request.param)


def _token_embed(llm: LLM, prompts: list) -> list:
    return llm.encode(prompts, PoolingParams(), pooling_task="token_embed", use_tqdm=False)


def test_documents_match_reference(colbert) -> None:
    _, llm, reference = colbert
    assert llm.supported_tasks == ("token_embed",)
    for out, text in zip(_token_embed(llm, DOCUMENTS), DOCUMENTS, strict=True):
        ids, expected, keep = reference.document(text)
        assert out.prompt_token_ids == ids
        assert len(ids) <= DOC_MAXLEN
        assert out.outputs.data.shape == (len(ids), DIM)
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)
    assert not keep.all()  # the last document has punctuation rows (zeros)


def _format_queries(llm):
    """The queries as the engine formats them (role "query")."""
    ids = [f"q{i}" for i in range(len(QUERIES))]
    params = PoolingParams(task="token_embed")
    return llm.input_processor.process_batch(ids, QUERIES, params, role="query")


def test_queries_match_reference(colbert) -> None:
    """Queries formatted by the engine (role "query"), embedded as token ids."""
    _, llm, reference = colbert
    formatted = _format_queries(llm)
    outputs = _token_embed(llm, [{"prompt_token_ids": f.prompt_token_ids} for f in formatted])
    for out, text in zip(outputs, QUERIES, strict=True):
        ids, expected = reference.query(text)
        assert out.prompt_token_ids == ids
        assert len(ids) == QUERY_MAXLEN
        torch.testing.assert_close(out.outputs.data, expected, atol=ATOL, rtol=0)
    assert formatted[0].prompt_token_ids[-1] == reference.tokenizer.mask_token_id  # augmented
    # whether tokens attend to the [MASK] padding changes the vectors: both settings are checked
    reference.attend_to_mask_tokens = not reference.attend_to_mask_tokens
    try:
        _, other = reference.query(QUERIES[0])
    finally:
        reference.attend_to_mask_tokens = not reference.attend_to_mask_tokens
    assert (other - outputs[0].outputs.data).abs().max() > 1e-2


def test_score_matches_colbert_score(colbert) -> None:
    _, llm, reference = colbert
    for query in QUERIES:
        outputs = llm.score(query, DOCUMENTS, use_tqdm=False)
        for out, document in zip(outputs, DOCUMENTS, strict=True):
            expected = reference.score(query, document)
            assert abs(out.outputs.score - expected) < ATOL * QUERY_MAXLEN, (query, document)


def test_batch_invariance(colbert) -> None:
    _, llm, _ = colbert
    formatted = _format_queries(llm)
    prompts = [*DOCUMENTS, *[{"prompt_token_ids": f.prompt_token_ids} for f in formatted]]
    together = _token_embed(llm, prompts)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = _token_embed(llm, [prompt])
        torch.testing.assert_close(
            batched.outputs.data, alone.outputs.data, atol=BATCH_ATOL, rtol=0
        )


def test_unsupported_settings_are_refused_at_load(colbert, tmp_path: Path) -> None:
    folder = tmp_path / "l2"
    shutil.copytree(colbert[0], folder)
    metadata = json.loads((folder / "artifact.metadata").read_text())
    (folder / "artifact.metadata").write_text(json.dumps({**metadata, "similarity": "l2"}))
    with pytest.raises(ValueError, match="similarity 'l2' is not supported; supported: cosine"):
        LLM(str(folder), dtype="float32")
