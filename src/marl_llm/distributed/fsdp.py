"""FSDP (`trainer.fsdp=true`): every model of the run is sharded over the ranks that train it,
for models that do not fit one GPU.

    torchrun --nproc_per_node 8 -m marl_llm experiment=at_grpo_sokoban_qwen3_8b_paper trainer.fsdp=true

Each decoder layer is one torch FSDP2 unit (`fully_shard`), and the rest of a model (embeddings,
final norm, LM head) is the root unit. A rank keeps 1/N of every unit's weights; a unit's full
weights are all-gathered just before it runs and freed after it. What is sharded:
- a fully fine-tuned policy (`algo.lora=null`), a separate critic (`critic.placement=separate`):
  every parameter. The shards are the fp32 master weights; on a GPU (bf16 `model.dtype`) a
  mixed-precision policy all-gathers them as bf16 and computes in bf16, and gradients are
  reduce-scattered in fp32. AdamW's moments follow the shards (sharded optimizer states), and
  gradient clipping reads the norm of the sharded gradients (`clip_grad_norm`);
- a LoRA policy's frozen base (and a KL reference copy): the adapters (and critics' value heads)
  are small, every rank keeps them whole, and `distributed.sync_gradients` averages their
  gradients as in plain data-parallel training.
Models load on the CPU and each unit moves its own shard to the device as it is sharded, so a
rank's device never holds a whole model.

Counted passes. An all-gather is a collective: the ranks must run the same sequence of forward
and backward passes of a sharded model, and theirs differ (micro-batch counts, uneven shares).
So each phase of passes (a mini-batch's forward/backward passes, the scoring passes before an
update, a critic's values) is announced with its number of passes (`passes(model, n, ...)`):
one all-reduce agrees on the largest count, and a rank with fewer pads with one-token dummy
passes of the same kind, whose backward adds zero to every gradient. A rank that runs more passes
than it announced stops at once with a message; the others then fail at the process group's
timeout (trainer.distributed_timeout_min) or are stopped by the launcher, never wait forever.
A pass outside a phase is refused with a message, with one exception: with
`trainer.fsdp_unshard_rollout=false` decoding runs on the shards, one forward pass per token and
as many as each rank's sequences need, so a pass without gradients outside a phase then runs one
small all-reduce of its own (a round), and a rank with no pass to run serves the others' rounds
with dummy passes when it reaches one of the project's own collectives (`distributed` calls
`drain` first, through `before_collectives`; phases then settle the rounds first).

Gradient weights. A rank's loss is normalized by its own share of the batch, and plain data
parallelism averages the gradients weighted by the shares (`sync_gradients`). FSDP's
reduce-scatter averages unweighted, so for a model whose trained weights are sharded the phase's
all-reduce also sums the shares' weights W, each rank scales its loss by N * w_r / W before the
backward (`Agreement.loss_scale`), and the replicated parameters beside the shards (a value head)
are then averaged unweighted (`sync_replicated`): the result is the gradient one process takes.

Unsharded rollouts (`trainer.fsdp_unshard_rollout`, on by default). Decoding runs one forward
pass per token, so per-pass all-gathers would dominate a rollout. `unsharded()` all-gathers every
unit once, keeps the full weights through the rollout (a whole copy of the policies, in the
compute dtype, on each rank meanwhile), and frees them after: no collective runs inside, so the
ranks decode at their own pace. Every rank enters at the same points: `train_step` around
`algo.collect`, and the trainer around evaluation (rank 0 evaluates while the others wait at the
barrier that follows). Inside, passes with gradients are refused (their backward would reshard).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from marl_llm.config import UserError
from marl_llm.distributed import data_parallel as distributed
from marl_llm.models.scoring import at_least_fp32

# What trainer.fsdp uses of torch's FSDP2 beyond fully_shard itself (older torch lacks them).
FSDP2_NEEDS = ("fully_shard(ignored_params=...)", "FSDPModule.set_reduce_scatter_unused_params")


def missing_fsdp2_api() -> str | None:
    """The first FSDP2 API this torch lacks (None: all there)."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError:
        return "torch.distributed.fsdp.fully_shard"
    if "ignored_params" not in inspect.signature(fully_shard).parameters:
        return FSDP2_NEEDS[0]
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        return FSDP2_NEEDS[1]
    return None


def check_supported(cfg: Any) -> None:
    """The settings FSDP cannot run with, refused before any model loads."""
    if not cfg.trainer.fsdp:
        return
    missing = missing_fsdp2_api()
    if missing:
        raise UserError(f"trainer.fsdp=true needs FSDP2's {missing}, which torch {torch.__version__} lacks: upgrade "
                        "torch (tested with 2.13), or set trainer.fsdp=false")
    if cfg.trainer.rollout != "hf":
        raise UserError(f"trainer.fsdp=true needs trainer.rollout=hf: the {cfg.trainer.rollout} backend keeps its own "
                        "whole copy of the base (set trainer.fsdp=false, or trainer.rollout=hf)")
    if cfg.model.agent_bases:
        raise UserError("trainer.fsdp=true shards one base shared by all agents: unset model.agent_bases")


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def trains_sharded(model: Any) -> bool:
    """Whether some trained parameter of `model` is an FSDP shard (full fine-tuning, a separate
    critic), as opposed to a frozen sharded base under whole adapters."""
    return is_sharded(model) and any(p.requires_grad and _is_dtensor(p) for p in model.parameters())


def replicated(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that every rank holds whole (not FSDP shards, nor the meta tensors of a
    policy this rank does not hold: placement=groups)."""
    return [p for p in params if not _is_dtensor(p) and p.device.type != "meta"]


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


def shard_model(model: Any, mesh: Any, device: torch.device, compute_dtype: torch.dtype | None = None,
                rounds: bool = False) -> tuple[int, int]:
    """Shard `model` over `mesh` in place (see the module docstring); returns (its parameters,
    those this rank holds). LoRA weights stay whole; a model with trained weights of its own gets
    `compute_dtype` (bf16 over fp32 shards) as its mixed-precision policy. `rounds`: passes
    without gradients outside phases and windows run one round each (else they are refused)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    adapters = {p for n, p in model.named_parameters() if "lora_" in n}
    trained = any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    whole = sum(p.numel() for p in model.parameters() if p not in adapters)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if trained and compute_dtype is not None else MixedPrecisionPolicy()
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=adapters)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=adapters)
    if any(p.device.type == "meta" for p in model.parameters()):  # loaded on the meta device: read the shards
        from marl_llm.distributed.sharded_loading import load_shards

        load_shards(model, device)
    with torch.no_grad():  # FSDP moves what it shards; the adapters stay whole and move here
        for p in adapters:
            p.data = p.data.to(device)
    if trained:
        # A dummy pass or a critic's pass (its loss reads hidden states, not logits) leaves some
        # gradients unset where another rank's pass sets them: reduce zeros for those. Sums, then
        # one division: gloo has no averaging reduce-scatter.
        model.set_reduce_scatter_unused_params(True)
        model.set_force_sum_reduction_for_comms(True)
    # The root unit (embeddings, final norm, LM head) stays gathered after a forward pass: the
    # chunked scoring applies the LM head after the model's forward (models/scoring.py).
    model.set_reshard_after_forward(False, recurse=False)
    local = sum(p.to_local().numel() if _is_dtensor(p) else p.numel() for p in model.parameters() if p not in adapters)
    model._marl_guard = Guard(model, layers[0], device, mesh, rounds)
    if rounds:
        distributed.before_collectives(model._marl_guard.drain)
    return whole, local


def shard_policies(policies: Any, extra: Iterable[Any] = (), meshes: dict[int, Any] | None = None,
                   rounds: bool = False) -> str:
    """Shard every model of `policies` (after all adapters, critics' included, are added: FSDP
    fixes which parameters it manages), their KL references and the `extra` trained models (a
    separate critic) over the ranks. `meshes`: model index -> mesh of the ranks that train it
    (default: all ranks). Returns a line saying how much a rank holds. The optimizers see the
    sharded parameters afterwards (`AgentPolicies.rebuild_optimizers`, `Algorithm.parameters_replaced`).
    `rounds`: see shard_model (trainer.fsdp_unshard_rollout=false decodes outside the windows)."""
    from torch.distributed.device_mesh import init_device_mesh

    w = distributed.world()
    world_mesh = init_device_mesh(policies.device.type, (w.size,))
    whole, local = 0, 0
    models = [(m, (meshes or {}).get(k, world_mesh)) for k, m in enumerate(policies.models)]
    models += [(m, world_mesh) for m in [*policies.references, *extra]]
    for model, mesh in models:
        if mesh is None:  # this rank does not train the model (placement=groups)
            continue
        a, b = shard_model(model, mesh, policies.device, policies.autocast_dtype, rounds)
        whole, local = whole + a, local + b
    policies.rebuild_optimizers()
    kind = "trained and frozen" if policies.full else "frozen"
    return (f"FSDP: the models are sharded over {w.size} ranks; each holds {local / 1e6:.2f}M of their "
            f"{whole / 1e6:.2f}M {kind} parameters")


# --------------------------------------------------------------------------------- counted passes
@dataclass
class Agreement:
    """What the ranks agreed on for one phase of passes of a model (see `passes`)."""

    passes: int  # every rank runs this many (its own, then dummy ones)
    total_weight: float  # the sum of the ranks' weights (their shares of the batch)
    ranks: int = 1
    sharded_grads: bool = False  # the model's trained weights are FSDP shards
    counts: list[int] = field(default_factory=list)  # each rank's own count

    def loss_scale(self, weight: float) -> float:
        """The factor on this rank's loss (normalized by its own share `weight`) that makes
        FSDP's plain average of the sharded gradients the weighted mean over the ranks."""
        if not self.sharded_grads or self.total_weight <= 0:
            return 1.0
        return self.ranks * weight / self.total_weight


class _Phase:
    def __init__(self, agreed: int, grad: bool, counts: list[int], rank: int):
        self.agreed, self.grad, self.counts, self.rank, self.done = agreed, grad, counts, rank, 0


class Guard:
    """Keeps one sharded model's passes in step over the ranks (see the module docstring): inside
    `unsharded()` passes run free; inside `passes()` they are counted; other passes without
    gradients run one round each when `rounds`; any other pass is refused."""

    def __init__(self, model: Any, first_layer: torch.nn.Module, device: torch.device, mesh: Any, rounds: bool):
        self.model, self.device, self.mesh, self.rounds = model, device, mesh, rounds
        self.group = mesh.get_group()
        self.phase: _Phase | None = None
        self.whole = False  # inside unsharded()
        self._draining = False
        self._awaiting_backward = False
        # prepend: the round comes before FSDP's own pre-forward all-gather of the root unit.
        model.register_forward_pre_hook(self._before_pass, prepend=True)
        model.register_forward_hook(self._after_pass)
        # The first decoder layer's output: every loss backpropagates through it (the model's own
        # outputs need not be in the loss: scoring applies the LM head to the hidden states).
        self._first_states: list[torch.Tensor] = []
        first_layer.register_forward_hook(self._layer_output)

    def _before_pass(self, module: Any, args: Any) -> None:
        if self._draining:
            return
        grad = torch.is_grad_enabled()
        if self.whole:
            if grad:
                raise RuntimeError("FSDP: a forward pass with gradients inside fsdp.unsharded() (the rollout phase); "
                                   "its backward would reshard the model mid-rollout: run it after the rollout")
            return
        if self._awaiting_backward:
            raise RuntimeError("FSDP: a forward pass with gradients must have its backward before the rank's next "
                               "forward pass (run reference/old-policy passes first, under no_grad)")
        phase = self.phase
        if phase is not None:
            if grad != phase.grad:
                raise RuntimeError(f"FSDP: a pass {'with' if grad else 'without'} gradients inside a phase announced "
                                   f"{'with' if phase.grad else 'without'} them (fsdp.passes(grad=...))")
            if phase.done >= phase.agreed:
                raise RuntimeError(f"FSDP: rank {phase.rank} ran pass {phase.done + 1} of a phase for which the ranks "
                                   f"agreed on {phase.agreed} (announced per rank: {phase.counts}): announce every "
                                   "pass in fsdp.passes(model, n); the other ranks stop at the process group's "
                                   "timeout (trainer.distributed_timeout_min)")
            phase.done += 1
            return
        if grad or not self.rounds:
            raise RuntimeError(f"FSDP: a forward pass {'with' if grad else 'without'} gradients of a sharded model "
                               "outside fsdp.passes(...) and fsdp.unsharded(): announce the phase's passes, so that "
                               "every rank runs as many")
        self._round(1)

    def _layer_output(self, module: Any, args: Any, output: Any) -> None:
        self._first_states = [t for t in _tensors(output) if t.requires_grad]

    def _after_pass(self, module: Any, args: Any, output: Any) -> None:
        first, self._first_states = self._first_states, []
        if self._draining or self.whole or not torch.is_grad_enabled():
            return
        trainable = first or [t for t in _tensors(output) if t.requires_grad]
        if not trainable:
            raise RuntimeError("FSDP: a forward pass with gradients enabled has nothing to backward through; "
                               "run it under torch.no_grad()")
        self._awaiting_backward = True
        torch.autograd.graph.register_multi_grad_hook(trainable, self._backward_started, mode="any")

    def _backward_started(self, grad: Any) -> None:
        self._awaiting_backward = False

    def _round(self, running: int) -> int:
        """All-reduce how many ranks run a pass without gradients outside a phase."""
        t = torch.tensor([running], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, group=self.group)
        return int(t[0])

    def drain(self) -> None:
        """Join the other ranks' remaining rounds with dummy passes until no rank runs one."""
        if self._awaiting_backward:
            raise RuntimeError("FSDP: a collective was reached between a forward pass with gradients and its backward")
        if self.phase is not None:
            raise RuntimeError("FSDP: a collective was reached inside fsdp.passes(...): a phase holds passes only")
        while self._round(0) > 0:
            self.dummy_pass(grad=False)

    def dummy_pass(self, grad: bool) -> None:
        """One token through every unit, in the model's current mode; with `grad`, a backward of
        zero: it all-gathers and reduce-scatters what a real pass does and adds zero to every
        gradient."""
        self._draining = True
        try:
            with torch.set_grad_enabled(grad):
                ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
                out = self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
                if grad:
                    (out.logits.float().sum() * 0).backward()
        finally:
            self._draining = False


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a model output (ModelOutput, tuple, tensor), nested tuples included."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if hasattr(output, "values") else output if isinstance(output, (tuple, list)) else []
    found: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            found.extend(_tensors(v))
    return found


@contextlib.contextmanager
def passes(model: Any, count: int, grad: bool, weight: float = 0.0) -> Iterator[Agreement]:
    """A phase of `count` forward passes of `model` on this rank (each with its backward inside the
    phase when `grad`), `weight`: this rank's share of the batch. One all-reduce agrees on the
    largest count and sums the weights; on leaving, a rank pads its passes with dummy ones to the
    agreed count. Every rank of the model's mesh enters the same phases in the same order. On an
    unsharded model (one process, no FSDP): nothing to agree, `Agreement(count, weight)`."""
    guard: Guard | None = getattr(model, "_marl_guard", None)
    if guard is None:
        yield Agreement(count, weight)
        return
    if guard.rounds:
        distributed.settle()  # no rank is still in rounds when the agreement runs
    n, rank = guard.mesh.size(), guard.mesh.get_local_rank()
    t = torch.zeros(n + 1, dtype=torch.float64, device=guard.device)
    t[rank], t[n] = count, weight
    torch.distributed.all_reduce(t, group=guard.group)
    counts = [int(c) for c in t[:n].tolist()]
    agreed = Agreement(max(counts), float(t[n]), n, trains_sharded(model), counts)
    guard.phase = _Phase(agreed.passes, grad, counts, torch.distributed.get_rank())
    try:
        yield agreed
        if guard._awaiting_backward:
            raise RuntimeError("FSDP: a phase ended between a forward pass with gradients and its backward")
        while guard.phase.done < agreed.passes:
            guard.phase.done += 1
            guard.dummy_pass(grad)
    finally:
        guard.phase = None


def sync_replicated(params: list[torch.Tensor], weight: float, agreed: Agreement) -> None:
    """Synchronize the gradients of `params` after a phase with gradients: the weighted mean of the
    whole parameters (`sync_gradients`); where the model's trained weights are shards (reduced by
    FSDP already), its losses were scaled (`Agreement.loss_scale`), so the whole parameters beside
    them take the plain mean."""
    whole = replicated(params)
    if not whole:
        return
    distributed.sync_gradients(whole, 1.0 if agreed.sharded_grads else weight)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> float:
    """torch's clip_grad_norm_ (None: no clipping, the norm measured), over FSDP-sharded gradients
    too: the squared norms of this rank's shards are summed over the mesh, the whole gradients
    beside them added once."""
    limit = float("inf") if max_norm is None else max_norm
    grads = [p.grad for p in params if p.grad is not None]
    shards = [g for g in grads if _is_dtensor(g)]
    if not shards:
        return float(torch.nn.utils.clip_grad_norm_(params, limit))
    whole = [g for g in grads if not _is_dtensor(g)]
    local = [g.to_local() for g in shards]
    squares = torch.stack([torch.linalg.vector_norm(at_least_fp32(g)) ** 2 for g in local]).sum()
    torch.distributed.all_reduce(squares, group=shards[0].device_mesh.get_group())
    if whole:
        squares = squares + sum(torch.linalg.vector_norm(at_least_fp32(g)).to(squares.device) ** 2 for g in whole)
    total = squares.sqrt()
    coef = torch.clamp(limit / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in [*local, *whole]:
            g.mul_(coef.to(g.device, g.dtype))
    return float(total)


def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """A sharded model's whole state dict on the CPU of its mesh's first rank ({} elsewhere),
    gathered one tensor at a time: a collective over the model's mesh (every rank of it calls)."""
    first = model._marl_guard.mesh.get_local_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        whole = t.full_tensor() if _is_dtensor(t) else t
        if first:
            out[name] = whole.detach().to("cpu", copy=True)
    return out


def whole_policies(policies: Any, staging: Any = None) -> dict[int, Any]:
    """The whole state dicts of the policies whose trained weights are shards, by model index, on
    rank 0 (every rank calls; {} when none is sharded): what the exported agents are written from.
    A model sharded over a group of ranks without rank 0 (placement=groups) is gathered on the
    group's first rank, which writes it to `staging`/<k> (a directory on the run dir's
    filesystem); rank 0 gets that path."""
    import os
    from pathlib import Path

    from marl_llm.distributed import placement

    where, me = placement.current(), distributed.world().rank
    out: dict[int, Any] = {}
    for key in policies.trainable_adapters():
        k, model = key[0], policies.models[key[0]]
        ranks = where.ranks_of(key)
        if me in ranks and trains_sharded(model):
            state = full_state_dict(model)
            if me == 0:
                out[k] = state
            elif me == ranks[0]:  # transformers' save_pretrained writes on rank 0 only: the files by hand
                from safetensors.torch import save_file

                target = Path(staging) / f"{k}"
                target.mkdir(parents=True, exist_ok=True)
                save_file({n: t.contiguous() for n, t in state.items()}, target / "model.safetensors",
                          metadata={"format": "pt"})
                model.config.to_json_file(target / "config.json")
                if getattr(model, "generation_config", None) is not None:
                    model.generation_config.to_json_file(target / "generation_config.json")
        if ranks[0] != 0 and me == 0:
            out[k] = Path(staging) / f"{k}"
    distributed.barrier()
    return {k: v for k, v in out.items() if not isinstance(v, Path) or os.path.isdir(v)}


# ------------------------------------------------------------------------------------- rollouts
def _units(model: Any) -> list[Any]:
    """The FSDP units of a sharded model, root first then layer by layer: the same order on
    every rank (their all-gathers must pair up)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(policies: Any, enabled: bool = True, extra: Iterable[Any] = ()) -> Iterator[None]:
    """The sharded models of `policies` (and `extra` ones) whole on every rank for the duration
    (see the module docstring): one all-gather per unit on entry, none inside, each rank's full
    copy freed on exit.

    A collective: every rank enters at the same point (a rank may leave whenever it is done, as
    freeing is local). A no-op when `enabled` is false or nothing is sharded (one process)."""
    models = [m for m in [*policies.models, *extra] if is_sharded(m)] if enabled else []
    if not models:
        yield
        return
    distributed.settle()  # no rank is still in rounds when the all-gathers start
    for model in models:
        model.set_reshard_after_forward(False)  # a pass must not free what the window gathered
        handles = [unit.unshard(async_op=True) for unit in _units(model)]  # overlapped on NCCL
        for handle in handles:
            handle.wait()
        model._marl_guard.whole = True
    try:
        yield
    finally:
        for model in models:
            model._marl_guard.whole = False
            for unit in _units(model):
                unit.reshard()
            # Back to shard_model's settings: the layers free their weights after each pass; the
            # root keeps its own.
            model.set_reshard_after_forward(True)
            model.set_reshard_after_forward(False, recurse=False)
