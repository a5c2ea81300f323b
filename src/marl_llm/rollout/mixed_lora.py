"""Mixed-adapter LoRA for generation: each row of a batch acts with its own agent's adapter.

peft's mixed batches (`adapter_names=[...]`) split the batch inside every LoRA layer: for each
adapter, index its rows, run A and B, scale, and scatter back. On CPU decoding, where every step
is a few hundred small ops, that per-adapter bookkeeping in 4 projections x 30 layers nearly
doubled rollout time (measured: results/bench.md). Here every LoRA layer instead stacks the
adapters' A matrices and their scaled B matrices once per rollout, transposed (A_all.T [in, n*r],
B_all.T [n*r, out]), and a row mask [rows, 1, n*r] keeps each row's own block:

    y = base(x) + ((x @ A_all.T) * mask) @ B_all.T     ==  base(x) + s_a * B_a @ A_a @ x  for row adapter a

Two small matmuls per layer, whatever the number of agents, and four torch calls beside the base
layer's (each is host time per token on a GPU; no cast: under autocast the matmuls cast, and
without it x, the stacks and the base's output share one dtype). Counted in the decode loop on a
Llama with LoRA on q and v: 84 torch calls per decoder layer and token, where transformers'
generate makes 86 with one peft adapter (tests/test_decode.py counts both). The stacks are in the compute dtype:
bf16/fp16 on a bf16/fp16 base or under autocast (peft keeps adapters fp32, which would run the
LoRA matmuls in fp32, off the tensor cores), else the adapters' own fp32. The row mask is built
once per batch composition (set_rows), not per step. The stacks, the row mask and each layer's
mixed forward are kept per model between rollouts and refilled in place (`_Kept`): a compiled
decode step (CUDA graphs) replays the addresses it recorded, and new tensors would make it record
again every rollout (rollout/static_step.py). Exact for vanilla LoRA (no DoRA or
other variants, no LoRA bias, no dropout at inference); a model with any other LoRA layer keeps
peft's own mixed-batch path (`MixedLoRA.supported`). A fully fine-tuned policy (algo.lora=null)
is its own model: it has no LoRA layers and never comes here (`has_adapters`).
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


def has_adapters(model) -> bool:
    """A peft model (LoRA agents); False for a fully fine-tuned policy (algo.lora=null), a plain
    transformers model that is its policy: no adapter to set, nothing to mix."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _lora_linears(model) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@dataclass
class _Kept:
    """What MixedLoRA keeps of one model between rollouts: the row mask in use and one buffer per
    row count (refilled in place), and each LoRA layer's mixed forward (one bound method per layer,
    reading its transposed stacks `layer._mixed_At` / `layer._mixed_Bt`, which stay on the layer)."""

    mask: torch.Tensor | None = None
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)
    forwards: dict[int, Any] = field(default_factory=dict)


_KEPT: "weakref.WeakKeyDictionary[Any, _Kept]" = weakref.WeakKeyDictionary()


def _static(t: torch.Tensor) -> torch.Tensor:
    """Mark a kept buffer as a fixed address for CUDA graphs (a step input that is not copied in)."""
    torch._dynamo.mark_static_address(t)
    return t


def _refill(held: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """`held` with `value` copied into it when their shape, dtype, device and inference mode
    agree (the same address), else `value` as a new kept buffer."""
    if (held is not None and held.shape == value.shape and held.dtype == value.dtype and held.device == value.device
            and held.is_inference() == torch.is_inference_mode_enabled()):
        return held.copy_(value)
    return _static(value)


class MixedLoRA:
    """Context manager: while active, the model's LoRA layers apply the adapter of each row.

        with MixedLoRA(model, ["agent_aux", "agent_main"]) as lora:
            lora.set_rows(["agent_aux", "agent_main", "agent_main"])   # one name per batch row
            model(input_ids=...)                                       # 3 rows, each with its adapter
    """

    def __init__(self, model, adapters: list[str]):
        self.model = model
        self.adapters = sorted(set(adapters))  # one order for every batch composition (its kept stacks)
        self._kept = _KEPT.setdefault(model, _Kept())
        self._layers = _lora_linears(model)
        self._r = max(layer.lora_A[a].weight.shape[0] for layer in self._layers for a in self.adapters)
        first = self._layers[0]
        self.device = first.lora_A[self.adapters[0]].weight.device
        self.dtype = compute_dtype(first.base_layer.weight, first.lora_A[self.adapters[0]].weight)
        # The adapter of each stacked rank column [n*r_max]: row b keeps the columns of its adapter.
        self._column_adapter = torch.arange(len(self.adapters) * self._r, device=self.device) // self._r

    @staticmethod
    def supported(model, adapters: list[str]) -> bool:
        """Every LoRA layer is a vanilla peft Linear holding all these adapters, unmerged."""
        from peft.tuners.lora import Linear

        if not has_adapters(model):
            return False
        layers = _lora_linears(model)
        return bool(layers) and all(
            type(m) is Linear and not m.merged and not m.fan_in_fan_out
            and all(a in m.lora_A and a not in m.lora_variant and not m.lora_bias.get(a, False) for a in adapters)
            for m in layers)

    def adapter_index(self, adapter_of_row: list[str]) -> torch.Tensor:
        """Each row's adapter as its index in `self.adapters` [rows] int64 on the weights' device
        (slice it when rows leave the batch, and set_rows again: no host round trip)."""
        index = {a: i for i, a in enumerate(self.adapters)}
        return torch.tensor([index[a] for a in adapter_of_row], device=self.device)

    @property
    def mask(self) -> torch.Tensor | None:
        """The row mask [rows, 1, n*r_max] in the compute dtype (None outside the context)."""
        return self._kept.mask

    def set_rows(self, adapter_of_row: list[str] | torch.Tensor) -> None:
        """The adapter of each batch row: names, or indices [rows] from `adapter_index`. Call it
        when the rows change (not every step): the row mask is one comparison, written into the
        mask kept for this many rows."""
        if not isinstance(adapter_of_row, torch.Tensor):
            adapter_of_row = self.adapter_index(adapter_of_row)
        mask = (adapter_of_row.view(-1, 1, 1) == self._column_adapter).to(self.dtype)
        kept = self._kept
        kept.mask = kept.masks[mask.shape] = _refill(kept.masks.get(mask.shape), mask)

    def __enter__(self) -> "MixedLoRA":
        r = self._r
        for layer in self._layers:
            a_blocks, b_blocks = [], []
            for a in self.adapters:
                A, B = layer.lora_A[a].weight, layer.lora_B[a].weight  # [r_a, in], [out, r_a]
                pad = r - A.shape[0]  # adapters of a smaller rank fill their block with zeros
                a_blocks.append(torch.nn.functional.pad(A, (0, 0, 0, pad)))
                b_blocks.append(torch.nn.functional.pad(B * layer.scaling[a], (0, pad)))  # scaled in fp32
            stack_a = torch.cat(a_blocks, dim=0).detach().to(self.dtype).T.contiguous()  # [in, n*r]
            stack_b = torch.cat(b_blocks, dim=1).detach().to(self.dtype).T.contiguous()  # [n*r, out]
            # One pair of kept stacks per adapter set: a rollout of one agent's rows and one of
            # both agents' each find their own buffers again.
            if getattr(layer, "_mixed_stacks", None) is None:
                layer._mixed_stacks = {}
            held_a, held_b = layer._mixed_stacks.get(tuple(self.adapters), (None, None))
            layer._mixed_At, layer._mixed_Bt = _refill(held_a, stack_a), _refill(held_b, stack_b)
            layer._mixed_stacks[tuple(self.adapters)] = (layer._mixed_At, layer._mixed_Bt)
            if id(layer) not in self._kept.forwards:
                self._kept.forwards[id(layer)] = types.MethodType(_mixed_forward(self._kept), layer)
            layer.forward = self._kept.forwards[id(layer)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer in self._layers:
            del layer.forward  # back to the class's (peft's) forward; the stacks stay for the next rollout
        self._kept.mask = None


def compute_dtype(base_weight: torch.Tensor, adapter_weight: torch.Tensor) -> torch.dtype:
    """The dtype LoRA matmuls run in: the active autocast dtype on the weights' device, else a
    bf16/fp16 base's dtype, else the adapter's own (fp32 on an fp32 base: nothing changes)."""
    device_type = base_weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if base_weight.dtype in (torch.bfloat16, torch.float16):
        return base_weight.dtype
    return adapter_weight.dtype


def _mixed_forward(owner: _Kept):
    def forward(layer, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = layer.base_layer(x, *args, **kwargs)
        return result + ((x @ layer._mixed_At) * owner.mask) @ layer._mixed_Bt  # [rows, L, n*r] in between

    return forward
