"""The checks of the keys every run shares (`check_shared`: trainer, logger, model, sampling) and of
`algo.agent_sampling`; `marl_llm.configure.validate` runs them before the chosen algorithm's and
task's own `check`. The generic checks they use live in marl_llm.config (plugins use them too)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from marl_llm.config import SamplingConfig, check_choice, check_sampling, check_value


def check_agent_sampling(cfg: DictConfig, agents: tuple[str, ...] | None) -> None:
    """algo.agent_sampling: keys name agents of this algorithm on this task (None: not known before
    the task loads; models.policies.AgentPolicies checks the names), values are sampling overrides."""
    a = cfg.algo
    check_sampling("algo.sampling", a.sampling)
    for agent, over in a.agent_sampling.items():
        check_value(agents is None or agent in agents, f"algo.agent_sampling.{agent}",
                    f"{agent!r} is not an agent of algo={a.name} on task={cfg.task.name}, whose agents are "
                    f"{', '.join(agents or ())}: key the overrides by one of them")
        check_value(isinstance(over, (dict, DictConfig)), f"algo.agent_sampling.{agent}", "must be a mapping")
        unknown = set(over) - set(SamplingConfig.__dataclass_fields__)
        check_value(not unknown, f"algo.agent_sampling.{agent}",
                    f"unknown keys {sorted(unknown)}; valid: {sorted(SamplingConfig.__dataclass_fields__)}")
        check_sampling(f"algo.agent_sampling.{agent}", {**a.sampling, **over})


def check_shared(cfg: DictConfig) -> None:
    """The keys every run has: seed, model, logger, trainer, the policy keys of every algorithm
    schema (PolicyConfig), and a task's data and sandbox sections where it has them."""
    a, t = cfg.algo, cfg.trainer
    # numpy's seed is 32-bit unsigned (trainer.seed_everything seeds it with this value).
    check_value(0 <= cfg.seed <= 2**32 - 1, "seed", f"{cfg.seed} must be in [0, 2**32-1] (e.g. seed=0)")
    check_choice(cfg, "model.dtype", ("auto", "float32", "bfloat16", "float16", "float64"))
    check_choice(cfg, "trainer.rollout", ("hf", "vllm"))
    check_choice(cfg, "trainer.decode", ("dynamic", "static", "auto"))
    check_choice(cfg, "trainer.fsdp_load", ("sharded", "whole"))
    check_choice(cfg, "trainer.master_weights", ("fp32", "bf16"))
    check_value(t.compile_decode in (True, False, "auto"), "trainer.compile_decode",
                f"is {t.compile_decode!r}: use true, false or auto")
    check_value(t.compile_decode is not True or t.decode in ("static", "auto"), "trainer.compile_decode",
                "compiles the fixed-shape decode step: set trainer.decode=static (or auto)")
    check_value(t.kv_cache_gib == "auto" or (isinstance(t.kv_cache_gib, (int, float)) and not isinstance(
        t.kv_cache_gib, bool) and t.kv_cache_gib > 0), "trainer.kv_cache_gib",
                f"is {t.kv_cache_gib!r}: use auto or a number of GiB > 0")
    check_value(t.gradient_checkpointing in (True, False, "auto"), "trainer.gradient_checkpointing",
                f"is {t.gradient_checkpointing!r}: use true, false or auto")
    check_value(0 < t.vllm_gpu_memory_utilization < 1, "trainer.vllm_gpu_memory_utilization", "must be in (0, 1)")
    check_value(cfg.model.device == "auto" or cfg.model.device.split(":")[0] in ("cpu", "cuda", "mps"),
                "model.device", f"{cfg.model.device!r}: use auto, cpu, cuda or cuda:<i>")
    check_value(bool(cfg.model.path or cfg.model.embedded or cfg.model.hub_id or cfg.model.agent_bases), "model",
                "set one of model.path=<dir>, model.hub_id=<id> or model.embedded=true")
    check_choice(cfg, "logger.name", ("wandb", "none"))
    if cfg.logger.mode is not None:
        check_choice(cfg, "logger.mode", ("online", "offline", "disabled"))
    # The policy keys every algorithm schema has (PolicyConfig).
    check_choice(cfg, "algo.adapters", ("per_agent", "shared"))
    check_value(a.learning_rate > 0, "algo.learning_rate", f"{a.learning_rate} must be > 0")
    check_value(a.weight_decay >= 0, "algo.weight_decay", "must be >= 0")
    if a.lora is not None:
        check_value(a.lora.r >= 1, "algo.lora.r", "must be >= 1")
        check_value(len(a.lora.target_modules) > 0, "algo.lora.target_modules", "name at least one module")
    else:  # full fine-tuning (models.policies.AgentPolicies): what assumes LoRA adapters is refused
        check_value(t.rollout == "hf", "trainer.rollout", "vllm serves LoRA adapters on one base, but algo.lora=null "
                    "fully fine-tunes every policy: use trainer.rollout=hf")
        placement = OmegaConf.select(cfg, "algo.critic.placement")
        check_value(placement in (None, "separate"), "algo.critic.placement", f"{placement} puts the critic on "
                    "the actors' LoRA adapters, but algo.lora=null fully fine-tunes the actors: use "
                    "algo.critic.placement=separate")
    check_choice(cfg, "algo.lr_scheduler", ("constant", "cosine"))
    if "early_termination_rule" in a:
        check_choice(cfg, "algo.early_termination_rule", ("joint_action", "node_mean"))
    check_value(a.warmup_steps >= 0, "algo.warmup_steps", "must be >= 0")
    cap = a.get("rollout_is_cap")
    check_value(cap is None or cap >= 1, "algo.rollout_is_cap", f"{cap} is below 1: set it >= 1 (e.g. 2.0; a token "
                "both samplers agree on has weight 1) or null (no correction)")
    check_value(0.0 <= a.min_lr_ratio <= 1.0, "algo.min_lr_ratio", "must be in [0, 1]")
    ct = cfg.model.chat_template
    check_value(ct in ("auto", True, False), "model.chat_template", f"{ct!r} is not one of auto, true, false")
    check_value(ct is not False or not cfg.model.chat_template_kwargs, "model.chat_template_kwargs",
                "template options need the chat template: set model.chat_template=true or drop the options")
    if "data" in cfg.task:
        check_choice(cfg, "task.data.source", ("auto", "hub", "files", "packaged"))  # splits: configure.validate
    if "sandbox" in cfg.task:
        sb = cfg.task.sandbox
        check_value(sb.timeout_s > 0, "task.sandbox.timeout_s", "must be > 0")
        check_value(sb.memory_mb >= 64, "task.sandbox.memory_mb", "must be >= 64")
        check_value(sb.workers >= 1, "task.sandbox.workers", "must be >= 1")
        check_value(sb.get("isolation", "namespaces") in ("namespaces", "process"), "task.sandbox.isolation",
                    "must be namespaces (the default) or process (weaker: see docs/sandbox.md)")
        check_value(sb.get("tmp_mb", 64) >= 1, "task.sandbox.tmp_mb", "must be >= 1")
        check_value(sb.get("max_procs", 32) >= 1, "task.sandbox.max_procs",
                    f"{sb.get('max_procs')} allows no process: every program would fail (and every code reward be 0); "
                    "use >= 1 (default 32)")
        check_value(sb.get("max_output_bytes", 65536) >= 1, "task.sandbox.max_output_bytes",
                    f"{sb.get('max_output_bytes')} keeps no output: every program's output (the tool agent's "
                    "included) would be empty; use >= 1 (default 65536)")
    plan = cfg.get("plan")
    if plan is not None:  # marl-llm-plan's hardware and a run's plan (distributed/memory_plan.py)
        check_value(plan.gpus is None or plan.gpus >= 1, "plan.gpus",
                    f"{plan.gpus} GPUs hold nothing: plan for >= 1 GPU (plan.gpus=8), or leave it unset (1)")
        check_value(plan.gpu_gib is None or plan.gpu_gib > 0, "plan.gpu_gib",
                    f"{plan.gpu_gib} GiB per GPU holds nothing: give the GPU's memory in GiB > 0 (plan.gpu_gib=80), "
                    "or leave it unset (80)")
        check_value(plan.prompt_tokens >= 1, "plan.prompt_tokens", "must be >= 1 (the longest prompt, in tokens)")
    check_value(t.max_steps >= 0, "trainer.max_steps", "must be >= 0")
    check_value(t.peak_tflops is None or t.peak_tflops > 0, "trainer.peak_tflops",
                "must be > 0 (dense TFLOP/s of one device) or null (from the GPU's name)")
    check_value(t.prompts_per_step >= 1, "trainer.prompts_per_step", "must be >= 1")
    check_value(t.distributed_timeout_min > 0, "trainer.distributed_timeout_min", "must be > 0 (minutes)")
    check_value(t.completions_per_micro_batch >= 1, "trainer.completions_per_micro_batch", "must be >= 1")
    check_value(t.eval_every >= 0, "trainer.eval_every", "must be >= 0")
    check_choice(cfg, "trainer.eval_protocol", ("own", "paper"))
    check_choice(cfg, "trainer.data_order", ("shuffle", "in_order"))
    check_value(t.eval_interval >= 0, "trainer.eval_interval", "must be >= 0 (batches of an epoch; 0: none)")
    check_value(t.save_every >= 0, "trainer.save_every", "must be >= 0")
    check_value(t.get("history_every", 0) >= 0, "trainer.history_every", "must be >= 0 (0: no history)")
    check_value(t.get("history_keep") is None or t.history_keep >= 1, "trainer.history_keep",
                "must be >= 1 (the newest kept) or null (all)")
    check_value(t.eval_max_problems is None or t.eval_max_problems >= 1, "trainer.eval_max_problems",
                "must be >= 1 or null")
    check_value(t.eval_num_samples >= 0, "trainer.eval_num_samples", "must be >= 0")
    for k in t.eval_k:
        check_value(k >= 1, "trainer.eval_k", f"k={k} must be >= 1")
        check_value(k == 1 or k <= t.eval_num_samples, "trainer.eval_k",
                    f"pass@{k} needs trainer.eval_num_samples >= {k} (now {t.eval_num_samples})")
