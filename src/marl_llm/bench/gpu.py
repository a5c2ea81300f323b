"""`marl-llm-bench gpu`: decode throughput, the step split, MFU and peak memory on one GPU.

    marl-llm-bench gpu --device cuda --dtype bfloat16 --arch qwen2.5-1.5b --arch qwen2.5-3b --out results/gpu
    make bench-gpu                                        # the same (GPU_ARGS adds flags)
    marl-llm-bench gpu --arch tiny --device cpu --dtype float32 --new-tokens 4 ...   # seconds, on a CPU (the tests)

Per architecture it builds a model with the real shapes and RANDOM weights (throughput does not
depend on the values; `--model-dir` keeps them) and the embedded model's tokenizer (SmolLM2's
49152 ids; the LM head keeps the architecture's real vocabulary, so it costs what it costs), then:

1. Decode, per setting (`--settings`: `dynamic`, `static`, `compiled` = the static step under
   torch.compile, CUDA graphs on a GPU; default dynamic and compiled on CUDA, dynamic and static
   on the CPU): marl-llm's rollout (`HFRollout` as `trainer.build` makes it, two LoRA adapters
   mixed in one batch, siblings sharing a prefill) against transformers `generate` (one adapter)
   on the same rows: the HumanEval paper prompts of both agents, G=4 siblings each, at batch
   8/32/64, a fixed length (min = max new tokens; top_p=1: random weights give flat
   distributions). Tokens/s, ms per token step, and the fraction of the memory-bandwidth
   roofline: the bytes a decode step must read (every weight once: the base, both adapters, the
   LM head; the KV cache of every row's prompt and tokens so far) over the step count, divided by
   time * bandwidth (`--bandwidth-tbs`, else the device's copy bandwidth measured here on CUDA).
   The time includes the prefill, so the fraction is a lower bound. Also per setting: GPU kernels
   per decode step (torch.profiler, CUDA only, at the largest batch), and graphs compiled and
   CUDA graphs recorded in the first rollout and per later rollout (0 when nothing re-records).
2. Training: `--steps` steps of `--experiment` (default the HumanEval paper preset, MAGRPO with
   two fully fine-tuned agents) on that model after `--warmup` steps, through the trainer's own
   `build` / `train_step`; reports its metrics (perf.py): the step split (rollout = generate +
   scoring; update), MFU of generation, update and step, peak GPU memory.

Writes <out>/<arch>_<dtype>.json (everything) and .md (the tables, the exact command, the
device, torch/transformers/peft versions; bench/gpu_report.py), after each part. Figures are
measured, never asserted; the issue's targets on an H100 are listed next to them: decode >= 3x
generate tokens/s and >= 20% of the roofline at batch 64, update MFU >= 35%.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from marl_llm.bench.gpu_report import environment, write_report

# Published config.json values (Qwen2.5-Coder-3B has exactly Qwen2.5-3B's shapes); `tiny` for CPU tests.
ARCHS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=None),  # None: the tokenizer's size
}
ALIASES = {"qwen2.5-coder-3b": "qwen2.5-3b"}
SIBLINGS = 4  # G of the HumanEval paper preset: rows per (agent, prompt)


def say(msg: str) -> None:
    print(f"[bench-gpu] {msg}", flush=True)


# ------------------------------------------------------------------------------------ model
def build_model(arch: str, dtype: str, device: str, out: Path) -> Path:
    """A random-weight Qwen2 model with `arch`'s shapes (tied embeddings, rope theta 1e6) and the
    embedded model's tokenizer, saved in `out` (kept when it already holds this arch and dtype)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config

    from marl_llm.models.loading import embedded_checkpoint

    stamp = out / "marl_bench_arch.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"arch": arch, "dtype": dtype}:
        return out
    transformers.utils.logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(embedded_checkpoint())
    shapes = dict(ARCHS[arch])
    shapes["vocab_size"] = shapes["vocab_size"] or len(tok)
    config = Qwen2Config(**shapes, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    stamp.write_text(json.dumps({"arch": arch, "dtype": dtype}))
    del model
    return out


def base_overrides(model_dir: Path, args: argparse.Namespace, run_dir: Path) -> list[str]:
    out = ["model=local", f"model.path={model_dir}", f"model.device={args.device}", f"model.dtype={args.dtype}",
           "model.chat_template=false", "logger=none", f"run_dir={run_dir}", "algo.sampling.top_p=1.0",
           f"algo.sampling.max_new_tokens={args.new_tokens}", f"algo.sampling.min_new_tokens={args.new_tokens}",
           "trainer.eval_before=false", "trainer.eval_after=false"]
    if args.peak_tflops is not None:
        out.append(f"trainer.peak_tflops={args.peak_tflops}")
    if args.deterministic is not None:
        out.append(f"trainer.deterministic={str(args.deterministic).lower()}")
    return out


def compose(overrides: list[str]):
    from marl_llm.configure import compose_config
    from marl_llm.configure import validate

    cfg = compose_config(overrides)
    validate(cfg)
    return cfg


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------- decode
def decode_bytes_per_run(kv_per_position: int, weight_bytes: int, prompt_lengths: list[int], new_tokens: int) -> float:
    """Bytes the decode steps of one rollout must read from memory at least: every weight once
    per step and the KV cache of every row (its prompt and the tokens before the fed one;
    `kv_per_position`: models.memory.kv_cache_bytes of one position); the prefill (compute-bound)
    is left out. n new tokens take n - 1 decode steps."""
    steps = max(new_tokens - 1, 0)
    kv = sum(kv_per_position * (steps * p + steps * (steps + 1) / 2) for p in prompt_lengths)
    return steps * weight_bytes + kv


SETTINGS = {"dynamic": (False, False), "static": (True, False), "compiled": (True, True)}  # (static, compiled)


def default_settings(device: str) -> list[str]:
    """The eager default and the compiled step on CUDA (the static eager step is a diagnostic:
    `--settings static`); on the CPU, where inductor takes minutes per shape, the two eager loops."""
    return ["dynamic", "compiled"] if device.startswith("cuda") else ["dynamic", "static"]


def copy_bandwidth_tbs(device) -> float:
    """The device's measured memory bandwidth (TB/s): a 1 GiB (CPU: 256 MiB) tensor copied in
    place 5 times after one warm-up copy, each copy reading and writing every byte."""
    import torch

    from marl_llm.training import perf

    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    dst.copy_(src)
    t0 = perf.clock(device)
    for _ in range(5):
        dst.copy_(src)
    seconds = perf.clock(device) - t0
    return 2 * 4 * n * 5 / seconds / 1e12


def kernels_per_step(generate, device, steps: int) -> float | None:
    """GPU kernels launched per decode step of one `generate()` (torch.profiler; None off CUDA).
    Kernels replayed inside a CUDA graph count where the profiler sees them (CUPTI's graph tracing)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate()
        torch.cuda.synchronize(device)
    kernels = sum(1 for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA"))
    return kernels / max(steps, 1)


def measure_decode(model_dir: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """marl-llm's rollout (two adapters mixed) in each setting against `generate` (one adapter) at each batch."""
    import torch

    from marl_llm.models.memory import kv_cache_bytes
    from marl_llm.models.policies import lora_weights
    from marl_llm.models.prompting import encode_prompt
    from marl_llm.rollout.base import GenRequest
    from marl_llm.rollout.decode import left_pad
    from marl_llm.rollout.sampling import SamplingParams
    from marl_llm.rollout.static_step import compile_counts
    from marl_llm.training import perf
    from marl_llm.training.setup import build, quiet_libraries, seed_everything

    batches = sorted(args.batches)
    settings = args.settings or default_settings(args.device)
    cfg = compose(base_overrides(model_dir, args, work / "decode") + [
        "algo=magrpo", "task=humaneval", "task.prompts=paper", f"trainer.sequences_per_generate={max(batches)}",
        *args.decode_overrides])
    quiet_libraries()
    seed_everything(cfg.seed, cfg.trainer.deterministic)
    run = build(cfg)
    policies, task = run.policies, run.task
    model, tok = policies.models[0], policies.tokenizers[0]
    device = policies.device
    hf = run.rollout.inner  # HFRollout: its decode setting is switched per setting below
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # fresh LoRA B matrices are zero: make the adapters act (and differ)
        for k, adapter in policies.trainable_adapters():
            for name, p in lora_weights(policies.models[k], adapter).items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    temperature = float(cfg.algo.sampling.temperature)
    sp = SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    base = model.get_base_model()
    if not base.config.tie_word_embeddings:  # an untied input embedding is read a row per token, not whole
        emb = base.get_input_embeddings().weight
        weight_bytes -= emb.numel() * emb.element_size()
    kv_per_position = kv_cache_bytes(base.config, policies.dtype, 1)
    datasheet = perf.memory_bandwidth_tbs(device)
    measured = copy_bandwidth_tbs(device)
    bandwidth = args.bandwidth_tbs or measured
    say(f"memory bandwidth: {measured:.3g} TB/s measured (copy){f', {datasheet:.3g} TB/s datasheet' if datasheet else ''}"
        f"; the roofline uses {bandwidth:.3g} TB/s")
    rows_out = []
    for B in batches:
        # Rows as a MAGRPO rollout has them: per problem, each agent's prompt with G siblings.
        requests = []
        for p in (task.load_split("train") * B)[: -(-B // (2 * SIBLINGS))]:
            for i, message in enumerate(task.initial_prompts(p)[:2]):
                requests += [GenRequest(i, message, sp, key=len(requests) + g) for g in range(SIBLINGS)]
        requests = requests[:B]
        prompts = [encode_prompt(tok, r.message) for r in requests]
        model.set_adapter(policies.agents[0].adapter)
        ids, att, _ = left_pad(prompts, tok.pad_token_id)

        def generate() -> None:
            with torch.inference_mode(), policies.autocast(0):
                model.generate(input_ids=ids.to(device), attention_mask=att.to(device), do_sample=True,
                               temperature=temperature, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, pad_token_id=tok.pad_token_id)

        generate_s = []
        for rep in range(1 + args.reps):  # the first is a warm-up
            t0 = perf.clock(device)
            generate()
            if rep:
                generate_s.append(perf.clock(device) - t0)
        tokens = B * args.new_tokens
        need = decode_bytes_per_run(kv_per_position, weight_bytes, [len(p) for p in prompts], args.new_tokens)
        for setting in settings:
            hf.static, hf.compile_decode = SETTINGS[setting]
            decode_s, counts, flops_before = [], [compile_counts()], run.meter.generate_flops
            for rep in range(1 + args.reps):  # the first is a warm-up (and compiles)
                t0 = perf.clock(device)
                out = run.rollout.generate(requests)
                seconds = perf.clock(device) - t0
                counts.append(compile_counts())
                assert all(len(c.completion_ids) == args.new_tokens for c in out), "fixed lengths: min = max new tokens"
                if rep:
                    decode_s.append(seconds)
            decode, generated = statistics.median(decode_s), statistics.median(generate_s)

            def delta(key: str, i: int) -> int | None:
                a, b = counts[i][key], counts[i + 1][key]
                return None if a is None or b is None else b - a

            later = [delta("cudagraph_recordings", i) for i in range(1, len(counts) - 1)]
            row = {"batch": B, "setting": setting, "new_tokens": args.new_tokens,
                   "mean_prompt_tokens": sum(map(len, prompts)) / B, "decode_s": decode, "generate_s": generated,
                   "decode_tokens_per_s": tokens / decode, "generate_tokens_per_s": tokens / generated,
                   "decode_vs_generate": generated / decode, "decode_ms_per_step": 1000 * decode / args.new_tokens,
                   "generate_ms_per_step": 1000 * generated / args.new_tokens, "bytes_read_per_run": need,
                   "decode_tflop_per_run": (run.meter.generate_flops - flops_before) / (1 + args.reps) / 1e12,
                   "decode_roofline": need / (bandwidth * 1e12) / decode,
                   "generate_roofline": need / (bandwidth * 1e12) / generated,
                   "graphs_compiled_first_rollout": delta("graphs", 0),
                   "graphs_compiled_per_later_rollout": sum(delta("graphs", i) for i in range(1, len(counts) - 1))
                   / max(len(counts) - 2, 1),
                   "cudagraph_recordings_first_rollout": delta("cudagraph_recordings", 0),
                   "cudagraph_rerecordings_per_rollout": None if None in later or not later else sum(later) / len(later),
                   "kernels_per_step": None}
            if B == batches[-1]:
                row["kernels_per_step"] = kernels_per_step(lambda: run.rollout.generate(requests), device,
                                                           args.new_tokens)
            if run.meter.peak_tflops:
                row["decode_mfu"] = row["decode_tflop_per_run"] / (decode * run.meter.peak_tflops)
            rows_out.append(row)
            say(f"batch {B}, {setting}: decode {row['decode_tokens_per_s']:.0f} tok/s ({row['decode_ms_per_step']:.1f} "
                f"ms/step, two adapters mixed), generate {row['generate_tokens_per_s']:.0f} tok/s "
                f"({row['generate_ms_per_step']:.1f} ms/step, one adapter): x{row['decode_vs_generate']:.2f}; roofline "
                f"{row['decode_roofline']:.1%} vs {row['generate_roofline']:.1%}"
                + (f"; {row['kernels_per_step']:.0f} kernels/step" if row["kernels_per_step"] is not None else "")
                + (f"; CUDA-graph re-recordings per rollout {row['cudagraph_rerecordings_per_rollout']:.1f}"
                   if row["cudagraph_rerecordings_per_rollout"] is not None else ""))
    info = {"rows": rows_out, "settings": settings, "weight_bytes": weight_bytes, "bandwidth_tbs": bandwidth,
            "measured_bandwidth_tbs": measured, "datasheet_bandwidth_tbs": datasheet,
            "kv_bytes_per_position": kv_per_position,
            "lora": {"r": cfg.algo.lora.r, "target_modules": list(cfg.algo.lora.target_modules)},
            "temperature": temperature, "sequences_per_generate": max(batches), "siblings": SIBLINGS}
    run.meter.close()
    del run, policies, model, task, hf
    free_memory()
    return info


# --------------------------------------------------------------------------------- training
SUMMARY_KEYS = ("step_time", "timing/rollout", "timing/generate", "timing/scoring", "timing/update",
                "perf/mfu/generate", "perf/mfu/update", "perf/mfu/step", "perf/tflop/generate", "perf/tflop/update",
                "perf/tflop/step", "perf/peak_gpu_mem_gib", "perf/peak_rss_gib", "num_tokens",
                "perf/rollout_tokens_per_s", "perf/throughput")


def measure_training(model_dir: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """`--warmup` + `--steps` trainer steps of `--experiment` on the model (warm-up excluded)."""
    import torch

    from marl_llm.training.setup import build, quiet_libraries, seed_everything
    from marl_llm.training.trainer import train_step

    overrides = [f"experiment={args.experiment}", *base_overrides(model_dir, args, work / "train"),
                 f"trainer.max_steps={args.warmup + args.steps}", *args.overrides]
    cfg = compose(overrides)
    quiet_libraries()
    seed_everything(cfg.seed, cfg.trainer.deterministic)
    policies_gib = None
    try:
        run = build(cfg)
        trained = sum(p.numel() for p in run.policies.trainable_parameters())
        # fp32 master weights, gradients and two AdamW moments: 16 bytes per trained parameter.
        policies_gib = 16 * trained / 2**30
        say(f"{args.experiment}: {len(run.policies.models)} model(s) on {run.policies.device} "
            f"({run.policies.dtype}); {trained / 1e9:.3f}B trained parameters (~{policies_gib:.1f} GiB of weights, "
            f"gradients and AdamW state); deterministic algorithms: {torch.are_deterministic_algorithms_enabled()}")
        steps = []
        for step in range(args.warmup + args.steps):
            _, metrics = train_step(run, cfg, step)
            steps.append({"step": step, "warmup": step < args.warmup, **metrics})
            say(f"step {step + 1}{' (warm-up)' if step < args.warmup else ''}: {metrics['step_time']:.2f} s (rollout "
                f"{metrics['timing/rollout']:.2f} = generate {metrics['timing/generate']:.2f} + scoring "
                f"{metrics['timing/scoring']:.2f}; update {metrics['timing/update']:.2f})"
                + "".join(f"; MFU {k.rsplit('/', 1)[1]} {metrics[k]:.1%}" for k in
                          ("perf/mfu/generate", "perf/mfu/update", "perf/mfu/step") if k in metrics)
                + (f"; peak GPU memory {metrics['perf/peak_gpu_mem_gib']:.1f} GiB"
                   if "perf/peak_gpu_mem_gib" in metrics else ""))
    except torch.cuda.OutOfMemoryError as err:
        free_memory()
        hint = (f" (~{policies_gib:.0f} GiB for the trained policies alone)" if policies_gib else "")
        return {"overrides": overrides, "error": f"out of GPU memory{hint}: {str(err).splitlines()[0]} -- use "
                f"--experiment {args.experiment}_lora (LoRA agents) or a GPU with more memory"}
    measured = [s for s in steps if not s["warmup"]] or steps
    summary = {k: statistics.median(s[k] for s in measured) for k in SUMMARY_KEYS if all(k in s for s in measured)}
    out = {"overrides": overrides, "experiment": args.experiment, "trained_parameters": trained,
           "policies_state_gib": policies_gib, "peak_tflops": run.meter.peak_tflops,
           "deterministic": torch.are_deterministic_algorithms_enabled(), "summary": summary, "steps": steps}
    run.meter.close()
    del run
    free_memory()
    return out


# ------------------------------------------------------------------------------------ main
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="marl-llm-bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=sorted([*ARCHS, *ALIASES]),
                    help="model shapes, repeatable (default: qwen2.5-1.5b and qwen2.5-3b)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:<i> or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default="results/gpu", help="where <arch>_<dtype>.md and .json go")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64], help="decode batch sizes (rows)")
    ap.add_argument("--new-tokens", type=int, default=256, help="fixed new tokens per row (the paper preset's 256)")
    ap.add_argument("--reps", type=int, default=2, help="timed decode repetitions per batch, after one warm-up")
    ap.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=None,
                    help="decode settings to measure (default: dynamic and compiled on CUDA, dynamic and static on the CPU)")
    ap.add_argument("--experiment", default="magrpo_humaneval_paper", help="the preset the training steps run")
    ap.add_argument("--steps", type=int, default=3, help="measured training steps")
    ap.add_argument("--warmup", type=int, default=1, help="training steps before the measured ones")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense peak TFLOP/s for MFU (default: from the GPU's name, perf.DEVICES)")
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help="memory bandwidth in TB/s for the roofline (default: the device's copy bandwidth, measured)")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                    help="trainer.deterministic for both parts (default: the config's)")
    ap.add_argument("--model-dir", default=None, help="keep the random-weight models here (default: a temp dir)")
    ap.add_argument("--skip", choices=("decode", "training"), action="append", default=[], help="leave a part out")
    ap.add_argument("--decode-override", dest="decode_overrides", action="append", default=[],
                    help="a Hydra override for the decode part only (repeatable), e.g. trainer.decode=static")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the training steps, e.g. "
                    "trainer.completions_per_micro_batch=8")
    return ap


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from marl_llm.training import perf

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    archs = [ALIASES.get(a, a) for a in (args.arch or ["qwen2.5-1.5b", "qwen2.5-3b"])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "marl-llm-bench gpu " + " ".join(shlex.quote(a) for a in argv)
    failed = False
    for arch in archs:
        work = Path(tempfile.mkdtemp(prefix=f"marl-bench-gpu-{arch}-"))
        model_dir = build_model(arch, args.dtype, args.device, Path(args.model_dir or work) / f"{arch}_{args.dtype}")
        config = AutoConfig.from_pretrained(model_dir)
        result: dict[str, Any] = {"arch": arch, "dtype": args.dtype, "command": command,
                                  "environment": environment(args.device), "model_dir": str(model_dir),
                                  "shape": {k: v for k, v in ARCHS[arch].items() if v is not None}
                                  | {"vocab_size": config.vocab_size}}
        with torch.device("meta"):  # the parameter count and FLOP shape without memory
            meta = AutoModelForCausalLM.from_config(config)
        result["parameters"] = sum(p.numel() for p in meta.parameters())
        result["flop_shape"] = perf.ModelShape.of(meta).__dict__
        del meta
        for part, fn in (("decode", measure_decode), ("training", measure_training)):
            if part in args.skip:
                continue
            say(f"{arch} ({args.dtype}, {result['environment']['device']}): {part} ...")
            try:
                result[part] = fn(model_dir, args, work)
            except Exception as err:  # noqa: BLE001  (reported, the next part and arch still run)
                failed = True
                result[part] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
                say(f"{part} failed: {type(err).__name__}: {err}")
                free_memory()
            write_report(result, out)  # after each part: a run stopped later keeps what it measured
        stem = write_report(result, out)
        say(f"wrote {stem}.md and {stem}.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
