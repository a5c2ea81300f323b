"""Which ranks and devices hold and train which policy (`trainer.placement`), and how a step's
work is split over the ranks (`trainer.work_split`).

    trainer.placement=shared     every policy on every rank (with trainer.fsdp sharded over all of
                                 them), the policies trained one after another (the default)
    trainer.placement=groups     disjoint groups of ranks, one per policy (trainer.placement_groups:
                                 their sizes in policy order, e.g. [4, 4]; default equal): a rank
                                 holds and trains its group's policy only, sharded over the group
                                 (trainer.fsdp=true); rollouts send each agent's requests to the
                                 group of its policy. Fully fine-tuned policies (algo.lora=null):
                                 LoRA policies share one base that every rank holds anyway
    trainer.placement=devices    one process with several GPUs: policy k on device k
                                 (trainer.placement_devices, default every visible GPU), as
                                 CoMLRL's per-agent devices; fully fine-tuned policies

    trainer.work_split=prompts        each rank rolls out its own share of the step's problems
    trainer.work_split=joint_actions  every rank holds the step's problems; each generate call's
                                      requests (the G branches of a prompt, the nodes of its tree)
                                      are split over the ranks that hold the requested policy and
                                      the completions gathered, so every rank has the whole tree;
                                      each mini-batch's samples are split over the ranks that
                                      train the policy. One prompt per step scales (MAGRPO's
                                      paper presets), and the results equal one process's
    trainer.work_split=auto           prompts when the step's problems divide over the ranks and
                                      placement=shared, else joint_actions

`check(cfg, world_size, ...)` refuses a placement that does not fit the world in one line. The
run's placement is module state, as `data_parallel.world()`: `current()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, TypeVar

import torch

from marl_llm.config import UserError
from marl_llm.distributed import data_parallel as distributed

T = TypeVar("T")
MODES = ("shared", "groups", "devices")
SPLITS = ("auto", "prompts", "joint_actions")


@dataclass
class Placement:
    """The run's placement. `ranks[key]`: the ranks that train policy `key` (model index, adapter
    name), in order; `devices[k]`: the device of model k (placement=devices)."""

    mode: str = "shared"
    split: str = "prompts"  # "prompts" | "joint_actions" (auto resolved)
    ranks: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    devices: dict[int, torch.device] = field(default_factory=dict)
    groups: dict[tuple[int, str], Any] = field(default_factory=dict)  # key -> its ranks' process group

    @property
    def by_actions(self) -> bool:
        return self.split == "joint_actions"

    def ranks_of(self, key: tuple[int, str]) -> list[int]:
        return self.ranks.get(key) or list(range(distributed.world().size))

    def holds(self, key: tuple[int, str]) -> bool:
        """Whether this rank holds (and trains) policy `key`."""
        return distributed.world().rank in self.ranks_of(key)

    def group_of(self, key: tuple[int, str]) -> Any:
        """The process group of the ranks that train `key` (None: every rank, the default group)."""
        return self.groups.get(key)

    def share(self, items: Sequence[T], key: tuple[int, str]) -> list[T]:
        """This rank's contiguous share of `items` among the ranks that train `key` (by actions),
        or all of them (by prompts: the rank's samples are its own already)."""
        if not self.by_actions:
            return list(items)
        ranks = self.ranks_of(key)
        me = distributed.world().rank
        if me not in ranks:
            return []
        return distributed.shard(items, distributed.World(ranks.index(me), len(ranks)))


_CURRENT = Placement()


def current() -> Placement:
    return _CURRENT


def reset() -> None:
    global _CURRENT
    _CURRENT = Placement()


def resolve_split(setting: str, mode: str, prompts_per_step: int, world_size: int) -> str:
    """trainer.work_split with `auto` resolved (see the module docstring)."""
    if world_size == 1:
        return "prompts"
    if setting != "auto":
        return setting
    return "prompts" if mode == "shared" and prompts_per_step % world_size == 0 else "joint_actions"


def group_sizes(cfg_sizes: Sequence[int] | None, policies: int, world_size: int) -> list[int]:
    """The ranks of each policy's group (placement=groups): trainer.placement_groups, or equal."""
    if cfg_sizes:
        return [int(n) for n in cfg_sizes]
    return [world_size // policies] * policies


def check(cfg: Any, world_size: int, policies: int, visible_gpus: int) -> None:
    """Refuse, in one line that names the fix, a placement that does not fit this world: before
    any model loads. `policies`: how many trained policies the config has."""
    tc = cfg.trainer
    mode, split = tc.placement, tc.work_split
    if mode not in MODES:
        raise UserError(f"trainer.placement={mode} is not one of {', '.join(MODES)}")
    if split not in SPLITS:
        raise UserError(f"trainer.work_split={split} is not one of {', '.join(SPLITS)}")
    full = cfg.algo.get("lora", None) is None
    if mode == "groups":
        if not full:
            raise UserError("trainer.placement=groups gives each policy its own ranks, but LoRA policies share one base "
                            "that every rank holds: use trainer.placement=shared (or algo.lora=null)")
        if not tc.fsdp:
            raise UserError("trainer.placement=groups shards each policy over its group of ranks: set trainer.fsdp=true")
        sizes = group_sizes(tc.placement_groups, policies, world_size)
        if len(sizes) != policies or min(sizes, default=0) < 1 or sum(sizes) != world_size:
            want = f"{policies} group sizes summing to {world_size}"
            raise UserError(f"trainer.placement=groups with trainer.placement_groups={list(sizes)} does not fit "
                            f"{policies} policies on {world_size} processes: give {want} (e.g. "
                            f"trainer.placement_groups=[{','.join(str(n) for n in _even(world_size, policies))}]), or "
                            "start as many processes")
        if split == "prompts":
            raise UserError("trainer.placement=groups needs every rank to roll out the same problems: set "
                            "trainer.work_split=joint_actions (or auto)")
        if float(cfg.algo.get("kl_coef", 0.0) or 0.0) > 0:
            raise UserError("trainer.placement=groups with algo.kl_coef > 0: the frozen KL reference of a base serves "
                            "policies of different groups; use trainer.placement=shared, or algo.kl_coef=0")
    if mode == "devices":
        if world_size > 1:
            raise UserError(f"trainer.placement=devices puts one policy per GPU of ONE process, but {world_size} "
                            "processes were started: run one process, or use trainer.placement=shared")
        if not full and not cfg.model.agent_bases:
            raise UserError("trainer.placement=devices puts each policy's own model on a device, but LoRA policies "
                            "share one base: set algo.lora=null (or model.agent_bases), or trainer.placement=shared")
        devices = list(tc.placement_devices or [])
        if not devices and visible_gpus < 2:
            raise UserError(f"trainer.placement=devices needs several GPUs, and this process sees {visible_gpus}: use "
                            "trainer.placement=shared, or list the devices (trainer.placement_devices=[cuda:0,cuda:1])")
    if split == "prompts" and world_size > 1 and tc.prompts_per_step % world_size:
        raise UserError(f"trainer.prompts_per_step={tc.prompts_per_step} does not split over {world_size} processes: "
                        f"use a multiple of {world_size}, or trainer.work_split=joint_actions (the ranks then share "
                        "each prompt's joint actions)")


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def setup(cfg: Any, policies: Any) -> Placement:
    """The run's placement for `policies` (after `check`): rank groups (and their process groups)
    or devices; becomes `current()`. Every rank calls (new_group is a collective)."""
    global _CURRENT
    tc = cfg.trainer
    w = distributed.world()
    keys = policies.trainable_adapters()
    placement = Placement(tc.placement, resolve_split(tc.work_split, tc.placement, tc.prompts_per_step, w.size))
    if tc.placement == "groups" and w.size > 1:
        start = 0
        for key, size in zip(keys, group_sizes(tc.placement_groups, len(keys), w.size)):
            placement.ranks[key] = list(range(start, start + size))
            placement.groups[key] = torch.distributed.new_group(placement.ranks[key])
            start += size
    if tc.placement == "devices":
        names = list(tc.placement_devices or []) or [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        models = sorted({k for k, _ in keys})
        placement.devices = {k: torch.device(names[i % len(names)]) for i, k in enumerate(models)}
    _CURRENT = placement
    return placement


def place_models(policies: Any, placement: Placement) -> str | None:
    """Move each policy model (and its KL reference) to its device (placement=devices), or drop
    the models this rank does not train (placement=groups: moved to the meta device, no memory).
    Returns a line saying where the policies are, or None."""
    if placement.devices:
        for k, device in placement.devices.items():
            policies.models[k].to(device)
            if policies.references:
                policies.references[policies._reference_of[k]].to(device)
        where = ", ".join(f"{policies.policy_label(key)} on {placement.devices[key[0]]}"
                          for key in policies.trainable_adapters())
        return f"placement=devices: {where}"
    if placement.ranks:
        for key, ranks in placement.ranks.items():
            if distributed.world().rank not in ranks:
                policies.models[key[0]].to("meta")
                if policies.references:
                    policies.references[policies._reference_of[key[0]]].to("meta")
        groups = "; ".join(f"{policies.policy_label(key)} on ranks {ranks[0]}-{ranks[-1]}"
                           for key, ranks in placement.ranks.items())
        return f"placement=groups: {groups}"
    return None


def meshes(policies: Any, placement: Placement) -> dict[int, Any] | None:
    """The device mesh each policy model is sharded over (placement=groups: its group's, None on the
    ranks outside it), for fsdp.shard_policies; None: every model over all ranks."""
    if not placement.ranks:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    out: dict[int, Any] = {}
    for key, ranks in placement.ranks.items():
        if distributed.world().rank in ranks:
            out[key[0]] = DeviceMesh.from_group(placement.groups[key], policies.device.type)
        else:
            out[key[0]] = None
    return out


def policy_count(agent_names: Sequence[str], algo_cfg: Any) -> int:
    """How many trained policies a config has (before any model loads): one per algo.policy_map
    name, one shared adapter, or one per agent."""
    policy_map = dict(algo_cfg.get("policy_map") or {})
    if policy_map:
        return len(set(policy_map.values()))
    return 1 if algo_cfg.get("adapters") == "shared" else len(agent_names)


class SplitRollout:
    """A rollout whose generate calls are shared by the ranks (trainer.work_split=joint_actions):
    every rank calls with the same requests; each request goes to the ranks that hold its agent's
    policy, split contiguously among them; every rank gets every completion back (one
    all-gather of the completions per call). A request draws the same tokens wherever it runs
    (GenRequest.key), so the tree equals one process's."""

    def __init__(self, inner: Any, policies: Any, placement: Placement):
        self.inner, self.policies, self.placement = inner, policies, placement

    def __getattr__(self, name: str) -> Any:  # release(), close(), ... of the backend
        if name == "inner":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def generate(self, requests: list[Any]) -> list[Any]:
        w = distributed.world()
        if w.size == 1:
            return self.inner.generate(requests)
        by_ranks: dict[tuple[int, ...], list[int]] = {}
        for j, r in enumerate(requests):
            agent = self.policies.agents[r.agent]
            by_ranks.setdefault(tuple(self.placement.ranks_of((agent.model_index, agent.adapter))), []).append(j)
        mine = [j for ranks, idx in by_ranks.items() if w.rank in ranks
                for j in distributed.shard(idx, distributed.World(ranks.index(w.rank), len(ranks)))]
        local = self.inner.generate([requests[j] for j in mine]) if mine else []
        out: list[Any] = [None] * len(requests)
        for part in distributed.gather_objects(list(zip(mine, local))):
            for j, completion in part:
                out[j] = completion
        return out

    def update_weights(self) -> None:
        self.inner.update_weights()
