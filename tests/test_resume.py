"""Exact resume after a hard kill: SIGKILL halfway through writing a checkpoint, then
`trainer.resume=true`, gives the same adapters and the same logged metrics as an uninterrupted
run; a corrupt latest checkpoint falls back to the previous one, with a message."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch

from conftest import VENV_BIN, compose_config, tiny_overrides
from marl_llm.config import UserError
from marl_llm.runs import digest
from marl_llm.training.trainer import train
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
    assert not any(p.name.endswith(".tmp") for p in killed.iterdir())  # removed at the next start
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
    assert "checkpoint.pt is corrupt (its SHA-256 is" in out and "resuming from checkpoint.prev.pt (step 2)" in out
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


def test_resume_without_a_checkpoint_is_refused_unless_asked_to_start_over(tiny_model_dir, tmp_path, monkeypatch,
                                                                          capsys):
    """A run killed before its first checkpoint: trainer.resume=true refuses in one line (its logs
    untouched); trainer.resume=if_possible, and a requeued SLURM job, start over in the dir and
    keep the earlier attempt's logs aside, saying so."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "train/reward": 9.0}\n')
    (run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(UserError, match=r"nothing to resume in .*run: it has no checkpoint\.pt or checkpoint\.prev\.pt"
                                        r".*trainer\.resume=if_possible"):
        train(compose_config(overrides(tiny_model_dir, run, 1, "trainer.resume=true")))
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "train/reward": 9.0}\n'
    assert not (run / ".marl-llm-run").exists()  # refused before the dir was claimed
    capsys.readouterr()
    train(compose_config(overrides(tiny_model_dir, run, 1, "trainer.resume=if_possible")))
    out = capsys.readouterr().out
    assert "no checkpoint in" in out and "starting over at step 0" in out and "metrics.attempt-1.jsonl" in out
    assert (run / "metrics.attempt-1.jsonl").read_text() == '{"step": 1, "train/reward": 9.0}\n'
    assert (run / "config.attempt-1.yaml").read_text() == "seed: 0\n"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1] and rows[0]["train/reward"] != 9.0
    record = json.loads((run / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["started_over"] and record["set_aside"]["metrics.jsonl"] == "metrics.attempt-1.jsonl"
    # A requeued SLURM job is "if possible" without being told: the second attempt goes aside too.
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (run / name).unlink(missing_ok=True)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    train(compose_config(overrides(tiny_model_dir, run, 1)))
    assert (run / "metrics.attempt-2.jsonl").exists() and (run / "samples.attempt-2.jsonl").exists()
    assert [r["step"] for r in metrics(run)] == [1]
    with pytest.raises(UserError, match=r"trainer\.resume=maybe is not a choice: true .*if_possible"):
        train(compose_config(overrides(tiny_model_dir, run, 1, "trainer.resume=maybe")))


def test_a_resume_refuses_settings_that_change_training_unless_allowed(tiny_model_dir, tmp_path, capsys):
    """The checkpoint's config against the resume's: a changed seed, learning rate, G or model is
    refused in one line listing each `old -> new` and the switch that allows it; logging, eval,
    saving and max_steps need no permission; config.yaml stays the run's original, and every
    resume appends its changes to resumes.jsonl."""
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 1)))
    original = (run / "config.yaml").read_bytes()
    checkpoint = (run / "checkpoint.pt").read_bytes()
    other_model = tmp_path / "other_model"
    other_model.symlink_to(tiny_model_dir)
    changed = ("seed=3", "algo.learning_rate=1e-3", "algo.num_generations=3", f"model.path={other_model}")
    with pytest.raises(UserError) as refused:
        train(compose_config(overrides(tiny_model_dir, run, 2, "trainer.resume=true", *changed)))
    message = str(refused.value)
    assert "\n" not in message and "step 1" in message
    for shown in ("seed 0 -> 3", "algo.learning_rate 5e-05 -> 0.001", "algo.num_generations 2 -> 3",
                  f"model.path {tiny_model_dir} -> {other_model}"):
        assert shown in message
    assert "trainer.max_steps" not in message  # free: a longer run
    allow = "trainer.resume_allow_changes=[algo.learning_rate,algo.num_generations,model.path,seed] (or [all])"
    assert allow in message
    assert (run / "checkpoint.pt").read_bytes() == checkpoint and not (run / "resumes.jsonl").exists()
    # A key that names nothing is refused too (it would allow nothing).
    with pytest.raises(UserError, match=r"resume_allow_changes names algo\.lr, which is no config key"):
        train(compose_config(overrides(tiny_model_dir, run, 2, "trainer.resume=true", "seed=3",
                                       "trainer.resume_allow_changes=[algo.lr,seed]")))
    # Free settings: steps, logging, evaluation, saving.
    capsys.readouterr()
    train(compose_config(overrides(tiny_model_dir, run, 2, "trainer.resume=true", "logger.sample_rows=1",
                                   "trainer.eval_after=true", "trainer.eval_max_problems=1", "trainer.save_every=2")))
    assert "resumed from" in capsys.readouterr().out
    # Allowed by key and by section.
    train(compose_config(overrides(tiny_model_dir, run, 3, "trainer.resume=true", "seed=3", "algo.learning_rate=1e-3",
                                   "trainer.resume_allow_changes=[seed,algo]")))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert (run / "config.yaml").read_bytes() == original
    first, second = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert first["step"] == 1 and first["resumed_from"].endswith("checkpoint.pt")
    assert first["changes"]["trainer.max_steps"] == [1, 2] and first["changes"]["logger.sample_rows"][1] == 1
    assert second["step"] == 2 and second["changes"]["seed"] == [0, 3]
    assert second["changes"]["algo.learning_rate"] == [5e-05, 1e-3] and "time" in second
    # The next resume compares with the settings the run now has (the checkpoint's): nothing to allow.
    train(compose_config(overrides(tiny_model_dir, run, 4, "trainer.resume=true", "seed=3", "algo.learning_rate=1e-3")))
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def test_which_config_changes_a_resume_compares():
    from marl_llm.runs.checkpoint import ABSENT, config_changes, free_on_resume

    old = {"seed": 0, "algo": {"lora": {"r": 4}, "lr_scheduler": "constant", "policy_map": {}},
           "trainer": {"max_steps": 2, "eval_k": [1]}, "logger": {"project": "a"}}
    new = {"seed": 0, "algo": {"lora": None, "lr_scheduler": "constant", "policy_map": {"tool": "coder"}},
           "trainer": {"max_steps": 5, "eval_k": [1, 5], "resume_allow_changes": []}, "logger": {"project": "b"}}
    changes = config_changes(old, new)
    assert changes == {"algo.lora": ({"r": 4}, None), "algo.policy_map.tool": (ABSENT, "coder"),
                       "trainer.max_steps": (2, 5), "trainer.eval_k": ([1], [1, 5]),
                       "trainer.resume_allow_changes": (ABSENT, []), "logger.project": ("a", "b")}
    assert [k for k in changes if not free_on_resume(k, old)] == ["algo.lora", "algo.policy_map.tool"]
    assert free_on_resume("model.device", old) and free_on_resume("trainer.completions_per_micro_batch", old)
    assert not free_on_resume("model.dtype", old) and not free_on_resume("seed", old)
    # A cosine schedule decays over trainer.max_steps: extending the run changes its learning rates.
    cosine = {**old, "algo": {**old["algo"], "lr_scheduler": "cosine"}}
    assert not free_on_resume("trainer.max_steps", cosine) and free_on_resume("trainer.eval_k", cosine)


def test_settings_added_to_marl_llm_since_a_checkpoint_do_not_block_its_resume():
    from marl_llm.runs.checkpoint import added_setting

    cfg = compose_config(["algo=magrpo", "task=humaneval", "run_dir=/tmp/x"])
    assert added_setting("task.sandbox.tmp_mb", cfg) and added_setting("algo.learning_rate", cfg)
    assert not added_setting("algo.policy_map.tool", cfg)  # a key added to a map is a real change


@pytest.mark.slow
def test_ctrl_c_prints_one_line_whose_command_continues_the_run(tiny_model_dir, tmp_path):
    """SIGINT during training (the real console script): exit code 130, no traceback, one line
    with the step reached, the last checkpoint and the command that continues the run; that
    command (with fewer steps) resumes from the checkpoint and finishes."""
    import shlex
    import time

    run_dir = tmp_path / "run"
    args = [a for a in overrides(tiny_model_dir, run_dir, 1000) if not a.startswith("run_dir=")]
    args.append(f"hydra.run.dir={run_dir}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([str(VENV_BIN / "marl-llm"), *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    try:
        for line in proc.stdout:  # step 1's checkpoint is written before step 2 starts
            if line.startswith("[marl-llm] step 2/1000") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if "trainer.resume=true" in x]
    assert line.startswith("interrupted at step ") and "/1000, last checkpoint " in line
    assert f"{run_dir}/checkpoint.pt (step " in line
    command = shlex.split(line.split("continue with: ", 1)[1])
    assert command[0] == "marl-llm" and command[-2:] == [f"hydra.run.dir={run_dir}", "trainer.resume=true"]
    assert "task.data.train_split='test[33:37]'" in command  # the original overrides, quoted for the shell
    resumed_at = int(line.split("(step ", 1)[1].split(")")[0])
    assert resumed_at >= 1
    command = [str(VENV_BIN / "marl-llm")] + [a for a in command[1:] if not a.startswith("trainer.max_steps=")]
    again = subprocess.run([*command, f"trainer.max_steps={resumed_at + 1}"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoint.pt at step {resumed_at}" in again.stdout
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, resumed_at + 2))


def test_an_interrupt_before_the_first_checkpoint_names_the_start_over_command(tmp_path):
    """No checkpoint yet: trainer.resume=true would refuse, so the line names if_possible; without
    Hydra's context the run dir's .hydra/overrides.yaml gives the overrides."""
    from marl_llm.runs.rundir import Progress, interrupted_line

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- algo=at_grpo\n- trainer.resume=true\n- hydra.run.dir=/elsewhere\n- seed=2\n")
    line = interrupted_line(Progress(run_dir=tmp_path, step=3, max_steps=10, started=True))
    assert line == (f"interrupted at step 3/10, no checkpoint yet; start it over in its dir (its logs are kept aside) "
                    f"with: marl-llm algo=at_grpo seed=2 hydra.run.dir={tmp_path} trainer.resume=if_possible")


def read_checkpoint_reason(path):
    from marl_llm.runs.checkpoint import _read

    return _read(path)[1]


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
    # Its checksum no longer matches: refused before anything is unpickled.
    assert "corrupt (its SHA-256" in read_checkpoint_reason(run / "checkpoint.pt")
    # One who also rewrites the checksum meets the loader's own refusal.
    digest.write_digest(run / "checkpoint.pt", digest.file_digest(run / "checkpoint.pt"))
    capsys.readouterr()
    train(compose_config(overrides(tiny_model_dir, run, 3, "trainer.resume=true")))
    assert not marker.exists()
    out = capsys.readouterr().out
    assert "checkpoint.pt is not plain data (it would run os.makedirs" in out and "resuming from checkpoint.prev.pt" in out
    # Both planted: a clear refusal, still nothing run.
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        torch.save({**state, "step": 2}, run / name)
        digest.write_digest(run / name, digest.file_digest(run / name))
    with pytest.raises(UserError, match="no usable checkpoint.*not plain data"):
        train(compose_config(overrides(tiny_model_dir, run, 4, "trainer.resume=true")))
    assert not marker.exists()


def test_checkpoints_with_numpys_own_rng_state_still_resume(tiny_model_dir, tmp_path):
    """Checkpoints written before the RNG state became plain data hold numpy's tuple (an array):
    they resume exactly as before, once their digests are recorded as the refusal says (they had
    none; a checkpoint without digests is never loaded)."""
    import numpy as np

    straight = tmp_path / "straight"
    train(compose_config(overrides(tiny_model_dir, straight, 3)))
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 2)))
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    n = state["rng"]["numpy"]
    state["rng"]["numpy"] = (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    torch.save(state, run / "checkpoint.pt")
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):  # such checkpoints had no checksum either
        digest.sidecar(run / name).unlink()
    with pytest.raises(UserError, match="checkpoint.pt is unverified .*record them with: ") as refused:
        train(compose_config(overrides(tiny_model_dir, run, 3, "trainer.resume=true")))
    fix = str(refused.value).split("record them with: ", 1)[1].split("; then resume again")[0]
    subprocess.run(fix, shell=True, check=True)  # the command the line names, as a user would paste it
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
    from marl_llm.runs import rundir

    run = tmp_path / "same-second"
    assert rundir.claim(run, resume=False) is None
    refusal = rundir.claim(run, resume=False)  # the second of two runs that picked the same dir
    assert refusal is not None and "in use" in refusal
    rundir.release(run, started=True)
    refusal = rundir.claim(run, resume=False)  # a run that came after the first one ended
    assert refusal is not None and "already holds a run (.marl-llm-run)" in refusal
    assert "trainer.resume=if_possible" in refusal  # no checkpoint: true would refuse
    assert rundir.claim(run, resume=True) is None
    rundir.release(run, started=True)


def test_a_resumed_runs_summary_keeps_the_first_attempts_evaluation_before_training(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = ["trainer.eval_before=true", "trainer.eval_max_problems=1"]
    train(compose_config(overrides(tiny_model_dir, run, 1, *args)))
    first = json.loads((run / "summary.json").read_text())
    assert first["before"] is not None and "reward" in first["before"]
    train(compose_config(overrides(tiny_model_dir, run, 2, *args, "trainer.resume=true")))
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 2 and resumed["before"] == first["before"]


class FakeCuda:
    """torch.cuda's RNG functions on a machine with `count` GPUs, this process on `current`:
    per-GPU generator states are strings; `get_rng_state_all` must not be needed."""

    def __init__(self, monkeypatch, count: int, current: int, states=None):
        self.count, self.current = count, current
        self.states = states or {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}
        self.set: list[tuple[int, list[int]]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self.current])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_state)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", self.refuse)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.refuse)

    def set_state(self, state, device="cuda"):
        if self.current >= self.count:
            raise RuntimeError("invalid device ordinal")
        self.set.append((self.current, state.tolist()))

    def refuse(self, *args, **kwargs):
        raise AssertionError("every GPU's RNG state was touched")


def test_resume_restores_only_the_ranks_own_cuda_rng_state_whatever_the_gpu_count(monkeypatch):
    """A run saved by the rank on GPU 3 of 4 resumes where each task sees one GPU (SLURM's
    --gpus-per-task: its GPU is device 0), and the reverse; a checkpoint from before (every
    visible GPU's state) still resumes, taking its own device's state or none."""
    from marl_llm.runs.checkpoint import rng_state, set_rng_state

    FakeCuda(monkeypatch, count=4, current=3)
    state = rng_state()
    assert state["cuda_device"].tolist() == [3] and "cuda" not in state
    one = FakeCuda(monkeypatch, count=1, current=0)
    set_rng_state(state)
    assert one.set == [(0, [3])]
    old = {**{k: v for k, v in state.items() if k != "cuda_device"},
           "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(4)]}  # an older checkpoint, 4 GPUs
    set_rng_state(old)
    assert one.set[-1] == (0, [0])
    four = FakeCuda(monkeypatch, count=8, current=6)  # more GPUs now than the old checkpoint saw
    set_rng_state(old)
    assert four.set == []  # nothing of its own saved: left as seeded
    two = FakeCuda(monkeypatch, count=2, current=1)
    set_rng_state(old)
    assert two.set == [(1, [1])]
