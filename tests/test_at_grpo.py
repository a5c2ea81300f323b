"""AT-GRPO: tree sampling per (environment, agent, turn), one test per defect of the public code,
and the basics (advantages, filtering, policy mapping, end to end on the tiny model)."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from conftest import compose_config, make_policies, tiny_overrides
from marl_llm.algos.at_grpo import ATGRPO, filter_groups, group_advantages
from marl_llm.algos.base import AgentBatch
from marl_llm.rollout.base import Completion, GenRequest
from marl_llm.rollout.decode import HFRollout
from marl_llm.rollout.sampling import SamplingParams
from marl_llm.tasks.base import Problem
from marl_llm.tasks.turn_based import CandidateGroup, Episode, Outcome, TurnTask, run_episodes

from test_agents import changed, snapshot


# ------------------------------------------------------------------------- a checkable toy env
class Counter:
    """The state: a value that agents add to, and every addition applied to it."""

    def __init__(self):
        self.value = 0
        self.applied: list[int] = []


class CounterEpisode(Episode):
    """Two agents add numbers (their text) to a counter; done at >= target or after max turns.
    team = 1 when the target is reached; local = minus the distance to the target."""

    def __init__(self, uid: str, target: int, max_turns: int):
        self.uid, self.target, self.max_turns = uid, target, max_turns
        self.state = Counter()
        self.turn = 0
        self.scored_states: list[Counter] = []

    @property
    def done(self):
        return self.state.value >= self.target or self.turn >= self.max_turns

    @property
    def success(self):
        return self.state.value >= self.target

    def observation(self, agent):
        return f"{self.uid} value={self.state.value} agent={agent}"

    def evaluate(self, agent, texts):
        outcomes = []
        for t in texts:
            s = copy.deepcopy(self.state)
            s.value += int(t)
            s.applied.append(int(t))
            self.scored_states.append(s)
            outcomes.append(Outcome(float(s.value >= self.target), -abs(self.target - s.value) / 10, s))
        return outcomes

    def commit(self, agent, outcome):
        self.state = outcome.state

    def end_turn(self):
        self.turn += 1


class CounterTask(TurnTask):
    agent_names = ("a", "b")

    def __init__(self, target=5, max_turns=3):
        super().__init__(type("Cfg", (), {"name": "counter", "max_turns": max_turns, "reward_shift": 0.0})())
        self.target = target
        self.episodes: list[CounterEpisode] = []

    def load_split(self, split):
        return [Problem(f"counter/{split}/{i}", {}) for i in range(3)]

    def new_episode(self, problem):
        e = CounterEpisode(problem.uid, self.target, self.num_turns)
        self.episodes.append(e)
        return e


def fake_generate(texts_for):
    """generate() that answers request j with texts_for(request, j), as Completion objects."""
    def generate(requests: list[GenRequest]) -> list[Completion]:
        out = []
        for j, r in enumerate(requests):
            text = texts_for(r, j)
            out.append(Completion(torch.tensor([1, 2, len(r.message)]), torch.tensor([3, 4]), text, False))
        return out
    return generate


SAMPLING = [SamplingParams(), SamplingParams()]


def test_stepping_scoring_and_selection_use_the_same_state_object():
    task = CounterTask(target=5, max_turns=3)
    # Candidates cycle 1, 2, 3: the best (closest to 5 without the team bonus) is chosen each time.
    tree, groups = run_episodes(task, fake_generate(lambda r, j: str(1 + j % 3)), task.load_split("train"),
                                SAMPLING, num_turns=3, k=3)
    for e in task.episodes:
        # The committed state IS one of the scored objects (no re-stepping of another copy) ...
        assert any(e.state is s for s in e.scored_states)
        # ... and its history is exactly the chosen candidates: turn 1: a adds 3 (->3), b adds 2 (->5, solved).
        assert e.state.applied == [3, 2] and e.state.value == 5 and e.done and e.success
    # Episodes stopped when done fired: one turn only, and the observation of b showed a's move.
    assert len(tree.turns) == 1
    assert all("value=3 agent=1" in n.messages[1] for n in tree.turns[0])
    assert all(n.terminated and n.reward.passed for n in tree.turns[0])


def test_group_keys_never_merge_environments():
    task = CounterTask(target=100, max_turns=2)
    problems = task.load_split("train")
    tree, groups = run_episodes(task, fake_generate(lambda r, j: str(j % 4)), problems, SAMPLING, num_turns=2, k=4)
    keys = [g.key for g in groups]
    assert len(keys) == len(set(keys)) == len(problems) * 2 * 2  # envs x agents x turns
    for g in groups:
        uid, agent, turn = g.key
        assert len(g.completions) == 4
        # every candidate of a group came from the same environment's prompt (same prompt ids)
        assert len({tuple(c.prompt_ids.tolist()) for c in g.completions}) == 1
    assert {g.key[0].split("/", 1)[1] for g in groups} == {p.uid for p in problems}


def test_one_level_drawn_twice_is_two_environments():
    task = CounterTask(target=100, max_turns=1)
    problem = task.load_split("train")[0]
    _, groups = run_episodes(task, fake_generate(lambda r, j: str(j % 3)), [problem, problem], SAMPLING,
                             num_turns=1, k=3)
    assert len({g.key for g in groups}) == len(groups) == 4  # 2 instances x 2 agents
    assert all(len(g.completions) == 3 for g in groups)


def test_random_selection_is_seeded():
    def run(seed):
        task = CounterTask(target=100, max_turns=2)
        _, groups = run_episodes(task, fake_generate(lambda r, j: str(j % 4)), task.load_split("train"), SAMPLING,
                                 num_turns=2, k=4, select="random", rng=random.Random(seed))
        return [g.chosen for g in groups]

    assert run(1) == run(1) and len(set(run(1))) > 1


def test_group_advantages_and_filters():
    adv = group_advantages([1.0, 2.0, 3.0, 4.0], eps=1e-6, unbiased=True)
    std = torch.tensor([1.0, 2.0, 3.0, 4.0]).std(unbiased=True).item()
    assert adv == pytest.approx([(x - 2.5) / (std + 1e-6) for x in (1, 2, 3, 4)])
    assert group_advantages([2.0, 2.0], 1e-6, True) == [0.0, 0.0]
    groups = [CandidateGroup(("e", 0, 0), [], [1.0, 1.0], 0), CandidateGroup(("e", 1, 0), [], [0.0, 1.0], 1),
              CandidateGroup(("f", 0, 0), [], [5.0, 6.0], 1), CandidateGroup(("f", 1, 0), [], [-3.0, 0.0], 1)]
    assert [g.key for g in filter_groups(groups, True, 0.0)] == [("e", 1, 0), ("f", 0, 0), ("f", 1, 0)]
    assert [g.key for g in filter_groups(groups, True, 0.34)] == [("e", 1, 0), ("f", 0, 0)]
    assert len(filter_groups(groups, False, 0.0)) == 4


# ------------------------------------------------------------------------ policies and updates
def at_grpo(policies, task, *overrides):
    cfg = compose_config(["algo=at_grpo", "run_dir=/tmp/x", *overrides]).algo
    return ATGRPO(cfg, task, policies, HFRollout(policies), micro_batch_size=2)


def real_batches(policies, agents_with_samples):
    ro = HFRollout(policies)
    batches = []
    for i in range(len(policies.agents)):
        comps = []
        if i in agents_with_samples:
            comps = ro.generate([GenRequest(i, f"state {j}", SamplingParams(temperature=1.0, max_new_tokens=5))
                                 for j in range(4)])
        batches.append(AgentBatch(i, comps, torch.tensor([1.0, -1.0, 0.5, -0.5][:len(comps)]), [0] * len(comps)))
    return batches


@pytest.mark.parametrize("agent", [0, 1])
def test_per_role_update_changes_only_the_owning_adapter(tiny_model_dir, agent):
    policies = make_policies(tiny_model_dir, agents=("a", "b"))
    algo = at_grpo(policies, CounterTask(), "algo.adapters=per_agent", "algo.mini_batch_size=2", "algo.ppo_epochs=2",
                   "algo.learning_rate=1e-2")
    before = snapshot(policies)
    stats = algo.update(real_batches(policies, {agent}))
    diff = changed(before, policies)
    adapter = policies.agents[agent].adapter
    assert diff and all(f".{adapter}." in n for _, n in diff), sorted(diff)[:3]
    name = policies.agents[agent].name
    assert stats[f"{name}/optimizer_steps"] == 4.0  # 4 samples / mini-batch 2 x 2 epochs
    assert f"{policies.agents[1 - agent].name}/loss" not in stats


def test_policy_map_routes_each_agent_to_its_policy(tiny_model_dir):
    policies = make_policies(tiny_model_dir, agents=("tool", "plan", "critic"),
                             policy_map={"tool": "coder", "plan": "thinker", "critic": "thinker"})
    assert [a.adapter for a in policies.agents] == ["policy_coder", "policy_thinker", "policy_thinker"]
    assert len(policies.optimizers) == 2
    algo = at_grpo(policies, CounterTask(), "algo.learning_rate=1e-2")
    before = snapshot(policies)
    stats = algo.update(real_batches(policies, {2}))  # only the critic has samples
    diff = changed(before, policies)
    assert diff and all(".policy_thinker." in n for _, n in diff)
    assert "thinker/loss" in stats and "coder/loss" not in stats
    with pytest.raises(ValueError, match="policy_map maps"):
        make_policies(tiny_model_dir, agents=("tool", "plan"), policy_map={"tool": "x"})


def test_shared_mode_trains_one_adapter_on_every_agents_samples(tiny_model_dir):
    policies = make_policies(tiny_model_dir, agents=("a", "b"), adapters="shared")
    algo = at_grpo(policies, CounterTask(), "algo.learning_rate=1e-2", "algo.mini_batch_size=null")
    batches = real_batches(policies, {0, 1})
    before = snapshot(policies)
    stats = algo.update(batches)
    assert stats["shared/num_tokens"] == sum(len(c.completion_ids) for b in batches for c in b.completions)
    assert stats["shared/optimizer_steps"] == 1.0 and len(policies.optimizers) == 1
    assert all(".shared." in n for _, n in changed(before, policies))


# ------------------------------------------------------------------------------- end to end
def run_train(tiny_model_dir, run_dir, task, *extra):
    from marl_llm.training.trainer import train

    overrides = [o for o in tiny_overrides(tiny_model_dir, run_dir) if not o.startswith(("algo.", "task."))]
    cfg = compose_config(["algo=at_grpo", f"task={task}", *overrides, "algo.sampling.max_new_tokens=6",
                          "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", "algo.num_branches=2", *extra])
    train(cfg)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("task", ["sokoban", "plan_path"])
def test_at_grpo_end_to_end_on_the_grid_games(tiny_model_dir, tmp_path, task):
    rows = run_train(tiny_model_dir, tmp_path, task, "task.max_turns=2", "task.num_eval_levels=2")
    train_row = next(r for r in rows if "train/reward" in r)
    assert train_row["train/groups"] >= 2 * 2 and "train/success_rate" in train_row
    assert "train/tool/reward_mixed" in train_row and "train/turn_1/reward" in train_row
    evals = [r for r in rows if "eval/success_rate" in r]
    assert len(evals) == 2 and all(0.0 <= r["eval/success_rate"] <= 1.0 for r in evals)


def test_at_grpo_on_a_joint_reward_task_expands_only_the_best(tiny_model_dir, tmp_path):
    rows = run_train(tiny_model_dir, tmp_path, "coophumaneval", "algo.num_turns=2", "algo.num_branches=3")
    train_row = next(r for r in rows if "train/reward" in r)
    # 1 problem x 2 agents x 2 turns; turn 2 expands only the best of 3 joint actions.
    assert train_row["train/groups"] == 4.0
    assert "eval/pass@1" in rows[0]


def test_prompt_only_baselines_refuse_turn_based_tasks(tiny_model_dir, tmp_path):
    from marl_llm.config import UserError
    from marl_llm.training.trainer import train

    cfg = compose_config(["algo=parallel", "task=sokoban", *[o for o in tiny_overrides(tiny_model_dir, tmp_path)
                                                             if not o.startswith(("task.", "algo."))]])
    with pytest.raises(UserError, match="use algo=at_grpo"):
        train(cfg)


# -------------------------------------------------- MAGRPO and one agent on turn-based tasks
def test_episode_tree_children_continue_from_their_parents_state():
    from marl_llm.tasks.turn_based import collect_episode_tree

    task = CounterTask(target=100, max_turns=2)
    # Every request adds 1 + (its index mod 2): forks of one parent get different additions.
    tree = collect_episode_tree(task, fake_generate(lambda r, j: str(1 + j % 2)), task.load_split("train")[:1],
                                [2, 2], SAMPLING)
    first, second = tree.turns
    assert len(first) == 2 and len(second) == 4
    for child in second:
        parent = first[child.parent]
        # the parent's committed value after its turn (both agents' additions) ...
        value = sum(int(c.text) for c in parent.completions)
        # ... is what the child's first agent observed
        assert f"value={value} agent=0" in child.messages[0]
        assert child.reward.total == pytest.approx(sum(
            (-abs(100 - (value + sum(int(c.text) for c in child.completions[:i + 1]))) / 10) for i in range(2)))
    assert all(n.terminated and n.reward.passed is False for n in second)


@pytest.mark.parametrize("game", ["sokoban", "plan_path"])
def test_magrpo_with_one_role_on_the_grid_games(tiny_model_dir, tmp_path, game):
    from marl_llm.training.trainer import train

    overrides = [o for o in tiny_overrides(tiny_model_dir, tmp_path) if not o.startswith("task.")]
    cfg = compose_config([f"task={game}", "task.roles=[plan]", "task.max_turns=2", "task.num_eval_levels=2",
                          "algo.num_turns=2", *overrides])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_row = next(r for r in rows if "train/reward" in r)
    assert "train/plan/loss" in train_row and "train/tool/loss" not in train_row
    assert "eval/success_rate" in rows[0]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all("tool agent" not in s["plan/prompt"] and "in a team" not in s["plan/prompt"] for s in samples)


@pytest.mark.parametrize("algo,extra,match", [("single", [], "task.roles=\\[plan\\]"),
                                              ("magrpo", ["algo.joint_mode=cross", "algo.num_turns=1"], "joint_mode")])
def test_turn_based_tasks_refuse_what_does_not_apply(tiny_model_dir, tmp_path, algo, extra, match):
    from marl_llm.config import UserError
    from marl_llm.training.trainer import train

    overrides = [o for o in tiny_overrides(tiny_model_dir, tmp_path) if not o.startswith("task.")]
    cfg = compose_config([f"algo={algo}", "task=sokoban", *overrides, *extra])
    with pytest.raises(UserError, match=match):
        train(cfg)


def test_bad_roles_name_the_fix():
    from marl_llm.config import UserError
    from marl_llm.tasks import build_task

    cfg = compose_config(["task=sokoban", "task.roles=[plan,coder]", "run_dir=/tmp/x"]).task
    with pytest.raises(UserError, match=r"task.roles=\['plan', 'coder'\]: use \[tool, plan\]"):
        build_task(cfg)


# ---------------------------------------------------------------------- what the metrics mean
class OwnRewardTask:
    """Two agents answer digits; the team reward is their sum / 10, and each agent has its own
    reward (task=env's role rewards): +1 for the first agent, -1 for the second."""

    agent_names = ("a", "b")
    num_agents = 2
    name = "own_reward"
    reward_shift = -4.0  # AT-GRPO's scores never see it; the team reward is logged unshifted

    def initial_prompts(self, problem):
        return [f"{problem.uid} a", f"{problem.uid} b"]

    def history_rewards(self, problems, histories):
        from marl_llm.tasks.base import JointReward

        return [JointReward(sum(int(agent[-1].action) for agent in hist) / 10, local=[1.0, -1.0]) for hist in histories]

    def next_prompts(self, problem, histories, reward):
        return [f"{problem.uid} again a", f"{problem.uid} again b"]


def metrics_of(task, texts, *overrides):
    from types import SimpleNamespace

    algo = ATGRPO(compose_config(["algo=at_grpo", *overrides]).algo, task, SimpleNamespace(seed=0),
                  SimpleNamespace(generate=fake_generate(texts)))
    tree = algo.collect(task.load_split("train")[:1] if hasattr(task, "load_split") else [Problem("p", {})])
    return tree, algo.rollout_metrics(tree)


def test_train_reward_is_the_team_reward_and_the_mixed_scores_have_their_own_names():
    """Issue 44: train/reward read alpha x team + own (-0.75 where the team reward was 0.25) and was
    plotted beside MAGRPO's team reward. Now reward, its std, per turn and joint_actions are MAGRPO's
    (reward_metrics of the same tree) and the candidates' scores are <...>/reward_mixed."""
    from marl_llm.training.rollout_metrics import reward_metrics

    task = OwnRewardTask()
    tree, m = metrics_of(task, lambda r, j: str(j % 3), "algo.alpha=0.5", "algo.num_branches=3", "algo.num_turns=2")
    team = [n.reward.total for n in tree.nodes()]
    assert len(team) == 6 and m["joint_actions"] == 6.0  # 3 joint actions per turn, the best one continued
    magrpo = reward_metrics(tree, task.reward_shift)
    for key in ("reward", "reward_std", "turn_1/reward", "turn_2/reward", "frac_reward_zero_std", "joint_actions"):
        assert m[key] == pytest.approx(magrpo[key]), key
    assert m["reward"] == pytest.approx(sum(team) / 6) and "reward_shifted" not in m
    a = [0.5 * r + 1.0 for r in team]
    b = [0.5 * r - 1.0 for r in team]
    assert m["a/reward_mixed"] == pytest.approx(sum(a) / 6) and m["b/reward_mixed"] == pytest.approx(sum(b) / 6)
    assert m["reward_mixed"] == pytest.approx((sum(a) + sum(b)) / 12) != pytest.approx(m["reward"])
    assert m["turn_2/reward_mixed"] == pytest.approx(sum(0.5 * n.reward.total for n in tree.turns[1]) / 3)
    assert not any(k.endswith("/reward") and k.split("/")[0] in task.agent_names for k in m)


def test_turn_based_train_reward_is_the_committed_joint_actions_reward_whatever_alpha():
    """On a turn-based task the logged joint action's reward is the agents' summed team + own
    rewards, as MAGRPO's episode tree and the evaluation score it, not the alpha-mixed scores; each
    (env, turn) stands for K joint actions' generations; no sibling groups, so no
    frac_reward_zero_std."""
    task = type("Unshifted", (CounterTask,), {"reward_shift": 0.0})(target=4, max_turns=2)
    tree, m = metrics_of(task, lambda r, j: str(1 + j % 3), "algo.alpha=3.0", "algo.num_branches=3")
    # a's candidates 1, 2, 3 (own: -0.3, -0.2, -0.1): 3 committed; b's reach 4, 5, 6, each solving
    # (team 1, scored 3 x 1 + own: 3.0, 2.9, 2.8): 1 committed. The joint action: (0 - 0.1) + (1 + 0).
    [[node]] = tree.turns
    assert node.reward.total == pytest.approx(0.9) and m["reward"] == pytest.approx(0.9)
    assert m["joint_actions"] == 3  # K=3 joint actions' generations for the one (env, turn)
    assert "frac_reward_zero_std" not in m and m["frac_reward_mixed_zero_std"] == 0.0
    mixed = [x for g in tree.groups for x in g.scores]
    assert m["reward_mixed"] == pytest.approx(sum(mixed) / len(mixed))
