#!/usr/bin/env python3
"""What the static decode step reads, and what it costs, against the step before bucketed views:
the embedded SmolLM2-135M decoding 8 rows on the CPU, one row long (the cap) and seven short,
with the eager static loop (trainer.decode=static), the dynamic loop beside them
(results/static_decode.md, .json).

    .venv/bin/python scripts/measure_static_decode.py --baseline 15a08b0 --out results

The baseline's source (`git archive` of that commit's src/) and this tree's each run in a child
process, alternately, `--repeats` times; each child times one warm-up-free decode per loop and
reports tokens per second. Before bucketed views, a static step attended over the whole cache
(the longest prompt plus the cap) for every row, finished ones included; now it reads the running
rows over a window of at most twice the positions written. Times on these shared CPUs are noisy:
compare the ratios within one run. Not measured: a GPU, CUDA graphs, the compiled step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS, SHORT, LONG = 8, 64, 512  # one row of LONG tokens (the cap), the others SHORT


def child() -> None:
    """Time the static and dynamic loops once each (in this process's marl_llm) and print JSON."""
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marl_llm.models.loading import embedded_checkpoint
    from marl_llm.models.prompting import encode_prompt
    from marl_llm.rollout.decode import decode
    from marl_llm.rollout.sampling import SamplingParams

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    path = embedded_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = [encode_prompt(tok, f"Write a function number {i} that adds two numbers.") for i in range(ROWS)]
    lengths = [LONG] + [SHORT] * (ROWS - 1)
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, min_new_tokens=n) for n in lengths]
    out = {}
    for name, static in (("static", True), ("dynamic", False)):
        start = time.perf_counter()
        with torch.inference_mode():
            ids = decode(model, prompts, [None] * ROWS, params, [], tok.pad_token_id, row_keys=list(range(ROWS)),
                         static=static)
        seconds = time.perf_counter() - start
        assert [len(i) for i in ids] == lengths
        out[name] = {"seconds": seconds, "tokens_per_s": sum(lengths) / seconds}
    print(json.dumps(out))


def run(src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit before bucketed views")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "results")
    args = parser.parse_args()
    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "src.tar"
        subprocess.run(["git", "archive", "-o", str(archive), args.baseline, "src"], cwd=REPO, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        sources = {f"before ({args.baseline})": Path(tmp) / "src", f"bucketed views ({here})": REPO / "src"}
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        for _ in range(args.repeats):  # alternately, so load on the machine falls on both
            for name, src in sources.items():
                runs[name].append(run(src))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "static_decode.json").write_text(json.dumps(runs, indent=2) + "\n")
    write_report(runs, args.baseline, args.out, os.getloadavg())


def write_report(runs: dict[str, list[dict]], baseline: str, out: Path, load: tuple[float, ...] | None) -> None:
    """results/static_decode.md from the runs: each run's figures, and the median of each run's
    static / dynamic ratio (both loops timed in one process, one after the other)."""
    lines = [
        "# The static decode step: bucketed views against the whole cache",
        "",
        f"Written by `scripts/measure_static_decode.py --baseline {baseline}`. The embedded SmolLM2-135M in "
        f"float32 on the CPU ({os.environ.get('THREADS', '2')} threads) decodes {ROWS} rows, one of {LONG} tokens "
        f"and {ROWS - 1} of {SHORT}, with the eager static loop (trainer.decode=static), then the dynamic loop, "
        "in one process per run; runs of the two sources alternate. Before: every static step attended over "
        f"the whole cache (the longest prompt + {LONG} positions) for all {ROWS} rows. Now: the running rows, "
        "over a window of at most twice the positions written.",
        "",
        "| source | static / dynamic, median of the runs' ratios | each run: static tok/s, dynamic tok/s |",
        "|---|---|---|",
    ]
    for name, results in runs.items():
        ratios = sorted(r["static"]["tokens_per_s"] / r["dynamic"]["tokens_per_s"] for r in results)
        each = "; ".join(f"{r['static']['tokens_per_s']:.1f}, {r['dynamic']['tokens_per_s']:.1f}" for r in results)
        lines.append(f"| {name} | {ratios[len(ratios) // 2]:.2f} | {each} |")
    if load is not None:
        lines += ["", f"Load average at the end: {', '.join(f'{x:.1f}' for x in load)} on this machine's cores."]
    lines += ["", "Absolute rates on a loaded shared machine mean little; compare the ratios. Not measured: a GPU, "
              "the compiled step (CUDA graphs), bf16."]
    (out / "static_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
