"""perf.py: the FLOP model against a hand count and against torch's own FlopCounterMode, device
peaks, and the perf metrics of a real (tiny) training run."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import compose_config, make_policies, tiny_overrides
from marl_llm.training import perf
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.rollout.base import GenRequest
from marl_llm.rollout.decode import HFRollout, decode
from marl_llm.rollout.sampling import SamplingParams

# The tiny Llama of conftest.build_tiny_model: hidden 32, MLP 64, 2 layers, 2 heads of 16, 1 KV head.
HIDDEN, MLP, LAYERS, HEAD_DIM, KV_DIM = 32, 64, 2, 16, 16
N_LINEAR = LAYERS * (HIDDEN * HIDDEN * 2 + HIDDEN * KV_DIM * 2 + 3 * HIDDEN * MLP)  # q, o; k, v; gate, up, down
D_ATTN = 2 * HEAD_DIM


def hand_pass(new: int, past: int, kept: int, vocab: int) -> dict[str, float]:
    """One row's forward FLOPs, written out: query i of `new` attends to past + i keys."""
    return {"linear": 2 * N_LINEAR * new,
            "attention": sum(4 * LAYERS * D_ATTN * (past + i) for i in range(1, new + 1)),
            "head": 2 * HIDDEN * vocab * kept}


def add(*parts: dict[str, float]) -> dict[str, float]:
    return {k: sum(p[k] for p in parts) for k in ("linear", "attention", "head")}


def test_shape_of_the_tiny_model(tiny_model_dir):
    pol = make_policies(tiny_model_dir)
    shape = perf.ModelShape.of(pol.models[0])  # a peft model: LoRA weights are not counted
    assert (shape.n_linear, shape.n_layers, shape.d_attn, shape.d_model, shape.kv_dim) == \
        (N_LINEAR, LAYERS, D_ATTN, HIDDEN, KV_DIM)
    assert shape.vocab == len(pol.tokenizers[0])


def test_generation_flops_match_a_hand_count_and_the_decode_loop(tiny_model_dir):
    """Generation counted from lengths (what MeteredRollout logs) equals the count written out by
    hand; the hooks on the rollout's own decode loop (mixed adapters, a shared prompt prefilled
    once) count the same when no row finishes early, and more when finished rows run on as
    padding (work done, not credited)."""
    pol = make_policies(tiny_model_dir)
    model, tok = pol.models[0], pol.tokenizers[0]
    counter = perf.FlopCounter()
    shape = counter.watch(model)
    V = shape.vocab
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [5, 6, 7], [5, 6, 7]]
    adapters = ["agent_aux", "agent_main", "agent_aux", "agent_main"]
    rows = list(zip(adapters, map(tuple, prompts)))
    # Prefill: three distinct (adapter, prompt) pairs (rows 0 and 2 share one), last logits only.
    prefill = [hand_pass(3, 0, 1, V), hand_pass(5, 0, 1, V), hand_pass(3, 0, 1, V)]

    def hand(lengths: list[int]) -> dict[str, float]:
        # A row feeds back its tokens but the last, token t with len(prompt) + t cached before it.
        steps = [hand_pass(1, len(p) + t, 1, V) for p, n in zip(prompts, lengths) for t in range(n - 1)]
        return add(*prefill, *steps)

    for lengths in ([4, 4, 4, 4], [4, 4, 4, 2]):
        want = hand(lengths)
        assert perf.generation_flops(shape, rows, lengths) == pytest.approx(want, rel=1e-12)
        before = counter.totals()
        params = [SamplingParams(temperature=1.0, max_new_tokens=n, min_new_tokens=n) for n in lengths]
        with torch.inference_mode():
            out = decode(model, prompts, adapters, params, pol.eos_ids[0], tok.pad_token_id)
        assert [len(o) for o in out] == lengths
        ran = {k: v - before[k] for k, v in counter.totals().items()}
        if len(set(lengths)) == 1:
            assert ran == pytest.approx(want, rel=1e-12)
        else:
            assert all(ran[k] >= want[k] for k in want) and ran["linear"] > want["linear"]
    counter.close()
    before = counter.totals()
    with torch.inference_mode():
        decode(model, prompts, adapters, params, pol.eos_ids[0], tok.pad_token_id)
    assert counter.totals() == before  # closed: no more counting


def test_padding_is_not_counted(tiny_model_dir):
    """A left-padded batch counts what each row alone would (the attention mask says which
    positions are real); the LM head counts every position whose logits it computes."""
    pol = make_policies(tiny_model_dir)
    model = pol.models[0]
    counter = perf.FlopCounter()
    V = counter.watch(model).vocab
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    att = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=att, logits_to_keep=2)
    want = add(hand_pass(3, 0, 0, V), hand_pass(5, 0, 0, V), {"linear": 0, "attention": 0, "head": 2 * HIDDEN * V * 4})
    assert counter.totals() == pytest.approx(want)


@pytest.mark.parametrize("kind", ["frozen", "trained", "trained_checkpointing"])
def test_forward_and_backward_agree_with_torch_flop_counter(tiny_model_dir, kind):
    """Independent check of the FLOP model and its backward multipliers: torch's FlopCounterMode
    counts the matmuls that really run (eager attention: full L x L products, where the model
    counts the causal half). frozen: no weight gradients, input gradients only (inputs_embeds
    requires grad, as a LoRA'd frozen base passes gradients down); trained: every weight."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager", dtype=torch.float32)
    model.requires_grad_(kind != "frozen")
    if kind == "trained_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    counter = perf.FlopCounter()
    shape = counter.watch(model)
    B, L = 2, 12
    ids = torch.randint(3, 1000, (B, L), generator=torch.Generator().manual_seed(0))
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with FlopCounterMode(display=False) as ftc:
        with torch.no_grad():  # a forward without gradients: counted once
            model(inputs_embeds=embeds, use_cache=False)
        no_grad = counter.totals()
        model(inputs_embeds=embeds, use_cache=False).logits.float().sum().backward()
    ops = {str(op).split(".")[-1]: n for op, n in ftc.get_flop_counts()["Global"].items()}
    matmuls, attention = ops.get("mm", 0) + ops.get("addmm", 0), ops.get("bmm", 0)
    fwd = add(hand_pass(L, 0, L, shape.vocab), hand_pass(L, 0, L, shape.vocab))
    assert no_grad == pytest.approx(fwd)
    # Checkpointing reruns each layer's forward but its last projection (MLP down: nothing saved
    # its output, so torch's non-reentrant recomputation stops before it).
    rerun = 1 - LAYERS * HIDDEN * MLP / N_LINEAR
    assert shape.n_recompute == N_LINEAR * rerun
    m_linear, m_attention, m_head = {"frozen": (2, 3, 2), "trained": (3, 3, 3),
                                     "trained_checkpointing": (3 + rerun, 4, 3)}[kind]
    got = counter.totals()
    want = {"linear": fwd["linear"] * (1 + m_linear), "attention": fwd["attention"] * (1 + m_attention),
            "head": fwd["head"] * (1 + m_head)}
    assert got == pytest.approx(want)
    # The linear layers and the LM head are exactly the matmuls torch ran.
    assert got["linear"] + got["head"] == pytest.approx(matmuls, rel=1e-9)
    # Attention: torch ran the full squares, the model counts their causal half.
    assert got["attention"] == pytest.approx(attention * (L + 1) / (2 * L), rel=1e-9)


def test_lora_update_pass_counts_input_gradients_only(tiny_model_dir):
    """A LoRA policy's scoring pass with gradients (the update): the frozen base's linear layers
    and head cost 2x their forward, attention 3x; a pass no gradient reaches costs its forward."""
    pol = make_policies(tiny_model_dir)
    counter = perf.FlopCounter()
    V = counter.watch(pol.models[0]).vocab
    ids = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 12, 13]])
    att = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    fwd = add(hand_pass(4, 0, 0, V), hand_pass(5, 0, 0, V), {"linear": 0, "attention": 0, "head": 2 * HIDDEN * V * 6})
    with pol.acting(0) as model:
        logits = model(input_ids=ids, attention_mask=att, logits_to_keep=3).logits
        assert counter.totals() == pytest.approx(fwd)  # nothing for the backward before it runs
        logits.float().logsumexp(-1).sum().backward()
        model(input_ids=ids, attention_mask=att, logits_to_keep=3)  # never backpropagated
    want = {"linear": 3 * fwd["linear"], "attention": 4 * fwd["attention"], "head": 3 * fwd["head"]}
    assert counter.totals() == pytest.approx(want)


def test_metered_rollout_times_generation_and_counts_it_from_lengths(tiny_model_dir):
    """MeteredRollout (any backend, vLLM included) counts generation from the completions'
    lengths, its own hooks paused: the same as a separate counter's hooks on the same decode
    (fixed lengths: no row runs on as padding), and nothing twice."""
    pol = make_policies(tiny_model_dir)
    meter = perf.Meter()
    meter.watch(pol.models)
    hooks = perf.FlopCounter()
    hooks.watch(pol.models[0])
    rollout = perf.MeteredRollout(HFRollout(pol), meter, pol)
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, min_new_tokens=5)
    requests = [GenRequest(i % 2, f"Say {word}.", sp, key=i) for i, word in enumerate(["hi", "hi", "yes", "no"])]
    out = rollout.generate(requests)
    assert all(len(c.completion_ids) == 5 for c in out)
    assert meter.generate_seconds > 0 and meter.generate_flops > 0
    assert meter.generate_flops == pytest.approx(hooks.total) == pytest.approx(meter.flops.total)
    assert rollout.max_batch == 64 and rollout.policies is pol  # the backend's own attributes


def test_device_peaks_and_overrides():
    spec = perf.device_spec
    assert spec("NVIDIA H100 80GB HBM3").bf16 == 989.4 and spec("NVIDIA H100 80GB HBM3").bandwidth_tbs == 3.35
    assert spec("NVIDIA H100 PCIe").bf16 == 756.0
    assert spec("NVIDIA H200").bandwidth_tbs == 4.8 and spec("NVIDIA H200").bf16 == 989.4
    assert spec("NVIDIA A100-SXM4-80GB").bf16 == 312.0 and spec("NVIDIA A100-SXM4-80GB").bandwidth_tbs == 2.039
    assert spec("NVIDIA L40S").bf16 == 362.05 and spec("NVIDIA L4").bf16 == 121.0
    assert spec("Some Future GPU") is None
    assert perf.peak_tflops("cpu", torch.bfloat16) is None  # no MFU on the CPU unless given
    assert perf.peak_tflops("cpu", torch.float32, 2.5) == 2.5
    assert perf.memory_bandwidth_tbs("cpu") is None and perf.memory_bandwidth_tbs("cpu", 0.1) == 0.1
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert perf.compute_precision(torch.float32) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert perf.compute_precision(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert perf.compute_precision(torch.bfloat16) == "bf16"


def test_cuda_branches_synchronize_reset_and_read_peak_memory(monkeypatch):
    """The CUDA branches of the meter and the peak lookup, run here with torch.cuda's calls
    recorded: every clock read synchronizes first, a step resets the peak-memory statistic, the
    peak comes from the device name, an unknown GPU warns and logs no MFU."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(perf, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert perf.peak_tflops("cuda", torch.float32) == 66.9 and perf.memory_bandwidth_tbs("cuda") == 3.35
    meter = perf.Meter("cuda", perf.peak_tflops("cuda", torch.bfloat16))
    assert meter.peak_tflops == 989.4
    meter.start_step()
    meter.mark("rollout")
    meter.mark("update")
    assert calls == ["reset", "sync", "sync", "sync"]
    m = meter.step_metrics()
    assert m["perf/peak_gpu_mem_gib"] == 3.0
    assert {k for k in m if k.startswith("perf/mfu/")} == {"perf/mfu/update", "perf/mfu/step"}  # nothing generated
    monkeypatch.setattr(perf, "device_name", lambda device: "Mystery GPU 9000")
    with pytest.warns(UserWarning, match="trainer.peak_tflops"):
        assert perf.peak_tflops("cuda", torch.bfloat16) is None


def test_peak_tflops_key_is_checked(tmp_path):
    cfg = compose_config(["model=smollm2_135m", f"run_dir={tmp_path}", "trainer.peak_tflops=0"])
    with pytest.raises(UserError, match="trainer.peak_tflops"):
        validate(cfg)


def test_training_run_logs_timings_flops_and_mfu(tiny_model_dir, tmp_path):
    from marl_llm.training.trainer import train

    run_dir = tmp_path / "run"
    train(compose_config(tiny_overrides(tiny_model_dir, run_dir, "trainer.peak_tflops=0.5", "trainer.eval_before=false",
                                        "trainer.eval_after=false")))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    m = {k.removeprefix("train/"): v for k, v in rows[0].items() if k.startswith("train/")}
    for key in ("timing/rollout", "timing/generate", "timing/update", "perf/tflop/generate", "perf/tflop/update",
                "perf/tflop/step", "perf/mfu/generate", "perf/mfu/update", "perf/mfu/step"):
        assert m[key] > 0, key
    assert m["timing/generate"] + m["timing/scoring"] == pytest.approx(m["timing/rollout"])
    assert m["timing/rollout"] + m["timing/update"] == pytest.approx(m["step_time"])
    # The step's FLOPs: generation, the update's passes, nothing counted twice.
    assert m["perf/tflop/generate"] + m["perf/tflop/update"] <= m["perf/tflop/step"] * (1 + 1e-9)
    assert m["perf/mfu/step"] == pytest.approx(m["perf/tflop/step"] / (m["step_time"] * 0.5))
    assert "perf/peak_gpu_mem_gib" not in m  # CUDA only
