"""CoLLM's avoidable cost: the critic reads its collection-time values off its update's own
forward/backward pass (Critic.fit_fresh) wherever that is exact. The fast path must give the same
advantages, TD targets, critic stats and weights as the reference (a no-grad pass at collection,
then the update's pass) with half the critic passes, and must stay off wherever it would not be
exact."""

from __future__ import annotations

import pytest
import torch

import marl_llm.algos.critic as critic_module
from conftest import FLOAT64_REL, assert_close_to_scale
from test_agents import snapshot
from test_collm import build, critic_params, problems


def passes(monkeypatch) -> dict[str, int]:
    """Counts the critics' forward passes (sequence_values calls) with and without gradients."""
    count = {"grad": 0, "no_grad": 0}
    original = critic_module.sequence_values

    def counted(*args, **kwargs):
        count["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(critic_module, "sequence_values", counted)
    return count


CASES = [
    ("collm_cc", "strbuild", ["algo.num_turns=2"]),  # TD(0) over 2-turn trajectories
    ("collm_dc", "strbuild", ["algo.num_turns=2", "algo.estimator=gae", "algo.critic.value_clip=0.2"]),
    ("collm_cc", "tldr", ["algo.critic.kind=q", "trainer.prompts_per_step=5"]),  # Q(h, a); 2 micro-batches
]


@pytest.mark.numerics
@pytest.mark.parametrize("algo_name,task,extra", CASES)
def test_critic_values_off_the_update_pass_match_the_reference(tiny_model_dir, tmp_path, monkeypatch, algo_name, task,
                                                               extra):
    """Critic values read off the update's own pass (fit_fresh) vs a no-grad pass at collection
    then the update (the reference): advantages, values, TD targets, critic stats and the critic's
    and actors' weights after the step, float64 (model.dtype=float64), to FLOAT64_REL of the
    largest element (stats: of their value, or absolutely for a stat near 0). CoLLM stores the
    advantages, values and targets in float32 (as every run's advantages), so those compare the
    float32 roundings of the two paths' float64 numbers. Seen: every difference 0."""
    extra = [*extra, "algo.learning_rate=1e-3", "algo.critic.learning_rate=1e-2", "model.dtype=float64"]
    fast = build(tiny_model_dir, tmp_path / "fast", algo_name, task, *extra)
    ref = build(tiny_model_dir, tmp_path / "ref", algo_name, task, *extra)
    monkeypatch.setattr(ref, "_fits_at_collection", lambda critic, spans: False)
    assert fast.policies.dtype == torch.float64 and all(c.head.net[-1].weight.dtype == torch.float64
                                                        for c in fast.critics)
    assert all(torch.equal(a, b) for a, b in zip(critic_params(fast).values(), critic_params(ref).values()))
    before = critic_params(fast)
    tree = fast.collect(problems(fast, 5 if task == "tldr" else 3))
    count = passes(monkeypatch)
    fast_batches = fast.advantages(tree)
    fast_critic = list(fast._critic_batches)
    assert fast_critic and all(cb.fitted for cb in fast_critic)
    fast_stats = fast.update(fast_batches)
    fast_passes = dict(count)
    count.update(grad=0, no_grad=0)
    ref_batches = ref.advantages(tree)
    ref_critic = list(ref._critic_batches)
    ref_stats = ref.update(ref_batches)
    # The reference runs every micro-batch twice (no-grad values, then the update); the fast path once.
    assert fast_passes["no_grad"] == 0 and count["no_grad"] == count["grad"] == fast_passes["grad"] > 0
    for fb, rb in zip(fast_batches, ref_batches):
        assert_close_to_scale(fb.advantages, rb.advantages, FLOAT64_REL, "advantages")
    for fc, rc in zip(fast_critic, ref_critic, strict=True):
        assert_close_to_scale(fc.old_values, rc.old_values, FLOAT64_REL, "values")
        assert_close_to_scale(fc.targets, rc.targets, FLOAT64_REL, "targets")
    assert fast_stats.keys() == ref_stats.keys()
    for key, value in ref_stats.items():
        assert fast_stats[key] == pytest.approx(value, rel=FLOAT64_REL, abs=FLOAT64_REL), key
    # Same critic step, same actor steps.
    moved = 0.0
    for (name, a), b in zip(critic_params(fast).items(), critic_params(ref).values()):
        assert_close_to_scale(a, b, FLOAT64_REL, str(name))
        moved = max(moved, float((a - before[name]).abs().max()))
    assert moved > 1e-6  # the critic stepped
    for fm, rm in zip(snapshot(fast.policies), snapshot(ref.policies)):
        for name in fm:
            assert_close_to_scale(fm[name], rm[name], FLOAT64_REL, name)


def test_critic_is_untouched_until_the_update(tiny_model_dir, tmp_path):
    """advantages() leaves the critic's weights as they were (the step waits for update()), so
    values read between the two are still the collection-time values."""
    algo = build(tiny_model_dir, tmp_path, "collm_cc", "strbuild", "algo.num_turns=2", "algo.critic.learning_rate=1e-2")
    before = critic_params(algo)
    tree = algo.collect(problems(algo))
    algo.advantages(tree)
    assert all(torch.equal(before[k], v) for k, v in critic_params(algo).items())
    assert any(p.grad is not None for p in algo.critics[0].params)  # the gradient waits in .grad
    algo.update(algo.advantages(tree))  # a second advantages() starts over (no doubled gradient)
    assert {int(s["step"]) for s in algo.critics[0].optimizer.state.values()} == {1}
    with pytest.raises(RuntimeError, match="without a fit_fresh"):
        algo.critics[0].step_fitted()


@pytest.mark.parametrize("algo_name,extra,micro_batch", [
    ("collm_cc", ["algo.rollout_buffer_size=3"], 4),  # buffered: the critic steps on other samples first
    ("collm_dc", ["algo.critic.placement=actor"], 4),  # the trunk is the actor's adapter: the actor step moves it
    ("collm_cc", ["algo.critic.placement=separate"], 4),  # a full model's gradient would wait across the actor update
    ("collm_cc", ["algo.lora.dropout=0.1"], 4),  # a train-mode pass is random
    ("collm_cc", ["algo.num_turns=2"], 1),  # a 2-turn trajectory does not fit a micro-batch of 1
])
def test_reference_path_where_the_fast_one_would_not_be_exact(tiny_model_dir, tmp_path, monkeypatch, algo_name, extra,
                                                               micro_batch):
    algo = build(tiny_model_dir, tmp_path, algo_name, "strbuild", *extra)
    for c in algo.critics:
        c.micro_batch_size = micro_batch
    count = passes(monkeypatch)
    algo.update(algo.advantages(algo.collect(problems(algo))), end_of_epoch=True)
    assert count["no_grad"] > 0  # the collection-time values had a pass of their own


def test_trajectories_never_split_across_critic_micro_batches(tiny_model_dir, tmp_path):
    algo = build(tiny_model_dir, tmp_path, "collm_cc", "strbuild")
    c = algo.critics[0]
    c.micro_batch_size = 3
    prompts = [torch.ones(n, dtype=torch.long) for n in (5, 1, 4, 2, 9, 3, 7)]
    # Alone: sorted by length, cut every micro_batch_size samples (less padding).
    assert c._chunks(prompts, None) == [[1, 3, 5], [2, 0, 6], [4]]
    groups = [[0, 1], [2, 3], [4], [5, 6]]
    chunks = c._chunks(prompts, None, groups)
    assert sorted(j for ch in chunks for j in ch) == list(range(7)) and all(len(ch) <= 3 for ch in chunks)
    assert all(any(set(g) <= set(ch) for ch in chunks) for g in groups)
