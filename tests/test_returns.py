"""TD(0) targets and GAE against hand computation; per-group advantage normalization."""

from __future__ import annotations

import pytest
import torch

from marl_llm.algos.returns import gae, normalize_per_group, td0

R = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
V = torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64)


def test_td0_by_hand():
    adv, y = td0(R, V, gamma=0.9)
    # y_0 = 1 + 0.9 * 1.0, y_1 = 0 + 0.9 * 1.5, y_2 = 2 (episode done: no bootstrap)
    assert y.tolist() == pytest.approx([1.9, 1.35, 2.0])
    assert adv.tolist() == pytest.approx([1.4, 0.35, 0.5])
    adv_cut, y_cut = td0(R, V, gamma=0.9, done=False, last_value=3.0)
    assert y_cut[-1].item() == pytest.approx(2.0 + 0.9 * 3.0) and adv_cut[:2].tolist() == pytest.approx([1.4, 0.35])


def test_gae_by_hand():
    gamma, lam = 0.9, 0.5
    d = [1.0 + 0.9 * 1.0 - 0.5, 0.0 + 0.9 * 1.5 - 1.0, 2.0 - 1.5]
    a2 = d[2]
    a1 = d[1] + gamma * lam * a2
    a0 = d[0] + gamma * lam * a1
    adv, y = gae(R, V, gamma, lam)
    assert adv.tolist() == pytest.approx([a0, a1, a2])
    assert y.tolist() == pytest.approx([a0 + 0.5, a1 + 1.0, a2 + 1.5])


def test_gae_limits():
    assert gae(R, V, 0.9, 0.0)[0].tolist() == pytest.approx(td0(R, V, 0.9)[0].tolist())
    mc = [1.0 + 0.9 * 0.0 + 0.81 * 2.0, 0.0 + 0.9 * 2.0, 2.0]  # discounted returns
    assert gae(R, V, 0.9, 1.0)[0].tolist() == pytest.approx([m - v for m, v in zip(mc, V.tolist())])


def test_normalize_per_group_skips_single_samples():
    a = torch.tensor([1.0, 3.0, 10.0, 5.0])
    out = normalize_per_group(a, [(0, 0), (0, 0), (1, 0), (0, 1)])
    assert out[:2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert out[2].item() == 10.0 and out[3].item() == 5.0


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="must be equal"):
        td0(R, V[:2], 0.9)
