"""marl-llm's own systems and the hardware ceiling, plus the registry of every benchmark system.

- `MarlLLM`: the real trainer (`trainer.build` + `trainer.train_step`) composed from conf/ as
  `marl-llm algo=magrpo` (or `algo=single` with one agent) would compose it.
- `BareGenerate`: the ceiling. A plain `transformers` model with no adapters: one batched
  `generate` of the same number of sequences and tokens from the same prompts, then one
  forward/backward over them (input gradients only: the least any adapter update must do).
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

from marl_llm.bench.workload import (BenchSystem, StepStats, Workload, compose, load_model, load_tokenizer,
                                     model_overrides)


class MarlLLM(BenchSystem):
    """marl-llm's trainer: one step = `train_step` (rollout, advantages, one update per adapter)."""

    name = "marl_magrpo"

    def __init__(self, workload: Workload):
        super().__init__(workload)
        from marl_llm.trainer import build, quiet_libraries, seed_everything

        w = workload
        self.cfg = compose(self.overrides(w))
        quiet_libraries()
        seed_everything(w.seed)
        self.run = build(self.cfg, task=self.task)
        self.k = 0

    @staticmethod
    def overrides(w: Workload) -> list[str]:
        T = w.new_tokens
        out = [f"algo={'single' if w.agents == 1 else 'magrpo'}", f"task={w.task}", "logger=none",
               f"run_dir={tempfile.mkdtemp(prefix='marl-bench-')}", f"seed={w.seed}", "algo.num_turns=1",
               f"algo.num_generations={w.num_generations}", f"algo.sampling.max_new_tokens={T}",
               f"algo.sampling.min_new_tokens={T}", f"algo.sampling.temperature={w.temperature}",
               f"algo.sampling.top_p={w.top_p}", f"algo.learning_rate={w.learning_rate}",
               "trainer.prompts_per_step=1", "trainer.max_steps=1000000", *model_overrides(w)]
        if w.lora:
            out += [f"algo.lora.r={w.lora['r']}", f"algo.lora.alpha={w.lora['alpha']}",
                    f"algo.lora.target_modules=[{','.join(w.lora['target_modules'])}]"]
        return out + list(w.extra.get("overrides", []))

    def step(self) -> StepStats:
        from marl_llm.trainer import train_step

        problem = self.problems[self.k % len(self.problems)]
        _, m = train_step(self.run, self.cfg, self.k, problems=[problem])
        self.k += 1
        return StepStats(m["step_time"], int(m["num_tokens"]), m["timing/rollout"])


class MarlGRPO(MarlLLM):
    """Single-agent GRPO in marl-llm (`algo=single`): the same trainer with one agent."""

    name = "marl_grpo"


class BareGenerate(BenchSystem):
    """The ceiling on this hardware for one step's work: `generate` on the bare base model
    (no adapters) for the step's sequences, then one forward/backward over the results."""

    name = "bare_generate"

    def __init__(self, workload: Workload):
        super().__init__(workload)
        self.tok = load_tokenizer(workload)
        self.model = load_model(workload).eval()
        self.model.requires_grad_(False)
        self.k = 0

    def step(self) -> StepStats:
        from marl_llm.prompting import encode_prompt
        from marl_llm.rollout import left_pad

        w, tok = self.workload, self.tok
        messages = self.task.initial_prompts(self.problems[self.k % len(self.problems)])
        self.k += 1
        prompts = [encode_prompt(tok, m) for m in messages for _ in range(w.num_generations)]
        ids, att, _ = left_pad(prompts, tok.pad_token_id)
        t0 = time.perf_counter()
        with torch.inference_mode():
            seqs = self.model.generate(
                input_ids=ids, attention_mask=att, max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens,
                do_sample=True, temperature=w.temperature, top_p=w.top_p, top_k=0, pad_token_id=tok.pad_token_id)
        t_gen = time.perf_counter()
        full_att = torch.cat([att, torch.ones((len(prompts), seqs.shape[1] - ids.shape[1]), dtype=att.dtype)], dim=1)
        self._forward_backward(seqs.clone(), full_att)
        t_end = time.perf_counter()
        return StepStats(t_end - t0, len(prompts) * (seqs.shape[1] - ids.shape[1]), t_gen - t0)

    def _forward_backward(self, seqs: torch.Tensor, att: torch.Tensor) -> Any:
        embeds = self.model.get_input_embeddings()(seqs).detach().requires_grad_(True)
        pos = (att.cumsum(dim=1) - 1).clamp(min=0)
        T = self.workload.new_tokens
        logits = self.model(inputs_embeds=embeds, attention_mask=att, position_ids=pos, logits_to_keep=T + 1).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, seqs[:, -T:].unsqueeze(2))
        logp.mean().backward()
        return embeds.grad


def registry() -> dict[str, type[BenchSystem]]:
    """Every system by name; the peers' classes import their packages only when built."""
    from marl_llm.bench.peers import ComlrlMAGRPO, TrlGRPO

    return {c.name: c for c in (MarlLLM, MarlGRPO, BareGenerate, ComlrlMAGRPO, TrlGRPO)}
