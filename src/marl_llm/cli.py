"""The `marl-llm` console script: Hydra composes conf/, the trainer runs one job per config.

    marl-llm algo=magrpo task=humaneval            # one run
    marl-llm --cfg job                             # print the composed config
    marl-llm -m seed=0,1 algo.baseline=mean,rloo   # a sweep (local, or SLURM via hydra/launcher)
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import sys
import typing
from datetime import datetime
from pathlib import Path
from typing import Any, Dict

import hydra
from omegaconf import DictConfig, OmegaConf

from marl_llm.config import (ALGO_SCHEMAS, TASK_SCHEMAS, ClusterConfig, LoggerConfig, ModelConfig, TrainerConfig,
                             UserError, register_configs, validate)


def config_dir() -> str:
    """conf/ as shipped in the package (wheel or editable install), else the source checkout's."""
    spec = importlib.util.find_spec("marl_llm.conf")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(list(spec.submodule_search_locations)[0]).resolve())
    return str(Path(__file__).resolve().parents[2] / "conf")


def compose_config(overrides: list[str]) -> DictConfig:
    """The real config from conf/ for these overrides, as the console script composes it (no
    validation: callers validate, or test invalid values)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir(), version_base="1.3"):
        return compose("config", overrides=overrides)


register_configs()
# Sweep subdirs: <overrides>/seed=<s>, so the seeds of one configuration sit side by side (and a
# seed-only sweep gets seed=<s>, not an absolute "/seed=<s>").
OmegaConf.register_new_resolver(
    "marl_llm_sweep_subdir", lambda overrides, seed: f"{overrides}/seed={seed}" if overrides else f"seed={seed}",
    replace=True)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _hydra_main(cfg: DictConfig) -> float:
    try:
        validate(cfg)  # before any heavy import: bad values fail in a second
        # Imported here so that `--help`, `--cfg job` and config errors stay fast (no torch import).
        from marl_llm.trainer import train

        return train(cfg)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _chosen_schemas(args: list[str]) -> tuple[dict[str, Any], bool]:
    """Top-level schema per config group for these overrides, and whether a preset is chosen."""
    chosen = {"algo": "magrpo", "task": "humaneval"}
    for a in args:
        group, _, option = a.partition("=")
        if group in chosen:
            chosen[group] = option
    schemas: dict[str, Any] = {"model": ModelConfig, "logger": LoggerConfig, "trainer": TrainerConfig,
                               "cluster": ClusterConfig}
    schemas["algo"] = ALGO_SCHEMAS.get(chosen["algo"])
    schemas["task"] = TASK_SCHEMAS.get(chosen["task"])
    return schemas, any(a.startswith(("experiment=", "sweep=")) for a in args)


def _walk(key: str, schemas: dict[str, Any], preset: bool) -> tuple[str, Any, str | None]:
    """Follow a dotted key through the schemas: ("ok" | "map" | "unknown" | "skip", ..., error)."""
    parts = key.split(".")
    head = parts[0]
    if head not in schemas or (preset and head in ("algo", "task")):
        return "skip", None, None
    schema, path = schemas[head], head
    for part in parts[1:]:
        if typing.get_origin(schema) is dict or schema in (dict, Dict):
            return "map", schema, None
        if schema is None or not dataclasses.is_dataclass(schema):
            return "skip", None, None
        names = [f.name for f in dataclasses.fields(schema)]
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" Did you mean {path}.{close[0]}?" if close else ""
            return "unknown", None, (f"unknown config key {path}.{part} ({schema.__name__}).{hint} "
                                     f"Valid keys of {path}: {', '.join(names)}")
        schema = typing.get_type_hints(schema).get(part)
        if typing.get_origin(schema) is typing.Union:  # Optional[Dict[...]]
            schema = next((t for t in typing.get_args(schema) if t is not type(None)), schema)
        path = f"{path}.{part}"
    return ("map" if typing.get_origin(schema) is dict else "ok"), schema, None


def unknown_key_error(args: list[str]) -> str | None:
    """Hydra rejects a misspelled key without naming the valid ones; say them (and the likely
    intended key) before Hydra runs. Keys of groups chosen by an experiment preset are left to
    Hydra, whose own error still stops the run."""
    schemas, preset = _chosen_schemas(args)
    for a in args:
        if a.startswith(("-", "+", "~", "hydra.")) or "=" not in a:
            continue
        kind, _, err = _walk(a.split("=", 1)[0], schemas, preset)
        if kind == "unknown":
            return err
    return None


def map_overrides(args: list[str]) -> list[str]:
    """`algo.policy_map={tool:a,plan:b}` or `task.data.files.train=x.jsonl`: keys of a map field
    (empty by default) are new to Hydra's struct config, which would refuse them; `++` sets them."""
    schemas, preset = _chosen_schemas(args)
    out = []
    for a in args:
        if not a.startswith(("-", "+", "~", "hydra.")) and "=" in a:
            if _walk(a.split("=", 1)[0], schemas, preset)[0] == "map":
                a = "++" + a
        out.append(a)
    return out


def named_dir_check(args: list[str]) -> None:
    """A run dir named on the command line (hydra.run.dir=) that holds another run is refused here,
    before Hydra writes its own files (.hydra/, the job log) into it; the trainer claims the dir
    (rundir.claim). A resume (trainer.resume=true, a requeued SLURM job) goes on in its dir."""
    named = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")), None)
    if named is None or any(a in ("-m", "--multirun") for a in args):
        return
    resume = any(a.split("=", 1)[1].lower() in ("true", "1", "yes") for a in args if a.startswith("trainer.resume="))
    from marl_llm import rundir

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
    from marl_llm import distributed

    if distributed.launched_world_size() <= 1:
        return []
    if any(a in ("-m", "--multirun") for a in args):
        raise UserError("a sweep (-m) runs its jobs through hydra/launcher, never inside torchrun/accelerate launch: "
                        "drop the launcher, or set hydra/launcher=slurm hydra.launcher.gpus_per_node=<n> for "
                        "data-parallel jobs")
    timeout = next((float(a.split("=", 1)[1]) for a in args if a.startswith("trainer.distributed_timeout_min=")),
                   TrainerConfig.distributed_timeout_min)
    import torch

    cpu = "model.device=cpu" in args or not torch.cuda.is_available()
    w = distributed.init(timeout, cpu=cpu)
    started = distributed.broadcast_object(datetime.now().timestamp())
    out = []
    if not any(a.startswith("hydra.run.dir=") for a in args):
        hydra_conf = OmegaConf.to_container(OmegaConf.load(Path(config_dir()) / "hydra" / "default.yaml"))
        pattern = hydra_conf["run"]["dir"]  # unresolved: outputs/${now:...}
        when = datetime.fromtimestamp(started)
        out.append("hydra.run.dir=" + re.sub(r"\$\{now:([^}]*)\}", lambda m: when.strftime(m.group(1)), pattern))
    if not w.is_main:
        out += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    return out


def main() -> None:
    err = unknown_key_error(sys.argv[1:])
    if err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = map_overrides(sys.argv[1:])
    try:
        named_dir_check(sys.argv[1:])  # every rank, before rank_overrides' first collective
        sys.argv[1:] += rank_overrides(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
