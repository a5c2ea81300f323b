"""The `marl-llm-eval` console script: evaluate a run's trained agents on any task and split,
leaving the run as it was.

    marl-llm-eval <run_dir>                                  # the run's own evaluation, again
    marl-llm-eval <run_dir> task=coophumaneval trainer.eval_max_problems=null
    marl-llm-eval <run_dir> --split train                    # the task's training split
    marl-llm-eval <run_dir> --step 20                        # the agents of step 20 (trainer.history_every)
    marl-llm-eval <run_dir> 'task.data.eval_split="test[:8]"' trainer.eval_num_samples=10 'trainer.eval_k=[1,5]'

The config is the run's config.yaml with the overrides on top: `task=<option>` swaps the task
section for that option's defaults, dotted keys set values (checked against the schemas, as
`marl-llm` checks them). A task whose agents have other names gets the run's agents by position.
The weights come from the run's agents/ export or its checkpoint, whichever is newer (--weights
picks one), or with --step N from the agents of step N, kept in its history (checkpoints/
checkpoint-N/, trainer.history_every) or in agents/ when that export is of step N; all are only read. The results go to a new directory, <run_dir>/evals/<time>/ or
--out: metrics.json (with the overrides and where the weights came from), overrides.yaml,
config.yaml (what was evaluated) and samples.jsonl. checkpoint.pt, config.yaml and the run's logs
are never written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from marl_llm.runs.atomic import atomic_write_text
from marl_llm.config import UserError, print_stderr_line
from marl_llm.runs.rundir import CHECKPOINT, PREVIOUS

EVALS_DIR = "evals"
# Groups a run's agents are tied to: another option would build other policies than the ones trained.
FIXED_GROUPS = ("algo", "model", "experiment", "sweep", "debug")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="marl-llm-eval", description="Evaluate a run's trained agents (its agents/ export or checkpoint) on any "
        "task and split; the results go to a new <run_dir>/evals/<time>/, the run's files stay as they are.")
    parser.add_argument("run_dir", help="the directory of a marl-llm run (config.yaml, agents/ or checkpoint.pt)")
    parser.add_argument("overrides", nargs="*", help="task=<option> and dotted keys on top of the run's config, e.g. "
                        "'task.data.eval_split=\"test[:8]\"' trainer.eval_max_problems=null model.device=cpu")
    parser.add_argument("--weights", choices=("auto", "agents", "checkpoint"), default="auto",
                        help="agents/ (the export) or checkpoint.pt; auto: whichever was written last")
    parser.add_argument("--step", type=int, default=None,
                        help="the agents of this training step: <run_dir>/checkpoints/checkpoint-<step>/ (kept with "
                             "trainer.history_every) or agents/ when it is of that step")
    parser.add_argument("--split", choices=("eval", "train"), default="eval",
                        help="the task's split to evaluate on (train: task.data.train_split)")
    parser.add_argument("--out", help="write the results here (a new directory) instead of <run_dir>/evals/<time>/")
    return parser.parse_intermixed_args(argv)


# ------------------------------------------------------------------------------- the run's files
def weights_source(run_dir: Path, choice: str) -> str:
    """"agents" or "checkpoint": what to evaluate, for --weights `choice`; UserError when the run
    dir is no run or holds no trained agents."""
    from marl_llm.runs.export import AGENTS_DIR, MANIFEST

    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory; pass the directory a marl-llm run wrote "
                        "(outputs/<date>/<time>/, holding config.yaml and agents/ or checkpoint.pt)")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} has no config.yaml, so it is no marl-llm run directory; pass the one that holds "
                        "config.yaml and agents/ or checkpoint.pt")
    manifest = run_dir / AGENTS_DIR / MANIFEST
    checkpoints = [p for p in (run_dir / CHECKPOINT, run_dir / PREVIOUS) if p.is_file()]
    if choice == "agents" and not manifest.is_file():
        raise UserError(f"{run_dir} has no {AGENTS_DIR}/{MANIFEST} (exported at the end of training): evaluate its "
                        "checkpoint with --weights checkpoint")
    if choice == "checkpoint" and not checkpoints:
        raise UserError(f"{run_dir} has no {CHECKPOINT}: evaluate its exported agents with --weights agents")
    if choice != "auto":
        return choice
    if not manifest.is_file() and not checkpoints:
        raise UserError(f"{run_dir} holds no trained agents (neither {AGENTS_DIR}/ nor {CHECKPOINT}): the run stopped "
                        "before its first checkpoint; let it finish, or save along the way with trainer.save_every=<n>")
    if not checkpoints:
        return "agents"
    # A resumed run that saved a later checkpoint without exporting: the checkpoint is newer.
    newest = max(p.stat().st_mtime for p in checkpoints)
    return "agents" if manifest.is_file() and manifest.stat().st_mtime >= newest else "checkpoint"


def _load_yaml(path: Path) -> DictConfig:
    try:
        cfg = OmegaConf.load(path)
    except Exception as err:  # noqa: BLE001  (a broken or foreign file: say which)
        raise UserError(f"{path} cannot be read as the run's config ({type(err).__name__}: {err})") from None
    if not isinstance(cfg, DictConfig) or not all(k in cfg for k in ("algo", "task", "model", "trainer")):
        raise UserError(f"{path} is not a marl-llm run config (no algo/task/model/trainer sections)")
    return cfg


# ---------------------------------------------------------------------------------- the config
def eval_config(run_cfg: DictConfig, overrides: list[str], split: str, out_dir: Path) -> DictConfig:
    """The run's config with `overrides` on top (UserError for a bad one), evaluation only."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from marl_llm.cli import train as cli

    err = cli.lookalike_error(overrides)
    if err:
        raise UserError(err)
    task_choice, values = None, []
    for line in overrides:
        try:
            override = OverridesParser.create().parse_override(line)
        except Exception as parse_err:  # noqa: BLE001  (Hydra's grammar errors: one line)
            raise UserError(f"override {line!r} cannot be read: {' '.join(str(parse_err).split())[:200]}; "
                            "write key=value (task=<option>, trainer.eval_max_problems=8)") from None
        key = override.key_or_group
        if override.is_sweep_override() or override.is_delete() or key.startswith("hydra"):
            raise UserError(f"override {line!r}: marl-llm-eval takes one value per key (key=value), no sweeps, "
                            "deletions or hydra.* settings")
        if key == "task":
            task_choice = str(override.value())
        elif key in FIXED_GROUPS or key == "logger":
            fix = "" if key == "logger" else f" (its {key}.* keys can still change, e.g. model.device=cpu)"
            raise UserError(f"override {line!r}: marl-llm-eval evaluates the run's own agents with the run's {key} "
                            f"settings{fix}; it takes task=<option> and dotted keys")
        elif key == "run_dir":
            raise UserError(f"override {line!r}: the results go to a new directory, name it with --out <dir>")
        else:
            values.append((line, override))
    algo_name, task_name = str(run_cfg.algo.name), task_choice or str(run_cfg.task.name)
    # The run's plugins (its own tasks, algorithms, ...) load first, their YAML on the search path.
    plugins = [f"plugins=[{','.join(run_cfg.plugins)}]"] if run_cfg.get("plugins") else []
    err = cli.unknown_key_error([*plugins, f"algo={algo_name}", f"task={task_name}", *(line for line, _ in values)])
    if err:
        raise UserError(err)
    run_container = OmegaConf.to_container(run_cfg, resolve=True)
    if task_choice:
        run_container.pop("task")  # the chosen option's defaults, not the run's task settings
    cfg = OmegaConf.merge(_defaults(algo_name, task_name, task_choice is not None, out_dir, plugins), run_container)
    for line, override in values:
        try:
            OmegaConf.update(cfg, override.key_or_group.lstrip("+"), override.value(), merge=True, force_add=True)
        except Exception as update_err:  # noqa: BLE001  (OmegaConf's validation errors)
            raise UserError(f"override {line!r} does not fit the run's config ({str(update_err).splitlines()[0]}): "
                            "give a key the run's config.yaml has, with a value of its type") from None
    if split == "train":
        if cfg.task.get("data") is None:
            raise UserError(f"task {cfg.task.name} has no data splits (its instances are generated): drop --split train")
        if any(line.lstrip("+").startswith(("task.data.eval_split=", "task.data.packaged_eval_split="))
               for line, _ in values):
            raise UserError("--split train evaluates on task.data.train_split: drop the task.data.eval_split override "
                            "(or --split)")
        cfg.task.data.eval_split = cfg.task.data.train_split
        cfg.task.data.packaged_eval_split = cfg.task.data.packaged_train_split
    # Evaluation only: no training split loaded, no training-only checks (a float16 evaluation is fine).
    cfg.trainer.max_steps = 0
    cfg.trainer.resume = False
    cfg.run_dir = str(out_dir)
    return cfg


def _defaults(algo_name: str, task_name: str, task_chosen: bool, out_dir: Path, plugins: list[str]) -> DictConfig:
    """Today's defaults of the run's algorithm and the task (typed by the schemas), under the run's
    values: keys a run from an older version lacks get their defaults, and overrides are
    type-checked. Without such options (a run's algorithm or task registered in code): an empty
    config; a chosen task=<option> must be one."""
    from hydra.errors import HydraException

    from marl_llm.configure import NoSuchOption, compose_config
    from marl_llm.tasks import TASKS

    options = sorted(TASKS)  # the built-in tasks and the run's plugins' (loaded by unknown_key_error)
    if task_chosen and task_name not in options:
        raise UserError(f"task={task_name} is no task option: choose one of {', '.join(options)}")
    try:
        defaults = compose_config([*plugins, f"algo={algo_name}", f"task={task_name}", "model=local", "logger=none",
                                   f"run_dir={out_dir}"])
    except (HydraException, NoSuchOption):  # an algorithm or task registered in code: no YAML option
        return OmegaConf.create()
    OmegaConf.set_struct(defaults, False)  # keys the run's config has that today's schema lacks stay
    return defaults


def agent_map(cfg: DictConfig, run_cfg: DictConfig, run_agents: list[str] | None) -> tuple[Any, list[str]]:
    """(the task as the algorithm's agents see it, the run's agent each of its agents acts as).
    Another task's agents take the run's by position (their keys in algo.policy_map and
    algo.agent_sampling are renamed alike); UserError when the numbers differ."""
    from marl_llm.algos import algorithm_class
    from marl_llm.tasks import build_task

    algo_cls = algorithm_class(cfg.algo.name)
    task = algo_cls.task_view(build_task(cfg.task), cfg.algo)
    names = list(task.agent_names)
    if run_agents is None:
        run_agents = list(algo_cls.task_view(build_task(run_cfg.task), run_cfg.algo).agent_names)
    if names == run_agents:
        return task, names
    if len(names) != len(run_agents):
        raise UserError(f"task {cfg.task.name} has {len(names)} agents ({', '.join(names)}) but the run trained "
                        f"{len(run_agents)} ({', '.join(run_agents)}): evaluate on a task with {len(run_agents)} agents")
    for key in ("policy_map", "agent_sampling"):
        mapping = cfg.algo.get(key)
        if mapping:
            cfg.algo[key] = {new: mapping[old] for new, old in zip(names, run_agents) if old in mapping}
    return task, run_agents


# --------------------------------------------------------------------------------- the weights
def load_checkpoint_weights(policies: Any, ckpt: dict[str, Any], source_agent: list[str]) -> None:
    """The checkpoint's policies into `policies` (agent i acts as the run's `source_agent[i]`),
    nothing else restored and nothing written. UserError when they do not fit."""
    from marl_llm.runs.export import check_kind, load_state, policy_tensors

    check_kind(ckpt.get("weights", "lora"), policies, ckpt["path"])
    state = {}
    for k, adapter in policies.trainable_adapters():
        agent = policies.agents[policies.agents_of((k, adapter))[0]]
        # Per-agent adapters are named after their agent (models.AgentPolicies); shared and
        # policy_map ones after the policy, which a renamed team keeps.
        source = f"agent_{source_agent[policies.agent_names.index(agent.name)]}" \
            if adapter == f"agent_{agent.name}" else adapter
        tensors = ckpt["adapters"].get(f"{k}/{source}")
        if tensors is None:
            raise UserError(f"{ckpt['path']} has no policy {source} (it has {', '.join(sorted(ckpt['adapters']))}): "
                            "evaluate with the run's algo.adapters / policy_map and model.agent_bases")
        state[f"{k}/{adapter}"] = policy_tensors(policies, (k, adapter), tensors,
                                                 lambda name: name.replace(f".{adapter}.", f".{source}."), ckpt["path"])
    load_state(policies, state, ckpt["path"])


# ------------------------------------------------------------------------------------ evaluate
def evaluate_run(args: argparse.Namespace) -> Path:
    """Evaluate and write the results; returns their directory."""
    from marl_llm.runs.export import AGENTS_DIR, agents_of_step, read_manifest

    run_dir = Path(args.run_dir)
    source = weights_source(run_dir, args.weights) if args.step is None else _step_source(run_dir, args.weights)
    run_cfg = _load_yaml(run_dir / "config.yaml")
    agents_dir = run_dir / AGENTS_DIR if args.step is None else agents_of_step(run_dir, args.step)
    manifest = read_manifest(agents_dir) if source == "agents" else None
    out_dir = Path(args.out) if args.out else run_dir / EVALS_DIR / datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    cfg = eval_config(run_cfg, list(args.overrides), args.split, out_dir.absolute())
    task, source_agent = agent_map(cfg, run_cfg, [a["name"] for a in manifest["agents"]] if manifest else None)

    from marl_llm.configure import validate

    validate(cfg)
    try:
        out_dir.mkdir(parents=True)
    except FileExistsError:
        raise UserError(f"--out {out_dir} exists: name a new directory") from None
    except OSError as err:
        raise UserError(f"cannot create {out_dir} ({err.strerror}): pass --out <a directory you can write>") from None
    try:
        return _evaluate(cfg, args, run_dir, agents_dir, source, manifest, task, source_agent, out_dir)
    except BaseException:
        # A failed evaluation leaves no empty dir behind (nor an empty evals/ in the run dir).
        for made in (out_dir,) if args.out else (out_dir, out_dir.parent):
            try:
                made.rmdir()  # only an empty one
            except OSError:
                break
        raise


def _step_source(run_dir: Path, choice: str) -> str:
    """--step N evaluates exported agents (the checkpoint holds the last step only)."""
    if choice == "checkpoint":
        raise UserError("--step evaluates the agents exported at that step; the checkpoint holds only the last one: "
                        "drop --weights checkpoint (or --step)")
    if not (run_dir / "config.yaml").is_file():
        weights_source(run_dir, "auto")  # its one line: no run dir, or no config.yaml
    return "agents"


def _evaluate(cfg: DictConfig, args: argparse.Namespace, run_dir: Path, agents_dir: Path, source: str,
              manifest: dict | None, task: Any, source_agent: list[str], out_dir: Path) -> Path:
    import torch

    from marl_llm.runs.checkpoint import read_checkpoint
    from marl_llm.training.evaluation import evaluate
    from marl_llm.runs.export import load_agents
    from marl_llm.training.console import format_metrics
    from marl_llm.training.setup import build, quiet_libraries, seed_everything
    from marl_llm.training.threads import AutoThreads, choose_threads

    def say(msg: str) -> None:
        print(f"[marl-llm-eval] {msg}", flush=True)

    quiet_libraries()
    seed_everything(cfg.seed, cfg.trainer.deterministic)
    t0 = time.perf_counter()
    # trainer.threads as a run uses it (the run's setting, or this command's override): auto follows
    # the machine's load during the evaluation too, and says when it changes.
    threads = choose_threads(cfg.trainer.threads, cfg.trainer.deterministic)
    torch.set_num_threads(threads.count)  # before any model loads
    say(f"torch threads: {threads.count}" + (f" ({threads.why})" if threads.why else ""))
    auto_threads = AutoThreads(threads, say)
    run = build(cfg, task=task)
    try:
        if source == "agents":
            load_agents(run.policies, agents_dir, manifest, source_agent)
            weights = {"source": "agents", "path": str(agents_dir.absolute()), "step": manifest["step"]}
        else:
            ckpt = read_checkpoint(run_dir)
            if ckpt is None:  # removed since weights_source looked
                raise UserError(f"{run_dir / CHECKPOINT} is gone: evaluate the exported agents with --weights agents")
            load_checkpoint_weights(run.policies, ckpt, source_agent)
            weights = {"source": "checkpoint", "path": str(Path(ckpt["path"]).absolute()), "step": ckpt["step"]}
            del ckpt
        data = OmegaConf.to_container(cfg.task.data, resolve=True) if cfg.task.get("data") is not None else None
        count = len(run.eval_set)
        renamed = [f"{a} as {s}" for a, s in zip(task.agent_names, source_agent) if a != s]
        say(f"{cfg.algo.name} agents of {run_dir} (step {weights['step']}, from {Path(weights['path']).name}) on "
            f"{cfg.task.name}{f', split ' + data['eval_split'] if data else ''}: {count} problem{'s' * (count != 1)}"
            + (f"; {', '.join(renamed)}" if renamed else ""))
        auto_threads.attach()
        metrics, rows = evaluate(run.algo, run.eval_set, cfg.trainer)
    finally:
        auto_threads.detach()
        if hasattr(run.rollout, "close"):  # vLLM: its exported adapters are removed
            run.rollout.close()
    overrides = list(args.overrides)
    result = {"metrics": metrics, "run_dir": str(run_dir.absolute()), "weights": weights, "task": str(cfg.task.name),
              "data": data, "eval_problems": len(run.eval_set),
              "agents": dict(zip(task.agent_names, source_agent)), "overrides": overrides,
              "options": {"weights": args.weights, "split": args.split, "step": args.step},
              "threads": {"setting": cfg.trainer.threads, "start": threads.count, "end": auto_threads.count},
              "time": datetime.now().astimezone().isoformat(timespec="seconds"),
              "wall_s": time.perf_counter() - t0}
    atomic_write_text(out_dir / "samples.jsonl", "".join(json.dumps(r, default=str) + "\n" for r in rows))
    atomic_write_text(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    atomic_write_text(out_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))
    atomic_write_text(out_dir / "metrics.json", json.dumps(result, indent=2, default=str) + "\n")
    say(format_metrics(metrics, ("pass@1", "pass@1_ceiling", "success_rate", "reward", "completions/mean_length")))
    say(f"metrics: {out_dir / 'metrics.json'}")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        evaluate_run(args)
    except UserError as err:
        print_stderr_line(f"error: {err}")
        sys.exit(2)


if __name__ == "__main__":
    main()
