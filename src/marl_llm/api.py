"""The Python API: the console script's runs, from Python.

    import marl_llm

    # The common case: a team trained on your rows with your joint reward (task=team).
    result = marl_llm.train_team(
        rows,                                         # dicts, a .jsonl/.json/.parquet path, or a datasets.Dataset
        agents=["writer", "editor"],
        prompts=lambda row: [f"Draft: {row['topic']}", f"Edit a draft on {row['topic']}"],
        reward=lambda row, texts: float(row["topic"] in texts[0]),   # or a dict of reward levels
        overrides=["algo=magrpo", "trainer.max_steps=20"],
    )
    result.run_dir, result.score

    # A multi-turn environment of your own (task=env): a class with reset(seed) and step(actions).
    marl_llm.train_team(env=Guess, env_kwargs={"high": 50}, overrides=["algo=at_grpo", "algo.num_turns=4"])

    # Everything else: any config, composed like the console script's.
    cfg = marl_llm.compose_config(["algo=at_grpo", "task=sokoban"])
    marl_llm.train(cfg)          # or marl_llm.train(["algo=at_grpo", "task=sokoban"])

Same config system, checks, loggers and run dir contents as `marl-llm` (the console is logged to
`<run_dir>/cli.log` as well). A run dir defaults to `outputs/<date>/<time>/` under the working
directory, as Hydra names it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from marl_llm.config import UserError
from marl_llm.configure import JOB_LOG_FORMAT, compose_config, default_run_dir, validate


@dataclass
class TrainResult:
    """What a run left: its dir (config.yaml, metrics.jsonl, checkpoint.pt, agents/, cli.log) and
    the number the console script returns (the final evaluation's pass@1 or success rate, else reward)."""

    run_dir: Path
    score: float

    @property
    def agents_dir(self) -> Path:
        return self.run_dir / "agents"

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl (one per training step and evaluation)."""
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def new_run_dir() -> Path:
    """outputs/<date>/<time to the microsecond>, as hydra.run.dir names a console-script run."""
    return Path(default_run_dir(datetime.now()))


def _has_run_dir(cfg: DictConfig) -> bool:
    return OmegaConf.select(cfg, "run_dir", throw_on_missing=False, throw_on_resolution_failure=False) not in (None, "???")


def train(cfg: DictConfig | Sequence[str] | None = None) -> TrainResult:
    """Train with `cfg`: a config from `compose_config`, or the overrides to compose one with (the
    console script's arguments: ["algo=magrpo", "task=tldr", "trainer.max_steps=5"])."""
    if cfg is None or not isinstance(cfg, DictConfig):
        cfg = compose_config(list(cfg or []))
    if not _has_run_dir(cfg):
        cfg.run_dir = str(new_run_dir())
    validate(cfg)
    from marl_llm.training.trainer import train as run  # noqa: PLC0415  (torch and the models: only to train)

    run_dir = Path(str(cfg.run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    job_log = logging.FileHandler(run_dir / "cli.log")  # what the console script's Hydra job log keeps
    job_log.setFormatter(logging.Formatter(JOB_LOG_FORMAT))
    log = logging.getLogger("marl_llm")
    log.addHandler(job_log)
    level = log.level
    log.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        score = run(cfg)
    finally:
        log.removeHandler(job_log)
        log.setLevel(level)
        job_log.close()
    return TrainResult(run_dir=run_dir, score=float(score))


# ------------------------------------------------------------------------------------ train_team
def _function_spec(fn: Callable[..., Any], role: str) -> str:
    """`module:qualname` when that import path reaches `fn` again (so a config read back rebuilds it),
    else a key of tasks.team.IN_PROCESS (lambdas, closures, functions of __main__)."""
    import importlib

    from marl_llm.tasks.team import IN_PROCESS

    if not callable(fn):
        raise UserError(f"{role} must be a {'class' if role == 'env' else 'function'}, not {type(fn).__name__}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            if obj is fn:
                return f"{module}:{qualname}"
        except (ImportError, AttributeError):
            pass
    key = f"{role}-{id(fn):x}"
    IN_PROCESS[key] = fn
    return "@" + key


def _rows(data: Any, role: str) -> list[dict[str, Any]] | str:
    """A path (str or Path) as it is; rows from a list of dicts or anything with `to_list()` (datasets)."""
    if isinstance(data, (str, Path)):
        path = Path(data).expanduser()
        if not path.is_file():
            raise UserError(f"{role}: {data} is not a file (give a .jsonl, .json or .parquet file, or a list of dicts)")
        return str(path.resolve())
    rows = data.to_list() if hasattr(data, "to_list") else list(data)
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"{role}: give a non-empty list of dicts (rows), a datasets.Dataset or a file path")
    return rows


def train_team(dataset: Any = None, *, prompts: Callable[[dict], Any] | None = None,
               reward: Callable[[dict, list[str]], Any] | None = None, env: Callable[..., Any] | None = None,
               env_kwargs: dict[str, Any] | None = None, agents: Sequence[str] | None = None,
               eval_dataset: Any = None, overrides: Sequence[str] = ()) -> TrainResult:
    """Train a team of `agents`, either on `dataset` with a joint reward (task=team, tasks/team.py)
    or in a multi-turn environment (task=env, tasks/env.py).

    prompts(row) -> one prompt per agent (a list in `agents` order, or a dict by agent name)
    reward(row, completions) -> float, or a dict of reward levels that sum to the total
    env: a class (or any factory) whose objects have reset(seed) and step(actions) (tasks/env.py),
        made with `env_kwargs`; evaluated on its eval seeds (task.num_eval_seeds) before and after
    agents: their names (default: agent1, agent2; with `env`, the class's `agents`)
    eval_dataset: rows evaluated before and after training (none: no evaluation)
    overrides: any other setting, as on the command line (algo=..., model=..., trainer.max_steps=...)

    Rows given in memory are written to <run_dir>/data/{train,test}.jsonl, which the run's config
    names, so the run dir records what it trained on.
    """
    user = list(overrides)
    if env is not None:
        if dataset is not None or prompts is not None or reward is not None or eval_dataset is not None:
            raise UserError("train_team: give either env (a multi-turn environment) or dataset, prompts and reward, "
                            "not both")
        over = ["task=env", f"task.env={_function_spec(env, 'env')}"]
        if agents is not None:
            over.append(f"task.agents=[{','.join(str(a) for a in agents)}]")
        cfg = compose_config([*over, *user])
        if env_kwargs:
            cfg.task.env_kwargs = dict(env_kwargs)
        if cfg.task.get("label") is None and str(cfg.task.env).startswith("@"):
            cfg.task.label = getattr(env, "__name__", None)  # its spec (@env-<id>) names no class
        return train(cfg)
    if dataset is None or prompts is None or reward is None:
        raise UserError("train_team: give dataset, prompts and reward (a task from rows), or env (a multi-turn "
                        "environment)")
    agents = [str(a) for a in (agents or ("agent1", "agent2"))]
    over = [f"task.agents=[{','.join(agents)}]", f"task.prompts={_function_spec(prompts, 'prompts')}",
            f"task.reward={_function_spec(reward, 'reward')}"]
    if not any(o.split("=", 1)[0] == "algo.num_turns" for o in user):
        over.append("algo.num_turns=1")  # team tasks are single-turn
    if eval_dataset is None and not any(o.startswith(("trainer.eval_before=", "trainer.eval_after=")) for o in user):
        over += ["trainer.eval_before=false", "trainer.eval_after=false"]
    cfg = compose_config(["task=team", *over, *user])
    if not _has_run_dir(cfg):
        cfg.run_dir = str(new_run_dir())
    run_dir = Path(str(cfg.run_dir))
    files = {}
    for split, data in (("train", dataset), ("test", eval_dataset)):
        if data is None:
            continue
        rows = _rows(data, "dataset" if split == "train" else "eval_dataset")
        if isinstance(rows, str):
            files[split] = rows
            continue
        path = run_dir / "data" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        except TypeError as err:
            raise UserError(f"{'dataset' if split == 'train' else 'eval_dataset'} rows must be JSON values "
                            f"(str, numbers, lists, dicts): {err}") from None
        files[split] = str(path.resolve())
    cfg.task.data.files = files
    cfg.task.data.source = "files"
    return train(cfg)
