#!/usr/bin/env python3
"""A real single-node SLURM cluster on this machine: `python scripts/slurm_local.py start|stop|status`.

The same daemons as a cluster's, from Debian's packages (slurm-wlm, slurmdbd, munge, mariadb-server):
munged with its own key, MariaDB holding the accounting database, slurmdbd on it (so that `sacct`
answers, as on a real cluster), then slurmctld and one slurmd for this machine. Everything lives in
one folder (default /tmp/marl-llm-slurm, or --dir): the generated slurm.conf, slurmdbd.conf and
gres.conf, the munge key, the database, spool dirs, logs and `cluster.json` (the pids and ports it
started). Nothing else on the machine is touched: non-default ports picked free at start, no system
service started or configured. Clients reach it through `SLURM_CONF=<dir>/etc/slurm.conf`.

The node has this machine's CPUs and memory (`slurmd -C`), one partition `debug` plus a higher
tier `urgent` that preempts it (PreemptMode=REQUEUE), `select/cons_tres`, and `JobRequeue=1`. It
also declares one `gpu` GRES per CPU, each a plain file standing in for a device, so that the
launcher presets' GPU keys (`hydra.launcher.gpus_per_node=2`) are scheduled as on a GPU cluster;
the tasks still run on the CPU.

It needs root (slurmd starts each job as its user). As root, `start --install` installs the
packages with apt-get where they are missing (no service is started by the packages). Stopping
cancels the cluster's jobs, waits for them to end, then stops each daemon by the pid it started;
`status` says what runs. Tests: tests/test_slurm_cluster.py; docs/cluster.md.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("MARL_LLM_SLURM_DIR", "/tmp/marl-llm-slurm"))
PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server")
# The programs each package brings (found on PATH or in /usr/sbin).
PROGRAMS = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sinfo": "slurm-wlm", "sacct": "slurm-wlm",
            "slurmdbd": "slurmdbd", "munged": "munge", "mariadbd": "mariadb-server",
            "mariadb-install-db": "mariadb-server", "mariadb": "mariadb-server"}
CLUSTER = "marl-llm-local"
STATE = "cluster.json"
# Daemons in start order; stop goes the other way.
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
READY_S = 20


class Refused(Exception):
    """Why the cluster cannot start here: one line naming the fix."""


def program(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/sbin", "/usr/bin"):
        if os.access(f"{folder}/{name}", os.X_OK):
            return f"{folder}/{name}"
    return None


def missing_packages() -> list[str]:
    return sorted({pkg for name, pkg in PROGRAMS.items() if program(name) is None})


def why_not(install: bool = False) -> str | None:
    """The one line that says why this machine cannot run the local cluster, or None."""
    missing = missing_packages()
    if os.geteuid() != 0:
        what = f"; install {' '.join(missing)} first (apt-get install {' '.join(missing)})" if missing else ""
        return ("the local SLURM cluster needs root (slurmd starts each job as its user): run it as root, "
                f"e.g. in a container or VM{what}")
    if missing and not (install and program("apt-get")):
        return (f"the local SLURM cluster needs Debian's {', '.join(missing)}: apt-get install -y "
                f"{' '.join(PACKAGES)} (or run `scripts/slurm_local.py start --install` as root)")
    return None


def install() -> None:
    """apt-get install the missing packages, starting none of their services (a policy-rc.d that
    refuses service starts is put in place for the install where none exists)."""
    missing = missing_packages()
    if not missing:
        return
    policy = Path("/usr/sbin/policy-rc.d")
    placed = not policy.exists()
    if placed:
        policy.write_text("#!/bin/sh\n# marl-llm slurm_local.py: no service starts during its install\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:  # package lists may be missing on a fresh image
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
            done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise Refused(f"apt-get install {' '.join(PACKAGES)} failed: {tail[0]}")
    finally:
        if placed:
            policy.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of this process counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def read_state(root: Path) -> dict | None:
    try:
        return json.loads((root / STATE).read_text())
    except (OSError, ValueError):
        return None


def write_state(root: Path, state: dict) -> None:
    tmp = root / f".{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, root / STATE)


def client_env(root: Path = DEFAULT_DIR, base: dict | None = None) -> dict[str, str]:
    """An environment whose SLURM commands (sbatch, sacct, ...) talk to the local cluster."""
    env = dict(os.environ if base is None else base)
    env["SLURM_CONF"] = str(root / "etc" / "slurm.conf")
    sbin = "/usr/sbin"
    if sbin not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = f"{env.get('PATH', '')}{os.pathsep}{sbin}"
    return env


def node_line() -> tuple[str, int, int]:
    """`slurmd -C`'s NodeName line (this machine's sockets, cores, threads and memory), its node
    name, CPUs and memory in MiB."""
    out = subprocess.run([program("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("NodeName="))
    fields = dict(f.split("=", 1) for f in line.split())
    # Leave the OS 1 GiB: slurmd refuses to register a node with more memory than it finds.
    memory = max(1024, int(fields["RealMemory"]) - 1024)
    fields["RealMemory"] = str(memory)
    return " ".join(f"{k}={v}" for k, v in fields.items()), fields["NodeName"], int(fields["CPUs"])


def write_configs(root: Path, ports: dict[str, int], db_password: str) -> tuple[dict[str, Path], str]:
    """The config files (slurm.conf, gres.conf, slurmdbd.conf, cgroup.conf) and the node's name."""
    etc, spool, logs, run = (root / d for d in ("etc", "spool", "log", "run"))
    node, name, cpus = node_line()
    munge_socket = run / "munge.socket"
    slurm_conf = f"""\
# Generated by scripts/slurm_local.py: one node, this machine.
ClusterName={CLUSTER}
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={ports['slurmctld']}
SlurmdPort={ports['slurmd']}
SlurmUser=root
AuthType=auth/munge
# cred_expire: also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={spool}/ctld
SlurmdSpoolDir={spool}/d
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd.pid
SlurmctldLogFile={logs}/slurmctld.log
SlurmdLogFile={logs}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
# Schedule every few seconds, not every 30-60 s: a requeued job starts again within seconds.
SchedulerParameters=bf_interval=2,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={ports['slurmdbd']}
# slurmctld reaches slurmdbd through this munged (AuthInfo does not cover that connection).
AccountingStoragePass={munge_socket}
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
# Seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or out of time.
KillWait=5
MinJobAge=300
InactiveLimit=0
GresTypes=gpu
{node} NodeAddr=127.0.0.1 Gres=gpu:{cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
    # Stand-in GPUs: slurmd keeps a GPU only with a device file, so each is a plain file here. They
    # are scheduled, counted and named in CUDA_VISIBLE_DEVICES as real ones; the tasks run on the CPU.
    (root / "dev").mkdir(exist_ok=True)
    for i in range(cpus):
        (root / "dev" / f"gpu{i}").touch()
    gres_conf = f"NodeName={name} Name=gpu File={root / 'dev'}/gpu[0-{cpus - 1}]\n"
    dbd_conf = f"""\
# Generated by scripts/slurm_local.py.
AuthType=auth/munge
AuthInfo=socket={munge_socket}
DbdHost=localhost
DbdPort={ports['slurmdbd']}
SlurmUser=root
PidFile={run}/slurmdbd.pid
LogFile={logs}/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports['mariadbd']}
StorageUser=slurm
StoragePass={db_password}
StorageLoc=slurm_acct_db
"""
    paths = {"slurm": etc / "slurm.conf", "gres": etc / "gres.conf", "dbd": etc / "slurmdbd.conf",
             "cgroup": etc / "cgroup.conf"}
    paths["slurm"].write_text(slurm_conf)
    paths["gres"].write_text(gres_conf)
    paths["cgroup"].write_text("CgroupPlugin=autodetect\n")
    fd = os.open(paths["dbd"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the DB password
    with os.fdopen(fd, "w") as f:
        f.write(dbd_conf)
    return paths, name


def spawn(root: Path, name: str, argv: list[str], env: dict | None = None) -> int:
    log = open(root / "log" / f"{name}.out", "ab")  # noqa: SIM115  (the daemon keeps it)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env, close_fds=True)
    log.close()
    return proc.pid


def wait_for(what: str, check, root: Path, pid: int, timeout: float = READY_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if not alive(pid):
            break
        time.sleep(0.25)
    logs = sorted((root / "log").glob("*"))
    tail = "".join(p.read_text(errors="replace")[-1500:] for p in logs if p.stem in what or what in p.stem)
    raise Refused(f"{what} did not come up (logs in {root / 'log'}):\n{tail}")


def run_sql(root: Path, sql: str) -> None:
    subprocess.run([program("mariadb"), "--no-defaults", "-S", str(root / "run" / "mariadb.sock"), "-uroot", "-e", sql],
                   check=True, capture_output=True, text=True)


def sinfo_state(env: dict) -> str:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True, check=False)
    states = set(out.stdout.split()) if out.returncode == 0 else set()
    return states.pop() if len(states) == 1 else " ".join(sorted(states))


def sacct_answers(env: dict) -> bool:
    return subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], env=env, capture_output=True, check=False).returncode == 0


def start(root: Path = DEFAULT_DIR, install_missing: bool = False) -> dict:
    """Start the cluster in root (a running one there is stopped first); returns its state. A
    daemon that does not come up stops the ones started before it: a failed start leaves nothing."""
    try:
        return _start(root, install_missing)
    except BaseException:
        if not os.environ.get("SLURM_LOCAL_KEEP_FAILED"):  # set to look at a failed start's daemons
            stop(root)
        raise


def _start(root: Path, install_missing: bool) -> dict:
    line = why_not(install_missing)
    if line:
        raise Refused(line)
    if install_missing:
        install()
    if read_state(root):
        stop(root)
    if root.exists():
        shutil.rmtree(root)
    for sub in ("etc", "spool/ctld", "spool/d", "log", "run", "munge", "db"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    for sub in ("munge", "db"):  # munged refuses a key dir others may read or write
        (root / sub).chmod(0o700)
    (root / "run").chmod(0o755)  # the socket dir: clients of every user reach munged through it
    ports = {name: free_port() for name in ("mariadbd", "slurmdbd", "slurmctld", "slurmd")}
    db_password = secrets.token_hex(16)
    paths, node = write_configs(root, ports, db_password)
    state = {"dir": str(root), "ports": ports, "pids": {}, "slurm_conf": str(paths["slurm"])}
    write_state(root, state)
    env = client_env(root)

    key = root / "munge" / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(1024))
    sock = root / "run" / "munge.socket"
    state["pids"]["munged"] = spawn(root, "munged", [
        program("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
        f"--pid-file={root / 'run' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
        f"--seed-file={root / 'munge' / 'munged.seed'}"])
    write_state(root, state)
    wait_for("munged", sock.exists, root, state["pids"]["munged"])

    data = root / "db" / "data"
    made = subprocess.run([program("mariadb-install-db"), "--no-defaults", f"--datadir={data}", "--user=root",
                           "--auth-root-authentication-method=socket", "--skip-test-db"],
                          capture_output=True, text=True, check=False)
    if made.returncode != 0:
        raise Refused(f"mariadb-install-db failed (exit {made.returncode}): "
                      f"{' | '.join((made.stderr or made.stdout).strip().splitlines()[-6:])}")
    db_sock = root / "run" / "mariadb.sock"
    state["pids"]["mariadbd"] = spawn(root, "mariadbd", [
        program("mariadbd"), "--no-defaults", f"--datadir={data}", f"--socket={db_sock}", f"--port={ports['mariadbd']}",
        "--bind-address=127.0.0.1", f"--pid-file={root / 'run' / 'mariadbd.pid'}", "--user=root",
        f"--log-error={root / 'log' / 'mariadbd.log'}", "--skip-name-resolve", "--innodb-buffer-pool-size=32M"])
    write_state(root, state)
    wait_for("mariadbd", db_sock.exists, root, state["pids"]["mariadbd"])
    run_sql(root, f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{db_password}'; "
                  "CREATE DATABASE slurm_acct_db; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")

    # slurmdbd reads slurmdbd.conf from SLURM_CONF's folder (env's, as every client's).
    state["pids"]["slurmdbd"] = spawn(root, "slurmdbd", [program("slurmdbd"), "-D"], env=env)
    write_state(root, state)
    wait_for("slurmdbd", lambda: _listening(ports["slurmdbd"]), root, state["pids"]["slurmdbd"])
    state["pids"]["slurmctld"] = spawn(root, "slurmctld", [program("slurmctld"), "-D", "-c", "-i", "-f", str(paths["slurm"])],
                                       env=env)
    write_state(root, state)
    wait_for("slurmctld", lambda: _listening(ports["slurmctld"]), root, state["pids"]["slurmctld"])
    state["pids"]["slurmd"] = spawn(root, "slurmd", [program("slurmd"), "-D", "-N", node, "-f", str(paths["slurm"])],
                                    env=env)
    write_state(root, state)
    wait_for("slurmd", lambda: sinfo_state(env) == "idle" and sacct_answers(env), root, state["pids"]["slurmd"])
    return state


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def cluster_processes(root: Path) -> list[int]:
    """Pids of processes that belong to this cluster's jobs: a slurmstepd of this cluster, or any
    process whose environment names this cluster's slurm.conf with a job id (the job's tasks and
    everything they started)."""
    conf = f"SLURM_CONF={root / 'etc' / 'slurm.conf'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        in_job = conf in environ and any(v.startswith(b"SLURM_JOB_ID=") for v in environ)
        stepd = b"slurmstepd" in cmdline.split(b"\0")[0] and str(root).encode() in cmdline
        if in_job or stepd:
            found.append(int(entry.name))
    return found


def stop(root: Path = DEFAULT_DIR, timeout: float = 60) -> list[str]:
    """Cancel the cluster's jobs, wait for them to end, then stop each daemon it started (TERM, then
    KILL after 15 s). Returns the daemons that were running."""
    state = read_state(root)
    if not state:
        return []
    env = client_env(root)
    running = [name for name in DAEMONS if name in state["pids"] and alive(state["pids"][name])]
    if "slurmctld" in running:
        subprocess.run(["scancel", "--full", "--user", str(os.geteuid())], env=env, capture_output=True, check=False)
        # scancel by user skips nothing of this cluster's; also every job id it still knows.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, check=False)
            if queue.returncode != 0 or not queue.stdout.strip():
                break
            subprocess.run(["scancel", "--full", *queue.stdout.split()], env=env, capture_output=True, check=False)
            time.sleep(0.5)
    for name in reversed(DAEMONS):
        pid = state["pids"].get(name)
        if pid and alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if pid:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    for pid in cluster_processes(root):  # a job's process that outlived its step (should be none)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    (root / STATE).unlink(missing_ok=True)
    return running


def status(root: Path = DEFAULT_DIR) -> dict:
    """Each daemon's pid and whether it runs, the node's state (sinfo) and the jobs (squeue)."""
    state = read_state(root)
    if not state:
        return {"running": False, "dir": str(root)}
    env = client_env(root)
    daemons = {name: {"pid": pid, "alive": alive(pid)} for name, pid in state["pids"].items()}
    up = all(d["alive"] for d in daemons.values()) and set(daemons) == set(DAEMONS)
    queue = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], env=env, capture_output=True, text=True, check=False)
    return {"running": up, "dir": str(root), "slurm_conf": state["slurm_conf"], "daemons": daemons,
            "node": sinfo_state(env) if up else "", "jobs": queue.stdout.split("\n") if up and queue.stdout.strip() else []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("start", "stop", "status"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the cluster's folder (default {DEFAULT_DIR})")
    parser.add_argument("--install", action="store_true", help="as root: apt-get install the missing packages first")
    args = parser.parse_args(argv)
    root = args.dir.resolve()
    try:
        if args.command == "start":
            t0 = time.monotonic()
            state = start(root, install_missing=args.install)
            print(f"local SLURM cluster {CLUSTER} up in {time.monotonic() - t0:.0f} s: {root}\n"
                  f"export SLURM_CONF={state['slurm_conf']}")
        elif args.command == "stop":
            stopped = stop(root)
            print(f"stopped {', '.join(stopped)}" if stopped else f"no local SLURM cluster runs in {root}")
        else:
            info = status(root)
            print(json.dumps(info, indent=1))
            return 0 if info["running"] else 3
    except Refused as err:
        print(f"slurm_local: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
