"""Memory-lean scoring (scoring.py): the chunked LM head gives the log-probs, entropies and
gradients of the full-logits computation, on the packed and shared-prompt paths, with gradient
checkpointing, under a full model's autocast, and falls back where the head is not the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close_to_scale, make_policies
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


def tolerance(policies) -> float:
    return 1e-5 if policies.dtype == torch.float32 else 5e-2


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


def chunked_and_reference(model_dir, shared: bool, checkpointing: bool, dtype: torch.dtype | None = None):
    """(lean, reference, policies): logp, mask, entropy and the LoRA gradients of agent 0 from the
    chunked head and from full logits, with the policies converted to `dtype` if given."""
    policies = make_policies(model_dir)
    if dtype is not None:
        for model in policies.models:
            model.to(dtype)
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
def test_chunked_logprobs_entropy_and_gradients_equal_full_logits(tiny_model_dir, small_chunks, shared, checkpointing):
    """In the model's dtype the two paths agree to rounding. Gradients are compared with the
    largest gradient element, not elementwise: a LoRA gradient element of 5e-3 is a sum of
    terms of order 1 that cancel, so it carries their rounding error, and that error depends on
    the CPU's BLAS code path (2e-5 on an AMD EPYC with MKL, and on Intel under
    MKL_CBWR=COMPATIBLE: 7.5e-6 of the largest element). The fp64 test below shows that this
    is rounding, not a difference between the paths."""
    new, ref, policies = chunked_and_reference(tiny_model_dir, shared, checkpointing)
    fp32 = policies.dtype == torch.float32
    values, grads = (1e-5, 1e-4) if fp32 else (tolerance(policies),) * 2
    assert torch.equal(new[1], ref[1])
    assert_close_to_scale(new[0], ref[0], values, "log-probs")
    assert_close_to_scale(new[2], ref[2], values, "entropies")
    assert torch.all(new[0][new[1] == 0] == 0) and torch.all(new[2][new[1] == 0] == 0)
    assert not new[2].requires_grad
    for g_new, g_ref in zip(new[3], ref[3]):
        assert g_ref.abs().sum() > 0
        assert_close_to_scale(g_new, g_ref, grads, "LoRA gradient")


@pytest.fixture
def fp64_norms(monkeypatch):
    """transformers' Llama RMSNorm computes in fp32 whatever the model's dtype; in an fp64 model
    that rounds the backward to fp32 (1e-7 of the largest gradient). Keep it in fp64 here."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_and_full_logits_are_the_same_computation(tiny_model_dir, small_chunks, fp64_norms, shared,
                                                          checkpointing):
    """In fp64 the chunked head and the full logits agree to 1e-12 of the largest element (seen:
    1e-15), where fp32 differs by up to 7.5e-6: the fp32 differences are floating-point
    reassociation (each path sums the vocabulary and the chunks' gradients in its own order),
    not a difference between the paths."""
    new, ref, _ = chunked_and_reference(tiny_model_dir, shared, checkpointing, torch.float64)
    assert new[0].dtype == torch.float64 and new[3][0].dtype == torch.float64
    assert torch.equal(new[1], ref[1])
    assert_close_to_scale(new[0], ref[0], 1e-12, "log-probs")
    assert_close_to_scale(new[2], ref[2], 1e-12, "entropies")
    for g_new, g_ref in zip(new[3], ref[3]):
        assert g_ref.abs().sum() > 0
        assert_close_to_scale(g_new, g_ref, 1e-12, "LoRA gradient")


def test_no_entropy_unless_asked_and_no_grad_scoring(tiny_model_dir):
    policies = make_policies(tiny_model_dir)
    with policies.acting(1) as model, torch.no_grad():
        logp, mask, entropy = completion_logprobs(model, PROMPTS, COMPS, 2)
        ref, _, _ = reference(model, PROMPTS, COMPS)
    assert entropy is None and not logp.requires_grad
    assert_close_to_scale(logp, ref, tolerance(policies), "log-probs")


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
    (models.full_model): the head chunks run under the same autocast."""
    from transformers import AutoModelForCausalLM

    from marl_llm.models.policies import full_model

    model = full_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                       torch.bfloat16, device_type="cpu")
    head = scoring.lm_head(model)
    ids, att, pos, cmask = pad_pairs(PROMPTS, COMPS, 2)
    _, states, used_head, autocast = scoring.predicting_states(model, head, 4, input_ids=ids, attention_mask=att,
                                                               position_ids=pos, use_cache=False)
    assert used_head is head and autocast == ("cpu", torch.bfloat16)
    assert states.shape == (3, 4, 32)
    new, mask, _ = completion_logprobs(model, PROMPTS, COMPS, 2)
    ref, _, _ = reference(model, PROMPTS, COMPS)
    targets = ids[:, -4:]
    with torch.no_grad():  # the same states through the head with and without its autocast
        kept = scoring.token_logprobs(states, targets, torch.ones_like(targets), head, autocast=autocast)[0]
        fp32 = scoring.token_logprobs(states, targets, torch.ones_like(targets), head, autocast=None)[0]
    # The model's own bf16 logits agree with the autocast head to fp32 rounding; a head run
    # without the autocast would be off by bf16 rounding (~1e-3 here).
    assert float((new.detach() - ref.detach()).abs().max()) < 1e-4 < float((kept - fp32).abs().max())
    new.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_a_logit_transform_the_head_does_not_show_falls_back_to_the_models_logits(tiny_model_dir):
    """If the model's logits are not head(hidden) (here a softcap added by a hook, invisible in
    the config), the check on the last position catches it: warning, then the model's own logits."""
    policies = make_policies(tiny_model_dir)
    with policies.acting(0) as model:
        base = model.get_base_model()
        base.register_forward_hook(lambda m, a, out: out.__setitem__("logits", 0.2 * torch.tanh(out.logits / 0.2)))
        with pytest.warns(UserWarning, match="falls back"):
            logp, mask, _ = completion_logprobs(model, PROMPTS, COMPS, 2)
        assert scoring.lm_head(model) is None  # remembered: no second lean attempt
        again, _, _ = completion_logprobs(model, [PROMPTS[0]] * 3, COMPS, 2)
        ref, _, _ = reference(model, PROMPTS, COMPS)
        ref_shared, _, _ = reference(model, [PROMPTS[0]] * 3, COMPS)
    tol = tolerance(policies)
    assert_close_to_scale(logp, ref, tol, "log-probs")
    assert_close_to_scale(again, ref_shared, tol, "log-probs, shared prompt")


def test_softcap_in_the_config_uses_the_full_logits_path(tiny_model_dir):
    """(An FSDP-sharded model keeps the chunked head: its root unit stays gathered after the
    forward pass, fsdp.shard_model; tests/test_fsdp.py scores through it on 2 ranks.)"""
    policies = make_policies(tiny_model_dir)
    model = policies.models[0]
    assert scoring.lm_head(model) is not None
    model.get_base_model().config.final_logit_softcapping = 30.0
    assert scoring.lm_head(model) is None
    with torch.no_grad():
        logp, _, entropy = completion_logprobs(model, PROMPTS, COMPS, 2, with_entropy=True)
        ref, _, ref_entropy = reference(model, PROMPTS, COMPS)
    assert_close_to_scale(logp, ref, tolerance(policies), "log-probs")
    assert_close_to_scale(entropy, ref_entropy, tolerance(policies), "entropies")


def test_chunk_size_does_not_change_the_result(tiny_model_dir):
    policies = make_policies(tiny_model_dir)
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
        assert_close_to_scale(logp, results[0][0], 1e-6, "log-probs")
        assert_close_to_scale(entropy, results[0][1], 1e-6, "entropies")
    empty = scoring.token_logprobs(states, targets, torch.zeros_like(cmask), head)[0]
    assert empty.shape == cmask.shape and torch.all(empty == 0)
