"""MAGRPO (arXiv 2508.04652): Multi-Agent Group Relative Policy Optimization.

Agents act in parallel on their own prompts; one team reward scores each joint action; each
agent's advantage is group-relative over the G joint actions that share a parent history
(align) or over its G samples with the other agents marginalized out (cross). Multi-turn
rollouts are trees with G^T leaves; a node's return is r + discount * mean(children's returns).
The default preset is the paper's: summed token log-probs, no KL, no clip.

Update granularity: by default one optimizer step per policy per trainer step, over the whole
step's tree. With algo.rollout_buffer_size, comlrl's: each sibling group (a node) is one sample
of a per-policy buffer drained turn by turn (marl_llm.algos.buffer), so the number and make-up of
optimizer steps per prompt are the reference's.
"""

from __future__ import annotations

import torch

from marl_llm.algos.advantages import (GroupIndex, level_matrix, normalize_then_sum, per_agent_advantages,
                                      per_agent_returns, tree_advantages, tree_level_advantages)
from marl_llm.algos.base import AgentBatch, Algorithm, register_algorithm
from marl_llm.algos.buffer import BufferedSample, SampleBuffer, step_stats
from marl_llm.algos.loss_tokens import with_loss_tokens
from marl_llm.algos.losses import k3_kl
from marl_llm.algos.update import UpdateSettings, micro_batches, policy_update
from marl_llm.algos.schemas import MAGRPOConfig  # the schema (and its checks) lives with the light ones
from marl_llm.training.episodes import JointTree
from marl_llm.rollout.base import Completion
from marl_llm.distributed import fsdp, placement
from marl_llm.rollout.decode import completion_logprobs
from marl_llm.tasks.base import Problem


@register_algorithm("magrpo", schema=MAGRPOConfig)
class MAGRPO(Algorithm):
    # On a turn-based task (Sokoban, Plan-Path) every node forks the episode G times.
    supports_turn_tasks = True

    def __init__(self, cfg, task, policies, rollout, micro_batch_size: int = 8):
        super().__init__(cfg, task, policies, rollout, micro_batch_size)
        self.buffer = SampleBuffer.from_cfg(cfg, policies.seed)

    def collect(self, problems: list[Problem]) -> JointTree:
        a = self.cfg
        return self.rollout_tree(problems, [a.num_generations] * a.num_turns, self.agent_sampling(), self.early_stop(),
                                 a.joint_mode)

    # ------------------------------------------------------------------------------ advantages
    def advantages(self, tree: JointTree) -> list[AgentBatch]:
        a, n_agents = self.cfg, self.task.num_agents
        shift = self.task.reward_shift
        rewards = [torch.tensor([n.reward.total + shift for n in turn], dtype=torch.float64) for turn in tree.turns]
        # Per-agent rewards: the team reward, minus beta * KL(agent || reference) when the KL
        # shapes the reward (the reference implementation's variant).
        agent_rewards = [list(rewards) for _ in range(n_agents)]
        agent_kl: list[torch.Tensor | None] = [None] * n_agents
        if a.kl_coef > 0 and a.kl_mode == "reward":
            for i in range(n_agents):
                kls = agent_kl[i] = self._sequence_kl(i, [n.completions[i] for n in tree.nodes()])
                start = 0
                for t, turn in enumerate(tree.turns):
                    agent_rewards[i][t] = rewards[t] - a.kl_coef * kls[start:start + len(turn)]
                    start += len(turn)
        # Per agent: (completion, advantage, turn) of every sample.
        rows: list[list[tuple[Completion, float, int]]] = [[] for _ in range(n_agents)]
        if a.reward_levels == "normalize_then_sum":
            self._level_rows(tree, rows)
        elif a.joint_mode == "cross":
            G, nodes = a.num_generations, tree.turns[0]
            for b in range(len(tree.problems)):
                idx = [j for j, n in enumerate(nodes) if n.problem == b]  # G^N nodes in product order
                for i in range(n_agents):
                    joint = agent_rewards[i][0][idx].reshape([G] * n_agents)
                    adv = per_agent_advantages(joint, n_agents, "cross", a.baseline, a.normalize_advantages)[i]
                    for g in range(G):
                        node = next(nodes[j] for j in idx if nodes[j].choice[i] == g)
                        rows[i].append((node.completions[i], float(adv[g]), 0))
        else:
            parents = [torch.tensor([n.parent for n in turn], dtype=torch.long) for turn in tree.turns]
            for i in range(n_agents):
                advs = tree_advantages(agent_rewards[i], parents, a.discount, a.baseline, a.normalize_advantages)
                for t, turn in enumerate(tree.turns):
                    rows[i].extend((n.completions[i], adv, t) for n, adv in zip(turn, advs[t].tolist()))
        if a.loss_tokens != "completion":
            self._loss_tokens(tree, rows)
        groups = sibling_groups(tree) if self.buffer is not None else None  # the buffer's node samples
        return [AgentBatch(i, [c for c, _, _ in r], torch.tensor([v for _, v, _ in r], dtype=torch.float32),
                           [t for _, _, t in r], agent_kl[i], groups) for i, r in enumerate(rows)]

    def _level_rows(self, tree: JointTree, rows: list[list[tuple[Completion, float, int]]]) -> None:
        """algo.reward_levels=normalize_then_sum (GDPO): every sample's advantage from the reward's
        levels (algos/advantages.py), one level matrix [K, nodes] over the whole tree."""
        a, n_agents = self.cfg, self.task.num_agents
        levels = level_matrix([n.reward for n in tree.nodes()])
        if a.joint_mode == "cross":
            G, nodes = a.num_generations, tree.turns[0]
            for i in range(n_agents):
                samples, values = [], []  # agent i's G samples per problem, and their [K] level returns
                for b in range(len(tree.problems)):
                    idx = [j for j, n in enumerate(nodes) if n.problem == b]  # G^N nodes in product order
                    joint = levels[:, idx].reshape([len(levels)] + [G] * n_agents)  # [K] + [G]*N
                    values.append(per_agent_returns(joint, n_agents, "cross")[:, i])  # [K, G]
                    samples += [next(nodes[j] for j in idx if nodes[j].choice[i] == g).completions[i] for g in range(G)]
                adv = normalize_then_sum(torch.cat(values, dim=1), GroupIndex.dense(len(tree.problems), G), a.baseline)
                rows[i].extend((c, float(v), 0) for c, v in zip(samples, adv))
            return
        parents = [torch.tensor([n.parent for n in turn], dtype=torch.long) for turn in tree.turns]
        advs = tree_level_advantages(list(levels.split([len(t) for t in tree.turns], dim=1)), parents, a.discount,
                                     a.baseline)
        for i in range(n_agents):
            for t, turn in enumerate(tree.turns):
                rows[i].extend((n.completions[i], adv, t) for n, adv in zip(turn, advs[t].tolist()))

    def _loss_tokens(self, tree: JointTree, rows: list[list[tuple[Completion, float, int]]]) -> None:
        """algo.loss_tokens (padded_row: comlrl's) for every sample, node by node: the samples its
        agent drew together (align: the sibling group; cross: the agent's G samples of the problem)."""
        G = self.cfg.num_generations
        groups = ([list(range(s, s + G)) for s in range(0, len(rows[0]), G)] if self.cfg.joint_mode == "cross"
                  else sibling_groups(tree))
        for i, r in enumerate(rows):
            pad = self.policies.tokenizers[self.policies.agents[i].model_index].pad_token_id
            for g in groups:
                for j, c in zip(g, with_loss_tokens(self.cfg.loss_tokens, [r[j][0] for j in g], pad)):
                    r[j] = (c, r[j][1], r[j][2])

    @torch.no_grad()
    def _sequence_kl(self, agent: int, completions: list[Completion]) -> torch.Tensor:
        """Per-completion k3 KL of agent's policy to the reference (adapters disabled, or the
        frozen base copy with algo.lora=null): Tensor[n]."""
        pad = self.policies.tokenizers[self.policies.agents[agent].model_index].pad_token_id
        kl = torch.zeros(len(completions), dtype=torch.float64)
        chunks = micro_batches(completions, self.micro_batch_size)
        inputs = [([completions[j].prompt_ids for j in idx], [completions[j].completion_ids for j in idx]) for idx in chunks]
        # The policy's passes, then the reference's: each one phase of an FSDP-sharded model (fsdp.passes).
        with self.policies.acting(agent) as model, fsdp.passes(model, len(chunks), grad=False):
            scored = [completion_logprobs(model, prompts, comps, pad)[:2] for prompts, comps in inputs]
        with self.policies.reference(self.policies.agents[agent].model_index) as ref_model, \
                fsdp.passes(ref_model, len(chunks), grad=False):
            for idx, (prompts, comps), (logp, mask) in zip(chunks, inputs, scored):
                ref, _, _ = completion_logprobs(ref_model, prompts, comps, pad)
                kl[idx] = k3_kl(logp, ref, mask).double().cpu()
        return kl

    # ---------------------------------------------------------------------------------- update
    def update(self, batches: list[AgentBatch], end_of_epoch: bool = False) -> dict[str, float]:
        if self.buffer is not None:
            return self._buffered_update(batches, end_of_epoch)
        stats: dict[str, float] = {}
        for key in self.policies.trainable_adapters():
            agents = self.policies.agents_of(key)
            comps = [c for i in agents for c in batches[i].completions]
            advs = torch.cat([batches[i].advantages for i in agents])
            label = self.policies.policy_label(key)
            s = self._update_adapter(agents[0], key, comps, advs)
            if not s:  # a policy this rank does not hold (trainer.placement=groups)
                continue
            s.pop("optimizer_steps")
            kls = [batches[i].kl for i in agents if batches[i].kl is not None]
            if kls:  # KL shaped the reward: report the mean per-sequence KL it used
                s["kl"] = float(torch.cat(kls).mean())
            stats.update({f"{label}/{k}": v for k, v in s.items()})
        return stats

    def _update_adapter(self, agent: int, key: tuple[int, str], comps: list[Completion],
                        advs: torch.Tensor) -> dict[str, float]:
        a = self.cfg
        settings = UpdateSettings.from_config(a, kl_coef=a.kl_coef if a.kl_mode == "loss" else 0.0)
        return policy_update(self.policies, agent, key, comps, advs, settings, self.micro_batch_size)

    def _buffered_update(self, batches: list[AgentBatch], end_of_epoch: bool) -> dict[str, float]:
        """comlrl's granularity (marl_llm.algos.buffer): every node goes into its agent's policy
        buffer in rollout order; a full buffer is drained turn by turn, one optimizer step per
        batch of train_batch_size nodes. Logs `<policy>/optimizer_steps` (0 when nothing drained)."""
        assert self.buffer is not None
        policies = self.policies
        key_of = [(ag.model_index, ag.adapter) for ag in policies.agents]
        parts: dict[tuple[int, str], list[dict[str, float]]] = {key: [] for key in policies.trainable_adapters()}

        def train(key: tuple[int, str], node_batches: list[list[BufferedSample]]) -> None:
            for nodes in node_batches:
                comps = [c for n in nodes for c in n.completions]
                advs = torch.cat([n.advantages for n in nodes])
                parts[key].append(self._update_adapter(policies.agents_of(key)[0], key, comps, advs))

        def node(b: AgentBatch, idx: list[int]) -> BufferedSample:
            return BufferedSample(b.turns[idx[0]], [b.completions[j] for j in idx], b.advantages[idx])

        positions = ([(key_of[i], node(b, b.groups[g])) for i, b in enumerate(batches)]
                     for g in range(len(batches[0].groups or [])))
        self.buffer.run(positions, train, end_of_epoch)
        stats: dict[str, float] = {}
        for key, p in parts.items():
            if placement.current().holds(key):  # placement=groups: a rank reports its own policy
                stats.update(step_stats(policies.policy_label(key), p))
        return stats

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.state_dict()} if self.buffer is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.buffer is not None and "buffer" in state:
            self.buffer.load_state_dict(state["buffer"])


def sibling_groups(tree: JointTree) -> list[list[int]]:
    """The tree's sibling groups (the joint actions sampled under one parent: comlrl's nodes) as
    indices into the turn-major sample order, in comlrl's rollout order: a problem's root group,
    then each of its joint actions' child groups, depth first."""
    offsets, start = [], 0
    for turn in tree.turns:
        offsets.append(start)
        start += len(turn)
    children: dict[tuple[int, int], list[int]] = {}  # (turn, parent) -> flat indices
    for t, turn in enumerate(tree.turns):
        for j, n in enumerate(turn):
            children.setdefault((t, n.parent), []).append(offsets[t] + j)
    out: list[list[int]] = []

    def visit(t: int, parent: int) -> None:
        group = children.get((t, parent))
        if group:
            out.append(group)
            for flat in group:
                visit(t + 1, flat - offsets[t])

    for b in range(len(tree.problems)):
        visit(0, b)
    return out
