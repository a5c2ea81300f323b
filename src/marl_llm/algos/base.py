"""The algorithm interface: collect → advantages → update. One module plus one YAML per algorithm.

The trainer calls, once per step:
    tree = algo.collect(problems)        # joint rollout (a tree when multi-turn) with team rewards
    batches = algo.advantages(tree)      # one AgentBatch per agent: samples with advantages
    stats = algo.update(batches)         # one optimizer step per trainable adapter
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from marl_llm.training.episodes import JointNode, JointTree, Terminate, collect_tree
from marl_llm.models.policies import AgentPolicies
from marl_llm.registry import ALGORITHMS, schema_registrar
from marl_llm.rollout.base import Completion, Rollout
from marl_llm.rollout.sampling import SamplingParams
from marl_llm.training.rollout_metrics import reward_metrics
from marl_llm.tasks.base import Problem, Task
from marl_llm.tasks.turn_based import TurnTask, collect_episode_tree


@dataclass
class AgentBatch:
    """One agent's training samples of a step.

    completions[j] holds the exact prompt/completion ids; advantages: Tensor[n] (one per
    completion); turns[j]: the turn the sample was taken at (for per-turn metrics); kl: Tensor[n]
    or None.
    """

    agent: int
    completions: list[Completion] = field(default_factory=list)
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    turns: list[int] = field(default_factory=list)
    # Per-sample KL(policy || reference), when the algorithm computed it before the update.
    kl: torch.Tensor | None = None
    # Sample indices of each sibling group (one parent's G joint actions), in rollout order
    # (MAGRPO's buffered update takes them as comlrl's node samples); None where not grouped.
    groups: list[list[int]] | None = None


class Algorithm(ABC):
    # False: a prompt-only baseline; the trainer evaluates it and skips training.
    trainable: bool = True
    # True: can play turn-based tasks (marl_llm.tasks.turn_based: Sokoban, Plan-Path).
    supports_turn_tasks: bool = False
    # trainer.eval_protocol=paper: True if the reference evaluates with its training rollout (comlrl's
    # actor-critic trainers: episodes end at the early termination); False: every turn played
    # (comlrl's MAGRPO). Either way the logged returns are undiscounted, as the reference logs them.
    eval_as_training: bool = False

    @classmethod
    def task_view(cls, task: Task, cfg: Any) -> Task:
        """The task as this algorithm's agents see it (algo=single: one agent doing every part)."""
        return task

    def __init__(self, cfg: Any, task: Task, policies: AgentPolicies, rollout: Rollout,
                 micro_batch_size: int = 8):
        self.cfg = cfg
        # Completions per forward/backward pass (gradient accumulation above it).
        self.micro_batch_size = micro_batch_size
        self.task = task
        self.policies = policies
        self.rollout = rollout

    def agent_sampling(self) -> list[SamplingParams]:
        """Each agent's sampling settings: algo.sampling with algo.agent_sampling.<agent> on top."""
        over = self.cfg.get("agent_sampling") or {}
        params = [SamplingParams.from_cfg(self.cfg.sampling, **dict(over.get(name, {})))
                  for name in self.task.agent_names]
        out = []
        for i, p in enumerate(params):
            if p.top_k is None:  # the model's generation config, as the references' generate()
                model = self.policies.models[self.policies.agents[i].model_index]
                warn_unapplied_generation_settings(model)
                p = dataclasses.replace(p, top_k=generation_default_top_k(model))
            out.append(p)
        return out

    @property
    def eval_turns(self) -> int:
        """Turns of an evaluation rollout (the final turn's joint action is scored)."""
        if isinstance(self.task, TurnTask):
            return self.task.num_turns
        return int(self.cfg.get("num_turns", 1))

    def early_stop(self) -> Terminate | None:
        """algo.early_termination on shifted rewards, by algo.early_termination_rule (early_stop_rule)."""
        return early_stop_rule(self.cfg.get("early_termination"), self.cfg.get("early_termination_rule", "joint_action"),
                               self.task.reward_shift)

    def rollout_tree(self, problems: list[Problem], widths: list[int], sampling: list[SamplingParams],
                     terminate: Terminate | None = None, joint_mode: str = "align") -> JointTree:
        """The algorithm's joint rollout, shared by training and evaluation (baselines override it).
        Turn-based tasks fork episodes instead (marl_llm.tasks.turn_based.collect_episode_tree)."""
        if isinstance(self.task, TurnTask):
            return collect_episode_tree(self.task, self.rollout.generate, problems, widths, sampling, terminate)
        return collect_tree(self.task, self.rollout.generate, problems, widths, sampling, joint_mode, terminate)

    def rollout_metrics(self, tree: JointTree) -> dict[str, float]:
        """Training-rollout metrics (reward, reward_std, per turn and level; TRL names)."""
        return reward_metrics(tree, self.task.reward_shift)

    @abstractmethod
    def collect(self, problems: list[Problem]) -> JointTree:
        """Roll out the agents on `problems` and score every joint action."""

    @abstractmethod
    def advantages(self, tree: JointTree) -> list[AgentBatch]:
        """Per agent, its samples of the tree with their advantages."""

    @abstractmethod
    def update(self, batches: list[AgentBatch], end_of_epoch: bool = False) -> dict[str, float]:
        """Update every trainable policy; returns metrics (TRL names, agent segments).
        end_of_epoch: this trainer step finished a pass over the training set (an algorithm that
        holds samples back, e.g. MAGRPO's update buffer, trains on all of them now)."""

    def extra_models(self) -> list[Any]:
        """Trained models the algorithm owns besides the agents' (a separate critic's copy of
        the base): the trainer turns gradient checkpointing on for these too."""
        return []

    def parameters_replaced(self) -> None:
        """FSDP replaced the parameters of the models (`extra_models` included) with their shards:
        an algorithm with optimizers of its own (critics) rebuilds them here."""

    def checkpoint_parts(self) -> dict[str, tuple[Any, Any]]:
        """Trained models of the algorithm's own with their optimizers, by name, that a sharded
        checkpoint stores as shards (runs/sharded_checkpoint.py): a separate critic."""
        return {}

    # Training state beyond the agents' adapters and optimizers (critics, ...), for checkpoints.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def early_stop_rule(threshold: float | None, rule: str, shift: float) -> Terminate | None:
    """Which joint actions of a sibling group are not expanded, on rewards + shift: joint_action
    (marl-llm's) ends each one whose reward reaches the threshold; node_mean (comlrl's) expands none
    of a group whose mean reward exceeds it. None: no threshold."""
    if threshold is None:
        return None
    if rule == "node_mean":
        def node_mean(group: list[JointNode]) -> list[bool]:
            mean = sum(n.reward.total + shift for n in group) / len(group)
            return [mean > threshold] * len(group)
        return node_mean
    return lambda group: [n.reward.total + shift >= threshold for n in group]


def generation_default_top_k(model) -> int:
    """The top_k generate() samples with when the caller passes none: the model's generation
    config, else transformers' global default (50)."""
    top_k = getattr(model.generation_config, "top_k", None)
    if top_k is None:
        defaults = getattr(model.generation_config, "_get_default_generation_params", lambda: {})()
        top_k = defaults.get("top_k", 50)
    return int(top_k)


def unapplied_generation_settings(model) -> dict[str, Any]:
    """The sampling settings of the model's generation config, other than temperature, top_p and
    top_k, that generate() applies when its caller passes none (as the reference trainers call it)
    and marl-llm's sampler does not: each one that differs from transformers' default."""
    from transformers import GenerationConfig

    default, own = GenerationConfig(), model.generation_config
    return {k: getattr(own, k) for k in UNAPPLIED_GENERATION_KEYS if getattr(own, k, None) != getattr(default, k, None)}


# Logits processors generate() builds from the generation config (transformers' own keys).
UNAPPLIED_GENERATION_KEYS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "min_p",
                             "typical_p", "epsilon_cutoff", "eta_cutoff", "min_length", "min_new_tokens",
                             "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                             "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id")
_WARNED: set[int] = set()


def warn_unapplied_generation_settings(model) -> None:
    """algo.sampling.top_k=null reads the model's generation config as the references' generate()
    does, for top_k; say once per model which other settings of it generate() would also apply."""
    if id(model) in _WARNED:
        return
    _WARNED.add(id(model))
    extra = unapplied_generation_settings(model)
    if extra:
        logging.getLogger("marl_llm").warning(
            "the generation config of %s sets %s, which the reference trainers' generate() applies and marl-llm's "
            "sampler does not (docs/fidelity.md)", getattr(model, "name_or_path", type(model).__name__),
            ", ".join(f"{k}={v!r}" for k, v in extra.items()))


# Class decorator: `@register_algorithm("name", schema=NameConfig)` makes an Algorithm available as
# `algo=<name>`, its config keys typed and checked by its schema (a PolicyConfig subclass). The
# table (marl_llm.registry.ALGORITHMS) also holds the built-ins declared in algos/schemas.py, each
# imported when first used.
register_algorithm = schema_registrar(ALGORITHMS, "algorithm", "algo")


def algorithm_class(name: str) -> type[Algorithm]:
    import marl_llm.algos.schemas  # noqa: F401  (declares the built-ins)

    if name not in ALGORITHMS:
        raise ValueError(f"unknown algo.name={name!r}; registered: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]  # type: ignore[return-value]


def build_algorithm(cfg: Any, task: Task, policies: AgentPolicies, rollout: Rollout,
                    micro_batch_size: int = 8) -> Algorithm:
    """`task` as returned by `algorithm_class(cfg.name).task_view(...)`."""
    return algorithm_class(cfg.name)(cfg, task, policies, rollout, micro_batch_size)
