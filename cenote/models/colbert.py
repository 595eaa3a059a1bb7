"""ColBERT late-interaction checkpoints as colbert-ai writes them (``HF_ColBERT``): a BERT trunk
under ``bert.`` and ``linear`` (no bias) projecting every token to the ColBERT dimension; and
the query / document encoding shared with PyLate folders (``models/pylate.py``).

Settings come from the folder's ``artifact.metadata`` (colbert-ai's ``ColBERTConfig``), with
colbert-ai's defaults where it is absent, or from a PyLate folder's
``config_sentence_transformers.json`` (``ColBERTSettings.from_pylate``). As colbert-ai encodes
them:

- a query is ``[CLS] [Q] tokens [SEP]`` padded to ``query_maxlen`` with ``[MASK]`` (query
  augmentation); unless ``attend_to_mask_tokens``, no token attends to those ``[MASK]`` rows, but
  they are embedded and take part in MaxSim;
- a document is ``[CLS] [D] tokens [SEP]`` cut to ``doc_maxlen``; with ``mask_punctuation`` its
  punctuation rows are zero vectors (MaxSim leaves them out).

``[Q]`` / ``[D]`` are vocabulary tokens (``[unused0]`` / ``[unused1]`` by default; PyLate adds
"[Q] " / "[D] " to the vocabulary). The model tells queries from documents by the marker at
position 1, so a request carries its role in its tokens. Every token vector is L2-normalized by
the embedding head.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from cenote.config import ModelConfig
from cenote.inputs import TextRole
from cenote.models.bert import BertModel
from cenote.models.checkpoint_map import Slot
from cenote.models.layers.attention import EncoderMaskFn
from cenote.models.layers.linear import TrunkLinear

COLBERT_ARCHITECTURES = ("HF_ColBERT",)
PYLATE_ARCHITECTURES = ("PyLateBertModel", "PyLateModernBertModel")
SUPPORTED_SIMILARITY = ("cosine",)
SUPPORTED_INTERACTION = ("colbert",)


@dataclass(frozen=True)
class ColBERTSettings:
    """What colbert-ai's ``ColBERTConfig`` says about encoding texts."""

    query_token: str = "[unused0]"  # vocabulary token of the [Q] marker
    doc_token: str = "[unused1]"  # vocabulary token of the [D] marker
    query_maxlen: int = 32  # queries are padded (with [MASK]) or cut to this many tokens
    doc_maxlen: int = 220  # documents are cut to this many tokens
    dim: int = 128  # output size of ``linear``
    attend_to_mask_tokens: bool = False  # whether tokens attend to the query's [MASK] padding
    mask_punctuation: bool = True  # whether documents' punctuation is left out of MaxSim
    query_expansion: bool = True  # queries padded with [MASK] to query_maxlen (else only cut)
    # the tokens left out of documents: None is colbert-ai's rule (the first token of each
    # punctuation character); PyLate lists words and leaves out those that are vocabulary tokens
    skiplist_words: tuple[str, ...] | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> ColBERTSettings:
        path = folder / "artifact.metadata"
        metadata: dict[str, Any] = {}
        if path.exists():
            with open(path, encoding="utf-8") as f:
                metadata = json.load(f)
        for key, supported in (
            ("similarity", SUPPORTED_SIMILARITY),
            ("interaction", SUPPORTED_INTERACTION),
        ):
            value = metadata.get(key, supported[0])
            if value not in supported:
                raise ValueError(
                    f"{path}: ColBERT {key} {value!r} is not supported; supported: "
                    f"{', '.join(supported)}"
                )
        defaults = cls()
        return cls(
            query_token=metadata.get("query_token_id", defaults.query_token),
            doc_token=metadata.get("doc_token_id", defaults.doc_token),
            query_maxlen=int(metadata.get("query_maxlen", defaults.query_maxlen)),
            doc_maxlen=int(metadata.get("doc_maxlen", defaults.doc_maxlen)),
            dim=int(metadata.get("dim", defaults.dim)),
            attend_to_mask_tokens=bool(
                metadata.get("attend_to_mask_tokens", defaults.attend_to_mask_tokens)
            ),
            mask_punctuation=bool(metadata.get("mask_punctuation", defaults.mask_punctuation)),
        )

    @classmethod
    def from_pylate(cls, folder: Path, dim: int) -> ColBERTSettings:
        """A PyLate folder's top-level ``config_sentence_transformers.json`` keys, with PyLate's
        defaults where absent; ``dim``: its Dense projection's output size."""
        path = folder / "config_sentence_transformers.json"
        with open(path, encoding="utf-8") as f:
            config: dict[str, Any] = json.load(f)
        skiplist = config.get("skiplist_words")
        words = tuple(string.punctuation) if skiplist is None else tuple(str(w) for w in skiplist)
        return cls(
            query_token=str(config.get("query_prefix", "[Q] ")),
            doc_token=str(config.get("document_prefix", "[D] ")),
            query_maxlen=int(config.get("query_length") or 32),
            doc_maxlen=int(config.get("document_length") or 180),
            dim=dim,
            attend_to_mask_tokens=bool(config.get("attend_to_expansion_tokens", False)),
            mask_punctuation=bool(words),
            query_expansion=config.get("do_query_expansion", True) is not False,
            skiplist_words=words,
        )


@dataclass(frozen=True)
class ColBERTTokens:
    """The token ids ColBERT's encoding needs, from the folder's tokenizer."""

    cls_id: int
    sep_id: int
    mask_id: int
    query_marker_id: int
    doc_marker_id: int
    skiplist: frozenset[int]  # token ids left out of documents (``ColBERTSettings.skiplist_words``)

    @classmethod
    def of(cls, tokenizer: Tokenizer, settings: ColBERTSettings) -> ColBERTTokens:
        def token_id(token: str) -> int:
            found = tokenizer.token_to_id(token)
            if found is None:
                raise ValueError(f"ColBERT token {token!r} is not in the tokenizer's vocabulary")
            return found

        skiplist = set()
        if settings.skiplist_words is not None:  # PyLate: the words that are vocabulary tokens
            found = (tokenizer.token_to_id(word) for word in settings.skiplist_words)
            skiplist = {token for token in found if token is not None}
        elif settings.mask_punctuation:
            for symbol in string.punctuation:
                ids = tokenizer.encode(symbol, add_special_tokens=False).ids
                if ids:
                    skiplist.add(ids[0])
        return cls(
            cls_id=token_id("[CLS]"),
            sep_id=token_id("[SEP]"),
            mask_id=token_id("[MASK]"),
            query_marker_id=token_id(settings.query_token),
            doc_marker_id=token_id(settings.doc_token),
            skiplist=frozenset(skiplist),
        )


class ColBERTPrompts:
    """Turns tokenized texts into ColBERT queries or documents (what colbert-ai's
    ``QueryTokenizer`` / ``DocTokenizer`` produce)."""

    def __init__(self, settings: ColBERTSettings, tokens: ColBERTTokens) -> None:
        self.settings = settings
        self.tokens = tokens

    def max_length(self, role: TextRole) -> int:
        """Tokens of a formatted text, the marker included."""
        return self.settings.query_maxlen if role == "query" else self.settings.doc_maxlen

    def format(self, ids: list[int], role: TextRole) -> list[int]:
        """``ids``: ``[CLS] tokens [SEP]`` cut to ``max_length(role) - 1`` -> the marker after
        ``[CLS]``; queries padded with ``[MASK]`` to ``query_maxlen`` (with query expansion)."""
        marker = self.tokens.query_marker_id if role == "query" else self.tokens.doc_marker_id
        formatted = [ids[0], marker, *ids[1:]]
        if role == "query" and self.settings.query_expansion:
            formatted += [self.tokens.mask_id] * (self.settings.query_maxlen - len(formatted))
        return formatted


def colbert_settings(model_config: ModelConfig) -> ColBERTSettings | None:
    """How a ColBERT model encodes queries and documents (colbert-ai's ``artifact.metadata`` or
    a PyLate folder's settings); None for any other model."""
    if model_config.architecture in COLBERT_ARCHITECTURES:
        return ColBERTSettings.from_folder(model_config.path)
    if model_config.architecture in PYLATE_ARCHITECTURES:
        return ColBERTSettings.from_pylate(model_config.path, pylate_dense_dim(model_config))
    return None


def pylate_dense_dim(model_config: ModelConfig) -> int:
    """The output size of a PyLate folder's projection: one Dense without bias or activation
    (so a zeroed skiplist row stays zero); else a ValueError naming what the folder has."""
    st = model_config.st_config
    layers = st.dense_layers if st is not None else ()
    if len(layers) != 1 or layers[0].bias or layers[0].activation is not None:
        found = [(d.path.name, d.bias, d.activation) for d in layers]
        raise ValueError(
            f"{model_config.path}: a PyLate ColBERT folder needs one Dense module without bias "
            f"or activation after its Transformer; found (folder, bias, activation): {found}"
        )
    return layers[0].out_features


def colbert_prompts(model_config: ModelConfig, tokenizer: Tokenizer) -> ColBERTPrompts | None:
    """The query / document formatting of a ColBERT model; None for any other model."""
    settings = colbert_settings(model_config)
    if settings is None:
        return None
    return ColBERTPrompts(settings, ColBERTTokens.of(tokenizer, settings))


class ColBERTMarks:
    """What a ColBERT trunk does around its layers, mixed in before the trunk class (which
    calls ``_mask_fn`` before its layers and ``_output`` after them): the query's [MASK]
    padding hidden from attention unless ``attend_to_mask_tokens``, and documents' skiplist
    rows zeroed (MaxSim leaves them out)."""

    settings: ColBERTSettings
    tokens: ColBERTTokens
    skiplist: torch.Tensor

    @classmethod
    def prompt_format(cls, model_config: ModelConfig, tokenizer: Tokenizer) -> ColBERTPrompts:
        """The query / document formatting of texts (``models/interfaces.py`` ``FormatsPrompts``)."""
        prompts = colbert_prompts(model_config, tokenizer)
        assert prompts is not None, f"{model_config.architecture} is not a ColBERT model"
        return prompts

    def _init_marks(self, model_config: ModelConfig) -> None:
        settings = colbert_settings(model_config)
        assert settings is not None, f"{model_config.architecture} is not a ColBERT model"
        self.settings = settings
        tokenizer = Tokenizer.from_file(str(model_config.path / "tokenizer.json"))
        self.tokens = ColBERTTokens.of(tokenizer, settings)
        # a plain tensor, not a buffer: ``to_empty`` after the meta-device build keeps it
        self.skiplist = torch.tensor(sorted(self.tokens.skiplist), dtype=torch.long, device="cpu")

    def _mask_fn(self, input_ids: torch.Tensor, positions: torch.Tensor) -> EncoderMaskFn | None:
        """The query's [MASK] padding hidden from attention (unless ``attend_to_mask_tokens``)."""
        if self.settings.attend_to_mask_tokens or not self.settings.query_expansion:
            return None
        request, is_query = _marked(input_ids, positions, self.tokens.query_marker_id)
        return _key_mask_fn(is_query & self._after_sep(input_ids, positions, request))

    def _output(
        self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """``x`` [num_tokens, dim] with documents' skiplist rows zeroed."""
        if len(self.skiplist) == 0:
            return x
        _, is_document = _marked(input_ids, positions, self.tokens.doc_marker_id)
        dropped = is_document & torch.isin(input_ids, self.skiplist.to(input_ids.device))
        return x.masked_fill(dropped.unsqueeze(1), 0.0)

    def _after_sep(
        self, input_ids: torch.Tensor, positions: torch.Tensor, request: torch.Tensor
    ) -> torch.Tensor:
        """[num_tokens] bool: a [MASK] after its request's first [SEP] (query augmentation)."""
        is_sep = (input_ids == self.tokens.sep_id).long()
        seps_before = torch.cumsum(is_sep, dim=0) - is_sep  # [SEP]s before each row, stream-wide
        at_start = seps_before[positions == 0]  # ... before each request
        after = (seps_before - at_start[request]) > 0
        return after & (input_ids == self.tokens.mask_id)


class HFColBERT(ColBERTMarks, BertModel):
    """``forward(input_ids, positions, token_type_ids) -> [num_tokens, dim]``: BERT, then
    ``linear``, as colbert-ai encodes (``ColBERTMarks``)."""

    checkpoint_prefixes = ("bert.",)

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self._init_marks(model_config)
        self.linear = TrunkLinear(self.hidden_size, self.settings.dim, bias=False)
        self.hidden_size = self.settings.dim  # what the pooler receives
        self.checkpoint_map = self.checkpoint_map.extended({"linear.weight": Slot("linear.weight")})

    def _output(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Projected to ``dim``; documents' punctuation rows are zeros."""
        return super()._output(self.linear(hidden), input_ids, positions)  # [num_tokens, dim]


def _marked(
    input_ids: torch.Tensor, positions: torch.Tensor, marker_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens] each row's request index in the step, and [num_tokens] bool: its request's
    marker (the token at position 1) is ``marker_id``."""
    request = torch.cumsum(positions == 0, dim=0) - 1
    num_requests = int(request[-1]) + 1
    marker = torch.full((num_requests,), -1, dtype=input_ids.dtype)
    second = positions == 1
    marker[request[second]] = input_ids[second]
    return request, (marker == marker_id)[request]


def _key_mask_fn(hidden_keys: torch.Tensor) -> EncoderMaskFn | None:
    """Attention masks that hide the keys ``hidden_keys`` ([num_tokens] bool) from every query;
    None when no key is hidden."""
    if not bool(hidden_keys.any()):
        return None
    visible = ~hidden_keys

    def mask_fn(rows: slice, num_requests: int, length: int) -> torch.Tensor | None:
        keys = visible[rows]
        if bool(keys.all()):
            return None
        return keys.view(num_requests, 1, 1, length)  # [requests, 1, 1, length] bool

    return mask_fn
