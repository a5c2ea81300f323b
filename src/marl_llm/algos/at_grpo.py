"""AT-GRPO (Stronger-MAS / PettingLLMs, arXiv 2510.11062): agent- and turn-wise grouped GRPO.

GRPO compares samples of the *same* prompt. In a multi-agent, multi-turn episode every agent's
prompt differs by role and turn, so AT-GRPO samples K candidates per (environment, agent, turn)
from the same state (tree sampling), scores each with alpha * team + local, normalizes within that
group, and continues the episode from the best candidate (greedy continuation; option: random),
applied as the agent's transition so the next agent in the turn sees it.

- Turn-based tasks (Sokoban, Plan-Path): `marl_llm.tasks.turn_based.run_episodes`.
- Joint-reward tasks (writing, code, task=env): the agents sample K joint actions in parallel from
  the current node (team = the joint reward, local = the agent's own reward where the task gives
  one, as task=env's environments do, else 0), groups are (env, agent, turn), and only the best
  joint action (by team reward; with local rewards, by the agents' summed scores) is expanded in
  the next turn. Single-turn, this is per-agent GRPO groups.

Advantage in a group: A = (r - mean) / (std + eps) (unbiased std, as verl). Loss: PPO clipped
surrogate, token-mean, `ppo_epochs` passes in mini-batches (marl_llm.algos.update). Each sample
updates the policy its agent maps to (`adapters` / `policy_map`), and only that one.

Group filter (`filter_low_mean_frac`, PettingLLMs' filter_method=mean with filter_ratio): before
any advantage is computed, the groups of one step are ranked by the mean of their K scores and the
lowest int(n * frac) are dropped whole (stable sort: on a tie the group collected first goes first).
Groups compete within one trained model, as the reference filters each verl trainer's batch on
its own: LoRA adapters on one base are one model (its shared-LoRA and per-agent-LoRA modes run one
trainer), while with full fine-tuning (algo.lora=null) every policy is its own model. No group is
dropped for zero std unless `filter_zero_std` (then before the mean ranking; the reference's mean
filter keeps them, and their advantages are 0).

Fixed relative to the public code (each tested): group keys use a unique environment id (the
code's env_idx // K merged K environments into one group); stepping, scoring and prompting use
one state object; per-role adapters each get their own samples (the code trained the first
adapter for every agent); a move-cap timeout is not a success; tool programs run sandboxed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from marl_llm.algos.advantages import REST_LEVEL, GroupIndex, level_matrix, normalize_then_sum
from marl_llm.algos.base import AgentBatch, Algorithm, register_algorithm
from marl_llm.algos.update import UpdateSettings, policy_update
from marl_llm.algos.schemas import ATGRPOConfig  # the schema (and its checks) lives with the light ones
from marl_llm.distributed.data_parallel import all_sum
from marl_llm.training.episodes import JointNode, JointTree, collect_tree
from marl_llm.training.rollout_metrics import reward_metrics
from marl_llm.tasks.base import JointReward, Problem
from marl_llm.tasks.turn_based import CandidateGroup, TurnTask, env_key, run_episodes


@dataclass
class ATTree(JointTree):
    """The committed path (for metrics, samples and evaluation) plus every candidate group."""

    groups: list[CandidateGroup] = field(default_factory=list)


def group_advantages(scores: list[float], eps: float, unbiased: bool) -> list[float]:
    """(r - mean) / (std + eps) within one group."""
    r = torch.tensor(scores, dtype=torch.float64)
    std = r.std(unbiased=unbiased) if len(r) > 1 else torch.tensor(0.0, dtype=torch.float64)
    return ((r - r.mean()) / (std + eps)).tolist()


def filter_groups(groups: list[CandidateGroup], zero_std: bool, low_mean_frac: float,
                  pool: Callable[[CandidateGroup], Hashable] | None = None) -> list[CandidateGroup]:
    """Drop groups without signal (all scores equal, if `zero_std`), then in each pool (groups with
    the same `pool(group)`; None: one pool) the int(n * low_mean_frac) groups with the lowest mean
    score, ties in collection order. The kept groups keep their order."""
    kept = [g for g in groups if not (zero_std and max(g.scores) == min(g.scores))]
    if low_mean_frac > 0 and kept:
        pools: dict[Hashable, list[CandidateGroup]] = {}
        for g in kept:
            pools.setdefault(None if pool is None else pool(g), []).append(g)
        dropped: set[int] = set()
        for members in pools.values():
            by_mean = sorted(members, key=lambda g: sum(g.scores) / len(g.scores))  # stable: ties keep order
            dropped |= {id(g) for g in by_mean[:int(len(members) * low_mean_frac)]}
        kept = [g for g in kept if id(g) not in dropped]
    return kept


@register_algorithm("at_grpo", schema=ATGRPOConfig)
class ATGRPO(Algorithm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Candidate selection (select=random) and mini-batch shuffles: seeded, so runs repeat.
        self.rng = random.Random(self.policies.seed)

    @property
    def turns(self) -> int:
        return self.task.num_turns if isinstance(self.task, TurnTask) else int(self.cfg.num_turns)

    @property
    def eval_turns(self) -> int:
        return self.turns

    # --------------------------------------------------------------------------------- rollout
    def collect(self, problems: list[Problem]) -> ATTree:
        a = self.cfg
        sampling = self.agent_sampling()
        if isinstance(self.task, TurnTask):
            tree, groups = run_episodes(self.task, self.rollout.generate, problems, sampling, self.turns,
                                        a.num_branches, a.alpha, a.select, self.rng)
            return ATTree(tree.problems, tree.turns, groups)

        def agent_score(n: JointNode, i: int) -> float:
            """alpha * team + the agent's own reward, where the task gives one (task=env)."""
            return a.alpha * n.reward.total + (n.reward.local[i] if n.reward.local else 0.0)

        def score_levels(n: JointNode, i: int) -> dict[str, float]:
            """agent_score's components: alpha * each level of the team reward (and what the levels
            leave of it), the agent's own reward."""
            levels = {k: a.alpha * v for k, v in n.reward.levels.items()}
            rest = n.reward.total - sum(n.reward.levels.values())
            if abs(rest) > 1e-9:
                levels[REST_LEVEL] = a.alpha * rest
            if n.reward.local:
                levels["local"] = n.reward.local[i]
            return levels

        def continue_from(siblings: list[JointNode]) -> list[JointNode]:
            if a.select == "random":
                return [self.rng.choice(siblings)]
            if siblings[0].reward.local:  # the joint action whose agents' scores sum highest
                return [max(siblings, key=lambda n: sum(agent_score(n, i) for i in range(self.task.num_agents)))]
            return [max(siblings, key=lambda n: n.reward.total)]  # ties: the first

        tree = collect_tree(self.task, self.rollout.generate, problems, [a.num_branches] * self.turns, sampling,
                            expand=continue_from)
        groups = []
        for t, turn in enumerate(tree.turns):
            by_parent: dict[tuple[int, int], list[JointNode]] = {}
            for n in turn:
                by_parent.setdefault((n.problem, n.parent), []).append(n)
            for (b, _), siblings in by_parent.items():
                for i in range(self.task.num_agents):
                    scores = [agent_score(n, i) for n in siblings]
                    groups.append(CandidateGroup((env_key(b, tree.problems[b].uid), i, t),
                                                 [n.completions[i] for n in siblings], scores,
                                                 scores.index(max(scores)), [score_levels(n, i) for n in siblings]))
        return ATTree(tree.problems, tree.turns, groups)

    supports_turn_tasks = True

    def rollout_metrics(self, tree: ATTree) -> dict[str, float]:
        """The team reward under the names every algorithm logs it by (reward, reward_std,
        turn_<t>/reward, joint_actions, frac_reward_zero_std, rewards/<level>/...: reward_metrics),
        so a report sets AT-GRPO beside MAGRPO on one axis; what the advantages see, every
        candidate's score alpha * team + own, under names of its own: reward_mixed,
        reward_mixed_std, <agent>/reward_mixed, turn_<t>/reward_mixed and
        frac_reward_mixed_zero_std over the (env, agent, turn) groups; the committed path's success
        rate. Turn-based tasks: the team reward is each committed joint action's (the agents'
        summed team + own rewards, as MAGRPO and the evaluation score one); there are no sibling
        groups, and each (env, turn) stands for K joint actions' generations."""
        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        def std(xs: list[float]) -> float:
            m = mean(xs)
            return (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5 if xs else 0.0

        out = reward_metrics(tree, self.task.reward_shift)
        out.pop("reward_shifted")  # AT-GRPO's advantages see the mixed scores, never the shift
        if isinstance(self.task, TurnTask):  # the committed path: one joint action per parent
            out.pop("frac_reward_zero_std")
            out["joint_actions"] = sum(len(g.scores) for g in tree.groups) / self.task.num_agents
        scores = [x for g in tree.groups for x in g.scores]
        out.update({"reward_mixed": mean(scores), "reward_mixed_std": std(scores),
                    "frac_reward_mixed_zero_std": mean([float(max(g.scores) == min(g.scores)) for g in tree.groups])})
        for i, name in enumerate(self.task.agent_names):
            out[f"{name}/reward_mixed"] = mean([x for g in tree.groups if g.key[1] == i for x in g.scores])
        for t in sorted({g.key[2] for g in tree.groups}):
            out[f"turn_{t + 1}/reward_mixed"] = mean([x for g in tree.groups if g.key[2] == t for x in g.scores])
        final = [n for n in tree.nodes() if n.terminated]
        if final and all(n.reward.passed is not None for n in final):
            out[self.task.success_metric] = mean([float(bool(n.reward.passed)) for n in final])
        out["groups"] = float(len(tree.groups))
        out["groups_kept"] = float(len(self.kept_groups(tree)))
        return out

    # ------------------------------------------------------------------------------ advantages
    def filter_pool(self, group: CandidateGroup) -> Hashable:
        """The model whose groups `group` is ranked with in the low-mean filter: its agent's model
        index (with LoRA all adapters on one base share it; with full fine-tuning each policy is
        its own model)."""
        return self.policies.agents[group.key[1]].model_index

    def kept_groups(self, tree: ATTree) -> list[CandidateGroup]:
        a = self.cfg
        return filter_groups(tree.groups, a.filter_zero_std, a.filter_low_mean_frac, self.filter_pool)

    def advantages(self, tree: ATTree) -> list[AgentBatch]:
        a = self.cfg
        groups = self.kept_groups(tree)  # before any advantage: a dropped group's samples count nowhere
        batches = [AgentBatch(i) for i in range(self.task.num_agents)]
        advs: list[list[float]] = [[] for _ in batches]
        by_level = iter(self._level_advantages(groups)) if a.reward_levels == "normalize_then_sum" else None
        for g in groups:
            _, agent, turn = g.key
            batches[agent].completions.extend(g.completions)
            batches[agent].turns.extend([turn] * len(g.completions))
            if by_level is not None:
                advs[agent].extend(next(by_level) for _ in g.completions)
            else:
                advs[agent].extend(group_advantages(g.scores, a.eps, a.unbiased_std))
        for b, v in zip(batches, advs):
            b.advantages = torch.tensor(v, dtype=torch.float32)
        return batches

    def _level_advantages(self, groups: list[CandidateGroup]) -> list[float]:
        """algo.reward_levels=normalize_then_sum (GDPO): each component of the candidates' scores
        (the team reward's levels times alpha, the agent's own reward) normalized within its group,
        summed, normalized over the step's kept candidates; in the groups' order."""
        rewards = [JointReward(score, levels) for g in groups for score, levels in zip(g.scores, g.levels)]
        ids = torch.tensor([j for j, g in enumerate(groups) for _ in g.scores], dtype=torch.long)
        if not rewards:
            return []
        return normalize_then_sum(level_matrix(rewards), GroupIndex.from_ids(ids), eps=self.cfg.eps,
                                  unbiased_std=self.cfg.unbiased_std).tolist()

    # ---------------------------------------------------------------------------------- update
    def update(self, batches: list[AgentBatch], end_of_epoch: bool = False) -> dict[str, float]:
        a = self.cfg
        stats: dict[str, float] = {}
        for key in self.policies.trainable_adapters():
            agents = [i for i in self.policies.agents_of(key) if batches[i].completions]
            if not all_sum(len(agents)):
                continue  # every group of this policy was filtered out (on every rank): nothing to learn from
            agents = agents or self.policies.agents_of(key)[:1]  # this rank has none: it still joins the sync
            comps = [c for i in agents for c in batches[i].completions]
            advs = torch.cat([batches[i].advantages for i in agents])
            settings = UpdateSettings.from_config(a, mini_batch_size=a.mini_batch_size, seed=self.rng.randrange(2**31))
            s = policy_update(self.policies, agents[0], key, comps, advs, settings, self.micro_batch_size)
            label = self.policies.policy_label(key)
            stats.update({f"{label}/{k}": v for k, v in s.items()})
        return stats
