"""The built-in algorithms' config schemas, and where each algorithm, baseline, policy loss,
aggregation and joint mode lives.

Light on purpose (no torch): composing and checking a config (`marl-llm --cfg job`, a bad value)
needs the schemas and the names, not the implementations, whose modules import torch and
transformers. Each built-in is declared here by name and module (marl_llm.registry); its module is
imported when it is first used, and its own `@register_*` decorator fills the entry in (with the
same schema or settings: a mismatch fails when that module is imported). An algorithm's schema
lives here, its code in its module (algos/magrpo.py, ...); a plugin's algorithm may keep both in
one module, as docs/extending.md shows.

A schema's optional `check(cfg)` checks what types cannot; `agents_for(task_agents)` says whom the
algorithm plays with where it changes the task's agents (algo=single).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from marl_llm.config import PolicyConfig, check_choice, check_group, check_policy_updates, check_value
from marl_llm.registry import (AGGREGATIONS, ALGORITHMS, BASELINE_MIN_GROUP_SIZE, BASELINES, GROUP_BASELINES,
                               JOINT_MODES, POLICY_LOSSES, declare_baseline, declare_option)

# algo=single's one agent (algos/baselines.SingleAgentTask).
SINGLE_AGENT = ("single",)
# algo.reward_levels: how a reward with several levels becomes advantages (algos/advantages.py
# implements them: sum, the papers'; normalize_then_sum, GDPO's).
REWARD_LEVELS = ("sum", "normalize_then_sum")
# algo.loss_tokens: the tokens a policy loss scores (algos/loss_tokens.py implements them).
MAGRPO_LOSS_TOKENS = ("completion", "padded_row")
ACTOR_CRITIC_LOSS_TOKENS = ("completion", "before_pad")


# ------------------------------------------------------------------------------------- schemas

@dataclass
class MAGRPOConfig(PolicyConfig):
    name: str = "magrpo"
    # G: completions each agent samples at every node of the rollout tree.
    num_generations: int = 4
    # align: sample g of every agent forms joint action g (G joint actions per node).
    # cross: Cartesian product of the agents' samples (G^N joint actions, single turn only).
    joint_mode: str = "align"
    # mean (MAGRPO) | rloo | max (ReMax) | raw (REINFORCE); see algos/advantages.py.
    baseline: str = "mean"
    # Divide advantages by the group std. With it on, all four baselines coincide.
    normalize_advantages: bool = False
    # sum: the advantage of the reward's total (the paper's). normalize_then_sum: GDPO's, each reward
    # level normalized within its group, summed, the sum normalized over the step (algos/advantages.py).
    reward_levels: str = "sum"
    num_turns: int = 2
    # Return of a node: r + discount * mean(children's returns).
    discount: float = 1.0
    # Early termination threshold on shifted rewards (null: off), applied by `early_termination_rule`:
    # joint_action: a joint action whose reward is >= the threshold is a leaf (marl-llm's);
    # node_mean: a node whose G rewards have a mean > the threshold expands none of them (comlrl's).
    early_termination: Optional[float] = None
    early_termination_rule: str = "joint_action"
    # Update granularity. Null: one optimizer step per trainer step over the whole step's tree.
    # A number: comlrl's per-agent buffer of node samples (a node = the G siblings of one parent),
    # filled in rollout order across trainer steps; when it holds rollout_buffer_size nodes it is
    # drained turn by turn, each turn's nodes shuffled and cut into train_batch_size-node batches,
    # one optimizer step each (null train_batch_size: = rollout_buffer_size).
    rollout_buffer_size: Optional[int] = None
    train_batch_size: Optional[int] = None
    # Gradient-norm clipping (null: none, as in the reference).
    max_grad_norm: Optional[float] = 1.0
    # seq_sum: the paper's sum of token log-probs per completion; token_mean: mean over all tokens.
    loss_aggregation: str = "seq_sum"
    # Tokens the loss scores (algos/loss_tokens.py). completion: each completion through its first
    # EOS; padded_row: comlrl's, the node's generate() row (padding after EOS included) minus its
    # last token.
    loss_tokens: str = "completion"
    # PPO ratio clipping (null: off, the paper's single on-policy step) and inner epochs.
    clip_eps: Optional[float] = None
    ppo_epochs: int = 1
    # KL to the reference policy (the base with adapters disabled), k3 estimator.
    kl_coef: float = 0.0
    # reward: shape the return R' = R - kl_coef * KL (the reference's); loss: add to the loss.
    kl_mode: str = "reward"

    @staticmethod
    def check(cfg: Any) -> None:
        a = cfg.algo
        check_choice(cfg, "algo.joint_mode", JOINT_MODES)
        check_choice(cfg, "algo.baseline", BASELINES)
        check_choice(cfg, "algo.kl_mode", ("reward", "loss"))
        check_choice(cfg, "algo.reward_levels", REWARD_LEVELS)
        check_value(a.reward_levels == "sum" or a.kl_coef == 0 or a.kl_mode == "loss", "algo.reward_levels",
                    "normalize_then_sum normalizes the task's reward levels, and a KL that shapes the reward is none "
                    "of them: set algo.kl_mode=loss (or algo.reward_levels=sum)")
        check_choice(cfg, "algo.loss_tokens", MAGRPO_LOSS_TOKENS)
        check_value(a.num_generations >= 1, "algo.num_generations", "must be >= 1")
        need = max(BASELINE_MIN_GROUP_SIZE[a.baseline], 2 if a.baseline in GROUP_BASELINES else 1)
        check_value(a.num_generations >= need, "algo.num_generations",
                    f"G={a.num_generations} < {need} leaves no group for baseline={a.baseline!r}: use G >= {need}"
                    + (" or algo.baseline=raw" if "raw" in BASELINES else ""))
        check_policy_updates(a)
        check_group(cfg, "algo.num_generations", a.num_turns, tree=True)
        check_value(a.joint_mode == "align" or a.num_turns == 1, "algo.joint_mode",
                    "cross is single-turn (G^N joint actions per node): set algo.num_turns=1 or algo.joint_mode=align")
        check_value(a.max_grad_norm is None or a.max_grad_norm > 0, "algo.max_grad_norm", "must be > 0 or null")
        check_value(a.rollout_buffer_size is None or a.joint_mode == "align", "algo.rollout_buffer_size",
                    "the node buffer is for align trees: set algo.joint_mode=align or algo.rollout_buffer_size=null")
        check_value(a.kl_coef >= 0, "algo.kl_coef", "must be >= 0")


@dataclass
class ATGRPOConfig(PolicyConfig):
    """AT-GRPO (arXiv 2510.11062): tree sampling per agent and turn, groups keyed by
    (environment, agent, turn), reward alpha * team + local, PPO clipped surrogate."""

    name: str = "at_grpo"
    # K: candidates per agent at every turn, from the same state.
    num_branches: int = 4
    # Turns per episode (turn-based tasks use task.max_turns; joint-reward tasks this).
    num_turns: int = 1
    # Score of a candidate: alpha * team reward + the agent's local (role) reward.
    alpha: float = 1.0
    # best: continue from the highest-scoring candidate (greedy); random: from a random one.
    select: str = "best"
    # Advantage (r - mean) / (std + eps) within a group; std unbiased (as in verl) or population.
    eps: float = 1.0e-6
    unbiased_std: bool = True
    # Before the advantages: drop groups whose rewards are all equal (no signal), then in each
    # trained model (one base with its LoRA adapters, or one fully fine-tuned policy) the
    # int(n * frac) groups with the lowest mean score (PettingLLMs: filter_method=mean, 0.5).
    filter_zero_std: bool = False
    filter_low_mean_frac: float = 0.0
    # sum: the advantage of each candidate's score (the paper's). normalize_then_sum: GDPO's, each
    # component of the score (the team reward's levels times alpha, the agent's own reward)
    # normalized within its group, summed, the sum normalized over the step (algos/advantages.py).
    reward_levels: str = "sum"
    learning_rate: float = 5.0e-6
    max_grad_norm: float = 1.0
    # Policies: one for all roles by default (per_agent: one per role; or `policy_map`).
    adapters: str = "shared"
    # PPO clipped surrogate with token-mean aggregation over `ppo_epochs` passes; each pass cut
    # into mini-batches of `mini_batch_size` samples (one optimizer step each; null: one step).
    clip_eps: float = 0.2
    ppo_epochs: int = 1
    mini_batch_size: Optional[int] = 16
    loss_aggregation: str = "token_mean"

    @staticmethod
    def check(cfg: Any) -> None:
        a = cfg.algo
        check_choice(cfg, "algo.select", ("best", "random"))
        check_choice(cfg, "algo.reward_levels", REWARD_LEVELS)
        check_value(a.num_branches >= 2, "algo.num_branches", "K must be >= 2: a group of one has no advantage")
        check_value(a.num_turns >= 1, "algo.num_turns", "must be >= 1")
        check_group(cfg, "algo.num_branches", a.num_turns, tree=False)
        check_value(a.eps > 0, "algo.eps", "must be > 0")
        check_value(0.0 <= a.filter_low_mean_frac < 1.0, "algo.filter_low_mean_frac", "must be in [0, 1)")
        check_value(a.max_grad_norm > 0, "algo.max_grad_norm", "must be > 0")
        check_value(a.clip_eps > 0, "algo.clip_eps", "must be > 0")
        check_value(a.ppo_epochs >= 1, "algo.ppo_epochs", "must be >= 1")
        check_value(a.mini_batch_size is None or a.mini_batch_size >= 1, "algo.mini_batch_size",
                    "must be >= 1 or null")


@dataclass
class CriticConfig:
    # Where the critic lives: `adapter` (one more LoRA adapter on the actors' frozen base, the
    # default), `separate` (a separate copy of the base, fully fine-tuned: the reference code's
    # critic), `actor` (collm_dc only: a value head on the agent's own actor adapter, shared trunk).
    placement: str = "adapter"
    # `value`: V(h) read at the last prompt token; `q`: Q(h, a) read at the last completion token
    # (CC appends the joint action to the joint history, DC the agent's own action).
    kind: str = "value"
    learning_rate: float = 5.0e-6
    weight_decay: float = 0.01
    # c_v in c_v * mean((y - V)^2).
    loss_coef: float = 0.6
    # PPO-style value clipping around the collection-time value (null: off; 0.2 with placement=actor).
    value_clip: Optional[float] = None
    # Linear + Tanh before the scalar head.
    hidden_layer: bool = False
    # Gradient-norm clipping of the critic (null: none, as in the reference).
    max_grad_norm: Optional[float] = None


@dataclass
class ActorCriticConfig(PolicyConfig):
    """CoLLM-CC / CoLLM-DC (arXiv 2601.21972): one trajectory per environment, TD(0) advantages from
    a centralized (cc) or per-agent (dc) critic."""

    name: str = MISSING
    num_turns: int = 1
    # gamma
    discount: float = 0.9
    # td0 (the paper's, from collection-time values) or gae
    estimator: str = "td0"
    gae_lambda: float = 0.95
    # Per (agent, turn) over the batch; a group of one sample is left as is.
    normalize_advantages: bool = True
    # End an episode once its (shifted) turn reward reaches this value (null: horizon / task success);
    # node_mean: once it exceeds it (comlrl's `mean(rewards) > threshold`; one joint action per turn).
    early_termination: Optional[float] = None
    early_termination_rule: str = "joint_action"
    # null: no importance ratio (the paper's actor loss); a value: PPO clipping, with ppo_epochs passes.
    clip_eps: Optional[float] = None
    ppo_epochs: int = 1
    # null: no gradient clipping (the reference).
    max_grad_norm: Optional[float] = None
    # Update granularity. Null: one actor step per policy and one step per critic per trainer step,
    # advantages normalized per (agent, turn) over the batch. A number: comlrl's per-agent buffer of
    # turn samples, filled trajectory by trajectory across trainer steps and drained once it holds
    # rollout_buffer_size samples: turn by turn, advantages normalized over the turn's samples, cut
    # into train_batch_size batches, one actor step and one step of the agent's critic (CC: the
    # shared one) per batch (null train_batch_size: = rollout_buffer_size).
    rollout_buffer_size: Optional[int] = None
    train_batch_size: Optional[int] = None
    loss_aggregation: str = "seq_sum"
    # Tokens the actor loss scores (algos/loss_tokens.py). completion: through the first EOS;
    # before_pad: comlrl's, the ids before the first pad token (no EOS when pad == eos).
    loss_tokens: str = "completion"
    learning_rate: float = 5.0e-6
    weight_decay: float = 0.01
    critic: CriticConfig = field(default_factory=CriticConfig)

    @staticmethod
    def check(cfg: Any) -> None:
        a, c = cfg.algo, cfg.algo.critic
        check_choice(cfg, "algo.estimator", ("td0", "gae"))
        check_choice(cfg, "algo.critic.placement", ("adapter", "separate", "actor"))
        check_choice(cfg, "algo.critic.kind", ("value", "q"))
        check_choice(cfg, "algo.loss_tokens", ACTOR_CRITIC_LOSS_TOKENS)
        check_value(c.placement != "actor" or a.name == "collm_dc", "algo.critic.placement",
                    "actor (a value head on the actor's own trunk) is per agent: use algo=collm_dc")
        check_policy_updates(a)
        check_value(0.0 <= a.gae_lambda <= 1.0, "algo.gae_lambda", "must be in [0, 1]")
        for key, v in (("algo.max_grad_norm", a.max_grad_norm), ("algo.critic.max_grad_norm", c.max_grad_norm),
                       ("algo.critic.value_clip", c.value_clip)):
            check_value(v is None or v > 0, key, "must be > 0 or null")
        check_value(c.learning_rate > 0, "algo.critic.learning_rate", "must be > 0")
        check_value(c.weight_decay >= 0, "algo.critic.weight_decay", "must be >= 0")
        check_value(c.loss_coef > 0, "algo.critic.loss_coef", "must be > 0")


@dataclass
class PromptBaselineConfig(PolicyConfig):
    """The prompt-only multi-agent baselines (evaluation only, greedy): parallel | sequential |
    discussion. Only `sampling.max_new_tokens` matters for greedy evaluation; temperature and
    top_p apply to sampled pass@k (trainer.eval_num_samples). The policy keys only shape the
    untrained (zero-initialized) adapters."""

    learning_rate: float = 1e-5


@dataclass
class SingleConfig(MAGRPOConfig):
    """One agent does the whole job (both parts in one answer), scored by the same joint reward
    and trained with GRPO (= MAGRPO with one agent)."""

    name: str = "single"
    num_turns: int = 1

    @staticmethod
    def agents_for(task_agents: tuple[str, ...] | None) -> tuple[str, ...]:
        """One agent does every part, whoever the task's agents are."""
        return SINGLE_AGENT


# --------------------------------------------------------------------------------- declarations
for _name, _module, _schema in (("magrpo", "marl_llm.algos.magrpo", MAGRPOConfig),
                                ("at_grpo", "marl_llm.algos.at_grpo", ATGRPOConfig),
                                ("collm_cc", "marl_llm.algos.collm", ActorCriticConfig),
                                ("collm_dc", "marl_llm.algos.collm", ActorCriticConfig),
                                ("single", "marl_llm.algos.baselines", SingleConfig),
                                ("parallel", "marl_llm.algos.baselines", PromptBaselineConfig),
                                ("sequential", "marl_llm.algos.baselines", PromptBaselineConfig),
                                ("discussion", "marl_llm.algos.baselines", PromptBaselineConfig)):
    declare_option(ALGORITHMS, "algo", _name, _module, _schema)

# algos/advantages.py: register_baseline's settings (min_group_size, uses_group).
declare_baseline("mean", "marl_llm.algos.advantages")
declare_baseline("rloo", "marl_llm.algos.advantages", min_group_size=2)
declare_baseline("max", "marl_llm.algos.advantages")
declare_baseline("raw", "marl_llm.algos.advantages", uses_group=False)
for _name in ("align", "cross"):
    JOINT_MODES.declare(_name, "marl_llm.algos.advantages")
# algos/losses.py
for _name in ("reinforce", "ppo_clip"):
    POLICY_LOSSES.declare(_name, "marl_llm.algos.losses")
for _name in ("seq_sum", "token_mean", "seq_mean_token_mean"):
    AGGREGATIONS.declare(_name, "marl_llm.algos.losses")
