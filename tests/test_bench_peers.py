"""The peer benchmark systems drive comlrl's and trl's own trainers on marl-llm's workload: each
step generates exactly agents * G * new_tokens tokens and updates the trainable weights."""

from __future__ import annotations

import itertools

import pytest
import torch

from marl_llm.bench.workload import Workload
from marl_llm.tasks.base import JointReward


class DistinctRewards:
    """The real task, except that every joint action gets a new reward: a random tiny model's
    text scores 0 everywhere, which gives zero advantages and hence no gradient to check."""

    def __init__(self, task):
        self.task = task
        self.counter = itertools.count()

    def __getattr__(self, name):
        return getattr(self.task, name)

    def joint_rewards(self, problems, joint_actions):
        self.task.joint_rewards(problems, joint_actions)  # the real scorer still runs on the peer's output
        return [JointReward(total=float(next(self.counter) % 3)) for _ in joint_actions]


def trainable_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    after = dict(model.named_parameters())
    return any(not torch.equal(before[name], after[name].detach()) for name in before)


def check_steps(system, workload: Workload) -> None:
    for _ in range(2):
        stats = system.step()
        assert stats.seconds > 0
        assert stats.tokens == workload.agents * workload.num_generations * workload.new_tokens
        assert stats.rollout_seconds is not None and 0 < stats.rollout_seconds < stats.seconds


def test_comlrl_magrpo_steps_update_every_agent(tiny_model_dir):
    pytest.importorskip("comlrl")
    from marl_llm.bench.peers import ComlrlMAGRPO

    workload = Workload(model=str(tiny_model_dir), agents=2, num_generations=2, new_tokens=4, seed=0)
    system = ComlrlMAGRPO(workload)
    system.task = DistinctRewards(system.task)
    before = [trainable_snapshot(agent) for agent in system.trainer.agents]
    check_steps(system, workload)
    assert all(changed(snap, agent) for snap, agent in zip(before, system.trainer.agents))
    # comlrl's AdamW decays weights (torch's default 0.01) even without a gradient: check the
    # update also saw one (non-zero first moments) for every agent.
    for optimizer in system.trainer.optimizers:
        assert any(state["exp_avg"].abs().sum() > 0 for state in optimizer.state.values())


def test_trl_grpo_steps_update_lora(tiny_model_dir):
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from marl_llm.bench.peers import TrlGRPO

    workload = Workload(model=str(tiny_model_dir), agents=1, num_generations=2, new_tokens=4, seed=0)
    system = TrlGRPO(workload)
    try:
        system.task = DistinctRewards(system.task)
        model = system.trainer.model
        before = trainable_snapshot(model)
        assert before and all("lora_" in name for name in before)
        check_steps(system, workload)
        assert system.trainer.state.global_step == 2
        assert changed(before, model)
    finally:
        system.close()
