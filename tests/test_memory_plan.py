"""The memory plan (distributed/memory_plan.py, `marl-llm-plan`): its figures against the measured
peak memory of real training runs on the CPU (LoRA, full fine-tuning, FSDP on 2 gloo ranks, bf16
weights: each process's peak RSS, within 15%) and of tiny models' tensors (within 15%), the
terms it adds on a GPU, the rows the runtime's KV budget trims, the presets' models' parameter
counts, the hardware every paper preset states, the console script, and a run that cannot fit
stopping within seconds with its plan.

Two measurements. A real run's: scripts/measure_memory_plan.py runs `marl-llm` for two steps in
its own processes and reads each one's peak RSS growth from a baseline after the imports (Linux
VmHWM). A tiny model's tensors: every tensor the CPU allocator hands out and takes back, from the
profiler's memory events (torch.profiler, profile_memory=True), summed in time order; the tensors
held before (weights, AdamW's moments) are added by their storages. That is the tensors' own
peak, without the process's tokenizers and Python objects (the plan's CPU `runtime` term)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, VENV_BIN, compose_config, rank_port, tiny_overrides
from test_distributed import env

sys.path.insert(0, str(REPO / "scripts"))
import measure_memory_plan  # noqa: E402

TOLERANCE = 0.15


# ------------------------------------------------------------------------------------ measuring
def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def peak_while(fn) -> int:
    """The most tensor bytes alive at once while `fn` runs, beyond those alive when it starts."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    alive = peak = 0
    for _, nbytes in events:
        alive += nbytes
        peak = max(peak, alive)
    return peak


def held(model, opt) -> int:
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    return storage_bytes(tensors)


def tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if kind == "llama":
        return LlamaForCausalLM, LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=512,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                             attn_implementation="sdpa", tie_word_embeddings=True)
    return Qwen3ForCausalLM, Qwen3Config(vocab_size=1024, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         attn_implementation="sdpa")


B, P, C, ROWS = 8, 96, 64, 32  # completions per micro-batch, prompt and completion tokens, decode rows


def build(kind: str, mode: str, checkpointing: bool):
    """A tiny model trained as `mode` ("full", "lora": q and v, "lora_all": every linear) with its
    AdamW, one update step taken (the moments exist, the gradients freed)."""
    from peft import LoraConfig, get_peft_model

    from marl_llm.rollout.decode import completion_logprobs

    cls, cfg = tiny(kind)
    torch.manual_seed(0)
    model = cls(cfg)
    if mode == "full_bf16":  # trainer.master_weights=bf16: weights, gradients and AdamW's moments in bf16
        model.to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not mode.startswith("full"):
        targets = ["q_proj", "v_proj"] if mode == "lora" else "all-linear"
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    prompts = [torch.randint(1, cfg.vocab_size, (P,)) for _ in range(B)]
    comps = [torch.randint(1, cfg.vocab_size, (C,)) for _ in range(B)]

    def step():  # the update's micro-batch: chunked scoring with entropies, backward, AdamW (foreach)
        logp, mask, _ = completion_logprobs(model, prompts, comps, pad_id=0, with_entropy=True)
        (-(logp * mask).sum() / mask.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return model, cfg, opt, step


def planned(cfg, mode: str, checkpointing: bool):
    from marl_llm.distributed import memory_terms as mp

    a = mp.arch(cfg)
    targets = ["q_proj", "v_proj"] if mode == "lora" else ["all-linear"]
    size = 2 if mode == "full_bf16" else 4
    work = mp.Workload(policies=1, full=mode.startswith("full"), compute_bytes=size, master_bytes=size,
                       frozen_bytes=size, rows=ROWS, device_type="cpu",
                       prompt_tokens=P, new_tokens=C, micro_batch=B, checkpointing=checkpointing,
                       adapters=0 if mode.startswith("full") else 1, all_linear=mode == "lora_all",
                       adapter_params=0 if mode.startswith("full") else a.adapter_params(8, targets))
    return mp.estimate(a, work, mp.Layout(1, "shared", [1] if mode.startswith("full") else [], 1, False))


@pytest.mark.parametrize("kind, mode, checkpointing", [
    ("llama", "full", False), ("llama", "full", True), ("qwen3", "full", False), ("qwen3", "full", True),
    ("llama", "lora", False), ("llama", "lora", True), ("llama", "lora_all", False),
    # trainer.master_weights=bf16 (Qwen3's was planned 8% under, 16% with checkpointing, while the
    # LM head's chunk counted 3 buffers of its logits instead of the 5 it keeps).
    ("llama", "full_bf16", False), ("llama", "full_bf16", True), ("qwen3", "full_bf16", False),
    ("qwen3", "full_bf16", True)])
def test_the_update_peak_is_within_15_percent_of_the_measured_one(kind, mode, checkpointing):
    model, cfg, opt, step = build(kind, mode, checkpointing)
    measured = held(model, opt) + peak_while(step)
    plan = planned(cfg, mode, checkpointing)
    tensors = plan.update_peak - plan.runtime  # the tensors' own: not the process's tokenizers and objects
    assert abs(tensors / measured - 1) <= TOLERANCE, (tensors, measured)
    # The activations really are the largest term here, so the check is of them, not of the weights.
    assert plan.activations > plan.weights + plan.optimizer


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_rollout_peak_is_within_15_percent_of_the_measured_one(kind):
    from marl_llm.rollout.decode import decode
    from marl_llm.rollout.sampling import SamplingParams

    model, cfg, opt, _ = build(kind, "full", False)
    model.eval()
    prompts = [torch.randint(1, cfg.vocab_size, (P,)).tolist() for _ in range(ROWS)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=C, min_new_tokens=C)] * ROWS

    def rollout():
        with torch.inference_mode():
            decode(model, prompts, [None] * ROWS, params, [cfg.vocab_size + 1], 0, row_keys=list(range(ROWS)))

    measured = held(model, opt) + peak_while(rollout)
    plan = planned(cfg, "full", False)
    tensors = plan.rollout_peak - plan.runtime
    assert abs(tensors / measured - 1) <= TOLERANCE, (tensors, measured)
    assert max(plan.prefill, plan.kv) > plan.weights  # the rows' terms dominate


# ------------------------------------------------------------------------------- real runs' RSS
@pytest.fixture(scope="module")
def measured_runs_files(tmp_path_factory):
    """The 43M-parameter model and the team task of scripts/measure_memory_plan.py (its QUICK sizes)."""
    work = tmp_path_factory.mktemp("memory_plan_runs")
    return (measure_memory_plan.build_model(work / "model"),
            measure_memory_plan.write_task(work / "task", measure_memory_plan.QUICK), work)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora", "full", "fsdp", "bf16"])
def test_a_real_runs_peak_memory_is_within_15_percent_of_its_plan(name, measured_runs_files):
    """A two-step marl-llm run per configuration (fsdp: 2 gloo ranks, each measured), each
    process's peak RSS growth against the plan the run prints. glibc's mmap threshold is kept at
    its starting value (MALLOC_MMAP_THRESHOLD_=131072): with its defaults glibc keeps the freed
    blocks of an update in its heap, and the peak RSS then runs up to ~15% above what the run
    holds at once (results/memory_plan.md measures both)."""
    model_dir, task_dir, work = measured_runs_files
    run = measure_memory_plan.measure(name, model_dir, task_dir, work, measure_memory_plan.QUICK, rank_port(),
                                      timeout=600)
    assert len(run["measured"]) == (2 if name == "fsdp" else 1)
    plan = run["plan"]
    for rank in run["measured"]:
        measured = measure_memory_plan.measured_peak(rank)
        assert abs(plan["peak"] / measured - 1) <= TOLERANCE, (name, rank["rank"], plan, rank["peaks"])
        # The run's own terms dominate what the interpreter adds (~60 MiB): a check of the plan, not of Python.
        assert measured > 300 * 2**20 and {"rollout", "update"} <= rank["peaks"].keys()
    if name == "fsdp":  # the root unit (embedding and tied head) gathered in the update: a term of its own
        assert plan["update_transients"] > plan["activations"]


# ------------------------------------------------------------------------ terms measured alone
@pytest.mark.parametrize("trained", [False, True])
def test_the_lm_heads_chunk_keeps_logit_buffers_of_its_logits(trained):
    """models/scoring.py's chunked head, forward and backward with the entropy: its peak is
    LOGIT_BUFFERS [rows, V] fp32 buffers (the plan's head term), within 10%."""
    from marl_llm.distributed.memory_terms import LOGIT_BUFFERS
    from marl_llm.models.scoring import TRAINED_HEAD_CHUNK_TOKENS, token_logprobs

    V, H, rows = 4096, 64, TRAINED_HEAD_CHUNK_TOKENS  # a trained head's chunks are at least that many rows
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.requires_grad_(trained)
    states = torch.randn(1, 2 * rows, H, requires_grad=True)  # two chunks
    targets, mask = torch.randint(0, V, (1, 2 * rows)), torch.ones(1, 2 * rows)

    def score():
        logp, entropy = token_logprobs(states, targets, mask, head, with_entropy=True, chunk_elements=rows * V)
        logp.sum().backward()

    gradient = V * H * 4 if trained else 0  # the head's own gradient, from the first chunk's backward
    buffers = (peak_while(score) - gradient) / (rows * V * 4)
    assert buffers == pytest.approx(LOGIT_BUFFERS, rel=0.1)


def test_adamw_on_the_cpu_keeps_temporaries_of_its_largest_tensor():
    """torch's AdamW on the CPU steps one tensor at a time: its step's peak is two temporaries of the
    largest tensor, the first as a model's embedding is (the plan's CPU optimizer term), within 10%."""
    from marl_llm.distributed.memory_terms import SINGLE_TENSOR_STEP_TEMPORARIES

    params = [torch.nn.Parameter(torch.randn(2048, 256)), torch.nn.Parameter(torch.randn(512, 256))]
    params += [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(8)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the moments exist
    planned = SINGLE_TENSOR_STEP_TEMPORARIES * 2048 * 256 * 4
    assert peak_while(opt.step) == pytest.approx(planned, rel=0.1)


# ---------------------------------------------------------------------------- terms of a GPU
def plan_8b(*overrides: str, gpus: int = 8, gib: float = 79.6, device: str = "cuda"):
    from marl_llm.distributed.memory_plan import for_config

    cfg = compose_config(["experiment=at_grpo_sokoban_qwen3_8b_paper", "run_dir=/tmp/p", *overrides])
    return for_config(cfg, ("agent1", "agent2"), gpus, None if gib is None else int(gib * 2**30), device)


def test_a_gpu_plan_counts_the_cuda_context_cublas_and_nccl_and_fsdps_root_unit():
    from marl_llm.distributed import memory_terms as mp

    eight = plan_8b()
    assert eight.runtime == mp.CUDA_CONTEXT_BYTES + mp.CUBLAS_WORKSPACE_BYTES + mp.NCCL_BUFFER_BYTES
    assert "CUDA context, cuBLAS, NCCL buffers" in "\n".join(eight.lines())
    # NCCL's 588 MiB: 32 channels x 2 peers x (4 MiB SIMPLE + LL128 + LL) buffers.
    assert mp.NCCL_BUFFER_BYTES / 2**20 == pytest.approx(588, abs=1)
    one = plan_8b("trainer.fsdp=false", gpus=1)
    assert one.runtime == mp.CUDA_CONTEXT_BYTES + mp.CUBLAS_WORKSPACE_BYTES  # one process: no NCCL
    # Qwen3-8B's root unit (embedding and untied head, 1.24B parameters) gathered in bf16 and the head's
    # unsharded bf16 gradient, beside the activations in the update.
    arch = eight.arch
    assert not arch.tied and arch.root_params == pytest.approx(1.245e9, rel=0.01)
    assert eight.update_transients >= 2 * arch.root_params + 2 * arch.head_params
    # On the CPU the process's own memory instead, and no GPU term.
    cpu = plan_8b(gpus=8, gib=None, device="cpu")
    assert cpu.runtime == mp.CPU_PROCESS_BYTES and "process (tokenizers, Python)" in "\n".join(cpu.lines())


def test_the_compiled_decode_keeps_a_rounded_cache_per_model_through_the_rollout():
    """trainer=gpu decodes with the compiled static step: each fully fine-tuned policy's model keeps
    its cache, rounded up to its rows and capacity multiples, until the rollout phase ends
    (rollout/static_step.py), so two policies hold two caches; the eager loop frees each call's."""
    from marl_llm.distributed.memory_plan import for_config
    from marl_llm.models.memory import kv_cache_bytes
    from marl_llm.rollout.static_step import CAPACITY_MULTIPLE, ROW_MULTIPLE, round_up

    def plan(*overrides: str):
        cfg = compose_config(["experiment=magrpo_tldr_paper", "trainer=gpu", "trainer.sequences_per_generate=30",
                              "plan.prompt_tokens=500", "run_dir=/tmp/p", *overrides])
        return for_config(cfg, ("summarizer", "expander"), 1, 1000 * 2**30, "cuda")

    compiled, eager = plan(), plan("trainer.compile_decode=false", "trainer.decode=dynamic")
    assert compiled.work.compiled_decode and not eager.work.compiled_decode and compiled.work.policies == 2
    per_position = kv_cache_bytes(compiled.arch.config, "bfloat16", 1)
    positions = 500 + compiled.work.new_tokens
    assert eager.kv == per_position * 30 * positions
    assert compiled.kv == 2 * per_position * round_up(30, ROW_MULTIPLE) * round_up(positions, CAPACITY_MULTIPLE)


# ------------------------------------------------------------------- rows the KV budget trims
def test_the_plan_trims_the_rows_as_the_runtimes_kv_budget_would_instead_of_refusing():
    """Where only the rollout's KV cache does not fit, the run would not fail: the KV budget
    (models/memory.kv_budget: 80% of the free memory) cuts each generate call's rows
    (rollout/decode.kv_chunks). The plan cuts them the same way, says so, and fits."""
    from marl_llm.distributed.memory_terms import GiB
    from marl_llm.models.memory import CUDA_FREE_SHARE, kv_cache_bytes
    from marl_llm.rollout.decode import kv_chunks

    whole = plan_8b("trainer.sequences_per_generate=64", gib=1000)  # room for all 64 rows
    assert whole.rows_per_call == 64 and not any("KV budget" in n for n in whole.notes)
    trimmed = plan_8b("trainer.sequences_per_generate=64")
    assert 1 < trimmed.rows_per_call < 64 and trimmed.fits
    assert f"KV budget: {trimmed.rows_per_call} rows per generate call (trainer.sequences_per_generate=64)" \
        in "\n".join(trimmed.lines())
    # The runtime's own cut, with the budget of the memory the plan leaves free: the same rows.
    w = trimmed.work
    free = trimmed.gpu_bytes - trimmed.held - trimmed.rollout_weights
    per_position = kv_cache_bytes(trimmed.arch.config, "bfloat16", 1)
    chunks = kv_chunks([w.prompt_tokens] * 64, [w.new_tokens] * 64, 64, int(CUDA_FREE_SHARE * free) // per_position)
    assert len(chunks[0]) == trimmed.rows_per_call
    # An explicit budget (trainer.kv_cache_gib) cuts as it says.
    explicit = plan_8b("trainer.kv_cache_gib=7")
    assert explicit.rows_per_call == int(7 * GiB) // (per_position * (2 * w.prompt_tokens + w.new_tokens))
    assert "trainer.kv_cache_gib=7" in "\n".join(explicit.lines())
    # Where not even the weights leave room, nothing is trimmed away into a fit.
    tiny_gpu = plan_8b(gib=40)
    assert not tiny_gpu.fits and tiny_gpu.rows_per_call == 1 and not math.isnan(tiny_gpu.peak)


# ------------------------------------------------------------------------------ the presets' models
@pytest.mark.parametrize("hub_id, billions", [("Qwen/Qwen3-8B", 8.19), ("Qwen/Qwen2.5-Coder-3B", 3.09),
                                              ("Qwen/Qwen3-1.7B", 1.72), ("Qwen/Qwen3-4B-Instruct-2507", 4.02)])
def test_the_presets_models_have_their_published_sizes(hub_id, billions):
    from omegaconf import OmegaConf

    from marl_llm.distributed import memory_terms as mp

    cfg = mp.model_config(OmegaConf.create(dict(path=None, embedded=False, hub_id=hub_id, agent_bases=None)))
    assert mp.arch(cfg).params / 1e9 == pytest.approx(billions, rel=0.01)


def test_the_known_shapes_agree_with_the_gpu_benchmarks():
    from marl_llm.bench.gpu import ARCHS
    from marl_llm.distributed.memory_terms import KNOWN_CONFIGS

    known = KNOWN_CONFIGS["Qwen/Qwen2.5-Coder-3B"]
    assert {k: v for k, v in ARCHS["qwen2.5-3b"].items()} == {k: known[k] for k in ARCHS["qwen2.5-3b"]}


def paper_presets() -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*_paper*.yaml"))


@pytest.mark.parametrize("preset", paper_presets())
def test_every_paper_preset_states_hardware_it_fits(preset):
    from marl_llm.cli.plan import plan_lines

    text = (REPO / "conf" / "experiment" / f"{preset}.yaml").read_text()
    assert re.search(r"^plan:\n  gpus: \d+\n  gpu_gib: [\d.]+", text, re.M), f"{preset} states no plan.gpus/gpu_gib"
    lines, fits = plan_lines([f"experiment={preset}"])
    assert fits, "\n".join(lines)


@pytest.mark.parametrize("preset", ["at_grpo_sokoban_qwen3_8b_paper", "at_grpo_plan_path_qwen3_8b_paper",
                                    "magrpo_humaneval_paper", "magrpo_coophumaneval_paper"])
def test_the_largest_full_fine_tuning_presets_fit_eight_80_gb_gpus_and_not_one(preset):
    from marl_llm.cli.plan import plan_lines

    cfg = compose_config([f"experiment={preset}", "run_dir=/tmp/p"])
    assert cfg.algo.lora is None and 1 < cfg.plan.gpus <= 8 and cfg.plan.gpu_gib == 79.6 and cfg.trainer.fsdp
    lines, fits = plan_lines([f"experiment={preset}", "plan.gpus=8"])
    assert fits, "\n".join(lines)
    lines, fits = plan_lines([f"experiment={preset}", "plan.gpus=1"])
    peak = next(line for line in lines if line.startswith("  peak"))
    assert not fits and "DOES NOT FIT" in peak and lines[-1].startswith("  to fit:")


def test_a_cpu_run_without_a_gpu_size_plans_per_process_not_per_gpu():
    from marl_llm.distributed.memory_plan import for_config

    cfg = compose_config(["task=tldr", "run_dir=/tmp/p"])
    cpu = for_config(cfg, ("a", "b"), 2, None, "cpu").lines()[0]
    assert "on 2 processes, placement=" in cpu and cpu.endswith("per process:") and "GPU" not in cpu
    gpu = for_config(cfg, ("a", "b"), 1, 80 * 2**30, "cpu").lines()[0]  # plan.gpu_gib on the CPU
    assert "on 1 GPU of 80 GiB" in gpu and gpu.endswith("per GPU:")


# ---------------------------------------------------------------------------------- the console
def test_marl_llm_plan_prints_the_terms_and_exits_by_the_fit():
    cli = str(VENV_BIN / "marl-llm-plan")
    out = subprocess.run([cli, "experiment=at_grpo_sokoban_qwen3_8b_paper"], capture_output=True, text=True,
                         timeout=300, env=env())
    assert out.returncode == 0, out.stdout + out.stderr
    for term in ("weights + master weights", "gradients + optimizer states", "KV cache (", "activations (checkpointing",
                 "peak"):
        assert term in out.stdout
    assert "on 8 GPUs of 79.6 GiB, placement=shared, FSDP over 8" in out.stdout and " fits" in out.stdout
    small = subprocess.run([cli, "experiment=at_grpo_sokoban_qwen3_8b_paper", "plan.gpus=2", "plan.gpu_gib=24"],
                           capture_output=True, text=True, timeout=300, env=env())
    assert small.returncode == 1 and "DOES NOT FIT in 24 GiB" in small.stdout and "to fit:" in small.stdout
    bad = subprocess.run([cli, "trainer.placement=nowhere"], capture_output=True, text=True, timeout=300, env=env())
    assert bad.returncode == 2 and "trainer.placement=nowhere" in bad.stderr and "Traceback" not in bad.stderr


def test_a_run_that_cannot_fit_stops_within_seconds_with_its_plan(tiny_model_dir, tmp_path):
    start = time.monotonic()
    out = subprocess.run([str(VENV_BIN / "marl-llm"), *tiny_overrides(tiny_model_dir, tmp_path / "run"),
                          "plan.gpu_gib=0.001"], capture_output=True, text=True, timeout=300, env=env())
    assert out.returncode != 0
    assert "memory plan: 1 policy" not in out.stdout  # two agents, two LoRA adapters: "2 policies"
    assert "memory plan: 2 policies" in out.stdout and "DOES NOT FIT in 0.001 GiB" in out.stdout
    assert "on 1 GPU of 0.001 GiB" in out.stdout and "per GPU:" in out.stdout  # plan.gpu_gib: a GPU's size to check
    assert "the memory plan above does not fit" in out.stderr and "plan.check=false" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "checkpoint.pt").exists() and "step 1/1" not in out.stdout  # nothing trained
    assert time.monotonic() - start < 120
