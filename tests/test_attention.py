"""attention.py: `auto` resolution, and `sdpa_gqa` (grouped-query SDPA without repeating K/V)
giving transformers' `sdpa` outputs and gradients with left padding: in a prefill, in the decode
loop (KV cache) and in scoring. The tiny model is GQA: 2 query heads share 1 key/value head."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import assert_close_to_scale, compose_config, make_policies
from marl_llm.models import attention
from marl_llm.config import UserError
from marl_llm.rollout.decode import completion_logprobs, decode, left_pad
from marl_llm.rollout.sampling import SamplingParams


def test_auto_resolution_is_a_pure_function_of_device_and_package():
    assert attention.choose("auto", "cuda", flash_installed=True) == "flash_attention_2"
    assert attention.choose("auto", "cuda", flash_installed=False) == "sdpa_gqa"
    assert attention.choose("auto", "cpu", flash_installed=True) == "sdpa_gqa"
    assert attention.choose("auto", "mps", flash_installed=False) == "sdpa"
    assert attention.choose("flash_attention_2", "cuda", flash_installed=True) == "flash_attention_2"
    for name in ("sdpa", "eager", "sdpa_gqa", None):
        assert attention.choose(name, "cpu", flash_installed=False) == name
    with pytest.raises(UserError, match="pip install flash-attn"):
        attention.choose("flash_attention_2", "cuda", flash_installed=False)
    with pytest.raises(UserError, match="CUDA only"):
        attention.choose("flash_attention_2", "cpu", flash_installed=True)


def test_auto_is_the_default_and_loads_sdpa_gqa_on_cpu(tiny_model_dir, tmp_path):
    cfg = compose_config(["model=local", f"model.path={tiny_model_dir}", "logger=none", f"run_dir={tmp_path}"])
    assert cfg.model.attn_implementation == "auto"
    policies = make_policies(tiny_model_dir, attn_implementation="auto")
    expected = {"cuda": "flash_attention_2" if attention.flash_attn_installed() else "sdpa_gqa", "cpu": "sdpa_gqa"}
    assert policies.models[0].get_base_model().config._attn_implementation == expected[policies.device.type]


@pytest.mark.skipif(attention.flash_attn_installed(), reason="flash-attn is installed here")
def test_flash_attention_without_the_package_names_the_fix(tiny_model_dir):
    from marl_llm.models.loading import load_base

    cfg = OmegaConf.create(dict(name="tiny", path=str(tiny_model_dir), embedded=False, hub_id=None,
                                attn_implementation="flash_attention_2", trust_remote_code=False))
    with pytest.raises(UserError, match="flash-attn"):
        load_base(None, cfg, torch.device("cpu"), torch.float32)


def test_folded_mask_repeats_the_mask_for_each_query_head_of_a_group():
    mask = torch.rand(2, 1, 5, 13) > 0.5
    folded = attention.fold_mask(mask, 3, torch.float32)
    assert folded.shape == (2, 1, 15, 13) and folded.stride(-2) % 8 == 0 and folded.stride(-1) == 1
    for r in range(3):
        block = folded[:, :, r * 5:(r + 1) * 5]
        assert torch.equal(block == 0, mask)
        assert torch.all(block[~mask] == torch.finfo(torch.float32).min)
    additive = torch.where(mask, 0.0, -1e4).expand(2, 6, 5, 13)  # a per-head mask (6 heads = 2 groups of 3)
    assert torch.equal(attention.fold_mask(additive, 3, torch.float32), additive.reshape(2, 2, 15, 13))


def models_by_attention(tiny_model_dir, **kwargs):
    return {impl: make_policies(tiny_model_dir, attn_implementation=impl, **kwargs) for impl in ("sdpa", "sdpa_gqa")}


def tolerance(policies) -> float:
    return 1e-5 if policies.dtype == torch.float32 else 3e-2


@pytest.mark.numerics
def test_prefill_outputs_and_gradients_match_sdpa_with_left_padding(tiny_model_dir, monkeypatch):
    folds = []
    fold = attention.fold_mask
    monkeypatch.setattr(attention, "fold_mask", lambda *a: folds.append(a[0].shape) or fold(*a))
    ids, att, pos = left_pad([[1, 40, 41, 42, 2, 43, 44], [1, 60], [1, 70, 71, 72]], pad_id=2)
    results = {}
    for impl, policies in models_by_attention(tiny_model_dir).items():
        with policies.acting(0) as model:
            assert model.get_base_model().config._attn_implementation == impl
            device = policies.device
            logits = model(input_ids=ids.to(device), attention_mask=att.to(device), position_ids=pos.to(device)).logits
            (logits.float().square() * att.to(device)[..., None]).sum().backward()
            params = policies.adapter_parameters(0, "agent_aux")
            results[impl] = logits.detach()[att.bool()], [p.grad.clone() for p in params]
    assert folds == [(3, 1, 7, 7)]  # one folded mask per forward pass, shared by both layers
    tol = tolerance(policies)
    assert_close_to_scale(results["sdpa_gqa"][0], results["sdpa"][0], tol, "logits")
    for g_ref, g in zip(results["sdpa"][1], results["sdpa_gqa"][1]):
        assert g_ref.abs().sum() > 0
        assert_close_to_scale(g, g_ref, max(tol, 1e-4), "LoRA gradient")


def test_autocast_bf16_matches_sdpa_under_the_same_autocast(tiny_model_dir):
    ids, att, pos = left_pad([[1, 40, 41, 42, 2, 43, 44], [1, 60]], pad_id=2)
    out = {}
    for impl, policies in models_by_attention(tiny_model_dir).items():
        model = policies.models[0]
        with torch.no_grad(), torch.autocast(policies.device.type, dtype=torch.bfloat16):
            out[impl] = model(input_ids=ids.to(policies.device), attention_mask=att.to(policies.device),
                              position_ids=pos.to(policies.device)).logits.float()[att.bool()]
    assert torch.allclose(out["sdpa"], out["sdpa_gqa"], atol=3e-2, rtol=3e-2)


@pytest.mark.numerics
def test_decode_loop_generates_the_same_tokens(tiny_model_dir):
    prompts = [[1, 40, 41, 42, 2, 43, 44], [1, 60], [1, 70, 71, 72], [1, 60]]
    adapters = ["agent_aux", "agent_main", "agent_aux", "agent_main"]
    params = [SamplingParams(temperature=0.0, max_new_tokens=8)] * 2 + [SamplingParams(temperature=1.0, max_new_tokens=8)] * 2
    out = {}
    for impl, policies in models_by_attention(tiny_model_dir).items():
        with torch.inference_mode():  # as HFRollout decodes (an inference-mode mask has no version counter)
            out[impl] = decode(policies.models[0], prompts, adapters, params, [2], 2, row_keys=[1, 2, 3, 4])
    for a, b in zip(out["sdpa"], out["sdpa_gqa"]):
        assert len(a) == 8 and torch.equal(a, b)


@pytest.mark.numerics
@pytest.mark.parametrize("shared", [False, True])
def test_scoring_logprobs_and_gradients_match_sdpa(tiny_model_dir, shared):
    prompts = [torch.tensor([1, 40, 41, 42, 2, 43, 44]), torch.tensor([1, 60]), torch.tensor([1, 70, 71])]
    if shared:  # one prompt: its KV cache, then the completions' pass with a [k, 1, C, P + C] mask
        prompts = [prompts[0]] * 3
    comps = [torch.tensor([50, 51, 2]), torch.tensor([52, 53, 54, 55, 2]), torch.tensor([56])]
    results = {}
    for impl, policies in models_by_attention(tiny_model_dir).items():
        with policies.acting(1) as model:
            logp, mask, entropy = completion_logprobs(model, prompts, comps, 2, with_entropy=True)
            logp.sum().backward()
            results[impl] = logp.detach(), entropy, [p.grad.clone() for p in policies.adapter_parameters(0, "agent_main")]
    tol = tolerance(policies)
    assert_close_to_scale(results["sdpa_gqa"][0], results["sdpa"][0], tol, "log-probs")
    assert_close_to_scale(results["sdpa_gqa"][1], results["sdpa"][1], tol, "entropies")
    for g_ref, g in zip(results["sdpa"][2], results["sdpa_gqa"][2]):
        assert g_ref.abs().sum() > 0
        assert_close_to_scale(g, g_ref, max(tol, 1e-4), "LoRA gradient")


@pytest.mark.numerics
def test_grouped_heads_attend_to_their_own_key_value_head():
    """The attention function itself, at 6 query heads on 2 K/V heads (the tiny model has one
    group only): same outputs and input gradients as transformers' sdpa (which repeats K/V)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):  # what the attention functions read off the layer
        num_key_value_groups, is_causal = 3, True

    gen = torch.Generator().manual_seed(0)
    B, S, D = 2, 6, 8
    q, k, v = (torch.randn(B, h, S, D, generator=gen, requires_grad=True) for h in (6, 2, 2))
    real = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # row 0 left-padded
    mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]  # [B, 1, S, S]
    outs = []
    for fn in (sdpa_attention_forward, attention.sdpa_gqa_attention_forward):
        out = fn(Attention(), q, k, v, mask, scaling=D ** -0.5)[0]  # [B, S, 6, D]
        grads = torch.autograd.grad((out[real] * torch.arange(D)).sum(), (q, k, v))
        outs.append((out.detach()[real], grads))
    assert_close_to_scale(outs[1][0], outs[0][0], 1e-5, "attention output")
    for g_ref, g in zip(outs[0][1], outs[1][1]):
        assert_close_to_scale(g, g_ref, 1e-4, "input gradient")
