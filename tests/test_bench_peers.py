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
        w = workload
        assert stats.tokens == w.agents * w.prompts_per_step * w.num_generations * w.new_tokens
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


AC_WORKLOAD = dict(agents=2, num_generations=1, prompts_per_step=3, new_tokens=4, seed=0)


@pytest.mark.parametrize("name,critics", [("comlrl_maac", 1), ("comlrl_iac", 2)])
def test_comlrl_actor_critic_steps_update_actors_and_critics(tiny_model_dir, name, critics):
    """One step = prompts_per_step environments, one trajectory each; the buffers drain inside the
    step: every actor and every critic took an optimizer step (and the critics are comlrl's own
    count: MAAC one shared critic, IAC one per agent)."""
    pytest.importorskip("comlrl")
    from marl_llm.bench.systems import registry

    workload = Workload(model=str(tiny_model_dir), **AC_WORKLOAD)
    system = registry()[name](workload)
    system.task = DistinctRewards(system.task)
    trainer = system.trainer
    assert len(trainer.critics) == critics
    seen = []
    original = trainer._collect_rollouts
    trainer._collect_rollouts = lambda item: (seen.append(item["problem_index"]), original(item))[1]
    models = [*trainer.agents, *trainer.critics]
    before = [trainable_snapshot(m) for m in models]
    check_steps(system, workload)
    assert seen == [0, 1, 2, 3, 4, 5]  # the step's problems, in order, as marl-llm's systems take them
    assert all(changed(snap, m) for snap, m in zip(before, models))
    optimizers = [*trainer.agent_optimizers,
                  *getattr(trainer, "critic_optimizers", [getattr(trainer, "critic_optimizer", None)])]
    for optimizer in optimizers:
        assert any(state["exp_avg"].abs().sum() > 0 for state in optimizer.state.values())


@pytest.mark.parametrize("name", ["marl_collm_cc", "marl_collm_dc"])
def test_marl_collm_systems_run_at_comlrls_granularity(tiny_model_dir, name):
    """marl-llm's side of the CoLLM group: the step's problems, one trajectory each, and the update
    buffer drained within the step (one actor step per agent, one critic step per agent's batch)."""
    from marl_llm.bench.systems import registry

    workload = Workload(model=str(tiny_model_dir), **AC_WORKLOAD)
    system = registry()[name](workload)
    assert system.cfg.algo.name == name.removeprefix("marl_")
    assert system.cfg.algo.rollout_buffer_size == system.cfg.algo.train_batch_size == 3
    assert system.cfg.trainer.prompts_per_step == 3
    critics = system.run.algo.critics
    before = [trainable_snapshot(c.head) for c in critics]
    check_steps(system, workload)
    assert all(changed(snap, c.head) for snap, c in zip(before, critics))
    assert not system.run.algo.buffer.pending()  # nothing carried over to the next step
    with pytest.raises(ValueError, match="num_generations=1"):
        registry()[name](Workload(model=str(tiny_model_dir), agents=2, num_generations=2))
