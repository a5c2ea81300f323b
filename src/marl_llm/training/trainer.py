"""The training loop, top to bottom.

A run's whole life (the step, the loop with its evaluations and checkpoints, Ctrl-C, the summary)
reads in order here, as nanoGPT's train.py does. What it is built from lives where its name says:
the task, policies, rollout and algorithm in setup.py, the data order in data_order.py, thread
counts in threads.py, what the console shows in console.py, the run dir's rules and the summary
in runs/, what an algorithm does within a step in algos/.

    for each step:
        problems  = next batch of training problems
        tree      = algo.collect(problems)      # rollout (a tree when multi-turn) + joint rewards
        batches   = algo.advantages(tree)       # group advantages, per agent
        stats     = algo.update(batches)        # one update per agent (its own adapter/optimizer)
        log; periodic eval; periodic checkpoint
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from marl_llm.algos.update import lr_schedulers
from marl_llm.config import UserError, task_label
from marl_llm.configure import check_run_does_something, validate
from marl_llm.distributed import data_parallel as distributed
from marl_llm.distributed import fsdp, placement
from marl_llm.rollout.base import PROGRESS
from marl_llm.runs import rundir
from marl_llm.runs.atomic import atomic_write_text
from marl_llm.runs.checkpoint import check_resume_config, save_checkpoint
from marl_llm.runs.export import export_agents, export_history
from marl_llm.runs.loggers import NullLogger, RunLogger
from marl_llm.runs.rundir import Progress, interrupted_line, resume_mode
from marl_llm.runs.sharded_checkpoint import is_sharded_run, read_any_checkpoint, restore_any_checkpoint, \
    save_sharded_checkpoint
from marl_llm.runs.summary import first_train_reward, held_out_line, logged_eval, write_summary
from marl_llm.tasks import Problem
from marl_llm.tasks.base import take_task_metrics
from marl_llm.training.console import Watch, console_logging, format_metrics, step_line
from marl_llm.training.data_order import batch_for_step, ends_epoch
from marl_llm.training.episodes import JointTree
from marl_llm.training.evaluation import evaluate, paper_eval_due
from marl_llm.training.perf import peak_rss_gib
from marl_llm.training.setup import Setup, build, join_world, quiet_libraries, seed_everything, strict_determinism
from marl_llm.training.threads import AutoThreads, choose_threads

log = logging.getLogger("marl_llm")  # the console and the job log (training/console.py)


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


def train_step(run: Setup, cfg: DictConfig, step: int,
               problems: list[Problem] | None = None) -> tuple[JointTree, dict[str, float]]:
    """One training step: collect a rollout tree, advantages, one update per adapter. Returns the
    tree (this rank's share) and the step's metrics over all ranks (TRL names, timings,
    throughput, peak memory). `problems` overrides the step's batch (the benchmark feeds every
    system the same prompts)."""
    policies, algo = run.policies, run.algo
    t0 = run.meter.start_step()  # synchronized clock (CUDA); resets the peak-memory statistic
    by_actions = placement.current().by_actions  # every rank holds every problem (trainer.work_split)
    if problems is None:
        problems = batch_for_step(run.train_set, step, cfg.trainer.prompts_per_step, cfg.seed, cfg.trainer.data_order)
        problems = problems if by_actions else distributed.shard(problems)
    PROGRESS.debug("phase", extra={"phase": "rollout"})  # the console's progress (Watch)
    take_task_metrics(algo.task)  # the task's own metrics count this step's rollout only, from here
    with fsdp.unsharded(policies, cfg.trainer.fsdp_unshard_rollout):  # every rank collects once per step
        tree = algo.collect(problems)
    task_metrics = take_task_metrics(algo.task)  # task=env: observations/clipped_ratio
    run.rollout.release()  # the update gets the rollout's memory (vLLM sleeps, kept KV caches go)
    t_rollout = run.meter.mark("rollout")
    PROGRESS.debug("phase", extra={"phase": "update"})
    with strict_determinism(cfg.trainer.deterministic):  # every backward pass of the step is in here
        batches = algo.advantages(tree)
        stats = algo.update(batches, end_of_epoch=ends_epoch(step, cfg.trainer.prompts_per_step, len(run.train_set),
                                                             run.max_steps))
    for sched in run.schedulers:
        sched.step()
    run.rollout.update_weights()
    t_end = run.meter.mark("update")

    # Sharing the joint actions, every rank has the whole tree: rank 0 alone reports its metrics.
    metrics = algo.rollout_metrics(tree) if not by_actions or distributed.world().is_main else {}
    metrics.update(stats)
    metrics.update(task_metrics)
    metrics.update(_agent_means(stats, [policies.policy_label(k) for k in policies.trainable_adapters()]))
    metrics["step_time"] = t_end - t0
    metrics["perf/time_per_step"] = t_end - t0
    # timing/{rollout,generate,scoring,update}, perf/tflop/*, perf/mfu/*, perf/peak_gpu_mem_gib
    metrics.update(run.meter.step_metrics())
    metrics["perf/throughput"] = metrics.get("num_tokens", 0.0) / max(t_end - t0, 1e-9)
    metrics["perf/rollout_tokens_per_s"] = metrics.get("num_tokens", 0.0) / max(t_rollout - t0, 1e-9)
    metrics["perf/peak_rss_gib"] = peak_rss_gib()
    return tree, distributed.reduce_metrics(metrics)


def train(cfg: DictConfig) -> float:
    """One run (see the module's docstring). Ctrl-C raises rundir.Interrupted, whose message says
    where the run stopped and how to continue it, after the loggers and process group are closed."""
    progress = Progress()
    threads = torch.get_num_threads()  # trainer.threads is the run's: an in-process caller gets its own back
    with rundir.interrupt_handling(progress):  # a second Ctrl-C, during the cleanup: out at once, one line
        try:
            with console_logging():
                return _train(cfg, progress)
        except KeyboardInterrupt:
            distributed.shutdown()  # as on an error before the loop (the loop's own cleanup has run)
            raise rundir.Interrupted(interrupted_line(progress), progress.main) from None
        except OSError as err:
            full = rundir.disk_full_line(err, progress)
            if full is None:
                raise
            raise UserError(full) from None
        finally:
            torch.set_num_threads(threads)
            if progress.claimed:  # its lock; and, had it not started, its marker (the fixed command runs there)
                rundir.release(progress.run_dir, progress.started)


def _train(cfg: DictConfig, progress: Progress) -> float:
    validate(cfg)
    check_run_does_something(cfg)
    resume = resume_mode(cfg)
    quiet_libraries()
    threads = choose_threads(cfg.trainer.threads, cfg.trainer.deterministic)
    torch.set_num_threads(threads.count)  # before any model loads
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
        ckpt = read_any_checkpoint(run_dir, main=w.is_main)
        if ckpt is None and resume == "on":
            raise UserError(f"nothing to resume in {run_dir}: it has no {rundir.CHECKPOINT} or {rundir.PREVIOUS} (the "
                            "run stopped before its first checkpoint, or they were removed); start it over there with "
                            "trainer.resume=if_possible (its logs are kept aside), or check hydra.run.dir")
        if ckpt is not None:
            changes = check_resume_config(ckpt, cfg)
    refusal = distributed.broadcast_object(rundir.claim(run_dir, resume != "off", rundir.sweep_dir()) if w.is_main
                                           else None)
    if refusal:
        raise UserError(refusal)
    progress.run_dir, progress.main, progress.max_steps, progress.claimed = run_dir, w.is_main, tc.max_steps, w.is_main
    if ckpt is not None:
        progress.step, progress.checkpoint = ckpt["step"], (ckpt["step"], ckpt["path"])
        if resume == "if_possible" and rundir.finished(run_dir, ckpt["step"], tc.max_steps):
            say(f"{run_dir} holds a finished run (step {ckpt['step']}, summary.json): nothing to do")
            distributed.shutdown()
            return rundir.finished_value(run_dir)
    if w.is_main:
        if resume != "off" and ckpt is None:  # if_possible, and nothing to continue from
            moved = rundir.set_aside(run_dir)
            if moved:
                rundir.record(run_dir, {"started_over": True, "why": "no checkpoint", "set_aside": moved,
                                        **rundir.slurm_attempt()})
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
        restore_any_checkpoint(run_dir, ckpt, policies, algo, main=w.is_main)
        start_step, wandb_id = ckpt["step"], ckpt["wandb_id"]
        run.schedulers = lr_schedulers(list(policies.optimizers.values()), cfg.algo, max_steps, start_step)
        if w.is_main:
            rundir.record(run_dir, {"resumed_from": ckpt["path"], "step": start_step, "changes": {
                k: list(v) for k, v in changes.items() if k != "trainer.resume"}, **rundir.slurm_attempt()})
        say(f"resumed from {ckpt['path']} at step {start_step}"
            + (f" (changed: {', '.join(k for k in changes if k != 'trainer.resume')})"
               if set(changes) - {"trainer.resume"} else ""))
        del ckpt  # its tensors are in the policies now
    distributed.broadcast_parameters(fsdp.replicated(policies.trainable_parameters()))  # shards: loaded alike
    sharded_checkpoints = is_sharded_run(policies, algo)
    logger = RunLogger(cfg, run_dir, wandb_id) if w.is_main else NullLogger()
    progress.started = True  # it logs from here on: a failure or Ctrl-C leaves a run to continue
    summary: dict[str, Any] = {"before": None, "after": None, "eval_problems": len(eval_set),
                               "train_problems": len(train_set)}
    t_start = time.perf_counter()
    say(f"{cfg.algo.name} on {task_label(cfg)}: agents {', '.join(task.agent_names)} on "
        f"{cfg.model.name} [{', '.join(m.get_base_model().name_or_path for m in policies.models)}] "
        f"({policies.device}, {policies.dtype}, torch threads: {torch.get_num_threads()}"
        + (f" [{threads.why}]" if threads.why else "") + f"); run dir {run_dir}"
        + (f"; {w.size} data-parallel processes" if w.size > 1 else ""))
    by_actions = placement.current().by_actions
    if by_actions:
        say(f"the {w.size} ranks share each step's joint actions (trainer.work_split=joint_actions)")
    if run.placed:
        say(run.placed)
    if run.sharding:
        say(run.sharding)
    elif tc.fsdp:
        say("trainer.fsdp=true on one process: nothing to shard, the base stays whole")

    if not algo_cls.trainable and tc.max_steps > 0:
        say(f"algo={cfg.algo.name} is a prompt-only baseline: evaluation only, no training steps")

    def run_eval(step: int) -> dict[str, float] | None:
        """Rank 0 evaluates (the other ranks wait for it); sharing joint actions, every rank
        takes its share of every generate call and rank 0 logs."""
        metrics = None
        # Every rank gathers the sharded base (a collective); rank 0 then decodes without rounds.
        with fsdp.unsharded(policies, tc.fsdp_unshard_rollout):
            if by_actions and not w.is_main:
                evaluate(algo, eval_set, tc)
            if w.is_main:
                watch.begin(f"eval @ step {step}")
                metrics, rows = evaluate(algo, eval_set, tc)
                watch.end()
                logger.log("eval", metrics, step)
                logger.log_samples("eval", rows[: cfg.logger.sample_rows], step)
                say(f"eval @ step {step}: " + format_metrics(metrics, ("reward", "pass@1", "pass@1_sampled",
                                                                       "pass@1_ceiling", "success_rate")))
        run.rollout.release()  # as after a rollout phase: no KV cache of the evaluation stays
        distributed.barrier()
        return metrics

    def checkpoint(step: int, final: bool = False) -> None:
        """Rank 0 saves (the ranks' states are equal), or with sharded trained weights every rank
        its shards; the others wait, so none runs ahead. The final save (each save with
        trainer.export_with_checkpoints) also exports the agents, gathered whole on rank 0."""
        if sharded_checkpoints:
            path = save_sharded_checkpoint(run_dir, cfg, policies, step, logger.wandb_id, algo)
        elif w.is_main:
            path = save_checkpoint(run_dir, cfg, policies, step, logger.wandb_id, algo.state_dict())
        if w.is_main:
            progress.checkpoint = (step, str(path))
        if (final and tc.export_agents) or tc.export_with_checkpoints:
            write_agents(step)
        distributed.barrier()

    def write_agents(step: int, history: bool = False) -> None:
        """The agents of `step`, gathered whole (a collective when sharded), written by rank 0 to
        agents/ (the export), or with `history` to <run_dir>/checkpoints/ (trainer.history_every)."""
        whole = fsdp.whole_policies(policies, run_dir / ".staged-agents")
        if w.is_main:
            try:  # a full disk must not cost the run its evaluation: the checkpoint holds the agents
                if history:
                    say(f"agents of step {step} kept as "
                        f"{export_history(run_dir, cfg, policies, step, tc.history_keep, whole=whole)}")
                else:
                    say(f"agents of step {step} written to {export_agents(run_dir, cfg, policies, step, whole=whole)}")
            except OSError as err:
                say(f"warning: the agents of step {step} were not kept ({err})" if history else
                    f"warning: the agents of step {step} were not exported ({err}); the checkpoint holds them")
            shutil.rmtree(run_dir / ".staged-agents", ignore_errors=True)  # placement=groups' leftovers
        del whole

    # trainer.eval_protocol=paper: the reference's schedule (before every eval_interval-th batch of
    # each epoch) replaces eval_every; own: every eval_every steps.
    paper_eval = tc.eval_protocol == "paper"

    def eval_due(step: int) -> bool:
        return paper_eval and paper_eval_due(step, tc.prompts_per_step, len(train_set), tc.eval_interval)

    exit_code = 1
    watch.start(max_steps, start_step)
    # trainer.threads=auto decides again as the machine's load changes, each rank for itself, and
    # says so (threads.py); a number stays.
    auto_threads = AutoThreads(threads, lambda line: log.info((f"rank {w.rank}: " if w.size > 1 else "")
                                                              + (f"{watch.context}: " if watch.context else "") + line))
    try:
        auto_threads.attach()
        evaluated_before = start_step == 0 and (tc.eval_before or eval_due(0))
        if evaluated_before:
            summary["before"] = run_eval(0)
        elif start_step > 0 and w.is_main:  # a resume: the first attempt's evaluation before training
            summary["before"] = logged_eval(run_dir, 0)
        step_times: list[float] = []
        last_train: dict[str, float] = {}
        for step in range(start_step, max_steps):
            if step > 0 and eval_due(step):  # step 0: the evaluation before training
                run_eval(step)
            watch.begin(f"step {step + 1}/{max_steps}")
            tree, metrics = train_step(run, cfg, step)
            watch.step_done(metrics["step_time"])
            progress.step = step + 1
            logger.log("train", metrics, step + 1)
            logger.log_samples("train", sample_rows(tree, policies.agent_names, cfg.logger.sample_rows), step + 1)
            step_times.append(metrics["step_time"])
            last_train = metrics
            say(step_line(step + 1, max_steps, metrics, task.agent_names, watch.tokens_per_s(), watch.eta_s()))
            # A NaN or inf loss or gradient has (or will have) reached the weights: stop before any
            # save or export could keep them. Every rank holds the same reduced metrics, so all stop.
            broken = rundir.non_finite(metrics)
            if broken:
                raise UserError(rundir.non_finite_line(progress, broken))

            if not paper_eval and tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < max_steps:
                run_eval(step + 1)
            if tc.save_every and (step + 1) % tc.save_every == 0:
                checkpoint(step + 1)
            if tc.history_every and (step + 1) % tc.history_every == 0:
                write_agents(step + 1, history=True)
                distributed.barrier()

        final_step = max(max_steps, start_step)
        if final_step > 0:  # nothing trained, nothing to save
            checkpoint(final_step, final=True)
        if tc.eval_after and (final_step > 0 or not evaluated_before):
            summary["after"] = run_eval(final_step)
        if not w.is_main:
            exit_code = 0
            return 0.0
        summary.update(train_reward_first=first_train_reward(run_dir), train_reward_last=last_train.get("reward"),
                       sec_per_step=(sum(step_times) / len(step_times)) if step_times else None,
                       peak_rss_gib=peak_rss_gib(), steps=final_step, wall_s=time.perf_counter() - t_start)
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
        if tc.summary_file:
            write_summary(Path(tc.summary_file), cfg, summary)
        say(f"{held_out_line(summary)}  (summary: {tc.summary_file or run_dir / 'summary.json'})")
        exit_code = 0
    except KeyboardInterrupt:
        exit_code = 130  # W&B records the run as stopped, as the shell would (128 + SIGINT)
        raise
    finally:
        watch.stop()  # the bars end before anything else prints
        auto_threads.detach()
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


