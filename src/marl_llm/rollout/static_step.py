"""The fixed-shape decode step (trainer.decode=static) and its compiled form (trainer.compile_decode).

A static step feeds [rows, 1] tokens over a transformers `StaticCache`: fixed [rows, H, capacity, D]
buffers written in place at a position kept on the device, so every step of a rollout has the
same shapes and can be captured by CUDA graphs (torch.compile's "reduce-overhead" mode: the whole
step replays as one graph launch instead of hundreds of kernel launches from Python).

What a capture keeps. CUDA graphs replay fixed memory addresses. The step's static inputs (the
model's parameters, the cache's buffers, MixedLoRA's adapter stacks: everything marked with
`torch._dynamo.mark_static_address`) must live at the same addresses in every rollout, or the
graph is recorded again (a re-recording: a synchronization and a new graph's memory each time).
So a compiled rollout does not build its cache for every generate call: it takes the one kept for
its (rows, capacity, dtype) and resets it (`static_cache(..., keep=True)`), and MixedLoRA copies
the adapters into stacks it keeps (rollout/mixed_lora.py). One cache is kept per model, and only
through its phase: a call of another shape drops the kept one before allocating its own (so the
KV budget, which counts the kept bytes as free, never counts memory it cannot reuse), and
`release_kept_caches` (HFRollout.release, which the trainer calls after every rollout phase and
evaluation) drops it before the update, whose activations need that memory: an 8B preset's
20 GiB cache kept through the update did not fit an 80 GB GPU. The cost: each rollout phase records
its graph again (once per shape). Fewer distinct
shapes mean fewer compilations and recordings: a compiled rollout's capacity is rounded up to a
multiple of CAPACITY_MULTIPLE positions and its rows to a multiple of ROW_MULTIPLE (extra rows
copy the first one, start finished, and are dropped; decode bandwidth, not rows, bounds a step).

What a step reads. The cache is allocated once at its full capacity, but a step attends only
over a live view of it: its first `rows` rows and `window` positions (`LiveStaticLayer`, views at
the buffers' own addresses, so a compiled step's static inputs do not move). The window grows in
buckets (CAPACITY_MULTIPLE x 2^k positions, at most the capacity) as the rows lengthen, and rows
that finished leave the batch at the loop's checks, the running ones moved to the front
(`compact_rows`), the rows a bucket of ROW_MULTIPLE x 2^k (compiled; the exact count eagerly).
So the KV bytes a step reads grow with the rows' length, not with the cap: at the 8B presets'
4,096-token cap, a 600-token row reads a 1,024-position window. Each (rows, window) bucket is a
shape of its own (a graph compiled once per process, and a CUDA graph recorded per phase): at
most log2(cap / 64) + 1 windows and log2(rows / 8) + 1 row counts, so a few dozen at worst.

What is counted (`compile_counts`, which `marl-llm-bench gpu` reports per rollout): the graphs
dynamo has compiled in this process, and on CUDA the graphs CUDA-graph trees have recorded (a
callback of torch's compile-event hooks; None where this torch has none).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicLayer, StaticCache, StaticLayer

from marl_llm.config import UserError
from marl_llm.models.cache_api import cache_kwargs

CAPACITY_MULTIPLE = 64  # a compiled static cache's length is rounded up to a multiple of this
ROW_MULTIPLE = 8  # and its rows
# Distinct (rows, window) shapes a compiled step may take in one process (dynamo's default limit, 8,
# would fall back to eager without a word past it): windows x row buckets, with room.
MAX_STEP_SHAPES = 128

# The one static cache kept per model, with its shape: model -> (shape, StaticCache).
_KEPT: "weakref.WeakKeyDictionary[Any, tuple[tuple, StaticCache]]" = weakref.WeakKeyDictionary()


def full_attention_only(model) -> bool:
    """Whether every layer of the model attends to the whole sequence (what a StaticCache of one
    capacity holds), from its config: transformers' `layer_types`, else its sliding-window keys."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    kinds = getattr(cfg, "layer_types", None)
    if kinds is not None:
        return all(kind == "full_attention" for kind in kinds)
    if getattr(cfg, "use_sliding_window", None) is False:
        return True
    return getattr(cfg, "sliding_window", None) is None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class LiveStaticLayer(StaticLayer):
    """A StaticLayer whose step reads only a live view of its buffers: the first `rows` rows and
    `window` positions (None: all). The buffers keep their full [B, H, capacity, D] shape and
    address; the view is a slice of them. `rows` and `window` are plain ints: a compiled step
    specializes on them (one graph per bucket)."""

    rows: int | None = None
    window: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        position = torch.arange(n, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(n)  # in place: a static address
        keys, values = self.keys[:self.rows], self.values[:self.rows]
        keys.index_copy_(2, position, key_states)
        values.index_copy_(2, position, value_states)
        return keys[:, :, :self.window], values[:, :, :self.window]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.window or self.max_cache_len), 0

    def reset(self) -> None:
        super().reset()
        self.rows = self.window = None


def bucket(n: int, multiple: int, most: int | None = None) -> int:
    """The smallest multiple x 2^k >= n (at most `most`): the shapes a static step takes."""
    size = multiple
    while size < n:
        size *= 2
    return size if most is None else min(size, most)


def set_view(cache: StaticCache, rows: int, window: int) -> None:
    """Let the next steps read the first `rows` rows and `window` positions of every layer."""
    for layer in cache.layers:
        layer.rows, layer.window = rows, window


def compact_rows(cache: StaticCache, order: torch.Tensor, written: int) -> None:
    """Move rows `order` [r] (batch indices) to the front of every layer's buffers, their first
    `written` positions (the rest is unwritten): row i of the new batch is old row order[i]. One
    layer's rows are gathered at a time (a temporary of 1/L of the cache)."""
    r = order.numel()
    for layer in cache.layers:
        for buffer in (layer.keys, layer.values):
            buffer[:r, :, :written] = buffer[order, :, :written]


def static_cache(model, cache: Any, capacity: int, keep: bool = False) -> StaticCache:
    """transformers' StaticCache of `capacity` positions holding a prefilled DynamicCache's keys
    and values [B, H, P, D] at positions [0, P). keep: the one kept for this model if it has this
    shape (reset and refilled), else a new one kept in its place (the old one dropped first), else
    a fresh one."""
    layers = getattr(cache, "layers", [])
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        raise UserError(f"trainer.decode=static needs a model whose layers all use full attention, but "
                        f"{type(model).__name__} caches {sorted({type(l).__name__ for l in layers})}: "
                        "set trainer.decode=dynamic")
    first = layers[0].keys
    shape = (first.shape[0], capacity, first.dtype, first.device, torch.is_inference_mode_enabled())
    kept_shape, static = _KEPT.pop(model, (None, None)) if keep else (None, None)
    if kept_shape != shape:
        static = None  # another shape's cache goes before this one allocates
    if static is None:
        static = StaticCache(config=model.config, max_cache_len=capacity)
        static.layers = [LiveStaticLayer(max_cache_len=capacity) for _ in static.layers]
    else:
        static.reset()  # zeroes the buffers and the write position, in place
    for fixed, filled in zip(static.layers, layers, strict=True):
        fixed.update(filled.keys, filled.values)  # first use allocates [B, H, capacity, D]; writes positions [0, P)
    if keep:
        _KEPT[model] = (shape, static)
    return static


def kept_cache_bytes(model) -> int:
    """Bytes of the static cache kept for `model` (a rollout's KV budget may reuse them: a call of
    another shape frees them before allocating)."""
    _, static = _KEPT.get(model, (None, None))
    layers = [] if static is None else [layer for layer in static.layers if getattr(layer, "is_initialized", False)]
    return sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))


def release_kept_caches(model) -> None:
    """Drop the static caches kept for `model` (their memory goes with them; the next compiled
    rollout of each shape records its graph again)."""
    _KEPT.pop(model, None)


def model_step(model, token: torch.Tensor, position: torch.Tensor, attention_mask: torch.Tensor, cache: Any,
               **kwargs: Any) -> torch.Tensor:
    """One decode step: next-token logits [B, V] for the tokens [B, 1] at positions [B, 1]."""
    return model(input_ids=token, position_ids=position, attention_mask=attention_mask, use_cache=True,
                 logits_to_keep=1, **cache_kwargs(cache), **kwargs).logits[:, -1]


_COMPILED_STEPS: dict[str, Callable[..., torch.Tensor]] = {}


def compiled_step(device: torch.device) -> Callable[..., torch.Tensor]:
    """`model_step` under torch.compile, built once per process and device kind: CUDA graphs
    ("reduce-overhead": one launch per step) on a GPU, inductor's fused kernels elsewhere."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    if mode not in _COMPILED_STEPS:
        if device.type == "cuda":
            count_cudagraph_recordings()
        # One graph per (rows, window) shape (dynamic=False: no dynamic-shape graph to guess at).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_STEP_SHAPES)
        _COMPILED_STEPS[mode] = torch.compile(model_step, mode=mode, dynamic=False)
    return _COMPILED_STEPS[mode]


# ------------------------------------------------------------------------------------ counters
_RECORDINGS: list[int] = []  # [graphs recorded] once the callback is installed


def count_cudagraph_recordings() -> bool:
    """Count every CUDA-graph recording of this process from now on (idempotent). False where
    this torch has no compile-event callback for recordings."""
    if _RECORDINGS:
        return True
    try:
        from torch._dynamo.callback import CallbackTrigger, callback_handler
    except ImportError:
        return False
    trigger = getattr(CallbackTrigger, "CUDAGRAPH_RECORDING", None)
    if trigger is None:
        return False

    def on_start(args: Any = None) -> None:
        if getattr(args, "callback_trigger", None) == trigger:
            _RECORDINGS[0] += 1

    _RECORDINGS.append(0)
    callback_handler.register_start_callback(on_start)
    return True


def compile_counts() -> dict[str, int | None]:
    """{graphs: graphs dynamo compiled in this process, cudagraph_recordings: CUDA graphs recorded
    since counting began (None: not counted)}. Differences between two reads count a rollout's."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "cudagraph_recordings": _RECORDINGS[0] if _RECORDINGS else None}
