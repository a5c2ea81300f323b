"""marl-llm-report on synthetic run directories: table numbers computed by hand, plots, warnings, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

from marl_llm.report import aggregate, find_runs, main, write_report

PNG_MAGIC = b"\x89PNG"


def make_run(root: Path, name: str, *, algo: str, seed: int, task: str = "tldr", max_steps: int = 5,
             train: dict[int, float] | None = None, evals: dict[int, dict[str, float]] | None = None,
             wall_s: float = 10.0, group: str | None = None, finished: bool = True,
             extra_lines: list[str] = (), joint_actions: float | None = None) -> Path:
    """A run dir as the trainer writes it: config.yaml, metrics.jsonl and (if finished) summary.json."""
    d = root / name
    d.mkdir(parents=True)
    group_yaml = "null" if group is None else group
    (d / "config.yaml").write_text(
        f"algo:\n  name: {algo}\ntask:\n  name: {task}\nmodel:\n  name: tiny\nseed: {seed}\n"
        f"logger:\n  group: {group_yaml}\ntrainer:\n  max_steps: {max_steps}\n")
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
        (d / "summary.json").write_text(json.dumps({"before": before, "after": after, "steps": max_steps,
                                                    "wall_s": wall_s, "sec_per_step": None}))
    return d


def levels(reward: float, structure: float, style: float) -> dict[str, float]:
    return {"reward": reward, "rewards/structure/mean": structure, "rewards/style/mean": style}


def build_tldr(root: Path) -> None:
    # magrpo: eval reward 0.5 -> 1.0 (seed 0) and 1.0 -> 2.0 (seed 1): final 1.500 ± 0.500, Δ 0.750 ± 0.250.
    make_run(root, "magrpo/0", algo="magrpo", seed=0, train={s: 0.1 * s for s in range(1, 6)},
             evals={0: levels(0.5, 0.2, 0.1), 5: levels(1.0, 0.4, 0.3)}, wall_s=100.0)
    make_run(root, "magrpo/1", algo="magrpo", seed=1, train={s: 0.3 * s for s in range(1, 6)},
             evals={0: levels(1.0, 0.2, 0.1), 5: levels(2.0, 0.6, 0.5)}, wall_s=200.0)
    # parallel: evaluation only (max_steps 0), rewards 0.2 and 0.4: 0.300 ± 0.100, Δ 0.
    make_run(root, "parallel/0", algo="parallel", seed=0, max_steps=0, evals={0: levels(0.2, 0.1, 0.0)}, wall_s=5.0)
    make_run(root, "parallel/1", algo="parallel", seed=1, max_steps=0, evals={0: levels(0.4, 0.3, 0.2)}, wall_s=7.0)
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
    assert header == ["method", "n", "steps", "eval/reward", "structure", "style", "Δ vs step 0", "train time (s)"]
    col = {h: i for i, h in enumerate(header)}
    magrpo, parallel = rows["magrpo"], rows["parallel"]
    assert magrpo[col["n"]] == "2" and parallel[col["n"]] == "2"
    assert magrpo[col["steps"]] == "5" and parallel[col["steps"]] == "0"
    assert magrpo[col["eval/reward"]] == "1.500 ± 0.500"
    assert magrpo[col["structure"]] == "0.500 ± 0.100"
    assert magrpo[col["style"]] == "0.400 ± 0.100"
    assert magrpo[col["Δ vs step 0"]] == "0.750 ± 0.250"
    assert magrpo[col["train time (s)"]] == "150.0 ± 50.0"
    assert parallel[col["eval/reward"]] == "0.300 ± 0.100"
    assert parallel[col["Δ vs step 0"]] == "0.000 ± 0.000"
    # Prompt-only baselines come first.
    assert md.index("| parallel |") < md.index("| magrpo |")
    assert "crashed" not in md
    assert "## Runs" in md and "## Legend" in md and "## Commands" not in md

    for name in ("tldr_train_reward.png", "tldr_eval_reward.png"):
        png = out / name
        assert png.read_bytes()[:4] == PNG_MAGIC
        assert str(png) in captured.out
    assert not list(out.glob(".*.tmp")), "temporary files left behind"


def test_output_is_deterministic(tmp_path, capsys):
    root = tmp_path / "runs"
    build_tldr(root)
    assert main([str(root), "--out", str(tmp_path / "a")]) == 0
    assert main([str(root), "--out", str(tmp_path / "b")]) == 0
    for name in ("tldr.md", "tldr_train_reward.png", "tldr_eval_reward.png"):
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
    assert rows["magrpo"][3] == "1.500 ± 0.500"


def test_two_tasks_two_files_and_task_filter(tmp_path, capsys):
    root = tmp_path / "runs"
    build_tldr(root)
    code_eval = {"reward": 3.0, "rewards/tests/mean": 0.5, "pass@1": 0.25, "pass@10": 0.5}
    make_run(root, "he/single", algo="single", task="humaneval", seed=0, max_steps=0, evals={0: code_eval})
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.md")) == ["humaneval.md", "tldr.md"]
    he = table_rows((out / "humaneval.md").read_text())
    assert he["__header__"][3:7] == ["eval/reward", "tests", "pass@1", "pass@10"]
    assert he["single"][3] == "3.000 ± 0.000" and he["single"][5] == "0.250 ± 0.000"
    assert "magrpo" not in (out / "humaneval.md").read_text()
    # No train rows for humaneval: the train plot is skipped with a message, the eval plot is still drawn.
    assert not (out / "humaneval_train_reward.png").exists()
    assert (out / "humaneval_eval_reward.png").read_bytes()[:4] == PNG_MAGIC
    assert "skipping" in capsys.readouterr().out

    only = tmp_path / "only"
    assert main([str(root), "--out", str(only), "--task", "humaneval"]) == 0
    assert [p.name for p in only.glob("*.md")] == ["humaneval.md"]
    assert main([str(root), "--out", str(only), "--task", "arxiv"]) == 2


def test_turn_based_tasks_report_the_success_rate_first(tmp_path):
    root = tmp_path / "runs"
    game = {"reward": 0.5, "success_rate": 0.25, "rewards/solved/mean": 0.25}
    make_run(root, "sok/a", algo="at_grpo", task="sokoban", seed=0, max_steps=0, evals={0: game})
    make_run(root, "sok/b", algo="at_grpo", task="sokoban", seed=1, max_steps=0, evals={0: {**game, "success_rate": 0.75}})
    out = tmp_path / "out"
    assert main([str(root), "--out", str(out)]) == 0
    rows = table_rows((out / "sokoban.md").read_text())
    assert rows["__header__"][3:6] == ["success_rate", "eval/reward", "solved"]
    assert rows["at_grpo"][3] == "0.500 ± 0.250"


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
    assert [p.name for p in written] == ["tldr.md", "tldr_eval_reward.png"]


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
    assert rows["magrpo"][col] == "120 ± 0" and rows["collm_cc"][col] == "114 ± 6"
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
