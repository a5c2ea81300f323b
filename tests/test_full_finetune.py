"""Full fine-tuning (`algo.lora=null`): each policy owns a whole copy of its base, every weight
trained by its own AdamW; fp32 master weights under autocast; a frozen reference copy only when
the KL needs one; what assumes LoRA adapters is refused in one line; exact resume; and the decode
loop generates what `transformers` generates from the same model."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import FLOAT64_REL, TEST_DEVICE, assert_close_to_scale, compose_config, tiny_overrides
from marl_llm.distributed import fsdp
from marl_llm.models import policies as models
from marl_llm.runs.checkpoint import load_checkpoint
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.models.policies import AgentPolicies
from marl_llm.rollout.base import GenRequest
from marl_llm.rollout.decode import HFRollout, encode_prompt
from marl_llm.rollout.sampling import SamplingParams
from marl_llm.training.setup import build
from marl_llm.training.trainer import train, train_step

from test_agents import assert_same_float64_states, make_batches, magrpo
from test_trainer import adapters, same_adapters


def full(overrides: list[str]) -> list[str]:
    """Overrides without the LoRA settings, with algo.lora=null. top_p=1: the tiny random model's
    nucleus is the whole vocabulary, whose sort would be most of a step's time."""
    return [o for o in overrides if not o.startswith("algo.lora")] + ["algo.lora=null", "algo.sampling.top_p=1.0"]


def base_overrides(model_dir, run_dir, *extra):
    return full(tiny_overrides(model_dir, run_dir, "trainer.eval_before=false", "trainer.eval_after=false", *extra))


def snapshot(models_):
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models_]


def moved(before, model) -> list[str]:
    return [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]


def assert_every_weight_moved(before, policies):
    for k, m in enumerate(policies.models):
        names = [n for n, _ in m.named_parameters()]
        assert names and all(p.requires_grad for p in m.parameters())
        assert sorted(moved(before[k], m)) == sorted(names), f"policy {k}: some weights did not move"


def assert_policies_differ(policies):
    a, b = (dict(m.named_parameters()) for m in policies.models[:2])
    assert any(not torch.equal(a[n], b[n]) for n in a)


def one_step(cfg):
    validate(cfg)
    run = build(cfg)
    before = snapshot(run.policies.models)
    refs = snapshot(run.policies.references)
    _, metrics = train_step(run, cfg, 0)
    return run, before, refs, metrics


def small_policies(model_dir, agents=("aux", "main"), dtype="auto", **algo):
    model_cfg = OmegaConf.create(dict(name="tiny", path=str(model_dir), embedded=False, hub_id=None, dtype=dtype,
                                      device=TEST_DEVICE, attn_implementation="sdpa", trust_remote_code=False,
                                      agent_bases=None))
    algo_cfg = OmegaConf.create({**dict(adapters="per_agent", learning_rate=1e-3, weight_decay=0.0, policy_map={},
                                        lora=None), **algo})
    return AgentPolicies(tuple(agents), model_cfg, algo_cfg, 0)


# --------------------------------------------------------------------------------- training
def test_magrpo_trains_every_weight_of_each_agents_own_copy(tiny_model_dir, tmp_path):
    # The raw baseline: advantage = shifted reward (nonzero), so the tiny model really learns.
    # kl_coef > 0 keeps one frozen reference copy of the base, which must not move.
    cfg = compose_config(base_overrides(tiny_model_dir, tmp_path, "algo.baseline=raw", "algo.kl_coef=0.05",
                                        "algo.kl_mode=loss"))
    run, before, refs, metrics = one_step(cfg)
    p = run.policies
    assert p.full and len(p.models) == 2 and len(p.optimizers) == 2 and len(p.references) == 1
    assert [(a.model_index, a.adapter) for a in p.agents] == [(0, "agent_aux"), (1, "agent_main")]
    assert p.models[0] is not p.models[1] and all(m is not p.references[0] for m in p.models)
    assert_every_weight_moved(before, p)
    assert_policies_differ(p)
    assert moved(refs[0], p.references[0]) == [] and not any(q.requires_grad for q in p.references[0].parameters())
    # Each optimizer holds exactly its policy's parameters; metric names as with LoRA.
    for (k, _), opt in p.optimizers.items():
        assert {id(q) for g in opt.param_groups for q in g["params"]} == {id(q) for q in p.models[k].parameters()}
    assert {"aux/loss", "main/loss", "aux/kl", "main/grad_norm", "loss", "entropy"} <= set(metrics)


def test_shared_policy_is_one_model_and_no_reference_without_kl(tiny_model_dir):
    p = small_policies(tiny_model_dir, agents=("a", "b", "c"), adapters="shared")
    assert len(p.models) == 1 and [a.model_index for a in p.agents] == [0, 0, 0] and p.references == []
    assert p.policy_label(p.trainable_adapters()[0]) == "shared"
    with pytest.raises(RuntimeError, match="kl_coef"):
        with p.reference(0):
            pass
    three = small_policies(tiny_model_dir, agents=("tool", "plan", "judge"), kl_coef=0.1)
    assert len(three.models) == 3 and len(three.references) == 1  # one reference per base, not per policy


def test_at_grpo_trains_each_roles_full_copy(tiny_model_dir, tmp_path, monkeypatch):
    from marl_llm.algos import at_grpo

    # The tiny model scores 0 everywhere, so group advantages would all be 0: force +-1.
    monkeypatch.setattr(at_grpo, "group_advantages", lambda scores, *a: [(-1.0) ** j for j in range(len(scores))])
    overrides = [o for o in tiny_overrides(tiny_model_dir, tmp_path) if not o.startswith(("algo.", "task."))]
    cfg = compose_config(full(["algo=at_grpo", "task=humaneval", *overrides, "task.data.train_split='test[33:37]'",
                               "algo.sampling.max_new_tokens=6", "algo.num_branches=2", "algo.adapters=per_agent",
                               "trainer.eval_before=false", "trainer.eval_after=false"]))
    run, before, _, metrics = one_step(cfg)
    assert len(run.policies.models) == 2 and run.policies.references == []
    assert_every_weight_moved(before, run.policies)
    assert_policies_differ(run.policies)
    assert {"aux/loss", "main/loss"} <= set(metrics)


def test_collm_cc_with_a_separate_critic(tiny_model_dir, tmp_path):
    cfg = compose_config(full(["model=local", f"model.path={tiny_model_dir}", "logger=none", f"run_dir={tmp_path}",
                               "algo=collm_cc", "task=strbuild", "algo.sampling.max_new_tokens=6",
                               "trainer.max_steps=1", "trainer.prompts_per_step=3", "algo.critic.placement=separate"]))
    run, before, _, metrics = one_step(cfg)
    p, critic = run.policies, run.algo.critics[0]
    assert all(critic.model is not m for m in p.models) and critic.adapter is None
    assert_every_weight_moved(before, p)
    assert_policies_differ(p)
    assert "critic/vf_loss" in metrics


@pytest.mark.numerics
def test_gradient_checkpointing_gives_the_same_full_update(tiny_model_dir):
    """A full fine-tuning MAGRPO update with gradient checkpointing vs without: every weight after
    the step, float64, to FLOAT64_REL of the weight's largest element; the step moves every
    weight."""
    results, initial = [], None
    for checkpointing in (False, True):
        p = small_policies(tiny_model_dir, dtype="float64")
        if checkpointing:
            p.enable_gradient_checkpointing()
        else:
            initial = p.adapter_state()
        torch.manual_seed(0)
        magrpo(p, "algo.lora=null").update(make_batches(p))
        results.append(p.adapter_state())
    plain, ckpt = results
    assert_same_float64_states(ckpt, plain)
    assert all(not torch.equal(w, initial[k][n]) for k in plain for n, w in plain[k].items())  # every weight moved


# --------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("algo, extra, match", [
    ("magrpo", ["trainer.rollout=vllm"], "use trainer.rollout=hf"),
    ("collm_cc", ["algo.critic.placement=adapter"], "use algo.critic.placement=separate"),
    ("collm_dc", ["algo.critic.placement=actor"], "use algo.critic.placement=separate"),
])
def test_what_assumes_adapters_is_refused_in_one_line(tmp_path, algo, extra, match):
    cfg = compose_config(full([f"algo={algo}", "task=strbuild" if algo != "magrpo" else "task=humaneval",
                               f"run_dir={tmp_path}", *extra]))
    with pytest.raises(UserError, match=match) as err:
        validate(cfg)
    assert "\n" not in str(err.value) and "algo.lora=null" in str(err.value)


def test_full_fine_tuning_is_accepted_with_fsdp(tmp_path):
    """trainer.fsdp shards fully fine-tuned policies (and a separate critic): no refusal."""
    for algo in ("magrpo", "collm_cc"):
        cfg = compose_config(full([f"algo={algo}", "task=strbuild" if algo != "magrpo" else "task=humaneval",
                                   f"run_dir={tmp_path}", "trainer.fsdp=true",
                                   *(["algo.critic.placement=separate"] if algo == "collm_cc" else [])]))
        validate(cfg)
        fsdp.check_supported(cfg)


def test_point_of_use_guards(tiny_model_dir):
    p = small_policies(tiny_model_dir)
    with pytest.raises(UserError, match="use algo.critic.placement=separate"):
        p.add_adapter(0, "critic")
    from marl_llm.rollout.vllm import VLLMRollout

    with pytest.raises(UserError, match="use trainer.rollout=hf"):
        VLLMRollout(p)


# -------------------------------------------------------------------------------- checkpoints
def test_exact_resume_and_a_mismatched_resume_is_refused(tiny_model_dir, tmp_path):
    def overrides(run_dir, steps, *extra):
        return base_overrides(tiny_model_dir, run_dir, f"trainer.max_steps={steps}", "trainer.save_every=1",
                              "algo.baseline=raw", "algo.learning_rate=1e-3", "trainer.deterministic=true", *extra)

    train(compose_config(overrides(tmp_path / "straight", 2)))
    train(compose_config(overrides(tmp_path / "resumed", 1)))
    train(compose_config(overrides(tmp_path / "resumed", 2, "trainer.resume=true")))
    straight, resumed = adapters(tmp_path / "straight"), adapters(tmp_path / "resumed")
    assert set(straight) == {"0/agent_aux", "1/agent_main"}
    assert all(len(t) == 20 for t in straight.values())  # every weight of the tiny Llama (tied embeddings)
    assert same_adapters(straight, resumed)
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(not torch.equal(init[n], t) for w in straight.values() for n, t in w.items())  # really trained
    opt_a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["optimizers"]
    opt_b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)["optimizers"]
    for key in opt_a:
        for i, state in opt_a[key]["state"].items():
            assert all(torch.equal(state[s], opt_b[key]["state"][i][s]) for s in ("exp_avg", "exp_avg_sq"))
    # A LoRA config cannot resume full weights (nor the reverse): one line naming the fix.
    from conftest import make_policies

    with pytest.raises(UserError, match="holds full weights .* but this config trains LoRA adapters.*new run dir"):
        load_checkpoint(tmp_path / "straight", make_policies(tiny_model_dir))


# --------------------------------------------------------------------------------- generation
@pytest.mark.numerics
def test_decode_loop_equals_transformers_greedy_generate(tiny_model_dir):
    """The decode loop vs transformers' `generate` on a fully fine-tuned policy, greedy: the same
    token ids, on a float64 model (a near-tie between two tokens cannot flip on rounding)."""
    p = small_policies(tiny_model_dir, dtype="float64")
    torch.manual_seed(1)
    with torch.no_grad():  # make policy 1 a different model from the base it was copied from
        for q in p.models[1].parameters():
            q.add_(torch.randn_like(q) * 0.05)
    tok = p.tokenizers[1]
    messages = ["Write a function that adds two numbers.", "hi"]
    out = HFRollout(p).generate([GenRequest(1, m, SamplingParams(temperature=0.0, max_new_tokens=10))
                                 for m in messages])
    for m, c in zip(messages, out):
        ids = torch.tensor([encode_prompt(tok, m)])
        ref = p.models[1].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                   eos_token_id=p.eos_ids[1], pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        n = len(c.completion_ids)
        assert c.completion_ids.tolist() == ref[:n].tolist() and (c.truncated or n == len(ref))


def test_fp32_master_weights_under_autocast(tiny_model_dir, monkeypatch):
    """What model.dtype=bfloat16 does on CUDA, exercised with CPU autocast: fp32 parameters and
    optimizer state, bf16 compute; the frozen reference stays bf16."""
    monkeypatch.setattr(models, "master_weights_dtype", lambda device, dtype: None if dtype == torch.float32 else dtype)
    p = small_policies(tiny_model_dir, dtype="bfloat16", kl_coef=0.1)
    assert p.autocast_dtype == torch.bfloat16
    assert all(q.dtype == torch.float32 for m in p.models for q in m.parameters())
    assert all(q.dtype == torch.bfloat16 for q in p.references[0].parameters())
    ids = torch.tensor([[1, 5, 6, 7]])
    assert p.models[0](input_ids=ids).logits.dtype == torch.bfloat16  # computed under autocast
    before = snapshot(p.models)
    magrpo(p, "algo.lora=null", "algo.kl_coef=0.1", "algo.kl_mode=loss").update(make_batches(p))
    assert_every_weight_moved(before, p)
    state = next(iter(p.optimizers.values())).state
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    assert p.models[0].generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape == (1, 7)


# ------------------------------------------------------------------------ the trained LM head
@pytest.mark.numerics
def test_a_trained_head_is_chunked_by_tokens_with_the_same_logprobs_and_gradients(tiny_model_dir, monkeypatch):
    """Full fine-tuning trains the LM head (the tied embeddings): its chunks are sized by tokens
    (scoring.TRAINED_HEAD_CHUNK_TOKENS, here 8) instead of by logits (here 2 rows), so the [V, d]
    head's gradient is accumulated ceil(N / 8) times, not ceil(N / 2); log-probs and gradients
    equal the full-logits computation. Compared in float64, to 1e-12 of the largest element: the
    same computation regrouped (the chunks' sums) differs by round-off of ~1e-16, while a wrong
    token, mask or chunk boundary differs by far more; no CPU's summation order matters there."""
    from marl_llm.models import scoring
    from marl_llm.rollout.decode import completion_logprobs, pad_pairs

    monkeypatch.setattr(scoring, "LOGIT_CHUNK_ELEMENTS", 2 * 49152)
    monkeypatch.setattr(scoring, "TRAINED_HEAD_CHUNK_TOKENS", 8)
    p = small_policies(tiny_model_dir, dtype="float64")
    model = p.models[0]
    head = scoring.lm_head(model)
    assert head is not None and head.weight.requires_grad
    prompts = [torch.tensor([1, 40, 41, 42, 2]), torch.tensor([1, 60, 61]), torch.tensor([1, 70])]
    comps = [torch.tensor([50, 51, 52, 53, 2]), torch.tensor([54, 55, 56, 57, 58, 59, 60]), torch.tensor([61, 62, 63])]
    device = p.device
    calls = []
    handle = head.register_forward_hook(  # the chunks: [n, d] states with gradients (not the model's own call)
        lambda m, i, o: calls.append(i[0].shape[0]) if i[0].dim() == 2 and torch.is_grad_enabled() else None)

    def grads_of(logp):
        model.zero_grad(set_to_none=True)
        (logp * torch.linspace(0.5, 1.5, logp.numel(), device=device).view_as(logp)).sum().backward()
        return {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}

    logp, mask, _ = completion_logprobs(model, prompts, comps, 2)
    chunks = list(calls)
    got = grads_of(logp)
    handle.remove()
    assert chunks == [8, 7], calls  # 15 tokens in chunks of 8 (by logits: 8 chunks of 2)
    ids, att, pos, cmask = pad_pairs(prompts, comps, 2)
    C = cmask.shape[1]
    logits = model(input_ids=ids.to(device), attention_mask=att.to(device), position_ids=pos.to(device),
                   logits_to_keep=C + 1, use_cache=False).logits[:, :-1]
    ref = torch.log_softmax(logits, -1).gather(2, ids[:, -C:].to(device).unsqueeze(2)).squeeze(2) * cmask.to(device)
    want = grads_of(ref)
    assert torch.equal(mask, cmask.to(device))
    assert logp.dtype == torch.float64
    assert_close_to_scale(logp, ref, FLOAT64_REL, "log-probs")
    assert set(got) == set(want) and any(n.endswith("embed_tokens.weight") for n in got)  # the tied head trains
    for n in want:
        assert want[n].abs().max() > 0
        assert_close_to_scale(got[n], want[n], FLOAT64_REL, n)


# ------------------------------------------------------------------- trainer.master_weights=bf16
def test_bf16_master_weights_train_in_bf16_without_autocast_and_the_plan_halves_adams_state(tiny_model_dir, tmp_path):
    """trainer.master_weights=bf16 (the references' precision): a full fine-tuning run keeps its
    weights, gradients and AdamW moments in bf16 and computes without autocast, LoRA adapters are
    bf16 too, a float32 model.dtype is refused in one line, and the memory plan counts 2 bytes a
    weight (AdamW's state halves)."""
    from marl_llm.distributed import memory_plan

    overrides = tiny_overrides(tiny_model_dir, tmp_path, "algo.lora=null", "model.dtype=bfloat16",
                               "trainer.master_weights=bf16", "trainer.eval_before=false", "algo.baseline=raw")
    cfg = compose_config(overrides)
    validate(cfg)
    run = build(cfg)
    model = run.policies.models[0]
    assert run.policies.autocast_dtype is None and not hasattr(model, "marl_autocast")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(run, cfg, 0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    moments = [v for opt in run.policies.optimizers.values() for st in opt.state.values()
               for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())  # it trained

    lora = build(compose_config(tiny_overrides(tiny_model_dir, tmp_path / "lora", "model.dtype=bfloat16",
                                               "trainer.master_weights=bf16")))
    assert {p.dtype for k in lora.policies.trainable_adapters() for p in lora.policies.adapter_parameters(*k)} \
        == {torch.bfloat16}
    with pytest.raises(UserError, match=r"^trainer.master_weights=bf16 keeps the trained weights in model.dtype, "
                                        r"which is float32 here: set model.dtype=bfloat16"):
        build(compose_config(tiny_overrides(tiny_model_dir, tmp_path / "f32", "trainer.master_weights=bf16",
                                            "model.dtype=float32")))

    preset = ["experiment=at_grpo_sokoban_qwen3_8b_paper", "run_dir=/tmp/p"]
    fp32, bf16 = (memory_plan.for_config(compose_config(preset + extra), ("tool", "plan"), 8, None)
                  for extra in ([], ["trainer.master_weights=bf16"]))
    assert (fp32.work.master_bytes, bf16.work.master_bytes) == (4, 2)
    assert bf16.optimizer * 2 == fp32.optimizer and bf16.weights < fp32.weights
