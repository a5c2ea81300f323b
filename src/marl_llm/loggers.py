"""Metrics sinks: always `metrics.jsonl` and `samples.jsonl` in the run dir; W&B on top if chosen.

Metric names follow TRL's GRPO names under `train/` and `eval/`, with agent and turn segments:
`train/reward`, `train/turn_1/reward`, `train/aux/kl`, `eval/pass@1`, ... (README lists them).
W&B is offline unless a key or mode is configured, and a W&B failure (no network, bad key,
service crash) only prints a warning: training goes on with the local files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from marl_llm.atomic import atomic_write_text


def sweep_dir() -> str | None:
    """The multirun's sweep directory when this job is one of a Hydra sweep, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    except Exception:  # noqa: BLE001  (no Hydra context: tests, the benchmark)
        return None


def run_identity(cfg: DictConfig, sweep: str | None = None) -> dict[str, Any]:
    """W&B group, name and tags of a run. The runs of one sweep share a group (named after its
    sweep directory); a single run's group is <algo>-<task>, shared by its seeds. The name and
    the tags say algorithm, task, model and seed; `logger.group` / `logger.tags` add to them."""
    algo, task, model, seed = cfg.algo.name, cfg.task.name, cfg.model.name, cfg.seed
    if cfg.logger.group:
        group = cfg.logger.group
    elif sweep:
        group = "sweep-" + "-".join(Path(sweep).parts[-2:])
    else:
        group = f"{algo}-{task}"
    tags = [f"algo:{algo}", f"task:{task}", f"model:{model}", f"seed:{seed}", *cfg.logger.tags]
    return {"group": group, "name": f"{algo}-{task}-{model}-seed{seed}", "tags": list(dict.fromkeys(tags))}


class RunLogger:
    def __init__(self, cfg: DictConfig, run_dir: Path, wandb_id: str | None = None):
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        self.wandb = None
        self.wandb_id = wandb_id
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
            identity = run_identity(cfg, sweep_dir())
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
                config=OmegaConf.to_container(cfg, resolve=True), dir=str(self.run_dir), id=wandb_id,
                resume="allow", settings=wandb.Settings(init_timeout=60), **kwargs)
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
        self._wandb_call(lambda: self.wandb.finish(exit_code=exit_code))
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
