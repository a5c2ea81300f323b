"""Policy-gradient losses for one agent's batch of completions (verl style registries).

Shapes: B sequences (an agent's samples), T token positions (padded), ``mask`` [B, T] is 1 on
the completion tokens the loss may touch (0 on prompt and padding: those contribute nothing to the
value or the gradient, even when their log-probs are NaN/inf).

Per-token surrogates (``POLICY_LOSSES``, extend with ``@register_loss(name)``):

    reinforce  -A * r,  r = exp(logp - old_logp.detach()). On-policy (old_logp = logp.detach(),
               the default when old_logp is None) r has value 1 and gradient grad(logp), so the
               gradient is exactly the REINFORCE term -A * grad(logp) (the paper's loss); the
               *value* is -A per token, not -A * logp. Off-policy it is the unclipped
               importance-weighted gradient -A * r * grad(logp).
    ppo_clip   -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) (PPO / GRPO clipped surrogate)

Aggregations (``AGGREGATIONS``), of a per-token loss l[b, t]:

    seq_sum             (1/B) * sum_b sum_t mask * l   (MAGRPO paper: summed token log-probs, no
                        length normalization; with B = G it is -sum_g A_g log pi(a_g) / G)
    token_mean          sum_{b,t} mask * l / sum mask   (DAPO / TRL "dapo" style)
    seq_mean_token_mean (1/B) * sum_b (sum_t mask * l / sum_t mask)   (original GRPO)

KL to the reference policy: k3 estimator per token, k3 = exp(d) - d - 1 with d = ref - logp
(>= 0, = 0 iff logp == ref). ``policy_loss`` adds kl_coef * aggregate(k3) when ref_logp is given
and kl_coef > 0; ``k3_kl`` gives the per-sequence sum for reward shaping R' = R - beta * KL.

Sampler/trainer mismatch (truncated importance sampling, TIS: Yao et al., "Your efficient RL
framework secretly brings you off-policy RL training", 2025; verl's token-level "truncate" rollout
IS). A separate sampler (vLLM: its own kernels, dtype and batching) draws tokens from pi_rollout,
which is close to but not the trainer's pi_old. Given the sampler's token log-probs, every
per-token surrogate (REINFORCE or PPO-clip) is multiplied by the detached weight

    w = min(exp(old_logp - rollout_logp), C)       C = rollout_is_cap (algo.rollout_is_cap)

with old_logp the trainer's log-prob before the update (logp.detach() on-policy). w = 1 where the
two agree, so an exact sampler changes nothing; the cap bounds the variance. The KL term is not
weighted (as in verl).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from marl_llm.registry import AGGREGATIONS, POLICY_LOSSES, Surrogate, register_aggregation, register_loss

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "Surrogate",
    "aggregate",
    "k3_kl",
    "k3_per_token",
    "policy_loss",
    "register_aggregation",
    "register_loss",
    "rollout_is_weights",
]


# fn(logp [B,T], old_logp [B,T] (detached), advantages [B], clip_eps_low, clip_eps_high) -> Surrogate
LossFn = Callable[[Tensor, Tensor, Tensor, "float | None", "float | None"], Surrogate]

# POLICY_LOSSES, AGGREGATIONS, Surrogate (what a loss returns) and their decorators register_loss and
# register_aggregation: marl_llm.registry (the built-ins are declared in algos/schemas.py, which
# config checks read without importing this module; a plugin imports them from there, no torch).


@register_loss("reinforce")
def reinforce_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float | None, eps_high: float | None
) -> Surrogate:
    """-A * exp(logp - old_logp): gradient -A * grad(logp) on-policy. Clip arguments ignored."""
    ratio = torch.exp(logp - old_logp.detach())
    no = torch.zeros_like(ratio, dtype=torch.bool)
    return Surrogate(-advantages[:, None] * ratio, ratio, no, no)


@register_loss("ppo_clip")
def ppo_clip_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float | None, eps_high: float | None
) -> Surrogate:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A): zero gradient where the clip is active."""
    if eps_low is None or eps_high is None:
        raise ValueError("ppo_clip needs clip_eps")
    ratio = torch.exp(logp - old_logp.detach())
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    clipped_low = (ratio < 1.0 - eps_low) & (adv < 0)
    clipped_high = (ratio > 1.0 + eps_high) & (adv > 0)
    return Surrogate(loss, ratio, clipped_low, clipped_high)


# --------------------------------------------------------------------------------------------
# Aggregations: per-token [B, T] + bool mask [B, T] -> scalar.
# --------------------------------------------------------------------------------------------

AggFn = Callable[[Tensor, Tensor], Tensor]


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    # where, not multiply: 0 * NaN would leak NaN from padding into the value and the gradient.
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


@register_aggregation("seq_sum")
def seq_sum(x: Tensor, mask: Tensor) -> Tensor:
    """(1/B) sum_b sum_t mask * x."""
    return _masked(x, mask).sum() / x.shape[0]


@register_aggregation("token_mean")
def token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum mask * x / sum mask (0 when the mask is empty)."""
    return _masked(x, mask).sum() / mask.sum().clamp_min(1)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(1/B) sum_b (sum_t mask * x / sum_t mask); an empty row contributes 0."""
    per_seq = _masked(x, mask).sum(-1) / mask.sum(-1).clamp_min(1)
    return per_seq.mean()


def aggregate(x: Tensor, mask: Tensor, aggregation: str = "seq_sum") -> Tensor:
    """Aggregate a per-token tensor x [B, T] over the completion tokens (mask [B, T])."""
    try:
        fn = AGGREGATIONS[aggregation]
    except KeyError:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {sorted(AGGREGATIONS)}") from None
    return fn(x, mask.bool())


# --------------------------------------------------------------------------------------------
# KL to the reference policy.
# --------------------------------------------------------------------------------------------


def k3_per_token(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1, d = ref_logp - logp, per token [B, T]; exactly 0 where mask == 0.

    No detaching: gradients flow into whichever input requires them.
    """
    mask = mask.bool()
    d = _masked(ref_logp - logp, mask)  # masked -> d = 0 -> k3 = 0, NaN-safe
    return torch.exp(d) - d - 1.0


def k3_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence k3 KL estimate: sum_t mask * k3, Tensor[B] (>= 0).

    For reward shaping R' = R - beta * KL call it under torch.no_grad() (or detach the result).
    """
    return k3_per_token(logp, ref_logp, mask).sum(-1)


# --------------------------------------------------------------------------------------------
# The loss.
# --------------------------------------------------------------------------------------------


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    aggregation: str = "seq_sum",
    clip_eps: float | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    *,
    clip_eps_high: float | None = None,
    loss_type: str | None = None,
    rollout_logp: Tensor | None = None,
    rollout_is_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Policy-gradient loss of one agent's batch.

    logp:       Tensor[B, T] log pi(token) under the current policy (requires grad).
    old_logp:   Tensor[B, T] under the sampling policy (detached here); None -> logp.detach()
                (on-policy: ratio value 1, gradient of the REINFORCE term).
    advantages: Tensor[B], one per sequence (detached here).
    mask:       Tensor[B, T] (bool or 0/1), 1 on completion tokens.
    aggregation: a key of AGGREGATIONS ("seq_sum" | "token_mean" | "seq_mean_token_mean").
    clip_eps:   None -> loss_type "reinforce"; a float -> "ppo_clip" with [1 - clip_eps,
                1 + clip_eps_high] (clip_eps_high defaults to clip_eps).
    ref_logp:   Tensor[B, T] under the reference policy, or None. With kl_coef > 0 the loss
                gets + kl_coef * aggregate(k3) (same aggregation as the policy term).
    loss_type:  override the surrogate (a key of POLICY_LOSSES).
    rollout_logp: Tensor[B, T] log-probs of the tokens under the sampler that drew them (detached
                here; NaN: unknown, weight 1), or None (the trainer sampled: no correction).
    rollout_is_cap: C of the truncated importance weight min(exp(old_logp - rollout_logp), C)
                applied to every token's surrogate; None: no weighting (the stats are still
                reported, to watch the mismatch).

    Returns (loss: scalar Tensor, stats: dict[str, float]) with stats
      loss, pg_loss, ratio_mean (over completion tokens),
      clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (fractions of completion
        tokens clipped below / above / either; 0 without clipping),
      kl (mean over sequences of the per-sequence k3 sum; only when ref_logp is given),
      kl_loss (kl_coef * aggregated k3; only when it is added),
      with rollout_logp: rollout_is/mean (mean weight w over completion tokens; 1 without a cap),
        rollout_is/clip_ratio (fraction of tokens whose ratio exceeds the cap),
        rollout_is/logp_diff_mean and rollout_is/logp_abs_diff_mean (old_logp - rollout_logp).
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got {tuple(logp.shape)}")
    for name, x in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(x.shape)} != logp shape {tuple(logp.shape)}")
    if advantages.shape != (logp.shape[0],):
        raise ValueError(f"advantages must be [B]={logp.shape[0]}, got {tuple(advantages.shape)}")
    if logp.shape[0] == 0:
        raise ValueError("empty batch")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {sorted(AGGREGATIONS)}")
    if loss_type is None:
        loss_type = "reinforce" if clip_eps is None else "ppo_clip"
    if loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {loss_type!r}; known: {sorted(POLICY_LOSSES)}")
    if (clip_eps is not None and clip_eps < 0) or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError("clip_eps must be >= 0")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    mask = mask.bool()
    if old_logp is None:
        old_logp = logp.detach()
    # Sanitize masked positions first (where's backward sends exactly 0 there, no NaN from exp).
    logp_m = _masked(logp, mask)
    old_m = _masked(old_logp.detach().to(logp.dtype), mask)
    adv = advantages.detach().to(logp.dtype)

    if rollout_is_cap is not None and rollout_is_cap <= 0:
        raise ValueError("rollout_is_cap must be > 0")
    sur = POLICY_LOSSES[loss_type](logp_m, old_m, adv, clip_eps, eps_high)
    per_token = sur.loss
    is_stats: dict[str, float] = {}
    if rollout_logp is not None:
        if rollout_logp.shape != logp.shape:
            raise ValueError(f"rollout_logp shape {tuple(rollout_logp.shape)} != logp shape {tuple(logp.shape)}")
        weight, is_stats = rollout_is_weights(old_m, rollout_logp, mask, rollout_is_cap)
        if rollout_is_cap is not None:
            per_token = per_token * weight
    pg_loss = AGGREGATIONS[aggregation](per_token, mask)
    loss = pg_loss

    n_tok = mask.sum().clamp_min(1)

    def frac(x: Tensor) -> float:
        return float(_masked(x.detach().to(torch.float64), mask).sum() / n_tok)

    stats: dict[str, float] = {
        "pg_loss": float(pg_loss.detach()),
        "ratio_mean": frac(sur.ratio),
        "clip_ratio/low_mean": frac(sur.clipped_low),
        "clip_ratio/high_mean": frac(sur.clipped_high),
        "clip_ratio/region_mean": frac(sur.clipped_low | sur.clipped_high),
    }
    if ref_logp is not None:
        k3 = k3_per_token(logp_m, _masked(ref_logp.detach().to(logp.dtype), mask), mask)
        stats["kl"] = float(k3.detach().sum(-1).mean())
        if kl_coef > 0:
            kl_loss = kl_coef * AGGREGATIONS[aggregation](k3, mask)
            loss = loss + kl_loss
            stats["kl_loss"] = float(kl_loss.detach())
    stats.update(is_stats)
    stats["loss"] = float(loss.detach())
    return loss, stats


def rollout_is_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                       cap: float | None) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights of the sampler/trainer mismatch and their stats.

    old_logp, rollout_logp: Tensor[B, T] (the trainer's before the update, the sampler's);
    mask: Tensor[B, T] bool. Returns (w [B, T] detached, in old_logp's dtype: min(exp(old -
    rollout), cap), exactly 1 on masked or NaN (unreported) positions and everywhere when cap is
    None; stats as in `policy_loss`).
    """
    old = old_logp.detach()
    rollout = rollout_logp.detach().to(old.dtype)
    known = mask & ~torch.isnan(rollout)
    diff = torch.where(known, old - rollout, torch.zeros((), dtype=old.dtype, device=old.device))
    if cap is None:
        weight = torch.ones_like(diff)
    else:
        # Clamp in log space: exp of a large difference would overflow before the min.
        weight = torch.exp(diff.clamp(max=math.log(cap)))
    n_tok = mask.sum().clamp_min(1)

    def mean(x: Tensor) -> float:
        return float(_masked(x.to(torch.float64), mask).sum() / n_tok)

    stats = {
        "rollout_is/mean": mean(weight),
        "rollout_is/clip_ratio": 0.0 if cap is None else mean((diff > math.log(cap)).to(torch.float64)),
        "rollout_is/logp_diff_mean": mean(diff),
        "rollout_is/logp_abs_diff_mean": mean(diff.abs()),
    }
    return weight, stats
