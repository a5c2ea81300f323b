"""Which tokens of a completion the policy loss scores (algo.loss_tokens).

marl-llm scores a completion's own tokens: the generated ids through the first end of sequence
(`completion`, the default). The reference trainers (comlrl 1.4.3) score others, and the paper
presets reproduce them:

    padded_row  (MAGRPO, comlrl/trainers/reinforce/magrpo.py `_compute_loss_with_gradients`): the
                row generate() returned for the node, padded after EOS to the longest of the
                node's G samples, minus the row's last token. Each sibling's loss sums log-probs
                of the padding after its EOS (pad == eos: more EOS tokens), and the longest
                sibling loses its last token (its EOS, or its max_new_tokens-th token).
    before_pad  (CoLLM-CC/DC, comlrl/trainers/actor_critic `_compute_sequence_stats` with the
                response length of `_generate`): the ids before the first pad token, so the EOS
                is left out when pad == eos (SmolLM2, Qwen2.5-Coder base) and kept when the model
                ends with an EOS other than the pad (Qwen3 instruct's <|im_end|>).

Each rule returns the completions with `Completion.loss_ids` set; nothing else changes (the
completion's text, length and stats are its own).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from marl_llm.rollout.base import Completion

MAGRPO_LOSS_TOKENS = ("completion", "padded_row")
ACTOR_CRITIC_LOSS_TOKENS = ("completion", "before_pad")


def padded_rows(siblings: list[Completion], pad_id: int) -> list[Completion]:
    """comlrl's MAGRPO loss tokens of one node's samples (generated together): each completion
    padded with `pad_id` to the longest one's length L, then cut to its first L - 1 ids."""
    width = max((len(c.completion_ids) for c in siblings), default=0)
    out = []
    for c in siblings:
        pad = torch.full((width - len(c.completion_ids),), pad_id, dtype=c.completion_ids.dtype)
        out.append(replace(c, loss_ids=torch.cat([c.completion_ids, pad])[:max(width - 1, 0)]))
    return out


def before_pad(completion: Completion, pad_id: int) -> Completion:
    """comlrl's actor-critic loss tokens: the completion's ids before its first `pad_id`."""
    ids = completion.completion_ids
    hits = (ids == pad_id).nonzero()
    return replace(completion, loss_ids=ids[:int(hits[0])] if len(hits) else ids)


def with_loss_tokens(rule: str, siblings: list[Completion], pad_id: int) -> list[Completion]:
    """The samples one node drew (generated together), with the loss tokens `rule` gives them."""
    if rule == "padded_row":
        return padded_rows(siblings, pad_id)
    if rule == "before_pad":
        return [before_pad(c, pad_id) for c in siblings]
    if rule == "completion":
        return list(siblings)
    raise ValueError(f"algo.loss_tokens={rule!r}: use completion, padded_row or before_pad")
