"""Attention implementations: `model.attn_implementation=auto` and a GQA-aware SDPA.

Grouped-query attention (GQA: n_rep query heads share one key/value head) with a padding mask:
transformers' `sdpa` attention repeats K and V to every query head before calling
`torch.nn.functional.scaled_dot_product_attention` (`use_gqa_in_sdpa` is False whenever a mask
is given, because SDPA's `enable_gqa` with a mask falls back to the math kernel on CUDA, which
materialises the whole [B, Hq, S, K] score matrix). Every layer then allocates [B, Hq, K, D] keys
and values, and autograd keeps them for the backward. Left-padded batches (every rollout prefill
and every scoring pass here) always carry a mask.

`sdpa_gqa` (registered with transformers' AttentionInterface) computes the same attention
without repeating K/V: the n_rep query heads of a group are folded into the query length,

    query [B, Hq, S, D] -> [B, Hkv, n_rep * S, D]     (row r * S + s: head g * n_rep + r, position s)
    mask  [B, 1, S, K]  -> [B, 1, n_rep * S, K]       (each group member sees the same mask)

so SDPA attends each group to its own K/V head directly. Only the mask is repeated (n_rep
copies of a [B, 1, S, K] mask, built once per forward pass and shared by all layers, additive in
the query dtype with its rows aligned for the memory-efficient kernel, which then neither
converts nor pads it per layer). A one-token decode step (S = 1) needs no copy at all: its
mask [B, 1, 1, K] broadcasts over the n_rep rows of a group, so the step reads each K/V head once
instead of n_rep times. (transformers' own `sdpa` does the same since 5.23, but not under
torch.compile, which the compiled decode step is, and not before 5.23: there it repeats K/V to
every query head: at Qwen2.5's 6-8 query heads per K/V head, repeat_kv writes that many copies
of the cache and SDPA reads them, 13-17x the bytes of the cache itself.) Unmasked passes and anything
unusual (position bias, paged cache, softcap) go to transformers' own `sdpa` (`enable_gqa`).

`auto`: flash-attention 2 on CUDA when the `flash_attn` package is importable (GQA and padding
natively, via unpadding), else `sdpa_gqa` on CUDA and on the CPU (measured on the embedded
SmolLM2-135M, 9 query / 3 K/V heads, 2 CPU cores: prefill 5%, scoring forward + backward 20%
faster than `sdpa`), plain `sdpa` elsewhere (MPS, XPU: untested here).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from marl_llm.config import UserError

GQA_SDPA = "sdpa_gqa"
FLASH = "flash_attention_2"
# Where the memory-efficient SDPA kernel wants its mask rows (elements): torch pads (copies) a
# mask whose strides are not multiples of this, at every call.
_MASK_ALIGN = 8

# The folded mask of each transformers mask (one per forward pass, shared by every layer),
# dropped with it: {mask: (n_rep, dtype, mask version, folded mask)}.
_FOLDED: Any = WeakTensorKeyDictionary()


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def choose(requested: str | None, device_type: str, flash_installed: bool) -> str | None:
    """The attn_implementation to load a model with (None: transformers' default), for a model
    that computes on `device_type` ("cuda", "cpu", ...). Raises UserError for flash-attention 2
    without the package or without CUDA."""
    if requested == "auto":
        if device_type == "cuda":
            return FLASH if flash_installed else GQA_SDPA
        return GQA_SDPA if device_type == "cpu" else "sdpa"
    if requested == FLASH:
        if not flash_installed:
            raise UserError("model.attn_implementation=flash_attention_2 needs the flash-attn package: "
                            "`pip install flash-attn --no-build-isolation`, or use model.attn_implementation=auto")
        if device_type != "cuda":
            raise UserError(f"model.attn_implementation=flash_attention_2 runs on CUDA only, but the model is on "
                            f"{device_type}: use model.attn_implementation=auto (or sdpa)")
    return requested


def resolve(requested: str | None, device: torch.device) -> str | None:
    """`choose` for this process (is flash_attn importable?), registering `sdpa_gqa` first."""
    register()
    return choose(requested, device.type, flash_attn_installed() if requested in ("auto", FLASH) else False)


def register() -> None:
    """Make `attn_implementation="sdpa_gqa"` known to transformers (idempotent); its masks are
    built as for `sdpa` (boolean [B, 1, S, K], or None where `is_causal` suffices)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if GQA_SDPA not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_gqa_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)


def fold_mask(mask: torch.Tensor, n_rep: int, dtype: torch.dtype) -> torch.Tensor:
    """A transformers SDPA mask [Bm, 1 or Hq, S, K] (boolean: True attends; or additive) as the
    additive mask [Bm, 1 or Hkv, n_rep * S, K] of folded queries, in `dtype`. Masked entries get
    the dtype's most negative finite value (not -inf: every SDPA backend then takes a fully
    masked row, a left-padding query, without NaN). Rows are strided by a multiple of 8."""
    Bm, Hm, S, K = mask.shape
    groups = 1 if Hm == 1 else Hm // n_rep
    source = mask[:, :, None] if Hm == 1 else mask.reshape(Bm, groups, n_rep, S, K)  # [Bm, g, 1 or n_rep, S, K]
    padded = -(-K // _MASK_ALIGN) * _MASK_ALIGN
    folded = torch.empty((Bm, groups, n_rep, S, padded), dtype=dtype, device=mask.device)[..., :K]
    if mask.dtype == torch.bool:
        folded.fill_(torch.finfo(dtype).min).masked_fill_(source, 0.0)
    else:
        folded.copy_(source)
    return folded.view(Bm, groups, n_rep * S, K)  # merging (n_rep, S) keeps the padded row stride


def _folded(mask: torch.Tensor, n_rep: int, dtype: torch.dtype) -> torch.Tensor:
    """fold_mask, computed once per transformers mask (every layer of a pass gets the same one).
    An inference-mode mask has no version counter to tell an in-place change: it is folded per
    layer (only prefills come here in inference mode: one-token decode steps fold no mask)."""
    if mask.is_inference():
        return fold_mask(mask, n_rep, dtype)
    hit = _FOLDED.get(mask)
    if hit is not None and hit[:3] == (n_rep, dtype, mask._version):
        return hit[3]
    folded = fold_mask(mask, n_rep, dtype)
    _FOLDED[mask] = (n_rep, dtype, mask._version, folded)
    return folded


def sdpa_gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, is_causal: bool | None = None,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query [B, Hq, S, D], key/value [B, Hkv, K, D(v)],
    attention_mask [B, 1, S, K] or None; returns (output [B, S, Hq, Dv], None), as `sdpa`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, Hq, S, _ = query.shape
    Hkv = key.shape[1]
    n_rep = Hq // Hkv
    if (n_rep == 1 or attention_mask is None or attention_mask.dim() != 4 or Hq != Hkv * n_rep
            or attention_mask.shape[1] not in (1, Hq) or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if S == 1:  # a decode step: [Bm, 1, 1, K] broadcasts over a group's rows; a per-head mask is a view
        Bm, Hm, _, K = attention_mask.shape
        mask = attention_mask if Hm == 1 else attention_mask.reshape(Bm, Hkv, n_rep, K)
    else:
        mask = _folded(attention_mask, n_rep, query.dtype)
    q = query.reshape(B, Hkv, n_rep * S, query.shape[-1])  # heads g * n_rep + r -> rows r * S + s of group g
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    out = out.reshape(B, Hq, S, value.shape[-1]).transpose(1, 2).contiguous()  # [B, S, Hq, Dv]
    return out, None
