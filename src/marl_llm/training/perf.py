"""Performance accounting: model FLOPs, device peaks, synchronized timers, peak GPU memory.

Every training step logs (trainer.train_step, through `Meter`):

    timing/{rollout,generate,scoring,update}   synchronized wall seconds
    perf/tflop/{generate,update,step}          model TFLOP counted (below)
    perf/mfu/{generate,update,step}            FLOPs / (seconds * peak), when a peak is known
    perf/peak_gpu_mem_gib                      torch.cuda.max_memory_allocated, reset per step (CUDA only)

timing/scoring is the rollout's time outside `generate` (rewards: the code sandbox, environment
steps); timing/update runs from the end of the rollout to the end of the step (advantages with
their scoring passes, the update, the LR schedule). On CUDA every clock read is preceded by
`torch.cuda.synchronize()`, so a phase's time includes the kernels it queued.

FLOP model. A decoder-only LM with N = weights of the decoder's linear layers (attention and MLP
projections of every layer: no embeddings, no LM head, no LoRA), n_layers layers,
d_attn = query heads * head_dim, d_model and a V-row LM head. A forward pass in which a row
feeds L real positions after `past` real cached positions costs

    2 * N * L  +  4 * n_layers * d_attn * L * (past + (L + 1) / 2)      (linear + attention)

(causal attention: query i of the L attends to past + i keys, QK^T and PV two FLOPs per
multiply-add each), summed over rows, plus the LM head

    2 * d_model * V * T_kept

on the T_kept positions whose logits are computed (`logits_to_keep`; padding included, since
those logits are computed). Decoder positions are counted from the attention mask: padding
neither counts as a position nor as a cached key. A pass whose output a gradient reaches adds
its backward, as multiples of the forward (total = m * forward):

    linear layers   m = 2 with a frozen base (LoRA: input gradients only, one more matmul per
                      weight; the first layer's input projections need not even that, < 1/n_layers),
                    m = 3 when the base is trained (algo.lora=null: input and weight gradients);
    attention       m = 3 always (QK^T and PV have two activation operands: two matmuls back each);
    LM head         m = 2 frozen, 3 trained (tied embeddings of a fully fine-tuned policy);
    gradient checkpointing adds the recomputed forward of the decoder layers (m + 1; not the
    head), less each layer's last projection: torch's non-reentrant checkpoint stops recomputing
    once every tensor the backward saved is back, and nothing saves the MLP down projection's
    output (`ModelShape.n_recompute`; the down projection is 29% of a Qwen2.5-1.5B layer). This
    is what runs (hardware FLOPs); PaLM's "model FLOPs" would leave the recomputation out.

LoRA's own matmuls are not counted: r * (d_in + d_out) per adapted projection, e.g. r=16 on
q/k/v/o of Qwen2.5-1.5B adds 0.3% to N. Neither are norms, rotary embeddings, softmax and
sampling (elementwise, not tensor-core work).

Where the counts come from. Generation (`MeteredRollout`, any backend: HF or vLLM) is counted
from the completions' lengths (`generation_flops`): each distinct (adapter, prompt) prefilled
once, then every generated token but the last fed back with its prompt and the tokens before it
cached. That is the work generation needs: rows the decode loop carries along as padding after
they finished (until it compacts the batch, or to the end with static shapes) are not credited,
so they lower MFU, as waste should. Every other pass (scoring, the update, reference and critic
passes) is counted by hooks on the watched models' decoder and LM head (`FlopCounter.watch`),
wherever it is called from, from its attention mask.

MFU = FLOPs / (seconds * peak). The peak is dense (no 2:4 sparsity) tensor-core throughput of the
compute dtype, from the device name (`DEVICES`; bf16/fp16, TF32 when float32 matmuls may use it,
else plain fp32), or `trainer.peak_tflops`. On the CPU there is no MFU unless that key is set.
"""

from __future__ import annotations

import contextlib
import re
import resource
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from marl_llm.models.cache_api import call_cache


# ---------------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class DeviceSpec:
    """Dense peak TFLOP/s by compute precision and memory bandwidth (TB/s) of one GPU model."""

    bf16: float  # also fp16 (same tensor-core rate on these parts)
    tf32: float
    fp32: float  # without tensor cores
    bandwidth_tbs: float


# NVIDIA datasheet figures (dense: half of the "with sparsity" ones), matched against
# torch.cuda.get_device_name() in this order, first match wins. The SXM parts report names like
# "NVIDIA H100 80GB HBM3" or "NVIDIA A100-SXM4-80GB"; PCIe and NVL parts say so.
DEVICES: tuple[tuple[str, DeviceSpec], ...] = (
    (r"H100.*PCIe", DeviceSpec(bf16=756.0, tf32=378.0, fp32=51.2, bandwidth_tbs=2.0)),
    (r"H100.*NVL", DeviceSpec(bf16=835.5, tf32=417.5, fp32=60.0, bandwidth_tbs=3.9)),
    (r"H100", DeviceSpec(bf16=989.4, tf32=494.7, fp32=66.9, bandwidth_tbs=3.35)),  # SXM5
    (r"H200.*NVL", DeviceSpec(bf16=835.5, tf32=417.5, fp32=60.0, bandwidth_tbs=4.8)),
    (r"H200", DeviceSpec(bf16=989.4, tf32=494.7, fp32=66.9, bandwidth_tbs=4.8)),
    (r"A100.*80GB.*PCIe|A100-PCIE-80GB", DeviceSpec(bf16=312.0, tf32=156.0, fp32=19.5, bandwidth_tbs=1.935)),
    (r"A100.*80GB", DeviceSpec(bf16=312.0, tf32=156.0, fp32=19.5, bandwidth_tbs=2.039)),
    (r"A100", DeviceSpec(bf16=312.0, tf32=156.0, fp32=19.5, bandwidth_tbs=1.555)),  # 40GB
    (r"L40S", DeviceSpec(bf16=362.05, tf32=183.0, fp32=91.6, bandwidth_tbs=0.864)),
    (r"\bL4\b", DeviceSpec(bf16=121.0, tf32=60.0, fp32=30.3, bandwidth_tbs=0.3)),
    (r"\bA10\b", DeviceSpec(bf16=125.0, tf32=62.5, fp32=31.2, bandwidth_tbs=0.6)),
)


def device_name(device: torch.device | str) -> str:
    """`torch.cuda.get_device_name` on CUDA, else the device type ("cpu")."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def device_spec(name: str) -> DeviceSpec | None:
    """The table entry of a device name, or None (an unknown GPU, the CPU)."""
    return next((spec for pattern, spec in DEVICES if re.search(pattern, name, re.IGNORECASE)), None)


def compute_precision(dtype: torch.dtype) -> str:
    """bf16 (also fp16), tf32 (float32 with TF32 matmuls allowed), or fp32."""
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    tf32 = torch.get_float32_matmul_precision() != "highest" or \
        getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee") == "tf32"
    return "tf32" if tf32 else "fp32"


def peak_tflops(device: torch.device | str, dtype: torch.dtype, override: float | None = None) -> float | None:
    """Dense peak TFLOP/s of `device` computing in `dtype`: `override` (trainer.peak_tflops)
    when given, else the DEVICES entry of a CUDA device's name; None on the CPU or an unknown GPU
    (no MFU then; an unknown GPU warns once, naming the key to set)."""
    if override is not None:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = device_name(device)
    spec = device_spec(name)
    if spec is None:
        warnings.warn(f"no peak TFLOP/s known for {name!r}: set trainer.peak_tflops=<dense TFLOP/s of its "
                      f"{compute_precision(dtype)} tensor cores> to log MFU", stacklevel=2)
        return None
    return getattr(spec, compute_precision(dtype))


def memory_bandwidth_tbs(device: torch.device | str, override: float | None = None) -> float | None:
    """Memory bandwidth (TB/s) of `device`: `override`, else the DEVICES entry; None if unknown."""
    if override is not None:
        return float(override)
    device = torch.device(device)
    spec = device_spec(device_name(device)) if device.type == "cuda" else None
    return spec.bandwidth_tbs if spec else None


# ---------------------------------------------------------------------- clocks and memory
def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued kernels (CUDA); a no-op elsewhere or before CUDA started."""
    device = torch.device(device) if device is not None else None
    if (device is None or device.type == "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)


def clock(device: torch.device | str | None = None) -> float:
    """time.perf_counter() after the device's queued work has finished."""
    synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_memory_gib(device: torch.device | str) -> float | None:
    """torch.cuda.max_memory_allocated since the last reset, in GiB; None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


# ------------------------------------------------------------------------------ FLOP model
@dataclass(frozen=True)
class ModelShape:
    """What the FLOP model (module docstring) needs of a decoder-only LM."""

    n_linear: int  # weights of the decoder's linear layers (no embeddings, LM head or LoRA)
    n_layers: int
    d_attn: int  # query heads * head_dim
    d_model: int
    vocab: int  # rows of the LM head
    kv_dim: int  # key/value heads * head_dim: a cached token holds 2 * n_layers * kv_dim values
    n_recompute: int = 0  # of n_linear, the weights gradient checkpointing reruns (module docstring)

    @classmethod
    def of(cls, model) -> "ModelShape":
        """The shape of a transformers causal LM, a peft model around one, or a fully fine-tuned
        policy (models.full_model)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder, head = base.get_decoder(), base.get_output_embeddings()
        cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        n_linear = _linear_weights(decoder)
        # Each layer's last projection (in registration order, which is execution order: the
        # MLP's down projection) is not rerun by a checkpointed layer's recomputation.
        last = sum(_linear_weights(layer, last_only=True) for layer in getattr(decoder, "layers", []))
        return cls(n_linear=n_linear, n_layers=cfg.num_hidden_layers, d_attn=heads * head_dim,
                   d_model=head.weight.shape[1], vocab=head.weight.shape[0], kv_dim=kv_heads * head_dim,
                   n_recompute=n_linear - last)


def _linear_weights(module: torch.nn.Module, last_only: bool = False) -> int:
    sizes = [m.weight.numel() for name, m in module.named_modules()
             if isinstance(m, torch.nn.Linear) and "lora_" not in name]
    return (sizes[-1] if sizes else 0) if last_only else sum(sizes)


def layer_flops(shape: ModelShape, new, past) -> tuple[Any, Any]:
    """Forward FLOPs (linear, attention) of the decoder layers for rows that feed `new` real
    positions after `past` real cached ones: ints, or Tensor[B] per row (summed over rows)."""
    linear = 2 * shape.n_linear * new
    attention = 4 * shape.n_layers * shape.d_attn * new * (past + (new + 1) / 2)
    if isinstance(linear, torch.Tensor):
        return linear.sum(), attention.sum()
    return float(linear), float(attention)


def head_flops(shape: ModelShape, kept: int) -> float:
    """Forward FLOPs of the LM head on `kept` positions."""
    return 2.0 * shape.d_model * shape.vocab * kept


def generation_flops(shape: ModelShape, prompts: list[tuple[Any, tuple[int, ...]]],
                     generated: list[int]) -> dict[str, float]:
    """Forward FLOPs {linear, attention, head} of generating with the KV cache, from lengths
    alone (module docstring): prompts[b] = (adapter, prompt ids) of row b, generated[b] its
    number of generated tokens. Each distinct (adapter, prompt) is prefilled once (logits of its
    last position only); a row then feeds back every generated token but its last, token t
    (0-based) with len(prompt) + t positions cached before it."""
    out = {"linear": 0.0, "attention": 0.0, "head": 0.0}
    passes = [(len(ids), 0, 1) for _, ids in dict.fromkeys(prompts)]  # prefill: (new, past, kept)
    passes += [(max(n - 1, 0), len(ids), max(n - 1, 0)) for (_, ids), n in zip(prompts, generated)]
    for new, past, kept in passes:
        linear, attention = layer_flops(shape, new, past)
        out["linear"] += linear
        out["attention"] += attention
        out["head"] += head_flops(shape, kept)
    return out


# --------------------------------------------------------------------------- FLOP counting
class FlopCounter:
    """Running model-FLOP totals of the watched models' passes: forward passes as they run,
    backward passes when a gradient reaches the pass's output (module docstring). Totals by
    part: `linear`, `attention`, `head`; `total` is their sum.

    Per-pass counts read from an attention mask stay tensors on its device until a total is read:
    no host sync per pass (a decode step on CUDA would otherwise wait for its forward)."""

    PARTS = ("linear", "attention", "head")

    def __init__(self) -> None:
        self._host = {p: 0.0 for p in self.PARTS}
        self._device: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._handles: list[Any] = []
        self._watched: set[int] = set()
        self._paused = 0
        self.shapes: list[ModelShape] = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The hooks count nothing inside (generation, counted from lengths instead). A flag the
        hooks check first, not removed hooks: a compiled decode step stays valid."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- totals
    def add(self, part: str, flops: Any) -> None:
        """Add FLOPs (a number, or a 0-dim float64 tensor: summed on its device) to `part`."""
        if isinstance(flops, torch.Tensor):
            key = (part, flops.device)
            acc = self._device.get(key)
            self._device[key] = flops.detach() if acc is None else acc + flops.detach()
        else:
            self._host[part] += flops

    def part(self, name: str) -> float:
        return self._host[name] + sum(float(t) for (p, _), t in self._device.items() if p == name)

    @property
    def total(self) -> float:
        return sum(self.part(p) for p in self.PARTS)

    def totals(self) -> dict[str, float]:
        return {p: self.part(p) for p in self.PARTS}

    # -- hooks
    def watch(self, model) -> ModelShape | None:
        """Count every pass of `model` (a transformers causal LM, a peft model, a full policy)
        from now on; returns its shape (None for a model without a decoder/LM head to hook).

        A pass inside a torch.compile'd region is not counted: the hooks return at once when
        traced, so the compiled graph holds nothing of them (no guard on the counter's running
        totals, which would recompile the step at every call). The one compiled region is the
        decode step, whose generation MeteredRollout counts from lengths."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        try:
            decoder, head = base.get_decoder(), base.get_output_embeddings()
        except (AttributeError, ValueError):
            return None
        if decoder is None or head is None:
            return None
        shape = ModelShape.of(model)
        if id(decoder) in self._watched:
            return shape
        self._watched.add(id(decoder))
        self.shapes.append(shape)
        probe = next((m.weight for n, m in decoder.named_modules()
                      if isinstance(m, torch.nn.Linear) and "lora_" not in n), None)
        self._handles.append(decoder.register_forward_hook(self._decoder_hook(shape, probe), with_kwargs=True))
        self._handles.append(head.register_forward_hook(self._head_hook(shape)))
        return shape

    def close(self) -> None:
        """Stop counting (remove the hooks)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._watched.clear()

    def _decoder_hook(self, shape: ModelShape, probe: torch.Tensor | None):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if torch.compiler.is_compiling() or self._paused:  # never traced (see `watch`)
                return
            new, past = _positions(args, kwargs)
            if new is None:
                return
            linear, attention = layer_flops(shape, new, past)
            self.add("linear", linear)
            self.add("attention", attention)
            hidden = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", None)
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                trained = probe is not None and probe.requires_grad
                recompute = float(bool(getattr(module, "gradient_checkpointing", False)) and module.training)
                extra_linear = 1 + trained + recompute * shape.n_recompute / max(shape.n_linear, 1)
                extra_attention = 2 + recompute

                def backward(grad: torch.Tensor) -> None:
                    self.add("linear", linear * extra_linear)
                    self.add("attention", attention * extra_attention)

                hidden.register_hook(backward)
        return hook

    def _head_hook(self, shape: ModelShape):
        def hook(module: torch.nn.Module, inputs: tuple, output: Any) -> None:
            if torch.compiler.is_compiling() or self._paused:  # never traced (see `watch`)
                return
            h = inputs[0]
            flops = head_flops(shape, h.numel() // h.shape[-1])
            self.add("head", flops)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                extra = 1 + bool(getattr(module, "weight", None) is not None and module.weight.requires_grad)
                output.register_hook(lambda grad: self.add("head", flops * extra))
        return hook


def _positions(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(real new positions, real cached positions) of each row of a decoder call, float64
    Tensor[B] each: from a 2-D attention mask [B, past + L] when there is one, else every row
    has the input's L positions and the cache's length before the call."""
    x = kwargs.get("input_ids")
    if x is None and args:
        x = args[0]
    if x is None:
        x = kwargs.get("inputs_embeds")
    if not isinstance(x, torch.Tensor):
        return None, None
    B, L = int(x.shape[0]), int(x.shape[1])
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == B and mask.shape[1] >= L:
        m = (mask.cpu() if mask.device.type == "mps" else mask).to(torch.float64)  # MPS has no float64
        new = m[:, mask.shape[1] - L:].sum(dim=1)
        return new, m.sum(dim=1) - new
    cache = call_cache(kwargs)
    # Called after the pass: the cache already holds this pass's L positions.
    past = max(int(cache.get_seq_length()) - L, 0) if cache is not None and hasattr(cache, "get_seq_length") else 0
    return torch.full((B,), float(L), dtype=torch.float64), torch.full((B,), float(past), dtype=torch.float64)


# ------------------------------------------------------------------------------ step meter
class Meter:
    """A run's performance meter: FLOPs of its models, synchronized step phases, peak memory.

        meter.watch(models)
        t0 = meter.start_step()            # resets the peak-memory statistic
        ... collect ...;  meter.mark("rollout")
        ... update ...;   meter.mark("update")
        metrics = meter.step_metrics()     # module docstring

    `generating()` wraps the rollout backend's generate calls (MeteredRollout) to set their time
    and FLOPs apart."""

    def __init__(self, device: torch.device | str = "cpu", peak_tflops: float | None = None):
        self.device = torch.device(device)
        self.peak_tflops = peak_tflops
        self.flops = FlopCounter()
        self.generate_seconds = 0.0
        self.generate_flops = 0.0
        self._marks: list[tuple[str, float, float, float, float]] = []

    def watch(self, models: list[Any]) -> None:
        for m in models:
            self.flops.watch(m)

    def clock(self) -> float:
        return clock(self.device)

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        start, flops = self.clock(), self.flops.total
        try:
            yield
        finally:
            self.generate_seconds += self.clock() - start
            self.generate_flops += self.flops.total - flops

    def start_step(self) -> float:
        reset_peak_memory(self.device)
        self._marks = []
        return self.mark("start")

    def mark(self, phase: str) -> float:
        """End `phase` now; returns the (synchronized) time."""
        t = self.clock()
        self._marks.append((phase, t, self.flops.total, self.generate_seconds, self.generate_flops))
        return t

    def step_metrics(self) -> dict[str, float]:
        """The step's timings, FLOPs, MFU (with a peak) and peak GPU memory (CUDA), from the marks
        start, rollout, update (module docstring)."""
        marks = {name: (t, f, gs, gf) for name, t, f, gs, gf in self._marks}
        (t0, f0, gs0, gf0), (t1, f1, _, _), (t2, f2, gs2, gf2) = marks["start"], marks["rollout"], marks["update"]
        gen_s, gen_f = gs2 - gs0, gf2 - gf0
        out = {"timing/rollout": t1 - t0, "timing/update": t2 - t1, "timing/generate": gen_s,
               "timing/scoring": max(t1 - t0 - gen_s, 0.0),
               "perf/tflop/generate": gen_f / 1e12, "perf/tflop/update": (f2 - f1) / 1e12,
               "perf/tflop/step": (f2 - f0) / 1e12}
        if self.peak_tflops:
            peak = self.peak_tflops * 1e12
            for name, flops, seconds in (("generate", gen_f, gen_s), ("update", f2 - f1, t2 - t1),
                                         ("step", f2 - f0, t2 - t0)):
                if seconds > 0:
                    out[f"perf/mfu/{name}"] = flops / (seconds * peak)
        mem = peak_memory_gib(self.device)
        if mem is not None:
            out["perf/peak_gpu_mem_gib"] = mem
        return out

    def close(self) -> None:
        self.flops.close()


class MeteredRollout:
    """A rollout backend whose `generate` calls the meter times (synchronized) and counts from
    the completions' lengths (module docstring), the model hooks paused meanwhile; everything
    else is the backend's own."""

    def __init__(self, inner: Any, meter: Meter, policies: Any):
        self.inner, self.meter, self.policies = inner, meter, policies
        self.shapes = [ModelShape.of(m) for m in policies.models]  # by model index

    def generate(self, requests: list[Any]) -> list[Any]:
        with self.meter.generating():
            with self.meter.flops.paused():
                out = self.inner.generate(requests)
            by_model: dict[int, tuple[list, list[int]]] = {}
            for r, c in zip(requests, out):
                agent = self.policies.agents[r.agent]
                rows, generated = by_model.setdefault(agent.model_index, ([], []))
                rows.append((agent.adapter, tuple(c.prompt_ids.tolist())))
                generated.append(len(c.completion_ids))
            for k, (rows, generated) in by_model.items():
                for part, flops in generation_flops(self.shapes[k], rows, generated).items():
                    self.meter.flops.add(part, flops)
        return out

    def update_weights(self) -> None:
        self.inner.update_weights()

    def __getattr__(self, name: str) -> Any:  # release(), close(), max_batch, ... of the backend
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
