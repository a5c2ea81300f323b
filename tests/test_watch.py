"""Watching a run: progress on the console (bars on a terminal, status lines elsewhere), the console
kept in the run dir's job log, the step line, trainer.threads, and debug=tiny for every algorithm
and task."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import VENV_BIN, compose_config, required_settings, tiny_overrides
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.plugins import load_plugins
from marl_llm.registry import SCHEMAS
from marl_llm.rollout.base import PROGRESS
from marl_llm.training import threads
from marl_llm.training.console import Watch, step_line
from marl_llm.training.threads import torch_threads
from marl_llm.training.trainer import train

STATUS_LINE = re.compile(r"^\[marl-llm\] (step 1/1|eval @ step \d+), .*\(\d+s in[;)]", re.M)


def marl_llm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "marl-llm"), *args], capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------ debug=tiny
load_plugins()  # every registered algorithm and task


@pytest.mark.parametrize("task", sorted(SCHEMAS["task"]))
@pytest.mark.parametrize("algo", sorted(SCHEMAS["algo"]))
def test_debug_tiny_composes_and_validates_for_every_algo_and_task(algo, task, tmp_path):
    cfg = compose_config(["debug=tiny", f"algo={algo}", f"task={task}", f"run_dir={tmp_path}",
                          *required_settings("task", task)])
    validate(cfg)
    assert (cfg.algo.name, cfg.task.name, cfg.logger.name) == (algo, task, "none")
    assert cfg.trainer.max_steps == 1 and cfg.trainer.eval_max_problems == 1 and cfg.trainer.prompts_per_step == 1
    assert cfg.algo.sampling.max_new_tokens == 32
    # The keys only some algorithms and tasks have are set where they exist.
    assert cfg.algo.get("num_generations", 2) == 2 and cfg.algo.get("num_branches", 2) == 2
    # task=env keeps two turns with the multi-turn algorithms: a smoke test of a user's environment steps
    # it twice and forks it (conf/debug/by_pair)
    two_turns = task == "env" and algo in ("magrpo", "at_grpo", "collm_cc", "collm_dc")
    assert cfg.algo.get("num_turns", 1) == (2 if two_turns else 1)
    assert cfg.task.get("max_turns", 2) == 2


def test_debug_tiny_leaves_other_runs_alone_and_the_command_line_wins(tmp_path):
    plain = compose_config([f"run_dir={tmp_path}"])
    assert (plain.algo.num_generations, plain.algo.num_turns, plain.trainer.max_steps, plain.logger.name) == \
        (4, 2, 3, "wandb")
    tiny = compose_config(["debug=tiny", "algo.num_turns=2", "logger=wandb", f"run_dir={tmp_path}"])
    assert (tiny.algo.num_generations, tiny.algo.num_turns, tiny.logger.name) == (2, 2, "wandb")
    # A preset that sets the algorithm (not the command line) still gets that algorithm's sizes.
    preset = compose_config(["debug=tiny", "experiment=at_grpo_sokoban_paper", f"run_dir={tmp_path}"])
    assert (preset.algo.name, preset.algo.num_branches, preset.task.max_turns) == ("at_grpo", 2, 2)


# ------------------------------------------------------------------------------- console runs
def test_console_run_shows_progress_on_stderr_and_keeps_its_log(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    out = marl_llm("debug=tiny", "model=local", f"model.path={tiny_model_dir}", "model.device=cpu",
                   f"hydra.run.dir={run_dir}", "trainer.eval_max_problems=2", "trainer.progress_every_s=0.05")
    assert out.returncode == 0, out.stderr[-3000:]
    # stderr is a pipe, not a terminal: status lines (no bars), none of them on stdout.
    assert STATUS_LINE.search(out.stderr), out.stderr[-3000:]
    assert "\r" not in out.stderr and not STATUS_LINE.search(out.stdout)
    assert re.search(r"(generating \d+/\d+ sequences|scoring rewards|micro-batches: \d+)", out.stderr)
    # The job log keeps what the console showed, with times.
    step = next(line for line in out.stdout.splitlines() if line.startswith("[marl-llm] step 1/1: "))
    assert "loss=" not in step and "frac_reward_zero_std=" in step and "grad_norm=" in step
    assert "tokens/s=" in step and "step_time=" in step
    job_log = (run_dir / "cli.log").read_text()
    for line in out.stdout.splitlines():
        if line.startswith("[marl-llm] ") and "data for task" not in line:  # tasks/data.py prints its line
            assert line.removeprefix("[marl-llm] ") in job_log
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\]\[INFO\]\[marl_llm\] step 1/1: reward=", job_log, re.M)


def test_a_bad_thread_count_is_one_error_line(tmp_path):
    out = marl_llm("trainer.threads=0", "logger=none", f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: trainer.threads=0 is not a choice: auto (the physical cores this process may use, less those other "
        "processes keep busy) or a number of threads, e.g. trainer.threads=1"]


# --------------------------------------------------------------------------------- in-process
class FakeLoad:
    """Load readings on a clock of the test's: each CPU's ticks (100 a second), `others` CPUs' worth
    of other processes' busy time and `own` of this run's since the last reading."""

    def __init__(self, cpus: int = 2):
        self.now, self.cpus, self.reads = 0.0, cpus, 0
        self.busy, self.total, self.own_s = [0] * cpus, [0] * cpus, 0.0

    def advance(self, seconds: float, others: float, own: float = 0.0) -> None:
        self.now += seconds
        for cpu in range(self.cpus):
            self.busy[cpu] += round(100 * seconds * min(1.0, (others + own) / self.cpus))
            self.total[cpu] += round(100 * seconds)
        self.own_s += own * seconds

    def read(self) -> threads.LoadReading:
        self.reads += 1
        return threads.LoadReading(self.now, {f"cpu{c}": (self.busy[c], self.total[c]) for c in range(self.cpus)},
                                   self.own_s)


def test_auto_threads_follow_the_load_during_the_run_and_say_so(monkeypatch):
    """Decided again at the progress events that mark boundaries of work, at most every
    MIN_WINDOW_S: other processes' load arriving takes threads away, its leaving gives them back,
    the run's own work (its threads, its children) is not load, and each change is one line."""
    monkeypatch.setattr(threads, "process_cpus", lambda: {0, 1})
    load, lines = FakeLoad(), []
    follow = threads.AutoThreads(threads.Threads(2, "auto: 2 cores", ceiling=2, cores=2), lines.append,
                                 read=load.read, clock=lambda: load.now)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        follow.attach()
        load.advance(5, others=1.8)
        PROGRESS.debug("phase", extra={"phase": "rollout"})  # 5 s: too soon to judge
        assert (torch.get_num_threads(), lines, load.reads) == (2, [], 1)
        load.advance(15, others=1.8, own=0.2)
        PROGRESS.debug("phase", extra={"phase": "update"})
        assert torch.get_num_threads() == 1 and follow.count == 1
        assert len(lines) == 1 and lines[0].startswith(
            "torch threads: 2 -> 1 (update) [auto: 1.8 of 2 CPUs busy with other processes over the last 20 s"), lines
        load.advance(12, others=0.0, own=1.0)
        PROGRESS.debug("decoding", extra={"tokens": 8})  # not a boundary: within a generate chunk
        assert torch.get_num_threads() == 1 and load.reads == 2
        PROGRESS.debug("generated", extra={"sequences": 2, "tokens": 8})
        assert torch.get_num_threads() == 2 and lines[1].startswith(
            "torch threads: 1 -> 2 (update) [auto: 0.0 of 2 CPUs busy"), lines
        load.advance(12, others=0.1, own=1.9)  # every CPU busy, nearly all of it this run's
        PROGRESS.debug("micro-batch", extra={"sequences": 2})
        assert torch.get_num_threads() == 2 and len(lines) == 2 and load.reads == 4
        load.advance(12, others=2.0)
        worker = threading.Thread(target=PROGRESS.debug, args=("generated",), kwargs={"extra": {"sequences": 1,
                                                                                               "tokens": 1}})
        worker.start()
        worker.join()  # another thread's event: torch.set_num_threads would set that thread's count only
        assert torch.get_num_threads() == 2 and len(lines) == 2
    finally:
        follow.detach()
        torch.set_num_threads(before)
    assert follow not in PROGRESS.handlers and not PROGRESS.isEnabledFor(logging.DEBUG)


@pytest.mark.parametrize("setting, deterministic", [(3, False), ("auto", True)])
def test_a_thread_count_given_or_deterministic_never_follows_the_load(monkeypatch, setting, deterministic):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: 2)
    chosen = threads.choose_threads(setting, deterministic)
    load = FakeLoad()
    follow = threads.AutoThreads(chosen, pytest.fail, read=load.read, clock=lambda: load.now)
    follow.attach()
    try:
        load.advance(60, others=2.0)
        assert follow.revisit() == chosen.count and load.reads == 0 and follow not in PROGRESS.handlers
    finally:
        follow.detach()


def test_own_cpu_time_counts_the_runs_children_live_and_reaped():
    """A child's CPU time (a sandbox judge, a vLLM engine) is the run's, not other processes' load."""
    # It spins 0.5 s and 0.4 s are asked: /proc counts CPU time in clock ticks (10 ms), and a
    # child's 0.3 s spin read as 0.30 less the parent's 1 ms (seen in CI).
    spin = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
            "print(flush=True)\ntime.sleep(60)")
    before, mine = threads.own_cpu_s(), time.process_time()
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # it has spun 0.5 s of CPU
        if not threads._children():
            pytest.skip("no /proc/<pid>/task/<tid>/children")
        assert threads.own_cpu_s() - before - (time.process_time() - mine) >= 0.4  # alive
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert threads.own_cpu_s() - before - (time.process_time() - mine) >= 0.4  # reaped


def test_threads_are_applied_for_the_run_and_restored(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """trainer.threads=1 is set for the run and stays whatever the load (readings of a saturated
    machine at every boundary); the caller's count is back afterwards."""
    monkeypatch.setattr(threads, "MIN_WINDOW_S", 0.0)
    load = FakeLoad()
    monkeypatch.setattr(threads, "read_load", lambda: (load.advance(30, others=2.0), load.read())[1])
    before = torch.get_num_threads()
    train(compose_config(tiny_overrides(tiny_model_dir, tmp_path / "one", "trainer.threads=1",
                                        "trainer.eval_before=false", "trainer.eval_after=false")))
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "run dir" in line)
    assert "torch threads: 1)" in header
    assert "torch threads: 1 ->" not in out and load.reads == 0
    assert torch.get_num_threads() == before


def test_auto_threads_change_within_a_run_on_the_console(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """An idle machine at the start (2 threads), saturated by other processes from then on: the
    run's next boundary after MIN_WINDOW_S takes one thread and the console says when and why."""
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cpus_sampled", lambda cpus: 0.0)
    monkeypatch.setattr(threads, "process_cpus", lambda: {0, 1})
    monkeypatch.setattr(threads, "MIN_WINDOW_S", 0.0)
    load = FakeLoad()
    monkeypatch.setattr(threads, "read_load", lambda: (load.advance(30, others=2.0), load.read())[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's default, as auto's most
    try:
        train(compose_config(tiny_overrides(tiny_model_dir, tmp_path / "auto", "trainer.eval_before=false",
                                            "trainer.eval_after=false", "trainer.progress=off")))
        assert torch.get_num_threads() == 2  # the caller's count is back
    finally:
        torch.set_num_threads(before)
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "run dir" in line)
    assert "torch threads: 2 [auto: 2 cores, 0.0 of 2 CPUs busy with other processes]" in header
    changed = [line for line in lines if "torch threads: 2 ->" in line]
    assert len(changed) == 1 and changed[0].startswith(
        "[marl-llm] step 1/1: torch threads: 2 -> 1 (rollout) [auto: 2.0 of 2 CPUs busy with other processes over "
        "the last 30 s; load average "), changed


def test_auto_threads_are_at_most_the_cores_the_process_may_use(monkeypatch):
    assert torch_threads(3) == 3
    assert torch_threads("auto", deterministic=True) == min(torch.get_num_threads(), threads.available_cores())
    assert 1 <= torch_threads("auto") <= min(torch.get_num_threads(), threads.available_cores())
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0})  # e.g. srun --cpus-per-task=1
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: None)
    assert threads.available_cores() == 1 and torch_threads("auto") == 1
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: 1.5)  # docker --cpus=1.5
    assert threads.available_cores() == 2
    for bad in (0, -2, "many", True):
        with pytest.raises(UserError, match="trainer.threads"):
            torch_threads(bad)


@pytest.mark.parametrize("cpus, cores, load, sampled, expected", [
    (2, 2, 0.1, 0.05, 2),   # an idle 2-core machine: both cores
    (2, 2, 2.6, 1.9, 1),    # two other jobs busy (the 4.3x case): one thread
    (2, 2, 1.0, 0.02, 2),   # a job that just ended left the load average at 1.0: the sample counts
    (2, 2, 0.1, 1.0, 1),    # one just started (not in the load average yet): the sample sees it
    (8, 8, 3.0, 2.5, 5),    # 8 cores, 3 busy: the rest
    (8, 4, 0.0, 4.0, 2),    # 4 cores with 2 hyper-threads each, half the CPUs busy: half the cores
    (2, 2, 1.0, None, 1),   # no /proc/stat: the load average, the only estimate left
    (4, 4, 0.0, None, 4),
])
def test_auto_threads_leave_the_cores_other_processes_keep_busy(monkeypatch, cpus, cores, load, sampled, expected):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(threads, "available_cores", lambda: cores)
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: cores)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(threads, "busy_cpus_sampled", lambda cpus: sampled)
    chosen = threads.choose_threads("auto")
    busy = sampled if sampled is not None else min(load, cpus)
    assert chosen.count == expected and f"{busy:.1f} of {cpus} CPUs busy" in chosen.why
    assert threads.choose_threads("auto", deterministic=True).count == cores  # the load left out


def test_auto_threads_see_processes_that_just_started(monkeypatch):
    """Real /proc/stat, no mocked sample: a busy process per CPU, started 0.2 s before (not yet in
    the 1-minute load average), leaves this run one thread of the machine's cores."""
    from marl_llm.bench.threads import SPIN

    cpus = os.sched_getaffinity(0)
    if threads.busy_cpus_sampled(cpus, 0.05) is None:
        pytest.skip("no /proc/stat")
    monkeypatch.setattr(threads.torch, "get_num_threads", lambda: len(cpus))
    monkeypatch.setattr(threads, "available_cores", lambda: len(cpus))
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in cpus]  # as `marl-llm-bench threads --busy`
    try:
        time.sleep(0.2)
        busy = threads.choose_threads("auto")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert busy.count == 1 or len(cpus) == 1, busy.why


def test_the_sampled_busy_time_reads_the_cpus_of_this_process(monkeypatch):
    """/proc/stat's per-CPU jiffies: busy = all but idle and iowait, over the sampled window."""
    readings = iter(["cpu  0 0 0 0 0\ncpu0 100 0 100 800 0 0 0 0\ncpu1 0 0 0 1000 0 0 0 0\n",
                     "cpu  0 0 0 0 0\ncpu0 130 0 130 840 0 0 0 0\ncpu1 0 0 50 1050 0 0 0 0\n"])
    monkeypatch.setattr(threads.Path, "read_text", lambda self: next(readings))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    assert threads.busy_cpus_sampled({0, 1}) == pytest.approx(60 / 100 + 50 / 100)


def test_bars_on_a_terminal_with_the_log_lines_above_them(tiny_model_dir, tmp_path, capsys):
    train(compose_config(tiny_overrides(tiny_model_dir, tmp_path / "bars", "trainer.progress=bars",
                                        "trainer.max_steps=2", "trainer.eval_before=false")))
    captured = capsys.readouterr()
    assert re.search(r"training: 100%\|.*\| 2/2 \[", captured.err), captured.err[-2000:]
    assert "step 1/2: reward=" in captured.out and "step 2/2: reward=" in captured.out
    assert not STATUS_LINE.search(captured.err)


def test_the_status_follows_the_work_events():
    watch = Watch("lines", every_s=60)
    watch.start(max_steps=10, done_steps=3)
    try:
        watch.step_times = [30.0]  # one step of 30 s done: 7 to go
        watch.begin("step 5/10")
        PROGRESS.debug("phase", extra={"phase": "rollout"})
        PROGRESS.debug("generate", extra={"sequences": 8})
        PROGRESS.debug("generated", extra={"sequences": 4, "tokens": 100})
        assert watch.status().startswith("step 5/10, rollout: generating 4/8 sequences, 100 tokens")
        assert watch.status().endswith("s in; ETA 3m30s)")
        PROGRESS.debug("generate done")
        for _ in range(3):
            PROGRESS.debug("sandbox job")
        assert "rollout: scoring rewards, sandbox jobs done: 3" in watch.status()
        PROGRESS.debug("phase", extra={"phase": "update"})
        PROGRESS.debug("micro-batch", extra={"sequences": 4})
        PROGRESS.debug("micro-batch", extra={"sequences": 4})
        assert "step 5/10, update: micro-batches: 2" in watch.status()
        assert watch.tokens_per_s() is not None and watch.tokens_per_s() > 0
    finally:
        watch.stop()
    assert watch not in PROGRESS.handlers and PROGRESS.level == logging.NOTSET


def test_the_step_line_shows_what_a_researcher_watches():
    # AT-GRPO: the team reward, then each agent's candidate scores (alpha x team + own) and their groups' signal
    metrics = {"reward": 0.5, "tool/reward_mixed": 0.75, "plan/reward_mixed": 0.25, "reward_std": 0.1,
               "frac_reward_zero_std": 0.5, "frac_reward_mixed_zero_std": 0.25, "loss": 0.0, "grad_norm": 0.12,
               "entropy": 1.5, "completions/mean_length": 40.0, "step_time": 12.0}
    line = step_line(3, 10, metrics, ["tool", "plan"], tokens_per_s=41.25, eta_s=84.0)
    assert line == ("step 3/10: reward=0.5  tool/reward_mixed=0.75  plan/reward_mixed=0.25  reward_std=0.1  "
                    "frac_reward_zero_std=0.5  frac_reward_mixed_zero_std=0.25  grad_norm=0.12  entropy=1.5  "
                    "completions/mean_length=40  tokens/s=41.25  step_time=12  eta=1m24s")
    assert step_line(10, 10, metrics, [], None, 0.0).endswith("step_time=12")  # the last step: no ETA


def test_bad_progress_settings_are_refused():
    with pytest.raises(UserError, match="trainer.progress=fancy is not a choice"):
        Watch("fancy", 30)
    with pytest.raises(UserError, match="trainer.progress_every_s=0 must be > 0"):
        Watch("lines", 0)
