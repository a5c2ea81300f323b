"""Rollout: generate every agent's completions, and score completions under a policy.

The rollout interface is deliberately small (as in verl): `generate(requests)` and
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
import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from marl_llm import fsdp
from marl_llm.mixed_lora import MixedLoRA, has_adapters
from marl_llm.models import AgentPolicies
from marl_llm.prompting import encode_prompt


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7  # 0: greedy
    top_p: float = 1.0
    top_k: int | None = 0  # 0: off; None: the model's generation config (Algorithm.agent_sampling fills it in)
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # no end of sequence before this many tokens (benchmarks fix lengths with it)

    @classmethod
    def from_cfg(cls, cfg: Any, **override: Any) -> "SamplingParams":
        fields = {k: cfg[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "min_new_tokens") if k in cfg}
        fields.update(override)
        return cls(**fields)


@dataclass
class GenRequest:
    agent: int
    message: str  # the agent's user message for this turn
    sampling: SamplingParams
    # Seeds this request's random draws (None: the global RNG). A request draws the same tokens
    # whatever else shares its batch, so splitting a step's problems over data-parallel ranks
    # samples exactly what one process would (see sample_key).
    key: int | None = None


def sample_key(*parts: int | str | None) -> int | None:
    """A 63-bit key from a path of parts (run seed, problem draw, turn, agent, sibling), or None
    when the path starts from no key (evaluation: the global RNG)."""
    if parts and parts[0] is None:
        return None
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Completion:
    prompt_ids: torch.Tensor  # [P] int64 on CPU, no padding
    completion_ids: torch.Tensor  # [C] int64 on CPU: generated ids through the first EOS, nothing after
    text: str  # the completion decoded without special tokens
    truncated: bool  # hit max_new_tokens before any EOS


class PerRowSampling:
    """Logits processor: row b gets its own temperature, top-k and top-p (temperature 0: argmax)."""

    def __init__(self, params: list[SamplingParams], device: torch.device):
        self.temperature = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
        self.top_k = [p.top_k for p in params]
        self.top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        greedy = self.temperature <= 0
        scores = scores / torch.where(greedy, 1.0, self.temperature).unsqueeze(1)
        neg = torch.finfo(scores.dtype).min
        if any(k > 0 for k in self.top_k):
            k = torch.tensor([k if k > 0 else scores.shape[1] for k in self.top_k], device=scores.device)
            kth = torch.sort(scores, dim=1, descending=True).values.gather(1, (k - 1).clamp(max=scores.shape[1] - 1).unsqueeze(1))
            scores = scores.masked_fill(scores < kth, neg)
        if bool((self.top_p < 1).any()):
            scores = self._top_p(scores, neg)
        if bool(greedy.any()):
            best = scores.argmax(dim=1, keepdim=True)
            only_best = torch.full_like(scores, neg).scatter(1, best, 0.0)
            scores = torch.where(greedy.unsqueeze(1), only_best, scores)
        return scores

    # The nucleus of a trained LM almost always lies in its top few hundred tokens: find it with
    # a partial top-k (cheap) and fall back to a full sort only for rows whose nucleus is wider.
    TOP_P_CANDIDATES = 256

    def _top_p(self, scores: torch.Tensor, neg: float) -> torch.Tensor:
        logz = scores.logsumexp(dim=1, keepdim=True)
        k = min(self.TOP_P_CANDIDATES, scores.shape[1])
        top, idx = scores.topk(k, dim=1)  # sorted descending
        probs = (top - logz).exp()
        before = probs.cumsum(dim=1) - probs  # mass strictly before each candidate
        active = self.top_p < 1
        wide = active & (before[:, -1] + probs[:, -1] < self.top_p)  # nucleus wider than the candidates
        if bool(wide.any()):
            top_w, idx_w = torch.sort(scores[wide], dim=1, descending=True)
            probs_w = (top_w - logz[wide]).exp()
            keep_w = (probs_w.cumsum(dim=1) - probs_w) < self.top_p[wide].unsqueeze(1)
            scores[wide] = torch.full_like(top_w, neg).scatter(1, idx_w, torch.where(keep_w, top_w, neg))
        narrow = active & ~wide
        if bool(narrow.any()):
            # Keep a token while the mass strictly before it is below top_p (always >= 1 token).
            keep = before[narrow] < self.top_p[narrow].unsqueeze(1)
            kept = torch.where(keep, top[narrow], torch.full_like(top[narrow], neg))
            scores[narrow] = torch.full_like(scores[narrow], neg).scatter(1, idx[narrow], kept)
        return scores


def cut_at_eos(generated: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, bool]:
    """Generated ids [L] → (ids through the first EOS, truncated?). Anything after the first EOS
    is padding (pad == eos for many models) and is dropped."""
    is_eos = torch.isin(generated, torch.tensor(eos_ids, device=generated.device))
    if bool(is_eos.any()):
        end = int(is_eos.int().argmax()) + 1
        return generated[:end], False
    return generated, True


class Rollout(Protocol):
    """What the algorithms generate with: HFRollout (default) or vllm_rollout.VLLMRollout."""

    def generate(self, requests: list[GenRequest]) -> list[Completion]: ...

    def update_weights(self) -> None:
        """Called after every update: a backend with its own copy of the weights syncs them."""


class HFRollout:
    """Generation on the trainer's own (peft) models, with a decode loop of its own.

    Why not `model.generate`: (1) siblings share a prompt, so each distinct (prompt, adapter) is
    prefilled once and its KV cache copied to its G rows (`generate` prefills every row); (2) rows
    that finished leave the batch, so a long straggler does not drag finished rows through every
    step; (3) per-row sampling and the minimum length are applied inline. Every row acts with its
    own agent's adapter through `MixedLoRA` (peft's mixed batches as a fallback). Fully
    fine-tuned policies (algo.lora=null) are one model each: a chunk is one policy's rows.
    """

    def __init__(self, policies: AgentPolicies, max_batch: int = 64):
        self.policies = policies
        self.max_batch = max_batch

    def update_weights(self) -> None:
        """The adapters are the trainer's own tensors: nothing to sync (a vLLM rollout would push them)."""

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        out: list[Completion | None] = [None] * len(requests)
        by_model: dict[int, list[int]] = {}
        for j, r in enumerate(requests):
            by_model.setdefault(self.policies.agents[r.agent].model_index, []).append(j)
        for k, rows in by_model.items():
            for start in range(0, len(rows), self.max_batch):
                chunk = rows[start:start + self.max_batch]
                for j, c in zip(chunk, self._generate_chunk(k, [requests[j] for j in chunk])):
                    out[j] = c
        return out  # type: ignore[return-value]

    def _generate_chunk(self, k: int, requests: list[GenRequest]) -> list[Completion]:
        model, tok = self.policies.models[k], self.policies.tokenizers[k]
        prompts = [encode_prompt(tok, r.message) for r in requests]
        adapters = [self.policies.agents[r.agent].adapter for r in requests]
        eos_ids = self.policies.eos_ids[k]
        with fsdp.inference_mode(model), self.policies.autocast(k):  # fp32 master weights: cast once
            generated = decode(model, prompts, adapters, [r.sampling for r in requests], eos_ids, tok.pad_token_id,
                               row_keys=[r.key for r in requests])
        return [to_completion(tok, p, ids, eos_ids) for p, ids in zip(prompts, generated)]


def to_completion(tokenizer, prompt: list[int], generated: torch.Tensor, eos_ids: list[int]) -> Completion:
    """A Completion from its exact prompt ids and generated ids, cut at the first end of sequence
    (every rollout backend builds its completions here, so they score alike)."""
    ids, truncated = cut_at_eos(generated, eos_ids)
    return Completion(torch.tensor(prompt), ids, tokenizer.decode(ids, skip_special_tokens=True), truncated)


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


def uniform_draws(keys: list[int | None], length: int, device: torch.device) -> torch.Tensor:
    """Each row's uniform draws for a whole rollout [B, length]: from its own generator when the
    row has a key (so a row's tokens do not depend on its batch), else from the global RNG."""
    u = torch.empty((len(keys), length))
    unkeyed = [b for b, key in enumerate(keys) if key is None]
    if unkeyed:
        u[unkeyed] = torch.rand((len(unkeyed), length))
    for b, key in enumerate(keys):
        if key is not None:
            u[b] = torch.rand(length, generator=torch.Generator().manual_seed(key))
    return u.to(device)


def sample_rows(probs: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of probs [B, V], by inverting each row's CDF at a uniform draw u [B]
    (default: fresh ones): 50x faster than torch.multinomial over a 49k vocabulary on CPU (0.16
    vs 7.8 ms for 8 rows), where multinomial was 5% of a training step. `right=True` never
    lands on a zero-probability token; a draw rounded past the total falls back to the row's
    most likely token."""
    cdf = probs.cumsum(dim=-1)
    if u is None:
        u = torch.rand(probs.shape[0], device=probs.device)
    u = u.to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    token = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)
    bad = probs.gather(1, token.unsqueeze(1)).squeeze(1) <= 0
    return torch.where(bad, probs.argmax(dim=-1), token)


def decode(model, prompts: list[list[int]], adapters: list[str], params: list[SamplingParams], eos_ids: list[int],
           pad_id: int, mixed_lora: bool = True, preallocate_cache: bool = True,
           row_keys: list[int | None] | None = None) -> list[torch.Tensor]:
    """Sample a completion for each (prompt, adapter, sampling) row; returns each row's generated
    ids [<= max_new_tokens] on CPU, through its first end-of-sequence id. `row_keys` seed rows'
    draws (GenRequest.key). `mixed_lora` and `preallocate_cache` switch those levers off for
    the benchmark's lever table.

    Shapes: the prefill runs on the U distinct (adapter, prompt) pairs [U, P]; its KV cache is
    then gathered to the B rows; each decode step feeds [b, 1] for the b rows still running.
    """
    device = next(model.parameters()).device
    keys = [(a, tuple(p)) for a, p in zip(adapters, prompts)]
    distinct = list(dict.fromkeys(keys))
    slot = {key: u for u, key in enumerate(distinct)}
    source = torch.tensor([slot[key] for key in keys], device=device)
    mixed = mixed_lora and MixedLoRA.supported(model, list(dict.fromkeys(adapters)))
    if not mixed and len(set(adapters)) == 1 and has_adapters(model):  # a full model is its own policy
        model.set_adapter(adapters[0])
    lora = MixedLoRA(model, adapters) if mixed else contextlib.nullcontext()
    eos = torch.tensor(eos_ids, device=device)
    max_new = [p.max_new_tokens for p in params]
    # Per-request length limits [B], indexed by `rows` (the requests still running).
    min_len = torch.tensor([p.min_new_tokens for p in params], device=device)
    max_len = torch.tensor(max_new, device=device)
    out = torch.full((len(prompts), max(max_new)), pad_id, dtype=torch.long)
    draws = uniform_draws(row_keys or [None] * len(prompts), max(max_new), device)  # [B, max_new]
    with lora:
        def forward(row_adapters: list[str], **inputs: Any):
            if mixed:
                lora.set_rows(row_adapters)
            elif len(set(adapters)) > 1:
                inputs["adapter_names"] = row_adapters
            return model(**inputs, use_cache=True, logits_to_keep=1)

        ids, att, pos = left_pad([list(p) for _, p in distinct], pad_id)
        head = forward([a for a, _ in distinct], input_ids=ids.to(device), attention_mask=att.to(device),
                       position_ids=pos.to(device))
        cache = head.past_key_values
        cache.batch_select_indices(source)  # each row starts from its prompt's keys and values
        if preallocate_cache:
            preallocate(cache, max(max_new))
        logits = head.logits[source, -1]
        att, next_pos = att.to(device)[source], pos.to(device)[source, -1] + 1
        rows = torch.arange(len(prompts), device=device)  # batch row -> request index, for rows still running
        row_adapters = list(adapters)
        sampler = PerRowSampling(params, device)
        eos_column = torch.isin(torch.arange(logits.shape[-1], device=device), eos)  # [V]
        for t in range(max(max_new)):
            scores = logits.float()
            early = t < min_len[rows]
            if bool(early.any()):  # no end of sequence before the row's minimum length
                scores = scores.masked_fill(early.unsqueeze(1) & eos_column, float("-inf"))
            token = sample_rows(sampler(None, scores).softmax(dim=-1), draws[rows, t])
            out[rows.cpu(), t] = token.cpu()
            done = torch.isin(token, eos) | (t + 1 >= max_len[rows])
            if bool(done.all()):
                break
            if bool(done.any()):  # finished rows leave the batch (and the cache)
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, token, att, next_pos = rows[keep], token[keep], att[keep], next_pos[keep]
                row_adapters = [row_adapters[int(i)] for i in keep]
                sampler = PerRowSampling([params[int(i)] for i in rows], device)
            att = torch.cat([att, att.new_ones((len(rows), 1))], dim=1)
            step = forward(row_adapters, input_ids=token.unsqueeze(1), attention_mask=att,
                           position_ids=next_pos.unsqueeze(1), past_key_values=cache)
            logits, next_pos = step.logits[:, -1], next_pos + 1
    return [out[b, :max_new[b]] for b in range(len(prompts))]


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

    Returns logp [B, C] (differentiable when grad is enabled), completion_mask [B, C] and, if
    asked, entropy [B, C] of the policy at each completion position (no grad). Only the logits
    of completion positions are materialized (`logits_to_keep`). When every completion shares
    one prompt (the G siblings of a rollout node), the prompt is encoded once and its KV cache
    reused for all of them (gradients flow through the cache); the result is the same. (Not on
    an FSDP-sharded model: its lockstep wants one forward pass per backward.)
    """
    device = next(model.parameters()).device
    shared = None
    if len(prompts) > 1 and not fsdp.is_sharded(model) and all(torch.equal(p, prompts[0]) for p in prompts[1:]):
        shared = _shared_prompt_logits(model, prompts[0], completions, pad_id, device)
    if shared is not None:
        logits, cmask, targets = shared
    else:
        ids, att, pos, cmask = pad_pairs(prompts, completions, pad_id)
        C = cmask.shape[1]
        ids, att, pos = ids.to(device), att.to(device), pos.to(device)
        out = model(input_ids=ids, attention_mask=att, position_ids=pos, logits_to_keep=C + 1, use_cache=False)
        logits = out.logits[:, :-1].float()  # position t predicts token t+1: these predict the C completion tokens
        targets = ids[:, -C:]
    logp = torch.gather(F.log_softmax(logits, dim=-1), 2, targets.unsqueeze(2)).squeeze(2)
    cmask = cmask.to(device)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            lp = F.log_softmax(logits.detach(), dim=-1)
            entropy = -(lp.exp() * lp).sum(-1)
    return logp * cmask, cmask, entropy


def _shared_prompt_logits(model, prompt: torch.Tensor, completions: list[torch.Tensor], pad_id: int,
                          device: torch.device):
    """Logits [k, C, V] predicting k completions of one prompt, encoding the prompt once.

    Returns (logits, completion_mask [k, C], completion ids [k, C]), or None when the model
    keeps no KV cache (e.g. gradient checkpointing): the caller then packs full sequences.
    """
    k, P = len(completions), len(prompt)
    head = model(input_ids=prompt[None].to(device), use_cache=True, logits_to_keep=1)
    cache = head.past_key_values
    if cache is None or not hasattr(cache, "layers"):
        return None
    for layer in cache.layers:  # one copy of the prompt's keys/values per completion
        layer.batch_repeat_interleave(k)
    ids, cmask = pad_completions(completions, pad_id)
    C = ids.shape[1]
    att = torch.cat([torch.ones((k, P), dtype=torch.long), cmask.long()], dim=1)
    pos = (P + torch.arange(C)).unsqueeze(0).expand(k, C)
    ids = ids.to(device)
    tail = model(input_ids=ids, attention_mask=att.to(device), position_ids=pos.to(device), past_key_values=cache,
                 use_cache=True, logits_to_keep=C)
    # The prompt's last position predicts completion token 0; completion position t predicts t+1.
    logits = torch.cat([head.logits[:, -1:].expand(k, 1, -1), tail.logits[:, :-1]], dim=1).float()
    return logits, cmask, ids
