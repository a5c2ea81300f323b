"""The memory plan: what a config takes per GPU, before anything loads.

    marl-llm-plan experiment=at_grpo_sokoban_qwen3_8b_paper plan.gpus=8 plan.gpu_gib=79.6

Every run prints the same plan first (training/setup.py), for its own world size and device, and
a run that cannot fit stops there, within seconds, with the plan and what to change.

The model's shapes come from its config alone (config.json, or the published values of the
presets' models: KNOWN_CONFIGS), its parameters counted on the meta device. Per GPU, in bytes
(P: a model's parameters, s: the ranks it is sharded over, c: the compute dtype's size, 2 for
bf16; m: a trained weight's size, 4 for fp32 master weights under a bf16 compute dtype, 2 with
trainer.master_weights=bf16; R: FSDP's root unit, the parameters outside the decoder layers):

    weights           trained models mP/s (master), frozen ones (a LoRA base, a KL reference)
                      P * dtype / s, LoRA adapters mA (whole on every rank)
    optimizer         AdamW's two moments, 2mP/s (2mA)
    runtime           on CUDA: the CUDA context, cuBLAS's workspaces and, with several processes,
                      NCCL's buffers (named constants in memory_terms.py, with their sources; not measured)
    gradients         mP/s of the policy being updated (freed after its step)
    rollout           every held policy whole in the compute dtype while FSDP has it unsharded
                      (cP; the largest unit gathered twice for a moment first), or one cast copy of
                      the decoding model (cP, autocast without FSDP); then the larger of the
                      prefill (distinct prompts x prompt tokens x (2 L kv + 3i + 2q + 2h)
                      elements: the prompts' KV and one layer's transients) and the decode: the
                      KV cache of the rows a generate call decodes (models/memory.kv_cache_bytes:
                      rows x (prompt + new tokens)) and its [rows, V] fp32 logits (x2). The rows
                      are trainer.sequences_per_generate, or as many as the runtime's KV budget
                      holds (rollout/decode.kv_chunks): the plan trims them as the run would. The
                      compiled static decode (CUDA) rounds a cache up and each decoding model keeps
                      its own until the rollout phase ends (rollout/static_step.py).
    update            the activations of one micro-batch, per token and layer 4h + 3q + 2q + 4i
                      (+ 2q + 2kv with Qwen3's q/k norms) elements (q = heads x head_dim; K/V are
                      repeated to q for attention), plus 3h outside the layers, over
                      completions_per_micro_batch x (prompt + new tokens) tokens, or, for k
                      siblings of one prompt, the prompt once and k completions (with the prompt's
                      K/V repeated k times); with gradient checkpointing h per layer plus one
                      layer's worth; the chunked LM head's [rows, V] fp32 logits x LOGIT_BUFFERS;
                      with FSDP two gathered layers and one's gradient, the root unit gathered
                      (cR) and the head's unsharded gradient; after the backward (where larger):
                      the root's gradients with their fp32 reduce-scatter input ((c + 4) R), and
                      AdamW's step (not fused, on the CPU: temporaries of its largest tensor)

    peak = weights + optimizer + runtime + max(rollout extras, gradients + update extras)

The terms, their figures and `estimate` live in memory_terms.py; this module reads a config into
them, says what to change when a plan does not fit, and plans a run. Checked on the CPU against
the measured peak memory of real training runs (LoRA, full
fine-tuning, FSDP on 2 gloo ranks, bf16 weights: scripts/measure_memory_plan.py,
results/memory_plan.md, tests/test_memory_plan.py) and of tiny models' tensors; the GPU-only
terms and the bf16 compute copies have not run on a GPU (docs/distributed.md lists each term and
its source).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from marl_llm.distributed.memory_terms import (GiB, Arch, Layout, Plan, Workload, arch, estimate, gib_text,
                                               is_fsdp_sharded, model_config)

# The chat template's tokens around a user message, beyond the message: SmolLM2's default system
# message and role headers are 30, Qwen3's headers fewer; the margin covers a truncation marker
# re-tokenized a token longer at its seam.
CHAT_TEMPLATE_TOKENS = 64


# --------------------------------------------------------------------------------- from a config
def workload(cfg: Any, agent_names: tuple[str, ...], device_type: str) -> Workload:
    """The numbers of a run's config (`device_type`: where it computes: the dtypes, fused AdamW)."""
    from marl_llm.distributed.placement import policy_count

    a, t, m = cfg.algo, cfg.trainer, cfg.model
    dtype = m.dtype if m.dtype != "auto" else ("bfloat16" if device_type == "cuda" else "float32")
    frozen = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    full = a.get("lora", None) is None
    critic = a.get("critic")
    separate = (1 if a.name == "collm_cc" else len(agent_names)) if critic is not None and \
        critic.get("placement") == "separate" else 0
    adapter_critics = (1 if a.name == "collm_cc" else len(agent_names)) if critic is not None and \
        critic.get("placement") == "adapter" else 0
    policies = policy_count(agent_names, a)
    sampling = a.get("sampling") or {}
    ckpt = t.gradient_checkpointing
    return Workload(
        policies=policies, full=full, compute_bytes=min(frozen, 4),
        # bf16 master weights (trainer.master_weights=bf16): the trained weights in the model's dtype.
        master_bytes=frozen if t.get("master_weights", "fp32") == "bf16" else 4 if full or frozen < 4 else frozen,
        frozen_bytes=frozen, adapters=0 if full else policies + adapter_critics,
        references=1 if full and float(a.get("kl_coef", 0.0) or 0.0) > 0 else 0, separate_critics=separate,
        rows=int(t.sequences_per_generate), prompt_tokens=prompt_tokens(cfg),
        new_tokens=int(sampling.get("max_new_tokens", 256)), micro_batch=int(t.completions_per_micro_batch),
        checkpointing=ckpt is True,  # auto: for_config, which knows the model's size
        siblings=int(a.get("num_generations") or a.get("num_branches") or 1),
        fused_optimizer=device_type == "cuda", trains=int(t.max_steps) > 0, device_type=device_type,
        kv_cache_gib=None if t.get("kv_cache_gib", "auto") == "auto" else float(t.kv_cache_gib))


def prompt_tokens(cfg: Any) -> int:
    """The longest prompt the plan budgets for: plan.prompt_tokens, or, for a task that caps its
    prompts in tokens (task=env's max_observation_tokens), that cap and the chat template around it."""
    cap = (cfg.get("task") or {}).get("max_observation_tokens")
    if cap is not None:
        return int(cap) + CHAT_TEMPLATE_TOKENS
    return int((cfg.get("plan") or {}).get("prompt_tokens", 512))


def layout(cfg: Any, ranks: int, policies: int) -> Layout:
    """Where the models sit on `ranks` GPUs under the config's placement (the fullest GPU)."""
    from marl_llm.distributed.placement import group_sizes

    t = cfg.trainer
    fsdp = bool(t.fsdp) and ranks > 1
    mode = t.placement
    if mode == "groups":
        sizes = group_sizes(t.placement_groups, policies, ranks)
        smallest = min(sizes) if sizes else 1
        # The fullest GPU holds one policy, sharded over the smallest group.
        return Layout(ranks, mode, [smallest] + [0] * (policies - 1), ranks if fsdp else 1, fsdp, t.fsdp_unshard_rollout)
    if mode == "devices":
        per_device = math.ceil(policies / max(ranks, 1))
        return Layout(ranks, mode, [1] * per_device + [0] * (policies - per_device), 1, False)
    return Layout(ranks, mode, [ranks if fsdp else 1] * policies, ranks if fsdp else 1, fsdp, t.fsdp_unshard_rollout)


def for_config(cfg: Any, agent_names: tuple[str, ...], gpus: int, gpu_bytes: int | None,
               device_type: str = "cuda") -> Plan:
    """The plan of a config on `gpus` GPUs of `gpu_bytes` (None: the fit is not checked)."""
    a = arch(model_config(cfg.model))
    w = workload(cfg, agent_names, device_type)
    if not w.full:
        lora = cfg.algo.lora
        w.adapter_params = a.adapter_params(int(lora.r), list(lora.target_modules))
        w.all_linear = list(lora.target_modules) == ["all-linear"]
    if cfg.trainer.gradient_checkpointing == "auto":  # training/setup.gradient_checkpointing
        w.checkpointing = device_type == "cuda" and a.params >= 4e9
    lay = layout(cfg, gpus, w.policies)
    lay.shards = lay.shards + [lay.frozen_shards] * w.separate_critics
    w.compiled_decode = compiled_decode(cfg, a, device_type, lay)
    plan = estimate(a, w, lay, gpu_bytes)
    if plan.fits is False:
        plan.notes += advice(cfg, agent_names, plan, device_type)
    return plan


def compiled_decode(cfg: Any, a: Arch, device_type: str, lay: Layout) -> bool:
    """Whether the run decodes with the compiled static step (rollout/decode.resolve_decode, for the
    model's config: full attention in every layer)."""
    from types import SimpleNamespace

    from marl_llm.rollout.decode import resolve_decode
    from marl_llm.rollout.static_step import full_attention_only

    t = cfg.trainer
    if t.get("rollout", "hf") != "hf":
        return False
    full = full_attention_only(SimpleNamespace(config=a.config))  # it reads a model's config
    return all(resolve_decode(t.get("decode", "dynamic"), t.get("compile_decode", False), device_type, full,
                              is_fsdp_sharded(lay)))


def advice(cfg: Any, agent_names: tuple[str, ...], plan: Plan, device_type: str) -> list[str]:
    """What to change so that the plan fits: the smallest sets of changes (more GPUs, FSDP,
    gradient checkpointing, fewer rows per generate call, smaller micro-batches, decoding on the
    shards, LoRA), each checked against the same plan; the fewest GPUs and the most rows that fit."""
    from itertools import combinations

    from omegaconf import OmegaConf

    def fits(overrides: dict[str, Any], gpus: int) -> bool:
        c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        for key, value in overrides.items():
            OmegaConf.update(c, key, value, force_add=True)
        w = workload(c, agent_names, device_type)
        if not w.full:
            w.adapter_params = plan.arch.adapter_params(int(c.algo.lora.r), list(c.algo.lora.target_modules))
            w.all_linear = list(c.algo.lora.target_modules) == ["all-linear"]
        if c.trainer.gradient_checkpointing == "auto":
            w.checkpointing = device_type == "cuda" and plan.arch.params >= 4e9
        lay = layout(c, gpus, w.policies)
        lay.shards = lay.shards + [lay.frozen_shards] * w.separate_critics
        w.compiled_decode = compiled_decode(c, plan.arch, device_type, lay)
        return bool(estimate(plan.arch, w, lay, plan.gpu_bytes).fits)

    t = cfg.trainer
    # Each kind of change: its choices, least disruptive first, as (overrides, GPUs, words).
    kinds: list[list[tuple[dict[str, Any], int | None, str]]] = []
    kinds.append([({"trainer.fsdp": True}, n, f"{n} GPUs with trainer.fsdp=true")
                  for n in (2, 4, 8, 16, 32, 64) if n > plan.gpus or (n == plan.gpus and not t.fsdp)])
    if t.gradient_checkpointing is not True:
        kinds.append([({"trainer.gradient_checkpointing": True}, None, "trainer.gradient_checkpointing=true")])
    kinds.append([({"trainer.sequences_per_generate": r}, None, f"trainer.sequences_per_generate={r}")
                  for r in (32, 16, 8, 4, 2, 1) if r < t.sequences_per_generate])
    kinds.append([({"trainer.completions_per_micro_batch": m}, None, f"trainer.completions_per_micro_batch={m}")
                  for m in (8, 4, 2, 1) if m < t.completions_per_micro_batch])
    if t.fsdp_unshard_rollout:
        kinds.append([({"trainer.fsdp_unshard_rollout": False}, None,
                       "trainer.fsdp_unshard_rollout=false (decode on the shards)")])
    if plan.work.full:
        lora = {"r": 64, "alpha": 128, "dropout": 0.0, "target_modules": ["all-linear"]}
        kinds.append([({"algo.lora": lora}, None, "LoRA instead of full fine-tuning (algo.lora.r=64)")])
    found: list[str] = []
    kinds = [k for k in kinds if k]
    for size in (1, 2, 3, 4):
        for subset in combinations(kinds, size):
            choice = _first_fitting(subset, plan.gpus, fits)
            if choice:
                found.append(choice)
        if found:
            break
    if not found:
        return ["nothing in reach fits: a smaller model, or larger GPUs"]
    return ["to fit: " + "; or ".join(found[:3])]


def _first_fitting(kinds: tuple, gpus: int, fits: Any) -> str | None:
    """The first combination (one choice per kind, in order) that fits, in words."""
    from itertools import product

    for choice in product(*kinds):
        overrides: dict[str, Any] = {}
        n = gpus
        for changes, want, _ in choice:
            overrides.update(changes)
            n = want or n
        if fits(overrides, n):
            return ", ".join(words for _, _, words in choice)
    return None


def for_run(cfg: Any, agent_names: tuple[str, ...], world_size: int, device: torch.device) -> Plan | str:
    """The plan of this run (every run prints it first): its own processes (or, with
    placement=devices, its devices), each of its GPU's memory (on the CPU: plan.gpu_gib, when set).
    A string says why there is none (a model whose config cannot be read)."""
    gpus = world_size
    if cfg.trainer.placement == "devices":
        gpus = len(cfg.trainer.placement_devices or []) or max(torch.cuda.device_count(), 1)
    if device.type == "cuda":
        gpu_bytes = torch.cuda.get_device_properties(device.index or 0).total_memory
    else:
        gib = cfg.get("plan", {}).get("gpu_gib")
        gpu_bytes = None if gib is None else int(float(gib) * GiB)
    try:
        return for_config(cfg, agent_names, gpus, gpu_bytes, device.type)
    except Exception as err:  # noqa: BLE001  (the plan informs; a config it cannot read must not stop the run)
        return f"memory plan: not available ({type(err).__name__}: {str(err)[:160]})"


def refusal(plan: Plan) -> str:
    """The one line a run that does not fit stops with (its plan printed just before)."""
    advice = "; ".join(n.removeprefix("to fit: ") for n in plan.notes)
    return (f"the memory plan above does not fit: {plan.peak / GiB:.1f} GiB per GPU on {plan.gpus} GPU(s) of "
            f"{gib_text(plan.gpu_bytes)} GiB; {advice} (or plan.check=false to try anyway)")
