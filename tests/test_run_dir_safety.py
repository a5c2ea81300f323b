"""Runs that cannot be lost or corrupted silently (issue 32): a checksum per checkpoint, one writer
per run dir, a refused command that leaves its dir usable, no leftover temp files, durable atomic
writes, and one line (never a traceback) for a full disk, Ctrl-C at any moment and a relaunched
sweep."""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import VENV_BIN, compose_config
from marl_llm.config import UserError
from marl_llm.runs import digest, rundir
from marl_llm.runs.atomic import atomic_write, atomic_write_text
from marl_llm.training.trainer import train
from test_bad_input import one_error_line
from test_resume import overrides
from test_trainer import metrics

CLI = str(VENV_BIN / "marl-llm")
QUIET = {"PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "WANDB_MODE": "offline"}


def cli(args: list[str], cwd: Path, timeout: float = 600, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, CLI, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **QUIET}, timeout=timeout)


def cli_args(model_dir: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """The tiny training config for the console script: its run dir is Hydra's (hydra.run.dir)."""
    return [a for a in overrides(model_dir, run_dir, steps, "trainer.progress=off", "trainer.export_agents=false", *extra)
            if not a.startswith("run_dir=")] + [f"hydra.run.dir={run_dir}"]


# --------------------------------------------------------------------------------- checksums
def tensor_bytes_offset(path: Path) -> int:
    """The offset of the middle of the largest stored tensor of a torch checkpoint (a zip)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
    return info.header_offset + 30 + name_len + extra_len + info.file_size // 2


def test_changed_bytes_of_the_same_size_fall_back_to_the_previous_checkpoint(tiny_model_dir, tmp_path, capsys):
    """Bytes changed inside checkpoint.pt's tensor data (same size) still load with torch: the
    recorded SHA-256 catches them, and the resume goes on from checkpoint.prev.pt, saying so."""
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 2)))
    path = run / "checkpoint.pt"
    assert digest.verify(path) is None and digest.verify(run / "checkpoint.prev.pt") is None
    blob = bytearray(path.read_bytes())
    at = tensor_bytes_offset(path)
    blob[at - at % 4:at - at % 4 + 4] = b"\xff\xff\x7f\x7f"  # a float32 of 3.4e38 in a tensor's data
    path.write_bytes(bytes(blob))
    assert torch.load(path, weights_only=True)["step"] == 2  # torch alone would resume from it
    capsys.readouterr()
    train(compose_config(overrides(tiny_model_dir, run, 3, "trainer.resume=true")))
    out = capsys.readouterr().out
    assert "checkpoint.pt is corrupt (its SHA-256 is" in out and "resuming from checkpoint.prev.pt (step 2)" in out
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert digest.verify(run / "checkpoint.pt") is None  # the new save has its own checksum


def test_checksum_files_move_with_their_file(tmp_path):
    a, b = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.prev.pt"
    a.write_bytes(b"new")
    digest.write_digest(a, digest.file_digest(a))
    b.write_bytes(b"old")
    digest.write_digest(b, "0" * 64)  # a stale one: replaced, never paired with the moved file
    digest.move(a, b)
    assert not a.exists() and not digest.sidecar(a).exists()
    assert b.read_bytes() == b"new" and digest.verify(b) is None
    assert digest.sidecar(b).read_text() == f"{digest.file_digest(b)}  checkpoint.prev.pt\n"  # sha256sum -c reads it
    c = tmp_path / "legacy.pt"
    c.write_bytes(b"no checksum")
    digest.write_digest(b, "0" * 64)
    digest.move(c, b)  # a file without a checksum drops the destination's old one: it is refused, unverified
    assert not digest.sidecar(b).exists() and digest.verify(b).startswith("unverified (no checkpoint.prev.pt.sha256")
    digest.write_digest(b, "1" * 64)
    assert digest.verify(b).startswith("corrupt (its SHA-256 is ")


# ---------------------------------------------------------------------------- one writer
HOLD = """
import sys, time
from pathlib import Path
from marl_llm.runs import rundir
assert rundir.claim(Path(sys.argv[1]), resume=True) is None
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_writer_is_refused_while_the_run_lives(tiny_model_dir, tmp_path):
    """A live run holds an flock on its dir: a resume of it (Python or the console script) is
    refused in one line, and the lock dies with the process, however it dies."""
    run = tmp_path / "run"
    train(compose_config(overrides(tiny_model_dir, run, 1)))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"{re.escape(str(run))} is in use: a marl-llm run \(pid {holder.pid} on "):
            train(compose_config(overrides(tiny_model_dir, run, 2, "trainer.resume=true")))
        line = one_error_line(cli(cli_args(tiny_model_dir, run, 2, "trainer.resume=true"), tmp_path))
        assert f"{run} is in use" in line and "Wait for that run to end" in line
        assert not (run / ".hydra").exists()  # refused before Hydra wrote into the run's dir
    finally:
        holder.kill()  # SIGKILL: no cleanup ran, the kernel dropped the lock
        holder.wait()
    assert rundir.in_use(run) is None
    train(compose_config(overrides(tiny_model_dir, run, 2, "trainer.resume=true")))
    assert [r["step"] for r in metrics(run)] == [1, 2]


@pytest.mark.slow
def test_a_refused_command_gives_its_dir_back(tiny_model_dir, tmp_path):
    """A command refused after it claimed the dir (here: a LoRA target the model lacks) leaves no
    marker: the corrected command runs in the same dir."""
    run = tmp_path / "run"
    line = one_error_line(cli(cli_args(tiny_model_dir, run, 1, "algo.lora.target_modules=[nope]"), tmp_path))
    assert "nope" in line
    assert not (run / ".marl-llm-run").exists() and not (run / "config.yaml").exists()
    fixed = cli(cli_args(tiny_model_dir, run, 1), tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [1]


def test_the_advice_for_a_dir_without_a_checkpoint_works(tmp_path):
    """A dir that holds only a marker (a run stopped before its first checkpoint): resume=true would
    refuse, so the advice is if_possible."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".marl-llm-run").touch()
    refusal = rundir.claim(run, resume=False)
    assert "it has no checkpoint: start it over there with trainer.resume=if_possible" in refusal
    assert rundir.in_use(run) is None  # the refused claim holds nothing
    (run / "checkpoint.pt").write_bytes(b"x")
    assert "continue it with trainer.resume=true" in rundir.claim(run, resume=False)


# ------------------------------------------------------------------------ leftovers, fsync
def test_temp_files_of_an_interrupted_save_are_removed_at_the_next_start(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".checkpoint.pt.k3j_x9a2.tmp").write_bytes(b"x" * 4096)
    (run / ".agents.tmp-ab12cd34").mkdir()
    (run / ".agents.tmp-ab12cd34" / "adapter.safetensors").write_bytes(b"y" * 1024)
    (run / "notes.tmp").write_text("the user's own")  # not a temp file of marl-llm's
    with caplog.at_level("INFO", logger="marl_llm"):
        assert rundir.claim(run, resume=True) is None
    rundir.release(run, started=True)
    assert sorted(p.name for p in run.iterdir()) == [".marl-llm-lock", ".marl-llm-run", "notes.tmp"]
    assert "removed 2 temp file(s) that an interrupted save left" in caplog.text and "(0.0 MiB)" in caplog.text


def test_atomic_writes_sync_the_file_and_its_dir(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def record(fd):
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    atomic_write_text(tmp_path / "summary.json", "{}")
    assert len(synced) == 2 and synced[0].startswith(".summary.json.") and synced[1] == "dir"


# -------------------------------------------------------------------------------- full disk
def test_a_full_disk_is_one_line_and_loses_nothing(tiny_model_dir, tmp_path):
    """A real full file system (a 160 KiB tmpfs, in a mount namespace): the second checkpoint does
    not fit. One line: disk full, where, that the first checkpoint is intact; then, with room,
    the command it names resumes."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to mount a small tmpfs")
    fs = tmp_path / "fs"
    fs.mkdir()
    run = fs / "run"
    ns = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    if subprocess.run([*ns, "true"], capture_output=True).returncode != 0:
        pytest.skip("mount namespaces are not allowed here")
    args = cli_args(tiny_model_dir, run, 2)
    script = f'mount -t tmpfs -o size=160k tmpfs "{fs}" && "$0" "$@"; echo "rc=$?" >&2; cp -a "{run}" "{tmp_path}/kept"'
    out = subprocess.run([*ns, "sh", "-c", script, CLI, *args], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, **QUIET}, timeout=600)
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == "rc=2" and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = lines[:-1]
    assert line.startswith(f"error: disk full: writing {run}/checkpoint.pt failed")
    assert f"nothing was lost: {run}/checkpoint.pt (step 1) is intact" in line and "trainer.resume=true" in line
    kept = tmp_path / "kept"
    assert not any(p.name.endswith(".tmp") for p in kept.iterdir())
    assert digest.verify(kept / "checkpoint.pt") is None and torch.load(kept / "checkpoint.pt")["step"] == 1


# ----------------------------------------------------------------------------- bad run dirs
def test_a_run_dir_in_proc_is_one_line(tmp_path):
    line = one_error_line(cli(["logger=none", "hydra.run.dir=/proc/marl-llm-run"], tmp_path))
    assert "hydra.run.dir=/proc/marl-llm-run cannot be created (/proc accepts no new directories" in line
    assert "on a proc file system" in line


# ------------------------------------------------------------------------------------ Ctrl-C
def ctrl_c_as_in_a_terminal() -> None:
    """SIGINT's disposition of a command typed at a terminal. Tests run under `make test &` or
    `nohup` inherit SIGINT ignored (a shell's background job), which Python keeps ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("after_s", [0.2, 0.4, 0.9])
def test_ctrl_c_while_the_script_imports_is_one_line(tmp_path, after_s):
    """Ctrl-C while Hydra imports, omegaconf builds the schemas or the config composes (Python
    starts in 0.1 s; the rest takes over a second): one line and 130 wherever it lands. A
    KeyboardInterrupt caught by omegaconf's own cleanup once surfaced as its AttributeError and a
    traceback (cli/launch.py)."""
    proc = subprocess.Popen([CLI, "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, text=True,
                            env={**os.environ, **QUIET}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=ctrl_c_as_in_a_terminal)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip() in ("interrupted while starting: nothing was run", rundir.NOT_STARTED)
    assert not (tmp_path / "run" / ".marl-llm-run").exists()


@pytest.mark.slow
def test_a_double_ctrl_c_is_one_line(tiny_model_dir, tmp_path):
    """Ctrl-C twice (the second while the first one's cleanup runs): exit code 130, one line, the
    line naming an existing checkpoint and the command that continues."""
    run = tmp_path / "run"
    proc = subprocess.Popen([CLI, *cli_args(tiny_model_dir, run, 1000)], cwd=tmp_path, text=True,
                            env={**os.environ, **QUIET}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:
            if line.startswith("[marl-llm] step 2/1000"):
                break
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    [line] = err.strip().splitlines()
    assert line.startswith("interrupted at step ") and "continue with: marl-llm" in line
    named = line.split("last checkpoint ", 1)[1].split(" (step", 1)[0]
    assert Path(named).is_file()


def test_ctrl_c_between_the_renames_of_a_save_waits_for_them(tmp_path):
    """SIGINT while a checkpoint's renames run (the old one to checkpoint.prev.pt, the new one into
    place) is held until both are done: no state where the file the run names is missing."""
    path, previous = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.prev.pt"
    path.write_text("step 1")

    def rotate(tmp):
        os.replace(path, previous)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C right between the two renames
        time.sleep(0.05)

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a terminal
    try:
        with pytest.raises(KeyboardInterrupt):
            atomic_write(path, lambda tmp: Path(tmp).write_text("step 2"), before_replace=rotate)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert path.read_text() == "step 2" and previous.read_text() == "step 1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]


def test_the_interrupt_line_names_a_checkpoint_that_exists(tmp_path):
    (tmp_path / "checkpoint.prev.pt").write_bytes(b"x")
    progress = rundir.Progress(run_dir=tmp_path, step=5, max_steps=9, started=True,
                               checkpoint=(4, str(tmp_path / "checkpoint.pt")))  # moved away, then stopped
    line = rundir.interrupted_line(progress)
    assert f"last checkpoint {tmp_path.resolve()}/checkpoint.prev.pt (step 4)" in line


# ----------------------------------------------------------------------------------- sweeps
@pytest.mark.slow
def test_a_relaunched_sweep_says_how_to_continue_and_if_possible_does(tiny_model_dir, tmp_path):
    """A sweep killed after its first job, relaunched with the same sweep dir: the first job's dir
    holds a run, and the one line says to continue the whole sweep with trainer.resume=if_possible;
    that command skips the finished job and runs the one that never ran."""
    sweep = tmp_path / "sweep"
    base = [a for a in cli_args(tiny_model_dir, tmp_path / "unused", 1) if not a.startswith("hydra.run.dir=")]
    base += [f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=seed_${seed}"]
    first = cli(["-m", *base, "seed=0"], tmp_path)  # job 0 ran, then the sweep was killed
    assert first.returncode == 0, first.stderr[-3000:]
    assert (sweep / "seed_0" / "summary.json").is_file()
    line = one_error_line(cli(["-m", *base, "seed=0,1"], tmp_path))
    assert f"{sweep}/seed_0 already holds a run" in line
    assert f"run the same command with hydra.sweep.dir={sweep} trainer.resume=if_possible" in line
    again = cli(["-m", *base, "seed=0,1", "trainer.resume=if_possible"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "holds a finished run (step 1, summary.json): nothing to do" in again.stdout
    assert [r["step"] for r in metrics(sweep / "seed_0")] == [1]  # not trained again
    assert [r["step"] for r in metrics(sweep / "seed_1")] == [1]
