"""CoLLM-CC / CoLLM-DC: what each critic sees, TD targets from collection-time values, which
parameters each step changes, critic options, checkpoints, and every task on the tiny model.

The tests that compare the algorithm's advantages, targets and critic loss with the same formulas
applied to values read again run the model in float64 (model.dtype=float64), so no CPU's summation
order shows: the two passes' values agree to ~1e-16, and the critic hands them on in its head's
dtype (Critic.dtype: float64 here), so advantages, targets and the critic loss agree to
FLOAT64_REL (conftest) of their scale, while a wrong value, reward or position is off by the order
of the values themselves."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import compose_config
from marl_llm.algos import build_algorithm
from marl_llm.algos.collm import joint_history, trajectories
from marl_llm.algos.returns import gae, td0
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.models.policies import AgentPolicies
from marl_llm.rollout.decode import HFRollout
from marl_llm.tasks import build_task
from marl_llm.training.trainer import train

from conftest import FLOAT64_REL, assert_close_to_scale
from test_agents import changed, snapshot

F64 = "model.dtype=float64"


def overrides(model_dir, run_dir, algo, task="strbuild", *extra):
    return ["model=local", f"model.path={model_dir}", "logger=none", f"run_dir={run_dir}", f"algo={algo}",
            f"task={task}", "algo.sampling.max_new_tokens=6", "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]",
            "trainer.max_steps=1", "trainer.eval_max_problems=2", "trainer.prompts_per_step=3", *extra]


def build(model_dir, tmp_path, algo, task="strbuild", *extra):
    cfg = compose_config(overrides(model_dir, tmp_path, algo, task, *extra))
    validate(cfg)
    t = build_task(cfg.task)
    policies = AgentPolicies(t.agent_names, cfg.model, cfg.algo, 0)
    return build_algorithm(cfg.algo, t, policies, HFRollout(policies), 4)


def problems(algo, n=3):
    return algo.task.load_split("train")[:n]


def critic_params(algo):
    return {(c.name, k): p.detach().clone() for c in algo.critics
            for k, p in list(c.trunk.items()) + [(f"head.{n}", q) for n, q in c.head.named_parameters()]}


def test_one_trajectory_per_environment_until_the_horizon(tiny_model_dir, tmp_path):
    algo = build(tiny_model_dir, tmp_path, "collm_cc", "strbuild", "algo.num_turns=3")
    tree = algo.collect(problems(algo))
    assert [len(turn) for turn in tree.turns] == [3, 3, 3]
    chains = trajectories(tree)
    assert len(chains) == 3 and all([n.turn for n in c] == [0, 1, 2] for c in chains)
    assert sorted(c[0].problem for c in chains) == [0, 1, 2]


def test_cc_critic_sees_the_joint_history_and_dc_only_its_own(tiny_model_dir, tmp_path):
    cc = build(tiny_model_dir, tmp_path / "cc", "collm_cc", "tldr", "algo.critic.kind=q")
    tok = cc.policies.tokenizers[0]
    node = cc.collect(problems(cc, 1)).turns[0][0]
    text = tok.decode(cc.critic_inputs([node], None)[0][0])
    assert "[Agent 1]" in text and "[Agent 2]" in text and "[Joint Action]" in text
    for msg in node.messages:
        assert msg.split("\n")[0] in text
    assert joint_history(node, False) in text

    dc = build(tiny_model_dir, tmp_path / "dc", "collm_dc", "tldr")
    node = dc.collect(problems(dc, 1)).turns[0][0]
    role = [m.split("\n")[0] for m in node.messages]  # the two agents' different instructions
    assert role[0] != role[1]
    for i in range(2):
        prompts, comps = dc.critic_inputs([node], i)
        assert comps is None and torch.equal(prompts[0], node.completions[i].prompt_ids)
        seen = tok.decode(prompts[0])
        assert role[i] in seen and role[1 - i] not in seen and "[Agent" not in seen
    dc_q = build(tiny_model_dir, tmp_path / "dcq", "collm_dc", "tldr", "algo.critic.kind=q")
    node = dc_q.collect(problems(dc_q, 1)).turns[0][0]
    assert torch.equal(dc_q.critic_inputs([node], 1)[1][0], node.completions[1].completion_ids)


@pytest.mark.numerics
@pytest.mark.parametrize("estimator", ["td0", "gae"])
def test_advantages_are_td_errors_of_the_collection_time_values(tiny_model_dir, tmp_path, estimator):
    """The algorithm's advantages and TD targets (from the values of the collection-time pass)
    against td0 / gae of the values the critic computes again, the model in float64: to
    FLOAT64_REL of their scale (module docstring)."""
    algo = build(tiny_model_dir, tmp_path, "collm_cc", "strbuild", "algo.num_turns=3", "algo.normalize_advantages=false",
                 f"algo.estimator={estimator}", "algo.discount=0.8", "algo.gae_lambda=0.5", F64)
    assert algo.policies.dtype == torch.float64
    tree = algo.collect(problems(algo))
    batches = algo.advantages(tree)
    nodes = [n for c in trajectories(tree) for n in c]
    values = algo.critics[0].values(*algo.critic_inputs(nodes, None)).double()
    for c, chain in enumerate(trajectories(tree)):
        r = torch.tensor([n.reward.total for n in chain], dtype=torch.float64)
        v = values[3 * c:3 * c + 3]
        adv, target = td0(r, v, 0.8) if estimator == "td0" else gae(r, v, 0.8, 0.5)
        for i in range(2):  # CC: every agent gets the team's TD error
            assert_close_to_scale(batches[i].advantages[3 * c:3 * c + 3].double(), adv, FLOAT64_REL, "advantages")
        assert_close_to_scale(algo._critic_batches[0].targets[3 * c:3 * c + 3].double(), target, FLOAT64_REL, "targets")
    if estimator == "td0":  # by hand, one chain: delta_t = r_t + 0.8 V_{t+1} - V_t, last: r_T - V_T
        r0 = [n.reward.total for n in trajectories(tree)[0]]
        want = [r0[0] + 0.8 * values[1] - values[0], r0[1] + 0.8 * values[2] - values[1], r0[2] - values[2]]
        assert_close_to_scale(batches[0].advantages[:3].double(), torch.stack(want), FLOAT64_REL, "by hand")


def test_advantages_are_normalized_per_agent_and_turn(tiny_model_dir, tmp_path):
    algo = build(tiny_model_dir, tmp_path, "collm_dc", "strbuild", "algo.num_turns=2", "trainer.prompts_per_step=4")
    batches = algo.advantages(algo.collect(problems(algo, 4)))
    for b in batches:
        for t in (0, 1):
            a = b.advantages[[j for j, turn in enumerate(b.turns) if turn == t]].double()
            assert len(a) == 4 and abs(float(a.mean())) < 1e-5 and abs(float(a.std(unbiased=False)) - 1) < 1e-3


@pytest.mark.parametrize("algo_name", ["collm_cc", "collm_dc"])
def test_a_step_changes_only_the_critics_and_the_actor_adapters(tiny_model_dir, tmp_path, algo_name):
    algo = build(tiny_model_dir, tmp_path, algo_name, "strbuild", "algo.num_turns=2", "algo.learning_rate=1e-2",
                 "algo.critic.learning_rate=1e-2")
    before, heads = snapshot(algo.policies), critic_params(algo)
    algo.update(algo.advantages(algo.collect(problems(algo))))
    moved = changed(before, algo.policies)
    assert all(".lora_" in name for _, name in moved)  # the frozen base never moves
    adapters = {name.split(".lora_")[1].split(".")[1] for _, name in moved}
    critics = {"critic"} if algo_name == "collm_cc" else {"critic_builder1", "critic_builder2"}
    assert adapters == {"agent_builder1", "agent_builder2"} | critics
    after = critic_params(algo)
    for c in algo.critics:
        assert all(not torch.equal(heads[(c.name, f"head.{n}")], after[(c.name, f"head.{n}")]) for n in ("net.0.weight", "net.0.bias"))
        # one critic step per batch, also for the shared centralized critic
        assert {int(s["step"]) for s in c.optimizer.state.values()} == {1}


def test_an_agent_without_advantage_keeps_its_adapter(tiny_model_dir, tmp_path):
    algo = build(tiny_model_dir, tmp_path, "collm_cc", "strbuild", "algo.weight_decay=0", "algo.learning_rate=1e-2")
    batches = algo.advantages(algo.collect(problems(algo)))
    batches[1].advantages = torch.zeros_like(batches[1].advantages)
    before = snapshot(algo.policies)
    algo.update(batches)
    adapters = {name.split(".lora_")[1].split(".")[1] for _, name in changed(before, algo.policies)}
    assert adapters == {"agent_builder1", "critic"}


@pytest.mark.numerics
def test_critic_loss_and_value_clipping_match_the_formula(tiny_model_dir, tmp_path):
    """The critic update's clipped value loss against the formula applied to the values read by
    Critic.values, the model in float64: to FLOAT64_REL (module docstring)."""
    algo = build(tiny_model_dir, tmp_path, "collm_dc", "tldr", "algo.critic.placement=actor", "algo.critic.value_clip=0.05",
                 F64)
    assert algo.policies.dtype == torch.float64
    c = algo.critics[0]
    assert c.adapter == "agent_concise" and c.trunk and all(
        any(p is q for q in algo.policies.adapter_parameters(0, "agent_concise")) for p in c.trunk.values())
    node_prompts = [n.completions[0].prompt_ids for n in algo.collect(problems(algo)).turns[0]]
    v = c.values(node_prompts).double()
    old = v + torch.tensor([-0.5, -0.01, 0.0], dtype=torch.float64)  # only the first is clipped (and worse)
    y = torch.tensor([1.0, -1.0, 0.3], dtype=torch.float64)
    clipped = old + (v - old).clamp(-0.05, 0.05)
    want = 0.6 * torch.maximum((v - y) ** 2, (clipped - y) ** 2).mean()
    assert c.dtype == torch.float64
    stats = c.update(node_prompts, None, y, old)
    assert stats["vf_loss"] == pytest.approx(float(want), rel=FLOAT64_REL)
    assert stats["vf_clipfrac"] == pytest.approx(1 / 3)


def test_separate_critic_is_its_own_fully_trained_model(tiny_model_dir, tmp_path):
    algo = build(tiny_model_dir, tmp_path, "collm_cc", "tldr", "algo.critic.placement=separate",
                 "algo.critic.learning_rate=1e-2")
    c = algo.critics[0]
    assert c.model is not algo.policies.models[0] and c.adapter is None
    base_weights = {n: p.detach().clone() for n, p in c.model.named_parameters()}
    actor_before = snapshot(algo.policies)
    algo.update(algo.advantages(algo.collect(problems(algo))))
    assert any(not torch.equal(base_weights[n], p) for n, p in c.model.named_parameters() if "layers" in n)
    moved = changed(actor_before, algo.policies)
    assert moved and all("lora_" in name for _, name in moved)  # the actors' base stays frozen


def test_bad_critic_settings_name_the_fix(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="use algo=collm_dc"):
        validate(compose_config(overrides(tiny_model_dir, tmp_path, "collm_cc", "tldr", "algo.critic.placement=actor")))
    with pytest.raises(UserError, match="algo.critic.placement"):
        validate(compose_config(overrides(tiny_model_dir, tmp_path, "collm_cc", "tldr", "algo.critic.placement=model")))
    with pytest.raises(UserError, match="set algo.clip_eps"):
        validate(compose_config(overrides(tiny_model_dir, tmp_path, "collm_dc", "tldr", "algo.ppo_epochs=2")))


TASKS = ["humaneval", "coophumaneval", "tldr", "arxiv", "sokoban", "plan_path", "strbuild"]


@pytest.mark.parametrize("algo_name", ["collm_cc", "collm_dc"])
@pytest.mark.parametrize("task", TASKS)
def test_actor_critic_trains_on_every_task(tiny_model_dir, tmp_path, algo_name, task):
    extra = ["algo.num_turns=2"] if task not in ("tldr", "arxiv") else []
    if task in ("humaneval", "coophumaneval"):
        extra += ["task.data.train_split='test[33:37]'"]
    train(compose_config(overrides(tiny_model_dir, tmp_path, algo_name, task, "trainer.eval_before=false", *extra)))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "train/reward" in r)
    for key in ("loss", "entropy", "completions/mean_length", "critic/vf_loss", "critic/values/mean",
                "critic/returns/mean", "critic/vf_explained_var", "episode/mean_turns"):
        assert f"train/{key}" in row, key
    agent = "aux" if "humaneval" in task else None
    if agent:
        assert f"train/{agent}/loss" in row
    assert "train/frac_reward_zero_std" not in row  # groups of one sample: not a meaningful metric
    assert any(k.startswith("eval/") for r in rows for k in r)


def test_ppo_option_clips_the_ratio(tiny_model_dir, tmp_path):
    train(compose_config(overrides(tiny_model_dir, tmp_path, "collm_cc", "tldr", "algo.clip_eps=0.2", "algo.ppo_epochs=2",
                                   "trainer.eval_before=false", "trainer.eval_after=false")))
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert "train/clip_ratio/region_mean" in row and "train/concise/clip_ratio/region_mean" in row


def test_resume_restores_the_critic_exactly(tiny_model_dir, tmp_path):
    def run(run_dir, steps, *extra):
        train(compose_config(overrides(tiny_model_dir, run_dir, "collm_cc", "tldr", f"trainer.max_steps={steps}",
                                       "trainer.eval_before=false", "trainer.eval_after=false",
                                       "algo.critic.learning_rate=1e-3", "trainer.deterministic=true", *extra)))
        return torch.load(run_dir / "checkpoint.pt", weights_only=False)

    straight = run(tmp_path / "a", 2)
    run(tmp_path / "b", 1)
    resumed = run(tmp_path / "b", 2, "trainer.resume=true")
    a, b = straight["algorithm"]["critics"]["critic"], resumed["algorithm"]["critics"]["critic"]
    assert all(torch.equal(a["trunk"][k], b["trunk"][k]) for k in a["trunk"])
    assert all(torch.equal(a["head"][k], b["head"][k]) for k in a["head"])
    assert a["optimizer"]["state"][0]["step"] == b["optimizer"]["state"][0]["step"] == 2


def test_samples_with_unshared_prompts_share_micro_batches():
    from marl_llm.algos.update import micro_batches
    from marl_llm.rollout.base import Completion

    def comp(prompt, n):
        return Completion(torch.tensor(prompt), torch.ones(n, dtype=torch.long), "", False)

    comps = [comp([1, 2], 3), comp([1, 2], 5), comp([7], 1), comp([8, 9, 9], 4), comp([5], 2), comp([6], 9)]
    chunks = micro_batches(comps, 2)
    assert [0, 1] in chunks  # siblings of one prompt stay together
    singles = [c for c in chunks if 0 not in c]
    assert sorted(j for c in singles for j in c) == [2, 3, 4, 5] and all(len(c) == 2 for c in singles)
    assert singles[0] == [2, 4]  # packed by length: the two shortest first
