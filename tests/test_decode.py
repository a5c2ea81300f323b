"""The decode loop (rollout.decode): the same tokens however rows are batched or compacted,
dynamic or static; host reads only every COMPACT_EVERY steps; a fixed-point sampler that draws
from the right distribution with integer prefix sums only; MixedLoRA in the base's compute dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import assert_close_to_scale, compose_config, make_policies, tiny_overrides
from marl_llm.rollout import decode as rollout
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.rollout.mixed_lora import MixedLoRA
from marl_llm.models.prompting import encode_prompt
from marl_llm.rollout.decode import COMPACT_EVERY, PerRowSampling, SamplingParams, decode
from marl_llm.rollout.sampling import sample_rows
from test_rollout import hf_greedy

# Rows of every kind: greedy, plain, top-k, top-p, both, held-back end of sequence, sharing a
# prompt (one prefill), both adapters, prompts of different lengths (left padding).
ROWS = [  # (agent, message, sampling, key)
    (0, "solve it", SamplingParams(temperature=0.0, max_new_tokens=40), 1),
    (1, "solve it", SamplingParams(temperature=1.0, max_new_tokens=40), 2),
    (1, "solve it", SamplingParams(temperature=1.0, max_new_tokens=40), 3),
    (0, "a much longer prompt " * 4, SamplingParams(temperature=0.7, top_k=50, max_new_tokens=40), 4),
    (1, "short", SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=35), 5),
    (0, "x", SamplingParams(temperature=1.0, top_k=100, top_p=0.5, max_new_tokens=40, min_new_tokens=20), 6),
    (1, "hello there", SamplingParams(temperature=1.0, max_new_tokens=40, min_new_tokens=33), 7),
    (0, "solve it", SamplingParams(temperature=1.0, max_new_tokens=9), 8),
]
# The tiny model's next-token distribution is nearly flat: ending on any of 3000 ids (~6% per
# step) gives rows that end before, between and after the checks at steps 16 and 32.
EXTRA_EOS = list(range(1000, 4000))


def run_rows(policies, rows, **kwargs) -> list[list[int]]:
    model, tok = policies.models[0], policies.tokenizers[0]
    prompts = [encode_prompt(tok, m) for _, m, _, _ in rows]
    adapters = [policies.agents[a].adapter for a, _, _, _ in rows]
    with torch.inference_mode():
        out = decode(model, prompts, adapters, [s for _, _, s, _ in rows], policies.eos_ids[0] + EXTRA_EOS,
                     tok.pad_token_id, row_keys=[k for _, _, _, k in rows], **kwargs)
    return [o.tolist() for o in out]


def generated_length(ids: list[int], pad_id: int) -> int:
    return sum(i != pad_id for i in ids)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small to split over threads: one thread decodes several times
    faster than two (tens of times on a busy shared machine, where OpenMP threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policies(tiny_model_dir):
    return make_policies(tiny_model_dir)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_every_row_decodes_as_it_would_alone(policies, static):
    """Batched with rows that end at other steps (compacted away every COMPACT_EVERY steps, or
    running on as padding in the static loop), each keyed row gets exactly the tokens it gets
    decoded on its own."""
    batched = run_rows(policies, ROWS, static=static)
    alone = [run_rows(policies, [row], static=static)[0] for row in ROWS]
    assert batched == alone
    pad = policies.tokenizers[0].pad_token_id
    lengths = [generated_length(ids, pad) for ids in batched]
    # The batch really changed under the loop: rows ended before the first check and after the second.
    assert min(lengths) < COMPACT_EVERY and max(lengths) > 2 * COMPACT_EVERY, lengths
    assert lengths[5] >= 20 and lengths[6] >= 33 and lengths[7] <= 9  # min and max lengths held
    assert batched[1] != batched[2]  # siblings of one prompt draw their own tokens


def test_static_decode_gives_the_dynamic_tokens_and_generates_greedy(policies):
    assert run_rows(policies, ROWS, static=True) == run_rows(policies, ROWS)
    # The static step on its own against transformers' generate (default EOS ids only).
    policies_eos = policies.eos_ids[0]
    model, tok = policies.models[0], policies.tokenizers[0]
    cases = [(0, "solve it", 7), (1, "a much longer prompt " * 4, 5)]
    with torch.inference_mode():
        out = decode(model, [encode_prompt(tok, m) for _, m, _ in cases],
                     [policies.agents[a].adapter for a, _, _ in cases],
                     [SamplingParams(temperature=0.0, max_new_tokens=n) for _, _, n in cases], policies_eos,
                     tok.pad_token_id, static=True)
    for (a, m, n), ids in zip(cases, out):
        assert rollout.cut_at_eos(ids, policies_eos)[0].tolist() == hf_greedy(policies, a, m, n)


def test_keyed_rows_are_reproducible_and_unkeyed_rows_follow_the_global_seed(policies):
    assert run_rows(policies, ROWS) == run_rows(policies, ROWS)
    unkeyed = [(a, m, s, None) for a, m, s, _ in ROWS]
    torch.manual_seed(11)
    first = run_rows(policies, unkeyed)
    torch.manual_seed(11)
    assert run_rows(policies, unkeyed, static=True) == first
    torch.manual_seed(12)
    assert run_rows(policies, unkeyed) != first


class HostReads(TorchFunctionMode):
    """Counts what makes the host wait on the device (a sync on a GPU): reading values, and
    boolean-mask indexing (its result size is data-dependent). Also records cumsum dtypes."""

    READS = {"__bool__", "item", "tolist", "cpu", "numpy", "nonzero", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.cumsum_dtypes: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        if name in ("__getitem__", "__setitem__") and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flat(args[1:2])):
            self.reads.append(name + "[bool]")
        if name == "cumsum":
            self.cumsum_dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _flat(items):
    for item in items:
        yield from (_flat(item) if isinstance(item, (tuple, list)) else [item])


class SyncFreeSampling(PerRowSampling):
    """The sampler as it runs on a GPU (no candidate pass for top-p, which reads on the host)."""

    def __init__(self, params, device):
        super().__init__(params, device, sync_free=True)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_loop_reads_the_device_only_at_its_checks(policies, monkeypatch, static):
    """Host reads grow by one per COMPACT_EVERY steps, not per token (the loop before this read
    the device 21 times per token on these rows); every prefix sum is over integers (a float
    cumsum is not deterministic on CUDA)."""
    monkeypatch.setattr(rollout, "PerRowSampling", SyncFreeSampling)
    counts = {}
    for steps in (20, 40):  # every row runs to `steps` tokens
        fixed = [(a, m, dataclasses.replace(s, max_new_tokens=steps, min_new_tokens=steps), k) for a, m, s, k in ROWS]
        with HostReads() as spy:
            run_rows(policies, fixed, static=static)
        counts[steps] = len(spy.reads)
        assert spy.cumsum_dtypes <= {torch.int64}, spy.cumsum_dtypes
    assert counts[40] - counts[20] == 40 // COMPACT_EVERY - 20 // COMPACT_EVERY, counts


# --------------------------------------------------------------------------------- the sampler
SCORES = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=torch.float64)


def reference_distribution(p: SamplingParams) -> torch.Tensor:
    """From the definitions, in float64: temperature; top-k keeps the k best tokens; top-p then
    keeps the best tokens of that renormalised distribution while the mass before them is below
    top_p (the smallest set reaching it)."""
    if p.temperature <= 0:
        return torch.nn.functional.one_hot(SCORES.argmax(), len(SCORES)).double()
    probs = (SCORES / p.temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if p.top_k:
        probs[order[p.top_k:]] = 0
        probs = probs / probs.sum()
    before = 0.0
    for i in order:
        if before >= p.top_p:
            probs[i] = 0
        before += float(probs[i])
    return probs / probs.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(temperature=1.5, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.8, top_k=5, top_p=0.7),
    SamplingParams(temperature=0.0)], ids=["t1", "t0.5", "topk3", "topp0.8", "topk5-topp0.7", "greedy"])
@pytest.mark.parametrize("sync_free", [False, True])
def test_sampler_draws_the_filtered_distribution(params, sync_free):
    n = 40_000
    draws = torch.rand(n, generator=torch.Generator().manual_seed(0))
    sampler = PerRowSampling([params] * n, torch.device("cpu"), sync_free=sync_free)
    tokens = sampler.sample(SCORES.float().expand(n, -1), draws)
    freq = torch.bincount(tokens, minlength=len(SCORES)).double() / n
    want = reference_distribution(params)
    assert torch.all(freq[want == 0] == 0), freq  # never a filtered token
    assert (freq - want).abs().max() < 0.01, (freq, want)  # ~4 standard errors at p=0.5


def test_sample_rows_inverts_the_cdf_exactly():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.25, 0.5, 0.0]]).expand(7, -1)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.4999, 0.5, 0.9999, 1.0 - 2 ** -24])
    assert sample_rows(probs, u).tolist() == [1, 1, 3, 3, 4, 4, 4]  # boundaries land on the next token
    one_hot = torch.zeros(3, 49_152)
    one_hot[0, 7], one_hot[1, 49_151], one_hot[2, 0] = 1, 1, 1
    assert sample_rows(one_hot, torch.tensor([0.0, 0.5, 1.0 - 2 ** -24])).tolist() == [7, 49_151, 0]


def test_top_p_with_and_without_the_candidate_pass_keeps_the_same_tokens():
    """The CPU's partial top-k (and its full sort of the wide rows) against the sync-free full sort."""
    torch.manual_seed(1)
    scores = torch.cat([torch.randn(3, 5000) * 6, torch.randn(3, 5000) * 0.1])  # narrow and wide nuclei
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.6, 0.95, 1.0, 0.6, 0.95, 1.0)]
    cpu = PerRowSampling(params, torch.device("cpu"))
    assert not cpu.sync_free
    gpu_like = PerRowSampling(params, torch.device("cpu"), sync_free=True)
    a, b = cpu(None, scores.clone()), gpu_like(None, scores.clone())
    assert torch.equal(a, b)
    kept = (a > torch.finfo(a.dtype).min).sum(dim=1)
    assert kept[3] > PerRowSampling.TOP_P_CANDIDATES and kept[0] < PerRowSampling.TOP_P_CANDIDATES
    assert kept[2] == kept[5] == 5000  # top_p=1 rows untouched


def test_a_sampler_sliced_to_some_rows_filters_them_as_before():
    torch.manual_seed(2)
    scores = torch.randn(4, 300)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=1.3)]
    full = PerRowSampling(params, torch.device("cpu"))(None, scores.clone())
    keep = torch.tensor([1, 3])
    assert torch.equal(PerRowSampling(params, torch.device("cpu")).select(keep)(None, scores[keep].clone()), full[keep])


# ----------------------------------------------------------------------- MixedLoRA's dtype
def _mixed_vs_peft(model, names, ids):
    with torch.no_grad():
        want = model(input_ids=ids, adapter_names=names).logits.float()
        with MixedLoRA(model, names) as lora:
            lora.set_rows(names)
            dtypes = {(layer._mixed_A.dtype, layer._mixed_B.dtype, lora.mask.dtype) for layer in lora._layers}
            got = model(input_ids=ids).logits.float()
        with model.disable_adapter():
            bare = model(input_ids=ids).logits.float()
    return want, got, bare, dtypes


@pytest.mark.numerics
def test_mixed_lora_runs_in_bf16_on_a_bf16_base(policies, tiny_model_dir):
    from peft.tuners.lora import LoraLayer

    names = ["agent_aux", "agent_main", "agent_main", "agent_aux"]
    ids = torch.randint(3, 200, (4, 9), generator=torch.Generator().manual_seed(0))
    bf16 = make_policies(tiny_model_dir).models[0]
    bf16.to(torch.bfloat16)
    for m in bf16.modules():  # as peft keeps them: fp32 adapters on the bf16 base
        if isinstance(m, LoraLayer):
            m.lora_A.float(), m.lora_B.float()
    want, got, bare, dtypes = _mixed_vs_peft(bf16, names, ids)
    assert dtypes == {(torch.bfloat16,) * 3}
    tol = 0.02 * want.abs().max()
    assert (got - want).abs().max() < tol
    assert (want - bare).abs().max() > 5 * tol  # the adapters matter far beyond the tolerance
    # fp32 base: fp32 stacks, and the same logits as peft to fp32 rounding.
    want, got, _, dtypes = _mixed_vs_peft(policies.models[0], names, ids)
    assert dtypes == {(torch.float32,) * 3}
    assert_close_to_scale(got, want, 1e-5, "logits")
    # fp32 base under bf16 autocast: bf16 stacks (the autocast dtype).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got, _, dtypes = _mixed_vs_peft(policies.models[0], names, ids)
    assert dtypes == {(torch.bfloat16,) * 3} and (got - want).abs().max() < 0.02 * want.abs().max()


def test_set_rows_from_indices_equals_set_rows_from_names(policies):
    model = policies.models[0]
    names = ["agent_main", "agent_aux", "agent_main"]
    with MixedLoRA(model, ["agent_aux", "agent_main"]) as lora:
        lora.set_rows(names)
        by_name = lora.mask.clone()
        index = lora.adapter_index(names)
        lora.set_rows(index)
        assert torch.equal(lora.mask, by_name) and lora.mask.shape == (3, 1, 2 * 4)
        assert lora.mask[0, 0].tolist() == [0] * 4 + [1] * 4
        lora.set_rows(index[torch.tensor([1, 2])])  # rows left the batch: slice the indices
        assert torch.equal(lora.mask, by_name[1:])


# ------------------------------------------------------------------------------ configuration
def test_decode_keys_reach_the_rollout_and_bad_values_say_the_fix(tiny_model_dir, tmp_path):
    from marl_llm.training.setup import build

    base = tiny_overrides(tiny_model_dir, tmp_path, "algo=magrpo", "task=tldr", "algo.num_turns=1")
    run = build(compose_config(base + ["trainer.decode=static"]))
    assert run.rollout.static and not run.rollout.compile_decode
    assert not build(compose_config(base)).rollout.static
    with pytest.raises(UserError, match="trainer.decode=static"):
        validate(compose_config(base + ["trainer.compile_decode=true"]))
    with pytest.raises(UserError, match=r"trainer\.decode"):
        validate(compose_config(base + ["trainer.decode=fixed"]))
    validate(compose_config(base + ["trainer.decode=static", "trainer.compile_decode=true"]))
