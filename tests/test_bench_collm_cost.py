"""`marl-llm-bench collm-cost`: every system ran its rounds, phases add up to the total, and the
fast CoLLM path has no no-grad critic pass while the reference has one over the same tokens."""

from __future__ import annotations

import json

import pytest
import torch

from marl_llm.bench.collm_cost import PHASES, main


def test_collm_cost_splits_each_system_by_phase(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    threads = torch.get_num_threads()
    assert main(["--model", str(tiny_model_dir), "--rounds", "1", "--warmup", "0", "--new-tokens", "2",
                 "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the caller's thread count is back (1 thread inside)
    report = json.loads((out / "collm_cost.json").read_text())
    systems = report["systems"]
    assert list(systems) == ["magrpo", "collm_cc", "collm_cc_ref", "collm_dc", "collm_dc_ref"]
    for name, r in systems.items():
        assert r["seconds"] > 0 and len(r["rounds"]) == 1, name
        assert sum(r["phases"].values()) == pytest.approx(r["seconds"], rel=1e-6), name
        assert r["phases"]["generate"] > 0 and r["phases"]["actor update"] > 0, name
        assert r["tokens"]["generate real"] > 0 and r["tokens"]["actor update real"] > 0, name
    assert systems["magrpo"]["phases"]["critic update"] == 0
    for algo in ("collm_cc", "collm_dc"):
        fast, ref = systems[algo], systems[algo + "_ref"]
        assert fast["phases"]["critic values (no grad)"] == 0 and "critic values (no grad) real" not in fast["tokens"]
        assert ref["phases"]["critic values (no grad)"] > 0
        # The reference's own pass reads exactly the samples its update reads.
        assert ref["tokens"]["critic values (no grad) real"] == ref["tokens"]["critic update real"]
        assert fast["phases"]["critic update"] > 0
    md = (out / "collm_cost.md").read_text()
    assert all(p in md for p in PHASES) and "| collm_cc | " in md and "Avoidable" in md
