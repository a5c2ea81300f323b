"""Policy losses: REINFORCE gradient, aggregations, masking, PPO clipping, k3 KL, stats."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import FLOAT64_REL, assert_close_to_scale
from marl_llm.algos.losses import AGGREGATIONS, POLICY_LOSSES, k3_kl, policy_loss

B, T, V = 4, 6, 5
STAT_KEYS = {
    "loss", "pg_loss", "ratio_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
}


def make_batch(seed=0):
    """Token log-probs from a leaf of logits, a mask with prompt (left) and padding (right)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b, (start, end) in enumerate([(1, 6), (2, 4), (0, 3), (3, 6)]):
        mask[b, start:end] = 1.0
    adv = torch.tensor([1.5, -0.5, 2.0, -1.0], dtype=torch.float64)
    return logits, tokens, mask, adv


def token_logp(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def grad_of(fn, logits):
    logits.grad = None
    fn().backward()
    return logits.grad.clone()


def test_registries():
    assert {"reinforce", "ppo_clip"} <= set(POLICY_LOSSES)
    assert {"seq_sum", "token_mean"} <= set(AGGREGATIONS)


@pytest.mark.numerics
@pytest.mark.parametrize("old_is_none", [False, True])
def test_seq_sum_gradient_is_reinforce(old_is_none):
    """policy_loss (seq_sum) vs the REINFORCE formula written out: the gradient with respect to the
    logits, float64, to FLOAT64_REL of its largest element; the loss value vs the on-policy formula."""
    logits, tokens, mask, adv = make_batch()

    def ours():
        lp = token_logp(logits, tokens)
        loss, stats = policy_loss(lp, None if old_is_none else lp.detach(), adv, mask, "seq_sum")
        assert set(stats) == STAT_KEYS and all(isinstance(v, float) for v in stats.values())
        assert stats["ratio_mean"] == pytest.approx(1.0)
        assert stats["clip_ratio/region_mean"] == 0.0
        # on-policy value: -(1/B) sum_b A_b * (number of completion tokens of b)
        want = -(adv * mask.sum(-1).double()).sum().item() / B
        assert loss.item() == pytest.approx(want)
        assert stats["loss"] == pytest.approx(want)
        return loss

    def manual():
        lp = token_logp(logits, tokens)
        return -(adv[:, None] * lp * mask).sum() / B

    g1, g2 = grad_of(ours, logits), grad_of(manual, logits)
    assert g1.abs().sum() > 0 and g1.dtype == torch.float64
    assert_close_to_scale(g1, g2, FLOAT64_REL, "gradient")


@pytest.mark.numerics
def test_token_mean_aggregation():
    """policy_loss (token_mean) vs its formula written out: the gradient, float64, to FLOAT64_REL
    of its largest element; the value at ratio 1 vs its formula."""
    logits, tokens, mask, adv = make_batch(1)

    def ours():
        lp = token_logp(logits, tokens)
        return policy_loss(lp, lp.detach(), adv, mask, "token_mean")[0]

    def manual():
        lp = token_logp(logits, tokens)
        return -(adv[:, None] * lp * mask).sum() / mask.sum()

    assert_close_to_scale(grad_of(ours, logits), grad_of(manual, logits), FLOAT64_REL, "gradient")
    lp = token_logp(logits, tokens)
    loss = policy_loss(lp, lp.detach(), adv, mask, "token_mean")[0]
    want = -(adv[:, None] * mask).sum() / mask.sum()  # ratio value 1
    assert loss.item() == pytest.approx(want.item())
    # token_mean and seq_sum differ (different token counts per sequence)
    seq = policy_loss(lp, lp.detach(), adv, mask, "seq_sum")[0]
    assert not math.isclose(loss.item(), seq.item())


@pytest.mark.numerics
def test_seq_mean_token_mean_aggregation():
    """policy_loss (seq_mean_token_mean) vs its formula written out: the gradient, float64, to
    FLOAT64_REL of its largest element."""
    logits, tokens, mask, adv = make_batch(2)

    def ours():
        lp = token_logp(logits, tokens)
        return policy_loss(lp, lp.detach(), adv, mask, "seq_mean_token_mean")[0]

    def manual():
        lp = token_logp(logits, tokens)
        return (-(adv[:, None] * lp * mask).sum(-1) / mask.sum(-1)).mean()

    assert_close_to_scale(grad_of(ours, logits), grad_of(manual, logits), FLOAT64_REL, "gradient")


@pytest.mark.numerics
@pytest.mark.parametrize("aggregation", ["seq_sum", "token_mean"])
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_masked_tokens_contribute_nothing(aggregation, clip_eps):
    """The loss with 0, NaN or -1e4 in the masked (prompt, padding) positions: the same loss and
    stats, and the same gradient, float64, to FLOAT64_REL of its largest element; exactly 0 there."""
    _, _, mask, adv = make_batch()
    torch.manual_seed(0)
    base = torch.randn(B, T, dtype=torch.float64) - 2
    old = base + 0.1 * torch.randn(B, T, dtype=torch.float64)
    ref = base + 0.3 * torch.randn(B, T, dtype=torch.float64)
    m = mask.bool()

    def run(fill):
        lp = torch.where(m, base, torch.full_like(base, fill)).requires_grad_(True)
        loss, stats = policy_loss(
            lp, torch.where(m, old, fill), adv, mask, aggregation, clip_eps, torch.where(m, ref, fill), 0.1
        )
        loss.backward()
        return loss, stats, lp.grad

    loss_a, stats_a, grad_a = run(0.0)
    loss_b, stats_b, grad_b = run(float("nan"))  # garbage in prompt/padding positions
    loss_c, _, _ = run(-1e4)
    assert torch.isfinite(loss_b) and torch.isfinite(grad_b).all()
    assert loss_a.item() == pytest.approx(loss_b.item()) == pytest.approx(loss_c.item())
    assert stats_a == pytest.approx(stats_b)
    assert (grad_b[~m] == 0).all() and (grad_a[~m] == 0).all()
    assert (grad_b[m] != 0).all()
    assert_close_to_scale(grad_b, grad_a, FLOAT64_REL, "gradient")


@pytest.mark.numerics
def test_clipping_zeroes_gradient_outside_trust_region():
    """PPO clipping vs the gradient written out by hand (-r A / B, or 0 where clipped): float64,
    to FLOAT64_REL of its largest element; the stats and the loss value vs their formulas."""
    eps = 0.2
    ratios = torch.tensor([1.5, 0.5, 1.05, 0.9], dtype=torch.float64)
    old = torch.zeros(2, 4, dtype=torch.float64)
    lp = ratios.log().repeat(2, 1).requires_grad_(True)
    adv = torch.tensor([2.0, -3.0], dtype=torch.float64)  # row 0 positive, row 1 negative
    mask = torch.ones(2, 4)
    loss, stats = policy_loss(lp, old, adv, mask, "seq_sum", clip_eps=eps)
    loss.backward()
    g = lp.grad
    # A > 0: ratio 1.5 (> 1 + eps) clipped -> 0; ratio 0.5 stays unclipped (min picks r*A)
    # A < 0: ratio 0.5 (< 1 - eps) clipped -> 0; ratio 1.5 stays unclipped
    # unclipped token gradient of -(r A)/B w.r.t. logp is -r A / B
    want = torch.tensor(
        [[0.0, -0.5 * 2.0 / 2, -1.05 * 2.0 / 2, -0.9 * 2.0 / 2],
         [1.5 * 3.0 / 2, 0.0, 1.05 * 3.0 / 2, 0.9 * 3.0 / 2]],
        dtype=torch.float64,
    )
    assert_close_to_scale(g, want, FLOAT64_REL, "gradient")
    assert torch.all(g[want == 0] == 0)  # clipped tokens: no gradient at all
    assert stats["clip_ratio/high_mean"] == pytest.approx(1 / 8)
    assert stats["clip_ratio/low_mean"] == pytest.approx(1 / 8)
    assert stats["clip_ratio/region_mean"] == pytest.approx(2 / 8)
    assert stats["ratio_mean"] == pytest.approx(ratios.mean().item())
    # loss value: clipped tokens use the clipped ratio
    vals = [[1.2 * 2, 0.5 * 2, 1.05 * 2, 0.9 * 2], [1.5 * -3, 0.8 * -3, 1.05 * -3, 0.9 * -3]]
    assert loss.item() == pytest.approx(-sum(map(sum, vals)) / 2)
    # a zero advantage is never counted as clipped
    zero = policy_loss(lp.detach(), old, torch.zeros(2, dtype=torch.float64), mask, clip_eps=eps)[1]
    assert zero["clip_ratio/region_mean"] == 0.0
    # without clipping every token has gradient -r A / B
    lp2 = lp.detach().clone().requires_grad_(True)
    policy_loss(lp2, old, adv, mask, "seq_sum", clip_eps=None)[0].backward()
    assert (lp2.grad != 0).all()


def test_asymmetric_clip_high():
    lp = torch.tensor([[math.log(1.25)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 1)
    policy_loss(lp, old, adv, mask, clip_eps=0.2)[0].backward()
    assert lp.grad.item() == 0.0
    lp.grad = None
    policy_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)[0].backward()
    assert lp.grad.item() == pytest.approx(-1.25)


def test_k3_kl():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert k3_kl(lp, lp.clone(), mask).item() == 0.0
    ref = lp + torch.tensor([[1.0, -0.5, 5.0]], dtype=torch.float64)  # last token masked
    want = (math.e - 1 - 1) + (math.exp(-0.5) + 0.5 - 1)
    kl = k3_kl(lp, ref, mask)
    assert kl.shape == (1,) and kl.item() == pytest.approx(want) and kl.item() > 0
    torch.manual_seed(0)
    a, b = torch.randn(3, 7), torch.randn(3, 7)
    assert (k3_kl(a, b, torch.ones(3, 7)) > 0).all()


@pytest.mark.numerics
def test_kl_term_in_loss():
    """The k3 KL term vs its formula (values); the gradient with a KL term at logp == ref vs
    without one (the KL's gradient vanishes there), float64, to FLOAT64_REL of its largest element."""
    logits, tokens, mask, adv = make_batch(3)
    lp = token_logp(logits, tokens)
    ref = (lp + 0.3).detach()
    base, s0 = policy_loss(lp, lp.detach(), adv, mask, "token_mean", ref_logp=ref, kl_coef=0.0)
    with_kl, s1 = policy_loss(lp, lp.detach(), adv, mask, "token_mean", ref_logp=ref, kl_coef=0.5)
    k3_tok = math.exp(0.3) - 0.3 - 1
    assert s0["kl"] == pytest.approx(k3_tok * mask.sum().item() / B)  # mean per-sequence sum
    assert "kl_loss" not in s0 and s1["kl_loss"] == pytest.approx(0.5 * k3_tok)
    assert with_kl.item() == pytest.approx(base.item() + 0.5 * k3_tok)
    assert "kl" not in policy_loss(lp, lp.detach(), adv, mask)[1]
    # KL gradient vanishes at logp == ref: adding the term changes nothing
    g_plain = torch.autograd.grad(policy_loss(lp, None, adv, mask)[0], logits, retain_graph=True)[0]
    g_same = torch.autograd.grad(
        policy_loss(lp, None, adv, mask, ref_logp=lp.detach(), kl_coef=1.0)[0], logits, retain_graph=True
    )[0]
    assert_close_to_scale(g_same, g_plain, FLOAT64_REL, "gradient")
    g_kl = torch.autograd.grad(with_kl, logits)[0]
    assert not torch.allclose(g_kl, g_plain)


def test_validation():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        policy_loss(lp, lp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(ValueError):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), aggregation="nope")
    with pytest.raises(ValueError):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), loss_type="ppo_clip")  # no clip_eps
