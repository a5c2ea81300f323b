"""Attacks on checkpoints and run dirs (issue 42), each as a class with its variants, as root and,
where who runs it matters, as an ordinary uid (what a SLURM user gets):

1. Code planted in a checkpoint never runs on resume: a sharded (DCP) checkpoint's `.metadata`,
   a shard's non-tensor value or meta.pt holding a pickle payload (one that creates a marker
   directory when unpickled), without digests or with digests rewritten to match.
2. Corruption is never loaded silently: changed bytes with the digest deleted, emptied, malformed
   or another file's; sharded checkpoints with flipped shard bytes (on 2 ranks, where only one rank
   hashes the changed shard), a missing or incomplete SHA256SUMS; checkpoints from before digests
   are refused with the command that records them; a non-finite gradient stops the run before a
   save or export.
3. The run lock: a symbolic link (to a file, dangling) or hard link planted as the lock file or run
   marker is never followed (its target keeps its bytes, nothing is created); deleting or
   replacing the lock file while a run holds the dir lets no second writer in.

The sharded checkpoint is a real 2-rank gloo FSDP one, made once for the module."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import VENV_BIN, as_ordinary_uid, compose_config
from marl_llm.config import UserError
from marl_llm.runs import digest
from marl_llm.runs.checkpoint import read_checkpoint, save_checkpoint
from marl_llm.runs.sharded_checkpoint import read_any_checkpoint
from marl_llm.training.trainer import train
from test_bad_input import one_error_line
from test_resume import overrides
from test_sharded_training import args as sharded_args
from test_sharded_training import ok, run as sharded_run
from test_trainer import metrics

ORDINARY_UID = 4242  # as tests/test_sandbox_attacks.py's unprivileged re-run
SUMS = "SHA256SUMS"  # a sharded checkpoint's digests (runs/digest.py), by the name users see
USERS = ["root", "ordinary"]


# ------------------------------------------------------------------------------------- helpers
class Planted:
    """A pickle that runs code when unpickled: it creates the directory `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def can_switch_user() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run as an ordinary uid"
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return "needs util-linux's unshare and setpriv"
    return None


def as_user(user: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess | subprocess.Popen:
    """Run argv as root (this process's user) or as ORDINARY_UID, as tests/test_sandbox_attacks.py
    does: in a private mount namespace, an interpreter under /root (pyenv) stays reachable on a
    traversable tmpfs; then setpriv drops to the uid with no capabilities. `popen=True`: started, not waited for."""
    popen = kwargs.pop("popen", False)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "PYTHONWARNINGS": "ignore", **kwargs.pop("env", {})}
    if user == "ordinary":
        argv = as_ordinary_uid(argv, ORDINARY_UID)
    if popen:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, **kwargs)


def owned_by(user: str, *paths: Path) -> None:
    for path in paths:
        if user == "ordinary":
            os.chown(path, ORDINARY_UID, ORDINARY_UID, follow_symlinks=False)


@dataclass
class World:
    """A traversable dir outside pytest's private tmp (an ordinary uid reads the model there), the
    tiny model, a 2-rank FSDP run of one step (`checkpoint/` and `checkpoint.prev/`, both step 1)."""

    root: Path
    model: Path
    base: Path

    def home(self, user: str, name: str) -> Path:
        """A fresh dir owned by `user`."""
        home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))
        home.chmod(0o755)
        owned_by(user, home)
        return home

    def copy(self, dst: Path, user: str = "root", previous: bool = True) -> Path:
        """The base run copied to dst (owned by `user`), with or without its checkpoint.prev/."""
        shutil.copytree(self.base, dst, ignore=None if previous else shutil.ignore_patterns("checkpoint.prev"))
        for path in [dst, *dst.rglob("*")]:
            owned_by(user, path)
        return dst

    def overrides(self, run: Path, *extra: str) -> list[str]:
        """The base run's settings (a resume compares them), one step: a resume of the step-1
        checkpoint trains nothing, loads everything and saves again."""
        return [*sharded_args(self.model), "trainer.max_steps=1", "trainer.save_every=1", "trainer.export_agents=false",
                f"run_dir={run}", *extra]

    def resume(self, run: Path, *extra: str) -> None:
        train(compose_config(self.overrides(run, "trainer.resume=true", *extra)))


@pytest.fixture(scope="module")
def world(tiny_model_dir):
    root = Path(tempfile.mkdtemp(prefix="marl-checkpoint-attacks-"))
    root.chmod(0o755)
    model = root / "model"
    shutil.copytree(tiny_model_dir, model)
    for path in [model, *model.rglob("*")]:  # pytest's tmp dirs are private (0700): readable by all here
        path.chmod(0o755 if path.is_dir() else 0o644)
    base = root / "base"
    ok(sharded_run(2, model, base, "trainer.max_steps=1", "trainer.save_every=1", "trainer.export_agents=false"))
    assert {"SHA256SUMS", ".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= {
        p.name for p in (base / "checkpoint").iterdir()}
    yield World(root, model, base)
    shutil.rmtree(root, ignore_errors=True)


def forge_sums(checkpoint: Path) -> None:
    """What an attacker who rewrites a checkpoint's files does to its SHA256SUMS: digests that match."""
    names = sorted(p.name for p in checkpoint.iterdir() if p.name not in (SUMS, "COMPLETE"))
    (checkpoint / SUMS).write_text(
        "".join(f"{hashlib.sha256((checkpoint / n).read_bytes()).hexdigest()}  {n}\n" for n in names))


def flip(path: Path, at: int | None = None) -> None:
    """Change 4 bytes in the middle of a file (same size)."""
    blob = bytearray(path.read_bytes())
    at = len(blob) // 2 if at is None else at
    blob[at:at + 4] = bytes(b ^ 0xFF for b in blob[at:at + 4])
    path.write_bytes(bytes(blob))


# ---------------------------------------------------------------------- 1. code on resume
def plant_metadata_only(world: World, run: Path, marker: Path) -> None:
    """The issue's plant: checkpoint/{COMPLETE, meta.pt, .metadata} in a run dir, .metadata a pickle
    payload, meta.pt a real one (so the resume gets as far as loading the shards), no digests."""
    (run / "checkpoint").mkdir(parents=True)
    for name in ("COMPLETE", "meta.pt"):
        shutil.copy(world.base / "checkpoint" / name, run / "checkpoint" / name)
    (run / "checkpoint" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))


def plant_metadata_with_digests(world: World, run: Path, marker: Path) -> None:
    """The real checkpoint, its .metadata replaced by the payload and SHA256SUMS rewritten to match."""
    (run / "checkpoint" / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    forge_sums(run / "checkpoint")


def plant_shard_value(world: World, run: Path, marker: Path) -> None:
    """A payload appended to a shard file as a non-tensor value (an optimizer's lr, which DCP's own
    planner unpickles with weights_only=False), .metadata pointed at it (a valid DCP metadata),
    SHA256SUMS rewritten to match: everything checks out but the value."""
    checkpoint = run / "checkpoint"
    meta = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own file: a trusted load
    index = next(k for k in meta.storage_data if k.fqn.endswith("param_groups.0.lr"))
    where = meta.storage_data[index]
    payload = io.BytesIO()
    torch.save(Planted(marker), payload)
    shard = checkpoint / where.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    meta.storage_data[index] = type(where)(relative_path=where.relative_path, offset=offset,
                                           length=len(payload.getvalue()), transform_descriptors=None)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(meta))
    forge_sums(checkpoint)


def plant_meta_pt(world: World, run: Path, marker: Path) -> None:
    """meta.pt with a payload among its values, SHA256SUMS rewritten to match."""
    checkpoint = run / "checkpoint"
    meta = torch.load(checkpoint / "meta.pt", weights_only=True)
    meta["wandb_id"] = Planted(marker)
    torch.save(meta, checkpoint / "meta.pt")
    forge_sums(checkpoint)


# variant: (plant, the whole base run under it?, what the refusal says)
CODE_PLANTS = {
    "metadata_without_digests": (plant_metadata_only, False, "checkpoint/ is unverified (no SHA256SUMS"),
    "metadata_with_forged_digests": (plant_metadata_with_digests, True,
                                     "checkpoint/ is not plain data (.metadata would run os.makedirs when loaded"),
    "shard_value_with_forged_digests": (plant_shard_value, True,
                                        "checkpoint is not plain data (a value in it would run os.makedirs"),
    "meta_pt_with_forged_digests": (plant_meta_pt, True,
                                    "checkpoint/ is not plain data (meta.pt would run os.makedirs when loaded"),
}


@pytest.mark.parametrize("variant", list(CODE_PLANTS))
def test_code_planted_in_a_sharded_checkpoint_never_runs_on_resume(world, variant, tmp_path):
    """As root, in the trainer's process: refused, and the payload never ran."""
    plant, whole, refusal = CODE_PLANTS[variant]
    run = tmp_path / "run"
    if whole:
        world.copy(run, previous=False)
    marker = tmp_path / "planted-code-ran"
    plant(world, run, marker)
    try:
        world.resume(run)
        raised = None
    except BaseException as err:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        raised = err
    assert not marker.exists(), "the planted code ran"
    assert isinstance(raised, UserError) and refusal in str(raised), repr(raised)


def test_code_planted_in_a_sharded_checkpoint_never_runs_for_an_ordinary_user(world):
    """The console script as an ordinary uid resuming its own run dir: the issue's plant and one
    whose digests match (the payload in a shard's value, found only while the shards load)."""
    skip = can_switch_user()
    if skip:
        pytest.skip(skip)
    for variant in ("metadata_without_digests", "shard_value_with_forged_digests"):
        plant, whole, refusal = CODE_PLANTS[variant]
        home = world.home("ordinary", variant)
        run = home / "run"
        if whole:
            world.copy(run, "ordinary", previous=False)
        marker = home / "planted-code-ran"
        plant(world, run, marker)
        owned_by("ordinary", *[run, *run.rglob("*")])
        cli = [a for a in world.overrides(run, "trainer.resume=true") if not a.startswith("run_dir=")]
        out = as_user("ordinary", [sys.executable, "-m", "marl_llm", *cli, f"hydra.run.dir={run}",
                                   "trainer.progress=off"], cwd=home, env={"HOME": str(home)})
        assert not marker.exists(), f"the planted code ran ({variant})"
        line = one_error_line(out)
        assert refusal in line, line


# --------------------------------------------------------------------- 2. silent corruption
def two_whole_checkpoints(run: Path) -> None:
    """checkpoint.pt (step 2) and checkpoint.prev.pt (step 1), as the trainer saves them."""
    run.mkdir()
    cfg = OmegaConf.create({"seed": 0})
    for step in (1, 2):
        save_checkpoint(run, cfg, None, step, None)


WHOLE_DIGEST_ATTACKS = {
    # variant: (what is done to checkpoint.pt's digest after its bytes changed, the refusal)
    "deleted": (lambda run: digest.sidecar(run / "checkpoint.pt").unlink(),
                "unverified (no checkpoint.pt.sha256"),
    "emptied": (lambda run: digest.sidecar(run / "checkpoint.pt").write_text(""),
                "unverifiable (checkpoint.pt.sha256 is empty)"),
    "malformed": (lambda run: digest.sidecar(run / "checkpoint.pt").write_text("ok\n"),
                  "unverifiable (checkpoint.pt.sha256 is not a digest record"),
    "another_files": (lambda run: shutil.copy(digest.sidecar(run / "checkpoint.prev.pt"),
                                              digest.sidecar(run / "checkpoint.pt")),
                      "unverifiable (checkpoint.pt.sha256 records checkpoint.prev.pt, not checkpoint.pt)"),
    "unreadable": (lambda run: (digest.sidecar(run / "checkpoint.pt").unlink(),
                                digest.sidecar(run / "checkpoint.pt").mkdir()),
                   "unverifiable (checkpoint.pt.sha256 is unreadable"),
}


@pytest.mark.parametrize("variant", list(WHOLE_DIGEST_ATTACKS))
def test_a_changed_checkpoint_without_a_usable_digest_is_refused(tmp_path, caplog, variant):
    """checkpoint.pt with changed bytes (torch still loads it) and its digest deleted, emptied,
    malformed, copied from checkpoint.prev.pt or unreadable: refused, the resume falls back to
    checkpoint.prev.pt and says why; with both refused, one line names the fix."""
    attack, why = WHOLE_DIGEST_ATTACKS[variant]
    run = tmp_path / "run"
    two_whole_checkpoints(run)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    torch.save({**state, "step": 7}, run / "checkpoint.pt")  # a changed file that loads
    attack(run)
    with caplog.at_level("WARNING", logger="marl_llm"):
        ckpt = read_checkpoint(run)
    assert ckpt["step"] == 1 and ckpt["path"] == str(run / "checkpoint.prev.pt")
    assert f"checkpoint.pt is {why}" in caplog.text, caplog.text
    flip(run / "checkpoint.prev.pt")
    with pytest.raises(UserError, match="no usable checkpoint in .*checkpoint.prev.pt is corrupt"):
        read_checkpoint(run)


def test_a_flipped_shard_on_two_ranks_is_refused_by_both(world, tmp_path):
    """The issue's case: a real 2-rank FSDP checkpoint with flipped bytes in rank 1's shard, resumed
    on 2 ranks, no previous checkpoint to fall back to. Rank 1 alone hashes that shard: both ranks
    refuse, in one line each, and nothing trains."""
    run = world.copy(tmp_path / "run", previous=False)
    flip(run / "checkpoint" / "__1_0.distcp")
    before = metrics(run)
    out = sharded_run(2, world.model, run, "trainer.max_steps=2", "trainer.save_every=1", "trainer.export_agents=false",
                      "trainer.resume=true")
    assert out.returncode != 0
    refusals = [line for line in out.stderr.splitlines()
                if line.startswith("error: no usable checkpoint") and "checkpoint/ is corrupt (__1_0.distcp's SHA-256" in line]
    assert len(refusals) == 2, out.stderr[-3000:]
    assert metrics(run) == before


SHARDED_ATTACKS = {
    # variant: (what is done to checkpoint/, the refusal)
    "flipped_shard": (lambda c: flip(c / "__0_0.distcp"), "corrupt (__0_0.distcp's SHA-256 is"),
    "flipped_metadata": (lambda c: flip(c / ".metadata"), "corrupt (.metadata's SHA-256 is"),
    "flipped_meta_pt": (lambda c: flip(c / "meta.pt"), "corrupt (meta.pt's SHA-256 is"),
    "shard_removed": (lambda c: (c / "__1_0.distcp").unlink(), "corrupt (__1_0.distcp, which SHA256SUMS lists, is missing)"),
    "sums_deleted": (lambda c: (c / SUMS).unlink(), "unverified (no SHA256SUMS"),
    "sums_emptied": (lambda c: (c / SUMS).write_text(""), "unverifiable (SHA256SUMS is empty)"),
    "shard_unlisted": (lambda c: (c / SUMS).write_text(
        "".join(line + "\n" for line in (c / SUMS).read_text().splitlines() if "__1_0" not in line)),
        "not a checkpoint of its own files (.metadata points to '__1_0.distcp', no verified file of it)"),
    "meta_unlisted": (lambda c: (c / SUMS).write_text(
        "".join(line + "\n" for line in (c / SUMS).read_text().splitlines() if "meta.pt" not in line)),
        "unverifiable (SHA256SUMS lists no meta.pt)"),
}


@pytest.mark.parametrize("variant", list(SHARDED_ATTACKS))
def test_a_changed_sharded_checkpoint_falls_back_to_the_previous_one(world, tmp_path, caplog, variant):
    attack, why = SHARDED_ATTACKS[variant]
    run = world.copy(tmp_path / "run")
    attack(run / "checkpoint")
    with caplog.at_level("WARNING", logger="marl_llm"):
        ckpt = read_any_checkpoint(run)
    assert ckpt["path"] == str(run / "checkpoint.prev")
    assert f"checkpoint/ is {why}" in caplog.text, caplog.text


def test_a_resume_refuses_two_flipped_checkpoints_and_falls_back_past_one(world, tmp_path, capsys):
    run = world.copy(tmp_path / "run")
    flip(run / "checkpoint" / "__0_0.distcp")
    flip(run / "checkpoint.prev" / "__1_0.distcp")
    with pytest.raises(UserError, match=r"no usable checkpoint in .*: checkpoint/ is corrupt \(__0_0.distcp's .*"
                                        r"checkpoint.prev/ is corrupt \(__1_0.distcp's .*start a new run dir"):
        world.resume(run)
    shutil.rmtree(run / "checkpoint.prev")
    shutil.copytree(world.base / "checkpoint.prev", run / "checkpoint.prev")
    capsys.readouterr()
    world.resume(run)  # loads the previous checkpoint's shards: the whole path after a fallback
    out = capsys.readouterr().out
    assert "checkpoint/ is corrupt (__0_0.distcp's SHA-256" in out and f"resumed from {run / 'checkpoint.prev'}" in out


def test_sharded_checkpoints_from_before_digests_are_refused_until_recorded(world, tmp_path):
    """No SHA256SUMS (a marl-llm from before digests): refused in one line naming the command that
    records them; run as given, the resume goes on."""
    run = world.copy(tmp_path / "run")
    for name in ("checkpoint", "checkpoint.prev"):
        (run / name / SUMS).unlink()
    with pytest.raises(UserError, match="checkpoint/ is unverified .*checkpoint.prev/ is unverified .*record them "
                                        "with: ") as refused:
        world.resume(run)
    fix = str(refused.value).split("record them with: ", 1)[1].split("; then resume again")[0]
    subprocess.run(fix, shell=True, check=True)
    world.resume(run)
    assert digest.verify_sums(run / "checkpoint", digest.read_sums(run / "checkpoint" / SUMS),
                              ["meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"]) is None


def test_a_non_finite_gradient_stops_the_run_before_any_save(tiny_model_dir, tmp_path):
    """A learning rate of 1e37 sends the weights near float32's limit after step 1, and the loss
    and gradient to NaN at step 2: the run stops there in one line, its last checkpoint (the step
    before) is kept as it was, and nothing is saved or exported after it. (Before: it went on with
    grad_norm=nan to exit 0 and exported the agents.)"""
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"grad_norm=nan.*stopped before a save or export") as stopped:
        train(compose_config(overrides(tiny_model_dir, run, 4, "algo.learning_rate=1e37")))
    rows = metrics(run)
    last = rows[-1]["step"]
    assert rows[-1]["train/grad_norm"] != rows[-1]["train/grad_norm"]  # NaN: the step it stopped at
    assert all(r["train/grad_norm"] == r["train/grad_norm"] for r in rows[:-1]) and 1 < last < 4
    assert f"step {last}/4" in str(stopped.value) and f"checkpoint.pt (step {last - 1})" in str(stopped.value)
    assert read_checkpoint(run)["step"] == last - 1 and digest.verify(run / "checkpoint.pt") is None
    assert not (run / "agents").exists() and not (run / "summary.json").exists()


# ------------------------------------------------------------------------------ 3. the lock
CLAIM = """
import sys
from pathlib import Path
from marl_llm.runs import rundir
print(rundir.claim(Path(sys.argv[1]), resume=sys.argv[2] == "resume"))
"""
HOLD = """
import sys, time
from pathlib import Path
from marl_llm.runs import rundir
assert rundir.claim(Path(sys.argv[1]), resume=True) is None
print("held", flush=True)
time.sleep(600)
"""


def claim(user: str, run: Path, mode: str) -> str:
    out = as_user(user, [sys.executable, "-c", CLAIM, str(run), mode])
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def plant_link(kind: str, at: Path, target: Path) -> None:
    if kind == "hard":
        os.link(target, at)
    else:
        at.symlink_to(target)


@pytest.mark.parametrize("user", USERS)
def test_the_run_lock_and_marker_never_follow_a_planted_link(world, user):
    """A symbolic link to a file the user can write, a dangling one, or a hard link, planted as the
    lock file of a fresh run's dir or as the marker of a resumed one: refused in one line; the
    target keeps its bytes, and no file is created where a dangling link points."""
    if user == "ordinary" and can_switch_user():
        pytest.skip(can_switch_user())
    home = world.home(user, f"links-{user}")
    # (The marker is never written to: a hard link there is harmless, and not refused.)
    for name, mode, kinds in ((".marl-llm-lock", "fresh", ("symbolic", "dangling", "hard")),
                              (".marl-llm-lock", "resume", ("symbolic", "dangling", "hard")),
                              (".marl-llm-run", "resume", ("symbolic", "dangling"))):
        for kind in kinds:
            case = f"{name}-{mode}-{kind}"
            run, target = home / f"run-{case}", home / f"precious-{case}"
            run.mkdir()
            owned_by(user, run)
            if kind != "dangling":
                target.write_text("the user's own file\n")
                owned_by(user, target)
            plant_link(kind, run / name, target)
            why = claim(user, run, mode)
            assert why.startswith(str(run / name)) and "remove it" in why, (case, why)
            if kind == "dangling":
                assert not target.exists(), case
            else:
                assert target.read_text() == "the user's own file\n", case


def test_a_fresh_run_refuses_a_linked_lock_file_in_one_line(tiny_model_dir, tmp_path):
    """The console script, as the issue ran it: a fresh run in a dir whose lock file links to a file."""
    run, target = tmp_path / "run", tmp_path / "precious"
    run.mkdir()
    target.write_text("kept\n")
    (run / ".marl-llm-lock").symlink_to(target)
    cli = [str(VENV_BIN / "marl-llm"), *[a for a in overrides(tiny_model_dir, run, 1) if not a.startswith("run_dir=")],
           f"hydra.run.dir={run}"]
    line = one_error_line(subprocess.run(cli, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                                         env={**os.environ, "PYTHONWARNINGS": "ignore"}))
    assert f"{run / '.marl-llm-lock'} is a symbolic link (to {target}" in line
    assert target.read_text() == "kept\n" and not (run / ".hydra").exists()


@pytest.mark.parametrize("user", USERS)
def test_deleting_the_lock_file_lets_no_second_writer_in(world, user):
    """A run holds its dir; its lock file is deleted, then replaced by a fresh empty file: a second
    writer (a resume, a fresh run) is still refused as "in use", the console script too; once the
    holder dies (SIGKILL), the dir is free."""
    if user == "ordinary" and can_switch_user():
        pytest.skip(can_switch_user())
    home = world.home(user, f"lock-{user}")
    run = home / "run"
    run.mkdir()
    owned_by(user, run)
    holder = as_user(user, [sys.executable, "-c", HOLD, str(run)], popen=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        (run / ".marl-llm-lock").unlink()
        assert "is in use" in claim(user, run, "resume")
        (run / ".marl-llm-lock").write_text("")  # a new file of the same name: another inode, unlocked
        owned_by(user, run / ".marl-llm-lock")
        assert "is in use" in claim(user, run, "resume")
        assert "is in use" in claim(user, run, "fresh")
        if user == "root":
            out = subprocess.run([str(VENV_BIN / "marl-llm"), f"hydra.run.dir={run}", "trainer.resume=true"],
                                 capture_output=True, text=True, timeout=600, cwd=home,
                                 env={**os.environ, "PYTHONWARNINGS": "ignore"})
            assert f"{run} is in use" in one_error_line(out)
    finally:
        holder.kill()
        holder.wait()
    assert claim(user, run, "resume") == "None"
