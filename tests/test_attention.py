"""attention.py: `auto` resolution, and `sdpa_gqa` (grouped-query SDPA without repeating K/V)
giving transformers' `sdpa` outputs and gradients with left padding: in a prefill, in the decode
loop (KV cache) and in scoring. The tiny model is GQA: 2 query heads share 1 key/value head."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import FLOAT64_REL, assert_close_to_scale, compose_config, make_policies
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


@pytest.mark.numerics
def test_prefill_outputs_and_gradients_match_sdpa_with_left_padding(tiny_model_dir, monkeypatch):
    """sdpa_gqa (folded query heads) vs sdpa (K/V repeated) in a left-padded prefill: logits and
    LoRA gradients, float64, to FLOAT64_REL of the largest element."""
    folds = []
    fold = attention.fold_mask
    monkeypatch.setattr(attention, "fold_mask", lambda *a: folds.append(a[0].shape) or fold(*a))
    ids, att, pos = left_pad([[1, 40, 41, 42, 2, 43, 44], [1, 60], [1, 70, 71, 72]], pad_id=2)
    results = {}
    for impl, policies in models_by_attention(tiny_model_dir, dtype="float64").items():
        with policies.acting(0) as model:
            assert model.get_base_model().config._attn_implementation == impl
            device = policies.device
            logits = model(input_ids=ids.to(device), attention_mask=att.to(device), position_ids=pos.to(device)).logits
            assert logits.dtype == torch.float64
            (logits.square() * att.to(device)[..., None]).sum().backward()
            params = policies.adapter_parameters(0, "agent_aux")
            results[impl] = logits.detach()[att.bool()], [p.grad.clone() for p in params]
    assert folds == [(3, 1, 7, 7)]  # one folded mask per forward pass, shared by both layers
    assert_close_to_scale(results["sdpa_gqa"][0], results["sdpa"][0], FLOAT64_REL, "logits")
    for g_ref, g in zip(results["sdpa"][1], results["sdpa_gqa"][1]):
        assert g_ref.abs().sum() > 0
        assert_close_to_scale(g, g_ref, FLOAT64_REL, "LoRA gradient")


@pytest.mark.numerics
def test_autocast_bf16_matches_sdpa_under_the_same_autocast(tiny_model_dir):
    """sdpa_gqa vs sdpa under bf16 autocast (the point: the folded mask and queries in bf16):
    logits, bf16, to a bound derived below, relative to the largest logit."""
    ids, att, pos = left_pad([[1, 40, 41, 42, 2, 43, 44], [1, 60]], pad_id=2)
    out = {}
    for impl, policies in models_by_attention(tiny_model_dir).items():
        model = policies.models[0]
        with torch.no_grad(), torch.autocast(policies.device.type, dtype=torch.bfloat16):
            out[impl] = model(input_ids=ids.to(policies.device), attention_mask=att.to(policies.device),
                              position_ids=pos.to(policies.device)).logits.float()[att.bool()]
    # The two attention kernels sum the same bf16 products in their own order and round the result to
    # bf16 (2^-8 relative) in a different place; that difference passes through the rest of the 2
    # layers (each output projection, MLP and residual sum rounds to bf16 again, ~4 roundings a layer)
    # to the logits: ~8 bf16 roundings of values no larger than the largest logit, 8 x 2^-8 = 3e-2 of it.
    # A wrong mask or head grouping changes the logits by their own size. Seen: 0 (the same sums here).
    assert_close_to_scale(out["sdpa_gqa"], out["sdpa"], 8 * 2**-8, "bf16 logits")


@pytest.mark.numerics
def test_decode_loop_generates_the_same_tokens(tiny_model_dir):
    """The decode loop with sdpa_gqa vs with sdpa, greedy and sampled rows (keyed draws): the same
    token ids, on float64 models (a near-tie between two tokens cannot flip on rounding)."""
    prompts = [[1, 40, 41, 42, 2, 43, 44], [1, 60], [1, 70, 71, 72], [1, 60]]
    adapters = ["agent_aux", "agent_main", "agent_aux", "agent_main"]
    params = [SamplingParams(temperature=0.0, max_new_tokens=8)] * 2 + [SamplingParams(temperature=1.0, max_new_tokens=8)] * 2
    out = {}
    for impl, policies in models_by_attention(tiny_model_dir, dtype="float64").items():
        with torch.inference_mode():  # as HFRollout decodes (an inference-mode mask has no version counter)
            out[impl] = decode(policies.models[0], prompts, adapters, params, [2], 2, row_keys=[1, 2, 3, 4])
    for a, b in zip(out["sdpa"], out["sdpa_gqa"]):
        assert len(a) == 8 and torch.equal(a, b)


@pytest.mark.numerics
@pytest.mark.parametrize("shared", [False, True])
def test_scoring_logprobs_and_gradients_match_sdpa(tiny_model_dir, shared):
    """Scoring with sdpa_gqa vs sdpa (packed, and a shared prompt's KV cache): log-probs,
    entropies and LoRA gradients, float64, to FLOAT64_REL of the largest element."""
    prompts = [torch.tensor([1, 40, 41, 42, 2, 43, 44]), torch.tensor([1, 60]), torch.tensor([1, 70, 71])]
    if shared:  # one prompt: its KV cache, then the completions' pass with a [k, 1, C, P + C] mask
        prompts = [prompts[0]] * 3
    comps = [torch.tensor([50, 51, 2]), torch.tensor([52, 53, 54, 55, 2]), torch.tensor([56])]
    results = {}
    for impl, policies in models_by_attention(tiny_model_dir, dtype="float64").items():
        with policies.acting(1) as model:
            logp, mask, entropy = completion_logprobs(model, prompts, comps, 2, with_entropy=True)
            logp.sum().backward()
            results[impl] = logp.detach(), entropy, [p.grad.clone() for p in policies.adapter_parameters(0, "agent_main")]
    assert results["sdpa"][0].dtype == torch.float64
    assert_close_to_scale(results["sdpa_gqa"][0], results["sdpa"][0], FLOAT64_REL, "log-probs")
    assert_close_to_scale(results["sdpa_gqa"][1], results["sdpa"][1], FLOAT64_REL, "entropies")
    for g_ref, g in zip(results["sdpa"][2], results["sdpa_gqa"][2]):
        assert g_ref.abs().sum() > 0
        assert_close_to_scale(g, g_ref, FLOAT64_REL, "LoRA gradient")


@pytest.mark.numerics
def test_grouped_heads_attend_to_their_own_key_value_head():
    """The attention function itself, at 6 query heads on 2 K/V heads (the tiny model has one
    group only): sdpa_gqa vs transformers' sdpa (which repeats K/V), outputs and input gradients,
    float64, to FLOAT64_REL of the largest element."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):  # what the attention functions read off the layer
        num_key_value_groups, is_causal = 3, True

    gen = torch.Generator().manual_seed(0)
    B, S, D = 2, 6, 8
    q, k, v = (torch.randn(B, h, S, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (6, 2, 2))
    real = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)  # row 0 left-padded
    mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]  # [B, 1, S, S]
    outs = []
    for fn in (sdpa_attention_forward, attention.sdpa_gqa_attention_forward):
        out = fn(Attention(), q, k, v, mask, scaling=D ** -0.5)[0]  # [B, S, 6, D]
        grads = torch.autograd.grad((out[real] * torch.arange(D)).sum(), (q, k, v))
        outs.append((out.detach()[real], grads))
    assert outs[1][0].dtype == torch.float64
    assert_close_to_scale(outs[1][0], outs[0][0], FLOAT64_REL, "attention output")
    for g_ref, g in zip(outs[0][1], outs[1][1]):
        assert g_ref.abs().sum() > 0
        assert_close_to_scale(g, g_ref, FLOAT64_REL, "input gradient")


@pytest.mark.numerics
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_one_token_steps_fold_the_query_heads_and_match_sdpa(per_head_mask):
    """A decode step (one query position) at 6 query heads on 2 K/V heads, with no K/V repeat and
    no folded mask copy, vs transformers' sdpa with K/V repeated: outputs, float64, to
    FLOAT64_REL of the largest element."""
    from transformers.integrations import sdpa_attention as S

    class Attention(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    gen = torch.Generator().manual_seed(1)
    B, K, D = 3, 9, 8
    q = torch.randn(B, 6, 1, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, 2, K, D, generator=gen, dtype=torch.float64) for _ in range(2))
    real = torch.ones(B, K, dtype=torch.bool)
    real[0, :4] = False  # a left-padded row
    real[2, :1] = False
    mask = real[:, None, None, :]  # [B, 1, 1, K]
    if per_head_mask:
        mask = mask.expand(B, 6, 1, K).clone()
    want = S.sdpa_attention_forward(Attention(), q, k, v, mask, scaling=D ** -0.5)[0]
    repeats, folds = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "repeat_kv", lambda h, n: repeats.append(n) or h)
        mp.setattr(attention, "fold_mask", lambda *a: folds.append(a) or None)
        got = attention.sdpa_gqa_attention_forward(Attention(), q, k, v, mask, scaling=D ** -0.5)[0]
    assert repeats == [] and folds == []
    assert got.shape == want.shape == (B, 1, 6, D) and got.dtype == torch.float64
    assert_close_to_scale(got, want, FLOAT64_REL, "decode-step attention")


def test_decode_steps_never_repeat_key_values(tiny_model_dir, monkeypatch):
    """Through the decode loop, dynamic and static: neither the prefill nor any decode step
    repeats K/V (the tiny model: 2 query heads share 1 K/V head). transformers' sdpa repeats them
    in every decode step before 5.23 and under torch.compile."""
    from transformers.integrations import sdpa_attention as S

    repeats = []
    repeat = S.repeat_kv
    monkeypatch.setattr(S, "repeat_kv", lambda h, n: (repeats.append(h.shape) if n > 1 else None) or repeat(h, n))
    params = [SamplingParams(temperature=0.0, max_new_tokens=5)] * 2
    policies = make_policies(tiny_model_dir, attn_implementation="sdpa_gqa")
    for static in (False, True):
        with torch.inference_mode():
            out = decode(policies.models[0], [[1, 40, 41], [1, 60]], ["agent_aux", "agent_main"], params, [2], 2,
                         static=static)
        assert [len(o) for o in out] == [5, 5]
    assert repeats == []
