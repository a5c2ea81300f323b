"""The training loop, top to bottom.

One file on purpose, at about 580 lines: a run's whole life (setup, the step, the loop with its
evaluations and checkpoints, Ctrl-C, the summary) reads in order, as nanoGPT's train.py does; what the
console shows is in console.py, what an algorithm does within a step in algos/.

    for each step:
        problems  = next batch of training problems
        tree      = algo.collect(problems)      # rollout (a tree when multi-turn) + joint rewards
        batches   = algo.advantages(tree)       # group advantages, per agent
        stats     = algo.update(batches)        # one update per agent (its own adapter/optimizer)
        log; periodic eval; periodic checkpoint
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import resource
import shlex
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from marl_llm.distributed import data_parallel as distributed

from marl_llm.distributed import fsdp

from marl_llm.training import perf

from marl_llm.runs import rundir
from marl_llm.algos import algorithm_class, build_algorithm
from marl_llm.algos.update import lr_schedulers
from marl_llm.runs.atomic import atomic_write_text
from marl_llm.runs.checkpoint import check_resume_config, read_checkpoint, restore_checkpoint, save_checkpoint
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.training.episodes import JointTree
from marl_llm.training.console import Watch, console_logging, format_metrics, step_line
from marl_llm.training.evaluation import evaluate
from marl_llm.runs.export import export_agents
from marl_llm.runs.loggers import NullLogger, RunLogger
from marl_llm.models.policies import AgentPolicies, check_trainable_dtype
from marl_llm.models.loading import check_device_for_ranks, resolve_device, resolve_dtype
from marl_llm.rollout.base import PROGRESS, Rollout, sample_key
from marl_llm.rollout.decode import HFRollout
from marl_llm.tasks import Problem, build_task
from marl_llm.tasks.turn_based import TurnTask

log = logging.getLogger("marl_llm")  # the console and the job log (training/console.py)


def quiet_libraries() -> None:
    """Progress bars and deprecation chatter from transformers/peft drown the training log."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)\.")
    # A buffered update (algo.rollout_buffer_size) may take no optimizer step in a trainer step,
    # whose LR schedule still advances: intended, so torch's order warning is noise.
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed every RNG; `deterministic` (trainer.deterministic) asks for bitwise-reproducible CUDA
    kernels. cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it creates its handle (the first matmul),
    so it is set here, before any model loads; without it deterministic mode warns on every
    cuBLAS call and is still not reproducible. Torch's debugging aid of filling uninitialized
    memory with NaN is switched off: it costs a write per allocation, and nothing here reads
    memory it has not written."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op with no deterministic CUDA kernel warns (naming itself) instead of
    # stopping a run that may be days long.
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False


def gradient_checkpointing(setting: Any, device: torch.device, num_params: int) -> bool:
    """trainer.gradient_checkpointing resolved: true/false as given; auto: on for a base of at
    least 4B parameters on CUDA (activations of long completions then outgrow a GPU's memory)."""
    if setting == "auto":
        return device.type == "cuda" and num_params >= 4e9
    return bool(setting)


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time a cgroup quota allows this process (docker --cpus, a Kubernetes limit),
    or None when there is none (cgroup v2 cpu.max, else v1 cpu.cfs_quota_us)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text().strip()
            period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or float(period) <= 0:
        return None
    return float(quota) / float(period)


def available_cores() -> int:
    """Physical cores this process may run on: its CPU affinity (SLURM's --cpus-per-task, taskset)
    with the hyper-threads of one core counted once, at most a cgroup quota's CPUs."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology / "physical_package_id").read_text().strip() + "/"
                      + (topology / "core_id").read_text().strip())
        except OSError:  # no sysfs topology: count the CPU
            cores.add(f"cpu{cpu}")
    quota = cgroup_cpu_quota()
    return max(1, min(len(cores), math.ceil(quota)) if quota else len(cores))


def torch_threads(setting: Any) -> int:
    """trainer.threads resolved: a number as given; auto: the fewer of torch's default
    (OMP_NUM_THREADS, else the machine's cores, whatever the process may use) and
    available_cores(). More threads than cores the process gets make every parallel region wait
    for threads that are not running."""
    if str(setting).lower() == "auto":
        return min(torch.get_num_threads(), available_cores())
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        return setting
    raise UserError(f"trainer.threads={setting} is not a choice: auto (the physical cores this process may use, at "
                    f"most torch's default) or a number of threads, e.g. trainer.threads=1")


def batch_for_step(problems: list[Problem], step: int, size: int, seed: int) -> list[Problem]:
    """The step's problems: epoch-wise shuffles derived from (seed, epoch), so the data order is
    a pure function of the step and a resumed run sees exactly the batches it would have seen.
    Each draw k carries its own sampling key (seed, k): what its rollouts sample does not depend
    on which rank or batch it lands in."""
    out = []
    for k in range(step * size, (step + 1) * size):
        epoch, pos = divmod(k, len(problems))
        order = torch.randperm(len(problems), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(dataclasses.replace(problems[int(order[pos])], sample_key=sample_key(seed, k)))
    return out


def ends_epoch(step: int, size: int, num_problems: int, max_steps: int) -> bool:
    """Does trainer step `step` (draws step*size .. (step+1)*size - 1, batch_for_step) finish a pass
    over the training set? The run's last step counts as one, so no held-back sample is left."""
    if step + 1 == max_steps:
        return True
    return num_problems > 0 and ((step + 1) * size) // num_problems > (step * size) // num_problems


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def sample_rows(tree: JointTree, agent_names: list[str], n: int) -> list[dict[str, Any]]:
    rows = []
    for node in list(tree.nodes())[:n]:
        row: dict[str, Any] = {"problem": tree.problems[node.problem].uid, "turn": node.turn + 1}
        for name, msg, text in zip(agent_names, node.messages, node.texts):
            row[f"{name}/prompt"] = msg
            row[f"{name}/completion"] = text
        row["reward"] = node.reward.total
        row["levels"] = node.reward.levels
        rows.append(row)
    return rows


@dataclass
class Setup:
    """Everything a run trains with, built from the config (the benchmark builds the same)."""

    task: Any
    policies: AgentPolicies
    rollout: Rollout
    algo: Any
    train_set: list[Problem]
    eval_set: list[Problem]
    max_steps: int
    sharding: str | None = None  # what FSDP left on each rank (trainer.fsdp), to print
    # algo.lr_scheduler, stepped once per trainer step (train() rebuilds them after a resume).
    schedulers: list = dataclasses.field(default_factory=list)
    # Synchronized step timers, model FLOPs and MFU, peak GPU memory (perf.py).
    meter: perf.Meter = dataclasses.field(default_factory=perf.Meter)


def build(cfg: DictConfig, task: Any = None) -> Setup:
    """The run's task, policies, rollout and algorithm; `task` replaces cfg.task's (benchmarks)."""
    tc = cfg.trainer
    algo_cls = algorithm_class(cfg.algo.name)
    task = task or algo_cls.task_view(build_task(cfg.task), cfg.algo)
    if isinstance(task, TurnTask) and not algo_cls.supports_turn_tasks:
        raise UserError(f"algo={cfg.algo.name} does not play turn-based tasks ({task.name}) yet: use algo=at_grpo "
                        "(trainer.max_steps=0 evaluates the untrained team)")
    if isinstance(task, TurnTask) and cfg.algo.get("joint_mode", "align") != "align":
        raise UserError(f"algo.joint_mode={cfg.algo.joint_mode} needs a joint-reward task; turn-based tasks ({task.name}) "
                        "fork episodes: set algo.joint_mode=align")
    turns = cfg.algo.get("num_turns", 1)
    if task.max_turns is not None and algo_cls.trainable and turns > task.max_turns:
        hint = "is single-turn" if task.max_turns == 1 else f"has at most {task.max_turns} turns"
        fix = "=1" if task.max_turns == 1 else f"<={task.max_turns}"
        raise UserError(f"task {task.name} {hint} but algo.num_turns={turns}: set algo.num_turns{fix}")
    # Prompt-only baselines are evaluated, never trained.
    max_steps = tc.max_steps if algo_cls.trainable else 0
    train_set = task.load_split("train") if max_steps > 0 else []
    # A run that trains with every evaluation off needs no eval data (a task=team without a test file);
    # one that does not train (a prompt-only baseline, marl-llm-eval) is there to evaluate.
    evaluates = tc.eval_before or tc.eval_after or tc.eval_every > 0 or max_steps == 0
    eval_set = task.load_split("eval")[: tc.eval_max_problems or None] if evaluates else []
    fsdp.check_supported(cfg)
    if max_steps > 0:
        check_trainable_dtype(resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device)))
    sharded = tc.fsdp and distributed.world().size > 1
    policies = AgentPolicies(task.agent_names, cfg.model, cfg.algo, cfg.seed, load_on_cpu=sharded)
    if tc.rollout == "vllm":
        from marl_llm.rollout.vllm import VLLMRollout

        run_dir = OmegaConf.select(cfg, "run_dir", throw_on_missing=False)
        rollout = VLLMRollout(policies, tc.vllm_gpu_memory_utilization, sleep=tc.vllm_sleep,
                              root=Path(run_dir) / "vllm_adapters" if run_dir else None)
    else:
        rollout = HFRollout(policies, max_batch=tc.sequences_per_generate, decode=tc.decode,
                            compile_decode=tc.compile_decode)
    meter = perf.Meter(policies.device, perf.peak_tflops(policies.device, policies.dtype, tc.peak_tflops))
    # Generation timed apart from reward scoring, its FLOPs counted from the completions' lengths.
    rollout = perf.MeteredRollout(rollout, meter, policies)
    algo = build_algorithm(cfg.algo, task, policies, rollout, tc.completions_per_micro_batch)
    # After the algorithm: a separate critic is a trained model too.
    base_params = sum(q.numel() for q in policies.models[0].get_base_model().parameters())
    if gradient_checkpointing(tc.gradient_checkpointing, policies.device, base_params):
        policies.enable_gradient_checkpointing(algo.extra_models())
    # After the algorithm: its critics add adapters, and FSDP fixes the parameters it manages.
    sharding = fsdp.shard_policies(policies) if sharded else None
    schedulers = lr_schedulers(list(policies.optimizers.values()), cfg.algo, max_steps)
    meter.watch([*policies.models, *policies.references, *algo.extra_models()])  # every pass of every model
    return Setup(task, policies, rollout, algo, train_set, eval_set, max_steps, sharding, schedulers, meter)


def train_step(run: Setup, cfg: DictConfig, step: int,
               problems: list[Problem] | None = None) -> tuple[JointTree, dict[str, float]]:
    """One training step: collect a rollout tree, advantages, one update per adapter. Returns the
    tree (this rank's share) and the step's metrics over all ranks (TRL names, timings,
    throughput, peak memory). `problems` overrides the step's batch (the benchmark feeds every
    system the same prompts)."""
    policies, algo = run.policies, run.algo
    t0 = run.meter.start_step()  # synchronized clock (CUDA); resets the peak-memory statistic
    if problems is None:
        problems = distributed.shard(batch_for_step(run.train_set, step, cfg.trainer.prompts_per_step, cfg.seed))
    PROGRESS.debug("phase", extra={"phase": "rollout"})  # the console's progress (Watch)
    with fsdp.unsharded(policies, cfg.trainer.fsdp_unshard_rollout):  # every rank collects once per step
        tree = algo.collect(problems)
    if hasattr(run.rollout, "release"):  # vLLM sleeps: the update gets its GPU memory
        run.rollout.release()
    t_rollout = run.meter.mark("rollout")
    PROGRESS.debug("phase", extra={"phase": "update"})
    batches = algo.advantages(tree)
    stats = algo.update(batches, end_of_epoch=ends_epoch(step, cfg.trainer.prompts_per_step, len(run.train_set),
                                                         run.max_steps))
    for sched in run.schedulers:
        sched.step()
    run.rollout.update_weights()
    t_end = run.meter.mark("update")

    metrics = algo.rollout_metrics(tree)
    metrics.update(stats)
    metrics.update(_agent_means(stats, [policies.policy_label(k) for k in policies.trainable_adapters()]))
    metrics["step_time"] = t_end - t0
    metrics["perf/time_per_step"] = t_end - t0
    # timing/{rollout,generate,scoring,update}, perf/tflop/*, perf/mfu/*, perf/peak_gpu_mem_gib
    metrics.update(run.meter.step_metrics())
    metrics["perf/throughput"] = metrics.get("num_tokens", 0.0) / max(t_end - t0, 1e-9)
    metrics["perf/rollout_tokens_per_s"] = metrics.get("num_tokens", 0.0) / max(t_rollout - t0, 1e-9)
    metrics["perf/peak_rss_gib"] = peak_rss_gib()
    return tree, distributed.reduce_metrics(metrics)


def join_world(cfg: DictConfig) -> distributed.World:
    """Join the launcher's data-parallel group (torchrun, accelerate launch, SLURM tasks), if any."""
    check_device_for_ranks(cfg.model.device, distributed.launched_world_size())
    cpu = cfg.model.device == "cpu" or not torch.cuda.is_available()
    w = distributed.init(cfg.trainer.distributed_timeout_min, cpu=cpu)
    if w.size > 1 and cfg.trainer.prompts_per_step % w.size:
        raise UserError(f"trainer.prompts_per_step={cfg.trainer.prompts_per_step} does not split over {w.size} "
                        f"processes: use a multiple of {w.size} (each rank rolls out its own share of the problems)")
    return w


def resume_mode(cfg: DictConfig) -> str:
    """trainer.resume as "off", "on" (continue from the run dir's checkpoint; none is an error) or
    "if_possible" (without a checkpoint, start over in the dir). A SLURM job that was requeued
    (timeout, pre-emption) resumes if possible without being told: it may have been stopped
    before its first checkpoint."""
    value = cfg.trainer.resume
    modes = {"false": "off", "true": "on", "if_possible": "if_possible"}
    mode = modes.get(str(value).lower()) if isinstance(value, (bool, str)) else None
    if mode is None:
        raise UserError(f"trainer.resume={value} is not a choice: true (continue the run in hydra.run.dir), "
                        "if_possible (continue, or start over there when it has no checkpoint) or false")
    return "if_possible" if rundir.requeued() else mode


@dataclass
class Progress:
    """How far a run has got: what an interrupted run reports."""

    run_dir: Path | None = None  # set once the run dir is this run's
    step: int = 0
    max_steps: int = 0
    checkpoint: tuple[int, str] | None = None  # (step, file) of the last checkpoint written or resumed from
    main: bool = True


def interrupted_line(progress: Progress) -> str:
    """Where a Ctrl-C'd run stopped and the command that goes on from there."""
    run_dir = progress.run_dir.resolve()
    reached = f"interrupted at step {progress.step}/{progress.max_steps}"
    if progress.checkpoint is None:  # trainer.resume=true would refuse: nothing to continue from
        return (f"{reached}, no checkpoint yet; start it over in its dir (its logs are kept aside) with: "
                f"{rundir.resume_command(run_dir, 'if_possible')}")
    step, path = progress.checkpoint
    return (f"{reached}, last checkpoint {path} (step {step}); continue with: "
            f"{rundir.resume_command(run_dir, 'true')}")


def train(cfg: DictConfig) -> float:
    """One run (see the module's docstring). Ctrl-C raises rundir.Interrupted, whose message says
    where the run stopped and how to continue it, after the loggers and process group are closed."""
    progress = Progress()
    threads = torch.get_num_threads()  # trainer.threads is the run's: an in-process caller gets its own back
    try:
        with console_logging():
            return _train(cfg, progress)
    except KeyboardInterrupt:
        distributed.shutdown()  # as on an error before the loop (the loop's own cleanup has run)
        if progress.run_dir is None:
            raise  # before this run had a dir: nothing to continue
        raise rundir.Interrupted(interrupted_line(progress), progress.main) from None
    finally:
        torch.set_num_threads(threads)


def _train(cfg: DictConfig, progress: Progress) -> float:
    validate(cfg)
    resume = resume_mode(cfg)
    quiet_libraries()
    torch.set_num_threads(torch_threads(cfg.trainer.threads))  # before any model loads
    w = join_world(cfg)
    # Every rank writes to (and resumes from) rank 0's run dir; only rank 0 writes anything.
    run_dir = Path(distributed.broadcast_object(str(cfg.run_dir)))
    tc = cfg.trainer
    watch = Watch(tc.progress if w.is_main else "off", tc.progress_every_s)

    def say(msg: str) -> None:
        if w.is_main:
            log.info(msg)

    # The checkpoint is read (and the config compared with its own) before the model loads: a
    # refused resume costs seconds. Every rank reads it.
    ckpt, changes = None, {}
    if resume != "off":
        ckpt = read_checkpoint(run_dir, main=w.is_main)
        if ckpt is None and resume == "on":
            raise UserError(f"nothing to resume in {run_dir}: it has no {rundir.CHECKPOINT} or {rundir.PREVIOUS} (the "
                            "run stopped before its first checkpoint, or they were removed); start it over there with "
                            "trainer.resume=if_possible (its logs are kept aside), or check hydra.run.dir")
        if ckpt is not None:
            changes = check_resume_config(ckpt, cfg)
    refusal = distributed.broadcast_object(rundir.claim(run_dir, resume != "off") if w.is_main else None)
    if refusal:
        raise UserError(refusal)
    progress.run_dir, progress.main, progress.max_steps = run_dir, w.is_main, tc.max_steps
    if ckpt is not None:
        progress.step, progress.checkpoint = ckpt["step"], (ckpt["step"], ckpt["path"])
    if w.is_main:
        if resume != "off" and ckpt is None:  # if_possible, and nothing to continue from
            moved = rundir.set_aside(run_dir)
            if moved:
                rundir.record(run_dir, {"started_over": True, "why": "no checkpoint", "set_aside": moved})
                say(f"no checkpoint in {run_dir} to resume from: starting over at step 0; the earlier attempt's "
                    f"files are kept as {', '.join(moved.values())}")
            else:
                say(f"no checkpoint in {run_dir} to resume from: starting at step 0")
        # The resolved config next to the metrics: marl-llm-report reads both (no W&B needed). A
        # resume keeps the run's own (the changes go to resumes.jsonl).
        if ckpt is None or not (run_dir / "config.yaml").exists():
            atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    seed_everything(cfg.seed, cfg.trainer.deterministic)

    run = build(cfg)
    task, policies, algo = run.task, run.policies, run.algo
    train_set, eval_set, max_steps = run.train_set, run.eval_set, run.max_steps
    progress.max_steps = max_steps
    algo_cls = type(algo)
    start_step, wandb_id = 0, None
    if ckpt is not None:
        restore_checkpoint(run_dir, ckpt, policies, algo, main=w.is_main)
        start_step, wandb_id = ckpt["step"], ckpt["wandb_id"]
        run.schedulers = lr_schedulers(list(policies.optimizers.values()), cfg.algo, max_steps, start_step)
        if w.is_main:
            rundir.record(run_dir, {"resumed_from": ckpt["path"], "step": start_step, "changes": {
                k: list(v) for k, v in changes.items() if k != "trainer.resume"}})
        say(f"resumed from {ckpt['path']} at step {start_step}"
            + (f" (changed: {', '.join(k for k in changes if k != 'trainer.resume')})"
               if set(changes) - {"trainer.resume"} else ""))
        del ckpt  # its tensors are in the policies now
    distributed.broadcast_parameters(policies.trainable_parameters())
    logger = RunLogger(cfg, run_dir, wandb_id) if w.is_main else NullLogger()
    summary: dict[str, Any] = {"before": None, "after": None, "eval_problems": len(eval_set),
                               "train_problems": len(train_set)}
    t_start = time.perf_counter()
    say(f"{cfg.algo.name} on {cfg.task.name}: agents {', '.join(task.agent_names)} on "
        f"{cfg.model.name} [{', '.join(m.get_base_model().name_or_path for m in policies.models)}] "
        f"({policies.device}, {policies.dtype}, torch threads: {torch.get_num_threads()}); run dir {run_dir}"
        + (f"; {w.size} data-parallel processes" if w.size > 1 else ""))
    if run.sharding:
        say(run.sharding)
    elif tc.fsdp:
        say("trainer.fsdp=true on one process: nothing to shard, the base stays whole")

    if not algo_cls.trainable and tc.max_steps > 0:
        say(f"algo={cfg.algo.name} is a prompt-only baseline: evaluation only, no training steps")

    def run_eval(step: int) -> dict[str, float] | None:
        """Rank 0 evaluates (the other ranks wait for it)."""
        metrics = None
        # Every rank gathers the sharded base (a collective); rank 0 then decodes without rounds.
        with fsdp.unsharded(policies, tc.fsdp_unshard_rollout):
            if w.is_main:
                watch.begin(f"eval @ step {step}")
                metrics, rows = evaluate(algo, eval_set, tc)
                watch.end()
                logger.log("eval", metrics, step)
                logger.log_samples("eval", rows[: cfg.logger.sample_rows], step)
                say(f"eval @ step {step}: " + format_metrics(metrics, ("reward", "pass@1", "success_rate")))
        distributed.barrier()
        return metrics

    def checkpoint(step: int, final: bool = False) -> None:
        """Rank 0 saves (the ranks' states are equal); the others wait, so none runs ahead. The
        final save (each save with trainer.export_with_checkpoints) also exports the agents."""
        if w.is_main:
            path = save_checkpoint(run_dir, cfg, policies, step, logger.wandb_id, algo.state_dict())
            progress.checkpoint = (step, str(path))
            if (final and tc.export_agents) or tc.export_with_checkpoints:
                try:  # a full disk must not cost the run its evaluation: the checkpoint holds the agents
                    say(f"agents of step {step} written to {export_agents(run_dir, cfg, policies, step)}")
                except OSError as err:
                    say(f"warning: the agents of step {step} were not exported ({err}); the checkpoint holds them")
        distributed.barrier()

    exit_code = 1
    watch.start(max_steps, start_step)
    try:
        evaluated_before = tc.eval_before and start_step == 0
        if evaluated_before:
            summary["before"] = run_eval(0)
        step_times: list[float] = []
        last_train: dict[str, float] = {}
        for step in range(start_step, max_steps):
            watch.begin(f"step {step + 1}/{max_steps}")
            tree, metrics = train_step(run, cfg, step)
            watch.step_done(metrics["step_time"])
            progress.step = step + 1
            logger.log("train", metrics, step + 1)
            logger.log_samples("train", sample_rows(tree, policies.agent_names, cfg.logger.sample_rows), step + 1)
            step_times.append(metrics["step_time"])
            last_train = metrics
            say(step_line(step + 1, max_steps, metrics, task.agent_names, watch.tokens_per_s(), watch.eta_s()))

            if tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < max_steps:
                run_eval(step + 1)
            if tc.save_every and (step + 1) % tc.save_every == 0:
                checkpoint(step + 1)

        final_step = max(max_steps, start_step)
        if final_step > 0:  # nothing trained, nothing to save
            checkpoint(final_step, final=True)
        if tc.eval_after and (final_step > 0 or not evaluated_before):
            summary["after"] = run_eval(final_step)
        if not w.is_main:
            exit_code = 0
            return 0.0
        summary.update(train_reward_first=_first_train_reward(run_dir), train_reward_last=last_train.get("reward"),
                       sec_per_step=(sum(step_times) / len(step_times)) if step_times else None,
                       peak_rss_gib=peak_rss_gib(), steps=final_step, wall_s=time.perf_counter() - t_start)
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
        if tc.summary_file:
            write_summary(Path(tc.summary_file), cfg, summary)
        before, after = summary["before"] or {}, summary["after"] or {}
        keys = ("pass@1", "success_rate", "reward")
        if after and before:
            shown = "held-out before -> after training: " + "  ".join(
                f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in keys if k in before and k in after)
        elif after:
            shown = "held-out after training: " + "  ".join(f"{k} {after[k]:.3f}" for k in keys if k in after)
        elif before:
            shown = "held-out, no training: " + "  ".join(f"{k} {before[k]:.3f}" for k in keys if k in before)
        else:
            shown = "no held-out evaluation (trainer.eval_before and trainer.eval_after are off)"
        say(f"{shown}  (summary: {tc.summary_file or run_dir / 'summary.json'})")
        exit_code = 0
    except KeyboardInterrupt:
        exit_code = 130  # W&B records the run as stopped, as the shell would (128 + SIGINT)
        raise
    finally:
        watch.stop()  # the bars end before anything else prints
        if hasattr(run.rollout, "close"):  # vLLM: its exported adapters are removed
            run.rollout.close()
        logger.finish(exit_code)
        if exit_code == 0:
            distributed.barrier()  # rank 0 has written everything before any rank exits
        distributed.shutdown()
    final = summary["after"] or summary["before"] or {}
    return float(final.get("pass@1", final.get("reward", 0.0)))


def _agent_means(stats: dict[str, float], policies: list[str]) -> dict[str, float]:
    """Team-level TRL names (`loss`, `entropy`, ...) as the mean over the policies' values."""
    out: dict[str, list[float]] = {}
    for key, v in stats.items():
        head, _, leaf = key.partition("/")
        if head in policies:
            out.setdefault(leaf, []).append(v)
    return {k: (sum(v) if k in ("num_tokens", "prompt_tokens") else sum(v) / len(v)) for k, v in out.items()}


def _first_train_reward(run_dir: Path) -> float | None:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/reward" in row:
            return row["train/reward"]
    return None


def _code_line() -> str:
    from marl_llm.runs.loggers import code_version

    code = code_version()
    commit = code.get("git_commit")
    where = f", commit {commit[:12]}" + (" (uncommitted changes)" if code.get("git_dirty") else "") if commit else ""
    return f"marl-llm {code.get('marl_llm')}{where}"


def write_summary(path: Path, cfg: DictConfig, s: dict[str, Any]) -> None:
    """A short markdown summary (make run writes results/), with the command that produced it."""
    def get(which: str, key: str) -> str:
        v = (s.get(which) or {}).get(key)
        return "n/a" if v is None else f"{v:.4f}"

    def num(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    cmd = "marl-llm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        f"# {cfg.algo.name} on {cfg.task.name} with {cfg.model.name}",
        "",
        f"Command: `{cmd}`",
        "",
        "| metric | before training | after training |",
        "|---|---|---|",
        f"| eval pass@1 (greedy, {cfg.algo.get('num_turns', 1)} turns, {s['eval_problems']} held-out problems) | {get('before', 'pass@1')} | {get('after', 'pass@1')} |",
        f"| eval reward (task scale) | {get('before', 'reward')} | {get('after', 'reward')} |",
        f"| train reward (first step / last step) | {num(s.get('train_reward_first'), '.4f')} | {num(s.get('train_reward_last'), '.4f')} |",
        "",
        f"- steps: {s.get('steps')} (prompts per step: {cfg.trainer.prompts_per_step}, "
        f"G={cfg.algo.get('num_generations')}); seconds per step: {num(s.get('sec_per_step'), '.1f')}; "
        f"whole run: {num(s.get('wall_s'), '.0f')} s; peak RSS: {num(s.get('peak_rss_gib'), '.2f')} GiB",
        f"- device: {'cuda' if torch.cuda.is_available() else 'cpu'}; torch {torch.__version__}",
        f"- code: {_code_line()}",
        "",
    ]
    atomic_write_text(path, "\n".join(lines))
