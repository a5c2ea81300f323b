"""The value head reads V(h) at the last prompt token and Q(h, a) at the last completion token,
whatever the padding of the batch.

The model and head run in float64 (the tiny model loaded as model.dtype=float64 loads it, norms
included), so a padded batch and an unpadded sequence compare to FLOAT64_REL (conftest.py): the
padded positions carry exactly zero attention weight, and only the regrouped sums differ."""

from __future__ import annotations

import pytest
import torch

from conftest import FLOAT64_REL, assert_close_to_scale
from marl_llm.algos.critic import ValueHead, read_positions, sequence_values


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from marl_llm.models.loading import norms_in_float64

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    assert norms_in_float64(m) > 0  # as load_base does for model.dtype=float64
    m.eval()
    return m


def single_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """Last-layer hidden state of the last token of one unpadded sequence."""
    out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][0, -1]


def test_head_init():
    head = ValueHead(32)
    lin = head.net[-1]
    assert torch.all(lin.bias == 0) and 0.005 < lin.weight.std().item() < 0.05
    assert len(ValueHead(32, hidden_layer=True).net) == 3


def test_read_positions():
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    assert read_positions(prompts, None).tolist() == [2, 2]
    assert read_positions(prompts, [torch.tensor([7, 8]), torch.tensor([9])]).tolist() == [4, 3]


@pytest.mark.numerics
def test_values_read_the_right_tokens_despite_padding(model):
    """Values of a padded batch against each sequence's own unpadded pass, both in float64: equal
    to FLOAT64_REL of the value (module docstring)."""
    torch.manual_seed(0)
    head = ValueHead(model.config.hidden_size).double()
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([11, 12])]
    completions = [torch.tensor([20, 21]), torch.tensor([30, 31, 32, 33])]
    with torch.no_grad():
        v = sequence_values(model, head, prompts, None, pad_id=0)
        q = sequence_values(model, head, prompts, completions, pad_id=0)
        for b in range(2):
            expect_v = head(single_hidden(model, prompts[b])[None])[0]
            expect_q = head(single_hidden(model, torch.cat([prompts[b], completions[b]]))[None])[0]
            assert v.dtype == q.dtype == torch.float64
            assert_close_to_scale(v[b], expect_v, FLOAT64_REL, f"V of sequence {b}")
            assert_close_to_scale(q[b], expect_q, FLOAT64_REL, f"Q of sequence {b}")
    assert not torch.allclose(v, q)


def test_values_are_differentiable_through_the_head(model):
    head = ValueHead(model.config.hidden_size).double()
    v = sequence_values(model, head, [torch.tensor([3, 4, 5])], None, pad_id=0)
    (v ** 2).sum().backward()
    assert head.net[-1].weight.grad is not None and head.net[-1].weight.grad.abs().sum() > 0
