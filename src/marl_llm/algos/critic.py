"""Critics for the actor-critic methods (CoLLM-CC / CoLLM-DC): a scalar value head on the last
hidden layer of a (LoRA-adapted) causal LM.

    head = ValueHead(hidden_size)                      # Linear(h, 1), N(0, 0.02) init, zero bias
    v = sequence_values(model, head, prompts, None, pad)          # V(h): at the last prompt token
    q = sequence_values(model, head, prompts, completions, pad)   # Q(h, a): at the last completion token

Sequences are packed as [left-padded prompt | right-padded completion] (rollout.pad_pairs), so
every prompt ends at the same column and a completion's last token sits at P + len(c) - 1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from marl_llm.rollout import pad_pairs


class ValueHead(nn.Module):
    """Scalar head: optionally Linear + Tanh first, then Linear(h, 1) with N(0, 0.02) weights and
    a zero bias (the reference's initialization)."""

    def __init__(self, hidden_size: int, hidden_layer: bool = False):
        super().__init__()
        layers: list[nn.Module] = []
        if hidden_layer:
            layers += [nn.Linear(hidden_size, hidden_size), nn.Tanh()]
        out = nn.Linear(hidden_size, 1)
        nn.init.normal_(out.weight, std=0.02)
        nn.init.zeros_(out.bias)
        layers.append(out)
        self.net = nn.Sequential(*layers)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden: Tensor[B, h] -> values Tensor[B]."""
        return self.net(hidden.float()).squeeze(-1)


def read_positions(prompts: list[Tensor], completions: list[Tensor] | None) -> Tensor:
    """Column of the token each value is read at: Tensor[B] (see the module docstring)."""
    P = max(len(p) for p in prompts)
    if completions is None:
        return torch.full((len(prompts),), P - 1, dtype=torch.long)
    return torch.tensor([P + len(c) - 1 if len(c) else P - 1 for c in completions], dtype=torch.long)


def sequence_values(model, head: ValueHead, prompts: list[Tensor], completions: list[Tensor] | None,
                    pad_id: int) -> Tensor:
    """V(h) (completions None) or Q(h, a) per sequence: Tensor[B], differentiable through the
    head and the model's trainable (adapter) weights when grad is enabled."""
    device = next(model.parameters()).device
    comps = completions if completions is not None else [torch.zeros(0, dtype=torch.long) for _ in prompts]
    ids, att, pos, _ = pad_pairs(prompts, comps, pad_id)
    out = model(input_ids=ids.to(device), attention_mask=att.to(device), position_ids=pos.to(device),
                output_hidden_states=True, logits_to_keep=1, use_cache=False)
    hidden = out.hidden_states[-1]  # [B, L, h]
    at = read_positions(prompts, completions).to(device)
    return head(hidden[torch.arange(len(prompts), device=device), at])
