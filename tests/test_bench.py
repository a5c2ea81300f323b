"""`make bench` runs: the real benchmark CLI on a tiny model with tiny settings. Timings are
measured and written, never asserted; the test checks that every system ran the same work and
that the report and figures are written."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import VENV_BIN

PEERS = ("comlrl_magrpo", "trl_grpo", "comlrl_maac", "comlrl_iac")


@pytest.mark.slow
def test_bench_runs_every_system_and_writes_the_report(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run([str(VENV_BIN / "marl-llm-bench"), "--quick", "--model", str(tiny_model_dir), "--out", str(out),
                           "--threads", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    groups = report["groups"]
    assert set(groups) == {"magrpo", "grpo", "collm_cc", "collm_dc"}
    assert set(groups["magrpo"]) == {"marl_magrpo", "comlrl_magrpo", "bare_generate"}
    assert set(groups["collm_cc"]) == {"marl_collm_cc", "comlrl_maac"}
    assert set(groups["collm_dc"]) == {"marl_collm_dc", "comlrl_iac"}
    for group in groups.values():
        for name, r in group.items():
            if name in PEERS and "error" in r:  # the bench extra is missing: say how to get it
                assert "pip install -e '.[bench]'" in r["error"]
                continue
            assert "error" not in r, (name, r)
            w = r["workload"]
            # Every system generated exactly agents x prompts x G x new_tokens tokens per step.
            assert r["tokens_per_step"] == w["agents"] * w["prompts_per_step"] * w["num_generations"] * w["new_tokens"], name
            assert r["median_step_s"] > 0 and r["peak_rss_gib"] > 0
            assert 0 < r["median_rollout_s"] <= r["median_step_s"]
    levers = report["levers"]
    assert set(levers) == {"hf_generate_peft_mixed", "own_decode_peft_mixed", "own_decode_mixed_lora", "own_decode_all",
                           "own_decode_static", "bare_generate_no_lora"}
    assert all(v["median_s"] > 0 for v in levers.values())
    ratios = report["ratios"]
    assert ratios["rollout_throughput_vs_bare_generate"] > 0
    if "error" not in groups["magrpo"]["comlrl_magrpo"]:
        assert ratios["magrpo_step_time_vs_comlrl"] > 0 and ratios["magrpo_peak_rss_vs_comlrl"] > 0
    # CoLLM: one trajectory per post, several posts per step; per joint action against MAGRPO.
    assert groups["collm_cc"]["marl_collm_cc"]["workload"]["prompts_per_step"] > 1
    assert ratios["collm_cc_per_joint_action_vs_magrpo"] > 0 and ratios["collm_dc_per_joint_action_vs_magrpo"] > 0
    if "error" not in groups["collm_cc"]["comlrl_maac"]:
        assert ratios["collm_cc_step_time_vs_comlrl_maac"] > 0 and ratios["collm_dc_step_time_vs_comlrl_iac"] > 0
    # The scaling curve doubles each axis; the agent axis really ran 4 agents.
    points = {(p["axis"], p["value"]): p for p in report["scaling"]}
    assert set(points) == {("num_generations", 2), ("num_generations", 4), ("agents", 2), ("agents", 4),
                           ("new_tokens", 4), ("new_tokens", 8)}
    assert points[("agents", 4)]["tokens_per_step"] == 2 * points[("agents", 2)]["tokens_per_step"]
    md = (out / "bench.md").read_text()
    assert "| marl-llm MAGRPO |" in md and "## Ratios (same run)" in md and report["command"] in md
    assert "| marl-llm CoLLM-CC |" in md and "| marl-llm CoLLM-DC / MAGRPO, seconds per joint action (comlrl's granularity) |" in md
    assert (out / "bench_scaling.png").stat().st_size > 10_000
    if report["profile_error"] is None:
        profile = (out / "bench_profile.md").read_text()
        assert "MAGRPO.collect" in profile and "MAGRPO.update" in profile
    else:
        assert "pip install -e '.[bench]'" in report["profile_error"]


@pytest.mark.slow
def test_groups_selector_runs_a_collm_group_alone(tiny_model_dir, tmp_path, capsys):
    """`--groups collm_cc` runs that group alone (no other group, no levers; scaling and profile
    switched off); an unknown group names the choices."""
    from marl_llm.bench.__main__ import main

    with pytest.raises(SystemExit) as err:
        main(["--groups", "collm_xx", "--out", str(tmp_path)])
    assert err.value.code == 2 and "choose from magrpo, grpo, collm" in capsys.readouterr().err
    out = tmp_path / "results"
    assert main(["--quick", "--model", str(tiny_model_dir), "--out", str(out), "--threads", "1", "--groups", "collm_cc",
                 "--no-scaling", "--no-profile"]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert list(report["groups"]) == ["collm_cc"] and "levers" not in report and "scaling" not in report
    ours = report["groups"]["collm_cc"]["marl_collm_cc"]
    assert ours["tokens_per_step"] == 2 * 2 * 4  # 2 agents x 2 posts x 4 tokens (--quick)
    assert report["ratios"]["collm_cc_per_joint_action_vs_magrpo"] is None  # magrpo did not run
    assert "## collm_cc: 2 agent(s), G=1, 2 posts per step" in (out / "bench.md").read_text()


def test_collm_ratios_per_joint_action():
    """Seconds per joint action divide by the joint actions of each system's own workload."""
    from marl_llm.bench.__main__ import collm_ratios

    magrpo = {"median_step_s": 8.0, "peak_rss_gib": 2.0, "workload": {"num_generations": 4}}  # old reports: no prompts_per_step
    cc = {"median_step_s": 12.0, "peak_rss_gib": 3.0, "workload": {"num_generations": 1, "prompts_per_step": 4}}
    maac = {"median_step_s": 24.0, "peak_rss_gib": 6.0, "workload": cc["workload"]}
    r = collm_ratios({"magrpo": {"marl_magrpo": magrpo}, "collm_cc": {"marl_collm_cc": cc, "comlrl_maac": maac}})
    assert r["collm_cc_per_joint_action_vs_magrpo"] == pytest.approx((12.0 / 4) / (8.0 / 4))
    assert r["collm_cc_step_time_vs_comlrl_maac"] == pytest.approx(0.5)
    assert r["collm_cc_peak_rss_vs_comlrl_maac"] == pytest.approx(0.5)
    assert r["collm_dc_step_time_vs_comlrl_iac"] is None  # the group did not run


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
