"""The launchers of `marl-llm -m hydra/launcher=slurm|local ...`: hydra-submitit-launcher's, waiting
for every job of the sweep and naming each failed one in one line.

The plugin returns the jobs' results in order and raises at the first failed one, with submitit's
multi-line report (its "has not produced any output" block, the job's stderr, then Hydra's trace),
and stops waiting for the jobs after it, which go on in SLURM unseen. Here the sweep waits for all
of them, then prints one line per failed job: its id, its overrides, the job's own error line (the
one-line `error: ...` the run printed, else the last line of its stderr) and its log, then a count
of the jobs that finished; it exits 2 when any failed. The presets in conf/hydra/launcher/ use these
classes; the plugin's own `submitit_slurm` and `submitit_local` keep the plugin's behaviour.

It lives in Hydra's `hydra_plugins` namespace, where Hydra looks for launcher classes (it scans
every module there at start; without the `slurm` extra this one defines nothing).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
except ImportError:  # no `slurm` extra: Hydra's plugin scan imports this module anyway
    submitit_launcher = None


@contextmanager
def _jobs_of(submitted: list) -> Iterator[None]:
    """Collect the jobs the plugin's launch submits (its map_array call), to wait for all of them."""
    import submitit

    real = submitit.AutoExecutor.map_array

    def map_array(executor, fn, *iterable):
        jobs = real(executor, fn, *iterable)
        submitted.extend(jobs)
        return jobs

    submitit.AutoExecutor.map_array = map_array
    try:
        yield
    finally:
        submitit.AutoExecutor.map_array = real


def error_line(stderr: str) -> str:
    """The job's own error: the run's last one-line `error: ...`, else its stderr's last line
    (srun's own report of the exit, "srun: error: <node>: task 0: Exited with exit code 2", is not
    the run's)."""
    from marl_llm.config import last_error_line

    line = last_error_line(stderr)
    return line.removeprefix("error: ") if line else "(no error output)"


def failure_line(job: Any, overrides: Sequence[str]) -> str:
    """One line for a failed job: id, overrides, its error and where its log is."""
    try:
        stderr = Path(job.paths.stderr).read_text(errors="replace")
    except OSError:
        stderr = ""
    # SLURM's state where it says more than "failed" (CANCELLED, TIMEOUT, OUT_OF_MEMORY, NODE_FAIL);
    # right after the job ends sacct may still say RUNNING or UNKNOWN.
    state = (str(getattr(job, "state", "")).split() or [""])[0]
    how = f" ({state})" if state not in ("", "FAILED", "UNKNOWN", "RUNNING", "COMPLETED", "PENDING") else ""
    return (f"error: job {job.job_id} ({' '.join(overrides) or 'no overrides'}) failed{how}: "
            f"{error_line(stderr)}; its log: {job.paths.stderr}")


class _WaitForAll:
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        from hydra.core.utils import filter_overrides
        from submitit.core.utils import UncompletedJobError

        submitted: list = []
        with _jobs_of(submitted):
            try:
                return super().launch(job_overrides, initial_job_idx)
            except UncompletedJobError:  # (FailedJobError is one) a job failed: wait for the others
                pass
        results, failed = [], []
        for job, overrides in zip(submitted, job_overrides):
            job.wait()
            try:
                results.append(job.results()[0])
            except UncompletedJobError:
                failed.append(failure_line(job, filter_overrides(list(overrides))))
        for line in failed:
            print(line, file=sys.stderr, flush=True)
        print(f"error: {len(failed)} of {len(submitted)} jobs of the sweep failed; the other {len(results)} finished "
              "(fix the overrides named above and run the same command to continue: jobs that finished are skipped "
              "with trainer.resume=if_possible)", file=sys.stderr, flush=True)
        sys.exit(2)


if submitit_launcher is not None:
    class SlurmLauncher(_WaitForAll, submitit_launcher.SlurmLauncher):
        """`hydra/launcher=slurm` (and the presets extending it): one SLURM job array per sweep."""

    class LocalLauncher(_WaitForAll, submitit_launcher.LocalLauncher):
        """`hydra/launcher=local`: the same submitit path on this machine."""
