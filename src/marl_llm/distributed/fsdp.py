"""FSDP (`trainer.fsdp=true`): the frozen base is sharded over the data-parallel ranks, for bases
that do not fit one GPU.

    torchrun --nproc_per_node 4 -m marl_llm algo=at_grpo task=sokoban model=qwen3_8b trainer.fsdp=true

Each decoder layer is one torch FSDP2 unit (`fully_shard`), and the rest of the base (embeddings,
final norm, LM head) is the root unit. A rank keeps 1/N of every unit's weights; a unit's full
weights are all-gathered just before it runs and freed after it. The LoRA adapters and the
critics' value heads are not sharded: they are small, every rank keeps all of them, and
`distributed.sync_gradients` averages their gradients exactly as in plain data-parallel training.
Bases load on the CPU and each unit moves its own shard to the device as it is sharded, so a
rank's device never holds the whole base.

Lockstep. An all-gather is a collective: every rank must run the same sequence of forward and
backward passes. Ours do not. Decode lengths, episode turns, tree forks and micro-batch counts
differ per rank, and rank 0 alone evaluates. So every forward pass of a sharded model is a
*round*: before it, the ranks all-reduce (how many run a pass, how many with gradients, how many
in train mode). A rank with no pass to run drains: when it reaches one of the project's own
collectives (gradient sync, barrier, metric gather; `distributed` calls `drain` first), it joins
the rounds with a one-token dummy pass of the same kind (with a backward when the others' passes
have gradients), until no rank runs a pass. Two rules make the kinds line up, and are checked:
- in one round the ranks' passes are of one kind: where a phase changes the kind (no gradients,
  gradients in eval or in train mode), the code calls `distributed.settle()` first, unless a
  collective comes first anyway;
- a pass with gradients is followed by its backward before the rank's next pass.

Unsharded rollouts (`trainer.fsdp_unshard_rollout`, on by default). Decoding runs one forward
pass per token, so per-pass all-gathers (and rounds) would dominate a rollout. `unsharded()`
all-gathers every unit once, keeps the full weights through the rollout (a whole copy of the base
on each rank meanwhile), and frees them after: no collective and no round runs inside, so the
ranks decode at their own pace. The all-gathers are collectives, so every rank enters at the
same points: `train_step` around `algo.collect` (every rank collects once per step, and
collecting runs generation only), and the trainer around evaluation (every rank enters; rank 0
evaluates while the others wait at the barrier that follows). Inside, passes with gradients are
refused (their backward would reshard the units).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from marl_llm.distributed import data_parallel as distributed
from marl_llm.config import UserError


def check_supported(cfg: Any) -> None:
    """The settings FSDP cannot run with, refused before any model loads."""
    if not cfg.trainer.fsdp:
        return
    if "lora" in cfg.algo and cfg.algo.lora is None:
        raise UserError("trainer.fsdp=true shards a frozen base under LoRA adapters, but algo.lora=null fully "
                        "fine-tunes every policy: set trainer.fsdp=false (or train LoRA adapters: algo.lora.r=...)")
    if cfg.trainer.rollout != "hf":
        raise UserError(f"trainer.fsdp=true needs trainer.rollout=hf: the {cfg.trainer.rollout} backend keeps its own "
                        "whole copy of the base (set trainer.fsdp=false, or trainer.rollout=hf)")
    if cfg.model.agent_bases:
        raise UserError("trainer.fsdp=true shards one base shared by all agents: unset model.agent_bases")
    critic = cfg.algo.get("critic")
    if critic is not None and critic.get("placement") == "separate":
        raise UserError("trainer.fsdp=true shards the frozen base only, but critic.placement=separate fully trains "
                        "a second copy of it: use algo.critic.placement=adapter (a LoRA critic on the shared base)")


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def inference_mode(model: Any) -> contextlib.AbstractContextManager:
    """Inference mode, except for a sharded model: FSDP's all-gathered weights would become
    inference tensors that a later training pass may not reuse."""
    return torch.no_grad() if is_sharded(model) else torch.inference_mode()


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The base's repeated blocks: the classes a transformers model lists in `_no_split_modules`."""
    base = model.get_base_model()
    kinds = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in kinds]
    if not layers:
        raise UserError(f"trainer.fsdp=true: {type(base).__name__} names no decoder layer class (_no_split_modules) "
                        "to shard by; use trainer.fsdp=false for this model")
    return layers


def shard_policies(policies: Any) -> str:
    """Shard every base of `policies` over the ranks (after all adapters, critics' included, are
    added: FSDP fixes which parameters it manages). Returns a line saying how much a rank holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w = distributed.world()
    mesh = init_device_mesh(policies.device.type, (w.size,))
    whole, local = 0, 0
    for model in policies.models:
        whole += sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
        adapters = {p for n, p in model.named_parameters() if "lora_" in n}
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, ignored_params=adapters)
        fully_shard(model, mesh=mesh, ignored_params=adapters)
        with torch.no_grad():  # FSDP moves what it shards; the adapters stay whole and move here
            for p in adapters:
                p.data = p.data.to(policies.device)
        local += sum(getattr(p, "to_local", lambda: p)().numel() for n, p in model.named_parameters() if "lora_" not in n)
        model._marl_lockstep = Lockstep(model, policies.device)  # unsharded() lifts its rounds
        distributed.before_collectives(model._marl_lockstep.drain)
    return (f"FSDP: the base is sharded over {w.size} ranks; each holds {local / 1e6:.2f}M of its "
            f"{whole / 1e6:.2f}M frozen parameters")


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a model output (ModelOutput, tuple, tensor), nested tuples included."""
    values = output.values() if hasattr(output, "values") else output if isinstance(output, (tuple, list)) else [output]
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found.extend(_tensors(v))
    return found


class Lockstep:
    """Keeps one sharded model's forward passes in step over the ranks (see the module docstring)."""

    def __init__(self, model: Any, device: torch.device):
        self.model, self.device = model, device
        self.hidden = model.get_base_model().config.hidden_size
        self.dtype = next(p for p in model.parameters()).dtype
        self._draining = False
        self._awaiting_backward = False
        self.whole = False  # inside unsharded(): passes need no rounds
        # prepend: the round comes before FSDP's own pre-forward all-gather of the root unit, as
        # it does on a draining rank.
        model.register_forward_pre_hook(self._before_pass, prepend=True)
        model.register_forward_hook(self._after_pass)

    def _round(self, kind: tuple[int, int, int]) -> tuple[int, int, int]:
        """All-reduce (running, with gradients, in train mode) over the ranks."""
        t = torch.tensor(kind, dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t)
        return int(t[0]), int(t[1]), int(t[2])

    def _before_pass(self, module: Any, args: Any) -> None:
        if self._draining:
            return
        if self.whole:
            if torch.is_grad_enabled():
                raise RuntimeError("FSDP: a forward pass with gradients inside fsdp.unsharded() (the rollout phase); "
                                   "its backward would reshard the base mid-rollout: run it after the rollout")
            return
        if self._awaiting_backward:
            raise RuntimeError("FSDP lockstep: a forward pass with gradients must have its backward before the "
                               "rank's next forward pass (run reference/old-policy passes first, under no_grad)")
        grad = torch.is_grad_enabled()
        # Train mode matters with gradients only (checkpointed layers recompute in the backward).
        running, with_grad, training = self._round((1, int(grad), int(grad and self.model.training)))
        if with_grad not in (0, running) or training not in (0, running):
            raise RuntimeError(f"FSDP lockstep: ranks ran passes of different kinds in one round ({running} passes, "
                               f"{with_grad} with gradients, {training} in train mode): where a phase changes the "
                               "kind of pass, call distributed.settle() first")

    def _after_pass(self, module: Any, args: Any, output: Any) -> None:
        if self._draining or not torch.is_grad_enabled():
            return
        trainable = [t for t in _tensors(output) if t.requires_grad]
        if not trainable:
            raise RuntimeError("FSDP lockstep: a forward pass with gradients enabled has nothing to backward "
                               "through; run it under torch.no_grad()")
        self._awaiting_backward = True
        torch.autograd.graph.register_multi_grad_hook(trainable, self._backward_started, mode="any")

    def _backward_started(self, grad: Any) -> None:
        self._awaiting_backward = False

    def drain(self) -> None:
        """Join the other ranks' remaining passes with dummy ones until no rank runs a pass."""
        if self._awaiting_backward:
            raise RuntimeError("FSDP lockstep: a collective was reached between a forward pass with gradients "
                               "and its backward")
        self._draining = True
        try:
            while True:
                running, with_grad, training = self._round((0, 0, 0))
                if running == 0:
                    return
                self._dummy_pass(with_grad > 0, training > 0)
        finally:
            self._draining = False

    def _dummy_pass(self, grad: bool, training: bool) -> None:
        """One token through every unit, in the others' mode. Its backward runs through the
        layers to the input embedding only (`inputs=`): it all-gathers what theirs does and
        leaves every parameter's gradient as it was."""
        was_training = self.model.training
        if grad:
            self.model.train(training)
        try:
            with torch.set_grad_enabled(grad):
                x = torch.zeros((1, 1, self.hidden), dtype=self.dtype, device=self.device, requires_grad=grad)
                out = self.model(inputs_embeds=x, use_cache=False, logits_to_keep=1)
                if grad:
                    torch.autograd.backward(out.logits.float().sum() * 0, inputs=[x])
        finally:
            self.model.train(was_training)


def _units(model: Any) -> list[Any]:
    """The FSDP units of a sharded model, root first then layer by layer: the same order on
    every rank (their all-gathers must pair up)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(policies: Any, enabled: bool = True) -> Iterator[None]:
    """The sharded bases of `policies` whole on every rank for the duration (see the module
    docstring): one all-gather per unit on entry, none inside, each rank's full copy freed on exit.

    A collective: every rank enters at the same point (a rank may leave whenever it is done, as
    freeing is local). A no-op when `enabled` is false or nothing is sharded (one process)."""
    models = [m for m in policies.models if is_sharded(m)] if enabled else []
    if not models:
        yield
        return
    distributed.settle()  # no rank is still in lockstep passes when the all-gathers start
    for model in models:
        model.set_reshard_after_forward(False)  # a pass must not free what the window gathered
        handles = [unit.unshard(async_op=True) for unit in _units(model)]  # overlapped on NCCL
        for handle in handles:
            handle.wait()
        model._marl_lockstep.whole = True
    try:
        yield
    finally:
        for model in models:
            model._marl_lockstep.whole = False
            for unit in _units(model):
                unit.reshard()
            # Back to fully_shard's defaults (shard_policies passes none): the layers free their
            # weights after each pass; the root keeps its own, as FSDP sets a root at its first pass.
            model.set_reshard_after_forward(True)
            model.set_reshard_after_forward(False, recurse=False)
