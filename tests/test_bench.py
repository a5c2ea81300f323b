"""`make bench` runs: the real benchmark CLI on a tiny model with tiny settings. Timings are
measured and written, never asserted; the test checks that every system ran the same work and
that the report and figures are written."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import VENV_BIN

PEERS = ("comlrl_magrpo", "trl_grpo")


@pytest.mark.slow
def test_bench_runs_every_system_and_writes_the_report(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([str(VENV_BIN / "marl-llm-bench"), "--quick", "--model", str(tiny_model_dir), "--out", str(out),
                           "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    groups = report["groups"]
    assert set(groups) == {"magrpo", "grpo"}
    assert set(groups["magrpo"]) == {"marl_magrpo", "comlrl_magrpo", "bare_generate"}
    for group in groups.values():
        for name, r in group.items():
            if name in PEERS and "error" in r:  # the bench extra is missing: say how to get it
                assert "pip install -e '.[bench]'" in r["error"]
                continue
            assert "error" not in r, (name, r)
            w = r["workload"]
            # Every system generated exactly agents x G x new_tokens tokens per step.
            assert r["tokens_per_step"] == w["agents"] * w["num_generations"] * w["new_tokens"], name
            assert r["median_step_s"] > 0 and r["peak_rss_gib"] > 0
            assert 0 < r["median_rollout_s"] <= r["median_step_s"]
    levers = report["levers"]
    assert set(levers) == {"hf_generate_peft_mixed", "own_decode_peft_mixed", "own_decode_mixed_lora", "own_decode_all",
                           "bare_generate_no_lora"}
    assert all(v["median_s"] > 0 for v in levers.values())
    ratios = report["ratios"]
    assert ratios["rollout_throughput_vs_bare_generate"] > 0
    if "error" not in groups["magrpo"]["comlrl_magrpo"]:
        assert ratios["magrpo_step_time_vs_comlrl"] > 0 and ratios["magrpo_peak_rss_vs_comlrl"] > 0
    # The scaling curve doubles each axis; the agent axis really ran 4 agents.
    points = {(p["axis"], p["value"]): p for p in report["scaling"]}
    assert set(points) == {("num_generations", 2), ("num_generations", 4), ("agents", 2), ("agents", 4),
                           ("new_tokens", 4), ("new_tokens", 8)}
    assert points[("agents", 4)]["tokens_per_step"] == 2 * points[("agents", 2)]["tokens_per_step"]
    md = (out / "bench.md").read_text()
    assert "| marl-llm MAGRPO |" in md and "## Ratios (same run)" in md and report["command"] in md
    assert (out / "bench_scaling.png").stat().st_size > 10_000
    if report["profile_error"] is None:
        profile = (out / "bench_profile.md").read_text()
        assert "MAGRPO.collect" in profile and "MAGRPO.update" in profile
    else:
        assert "pip install -e '.[bench]'" in report["profile_error"]


def test_replicated_roles_scale_the_team_without_changing_the_task():
    from marl_llm.bench.workload import Workload, workload_task

    task, problems = workload_task(Workload(agents=4))
    base, _ = workload_task(Workload(agents=2))
    assert task.agent_names == ("concise0", "detailed0", "concise1", "detailed1")
    assert task.initial_prompts(problems[0]) == base.initial_prompts(problems[0]) * 2
    good = ["A short summary.", "A longer and more detailed summary of the post, with its main points."]
    bad = ["", ""]
    r_good, r_bad = (base.joint_rewards(problems[:1], [a])[0].total for a in (good, bad))
    mixed = task.joint_rewards(problems[:1], [good + bad])[0].total
    assert mixed == pytest.approx((r_good + r_bad) / 2)
    with pytest.raises(ValueError, match="multiple of 2"):
        workload_task(Workload(agents=3))
