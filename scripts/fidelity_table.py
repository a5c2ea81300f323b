"""Write docs/fidelity.md: every MAGRPO and CoLLM paper preset against its reference values.

    python scripts/fidelity_table.py          # rewrite docs/fidelity.md
    python scripts/fidelity_table.py --check  # exit 1 if docs/fidelity.md is out of date

The reference values live in docs/fidelity_references.yaml (with their sources); the preset values
are read from the composed preset, so the table cannot drift from what a preset trains with.

Beside the config keys, every preset has behaviour rows, measured on the composed preset rather
than read off a key (`BEHAVIOURS`): its task's reward on joint actions whose reference outputs
are recorded fixtures, its episode end on probe reward groups, the tokens its loss scores on a
probe node, its evaluation schedule, and its data order. A preset that changes any of them, by
whatever key, gets a differing row, which needs a note.
"""

from __future__ import annotations

import gzip
import json
import sys
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import yaml
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
REFERENCES = REPO / "docs" / "fidelity_references.yaml"
DOC = REPO / "docs" / "fidelity.md"
FIXTURES = REPO / "tests" / "fixtures"

HEAD = """# Fidelity of the paper presets

Every `experiment=*_paper` preset of MAGRPO and CoLLM-CC/DC, value by value, against the reference
code and configs it reproduces. Written by `scripts/fidelity_table.py` from
`docs/fidelity_references.yaml` (the reference values and their sources) and the composed presets
(the preset column is what the preset trains with); `tests/test_fidelity.py` fails when this page
is out of date or a differing row has no note. AT-GRPO: [fidelity_at_grpo.md](fidelity_at_grpo.md).
Rewards: [rewards_code.md](rewards_code.md), [rewards_writing.md](rewards_writing.md),
[rewards_strbuild.md](rewards_strbuild.md).

Deliberate deviations are opt-in switches; the paper presets use the reference's setting:

| switch | reference (paper presets) | marl-llm's own default |
|---|---|---|
| `algo.lora` | `null`: every agent fully fine-tuned | a LoRA adapter per agent; each preset has a `<preset>_lora` variant with a learning rate for LoRA (10 x, source in its header) |
| `model.chat_template` | `false` for writing and code (raw prompt strings), `true` for StrBuild | `auto` |
| `task.prompts` | `paper`: the reference formatters' prompts and feedback, byte for byte (docs/prompts_code.md, rewards_writing.md, prompts_strbuild.md) | `own`: this project's wording |
| `algo.sampling.top_k` | `null`: the model's generation-config value (the references pass none to `generate()`) | `0` (off) |
| `task.reward.variant` | `paper`: the reference reward functions, quirks included | `fixed` |
| `algo.early_termination_rule` | `node_mean`: a node whose G rewards have a mean above the threshold is not expanded | `joint_action`: each joint action at or above it is a leaf |
| `algo.rollout_buffer_size`, `algo.train_batch_size` | comlrl's per-agent node buffer, drained turn by turn | `null`: one optimizer step per trainer step |
| `algo.max_grad_norm`, `algo.weight_decay` | `null` (no clipping), `0.01` (torch AdamW default) | `1.0`, `0.0` |
| `algo.normalize_advantages` (MAGRPO) | `true` | `false` |
| `algo.loss_tokens` | MAGRPO `padded_row`: the node's `generate()` row, padding after EOS included, minus its last token; CoLLM `before_pad`: the ids before the first pad (no EOS when pad == eos) | `completion`: each completion through its first EOS |
| `trainer.eval_protocol`, `trainer.eval_interval` | `paper`: before every `eval_interval`-th batch of each epoch, one rollout sampled at the training settings on each of the first `eval_max_problems` (4; StrBuild 2) eval items; the mean reward, expected return and test pass rate per turn. The expected return is comlrl's for every algorithm: the undiscounted sum of the shifted rewards from the turn on (CoLLM's evaluation discounted it by `algo.discount` before issue 44: -4.507 where comlrl logged -4.704 on a stub case; `tests/test_collm_vs_comlrl.py`) | `own`: greedy pass@1, reward and levels every `eval_every` steps, sampled pass@k |
| `trainer.eval_after` | `false`: no evaluation after the last step; comlrl's train loop ends with its last batch (HumanEval: 198 evaluations, not 199) | `true`: one more evaluation after training (`summary.json`'s `after`) |
| `task.reward.variant` + pass@1 | under the reference harness pass@1 cannot reach 1: it fails 21 of 164 HumanEval canonical solutions (4 of `test[:32]`); `pass@1_ceiling` is reported beside every pass@ metric | `fixed`: every canonical solution passes |
| `task.end_on_success` (StrBuild) | `false`: an episode ends at the horizon or the early-termination threshold | `true`: success ends it |

Every preset also has **behaviour rows**, measured on the composed preset rather than read off a
key, so a preset that changes a behaviour by any key gets a differing row, which needs a note
(`tests/test_fidelity.py` changes each behaviour of a preset and checks its row stops matching):

| behaviour | how it is measured |
|---|---|
| reward | the task's reward on joint actions whose reference rewards are recorded fixtures (`tests/fixtures/{code_reward_paper,writing_reward_paper_*,strbuild_reward_paper}.jsonl.gz`, the reference code run outside the project; StrBuild: every turn of multi-turn cases) |
| episode_end | which sibling groups are expanded, on probe rewards around the reference's threshold (comlrl: none of a node whose mean shifted reward exceeds it); StrBuild: whether a perfect build ends the episode (the reference: no) |
| loss_tokens | the tokens scored per sample of a probe node, against comlrl's (its own trainers: `tests/test_{magrpo,collm}_vs_comlrl.py`) |
| evaluation | when, on how many items and how the preset evaluates over two epochs, against comlrl's schedule (`tests/test_reference_loop.py`) |
| data_order | two epochs over five probe problems (the reference: in order) |

What the presets follow where the reference differs between its own versions or pairings:

| aspect | reference | the presets |
|---|---|---|
| trainer library | the MAGRPO scripts at the cited commits (LLM_Collab_Writing `train_magrpo.py`, LLM_Collab_Minecraft `str_build/train/train_magrpo.py`, and LLM_Collab_Code_Generation's `train_magrpo.py` of the same generation) pass `dataset_type=` to `MAGRPOTrainer`, which comlrl 1.4.3 rejects (a TypeError): they ran with an earlier comlrl. The MAAC and IAC scripts run with 1.4.3 as they are | the scripts' configs, formatters and rewards, run by comlrl 1.4.3's trainers (the keyword dropped): the version `tests/test_{magrpo,collm}_vs_comlrl.py` compare with |
| turn-2 code prompt | `external/__init__.py` forwards each agent's prompt and response history to `level_feedback` from upstream `523fb3a` on (older versions, every stored OpenMLRL one among them, do not: no history in the report), and the scripts read `external_prompt_passthrough` (default false) in the versions read | the newest versions read: histories forwarded, the report inside the turn-1 frame (`passthrough: false`); files and commits in [prompts_code.md](prompts_code.md#sources-and-fixtures) |
| generation config | `generate()` applies what the model's generation config sets where the caller passes nothing: `top_k` (the scripts pass `top_k=None`) and any `repetition_penalty`, `min_p`, `typical_p`, `no_repeat_ngram_size`, ... | `top_k` is read (`algo.sampling.top_k: null`); the others are not applied, and a run names each one its model's config sets in a warning (`algos/base.py`, `UNAPPLIED_GENERATION_KEYS`). The paper models' configs could not be read here |
| seed | 42: the code MAGRPO configs, the MAAC and IAC scripts' default; unseeded: the writing MAGRPO script, the StrBuild scripts (a seed drawn, never applied) | `seed: 42` where the reference sets it, marl-llm's 0 where it sets none: the same number, not the same random draws |
| `evaluate` metric `writing_reward` | the reference's reward | `variant="paper"` ([tasks.md](tasks.md#task-metrics-outside-training-evaluate-modules)); `variant="fixed"` (default) marl-llm's |
| IAC value clipping | the IAC configs name `value_clip_range`; comlrl's IACTrainer applies it only without a separate critic | none: every config trains a separate critic |

Sources:
"""


def compose(preset: str, overrides: tuple[str, ...] = ()):
    from marl_llm.configure import compose_config

    return compose_config([f"experiment={preset}", "run_dir=/tmp/fidelity", *overrides])


def fmt(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def same(ref, got) -> bool:
    if isinstance(ref, (int, float)) and isinstance(got, (int, float)) and not isinstance(ref, bool):
        return float(ref) == float(got)
    return ref == got


def note_of(spec: dict) -> str:
    return " ".join(str(spec.get("note") or "").split())


def rows(preset: str, values: dict, overrides: tuple[str, ...] = ()) -> list[tuple[str, str, str, bool, str]]:
    """(key, reference, preset value, match, note) of one preset."""
    cfg = compose(preset, overrides)
    out = []
    for key, spec in values.items():
        ref = spec.get("ref")
        got = OmegaConf.select(cfg, key, default="(missing)")
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        match = same(ref, got)
        out.append((key, fmt(ref), fmt(got), match, note_of(spec)))
    return out


# ------------------------------------------------------------------------------ behaviours
# Each probe: (composed preset, its spec in fidelity_references.yaml) -> (reference, preset, match).

def _code_cases() -> list[dict]:
    with gzip.open(FIXTURES / "code_reward_paper.jsonl.gz", "rt", encoding="utf-8") as f:
        rows_ = [json.loads(line) for line in f][1:]
    return [r for r in rows_ if r["id"] in CODE_CASES]


# Inline-problem cases of the code fixture where the reference harness's quirks decide the reward
# (none times out): wrappers, nested and indented defs, prose, unimported math, discarded calls.
CODE_CASES = ("sum_sq/correct_loop", "sum_sq/wrapper_assign_return", "sum_sq/wrapper_return_f_of_aux",
              "sum_sq/discarded_call", "sum_sq/aux_in_comment_only", "sum_sq/aux_col0_string_breaks",
              "sum_sq/main_nested_helper", "sum_sq/main_uses_math_unimported", "sum_sq/main_indented_def",
              "sum_sq/main_return_word_in_docstring", "add/wrong", "first_negative/return_none")


@lru_cache(maxsize=None)
def _reward_check(fixture: str, task_yaml: str) -> tuple[int, int]:
    """(equal, cases): how many recorded reference rewards the task `task_yaml` reproduces."""
    from marl_llm.tasks import build_task
    from marl_llm.tasks.base import Problem, Turn

    task = build_task(OmegaConf.create(task_yaml))
    if fixture.startswith("writing_"):
        with gzip.open(FIXTURES / f"writing_reward_paper_{fixture[8:]}.jsonl.gz", "rt", encoding="utf-8") as f:
            cases = [json.loads(line) for line in f][1::50]
        got = task.joint_rewards([Problem("p", {})] * len(cases), [[c["text1"], c["text2"]] for c in cases])
        return sum(abs(g.total - c["reward"]) <= 1e-9 for g, c in zip(got, cases)), len(cases)
    if fixture == "code":
        cases = _code_cases()
        problems = [Problem(c["id"], {k: c[k] for k in ("prompt", "test", "entry_point")}) for c in cases]
        got = task.joint_rewards(problems, [[c["aux"], c["main"]] for c in cases])
        return sum(abs(g.total - c["reward"]) <= 1e-9 for g, c in zip(got, cases)), len(cases)
    with gzip.open(FIXTURES / "strbuild_reward_paper.jsonl.gz", "rt", encoding="utf-8") as f:
        cases = [c for c in (json.loads(line) for line in f) if c.get("group") == "config" and c["target"] in ("I", "LI")]
    equal = total = 0
    for c in cases:
        for t in range(1, len(c["turns"]) + 1):  # every turn, scored after the turns before it
            history = [[Turn("", c["turns"][k][i]) for k in range(t)] for i in range(len(c["palettes"]))]
            [r] = task.history_rewards([Problem("p", {"target": c["target"]})], [history])
            equal += abs(r.total - c["rewards"][t - 1]) <= 1e-9
            total += 1
    return equal, total


def probe_reward(cfg, spec: dict) -> tuple[str, str, bool]:
    """The task's reward on recorded reference outputs (tests/fixtures/*_paper.jsonl.gz)."""
    equal, n = _reward_check(spec["fixture"], OmegaConf.to_yaml(cfg.task, resolve=True))
    return (f"the reference's reward: its outputs on {n} recorded joint actions ({spec['fixture']})",
            f"{equal} / {n} equal (`task.reward.variant={cfg.task.reward.variant}`)", equal == n)


def probe_episode_end(cfg, spec: dict) -> tuple[str, str, bool]:
    """Which sibling groups the preset expands, on probe rewards around the reference threshold;
    StrBuild: whether a perfect build ends the episode."""
    from marl_llm.algos.base import early_stop_rule
    from marl_llm.tasks.base import JointReward

    theta, shift = float(spec["threshold"]), float(cfg.task.reward_shift)
    groups = [[theta + 0.05, theta - 0.15], [theta + 0.1, theta + 0.2], [theta - 0.05, theta], [theta, theta]]
    stop = early_stop_rule(cfg.algo.get("early_termination"), cfg.algo.get("early_termination_rule", "joint_action"),
                           shift)
    nodes = [[SimpleNamespace(reward=JointReward(r - shift)) for r in g] for g in groups]
    got = [stop(g) if stop else [False] * len(g) for g in nodes]
    ref = [[sum(g) / len(g) > theta] * len(g) for g in groups]
    ref_text = f"a node whose mean shifted reward exceeds {theta} is not expanded; otherwise the horizon"
    got_text = (f"`{cfg.algo.get('early_termination_rule')}` at {cfg.algo.get('early_termination')}" if stop
                else "the horizon only")
    match = got == ref
    if "success_ends" in spec:
        ends = _perfect_build_ends(OmegaConf.to_yaml(cfg.task, resolve=True))
        ref_text += "; a perfect build does not end it"
        got_text += f"; a perfect build {'ends' if ends else 'does not end'} it"
        match = match and ends == bool(spec["success_ends"])
    return ref_text, got_text, match


@lru_cache(maxsize=None)
def _perfect_build_ends(task_yaml: str) -> bool:
    from marl_llm.tasks import build_task
    from marl_llm.tasks.base import Problem, Turn

    task = build_task(OmegaConf.create(task_yaml))
    env = task.new_env("LI")
    owner = lambda x, y: (x + y) % task.num_agents  # noqa: E731
    actions = ["\n".join(f"/setblock {x} {y} 0 {task.palettes[a][(x // 2 + y) % len(task.palettes[a])]}"
                          for x, y, _ in sorted(env.target_cells()) if owner(x, y) == a) for a in range(task.num_agents)]
    [r] = task.history_rewards([Problem("p", {"target": "LI"})], [[[Turn("", a)] for a in actions]])
    return bool(r.done)


def probe_loss_tokens(cfg, spec: dict) -> tuple[str, str, bool]:
    """Tokens scored per sample of a probe node (pad == eos = 0): completions of 3 and 6 ids
    ending in EOS and one of 4 ids cut at max_new_tokens."""
    import torch

    from marl_llm.algos.loss_tokens import with_loss_tokens
    from marl_llm.rollout.base import Completion

    ids = ([5, 6, 0], [5, 6, 7, 8, 9, 0], [5, 6, 7, 8])
    node = [Completion(torch.tensor([1, 2]), torch.tensor(c), "", c[-1] != 0) for c in ids]
    got = [len(c.scored_ids) for c in with_loss_tokens(cfg.algo.get("loss_tokens", "completion"), node, 0)]
    return (f"comlrl: {spec['scored']} tokens of completions of {[len(c) for c in ids]} (pad == eos)",
            f"{got} (`algo.loss_tokens={cfg.algo.get('loss_tokens', 'completion')}`)", got == list(spec["scored"]))


def probe_evaluation(cfg, spec: dict) -> tuple[str, str, bool]:
    """Before which steps of the first two epochs the preset evaluates, on how many items, how."""
    from marl_llm.training.evaluation import paper_eval_due

    n, t = int(spec["train_size"]), cfg.trainer
    # comlrl 1.4.3: before batch b of each epoch when b % eval_interval == 0 (one item per batch).
    ref = [s for s in range(2 * n) if (s % n) % int(spec["interval"]) == 0]
    if t.eval_protocol == "paper":
        got = [s for s in range(2 * n) if paper_eval_due(s, t.prompts_per_step, n, t.eval_interval)]
        how = "one sampled rollout per item"
    else:
        got = ([0] if t.eval_before else []) + [s for s in range(1, 2 * n) if t.eval_every and s % t.eval_every == 0]
        how = "greedy rollouts and sampled pass@k"
    items = t.eval_max_problems
    # The reference never evaluates after its last batch; trainer.eval_after adds one.
    after = ", and once after training" if t.eval_after else ""
    return (f"every {spec['interval']}th batch of each epoch ({len(ref)} times in 2 epochs), none after training, "
            f"the first {spec['items']} items, one rollout sampled at the training settings",
            f"`{t.eval_protocol}`: {len(got)} times in 2 epochs{after}, {items or 'all'} items, {how}",
            got == ref and not t.eval_after and items == spec["items"] and t.eval_protocol == "paper")


def probe_data_order(cfg, spec: dict) -> tuple[str, str, bool]:
    """The order of two epochs over 5 probe problems."""
    from marl_llm.tasks.base import Problem
    from marl_llm.training.data_order import batch_for_step

    problems = [Problem(str(k), {}) for k in range(5)]
    size = cfg.trainer.prompts_per_step
    got = [int(p.uid) for s in range(10 // size) for p in batch_for_step(problems, s, size, cfg.seed, cfg.trainer.data_order)]
    return ("the training set in its order, every epoch", f"`{cfg.trainer.data_order}`: {got}", got == [0, 1, 2, 3, 4] * 2)


BEHAVIOURS = {"reward": probe_reward, "episode_end": probe_episode_end, "loss_tokens": probe_loss_tokens,
              "evaluation": probe_evaluation, "data_order": probe_data_order}


def behaviour_rows(preset: str, behaviours: dict, overrides: tuple[str, ...] = ()) -> list[tuple[str, str, str, bool, str]]:
    """(behaviour, reference, preset, match, note) of one preset, each measured by its probe."""
    cfg = compose(preset, overrides)
    return [(name, *BEHAVIOURS[name](cfg, spec), note_of(spec)) for name, spec in behaviours.items()]


def render() -> str:
    data = yaml.safe_load(REFERENCES.read_text())
    lines = [HEAD.rstrip("\n")]
    lines += [f"- `{name}`: {text}" for name, text in data["sources"].items()]
    for preset, entry in data["presets"].items():
        lines += ["", f"## `{preset}`", "", f"Sources: {', '.join(entry['sources'])}.", "",
                  "| key | reference | preset | match | note |", "|---|---|---|---|---|"]
        for key, ref, got, match, note in rows(preset, entry["values"]):
            lines.append(f"| `{key}` | {ref} | {got} | {'yes' if match else '**no**'} | {note} |")
        lines += ["", "| behaviour | reference | preset | match | note |", "|---|---|---|---|---|"]
        for name, ref, got, match, note in behaviour_rows(preset, entry["behaviours"]):
            lines.append(f"| {name} | {ref} | {got} | {'yes' if match else '**no**'} | {note} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if DOC.read_text() != text:
            print("docs/fidelity.md is out of date: run python scripts/fidelity_table.py")
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
