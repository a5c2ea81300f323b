"""The `marl-llm` console script: Hydra composes conf/, the trainer runs one job per config.

    marl-llm algo=magrpo task=humaneval            # one run
    marl-llm --cfg job                             # print the composed config
    marl-llm -m seed=0,1 algo.baseline=mean,rloo   # a sweep (local, or SLURM via hydra/launcher)
"""

from __future__ import annotations

import os
import signal
import sys
import unicodedata
from datetime import datetime
from pathlib import Path

import hydra
from omegaconf import DictConfig

from marl_llm.config import TrainerConfig, UserError, print_stderr_line
from marl_llm.config_keys import walk_key
from marl_llm.configure import (add_overrides, config_dir, default_dir_pattern, default_run_dir, group_choice_error,
                               map_overrides, option_schemas, plugin_overrides, plugins_from_overrides,
                               register_configs, validate)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _hydra_main(cfg: DictConfig) -> float:
    from marl_llm.cli.new_run_dir import OVERRIDE, take_back
    from marl_llm.preflight import preflight
    from marl_llm.runs.rundir import NOT_STARTED, Interrupted

    # Hydra has read the command line: the callback it was given for take_back is no part of the
    # user's command, which the run's summary quotes (runs/summary.py).
    sys.argv[1:] = [a for a in sys.argv[1:] if a != OVERRIDE]
    try:
        validate(cfg)  # before any model loads: bad values fail in seconds
        preflight(cfg)  # the task's environment and the models' sources, before torch is imported
        from marl_llm.training.trainer import train

        return train(cfg)
    except UserError as err:
        take_back()  # the run dir this command made, if the run never started in it
        print_stderr_line(f"error: {err}")
        sys.exit(2)
    except Interrupted as stop:  # Ctrl-C: one line (where it stopped, how to go on), the shell's 128 + SIGINT
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run is over: another Ctrl-C must not cut this line
        take_back()
        if stop.main:
            print_stderr_line(str(stop))
        sys.exit(130)
    except KeyboardInterrupt:  # before the run claimed its dir: nothing there to continue
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        take_back()
        print_stderr_line(NOT_STARTED)
        sys.exit(130)


def unknown_key_error(args: list[str]) -> str | None:
    """Hydra rejects a misspelled key without naming the valid ones; say them (and the likely
    intended key) before Hydra runs. Keys of groups chosen by an experiment preset are left to
    Hydra, whose own error still stops the run. `+key=value` (Hydra's "add a key") is refused
    for a key no part of marl-llm reads: Hydra would add it silently."""
    schemas, preset = option_schemas(args)
    for a in args:
        if a.startswith(("-", "~", "hydra.", "+hydra.", "++hydra.")) or "=" not in a:
            continue
        key = a.split("=", 1)[0].lstrip("+")
        kind, _, err = walk_key(key, schemas, preset)
        if kind == "unknown":
            return err
        if a.startswith("+") and kind == "skip" and key.split(".")[0] not in schemas and "." not in key \
                and not (Path(config_dir()) / key).is_dir() and key != "plugins":
            return (f"{a!r} adds a key no part of marl-llm reads ({key}): drop it, or set an existing key without the "
                    f"'+' (top-level keys: {', '.join(TOP_LEVEL_KEYS)}; groups: marl-llm --help)")
        if a.startswith("+") and kind == "skip" and key.split(".")[0] not in schemas and "." in key:
            return (f"{a!r} adds a key under {key.split('.')[0]}, which is no section of the config: drop it "
                    f"(top-level keys: {', '.join(TOP_LEVEL_KEYS)})")
    return None


TOP_LEVEL_KEYS = ("algo", "task", "model", "logger", "trainer", "cluster", "seed", "run_dir", "plugins")


def repeated_key_error(args: list[str]) -> str | None:
    """A config group chosen twice, `algo=magrpo algo=at_grpo`: Hydra silently keeps the last, and
    the run trains another algorithm, task or model than one of the two says. Name both; a sweep
    over options is one argument, `-m algo=magrpo,at_grpo`. (A plain key given twice is Hydra's
    usual "the later value overrides", which scripts rely on.)"""
    seen: dict[str, str] = {}
    groups = Path(config_dir())
    for a in args:
        if a.startswith("-") or "=" not in a:
            continue
        key = a.split("=", 1)[0].lstrip("+~")
        if not (groups / key).is_dir():
            continue
        if key in seen and seen[key] != a:
            sweep = "" if key.startswith("hydra") else \
                f" (to run both, sweep them: marl-llm -m {key}={seen[key].split('=', 1)[1]},{a.split('=', 1)[1]})"
            return f"{key} is given twice ({seen[key]}, then {a}): Hydra would silently use the last; keep one{sweep}"
        seen[key] = a
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

    busy = rundir.in_use(Path(named))  # a live run writes there: a second writer would mix into its logs
    if busy:
        raise UserError(busy)
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
        if a.startswith("-") or (where is None and (a.isascii() or "=" not in a)):
            continue
        if "=" in a and _hydra_reads(a):
            continue  # the character is inside a quoted value, or Hydra reads it where it is
        if where is None:  # another non-ASCII character (runé, 実験): Hydra reads them inside quotes only
            key, _, value = a.partition("=")
            quoted = f"{key}='{value}'"
            if not _hydra_reads(quoted):
                continue  # quoting would not help: Hydra's own error says what is wrong
            at = next(i for i, c in enumerate(a) if ord(c) > 127)
            return (f"argument {a!r} has {a[at]!r} ({unicodedata.name(a[at], 'U+%04X' % ord(a[at]))}) at position "
                    f"{at + 1}, which Hydra reads only inside quotes: quote the value for Hydra, \"{quoted}\"")
        ch, ascii_ch = a[where], LOOKALIKES[a[where]]
        fixed = "".join(LOOKALIKES.get(c, c) for c in a)
        if where == 0 and ascii_ch == "-":  # autocorrect makes one dash of a flag's two: --cfg -> \u2014cfg
            ascii_ch, fixed = "--", "-" + fixed
        return (f"argument {a!r} has {ch!r} ({unicodedata.name(ch, 'U+%04X' % ord(ch))}) at position {where + 1}, "
                f"which Hydra cannot read: type the ASCII {ascii_ch!r} instead ({fixed})")
    return None


def grammar_error(args: list[str]) -> str | None:
    """An override Hydra's grammar cannot read (`task.data.train_split=train[:5000]`: brackets and
    colons), as one line with Hydra's reason and, where quoting the value makes it readable, the
    argument quoted for Hydra inside the shell's quotes; Hydra's own error is three lines and names
    neither the argument nor the quoting."""
    from marl_llm.configure import _is_override

    for i, a in enumerate(args):
        if not _is_override(args, i) or _hydra_reads(a):
            continue
        reason = _hydra_reason(a)
        key, eq, value = a.partition("=")
        if eq:
            inner = '"' if '"' not in value else "'"
            quoted = f"{key}={inner}{value}{inner}"
            if "'" not in quoted and _hydra_reads(quoted):
                return (f"Hydra cannot read {a!r} ({reason}): brackets, colons, spaces and the like need Hydra's "
                        f"quotes around the value, inside the shell's: '{quoted}'")
        return (f"Hydra cannot read {a!r} ({reason}): write key=value, quoting a value with brackets, colons or "
                "spaces for Hydra inside the shell's quotes ('key=\"value\"'); the override grammar: "
                "https://hydra.cc/docs/advanced/override_grammar/basic/")
    return None


def _hydra_reason(override: str) -> str:
    """Why Hydra's grammar cannot read `override` (its parser's first line), "" when it can."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_override(override)
    except Exception as err:  # noqa: BLE001  (any parse error)
        return (str(err).strip().splitlines() or [type(err).__name__])[0]
    return ""


# Hydra's commands: it runs one per call and raises a ValueError (a traceback) for two.
COMMAND_FLAGS = {"-r": "--run", "--run": "--run", "-m": "--multirun", "--multirun": "--multirun", "-c": "--cfg",
                 "--cfg": "--cfg", "-i": "--info", "--info": "--info", "-sc": "--shell-completion",
                 "--shell-completion": "--shell-completion"}


def exclusive_flags_error(args: list[str]) -> str | None:
    """`marl-llm -m ... --cfg hydra`: Hydra takes one of --run, --multirun, --cfg, --info and
    --shell-completion, and answers two with a traceback. Say which, and what prints a sweep's config."""
    given = []
    for a in args:
        flag = COMMAND_FLAGS.get(a.split("=", 1)[0]) if a.startswith("-") else None
        if flag and flag not in given:
            given.append(flag)
    if len(given) < 2:
        return None
    fix = (" (a sweep's jobs share one config but for the swept keys: to see one job's, drop -m and give one value "
           "per key, e.g. marl-llm --cfg job seed=0)") if "--multirun" in given and "--cfg" in given else ""
    return f"{' and '.join(given)} cannot be combined: Hydra runs one of them per command; keep one{fix}"


def _hydra_reads(override: str) -> bool:
    return not _hydra_reason(override)


def _uncreatable(path: Path) -> str | None:
    """Why Hydra could not make `path` and write into it (its nearest existing ancestor is a file,
    not writable or a kernel file system such as /proc; a name too long for the file system), or
    None."""
    path = path.absolute()  # Hydra makes it relative to the working directory (hydra.job.chdir=false)
    for p in (path, *path.parents):
        if os.path.lexists(p) and not os.path.exists(p):
            return f"{p} is a broken symbolic link"
        if os.path.exists(p):
            if not os.path.isdir(p):
                return f"{p} is a file, not a directory"
            if not os.access(p, os.W_OK | os.X_OK):
                return f"{p} is not writable"
            return None if p == path else _probe(p)
    return None


def _too_long(path: Path) -> str | None:
    """A name in `path` longer than its file system allows, or a path too long (measured on the
    nearest existing dir's file system)."""
    existing = next((p for p in path.parents if os.path.isdir(p)), Path("/"))  # isdir: False for too long
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            return (f"its name {part[:24]}... is {len(os.fsencode(part))} bytes, more than the {name_max} this file "
                    "system allows")
    if len(os.fsencode(str(path))) >= path_max:
        return f"the path is {len(os.fsencode(str(path)))} bytes, more than the {path_max} this file system allows"
    return None


def _probe(existing: Path) -> str | None:
    """Make and remove a dir in `existing`: what the permission bits do not show (a read-only
    mount, /proc or /sys, which accept no new dirs, not even from root)."""
    probe = existing / f".marl-llm-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except FileExistsError:
        return None
    except OSError as err:
        kind = next((fs for mount, fs in _mounts() if existing == mount or mount in existing.parents), None)
        on = f", on a {kind} file system" if kind else ""
        return f"{existing} accepts no new directories ({err.strerror}{on})"
    probe.rmdir()
    return None


def _mounts() -> list[tuple[Path, str]]:
    """(mount point, file system type), the longest mount point first."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    found = [(Path(f[1]), f[2]) for f in (line.split() for line in lines) if len(f) > 2]
    return sorted(found, key=lambda m: len(str(m[0])), reverse=True)


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
    if named is not None and not value.strip():  # Hydra would write the run into the working directory
        raise UserError(f"{key}= is empty: name a directory ({key}=<dir>), or leave {key} out for Hydra's default "
                        f"({default_dir_pattern(key.split('.')[1])})")
    fixed = value.split("${", 1)[0]  # the part before any ${now:...} is made as written
    if "${" in value:
        fixed = fixed.rpartition("/")[0]
    too_long = _too_long(Path(fixed or ".").absolute())
    if too_long:
        raise UserError(f"{key}={named if named is not None else value} cannot be created: {too_long}; use a shorter "
                        f"name, {key}=<dir>")
    reason = _uncreatable(Path(fixed or "."))
    if reason is None:
        return
    if named is not None:
        raise UserError(f"{key}={named} cannot be created ({reason}): name a directory you can write, "
                        f"{key}=<dir>")
    raise UserError(f"Hydra's default run dir {value} under {Path.cwd()} cannot be created ({reason}): set "
                    f"{key}=<dir you can write>, or run marl-llm from a directory you can write")


PRINT_ONLY = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc")


def take_back_overrides(args: list[str]) -> list[str]:
    """The Hydra callback that notes which dirs of a single run's dir are new (cli/new_run_dir.py),
    so that a command refused before its run started removes what it made. Not for a sweep, nor
    under a launcher (their dirs are shared), nor for what only prints."""
    if any(a in ("-m", "--multirun") or a.split("=", 1)[0] in PRINT_ONLY for a in args):
        return []
    from marl_llm.cli.new_run_dir import OVERRIDE
    from marl_llm.distributed.world import launched_world_size

    return [] if launched_world_size() > 1 else [OVERRIDE]


def main() -> None:
    import logging

    logging.raiseExceptions = False  # a log file on a full disk: the run's own one-line error, not one traceback per line
    try:
        _main()
    except KeyboardInterrupt:  # while starting (imports, composing the config): nothing was run
        from marl_llm.runs.rundir import NOT_STARTED

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print_stderr_line(NOT_STARTED)
        sys.exit(130)


def expose_sweep_launchers() -> None:
    """Hydra finds launcher classes by walking the directories of the `hydra_plugins` namespace
    package. An editable install (`pip install -e`: setuptools' import finder) maps
    hydra_plugins.marl_llm_launcher without a directory there, so the walk missed the presets'
    launchers ("Unknown plugin class"); its directory is added before Hydra's first scan."""
    try:
        import hydra_plugins
        from hydra_plugins import marl_llm_launcher
    except ImportError:  # no `slurm` extra: no launcher of ours to find
        return
    folder = str(Path(marl_llm_launcher.__file__).resolve().parent.parent)
    if folder not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(folder)


def _main() -> None:
    args = sys.argv[1:]
    expose_sweep_launchers()
    err, searchpath = lookalike_error(args) or grammar_error(args) or exclusive_flags_error(args), []
    if err is None:
        try:  # the algorithms, tasks and plugins register their schemas before the overrides are read
            searchpath = register_configs(plugins_from_overrides(sys.argv[1:]))
        except UserError as e:
            err = str(e)
    err = err or repeated_key_error(sys.argv[1:])
    if err is None:
        sys.argv[1:] = plugin_overrides(sys.argv[1:], searchpath)
        err = group_choice_error(sys.argv[1:]) or unknown_key_error(sys.argv[1:])
    if err:
        print_stderr_line(f"error: {err}")
        sys.exit(2)
    sys.argv[1:] = map_overrides(sys.argv[1:])
    try:
        run_dir_check(sys.argv[1:])
        named_dir_check(sys.argv[1:])  # every rank, before rank_overrides' first collective
        sys.argv[1:] = add_overrides(sys.argv[1:], rank_overrides(sys.argv[1:]))
    except UserError as e:
        print_stderr_line(f"error: {e}")
        sys.exit(2)
    sys.argv[1:] = add_overrides(sys.argv[1:], take_back_overrides(sys.argv[1:]))
    if any(a in ("-m", "--multirun") for a in sys.argv[1:]):
        from marl_llm.cli.submitit_logs import quiet_submitit

        quiet_submitit()  # a SLURM sweep's sacct failure: one line, once
    from marl_llm.cli.help import asks_for_help, print_help

    if asks_for_help(sys.argv[1:]) and print_help(sys.argv[1:]):  # Hydra's help text, without its ~4 s
        return
    _hydra_main()


if __name__ == "__main__":
    main()
