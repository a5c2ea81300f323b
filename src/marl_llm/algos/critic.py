"""Critics for the actor-critic methods (CoLLM-CC / CoLLM-DC): a scalar value head on the last
hidden layer of a (LoRA-adapted) causal LM.

    head = ValueHead(hidden_size)                      # Linear(h, 1), N(0, 0.02) init, zero bias
    v = sequence_values(model, head, prompts, None, pad)          # V(h): at the last prompt token
    q = sequence_values(model, head, prompts, completions, pad)   # Q(h, a): at the last completion token
    critic = Critic(...); v = critic.values(prompts); stats = critic.update(prompts, None, targets, v)
    v, y = critic.fit_fresh(prompts, None, groups, targets_of); ...; stats = critic.step_fitted()
                                                      # the same, values read off the update's own pass

Sequences are packed as [left-padded prompt | right-padded completion] (rollout.pad_pairs), so
every prompt ends at the same column and a completion's last token sits at P + len(c) - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from marl_llm.distributed import data_parallel as distributed
from marl_llm.distributed import fsdp, placement
from marl_llm.models.policies import adamw, restore_implementation, same_optimizer
from marl_llm.rollout.decode import pad_pairs


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
        # float32 at least (a bf16 trunk's hidden states are read by a float32 head), float64 in a float64 run.
        return self.net(hidden.to(self.net[-1].weight.dtype)).squeeze(-1)


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


def has_dropout(model) -> bool:
    """Whether a train-mode forward of `model` is random (a dropout module with p > 0, or the
    attention dropout that Llama-style models apply without a module)."""
    config = getattr(model, "config", None)
    return (any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
            or float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0)


@dataclass
class _Pass:
    """One forward/backward pass over n samples whose gradient awaits the optimizer step:
    values, targets: Tensor[n] (Critic.dtype, CPU)."""

    n: int
    values: Tensor
    targets: Tensor
    rows: list[int] = field(default_factory=list)  # the samples of this rank's passes (all, unless shared)
    loss_sum: float = 0.0
    clipped: int = 0
    agreed: fsdp.Agreement | None = None  # what the ranks agreed on for the passes (fsdp.passes)


class Critic:
    """One critic: a trunk (a LoRA adapter on the actors' frozen base, an actor's own adapter, or
    a separate fully trained model) plus a ValueHead, with its own AdamW optimizer.

    Inputs are token ids: prompts: list of Tensor[P_j]; completions: list of Tensor[C_j] (Q(h, a),
    read at the last completion token) or None (V(h), read at the last prompt token).
    """

    def __init__(self, name: str, model, adapter: str | None, trunk: dict[str, nn.Parameter], head: ValueHead,
                 pad_id: int, learning_rate: float, weight_decay: float, loss_coef: float,
                 value_clip: float | None, max_grad_norm: float | None, micro_batch_size: int):
        self.name, self.model, self.adapter, self.trunk, self.head = name, model, adapter, trunk, head
        # The values' dtype: the head's (float32, or float64 in a float64 run, whose values then stay exact).
        self.dtype = head.net[-1].weight.dtype
        self.pad_id, self.loss_coef, self.value_clip = pad_id, loss_coef, value_clip
        self.max_grad_norm = float("inf") if max_grad_norm is None else max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.params = list(trunk.values()) + list(head.parameters())
        self.optimizer = adamw(self.params, learning_rate, weight_decay)

    def _activate(self) -> None:
        if self.adapter is not None:
            self.model.set_adapter(self.adapter)
        for p in self.trunk.values():  # set_adapter clears the flag of inactive adapters
            p.requires_grad_(True)

    def _chunks(self, prompts: list[Tensor], completions: list[Tensor] | None,
                groups: list[list[int]] | None = None) -> list[list[int]]:
        """Micro-batches of similar total length (less padding), of at most micro_batch_size
        samples; `groups` (default: every sample alone) are never split across micro-batches."""
        size = [len(p) + (len(completions[j]) if completions is not None else 0) for j, p in enumerate(prompts)]
        order = sorted(groups if groups is not None else [[j] for j in range(len(prompts))],
                       key=lambda g: max(size[j] for j in g))
        chunks: list[list[int]] = []
        for g in order:
            if not chunks or len(chunks[-1]) + len(g) > self.micro_batch_size:
                chunks.append([])
            chunks[-1].extend(g)
        return chunks

    def _forward(self, prompts: list[Tensor], completions: list[Tensor] | None, idx: list[int]) -> Tensor:
        comps = [completions[j] for j in idx] if completions is not None else None
        return sequence_values(self.model, self.head, [prompts[j] for j in idx], comps, self.pad_id)

    @torch.no_grad()
    def values(self, prompts: list[Tensor], completions: list[Tensor] | None = None) -> Tensor:
        """The critic's current values: Tensor[n] (self.dtype, CPU)."""
        self._activate()
        out = torch.zeros(len(prompts), dtype=self.dtype)
        chunks = self._chunks(prompts, completions)
        with fsdp.passes(self.model, len(chunks), grad=False):
            for idx in chunks:
                out[idx] = self._forward(prompts, completions, idx).to(self.dtype).cpu()
        return out

    def rebind(self) -> None:
        """A new optimizer over the trunk's parameters as the model holds them now (FSDP replaced a
        separate critic's parameters with its shards); no state is lost: none exists yet."""
        if self.adapter is None:  # a separate model: its trunk is every parameter
            self.trunk = dict(self.model.named_parameters())
        self.params = list(self.trunk.values()) + list(self.head.parameters())
        self.optimizer = same_optimizer(self.optimizer, self.params)

    def update(self, prompts: list[Tensor], completions: list[Tensor] | None, targets: Tensor,
               old_values: Tensor) -> dict[str, float]:
        """One optimizer step on loss_coef * mean((y - V)^2) over all n samples (with value
        clipping: the max of the clipped and unclipped errors, PPO style). targets, old_values:
        Tensor[n]. Returns verl-style critic stats."""
        return self._step(self._backward(prompts, completions, self._chunks(prompts, completions),
                                          lambda idx, v: targets[idx], lambda idx, v: old_values[idx]))

    def fit_fresh(self, prompts: list[Tensor], completions: list[Tensor] | None, groups: list[list[int]],
                  targets_of: Callable[[list[int], Tensor], Tensor]) -> tuple[Tensor, Tensor]:
        """`values()` and `update()`'s forward/backward in one pass, for a caller that would step the
        critic on these samples with these values as the old values and nothing changing the critic
        in between: the values are read off the pass with gradients instead of a pass of their own.
        `targets_of(rows, values of rows)` gives the rows' targets (Tensor[len(rows)]); `groups`
        (e.g. trajectories, whose TD targets need all their values) share a micro-batch each.
        Returns (values, targets): Tensor[n]; the gradient waits for `step_fitted()`."""
        self._fitted = self._backward(prompts, completions, self._chunks(prompts, completions, groups),
                                      targets_of, lambda idx, v: v)
        return self._fitted.values, self._fitted.targets

    def step_fitted(self) -> dict[str, float]:
        """The optimizer step of the last `fit_fresh` pass; its stats, as update() returns them."""
        fitted, self._fitted = getattr(self, "_fitted", None), None
        if fitted is None:
            raise RuntimeError(f"{self.name}: step_fitted() without a fit_fresh() pass before it")
        return self._step(fitted)

    def _backward(self, prompts: list[Tensor], completions: list[Tensor] | None, chunks: list[list[int]],
                  targets_of: Callable[[list[int], Tensor], Tensor],
                  old_of: Callable[[list[int], Tensor], Tensor]) -> _Pass:
        """Forward/backward of the loss over `chunks` (gradients accumulate; no step). targets_of /
        old_of(rows, the rows' values Tensor[len(rows)]): their targets / old values."""
        self._activate()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if placement.current().by_actions:  # every rank holds every sample: it trains on its share
            chunks = distributed.shard(chunks)
        rows = sorted(j for idx in chunks for j in idx)
        n = len(rows)
        out = _Pass(n, torch.zeros(len(prompts), dtype=self.dtype), torch.zeros(len(prompts), dtype=self.dtype), rows=rows)
        try:
            with fsdp.passes(self.model, len(chunks), grad=True, weight=n) as out.agreed:
                self._passes(prompts, completions, chunks, targets_of, old_of, out, out.agreed.loss_scale(n))
        finally:
            self.model.eval()
        return out

    def _passes(self, prompts: list[Tensor], completions: list[Tensor] | None, chunks: list[list[int]],
                targets_of: Callable[[list[int], Tensor], Tensor], old_of: Callable[[list[int], Tensor], Tensor],
                out: _Pass, scale: float) -> None:
        """The forward/backward passes of `_backward`, each loss times `scale` (fsdp.Agreement.loss_scale)."""
        n = out.n
        for idx in chunks:
            v = self._forward(prompts, completions, idx)
            seen = v.detach().to(self.dtype).cpu()
            out.values[idx] = seen
            out.targets[idx] = targets_of(idx, seen).to(self.dtype)
            y = out.targets[idx].to(v.device, v.dtype)
            err = (v - y) ** 2
            if self.value_clip is not None:
                old = old_of(idx, seen).to(v.device, v.dtype)
                v_clip = old + (v - old).clamp(-self.value_clip, self.value_clip)
                err_clip = (v_clip - y) ** 2
                out.clipped += int((err_clip > err).sum())
                err = torch.maximum(err, err_clip)
            loss = self.loss_coef * err.sum() / n
            (loss * scale).backward()
            out.loss_sum += float(loss.detach())

    def _step(self, done: _Pass) -> dict[str, float]:
        n, loss_sum, clipped = done.n, done.loss_sum, done.clipped
        fsdp.sync_replicated(self.params, n, done.agreed)  # data-parallel ranks: the gradient over every rank's samples
        grad_norm = fsdp.clip_grad_norm(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # the gradients' memory back before the next rollout
        if not done.rows:  # a rank whose share was empty: it still took the synced step
            return {"grad_norm": grad_norm, "learning_rate": float(self.optimizer.param_groups[0]["lr"])}
        values, y = done.values[done.rows], done.targets[done.rows]
        var_y = float(y.var(unbiased=False)) if n > 1 else 0.0
        stats = {"vf_loss": loss_sum, "values/mean": float(values.mean()), "returns/mean": float(y.mean()),
                 "vf_explained_var": (1.0 - float((y - values).var(unbiased=False)) / var_y) if var_y > 0 else 0.0,
                 "grad_norm": grad_norm, "learning_rate": float(self.optimizer.param_groups[0]["lr"])}
        if self.value_clip is not None:
            stats["vf_clipfrac"] = clipped / n
        return stats

    # -- checkpoint state
    def checkpoint_part(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The critic as one module (trunk model and head) with its optimizer, for a sharded
        checkpoint (runs/sharded_checkpoint.py): a critic whose trunk is a model of its own."""
        return nn.ModuleDict({"trunk": self.model, "head": self.head}), self.optimizer

    def state_dict(self) -> dict:
        if fsdp.trains_sharded(self.model):  # its shards are in the sharded checkpoint's own files
            return {"in_sharded_checkpoint": True}
        return {"trunk": {k: p.detach().cpu().clone() for k, p in self.trunk.items()},
                "head": {k: t.detach().cpu().clone() for k, t in self.head.state_dict().items()},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("in_sharded_checkpoint"):
            return  # restored from the sharded checkpoint's files (sharded_checkpoint.restore_any_checkpoint)
        with torch.no_grad():
            for k, t in state["trunk"].items():
                self.trunk[k].copy_(t.to(self.trunk[k].device, self.trunk[k].dtype))
        self.head.load_state_dict(state["head"])
        restore_implementation(self.optimizer, state["optimizer"])
