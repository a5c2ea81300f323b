"""CoLLM-CC's update buffer and early termination against comlrl 1.4.3's own MAACTrainer, executed
here on the same tiny model, with rewards fixed by each turn's position (test_magrpo_vs_comlrl):
the same trajectories, the same sequence of actor steps (agent, turn, trajectories) and one critic
step per actor step; and the loss tokens of algo.loss_tokens=before_pad against comlrl's, both
sides in float64 (to FLOAT64_REL, conftest.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import FLOAT64_REL, assert_close_to_scale, compose_config, make_policies
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


@pytest.mark.numerics
@pytest.mark.parametrize("end", [0, 3, None])
def test_before_pad_loss_tokens_are_comlrls(tiny_model_dir, end):
    """algo.loss_tokens=before_pad scores what comlrl's actor-critic loss scores: the ids before
    the first pad, so with pad == eos (the tiny model's tokenizer, as SmolLM2's) the EOS is left
    out; the summed log-prob equals comlrl's own _policy_eval on the sequence its _generate made
    (both models in float64: to FLOAT64_REL of it), and marl-llm's own tokens (through the EOS)
    differ by the EOS's log-prob."""
    import functools

    from transformers import LogitsProcessorList

    from marl_llm.algos.loss_tokens import before_pad
    from marl_llm.rollout.base import Completion
    from marl_llm.rollout.decode import completion_logprobs, cut_at_eos
    from test_magrpo_vs_comlrl import EndAt, float64_model, full_policies

    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.pad_token = tok.eos_token
    load = lambda: float64_model(tiny_model_dir)  # noqa: E731
    args = comlrl_maac.MAACConfig(num_train_epochs=1, num_agents=2, num_turns=1, max_new_tokens=6, temperature=1.0,
                                  top_p=1.0, top_k=0, eval_interval=0)
    trainer = comlrl_maac.MAACTrainer(
        agents=[load(), load()], critics=[load()], tokenizer=tok, args=args, reward_func=lambda a, b: [0.0],
        train_dataset=Dataset.from_list([{"prompt": "p"}]),
        formatters=[lambda item, external_prompts=None: item["prompt"]] * 2)
    prompt = "Write the main function."
    agent = trainer.agents[0]
    processor = EndAt([end], tok.eos_token_id, len(tok(prompt).input_ids))
    agent.generate = functools.partial(agent.generate, logits_processor=LogitsProcessorList([processor]))
    gen = trainer._generate(agent, prompt, 0)
    with torch.no_grad():
        ref, _ = trainer._policy_eval(agent, gen["sequences"], gen["attention_mask"], gen["prompt_len"],
                                      gen["response_lens"][0])
    seq, plen = gen["sequences"][0].cpu(), gen["prompt_len"]
    ids, truncated = cut_at_eos(seq[plen:], [tok.eos_token_id])
    own = Completion(seq[:plen], ids, gen["completions"][0], truncated)
    comlrls = before_pad(own, tok.pad_token_id)
    assert len(comlrls.loss_ids) == gen["response_lens"][0] == (6 if end is None else end)
    policies = full_policies(tiny_model_dir)
    with torch.no_grad(), policies.acting(0) as model:
        def total(c):
            logp, mask, _ = completion_logprobs(model, [c.prompt_ids], [c.scored_ids], tok.pad_token_id)
            return float((logp * mask).sum())

        assert ref.dtype == torch.float64
        assert_close_to_scale(total(comlrls), float(ref), FLOAT64_REL, "summed log-prob")
        if end is None:  # no EOS: the same tokens
            assert_close_to_scale(total(own), float(ref), FLOAT64_REL, "summed log-prob")
        else:
            assert total(own) < float(ref) - 1e-3  # + log p(EOS)


def test_collm_switch_cuts_before_the_first_pad(tiny_model_dir):
    from marl_llm.algos import build_algorithm
    from marl_llm.models.prompting import PromptFormat
    from marl_llm.rollout.decode import HFRollout
    from marl_llm.tasks.base import Problem

    cfg = compose_config(["algo=collm_dc", "algo.num_turns=2", "algo.sampling.max_new_tokens=6",
                          "algo.loss_tokens=before_pad", "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]"])
    policies = make_policies(tiny_model_dir)
    policies.tokenizers[0].prompt_format = PromptFormat(False)
    algo = build_algorithm(cfg.algo, PathTask(), policies, HFRollout(policies), 8)
    pad = policies.tokenizers[0].pad_token_id
    batches = algo.advantages(algo.collect([Problem(f"p{k}", {}, sample_key=k) for k in range(3)]))
    for c in (c for b in batches for c in b.completions):
        hits = (c.completion_ids == pad).nonzero()
        assert torch.equal(c.loss_ids, c.completion_ids[:int(hits[0])] if len(hits) else c.completion_ids)
    assert compose_config(["algo=collm_cc"]).algo.loss_tokens == "completion"


def test_paper_evaluation_logs_comlrls_undiscounted_returns(tiny_model_dir):
    """eval/turn_<t>/expected_return under trainer.eval_protocol=paper against comlrl 1.4.3's own
    MAACTrainer.evaluate, on the same path rewards (fixed by each turn's position) with discount
    0.9: the reference logs the undiscounted sum of the rewards from each turn on (marl-llm logged
    a discounted one: -4.507 where comlrl logged -4.704 on a stub case), and its per-turn reward."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marl_llm.algos import build_algorithm
    from marl_llm.models.prompting import PromptFormat
    from marl_llm.rollout.decode import HFRollout
    from marl_llm.tasks.base import Problem
    from marl_llm.training.evaluation import evaluate

    items, turns = ["e0"], 2  # one episode of two turns: the discount already tells them apart
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.pad_token = tok.eos_token
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # noqa: E731
    args = comlrl_maac.MAACConfig(num_train_epochs=1, num_agents=2, num_turns=turns, max_new_tokens=4,
                                  temperature=1.0, top_p=1.0, top_k=0, discount=GAMMA, eval_interval=0,
                                  eval_num_samples=len(items))
    trainer = comlrl_maac.MAACTrainer(
        agents=[load(), load()], critics=[load()], tokenizer=tok, args=args,
        reward_func=lambda c1, c2, *, prompts: [path_reward(f"{prompts[0]}.0")],
        external_transition=lambda prompt, agent_completions, num_agents, prompt_history_per_agent, **_:
            [f"{prompt_history_per_agent[0][-1]}.0"] * num_agents,
        train_dataset=Dataset.from_list([{"prompt": "t0"}]), eval_dataset=Dataset.from_list([{"prompt": p} for p in items]),
        formatters=[lambda item, external_prompts=None: external_prompts or item["prompt"]] * 2)
    ref = trainer.evaluate()

    cfg = compose_config(["algo=collm_cc", f"algo.num_turns={turns}", "algo.sampling.max_new_tokens=4",
                          "algo.sampling.temperature=1.0", "algo.sampling.top_p=1.0", f"algo.discount={GAMMA}",
                          "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", "trainer.eval_protocol=paper"])
    policies = make_policies(tiny_model_dir)
    policies.tokenizers[0].prompt_format = PromptFormat(False)
    task = type("EvalPathTask", (PathTask,), {"success_metric": "success_rate"})()
    algo = build_algorithm(cfg.algo, task, policies, HFRollout(policies), 8)
    ours, _ = evaluate(algo, [Problem(p, {}, sample_key=k) for k, p in enumerate(items)], cfg.trainer)

    paths = {t: [f"{p}{'.0' * t}" for p in items] for t in range(1, turns + 1)}
    undiscounted = {t: sum(path_reward(x) for s in range(t, turns + 1) for x in paths[s]) / len(items)
                    for t in paths}
    for t in range(1, turns + 1):
        assert ref[f"eval/turn_{t}/expected_return"] == pytest.approx(undiscounted[t], rel=1e-6)
        assert ours[f"turn_{t}/expected_return"] == pytest.approx(ref[f"eval/turn_{t}/expected_return"], rel=1e-6)
        assert ours[f"turn_{t}/reward"] == pytest.approx(ref[f"eval/turn_{t}/reward_mean"], rel=1e-6)
    discounted = sum(GAMMA ** (s - 1) * path_reward(x) for s in paths for x in paths[s]) / len(items)
    assert ours["turn_1/expected_return"] != pytest.approx(discounted, rel=1e-3)  # what was logged before
