"""models/memory.py: the KV cache's bytes from a config, the rollout's KV budget, and how the hf
rollout cuts a step's rows into generate calls within it."""

from __future__ import annotations

import pytest
import torch

from conftest import make_policies
from marl_llm.models import memory
from marl_llm.rollout import decode as rollout
from marl_llm.rollout.base import GenRequest
from marl_llm.rollout.decode import HFRollout, kv_chunks
from marl_llm.rollout.sampling import SamplingParams

# Published config.json values.
QWEN25_15B = {"num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "hidden_size": 1536}
QWEN3_8B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            "head_dim": 128}


def test_kv_bytes_from_a_config():
    assert memory.kv_bytes_per_token_per_layer(QWEN25_15B, torch.bfloat16) == 2 * 2 * 128 * 2  # K and V, 2 heads of 128
    assert memory.kv_cache_bytes(QWEN25_15B, torch.bfloat16, 1) == 28 * 1024
    assert memory.kv_cache_bytes(QWEN3_8B, "bfloat16", 1) == 144 * 1024
    # The figure: 32 rows of 4,096 tokens of the 8B AT-GRPO preset hold 18 GiB (26 GB with the prompts).
    assert memory.kv_cache_bytes(QWEN3_8B, torch.bfloat16, 32 * 4096) == 18 * 2**30
    assert memory.kv_cache_bytes(QWEN3_8B, torch.float32, 1) == 2 * memory.kv_cache_bytes(QWEN3_8B, torch.bfloat16, 1)
    from transformers import LlamaConfig

    mha = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)  # no GQA: K/V heads = query heads
    assert memory.kv_cache_bytes(mha, torch.float32, 10) == 10 * 2 * 2 * 4 * 16 * 4


def test_kv_budget_from_free_memory_or_the_setting(monkeypatch):
    assert memory.kv_budget("cpu", 1.5) == (int(1.5 * 2**30), "trainer.kv_cache_gib=1.5")
    assert 0 < memory.available_ram_bytes() < 2**50
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 10 * 2**30)
    budget, how = memory.kv_budget("cpu", "auto")
    assert budget == 5 * 2**30 and "10.0 GiB of RAM" in how
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * 2**30)
    budget, how = memory.kv_budget("cuda:0", "auto", held=3 * 2**30)
    assert budget == int(0.8 * 35 * 2**30) and "35.0 GiB free on cuda:0" in how  # free + cached unused + held


def test_rows_are_cut_into_calls_within_the_budget_and_the_row_limit():
    prompts, new = [10, 10, 30, 10, 10], [6, 6, 6, 6, 2]
    assert kv_chunks(prompts, new, 64, 10**9) == [[0, 1, 2, 3, 4]]
    assert kv_chunks(prompts, new, 2, 10**9) == [[0, 1], [2, 3], [4]]
    # Rows of P + N positions plus P while the prefill's cache moves: 2 rows of 10 + 6 cost 2 * 26 = 52.
    assert kv_chunks(prompts, new, 64, 52) == [[0, 1], [2], [3, 4]]
    assert kv_chunks(prompts, new, 64, 1) == [[0], [1], [2], [3], [4]]  # a row alone over the budget still runs
    # A compiled step rounds rows up to 8 and positions to 64: one row costs 8 * (10 + 64).
    assert kv_chunks(prompts, new, 64, 8 * 74, 8, 64) == [[0, 1], [2], [3, 4]]


def test_the_rollout_splits_a_step_by_its_kv_budget_and_tells_it_once(tiny_model_dir, monkeypatch, capsys):
    policies = make_policies(tiny_model_dir)
    requests = [GenRequest(j % 2, "solve it" if j < 4 else "a much longer prompt " * 3,
                           SamplingParams(temperature=1.0, max_new_tokens=8), key=j) for j in range(8)]
    whole = [c.completion_ids.tolist() for c in HFRollout(policies).generate(requests)]
    capsys.readouterr()
    calls = []
    real = rollout.decode
    monkeypatch.setattr(rollout, "decode", lambda model, prompts, *a, **k: calls.append(len(prompts)) or
                        real(model, prompts, *a, **k))
    per_position = memory.kv_cache_bytes(policies.models[0].config, policies.dtype, 1)
    longest = max(len(rollout.encode_prompt(policies.tokenizers[0], r.message)) for r in requests)
    gib = 3 * (2 * longest + 8) * per_position / 2**30  # three rows of the longest prompt
    bounded = HFRollout(policies, kv_cache_gib=gib)
    split = [c.completion_ids.tolist() for c in bounded.generate(requests)]
    assert split == whole  # keyed rows draw the same tokens in any batch
    assert max(calls) <= 4 and len(calls) >= 3 and sum(calls) == 8, calls
    bounded.generate(requests[:2])
    told = capsys.readouterr().out
    assert told.count("KV cache budget") == 1 and "trainer.kv_cache_gib=" in told, told
