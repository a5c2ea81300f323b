"""`marl-llm-bench tiny` runs each `marl-llm debug=tiny ...` command and writes its report: exit
codes, wall and CPU time, where the time went; a failing command is a row with its exit code and
one-line error, not a crash. Timings are measured, never asserted beyond being there."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import VENV_BIN
from marl_llm.bench.tiny_runs import NEEDS_OWN_CODE, README_COMMANDS, command_list, pair_overrides, wall_split

# Shorter than debug=tiny's own (32 new tokens): the tiny model's run is then mostly its imports.
SHORT = "algo.num_generations=2 algo.sampling.max_new_tokens=4 algo.lora.r=4"


@pytest.mark.slow
def test_tiny_bench_reports_each_command_and_a_failing_one(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    pairs = [f"magrpo:humaneval:{SHORT}", "magrpo:humaneval:trainer.max_stepz=1"]  # the second: a misspelled key
    proc = subprocess.run([str(VENV_BIN / "marl-llm-bench"), "tiny", "--model", str(tiny_model_dir), "--warmup", "0",
                           "--out", str(out), "--pairs", *pairs], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # a command failed: said, after the report
    assert "Traceback" not in proc.stderr
    report = json.loads((out / "debug_tiny.json").read_text())
    good, bad = report["rows"]
    assert good["command"] == f"marl-llm debug=tiny algo=magrpo task=humaneval {SHORT}"
    assert good["exit_codes"] == [0] and good["errors"] == []
    run = good["runs"][0]
    assert run["wall_s"] > 0 and run["cpu_s"] > 0 and run["steps"] == 1
    # The split comes from the run's own files: its job log, metrics.jsonl, summary.json.
    for key in ("first_log_s", "load_s", "steps_s", "eval_s", "loop_wall_s"):
        assert run[key] > 0, (key, run)
    assert run["first_log_s"] + run["load_s"] + run["steps_s"] + run["eval_s"] < run["wall_s"]
    assert bad["exit_codes"] == [2]
    assert len(bad["errors"]) == 1 and bad["errors"][0].startswith("error: unknown config key trainer.max_stepz")
    assert bad["runs"][0]["wall_s"] > 0 and bad["runs"][0]["steps_s"] is None
    assert report["machine"]["cores"] > 0 and len(report["load_average_before"]) == 3
    md = (out / "debug_tiny.md").read_text()
    assert report["command"] in md and "load average (1 min)" in md
    assert f"| `{good['command']}` | 0 |" in md and f"| `{bad['command']}` | 2 |" in md
    assert "Failed:" in md and "unknown config key trainer.max_stepz" in md
    assert "error: unknown config key trainer.max_stepz" in proc.stderr


def test_commands_default_to_the_readmes_and_all_adds_every_algo_and_task():
    commands, notes = command_list(None, False)
    assert commands == README_COMMANDS and notes == []
    commands, notes = command_list(None, True)
    assert commands[:3] == README_COMMANDS
    assert ["algo=collm_dc", "task=humaneval"] in commands and ["algo=magrpo", "task=plan_path"] in commands
    assert ["algo=magrpo", "task=humaneval"] not in commands  # README's bare debug=tiny is that pair
    assert not any(f"task={task}" in c for c in commands for task in NEEDS_OWN_CODE)
    assert len(notes) == len(NEEDS_OWN_CODE)
    assert len(commands) == len({tuple(c) for c in commands})
    commands, _ = command_list(["magrpo:humaneval", "at_grpo:sokoban"], True)  # --pairs replace the README's
    assert commands[:2] == [["algo=magrpo", "task=humaneval"], ["algo=at_grpo", "task=sokoban"]]
    assert commands.count(["algo=magrpo", "task=humaneval"]) == 1


def test_pairs_keep_colons_in_their_overrides_and_refuse_what_is_no_pair():
    assert pair_overrides("magrpo:env:task.env=my_games:Guess algo.num_turns=2") == \
        ["algo=magrpo", "task=env", "task.env=my_games:Guess", "algo.num_turns=2"]
    for entry in ("magrpo", "magrpo:", ":tldr", "trainer.threads=1", "task.env=a:B"):
        with pytest.raises(ValueError, match="write algo:task"):
            pair_overrides(entry)


def test_the_split_reads_the_job_log_and_metrics(tmp_path):
    """Each evaluation counts from the line before it (a line logged within it, the KV cache
    budget or a thread change, does not start it) to its result line."""
    log = ["[2026-01-01 10:00:02,000][INFO][marl_llm] data for task humaneval: packaged",
           "[2026-01-01 10:00:05,000][INFO][marl_llm] magrpo on humaneval: agents aux, main on model [m]; run dir /r",
           "[2026-01-01 10:00:05,100][INFO][marl_llm] KV cache budget 11.3 GiB",
           "[2026-01-01 10:00:06,000][INFO][marl_llm] eval @ step 0: reward=0",
           "[2026-01-01 10:00:08,000][INFO][marl_llm] step 1/1: reward=0  step_time=2",
           "[2026-01-01 10:00:08,500][INFO][marl_llm] agents of step 1 written to /r/agents",
           "[2026-01-01 10:00:09,000][INFO][marl_llm] eval @ step 1: torch threads: 2 -> 1 (greedy rollout)",
           "[2026-01-01 10:00:09,500][INFO][marl_llm] eval @ step 1: reward=0"]
    (tmp_path / "cli.log").write_text("\n".join(log) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/reward": 0}) + "\n"
                                            + json.dumps({"step": 1, "train/step_time": 2.0}) + "\n")
    from datetime import datetime

    started = datetime(2026, 1, 1, 10, 0, 0).timestamp()
    split = wall_split(tmp_path, started, wall=11.0)
    assert split["first_log_s"] == pytest.approx(2.0) and split["load_s"] == pytest.approx(3.0)
    assert split["steps_s"] == pytest.approx(2.0) and split["steps"] == 1
    assert split["eval_s"] == pytest.approx(1.0 + 1.0)  # 10:00:05 -> :06, then :08.5 -> :09.5
    assert split["rest_s"] == pytest.approx(11.0 - 2 - 3 - 2 - 2)
    assert wall_split(tmp_path / "missing", started, wall=1.0)["first_log_s"] is None
