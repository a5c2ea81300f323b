#!/usr/bin/env python3
"""The memory plan (`marl-llm-plan`, distributed/memory_plan.py) against the measured peak memory
of real training runs on the CPU: results/memory_plan.md (+ .json).

    PYTHONPATH=src .venv/bin/python scripts/measure_memory_plan.py --out results

Four configurations of a two-step `marl-llm` run (MAGRPO, two agents, task=team with fixed
prompts), each in its own processes:

    lora      LoRA adapters on one frozen fp32 base, 1 process
    full      full fine-tuning (two fp32 policies, fp32 AdamW), 1 process
    fsdp      full fine-tuning sharded with FSDP over 2 gloo ranks (torchrun), per rank
    bf16      full fine-tuning with trainer.master_weights=bf16 (model.dtype=bfloat16), 1 process

What is measured: each process's resident memory (Linux VmRSS, VmHWM). The baseline is taken
after the imports, before anything of the run loads (its config, tokenizer, data, models); each
phase's peak (loading, rollout, update, what follows them) is VmHWM after the kernel's peak counter
was reset at the phase's start (/proc/self/clear_refs 5), less the baseline. Two steps, so that
the second rollout holds AdamW's moments as every later one does. The plan is the one the run
prints first (memory_plan.for_config on the CPU, its own world size), for the prompt's length in
tokens. The model is a random Llama of 43M parameters (scripts/measure_sharded_loading.py's), so
that the plan's terms dominate what the interpreter and the libraries add (~55 MB).

glibc's allocator (the CPU's) keeps freed memory in its heap once a large block was freed (its
mmap threshold then rises, up to 32 MiB): RSS then grows past what the tensors need. Each
configuration runs twice: with MALLOC_MMAP_THRESHOLD_=131072 (glibc's own starting value, kept
fixed: blocks above it return to the system when freed), where RSS follows the run's memory,
and with glibc's defaults. Only the CPU is measured: the plan's GPU terms (CUDA context, NCCL
buffers, bf16 compute copies, fused AdamW) are not (docs/distributed.md names their sources).

`--tensors` adds each phase's peak of the tensors themselves (torch.profiler's memory events) and
the ops running at it; it misses tensors that other threads allocate (transformers loads
weights on a thread pool), so it reads low where loading casts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20

# Per configuration: the ranks it runs on and its overrides beyond the common ones.
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "lora": (1, ["algo.lora.r=16", "algo.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"]),
    "full": (1, ["algo.lora=null"]),
    "fsdp": (2, ["algo.lora=null", "trainer.fsdp=true"]),
    "bf16": (1, ["algo.lora=null", "model.dtype=bfloat16", "trainer.master_weights=bf16"]),
}
# glibc's mmap threshold kept at its starting value (bytes): freed blocks above it leave the heap.
FIXED_MMAP_THRESHOLD = 131072


@dataclass(frozen=True)
class Sizes:
    """The workload: one prompt per rank and step, `generations` completions of it per agent (one
    generate call of that many rows per fully fine-tuned policy, twice as many on LoRA's shared
    base), micro-batches of the siblings of one prompt; a prompt of `prompt_words` words (~3
    tokens each, plus the chat template's)."""

    generations: int = 4
    new_tokens: int = 96
    prompt_words: int = 100


RESULTS = Sizes()
QUICK = Sizes(generations=4, new_tokens=32, prompt_words=60)  # tests/test_memory_plan.py's

TEAM_MODULE = '''
"""task=team functions for scripts/measure_memory_plan.py: a fixed prompt of {words} words."""
WORDS = " ".join(f"word{{i % 50}}" for i in range({words}))


def prompts(row):
    return [f"Write about {{row['topic']}}: {{WORDS}}", f"Edit a text on {{row['topic']}}: {{WORDS}}"]


def reward(row, completions):
    return float(sum(len(c) for c in completions) % 7)
'''


# ------------------------------------------------------------------------------------ the files
def build_model(path: Path) -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    from measure_sharded_loading import build_model as build  # the 43M-parameter Llama

    return build(path)


def write_task(folder: Path, sizes: Sizes) -> Path:
    """The team task's module (memory_plan_team) and its rows in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "memory_plan_team.py").write_text(TEAM_MODULE.format(words=sizes.prompt_words))
    (folder / "rows.jsonl").write_text("".join(json.dumps({"topic": f"topic {i}"}) + "\n" for i in range(8)))
    return folder


def overrides(name: str, model_dir: Path, task_dir: Path, run_dir: Path, sizes: Sizes) -> list[str]:
    """A two-step run of configuration `name`. sequences_per_generate is the rows a generate call
    gets, so the plan's rows are the run's."""
    ranks, extra = CONFIGS[name]
    lora = "algo.lora=null" not in extra
    g = sizes.generations
    return ["algo=magrpo", "task=team", "task.agents=[writer,editor]", "task.prompts=memory_plan_team:prompts",
            "task.reward=memory_plan_team:reward", f"task.data.files.train={task_dir / 'rows.jsonl'}",
            f"task.data.files.test={task_dir / 'rows.jsonl'}", "model=local", f"model.path={model_dir}",
            "model.device=cpu", "logger=none", f"run_dir={run_dir}", "algo.num_turns=1", f"algo.num_generations={g}",
            f"algo.sampling.max_new_tokens={sizes.new_tokens}", "algo.sampling.top_p=1.0",
            "algo.sampling.temperature=1.0", "trainer.max_steps=2", f"trainer.prompts_per_step={ranks}",
            f"trainer.completions_per_micro_batch={g}", f"trainer.sequences_per_generate={2 * g if lora else g}",
            "trainer.eval_before=false", "trainer.eval_after=false", "trainer.export_agents=false",
            "trainer.progress=off", "trainer.threads=1", *extra]


def prompt_tokens(model_dir: Path, task_dir: Path) -> int:
    """The longer of the two agents' prompts in tokens, as the rollout encodes them (plan.prompt_tokens)."""
    import importlib

    from transformers import AutoTokenizer

    from marl_llm.models.prompting import encode_prompt

    sys.path.insert(0, str(task_dir))
    team = importlib.reload(importlib.import_module("memory_plan_team"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    return max(len(encode_prompt(tok, p)) for p in team.prompts({"topic": "topic 0"}))


# ------------------------------------------------------------------------------- a rank's side
def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    text = Path("/proc/self/status").read_text()
    return tuple(int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))


def reset_peak() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


# A phase boundary in the profiler's memory events: a tensor of MARKER_BYTES + the phase's index
# allocated and freed at once (no tensor of the run has such a size).
MARKER_BYTES = 7_777_777


class Phases:
    """Each phase's peak RSS growth (VmHWM since its start, less the baseline), and its RSS at the end."""

    def __init__(self, baseline: int):
        self.baseline, self.name, self.peaks, self.ends, self.order = baseline, "loading", {}, {}, ["loading"]
        reset_peak()

    def enter(self, name: str) -> None:
        import torch

        current, peak = rss()
        self.peaks[self.name] = max(self.peaks.get(self.name, 0), peak - self.baseline)
        self.ends[self.name] = current - self.baseline
        self.name = name
        self.order.append(name)
        torch.empty(MARKER_BYTES + len(self.order) - 1, dtype=torch.uint8)  # freed at once
        reset_peak()


def tensor_peaks(prof, order: list[str]) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Each phase's peak of tensor bytes alive (the profiler's memory events, summed in time order),
    over the tensors alive when the profile started; and the ops running at each peak."""
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    alive, phase, peaks, when = 0, order[0], {}, {}
    for t, nbytes in memory:
        if MARKER_BYTES <= abs(nbytes) < MARKER_BYTES + len(order):
            phase = order[nbytes - MARKER_BYTES] if nbytes > 0 else phase
            continue
        alive += nbytes
        if alive > peaks.get(phase, -1):
            peaks[phase], when[phase] = alive, t
    ops = {name: [e.name() for e in sorted(events, key=lambda e: e.start_ns()) if e.name() != "[memory]"
                  and e.start_ns() <= t <= e.start_ns() + e.duration_ns()][:4] for name, t in when.items()}
    return peaks, ops


def run_side(argv: list[str], out_path: str, tensors: bool) -> None:
    """A run of `argv` (marl-llm's overrides) in this process; its phases' peaks to `out_path`."""
    import gc
    import logging

    # Everything the run imports, before the baseline: modules are not what the plan counts.
    import peft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import marl_llm.algos.magrpo  # noqa: F401
    import marl_llm.tasks.team  # noqa: F401
    from marl_llm.configure import compose_config
    from marl_llm.distributed import fsdp  # noqa: F401
    from marl_llm.training import trainer

    gc.collect()
    phases = Phases(rss()[0])

    class PhaseEvents(logging.Handler):  # the trainer's own progress events (rollout.PROGRESS)
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "phase":
                phases.enter(record.phase)

    build, train_step, cpu_seconds = trainer.build, trainer.train_step, []

    def build_then_mark(*a, **k):
        out = build(*a, **k)
        phases.enter("loaded")
        return out

    def step_then_mark(*a, **k):
        start = time.process_time()
        out = train_step(*a, **k)
        cpu_seconds.append(time.process_time() - start)
        phases.enter("after the step")
        return out

    trainer.build, trainer.train_step = build_then_mark, step_then_mark
    logging.getLogger("marl_llm.progress").addHandler(PhaseEvents())
    cfg = compose_config(argv)
    tensor_bytes, at_peak = {}, {}
    if tensors:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer.train(cfg)
            phases.enter("end")
        tensor_bytes, at_peak = tensor_peaks(prof, phases.order)
    else:
        trainer.train(cfg)
        phases.enter("end")
    rank = int(os.environ.get("RANK", 0))
    Path(out_path.format(rank=rank)).write_text(json.dumps(
        {"rank": rank, "peaks": phases.peaks, "ends": phases.ends, "tensors": tensor_bytes, "at_peak": at_peak,
         "step_cpu_seconds": cpu_seconds}))


# -------------------------------------------------------------------------------- the parent
def plan_of(argv: list[str], ranks: int):
    """The plan the run prints (memory_plan.for_config on the CPU, `ranks` processes)."""
    from marl_llm.configure import compose_config
    from marl_llm.distributed import memory_plan

    return memory_plan.for_config(compose_config(argv), ("writer", "editor"), ranks, None, "cpu")


def plan_terms(plan) -> dict:
    names = ["weights", "optimizer", "runtime", "rollout_weights", "gather", "kv", "decode", "prefill", "gradients",
             "activations", "update_transients", "after_backward"]
    return {**{n: getattr(plan, n) for n in names}, "rollout_peak": plan.rollout_peak,
            "update_peak": plan.update_peak, "peak": plan.peak, "peaks_at_backward_start": plan.peaks_at_backward_start}


def measure(name: str, model_dir: Path, task_dir: Path, work: Path, sizes: Sizes, port: int,
            mmap_threshold: int | None = FIXED_MMAP_THRESHOLD, tensors: bool = False, timeout: int = 1200) -> dict:
    """Run configuration `name` (glibc's mmap threshold fixed at `mmap_threshold`; None: glibc's
    defaults); its plan's terms and each rank's measured phase peaks. RuntimeError with the run's
    output when it fails."""
    ranks = CONFIGS[name][0]
    prompt_len = prompt_tokens(model_dir, task_dir)
    run_dir = Path(tempfile.mkdtemp(prefix=f"run_{name}_", dir=work))  # a fresh run each time
    argv = [*overrides(name, model_dir, task_dir, run_dir, sizes),
            f"plan.prompt_tokens={prompt_len}"]
    out = str(work / f"{name}_{mmap_threshold}_rank{{rank}}.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(task_dir), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    side = [__file__, "--run-side", out, *(["--tensors"] if tensors else []), "--", *argv]
    cmd = [sys.executable, *side] if ranks == 1 else \
        [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(port), *side]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: the run failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    plan = plan_of(argv, ranks)
    return {"name": name, "ranks": ranks, "mmap_threshold": mmap_threshold, "sizes": asdict(sizes),
            "prompt_tokens": prompt_len, "overrides": argv, "plan": plan_terms(plan), "plan_lines": plan.lines(),
            "measured": [json.loads(Path(out.format(rank=r)).read_text()) for r in range(ranks)]}


def measured_peak(rank: dict) -> int:
    return max(rank["peaks"].values())


def table(results: list[dict]) -> str:
    lines = ["| configuration | rank | rollout: plan | measured | update: plan | measured | peak: plan | measured | "
             "plan / measured | CPU s per step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p = r["plan"]
        for rank in r["measured"]:
            m, peak = rank["peaks"], measured_peak(rank)
            cpu = "/".join(f"{s:.1f}" for s in rank.get("step_cpu_seconds", []))
            lines.append(f"| {r['name']} | {rank['rank']} | {p['rollout_peak'] / MiB:.0f} | {m.get('rollout', 0) / MiB:.0f} "
                         f"| {p['update_peak'] / MiB:.0f} | {m.get('update', 0) / MiB:.0f} | {p['peak'] / MiB:.0f} | "
                         f"{peak / MiB:.0f} | {p['peak'] / peak:.3f} | {cpu} |")
    return "\n".join(lines)


def terms_table(results: list[dict]) -> str:
    names = ["weights", "optimizer", "runtime", "rollout_weights", "gather", "prefill", "kv", "decode", "gradients",
             "activations", "update_transients", "after_backward"]
    lines = ["| configuration | " + " | ".join(names) + " | the update peaks |", "|---|" + "---|" * (len(names) + 1)]
    for r in results:
        moment = "at the backward's start" if r["plan"]["peaks_at_backward_start"] else "at the backward's end"
        lines.append(f"| {r['name']} | " + " | ".join(f"{r['plan'][n] / MiB:.0f}" for n in names) + f" | {moment} |")
    return "\n".join(lines)


def report(results: list[dict]) -> str:
    fixed = [r for r in results if r["mmap_threshold"] is not None]
    default = [r for r in results if r["mmap_threshold"] is None]
    sizes = results[0]["sizes"]
    return (
        "# The memory plan against measured peak memory (CPU)\n\n"
        "`scripts/measure_memory_plan.py` on this machine's CPU (MiB; the module docstring says how). Two-step "
        "`marl-llm` runs of MAGRPO with two agents on a random 43M-parameter Llama (49,152-token vocabulary, tied "
        f"head), {sizes['generations']} completions of {sizes['new_tokens']} tokens per prompt and agent, prompts of "
        f"{results[0]['prompt_tokens']} tokens; each process's peak RSS growth from a baseline taken after the imports, "
        "per phase; the plan is the run's own (`memory_plan.for_config`, CPU, its world size). FSDP: 2 gloo ranks, one "
        "prompt each.\n\n"
        f"## glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_={FIXED_MMAP_THRESHOLD}): RSS follows the run's memory\n\n"
        + table(fixed) +
        "\n\n## glibc's defaults: freed memory stays in the heap\n\n" + table(default) +
        "\n\nglibc raises its mmap threshold each time a block above it is freed (to 32 MiB at most), after which "
        "such blocks come from the heap and stay there when freed: the peak RSS then exceeds what the run's tensors "
        "need at once, by most in LoRA (whose update is small next to its heap's churn). Fixing the threshold costs "
        "CPU time (fresh pages for each large tensor: the CPU seconds per step above). The plan does not model "
        "this allocator's retention; a CUDA run allocates through torch's caching allocator instead.\n\n"
        "## The plan's terms (MiB, per process)\n\n" + terms_table(fixed) +
        "\n\n`runtime` is the CPU process's own memory (`CPU_PROCESS_BYTES`: its tokenizers, Python objects); "
        "`update_transients` what the backward's start holds beside the activations (the LM head's chunk, FSDP's "
        "gathered layers and root unit), `after_backward` what its end holds beside the gradients (AdamW's step, "
        "the tied embedding's gradient, FSDP's root reduce-scatter).\n\n"
        "Not measured here: any GPU. The plan's CUDA terms (context, cuBLAS workspaces, NCCL buffers), the bf16 "
        "compute copies of autocast and FSDP's mixed precision, flash attention's activations and fused AdamW "
        "have not run on a GPU (docs/distributed.md lists each GPU term with its source).\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run-side"]:
        tensors = argv[2] == "--tensors"
        run_side(argv[argv.index("--") + 1:], argv[1], tensors)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results", help="folder for memory_plan.md and .json")
    ap.add_argument("--only", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--tensors", action="store_true", help="the tensors' peaks too (torch.profiler; slower)")
    args = ap.parse_args(argv)
    port = int(os.environ.get("MASTER_PORT", "29500"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_model(work / "model")
        task_dir = write_task(work / "task", RESULTS)
        for threshold in (FIXED_MMAP_THRESHOLD, None):
            for name in args.only:
                results.append(measure(name, model_dir, task_dir, work, RESULTS, port, threshold, args.tensors))
                print(table(results[-1:]).splitlines()[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_plan.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "memory_plan.md").write_text(report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
