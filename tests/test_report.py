"""marl-llm-report on synthetic run directories: table numbers computed by hand, plots, warnings, exit codes."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from marl_llm.report.aggregate import aggregate
from marl_llm.report.cli import fresh_report_dir, main, write_report
from marl_llm.report.plots import _pyplot, draw_eval_reward, draw_final, draw_train_reward
from marl_llm.report.runs import find_runs
from marl_llm.report.stats import iqm, mean_std, stratified_bootstrap_ci

PNG_MAGIC = b"\x89PNG"


def make_run(root: Path, name: str, *, algo: str, seed: int, task: str = "tldr", max_steps: int = 5,
             train: dict[int, float] | None = None, evals: dict[int, dict[str, float]] | None = None,
             wall_s: float = 10.0, group: str | None = None, finished: bool = True,
             extra_lines: list[str] = (), joint_actions: float | None = None, config: dict | None = None,
             eval_problems: int | None = None) -> Path:
    """A run dir as the trainer writes it: config.yaml, metrics.jsonl and (if finished) summary.json.
    `config`: extra or changed config.yaml keys (nested dicts), e.g. {"algo": {"baseline": "rloo"}}."""
    d = root / name
    d.mkdir(parents=True)
    cfg = OmegaConf.merge({"algo": {"name": algo}, "task": {"name": task}, "model": {"name": "tiny"}, "seed": seed,
                           "logger": {"group": group}, "trainer": {"max_steps": max_steps}, "run_dir": str(d)},
                          config or {})
    (d / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    lines = []
    evals = evals or {}
    for step in sorted(set(train or {}) | set(evals)):
        if step in evals:
            lines.append(json.dumps({"step": step, **{f"eval/{k}": v for k, v in evals[step].items()}}))
        if train and step in train:
            row = {"step": step, "train/reward": train[step], "train/loss": 0.1}
            if joint_actions is not None:
                row["train/joint_actions"] = joint_actions
            lines.append(json.dumps(row))
    (d / "metrics.jsonl").write_text("\n".join([*lines, *extra_lines]) + "\n")
    if finished:
        before = {k: v for k, v in evals.get(0, {}).items()} or None
        after = evals[max(evals)] if evals else None
        summary = {"before": before, "after": after, "steps": max_steps, "wall_s": wall_s, "sec_per_step": None}
        if eval_problems is not None:  # runs before issue 34 did not record it
            summary["eval_problems"] = eval_problems
        (d / "summary.json").write_text(json.dumps(summary))
    return d


def levels(reward: float, structure: float, style: float) -> dict[str, float]:
    return {"reward": reward, "rewards/structure/mean": structure, "rewards/style/mean": style}


def build_tldr(root: Path) -> None:
    # magrpo: eval reward 0.5 -> 1.0 (seed 0) and 1.0 -> 2.0 (seed 1): final 1.500 ± 0.707 (sample std:
    # sqrt((0.5² + 0.5²) / 1)), Δ 0.750 ± 0.354; the IQM of two runs is their mean, the bootstrap CI [1.0, 2.0].
    make_run(root, "magrpo/0", algo="magrpo", seed=0, train={s: 0.1 * s for s in range(1, 6)},
             evals={0: levels(0.5, 0.2, 0.1), 5: levels(1.0, 0.4, 0.3)}, wall_s=100.0, eval_problems=16)
    make_run(root, "magrpo/1", algo="magrpo", seed=1, train={s: 0.3 * s for s in range(1, 6)},
             evals={0: levels(1.0, 0.2, 0.1), 5: levels(2.0, 0.6, 0.5)}, wall_s=200.0, eval_problems=16)
    # parallel: evaluation only (max_steps 0), rewards 0.2 and 0.4: 0.300 ± 0.141, Δ 0.
    # Their runs evaluated on 1 and 4 problems; an older run would not say (shown as "?").
    make_run(root, "parallel/0", algo="parallel", seed=0, max_steps=0, evals={0: levels(0.2, 0.1, 0.0)}, wall_s=5.0,
             eval_problems=1)
    make_run(root, "parallel/1", algo="parallel", seed=1, max_steps=0, evals={0: levels(0.4, 0.3, 0.2)}, wall_s=7.0,
             eval_problems=4)
    # Unfinished: would change every magrpo number if it were counted.
    make_run(root, "magrpo/crashed", algo="magrpo", seed=2, train={1: 50.0}, evals={0: levels(50.0, 9.0, 9.0)},
             finished=False)


def table_rows(md: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in md.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0]]
    return {"__header__": header,
            **{cells[0].strip(): [c.strip() for c in cells] for cells in rows[2:]}}


def test_end_to_end_table_plots_and_warnings(tmp_path, capsys):
    root, out = tmp_path / "runs", tmp_path / "results"
    build_tldr(root)

    assert main([str(root), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "crashed" in captured.err and "unfinished" in captured.err
    md_path = out / "tldr.md"
    assert md_path.is_file() and str(md_path) in captured.out

    md = md_path.read_text()
    rows = table_rows(md)
    header = rows["__header__"]
    assert header == ["method", "n", "steps", "eval/reward IQM [95% CI]", "eval problems", "eval/reward", "structure",
                      "style", "Δ vs step 0", "train time (s)"]
    col = {h: i for i, h in enumerate(header)}
    magrpo, parallel = rows["magrpo"], rows["parallel"]
    assert magrpo[col["n"]] == "2" and parallel[col["n"]] == "2"
    assert magrpo[col["steps"]] == "5" and parallel[col["steps"]] == "0"
    assert magrpo[col["eval/reward"]] == "1.500 ± 0.707"
    assert magrpo[col["eval/reward IQM [95% CI]"]] == "1.500 [1.000, 2.000]"
    # Next to the interval over runs: the problems each run's value comes from.
    assert magrpo[col["eval problems"]] == "16" and parallel[col["eval problems"]] == "1/4"
    assert "**eval problems** says how many held-out problems" in md
    assert magrpo[col["structure"]] == "0.500 ± 0.141"
    assert magrpo[col["style"]] == "0.400 ± 0.141"
    assert magrpo[col["Δ vs step 0"]] == "0.750 ± 0.354"
    assert magrpo[col["train time (s)"]] == "150.0 ± 70.7"
    assert parallel[col["eval/reward"]] == "0.300 ± 0.141"
    assert parallel[col["Δ vs step 0"]] == "0.000 ± 0.000"
    # The interval method, level and resamples are printed with the table.
    assert "95% percentile bootstrap" in md and "2000 resamples" in md and "IQM" in md
    # Prompt-only baselines come first.
    assert md.index("| parallel |") < md.index("| magrpo |")
    assert "crashed" not in md
    assert "## Runs" in md and "## Legend" in md and "## Commands" not in md

    for name in ("tldr_train_reward.png", "tldr_eval_reward.png", "tldr_final.png"):
        png = out / name
        assert png.read_bytes()[:4] == PNG_MAGIC
        assert str(png) in captured.out
    assert not list(out.glob(".*.tmp")), "temporary files left behind"


def test_output_is_deterministic(tmp_path, capsys):
    root = tmp_path / "runs"
    build_tldr(root)
    assert main([str(root), "--out", str(tmp_path / "a")]) == 0
    assert main([str(root), "--out", str(tmp_path / "b")]) == 0
    for name in ("tldr.md", "tldr_train_reward.png", "tldr_eval_reward.png", "tldr_final.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_no_runs_is_exit_2_with_error(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    make_run(tmp_path / "empty", "unfinished", algo="magrpo", seed=0, evals={0: levels(1, 1, 1)}, finished=False)
    assert main([str(empty), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and str(empty) in err and "metrics.jsonl" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_corrupt_metrics_line_skips_run(tmp_path, capsys):
    root = tmp_path / "runs"
    build_tldr(root)
    make_run(root, "magrpo/corrupt", algo="magrpo", seed=3, evals={0: levels(9, 9, 9), 5: levels(9, 9, 9)},
             extra_lines=['{"step": 6, "train/rew'])
    assert main([str(root), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "corrupt" in err and "unreadable" in err and "line" in err
    rows = table_rows((tmp_path / "out" / "tldr.md").read_text())
    assert rows["magrpo"][1] == "2"
    assert rows["magrpo"][rows["__header__"].index("eval/reward")] == "1.500 ± 0.707"


def test_two_tasks_two_files_and_task_filter(tmp_path, capsys):
    root = tmp_path / "runs"
    build_tldr(root)
    code_eval = {"reward": 3.0, "rewards/tests/mean": 0.5, "pass@1": 0.25, "pass@10": 0.5}
    make_run(root, "he/single", algo="single", task="humaneval", seed=0, max_steps=0, evals={0: code_eval})
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.md")) == ["humaneval.md", "tldr.md"]
    he = table_rows((out / "humaneval.md").read_text())
    assert he["__header__"][3:9] == ["eval/reward IQM [95% CI]", "eval problems", "eval/reward", "tests", "pass@1",
                                     "pass@10"]
    # One run: a mean, but no spread and no interval; it does not say how many problems it evaluated.
    assert he["single"][3] == "3.000 [n/a]" and he["single"][5] == "3.000 ± n/a" and he["single"][7] == "0.250 ± n/a"
    assert he["single"][4] == "?"
    assert "magrpo" not in (out / "humaneval.md").read_text()
    # No train rows for humaneval: the train plot is skipped with a message, the eval plot is still drawn.
    assert not (out / "humaneval_train_reward.png").exists()
    assert (out / "humaneval_eval_reward.png").read_bytes()[:4] == PNG_MAGIC
    assert "skipping" in capsys.readouterr().out

    only = tmp_path / "only"
    assert main([str(root), "--out", str(only), "--task", "humaneval"]) == 0
    assert [p.name for p in only.glob("*.md")] == ["humaneval.md"]
    assert main([str(root), "--out", str(only), "--task", "arxiv"]) == 2


def test_the_pass_at_1_ceiling_of_paper_reward_runs_is_a_column_after_pass_at_k(tmp_path):
    """Under task.reward.variant=paper, pass@1 is read against what the reference harness lets
    canonical solutions reach (eval/pass@1_ceiling): the table shows both, and says what it is."""
    root = tmp_path / "runs"
    for seed, ceiling in ((0, 0.875), (1, 0.875)):
        make_run(root, f"he/s{seed}", algo="single", task="humaneval", seed=seed, max_steps=0,
                 evals={0: {"reward": 2.0, "pass@1": 0.5, "pass@1_ceiling": ceiling}})
    assert main([str(root), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "humaneval.md").read_text()
    he = table_rows(md)
    header = he["__header__"]
    column = header.index("pass@1") + 1
    assert header[column] == "pass@1 ceiling"
    assert he["single"][column].startswith("0.875 ±")
    assert "canonical solution passes the reference harness" in md


def test_turn_based_tasks_report_the_success_rate_first(tmp_path):
    root = tmp_path / "runs"
    game = {"reward": 0.5, "success_rate": 0.25, "rewards/solved/mean": 0.25}
    make_run(root, "sok/a", algo="at_grpo", task="sokoban", seed=0, max_steps=0, evals={0: game})
    make_run(root, "sok/b", algo="at_grpo", task="sokoban", seed=1, max_steps=0, evals={0: {**game, "success_rate": 0.75}})
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out)]) == 0
    rows = table_rows((out / "sokoban.md").read_text())
    assert rows["__header__"][3:8] == ["success_rate IQM [95% CI]", "eval problems", "success_rate", "eval/reward",
                                       "solved"]
    assert rows["at_grpo"][5] == "0.500 ± 0.354"


def test_commands_file_appended_verbatim(tmp_path, capsys):
    root = tmp_path / "runs"
    build_tldr(root)
    commands = "marl-llm -m algo=magrpo task=tldr seed=0,1\nmarl-llm algo=parallel trainer.max_steps=0 seed=0\n"
    cmd_file = tmp_path / "commands.txt"
    cmd_file.write_text(commands)
    assert main([str(root), "--out", str(tmp_path / "out"), "--commands", str(cmd_file)]) == 0
    md = (tmp_path / "out" / "tldr.md").read_text()
    assert "## Commands" in md and commands in md
    assert main([str(root), "--out", str(tmp_path / "out"), "--commands", str(tmp_path / "nope.txt")]) == 2
    assert "error:" in capsys.readouterr().err


def test_group_label_duplicate_seed_warning_and_python_api(tmp_path, capsys):
    root = tmp_path / "runs"
    make_run(root, "a", algo="magrpo", seed=0, group="magrpo-lr1e-4", evals={0: {"reward": 1.0}, 5: {"reward": 2.0}})
    make_run(root, "b", algo="magrpo", seed=0, group="magrpo-lr1e-4", evals={0: {"reward": 1.0}, 5: {"reward": 4.0}})
    runs = find_runs([root, root / "a"])  # overlapping roots must not count run a twice
    assert [r.method for r in runs] == ["magrpo-lr1e-4", "magrpo-lr1e-4"]
    agg = aggregate(runs)
    assert "share seed" in capsys.readouterr().err
    m = agg["tldr"]["methods"]["magrpo-lr1e-4"]
    assert m["n"] == 2 and m["final"]["eval/reward"]["mean"] == 3.0 and m["delta"]["mean"] == 2.0
    assert [p["step"] for p in m["eval_curve"]] == [0, 5]
    written = write_report(runs, tmp_path / "out")
    assert [p.name for p in written] == ["tldr.md", "tldr_eval_reward.png", "tldr_final.png"]


def test_matched_budget_table_sums_the_joint_actions(tmp_path):
    root, out = tmp_path / "runs", tmp_path / "results"
    ev = {0: {"reward": 0.0}, 4: {"reward": 1.0}}
    # MAGRPO: 4 steps x 30 joint actions; CoLLM-CC: 6 steps x 20 (seed 1 stopped early: 6 x 18).
    make_run(root, "magrpo/0", algo="magrpo", seed=0, task="strbuild", max_steps=4,
             train={s: 0.1 for s in range(1, 5)}, evals=ev, joint_actions=30)
    make_run(root, "cc/0", algo="collm_cc", seed=0, task="strbuild", max_steps=6,
             train={s: 0.1 for s in range(1, 7)}, evals=ev, joint_actions=20)
    make_run(root, "cc/1", algo="collm_cc", seed=1, task="strbuild", max_steps=6,
             train={s: 0.1 for s in range(1, 7)}, evals=ev, joint_actions=18)
    assert main([str(root), "--out", str(out)]) == 0
    rows = table_rows((out / "strbuild.md").read_text())
    col = rows["__header__"].index("joint actions")
    # 120 and 108: mean 114, sample std sqrt((6² + 6²) / 1) = 8.5; one run has no spread.
    assert rows["magrpo"][col] == "120 ± n/a" and rows["collm_cc"][col] == "114 ± 8"
    assert "joint actions" not in table_rows(_tldr_table(tmp_path))["__header__"]  # runs that do not log it
    # the curves carry the joint actions spent by each step: the plots' x axis
    cc = aggregate(find_runs([root]))["strbuild"]["methods"]["collm_cc"]
    assert [p["budget"] for p in cc["train_curve"]] == [19.0 * s for s in range(1, 7)]
    assert [(p["step"], p["budget"]) for p in cc["eval_curve"]] == [(0, 0.0), (4, 76.0)]  # 4 x (20 + 18) / 2
    assert (out / "strbuild_train_reward.png").read_bytes().startswith(PNG_MAGIC)


def _tldr_table(tmp_path):
    root, out = tmp_path / "tldr_runs", tmp_path / "tldr_results"
    build_tldr(root)
    main([str(root), "--out", str(out)])
    return (out / "tldr.md").read_text()


# ----------------------------------------------------------------------------------------------- grouping


def build_baseline_sweep(root: Path) -> None:
    """`marl-llm -m seed=0,1 algo.baseline=mean,rloo`: four runs whose configs differ in the baseline, the
    seed and bookkeeping keys only (run_dir, logger.*, trainer.resume)."""
    for baseline, rewards in (("mean", (1.0, 2.0)), ("rloo", (3.0, 5.0))):
        for seed, reward in enumerate(rewards):
            make_run(root, f"{baseline}/seed={seed}", algo="magrpo", seed=seed, evals={0: {"reward": 0.0}, 5: {"reward": reward}},
                     config={"algo": {"baseline": baseline}, "logger": {"name": f"run-{baseline}-{seed}", "tags": [str(seed)]},
                             "trainer": {"resume": seed == 1}})


def test_sweep_rows_by_differing_keys_and_group_by_override(tmp_path, capsys):
    root = tmp_path / "runs"
    build_baseline_sweep(root)
    assert main([str(root), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "tldr.md").read_text()
    rows = table_rows(md)
    assert set(rows) - {"__header__"} == {"magrpo baseline=mean", "magrpo baseline=rloo"}
    col = rows["__header__"].index("eval/reward")
    assert rows["magrpo baseline=mean"][1] == "2" and rows["magrpo baseline=mean"][col] == "1.500 ± 0.707"
    assert rows["magrpo baseline=rloo"][1] == "2" and rows["magrpo baseline=rloo"][col] == "4.000 ± 1.414"
    assert "keys that differ between rows: `algo.baseline`." in md  # seed, run_dir, logger.*, resume: ignored
    assert "warning" not in capsys.readouterr().err

    # --group-by: one row per algorithm; the merge is said out loud (a training key, so a warning only).
    assert main([str(root), "--out", str(tmp_path / "by_algo"), "--group-by", "algo.name"]) == 0
    md = (tmp_path / "by_algo" / "tldr.md").read_text()
    rows = table_rows(md)
    assert set(rows) - {"__header__"} == {"magrpo"} and rows["magrpo"][1] == "4"
    assert "`--group-by algo.name`" in md and "merges runs that differ in algo.baseline (mean vs rloo)" in md
    err = capsys.readouterr().err
    assert "merges runs that differ in algo.baseline" in err and "share seed" not in err  # seeds of other configs

    # Several keys, comma-separated: the label names each.
    agg = aggregate(find_runs([root]), group_by=["algo.name", "algo.baseline"])
    assert list(agg["tldr"]["methods"]) == ["magrpo, baseline=mean", "magrpo, baseline=rloo"]


def test_group_by_unknown_key_is_one_line_with_the_fix(tmp_path, capsys):
    root = tmp_path / "runs"
    build_baseline_sweep(root)
    assert main([str(root), "--out", str(tmp_path / "out"), "--group-by", "algo.baseleine"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --group-by algo.baseleine") and "did you mean algo.baseline?" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_mixed_data_or_model_is_labelled_warned_or_refused(tmp_path, capsys):
    root = tmp_path / "runs"
    ev = {0: {"reward": 0.0}, 5: {"reward": 1.0}}
    for seed in (0, 1):
        make_run(root, f"a/{seed}", algo="magrpo", seed=seed, evals=ev, config={"task": {"data": {"files": {"train": "a.jsonl"}}}})
        make_run(root, f"b/{seed}", algo="magrpo", seed=seed, evals=ev, config={"task": {"data": {"files": {"train": "b.jsonl"}}}})
    make_run(root, "parallel/0", algo="parallel", seed=0, max_steps=0, evals={0: {"reward": 0.5}},
             config={"task": {"data": {"files": {"train": "a.jsonl"}}}})

    # Default: never merged; every row names its data, and the comparison across data is warned.
    assert main([str(root), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "tldr.md").read_text()
    assert {"magrpo data.files.train=a.jsonl", "magrpo data.files.train=b.jsonl",
            "parallel data.files.train=a.jsonl"} == set(table_rows(md)) - {"__header__"}
    err = capsys.readouterr().err
    assert "warning: tldr: the rows differ in data settings: task.data.files.train (a.jsonl vs b.jsonl)" in err
    assert "**Warning:** tldr: the rows differ in data settings" in md

    # Grouping that would merge the data sets: refused in one line naming both fixes; nothing written.
    assert main([str(root), "--out", str(tmp_path / "refused"), "--group-by", "algo.name"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: tldr: group 'magrpo' mixes data settings")
    assert "--group-by algo.name,task.data.files.train" in err and "--allow-mixed" in err and "Traceback" not in err
    assert not (tmp_path / "refused").exists()

    # --allow-mixed: reported, and the table says loudly what it merged.
    assert main([str(root), "--out", str(tmp_path / "mixed"), "--group-by", "algo.name", "--allow-mixed"]) == 0
    md = (tmp_path / "mixed" / "tldr.md").read_text()
    assert table_rows(md)["magrpo"][1] == "4"
    assert "**Warning:** tldr: group 'magrpo' mixes data settings" in md

    # A model mix is refused the same way.
    other = tmp_path / "models"
    make_run(other, "x", algo="magrpo", seed=0, evals=ev)
    make_run(other, "y", algo="magrpo", seed=1, evals=ev, config={"model": {"name": "other"}})
    assert main([str(other), "--out", str(tmp_path / "m"), "--group-by", "algo.name"]) == 2
    assert "mixes model settings: model.name (other vs tiny)" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- statistics


def test_sample_std_iqm_and_bootstrap_interval():
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)  # sample std (n - 1); the population std would be 0.816
    assert mean_std([5.0]) == (5.0, None)
    # IQM: the middle half of the runs; an outlier run does not move it.
    assert iqm([1.0, 2.0, 3.0, 100.0]) == 2.5
    assert iqm([1.0, 2.0, 3.0]) == 2.0
    scores = [float(v) for v in range(10)]  # IQM 4.5 (2..7), mean 4.5
    ci = stratified_bootstrap_ci([scores])
    assert ci is not None and ci[0] < 4.5 < ci[1] and 2.0 < ci[0] and ci[1] < 7.0
    assert ci == stratified_bootstrap_ci([scores])  # seeded: the report is reproducible
    assert stratified_bootstrap_ci([[3.0]]) is None  # one run: no interval
    # Stratified: each stratum keeps its size in every resample, so two constant strata give no spread.
    assert stratified_bootstrap_ci([[1.0, 1.0], [3.0, 3.0]], statistic=lambda x: x.mean(axis=-1)) == (2.0, 2.0)


def test_table_interval_contains_the_mean(tmp_path):
    root = tmp_path / "runs"
    for seed, reward in enumerate((1.0, 2.0, 2.5, 3.0, 4.5)):
        make_run(root, f"r/{seed}", algo="magrpo", seed=seed, evals={5: {"reward": reward}})
    head = aggregate(find_runs([root]))["tldr"]["methods"]["magrpo"]["headline"]
    assert head["count"] == 5 and head["iqm"] == 2.5  # 5 runs: int(5/4) = 1 cut at each end
    assert head["ci_low"] <= 2.6 <= head["ci_high"]  # 2.6: the mean
    assert 1.0 <= head["ci_low"] < head["ci_high"] <= 4.5


# ----------------------------------------------------------------------------------------------- outputs


def test_no_out_never_replaces_tracked_results(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    build_tldr(tmp_path / "outputs")  # the default root
    committed = tmp_path / "results" / "tldr.md"
    committed.parent.mkdir()
    committed.write_text("# the committed table\n")
    if shutil.which("git"):
        subprocess.run(["git", "init", "-q"], check=True)
        subprocess.run(["git", "add", "results/tldr.md"], check=True)
        assert subprocess.run(["git", "ls-files", "results"], capture_output=True, text=True).stdout == "results/tldr.md\n"

    assert main([]) == 0
    assert committed.read_text() == "# the committed table\n" and sorted(p.name for p in committed.parent.iterdir()) == ["tldr.md"]
    out = capsys.readouterr().out
    (report_dir,) = (tmp_path / "reports").iterdir()
    assert (report_dir / "tldr.md").is_file() and "no --out given" in out and str(report_dir.relative_to(tmp_path)) in out
    assert main([]) == 0  # a second report in the same second goes to a new directory too
    assert len(list((tmp_path / "reports").iterdir())) == 2

    # Named explicitly, the directory is the user's to overwrite (make report: --out results).
    assert main(["--out", "results"]) == 0
    assert committed.read_text().startswith("# tldr: method comparison")


def test_fresh_report_dir_never_reuses_a_name(tmp_path):
    from datetime import datetime

    now = datetime(2026, 1, 2, 3, 4, 5)
    first = fresh_report_dir(tmp_path, now)
    assert first == tmp_path / "2026-01-02_03-04-05"
    first.mkdir()
    assert fresh_report_dir(tmp_path, now) == tmp_path / "2026-01-02_03-04-05-2"


def test_csv_and_json_formats_parse(tmp_path, capsys):
    root, out = tmp_path / "runs", tmp_path / "out"
    build_tldr(root)
    assert main([str(root), "--out", str(out), "--format", "csv,json"]) == 0
    assert not (out / "tldr.md").exists()
    rows = {r["method"]: r for r in csv.DictReader((out / "tldr.csv").open(newline=""))}
    assert set(rows) == {"parallel", "magrpo"}
    magrpo = rows["magrpo"]
    assert magrpo["n"] == "2" and magrpo["seeds"] == "0 1" and magrpo["config:algo.name"] == "magrpo"
    assert float(magrpo["eval/reward_mean"]) == 1.5 and abs(float(magrpo["eval/reward_std"]) - 0.5 ** 0.5) < 1e-9
    assert float(magrpo["eval/reward_ci_low"]) == 1.0 and float(magrpo["eval/reward_ci_high"]) == 2.0
    assert magrpo["ci_level"] == "0.95" and magrpo["ci_resamples"] == "2000"
    assert magrpo["eval_problems"] == "16" and rows["parallel"]["eval_problems"] == "1 4"

    doc = json.loads((out / "tldr.json").read_text())
    assert doc["task"] == "tldr" and doc["interval"]["resamples"] == 2000 and doc["interval"]["level"] == 0.95
    groups = {g["label"]: g for g in doc["groups"]}
    assert groups["magrpo"]["final"]["eval/reward"]["mean"] == 1.5 and groups["magrpo"]["seeds"] == [0, 1]
    assert groups["magrpo"]["headline"]["values"] == [1.0, 2.0] and groups["parallel"]["eval_problems"] == [1, 4]
    assert [p["step"] for p in groups["magrpo"]["eval_curve"]] == [0, 5]

    # One run: its std is null in JSON and empty in CSV, never 0.
    one = tmp_path / "one"
    make_run(one, "r", algo="magrpo", seed=0, evals={5: {"reward": 1.0}})
    assert main([str(one), "--out", str(tmp_path / "o1"), "--format", "json", "--format", "csv"]) == 0
    (group,) = json.loads((tmp_path / "o1" / "tldr.json").read_text())["groups"]
    assert group["final"]["eval/reward"]["std"] is None and group["headline"]["ci_low"] is None
    assert next(csv.DictReader((tmp_path / "o1" / "tldr.csv").open()))["eval/reward_std"] == ""

    assert main([str(root), "--out", str(tmp_path / "bad"), "--format", "md,xlsx"]) == 2
    err = capsys.readouterr().err
    assert "error: --format xlsx" in err and "md, csv, json" in err and not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------------------------- plots


@pytest.fixture
def axes():
    plt = _pyplot()
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def _legend_colors(ax) -> dict[str, tuple]:
    handles, labels = ax.get_legend_handles_labels()
    # errorbar legends are containers; their first line carries the colour.
    return {lab: tuple((h.lines[0] if hasattr(h, "lines") else h).get_color()) for h, lab in zip(handles, labels)}


def test_one_point_curves_draw_markers_and_steps_are_integers(tmp_path, axes):
    root = tmp_path / "runs"
    make_run(root, "one", algo="magrpo", seed=0, max_steps=1, train={1: 0.5}, evals={1: {"reward": 0.7}})
    make_run(root, "three", algo="collm_cc", seed=0, max_steps=3, train={1: 0.1, 2: 0.2, 3: 0.3},
             evals={0: {"reward": 0.1}, 3: {"reward": 0.9}})
    agg = aggregate(find_runs([root]))["tldr"]
    assert draw_train_reward(axes, agg)
    lines = {line.get_label(): line for line in axes.lines}
    one = lines["magrpo (n=1)"]
    assert len(one.get_xdata()) == 1 and one.get_marker() not in (None, "", "None", " ")
    # Curves that could coincide differ in more than colour: dashes or markers.
    three = lines["collm_cc (n=1)"]
    assert (one.get_linestyle(), one.get_marker()) != (three.get_linestyle(), three.get_marker())
    axes.figure.canvas.draw()
    ticks = [t for t in axes.get_xticks() if axes.get_xlim()[0] <= t <= axes.get_xlim()[1]]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


def test_eval_points_are_not_joined(tmp_path, axes):
    root = tmp_path / "runs"
    build_tldr(root)
    agg = aggregate(find_runs([root]))["tldr"]
    assert draw_eval_reward(axes, agg)
    (container,) = [c for c in axes.containers if c.get_label() == "magrpo (n=2)"]
    data_line = container.lines[0]
    xs = list(data_line.get_xdata())
    assert len(xs) == 2 and data_line.get_linestyle() == "None"  # points, no line
    assert data_line.get_marker() not in (None, "", "None", " ")
    # Dodged: at each step, a little to one side of it, never on another group's point.
    assert abs(xs[0]) <= 1 and abs(xs[1] - 5) <= 1 and xs[1] - xs[0] == 5
    step0 = sorted(float(c.lines[0].get_xdata()[0]) for c in axes.containers)
    assert len(step0) == 2 and step0[0] < 0 < step0[1]


def test_dodged_points_stay_near_their_x_on_a_wide_axis():
    """Five groups at x=0, one also at 96 (the TLDR report): side by side, yet every point within
    6% of the axis of its own x, so none reads as another budget and no tick goes below 0 for it."""
    from marl_llm.report.plots import dodge

    offsets = dodge(5, [0.0, 96.0])
    assert len(set(offsets)) == 5 and max(offsets) - min(offsets) <= 0.06 * 96 + 1e-9
    assert dodge(3, [0.0, 5.0]) == pytest.approx([-0.15, 0.0, 0.15])
    assert dodge(3, [0.0, 1.0, 50.0]) == pytest.approx([-0.2, 0.0, 0.2])  # 40% of the smallest gap


def test_many_groups_keep_their_legend_labels_and_points_apart(tmp_path, monkeypatch):
    """Twelve groups evaluated at the same steps: the legend goes beside the axes, wholly inside
    the saved image (which grows to hold it and the final chart's long row labels), and no two
    groups' points share an x."""
    from marl_llm.report.plots import plot_eval_reward, plot_final

    root = tmp_path / "runs"
    for g in range(12):
        for seed in (0, 1):
            make_run(root, f"g{g}/{seed}", algo="magrpo", seed=seed, evals={0: {"reward": 0.5}, 5: {"reward": 1.0}},
                     config={"algo": {"learning_rate": 10.0 ** -(g + 1)}}, eval_problems=1)
    agg = aggregate(find_runs([root]))["tldr"]
    assert len(agg["methods"]) == 12
    plt = _pyplot()
    fig, ax = plt.subplots()
    draw_eval_reward(ax, agg)
    xs = [float(x) for c in ax.containers for x in c.lines[0].get_xdata()]
    assert len(set(xs)) == len(xs) == 24
    plt.close(fig)
    from PIL import Image

    from marl_llm.report.plots import place_legend

    # The legend of many groups sits beside the axes (axes coordinates beyond 1), in columns.
    fig, ax = plt.subplots()
    draw_eval_reward(ax, agg)
    place_legend(ax)
    legend = ax.get_legend()
    anchor = legend.get_bbox_to_anchor().transformed(ax.transAxes.inverted())
    assert anchor.x0 > 1 and legend._ncols == 1 and len(legend.get_texts()) == 12
    plt.close(fig)
    # Saved, the image holds the legend and the row labels whole: each inside what savefig keeps
    # (bbox_inches="tight"), and the legend clear of the axes, where it would hide points.
    from marl_llm.report import plots

    seen = {}
    real_save = plots._save_fig

    def save(fig, path):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        kept = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # inches -> pixels
        parts = [ax.get_legend()] if ax.get_legend() else []
        low, high = sorted(ax.get_ylim())
        parts += [t for t in ax.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high]
        seen[path.name] = (kept, [p.get_window_extent(renderer) for p in parts], ax.get_window_extent(renderer),
                           [t.get_text() for t in ax.get_yticklabels()])
        real_save(fig, path)

    monkeypatch.setattr(plots, "_save_fig", save)
    for plot, name in ((plots.plot_eval_reward, "eval.png"), (plots.plot_final, "final.png")):
        assert plot("tldr", agg, tmp_path / name)
        kept, boxes, axes_box, labels = seen[name]
        assert boxes and all(kept.x0 - 1 <= b.x0 and b.x1 <= kept.x1 + 1 and kept.y0 - 1 <= b.y0 and b.y1 <= kept.y1 + 1
                             for b in boxes), name
        assert Image.open(tmp_path / name).size[0] >= kept.width - 2
    assert seen["eval.png"][1][0].x0 >= seen["eval.png"][2].x1  # the legend beside the axes
    assert all(label.endswith("(n=2, 1 eval problems)") for label in seen["final.png"][3] if label)


def test_colours_are_stable_across_reports(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    build_tldr(first)  # parallel, magrpo
    for name in ("discussion", "sequential"):  # more groups ahead of magrpo in the table
        make_run(second, f"{name}/0", algo=name, seed=0, max_steps=0, evals={0: {"reward": 0.3}})
    make_run(second, "parallel/0", algo="parallel", seed=0, max_steps=0, evals={0: {"reward": 0.2}})
    make_run(second, "parallel/1", algo="parallel", seed=1, max_steps=0, evals={0: {"reward": 0.4}})
    for seed in (0, 1):
        make_run(second, f"magrpo/{seed}", algo="magrpo", seed=seed, evals={0: {"reward": 0.5}, 5: {"reward": 1.0}})
    plt = _pyplot()
    colors = []
    for root in (first, second):
        fig, ax = plt.subplots()
        draw_eval_reward(ax, aggregate(find_runs([root]))["tldr"])
        colors.append(_legend_colors(ax))
        plt.close(fig)
    assert list(aggregate(find_runs([second]))["tldr"]["methods"]).index("magrpo") == 3  # position 1 in the first
    for label in ("magrpo (n=2)", "parallel (n=2), no training"):
        assert colors[0][label] == colors[1][label], label
    assert colors[1]["magrpo (n=2)"] != colors[1]["parallel (n=2), no training"]


def test_final_chart_puts_each_group_on_its_own_row_with_its_interval(tmp_path, axes):
    root = tmp_path / "runs"
    # A matched-budget comparison: both methods end at 60 joint actions, where an eval plot stacks them.
    for algo, rewards in (("magrpo", (0.0, 0.2, 0.1)), ("collm_cc", (0.3, 0.1, 0.2))):
        for seed, reward in enumerate(rewards):
            make_run(root, f"{algo}/{seed}", algo=algo, seed=seed, task="strbuild", max_steps=2,
                     train={1: 0.0, 2: 0.1}, evals={2: {"reward": reward}}, joint_actions=30)
    agg = aggregate(find_runs([root]))["strbuild"]
    assert draw_final(axes, agg)
    segments = [seg for coll in axes.collections for seg in coll.get_segments()]
    assert len(segments) == 2
    by_y = {seg[0][1]: (seg[0][0], seg[1][0]) for seg in segments}
    assert len(by_y) == 2  # one row each: nothing stacks
    heads = [a["headline"] for a in agg["methods"].values()]
    assert sorted(by_y.values()) == sorted((h["ci_low"], h["ci_high"]) for h in heads)
    assert [t.get_text() for t in axes.get_yticklabels()] == [f"{m} (n=3, ? eval problems)"
                                                              for m in reversed(agg["methods"])]


# ------------------------------------------------------------------- issue 44: labels, colours, order, metric
def test_long_labels_keep_the_figures_small_and_the_legend_off_the_curves(tmp_path, monkeypatch):
    """Four runs differing in 35 keys gave a 1881-px-wide chart with the legend over the curves
    ("Tight layout not applied"): the labels are wrapped to a few short lines, the legend sits
    beside the axes and the figures keep a sane size."""
    import warnings

    from PIL import Image

    from marl_llm.report import plots

    root = tmp_path / "runs"
    for g in range(4):
        knobs = {f"knob_{k:02d}_with_a_long_name": g * 100 + k for k in range(35)}
        make_run(root, f"g{g}", algo="magrpo", seed=0, train={1: 0.1 * g, 2: 0.2 * g},
                 evals={0: {"reward": 0.1}, 2: {"reward": 0.2 * g}}, config={"algo": knobs})
    boxes = {}
    real_save = plots._save_fig

    def save(fig, path):
        fig.canvas.draw()
        ax, renderer = fig.axes[0], fig.canvas.get_renderer()
        legend = ax.get_legend()
        boxes[path.name] = (ax.get_window_extent(renderer), legend and legend.get_window_extent(renderer),
                            [t.get_text() for t in (legend.get_texts() if legend else ax.get_yticklabels())])
        real_save(fig, path)

    monkeypatch.setattr(plots, "_save_fig", save)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = write_report(find_runs([root]), tmp_path / "out")
    assert not [w for w in caught if "ight layout" in str(w.message)]
    pngs = {p.name: Image.open(p).size for p in written if p.suffix == ".png"}
    assert set(pngs) == {"tldr_train_reward.png", "tldr_eval_reward.png", "tldr_final.png"}
    assert all(w <= 1300 and h <= 900 for w, h in pngs.values()), pngs
    for name in ("tldr_train_reward.png", "tldr_eval_reward.png"):
        axes_box, legend_box, texts = boxes[name]
        assert legend_box.x0 >= axes_box.x1, name  # beside the curves, not over them
        assert len(texts) == 4 and all(t.count("\n") <= 2 and "+" in t for t in texts), texts
        assert len(set(texts)) == 4 and all(len(line) <= 48 for t in texts for line in t.splitlines())
    rows = [t for t in boxes["tldr_final.png"][2] if t]
    assert len(rows) == 4 and all(t.count("\n") <= 3 and t.endswith("(n=1, ? eval problems)") for t in rows)


def test_colours_never_repeat_and_rows_sort_by_number(tmp_path, axes):
    """Twelve groups: twelve colours (tab10 ran out and hashed labels collided); the rows of a
    learning-rate sweep in numeric order (as text, 0.0001 sorted before 1e-05)."""
    root = tmp_path / "runs"
    rates = [10.0 ** -k for k in range(1, 13)]
    for lr in rates:
        make_run(root, f"lr{lr}", algo="magrpo", seed=0, evals={0: {"reward": 0.5}, 5: {"reward": lr}},
                 config={"algo": {"learning_rate": lr}})
    agg = aggregate(find_runs([root]))["tldr"]
    assert list(agg["methods"]) == [f"magrpo learning_rate={lr}" for lr in sorted(rates)]
    draw_eval_reward(axes, agg)
    colors = _legend_colors(axes)
    assert len(colors) == 12 and len(set(colors.values())) == 12


def test_metric_chooses_the_headline_and_a_wrong_one_is_one_line(tmp_path, capsys):
    root = tmp_path / "runs"
    build_tldr(root)
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out), "--metric", "structure"]) == 0
    header = next(line for line in (out / "tldr.md").read_text().splitlines() if line.startswith("| method"))
    assert "| structure IQM [95% CI] | eval problems | structure | eval/reward | style |" in header
    agg = aggregate(find_runs([root]), metric="eval/rewards/structure/mean")["tldr"]
    assert agg["headline"] == "eval/rewards/structure/mean"
    assert agg["methods"]["magrpo"]["headline"]["values"] == [0.4, 0.6]
    capsys.readouterr()
    assert main([str(root), "--out", str(tmp_path / "bad"), "--metric", "pass@9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --metric pass@9: no run's final evaluation has it; choose one of ")
    assert "reward" in err[-1] and "Traceback" not in "".join(err) and not (tmp_path / "bad").exists()


def test_old_at_grpo_runs_stay_off_the_team_reward_axis(tmp_path, capsys):
    """Before issue 44 AT-GRPO logged its alpha x team + own scores as train/reward: such a run is
    left out of the training-reward curve, with a warning; a run that logs train/reward_mixed is
    plotted with MAGRPO's."""
    root = tmp_path / "runs"
    old = make_run(root, "old", algo="at_grpo", seed=0, train={1: -0.75}, evals={1: {"reward": 0.25}})
    new = make_run(root, "new", algo="at_grpo", seed=1, train={1: 0.25}, evals={1: {"reward": 0.25}},
                   config={"algo": {"alpha": 2.0}})
    with (new / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 1, "train/reward_mixed": -0.75}) + "\n")
    agg = aggregate(find_runs([root]))["tldr"]
    curves = {label: m["train_curve"] for label, m in agg["methods"].items()}
    assert curves == {"at_grpo alpha=2.0": [{"step": 1, "mean": 0.25, "std": None, "count": 1}], "at_grpo": []}
    assert any("train/reward as AT-GRPO's alpha x team + own scores" in w and "old" in w for w in agg["warnings"])


def test_runs_of_user_environments_are_named_by_their_class_or_label(tmp_path):
    """task=env runs of two environment classes and one labelled run: three tasks, not one "env"."""
    from marl_llm.report.runs import find_runs

    for i, env in enumerate(("my_games:Guess", "my_pz_games:Meet")):
        make_run(tmp_path, f"env/{i}", algo="magrpo", seed=0, task="env", config={"task": {"env": env}},
                 evals={0: {"reward": 0.1}, 5: {"reward": 0.2}})
    make_run(tmp_path, "env/2", algo="magrpo", seed=0, task="env",
             config={"task": {"env": "my_games:Guess", "label": "guess-hard"}}, evals={5: {"reward": 0.3}})
    assert sorted(r.task for r in find_runs([tmp_path])) == ["Guess", "Meet", "guess-hard"]
