"""CoLLM-CC's update buffer and early termination against comlrl 1.4.3's own MAACTrainer, executed
here on the same tiny model, with rewards fixed by each turn's position (test_magrpo_vs_comlrl):
the same trajectories, the same sequence of actor steps (agent, turn, trajectories) and one critic
step per actor step."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import compose_config, make_policies
from test_magrpo_vs_comlrl import PathTask, path_reward

comlrl_maac = pytest.importorskip("comlrl.trainers.actor_critic.maac")

TURNS, PROBLEMS, GAMMA = 3, 4, 0.9


def run_comlrl(model_dir, threshold: float, buffer: int, batch: int):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir)  # noqa: E731
    args = comlrl_maac.MAACConfig(
        num_train_epochs=1, num_agents=2, num_turns=TURNS, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
        early_termination_threshold=threshold, rollout_buffer_size=buffer, train_batch_size=batch,
        discount=GAMMA, eval_interval=0)
    nodes: set[str] = set()

    def reward(c1, c2, *, prompts):
        nodes.add(prompts[0])
        return [path_reward(f"{prompts[0]}.0")]

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, **_):
        return [f"{prompt_history_per_agent[0][-1]}.0"] * num_agents

    trainer = comlrl_maac.MAACTrainer(
        agents=[load(), load()], critics=[load()], tokenizer=tok, args=args, reward_func=reward,
        external_transition=transition, train_dataset=Dataset.from_list([{"prompt": f"p{k}"} for k in range(PROBLEMS)]),
        formatters=[lambda item, external_prompts=None: external_prompts or item["prompt"]] * 2)
    steps, critic_steps = [], []
    original = trainer._ac_step

    def ac_step(agent_idx, batch):
        steps.append((agent_idx, batch[0].prompt.count("."), frozenset(s.prompt for s in batch)))
        return original(agent_idx, batch)

    trainer._ac_step = ac_step
    critic_step = trainer.critic_optimizer.step
    trainer.critic_optimizer.step = lambda *a, **k: (critic_steps.append(1), critic_step(*a, **k))[1]
    trainer.train()
    return nodes, steps, len(critic_steps)


def run_marl(model_dir, threshold: float, buffer: int, batch: int, monkeypatch):
    import marl_llm.algos.collm as collm
    from marl_llm.algos import build_algorithm
    from marl_llm.models.prompting import PromptFormat
    from marl_llm.rollout.decode import HFRollout
    from marl_llm.tasks.base import Problem

    cfg = compose_config(["algo=collm_cc", f"algo.num_turns={TURNS}", "algo.sampling.max_new_tokens=4",
                          "algo.sampling.temperature=1.0", "algo.sampling.top_p=1.0", f"algo.discount={GAMMA}",
                          f"algo.early_termination={threshold}", "algo.early_termination_rule=node_mean",
                          f"algo.rollout_buffer_size={buffer}", f"algo.train_batch_size={batch}",
                          "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]"])
    policies = make_policies(model_dir)
    policies.tokenizers[0].prompt_format = PromptFormat(False)
    algo = build_algorithm(cfg.algo, PathTask(), policies, HFRollout(policies), 8)
    tok = policies.tokenizers[0]
    steps, critic_steps = [], []
    original = collm.policy_update

    def update(policies_, agent, key, comps, advs, settings, micro):
        paths = frozenset(tok.decode(c.prompt_ids, skip_special_tokens=True).strip() for c in comps)
        steps.append((agent, next(iter(paths)).count("."), paths))
        assert abs(float(advs.mean())) < 1e-5 or len(advs) == 1 or float(advs.std()) == 0  # normalized per turn
        return original(policies_, agent, key, comps, advs, settings, micro)

    monkeypatch.setattr(collm, "policy_update", update)
    critic_update = algo.critics[0].update
    algo.critics[0].update = lambda *a: (critic_steps.append(1), critic_update(*a))[1]
    nodes: set[str] = set()
    for k in range(PROBLEMS):
        tree = algo.collect([Problem(f"p{k}", {}, sample_key=k)])
        nodes.update(n.messages[0] for n in tree.nodes())
        stats = algo.update(algo.advantages(tree), end_of_epoch=k == PROBLEMS - 1)
        assert stats["critic/optimizer_steps"] == stats["aux/optimizer_steps"] + stats["main/optimizer_steps"]
    return nodes, steps, len(critic_steps)


@pytest.mark.parametrize("threshold,buffer,batch", [(-1.5, 4, 4), (-1.0, 1, 1), (-2.5, 3, 2)])
def test_buffer_and_early_termination_match_comlrl(tiny_model_dir, monkeypatch, threshold, buffer, batch):
    ref_nodes, ref_steps, ref_critic = run_comlrl(tiny_model_dir, threshold, buffer, batch)
    nodes, steps, critic = run_marl(tiny_model_dir, threshold, buffer, batch, monkeypatch)
    assert nodes == ref_nodes
    if batch == buffer:  # no turn group exceeds a batch: the composition of each step is fixed
        assert steps == ref_steps
    else:  # a drain shuffles a turn's samples before cutting batches: compare turn by turn
        assert Counter((a, t, len(p)) for a, t, p in steps) == Counter((a, t, len(p)) for a, t, p in ref_steps)
    assert critic == ref_critic == len(steps)
    # Every drained turn group takes at least one step: more steps than one per trajectory.
    assert len(steps) > 2 * PROBLEMS


def test_buffered_samples_keep_their_critic_inputs():
    """A checkpointed buffer restores every sample's critic input, target and collection-time value."""
    import copy

    from marl_llm.algos.buffer import BufferedSample, SampleBuffer

    buf = SampleBuffer(2, None, 0)
    extra = {"critic_prompt": torch.tensor([1, 2]), "critic_completion": None, "target": 0.25, "old_value": -0.1}
    buf.push(0, BufferedSample(1, [], torch.tensor([0.5]), extra))
    restored = SampleBuffer(2, None, 0)
    restored.load_state_dict(copy.deepcopy(buf.state_dict()))
    [[sample]] = restored.drain(0)
    assert sample.turn == 1 and float(sample.advantages) == 0.5
    assert sample.extra["target"] == 0.25 and sample.extra["old_value"] == -0.1
    assert sample.extra["critic_prompt"].tolist() == [1, 2]
