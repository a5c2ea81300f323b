"""Metrics sinks: always `metrics.jsonl` and `samples.jsonl` in the run dir; W&B on top if chosen.

Metric names follow TRL's GRPO names under `train/` and `eval/`, with agent and turn segments:
`train/reward`, `train/turn_1/reward`, `train/aux/kl`, `eval/pass@1`, ... (docs/logging.md lists them).
`num_tokens` means what it means in TRL: the prompt and completion tokens trained on so far (a
running total kept here, restored from metrics.jsonl on a resume); a step's own counts are
`prompt_tokens` and `completion_tokens`.
W&B is offline unless a key or mode is configured, and a W&B failure (no network, bad key,
service crash) only prints a warning: training goes on with the local files.
Every run records the code it ran (package version, git commit and whether the checkout had
uncommitted changes) in `<run_dir>/version.json` and in the W&B config.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from marl_llm.config import task_label
from marl_llm.runs.atomic import atomic_write_text

# Settings that say where a run writes and how it is logged, not what it trains: runs that differ
# only in these (and the seed) are the same experiment, one W&B group.
NOT_IN_GROUP = ("seed", "run_dir", "logger", "cluster", "trainer.resume", "trainer.resume_allow_changes",
                "trainer.summary_file", "trainer.save_every", "trainer.distributed_timeout_min",
                "trainer.export_agents", "trainer.export_with_checkpoints", "trainer.threads", "trainer.progress",
                "trainer.progress_every_s")
WANDB_TAG_MAX = 64  # W&B refuses a longer tag (and with it the whole run)


def sweep_dir() -> str | None:
    """The multirun's sweep directory when this job is one of a Hydra sweep, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    except Exception:  # noqa: BLE001  (no Hydra context: tests, the benchmark)
        return None


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def swept_keys(sweep: str) -> set[str] | None:
    """The keys a sweep varies: a choice list or sweep function on its command line or in
    `hydra.sweeper.params` (the `sweep=` presets), as Hydra saved them in <sweep>/multirun.yaml.
    None when that file cannot be read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        saved = OmegaConf.load(Path(sweep) / "multirun.yaml")
        args = [str(a) for a in OmegaConf.select(saved, "hydra.overrides.task", default=None) or []]
        params = OmegaConf.select(saved, "hydra.sweeper.params", default=None) or {}
        args += [f"{k}={v}" for k, v in params.items()]
        return {o.key_or_group for o in OverridesParser.create().parse_overrides(args) if o.is_sweep_override()}
    except Exception:  # noqa: BLE001  (no file, or one Hydra cannot parse: name runs by all their overrides)
        return None


def swept_overrides(sweep: str | None) -> list[str]:
    """This sweep job's values of the swept keys, seed aside (`algo.baseline=rloo`), in command-line
    order: what tells the runs of a sweep apart. Without a readable multirun.yaml: every override
    of the job that names its sweep subdir. Empty outside a sweep."""
    if sweep is None:
        return []
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.override_parser.overrides_parser import OverridesParser

        hc = HydraConfig.get()
        job = OverridesParser.create().parse_overrides([str(a) for a in hc.overrides.task])
        excluded = set(hc.job.config.override_dirname.exclude_keys)
    except Exception:  # noqa: BLE001  (no Hydra context)
        return []
    keys = swept_keys(sweep)
    return [f"{o.key_or_group}={_unquote(o.get_value_element_as_str())}" for o in job
            if o.key_or_group != "seed" and o.key_or_group not in excluded and not o.key_or_group.startswith("hydra")
            and (keys is None or o.key_or_group in keys)]


def config_hash(cfg: DictConfig) -> str:
    """8 hex digits that are the same for two runs exactly when their resolved configs are, except
    for the seed and the NOT_IN_GROUP settings."""
    tree: dict[str, Any] = {}
    for key in cfg.keys():
        if key in NOT_IN_GROUP:
            continue  # unresolved: run_dir needs Hydra's runtime, which tests and tools lack
        value = cfg[key]
        tree[str(key)] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    for dotted in NOT_IN_GROUP:
        head, _, leaf = dotted.rpartition(".")
        if head and isinstance(tree.get(head), dict):
            tree[head].pop(leaf, None)
    text = json.dumps(tree, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def run_identity(cfg: DictConfig, sweep: str | None = None, swept: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """W&B group, name and tags of a run. The group is "the same config but the seed":
    `<algo>-<task>-<model>-<config_hash>`, so seeds of one setting share it and settings never
    mix. A run is named `<algo>-<task>-<model>-seed<s>`; in a sweep, by what tells it apart from
    the sweep's other runs, the `swept` overrides (`algo.baseline=rloo seed=0`). <task> is
    config.task_label (task=env: the environment's class, or task.label). Tags: algorithm,
    task, model, seed, the sweep and the swept overrides; `logger.group` / `logger.tags` win / add."""
    algo, task, model, seed = cfg.algo.name, task_label(cfg), cfg.model.name, cfg.seed
    group = cfg.logger.group or f"{algo}-{task}-{model}-{config_hash(cfg)}"
    name = " ".join([*swept, f"seed={seed}"]) if swept else f"{algo}-{task}-{model}-seed{seed}"
    tags = [f"algo:{algo}", f"task:{task}", f"model:{model}", f"seed:{seed}"]
    if sweep:
        tags.append("sweep:" + "/".join(Path(sweep).parts[-2:]))
    tags += [*swept, *cfg.logger.tags]
    return {"group": group, "name": name, "tags": list(dict.fromkeys(str(t)[:WANDB_TAG_MAX] for t in tags))}


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """The code a run runs: marl-llm's version and, when the package is imported from a git
    checkout, its commit and whether src/, conf/ or pyproject.toml had uncommitted changes (None
    for an installed copy, or without git); torch, transformers and peft versions. Read once
    per process: the modules it has imported are the code that runs."""
    from importlib import metadata

    from marl_llm.version import __version__

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    info: dict[str, Any] = {"marl_llm": version("marl-llm") or __version__, "git_commit": None,
                            "git_dirty": None}
    package = Path(__file__).resolve().parents[1]  # src/marl_llm

    def git(where: Path, *args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout if out.returncode == 0 else None

    found = (git(package, "rev-parse", "--show-toplevel", "HEAD") or "").splitlines()
    # The checkout must be this package's own: a copy installed into a venv inside another
    # repository is not that repository's code.
    if len(found) == 2 and Path(found[0]).resolve() / "src" / "marl_llm" == package:
        top = Path(found[0])
        info["git_commit"] = found[1].strip()
        status = git(top, "status", "--porcelain", "--", "src", "conf", "pyproject.toml")
        info["git_dirty"] = None if status is None else bool(status.strip())
    info.update(python=sys.version.split()[0], torch=version("torch"), transformers=version("transformers"),
                peft=version("peft"))
    return info


def record_version(run_dir: Path) -> dict[str, Any]:
    """Write <run_dir>/version.json: the code of the run's first start, and each later start
    (a resume, a requeue) under `later_starts`. Returns this start's record."""
    now = {**code_version(), "started": datetime.now().astimezone().isoformat(timespec="seconds")}
    path = run_dir / "version.json"
    try:
        record = json.loads(path.read_text())
        record.setdefault("later_starts", []).append(now)
    except (OSError, ValueError, AttributeError):
        record = dict(now)
    atomic_write_text(path, json.dumps(record, indent=2))
    return now


def sync_commands(run_dir: Path, sweep: str | None = None) -> list[str]:
    """The `wandb sync` commands that upload an offline run (and the whole sweep it belongs to):
    `wandb sync` takes a run's wandb/ directory, but finds nothing in a sweep's nested dirs."""
    commands = [f"wandb sync {shlex.quote(str(run_dir / 'wandb'))}"]
    if sweep:
        commands.append(f"find {shlex.quote(sweep)} -type d -name wandb -prune -exec wandb sync {{}} +")
    return commands


def tokens_seen_before(metrics_path: Path, step: int) -> dict[str, float]:
    """The `num_tokens` totals (per scope: "" for the team, "<policy>/") logged before `step`, from
    metrics.jsonl (a resume truncates it to its checkpoint). Rows written before `num_tokens` was
    a running total (no `completion_tokens`) held one step's completion tokens: they add up."""
    seen: dict[str, float] = {}
    try:
        lines = metrics_path.read_text().splitlines()
    except OSError:
        return seen
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] >= step:
            continue
        counts = {k[len("train/"):-len("num_tokens")]: v for k, v in row.items()
                  if k.startswith("train/") and k.endswith("num_tokens") and k[len("train/"):].count("/") <= 1}
        if not counts:
            continue
        if "train/completion_tokens" in row:
            seen = dict(counts)
        else:
            for scope, n in counts.items():
                seen[scope] = seen.get(scope, 0.0) + n
    return seen


def count_tokens(metrics: dict[str, float], seen: dict[str, float]) -> dict[str, float]:
    """A train step's metrics with TRL's `num_tokens`: the running total of prompt + completion
    tokens trained on, per policy (`<policy>/num_tokens`) and for the team, added to `seen`. The
    step's own counts become `completion_tokens` (what the algorithms report as `num_tokens`) and
    `prompt_tokens`."""
    out = dict(metrics)
    policies = [k[:-len("num_tokens")] for k in metrics if k.endswith("/num_tokens") and k.count("/") == 1]
    step_tokens: dict[str, float] = {}
    for p in policies:  # "aux/", "shared/", ...
        out[p + "completion_tokens"] = metrics[p + "num_tokens"]
        step_tokens[p] = metrics[p + "num_tokens"] + metrics.get(p + "prompt_tokens", 0.0)
    if "num_tokens" in metrics:
        out["completion_tokens"] = metrics["num_tokens"]
        if policies:  # the team's prompts are all its policies' (a team-level mean would undercount)
            out["prompt_tokens"] = sum(metrics.get(p + "prompt_tokens", 0.0) for p in policies)
        step_tokens[""] = out["completion_tokens"] + out.get("prompt_tokens", 0.0)
    for scope, n in step_tokens.items():
        seen[scope] = seen.get(scope, 0.0) + n
        out[scope + "num_tokens"] = seen[scope]
    return out


class RunLogger:
    def __init__(self, cfg: DictConfig, run_dir: Path, wandb_id: str | None = None):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self.wandb = None
        self.wandb_id = wandb_id
        self.sweep = sweep_dir()
        self._tokens_seen: dict[str, float] | None = None  # read from metrics.jsonl at the first train step
        self.version = record_version(run_dir)
        if cfg.logger.name == "wandb":
            self._init_wandb(cfg, wandb_id)

    # --------------------------------------------------------------------------------- wandb
    def _init_wandb(self, cfg: DictConfig, wandb_id: str | None) -> None:
        lc = cfg.logger
        try:
            import wandb

            kwargs: dict[str, Any] = {}
            # Init arguments override WANDB_MODE, so pass a mode only when one is configured;
            # with neither a mode nor an API key, stay offline (sync later with `wandb sync`).
            if lc.mode is not None:
                kwargs["mode"] = lc.mode
            elif not os.environ.get("WANDB_MODE") and not os.environ.get("WANDB_API_KEY"):
                kwargs["mode"] = "offline"
            identity = run_identity(cfg, self.sweep, swept_overrides(self.sweep))
            settings = wandb.setup().settings  # also `wandb login --host`'s server and W&B's defaults
            mode = kwargs.get("mode") or os.environ.get("WANDB_MODE") or settings.mode
            if mode in ("online", "run", "shared"):
                # An unreachable server makes wandb.init retry for about a minute (init_timeout, and
                # its resume check) at every start and resume; a probe of a few seconds fails alike.
                from marl_llm.tasks.data import endpoint_unreachable

                server = os.environ.get("WANDB_BASE_URL") or settings.base_url
                reason = endpoint_unreachable(server)
                if reason:
                    raise ConnectionError(f"W&B server {server}: {reason}; logger.mode=offline keeps a local W&B "
                                          "run to `wandb sync` later")
            self.wandb = wandb.init(
                project=lc.project, entity=lc.entity, job_type="train", **identity,
                config={**OmegaConf.to_container(cfg, resolve=True), "code": self.version},
                dir=str(self.run_dir), id=wandb_id, resume="allow", settings=wandb.Settings(init_timeout=60, quiet=True), **kwargs)
            self.wandb_id = self.wandb.id
            # Which W&B run this run dir is (find it in the UI, or `wandb sync` it when offline).
            atomic_write_text(self.run_dir / "wandb.json",
                              json.dumps({"id": self.wandb_id, "project": lc.project, **identity}, indent=2))
            self.wandb.define_metric("train/global_step")
            self.wandb.define_metric("train/*", step_metric="train/global_step")
            self.wandb.define_metric("eval/*", step_metric="train/global_step")
        except Exception as err:  # noqa: BLE001  (W&B must never stop training)
            why = " ".join(str(err).split())  # W&B's errors span lines: keep the warning on one
            print(f"[marl-llm] warning: W&B unavailable ({type(err).__name__}: {why}); "
                  f"logging to {self.metrics_path} only", file=sys.stderr)
            self.wandb = None

    def _wandb_call(self, fn: Callable[[], Any]) -> None:
        """Run a W&B call; on any failure warn once and continue without W&B."""
        if self.wandb is None:
            return
        try:
            fn()
        except Exception as err:  # noqa: BLE001
            print(f"[marl-llm] warning: W&B call failed ({err}); continuing without W&B", file=sys.stderr)
            self.wandb = None

    # ------------------------------------------------------------------------------- logging
    def log(self, split: str, metrics: dict[str, float], step: int) -> None:
        """Append `{split}/{name}` metrics at `step` to metrics.jsonl and W&B."""
        if split == "train":
            if self._tokens_seen is None:
                self._tokens_seen = tokens_seen_before(self.metrics_path, step)
            metrics = count_tokens(metrics, self._tokens_seen)
        row = {f"{split}/{k}": v for k, v in metrics.items()}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")
        self._wandb_call(lambda: self.wandb.log({"train/global_step": step, **row}))

    def log_samples(self, split: str, rows: list[dict[str, Any]], step: int) -> None:
        """Sample rows (prompt, each agent's completion, reward levels): every step kept in
        samples.jsonl (W&B shows only the latest table under one key)."""
        if not rows:
            return
        with open(self.samples_path, "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, "split": split, **r}) + "\n")
        if self.wandb is not None:
            def table():
                import wandb

                columns = ["step"] + list(rows[0])
                data = [[step] + [json.dumps(v) if isinstance(v, (dict, list)) else v for v in r.values()] for r in rows]
                self.wandb.log({"train/global_step": step, f"{split}/samples": wandb.Table(columns=columns, data=data)})

            self._wandb_call(table)

    def finish(self, exit_code: int = 0) -> None:
        offline = self.wandb is not None and bool(getattr(self.wandb, "offline", False))
        self._wandb_call(lambda: self.wandb.finish(exit_code=exit_code))
        if offline and self.wandb is not None:
            commands = sync_commands(self.run_dir, self.sweep)
            print(f"[marl-llm] W&B logged offline; upload with: {commands[0]}"
                  + (f"  (every run of the sweep: {commands[1]})" if len(commands) > 1 else ""), flush=True)
        self.wandb = None


class NullLogger:
    """What data-parallel ranks other than 0 log with: nothing (rank 0 writes the run dir)."""

    wandb_id = None

    def log(self, split: str, metrics: dict[str, float], step: int) -> None:
        pass

    def log_samples(self, split: str, rows: list[dict[str, Any]], step: int) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass
