"""Exact resume after a hard kill: SIGKILL halfway through writing a checkpoint, then
`trainer.resume=true`, gives the same adapters and the same logged metrics as an uninterrupted
run; a corrupt latest checkpoint falls back to the previous one, with a message."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch

from conftest import VENV_BIN, compose_config, tiny_overrides
from marl_llm.config import UserError
from marl_llm.trainer import train
from test_trainer import adapters, metrics, same_adapters, trained

TIMING = ("step_time", "perf/", "timing/")


def steady(rows):
    """Metric rows without the wall-clock ones (they differ between any two runs)."""
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def overrides(model_dir, run_dir, steps, *extra):
    # The raw baseline: advantage = shifted reward, so the adapters move even though the tiny
    # model's rewards are all equal (group-relative advantages would be zero).
    return tiny_overrides(model_dir, run_dir, f"trainer.max_steps={steps}", "trainer.save_every=1",
                          "trainer.eval_before=false", "trainer.eval_after=false", "algo.baseline=raw",
                          "trainer.deterministic=true", *extra)



@pytest.mark.slow
def test_sigkill_mid_checkpoint_then_resume_matches_an_uninterrupted_run(tiny_model_dir, tmp_path):
    straight = tmp_path / "straight"
    train(compose_config(overrides(tiny_model_dir, straight, 3)))
    killed = tmp_path / "killed"
    # The console script runs with this process's torch threads: a float sum split over another
    # number of threads rounds differently (grad norms differ at 1e-7).
    env = dict(os.environ, MARL_LLM_FAULT="kill_in_checkpoint:2", OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.run([str(VENV_BIN / "marl-llm"), *overrides(tiny_model_dir, killed, 3)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [r["step"] for r in metrics(killed)] == [1, 2]  # step 2 was logged, its checkpoint never finished
    assert any(p.name.endswith(".tmp") for p in killed.iterdir())  # the half-written checkpoint
    train(compose_config(overrides(tiny_model_dir, killed, 3, "trainer.resume=true")))
    assert [r["step"] for r in metrics(killed)] == [1, 2, 3]  # step 2 is not logged twice
    assert steady(metrics(killed)) == steady(metrics(straight))
    assert trained(adapters(straight)) and same_adapters(adapters(killed), adapters(straight))


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tiny_model_dir, tmp_path, capsys):
    straight = tmp_path / "straight"
    train(compose_config(overrides(tiny_model_dir, straight, 3)))
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 2)))
    assert (run / "checkpoint.prev.pt").exists()  # the end-of-run save rotated step 2's into it
    blob = (run / "checkpoint.pt").read_bytes()
    (run / "checkpoint.pt").write_bytes(blob[: len(blob) // 3])  # a partial copy
    capsys.readouterr()
    train(compose_config(overrides(tiny_model_dir, run, 3, "trainer.resume=true")))
    out = capsys.readouterr().out
    assert "checkpoint.pt is unreadable" in out and "resuming from checkpoint.prev.pt (step 2)" in out
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert steady(metrics(run)) == steady(metrics(straight))
    assert same_adapters(adapters(run), adapters(straight))
    # Both unusable: a clear error that names the fix, not a traceback from torch.load.
    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    (run / "checkpoint.prev.pt").write_bytes(b"")
    with pytest.raises(UserError, match="no usable checkpoint.*start a new run dir"):
        train(compose_config(overrides(tiny_model_dir, run, 4, "trainer.resume=true")))


def test_a_requeued_slurm_job_resumes_without_being_told(tiny_model_dir, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 2)))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # what SLURM sets on a requeued job
    capsys.readouterr()
    train(compose_config(overrides(tiny_model_dir, run, 3)))  # no trainer.resume
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]


def test_resume_before_any_checkpoint_starts_over_with_clean_logs(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "train/reward": 9.0}\n')  # a run killed before its first save
    train(compose_config(overrides(tiny_model_dir, run, 1, "trainer.resume=true")))
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1] and rows[0]["train/reward"] != 9.0


class Planted:
    """A pickle that runs code when unpickled: it would create `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_a_planted_pickle_in_a_checkpoint_never_runs(tiny_model_dir, tmp_path, capsys):
    """Checkpoints load as tensors and plain data only: code planted in checkpoint.pt does not run
    at resume; the run falls back to checkpoint.prev.pt and says why."""
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 2)))
    marker = tmp_path / "planted-code-ran"
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["wandb_id"] = Planted(marker)
    torch.save(state, run / "checkpoint.pt")
    capsys.readouterr()
    train(compose_config(overrides(tiny_model_dir, run, 3, "trainer.resume=true")))
    assert not marker.exists()
    out = capsys.readouterr().out
    assert "checkpoint.pt is not plain data (it would run os.makedirs" in out and "resuming from checkpoint.prev.pt" in out
    # Both planted: a clear refusal, still nothing run.
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        torch.save({**state, "step": 2}, run / name)
    with pytest.raises(UserError, match="no usable checkpoint.*not plain data"):
        train(compose_config(overrides(tiny_model_dir, run, 4, "trainer.resume=true")))
    assert not marker.exists()


def test_checkpoints_with_numpys_own_rng_state_still_resume(tiny_model_dir, tmp_path):
    """Checkpoints written before the RNG state became plain data hold numpy's tuple (an array):
    they resume exactly as before."""
    import numpy as np

    straight = tmp_path / "straight"
    train(compose_config(overrides(tiny_model_dir, straight, 3)))
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 2)))
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    n = state["rng"]["numpy"]
    state["rng"]["numpy"] = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    torch.save(state, run / "checkpoint.pt")
    train(compose_config(overrides(tiny_model_dir, run, 3, "trainer.resume=true")))
    assert steady(metrics(run)) == steady(metrics(straight))
    assert same_adapters(adapters(run), adapters(straight))


def test_a_fresh_run_never_starts_in_a_dir_that_holds_a_run(tiny_model_dir, tmp_path):
    """Starting (not resuming) in a run's dir is refused, naming the fix, and leaves that run's
    checkpoints and logs exactly as they were; resuming it is still allowed."""
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 1)))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert {"checkpoint.pt", "metrics.jsonl", ".marl-llm-run"} <= set(before)
    with pytest.raises(UserError, match=r"already holds a run \(\.marl-llm-run, checkpoint\.pt.*trainer\.resume=true"):
        train(compose_config(overrides(tiny_model_dir, run, 2)))
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    train(compose_config(overrides(tiny_model_dir, run, 2, "trainer.resume=true")))
    assert [r["step"] for r in metrics(run)] == [1, 2]


def test_two_runs_starting_in_one_dir_at_once_get_it_once(tmp_path):
    from marl_llm import rundir

    run = tmp_path / "same-second"
    assert rundir.claim(run, resume=False) is None
    refusal = rundir.claim(run, resume=False)  # the second of two runs that picked the same dir
    assert refusal is not None and "already holds a run (.marl-llm-run)" in refusal
    assert rundir.claim(run, resume=True) is None
