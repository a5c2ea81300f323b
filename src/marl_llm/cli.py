"""The `marl-llm` console script: Hydra composes conf/, the trainer runs one job per config.

    marl-llm algo=magrpo task=humaneval            # one run
    marl-llm --cfg job                             # print the composed config
    marl-llm -m seed=0,1 algo.baseline=mean,rloo   # a sweep (local, or SLURM via hydra/launcher)
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import sys
import typing
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from marl_llm.config import (ALGO_SCHEMAS, TASK_SCHEMAS, LoggerConfig, ModelConfig, TrainerConfig, UserError,
                             register_configs, validate)


def config_dir() -> str:
    """conf/ as shipped in the package (wheel or editable install), else the source checkout's."""
    spec = importlib.util.find_spec("marl_llm.conf")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(list(spec.submodule_search_locations)[0]).resolve())
    return str(Path(__file__).resolve().parents[2] / "conf")


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


def unknown_key_error(args: list[str]) -> str | None:
    """Hydra rejects a misspelled key without naming the valid ones; say them (and the likely
    intended key) before Hydra runs. Keys of groups chosen by an experiment preset are left to
    Hydra, whose own error still stops the run."""
    chosen = {"algo": "magrpo", "task": "humaneval"}
    for a in args:
        group, _, option = a.partition("=")
        if group in chosen:
            chosen[group] = option
    fixed = {"model": ModelConfig, "logger": LoggerConfig, "trainer": TrainerConfig}
    preset = any(a.startswith("experiment=") for a in args)
    for a in args:
        if a.startswith(("-", "+", "~", "hydra.")) or "=" not in a:
            continue
        parts = a.split("=", 1)[0].split(".")
        head = parts[0]
        if head in fixed:
            schema = fixed[head]
        elif head in chosen and not preset:
            schema = {"algo": ALGO_SCHEMAS, "task": TASK_SCHEMAS}[head].get(chosen[head])
        else:
            continue
        path = head
        for part in parts[1:]:
            if schema is None or not dataclasses.is_dataclass(schema):
                break
            names = [f.name for f in dataclasses.fields(schema)]
            if part not in names:
                close = difflib.get_close_matches(part, names, n=1)
                hint = f" Did you mean {path}.{close[0]}?" if close else ""
                return (f"unknown config key {path}.{part} ({schema.__name__}).{hint} "
                        f"Valid keys of {path}: {', '.join(names)}")
            schema = typing.get_type_hints(schema).get(part)
            path = f"{path}.{part}"
    return None


def main() -> None:
    err = unknown_key_error(sys.argv[1:])
    if err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
