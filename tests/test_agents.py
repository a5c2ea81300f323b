"""Agents are LoRA adapters on one frozen base; each optimizer updates only its own adapter."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import FLOAT64_REL, TEST_DEVICE, assert_close_to_scale, compose_config, make_policies
from marl_llm.algos.base import AgentBatch
from marl_llm.algos.magrpo import MAGRPO
from marl_llm.config import UserError
from marl_llm.rollout.base import GenRequest
from marl_llm.rollout.decode import HFRollout, completion_logprobs
from marl_llm.rollout.sampling import SamplingParams


def snapshot(policies):
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in policies.models]


def changed(before, policies):
    return {(k, n) for k, m in enumerate(policies.models) for n, p in m.named_parameters()
            if not torch.equal(before[k][n], p.detach())}


def make_batches(policies, advantages=(1.0, -1.0)):
    ro = HFRollout(policies)
    batches = []
    for i in range(len(policies.agents)):
        comps = ro.generate([GenRequest(i, f"prompt {j}", SamplingParams(temperature=1.0, max_new_tokens=5))
                             for j in range(len(advantages))])
        batches.append(AgentBatch(i, comps, torch.tensor(advantages), [0] * len(comps)))
    return batches


def magrpo(policies, *overrides):
    cfg = compose_config(["run_dir=/tmp/x", *overrides]).algo
    return MAGRPO(cfg, None, policies, HFRollout(policies), micro_batch_size=1)


def test_one_base_one_adapter_and_optimizer_per_agent(tiny_model_dir):
    policies = make_policies(tiny_model_dir)
    assert len(policies.models) == 1
    assert [a.adapter for a in policies.agents] == ["agent_aux", "agent_main"]
    assert len(policies.optimizers) == 2
    base_params = [p for n, p in policies.models[0].named_parameters() if "lora_" not in n]
    assert base_params and not any(p.requires_grad for p in base_params)


@pytest.mark.parametrize("agent", [0, 1])
def test_update_changes_only_that_agents_adapter(tiny_model_dir, agent):
    policies = make_policies(tiny_model_dir)
    batches = make_batches(policies)
    algo = magrpo(policies)
    key = policies.trainable_adapters()[agent]
    before = snapshot(policies)
    algo._update_adapter(agent, key, batches[agent].completions, batches[agent].advantages)
    diff = changed(before, policies)
    adapter = policies.agents[agent].adapter
    assert diff, "the agent's adapter did not change"
    assert all(f".{adapter}." in n and "lora_" in n for _, n in diff), sorted(diff)[:3]


def test_full_update_moves_every_adapter_and_never_the_base(tiny_model_dir):
    policies = make_policies(tiny_model_dir)
    batches = make_batches(policies)
    before = snapshot(policies)
    stats = magrpo(policies).update(batches)
    diff = changed(before, policies)
    assert {n.split(".")[-2] for _, n in diff} == {"agent_aux", "agent_main"}
    assert all("lora_" in n for _, n in diff)
    assert {"aux/loss", "main/loss", "aux/grad_norm", "main/entropy"} <= set(stats)


def test_shared_adapter_is_one_set_of_weights(tiny_model_dir):
    policies = make_policies(tiny_model_dir, adapters="shared")
    assert {a.adapter for a in policies.agents} == {"shared"} and len(policies.optimizers) == 1
    before = snapshot(policies)
    stats = magrpo(policies, "algo.adapters=shared").update(make_batches(policies))
    assert "shared/loss" in stats
    assert {n.split(".")[-2] for _, n in changed(before, policies)} == {"shared"}


def test_heterogeneous_agents_get_their_own_base(tiny_model_dir):
    policies = make_policies(tiny_model_dir, agent_bases=[str(tiny_model_dir), str(tiny_model_dir)])
    assert len(policies.models) == 2 and policies.models[0] is not policies.models[1]
    assert [a.model_index for a in policies.agents] == [0, 1]
    before = snapshot(policies)
    magrpo(policies).update(make_batches(policies))
    assert {k for k, _ in changed(before, policies)} == {0, 1}
    with pytest.raises(UserError, match="one base per agent"):
        make_policies(tiny_model_dir, agent_bases=[str(tiny_model_dir)] * 3)


@pytest.mark.numerics
def test_reference_policy_is_the_base_with_adapters_disabled(tiny_model_dir):
    """The policy with its adapters disabled vs the plain base model: log-probs, float64, to
    FLOAT64_REL of the largest element; the adapter changes them by far more."""
    from transformers import AutoModelForCausalLM

    from marl_llm.models.loading import norms_in_float64

    policies = make_policies(tiny_model_dir, dtype="float64")
    model = policies.models[0]
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).to(policies.device)
    norms_in_float64(plain)  # as loading does for a float64 model
    prompts, comps = [torch.tensor([1, 5, 6, 7])], [torch.tensor([8, 9, 2])]
    with torch.no_grad():
        model.set_adapter("agent_aux")
        with_adapter = completion_logprobs(model, prompts, comps, 2)[0]
        with model.disable_adapter():
            ref = completion_logprobs(model, prompts, comps, 2)[0]
        base = completion_logprobs(plain, prompts, comps, 2)[0]
    assert ref.dtype == base.dtype == torch.float64
    assert_close_to_scale(ref, base, FLOAT64_REL, "log-probs")
    assert not torch.allclose(with_adapter, base, atol=1e-4)


def test_adapter_state_round_trip(tiny_model_dir):
    a = make_policies(tiny_model_dir, seed=0)
    b = make_policies(tiny_model_dir, seed=1)
    b.load_adapter_state(a.adapter_state())
    sa, sb = a.adapter_state(), b.adapter_state()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k])


def test_missing_lora_targets_name_the_fix(tiny_model_dir):
    from marl_llm.models.policies import AgentPolicies

    model_cfg = OmegaConf.create(dict(name="t", path=str(tiny_model_dir), embedded=False, hub_id=None, dtype="auto",
                                      device=TEST_DEVICE, attn_implementation=None, trust_remote_code=False,
                                      agent_bases=None))
    algo_cfg = OmegaConf.create(dict(adapters="per_agent", learning_rate=1e-3, weight_decay=0.0,
                                     lora=dict(r=2, alpha=4, dropout=0.0, target_modules=["c_attn"])))
    with pytest.raises(UserError, match="target_modules"):
        AgentPolicies(("a", "b"), model_cfg, algo_cfg, 0)


def assert_same_float64_states(got, want) -> None:
    """Two adapter_state()s ({key: {name: tensor}}) of float64 policies: the same weights, each to
    FLOAT64_REL of its largest element."""
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].keys() == want[k].keys()
        for n in want[k]:
            assert want[k][n].dtype == torch.float64
            assert_close_to_scale(got[k][n], want[k][n], FLOAT64_REL, f"{k} {n}")


@pytest.mark.numerics
def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir):
    """A MAGRPO update with gradient checkpointing vs without: every adapter weight after the
    step, float64, to FLOAT64_REL of the weight's largest element; the step moves them by far
    more."""
    results = []
    for checkpointing in (False, True):
        policies = make_policies(tiny_model_dir, dtype="float64")
        if checkpointing:
            policies.enable_gradient_checkpointing()
        torch.manual_seed(0)
        batches = make_batches(policies)
        magrpo(policies).update(batches)
        results.append(policies.adapter_state())
    plain, ckpt = results
    initial = make_policies(tiny_model_dir, dtype="float64").adapter_state()
    assert_same_float64_states(ckpt, plain)
    assert any(float((plain[k][n] - initial[k][n]).abs().max()) > 1e-6 for k in plain for n in plain[k])
