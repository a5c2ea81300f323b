"""Sweeps through a real SLURM scheduler: slurmctld, slurmd and slurmdbd (on MariaDB) of Debian's
packages, started on this machine by scripts/slurm_local.py, no fake sbatch. Each test submits
`marl-llm -m hydra/launcher=slurm ...` as a researcher would and reads what SLURM (sacct, the job
logs) and the run dirs say: a job array, 2 tasks as 2 torch.distributed ranks, a requeue and a
time limit resumed bitwise, a wrong override in one job, scancel and a relaunch.

The runs are debug=tiny on the embedded model, two steps with a checkpoint after each, one
thread each. One uninterrupted run (seed 0 of the first sweep) is the reference the interrupted
runs are compared with, bitwise: a resumed run computes the same numbers in the same order, in
float32 as in float64. The 2-rank job is compared across processes, so it and its one-process
reference run in float64, within the gloo tests' float64 bound (tests/test_distributed.py); the
others stay in float32, which here takes 23 s a run against 41 s.

Where the cluster cannot run (not root, SLURM not installed and no apt-get) the tests skip with
slurm_local's one line; under CI (CI=true) that skip is a failure (conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, VENV_BIN

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `slurm` extra is not installed")

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLI = str(VENV_BIN / "marl-llm")
ATOL = 1e-9  # tests/test_distributed.py's float64 bound for 2 ranks against one process (its docstring)
# The run every test trains: two steps, a checkpoint after each, no evaluation (the adapters do not
# depend on it; the time-limit test evaluates to outlast slurmctld's check).
# The raw baseline (advantage = shifted reward): the adapters move even where every sample of a
# group scores alike, as the embedded model's do on HumanEval in 8 tokens (tests/test_distributed.py).
RUN = ["debug=tiny", "trainer.threads=1", "trainer.max_steps=2", "trainer.save_every=1",
       "trainer.eval_before=false", "trainer.eval_after=false", "algo.baseline=raw", "algo.sampling.max_new_tokens=8", "algo.sampling.top_p=1.0",
       "algo.learning_rate=1e-3", "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", "task.sandbox.workers=1"]
# This machine's node has 2 CPUs and ~22 GiB: the presets' 8 CPUs and 64 GB per job would never be scheduled.
LAUNCHER = ["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=4",
            "hydra.launcher.timeout_min=30"]


def load_slurm_local():
    spec = importlib.util.spec_from_file_location("slurm_local", REPO / "scripts" / "slurm_local.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


slurm_local = load_slurm_local()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The local cluster for this module's tests (installed with apt-get where root and missing)."""
    why = slurm_local.why_not(install=True)
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    slurm_local.start(root, install_missing=True)
    yield root
    slurm_local.stop(root)
    assert not slurm_local.cluster_processes(root), "a job's process outlived the cluster"


def job_env(cluster: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "SLURM_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return slurm_local.client_env(cluster, env)


def submit(cluster: Path, sweep: Path, *overrides: str) -> subprocess.Popen:
    """`marl-llm -m hydra/launcher=slurm ...` in its own process group, as a user would type it."""
    argv = [CLI, "-m", *LAUNCHER, *RUN, *overrides, f"hydra.sweep.dir={sweep}"]
    return subprocess.Popen(argv, cwd=sweep.parent, env=job_env(cluster), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 900) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the sweep ran past {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def sweep_run(cluster: Path, sweep: Path, *overrides: str, timeout: float = 900) -> subprocess.CompletedProcess:
    sweep.parent.mkdir(parents=True, exist_ok=True)
    return finish(submit(cluster, sweep, *overrides), timeout)


def job_logs(sweep: Path, tail: int | None = 4000) -> str:
    """The jobs' logs (submitit's <job>_<task>_log.out/.err), each cut to its last `tail` characters."""
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-tail if tail else 0:]}"
                     for p in sorted((sweep / ".submitit").rglob("*_log.*")))


def job_ids(sweep: Path) -> list[str]:
    """The SLURM ids of the sweep's jobs (<array>_<index>; a one-job sweep is a plain job), from
    submitit's folders."""
    return sorted(d.name for d in (sweep / ".submitit").iterdir() if list(d.glob("*_submitted.pkl")))


def sacct(cluster: Path, job: str, *fields: str, duplicates: bool = False) -> list[list[str]]:
    """sacct's rows for a job (array or one task of it): the allocation only (-X); with
    duplicates, every attempt of a requeued job (-D)."""
    out = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", ",".join(fields), *(["-D"] if duplicates else [])],
                         env=job_env(cluster), capture_output=True, text=True, check=True)
    return [line.split("|") for line in out.stdout.splitlines() if line.strip()]


def wait_for_state(cluster: Path, job: str, states: set[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = sacct(cluster, job, "State")
        if rows and all(r[0].split()[0] in states for r in rows):
            return
        time.sleep(1)
    pytest.fail(f"job {job} never reached {states}: {sacct(cluster, job, 'JobID', 'State', duplicates=True)}")


def adapters(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["adapters"]


def assert_bitwise(run_dir: Path, reference: Path) -> None:
    a, b = adapters(run_dir), adapters(reference)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k]), f"{run_dir} differs from {reference}"
    assert any(float(t.abs().max()) > 0 for x in a.values() for n, t in x.items() if "lora_B" in n)  # it trained


def run_of(sweep: Path, seed: int) -> Path:
    """The run dir of `seed` in a sweep: <sweep>/<overrides>/seed=<s> (the overrides part shortened
    with a hash, configure.sweep_subdir: this module's dozen overrides pass NAME_MAX)."""
    found = [p for p in sweep.glob(f"*/seed={seed}") if p.is_dir()]
    assert len(found) == 1, (sweep, found)
    return found[0]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def resumes(run_dir: Path) -> list[dict]:
    path = run_dir / "resumes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_for_run_dir(proc: subprocess.Popen, sweep: Path, seed: int, timeout: float = 300) -> Path:
    deadline = time.monotonic() + timeout
    while not list(sweep.glob(f"*/seed={seed}")):
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            pytest.fail(f"no run dir of seed {seed} in {sweep}: {err[-2000:]}\n{job_logs(sweep)}")
        time.sleep(0.2)
    return run_of(sweep, seed)


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, sweep: Path, timeout: float = 600) -> None:
    """Until the run's first checkpoint is on disk (its digest written last)."""
    deadline = time.monotonic() + timeout
    while not (run_dir / "checkpoint.pt.sha256").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate()
            pytest.fail(f"no checkpoint in {run_dir}: {err[-2000:]}\n{job_logs(sweep)}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def seeds_sweep(cluster, tmp_path_factory):
    """`marl-llm -m hydra/launcher=slurm seed=0,1 logger=wandb ...`: one job array of two runs; its
    seed=0 run is every other test's uninterrupted reference."""
    sweep = tmp_path_factory.mktemp("seeds") / "multirun" / "sweep1"
    done = sweep_run(cluster, sweep, "seed=0,1", "logger=wandb")
    return sweep, done


@pytest.fixture(scope="module")
def reference(seeds_sweep) -> Path:
    sweep, done = seeds_sweep
    assert done.returncode == 0, done.stderr[-3000:] + job_logs(sweep)
    return run_of(sweep, 0)


def test_the_local_cluster_has_accounting_and_stops_cleanly_twice(tmp_path):
    """start -> sinfo idle, sacct answers -> stop leaves none of its daemons, twice in a row, in a
    folder of its own (the module's cluster runs alongside on other ports)."""
    why = slurm_local.why_not(install=True)
    if why:
        pytest.skip(why)
    root = tmp_path / "cluster"
    for _ in range(2):
        state = slurm_local.start(root, install_missing=True)
        info = slurm_local.status(root)
        assert info["running"] and info["node"] == "idle", info
        env = slurm_local.client_env(root)
        assert subprocess.run(["sacct", "-n"], env=env, capture_output=True, check=False).returncode == 0
        pids = list(state["pids"].values())
        assert sorted(slurm_local.stop(root)) == sorted(slurm_local.DAEMONS)
        assert not any(slurm_local.alive(p) for p in pids)
        assert not slurm_local.status(root)["running"]


def test_a_seed_sweep_is_one_job_array_that_completes(cluster, seeds_sweep, reference):
    sweep, done = seeds_sweep
    ids = job_ids(sweep)
    assert len(ids) == 2 and len({i.split("_")[0] for i in ids}) == 1, ids  # one array, two jobs
    array = ids[0].split("_")[0]
    wait_for_state(cluster, array, {"COMPLETED"}, timeout=60)  # a job's end reaches accounting after its result
    states = {row[0]: row[1] for row in sacct(cluster, array, "JobID", "State")}
    assert states == {f"{array}_0": "COMPLETED", f"{array}_1": "COMPLETED"}, states
    # The run dirs, metrics and W&B offline runs that docs/cluster.md describes.
    runs = sorted(p.parent for p in sweep.glob("*/*/metrics.jsonl"))
    assert [r.name for r in runs] == ["seed=0", "seed=1"] and runs[0].parent == runs[1].parent, runs
    meta = [json.loads((r / "wandb.json").read_text()) for r in runs]
    for run_dir in runs:
        assert [m["step"] for m in metrics(run_dir) if "train/reward" in m] == [1, 2]
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
        assert list((run_dir / "wandb").glob("offline-run-*"))
    assert len({m["group"] for m in meta}) == 1 and meta[0]["id"] != meta[1]["id"]
    assert all(f"sweep:{sweep.parent.name}/{sweep.name}" in m["tags"] for m in meta), meta
    assert [m["name"].rsplit("-", 1)[1] for m in meta] == ["seed0", "seed1"]
    # sacct answered every poll: no warning about accounting in the submit console.
    assert "sacct failed" not in done.stderr and "Job completed successfully" in job_logs(sweep, tail=None)


def test_two_tasks_are_two_ranks_that_match_one_process(cluster, tmp_path):
    """hydra.launcher.gpus_per_node=2 (docs/cluster.md's key for multi-GPU jobs): 2 tasks, each a
    torch.distributed rank from SLURM's variables, gloo on the CPU; adapters within the gloo tests'
    float64 bound of a one-process job of the same run, submitted alongside."""
    sweep, one = tmp_path / "multirun" / "ranks", tmp_path / "multirun" / "one_process"
    sweep.parent.mkdir(parents=True)
    pending = submit(cluster, one, "seed=0", "model.dtype=float64")  # queued beside the 2-task job
    done = sweep_run(cluster, sweep, "seed=0", "model.dtype=float64", "hydra.launcher.gpus_per_node=2")
    assert done.returncode == 0, done.stderr[-3000:] + job_logs(sweep)
    alone = finish(pending)
    assert alone.returncode == 0, alone.stderr[-3000:] + job_logs(one)
    reference = run_of(one, 0)
    logs = job_logs(sweep, tail=None)
    script = next((sweep / ".submitit").rglob("*_submission.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2\n" in script and "#SBATCH --gpus-per-node=2\n" in script
    assert "global_rank=1(2)" in logs and logs.count("2 data-parallel processes") == 1
    run_dir = run_of(sweep, 0)
    a, b = adapters(run_dir), adapters(reference)
    assert a.keys() == b.keys()
    worst = max(float((a[k][n] - b[k][n]).abs().max()) for k in a for n in a[k])
    assert worst <= ATOL, f"2 ranks differ from one process by {worst:.3g}"
    assert [m["step"] for m in metrics(run_dir) if "train/reward" in m] == [1, 2]


def test_a_requeued_job_resumes_bitwise(cluster, reference, tmp_path):
    """`scontrol requeue` of the running job after its first checkpoint: SLURM stops it and starts it
    again (same job id, same run dir); the run resumes at step 1 and ends bitwise as the
    uninterrupted run, and its resume record names the requeue."""
    sweep = tmp_path / "multirun" / "requeue"
    sweep.parent.mkdir(parents=True)
    proc = submit(cluster, sweep, "seed=0")
    run_dir = wait_for_run_dir(proc, sweep, 0)
    wait_for_checkpoint(proc, run_dir, sweep)
    (job,) = job_ids(sweep)
    subprocess.run(["scontrol", "requeue", job], env=job_env(cluster), check=True, capture_output=True)
    done = finish(proc)
    logs = job_logs(sweep)
    assert done.returncode == 0, done.stderr[-3000:] + logs
    wait_for_state(cluster, job, {"COMPLETED"}, timeout=60)
    attempts = [row[0] for row in sacct(cluster, job, "State", duplicates=True)]
    assert attempts[-1] == "COMPLETED" and "REQUEUED" in attempts, attempts
    (record,) = resumes(run_dir)
    assert record["step"] == 1 and record["slurm"] == {"job_id": job, "restart_count": 1}, record
    assert_bitwise(run_dir, reference)


def elapsed_s(cluster: Path, job: str) -> int:
    """How long the job's current attempt has run (squeue's [D-]HH:MM:SS or M:SS), in seconds."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%M"], env=job_env(cluster), capture_output=True,
                         text=True, check=True).stdout.strip()
    days, _, clock = out.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = 60 * seconds + int(part)
    return seconds + 86400 * int(days or 0)


def test_a_time_limit_signals_the_job_which_resumes_bitwise(cluster, reference, tmp_path):
    """The time limit with the launcher's signal (`--signal=USR2@120`, the preset's): once the
    first checkpoint is on disk the test cuts the job's limit (scontrol update) to end within the
    next 60-120 s, so SLURM's signal is due at once, mid-run (SLURM may send it up to a minute
    early, so a short limit from the start could signal before anything ran). slurmctld checks
    time limits every 30 s (seen here: a cut limit signalled 17-24 s later), so this job evaluates
    on 16 problems after training: the rest of the run outlasts that check (the adapters do not
    depend on the evaluation). submitit's handler requeues the job; the test gives it its 30
    minutes back; the next attempt resumes from the last checkpoint and the run ends bitwise as
    the uninterrupted one."""
    sweep = tmp_path / "multirun" / "timeout"
    sweep.parent.mkdir(parents=True)
    proc = submit(cluster, sweep, "seed=0", "trainer.eval_after=true", "trainer.eval_max_problems=16")
    run_dir = wait_for_run_dir(proc, sweep, 0)
    wait_for_checkpoint(proc, run_dir, sweep)
    (job,) = job_ids(sweep)
    limit_min = elapsed_s(cluster, job) // 60 + 2
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit_min}"], env=job_env(cluster), check=True,
                   capture_output=True)
    deadline = time.monotonic() + 240
    while "REQUEUED" not in [row[0] for row in sacct(cluster, job, "State", duplicates=True)]:
        assert proc.poll() is None, f"the run ended before SLURM signalled it: {job_logs(sweep)}"
        assert time.monotonic() < deadline, job_logs(sweep)
        time.sleep(0.5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=30"], env=job_env(cluster), check=True,
                   capture_output=True)
    done = finish(proc)
    assert done.returncode == 0, done.stderr[-3000:] + job_logs(sweep)
    logs = job_logs(sweep, tail=None)
    assert "Caught signal SIGUSR2" in logs and "DUE TO JOB REQUEUE" in logs, logs[-3000:]
    wait_for_state(cluster, job, {"COMPLETED"}, timeout=60)
    attempts = [row[0] for row in sacct(cluster, job, "State", duplicates=True)]
    assert attempts == ["REQUEUED", "COMPLETED"], attempts
    (record,) = resumes(run_dir)
    assert record["step"] >= 1 and record["slurm"] == {"job_id": job, "restart_count": 1}, record
    assert_bitwise(run_dir, reference)


def test_a_wrong_override_fails_its_job_in_one_line_and_the_others_finish(cluster, tmp_path):
    sweep = tmp_path / "multirun" / "mixed"
    done = sweep_run(cluster, sweep, "seed=0", "algo.loss_aggregation=seq_sum,banana", "trainer.max_steps=1",
                     "trainer.save_every=0")
    logs = job_logs(sweep)
    assert done.returncode != 0, done.stdout[-2000:]
    line = "invalid config value algo.loss_aggregation"
    errors = [x for x in done.stderr.splitlines() if line in x]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    array = job_ids(sweep)[0].split("_")[0]
    wait_for_state(cluster, array, {"COMPLETED", "FAILED"}, timeout=60)
    states = {row[0]: row[1] for row in sacct(cluster, array, "JobID", "State")}
    assert sorted(states.values()) == ["COMPLETED", "FAILED"], states
    failed = next(j for j, s in states.items() if s == "FAILED")
    failed_log = (sweep / ".submitit" / failed / f"{failed}_0_log.err").read_text()
    assert line in failed_log and "Traceback" not in failed_log, failed_log[-3000:]
    good = next(p.parent for p in sweep.glob("*/*/summary.json"))
    assert "seq_sum" in good.parent.name and json.loads((good / "summary.json").read_text())["steps"] == 1


def test_scancel_leaves_nothing_and_the_same_command_continues(cluster, reference, tmp_path):
    """scancel of a running 2-job array: no process of it is left, each run dir holds whole
    checkpoints (or none); the same sweep command then continues both runs, bitwise as the
    uninterrupted run."""
    sweep = tmp_path / "multirun" / "cancel"
    sweep.parent.mkdir(parents=True)
    args = ("seed=0,1", "trainer.resume=if_possible")
    proc = submit(cluster, sweep, *args)
    wait_for_checkpoint(proc, wait_for_run_dir(proc, sweep, 0), sweep)
    array = job_ids(sweep)[0].split("_")[0]
    subprocess.run(["scancel", array], env=job_env(cluster), check=True, capture_output=True)
    wait_for_state(cluster, array, {"CANCELLED"})
    finish(proc)
    deadline = time.monotonic() + 30
    while slurm_local.cluster_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not slurm_local.cluster_processes(cluster), "a process of the cancelled array is left"
    from marl_llm.runs.digest import verify  # the trainer's own check: None when the file matches its digest

    for run_dir in (run_of(sweep, 0), run_of(sweep, 1)):
        for name in ("checkpoint.pt", "checkpoint.prev.pt"):
            if (run_dir / name).exists():
                assert verify(run_dir / name) is None, f"{run_dir / name} is not whole"
    done = sweep_run(cluster, sweep, *args)
    assert done.returncode == 0, done.stderr[-3000:] + job_logs(sweep)
    assert_bitwise(run_of(sweep, 0), reference)
    assert any("resumed_from" in r for r in resumes(run_of(sweep, 0)))
    assert json.loads((run_of(sweep, 1) / "summary.json").read_text())["steps"] == 2

