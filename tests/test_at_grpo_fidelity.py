"""The AT-GRPO presets train what PettingLLMs' release trains (pettingllms-ai/PettingLLMs commit
a054fb18b83f4dc7c1d49aba3b71669d1f93ca71; docs/fidelity_at_grpo.md is the same table with the
files each value comes from), the group filter works as the reference's mean filter, and the
reference's -2 for an unusable move list is a switch on the grid games."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, TEST_DEVICE, compose_config
from marl_llm.algos.at_grpo import ATGRPO, ATTree, filter_groups
from marl_llm.configure import validate
from marl_llm.envs.plan_path import PlanPathEnv
from marl_llm.envs.sokoban import SokobanEnv
from marl_llm.models.policies import Agent
from marl_llm.tasks.base import Problem
from marl_llm.tasks.grid_games import PlanPathTask, SokobanTask
from marl_llm.tasks.turn_based import CandidateGroup

REFERENCE_COMMIT = "a054fb18b83f4dc7c1d49aba3b71669d1f93ca71"

# ------------------------------------------------------------------------------- the presets
# What the reference trains. 1.7B: scripts/train/game/sokoban_prompt_1.7B_at_grpo.sh on
# pettingllms/config/stateful/stateful_L1_prompt.yaml (shared) / stateful_L2_lora.yaml (per-role
# LoRA), pettingllms/config/ppo_trainer/eval.yaml (optimiser, PPO, LoRA targets); 8B: the 8B game
# script "scripts/train/game/plan_path_L1_prompt_8B_grpo copy.sh" (full fine-tuning, K=8, 4096
# tokens), L1 (shared) / stateful_L3_model.yaml (per-role models) sampling.
COMMON = {
    "algo.name": "at_grpo", "algo.alpha": 1.0, "task.roles": ["tool", "plan"], "task.max_turns": 4,
    # prompts: chat template, Qwen3 thinking off (enable_thinking: false; async_generate.py)
    "model.chat_template": True, "model.chat_template_kwargs": {"enable_thinking": False},
    # sampling (train_llm_config): top_p 0.9, top_k 20
    "algo.sampling.top_p": 0.9, "algo.sampling.top_k": 20,
    # optimiser and schedule (eval.yaml actor.optim, actor.grad_clip)
    "algo.learning_rate": 5e-6, "algo.weight_decay": 0.01, "algo.max_grad_norm": 1.0,
    "algo.lr_scheduler": "cosine", "algo.warmup_steps": 10, "algo.min_lr_ratio": 0.3,
    # PPO (eval.yaml actor.*: clip_ratio 0.2, token-mean, ppo_epochs 1, ppo_mini_batch_size 16)
    "algo.clip_eps": 0.2, "algo.loss_aggregation": "token_mean", "algo.ppo_epochs": 1, "algo.mini_batch_size": 16,
    # group filter (filter_method: mean, filter_ratio: 0.5; no zero-std filter in mean mode)
    "algo.filter_low_mean_frac": 0.5, "algo.filter_zero_std": False,
    # batch and budget (the scripts' training.*): 32 environments, 200 steps, validation every 10
    "trainer.prompts_per_step": 32, "trainer.max_steps": 200, "trainer.eval_every": 10,
    "trainer.eval_before": True, "trainer.eval_num_samples": 0,
    # validation: 100 fixed levels (StatefulEnvBatch validate: range(100), seeds from 100000)
    "task.num_eval_levels": 100, "task.eval_seed": 100000,
    # tool programs: 20 s (tool_agent.py); unusable move list: -2 (plan_agent.py / tool_agent.py)
    "task.sandbox.timeout_s": 20.0, "task.unparseable_plan_reward": -2.0,
}
LORA_ALL_LINEAR = {"algo.lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["all-linear"]}}
SIZE_1_7B = {"model.hub_id": "Qwen/Qwen3-1.7B", "algo.num_branches": 4, "algo.sampling.max_new_tokens": 2048,
             **LORA_ALL_LINEAR}
SIZE_8B = {"model.hub_id": "Qwen/Qwen3-8B", "algo.num_branches": 8, "algo.sampling.max_new_tokens": 4096,
           "algo.lora": None}
TASKS = {"sokoban": {"task.name": "sokoban", "task.size": 6, "task.num_boxes": 1, "task.max_moves": 200},
         "plan_path": {"task.name": "plan_path", "task.size": 10, "task.wall_prob": 0.22, "task.max_moves": 10000}}
# Shared policy: stateful_L1_prompt.yaml samples at T=1.5; per-role (L2 LoRA, L3 models) at T=1.0.
MODES = {"": {"algo.adapters": "per_agent", "algo.sampling.temperature": 1.0},
         "_shared": {"algo.adapters": "shared", "algo.sampling.temperature": 1.5}}
EXPECTED = {f"at_grpo_{task}{mode}{size}_paper": {**COMMON, **TASKS[task], **MODES[mode],
                                                  **(SIZE_8B if size else SIZE_1_7B)}
            for task in TASKS for mode in MODES for size in ("", "_qwen3_8b")}


def preset_names() -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / "experiment").glob("at_grpo_*.yaml"))


def test_every_at_grpo_preset_has_expected_values():
    assert set(preset_names()) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_matches_the_reference(name):
    cfg = compose_config([f"experiment={name}", "run_dir=/tmp/x"])
    validate(cfg)

    def value(key):
        v = OmegaConf.select(cfg, key)
        return OmegaConf.to_container(v) if OmegaConf.is_config(v) else v

    got = {key: value(key) for key in EXPECTED[name]}
    assert got == EXPECTED[name]
    assert cfg.algo.num_turns == cfg.task.max_turns


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_header_names_the_reference_commit(name):
    text = (REPO / "conf" / "experiment" / f"{name}.yaml").read_text()
    assert REFERENCE_COMMIT in text and "docs/fidelity_at_grpo.md" in text
    if EXPECTED[name]["algo.lora"] is None:
        assert "memory" in text  # full fine-tuning of 8B: say what it needs


def test_doc_names_the_commit_and_every_preset():
    doc = (REPO / "docs" / "fidelity_at_grpo.md").read_text()
    assert REFERENCE_COMMIT in doc
    assert all(name in doc for name in EXPECTED)


# --------------------------------------------------------------------------------- the filter
def group(env: str, agent: int, scores: list[float]) -> CandidateGroup:
    return CandidateGroup((env, agent, 0), [f"{env}/{agent}/{j}" for j in range(len(scores))], scores, 0)


# Hand-computed case. Means: g1 1.0 (all equal: zero std), g2 1.0, g3 -1.0, g4 4.0, g5 1.0.
GROUPS = [group("e0", 0, [1.0, 1.0, 1.0, 1.0]),    # g1: tool
          group("e0", 1, [-2.0, 0.0, 2.0, 4.0]),   # g2: plan
          group("e1", 0, [-2.0, -2.0, 0.0, 0.0]),  # g3: tool
          group("e1", 1, [3.0, 5.0, 5.0, 3.0]),    # g4: plan
          group("e2", 0, [0.0, 2.0, 0.0, 2.0])]    # g5: tool


def keys(groups):
    return [g.key[:2] for g in groups]


def test_low_mean_filter_by_hand():
    # One pool of 5: int(5 * 0.5) = 2 dropped, the lowest means: g3 (-1.0), then of the three
    # tied at 1.0 the one collected first (g1; a stable sort, as the reference's sorted()).
    assert keys(filter_groups(GROUPS, False, 0.5)) == [("e0", 1), ("e1", 1), ("e2", 0)]
    # Per model (tool: g1 g3 g5, plan: g2 g4): int(3 * 0.5) = 1 and int(2 * 0.5) = 1 dropped.
    by_agent = filter_groups(GROUPS, False, 0.5, pool=lambda g: g.key[1])
    assert keys(by_agent) == [("e0", 0), ("e1", 1), ("e2", 0)]
    # The mean filter keeps a zero-std group (g1 survives above); zero-std filtering is separate
    # and comes first: g1 out, then int(4 * 0.5) = 2 of g2 g3 g4 g5 (g3, then g2 of the tie).
    assert keys(filter_groups(GROUPS, True, 0.5)) == [("e1", 1), ("e2", 0)]
    assert keys(filter_groups(GROUPS, False, 0.0)) == keys(GROUPS)
    # int() floors: 3 groups at 0.5 drop 1, 1 group drops none.
    assert len(filter_groups(GROUPS[:3], False, 0.5)) == 2 and len(filter_groups(GROUPS[:1], False, 0.5)) == 1


def algo_with(model_of_agent: list[int], *overrides: str) -> ATGRPO:
    """An ATGRPO with just what `advantages` reads: its config, the task's agents, the policies' map."""
    algo = ATGRPO.__new__(ATGRPO)
    algo.cfg = compose_config(["algo=at_grpo", "run_dir=/tmp/x", "algo.filter_low_mean_frac=0.5", *overrides]).algo
    algo.task = SimpleNamespace(num_agents=2)
    names = ("tool", "plan")
    algo.policies = SimpleNamespace(agents=[Agent(n, m, f"agent_{n}") for n, m in zip(names, model_of_agent)])
    return algo


def test_filter_runs_before_the_advantages_within_each_trained_model():
    # LoRA adapters on one base (model 0): one pool, as PettingLLMs' single trainer.
    batches = algo_with([0, 0]).advantages(ATTree([], [], list(GROUPS)))
    assert batches[0].completions == [f"e2/0/{j}" for j in range(4)]
    assert batches[1].completions == [f"e0/1/{j}" for j in range(4)] + [f"e1/1/{j}" for j in range(4)]
    s2 = torch.tensor([-2.0, 0.0, 2.0, 4.0]).std().item()  # unbiased, as verl
    s4 = torch.tensor([3.0, 5.0, 5.0, 3.0]).std().item()
    want = [-3 / s2, -1 / s2, 1 / s2, 3 / s2, -1 / s4, 1 / s4, 1 / s4, -1 / s4]
    assert batches[1].advantages.tolist() == pytest.approx(want, rel=1e-5)
    assert batches[0].advantages.tolist() == pytest.approx([-1 / s4, 1 / s4, -1 / s4, 1 / s4], rel=1e-5)
    # Fully fine-tuned per-role policies are two models: each ranks its own groups.
    batches = algo_with([0, 1], "algo.lora=null").advantages(ATTree([], [], list(GROUPS)))
    assert [c.split("/")[0] for c in batches[0].completions[::4]] == ["e0", "e2"]
    assert batches[0].advantages[:4].tolist() == [0.0] * 4  # g1 kept, zero std: advantage 0
    assert [c.split("/")[0] for c in batches[1].completions[::4]] == ["e1"]


# ------------------------------------------------------------------ the unusable-plan penalty
def make_task(name: str, penalty: str):
    cfg = compose_config([f"experiment=at_grpo_{name}_paper", "run_dir=/tmp/x",
                          f"task.unparseable_plan_reward={penalty}"])
    return (SokobanTask if name == "sokoban" else PlanPathTask)(cfg.task)


def hand_made(name: str):
    # An "U" from the start is invalid in both (into the wall / off the grid).
    if name == "sokoban":
        return SokobanEnv.from_ascii(["#####", "#@$.#", "#   #", "#####"])
    return PlanPathEnv.from_ascii(["S.G", "..."])


PLAN_TEXTS = {"no #### line": ("I would go right.", True),
              "unparseable": ("thinking...\n#### [X, Q]", True),
              "empty list": ('done\n#### []', True),
              "invalid move": ('#### ["U"]', False)}


@pytest.mark.parametrize("name", ["sokoban", "plan_path"])
@pytest.mark.parametrize("penalty", ["null", "-2.0"])
def test_plan_penalty_switch(name, penalty):
    task = make_task(name, penalty)
    episode = task.new_episode(Problem(f"{name}/train/0", {"seed": 0}))
    episode.env = hand_made(name)
    plan = task.agent_names.index("plan")
    outcomes = dict(zip(PLAN_TEXTS, episode.evaluate(plan, [t for t, _ in PLAN_TEXTS.values()])))
    invalid = outcomes["invalid move"].local
    assert invalid < 0 and outcomes["invalid move"].team == 0.0
    for label, (_, unusable) in PLAN_TEXTS.items():
        if not unusable:
            continue
        o = outcomes[label]
        assert o.info["actions"] == [] and o.team == 0.0
        if penalty == "null":
            assert o.local == 0.0 > invalid  # the old ranking: doing nothing beats an invalid move
        else:
            assert o.local == -2.0 < invalid
            assert o.score(1.0) == -2.0  # alpha * team + local


def run(stdout: str, status: str = "passed"):
    return SimpleNamespace(stdout=stdout, status=SimpleNamespace(value=status))


TOOL_CASES = {"no program": ("", run(""), True),
              "prints no list": ("print('hi')", run("hi\n"), True),
              "crashed": ("1/0", run("", "error"), True),
              "prints []": ("print([])", run("[]\n"), False),  # a valid plan of no moves (as the reference)
              "invalid move": ("print(['U'])", run('["U"]\n'), False)}


@pytest.mark.parametrize("name", ["sokoban", "plan_path"])
@pytest.mark.parametrize("penalty", ["null", "-2.0"])
def test_tool_penalty_switch(name, penalty):
    task = make_task(name, penalty)
    episode = task.new_episode(Problem(f"{name}/train/0", {"seed": 0}))
    episode.env = hand_made(name)
    codes = [c for c, _, _ in TOOL_CASES.values()]
    outcomes = dict(zip(TOOL_CASES, episode.tool_outcomes(codes, [r for _, r, _ in TOOL_CASES.values()])))
    assert outcomes["prints []"].local == 0.0 and outcomes["invalid move"].local < 0
    for label, (_, _, unusable) in TOOL_CASES.items():
        if unusable:
            assert outcomes[label].local == (0.0 if penalty == "null" else -2.0), label


def test_grid_tasks_default_to_no_penalty():
    for name in ("sokoban", "plan_path"):
        cfg = compose_config([f"task={name}", "algo=at_grpo", "run_dir=/tmp/x"])
        assert cfg.task.unparseable_plan_reward is None


# --------------------------------------------------------------------------- LoRA all-linear
def test_lora_all_linear_reaches_every_linear_layer(tiny_model_dir):
    from marl_llm.models.policies import AgentPolicies

    model_cfg = OmegaConf.create(dict(name="tiny", path=str(tiny_model_dir), embedded=False, hub_id=None, dtype="auto",
                                      device=TEST_DEVICE, attn_implementation="sdpa", trust_remote_code=False,
                                      agent_bases=None))
    algo_cfg = OmegaConf.create(dict(adapters="per_agent", learning_rate=1e-3, weight_decay=0.01, policy_map={},
                                     lora=dict(r=2, alpha=4, dropout=0.0, target_modules=["all-linear"])))
    policies = AgentPolicies(("tool", "plan"), model_cfg, algo_cfg, seed=0)
    assert policies.lora.target_modules == "all-linear"  # resolved per model, on copies
    model = policies.models[0]
    wrapped = {n.split(".")[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # Both roles' adapters sit on the same layers (no LoRA on LoRA, not on the output head).
    per_adapter = {a: {n.split(f".{a}.")[0] for n, _ in model.named_parameters() if f".{a}." in n and "lora_A" in n}
                   for a in ("agent_tool", "agent_plan")}
    assert per_adapter["agent_tool"] == per_adapter["agent_plan"] and len(per_adapter["agent_tool"]) == 7 * 2
