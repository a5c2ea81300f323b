"""MAGRPO's tree shape (early termination) and update granularity (comlrl's buffer) against comlrl
1.4.3's own MAGRPOTrainer, executed here on the same tiny model.

Both systems roll out trees whose team reward is a fixed function of the joint action's position in
the tree (its path: problem, then the index of each joint action along the way), so the rewards, and
with them every early-termination decision, agree whatever the tiny model writes. Prompts carry the
path. Compared: which nodes exist (early termination), and the sequence of optimizer steps per
agent with the nodes (and turn) each one trained on.

The loss-token tests compare numbers: comlrl's own loss (its per-token log_softmax of full logits)
and marl-llm's (its chunked scoring) on the same node, both on the tiny model loaded in float64
(comlrl's models too: `float64_model`), so no CPU's summation order shows. The two compute the same
log-probs and gradients with the sums grouped differently: they agree to FLOAT64_REL (1e-12,
conftest.py) of the largest element, while the other choice of tokens differs by far more.
"""

from __future__ import annotations

import copy
import hashlib
from collections import Counter

import pytest
import torch

from conftest import FLOAT64_REL, assert_close_to_scale, compose_config, make_policies

comlrl_magrpo = pytest.importorskip("comlrl.trainers.reinforce.magrpo")

G, TURNS, PROBLEMS = 2, 3, 3


def path_reward(path: str) -> float:
    """A fixed reward in [-3, 0] for the joint action at `path` ("p<k>.<j>.<j>...")."""
    return -3.0 * int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) / 2**32


class PathTask:
    """A two-agent joint-reward task whose prompt is the node's path and whose reward is path_reward."""

    agent_names = ("aux", "main")
    num_agents = 2
    name = "path"
    max_turns = None
    reward_shift = 0.0

    def __init__(self):
        from omegaconf import OmegaConf

        self.cfg = OmegaConf.create({"reward_shift": 0.0})

    def initial_prompts(self, problem):
        return [problem.uid] * 2

    def history_rewards(self, problems, histories):
        from marl_llm.tasks.base import JointReward

        seen: Counter = Counter()
        out = []
        for hist in histories:  # a turn's joint actions, parent by parent, sample g in order
            parent = hist[0][-1].prompt
            path = f"{parent}.{seen[parent]}"
            seen[parent] += 1
            out.append(JointReward(path_reward(path), info={"path": path}))
        return out

    def next_prompts(self, problem, histories, reward):
        return [reward.info["path"]] * 2


def run_comlrl(model_dir, threshold: float, buffer: int, batch: int):
    """comlrl's real train() for one epoch over PROBLEMS items; returns (node paths, steps)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    agents = [AutoModelForCausalLM.from_pretrained(model_dir) for _ in range(2)]
    args = comlrl_magrpo.MAGRPOConfig(
        num_train_epochs=1, num_agents=2, num_generations=G, num_turns=TURNS, max_new_tokens=4, temperature=1.0,
        top_p=1.0, top_k=0, early_termination_threshold=threshold, rollout_buffer_size=buffer,
        train_batch_size=batch, eval_interval=0, agent_learning_rate=1e-4)
    calls: Counter = Counter()
    transitions: Counter = Counter()
    nodes: set[str] = set()

    def reward(c1, c2, *, prompts):
        path = f"{prompts[0]}.{calls[prompts[0]]}"
        calls[prompts[0]] += 1
        nodes.add(prompts[0])
        return [path_reward(path)]

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent, **_):
        parent = prompt_history_per_agent[0][-1]
        child = f"{parent}.{transitions[parent]}"
        transitions[parent] += 1
        return [child] * num_agents

    trainer = comlrl_magrpo.MAGRPOTrainer(
        agents=agents, num_agents=2, tokenizer=tok, args=args, reward_func=reward, external_transition=transition,
        train_dataset=Dataset.from_list([{"prompt": f"p{k}"} for k in range(PROBLEMS)]),
        formatters=[lambda item, external_prompts=None: external_prompts or item["prompt"]] * 2)
    steps: list[tuple[int, int, frozenset]] = []
    trained: list[str] = []
    original_loss = trainer._compute_loss_with_gradients

    def loss(agent, data, returns):
        trained.append(tok.decode(data["prompt_input_ids"][0], skip_special_tokens=True))
        return original_loss(agent, data, returns)

    trainer._compute_loss_with_gradients = loss
    for i, opt in enumerate(trainer.optimizers):
        original_step = opt.step

        def step(*a, _i=i, _orig=original_step, **k):
            steps.append((_i, trained[0].count("."), frozenset(trained)))
            trained.clear()
            return _orig(*a, **k)

        opt.step = step
    trainer.train()
    return nodes, steps


def run_marl(tiny_model_dir, threshold: float, buffer: int, batch: int, rule: str = "node_mean"):
    from marl_llm.algos import build_algorithm
    from marl_llm.models.prompting import PromptFormat
    from marl_llm.rollout.decode import HFRollout
    from marl_llm.tasks.base import Problem

    cfg = compose_config(["algo=magrpo", f"algo.num_generations={G}", f"algo.num_turns={TURNS}",
                          "algo.sampling.max_new_tokens=4", "algo.sampling.temperature=1.0", "algo.sampling.top_p=1.0",
                          f"algo.early_termination={threshold}", f"algo.early_termination_rule={rule}",
                          f"algo.rollout_buffer_size={buffer}", f"algo.train_batch_size={batch}",
                          "algo.normalize_advantages=true", "algo.max_grad_norm=null"])
    policies = make_policies(tiny_model_dir)
    policies.tokenizers[0].prompt_format = PromptFormat(False)  # raw prompts: the ids decode to the path
    algo = build_algorithm(cfg.algo, PathTask(), policies, HFRollout(policies), 8)
    tok = policies.tokenizers[0]
    steps: list[tuple[int, int, frozenset]] = []
    original = algo._update_adapter

    def update(agent, key, comps, advs):
        paths = {tok.decode(c.prompt_ids, skip_special_tokens=True).strip() for c in comps}
        steps.append((agent, next(iter(paths)).count("."), frozenset(paths)))
        return original(agent, key, comps, advs)

    algo._update_adapter = update
    nodes: set[str] = set()
    per_prompt_steps = []
    for k in range(PROBLEMS):
        tree = algo.collect([Problem(f"p{k}", {}, sample_key=k)])
        for n in tree.nodes():
            nodes.add(n.messages[0])
        before = len(steps)
        stats = algo.update(algo.advantages(tree), end_of_epoch=k == PROBLEMS - 1)
        assert stats["aux/optimizer_steps"] + stats["main/optimizer_steps"] == len(steps) - before
        per_prompt_steps.append(len(steps) - before)
    return nodes, steps, algo


@pytest.mark.parametrize("threshold,buffer", [(-1.5, 3), (-1.0, 2), (-2.2, 1), (-0.1, 4)])
def test_early_termination_and_buffer_match_comlrl(tiny_model_dir, threshold, buffer):
    ref_nodes, ref_steps = run_comlrl(tiny_model_dir, threshold, buffer, buffer)
    nodes, steps, _ = run_marl(tiny_model_dir, threshold, buffer, buffer)
    # Which sibling groups were expanded: the same trees.
    assert nodes == ref_nodes
    # The same optimizer steps in the same order: agent, turn, and the nodes each one trained on.
    assert steps == ref_steps
    assert len(steps) > PROBLEMS  # more than one step per prompt: the granularity is not marl-llm's default


def test_joint_action_rule_differs_from_comlrl(tiny_model_dir):
    """marl-llm's own rule (each joint action at or above the threshold is a leaf) grows other trees."""
    ref_nodes, _ = run_comlrl(tiny_model_dir, -1.5, 3, 3)
    nodes, _, _ = run_marl(tiny_model_dir, -1.5, 3, 3, rule="joint_action")
    assert nodes != ref_nodes


def test_buffer_state_round_trips(tiny_model_dir):
    """A checkpoint holds the buffered nodes: a restored buffer drains to the same batches."""
    from marl_llm.algos.buffer import SampleBuffer

    _, _, algo = run_marl(tiny_model_dir, -1.5, 4, 4)
    buf = algo.buffer
    assert buf.drains > 0
    # Refill it with a fresh tree without draining, then compare drains of the copy and the original.
    from marl_llm.tasks.base import Problem

    tree = algo.collect([Problem("p9", {}, sample_key=9)])
    batches = algo.advantages(tree)
    for g in batches[0].groups:
        from marl_llm.algos.buffer import BufferedSample

        buf.push("k", BufferedSample(batches[0].turns[g[0]], [batches[0].completions[j] for j in g],
                                     batches[0].advantages[g]))
    restored = SampleBuffer(buf.size, buf.batch_size, buf.seed)
    restored.load_state_dict(copy.deepcopy(buf.state_dict()))
    a, b = buf.drain("k"), restored.drain("k")
    assert [[(s.turn, s.completions[0].text, s.advantages.tolist()) for s in batch] for batch in a] == \
           [[(s.turn, s.completions[0].text, s.advantages.tolist()) for s in batch] for batch in b]


def test_buffer_batches_turn_groups():
    """A drain trains turn by turn, each turn's samples cut into train_batch_size batches."""
    from marl_llm.algos.buffer import BufferedSample, SampleBuffer

    buf = SampleBuffer(size=5, batch_size=2, seed=0)
    turns = [0, 1, 1, 0, 1]
    full = [buf.push("k", BufferedSample(t, [], torch.tensor([float(j)]))) for j, t in enumerate(turns)]
    assert full == [False] * 4 + [True]
    batches = buf.drain("k")
    assert [len(b) for b in batches] == [2, 2, 1]
    assert [{s.turn for s in b} for b in batches] == [{0}, {1}, {1}]
    assert sorted(float(s.advantages) for b in batches[1:] for s in b) == [1.0, 2.0, 4.0]
    assert buf.pending() == []


# ------------------------------------------------------------------------- the loss's tokens
class EndAt:
    """A logits processor that ends row r of a generate() call with EOS at its step ends[r] (None:
    never, the row runs to max_new_tokens), so a node's samples end at different lengths."""

    def __init__(self, ends, eos: int, prompt_len: int):
        self.ends, self.eos, self.prompt_len = ends, eos, prompt_len

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        for r, end in enumerate(self.ends):
            scores[r, self.eos] = float("-inf")
            if end is not None and step == end:
                scores[r] = float("-inf")
                scores[r, self.eos] = 0.0
        return scores


def float64_model(model_dir):
    """The tiny model as comlrl's trainers get it, in float64 (RMSNorms too, as marl-llm's
    model.dtype=float64 loads it)."""
    from transformers import AutoModelForCausalLM

    from marl_llm.models.loading import norms_in_float64

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    assert norms_in_float64(model) > 0
    return model


def full_policies(model_dir):
    """One fully fine-tuned policy (algo.lora=null) on the tiny model: the weights comlrl loads, in
    float64 (float64_model)."""
    from omegaconf import OmegaConf

    from marl_llm.models.policies import AgentPolicies

    model_cfg = OmegaConf.create(dict(name="tiny", path=str(model_dir), embedded=False, hub_id=None, dtype="float64",
                                      device="cpu", attn_implementation="sdpa", trust_remote_code=False,
                                      agent_bases=None))
    algo_cfg = OmegaConf.create(dict(adapters="per_agent", learning_rate=1e-4, weight_decay=0.0, policy_map={},
                                     lora=None))
    return AgentPolicies(("aux",), model_cfg, algo_cfg, 0)


def comlrl_node(model_dir, ends, max_new: int = 6):
    """comlrl's own trainer (on float64_model): one node of G samples generated by its
    _generate_completions, and the per-sample log-prob its loss sums (raw advantages, no
    normalization: a one-hot return turns its loss into -logp_g / G)."""
    from transformers import AutoTokenizer, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    args = comlrl_magrpo.MAGRPOConfig(num_train_epochs=1, num_agents=1, num_generations=len(ends), num_turns=1,
                                      max_new_tokens=max_new, temperature=1.0, top_p=1.0, top_k=0,
                                      advantage_normalization=False, advantage_mode="raw", eval_interval=0)
    trainer = comlrl_magrpo.MAGRPOTrainer(agents=[float64_model(model_dir)], num_agents=1,
                                          tokenizer=tok, args=args, reward_func=lambda c: [0.0] * len(c),
                                          formatters=[lambda item, external_prompts=None: item["prompt"]])
    prompt = "Write a helper function."
    prompt_len = len(tok(prompt).input_ids)
    data = trainer._generate_completions(trainer.agents[0], [{"prompt": prompt}], num_return_sequences=len(ends),
                                         max_new_tokens=max_new,
                                         logits_processor=LogitsProcessorList([EndAt(ends, tok.eos_token_id, prompt_len)]))
    G = len(ends)
    with torch.no_grad():
        logps = [-G * float(trainer._compute_loss_with_gradients(trainer.agents[0], data,
                                                                 [float(k == g) for k in range(G)])) for g in range(G)]
    return trainer, tok, data, logps


def marl_completions(tok, data):
    from marl_llm.rollout.base import Completion
    from marl_llm.rollout.decode import cut_at_eos

    prompt = data["prompt_input_ids"][0].cpu()
    out = []
    for row in data["completion_input_ids"][0]:
        ids, truncated = cut_at_eos(row.cpu(), [tok.eos_token_id])
        out.append(Completion(prompt, ids, tok.decode(ids, skip_special_tokens=True), truncated))
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("ends", [(1, 3, None, 0), (2, 4, 1, 3), (None, None, 2, 5)])
def test_padded_row_loss_tokens_are_comlrls(tiny_model_dir, ends):
    """algo.loss_tokens=padded_row scores what comlrl's MAGRPO loss scores: each sample's generate()
    row (padding after EOS included) without its last token; its summed log-probs equal comlrl's
    (both in float64, to FLOAT64_REL of the largest), and they differ from marl-llm's own tokens
    (the completion through its EOS)."""
    from marl_llm.algos.loss_tokens import padded_rows
    from marl_llm.rollout.decode import completion_logprobs

    _, tok, data, ref_logps = comlrl_node(tiny_model_dir, ends)
    comps = marl_completions(tok, data)
    rows = padded_rows(comps, tok.pad_token_id)
    for c, row in zip(rows, data["completion_input_ids"][0]):
        assert torch.equal(c.loss_ids, row.cpu()[:-1])
    assert any(len(c.completion_ids) != len(c.loss_ids) for c in rows)
    policies = full_policies(tiny_model_dir)
    with torch.no_grad(), policies.acting(0) as model:
        def sums(ids):
            logp, mask, _ = completion_logprobs(model, [c.prompt_ids for c in comps], ids, tok.pad_token_id)
            return (logp * mask).sum(dim=1).tolist()

        padded, own = sums([c.scored_ids for c in rows]), sums([c.completion_ids for c in comps])
    assert_close_to_scale(torch.tensor(padded), torch.tensor(ref_logps), FLOAT64_REL, "summed log-probs")
    assert max(abs(a - b) for a, b in zip(own, ref_logps)) > 0.1


@pytest.mark.numerics
def test_padded_row_gradient_is_comlrls(tiny_model_dir):
    """The update's gradient with padded_row equals comlrl's _compute_loss_with_gradients' on the
    same node and advantages, parameter by parameter, both in float64 (to FLOAT64_REL of each
    parameter's largest gradient element; the norm to FLOAT64_REL), and differs with marl-llm's
    own tokens."""
    from marl_llm.algos.loss_tokens import padded_rows
    from marl_llm.algos.update import UpdateSettings, policy_update

    trainer, tok, data, _ = comlrl_node(tiny_model_dir, (1, 4, None, 2))
    advs = [0.9, -1.3, 0.25, 0.15]
    ref_model = trainer.agents[0]
    ref_model.zero_grad()
    ref_loss = trainer._compute_loss_with_gradients(ref_model, data, advs)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    comps = marl_completions(tok, data)
    settings = UpdateSettings(max_grad_norm=None, rollout_is_cap=None)

    def marl_update(samples):
        policies = full_policies(tiny_model_dir)
        key = policies.trainable_adapters()[0]
        names = {id(p): n for n, p in policies.models[0].named_parameters()}
        grads = {}  # as the optimizer step saw them (the update frees them right after)
        policies.optimizers[key].register_step_pre_hook(lambda opt, *_: grads.update(
            {names[id(p)]: p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None}))
        stats = policy_update(policies, 0, key, samples, torch.tensor(advs), settings, 8)
        return stats, grads

    stats, grads = marl_update(padded_rows(comps, tok.pad_token_id))
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert g.dtype == ref_grads[name].dtype == torch.float64, name
        assert_close_to_scale(g, ref_grads[name], FLOAT64_REL, name)
    assert stats["grad_norm"] == pytest.approx(float(torch.cat([g.flatten() for g in ref_grads.values()]).norm()),
                                               rel=FLOAT64_REL)
    _, own = marl_update(comps)
    assert max(float((own[n] - ref_grads[n]).abs().max()) for n in own) > 1e-3


def test_magrpo_switch_pads_each_sibling_group(tiny_model_dir):
    """algo.loss_tokens=padded_row through MAGRPO.advantages: every sample's loss tokens are its
    completion padded to the longest of its sibling group, minus the last token."""
    from marl_llm.algos import build_algorithm
    from marl_llm.algos.magrpo import sibling_groups
    from marl_llm.models.prompting import PromptFormat
    from marl_llm.rollout.decode import HFRollout
    from marl_llm.tasks.base import Problem

    cfg = compose_config(["algo=magrpo", f"algo.num_generations={G}", "algo.num_turns=2",
                          "algo.sampling.max_new_tokens=6", "algo.loss_tokens=padded_row"])
    policies = make_policies(tiny_model_dir)
    policies.tokenizers[0].prompt_format = PromptFormat(False)
    algo = build_algorithm(cfg.algo, PathTask(), policies, HFRollout(policies), 8)
    tree = algo.collect([Problem("p0", {}, sample_key=0)])
    pad = policies.tokenizers[0].pad_token_id
    for batch in algo.advantages(tree):
        for group in sibling_groups(tree):
            width = max(len(batch.completions[j].completion_ids) for j in group)
            for j in group:
                c = batch.completions[j]
                assert len(c.loss_ids) == width - 1
                assert torch.equal(c.loss_ids[:len(c.completion_ids)], c.completion_ids[:width - 1])
                assert (c.loss_ids[len(c.completion_ids):] == pad).all()
    assert compose_config(["algo=magrpo"]).algo.loss_tokens == "completion"
