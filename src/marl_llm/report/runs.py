"""Finding and loading finished runs: a run directory's config.yaml, metrics.jsonl and summary.json
read into a `Run`; unfinished and unreadable runs are skipped with a warning."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from marl_llm.config import task_label

RUN_REQUIREMENTS = "config.yaml (or .hydra/config.yaml), metrics.jsonl and, once finished, summary.json"


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


@dataclass
class Run:
    """One finished run: its identity from config.yaml and its curves from metrics.jsonl."""

    path: Path
    task: str
    method: str  # logger.group if set, else algo.name: the base of the run's group label
    algo: str
    model: str | None
    seed: int | None
    max_steps: int | None
    summary: dict[str, Any]
    train: dict[int, dict[str, float]] = field(default_factory=dict)
    eval: dict[int, dict[str, float]] = field(default_factory=dict)
    # Every leaf of config.yaml by dotted path ("algo.sampling.temperature"): what the groups are built from.
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def display_path(self) -> str:
        # Relative to the working directory when possible so the committed report is machine-independent.
        try:
            return self.path.resolve().relative_to(Path.cwd().resolve()).as_posix()
        except ValueError:
            return self.path.as_posix()

    @property
    def final_eval(self) -> dict[str, float]:
        return self.eval[max(self.eval)] if self.eval else {}

    @property
    def steps(self) -> int | None:
        s = self.summary.get("steps")
        return int(s) if isinstance(s, (int, float)) else self.max_steps

    @property
    def mixed_train_reward(self) -> bool:
        """An AT-GRPO run logged before train/reward meant the team reward under every algorithm: its
        train/reward is the mean of the agents' alpha x team + own scores (now train/reward_mixed)."""
        return self.algo == "at_grpo" and bool(self.train) and not any(
            "train/reward_mixed" in row for row in self.train.values())

    @property
    def eval_only(self) -> bool:
        return not self.train and set(self.eval) <= {0}


# ----------------------------------------------------------------------------------------------- reading


def _config_path(d: Path) -> Path | None:
    for p in (d / "config.yaml", d / ".hydra" / "config.yaml"):
        if p.is_file():
            return p
    return None


def _is_run_dir(d: Path) -> bool:
    return (d / "metrics.jsonl").is_file() and _config_path(d) is not None


def _iter_run_dirs(root: Path) -> Iterable[Path]:
    if _is_run_dir(root):
        yield root
        return
    for dirpath, dirnames, _ in os.walk(root):
        d = Path(dirpath)
        if d != root and _is_run_dir(d):
            yield d
            # A run's own subfolders (wandb/, checkpoints) never hold other runs; not walking them is much faster.
            dirnames[:] = []
            continue
        dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    # Unresolvable interpolations (e.g. in an unresolved .hydra/config.yaml) read as missing, not as errors.
    return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested dict by dotted path; lists are leaves, empty maps have none (a map that
    gained a key then differs from the empty one in that key only)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def _config_leaves(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an unresolved .hydra/config.yaml: compare the interpolations' text
        tree = OmegaConf.to_container(cfg, resolve=False)
    return _flatten(tree) if isinstance(tree, dict) else {}


def _read_metrics(path: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    train: dict[int, dict[str, float]] = {}
    evals: dict[int, dict[str, float]] = {}
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is named by its number
        for lineno, raw in enumerate(f, 1):
            line = _utf8(raw, path, f"line {lineno}")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError("not a JSON object")
                step = int(row["step"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} line {lineno}: {type(e).__name__}: {e}") from None
            for key, value in row.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                # A resumed run re-logs steps after its last checkpoint; the later row is the one that counts.
                if key.startswith("train/"):
                    train.setdefault(step, {})[key] = float(value)
                elif key.startswith("eval/"):
                    evals.setdefault(step, {})[key] = float(value)
    return train, evals


def _utf8(raw: bytes, path: Path, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at = f" {where}" if where else ""
        raise ValueError(f"{path}{at} is not UTF-8 text (byte {raw[e.start]:#04x} at byte {e.start + 1}): the run's "
                         "files are written as UTF-8, so this one was changed or damaged since; restore it or leave "
                         "this run out") from None


def _read_summary(path: Path) -> dict[str, Any]:
    """summary.json as a dict; ValueError naming the file (and where in it) when it is not one."""
    text = _utf8(path.read_bytes(), path, "")
    try:
        summary = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): the run writes it whole when it finishes, so it was "
                         "changed or damaged since; restore it, or remove it to have the run skipped as unfinished"
                         ) from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path} is not a JSON object")
    return summary


def load_run(d: Path) -> Run:
    """Read one run directory; raises FileNotFoundError if unfinished, ValueError/OSError if unreadable."""
    from omegaconf import OmegaConf

    summary_path = d / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError("unfinished (no summary.json)")
    cfg_path = _config_path(d)
    assert cfg_path is not None
    try:
        cfg = OmegaConf.load(cfg_path)
    except Exception as e:  # noqa: BLE001 - any YAML/OmegaConf failure means the same thing here: unreadable
        raise ValueError(f"{cfg_path}: {' '.join(str(e).split())}") from None
    summary = _read_summary(summary_path)
    task, algo = _select(cfg, "task.name"), _select(cfg, "algo.name")
    if not task or not algo:
        raise ValueError(f"{cfg_path.name} lacks task.name or algo.name")
    task = task_label(cfg)  # task=env runs: one table per environment class (or task.label), not one "env"
    group = _select(cfg, "logger.group")
    seed = _select(cfg, "seed")
    max_steps = _select(cfg, "trainer.max_steps")
    train, evals = _read_metrics(d / "metrics.jsonl")
    return Run(path=d, task=str(task), method=str(group) if group not in (None, "") else str(algo), algo=str(algo),
               model=None if _select(cfg, "model.name") is None else str(_select(cfg, "model.name")),
               seed=int(seed) if isinstance(seed, (int, float)) and not isinstance(seed, bool) else None,
               max_steps=int(max_steps) if isinstance(max_steps, int) else None,
               summary=summary, train=train, eval=evals, config=_config_leaves(cfg))


def find_runs(paths: Sequence[str | os.PathLike[str]], unreadable: list[Path] | None = None) -> list[Run]:
    """Every finished, readable run under `paths` (run dirs or roots searched recursively), sorted by path.

    Unfinished and unreadable runs are skipped with a warning on stderr that names the file; missing
    paths too. `unreadable`, when given, gets the dirs of the unreadable runs.
    """
    runs: list[Run] = []
    seen: set[Path] = set()
    for p in paths:
        root = Path(p)
        if not root.exists():
            warn(f"{root}: no such file or directory")
            continue
        for d in _iter_run_dirs(root):
            key = d.resolve()
            if key in seen:  # overlapping roots (e.g. `outputs outputs/x`) must not count a run twice
                continue
            seen.add(key)
            try:
                runs.append(load_run(d))
            except FileNotFoundError as e:
                warn(f"skipping {d}: {e}")
            except (OSError, ValueError, UnicodeDecodeError) as e:
                warn(f"skipping {d}: unreadable ({' '.join(str(e).split())})")
                if unreadable is not None:
                    unreadable.append(d)
    return sorted(runs, key=lambda r: r.path.as_posix())
