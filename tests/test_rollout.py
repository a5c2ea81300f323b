"""Generation and log-probs: batched mixed-adapter generation, per-row sampling, and completion
masks that cover completion tokens only (nothing of the prompt, nothing after EOS), with a chat
template where pad == eos (SmolLM2's tokenizer)."""

from __future__ import annotations

import pytest
import torch

from conftest import FLOAT64_REL, assert_close_to_scale, make_policies
from marl_llm.rollout.decode import (GenRequest, HFRollout, PerRowSampling, SamplingParams, completion_logprobs,
                              cut_at_eos, encode_prompt, pad_pairs)


def test_pad_equals_eos_and_the_prompt_contains_it(tiny_model_dir):
    policies = make_policies(tiny_model_dir)
    tok = policies.tokenizers[0]
    assert tok.pad_token_id == tok.eos_token_id
    ids = encode_prompt(tok, "Write aux.")
    # The chat template closes the system turn with <|im_end|> == eos == pad, mid-prompt: a
    # "first pad token" prompt boundary (the reference's) would cut the prompt there.
    assert tok.eos_token_id in ids[:-3]
    ro = HFRollout(policies)
    out = ro.generate([GenRequest(0, "Write aux.", SamplingParams(temperature=0.0, max_new_tokens=5)),
                       GenRequest(1, "A much longer message " * 5, SamplingParams(temperature=0.0, max_new_tokens=5))])
    assert out[0].prompt_ids.tolist() == ids  # exact prompt ids, never re-tokenized or cut
    assert all(len(o.completion_ids) == 5 and o.truncated for o in out)


def test_cut_at_eos_drops_everything_after_the_first_eos():
    ids, truncated = cut_at_eos(torch.tensor([5, 7, 2, 2, 2]), [2])
    assert ids.tolist() == [5, 7, 2] and not truncated
    ids, truncated = cut_at_eos(torch.tensor([5, 7, 9]), [2, 3])
    assert ids.tolist() == [5, 7, 9] and truncated
    assert cut_at_eos(torch.tensor([3, 2, 1]), [2, 3])[0].tolist() == [3]


def test_generation_stops_at_eos_and_padding_is_not_part_of_the_completion(tiny_model_dir):
    policies = make_policies(tiny_model_dir)
    ro = HFRollout(policies)
    req = [GenRequest(0, "hello", SamplingParams(temperature=0.0, max_new_tokens=8)),
           GenRequest(0, "a different and longer prompt", SamplingParams(temperature=0.0, max_new_tokens=8))]
    free = ro.generate(req)
    toks = free[0].completion_ids.tolist()
    # Make the first token that differs from its predecessors an end-of-sequence id.
    k = next(k for k in range(1, len(toks)) if toks[k] not in toks[:k])
    stop = toks[k]
    policies.eos_ids[0] = policies.eos_ids[0] + [stop]
    cut = ro.generate(req)
    assert cut[0].completion_ids.tolist() == toks[: k + 1]
    assert not cut[0].truncated
    # The other row is unaffected unless it produced the same id.
    if stop not in free[1].completion_ids.tolist():
        assert cut[1].completion_ids.tolist() == free[1].completion_ids.tolist()


@pytest.mark.numerics
def test_completion_mask_and_logprobs_ignore_prompt_and_padding(tiny_model_dir):
    """Masks and positions exactly; batched, left-padded scoring vs each pair scored alone and
    unpadded by hand: log-probs, float64, to FLOAT64_REL of the largest element."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    model = policies.models[0]
    model.set_adapter("agent_aux")
    prompts = [torch.tensor([1, 10, 11, 2, 12]), torch.tensor([1, 13])]
    comps = [torch.tensor([20, 21, 2]), torch.tensor([22, 23, 24, 25, 2])]
    ids, att, pos, cmask = pad_pairs(prompts, comps, pad_id=2)
    assert cmask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert att[0].tolist() == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0] and att[1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert pos[1, 3:].tolist() == list(range(7))  # positions count real tokens only
    with torch.no_grad():
        logp, mask, _ = completion_logprobs(model, prompts, comps, pad_id=2)
        # Same log-probs as scoring each pair alone, unpadded, by hand.
        for b in range(2):
            full = torch.cat([prompts[b], comps[b]]).unsqueeze(0)
            lp = torch.log_softmax(model(input_ids=full).logits[0, :-1], -1)
            want = lp[len(prompts[b]) - 1:].gather(1, comps[b].unsqueeze(1)).squeeze(1)
            assert want.dtype == logp.dtype == torch.float64
            assert_close_to_scale(logp[b, : len(comps[b])], want, FLOAT64_REL, "log-probs")
            assert torch.all(logp[b, len(comps[b]):] == 0)


@pytest.mark.numerics
def test_padding_rows_do_not_change_a_completions_logprobs(tiny_model_dir):
    """A completion scored alone vs batched with a longer neighbour (padding after its EOS):
    log-probs, float64, to FLOAT64_REL of the largest element."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    model = policies.models[0]
    prompts, comps = [torch.tensor([1, 10, 11, 12])], [torch.tensor([20, 2])]
    with torch.no_grad():
        alone, _, _ = completion_logprobs(model, prompts, comps, pad_id=2)
        # Batched with a longer neighbour, row 0 gets padding after its EOS: masked, and its
        # real tokens score exactly as alone.
        both, mask, _ = completion_logprobs(model, prompts * 2, comps + [torch.tensor([20, 21, 22, 23, 2])], 2)
    assert mask[0].tolist() == [1, 1, 0, 0, 0]
    assert_close_to_scale(both[0, :2], alone[0], FLOAT64_REL, "log-probs")
    assert torch.all(both[0, 2:] == 0)


@pytest.mark.numerics
def test_mixed_adapter_batch_matches_per_agent_generation(tiny_model_dir):
    """Greedy generation of a mixed-adapter batch vs each agent's row alone: the same token ids,
    on a float64 model (a near-tie between two tokens cannot flip on the batch's rounding)."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    ro = HFRollout(policies)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    mixed = ro.generate([GenRequest(0, "solve it", greedy), GenRequest(1, "solve it", greedy)])
    alone = [ro.generate([GenRequest(i, "solve it", greedy)])[0] for i in range(2)]
    for m, a in zip(mixed, alone):
        assert m.completion_ids.tolist() == a.completion_ids.tolist()
    # The two adapters differ, so the same prompt gives different greedy completions.
    assert mixed[0].completion_ids.tolist() != mixed[1].completion_ids.tolist()


def test_per_row_sampling_settings():
    torch.manual_seed(0)
    scores = torch.randn(3, 50)
    proc = PerRowSampling([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3),
                           SamplingParams(temperature=1.0, top_p=0.5)], torch.device("cpu"))
    out = proc(None, scores.clone())
    finite = out > torch.finfo(out.dtype).min
    assert finite[0].sum() == 1 and int(out[0].argmax()) == int(scores[0].argmax())  # greedy row
    assert finite[1].sum() == 3  # top-k row keeps 3 tokens
    probs = scores[2].softmax(-1).sort(descending=True).values
    kept = int(finite[2].sum())
    assert probs[: kept - 1].sum() < 0.5 <= probs[:kept].sum()  # smallest set reaching top_p


def reference_top_p(scores, top_p):
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = sorted_scores.softmax(-1)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, (probs.cumsum(-1) - probs) >= top_p)
    return drop


def test_top_p_matches_a_full_sort_for_narrow_and_wide_nuclei():
    torch.manual_seed(1)
    peaked = torch.randn(2, 5000) * 6  # nucleus of a few tokens: the fast top-k path
    flat = torch.randn(2, 5000) * 0.1  # nucleus of thousands of tokens: the full-sort fallback
    scores = torch.cat([peaked, flat])
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.6, 0.95, 0.6, 0.95)]
    out = PerRowSampling(params, torch.device("cpu"))(None, scores.clone())
    for b, p in enumerate(params):
        dropped = out[b] == torch.finfo(out.dtype).min
        assert torch.equal(dropped, reference_top_p(scores[b], p.top_p)), b
        assert torch.equal(out[b][~dropped], scores[b][~dropped])
    assert (out[2] > torch.finfo(out.dtype).min).sum() > 256  # the wide rows really were wide
    untouched = PerRowSampling([SamplingParams(temperature=1.0, top_p=1.0)], torch.device("cpu"))(None, flat[:1].clone())
    assert torch.equal(untouched, flat[:1])


def test_sampling_is_seeded(tiny_model_dir):
    policies = make_policies(tiny_model_dir)
    ro = HFRollout(policies)
    req = [GenRequest(i % 2, "go", SamplingParams(temperature=1.0, max_new_tokens=6)) for i in range(4)]
    torch.manual_seed(3)
    a = [c.completion_ids.tolist() for c in ro.generate(req)]
    torch.manual_seed(3)
    b = [c.completion_ids.tolist() for c in ro.generate(req)]
    assert a == b and len({tuple(x) for x in a}) > 1


@pytest.mark.numerics
def test_siblings_share_one_prompt_encoding_with_the_same_logprobs_and_gradients(tiny_model_dir):
    """Completions of one prompt reuse its KV cache: shared-prompt scoring vs full packing (and vs
    each completion scored alone), log-probs and LoRA gradients, float64, to FLOAT64_REL of the
    largest element."""
    from marl_llm.rollout.decode import _shared_prompt_logits

    policies = make_policies(tiny_model_dir, dtype="float64")
    with policies.acting(0) as model:
        params = policies.adapter_parameters(0, "agent_aux")
        prompt = torch.tensor([1, 40, 41, 42, 2, 43, 44])
        comps = [torch.tensor([50, 51, 2]), torch.tensor([52, 53, 54, 55, 2]), torch.tensor([56])]
        shared, mask_s, _ = completion_logprobs(model, [prompt] * 3, comps, pad_id=2)
        assert _shared_prompt_logits(model, prompt, comps, 2, torch.device("cpu"))[0] is not None  # the shared path ran
        shared.sum().backward()
        grads_shared = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        packed, mask_p = completion_logprobs_packed(model, [prompt] * 3, comps)
        packed.sum().backward()
        alone = [completion_logprobs(model, [prompt], [c], pad_id=2)[0][0] for c in comps]
    assert torch.equal(mask_s, mask_p)
    assert shared.dtype == packed.dtype == torch.float64
    assert_close_to_scale(shared, packed, FLOAT64_REL, "log-probs")
    for b, c in enumerate(comps):
        assert_close_to_scale(shared[b, : len(c)], alone[b], FLOAT64_REL, "log-probs")
        assert torch.all(shared[b, len(c):] == 0)
    for g_s, p in zip(grads_shared, params):
        assert g_s.abs().sum() > 0
        assert_close_to_scale(g_s, p.grad, FLOAT64_REL, "LoRA gradient")


def completion_logprobs_packed(model, prompts, comps):
    """The packing path on its own (what completion_logprobs does for distinct prompts)."""
    import torch.nn.functional as F

    ids, att, pos, cmask = pad_pairs(prompts, comps, 2)
    C = cmask.shape[1]
    logits = model(input_ids=ids, attention_mask=att, position_ids=pos, logits_to_keep=C + 1).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 for an fp64 model
    logp = torch.gather(F.log_softmax(logits, -1), 2, ids[:, -C:].unsqueeze(2)).squeeze(2)
    return logp * cmask, cmask


# ------------------------------------------------------------------ the decode loop of its own
def hf_greedy(policies, agent: int, message: str, max_new_tokens: int, **kwargs) -> list[int]:
    """Reference: transformers' own `generate` on the peft model with the agent's adapter."""
    model, tok = policies.models[0], policies.tokenizers[0]
    model.set_adapter(policies.agents[agent].adapter)
    ids = torch.tensor([encode_prompt(tok, message)])
    with torch.no_grad():
        seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=policies.eos_ids[0], **kwargs)
    return cut_at_eos(seqs[0, ids.shape[1]:], policies.eos_ids[0])[0].tolist()


@pytest.mark.numerics
def test_decode_matches_transformers_generate_for_every_row_of_a_mixed_batch(tiny_model_dir):
    """Mixed adapters, shared prefill of siblings, rows of different prompt lengths (left
    padding) and lengths (rows leave the batch): the decode loop vs `generate` on each row alone,
    greedy, the same token ids, on a float64 model (a near-tie cannot flip on rounding)."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    ro = HFRollout(policies)
    cases = [(0, "solve it", 7), (1, "solve it", 7), (0, "solve it", 7), (1, "a much longer prompt " * 4, 3),
             (0, "short", 9)]
    out = ro.generate([GenRequest(a, m, SamplingParams(temperature=0.0, max_new_tokens=n)) for a, m, n in cases])
    for (a, m, n), c in zip(cases, out):
        assert c.completion_ids.tolist() == hf_greedy(policies, a, m, n)
    assert out[0].completion_ids.tolist() == out[2].completion_ids.tolist()  # siblings, greedy
    assert out[0].completion_ids.tolist() != out[1].completion_ids.tolist()  # the adapters differ


@pytest.mark.numerics
def test_min_new_tokens_holds_back_the_end_of_sequence(tiny_model_dir):
    """min_new_tokens in the decode loop vs in `generate`: greedy, the same token ids, on a
    float64 model (a near-tie cannot flip on rounding)."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    ro = HFRollout(policies)
    free = ro.generate([GenRequest(0, "hello", SamplingParams(temperature=0.0, max_new_tokens=8))])[0]
    stop = free.completion_ids.tolist()[1]  # make the second greedy token an end of sequence
    policies.eos_ids[0] = policies.eos_ids[0] + [stop]
    short = ro.generate([GenRequest(0, "hello", SamplingParams(temperature=0.0, max_new_tokens=8))])[0]
    assert len(short.completion_ids) <= 2 and not short.truncated
    fixed = ro.generate([GenRequest(0, "hello", SamplingParams(temperature=0.0, max_new_tokens=8, min_new_tokens=8))])[0]
    assert len(fixed.completion_ids) == 8
    assert fixed.completion_ids.tolist() == hf_greedy(policies, 0, "hello", 8, min_new_tokens=8)


@pytest.mark.numerics
def test_mixed_lora_forward_equals_peft_mixed_batches(tiny_model_dir):
    """MixedLoRA's stacked per-row adapters vs peft's mixed-batch forward (adapter_names): logits,
    float64, to FLOAT64_REL of the largest element; peft's own forward afterwards is bitwise the
    one before (the same code path)."""
    from marl_llm.rollout.mixed_lora import MixedLoRA

    policies = make_policies(tiny_model_dir, dtype="float64")
    model = policies.models[0]
    names = ["agent_aux", "agent_main", "agent_main", "agent_aux"]
    ids = torch.randint(3, 200, (4, 9))
    with torch.no_grad():
        want = model(input_ids=ids, adapter_names=names).logits
        assert MixedLoRA.supported(model, ["agent_aux", "agent_main"])
        with MixedLoRA(model, names) as lora:
            lora.set_rows(names)
            got = model(input_ids=ids).logits
        after = model(input_ids=ids, adapter_names=names).logits  # peft's own forward is back
        with model.disable_adapter():
            bare = model(input_ids=ids).logits
    assert got.dtype == torch.float64
    assert_close_to_scale(got, want, FLOAT64_REL, "logits")
    assert float((want - bare).abs().max()) > 1e-3 * float(want.abs().max())  # the adapters matter
    assert torch.equal(after, want)


# ------------------------------------------------------------------------- the vLLM backend
def test_vllm_rollout_without_vllm_or_a_gpu_says_how_to_run(tiny_model_dir, tmp_path):
    import pytest

    from conftest import compose_config, tiny_overrides
    from marl_llm.config import UserError
    from marl_llm.training.setup import build

    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path, "algo=magrpo", "task=tldr", "algo.num_turns=1",
                                             "trainer.rollout=vllm"))
    with pytest.raises(UserError, match="use trainer.rollout=hf"):
        build(cfg)


def test_exported_adapter_loads_back_into_peft_with_the_same_weights(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marl_llm.models.policies import lora_weights
    from marl_llm.rollout.vllm import export_adapter

    policies = make_policies(tiny_model_dir)
    model = policies.models[0]
    path = export_adapter(model, "agent_main", tmp_path / "adapters" / "agent_main-v1")
    assert (path / "adapter_config.json").exists() and (path / "adapter_model.safetensors").exists()
    assert [p.name for p in path.parent.iterdir()] == ["agent_main-v1"]  # no temp dir left behind
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), path, adapter_name="agent_main")
    want = {n.replace("base_model.model.", ""): p for n, p in lora_weights(model, "agent_main").items()}
    got = {n.replace("base_model.model.", ""): p for n, p in lora_weights(loaded, "agent_main").items()}
    assert set(got) == set(want) and len(want) > 0
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert any(float(w.abs().sum()) > 0 for n, w in want.items() if "lora_B" in n)  # a trained-looking adapter


def test_sample_rows_draws_from_each_rows_distribution():
    from marl_llm.rollout.sampling import sample_rows

    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draws = torch.stack([sample_rows(probs) for _ in range(4000)])  # [4000, 3]
    for row in range(3):
        freq = torch.bincount(draws[:, row], minlength=4).float() / len(draws)
        assert torch.allclose(freq, probs[row], atol=0.03), (row, freq)
        assert torch.all(freq[probs[row] == 0] == 0)  # never a zero-probability token
