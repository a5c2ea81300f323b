"""One policy's update from scored samples, shared by the algorithms (MAGRPO, AT-GRPO, ...).

    stats = policy_update(policies, agent, key, completions, advantages, settings, micro_batch_size)

`completions[j]` (prompt ids + completion ids) has advantage `advantages[j]`: Tensor[n]. The
samples are cut into mini-batches (one optimizer step each; `mini_batch_size=None`: all samples
in one step) for `epochs` passes; each mini-batch is cut into micro-batches of at most
`micro_batch_size` completions sharing one prompt (its KV cache is reused) whose gradients
accumulate. Several optimizer steps over the same samples make them off-policy, so then the
sampling-time log-probs are computed first and the PPO ratio is clipped (`clip_eps`).

Completions that carry the sampler's own log-probs (`Completion.rollout_logprobs`: vLLM) get
every token's loss weighted by the truncated importance ratio min(exp(old - rollout), C) of the
trainer's pre-update log-prob to the sampler's (`rollout_is_cap` = C; losses.py), whatever the
loss: the default MAGRPO loss has no ratio of its own to absorb the mismatch.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from marl_llm.algos.losses import policy_loss
from marl_llm.distributed import fsdp, placement
from marl_llm.distributed.data_parallel import all_sum, world
from marl_llm.models.policies import AgentPolicies
from marl_llm.rollout.base import Completion
from marl_llm.rollout.decode import completion_logprobs


@dataclass
class UpdateSettings:
    epochs: int = 1
    mini_batch_size: int | None = None
    clip_eps: float | None = None
    aggregation: str = "seq_sum"
    # Null: no clipping (the gradient norm is still measured and logged).
    max_grad_norm: float | None = 1.0
    # KL to the reference policy (`AgentPolicies.reference`: adapters disabled, or the frozen
    # base copy with algo.lora=null) added to the loss; 0: off.
    kl_coef: float = 0.0
    seed: int = 0
    # C of the truncated importance weight min(exp(logp_old - logp_rollout), C) that corrects the
    # sampler/trainer mismatch when completions carry rollout log-probs (vLLM); None: no weighting.
    rollout_is_cap: float | None = 2.0
    # The per-token surrogate (algos/losses.py POLICY_LOSSES); None: reinforce, or ppo_clip with clip_eps.
    loss_type: str | None = None

    @classmethod
    def from_config(cls, a: Any, **overrides: Any) -> "UpdateSettings":
        """The settings an algorithm config `a` (algo.*) gives: its PPO keys, aggregation, gradient
        clipping, rollout IS cap and loss; `overrides` for what the algorithm sets itself."""
        return cls(**{"epochs": a.ppo_epochs, "clip_eps": a.clip_eps, "aggregation": a.loss_aggregation,
                      "max_grad_norm": a.max_grad_norm, "rollout_is_cap": a.rollout_is_cap,
                      "loss_type": a.get("loss_type"), **overrides})


def lr_schedulers(optimizers: list[torch.optim.Optimizer], algo_cfg, max_steps: int,
                  start_step: int = 0) -> list[torch.optim.lr_scheduler.LRScheduler]:
    """algo.lr_scheduler over the run's trainer steps, one scheduler per policy optimizer, each
    stepped once per trainer step whatever its number of optimizer steps (as verl steps its
    scheduler once per training step). constant: none. cosine: verl's (the AT-GRPO reference's)
    factor of the base lr at scheduler step s, with W warm-up steps and m = min_lr_ratio:

        s < W:  m + (1 - m) * s / W                  (warm-up from m, not from 0 as transformers')
        else:   m + (1 - m) * 0.5 * (1 + cos(pi * p)),  p = (s - W) / max(1, max_steps - W)

    A resumed run fast-forwards to its step (the optimizers' restored `initial_lr` is the base rate)."""
    if algo_cfg.get("lr_scheduler", "constant") == "constant":
        return []
    warmup, floor, total = algo_cfg.warmup_steps, algo_cfg.min_lr_ratio, max(max_steps, 1)

    def factor(s: int) -> float:
        if s < warmup:
            return floor + (1 - floor) * s / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    out = []
    for opt in optimizers:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        with warnings.catch_warnings():  # fast-forwarding steps the schedule without the optimizer
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(start_step):
                sched.step()
        out.append(sched)
    return out


def micro_batches(completions: list[Completion], size: int, subset: list[int] | None = None) -> list[list[int]]:
    """Indices (of `subset`, default all) grouped by identical prompt (siblings of one node), each
    group cut into chunks of at most `size`: a chunk's shared prompt is encoded once. Samples whose
    prompt no other sample shares (one trajectory per environment: the actor-critic methods) are
    packed together instead, by length, so they do not run one forward pass each."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for j in (range(len(completions)) if subset is None else subset):
        groups.setdefault(tuple(completions[j].prompt_ids.tolist()), []).append(j)
    chunks = [idx[s:s + size] for idx in groups.values() if len(idx) > 1 for s in range(0, len(idx), size)]
    singles = sorted((idx[0] for idx in groups.values() if len(idx) == 1),
                     key=lambda j: len(completions[j].prompt_ids) + len(completions[j].scored_ids))
    return chunks + [singles[s:s + size] for s in range(0, len(singles), size)]


def rollout_logprobs(comps: list[Completion], like: torch.Tensor) -> torch.Tensor | None:
    """The micro-batch's sampler log-probs padded like the trainer's `like` [B, C] (NaN where a
    completion has none: weight 1), or None when no completion carries any (HFRollout)."""
    if all(c.rollout_logprobs is None for c in comps):
        return None
    out = torch.full(like.shape, float("nan"), dtype=torch.float32)
    for row, c in enumerate(comps):
        if c.rollout_logprobs is not None:
            out[row, :len(c.rollout_logprobs)] = c.rollout_logprobs[:like.shape[1]]
    return out.to(like.device)


def policy_update(policies: AgentPolicies, agent: int, key: tuple[int, str], comps: list[Completion],
                  advs: torch.Tensor, s: UpdateSettings, micro_batch_size: int) -> dict[str, float]:
    """Update adapter `key` (acting as agent `agent`) on the samples; returns TRL-named stats.
    With trainer.work_split=joint_actions every rank holds every sample, and trains on its share
    of each mini-batch (distributed/placement.py); a rank that does not hold the policy
    (placement=groups) returns no stats."""
    where = placement.current()
    if not where.holds(key):
        return {}
    opt = policies.optimizers[key]
    params = [p for group in opt.param_groups for p in group["params"]]
    pad = policies.tokenizers[key[0]].pad_token_id
    n = len(comps)
    order = list(range(n))
    if s.mini_batch_size is not None and s.mini_batch_size < n:
        gen = torch.Generator().manual_seed(s.seed)
        order = torch.randperm(n, generator=gen).tolist()
    if where.by_actions:
        # Every rank holds every sample: one process's mini-batches, each split over the ranks
        # that train the policy (their gradients' weighted mean is the whole mini-batch's).
        size = n if s.mini_batch_size is None else min(s.mini_batch_size, n)
        mini_batches = [where.share(sorted(order[i:i + size]), key) for i in range(0, n, size)]
        mine = sorted(j for batch in mini_batches for j in batch)
        comps, advs = [comps[j] for j in mine], advs[mine]  # this rank's samples (the stats are of them)
        index = {j: row for row, j in enumerate(mine)}
        mini_batches = [[index[j] for j in batch] for batch in mini_batches]
        n = len(comps)
    elif world().size > 1:
        # Data-parallel ranks hold different sample counts but must step together: the number
        # of mini-batches follows the global count, each rank splitting its share as evenly.
        n_global = int(all_sum(n))
        steps = 1 if s.mini_batch_size is None else max(1, -(-n_global // s.mini_batch_size))
        mini_batches = [sorted(order[j * n // steps:(j + 1) * n // steps]) for j in range(steps)]
    else:
        size = n if s.mini_batch_size is None else min(s.mini_batch_size, n)
        mini_batches = [sorted(order[i:i + size]) for i in range(0, n, size)]
    steps_per_epoch = len(mini_batches)
    # Several optimizer steps over the same samples: the ratio to the sampling-time policy matters.
    off_policy = s.epochs > 1 or steps_per_epoch > 1
    if off_policy and s.clip_eps is None:
        raise ValueError("several optimizer steps per batch need PPO ratio clipping: set clip_eps")
    total_tokens = sum(len(c.completion_ids) for c in comps)
    scored_tokens = sum(len(c.scored_ids) for c in comps)  # the loss's tokens (algo.loss_tokens)
    old: dict[int, torch.Tensor] = {}  # sample -> sampling-time token log-probs, Tensor[len]
    ref_logps: dict[tuple[int, ...], torch.Tensor] = {}
    acc: dict[str, float] = {}
    entropy_sum, grad_norm, n_steps = 0.0, 0.0, 0
    with policies.acting(agent) as model:
        device = next(model.parameters()).device

        def logps(idx: list[int], with_entropy: bool = False):
            return completion_logprobs(model, [comps[j].prompt_ids for j in idx],
                                       [comps[j].scored_ids for j in idx], pad, with_entropy=with_entropy)

        def keep_old(idx: list[int], logp: torch.Tensor) -> None:
            for row, j in enumerate(idx):
                old[j] = logp[row, :len(comps[j].scored_ids)].detach()

        # Passes without gradients first, each kind as one phase (FSDP: fsdp.passes).
        if off_policy and steps_per_epoch > 1:  # later mini-batches run after earlier steps
            chunks = micro_batches(comps, micro_batch_size)
            with torch.no_grad(), fsdp.passes(model, len(chunks), grad=False):
                for idx in chunks:
                    keep_old(idx, logps(idx)[0])
        if s.kl_coef > 0:  # the frozen reference's log-probs of every micro-batch, once
            chunks = [idx for batch in mini_batches for idx in micro_batches(comps, micro_batch_size, batch)]
            with torch.no_grad(), policies.reference(key[0]) as ref_model, \
                    fsdp.passes(ref_model, len(chunks), grad=False):
                for idx in chunks:
                    ref_logps[tuple(idx)] = completion_logprobs(ref_model, [comps[j].prompt_ids for j in idx],
                                                                [comps[j].scored_ids for j in idx], pad)[0]
        for epoch in range(s.epochs):
            for batch in mini_batches:
                opt.zero_grad(set_to_none=True)
                batch_tokens = sum(len(comps[j].scored_ids) for j in batch)
                # This rank's share of the batch, in the unit its loss is normalized by.
                share = batch_tokens if s.aggregation == "token_mean" else len(batch)
                chunks = micro_batches(comps, micro_batch_size, batch)
                with fsdp.passes(model, len(chunks), grad=True, weight=share) as agreed:
                    scale = agreed.loss_scale(share)  # 1 unless the trained weights are FSDP shards
                    for idx in chunks:
                        ref = ref_logps[tuple(idx)] if s.kl_coef > 0 else None
                        logp, mask, ent = logps(idx, with_entropy=epoch == 0)
                        if epoch == 0:
                            entropy_sum += float((ent * mask).sum())
                            if off_policy and steps_per_epoch == 1:  # epoch 0 is still on-policy
                                keep_old(idx, logp)
                        old_logp = None
                        if off_policy:
                            old_logp = torch.zeros_like(logp)
                            for row, j in enumerate(idx):
                                old_logp[row, :len(old[j])] = old[j]
                        loss, stats = policy_loss(logp, old_logp, advs[idx].to(device), mask, aggregation=s.aggregation,
                                                  clip_eps=s.clip_eps, loss_type=s.loss_type, ref_logp=ref,
                                                  kl_coef=s.kl_coef, rollout_logp=rollout_logprobs([comps[j] for j in idx], logp),
                                                  rollout_is_cap=s.rollout_is_cap)
                        # Weights make the micro-batches sum to the mini-batch's loss.
                        weight = (float(mask.sum()) / max(batch_tokens, 1) if s.aggregation == "token_mean"
                                  else len(idx) / len(batch))
                        (loss * (weight * scale)).backward()
                        if epoch == s.epochs - 1:
                            for k, v in stats.items():
                                acc[k] = acc.get(k, 0.0) + v * weight / steps_per_epoch
                # The rank's loss is normalized by its own batch: sync weights it by that batch's share.
                fsdp.sync_replicated(params, share, agreed)
                grad_norm = fsdp.clip_grad_norm(params, s.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)  # freed now, not at the next step: the next rollout has the memory
                n_steps += 1
    lengths = [len(c.completion_ids) for c in comps] or [0]  # a data-parallel rank may hold none
    terminated = [len(c.completion_ids) for c in comps if not c.truncated] or [0]  # ended by EOS (TRL's)
    out = {k: v for k, v in acc.items() if k in ("loss", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                                 "clip_ratio/region_mean") or k.startswith("rollout_is/")}
    out.update({
        "grad_norm": grad_norm,
        "optimizer_steps": float(n_steps),
        "entropy": entropy_sum / max(scored_tokens, 1),
        "learning_rate": float(opt.param_groups[0]["lr"]),
        "num_tokens": float(total_tokens),  # this step's completion tokens (the logger keeps TRL's running total)
        "prompt_tokens": float(sum(len(c.prompt_ids) for c in comps)),
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/min_length": float(min(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/clipped_ratio": sum(c.truncated for c in comps) / max(len(comps), 1),
        "completions/mean_terminated_length": sum(terminated) / len(terminated),
        "completions/min_terminated_length": float(min(terminated)),
        "completions/max_terminated_length": float(max(terminated)),
        "advantage/mean": float(advs.mean()) if len(advs) else 0.0,
        "advantage/std": float(advs.std()) if len(advs) > 1 else 0.0,
    })
    return out
