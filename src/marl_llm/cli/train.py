"""The `marl-llm` console script: Hydra composes conf/, the trainer runs one job per config.

    marl-llm algo=magrpo task=humaneval            # one run
    marl-llm --cfg job                             # print the composed config
    marl-llm -m seed=0,1 algo.baseline=mean,rloo   # a sweep (local, or SLURM via hydra/launcher)
"""

from __future__ import annotations

import os
import sys
import unicodedata
from datetime import datetime
from pathlib import Path

import hydra
from omegaconf import DictConfig

from marl_llm.config import TrainerConfig, UserError, walk_key
from marl_llm.configure import (add_overrides, config_dir, default_dir_pattern, default_run_dir, map_overrides,
                               option_schemas, plugin_overrides, plugins_from_overrides, register_configs, validate)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _hydra_main(cfg: DictConfig) -> float:
    from marl_llm.runs.rundir import Interrupted

    try:
        validate(cfg)  # before any model loads: bad values fail in seconds
        from marl_llm.training.trainer import train

        return train(cfg)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except Interrupted as stop:  # Ctrl-C: one line (where it stopped, how to go on), the shell's 128 + SIGINT
        if stop.main:
            print(stop, file=sys.stderr, flush=True)
        sys.exit(130)
    except KeyboardInterrupt:  # before the run claimed its dir: nothing there to continue
        print("interrupted before the run started: run the same command to start it", file=sys.stderr, flush=True)
        sys.exit(130)


def unknown_key_error(args: list[str]) -> str | None:
    """Hydra rejects a misspelled key without naming the valid ones; say them (and the likely
    intended key) before Hydra runs. Keys of groups chosen by an experiment preset are left to
    Hydra, whose own error still stops the run."""
    schemas, preset = option_schemas(args)
    for a in args:
        if a.startswith(("-", "+", "~", "hydra.")) or "=" not in a:
            continue
        kind, _, err = walk_key(a.split("=", 1)[0], schemas, preset)
        if kind == "unknown":
            return err
    return None


def named_dir_check(args: list[str]) -> None:
    """A run dir named on the command line (hydra.run.dir=) that holds another run is refused here,
    before Hydra writes its own files (.hydra/, the job log) into it; the trainer claims the dir
    (rundir.claim). A resume (trainer.resume=true, a requeued SLURM job) goes on in its dir."""
    named = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")), None)
    if named is None or any(a in ("-m", "--multirun") for a in args):
        return
    resume = any(a.split("=", 1)[1].lower() in ("true", "1", "yes", "if_possible") for a in args
                 if a.startswith("trainer.resume="))
    from marl_llm.runs import rundir

    if resume or rundir.requeued():
        return
    files = rundir.held(Path(named))
    if files:
        raise UserError(rundir.refusal(Path(named), files))


def rank_overrides(args: list[str]) -> list[str]:
    """Under a multi-process launcher (torchrun, accelerate launch) every rank runs this script:
    all ranks must share rank 0's run dir, and only rank 0 writes Hydra's files and log. The
    ranks join their process group here, before Hydra names the dir from the clock, and take
    rank 0's clock reading. A sweep (-m) is never run inside such a launcher: its jobs would be
    ranks of one another."""
    if any(a in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c") or a.startswith(("--cfg", "--info"))
           for a in args):
        return []
    from marl_llm.distributed.world import launched_world_size

    if launched_world_size() <= 1:
        return []
    if any(a in ("-m", "--multirun") for a in args):
        raise UserError("a sweep (-m) runs its jobs through hydra/launcher, never inside torchrun/accelerate launch: "
                        "drop the launcher, or set hydra/launcher=slurm hydra.launcher.gpus_per_node=<n> for "
                        "data-parallel jobs")
    timeout = next((float(a.split("=", 1)[1]) for a in args if a.startswith("trainer.distributed_timeout_min=")),
                   TrainerConfig.distributed_timeout_min)
    import torch

    from marl_llm.distributed import data_parallel as distributed

    cpu = "model.device=cpu" in args or not torch.cuda.is_available()
    w = distributed.init(timeout, cpu=cpu)
    started = distributed.broadcast_object(datetime.now().timestamp())
    out = []
    if not any(a.startswith("hydra.run.dir=") for a in args):
        out.append("hydra.run.dir=" + default_run_dir(datetime.fromtimestamp(started)))
    if not w.is_main:
        out += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    return out


# What word processors, chat apps and East Asian input methods type in place of ASCII: curly quotes,
# unicode dashes and primes, full-width forms (digits, =, brackets, ...) and the ideographic space.
LOOKALIKES = {**dict.fromkeys("\u2018\u2019\u201a\u201b\u2032", "'"),
              **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033", '"'),
              **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"), "\u3000": " ",
              **{chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F)}}


def lookalike_error(args: list[str]) -> str | None:
    """An override with a curly quote or a full-width digit outside a quoted value stops Hydra's
    lexer with an error that names neither the character nor the fix: name both, before Hydra
    parses. Inside a quoted value (logger.group='実験１') such characters are text, left as they are."""
    for a in args:
        where = next((i for i, ch in enumerate(a) if ch in LOOKALIKES), None)
        if where is None or a.startswith("-"):
            continue
        if "=" in a:
            from hydra.core.override_parser.overrides_parser import OverridesParser

            try:
                OverridesParser.create().parse_override(a)
                continue  # Hydra reads it: the character is inside a quoted value
            except Exception:  # noqa: BLE001  (any parse error: name the character below)
                pass
        ch, ascii_ch = a[where], LOOKALIKES[a[where]]
        fixed = "".join(LOOKALIKES.get(c, c) for c in a)
        if where == 0 and ascii_ch == "-":  # autocorrect makes one dash of a flag's two: --cfg -> \u2014cfg
            ascii_ch, fixed = "--", "-" + fixed
        return (f"argument {a!r} has {ch!r} ({unicodedata.name(ch, 'U+%04X' % ord(ch))}) at position {where + 1}, "
                f"which Hydra cannot read: type the ASCII {ascii_ch!r} instead ({fixed})")
    return None


def _uncreatable(path: Path) -> str | None:
    """Why Hydra could not make `path` and write into it (its nearest existing ancestor is a file
    or not writable), or None."""
    path = path.absolute()  # Hydra makes it relative to the working directory (hydra.job.chdir=false)
    for p in (path, *path.parents):
        if os.path.lexists(p) and not os.path.exists(p):
            return f"{p} is a broken symbolic link"
        if os.path.exists(p):
            if not os.path.isdir(p):
                return f"{p} is a file, not a directory"
            if not os.access(p, os.W_OK | os.X_OK):
                return f"{p} is not writable"
            return None
    return None


def run_dir_check(args: list[str]) -> None:
    """The run dir (hydra.run.dir, or hydra.sweep.dir for -m; named or Hydra's default under the
    working directory) must be creatable: Hydra makes it before the job starts, where a parent
    that is a file or read-only fails with a pathlib traceback."""
    if any(a in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c") or a.startswith(("--cfg", "--info"))
           for a in args):
        return  # Hydra prints and makes no dir
    key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in args) else "hydra.run.dir"
    named = next((a.split("=", 1)[1] for a in args if a.startswith(key + "=")), None)
    value = named
    if value is None:
        value = default_dir_pattern(key.split(".")[1])  # unresolved: outputs/${now:...}
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]  # Hydra's quoting
    fixed = value.split("${", 1)[0]  # the part before any ${now:...} is made as written
    if "${" in value:
        fixed = fixed.rpartition("/")[0]
    reason = _uncreatable(Path(fixed or "."))
    if reason is None:
        return
    if named is not None:
        raise UserError(f"{key}={named} cannot be created ({reason}): name a directory you can write, "
                        f"{key}=<dir>")
    raise UserError(f"Hydra's default run dir {value} under {Path.cwd()} cannot be created ({reason}): set "
                    f"{key}=<dir you can write>, or run marl-llm from a directory you can write")


def main() -> None:
    err, searchpath = lookalike_error(sys.argv[1:]), []
    if err is None:
        try:  # the algorithms, tasks and plugins register their schemas before the overrides are read
            searchpath = register_configs(plugins_from_overrides(sys.argv[1:]))
        except UserError as e:
            err = str(e)
    err = err or unknown_key_error(sys.argv[1:])
    if err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = map_overrides(plugin_overrides(sys.argv[1:], searchpath))
    try:
        run_dir_check(sys.argv[1:])
        named_dir_check(sys.argv[1:])  # every rank, before rank_overrides' first collective
        sys.argv[1:] = add_overrides(sys.argv[1:], rank_overrides(sys.argv[1:]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        from marl_llm.cli.submitit_logs import quiet_submitit

        quiet_submitit()  # a SLURM sweep's sacct failure: one line, once
    _hydra_main()


if __name__ == "__main__":
    main()
