"""What a run trains with, built from the config: the process group, the RNGs, the task, the
policies, the rollout and the algorithm (trainer.py runs them; the benchmarks and marl-llm-eval
build the same)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from marl_llm.algos import algorithm_class, build_algorithm
from marl_llm.algos.update import lr_schedulers
from marl_llm.config import UserError
from marl_llm.distributed import data_parallel as distributed
from marl_llm.distributed import fsdp, memory_plan, placement
from marl_llm.models.loading import check_device_for_ranks, resolve_device, resolve_dtype
from marl_llm.models.policies import AgentPolicies, check_trainable_dtype
from marl_llm.rollout.base import Rollout
from marl_llm.rollout.decode import HFRollout
from marl_llm.tasks import Problem, build_task
from marl_llm.tasks.turn_based import TurnTask
from marl_llm.training import perf


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
    memory it has not written. flash-attention 2's backward accumulates in an order that varies
    from run to run unless it is asked for its deterministic kernel, which transformers does when
    FLASH_ATTENTION_DETERMINISTIC=1 (read at every call, as its own `enable_full_determinism` sets
    it); torch's deterministic mode does not reach that extension."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    # warn_only: an op with no deterministic CUDA kernel warns (naming itself) instead of
    # stopping a run that may be days long; the update runs in strict mode (strict_determinism).
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def strict_determinism(enabled: bool) -> Iterator[None]:
    """trainer.deterministic inside the update (advantages and optimizer steps: every backward
    pass): torch's deterministic algorithms in strict mode, not the run's warn-only one. Strict
    mode is what makes SDPA's memory-efficient backward on CUDA deterministic (it then takes one
    key split; warn-only mode only warns and keeps the non-deterministic split). An op with no
    deterministic kernel stops the update with one line naming it, instead of a warning and a run
    that is not reproducible. Elsewhere (rollouts, evaluation: forward passes only) the run stays
    in warn-only mode."""
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    except RuntimeError as err:
        marker = " does not have a deterministic implementation"
        if marker not in str(err):
            raise
        op = str(err).split(marker)[0].strip().splitlines()[-1]
        raise UserError(f"trainer.deterministic=true: {op} has no deterministic kernel on this device, so the update "
                        "cannot be bitwise reproducible: set trainer.deterministic=false (or avoid what runs it)") from None
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def gradient_checkpointing(setting: Any, device: torch.device, num_params: int) -> bool:
    """trainer.gradient_checkpointing resolved: true/false as given; auto: on for a base of at
    least 4B parameters on CUDA (activations of long completions then outgrow a GPU's memory)."""
    if setting == "auto":
        return device.type == "cuda" and num_params >= 4e9
    return bool(setting)


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
    placed: str | None = None  # where the policies are (trainer.placement), to print
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
    w = distributed.world()
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    placement.check(cfg, w.size, placement.policy_count(task.agent_names, cfg.algo), visible)
    show_memory_plan(cfg, task.agent_names, w, resolve_device(cfg.model.device))
    if max_steps > 0:
        check_trainable_dtype(resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device)))
    sharded = tc.fsdp and w.size > 1
    policies = AgentPolicies(task.agent_names, cfg.model, cfg.algo, cfg.seed, load_on_cpu=sharded,
                             on_meta=sharded and tc.fsdp_load == "sharded", master_weights=tc.master_weights)
    check_context(cfg, policies)
    getattr(task, "use_tokenizers", lambda tokenizers: None)([policies.tokenizers[a.model_index] for a in policies.agents])
    where = placement.setup(cfg, policies)
    placed = placement.place_models(policies, where)
    if tc.rollout == "vllm":
        from marl_llm.rollout.vllm import VLLMRollout

        run_dir = OmegaConf.select(cfg, "run_dir", throw_on_missing=False)
        rollout = VLLMRollout(policies, tc.vllm_gpu_memory_utilization, sleep=tc.vllm_sleep,
                              root=Path(run_dir) / "vllm_adapters" if run_dir else None)
    else:
        rollout = HFRollout(policies, max_batch=tc.sequences_per_generate, decode=tc.decode,
                            compile_decode=tc.compile_decode, kv_cache_gib=tc.kv_cache_gib, sharded=sharded)
    meter = perf.Meter(policies.device, perf.peak_tflops(policies.device, policies.dtype, tc.peak_tflops))
    # Generation timed apart from reward scoring, its FLOPs counted from the completions' lengths.
    rollout = perf.MeteredRollout(rollout, meter, policies)
    if where.by_actions:  # the ranks share every generate call (trainer.work_split)
        rollout = placement.SplitRollout(rollout, policies, where)
    algo = build_algorithm(cfg.algo, task, policies, rollout, tc.completions_per_micro_batch)
    # After the algorithm: a separate critic is a trained model too.
    base_params = sum(q.numel() for q in policies.models[0].get_base_model().parameters())
    if gradient_checkpointing(tc.gradient_checkpointing, policies.device, base_params):
        policies.enable_gradient_checkpointing(algo.extra_models())
    # After the algorithm: its critics add adapters, and FSDP fixes the parameters it manages.
    sharding = None
    if sharded:
        sharding = fsdp.shard_policies(policies, algo.extra_models(), placement.meshes(policies, where),
                                       rounds=not tc.fsdp_unshard_rollout)
        algo.parameters_replaced()
    schedulers = lr_schedulers(list(policies.optimizers.values()), cfg.algo, max_steps)
    meter.watch([*policies.models, *policies.references, *algo.extra_models()])  # every pass of every model
    return Setup(task, policies, rollout, algo, train_set, eval_set, max_steps, sharding, placed, schedulers, meter)


def show_memory_plan(cfg: DictConfig, agent_names: tuple[str, ...], w: distributed.World,
                     device: torch.device) -> None:
    """Print the run's memory plan (rank 0) before any model loads; stop when it does not fit
    (plan.check)."""
    plan = memory_plan.for_run(cfg, tuple(agent_names), w.size, device)
    if w.is_main:
        for line in [plan] if isinstance(plan, str) else plan.lines():
            logging.getLogger("marl_llm").info(line)
    if not isinstance(plan, str) and plan.fits is False and OmegaConf.select(cfg, "plan.check", default=True):
        raise UserError(memory_plan.refusal(plan))


def check_context(cfg: DictConfig, policies: AgentPolicies) -> None:
    """max_new_tokens beyond what a base can attend to (its max_position_embeddings) would have the
    decode loop allocate for it (10**8 tokens: hundreds of GB) before any token is sampled."""
    a = cfg.algo
    for model in policies.models:
        limit = getattr(model.config, "max_position_embeddings", None)
        if not limit:
            continue
        for where, over in [("algo.sampling", {}), *((f"algo.agent_sampling.{k}", v) for k, v in a.agent_sampling.items())]:
            wanted = {**a.sampling, **over}.get("max_new_tokens", 0)
            if wanted > limit:
                raise UserError(f"{where}.max_new_tokens={wanted} is more than {getattr(model.config, '_name_or_path', 'the model')} "
                                f"can attend to ({limit} positions, prompt included): set it below {limit}")


def join_world(cfg: DictConfig) -> distributed.World:
    """Join the launcher's data-parallel group (torchrun, accelerate launch, SLURM tasks), if any."""
    check_device_for_ranks(cfg.model.device, distributed.launched_world_size())
    cpu = cfg.model.device == "cpu" or not torch.cuda.is_available()
    return distributed.init(cfg.trainer.distributed_timeout_min, cpu=cpu)
