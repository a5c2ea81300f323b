"""MAGRPO (arXiv 2508.04652): Multi-Agent Group Relative Policy Optimization.

Agents act in parallel on their own prompts; one team reward scores each joint action; each
agent's advantage is group-relative over the G joint actions that share a parent history
(align) or over its G samples with the other agents marginalized out (cross). Multi-turn
rollouts are trees with G^T leaves; a node's return is r + discount * mean(children's returns).
The default preset is the paper's: summed token log-probs, one on-policy step, no KL, no clip.
"""

from __future__ import annotations

import torch

from marl_llm.algos.advantages import per_agent_advantages, tree_advantages
from marl_llm.algos.base import AgentBatch, Algorithm, register_algorithm
from marl_llm.algos.losses import k3_kl, policy_loss
from marl_llm.episodes import JointNode, JointTree
from marl_llm.rollout import Completion, completion_logprobs
from marl_llm.tasks.base import Problem


def micro_batches(completions: list[Completion], size: int) -> list[list[int]]:
    """Indices of completions grouped by identical prompt (siblings of one node), each group cut
    into chunks of at most `size`: a chunk's shared prompt is encoded once."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, c in enumerate(completions):
        groups.setdefault(tuple(c.prompt_ids.tolist()), []).append(j)
    return [idx[s:s + size] for idx in groups.values() for s in range(0, len(idx), size)]


@register_algorithm("magrpo")
class MAGRPO(Algorithm):
    def collect(self, problems: list[Problem]) -> JointTree:
        a = self.cfg
        terminate = None
        if a.early_termination is not None:
            threshold, shift = a.early_termination, self.task.cfg.reward_shift

            def terminate(node: JointNode) -> bool:
                return node.reward.total + shift >= threshold

        return self.rollout_tree(problems, [a.num_generations] * a.num_turns, self.agent_sampling(), terminate,
                                 a.joint_mode)

    # ------------------------------------------------------------------------------ advantages
    def advantages(self, tree: JointTree) -> list[AgentBatch]:
        a, n_agents = self.cfg, self.task.num_agents
        shift = self.task.cfg.reward_shift
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
        if a.joint_mode == "cross":
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
        return [AgentBatch(i, [c for c, _, _ in r], torch.tensor([v for _, v, _ in r], dtype=torch.float32),
                           [t for _, _, t in r], agent_kl[i]) for i, r in enumerate(rows)]

    @torch.no_grad()
    def _sequence_kl(self, agent: int, completions: list[Completion]) -> torch.Tensor:
        """Per-completion k3 KL of agent's policy to the reference (adapters disabled): Tensor[n]."""
        pad = self.policies.tokenizers[self.policies.agents[agent].model_index].pad_token_id
        kl = torch.zeros(len(completions), dtype=torch.float64)
        with self.policies.acting(agent) as model:
            for idx in micro_batches(completions, self.micro_batch_size):
                prompts = [completions[j].prompt_ids for j in idx]
                comps = [completions[j].completion_ids for j in idx]
                logp, mask, _ = completion_logprobs(model, prompts, comps, pad)
                with model.disable_adapter():
                    ref, _, _ = completion_logprobs(model, prompts, comps, pad)
                kl[idx] = k3_kl(logp, ref, mask).double().cpu()
        return kl

    # ---------------------------------------------------------------------------------- update
    def update(self, batches: list[AgentBatch]) -> dict[str, float]:
        stats: dict[str, float] = {}
        for key in self.policies.trainable_adapters():
            agents = self.policies.agents_of(key)
            comps = [c for i in agents for c in batches[i].completions]
            advs = torch.cat([batches[i].advantages for i in agents])
            label = "shared" if len(agents) > 1 else self.policies.agents[agents[0]].name
            s = self._update_adapter(agents[0], key, comps, advs)
            kls = [batches[i].kl for i in agents if batches[i].kl is not None]
            if kls:  # KL shaped the reward: report the mean per-sequence KL it used
                s["kl"] = float(torch.cat(kls).mean())
            stats.update({f"{label}/{k}": v for k, v in s.items()})
        return stats

    def _update_adapter(self, agent: int, key: tuple[int, str], comps: list[Completion],
                        advs: torch.Tensor) -> dict[str, float]:
        a = self.cfg
        policies = self.policies
        opt = policies.optimizers[key]
        params = [p for group in opt.param_groups for p in group["params"]]
        pad = policies.tokenizers[key[0]].pad_token_id
        chunks = micro_batches(comps, self.micro_batch_size)
        total_seqs = len(comps)
        total_tokens = sum(len(c.completion_ids) for c in comps)
        old_logps: dict[int, torch.Tensor] = {}
        ref_logps: dict[int, torch.Tensor] = {}
        acc: dict[str, float] = {}
        entropy_sum, grad_norm = 0.0, 0.0
        with policies.acting(agent) as model:
            device = next(model.parameters()).device
            for epoch in range(a.ppo_epochs):
                opt.zero_grad(set_to_none=True)
                for c, idx in enumerate(chunks):
                    prompts = [comps[j].prompt_ids for j in idx]
                    completions = [comps[j].completion_ids for j in idx]
                    logp, mask, ent = completion_logprobs(model, prompts, completions, pad, with_entropy=epoch == 0)
                    if epoch == 0:
                        entropy_sum += float((ent * mask).sum())
                        old_logps[c] = logp.detach()
                    ref = None
                    if a.kl_coef > 0 and a.kl_mode == "loss":
                        if c not in ref_logps:
                            with torch.no_grad(), model.disable_adapter():
                                ref_logps[c] = completion_logprobs(model, prompts, completions, pad)[0]
                        ref = ref_logps[c]
                    loss, s = policy_loss(
                        logp, old_logps[c] if a.ppo_epochs > 1 else None, advs[idx].to(device), mask,
                        aggregation=a.loss_aggregation, clip_eps=a.clip_eps, ref_logp=ref,
                        kl_coef=a.kl_coef if a.kl_mode == "loss" else 0.0)
                    # Weight each micro-batch so the sum over micro-batches is the full-batch loss.
                    n_tok = float(mask.sum())
                    weight = (n_tok / max(total_tokens, 1)) if a.loss_aggregation == "token_mean" else len(idx) / total_seqs
                    (loss * weight).backward()
                    if epoch == a.ppo_epochs - 1:
                        for k, v in s.items():
                            acc[k] = acc.get(k, 0.0) + v * weight
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm))
                opt.step()
        lengths = [len(c.completion_ids) for c in comps]
        out = {k: v for k, v in acc.items() if k in ("loss", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                                     "clip_ratio/region_mean")}
        out.update({
            "grad_norm": grad_norm,
            "entropy": entropy_sum / max(total_tokens, 1),
            "learning_rate": float(opt.param_groups[0]["lr"]),
            "num_tokens": float(total_tokens),
            "completions/mean_length": sum(lengths) / len(lengths),
            "completions/min_length": float(min(lengths)),
            "completions/max_length": float(max(lengths)),
            "completions/clipped_ratio": sum(c.truncated for c in comps) / len(comps),
            "advantage/mean": float(advs.mean()),
            "advantage/std": float(advs.std()) if len(advs) > 1 else 0.0,
        })
        return out
