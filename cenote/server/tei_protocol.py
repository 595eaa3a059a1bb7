"""Request and response bodies of text-embeddings-inference's routes (TEI's field names and
shapes), and how their inputs become cenote's prompts. Bodies are read as strictly as every
other route's (unknown fields and wrong JSON types refused)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, RootModel

from cenote.errors import InvalidInputError
from cenote.inputs import PairPrompt, PromptType, TokensPrompt
from cenote.server.errors import EmptyBatch, WrongModelType
from cenote.server.protocol import PositiveCount, TokenIds, _Body

if TYPE_CHECKING:
    from cenote.server.state import ServerState

TruncationDirection = Literal["right", "left", "Right", "Left"]
TEIInput = str | TokenIds | list[str | TokenIds]  # a text, token ids, or a batch of them
PredictInput = str | list[str] | list[list[str]]  # a text, a pair, or a batch of texts and pairs


class _TEIBody(_Body):
    truncate: bool | None = None  # cut inputs to the model's limit; None: the server's default
    truncation_direction: TruncationDirection = "right"  # which end truncation cuts

    @property
    def truncation_side(self) -> Literal["left", "right"]:
        return "left" if self.truncation_direction.lower() == "left" else "right"

    @property
    def truncate_prompt_tokens(self) -> int | None:
        return -1 if self.truncate else None


class TEIEmbedRequest(_TEIBody):
    """POST /embed (and POST / on an embedding model)."""

    inputs: TEIInput
    normalize: bool = True  # L2 normalization (TEI's default: on)
    prompt_name: str | None = None  # one of the model's sentence-transformers prompts
    dimensions: PositiveCount | None = None  # matryoshka truncation


class TEIEmbedAllRequest(_TEIBody):
    """POST /embed_all: every token's embedding."""

    inputs: TEIInput
    prompt_name: str | None = None


class TEIPredictRequest(_TEIBody):
    """POST /predict: class scores of a text, a pair, or a batch of texts and pairs."""

    inputs: PredictInput
    raw_scores: bool = False  # the logits, without the model's activation


class TEIRerankRequest(_TEIBody):
    """POST /rerank with TEI's fields (``texts``, not Jina's ``documents``)."""

    query: str
    texts: list[str]
    raw_scores: bool = False  # the logit, without the model's activation
    return_text: bool = False  # each rank carries its text


class TEISimilarityInput(_Body):
    source_sentence: str  # compared with each of ``sentences``
    sentences: list[str]


class TEISimilarityParameters(_TEIBody):
    prompt_name: str | None = None


class TEISimilarityRequest(_Body):
    """POST /similarity: cosine similarity of a sentence with each of others."""

    inputs: TEISimilarityInput
    parameters: TEISimilarityParameters | None = None


class TEITokenizeRequest(_Body):
    """POST /tokenize with TEI's fields (``inputs``, not vLLM's ``prompt``)."""

    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None  # the model's prompt in front of each text, tokenized too


class TEIDecodeRequest(_Body):
    """POST /decode: token ids back to text."""

    ids: TokenIds | list[TokenIds]
    skip_special_tokens: bool = True


# ---- responses ---------------------------------------------------------------------------------


class TEIEmbedResponse(RootModel[list[list[float]]]):
    """One embedding per input."""


class TEIEmbedAllResponse(RootModel[list[list[list[float]]]]):
    """Per input, one embedding per token (special tokens included)."""


class TEISparseValue(BaseModel):
    index: int  # token id
    value: float  # its weight


class TEIEmbedSparseResponse(RootModel[list[list[TEISparseValue]]]):
    """Per input, its active vocabulary entries in token-id order."""


class TEIPrediction(BaseModel):
    score: float
    label: str


class TEIPredictResponse(RootModel[list[TEIPrediction] | list[list[TEIPrediction]]]):
    """Every label's score, best first; a batch answers one such list per input."""


class TEIRank(BaseModel):
    index: int  # the text's position in ``texts``
    score: float
    text: str | None = None  # with return_text


class TEIRerankResponse(RootModel[list[TEIRank]]):
    """Every text, best first."""


class TEISimilarityResponse(RootModel[list[float]]):
    """Cosine similarity of the source sentence with each sentence, in order."""


class TEIToken(BaseModel):
    id: int
    text: str  # the token's span of the text (special tokens: the token itself)
    special: bool
    start: int | None  # UTF-8 byte offsets of the span; None for special tokens
    stop: int | None


class TEITokenizeResponse(RootModel[list[list[TEIToken]]]):
    """The tokens of each input."""


class TEIDecodeResponse(RootModel[list[str]]):
    """The text of each id list."""


class TEIEmbeddingModel(BaseModel):
    pooling: str  # cls, mean, last, splade, ...


class TEIClassifierModel(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class TEIModelType(BaseModel):
    """One of the three keys, as TEI names the model's kind."""

    embedding: TEIEmbeddingModel | None = None
    classifier: TEIClassifierModel | None = None
    reranker: TEIClassifierModel | None = None  # a classifier with one label


class TEIInfo(BaseModel):
    """GET /info: the served model and this server's limits."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    served_model_name: str
    model_type: TEIModelType | None  # None: a generation model (no TEI kind)
    max_concurrent_requests: int  # requests in flight before 429
    max_input_length: int  # tokens of one input
    max_batch_tokens: int  # tokens of one engine step
    max_batch_requests: int | None  # requests of one engine step
    max_client_batch_size: int  # inputs of one request
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None
    docker_label: str | None


# ---- TEI inputs as cenote's prompts ------------------------------------------------------------


def require_task(state: ServerState, task: str, route: str, kind: str) -> None:
    """424 (TEI's answer to a route the model cannot serve) unless the model serves ``task``."""
    if task not in state.supported_tasks:
        raise WrongModelType(
            f"{route} needs {kind}; {state.model_name} serves "
            f"{', '.join(state.supported_tasks) or 'no pooling task'}"
        )


def embed_prompts(inputs: TEIInput) -> list[PromptType]:
    """``inputs`` (one text, one id list, or a batch mixing them) as prompts, at least one."""
    if isinstance(inputs, str) or (inputs and all(isinstance(t, int) for t in inputs)):
        items: list[str | list[int]] = [inputs]  # type: ignore[list-item]
    else:
        items = list(inputs)  # type: ignore[arg-type]
    if not items:
        raise EmptyBatch("`inputs` cannot be empty: send at least one text or token-id list")
    prompts: list[PromptType] = []
    for i, item in enumerate(items):
        if not item:
            kind = "string" if isinstance(item, str) else "token-id list"
            raise InvalidInputError(f"inputs[{i}] is an empty {kind}", param="inputs")
        prompts.append(item if isinstance(item, str) else TokensPrompt(prompt_token_ids=item))
    return prompts


def predict_prompts(inputs: PredictInput) -> tuple[list[PromptType], bool]:
    """``inputs`` as prompts (pairs as cross-encoder pairs), and whether they were a batch: a
    string, ``[text]`` or ``[text, text_pair]`` is one input; a list of such lists a batch."""
    if isinstance(inputs, str):
        return [inputs], False
    if not inputs:
        raise EmptyBatch("`inputs` cannot be empty: send a text, a pair or a batch of them")
    if all(isinstance(item, str) for item in inputs):
        return [_sequence(inputs, "inputs")], False  # type: ignore[arg-type]
    return [_sequence(item, f"inputs[{i}]") for i, item in enumerate(inputs)], True  # type: ignore[arg-type]


def _sequence(texts: list[str], name: str) -> PromptType:
    if len(texts) not in (1, 2):
        raise InvalidInputError(
            f"{name} has {len(texts)} texts: a single text or a pair of 2 texts is expected",
            param="inputs",
        )
    for j, text in enumerate(texts):
        if not text:
            raise InvalidInputError(f"{name}[{j}] is an empty string", param="inputs")
    if len(texts) == 1:
        return texts[0]
    return PairPrompt(text=texts[0], text_pair=texts[1])
