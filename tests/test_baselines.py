"""The papers' baselines end to end on the tiny model: single (trained with GRPO), and the
prompt-only parallel / sequential / discussion teams (evaluation only), with the same metrics."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import VENV_BIN, compose_config, tiny_overrides

CORE = {"reward", "completions/mean_length"}


def run(tiny_model_dir: Path, run_dir: Path, algo: str, task: str, *extra: str) -> tuple[dict, list[dict], list[dict]]:
    from marl_llm.training.trainer import train

    overrides = [o for o in tiny_overrides(tiny_model_dir, run_dir) if not o.startswith("algo.")]
    cfg = compose_config([f"algo={algo}", f"task={task}", *overrides, "algo.sampling.max_new_tokens=6",
                          "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", *extra])
    train(cfg)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), metrics, samples


def eval_keys(metrics: list[dict]) -> set[str]:
    return {k.removeprefix("eval/") for row in metrics for k in row if k.startswith("eval/")}


@pytest.mark.parametrize("task,levels", [("tldr", {"structure", "length", "vocabulary", "style"}),
                                         ("coophumaneval", {"structure", "syntax", "tests", "cooperation"})])
def test_every_baseline_reports_the_same_metrics(tiny_model_dir, tmp_path, task, levels):
    keys = {}
    for algo in ("parallel", "sequential", "discussion", "single"):
        extra = ["algo.num_generations=2"] if algo == "single" else []
        summary, metrics, _ = run(tiny_model_dir, tmp_path / algo, algo, task, *extra)
        keys[algo] = eval_keys(metrics)
        assert CORE | {f"rewards/{lv}/mean" for lv in levels} <= keys[algo]
        if task == "coophumaneval":
            assert "pass@1" in keys[algo]
        else:
            assert "reward_ungated" in keys[algo] and "rewards/style_ungated/mean" in keys[algo]
    core = {k for k in keys["parallel"] if not k.startswith("turn_")}
    assert all(core <= k for k in keys.values())


@pytest.mark.parametrize("algo", ["parallel", "sequential", "discussion"])
def test_prompt_only_baselines_never_train(tiny_model_dir, tmp_path, algo, capsys):
    summary, metrics, samples = run(tiny_model_dir, tmp_path, algo, "tldr", "trainer.max_steps=3")
    assert "prompt-only baseline" in capsys.readouterr().out
    assert summary["steps"] == 0 and summary["before"] is not None and summary["after"] is None
    assert not any(k.startswith("train/") for row in metrics for k in row)
    assert [row["step"] for row in metrics] == [0]
    assert not (tmp_path / "checkpoint.pt").exists()
    assert {s["split"] for s in samples} == {"eval"}


def test_sequential_shows_agent_one_output_to_agent_two(tiny_model_dir, tmp_path):
    _, _, samples = run(tiny_model_dir, tmp_path, "sequential", "tldr")
    for row in samples:
        assert "The concise agent has already written" in row["detailed/prompt"]
        assert row["concise/completion"].strip() in row["detailed/prompt"]
        assert "already written" not in row["concise/prompt"]


def test_discussion_scores_the_revised_joint_action(tiny_model_dir, tmp_path):
    _, metrics, samples = run(tiny_model_dir, tmp_path, "discussion", "tldr")
    assert {row["turn"] for row in samples} == {2}
    for row in samples:
        assert "Your draft" in row["concise/prompt"] and "The detailed agent's draft" in row["concise/prompt"]
        assert "The concise agent's draft" in row["detailed/prompt"]
    assert {"turn_1/reward", "turn_2/reward"} <= eval_keys(metrics)


def test_parallel_is_the_untrained_magrpo_team(tiny_model_dir, tmp_path):
    """Greedy, zero-initialized adapters: parallel equals MAGRPO's evaluation before training."""
    _, par, par_samples = run(tiny_model_dir, tmp_path / "par", "parallel", "tldr")
    _, mag, mag_samples = run(tiny_model_dir, tmp_path / "mag", "magrpo", "tldr", "algo.num_turns=1",
                              "algo.num_generations=2")
    assert par[0]["eval/reward"] == mag[0]["eval/reward"]
    first = [s for s in mag_samples if s["split"] == "eval" and s["step"] == 0]
    assert [s["detailed/completion"] for s in par_samples] == [s["detailed/completion"] for s in first]


def test_single_agent_trains_with_grpo(tiny_model_dir, tmp_path):
    summary, metrics, samples = run(tiny_model_dir, tmp_path, "single", "tldr", "algo.num_generations=2",
                                    "trainer.max_steps=2")
    train_rows = [r for r in metrics if "train/reward" in r]
    assert len(train_rows) == 2 and "train/single/loss" in train_rows[0] and summary["steps"] == 2
    assert (tmp_path / "checkpoint.pt").exists()
    assert all("single/completion" in s and "[PART 2]" in s["single/prompt"] for s in samples)


def test_max_steps_zero_evaluates_magrpo_without_training(tiny_model_dir, tmp_path):
    summary, metrics, _ = run(tiny_model_dir, tmp_path, "magrpo", "coophumaneval", "trainer.max_steps=0")
    assert summary["steps"] == 0 and summary["before"]["reward"] == metrics[0]["eval/reward"]
    assert [row["step"] for row in metrics] == [0] and "eval/pass@1" in metrics[0]
    assert not (tmp_path / "checkpoint.pt").exists()


def test_multi_turn_on_a_single_turn_task_fails_early(tiny_model_dir, tmp_path):
    from marl_llm.config import UserError

    with pytest.raises(UserError, match="task tldr is single-turn but algo.num_turns=2: set algo.num_turns=1"):
        run(tiny_model_dir, tmp_path, "magrpo", "tldr")


def test_unknown_baseline_lists_the_valid_options(tmp_path):
    out = subprocess.run([str(VENV_BIN / "marl-llm"), "algo=sequentail"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    for option in ("single", "parallel", "sequential", "discussion", "magrpo"):
        assert option in out.stderr
