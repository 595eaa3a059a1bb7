"""A GGUF base with a PEFT adapter beside it (issue 31): SmolLM2-135M's Q4_1 file stays
quantized and the adapter's factors stay fp32; greedy tokens equal peft's merged model over
transformers' own (dequantized) load of the same file."""

from __future__ import annotations

from factories.generation import hf_greedy, random_prompts, smollm2_hf, smollm2_path, token_prompts
from factories.lora import write_adapter

from cenote import LLM, LoRARequest, SamplingParams

MAX_NEW = 6


def test_gguf_base_with_an_adapter_equals_peft_merged_model(tmp_path) -> None:
    path = smollm2_path()
    base = smollm2_hf(path)
    targets = ["q_proj", "v_proj", "down_proj"]
    merged = write_adapter(base, tmp_path / "adapter", 7, targets, r=4, lora_alpha=8)
    prompts = random_prompts([6, 11], seed=5)
    expected = hf_greedy(merged, prompts, MAX_NEW)
    assert expected != hf_greedy(base, prompts, MAX_NEW)  # the adapter moves the tokens
    del base, merged
    llm = LLM(str(path), dtype="float32", enable_prefix_caching=False, max_lora_rank=8)
    adapter = LoRARequest("adapter", 1, str(tmp_path / "adapter"))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outputs = llm.generate(token_prompts(prompts), params, lora_request=adapter)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
