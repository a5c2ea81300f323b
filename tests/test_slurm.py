"""Cluster sweeps through hydra-submitit-launcher: the launcher presets (conf/hydra/launcher/), the
machine settings from the untracked conf/local/default.yaml, the sbatch script a sweep submits
(fake sbatch, no SLURM needed). Sweeps through a real scheduler: tests/test_slurm_cluster.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, VENV_BIN

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `slurm` extra is not installed")

CLI = str(VENV_BIN / "marl-llm")
# The presets' launchers (src/hydra_plugins/marl_llm_launcher/sweep_launcher.py) and the plugin's own, which they extend.
SLURM_TARGET = "hydra_plugins.marl_llm_launcher.sweep_launcher.SlurmLauncher"
LOCAL_TARGET = "hydra_plugins.marl_llm_launcher.sweep_launcher.LocalLauncher"
PLUGIN_SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
PLUGIN_LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
LOCAL_CFG = """\
# @package _global_
cluster:
  partition: gpu-test
  account: proj-42
  qos: high
  setup: ["module load cuda/12.4"]
"""


def conf_copy(tmp_path: Path, local_yaml: str | None = None) -> Path:
    """A copy of the real conf/ whose local/default.yaml is `local_yaml` (or absent), so that a
    developer's own conf/local/default.yaml never leaks into a test, nor a test into it."""
    from marl_llm.configure import config_dir

    conf = tmp_path / "conf"
    shutil.copytree(config_dir(), conf, ignore=shutil.ignore_patterns("__pycache__"))
    (conf / "local" / "default.yaml").unlink(missing_ok=True)
    if local_yaml is not None:
        (conf / "local" / "default.yaml").write_text(local_yaml)
    return conf


def compose_hydra(conf: Path, overrides: list[str]):
    """The config with its `hydra` node, as `marl-llm -m <overrides>` composes it."""
    from hydra import compose, initialize_config_dir

    from marl_llm.configure import register_configs

    register_configs()
    with initialize_config_dir(str(conf), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("launcher, extra, gpus", [("slurm", [], 1), ("slurm", ["hydra.launcher.gpus_per_node=4"], 4),
                                                    ("slurm_multigpu", [], 4)])
def test_slurm_presets_run_one_task_per_gpu_and_requeue(tmp_path, launcher, extra, gpus):
    overrides = [f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path}/sweep", *extra]
    cfg = compose_hydra(conf_copy(tmp_path), overrides)
    lc = cfg.hydra.launcher
    assert lc._target_ == SLURM_TARGET
    assert lc.gpus_per_node == gpus and lc.tasks_per_node == lc.gpus_per_node  # one rank per GPU
    assert lc.nodes == 1 and lc.max_num_timeout > 0 and lc.timeout_min > 0 and lc.signal_delay_s > 0
    assert lc.cpus_per_task >= 1 and lc.mem_gb >= 16 * gpus and lc.array_parallelism >= 1
    assert lc.submitit_folder == f"{tmp_path}/sweep/.submitit/%j"
    # No local config: partition and account are left to the cluster's defaults.
    assert lc.partition is None and lc.account is None and lc.qos is None and lc.setup == []


def test_partition_and_account_come_from_the_local_config(tmp_path):
    from hydra.utils import instantiate

    cfg = compose_hydra(conf_copy(tmp_path, LOCAL_CFG), ["hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}/s"])
    lc = cfg.hydra.launcher
    assert (lc.partition, lc.account, lc.qos) == ("gpu-test", "proj-42", "high")
    assert list(lc.setup) == ["module load cuda/12.4"]
    assert lc.constraint is None
    # What the plugin itself receives (Hydra instantiates the launcher from this node).
    params = instantiate(lc).params
    assert params["partition"] == "gpu-test" and params["account"] == "proj-42"
    assert params["tasks_per_node"] == params["gpus_per_node"] == 1
    # A command-line override still wins over the local file.
    cfg = compose_hydra(conf_copy(tmp_path / "2", LOCAL_CFG),
                        ["hydra/launcher=slurm", "hydra.launcher.partition=debug"])
    assert cfg.hydra.launcher.partition == "debug" and cfg.hydra.launcher.account == "proj-42"


@pytest.mark.parametrize("launcher", [None, "basic", "local", "submitit_local", "slurm", "slurm_multigpu",
                                      "slurm_gres", "slurm_8gpu", "slurm_2x8gpu"])
def test_the_example_local_config_composes_with_every_launcher(tmp_path, launcher):
    example = (REPO / "conf" / "local" / "default.example.yaml").read_text()
    cfg = compose_hydra(conf_copy(tmp_path, example), [f"hydra/launcher={launcher}"] if launcher else [])
    assert cfg.cluster.partition == "gpu" and cfg.cluster.account == "my_project"
    lc = cfg.hydra.launcher
    if launcher in (None, "basic"):
        assert lc._target_ == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    elif launcher in ("local", "submitit_local"):
        assert lc._target_ == (LOCAL_TARGET if launcher == "local" else PLUGIN_LOCAL)
        assert lc.tasks_per_node == 1 and "partition" not in lc
    else:
        assert lc._target_ == SLURM_TARGET and (lc.partition, lc.account) == ("gpu", "my_project")


def test_the_local_config_may_make_slurm_the_default_launcher(tmp_path):
    example = (REPO / "conf" / "local" / "default.example.yaml").read_text()
    enabled = example.replace("# defaults:\n#   - override /hydra/launcher: slurm",
                              "defaults:\n  - override /hydra/launcher: slurm")
    assert enabled != example, "the example should show how to make SLURM the default launcher"
    cfg = compose_hydra(conf_copy(tmp_path, enabled), [])
    assert cfg.hydra.launcher._target_ == SLURM_TARGET and cfg.hydra.launcher.partition == "gpu"
    # ... and the command line can still pick another one.
    cfg = compose_hydra(conf_copy(tmp_path / "2", enabled), ["hydra/launcher=local"])
    assert cfg.hydra.launcher._target_ == LOCAL_TARGET


def fake_slurm(tmp_path: Path, **commands: str) -> dict[str, str]:
    """An environment whose PATH finds these fake SLURM commands (shell bodies) first, and an srun
    (submitit's check that this is a SLURM host)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"srun": "exit 0\n", **commands}.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def refusing_sbatch(tmp_path: Path) -> str:
    """A fake sbatch that keeps the script it is given (job.sh) and refuses the job."""
    return f'cp "$1" {tmp_path}/job.sh\necho "sbatch: error: refused (test)" >&2\nexit 1\n'


def test_a_sweep_submits_one_job_array_with_the_local_settings(tmp_path):
    """`marl-llm -m hydra/launcher=slurm ...` through the real CLI and plugin, up to sbatch: a fake
    sbatch keeps the script it is given and refuses the job, so the sweep stops right there."""
    sweep = tmp_path / "multirun" / "sweep1"
    env = fake_slurm(tmp_path, sbatch=refusing_sbatch(tmp_path))
    local_dir = tmp_path / "machine"  # --config-dir <dir>: <dir>/local/default.yaml, ahead of conf/
    (local_dir / "local").mkdir(parents=True)
    (local_dir / "local" / "default.yaml").write_text(LOCAL_CFG)
    out = subprocess.run([CLI, "-m", "--config-dir", str(local_dir), "hydra/launcher=slurm", "seed=0,1,2",
                          "hydra.launcher.gpus_per_node=2", f"hydra.sweep.dir={sweep}"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode != 0 and "refused (test)" in out.stderr, out.stderr[-3000:]
    script = (tmp_path / "job.sh").read_text()
    for line in ("--partition=gpu-test", "--account=proj-42", "--qos=high", "--array=0-2%3", "--nodes=1",
                 "--gpus-per-node=2", "--ntasks-per-node=2", "--cpus-per-task=8", "--time=480", "--signal=USR2@120",
                 "--job-name=marl-llm", f"--output={sweep}/.submitit/%A_%a/%A_%a_0_log.out"):
        assert f"#SBATCH {line}\n" in script, (line, script)
    assert "\nmodule load cuda/12.4\n" in script.split("# command")[0]
    # Each task runs the same python that submitted the sweep (one rank each, no torchrun).
    assert "srun --unbuffered" in script and "-u -m submitit.core._submit" in script
    assert "torchrun" not in script


@pytest.mark.parametrize("launcher, nodes", [("slurm_8gpu", 1), ("slurm_2x8gpu", 2)])
def test_the_8_gpu_presets_submit_one_rank_per_gpu_on_one_and_two_nodes(tmp_path, launcher, nodes):
    """The presets for 1 and 2 nodes of 8 GPUs, through the real CLI up to a fake sbatch: 8 tasks
    per node, one per GPU, the host memory for 8 ranks loading their models."""
    sweep, env = tmp_path / "multirun" / "sweep1", fake_slurm(tmp_path, sbatch=refusing_sbatch(tmp_path))
    out = subprocess.run([CLI, "-m", "--config-dir", str(conf_copy(tmp_path)), f"hydra/launcher={launcher}", "seed=0,1",
                          "experiment=at_grpo_sokoban_qwen3_8b_paper", f"hydra.sweep.dir={sweep}"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert "refused (test)" in out.stderr, out.stderr[-3000:]
    script = (tmp_path / "job.sh").read_text()
    for line in (f"--nodes={nodes}", "--gpus-per-node=8", "--ntasks-per-node=8", "--mem=960GB", "--array=0-1%2"):
        assert f"#SBATCH {line}\n" in script, (line, script)
    assert "torchrun" not in script


def test_the_gres_preset_sets_gpus_and_ranks_with_one_key(tmp_path):
    """Clusters that take GPUs as --gres=gpu:<n>: `slurm_gres` and one override,
    hydra.launcher.tasks_per_node=<n>, give n GPUs and n ranks, without --gpus-per-node."""
    sweep = tmp_path / "multirun" / "sweep1"
    env = fake_slurm(tmp_path, sbatch=refusing_sbatch(tmp_path))
    out = subprocess.run([CLI, "-m", "--config-dir", str(conf_copy(tmp_path)), "hydra/launcher=slurm_gres", "seed=0,1",
                          "hydra.launcher.tasks_per_node=4", f"hydra.sweep.dir={sweep}"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert "refused (test)" in out.stderr, out.stderr[-3000:]
    script = (tmp_path / "job.sh").read_text()
    assert "#SBATCH --gres=gpu:4\n" in script and "#SBATCH --ntasks-per-node=4\n" in script, script
    assert "--gpus-per-node" not in script
    cfg = compose_hydra(conf_copy(tmp_path / "2"), ["hydra/launcher=slurm_gres"])
    assert (cfg.hydra.launcher.gres, cfg.hydra.launcher.tasks_per_node) == ("gpu:1", 1)


def test_a_failing_sacct_is_said_once(tmp_path):
    """Where sacct fails (accounting disabled), submitit warned at every poll, each warning three
    times (its stdout and stderr handlers, Hydra's root logger), under sacct's own error: one line
    now, with sacct's error, however many polls fail. The fake sbatch accepts the job, which never
    runs; the sweep is stopped after sacct's third failing poll (about 4 s in)."""
    calls = tmp_path / "sacct_calls"
    env = fake_slurm(tmp_path, sbatch="echo 'Submitted batch job 4242'\n",
                     sacct=f"echo x >> {calls}\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    proc = subprocess.Popen([CLI, "-m", "--config-dir", str(conf_copy(tmp_path)), "hydra/launcher=slurm", "seed=0",
                             "logger=none", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while (not calls.exists() or len(calls.read_text().split()) < 3) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        time.sleep(0.5)  # the third poll's warning, if any, is written
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    assert len(calls.read_text().split()) >= 3, out + err
    both = out + err
    assert both.count("Slurm accounting storage is disabled") == 1, both
    assert "sacct failed (sacct: error: Slurm accounting storage is disabled)" in err and "Bypassing" not in both


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to run as another uid")
def test_the_local_cluster_refuses_an_ordinary_user_in_one_line(tmp_path):
    """scripts/slurm_local.py as an ordinary uid: one line naming what it needs, exit 2, nothing started."""
    from conftest import as_ordinary_uid

    tmp_path.chmod(0o777)
    argv = as_ordinary_uid([sys.executable, str(REPO / "scripts" / "slurm_local.py"), "start", "--dir",
                            str(tmp_path / "cluster")], 4242)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and "needs root" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "cluster").exists()


def test_a_failed_jobs_line_is_the_runs_own_error():
    """What the sweep prints for a failed job: the run's one-line `error: ...` (the last one), not
    srun's report of the exit; without one, the last line the job wrote."""
    from hydra_plugins.marl_llm_launcher.sweep_launcher import error_line

    log = ("submitit INFO ...\nerror: invalid config value algo.loss_aggregation: 'banana' is not one of ...\n"
           "srun: error: vm: task 0: Exited with exit code 2\n")
    assert error_line(log) == "invalid config value algo.loss_aggregation: 'banana' is not one of ..."
    assert error_line("Traceback (most recent call last):\n  ...\nMemoryError\nsrun: error: x\n") == "MemoryError"
    assert error_line("") == "(no error output)"
