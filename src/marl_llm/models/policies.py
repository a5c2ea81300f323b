"""The agents' policies: N LoRA adapters on one frozen base (peft multi-adapter) by default (loading
a base: models/loading.py).

- `AgentPolicies` owns the base model(s), one adapter per agent (or one shared adapter, or one
  base per agent for heterogeneous teams) and one optimizer per trainable adapter. The reference
  policy is the base with adapters disabled: no second copy in memory.
- `algo.lora=null`: full fine-tuning. Each policy owns a whole copy of its base, every parameter
  trained by its own AdamW. With a bf16 `model.dtype` (the default on CUDA) the copy keeps fp32
  master weights (and fp32 optimizer state) and every forward pass runs under
  `torch.autocast(<device>, bf16)`; with float32 (the CPU default) nothing is autocast. LoRA
  policies alike: a frozen bf16 base, fp32 adapters, forward passes under bf16 autocast (the
  adapters' matmuls on tensor cores). Memory per policy: params + grads + two
  AdamW moments, ~16 bytes/param in fp32. The KL reference (only when algo.kl_coef > 0) is one
  frozen copy of each base model in `model.dtype`, shared by the policies on that base.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from marl_llm.config import UserError
from marl_llm.models.loading import eos_token_ids, load_base, resolve_device, resolve_dtype

# ---------------------------------------------------------------------------- full fine-tuning
def master_weights_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of trained weights: `dtype` when it is bf16/fp16 (the trained
    parameters are then kept in fp32, master weights with fp32 AdamW state, and every forward
    pass computes in `dtype` under `torch.autocast(device.type, dtype)`), else None (float32:
    nothing is autocast). Why: AdamW steps of a bf16 parameter round away at the presets'
    learning rates (a bf16 weight of magnitude 0.02 has a spacing of ~1e-4; an update of
    lr 5e-6 x ~1 never moves it). The same rule holds on every device, so CPU autocast runs
    exactly the CUDA code path in the tests. fp16 is never trained (no loss scaling):
    `check_trainable_dtype` refuses it."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


@contextlib.contextmanager
def created_in(dtype: torch.dtype):
    """Inside, modules are created (and randomly initialized) in float64 when `dtype` is float64, else
    as usual. Why: peft creates LoRA weights in torch's default dtype (float32) and casts them to the
    base's; float32 draws (kaiming_uniform_, normal_) round differently under ATen's scalar and vector
    kernels, so a float64 run would start from other weights on another CPU
    (development.md#numerics-on-other-cpus)."""
    if dtype != torch.float64:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def linears_cast(model, dtype: torch.dtype):
    """Inside, each nn.Linear of `model` holds its weight and bias as frozen copies in `dtype`
    (the module's own attribute replaced, so a weight tied to an embedding keeps the embedding in
    its own dtype); the master parameters come back on exit. What autocast computes with, cast
    once: `.to(dtype)` is the cast autocast applies to a linear's arguments."""
    swapped = []
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                for name in ("weight", "bias"):
                    p = module._parameters.get(name)
                    if p is not None and p.is_floating_point() and p.dtype != dtype:
                        swapped.append((module, name, p))
                        module._parameters[name] = torch.nn.Parameter(p.to(dtype), requires_grad=False)
    try:
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def check_trainable_dtype(dtype: torch.dtype) -> None:
    """Refuse fp16 training: without loss scaling small gradients underflow to zero in fp16,
    and bf16 (same memory, fp32's exponent range) needs none."""
    if dtype == torch.float16:
        raise UserError("model.dtype=float16 trains without loss scaling (small gradients underflow): use "
                        "model.dtype=bfloat16 (or float32 on a GPU without bf16); float16 is fine for "
                        "evaluation only (trainer.max_steps=0)")


def _autocast_context(model) -> contextlib.AbstractContextManager:
    autocast = getattr(model, "marl_autocast", None)
    return torch.autocast(device_type=autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()


def compute_autocast(model) -> contextlib.AbstractContextManager:
    """The autocast a model's own forward runs under (`autocast_forward`), for code that calls
    its submodules directly (chunked scoring calls the decoder and the LM head): a no-op for a
    model without one."""
    return _autocast_context(model)


def autocast_forward(model, device_type: str, dtype: torch.dtype):
    """Run every forward pass of `model` (this instance) under torch.autocast(device_type,
    dtype), keeping the forward's signature (generate reads it); `model.marl_autocast` records
    it (see compute_autocast). Bound with MethodType, so `copy.deepcopy` rebinds it to a copy."""
    model.forward = types.MethodType(_autocast_forward(type(model).forward, device_type, dtype), model)
    model.marl_autocast = (device_type, dtype)
    return model


def _itself(model):
    return model


def _autocast_forward(forward, device_type: str, dtype: torch.dtype):
    """`forward` (the class's, unbound) run under autocast; keeps its signature (generate reads it)."""
    @functools.wraps(forward)
    def wrapped(self, *args: Any, **kwargs: Any):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(self, *args, **kwargs)

    return wrapped


def full_model(model, autocast: torch.dtype | None, trainable: bool = True, device_type: str = "cuda"):
    """Make a plain transformers model one fully fine-tuned policy (or, trainable=False, its
    frozen reference), in place; returns it.

    autocast (see master_weights_dtype): None keeps the parameters' dtype and plain forward
    passes. A dtype makes a trainable model's parameters fp32 (the master weights; AdamW's state
    follows them) and runs every forward pass under `torch.autocast(device_type, dtype)`; a
    frozen reference is stored in that dtype (it is never stepped) and gets the same autocast,
    so both compute alike.
    Instance attributes bound with MethodType, so `copy.deepcopy` rebinds them to the copy. The
    model also answers `get_base_model()` (itself), as a peft model does, for code that reads the
    base's config or name whatever the kind of policy.
    """
    if autocast is not None:
        model.to(torch.float32 if trainable else autocast)
        autocast_forward(model, device_type, autocast)
    model.get_base_model = types.MethodType(_itself, model)
    model.requires_grad_(trainable)
    model.eval()
    return model


def same_optimizer(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """An optimizer of `opt`'s class and settings (no state) over `params`, with the AdamW
    implementation for the device `params` are on now (`adamw_kwargs`): FSDP's shards of a model
    loaded on the CPU live on the GPU, where AdamW is fused, though the first optimizer was not."""
    accepted = inspect.signature(type(opt).__init__).parameters
    settings = {k: v for k, v in opt.defaults.items() if k in accepted}
    if isinstance(opt, torch.optim.AdamW):
        settings.update(fused=None, foreach=None, **adamw_kwargs({p.device.type for p in params}))
    return type(opt)(params, **settings)


# --------------------------------------------------------------------------------------- agents
def adamw(params, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over `params` with `adamw_kwargs` (fused on CUDA)."""
    params = list(params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                             **adamw_kwargs({p.device.type for p in params}))


def adamw_kwargs(device_types: set[str]) -> dict[str, Any]:
    """AdamW's implementation for parameters on these device types: fused on CUDA (one kernel
    steps every parameter, instead of a few foreach kernels per step; the update's optimizer step
    is then bound by reading and writing the fp32 state once), torch's default elsewhere. A
    resumed optimizer keeps the implementation the run has now (`restore_implementation`)."""
    return {"fused": True} if device_types == {"cuda"} else {}


def restore_implementation(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """`opt.load_state_dict(saved)`, keeping `opt`'s own fused/foreach choice (a checkpoint of a
    CPU run resumed on CUDA would otherwise bring its unfused setting along, and the reverse)."""
    own = [{k: g.get(k) for k in ("fused", "foreach")} for g in opt.param_groups]
    opt.load_state_dict(saved)
    for group, keep in zip(opt.param_groups, own):
        group.update(keep)


def lora_weights(model, adapter: str) -> dict[str, torch.nn.Parameter]:
    """One adapter's LoRA weights of a peft model, by name ("<...>.<adapter>.<...>lora_<A|B>...")."""
    return {n: p for n, p in model.named_parameters() if f".{adapter}." in n and "lora_" in n}


@dataclass
class Agent:
    """One agent: which base model it runs on and which adapter it acts with."""

    name: str
    model_index: int
    adapter: str


class AgentPolicies:
    """The agents' policies: LoRA adapters on frozen base model(s), with their optimizers.

    models[k] is a peft model; agents[i] says which model and adapter agent i uses. With
    `adapters=shared` all agents act with one adapter (and one optimizer); with
    `model.agent_bases` each agent gets its own base model (heterogeneous teams).

    `algo.lora=null` (`full`): models[k] is one policy's own full copy of its base (a plain
    transformers model, all parameters trainable; see `full_model` for fp32 master weights and
    autocast) and its one "adapter" is just the policy's name (agent_<name>, shared or
    policy_<name>, as with LoRA, so keys and metric labels are the same). Several policies on one
    base are several models; agents sharing a policy share its model. `references` holds one
    frozen copy per base model when algo.kl_coef > 0, else nothing.
    """

    def __init__(self, agent_names: tuple[str, ...], model_cfg: Any, algo_cfg: Any, seed: int,
                 load_on_cpu: bool = False, on_meta: bool = False, master_weights: str = "fp32"):
        with created_in(resolve_dtype(model_cfg.dtype, resolve_device(model_cfg.device))):
            self._build(agent_names, model_cfg, algo_cfg, seed, load_on_cpu, on_meta, master_weights)

    def _build(self, agent_names: tuple[str, ...], model_cfg: Any, algo_cfg: Any, seed: int, load_on_cpu: bool,
               on_meta: bool, master_weights: str):
        from peft import LoraConfig, get_peft_model

        self.device = resolve_device(model_cfg.device)
        self.master_weights = master_weights
        # FSDP loads bases on the CPU and moves each rank's shards to the device (fsdp.py); fully
        # fine-tuned policies (`on_meta`, trainer.fsdp_load=sharded) are built on the meta device
        # instead and each rank reads only its shards (distributed/sharded_loading.py). LoRA bases load on the
        # CPU whole: peft draws the adapters' initial weights where the base is.
        load_device = torch.device("cpu") if load_on_cpu else self.device
        # Whether fully fine-tuned models of this run load on the meta device (a separate critic too).
        self.on_meta = on_meta = on_meta and algo_cfg.lora is None
        self.dtype = resolve_dtype(model_cfg.dtype, self.device)
        if master_weights == "bf16" and self.dtype != torch.bfloat16:
            raise UserError(f"trainer.master_weights=bf16 keeps the trained weights in model.dtype, which is "
                            f"{str(self.dtype).removeprefix('torch.')} here: set model.dtype=bfloat16 (auto is bf16 on "
                            "CUDA only) or trainer.master_weights=fp32")
        bases = list(model_cfg.agent_bases) if model_cfg.agent_bases else [None]
        if len(bases) not in (1, len(agent_names)):
            raise UserError(f"model.agent_bases has {len(bases)} entries for {len(agent_names)} agents "
                            f"({', '.join(agent_names)}): give one base per agent")
        shared = algo_cfg.adapters == "shared"
        if shared and len(bases) > 1:
            raise UserError("algo.adapters=shared needs one base model: unset model.agent_bases")
        # An explicit agent -> policy map (AT-GRPO's sigma) overrides `adapters`.
        policy_map = dict(algo_cfg.get("policy_map") or {})
        if policy_map:
            if set(policy_map) != set(agent_names):
                raise UserError(f"algo.policy_map maps {sorted(policy_map)} but the agents are {list(agent_names)}: "
                                "give every agent exactly one policy name")
            if len(bases) > 1 and len(set(policy_map.values())) < len(agent_names):
                raise UserError("agents on different base models (model.agent_bases) cannot share a policy")
        # config.validate knows the built-in tasks' agents; these are the task's own (any task).
        unknown = sorted(set(algo_cfg.get("agent_sampling") or {}) - set(agent_names))
        if unknown:
            raise UserError(f"algo.agent_sampling names {unknown}, which are not agents of this task; its agents are "
                            f"{list(agent_names)}: key the overrides by one of them")
        self.seed = seed
        self.full = algo_cfg.lora is None
        # What loaded each model (a separate critic loads another copy of its agents' base).
        self.model_cfg, self.base_specs = model_cfg, []
        self.lora = lora = None if self.full else LoraConfig(
            r=algo_cfg.lora.r, lora_alpha=algo_cfg.lora.alpha, lora_dropout=algo_cfg.lora.dropout,
            # [all-linear]: peft's own "all-linear" (every linear layer but the output head).
            target_modules=("all-linear" if list(algo_cfg.lora.target_modules) == ["all-linear"]
                            else list(algo_cfg.lora.target_modules)), task_type="CAUSAL_LM")
        # The compute dtype of the fp32 trained weights (None: float32, no autocast). Full
        # fine-tuning keeps fp32 master copies of whole models; LoRA keeps its adapters in fp32
        # (peft's default) on the frozen bf16 base, and autocast runs the adapters' matmuls in
        # bf16 (tensor cores) instead of fp32.
        # trainer.master_weights=bf16 (the references' precision): the trained weights and AdamW's
        # state stay in bf16, nothing is autocast.
        self.autocast_dtype = master_weights_dtype(self.device, self.dtype) if master_weights == "fp32" else None
        self.models, self.tokenizers, self.agents = [], [], []
        self.references: list[Any] = []
        self._reference_of: list[int] = []  # model index -> index in `references`
        keep_reference = self.full and float(algo_cfg.get("kl_coef", 0.0) or 0.0) > 0
        for k, base_spec in enumerate(bases):
            # Master weights load in fp32 straight from the checkpoint (no round trip through bf16).
            load_dtype = torch.float32 if self.full and self.autocast_dtype is not None else self.dtype
            base, tok = load_base(base_spec, model_cfg, load_device, load_dtype, compute_device=self.device,
                                  on_meta=on_meta)
            if self.full:
                names = agent_names if len(bases) == 1 else (agent_names[k],)
                self._add_full_policies(base, tok, base_spec, names, policy_map, shared, keep_reference)
                continue
            missing = [] if lora.target_modules == "all-linear" else [
                m for m in lora.target_modules if not any(n.endswith(m) for n, _ in base.named_modules())]
            # peft resolves "all-linear" into the model's own names in the config it is given: a copy each.
            if missing:
                raise UserError(f"algo.lora.target_modules {missing} are not modules of {type(base).__name__}; "
                                "list the model's linear layers (e.g. q_proj, v_proj)")
            # Agents on this base: all of them with one shared base, else agent k alone.
            names = agent_names if len(bases) == 1 else (agent_names[k],)
            adapter_of = {n: (f"policy_{policy_map[n]}" if policy_map else "shared" if shared else f"agent_{n}")
                          for n in names}
            adapters = list(dict.fromkeys(adapter_of.values()))
            torch.manual_seed(seed + 1000 * k)  # LoRA A matrices are random: seed them
            model = get_peft_model(base, copy.deepcopy(lora), adapter_name=adapters[0])
            for a in adapters[1:]:
                model.add_adapter(a, copy.deepcopy(lora))
            if self.autocast_dtype is not None:
                autocast_forward(model, self.device.type, self.autocast_dtype)
            elif master_weights == "bf16":
                self._adapters_in_model_dtype(model)
            model.eval()
            self.models.append(model)
            self.tokenizers.append(tok)
            self.base_specs.append(base_spec)
            self.agents.extend(Agent(n, k, adapter_of[n]) for n in names)
        self.eos_ids = [eos_token_ids(m, t) for m, t in zip(self.models, self.tokenizers)]
        # Each adapter's LoRA weights (full fine-tuning: all of its model's parameters) by name, found once.
        self._adapter_params = {(k, name): dict(self.models[k].named_parameters()) if self.full
                                else lora_weights(self.models[k], name) for k, name in self.trainable_adapters()}
        self.optimizers: dict[tuple[int, str], torch.optim.Optimizer] = {
            key: adamw(self.adapter_parameters(*key), algo_cfg.learning_rate, algo_cfg.weight_decay)
            for key in self.trainable_adapters()}

    def _add_full_policies(self, base, tok, base_spec: str | None, names: tuple[str, ...], policy_map: dict,
                           shared: bool, keep_reference: bool) -> None:
        """One model per policy of `names` (agents on this base), in agent order: copies of
        `base`, which itself becomes the frozen reference when one is kept, else the last policy
        (no copy more than needed)."""
        policy_of = {n: (f"policy_{policy_map[n]}" if policy_map else "shared" if shared else f"agent_{n}")
                     for n in names}
        policies = list(dict.fromkeys(policy_of.values()))
        first = len(self.models)
        copies = [copy.deepcopy(base) for _ in range(len(policies) - (0 if keep_reference else 1))]
        if not keep_reference:
            copies.append(base)
        device_type = self.device.type
        for model in copies:
            self.models.append(full_model(model, self.autocast_dtype, device_type=device_type))
            self.tokenizers.append(tok)
            self.base_specs.append(base_spec)
        if keep_reference:
            self.references.append(full_model(base, self.autocast_dtype, trainable=False, device_type=device_type))
            self._reference_of.extend([len(self.references) - 1] * len(policies))
        self.agents.extend(Agent(n, first + policies.index(policy_of[n]), policy_of[n]) for n in names)

    # -- structure
    @property
    def agent_names(self) -> list[str]:
        return [a.name for a in self.agents]

    def trainable_adapters(self) -> list[tuple[int, str]]:
        """(model index, adapter name) of every adapter with its own optimizer, in agent order."""
        keys: list[tuple[int, str]] = []
        for a in self.agents:
            if (a.model_index, a.adapter) not in keys:
                keys.append((a.model_index, a.adapter))
        return keys

    def trainable_parameters(self) -> list[torch.Tensor]:
        """Every adapter parameter an optimizer steps (in a fixed order: data-parallel ranks
        broadcast and all-reduce them alike)."""
        return [p for opt in self.optimizers.values() for group in opt.param_groups for p in group["params"]]

    def agents_of(self, key: tuple[int, str]) -> list[int]:
        return [i for i, a in enumerate(self.agents) if (a.model_index, a.adapter) == key]

    def policy_label(self, key: tuple[int, str]) -> str:
        """The metric segment of an adapter: the agent's name, `shared`, or the policy_map name."""
        adapter = key[1]
        if adapter.startswith("policy_"):
            return adapter.removeprefix("policy_")
        agents = self.agents_of(key)
        return "shared" if len(agents) > 1 or adapter == "shared" else self.agents[agents[0]].name

    def add_adapter(self, model_index: int, name: str) -> dict[str, torch.nn.Parameter]:
        """One more LoRA adapter on base `model_index` that is not an agent's (e.g. a critic: one
        more adapter, not one more model). Its owner trains and saves it; returns its weights by
        name, trainable."""
        if self.full:
            raise UserError(f"{name}: a LoRA adapter needs LoRA actors, but algo.lora=null fully fine-tunes them: "
                            "use algo.critic.placement=separate")
        model = self.models[model_index]
        if name in model.peft_config:
            raise ValueError(f"adapter {name!r} already exists on model {model_index}")
        torch.manual_seed(self.seed + 1000 * model_index + len(model.peft_config))
        with created_in(self.dtype):
            model.add_adapter(name, copy.deepcopy(self.lora))
        if self.master_weights == "bf16":
            self._adapters_in_model_dtype(model)
        params = lora_weights(model, name)
        for p in params.values():
            p.requires_grad_(True)
        return params

    def _adapters_in_model_dtype(self, model) -> None:
        """trainer.master_weights=bf16: the LoRA weights peft creates in fp32, cast to the base's
        dtype (they are then trained there, as the references train theirs)."""
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)

    def model_device(self, model_index: int) -> torch.device:
        """Where model `model_index` computes: its parameters' device (trainer.placement=devices
        spreads the models), the run's device for one loaded on the CPU to be sharded."""
        device = next(self.models[model_index].parameters()).device
        return self.device if device.type in ("cpu", "meta") else device

    def rebuild_optimizers(self) -> None:
        """New optimizers (same class and settings, no state yet) over the parameters the models
        hold now: FSDP replaces a sharded model's parameters with its shards."""
        for key, opt in self.optimizers.items():
            if self.full:
                self._adapter_params[key] = dict(self.models[key[0]].named_parameters())
            self.optimizers[key] = same_optimizer(opt, self.adapter_parameters(*key))

    def adapter_parameters(self, model_index: int, adapter: str) -> list[torch.nn.Parameter]:
        """The LoRA weights of one adapter (made trainable; everything else stays frozen); full
        fine-tuning: every parameter of the policy's model."""
        params = list(self._adapter_params[(model_index, adapter)].values())
        for p in params:
            p.requires_grad_(True)
        return params

    @contextmanager
    def acting(self, agent_index: int) -> Iterator[Any]:
        """Context: agent i's model with its adapter active, in train mode; yields the model."""
        a = self.agents[agent_index]
        model = self.models[a.model_index]
        if not self.full:  # a full model is its policy: nothing to switch
            model.set_adapter(a.adapter)
            # set_adapter marks only the active adapter trainable; keep every adapter's flag on so
            # the optimizers always see their parameters.
            for key in self.trainable_adapters():
                if key[0] == a.model_index:
                    for p in self.adapter_parameters(*key):
                        p.requires_grad_(True)
        model.train()
        try:
            yield model
        finally:
            model.eval()

    @contextmanager
    def reference(self, model_index: int) -> Iterator[Any]:
        """Context: the frozen reference policy of model `model_index`; yields a model to score
        with (no gradients wanted). LoRA: the same model with its adapters disabled. Full
        fine-tuning: the frozen copy of its base, kept only when algo.kl_coef > 0."""
        if not self.full:
            model = self.models[model_index]
            with model.disable_adapter():
                yield model
            return
        if not self.references:
            raise RuntimeError("no reference model was kept: AgentPolicies keeps one for algo.lora=null only "
                               "when algo.kl_coef > 0")
        yield self.references[self._reference_of[model_index]]

    def autocast(self, model_index: int) -> contextlib.AbstractContextManager:
        """Autocast around many forward passes of model `model_index` (a rollout): the forward
        passes autocast anyway, but inside one outer context each fp32 weight is cast to the
        compute dtype once and cached until the context ends (one transient low-precision copy)
        instead of at every decode step. A no-op without fp32 master weights."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def decoding_weights(self, model_index: int) -> contextlib.AbstractContextManager:
        """Around a generate call of model `model_index`: with fp32 master weights (full
        fine-tuning under bf16 autocast), every Linear layer computes with a copy of its weight and
        bias cast to the compute dtype once here (`linears_cast`), instead of autocast casting them
        inside every decode step (a compiled step's graph holds a cast of every weight, run at
        every token; eager autocast caches them, to the same values). A no-op for LoRA policies
        (their bases are stored in the compute dtype; MixedLoRA stacks the adapters in it), for
        float32 runs and for FSDP's all-gathered weights (already in the compute dtype)."""
        from marl_llm.distributed import fsdp

        model = self.models[model_index]
        if not self.full or self.autocast_dtype is None or fsdp.is_sharded(model):
            return contextlib.nullcontext()
        return linears_cast(model, self.autocast_dtype)

    def enable_gradient_checkpointing(self, extra: list[Any] = ()) -> None:
        """On every policy model, and on `extra` trained models (a separate critic)."""
        for m in [*self.models, *extra]:
            # Non-reentrant: with a frozen base, reentrant checkpointing would cut the LoRA grads
            # (full fine-tuning: the whole model is trainable, non-reentrant works the same).
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # -- state for checkpoints
    @property
    def kind(self) -> str:
        """What `adapter_state` holds: "lora" (adapters) or "full" (whole models, algo.lora=null)."""
        return "full" if self.full else "lora"

    def adapter_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{"<model index>/<adapter>": trainable tensors on CPU}: the LoRA weights, or with
        algo.lora=null every parameter of the policy's model (fp32 master weights as they are)."""
        return {f"{k}/{name}": {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
                for (k, name), params in self._adapter_params.items()}

    def load_adapter_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore `adapter_state()` exactly; KeyError when it does not hold exactly this
        config's policies and tensors."""
        want = {f"{k}/{name}" for k, name in self._adapter_params}
        if set(state) != want:
            raise KeyError(f"policies {sorted(state)} where this config has {sorted(want)}")
        for key, tensors in state.items():
            k, name = key.split("/", 1)
            params = self._adapter_params[(int(k), name)]
            if set(tensors) != set(params):
                missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
                raise KeyError(f"{key}: missing {missing[:3]}, unexpected {extra[:3]}")
            with torch.no_grad():
                for n, t in tensors.items():
                    params[n].copy_(t.to(params[n].device, params[n].dtype))

    def optimizer_state(self) -> dict[str, Any]:
        return {f"{k}/{name}": opt.state_dict() for (k, name), opt in self.optimizers.items()}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        for (k, name), opt in self.optimizers.items():
            restore_implementation(opt, state[f"{k}/{name}"])
