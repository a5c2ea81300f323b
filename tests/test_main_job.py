"""The main job (`make run` = experiment=magrpo_humaneval_cpu) keeps the task's own reward, and
scripts/measure_main_job.py runs it through the console script and writes its report and plot
(here on the tiny model, two steps: the script's plumbing, not the measurement)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, TEST_DEVICE, compose_config


def test_make_run_is_the_preset_on_the_tasks_own_reward():
    assert "marl-llm experiment=magrpo_humaneval_cpu" in (REPO / "Makefile").read_text()
    job, plain = (compose_config([*extra, "run_dir=/tmp/x"]) for extra in (["experiment=magrpo_humaneval_cpu"], []))
    assert (job.algo.name, job.task.name, job.model.name) == ("magrpo", "humaneval", plain.model.name)
    assert job.task == plain.task  # the task's own data, reward (variant fixed, shift) and sandbox
    assert job.algo.sampling.stop == "code" and job.algo.num_turns == 1


def test_the_measurement_script_runs_the_job_and_writes_the_report(tiny_model_dir, tmp_path):
    md = tmp_path / "results" / "main.md"
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "measure_main_job.py"), "--seeds", "3", "--out-dir", str(tmp_path / "runs"),
         "--md", str(md), "model=local", f"model.path={tiny_model_dir}", f"model.device={TEST_DEVICE}",
         "trainer.max_steps=2", "trainer.prompts_per_step=1", "trainer.eval_max_problems=1", "algo.num_generations=2",
         "algo.sampling.max_new_tokens=8", "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]",
         "trainer.export_agents=false"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = md.read_text()
    assert "| 3 | " in text and "| **mean** |" in text and "steps with reward spread" in text
    assert "| 1 | " in text and "| 2 | " in text  # the train reward of each step
    assert "experiment=magrpo_humaneval_cpu seed=3" in text and (tmp_path / "runs" / "seed3" / "measure.json").is_file()
    assert md.with_suffix(".png").stat().st_size > 10_000
    # Reporting finished runs only runs nothing and gives the same table.
    again = subprocess.run([sys.executable, str(REPO / "scripts" / "measure_main_job.py"), "--runs",
                            str(tmp_path / "runs" / "seed3"), "--md", str(tmp_path / "again.md")],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    def table(t: str) -> str:
        return t.split("## Before")[1].split("## Train")[0]
    assert table(text) == table((tmp_path / "again.md").read_text())
