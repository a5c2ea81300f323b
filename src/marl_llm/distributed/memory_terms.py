"""The memory plan's terms (distributed/memory_plan.py reads a config into them): the figures it
counts with, each a named constant with its source; a model's shapes (`Arch`, from its config
alone); a run's workload and layout; and `estimate`, the bytes per GPU each phase holds, term by
term (`Plan`). The formula, in words: memory_plan.py's docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# The rollout's KV budget, mirrored: trainer.kv_cache_gib=auto lets a generate call's cache take
# this share of the GPU memory free when it starts (rollout/decode.py cuts its rows to fit).
from marl_llm.models.memory import CUDA_FREE_SHARE, kv_cache_bytes

GiB = 2**30
MiB = 2**20

# --- The LM head in the update (models/scoring.py applies it in chunks of [rows, V] fp32 logits).
# Buffers of one chunk alive at its peak (its logits, their exponentials, the softmax for the
# entropy, the logits' gradient): measured 5.0 at SmolLM2's 49,152-token vocabulary, frozen or
# trained head, with or without the entropy (scoring.py: ~21 bytes per element), checked by
# tests/test_memory_plan.py's head test.
LOGIT_BUFFERS = 5

# --- The optimizer step. On the CPU torch steps AdamW one tensor at a time (its foreach kernels
# are CUDA's): a tensor's step holds two temporaries of its size (the square root of the second
# moment and the denominator made from it): measured 2.0x the largest tensor (the embedding: the
# first parameter, so no earlier tensor's denominator is still referenced beside it; equal tensors
# in a row reach 3.0x their size). tests/test_memory_plan.py. On CUDA AdamW is fused
# (models/policies.adamw_kwargs): one kernel, no temporaries.
SINGLE_TENSOR_STEP_TEMPORARIES = 2

# --- What a CPU run's process holds beyond its tensors, from the imports on: its tokenizers (the
# tokenizers library's first load with SmolLM2's 49k-token vocabulary: 99 MiB of RSS, a second
# tokenizer 13 MiB), the run's Python objects, the allocator's small blocks. Measured 57 MiB over
# the tensors' own peak in the rollouts of scripts/measure_memory_plan.py's runs (results/
# memory_plan.md); counted at 64 MiB per process. On a GPU this is host memory, not the GPU's.
CPU_PROCESS_BYTES = 64 * MiB

# --- What a CUDA process holds outside its tensors (counted only when the plan is for CUDA).
# The CUDA context: PyTorch measured 287,047,680 bytes (274 MiB) with lazy module loading, against
# 666,632,192 eager (pytorch/pytorch#86509; lazy loading is CUDA's default since 12.2, PyTorch's
# since 1.13); the kernels a training run loads into it as they first run (cuBLAS's, attention's,
# NCCL's) add to that, so a process is counted at 512 MiB. Not measured here (no GPU).
CUDA_CONTEXT_BYTES = 512 * MiB
# cuBLAS and cuBLASLt keep a workspace per handle and stream: 32 MiB each on Hopper (cuBLAS's
# recommendation, PyTorch's default since pytorch/pytorch#120925), through torch's allocator.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MiB
# NCCL's buffers, per communicator (every multi-GPU run: the world group). Per channel and per
# peer a rank receives from, one buffer per protocol: SIMPLE 4 MiB (NCCL_BUFFSIZE's default,
# DEFAULT_BUFFSIZE in NCCL's src/init.cc), LL128 4.69 MiB (120 elements x 640 threads x 8 steps x
# 8 bytes) and LL 0.5 MiB (8 lines x 512 threads x 8 steps x 16 bytes); counted for NCCL's
# MAXCHANNELS (32) channels of two peers each (a ring's: previous and next): 588 MiB. NVLS
# (NVSwitch reductions) and user buffer registration add more where NCCL turns them on. Not measured here.
NCCL_BUFFER_BYTES_PER_CHANNEL_PEER = 4 * MiB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
NCCL_CHANNELS = 32
NCCL_PEERS_PER_CHANNEL = 2
NCCL_BUFFER_BYTES = NCCL_CHANNELS * NCCL_PEERS_PER_CHANNEL * NCCL_BUFFER_BYTES_PER_CHANNEL_PEER

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
    largest: int = 0  # the largest parameter tensor's elements (the embedding)
    tied: bool = True  # the LM head is the embedding

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (embeddings, final norm, LM head): FSDP's root unit."""
        return self.params - self.layers * self.layer_params

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

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
    params = list(model.parameters())  # tied weights once
    return Arch(config, sum(p.numel() for p in params), sum(p.numel() for p in first.parameters()),
                text.hidden_size, text.intermediate_size, len(layers), heads * head_dim,
                (getattr(text, "num_key_value_heads", None) or heads) * head_dim, text.vocab_size,
                any("q_norm" in n for n, _ in first.named_modules()), shapes, max(p.numel() for p in params),
                model.get_output_embeddings() is None
                or model.get_output_embeddings().weight is model.get_input_embeddings().weight)


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
    rows: int = 32  # sequences per generate call (trainer.sequences_per_generate)
    prompt_tokens: int = 512
    new_tokens: int = 256
    micro_batch: int = 4  # completions per forward/backward pass
    # Completions sampled from one prompt (algo.num_generations, algo.num_branches; 1: the
    # actor-critic methods' one trajectory per environment). Siblings are prefilled once in the
    # rollout, and a micro-batch of siblings encodes their prompt once (rollout/decode.py).
    siblings: int = 1
    checkpointing: bool = False
    fused_optimizer: bool = False  # AdamW fused (CUDA): no temporaries in its step
    kv_cache_gib: float | None = None  # trainer.kv_cache_gib (None: auto, a share of the free memory)
    # The compiled static decode step (trainer.decode / compile_decode on CUDA, rollout/decode.
    # resolve_decode): its caches are rounded up and each model keeps its own until the rollout ends.
    compiled_decode: bool = False
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
    runtime: int = 0  # CUDA: its context, cuBLAS's workspaces, NCCL's buffers; the CPU: the process's own
    rollout_weights: int = 0  # gathered / cast copies while decoding
    gather: int = 0  # FSDP's all-gather of the largest unit at the rollout's start (before any KV cache)
    rows_per_call: int = 0  # rows a generate call decodes: trainer.sequences_per_generate, or what the KV budget holds
    kv: int = 0
    decode: int = 0
    prefill: int = 0  # the prompts' forward pass: their KV and one layer's transients
    gradients: int = 0
    activations: int = 0
    activations_other: int = 0  # with the other gradient checkpointing setting
    # The update peaks at the backward's start (every activation kept, the LM head's chunk, FSDP's
    # gathered units: `update_transients`; no gradient yet, the head's aside) or at its end (every
    # gradient, with a recomputed layer, the root unit's reduce-scatter or AdamW's temporaries:
    # `after_backward`), whichever is larger.
    update_transients: int = 0
    after_backward: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def held(self) -> int:
        """What both phases hold: weights, optimizer states, the process's runtime (CUDA's, or the CPU process's)."""
        return self.weights + self.optimizer + self.runtime

    @property
    def rollout_extra(self) -> int:
        """The rollout's largest moment beyond its weights: FSDP's gather, the prefill or the decode."""
        return max(self.gather, self.prefill, self.kv + self.decode)

    @property
    def rollout_peak(self) -> int:
        return self.held + self.rollout_weights + self.rollout_extra

    @property
    def peaks_at_backward_start(self) -> bool:
        return self.activations + self.update_transients >= self.gradients + self.after_backward

    @property
    def update_peak(self) -> int:
        if not self.work.trains:
            return 0
        return self.held + max(self.activations + self.update_transients, self.gradients + self.after_backward)

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
            f" of {gib_text(self.gpu_bytes)} GiB" if self.gpu_bytes else "")
        shard = f", FSDP over {max(lay.shards or [lay.frozen_shards])}" if lay.fsdp and lay.ranks > 1 else ""
        size = f"{self.arch.params / 1e9:.2f}B" if self.arch.params >= 1e9 else f"{self.arch.params / 1e6:.1f}M"
        head = (f"memory plan: {w.policies} {'policies' if w.policies > 1 else 'policy'} of {size} ({kind}) on "
                f"{where}, placement={lay.placement}{shard}; per {unit}:")

        def g(b: int) -> str:
            return f"{b / GiB:8.2f}"

        ckpt = "on" if w.checkpointing else "off"
        # The update's column is its peak moment's: the backward's start (no gradients yet) or its end.
        start = self.peaks_at_backward_start
        update_extra = self.activations + self.update_transients if start else self.after_backward
        rows = [
            ("weights + master weights", self.weights + self.rollout_weights, self.weights),
            ("gradients + optimizer states", self.optimizer, self.optimizer + (0 if start else self.gradients)),
            (f"KV cache ({self.rows_per_call} rows x {w.prompt_tokens + w.new_tokens} tokens)", self.rollout_extra, 0),
            (f"activations (checkpointing {ckpt}; {'off' if w.checkpointing else 'on'}: "
             f"{self.activations_other / GiB:.2f})", 0, update_extra),
        ]
        if self.runtime:
            name = "CUDA context, cuBLAS, NCCL buffers" if w.device_type == "cuda" else "process (tokenizers, Python)"
            rows.append((name, self.runtime, self.runtime))
        out = [head, f"  {'GiB':46s}{'rollout':>10s}{'update':>10s}"]
        out += [f"  {name:46s}{g(a):>10s}{g(b) if w.trains else '       -':>10s}" for name, a, b in rows]
        verdict = ("" if self.fits is None else " fits" if self.fits else
                   f" DOES NOT FIT in {gib_text(self.gpu_bytes)} GiB")
        out.append(f"  {'peak':46s}{g(self.rollout_peak):>10s}{g(self.update_peak) if w.trains else '       -':>10s}"
                   f"  -> {self.peak / GiB:.2f} GiB{verdict}")
        return out + [f"  {n}" for n in self.notes]


def gib_text(nbytes: int) -> str:
    """A GPU's size in GiB as a person writes it: 80, 79.6, 0.001."""
    return f"{nbytes / GiB:.4g}"


def estimate(a: Arch, w: Workload, lay: Layout, gpu_bytes: int | None = None) -> Plan:
    """The plan of workload `w` on layout `lay` (see the module docstring)."""
    p = Plan(lay.ranks, gpu_bytes, lay, w, a)
    trained = [a.params] * (w.policies if w.full else 0) + [a.params] * w.separate_critics
    shards = lay.shards or [1] * len(trained)
    held = [(n, s) for n, s in zip(trained, shards) if s > 0]
    m = w.master_bytes
    p.weights = sum(m * n // s for n, s in held)
    p.weights += w.frozen_bytes * a.params * ((0 if w.full else 1) + w.references) // lay.frozen_shards
    # AdamW's two moments and the gradients follow the trained weights' dtype (trainer.master_weights).
    p.weights += m * w.adapter_params * w.adapters
    p.optimizer = sum(2 * m * n // s for n, s in held) + 2 * m * w.adapter_params * w.adapters
    whole_models_train = w.full or w.separate_critics > 0
    p.gradients = m * (max((n // s for n, s in held), default=0) if whole_models_train else w.adapter_params)
    if w.device_type == "cuda":
        # Several processes talk through NCCL; placement=devices is one process over its GPUs.
        nccl = lay.ranks > 1 and lay.placement != "devices"
        p.runtime = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + (NCCL_BUFFER_BYTES if nccl else 0)
    elif w.device_type == "cpu":
        p.runtime = CPU_PROCESS_BYTES
    _plan_rollout(p, held)
    _plan_update(p, held)
    return p


def is_fsdp_sharded(lay: Layout) -> bool:
    """Whether FSDP shards the models over several ranks."""
    return lay.fsdp and lay.ranks > 1


def _plan_rollout(p: Plan, held: list[tuple[int, int]]) -> None:
    """The rollout's terms: the decoding copies of the weights, and the rows of one generate call
    (trimmed as the runtime's KV budget would trim them)."""
    a, w, lay = p.arch, p.work, p.layout
    c = w.compute_bytes
    if is_fsdp_sharded(lay) and lay.unshard_rollout:
        p.rollout_weights = sum(c * n for n, s in (held[:w.policies] if w.full else []) if s > 1)
        if not w.full:
            p.rollout_weights += w.frozen_bytes * a.params * (lay.frozen_shards - 1) // lay.frozen_shards
        # FSDP's all-gather of a unit lands in one buffer, then is copied out into its parameters:
        # the largest unit (the root: embeddings and head) twice, for a moment.
        p.gather = (c if w.full else w.frozen_bytes) * max(a.root_params, a.layer_params)
    elif w.full and c < w.master_bytes:
        p.rollout_weights = c * a.params  # autocast's cast copy of the decoding model
    from marl_llm.rollout.static_step import CAPACITY_MULTIPLE, ROW_MULTIPLE, round_up

    compute = {2: torch.bfloat16, 4: torch.float32}[c]
    per_position = kv_cache_bytes(a.config, compute, 1)
    P, N = w.prompt_tokens, w.new_tokens
    # The compiled step rounds a cache's rows and positions up; every decoding model (each fully
    # fine-tuned policy) keeps its cache until the rollout phase ends (rollout/static_step.py).
    positions, row_multiple, kept = P + N, 1, 1
    if w.compiled_decode:
        positions, row_multiple, kept = round_up(P + N, CAPACITY_MULTIPLE), ROW_MULTIPLE, w.policies if w.full else 1
    p.rows_per_call = w.rows
    budget = _kv_budget(p)
    if budget is not None:
        # rollout/decode.kv_chunks: a call of r rows caches r (P + N) positions, and r P more while
        # the prefill's cache moves into the decode's; with auto's share of the free memory, the
        # other models' kept caches take from it first.
        share = CUDA_FREE_SHARE if w.kv_cache_gib is None else 0.0
        fit = int(budget // (per_position * ((P + positions) + share * (kept - 1) * positions)))
        fit = fit // row_multiple * row_multiple
        if fit < w.rows:
            # A row over the budget still gets a call of its own (then the plan does not fit).
            p.rows_per_call = max(1, fit)
        if 1 <= fit < w.rows:
            p.notes.append(f"KV budget: {fit} rows per generate call (trainer.sequences_per_generate={w.rows}), "
                           f"{budget / GiB:.2f} GiB for the cache ({_budget_source(w)})")
    rows = p.rows_per_call
    # Siblings share a prompt: the prefill runs on the distinct prompts, then copies their keys and values.
    prompts = math.ceil(rows / max(1, min(w.siblings, rows)))
    p.kv = per_position * round_up(rows, row_multiple) * positions * kept
    p.decode = 2 * 4 * rows * a.vocab  # [rows, V] fp32 logits, and the sampler's copy
    p.prefill = prompts * P * (2 * a.layers * a.kv + 3 * a.intermediate + 2 * a.q + 2 * a.hidden) * c


def _kv_budget(p: Plan) -> int | None:
    """The bytes a generate call's KV cache may take, as models/memory.kv_budget decides at run
    time: trainer.kv_cache_gib, or (auto, on CUDA) CUDA_FREE_SHARE of what is free when the call
    starts. None: not known before the run (auto on the CPU: a share of the RAM then available)."""
    w = p.work
    if w.kv_cache_gib is not None:
        return int(w.kv_cache_gib * GiB)
    if w.device_type != "cuda" or p.gpu_bytes is None:
        return None
    return max(0, int(CUDA_FREE_SHARE * (p.gpu_bytes - p.held - p.rollout_weights)))


def _budget_source(w: Workload) -> str:
    if w.kv_cache_gib is not None:
        return f"trainer.kv_cache_gib={w.kv_cache_gib:g}"
    return f"trainer.kv_cache_gib=auto: {CUDA_FREE_SHARE:.0%} of the memory free"


def _plan_update(p: Plan, held: list[tuple[int, int]]) -> None:
    """The update's terms: one micro-batch's activations, the LM head's chunk, FSDP's gathered
    units and reductions, the optimizer step."""
    a, w, lay = p.arch, p.work, p.layout
    c, m = w.compute_bytes, w.master_bytes
    P, C, B = w.prompt_tokens, w.new_tokens, w.micro_batch
    sharded = is_fsdp_sharded(lay)
    # A micro-batch of siblings encodes their prompt once and reuses its KV cache (rollout/decode.
    # completion_logprobs), except on an FSDP-sharded model and under gradient checkpointing (no cache).
    siblings = min(B, w.siblings) if w.siblings > 1 and B > 1 and not sharded else 1
    per_token = a.activation_elements(frozen_linears=not w.full and not w.all_linear)
    # A bf16 RMSNorm upcasts its input to fp32 and keeps that copy (4 bytes an element) beside its bf16
    # output (2), where the elements count 2 x 2: 2 more bytes per element it normalizes, per token
    # (a layer's two norms of h, Qwen3's q and k norms of q and kv, and the final norm).
    norm_elements = 2 * a.hidden + (a.q + a.kv if a.qk_norm else 0)
    norm_extra = 2 * norm_elements if c == 2 else 0
    final_norm_extra = 2 * a.hidden if c == 2 else 0

    def kept(tokens: int, span: int) -> int:
        """Bytes every layer keeps for `tokens` tokens, plus `span` elements of repeated keys and values per layer."""
        return tokens * ((a.layers * per_token + 3 * a.hidden) * c + a.layers * norm_extra + final_norm_extra) \
            + a.layers * span * c

    packed_tokens = B * (P + C)
    if siblings > 1:
        # The completions' pass attends to the prompt's keys and values, repeated for each of its
        # k completions and to every query head (SDPA with a mask: transformers repeats K/V).
        full_acts = kept(P + siblings * C, siblings * P * 2 * a.q)
    else:
        full_acts = kept(packed_tokens, 0)
    # A recomputed layer, with the gradients flowing through it, takes a whole layer's worth even
    # where frozen linears keep nothing.
    layer = packed_tokens * (a.activation_elements() * c + norm_extra)
    ckpt_acts = packed_tokens * (a.layers + 3) * a.hidden * c + layer  # inputs kept, one layer recomputed
    p.activations, p.activations_other = (ckpt_acts, full_acts) if w.checkpointing else (full_acts, ckpt_acts)

    # The LM head's chunk (models/scoring.py): rows of fp32 logits, at least TRAINED_HEAD_CHUNK_TOKENS
    # when the head itself trains; after the last layer: with every activation kept it adds to them,
    # with checkpointing it and the recomputed layer come one after the other.
    from marl_llm.models.scoring import LOGIT_CHUNK_ELEMENTS, TRAINED_HEAD_CHUNK_TOKENS

    scored = (siblings if siblings > 1 and not w.checkpointing else B) * C
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // a.vocab)
    if w.full:
        chunk = max(chunk, TRAINED_HEAD_CHUNK_TOKENS)
    rows = min(chunk, scored)
    head = LOGIT_BUFFERS * 4 * rows * a.vocab
    beside = max(0, head - layer) if w.checkpointing else head
    whole_models_train = w.full or w.separate_critics > 0
    unit = c if whole_models_train else w.frozen_bytes  # what an FSDP unit is gathered in
    # FSDP: two gathered layers (the one running and the next, prefetched) and one's gradient; the
    # root unit (embeddings, final norm, head) stays gathered from the forward to the backward's end.
    gathered = (3 * a.layer_params + a.root_params) * unit if sharded else 0
    # A trained head's gradient exists from its first chunk's backward on (a single chunk peaks
    # before it): unsharded in the compute dtype under FSDP, else among the gradients.
    head_grad = (unit if sharded else m) * a.head_params if w.full else 0
    beside += gathered + (head_grad if scored > rows else 0)
    # Beside the gradients within the backward: the gathered units and FSDP's unsharded head gradient.
    within = gathered + (head_grad if sharded else 0)
    end = 0
    if sharded and whole_models_train:
        # The root is reduced last: its unsharded gradients are copied into the reduce-scatter's
        # fp32 input (MixedPrecisionPolicy's reduce_dtype), beside them.
        end = a.root_params * unit + 4 * a.root_params
    if w.checkpointing:
        # A recomputed layer, beside every kept input and the gradients so far (counted whole).
        end = max(end, p.activations + within)
    if w.full and a.tied:
        # The embedding's backward comes last: a dense [V, h] gradient, added to the head's into a
        # new tensor (measured: a short micro-batch's update peaks at EmbeddingBackward's add).
        end = max(end, within + 2 * (unit if sharded else m) * a.head_params)
    if not w.fused_optimizer:  # torch's AdamW on the CPU: one tensor at a time
        if whole_models_train:
            over = min((s for _, s in held), default=1)  # the fewest ranks a trained model is sharded over
            step = SINGLE_TENSOR_STEP_TEMPORARIES * math.ceil(a.largest / over)
        else:
            # An adapter tensor is at most one layer's adapters.
            step = SINGLE_TENSOR_STEP_TEMPORARIES * w.adapter_params // max(1, a.layers)
        end = max(end, m * step)
    p.update_transients, p.after_backward = beside, end
