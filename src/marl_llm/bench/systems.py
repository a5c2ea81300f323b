"""marl-llm's own systems and the hardware ceiling, plus the registry of every benchmark system.

- `MarlLLM`: the real trainer (`trainer.build` + `trainer.train_step`) composed from conf/ as
  `marl-llm algo=magrpo` (or `algo=single` with one agent) would compose it; `MarlCoLLMCC` /
  `MarlCoLLMDC` the same trainer as `algo=collm_cc` / `algo=collm_dc`.
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
        from marl_llm.training.setup import build, quiet_libraries, seed_everything

        w = workload
        self.cfg = compose(self.overrides(w))
        quiet_libraries()
        seed_everything(w.seed, self.cfg.trainer.deterministic)
        self.run = build(self.cfg, task=self.task)
        self.k = 0

    @classmethod
    def overrides(cls, w: Workload) -> list[str]:
        T = w.new_tokens
        out = [f"algo={cls.algo(w)}", f"task={w.task}", "logger=none",
               f"run_dir={tempfile.mkdtemp(prefix='marl-bench-')}", f"seed={w.seed}", "algo.num_turns=1",
               f"algo.sampling.max_new_tokens={T}",
               f"algo.sampling.min_new_tokens={T}", f"algo.sampling.temperature={w.temperature}",
               f"algo.sampling.top_p={w.top_p}", f"algo.learning_rate={w.learning_rate}",
               f"trainer.prompts_per_step={w.prompts_per_step}", "trainer.max_steps=1000000", *model_overrides(w),
               *cls.algo_overrides(w)]
        if w.lora:
            out += [f"algo.lora.r={w.lora['r']}", f"algo.lora.alpha={w.lora['alpha']}",
                    f"algo.lora.target_modules=[{','.join(w.lora['target_modules'])}]"]
        return out + list(w.extra.get("overrides", []))

    @staticmethod
    def algo(w: Workload) -> str:
        return "single" if w.agents == 1 else "magrpo"

    @staticmethod
    def algo_overrides(w: Workload) -> list[str]:
        return [f"algo.num_generations={w.num_generations}"]

    def step(self) -> StepStats:
        from marl_llm.training.trainer import train_step

        problems = [self.problems[j] for j in self.step_problems(self.k)]
        _, m = train_step(self.run, self.cfg, self.k, problems=problems)
        self.k += 1
        return StepStats(m["step_time"], int(m["num_tokens"]), m["timing/rollout"])


class MarlGRPO(MarlLLM):
    """Single-agent GRPO in marl-llm (`algo=single`): the same trainer with one agent."""

    name = "marl_grpo"


class MarlCoLLMCC(MarlLLM):
    """marl-llm's CoLLM-CC (`algo=collm_cc`): one trajectory per environment, `prompts_per_step`
    environments per step, at comlrl's update granularity (its per-agent buffer holding exactly one
    step's samples: per agent one actor step and one step of its critic, CC's shared critic once per
    agent), so that one step does the work of one comlrl step."""

    name = "marl_collm_cc"

    @classmethod
    def algo(cls, w: Workload) -> str:
        return cls.name.removeprefix("marl_")

    @staticmethod
    def algo_overrides(w: Workload) -> list[str]:
        if w.num_generations != 1:
            raise ValueError(f"CoLLM samples one joint action per environment: set num_generations=1 "
                             f"(got {w.num_generations}) and prompts_per_step for more")
        n = w.joint_actions_per_step
        return [f"algo.rollout_buffer_size={n}", f"algo.train_batch_size={n}"]


class MarlCoLLMDC(MarlCoLLMCC):
    """marl-llm's CoLLM-DC (`algo=collm_dc`): one critic per agent; otherwise as MarlCoLLMCC."""

    name = "marl_collm_dc"


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
        from marl_llm.models.prompting import encode_prompt
        from marl_llm.rollout.decode import left_pad

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
    from marl_llm.bench.peers import ComlrlIAC, ComlrlMAAC, ComlrlMAGRPO, TrlGRPO

    return {c.name: c for c in (MarlLLM, MarlGRPO, MarlCoLLMCC, MarlCoLLMDC, BareGenerate, ComlrlMAGRPO, TrlGRPO,
                                ComlrlMAAC, ComlrlIAC)}
