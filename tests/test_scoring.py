"""Memory-lean scoring (scoring.py): the chunked LM head gives the log-probs, entropies and
gradients of the full-logits computation, on the packed and shared-prompt paths, with gradient
checkpointing, under a full model's autocast, and falls back where the head is not the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import FLOAT64_REL, assert_close_to_scale, make_policies
from marl_llm.models import scoring
from marl_llm.rollout.decode import _shared_prompt_logits, completion_logprobs, pad_pairs

# Every test here compares two computations of the same numbers (make test reruns them on another
# BLAS code path: `-m numerics`).
pytestmark = pytest.mark.numerics

PROMPTS = [torch.tensor([1, 40, 41, 42, 2, 43, 44]), torch.tensor([1, 60, 61]), torch.tensor([1, 70, 71, 72, 73])]
COMPS = [torch.tensor([50, 51, 2]), torch.tensor([52, 53, 54, 55, 56, 57, 2]), torch.tensor([58])]


def reference(model, prompts, comps):
    """The full-logits computation (what scoring did before): logp [B, C], mask [B, C], entropy [B, C]."""
    ids, att, pos, cmask = pad_pairs(prompts, comps, 2)
    device = next(model.parameters()).device
    C = cmask.shape[1]
    out = model(input_ids=ids.to(device), attention_mask=att.to(device), position_ids=pos.to(device),
                logits_to_keep=C + 1, use_cache=False)
    logits = out.logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 for an fp64 model
    lp = F.log_softmax(logits, -1)
    logp = lp.gather(2, ids[:, -C:].to(device).unsqueeze(2)).squeeze(2) * cmask.to(device)
    entropy = -(lp.exp() * lp).sum(-1).detach() * cmask.to(device)
    return logp, cmask.to(device), entropy


def logps_and_grads(fn, model, params):
    for p in params:
        p.grad = None
    logp, mask, entropy = fn()
    (logp * torch.linspace(0.5, 1.5, logp.numel(), device=logp.device).view_as(logp)).sum().backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return logp.detach(), mask, entropy, grads


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 rows, so every batch here spans several chunks."""
    monkeypatch.setattr(scoring, "LOGIT_CHUNK_ELEMENTS", 3 * 49152)


def chunked_and_reference(model_dir, shared: bool, checkpointing: bool):
    """(lean, reference, policies): logp, mask, entropy and the LoRA gradients of agent 0 from the
    chunked head and from full logits, on float64 policies."""
    policies = make_policies(model_dir, dtype="float64")
    if checkpointing:
        policies.enable_gradient_checkpointing()
    prompts = [PROMPTS[0]] * 3 if shared else PROMPTS
    with policies.acting(0) as model:
        params = policies.adapter_parameters(0, "agent_aux")
        assert scoring.lm_head(model) is model.get_base_model().lm_head  # the lean path applies
        if shared and not checkpointing:  # the prompt's KV cache is reused (no cache under checkpointing)
            assert _shared_prompt_logits(model, PROMPTS[0], COMPS, 2, policies.device, scoring.lm_head(model)) is not None
        new = logps_and_grads(lambda: completion_logprobs(model, prompts, COMPS, 2, with_entropy=True), model, params)
        ref = logps_and_grads(lambda: reference(model, prompts, COMPS), model, params)
    return new, ref, policies


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_and_full_logits_are_the_same_computation(tiny_model_dir, small_chunks, shared, checkpointing):
    """Chunked head (packed or shared-prompt, with and without gradient checkpointing) vs full
    logits: log-probs, entropies and LoRA gradients, float64, to FLOAT64_REL of the largest
    element (seen: ~1e-15). Gradients are compared with the largest gradient element, not
    elementwise: a small element is a sum of cancelling terms and carries their rounding. (The
    float32 version of this test differed by up to 2e-5 on an AMD EPYC: each path sums the
    vocabulary and the chunks' gradients in its own order, which float64 makes negligible.)"""
    new, ref, _ = chunked_and_reference(tiny_model_dir, shared, checkpointing)
    assert new[0].dtype == torch.float64 and new[3][0].dtype == torch.float64
    assert torch.equal(new[1], ref[1])
    assert_close_to_scale(new[0], ref[0], FLOAT64_REL, "log-probs")
    assert_close_to_scale(new[2], ref[2], FLOAT64_REL, "entropies")
    assert torch.all(new[0][new[1] == 0] == 0) and torch.all(new[2][new[1] == 0] == 0)
    assert not new[2].requires_grad
    for g_new, g_ref in zip(new[3], ref[3]):
        assert g_ref.abs().sum() > 0
        assert_close_to_scale(g_new, g_ref, FLOAT64_REL, "LoRA gradient")


def test_no_entropy_unless_asked_and_no_grad_scoring(tiny_model_dir):
    """Scoring without gradients or entropies vs full logits: log-probs, float64, to FLOAT64_REL
    of the largest element."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    with policies.acting(1) as model, torch.no_grad():
        logp, mask, entropy = completion_logprobs(model, PROMPTS, COMPS, 2)
        ref, _, _ = reference(model, PROMPTS, COMPS)
    assert entropy is None and not logp.requires_grad
    assert_close_to_scale(logp, ref, FLOAT64_REL, "log-probs")


def test_the_backward_keeps_no_vocabulary_sized_tensor(tiny_model_dir, small_chunks):
    """What autograd saves for the backward, outside the per-chunk checkpoints: no [B, C, V]
    fp32 block (the full-logits computation saves several). Sizes in fp32 elements of the
    saved tensors' storage (parameters, e.g. the tied head viewed per batch row, are not new)."""
    policies = make_policies(tiny_model_dir)
    B, C, V = len(COMPS), max(len(c) for c in COMPS), 49152
    weights = {p.untyped_storage().data_ptr() for p in policies.models[0].parameters()}

    def largest_saved(fn) -> int:
        sizes = [0]

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                sizes.append(t.untyped_storage().nbytes() // 4)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return max(sizes)

    with policies.acting(0) as model:
        lean = largest_saved(lambda: completion_logprobs(model, PROMPTS, COMPS, 2, with_entropy=True))
        full = largest_saved(lambda: reference(model, PROMPTS, COMPS))
    assert full >= B * C * V
    assert lean < 3 * V  # one chunk's row block at most, never the whole batch's logits


def test_full_model_autocast_is_kept_for_the_head(tiny_model_dir):
    """A fully fine-tuned policy computes under the autocast its forward is wrapped in
    (models.full_model): the head chunks run under the same autocast. bf16 autocast is the point
    here, so no float64: that the chunks run in bf16 is checked exactly (the dtype of the head's
    output in each chunk, and with autocast=None fp32), and the chunked head vs the model's own
    bf16 logits (full_logits) are compared in bf16 to a bound derived below."""
    from transformers import AutoModelForCausalLM

    from marl_llm.models.policies import full_model

    model = full_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                       torch.bfloat16, device_type="cpu")
    head = scoring.lm_head(model)
    chunk_dtypes = []
    handle = head.register_forward_hook(  # the chunks: [n, d] states (not the model's own [B, T, d] call)
        lambda m, i, o: chunk_dtypes.append(o.dtype) if i[0].dim() == 2 else None)
    ids, att, pos, cmask = pad_pairs(PROMPTS, COMPS, 2)
    _, states, used_head, autocast = scoring.predicting_states(model, head, 4, input_ids=ids, attention_mask=att,
                                                               position_ids=pos, use_cache=False)
    assert used_head is head and autocast == ("cpu", torch.bfloat16)
    assert states.shape == (3, 4, 32)
    chunk_dtypes.clear()
    new, mask, _ = completion_logprobs(model, PROMPTS, COMPS, 2)
    assert chunk_dtypes and set(chunk_dtypes) == {torch.bfloat16}  # every chunk under the model's autocast
    ref, _, _ = reference(model, PROMPTS, COMPS)
    targets = ids[:, -4:]
    with torch.no_grad():  # the same states through the head with and without its autocast
        chunk_dtypes.clear()
        kept = scoring.token_logprobs(states, targets, torch.ones_like(targets), head, autocast=autocast)[0]
        assert set(chunk_dtypes) == {torch.bfloat16}
        chunk_dtypes.clear()
        fp32 = scoring.token_logprobs(states, targets, torch.ones_like(targets), head, autocast=None)[0]
        assert set(chunk_dtypes) == {torch.float32}
        largest_logit = float(head(states).abs().max())
    handle.remove()
    assert not torch.equal(kept, fp32)  # the autocast changes the log-probs (by bf16 rounding, ~1e-3 here)
    # Both paths round each logit (a 32-term dot product, accumulated in fp32) once to bf16. If the
    # accumulation order differs, a logit's rounding can flip by one bf16 step, 2^-8 x |logit| at most;
    # the target's log-prob moves by that for the target's logit plus as much for the log-sum-exp
    # (a weighted mean of the flips): 2 x 2^-8 x max |logit|, plus the fp32 log-softmax's rounding
    # (eps32 x ~16 pairwise summation levels x |log-prob| ~11: ~2e-5). Seen: 1e-6 (no flip here).
    bound = 2 * 2**-8 * largest_logit + 2e-5
    assert float((new.detach() - ref.detach()).abs().max()) <= bound
    new.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_a_logit_transform_the_head_does_not_show_falls_back_to_the_models_logits(tiny_model_dir):
    """If the model's logits are not head(hidden) (here a softcap added by a hook, invisible in
    the config), the check on the last position catches it: warning, then the model's own logits.
    The fallback vs full logits (packed and shared prompt): log-probs, float64, to FLOAT64_REL of
    the largest element."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    with policies.acting(0) as model:
        base = model.get_base_model()
        base.register_forward_hook(lambda m, a, out: out.__setitem__("logits", 0.2 * torch.tanh(out.logits / 0.2)))
        with pytest.warns(UserWarning, match="falls back"):
            logp, mask, _ = completion_logprobs(model, PROMPTS, COMPS, 2)
        assert scoring.lm_head(model) is None  # remembered: no second lean attempt
        again, _, _ = completion_logprobs(model, [PROMPTS[0]] * 3, COMPS, 2)
        ref, _, _ = reference(model, PROMPTS, COMPS)
        ref_shared, _, _ = reference(model, [PROMPTS[0]] * 3, COMPS)
    assert_close_to_scale(logp, ref, FLOAT64_REL, "log-probs")
    assert_close_to_scale(again, ref_shared, FLOAT64_REL, "log-probs, shared prompt")


def test_softcap_in_the_config_uses_the_full_logits_path(tiny_model_dir):
    """The full-logits path (taken for a softcap) vs the reference: log-probs and entropies,
    float64, to FLOAT64_REL of the largest element. (An FSDP-sharded model keeps the chunked
    head: its root unit stays gathered after the forward pass, fsdp.shard_model;
    tests/test_fsdp.py scores through it on 2 ranks.)"""
    policies = make_policies(tiny_model_dir, dtype="float64")
    model = policies.models[0]
    assert scoring.lm_head(model) is not None
    model.get_base_model().config.final_logit_softcapping = 30.0
    assert scoring.lm_head(model) is None
    with torch.no_grad():
        logp, _, entropy = completion_logprobs(model, PROMPTS, COMPS, 2, with_entropy=True)
        ref, _, ref_entropy = reference(model, PROMPTS, COMPS)
    assert_close_to_scale(logp, ref, FLOAT64_REL, "log-probs")
    assert_close_to_scale(entropy, ref_entropy, FLOAT64_REL, "entropies")


def test_chunk_size_does_not_change_the_result(tiny_model_dir):
    """token_logprobs in chunks of 1 row, 5 rows and the whole batch: log-probs and entropies,
    float64, to FLOAT64_REL of the largest element."""
    policies = make_policies(tiny_model_dir, dtype="float64")
    model = policies.models[0]
    ids, att, pos, cmask = pad_pairs(PROMPTS, COMPS, 2)
    head = scoring.lm_head(model)
    with torch.no_grad():
        _, states, head, autocast = scoring.predicting_states(model, head, cmask.shape[1] + 1, input_ids=ids,
                                                              attention_mask=att, position_ids=pos, use_cache=False)
        states, targets = states[:, :-1], ids[:, -cmask.shape[1]:]
        results = [scoring.token_logprobs(states, targets, cmask, head, True, autocast, chunk_elements=n)
                   for n in (1, 5 * 49152, 1 << 30)]
    for logp, entropy in results[1:]:
        assert logp.dtype == torch.float64
        assert_close_to_scale(logp, results[0][0], FLOAT64_REL, "log-probs")
        assert_close_to_scale(entropy, results[0][1], FLOAT64_REL, "entropies")
    empty = scoring.token_logprobs(states, targets, torch.zeros_like(cmask), head)[0]
    assert empty.shape == cmask.shape and torch.all(empty == 0)
