"""Mixed-adapter LoRA for generation: each row of a batch acts with its own agent's adapter.

peft's mixed batches (`adapter_names=[...]`) split the batch inside every LoRA layer: for each
adapter, index its rows, run A and B, scale, and scatter back. On CPU decoding, where every step
is a few hundred small ops, that per-adapter bookkeeping in 4 projections x 30 layers nearly
doubled rollout time (measured: results/bench.md). Here every LoRA layer instead stacks the
adapters' A matrices ([n*r, in]) and their scaled B matrices ([out, n*r]) once per rollout, and a
row mask [rows, 1, n*r] keeps each row's own block:

    y = base(x) + ((x @ A_all.T) * mask) @ B_all.T     ==  base(x) + s_a * B_a @ A_a @ x  for row adapter a

Two small matmuls per layer, whatever the number of agents. Exact for vanilla LoRA (no DoRA or
other variants, no LoRA bias, no dropout at inference); a model with any other LoRA layer keeps
peft's own mixed-batch path (`MixedLoRA.supported`). A fully fine-tuned policy (algo.lora=null)
is its own model: it has no LoRA layers and never comes here (`has_adapters`).
"""

from __future__ import annotations

import types
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


class MixedLoRA:
    """Context manager: while active, the model's LoRA layers apply the adapter of each row.

        with MixedLoRA(model, ["agent_aux", "agent_main"]) as lora:
            lora.set_rows(["agent_aux", "agent_main", "agent_main"])   # one name per batch row
            model(input_ids=...)                                       # 3 rows, each with its adapter
    """

    def __init__(self, model, adapters: list[str]):
        self.model = model
        self.adapters = list(dict.fromkeys(adapters))
        self.mask: torch.Tensor | None = None  # [rows, 1, n*r_max] in the LoRA weights' dtype
        self._layers = _lora_linears(model)
        self._r = max(layer.lora_A[a].weight.shape[0] for layer in self._layers for a in self.adapters)

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

    def set_rows(self, adapter_of_row: list[str]) -> None:
        index = {a: i for i, a in enumerate(self.adapters)}
        ref = self._layers[0].lora_A[self.adapters[0]].weight
        mask = torch.zeros((len(adapter_of_row), 1, len(self.adapters) * self._r), dtype=ref.dtype, device=ref.device)
        for row, a in enumerate(adapter_of_row):
            mask[row, 0, index[a] * self._r:(index[a] + 1) * self._r] = 1
        self.mask = mask

    def __enter__(self) -> "MixedLoRA":
        r = self._r
        for layer in self._layers:
            a_blocks, b_blocks = [], []
            for a in self.adapters:
                A, B = layer.lora_A[a].weight, layer.lora_B[a].weight  # [r_a, in], [out, r_a]
                pad = r - A.shape[0]  # adapters of a smaller rank fill their block with zeros
                a_blocks.append(torch.nn.functional.pad(A, (0, 0, 0, pad)))
                b_blocks.append(torch.nn.functional.pad(B * layer.scaling[a], (0, pad)))
            layer._mixed_A = torch.cat(a_blocks, dim=0).detach()  # [n*r, in]
            layer._mixed_B = torch.cat(b_blocks, dim=1).detach()  # [out, n*r]
            layer.forward = types.MethodType(_mixed_forward(self), layer)
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer in self._layers:
            del layer.forward, layer._mixed_A, layer._mixed_B  # back to the class's (peft's) forward
        self.mask = None


def _mixed_forward(owner: MixedLoRA):
    def forward(layer, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = layer.base_layer(x, *args, **kwargs)
        A, B = layer._mixed_A, layer._mixed_B
        h = x.to(A.dtype) @ A.T  # [rows, L, n*r]
        return result + ((h * owner.mask) @ B.T).to(result.dtype)

    return forward
