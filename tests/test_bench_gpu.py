"""`marl-llm-bench gpu` end to end on the CPU with the tiny architecture: the decode comparison,
the training steps of the HumanEval paper preset, and the report files with every field. The
numbers are measured, never compared with targets."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import VENV_BIN
import torch

from marl_llm.bench.gpu import decode_bytes_per_run
from marl_llm.models.memory import kv_cache_bytes


def test_decode_bytes_per_run_counts_weights_and_kv_cache_per_step():
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8}
    per_position = kv_cache_bytes(config, torch.bfloat16, 1)
    assert per_position == 2 * 2 * 2 * 2 * 2  # K and V, 2 layers, 2 K/V heads of 2, 2 bytes
    # 3 new tokens: 2 decode steps; step t of a row with prompt p reads p + t + 1 cached positions.
    want = 2 * 100 + per_position * ((2 + 1) + (2 + 2) + (3 + 1) + (3 + 2))
    assert decode_bytes_per_run(per_position, 100, [2, 3], 3) == want


@pytest.mark.slow
def test_gpu_mode_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "gpu"
    cmd = [str(VENV_BIN / "marl-llm-bench"), "gpu", "--arch", "tiny", "--device", "cpu", "--dtype", "float32",
           "--batches", "8", "--new-tokens", "3", "--reps", "2", "--steps", "1", "--warmup", "0",
           "--settings", "dynamic", "compiled",
           "--peak-tflops", "0.5", "--bandwidth-tbs", "0.02", "--no-deterministic",
           "--model-dir", str(tmp_path / "models"), "--out", str(out), "algo.num_turns=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "tiny_float32.json").read_text())
    assert r["command"] == "marl-llm-bench gpu " + " ".join(cmd[2:])
    env = r["environment"]
    assert env["device"] == "cpu" and all(env["versions"][k] for k in ("torch", "transformers", "peft"))
    assert r["parameters"] > 0 and r["flop_shape"]["n_layers"] == 2

    dynamic, compiled = r["decode"]["rows"]
    assert (dynamic["setting"], compiled["setting"]) == ("dynamic", "compiled")
    assert r["decode"]["measured_bandwidth_tbs"] > 0 and r["decode"]["bandwidth_tbs"] == 0.02
    for row in (dynamic, compiled):
        assert row["batch"] == 8 and row["new_tokens"] == 3
        for key in ("decode_tokens_per_s", "generate_tokens_per_s", "decode_vs_generate", "decode_ms_per_step",
                    "generate_ms_per_step", "bytes_read_per_run", "decode_roofline", "generate_roofline", "decode_mfu"):
            assert row[key] > 0, key
        assert row["kernels_per_step"] is None and row["cudagraph_rerecordings_per_rollout"] is None  # CUDA only
    assert dynamic["graphs_compiled_first_rollout"] == 0 and compiled["graphs_compiled_first_rollout"] >= 1
    assert compiled["graphs_compiled_per_later_rollout"] == 0  # the same shape compiles once

    t = r["training"]
    assert t["experiment"] == "magrpo_humaneval_paper" and "error" not in t
    assert {"algo.num_turns=1", "trainer.deterministic=false", "trainer.peak_tflops=0.5"} <= set(t["overrides"])
    assert t["deterministic"] is False and [s["warmup"] for s in t["steps"]] == [False]
    s = t["summary"]
    for key in ("step_time", "timing/rollout", "timing/generate", "timing/update", "perf/mfu/generate",
                "perf/mfu/update", "perf/mfu/step", "perf/tflop/step", "num_tokens"):
        assert s[key] > 0, key
    assert s["timing/scoring"] >= 0

    md = (out / "tiny_float32.md").read_text()
    assert r["command"] in md and "| 8 | dynamic |" in md and "| 8 | compiled |" in md and "| update MFU | >= 35% |" in md
    assert "Not run" not in md
