"""Memory-lean scoring: per-token log-probs and entropies without whole [B, C, V] fp32 logits.

Scoring completions used to ask the model for the logits of every completion position ([B, C, V]
in the model dtype), cast them to fp32 and take a log-softmax (and a softmax for the entropy):
several [B, C, V] fp32 tensors alive at once, the fp32 ones kept by autograd for the backward.
With a 152k vocabulary that is ~13.7 GB at 16 x 256 completion tokens.

Here the model runs with `logits_to_keep=1` (one position's logits) while a forward hook on its
decoder records the final hidden states [B, T, H]. The LM head is then applied to the
completion tokens' states in chunks of rows, each chunk in fp32:

    logp    = logits[target] - logsumexp(logits)
    entropy = logsumexp(logits) - sum(softmax(logits) * logits)     (no gradient)

each chunk under a non-reentrant `torch.utils.checkpoint`, so the backward recomputes one
chunk's logits at a time instead of keeping them all: the extra peak is a few [rows, V] fp32
buffers. Padding positions (after a completion's end) are skipped altogether.

The model is still called through its own forward (peft's, or `models.full_model`'s autocast
wrapper), so adapters, mixed batches and autocast are as before; the head runs under the
autocast state the decoder ran under. An FSDP-sharded model keeps its root unit (embeddings,
final norm, LM head) gathered after its forward pass (fsdp.shard_model), so its head is applied
the same way. Models whose logits are not just `head(hidden)` (a final logit softcap or scale)
keep the full-logits path, which is chunked the same way.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterator

import torch
from torch.utils.checkpoint import checkpoint


# Elements of one chunk's [rows, V] logits: rows = LOGIT_CHUNK_ELEMENTS // V (341 rows of
# SmolLM2's 49k vocabulary, 110 of Qwen's 152k). Measured on SmolLM2's head (CPU, fwd + bwd of
# 2048 rows with entropy): peak extra memory ~21 bytes per element (32 / 128 / 341 / 1024 rows:
# 40 / 129 / 352 / 994 MB); time flat from 128 rows up, 2.4x slower at 32. Not a config key:
# ~350 MB is small next to the decoder's activations at any size where it matters.
LOGIT_CHUNK_ELEMENTS = 1 << 24
# When the head itself trains (full fine-tuning: its tied embeddings), every chunk's backward adds
# a whole [V, d] gradient into the head's .grad (and, under autocast, casts the whole head again in
# the recomputation): at 110 rows a chunk that is ~300 times per micro-batch of 32k tokens at
# Qwen's vocabulary, each moving ~4 GB of the head, several times the chunk's own matmuls. Chunks
# are then at least this many tokens (the head's traffic about a quarter of its FLOPs' time at
# 1024; the extra peak is ~3 GB of [1024, 152k] fp32 buffers, next to a full fine-tuning's
# 16 bytes per parameter).
TRAINED_HEAD_CHUNK_TOKENS = 1024

# Config attributes of transformers models whose logits are not `lm_head(hidden)`.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scaling")

# Models seen to produce logits other than head(final hidden state): full-logits path from then on.
_UNUSUAL: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lm_head(model: Any) -> torch.nn.Module | None:
    """The module that turns the decoder's final hidden states into logits (peft's LoRA wrapper
    of it, when the head is an adapter target), or None where the lean path does not apply:
    a model without the usual decoder/head structure, a final logit transform (softcap, scale)
    the head alone does not reproduce. (An FSDP-sharded model's head is gathered by the model's
    own forward pass and stays so: fsdp.shard_model.)"""
    if model in _UNUSUAL:
        return None
    base = _base(model)
    get_head, get_decoder = getattr(base, "get_output_embeddings", None), getattr(base, "get_decoder", None)
    if get_head is None or get_decoder is None:
        return None
    head = get_head()
    try:
        decoder = get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return None
    if not isinstance(head, torch.nn.Module) or not isinstance(decoder, torch.nn.Module) or decoder is base:
        return None
    config = getattr(base, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value is not None and value != 1 and not isinstance(value, bool):
            return None
    return head


@contextlib.contextmanager
def _recording_final_states(model: Any) -> Iterator[dict[str, Any]]:
    """Context: records the decoder's output hidden states [B, T, H] of each forward pass (the
    last one wins) and the autocast state it ran under."""
    record: dict[str, Any] = {}
    device_type = next(model.parameters()).device.type

    def hook(module: Any, args: Any, output: Any) -> None:
        record["states"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        enabled = torch.is_autocast_enabled(device_type)
        record["autocast"] = (device_type, torch.get_autocast_dtype(device_type)) if enabled else None

    handle = _base(model).get_decoder().register_forward_hook(hook)
    try:
        yield record
    finally:
        handle.remove()


def _autocast(state: tuple[str, torch.dtype] | None) -> contextlib.AbstractContextManager:
    return torch.autocast(state[0], dtype=state[1]) if state is not None else contextlib.nullcontext()


def final_states(model: Any, head: torch.nn.Module, **inputs: Any):
    """Run `model(**inputs, logits_to_keep=1)` and return (out, states [B, T, H], autocast state),
    where `states` are the decoder's final hidden states, or None when `head(states)` does not
    reproduce the model's own logits of the last position (a logit transform `lm_head` could not
    see): the model is then marked for the full-logits path and the caller falls back."""
    with _recording_final_states(model) as record:
        out = model(**inputs, logits_to_keep=1)
    states, autocast = record.get("states"), record.get("autocast")
    if states is None or states.shape[:2] != inputs["input_ids"].shape[:2]:
        _UNUSUAL.add(model)
        return out, None, None
    with torch.no_grad(), _autocast(autocast):
        ours = head(states[:, -1]).float()
    theirs = out.logits[:, -1].detach().float()
    # Same head on the same states: equal up to the matmul's rounding (bf16: ~1%); a softcap or
    # logit scale changes the largest logits by far more.
    tol = 1e-4 if out.logits.dtype == states.dtype == torch.float32 and autocast is None else 3e-2
    if ours.shape != theirs.shape or float((ours - theirs).abs().max()) > tol * (1 + float(theirs.abs().max())):
        _UNUSUAL.add(model)
        warnings.warn(f"{type(_base(model)).__name__}: its logits are not lm_head(hidden states); scoring falls back "
                      "to full-vocabulary logits (more memory)", stacklevel=3)
        return out, None, None
    return out, states, autocast


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32, or as it is when wider (float64 runs keep float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _chunk_logprobs(head: torch.nn.Module | None, x: torch.Tensor, targets: torch.Tensor,
                    entropy: dict[str, Any] | None) -> torch.Tensor:
    """Log-probs [n] of `targets` [n] from hidden states x [n, H] (head=None: x are logits
    [n, V]), in fp32 (fp64 stays fp64, so the tests can tell rounding from a real difference). Appends the entropies [n] (no gradient) to entropy["chunks"] unless
    entropy["done"] (the checkpoint's recomputation in the backward)."""
    logits = at_least_fp32(x if head is None else head(x))  # [n, V]
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
    if entropy is not None and not entropy["done"]:
        with torch.no_grad():
            entropy["chunks"].append(lse - (torch.softmax(logits, dim=-1) * logits).sum(-1))
    return logp


def token_logprobs(states: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, head: torch.nn.Module | None,
                   with_entropy: bool = False, autocast: tuple[str, torch.dtype] | None = None,
                   chunk_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of `targets` [B, C] from the states predicting them.

    states: [B, C, H] final hidden states, turned into logits by `head` (under `autocast`, the
    decoder's autocast state), or [B, C, V] logits when head is None. mask [B, C]: 1 where a
    token counts; other positions are skipped and get 0. chunk_elements: a chunk's rows x V
    (default LOGIT_CHUNK_ELEMENTS).
    Returns logp [B, C] fp32 (differentiable) and, if asked, entropy [B, C] fp32 (no gradient);
    fp64 for fp64 states.
    """
    B, C = targets.shape
    keep = mask.to(states.device).bool()
    if not bool(keep.any()):  # nothing to score: still one row, so the result stays in the graph
        keep = torch.zeros_like(keep)
        keep[0, 0] = True
    rows = states[keep]  # [N, H or V]
    wanted = targets.to(states.device)[keep]  # [N]
    with torch.no_grad(), _autocast(autocast):  # the vocabulary size, from one row
        vocab = (rows[:1] if head is None else head(rows[:1])).shape[-1]
    n = max(1, (chunk_elements or LOGIT_CHUNK_ELEMENTS) // vocab)
    entropy = {"chunks": [], "done": False} if with_entropy else None
    params_need_grad = head is not None and any(p.requires_grad for p in head.parameters())
    grad = torch.is_grad_enabled() and (rows.requires_grad or params_need_grad)
    if grad and params_need_grad:  # the head trains: chunks by tokens (TRAINED_HEAD_CHUNK_TOKENS)
        n = max(n, TRAINED_HEAD_CHUNK_TOKENS)
    pieces = []
    with _autocast(autocast):
        for x, t in zip(torch.split(rows, n), torch.split(wanted, n)):
            if grad:
                pieces.append(checkpoint(_chunk_logprobs, head, x, t, entropy, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(head, x, t, entropy))
    if entropy is not None:
        entropy["done"] = True
    kept = torch.cat(pieces)  # [N]
    logp = torch.zeros((B, C), dtype=kept.dtype, device=states.device)
    logp = logp.index_put(keep.nonzero(as_tuple=True), kept)
    ent = None
    if entropy is not None:
        ent = torch.zeros((B, C), dtype=kept.dtype, device=states.device)
        ent[keep] = torch.cat(entropy["chunks"])
        ent = ent * mask.to(ent.device, ent.dtype)
    return logp * mask.to(logp.device, logp.dtype), ent


def predicting_states(model: Any, head: torch.nn.Module | None, keep: int, **inputs: Any):
    """One forward pass for scoring: returns (out, states, head, autocast) where states are the
    final hidden states [B, keep, H] of the last `keep` positions, to be turned into logits by
    `head` under `autocast` (token_logprobs). head=None, or a model whose logits `head` does not
    reproduce: states are the model's own logits [B, keep, V] and the returned head is None."""
    if head is not None:
        out, states, autocast = final_states(model, head, **inputs)
        if states is not None:
            return out, states[:, -keep:], head, autocast
    out = model(**inputs, logits_to_keep=keep)
    return out, out.logits, None, None
