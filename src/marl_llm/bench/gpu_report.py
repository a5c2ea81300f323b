"""The report of `marl-llm-bench gpu` (bench/gpu.py): the environment it ran in, and the JSON and
markdown files of one architecture's results, written after each part."""

from __future__ import annotations

import importlib.metadata as md
import json
import time
from pathlib import Path
from typing import Any

from marl_llm.runs.atomic import atomic_write_text

# The issue's figures on an H100 (benchmark targets, not test assertions).
TARGETS = {"decode_vs_generate_at_64": 3.0, "decode_roofline_at_64": 0.20, "update_mfu": 0.35}


def environment(device: str) -> dict[str, Any]:
    import torch

    from marl_llm.training import perf

    versions = {}
    for dist in ("torch", "transformers", "peft"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {"device": perf.device_name(device), "cuda": torch.version.cuda, "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def write_report(result: dict[str, Any], out: Path) -> Path:
    stem = out / f"{result['arch']}_{result['dtype']}"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(result, indent=2, default=str))
    env, d, t = result["environment"], result.get("decode") or {}, result.get("training") or {}
    lines = [f"# marl-llm on {env['device']}: {result['arch']} shapes, {result['dtype']}, random weights", "",
             f"Command: `{result['command']}`", "",
             f"torch {env['versions']['torch']} (CUDA {env['cuda']}), transformers {env['versions']['transformers']}, "
             f"peft {env['versions']['peft']}; {env['date']}. Shapes: {json.dumps(result['shape'])}; "
             f"{result['parameters'] / 1e9:.3f}B parameters.", ""]
    if "error" in d:
        lines += ["## Decode", "", f"Not run: {d['error']}", ""]
    elif d:
        lines += ["## Decode: marl-llm's rollout (two adapters mixed) vs transformers generate (one adapter)", "",
                  f"Fixed {d['rows'][0]['new_tokens']} new tokens per row (min = max), top_p 1, temperature "
                  f"{d['temperature']}; rows: HumanEval paper prompts of both agents, {d.get('siblings', 4)} siblings each; LoRA "
                  f"r={d['lora']['r']} on {', '.join(d['lora']['target_modules'])}. Settings: dynamic (the eager "
                  "loop, rows leave the batch), static (the eager fixed-shape step), compiled (the static step "
                  "under torch.compile: CUDA graphs on a GPU). Roofline: bytes the decode steps must read (weights "
                  f"{d['weight_bytes'] / 2**30:.2f} GiB per step + KV cache {d['kv_bytes_per_position'] / 2**10:.3g} "
                  f"KiB per cached position) / (time x {_f(d['bandwidth_tbs'], '.3g')} TB/s; measured copy "
                  f"bandwidth {_f(d.get('measured_bandwidth_tbs'), '.3g')} TB/s, datasheet "
                  f"{_f(d.get('datasheet_bandwidth_tbs'), '.3g')}); time includes the prefill. Kernels: GPU "
                  "kernels per decode step at the largest batch (CUDA only). Compiled graphs and CUDA-graph "
                  "recordings: in the first rollout / per later rollout.", "",
                  "| batch | setting | decode tok/s | generate tok/s | decode / generate | decode ms/step "
                  "| generate ms/step | decode roofline | generate roofline | decode MFU | kernels/step "
                  "| graphs compiled | CUDA graphs recorded |", "|---" * 13 + "|"]
        for r in d["rows"]:
            lines.append(f"| {r['batch']} | {r.get('setting', 'dynamic')} | {r['decode_tokens_per_s']:.0f} "
                         f"| {r['generate_tokens_per_s']:.0f} | {r['decode_vs_generate']:.2f}x "
                         f"| {r['decode_ms_per_step']:.2f} | {r['generate_ms_per_step']:.2f} "
                         f"| {_f(r.get('decode_roofline'), '.1%')} | {_f(r.get('generate_roofline'), '.1%')} "
                         f"| {_f(r.get('decode_mfu'), '.2%')} | {_f(r.get('kernels_per_step'), '.0f')} "
                         f"| {_f(r.get('graphs_compiled_first_rollout'), 'd')} / "
                         f"{_f(r.get('graphs_compiled_per_later_rollout'), '.1f')} "
                         f"| {_f(r.get('cudagraph_recordings_first_rollout'), 'd')} / "
                         f"{_f(r.get('cudagraph_rerecordings_per_rollout'), '.1f')} |")
        lines.append("")
    if "error" in t:
        lines += ["## Training", "", f"Not run: {t['error']}", ""]
    elif t:
        s = t["summary"]
        n = len([x for x in t["steps"] if not x["warmup"]])
        lines += [f"## Training: `experiment={t['experiment']}`, median of {n} step(s) after "
                  f"{len(t['steps']) - n} warm-up", "",
                  f"Peak {_f(t['peak_tflops'], '.4g')} TFLOP/s; deterministic algorithms: {t['deterministic']}; "
                  f"{t['trained_parameters'] / 1e9:.3f}B trained parameters.", "",
                  "| step s | rollout s | of which generate s | scoring s | update s | MFU generate | MFU update "
                  "| MFU step | TFLOP/step | peak GPU GiB | trained tokens/step |", "|---" * 11 + "|",
                  f"| {_f(s.get('step_time'), '.2f')} | {_f(s.get('timing/rollout'), '.2f')} "
                  f"| {_f(s.get('timing/generate'), '.2f')} | {_f(s.get('timing/scoring'), '.2f')} "
                  f"| {_f(s.get('timing/update'), '.2f')} | {_f(s.get('perf/mfu/generate'), '.1%')} "
                  f"| {_f(s.get('perf/mfu/update'), '.1%')} | {_f(s.get('perf/mfu/step'), '.1%')} "
                  f"| {_f(s.get('perf/tflop/step'), '.1f')} | {_f(s.get('perf/peak_gpu_mem_gib'), '.1f')} "
                  f"| {_f(s.get('num_tokens'), '.0f')} |", ""]
    lines += ["## The issue's targets on an H100 (benchmark figures, not assertions)", "",
              "| target | wanted | measured |", "|---|---|---|"]
    at64 = max((r for r in d.get("rows", []) if r["batch"] == 64), key=lambda r: r["decode_tokens_per_s"], default=None)
    best = f" ({at64.get('setting', 'dynamic')})" if at64 else ""
    lines += [f"| decode / generate tokens/s at batch 64, fastest setting | >= {TARGETS['decode_vs_generate_at_64']:.0f}x "
              f"| {_f(at64 and at64['decode_vs_generate'], '.2f')}{best} |",
              f"| decode roofline at batch 64, fastest setting | >= {TARGETS['decode_roofline_at_64']:.0%} "
              f"| {_f(at64 and at64.get('decode_roofline'), '.1%')}{best} |",
              f"| update MFU | >= {TARGETS['update_mfu']:.0%} "
              f"| {_f((t.get('summary') or {}).get('perf/mfu/update'), '.1%')} |", ""]
    atomic_write_text(stem.with_suffix(".md"), "\n".join(lines))
    return stem
