"""Rollout: generate every agent's completions, and score completions under a policy.

Per-row sampling itself is in sampling.py. The rollout interface is deliberately small (as in verl): `generate(requests)` and
`update_weights()`. `HFRollout` batches the requests of all agents that share a base model into
one `generate` call per chunk (peft mixed-adapter batches: each row names its adapter), with left
padding and the KV cache. Sampling settings may differ per row: a per-row logits processor
applies each request's temperature / top-k / top-p (temperature 0 = greedy).

Token bookkeeping never re-tokenizes text: a completion keeps the exact prompt ids it was
generated from and the generated ids up to and including the first end-of-sequence token. That
keeps the prompt/completion boundary right when pad == eos (SmolLM2 and many chat models).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicLayer

from marl_llm.distributed import fsdp
from marl_llm.models import scoring
from marl_llm.models.cache_api import cache_kwargs, output_cache
from marl_llm.models.loading import announce
from marl_llm.models.memory import kv_budget, kv_cache_bytes
from marl_llm.models.policies import AgentPolicies
from marl_llm.models.prompting import encode_prompt
from marl_llm.rollout.base import PROGRESS, Completion, GenRequest
from marl_llm.rollout.mixed_lora import MixedLoRA, has_adapters
from marl_llm.rollout.sampling import PerRowSampling, SamplingParams, uniform_draws
from marl_llm.rollout.static_step import (CAPACITY_MULTIPLE, ROW_MULTIPLE, bucket, compact_rows, compiled_step,
                                          full_attention_only, kept_cache_bytes, model_step, release_kept_caches,
                                          round_up, set_view, static_cache)
from marl_llm.rollout.stops import cut_at_stop, stop_position

def cut_at_eos(generated: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, bool]:
    """Generated ids [L] → (ids through the first EOS, truncated?). Anything after the first EOS
    is padding (pad == eos for many models) and is dropped."""
    is_eos = torch.isin(generated, torch.tensor(eos_ids, device=generated.device))
    if bool(is_eos.any()):
        end = int(is_eos.int().argmax()) + 1
        return generated[:end], False
    return generated, True


class HFRollout:
    """Generation on the trainer's own (peft) models, with a decode loop of its own.

    Why not `model.generate`: (1) siblings share a prompt, so each distinct (prompt, adapter) is
    prefilled once and its KV cache copied to its G rows (`generate` prefills every row); (2) rows
    that finished leave the batch (checked every COMPACT_EVERY steps), so a long straggler does not
    drag finished rows through every step; (3) per-row sampling and the minimum length are applied
    inline, with no host read of the device per token. Every row acts with its
    own agent's adapter through `MixedLoRA` (peft's mixed batches as a fallback). Fully
    fine-tuned policies (algo.lora=null) are one model each: a chunk is one policy's rows.
    `decode` (trainer.decode): "dynamic" (rows leave the batch), "static" (fixed shapes, a
    StaticCache) or "auto"; `compile_decode` (trainer.compile_decode: true, false or "auto") runs
    the static step under torch.compile (`resolve_decode`).

    Rows per generate call: at most `max_batch` (trainer.sequences_per_generate), and at most what
    the KV budget holds (`kv_cache_gib`: GiB, or "auto", from the memory free at each call;
    models/memory.py). Each row's cache holds the chunk's longest prompt plus its largest
    max_new_tokens; the budget is told once (`kv_chunks`).
    """

    def __init__(self, policies: AgentPolicies, max_batch: int = 64, decode: str = "dynamic",
                 compile_decode: bool | str = False, kv_cache_gib: Any = "auto", sharded: bool = False):
        self.policies = policies
        self.max_batch = max_batch
        self.static, self.compile_decode = resolve_decode(
            decode, compile_decode, policies.device.type, all(full_attention_only(m) for m in policies.models), sharded)
        if sharded and resolve_decode(decode, compile_decode, policies.device.type, True) != (False, False):
            announce(FSDP_EAGER)  # one line where the run would have decoded otherwise
        self.kv_cache_gib = kv_cache_gib
        self._told_budget = False

    def update_weights(self) -> None:
        """The adapters are the trainer's own tensors: nothing to sync (a vLLM rollout would push them)."""

    def release(self) -> None:
        """The end of a rollout phase (the trainer calls it before each update and after each
        evaluation): the compiled step's kept caches go (static_step.py), so no KV cache outlives its phase."""
        for model in self.policies.models:
            release_kept_caches(model)

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        PROGRESS.debug("generate", extra={"sequences": len(requests)})
        out: list[Completion | None] = [None] * len(requests)
        by_model: dict[int, list[int]] = {}
        for j, r in enumerate(requests):
            by_model.setdefault(self.policies.agents[r.agent].model_index, []).append(j)
        for k, rows in by_model.items():
            prompts = [encode_prompt(self.policies.tokenizers[k], requests[j].message) for j in rows]
            for chunk in self._chunks(k, prompts, [requests[j].sampling.max_new_tokens for j in rows]):
                completions = self._generate_chunk(k, [requests[rows[i]] for i in chunk], [prompts[i] for i in chunk])
                for i, c in zip(chunk, completions):
                    out[rows[i]] = c
                PROGRESS.debug("generated", extra={"sequences": len(chunk),
                                                   "tokens": sum(len(c.completion_ids) for c in completions)})
        PROGRESS.debug("generate done")
        return out  # type: ignore[return-value]

    def _chunks(self, k: int, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
        """The rows of model k cut into generate calls within max_batch and the KV budget."""
        model = self.policies.models[k]
        held = kept_cache_bytes(model) if self.compile_decode else 0
        budget, how = kv_budget(self.policies.device, self.kv_cache_gib, held)
        per_position = kv_cache_bytes(model.config, self.policies.dtype, 1)
        compiled = self.static and self.compile_decode
        chunks = kv_chunks([len(p) for p in prompts], new_tokens, self.max_batch, budget // per_position,
                           ROW_MULTIPLE if compiled else 1, CAPACITY_MULTIPLE if compiled else 1)
        if not self._told_budget:
            self._told_budget = True
            width, steps = max(len(p) for p in prompts), max(new_tokens)
            fit = budget // per_position // (2 * width + steps)
            announce(f"KV cache budget {budget / 2**30:.1f} GiB ({how}; trainer.kv_cache_gib sets it): a cached "
                     f"position takes {per_position / 2**10:.3g} KiB, so {fit} rows of {width} + {steps} positions fit "
                     f"in one generate call (trainer.sequences_per_generate={self.max_batch} at most)")
        return chunks

    def _generate_chunk(self, k: int, requests: list[GenRequest], prompts: list[list[int]]) -> list[Completion]:
        model, tok = self.policies.models[k], self.policies.tokenizers[k]
        adapters = [self.policies.agents[r.agent].adapter for r in requests]
        eos_ids = self.policies.eos_ids[k]
        rules = [r.sampling.stop for r in requests]

        def stopped(row: int, ids: torch.Tensor) -> bool:
            return stop_position(rules[row], tok.decode(ids.tolist(), skip_special_tokens=True)) is not None

        # fp32 master weights: cast once per generate call, not in every decode step
        with fsdp.inference_mode(model), self.policies.autocast(k), self.policies.decoding_weights(k):
            generated = decode(model, prompts, adapters, [r.sampling for r in requests], eos_ids, tok.pad_token_id,
                               row_keys=[r.key for r in requests], static=self.static,
                               compile_step=self.compile_decode, stop_check=stopped if any(rules) else None)
        return [to_completion(tok, p, ids, eos_ids, rule) for p, ids, rule in zip(prompts, generated, rules)]


def resolve_decode(decode: str, compile_decode: bool | str, device_type: str, full_attention: bool,
                   sharded: bool = False) -> tuple[bool, bool]:
    """(static, compiled) for trainer.decode / trainer.compile_decode. auto: the static step
    compiled into CUDA graphs on CUDA for a model whose layers all attend in full (the fixed-shape
    step CUDA graphs replay), the dynamic eager loop otherwise (on the CPU compiling only costs:
    docs/gpu.md); compile_decode=auto compiles a static step on CUDA. `sharded` (FSDP): the
    eager dynamic loop, whatever was asked (`FSDP_EAGER`)."""
    if sharded:
        return False, False
    static = decode == "static" or (decode == "auto" and device_type == "cuda" and full_attention)
    compiled = compile_decode is True or (compile_decode == "auto" and static and device_type == "cuda")
    return static, static and compiled


# Why FSDP-sharded models decode with the eager loop: dynamo breaks a compiled step into a graph per
# FSDP unit at its hooks, and the all-gathered weights of an unsharded rollout live at new addresses
# every rollout, so CUDA graphs would record again every time.
FSDP_EAGER = ("trainer.fsdp: the sharded models decode with the eager loop (trainer.decode=dynamic): a compiled "
              "step breaks at every FSDP unit and records its graphs again every rollout")


def kv_chunks(prompt_lengths: list[int], new_tokens: list[int], max_rows: int, max_positions: int,
              row_multiple: int = 1, capacity_multiple: int = 1) -> list[list[int]]:
    """Rows (indices, in order) cut into generate calls: at most `max_rows` each, and at most
    `max_positions` cached positions (the KV budget over a position's bytes). A call of r rows
    whose longest prompt is P and largest max_new_tokens N caches r * (P + N) positions, and while
    its prefill's cache moves into the decode's, r * P more (rows and the P + N positions rounded
    up as a compiled step rounds them). A row alone over the budget still gets its own call."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    width = steps = 0
    for i, (p, n) in enumerate(zip(prompt_lengths, new_tokens)):
        w, s = max(width, p), max(steps, n)
        cost = round_up(len(chunk) + 1, row_multiple) * (w + round_up(w + s, capacity_multiple))
        if chunk and (len(chunk) >= max_rows or cost > max_positions):
            chunks.append(chunk)
            chunk, w, s = [], p, n
        chunk.append(i)
        width, steps = w, s
    return chunks + [chunk] if chunk else chunks


def to_completion(tokenizer, prompt: list[int], generated: torch.Tensor, eos_ids: list[int],
                  stop: str | None = None) -> Completion:
    """A Completion from its exact prompt ids and generated ids, cut at the first end of sequence
    or where the stop rule `stop` ends it (rollout/stops.py; every rollout backend builds its
    completions here, so they score alike)."""
    ids, truncated = cut_at_eos(generated, eos_ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = cut_at_stop(tokenizer, ids.tolist(), stop) if stop is not None else None
    if cut is not None:
        (n, text), truncated = cut, False
        ids = ids[:n]
    return Completion(torch.tensor(prompt), ids, text, truncated)


def left_pad(prompts: list[Any], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts (id lists or tensors) as left-padded input_ids [B, P], attention_mask [B, P] and
    position_ids [B, P] (counting real tokens only, so a padded row sees the positions it would
    see alone)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        att[b, width - len(p):] = 1
    return ids, att, (att.cumsum(dim=1) - 1).clamp(min=0)


class PreallocatedLayer(DynamicLayer):
    """A KV-cache layer whose keys/values live in one buffer sized for the whole rollout.

    transformers' DynamicLayer concatenates the whole cache at every decode step (about a tenth
    of decoding time here); this writes the new column in place and hands attention a view.
    Built from a prefilled DynamicLayer, it replaces it in `cache.layers`.
    """

    _layer_type = None  # never registered as a layer type of transformers' own caches
    # transformers skips the decode mask when the 2D padding mask is all ones, which it finds out
    # by reading it on the host: a device sync per step. A "compileable" cache always gets the mask.
    is_compileable = True

    def __init__(self, layer: DynamicLayer, capacity: int):
        super().__init__()
        B, H, L, D = layer.keys.shape
        self.dtype, self.device, self.length, self.is_initialized = layer.keys.dtype, layer.keys.device, L, True
        self._keys = layer.keys.new_empty((B, H, capacity, D))
        self._values = layer.values.new_empty((B, H, capacity, D))
        self._keys[:, :, :L], self._values[:, :, :L] = layer.keys, layer.values
        self._expose()

    def _expose(self) -> None:
        self.keys, self.values = self._keys[:, :, :self.length], self._values[:, :, :self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        n = key_states.shape[-2]
        self._keys[:, :, self.length:self.length + n] = key_states
        self._values[:, :, self.length:self.length + n] = value_states
        self.length += n
        self._expose()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._expose()


def preallocate(cache: Any, new_tokens: int) -> None:
    """Swap a prefilled DynamicCache's plain layers for PreallocatedLayers with room for
    `new_tokens` more positions (sliding-window and other layer kinds stay as they are)."""
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if type(layer) is DynamicLayer and layer.is_initialized:
            cache.layers[i] = PreallocatedLayer(layer, layer.keys.shape[-2] + new_tokens)


# The dynamic decode loop reads which rows are done only every COMPACT_EVERY steps (each read is
# a device sync: on a GPU it drains the queue the host had launched ahead): rows that finished in
# between keep decoding, their tokens written as padding, until the check drops them from the
# batch and the KV cache. Measured on 2 shared CPU cores (SmolLM2-135M, 32 rows of 4..64 tokens):
# 79-80 tokens/s compacting every 1 or 4 steps, 78.5 every 16, 70 every 64 (within noise up to 16).
COMPACT_EVERY = 16


def decode(model, prompts: list[list[int]], adapters: list[str], params: list[SamplingParams], eos_ids: list[int],
           pad_id: int, mixed_lora: bool = True, preallocate_cache: bool = True,
           row_keys: list[int | None] | None = None, static: bool = False,
           compile_step: bool = False, stop_check: Callable[[int, torch.Tensor], bool] | None = None
           ) -> list[torch.Tensor]:
    """Sample a completion for each (prompt, adapter, sampling) row; returns each row's generated
    ids [<= max_new_tokens] on CPU, through its first end-of-sequence id. `row_keys` seed rows'
    draws (GenRequest.key). `mixed_lora` and `preallocate_cache` switch those levers off for
    the benchmark's lever table. `stop_check(row, ids so far [t])`: has a stop rule ended the row?
    Asked at every compaction check (COMPACT_EVERY steps), so a stopped row leaves the batch then;
    the ids it generated after the rule's end are cut by the caller (to_completion).

    Shapes: the prefill runs on the U distinct (adapter, prompt) pairs [U, P]; its KV cache is
    then gathered to the B rows; each decode step feeds [b, 1]. Dynamic (default): b is the rows
    still running, finished rows leaving the batch every COMPACT_EVERY steps. `static`: a
    StaticCache of P + max_new_tokens positions, each step reading a view of it: the running rows
    (finished rows leave at the same checks; compiled, a bucket of rows >= the running ones) and a
    window of a bucket of positions >= those written (fixed shapes, few of them), the same tokens;
    `compile_step` runs that step under torch.compile, over the cache kept for its shape, rows
    and positions rounded up (static_step.py).
    Nothing reads the device inside the loop but the check every COMPACT_EVERY steps; the
    generated ids stay on the device until the end.
    """
    compiled = static and compile_step
    real = len(prompts)
    if compiled and real % ROW_MULTIPLE:  # extra rows: copies of row 0 (no extra prefill), finished from the start
        extra = round_up(real, ROW_MULTIPLE) - real
        prompts, adapters, params = list(prompts) + [prompts[0]] * extra, list(adapters) + [adapters[0]] * extra, \
            list(params) + [params[0]] * extra
        row_keys = list(row_keys or [None] * real) + [0] * extra  # keyed: no draw from the global RNG
    device = next(model.parameters()).device
    keys = [(a, tuple(p)) for a, p in zip(adapters, prompts)]
    distinct = list(dict.fromkeys(keys))
    slot = {key: u for u, key in enumerate(distinct)}
    source = torch.tensor([slot[key] for key in keys], device=device)
    mixed = mixed_lora and MixedLoRA.supported(model, list(dict.fromkeys(adapters)))
    peft_mixed = not mixed and len(set(adapters)) > 1  # peft's own mixed batches: adapter names per row
    if not mixed and len(set(adapters)) == 1 and has_adapters(model):  # a full model is its own policy
        model.set_adapter(adapters[0])
    lora = MixedLoRA(model, adapters) if mixed else contextlib.nullcontext()
    B, max_new = len(prompts), [p.max_new_tokens for p in params]
    steps = max(max_new)
    eos = torch.tensor(eos_ids, device=device)
    step = compiled_step(device) if compiled else model_step
    with lora:
        ids, att, pos = left_pad([list(p) for _, p in distinct], pad_id)
        prefill_adapters = [a for a, _ in distinct]
        if mixed:
            lora.set_rows(prefill_adapters)
        head = model(input_ids=ids.to(device), attention_mask=att.to(device), position_ids=pos.to(device),
                     use_cache=True, logits_to_keep=1, **({"adapter_names": prefill_adapters} if peft_mixed else {}))
        cache = output_cache(head)
        cache.batch_select_indices(source)  # each row starts from its prompt's keys and values
        width = ids.shape[1]
        capacity = width + steps
        if static:
            if compiled:  # fewer distinct shapes to compile (and capture as CUDA graphs)
                capacity = round_up(capacity, CAPACITY_MULTIPLE)
            cache = static_cache(model, cache, capacity, keep=compiled)
            window = bucket(width + 1, CAPACITY_MULTIPLE, capacity)
            set_view(cache, B, window)
        elif preallocate_cache:
            preallocate(cache, steps)
        logits = head.logits[source, -1]  # [B, V]
        # Per-row state [b, ...], sliced together when finished rows leave the batch. The
        # attention mask covers every position the rollout can reach [b, P + steps]: generated
        # positions are real tokens, and causality hides those not written yet.
        att = torch.cat([att.to(device)[source], att.new_ones((B, capacity - width), device=device)], dim=1)
        next_pos = pos.to(device)[source, -1] + 1
        min_len = torch.tensor([p.min_new_tokens for p in params], device=device)
        max_len = torch.tensor(max_new, device=device)
        draws = uniform_draws(row_keys or [None] * B, steps, device)  # [B, steps]
        sampler = PerRowSampling(params, device)
        rows = list(range(B))  # batch row -> request index (host)
        row_index = torch.arange(B, device=device)  # the same on the device
        if mixed:
            adapter_of_row = lora.adapter_index(adapters)  # [B]
            lora.set_rows(adapter_of_row)
        finished = torch.arange(B, device=device) >= real  # the extra rows of a compiled step
        out = torch.full((B, steps), pad_id, dtype=torch.long, device=device)
        eos_column = torch.isin(torch.arange(logits.shape[-1], device=device), eos)  # [V]
        early_until = max(p.min_new_tokens for p in params)  # no end of sequence before a row's minimum
        end = steps  # every row still running stops by then
        for t in range(steps):
            scores = logits.float()
            if t < early_until:
                scores = scores.masked_fill((t < min_len).unsqueeze(1) & eos_column, float("-inf"))
            token = sampler.sample(scores, draws[:, t])
            out[:, t].index_copy_(0, row_index, token.masked_fill(finished, pad_id))  # finished rows: padding
            finished = finished | torch.isin(token, eos) | (t + 1 >= max_len)
            if t + 1 >= end:
                break
            if (t + 1) % COMPACT_EVERY == 0:
                done = finished.tolist()  # the loop's only device read
                if stop_check is not None:
                    ended = [i for i, d in enumerate(done) if not d and stop_check(rows[i], out[rows[i], :t + 1].cpu())]
                    for i in ended:
                        done[i] = True
                    if ended:
                        finished[torch.tensor(ended, device=device)] = True
                # about the tokens of the last COMPACT_EVERY steps (rows that ended within them count whole)
                PROGRESS.debug("decoding", extra={"tokens": len(rows) * COMPACT_EVERY})
                if all(done):
                    break
                end = max(max_new[r] for r, d in zip(rows, done) if not d)
                kept = [i for i, d in enumerate(done) if not d]
                if compiled:  # a compiled step's rows come in buckets: finished rows fill the bucket
                    size = bucket(len(kept), ROW_MULTIPLE, len(done))
                    kept = sorted(kept + [i for i, d in enumerate(done) if d][:size - len(kept)])
                if len(kept) < len(done):  # finished rows leave the batch (and the cache)
                    keep = torch.tensor(kept, device=device)
                    if static:  # the running rows move to the front of the fixed buffers
                        compact_rows(cache, keep, width + t)
                        set_view(cache, len(kept), window)
                    else:
                        cache.batch_select_indices(keep)
                    rows = [rows[i] for i in kept]
                    row_index, token, att, next_pos = row_index[keep], token[keep], att[keep], next_pos[keep]
                    min_len, max_len, draws, finished = min_len[keep], max_len[keep], draws[keep], finished[keep]
                    sampler = sampler.select(keep)
                    if mixed:
                        adapter_of_row = adapter_of_row[keep]
                        lora.set_rows(adapter_of_row)
            if static and width + t + 1 > window:  # the next bucket of positions
                window = bucket(width + t + 1, CAPACITY_MULTIPLE, capacity)
                set_view(cache, len(rows), window)
            if compiled and device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are consumed
            logits = step(model, token.unsqueeze(1), next_pos.unsqueeze(1), att[:, :window if static else width + t + 1],
                          cache, **({"adapter_names": [adapters[r] for r in rows]} if peft_mixed else {}))
            next_pos = next_pos + 1
    out = out.cpu()
    return [out[b, :max_new[b]] for b in range(real)]


# ---------------------------------------------------------------------------------- scoring
def pad_completions(completions: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded completion ids [B, C] and their mask [B, C] (1 on each completion's own tokens)."""
    C = max(max(len(c) for c in completions), 1)
    ids = torch.full((len(completions), C), pad_id, dtype=torch.long)
    mask = torch.zeros((len(completions), C), dtype=torch.float32)
    for b, c in enumerate(completions):
        ids[b, :len(c)] = c
        mask[b, :len(c)] = 1
    return ids, mask


def pad_pairs(prompts: list[torch.Tensor], completions: list[torch.Tensor], pad_id: int):
    """Pack (prompt, completion) pairs as [left-padded prompt | right-padded completion].

    Returns input_ids [B, P+C], attention_mask [B, P+C], position_ids [B, P+C] (counting real
    tokens only, as `generate` does with left padding) and completion_mask [B, C] (1 on the
    completion's own tokens: nothing of the prompt, nothing after its EOS).
    """
    prompt_ids, prompt_att, _ = left_pad(prompts, pad_id)
    comp_ids, cmask = pad_completions(completions, pad_id)
    ids = torch.cat([prompt_ids, comp_ids], dim=1)
    att = torch.cat([prompt_att, cmask.long()], dim=1)
    pos = (att.cumsum(dim=1) - 1).clamp(min=0)
    return ids, att, pos, cmask


def completion_logprobs(model, prompts: list[torch.Tensor], completions: list[torch.Tensor], pad_id: int,
                        with_entropy: bool = False):
    """Per-token log-probs of each completion given its prompt under `model` (its active adapter).

    Returns logp [B, C] fp32 (differentiable when grad is enabled), completion_mask [B, C] and,
    if asked, entropy [B, C] of the policy at each completion token (no grad; 0 elsewhere).
    No [B, C, V] logits are materialized: the LM head runs on the completion tokens' hidden
    states in chunks, each in fp32 and recomputed in the backward (scoring.py; models whose
    logits are not head(hidden), e.g. a softcap, chunk their own logits instead). When every
    completion shares one prompt (the G siblings of a rollout node), the prompt is encoded once
    and its KV cache reused for all of them (gradients flow through the cache); the result is
    the same. (Not on an FSDP-sharded model: its lockstep wants one forward pass per backward.)
    """
    if torch.is_grad_enabled():  # a micro-batch of an update (passes without gradients are not counted)
        PROGRESS.debug("micro-batch", extra={"sequences": len(prompts)})
    device = next(model.parameters()).device
    head = scoring.lm_head(model)  # None: the model's own logits
    shared = None
    if len(prompts) > 1 and not fsdp.is_sharded(model) and all(torch.equal(p, prompts[0]) for p in prompts[1:]):
        shared = _shared_prompt_logits(model, prompts[0], completions, pad_id, device, head)
    if shared is not None:
        states, cmask, targets, head, autocast = shared
    else:
        ids, att, pos, cmask = pad_pairs(prompts, completions, pad_id)
        C = cmask.shape[1]
        ids = ids.to(device)
        _, states, head, autocast = scoring.predicting_states(
            model, head, C + 1, input_ids=ids, attention_mask=att.to(device), position_ids=pos.to(device),
            use_cache=False)
        states, targets = states[:, :-1], ids[:, -C:]  # position t predicts token t+1: these predict the C completion tokens
    cmask = cmask.to(device)
    logp, entropy = scoring.token_logprobs(states, targets, cmask, head, with_entropy, autocast)
    return logp, cmask, entropy


def _shared_prompt_logits(model, prompt: torch.Tensor, completions: list[torch.Tensor], pad_id: int,
                          device: torch.device, head: torch.nn.Module | None = None):
    """What predicts k completions of one prompt, encoding the prompt once: with `head` (see
    scoring.lm_head) the final hidden states [k, C, H] the head turns into logits, else the
    logits [k, C, V].

    Returns (states, completion_mask [k, C], completion ids [k, C], head, autocast) (head None
    when the states are logits; see scoring.predicting_states), or None when the model keeps no
    KV cache (e.g. gradient checkpointing): the caller then packs full sequences.
    """
    k, P = len(completions), len(prompt)
    first, first_states, head, autocast = scoring.predicting_states(model, head, 1, input_ids=prompt[None].to(device),
                                                                    use_cache=True)
    cache = output_cache(first)
    if cache is None or not hasattr(cache, "layers"):
        return None
    for layer in cache.layers:  # one copy of the prompt's keys/values per completion
        layer.batch_repeat_interleave(k)
    ids, cmask = pad_completions(completions, pad_id)
    C = ids.shape[1]
    att = torch.cat([torch.ones((k, P), dtype=torch.long), cmask.long()], dim=1)
    pos = (P + torch.arange(C)).unsqueeze(0).expand(k, C)
    ids = ids.to(device)
    _, tail_states, tail_head, _ = scoring.predicting_states(
        model, head, C, input_ids=ids, attention_mask=att.to(device), position_ids=pos.to(device),
        use_cache=True, **cache_kwargs(cache))
    if tail_head is not head:  # the lean path fell back between the two passes: pack instead
        return None
    # The prompt's last position predicts completion token 0; completion position t predicts t+1.
    states = torch.cat([first_states[:, -1:].expand(k, 1, -1), tail_states[:, :-1]], dim=1)
    return states, cmask, ids, head, autocast
