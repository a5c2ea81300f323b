"""The benchmark workload, shared by every system, and the interface each system implements."""

from __future__ import annotations

import dataclasses
import json
import resource
from dataclasses import dataclass, field
from typing import Any

from marl_llm.tasks.base import Task


@dataclass
class Workload:
    """One benchmark setting. Every system sees the same prompts, reward, sampling and lengths.

    model: "embedded" (SmolLM2-135M-Instruct) or a local HF checkpoint directory.
    agents: number of cooperating agents (MAGRPO; 1 for single-agent GRPO).
    num_generations: joint actions sampled per prompt (G; the actor-critic group: 1).
    prompts_per_step: problems per step, each its own environment (the actor-critic group runs
        one trajectory per environment, so its joint actions per step come from here).
    new_tokens: every completion is exactly this long (min = max new tokens) where the system
        allows it, so systems and steps generate the same number of tokens.
    lora: LoRA settings {r, alpha, target_modules}; None keeps the algorithm's own defaults.
    task: the task whose training prompts and joint reward every system uses (tldr: the
        packaged offline sample, one post per step).
    """

    model: str = "embedded"
    dtype: str = "float32"
    agents: int = 2
    num_generations: int = 4
    prompts_per_step: int = 1
    new_tokens: int = 64
    temperature: float = 0.6
    top_p: float = 0.6
    learning_rate: float = 5e-5
    lora: dict[str, Any] | None = None
    task: str = "tldr"
    seed: int = 0
    threads: int = 0  # torch threads per worker; 0: torch's default
    extra: dict[str, Any] = field(default_factory=dict)  # system-specific knobs (documented where read)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Workload":
        return cls(**json.loads(text))

    @property
    def joint_actions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def sequences_per_step(self) -> int:
        return self.agents * self.joint_actions_per_step

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.new_tokens


@dataclass
class StepStats:
    """What one step of one system measured (seconds of wall time in the worker)."""

    seconds: float
    tokens: int  # tokens generated in the step
    rollout_seconds: float | None = None  # generation alone, where the system exposes it


def peak_rss_gib() -> float:
    """The worker process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class BenchSystem:
    """A system under test: built once in its worker, then stepped. `name` keys the registry.
    The base sets torch's threads and seed and loads the workload's task and problems."""

    name: str = ""

    def __init__(self, workload: Workload):
        import torch

        self.workload = workload
        if workload.threads > 0:
            torch.set_num_threads(workload.threads)
        torch.manual_seed(workload.seed)
        self.task, self.problems = workload_task(workload)

    def step_problems(self, k: int) -> list[int]:
        """Indices of step k's problems: the next `prompts_per_step` in order, wrapping around."""
        p = self.workload.prompts_per_step
        return [(k * p + j) % len(self.problems) for j in range(p)]

    def step(self) -> StepStats:
        raise NotImplementedError


def compose(overrides: list[str]):
    """marl-llm's real config (conf/) for these overrides, as the CLI composes it, validated."""
    from marl_llm.configure import compose_config
    from marl_llm.configure import validate

    cfg = compose_config(overrides)
    validate(cfg)
    return cfg


def model_overrides(w: Workload) -> list[str]:
    if w.model == "embedded":
        return ["model=smollm2_135m", f"model.dtype={w.dtype}", "model.device=cpu"]
    return ["model=local", f"model.path={w.model}", f"model.dtype={w.dtype}", "model.device=cpu"]


def model_path(w: Workload) -> str:
    """A directory that `from_pretrained` loads (the embedded model's converted checkpoint)."""
    if w.model == "embedded":
        from marl_llm.models.loading import embedded_checkpoint

        return str(embedded_checkpoint())
    return w.model


def load_model(w: Workload):
    """A plain `transformers` model of the workload (no adapters), in its dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path(w), dtype=getattr(torch, w.dtype))


def load_tokenizer(w: Workload):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path(w))


def workload_task(w: Workload):
    """(task, training problems) every system uses: marl-llm's own task, so prompts and the joint
    reward are identical across systems. With one agent, the single-agent view of the task
    (one agent writes every part; the same joint reward)."""
    from marl_llm.algos.baselines import SingleAgent
    from marl_llm.tasks import build_task

    cfg = compose([f"task={w.task}", "algo=single" if w.agents == 1 else "algo=magrpo", "run_dir=/tmp/unused"])
    task = build_task(cfg.task)
    if w.agents == 1:
        task = SingleAgent.task_view(task, cfg.algo)
    elif w.agents != task.num_agents:
        task = ReplicatedRoles(task, w.agents)
    return task, task.load_split("train")


class ReplicatedRoles(Task):
    """A task seen by n agents where the base task has m roles (n a multiple of m): agent i plays
    role i mod m; the team reward is the mean of the base reward over the n/m role groups. For the
    agent-scaling curve only: the compute grows with the agents, the task itself does not change."""

    max_turns = 1

    def __init__(self, base: Any, agents: int):
        m = base.num_agents
        if agents % m:
            raise ValueError(f"task {base.name} has {m} roles: the agent count must be a multiple of {m}")
        super().__init__(base.cfg)
        self.base, self.groups = base, agents // m
        self.agent_names = tuple(f"{name}{g}" for g in range(self.groups) for name in base.agent_names)

    def load_split(self, split: str):
        return self.base.load_split(split)

    def initial_prompts(self, problem):
        return self.base.initial_prompts(problem) * self.groups

    def joint_rewards(self, problems, joint_actions):
        m = self.base.num_agents
        per_group = [self.base.joint_rewards(problems, [a[g * m:(g + 1) * m] for a in joint_actions])
                     for g in range(self.groups)]
        return [dataclasses.replace(rs[0], total=sum(r.total for r in rs) / len(rs)) for rs in zip(*per_group)]
