"""The memory plan: what a config takes per GPU, before anything loads.

    marl-llm-plan experiment=at_grpo_sokoban_qwen3_8b_paper plan.gpus=8 plan.gpu_gib=80

Every run prints the same plan first (training/setup.py), for its own world size and device, and
a run that cannot fit stops there, within seconds, with the plan and what to change.

The model's shapes come from its config alone (config.json, or the published values of the
presets' models: KNOWN_CONFIGS), its parameters counted on the meta device. Per GPU, in bytes
(P: a model's parameters, s: the ranks it is sharded over, c: the compute dtype's size, 2 for
bf16; m: a trained weight's size, 4 for fp32 master weights under a bf16 compute dtype, 2 with
trainer.master_weights=bf16):

    weights           trained models mP/s (master), frozen ones (a LoRA base, a KL reference)
                      P * dtype / s, LoRA adapters mA (whole on every rank)
    optimizer         AdamW's two moments, 2mP/s (2mA)
    gradients         mP/s of the policy being updated (freed after its step)
    rollout           every held policy whole in the compute dtype while FSDP has it unsharded
                      (cP), or one cast copy of the decoding model (cP, autocast without FSDP);
                      the larger of the prefill (rows x prompt tokens x (2 L kv + 3i + 2q + 2h)
                      elements: the prompts' KV and one layer's transients) and the decode: the
                      KV cache of the rows a generate call decodes (models/memory.kv_cache_bytes:
                      rows x (prompt + new tokens)) and its [rows, V] fp32 logits (x2)
    update            the activations of one micro-batch (completions_per_micro_batch sequences of
                      prompt + new tokens), per token and layer  4h + 3q + 2q + 4i
                      (+ 2q + 2kv with Qwen3's q/k norms) elements (q = heads x head_dim; K/V are
                      repeated to q for attention), plus 3h outside the layers; with gradient
                      checkpointing h per layer plus one layer's worth; the chunked LM head's
                      [rows, V] fp32 logits x LOGIT_BUFFERS; with FSDP three gathered layers
                      (two in the compute dtype, one's gradient); AdamW's foreach step (not fused:
                      on the CPU) one copy of the shard in the weights' dtype

    peak = weights + optimizer + max(rollout extras, gradients + update extras)

The activation terms were measured on the CPU (float32, SDPA's math kernel: tests/test_memory_plan.py
checks the whole plan against the measured peak of tiny models, within 15%); on a GPU flash
attention keeps less, a bf16 RMSNorm keeps fp32 copies and the CUDA allocator adds slack: the GPU
figures are not measured yet. What has run on a GPU: docs/gpu.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

GiB = 2**30
# Buffers of the chunked LM head's [rows, V] fp32 logits alive at its peak (logits, softmax, their
# gradients), measured on the CPU (see the module docstring).
LOGIT_BUFFERS = 3
LOGIT_CHUNK_ELEMENTS = 1 << 24  # models/scoring.py's chunk (rows x V)

# The presets' models as published (config.json), for plans without the hub.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False),
    "Qwen/Qwen3-4B-Instruct-2507": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728,
                                        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                        head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                            tie_word_embeddings=True),
    "Qwen/Qwen2.5-Coder-3B": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008,
                                  num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                                  vocab_size=151936, tie_word_embeddings=True),
}


# ------------------------------------------------------------------------------------ the model
@dataclass
class Arch:
    """A model's shapes and parameter counts (from its config)."""

    config: Any
    params: int
    layer_params: int  # one decoder layer
    hidden: int
    intermediate: int
    layers: int
    q: int  # heads x head_dim
    kv: int  # K/V heads x head_dim
    vocab: int
    qk_norm: bool
    linear_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # per layer: name -> (in, out)

    def adapter_params(self, r: int, targets: list[str]) -> int:
        """LoRA parameters of one adapter of rank r on `targets` (["all-linear"]: every linear of
        the layers), over all layers."""
        names = self.linear_shapes if targets == ["all-linear"] else {n: s for n, s in self.linear_shapes.items()
                                                                       if n in targets}
        return self.layers * sum(r * (i + o) for i, o in names.values())

    def activation_elements(self, frozen_linears: bool = False) -> int:
        """Elements one token keeps for the backward in one decoder layer (module docstring).
        `frozen_linears`: LoRA on some of the linears only (q and v, say): a frozen linear keeps
        no input, nor does a frozen norm's weight product (one h, one q and one i less)."""
        full = 4 * self.hidden + 3 * self.q + 2 * self.q + 4 * self.intermediate \
            + (2 * self.q + 2 * self.kv if self.qk_norm else 0)
        return full - (self.hidden + self.q + self.intermediate if frozen_linears else 0)


def arch(config: Any) -> Arch:
    """`config`'s shapes, its parameters counted on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kinds = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    first = layers[0]
    shapes = {n.rsplit(".", 1)[-1]: (m.in_features, m.out_features) for n, m in first.named_modules()
              if isinstance(m, torch.nn.Linear)}
    return Arch(config, sum(p.numel() for p in model.parameters()), sum(p.numel() for p in first.parameters()),
                text.hidden_size, text.intermediate_size, len(layers), heads * head_dim,
                (getattr(text, "num_key_value_heads", None) or heads) * head_dim, text.vocab_size,
                any("q_norm" in n for n, _ in first.named_modules()), shapes)


def model_config(model_cfg: Any) -> Any:
    """The transformers config of `model` (config section): a local checkpoint's config.json, the
    embedded model's, a preset model's published values, or the hub's (its cache offline)."""
    from transformers import AutoConfig

    spec = (list(model_cfg.agent_bases)[0] if model_cfg.get("agent_bases") else None)
    if spec is None:
        spec = model_cfg.path or ("embedded" if model_cfg.embedded else model_cfg.hub_id)
    if spec == "embedded":
        from marl_llm.models.loading import embedded_checkpoint

        spec = embedded_checkpoint()
    if spec in KNOWN_CONFIGS:
        known = dict(KNOWN_CONFIGS[spec])
        return AutoConfig.for_model(known.pop("model_type"), **known)
    return AutoConfig.from_pretrained(str(spec), trust_remote_code=bool(model_cfg.get("trust_remote_code")))


# --------------------------------------------------------------------------------- the workload
@dataclass
class Workload:
    """What a run holds and computes, in numbers (`from_config` reads them off a config)."""

    policies: int  # trained policies
    full: bool  # full fine-tuning (each policy its own model) or LoRA adapters on one base
    compute_bytes: int  # the compute dtype's size (2: bf16 autocast over fp32 master weights)
    master_bytes: int  # a trained weight's, its gradient's and each AdamW moment's (4: fp32; 2: master_weights=bf16)
    frozen_bytes: int  # the model dtype's (a LoRA base, a KL reference)
    adapter_params: int = 0  # per LoRA adapter
    adapters: int = 0  # LoRA adapters (critics' included)
    references: int = 0  # frozen KL reference copies (full fine-tuning)
    separate_critics: int = 0  # critics with a model of their own (fully trained)
    rows: int = 32  # sequences per generate call
    prompt_tokens: int = 512
    new_tokens: int = 256
    micro_batch: int = 4  # completions per forward/backward pass
    checkpointing: bool = False
    fused_optimizer: bool = False  # AdamW fused (CUDA): no fp32 temporary in its step
    trains: bool = True
    all_linear: bool = False  # LoRA on every linear layer (else on some: frozen ones keep no input)
    device_type: str = "cuda"  # where it computes


@dataclass
class Layout:
    """How the models are spread: `ranks` GPUs; `shards[m]` the ranks trained model m (a policy,
    then the separate critics) is sharded over on the fullest GPU; frozen models sharded over
    `frozen_shards`; `unshard_rollout`: FSDP gathers the held policies for the rollout."""

    ranks: int
    placement: str
    shards: list[int]
    frozen_shards: int
    fsdp: bool
    unshard_rollout: bool = True


@dataclass
class Plan:
    """Bytes per GPU by term, in the rollout and in the update, for the fullest GPU."""

    gpus: int
    gpu_bytes: int | None
    layout: Layout
    work: Workload
    arch: Arch
    weights: int = 0
    optimizer: int = 0
    rollout_weights: int = 0  # gathered / cast copies while decoding
    kv: int = 0
    decode: int = 0
    prefill: int = 0  # the prompts' forward pass: their KV and one layer's transients
    gradients: int = 0
    activations: int = 0
    activations_other: int = 0  # with the other gradient checkpointing setting
    update_transients: int = 0  # FSDP's gathered layers, the LM head's chunk, the optimizer step
    notes: list[str] = field(default_factory=list)

    @property
    def rollout_peak(self) -> int:
        return self.weights + self.optimizer + self.rollout_weights + max(self.prefill, self.kv + self.decode)

    @property
    def update_peak(self) -> int:
        return self.weights + self.optimizer + self.gradients + self.activations + self.update_transients \
            if self.work.trains else 0

    @property
    def peak(self) -> int:
        return max(self.rollout_peak, self.update_peak)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_bytes is None else self.peak <= self.gpu_bytes

    def lines(self) -> list[str]:
        w, lay = self.work, self.layout
        kind = "full fine-tuning" if w.full else f"LoRA ({w.adapters} adapters)"
        # A CPU run without plan.gpu_gib (no GPU size to check against) has processes, not GPUs.
        gpu = w.device_type == "cuda" or self.gpu_bytes is not None
        unit, units = ("GPU", "GPUs") if gpu else ("process", "processes")
        where = f"{self.gpus} {unit if self.gpus == 1 else units}" + (
            f" of {self.gpu_bytes / GiB:.0f} GiB" if self.gpu_bytes else "")
        shard = f", FSDP over {max(lay.shards or [lay.frozen_shards])}" if lay.fsdp and lay.ranks > 1 else ""
        size = f"{self.arch.params / 1e9:.2f}B" if self.arch.params >= 1e9 else f"{self.arch.params / 1e6:.1f}M"
        head = (f"memory plan: {w.policies} {'policies' if w.policies > 1 else 'policy'} of {size} ({kind}) on "
                f"{where}, placement={lay.placement}{shard}; per {unit}:")

        def g(b: int) -> str:
            return f"{b / GiB:8.2f}"

        ckpt = "on" if w.checkpointing else "off"
        rows = [
            ("weights + master weights", self.weights + self.rollout_weights, self.weights),
            ("gradients + optimizer states", self.optimizer, self.optimizer + self.gradients),
            (f"KV cache ({w.rows} rows x {w.prompt_tokens + w.new_tokens} tokens)", max(self.prefill, self.kv + self.decode),
             0),
            (f"activations (checkpointing {ckpt}; {'off' if w.checkpointing else 'on'}: "
             f"{self.activations_other / GiB:.2f})", 0, self.activations + self.update_transients),
        ]
        out = [head, f"  {'GiB':46s}{'rollout':>10s}{'update':>10s}"]
        out += [f"  {name:46s}{g(a):>10s}{g(b) if w.trains else '       -':>10s}" for name, a, b in rows]
        verdict = ("" if self.fits is None else " fits" if self.fits else
                   f" DOES NOT FIT in {self.gpu_bytes / GiB:.0f} GiB")
        out.append(f"  {'peak':46s}{g(self.rollout_peak):>10s}{g(self.update_peak) if w.trains else '       -':>10s}"
                   f"  -> {self.peak / GiB:.2f} GiB{verdict}")
        return out + [f"  {n}" for n in self.notes]


def estimate(a: Arch, w: Workload, lay: Layout, gpu_bytes: int | None = None) -> Plan:
    """The plan of workload `w` on layout `lay` (see the module docstring)."""
    p = Plan(lay.ranks, gpu_bytes, lay, w, a)
    trained = [a.params] * (w.policies if w.full else 0) + [a.params] * w.separate_critics
    shards = lay.shards or [1] * len(trained)
    held = [(n, s) for n, s in zip(trained, shards) if s > 0]
    p.weights = sum(w.master_bytes * n // s for n, s in held)
    p.weights += w.frozen_bytes * a.params * ((0 if w.full else 1) + w.references) // lay.frozen_shards
    # AdamW's two moments and the gradients follow the trained weights' dtype (trainer.master_weights).
    p.weights += w.master_bytes * w.adapter_params * w.adapters
    p.optimizer = sum(2 * w.master_bytes * n // s for n, s in held) + 2 * w.master_bytes * w.adapter_params * w.adapters
    largest = max((n // s for n, s in held), default=0)
    p.gradients = w.master_bytes * (largest if w.full or w.separate_critics else w.adapter_params)
    policies_held = held[:w.policies] if w.full else []
    if lay.fsdp and lay.ranks > 1 and lay.unshard_rollout:
        p.rollout_weights = sum(w.compute_bytes * n for n, s in policies_held if s > 1)
        if not w.full:
            p.rollout_weights += w.frozen_bytes * a.params * (lay.frozen_shards - 1) // lay.frozen_shards
    elif w.full and w.compute_bytes < w.master_bytes:
        p.rollout_weights = w.compute_bytes * a.params  # autocast's cast copy of the decoding model
    from marl_llm.models.memory import kv_cache_bytes

    compute = {2: torch.bfloat16, 4: torch.float32}[w.compute_bytes]
    p.kv = kv_cache_bytes(a.config, compute, w.rows * (w.prompt_tokens + w.new_tokens))
    p.decode = 2 * 4 * w.rows * a.vocab
    p.prefill = w.rows * w.prompt_tokens * (2 * a.layers * a.kv + 3 * a.intermediate + 2 * a.q + 2 * a.hidden) \
        * w.compute_bytes
    tokens = w.micro_batch * (w.prompt_tokens + w.new_tokens)
    per_layer = a.activation_elements(frozen_linears=not w.full and not w.all_linear)
    # A recomputed layer, with the gradients flowing through it, takes a whole layer's worth even
    # where frozen linears keep nothing.
    # A bf16 RMSNorm upcasts its input to fp32 and keeps that copy (4 bytes an element) beside its bf16
    # output (2), where the elements count 2 x 2: 2 more bytes per element it normalizes, per token
    # (a layer's two norms of h, Qwen3's q and k norms of q and kv, and the final norm).
    norm_elements = 2 * a.hidden + (a.q + a.kv if a.qk_norm else 0)
    norm_extra = 2 * norm_elements if w.compute_bytes == 2 else 0
    layer = tokens * (a.activation_elements() * w.compute_bytes + norm_extra)
    full_acts = tokens * ((a.layers * per_layer + 3 * a.hidden) * w.compute_bytes + a.layers * norm_extra
                          + (2 * a.hidden if w.compute_bytes == 2 else 0))
    ckpt_acts = tokens * (a.layers + 3) * a.hidden * w.compute_bytes + layer  # inputs kept, one layer recomputed
    p.activations, p.activations_other = (ckpt_acts, full_acts) if w.checkpointing else (full_acts, ckpt_acts)
    chunk_rows = min(w.micro_batch * w.new_tokens, max(1, LOGIT_CHUNK_ELEMENTS // a.vocab))
    head = LOGIT_BUFFERS * 4 * chunk_rows * a.vocab
    # The LM head's chunk runs after the last layer: with every activation kept it adds to them; with
    # checkpointing it and the recomputed layer come one after the other.
    head_extra = max(0, head - layer) if w.checkpointing else head
    gathered = 3 * a.layer_params * w.compute_bytes if lay.fsdp and lay.ranks > 1 else 0
    step = 0 if w.fused_optimizer else w.master_bytes * (largest if (w.full or w.separate_critics) else w.adapter_params)
    p.update_transients = max(head_extra + gathered, step - p.activations)
    return p


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
        rows=int(t.sequences_per_generate), prompt_tokens=int(cfg.get("plan", {}).get("prompt_tokens", 512)),
        new_tokens=int(sampling.get("max_new_tokens", 256)), micro_batch=int(t.completions_per_micro_batch),
        checkpointing=ckpt is True,  # auto: for_config, which knows the model's size
        fused_optimizer=device_type == "cuda", trains=int(t.max_steps) > 0, device_type=device_type)


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
    plan = estimate(a, w, lay, gpu_bytes)
    if plan.fits is False:
        plan.notes += advice(cfg, agent_names, plan, device_type)
    return plan


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
            f"{plan.gpu_bytes / GiB:.0f} GiB; {advice} (or plan.check=false to try anyway)")
