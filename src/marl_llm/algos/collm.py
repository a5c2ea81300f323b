"""CoLLM-CC and CoLLM-DC (arXiv 2601.21972): multi-agent actor-critic for decentralized LLM teams.

Rollout: one trajectory per environment (G = 1 per node, sampled), many environments per step
(trainer.prompts_per_step); an episode ends at the horizon (algo.num_turns), at the task's success
(reward.done, e.g. StrBuild) or at algo.early_termination.

Critics (marl_llm.algos.critic.Critic): a LoRA adapter plus a scalar value head on the actors'
frozen base by default; `critic.placement=separate` trains a separate copy of the base (the
reference), `actor` (DC) puts the head on the agent's own actor adapter (shared trunk).

    collm_cc: ONE critic V(h_t) over the joint history: every agent's prompt tagged "[Agent i]"
              (critic.kind=q appends "[Joint Action]" and every agent's completion: Q(h_t, a_t)).
    collm_dc: one critic per agent, V_i(h_{i,t}) over the agent's own prompt ids (q: + its own
              completion ids).

Per trajectory of T turns with team rewards r_t and the values recorded at collection time:

    delta_t = r_t + gamma * V(h_{t+1}) - V(h_t)     (last turn: r_T - V(h_T)); target y_t = r_t + gamma * V(h_{t+1})
    (estimator=gae: GAE(lambda) advantages, targets A_t + V(h_t))

Advantages are normalized per (agent, turn) over the batch (a single sample is left as is).
Actor i: -A * sum_t log pi_i(a_t | h_t) over its completion tokens, no importance ratio
(clip_eps + ppo_epochs: PPO clipping). Critic: loss_coef * mean((y - V)^2), one optimizer step
per batch. Where that is exact (ActorCritic._fits_at_collection: the default critic adapter, the
unbuffered update), the collection-time values are read off the critic update's own
forward/backward pass, run at collection (Critic.fit_fresh), instead of a no-grad pass of their own.

With algo.rollout_buffer_size the granularity is comlrl's (marl_llm.algos.buffer): each agent's
turn samples wait in its buffer, trajectory by trajectory; a full buffer is drained turn by turn,
advantages normalized over the turn's samples (population std, at least 1e-6), one actor step and
one step of that agent's critic (CC: the shared critic, so once per agent) per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from marl_llm.algos.base import AgentBatch, Algorithm, register_algorithm
from marl_llm.algos.buffer import BufferedSample, SampleBuffer, step_stats
from marl_llm.algos.critic import Critic, ValueHead, has_dropout
from marl_llm.algos.loss_tokens import with_loss_tokens
from marl_llm.algos.returns import gae, normalize_per_group, td0
from marl_llm.algos.update import UpdateSettings, policy_update
from marl_llm.algos.schemas import ActorCriticConfig  # the schema (and its checks) lives with the light ones
from marl_llm.config import UserError
from marl_llm.distributed import fsdp, placement
from marl_llm.training.episodes import JointNode, JointTree, trajectories
from marl_llm.training.rollout_metrics import reward_metrics
from marl_llm.models.policies import created_in, full_model, lora_weights
from marl_llm.models.loading import load_base
from marl_llm.models.prompting import encode_prompt
from marl_llm.tasks.base import Problem


def joint_history(node: JointNode, with_actions: bool) -> str:
    """The centralized critic's text: every agent's prompt, tagged; optionally the joint action."""
    text = "\n\n".join(f"[Agent {i + 1}]\n{m}" for i, m in enumerate(node.messages))
    if with_actions:
        text += "\n\n[Joint Action]\n" + "\n\n".join(f"[Agent {i + 1}]\n{t}" for i, t in enumerate(node.texts))
    return text


@dataclass
class CriticBatch:
    """One critic's training samples of a step: inputs (ids), TD targets and collection-time values: Tensor[n]."""

    prompts: list[torch.Tensor]
    completions: list[torch.Tensor] | None
    targets: torch.Tensor
    old_values: torch.Tensor
    # The critic already ran its update's forward/backward at collection (Critic.fit_fresh): the
    # update only steps it.
    fitted: bool = False


class ActorCritic(Algorithm):
    supports_turn_tasks = True
    eval_as_training = True
    # True: one critic over the joint history (CC); False: one critic per agent (DC).
    centralized: ClassVar[bool] = True

    def __init__(self, cfg: Any, task, policies, rollout, micro_batch_size: int = 8):
        super().__init__(cfg, task, policies, rollout, micro_batch_size)
        # critic j's owner: None (the centralized critic) or the agent index
        self.owners: list[int | None] = [None] if self.centralized else list(range(task.num_agents))
        self.critics = [self._build_critic(owner) for owner in self.owners]
        self._critic_batches: list[CriticBatch] = []
        self.buffer = SampleBuffer.from_cfg(cfg, policies.seed)
        # The step's trajectories as (first sample, length) in the turn-major sample order of
        # advantages(): the buffered update feeds them trajectory by trajectory.
        self._chains: list[tuple[int, int]] = []

    def _build_critic(self, owner: int | None) -> Critic:
        c, p = self.cfg.critic, self.policies
        k = 0 if owner is None else p.agents[owner].model_index
        name = "critic" if owner is None else f"critic_{self.task.agent_names[owner]}"
        if p.full and c.placement != "separate":
            raise UserError(f"algo.critic.placement={c.placement} puts the critic on the actors' LoRA adapters, but "
                            "algo.lora=null fully fine-tunes the actors: use algo.critic.placement=separate")
        model, adapter = p.models[k], None
        if c.placement == "adapter":
            adapter, trunk = name, p.add_adapter(k, name)
        elif c.placement == "actor":
            adapter = p.agents[owner].adapter
            trunk = lora_weights(model, adapter)
        else:  # separate: a full copy of the base, every weight trained (the reference's critic)
            # fp32 master weights under bf16 autocast, as a fully fine-tuned actor (models.full_model):
            # trained in bf16, AdamW at the presets' lr 5e-6 would round every update away.
            # On its agents' device (trainer.placement=devices puts the policies on several).
            # Under FSDP with sharded loading, on the meta device: each rank reads its shards (distributed/sharded_loading.py).
            model, _ = load_base(p.base_specs[k], p.model_cfg, p.model_device(k),
                                 torch.float32 if p.autocast_dtype is not None else p.dtype, on_meta=p.on_meta)
            full_model(model, p.autocast_dtype, device_type=p.device.type)
            trunk = dict(model.named_parameters())
        torch.manual_seed(p.seed + 31 * (len(self.task.agent_names) + (owner or 0)))
        with created_in(p.dtype):
            head = ValueHead(model.config.hidden_size, c.hidden_layer).to(
                p.model_device(k), torch.promote_types(torch.float32, p.dtype))
        return Critic(name, model, adapter, trunk, head, p.tokenizers[k].pad_token_id, c.learning_rate,
                      c.weight_decay, c.loss_coef, c.value_clip, c.max_grad_norm, self.micro_batch_size)

    # ------------------------------------------------------------------------------ rollout
    def collect(self, problems: list[Problem]) -> JointTree:
        return self.rollout_tree(problems, [1] * self.cfg.num_turns, self.agent_sampling(), self.early_stop())

    def critic_inputs(self, nodes: list[JointNode], owner: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(prompt ids, completion ids or None) of each node as critic `owner` sees it."""
        q = self.cfg.critic.kind == "q"
        if owner is None:
            tok = self.policies.tokenizers[0]
            return [torch.tensor(encode_prompt(tok, joint_history(n, q))) for n in nodes], None
        comps = [n.completions[owner] for n in nodes]
        return [c.prompt_ids for c in comps], ([c.completion_ids for c in comps] if q else None)

    def rollout_metrics(self, tree: JointTree) -> dict[str, float]:
        out = reward_metrics(tree, self.task.reward_shift)
        out.pop("frac_reward_zero_std")  # every sibling group has one member
        chains = trajectories(tree)
        out["episode/mean_turns"] = sum(len(c) for c in chains) / len(chains)
        passed = [c[-1].reward.passed for c in chains]
        if all(v is not None for v in passed):
            out[self.task.success_metric] = sum(bool(v) for v in passed) / len(passed)
        return out

    # ---------------------------------------------------------------------------- advantages
    def advantages(self, tree: JointTree) -> list[AgentBatch]:
        """TD(0) (or GAE) advantages from the critics' values, which are still the collection-time
        values here: advantages() runs right after collect(), before any update."""
        a, shift = self.cfg, self.task.reward_shift
        chains = trajectories(tree)
        nodes = [n for chain in chains for n in chain]
        n_agents = self.task.num_agents
        agent_adv: list[torch.Tensor] = [torch.zeros(0)] * n_agents
        starts = [0]
        for chain in chains[:-1]:
            starts.append(starts[-1] + len(chain))
        spans = [list(range(s, s + len(c))) for s, c in zip(starts, chains)]  # each trajectory's rows
        chain_of = [c for c, rows in enumerate(spans) for _ in rows]
        rewards = [torch.tensor([n.reward.total + shift for n in chain], dtype=torch.float64) for chain in chains]
        self._critic_batches = []
        for critic, owner in zip(self.critics, self.owners):
            prompts, comps = self.critic_inputs(nodes, owner)
            values = torch.zeros(len(nodes), dtype=torch.float64)
            adv, targets = torch.zeros_like(values), torch.zeros_like(values)

            def estimate(rows: list[int], v: torch.Tensor) -> torch.Tensor:
                """Advantages and TD targets of the trajectories of `rows` (whole ones) from
                their values v: Tensor[len(rows)]; returns the rows' targets."""
                values[rows] = v.double()
                for c in dict.fromkeys(chain_of[r] for r in rows):
                    span = slice(spans[c][0], spans[c][-1] + 1)
                    if a.estimator == "gae":
                        adv[span], targets[span] = gae(rewards[c], values[span], a.discount, a.gae_lambda)
                    else:
                        adv[span], targets[span] = td0(rewards[c], values[span], a.discount)
                return targets[rows]

            fitted = self._fits_at_collection(critic, spans)
            if fitted:  # values off the update's own pass: no pass of their own
                critic.fit_fresh(prompts, comps, spans, estimate)
            else:
                estimate(list(range(len(nodes))), critic.values(prompts, comps))
            self._critic_batches.append(CriticBatch(prompts, comps, targets.to(critic.dtype), values.to(critic.dtype), fitted))
            for i in (range(n_agents) if owner is None else [owner]):
                agent_adv[i] = adv
        turns = [n.turn for n in nodes]
        self._chains = list(zip(starts, [len(c) for c in chains]))
        batches = []
        for i, adv in enumerate(agent_adv):
            # Buffered: normalized when drained, over the turn's samples in the buffer.
            if a.normalize_advantages and self.buffer is None:
                adv = normalize_per_group(adv, [(i, t) for t in turns])
            comps = [n.completions[i] for n in nodes]
            if a.loss_tokens != "completion":  # one trajectory per environment: each sample its own node
                pad = self.policies.tokenizers[self.policies.agents[i].model_index].pad_token_id
                comps = [c for one in comps for c in with_loss_tokens(a.loss_tokens, [one], pad)]
            # float32 (float64 in a float64 run: the critics' dtype)
            batches.append(AgentBatch(i, comps, adv.to(self.critics[0].dtype), list(turns)))
        return batches

    def _fits_at_collection(self, critic: Critic, spans: list[list[int]]) -> bool:
        """Whether `critic` can run its update's forward/backward now and read its collection-time
        values off that pass (saving a forward pass per sample, about a quarter of the critic's compute)
        with the same values, targets and gradient: only when nothing changes the critic before its
        one step of this trainer step (the unbuffered update and the critic's own adapter: a shared
        actor trunk moves with the actor steps in between, buffered updates step it on other
        samples first; a separate critic would hold a full model's gradient across the actor
        update), the pass is deterministic (no dropout), and every trajectory fits one micro-batch
        (its TD targets need all its values). Not on an FSDP-sharded model."""
        return (self.buffer is None and self.cfg.critic.placement == "adapter"
                and max((len(rows) for rows in spans), default=0) <= critic.micro_batch_size
                and not has_dropout(critic.model) and not fsdp.is_sharded(critic.model)
                and not placement.current().by_actions)  # there each rank fits a share only

    # -------------------------------------------------------------------------------- update
    def update(self, batches: list[AgentBatch], end_of_epoch: bool = False) -> dict[str, float]:
        if self.buffer is not None:
            return self._buffered_update(batches, end_of_epoch)
        a = self.cfg
        settings = UpdateSettings.from_config(a)
        stats: dict[str, float] = {}
        for key in self.policies.trainable_adapters():
            agents = self.policies.agents_of(key)
            comps = [c for i in agents for c in batches[i].completions]
            advs = torch.cat([batches[i].advantages for i in agents])
            s = policy_update(self.policies, agents[0], key, comps, advs, settings, self.micro_batch_size)
            if not s:  # a policy this rank does not hold (trainer.placement=groups)
                continue
            s.pop("optimizer_steps")
            stats.update({f"{self.policies.policy_label(key)}/{k}": v for k, v in s.items()})
        # Each critic steps once on the whole batch.
        critic_stats: dict[str, list[float]] = {}
        for critic, owner, cb in zip(self.critics, self.owners, self._critic_batches):
            s = critic.step_fitted() if cb.fitted else critic.update(cb.prompts, cb.completions, cb.targets,
                                                                      cb.old_values)
            s["advantages/mean"] = float((cb.targets - cb.old_values).mean())
            prefix = "critic" if owner is None else f"{self.task.agent_names[owner]}/critic"
            stats.update({f"{prefix}/{k}": v for k, v in s.items()})
            for k, v in s.items():
                critic_stats.setdefault(k, []).append(v)
        if not self.centralized:  # team-level critic metrics: the mean over the agents' critics
            stats.update({f"critic/{k}": sum(v) / len(v) for k, v in critic_stats.items()})
        self._critic_batches = []
        return stats

    def _buffered_update(self, batches: list[AgentBatch], end_of_epoch: bool) -> dict[str, float]:
        """comlrl's granularity: after each trajectory, every agent's turn samples join its
        buffer; full buffers are drained (marl_llm.algos.buffer). A sample carries its critic's
        input, TD target and collection-time value, so the critic steps on the same batch."""
        assert self.buffer is not None
        a, policies = self.cfg, self.policies
        settings = UpdateSettings.from_config(a)
        actor_parts: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(batches))}
        critic_parts: dict[int, list[dict[str, float]]] = {j: [] for j in range(len(self.critics))}
        n_agents = len(batches)

        def train(i: int, groups: list[list[BufferedSample]]) -> None:
            for turn in dict.fromkeys(g[0].turn for g in groups):
                same = [g for g in groups if g[0].turn == turn]
                adv = torch.cat([s.advantages for g in same for s in g]).double()
                if a.normalize_advantages and len(adv) > 1:  # comlrl: population std, at least 1e-6
                    adv = (adv - adv.mean()) / adv.std(unbiased=False).clamp_min(1e-6)
                start = 0
                for g in same:
                    key = (policies.agents[i].model_index, policies.agents[i].adapter)
                    part = policy_update(policies, i, key, [s.completions[0] for s in g],
                                         adv[start:start + len(g)].to(self.critics[0].dtype), settings, self.micro_batch_size)
                    actor_parts[i].append(part)
                    start += len(g)
                    j = 0 if self.centralized else i
                    x = [s.extra for s in g]
                    comps = None if x[0]["critic_completion"] is None else [e["critic_completion"] for e in x]
                    critic_parts[j].append(self.critics[j].update(
                        [e["critic_prompt"] for e in x], comps, torch.tensor([e["target"] for e in x]),
                        torch.tensor([e["old_value"] for e in x])))

        def sample(i: int, j: int) -> BufferedSample:
            """Agent i's sample j with what its critic (CC: the shared one) trains on."""
            cb = self._critic_batches[0 if self.centralized else i]
            extra = {"critic_prompt": cb.prompts[j],
                     "critic_completion": None if cb.completions is None else cb.completions[j],
                     "target": float(cb.targets[j]), "old_value": float(cb.old_values[j])}
            return BufferedSample(batches[i].turns[j], [batches[i].completions[j]], batches[i].advantages[j:j + 1], extra)

        # One position per trajectory: comlrl fills the buffers with a whole trajectory, then drains.
        positions = ([(i, sample(i, j)) for i in range(n_agents) for j in range(start, start + length)]
                     for start, length in self._chains)
        self.buffer.run(positions, train, end_of_epoch)
        self._critic_batches = []
        stats: dict[str, float] = {}
        by_policy: dict[tuple[int, str], list[dict[str, float]]] = {}
        for i, parts in actor_parts.items():
            by_policy.setdefault((policies.agents[i].model_index, policies.agents[i].adapter), []).extend(parts)
        for key, parts in by_policy.items():
            if placement.current().holds(key):  # placement=groups: a rank reports its own policy
                stats.update(step_stats(policies.policy_label(key), parts))
        for j, owner in enumerate(self.owners):
            stats.update(step_stats("critic" if owner is None else f"{self.task.agent_names[owner]}/critic",
                                    critic_parts[j]))
        return stats

    # ---------------------------------------------------------------------------- checkpoint
    def extra_models(self) -> list[Any]:
        """The separate critics' own models (critic.placement=separate)."""
        return [c.model for c in self.critics if c.adapter is None and all(c.model is not m for m in self.policies.models)]

    def parameters_replaced(self) -> None:
        for critic in self.critics:
            critic.rebind()

    def checkpoint_parts(self) -> dict[str, tuple[Any, Any]]:
        separate = {id(m) for m in self.extra_models()}
        return {f"critic/{c.name}": c.checkpoint_part() for c in self.critics if id(c.model) in separate}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"critics": {c.name: c.state_dict() for c in self.critics}}
        if self.buffer is not None:
            state["buffer"] = self.buffer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for c in self.critics:
            c.load_state_dict(state["critics"][c.name])
        if self.buffer is not None and "buffer" in state:
            self.buffer.load_state_dict(state["buffer"])


@register_algorithm("collm_cc", schema=ActorCriticConfig)
class CoLLMCC(ActorCritic):
    centralized = True


@register_algorithm("collm_dc", schema=ActorCriticConfig)
class CoLLMDC(ActorCritic):
    centralized = False
