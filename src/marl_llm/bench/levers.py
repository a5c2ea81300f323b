"""The rollout levers, one at a time: the same step's generation (marl-llm's MAGRPO requests) by
each variant, alternated round by round in one process, median seconds per variant.

- hf_generate_peft_mixed: `transformers` `generate` on the peft model with peft's mixed-adapter
  batches (`adapter_names=`): marl-llm's rollout before the performance work.
- own_decode_peft_mixed: marl-llm's decode loop (shared prefill per distinct prompt, finished rows
  leave the batch, inference mode), LoRA still through peft's mixed batches.
- own_decode_mixed_lora: + MixedLoRA (stacked adapters, one row mask).
- own_decode_all: + the preallocated KV cache: what marl-llm runs (trainer.decode=dynamic).
- own_decode_static: the fixed-shape loop instead (trainer.decode=static: a StaticCache, no row
  leaves the batch), not compiled: what CUDA graphs / torch.compile would capture.
- bare_generate_no_lora: `generate` on the bare base model (the ceiling; no adapters at all).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from marl_llm.bench.workload import Workload


def measure_levers(workload: Workload, rounds: int) -> dict[str, Any]:
    from marl_llm.bench.systems import MarlLLM
    from marl_llm.models.prompting import encode_prompt
    from marl_llm.rollout.base import GenRequest
    from marl_llm.rollout.decode import cut_at_eos, decode, left_pad
    from marl_llm.rollout.sampling import SamplingParams

    w = workload
    system = MarlLLM(w)
    policies = system.run.policies
    model, tok, eos = policies.models[0], policies.tokenizers[0], policies.eos_ids[0]
    sampling = SamplingParams(temperature=w.temperature, top_p=w.top_p, max_new_tokens=w.new_tokens,
                              min_new_tokens=w.new_tokens)
    messages = system.task.initial_prompts(system.problems[0])
    requests = [GenRequest(i, m, sampling) for i, m in enumerate(messages) for _ in range(w.num_generations)]
    prompts = [encode_prompt(tok, r.message) for r in requests]
    adapters = [policies.agents[r.agent].adapter for r in requests]
    ids, att, _ = left_pad(prompts, tok.pad_token_id)
    gen_kwargs = dict(input_ids=ids, attention_mask=att, max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens,
                      do_sample=True, temperature=w.temperature, top_p=w.top_p, top_k=0, pad_token_id=tok.pad_token_id)

    def hf_mixed() -> None:
        with torch.inference_mode():
            model.generate(**gen_kwargs, adapter_names=adapters)

    def bare() -> None:
        with torch.inference_mode(), model.disable_adapter():
            model.generate(**gen_kwargs)

    def own(**levers: bool):
        def run() -> None:
            with torch.inference_mode():
                out = decode(model, prompts, adapters, [sampling] * len(prompts), eos, tok.pad_token_id, **levers)
            assert all(len(cut_at_eos(o, eos)[0]) == w.new_tokens for o in out)
        return run

    variants = {"hf_generate_peft_mixed": hf_mixed,
                "own_decode_peft_mixed": own(mixed_lora=False, preallocate_cache=False),
                "own_decode_mixed_lora": own(mixed_lora=True, preallocate_cache=False),
                "own_decode_all": own(),
                "own_decode_static": own(static=True),
                "bare_generate_no_lora": bare}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds + 1):  # round 0 warms up
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    tokens = len(prompts) * w.new_tokens
    return {name: {"median_s": statistics.median(ts), "seconds": ts, "tokens_per_s": tokens / statistics.median(ts)}
            for name, ts in times.items()}
