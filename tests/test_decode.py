"""The decode loop (rollout.decode): the same tokens however rows are batched or compacted,
dynamic or static; host reads only every COMPACT_EVERY steps; a fixed-point sampler that draws
from the right distribution with integer prefix sums only; MixedLoRA in the base's compute dtype."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import FLOAT64_REL, TEST_DEVICE, assert_close_to_scale, compose_config, make_policies, tiny_overrides
from marl_llm.rollout import decode as rollout
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.models.cache_api import cache_name
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


@pytest.fixture(scope="module")
def policies64(tiny_model_dir):
    """Float64 policies, for the tests that compare the tokens of two computations: a near-tie
    between two tokens (or a draw near a boundary of the cumulative distribution) cannot flip on
    the rounding of a batch of another size or of another loop."""
    return make_policies(tiny_model_dir, dtype="float64")


@pytest.mark.numerics
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_every_row_decodes_as_it_would_alone(policies64, static):
    """Batched with rows that end at other steps (compacted away every COMPACT_EVERY steps, or
    running on as padding in the static loop), each keyed row gets exactly the tokens it gets
    decoded on its own: batched vs alone, the same token ids, on float64 policies."""
    policies = policies64
    batched = run_rows(policies, ROWS, static=static)
    alone = [run_rows(policies, [row], static=static)[0] for row in ROWS]
    assert batched == alone
    pad = policies.tokenizers[0].pad_token_id
    lengths = [generated_length(ids, pad) for ids in batched]
    # The batch really changed under the loop: rows ended before the first check and after the second.
    assert min(lengths) < COMPACT_EVERY and max(lengths) > 2 * COMPACT_EVERY, lengths
    assert lengths[5] >= 20 and lengths[6] >= 33 and lengths[7] <= 9  # min and max lengths held
    assert batched[1] != batched[2]  # siblings of one prompt draw their own tokens


@pytest.mark.numerics
def test_static_decode_gives_the_dynamic_tokens_and_generates_greedy(policies64):
    """The static loop vs the dynamic loop, and the static loop vs transformers' greedy
    `generate`: the same token ids, on float64 policies."""
    policies = policies64
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


def test_a_static_step_reads_the_running_rows_over_a_window_that_grows_with_them_not_the_cap(policies):
    """The static step's KV reads (rollout/static_step.py): at every step, each layer reads only
    the rows still running (finished ones leave at the checks) and a window of at most twice the
    positions written (at least CAPACITY_MULTIPLE), however large the cap; over the rollout that
    is well under what reading the whole cache for every row costs."""
    from marl_llm.rollout import static_step

    model, tok = policies.models[0], policies.tokenizers[0]
    cap = 300  # the longest row's max_new_tokens: the cache's capacity is its prompt plus this
    params = [SamplingParams(temperature=1.0, max_new_tokens=n, min_new_tokens=n) for n in (cap, 20, 20, 40)]
    prompts = [encode_prompt(tok, m) for m in ("solve it", "x", "hello there", "short")]
    reads = []  # (rows, window, positions written before this step) per layer per decode step
    read = static_step.LiveStaticLayer.update

    def reading(layer, key_states, *args, **kwargs):
        written = int(layer.cumulative_length)
        keys, values = read(layer, key_states, *args, **kwargs)
        if key_states.shape[-2] == 1:
            reads.append((keys.shape[0], keys.shape[2], written))
        return keys, values

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(static_step.LiveStaticLayer, "update", reading)
        out = decode(model, prompts, [policies.agents[0].adapter] * 4, params, [], tok.pad_token_id,
                     row_keys=[1, 2, 3, 4], static=True)
    assert [len(o) for o in out] == [cap, 20, 20, 40]
    width = max(len(p) for p in prompts)
    layers = len(model.get_base_model().model.layers)
    assert len(reads) == layers * (cap - 1)  # every step of every layer seen
    for rows, window, written in reads:
        assert written < window <= max(static_step.CAPACITY_MULTIPLE, 2 * (written + 1)), (window, written)
        step = written - width  # rows 2 and 3 end at step 19 and leave at the check of step 31, row 4 at 47
        assert rows == (4 if step < 31 else 2 if step < 47 else 1), (rows, step)
    whole = layers * (cap - 1) * 4 * (width + cap)  # every row's whole cache at every step
    assert sum(rows * window for rows, window, _ in reads) < 0.4 * whole


@pytest.mark.numerics
def test_keyed_rows_are_reproducible_and_unkeyed_rows_follow_the_global_seed(policies64):
    """The same loop twice (determinism), and unkeyed rows of the dynamic vs the static loop under
    one global seed: the same token ids, on float64 policies."""
    policies = policies64
    assert run_rows(policies, ROWS) == run_rows(policies, ROWS)
    unkeyed = [(a, m, s, None) for a, m, s, _ in ROWS]
    torch.manual_seed(11)
    first = run_rows(policies, unkeyed)
    torch.manual_seed(11)
    assert run_rows(policies, unkeyed, static=True) == first
    torch.manual_seed(12)
    assert run_rows(policies, unkeyed) != first


def test_the_cache_goes_by_the_installed_transformers_name_and_nothing_warns(policies):
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in
    5.40); 5.17 knows only the old one. Decoding and scoring use the model's own name: no
    FutureWarning."""
    base = policies.models[0].get_base_model()
    assert cache_name() in inspect.signature(type(base).forward).parameters
    assert cache_name() in inspect.signature(type(base.get_decoder()).forward).parameters
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_rows(policies, ROWS[:3])
        run_rows(policies, ROWS[:3], static=True)
        prompt = torch.tensor(encode_prompt(policies.tokenizers[0], "solve it"))
        with policies.acting(0) as model:  # the shared prompt's KV cache, handed to the completions' pass
            rollout.completion_logprobs(model, [prompt] * 2, [torch.tensor([5, 6]), torch.tensor([7])], 2)
    assert [str(w.message) for w in seen if issubclass(w.category, FutureWarning)] == []


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
    SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3, top_p=1 - 1e-13)],
    ids=["t1", "t0.5", "topk3", "topp0.8", "topk5-topp0.7", "greedy", "topk3-topp-wider"])
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


class Sorts(TorchFunctionMode):
    """Records the widths of the sorts and top-k's a sampler runs."""

    def __init__(self):
        super().__init__()
        self.sorted: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("sort", "topk"):
            self.sorted.append((name, args[0].shape[-1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sync_free", [False, True])
def test_top_p_inside_top_k_keeps_the_tokens_a_full_sort_keeps(sync_free):
    """The nucleus taken among the top-k against the same sampler sorting the whole vocabulary:
    the same scores to the bit, on bf16-rounded logits (many ties, some at the k-th), with rows
    whose k is below the batch's largest, a nucleus wider than the top-k, and rows without top-p.
    The vocabulary is sorted nowhere."""
    torch.manual_seed(3)
    V = 5000
    scores = (torch.randn(8, V) * 4).bfloat16().float()
    scores[3, :200] = scores[3].max() - 0.25  # 200 tokens tied at the top: ties at the k-th and a wide nucleus
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9), SamplingParams(temperature=0.6, top_k=20, top_p=0.6),
              SamplingParams(temperature=1.0, top_k=5, top_p=1 - 1e-13), SamplingParams(temperature=1.0, top_k=30, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.0, top_k=50, top_p=0.5),
              SamplingParams(temperature=1.3), SamplingParams(temperature=0.8, top_k=1, top_p=0.3)]
    inside = PerRowSampling(params, torch.device("cpu"), sync_free=sync_free)
    full = PerRowSampling(params, torch.device("cpu"), sync_free=sync_free)
    assert inside.top_p_within_top_k
    full.top_p_within_top_k = False  # the full sort (or the CPU's candidates), as before
    with Sorts() as spy:
        got = inside(None, scores.clone())
    assert all(width <= 50 for name, width in spy.sorted if name == "sort") and ("topk", V) in spy.sorted
    want = full(None, scores.clone())
    assert torch.equal(got, want)
    kept = (got > torch.finfo(got.dtype).min).sum(dim=1)
    assert kept[3] >= 30 and kept[2] == 5 and kept[6] == V  # ties kept; the wide nucleus keeps the top-5


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
    def at_least_fp32(t):  # bf16 logits compared in fp32; fp64 stays fp64
        return t.to(torch.promote_types(t.dtype, torch.float32))

    with torch.no_grad():
        want = at_least_fp32(model(input_ids=ids, adapter_names=names).logits)
        with MixedLoRA(model, names) as lora:
            lora.set_rows(names)
            dtypes = {(layer._mixed_At.dtype, layer._mixed_Bt.dtype, lora.mask.dtype) for layer in lora._layers}
            got = at_least_fp32(model(input_ids=ids).logits)
        with model.disable_adapter():
            bare = at_least_fp32(model(input_ids=ids).logits)
    return want, got, bare, dtypes


@pytest.mark.numerics
def test_mixed_lora_runs_in_bf16_on_a_bf16_base(policies, policies64, tiny_model_dir):
    """MixedLoRA vs peft's mixed-batch forward, in the base's compute dtype: on a bf16 base (and
    an fp32 base under bf16 autocast) in bf16, logits to a bound derived below; on a float64 base
    in float64, logits to FLOAT64_REL of the largest element (the equivalence). An fp32 base
    gets fp32 stacks (checked by dtype; its logits are the float64 case's computation)."""
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
    # bf16 keeps 8 significant bits: each rounding moves a value by 2^-9 of it at most. The mixed path
    # rounds the adapters' weights, x @ A and its product with B to bf16 where peft keeps them in fp32
    # (3 roundings of the LoRA term in each of the 2 layers' q and v projections); through the rest of
    # the model, that is ~8 bf16 roundings of values no larger than the largest logit: 8 x 2^-9 of it,
    # doubled as the roundings of one layer are amplified by the next (3% in all). Seen: 0.8%. The
    # adapters move the logits by more than 5 times that (seen: 130%).
    tol = 2 * 8 * 2**-9 * want.abs().max()
    assert (got - want).abs().max() < tol
    assert (want - bare).abs().max() > 5 * tol  # the adapters matter far beyond the tolerance
    # fp32 base: fp32 stacks.
    _, _, _, dtypes = _mixed_vs_peft(policies.models[0], names, ids)
    assert dtypes == {(torch.float32,) * 3}
    # float64 base: float64 stacks, and the same logits as peft.
    want, got, bare, dtypes = _mixed_vs_peft(policies64.models[0], names, ids)
    assert dtypes == {(torch.float64,) * 3} and got.dtype == torch.float64
    assert_close_to_scale(got, want, FLOAT64_REL, "logits")
    assert (want - bare).abs().max() > 1e-3 * want.abs().max()  # the adapters matter
    # fp32 base under bf16 autocast: bf16 stacks (the autocast dtype), the bound above.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got, _, dtypes = _mixed_vs_peft(policies.models[0], names, ids)
    assert dtypes == {(torch.bfloat16,) * 3} and (got - want).abs().max() < 2 * 8 * 2**-9 * want.abs().max()


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


def test_mixed_lora_keeps_its_buffers_per_adapter_set_and_refills_them(policies):
    """Rollouts of one agent's rows and of both agents' alternate: each adapter set finds its own
    stacks again, refilled in place with the adapters' current values (what a recorded CUDA graph
    reads); a row mask is kept per row count."""
    model = policies.models[0]
    layer = next(m for n, m in model.named_modules() if n.endswith("q_proj"))
    seen = []
    with torch.inference_mode():
        for names in (["agent_aux"], ["agent_main", "agent_aux"], ["agent_aux"], ["agent_aux", "agent_main"]):
            with MixedLoRA(model, names) as lora:
                lora.set_rows(names * 2)
                seen.append((layer._mixed_At.data_ptr(), lora.mask.data_ptr(), layer._mixed_At.shape[1]))
                assert layer.forward is lora._kept.forwards[id(layer)]  # one mixed forward per layer, kept
    assert seen[0] == seen[2] and seen[1] == seen[3] and seen[0][0] != seen[1][0]
    with torch.inference_mode(), MixedLoRA(model, ["agent_aux"]):
        lora_a = layer.lora_A["agent_aux"].weight
        assert torch.equal(layer._mixed_At, lora_a.T.to(layer._mixed_At.dtype))
    with torch.no_grad():
        lora_a.add_(1.0)  # the adapter changed (an update): the same buffer, the new values
    with torch.inference_mode(), MixedLoRA(model, ["agent_aux"]):
        assert layer._mixed_At.data_ptr() == seen[0][0] and torch.equal(layer._mixed_At, lora_a.T)
    with torch.no_grad():
        lora_a.sub_(1.0)


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


# ------------------------------------------------------------------------------ compiled decode
@pytest.mark.numerics
@pytest.mark.skipif(TEST_DEVICE == "cpu" and os.environ.get("ATEN_CPU_CAPABILITY") == "default",
                    reason="inductor (torch 2.13) emits at::vec kernels without their header at "
                           "ATEN_CPU_CAPABILITY=default: a C++ compile error, in float32 too "
                           "(the plain run covers this test)")
def test_compiled_decode_equals_eager_and_compiles_once_per_bucket(tiny_model_dir, tmp_path):
    """trainer.decode=static with trainer.compile_decode=true (inductor on the CPU, CUDA graphs on
    a GPU): greedy tokens equal to the eager static loop's; the first rollout compiles a graph
    per (rows, window) bucket it meets (16 rows, then 8 once the short rows leave; a window of 64
    positions, then 128), and the next two compile nothing more, and reuse one kept StaticCache
    and MixedLoRA's kept stacks (the same addresses: on CUDA the graphs are recorded once,
    counted); with the FLOP meter's hooks live (decode called outside the trainer, nothing
    paused) it compiles nothing more. 12 rows run as 16 (ROW_MULTIPLE): the extra rows' tokens
    are dropped. Compiled vs eager tokens are compared on a float64 model on
    the CPU (the same token ids: a near-tie cannot flip on the compiled kernels' rounding); on CUDA
    the model is bf16 (the compiled path that runs there) and most rows must agree."""
    from marl_llm.rollout import static_step
    from marl_llm.rollout.base import GenRequest
    from marl_llm.training.setup import build

    torch._dynamo.reset()
    static_step._COMPILED_STEPS.clear()
    dtype = ["model.dtype=float64"] if TEST_DEVICE == "cpu" else []
    run = build(compose_config(tiny_overrides(tiny_model_dir, tmp_path, "trainer.decode=static",
                                              "trainer.compile_decode=true", "trainer.eval_before=false", *dtype)))
    assert run.rollout.static and run.rollout.compile_decode
    policies = run.policies
    model, tok = policies.models[0], policies.tokenizers[0]
    with torch.no_grad():  # fresh LoRA B matrices are zero: make the two adapters act, and differ
        for k, adapter in policies.trainable_adapters():
            for p in policies.adapter_parameters(k, adapter):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(adapter))).to(p) * 0.5)
    short, long = (SamplingParams(temperature=0.0, max_new_tokens=n, min_new_tokens=n) for n in (12, 70))
    rows = [(0, "solve it"), (1, "solve it"), (0, "a much longer prompt " * 3), (1, "x"), (1, "solve it"), (0, "x")] * 2
    greedy = [short] * 6 + [long] * 6
    requests = [GenRequest(a, m, g, key=j) for j, ((a, m), g) in enumerate(zip(rows, greedy))]
    prompts = [encode_prompt(tok, m) for _, m in rows]
    adapters = [policies.agents[a].adapter for a, _ in rows]
    eos = policies.eos_ids[0]
    shapes = []  # the (rows, window) each decode step reads, in every layer
    read = static_step.LiveStaticLayer.update

    def reading(layer, key_states, *args, **kwargs):
        keys, values = read(layer, key_states, *args, **kwargs)
        if key_states.shape[-2] == 1:  # a decode step (not the prefill's copy)
            shapes.append((keys.shape[0], keys.shape[2]))
        return keys, values

    with torch.inference_mode(), policies.autocast(0), pytest.MonkeyPatch.context() as mp:
        mp.setattr(static_step.LiveStaticLayer, "update", reading)
        eager = [rollout.cut_at_eos(ids, eos)[0].tolist() for ids in
                 decode(model, prompts, adapters, greedy, eos, tok.pad_token_id, static=True, compile_step=False)]
    # The eager static loop's views: 12 rows, then the 6 long ones from the check at step 16; a
    # window of 64 positions, then its capacity (its longest prompt + 70). The compiled step rounds
    # the rows and the capacity up.
    capacity = max(len(p) for p in prompts) + 70
    assert 64 < capacity < 128 and shapes[0] == (12, 64), shapes[0]
    assert sorted(set(shapes)) == [(6, 64), (6, capacity), (12, 64)], sorted(set(shapes))

    caches, stacks = [], []
    build_cache = static_step.static_cache

    def spying(*args, **kwargs):
        caches.append(build_cache(*args, **kwargs))
        return caches[-1]

    counts = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout, "static_cache", spying)
        for _ in range(3):  # as the trainer calls it: MeteredRollout, the meter's hooks paused
            out = [c.completion_ids.tolist() for c in run.rollout.generate(requests)]
            counts.append(static_step.compile_counts())
            lora_a = next(m for n, m in model.named_modules() if n.endswith("q_proj"))
            stacks.append(lora_a._mixed_At.data_ptr())
            if policies.dtype == torch.float64:
                assert out == eager
            else:  # bf16 on CUDA: compiled kernels round differently; near-ties of a random model may flip
                assert sum(a == b for a, b in zip(out, eager)) >= len(rows) // 2
        with torch.inference_mode(), policies.autocast(0):  # outside the trainer: the hooks count
            before = run.meter.flops.total
            direct = decode(model, prompts, adapters, greedy, eos, tok.pad_token_id, static=True,
                            compile_step=True)
        counts.append(static_step.compile_counts())
    assert run.meter.flops.total > before  # the hooks were live (the eager prefill was counted)
    assert len(direct) == len(rows)
    # (16, 64), (8, 64), (8, 128); each its own graph, or more where dynamo breaks a step in two.
    assert counts[0]["graphs"] >= 3 and all(c["graphs"] == counts[0]["graphs"] for c in counts), counts
    assert len({id(c) for c in caches}) == 1 and len(set(stacks)) == 1
    assert caches[0].layers[0].keys.shape[0] == 2 * static_step.ROW_MULTIPLE
    assert caches[0].layers[0].keys.shape[2] % static_step.CAPACITY_MULTIPLE == 0
    if policies.device.type == "cuda":
        assert all(c["cudagraph_recordings"] == counts[0]["cudagraph_recordings"] for c in counts), counts
    run.meter.close()


def test_cudagraph_recordings_are_counted_from_torchs_callbacks():
    """The counter the bench reports hooks torch's compile-event callbacks: a recording event
    (what CUDA-graph trees announce before each recording) counts one; other events none."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    from marl_llm.rollout import static_step

    assert static_step.count_cudagraph_recordings()
    before = static_step.compile_counts()["cudagraph_recordings"]
    with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "test"):
        pass
    with callback_handler.install_callbacks(CallbackTrigger.LAZY_BACKWARD, "test"):
        pass
    assert static_step.compile_counts()["cudagraph_recordings"] == before + 1


def test_decode_auto_is_the_compiled_static_step_on_cuda_only():
    from marl_llm.rollout.decode import resolve_decode

    assert resolve_decode("auto", "auto", "cuda", True) == (True, True)
    assert resolve_decode("auto", "auto", "cuda", False) == (False, False)  # sliding-window layers
    assert resolve_decode("auto", "auto", "cpu", True) == (False, False)
    assert resolve_decode("static", "auto", "cpu", True) == (True, False)
    assert resolve_decode("static", True, "cpu", True) == (True, True)
    assert resolve_decode("dynamic", False, "cuda", True) == (False, False)
    for decode_, compile_ in (("auto", "auto"), ("static", True)):  # FSDP-sharded models: the eager loop
        assert resolve_decode(decode_, compile_, "cuda", True, sharded=True) == (False, False)
    cfg = compose_config(["trainer=gpu", "run_dir=/tmp/x"])
    assert (cfg.trainer.decode, cfg.trainer.compile_decode) == ("auto", "auto")
    validate(cfg)
    with pytest.raises(UserError, match=r"trainer\.compile_decode"):
        validate(compose_config(["trainer.compile_decode=sometimes", "run_dir=/tmp/x"]))


def test_sharded_models_decode_with_the_eager_loop_and_say_so_in_one_line(tiny_model_dir, capsys):
    from marl_llm.rollout.decode import FSDP_EAGER, HFRollout

    policies = make_policies(tiny_model_dir)
    asked = HFRollout(policies, decode="static", compile_decode=True, sharded=True)
    assert (asked.static, asked.compile_decode) == (False, False)
    assert capsys.readouterr().out.count(FSDP_EAGER) == 1
    HFRollout(policies, decode="dynamic", sharded=True)  # the eager loop asked for: nothing to say
    assert FSDP_EAGER not in capsys.readouterr().out


def test_one_static_cache_is_kept_per_model_freed_before_another_shape_and_released_after_the_phase(tiny_model_dir):
    """The compiled step's kept cache (rollout/static_step.py): one per model; a call of another
    shape drops it before allocating its own (the KV budget counts the kept bytes as free: they
    must be, when a new cache is made); HFRollout.release (the trainer's end of a rollout phase or
    evaluation) leaves no cache behind."""
    from marl_llm.models.cache_api import output_cache
    from marl_llm.rollout import static_step

    policies = make_policies(tiny_model_dir)
    model = policies.models[0]
    held_when_made = []

    class Spied(static_step.StaticCache):
        def __init__(self, *args, **kwargs):
            held_when_made.append(static_step.kept_cache_bytes(model))
            super().__init__(*args, **kwargs)

    def prefilled(rows: int):
        with torch.inference_mode():
            return output_cache(model(input_ids=torch.tensor([[5, 6, 7]] * rows), use_cache=True))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(static_step, "StaticCache", Spied)
        first = static_step.static_cache(model, prefilled(2), 64, keep=True)
        one = static_step.kept_cache_bytes(model)
        assert static_step.static_cache(model, prefilled(2), 64, keep=True) is first  # same shape: reused
        second = static_step.static_cache(model, prefilled(4), 128, keep=True)  # another shape
    assert second is not first and held_when_made == [0, 0]  # nothing kept while the new one allocated
    assert one > 0 and static_step.kept_cache_bytes(model) == 4 * one  # 2x rows x 2x positions: only it kept
    rollout.HFRollout(policies).release()
    assert static_step.kept_cache_bytes(model) == 0 and model not in static_step._KEPT


def full_bf16_policies(model_dir):
    """Fully fine-tuned policies with fp32 master weights under bf16 autocast (the GPU default's
    path, run on the CPU)."""
    from omegaconf import OmegaConf

    from marl_llm.models.policies import AgentPolicies

    model_cfg = OmegaConf.create(dict(name="tiny", path=str(model_dir), embedded=False, hub_id=None, dtype="bfloat16",
                                      device="cpu", attn_implementation="sdpa", trust_remote_code=False,
                                      agent_bases=None))
    algo_cfg = OmegaConf.create(dict(adapters="shared", learning_rate=1e-3, weight_decay=0.01, policy_map={},
                                     lora=None, kl_coef=0.0))
    return AgentPolicies(("aux", "main"), model_cfg, algo_cfg, 0)


def test_a_compiled_decode_step_of_fp32_master_weights_holds_no_weight_cast(tiny_model_dir):
    """Full fine-tuning keeps fp32 master weights and decodes under bf16 autocast: traced into the
    compiled step, autocast casts every linear weight at every token (15 casts on the tiny
    model's graph). `decoding_weights` casts them once per generate call: the step's graph (as
    AOT autograd lowers it, autocast made explicit) then holds no cast of a float32 weight, the
    master parameters are back after it, and the eager step's logits are bitwise the same (the
    same .to(bf16) casts, done before instead of inside)."""
    from torch._dynamo.backends.common import aot_autograd

    from marl_llm.models.cache_api import output_cache
    from marl_llm.rollout.static_step import model_step, static_cache

    policies = full_bf16_policies(tiny_model_dir)
    model = policies.models[0]
    masters = [p for p in model.parameters()]
    assert policies.autocast_dtype == torch.bfloat16 and {p.dtype for p in masters} == {torch.float32}

    def step_inputs():
        out = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
        return torch.tensor([[8]]), torch.tensor([[3]]), torch.ones(1, 16, dtype=torch.long), \
            static_cache(model, output_cache(out), 16)

    def weight_casts(cast_once: bool) -> tuple[int, torch.Tensor]:
        graphs = []

        def keep_graph(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        step = torch.compile(model_step, backend=aot_autograd(fw_compiler=keep_graph))
        with torch.inference_mode(), policies.autocast(0), \
                (policies.decoding_weights(0) if cast_once else contextlib.nullcontext()):
            step(model, *step_inputs())
            eager = model_step(model, *step_inputs())
        casts = [n for gm in graphs for n in gm.graph.nodes
                 if n.op == "call_function" and any(k in str(n.target) for k in ("convert_element_type", "_to_copy"))
                 and getattr(n.args[0], "op", None) == "placeholder" and n.args[0].meta["val"].dim() == 2
                 and n.args[0].meta["val"].dtype == torch.float32]
        return len(casts), eager

    before, eager_autocast = weight_casts(cast_once=False)
    after, eager_cast_once = weight_casts(cast_once=True)
    torch._dynamo.reset()
    assert before >= 14 and after == 0, (before, after)  # 2 layers x 7 linears (+ the tied head)
    assert torch.equal(eager_autocast, eager_cast_once)
    back = list(model.parameters())
    assert len(back) == len(masters) and all(a is b for a, b in zip(back, masters))  # the master parameters themselves


class TorchCalls(TorchFunctionMode):
    """Counts every Python-level torch call (functions, methods, attribute reads): each is host
    time per token on a GPU, where a decode step is host-bound."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_the_decode_loop_makes_no_more_torch_calls_per_layer_and_token_than_generate(tiny_model_dir, tmp_path):
    """Python-level torch calls per decoder layer per token (the slope between a 2- and a 4-layer
    Llama, and between 9 and 41 new tokens): the project's decode loop, with rows of both agents'
    adapters (MixedLoRA), against transformers' `generate` on the same peft model with one active
    adapter (sampling, no early end). Measured: 84 against 86."""
    from conftest import build_tiny_model

    def per_token(model_dir) -> tuple[float, float, int]:
        policies = make_policies(model_dir)
        model, tok = policies.models[0], policies.tokenizers[0]
        prompt = encode_prompt(tok, "hello there")

        def ours(steps: int) -> int:
            sampling = SamplingParams(temperature=1.0, max_new_tokens=steps, min_new_tokens=steps)
            with torch.inference_mode(), TorchCalls() as calls:
                decode(model, [prompt] * 4, ["agent_aux", "agent_main"] * 2, [sampling] * 4, [10**9], tok.pad_token_id,
                       row_keys=[0, 1, 2, 3])
            return calls.n

        def generate(steps: int) -> int:
            model.set_adapter("agent_aux")
            ids = torch.tensor([prompt] * 4)
            with torch.inference_mode(), TorchCalls() as calls:
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                               max_new_tokens=steps, min_new_tokens=steps, pad_token_id=tok.pad_token_id)
            return calls.n

        return (ours(41) - ours(9)) / 32, (generate(41) - generate(9)) / 32, model.config.num_hidden_layers

    two, four = per_token(tiny_model_dir), per_token(build_tiny_model(tmp_path / "four_layers", layers=4))
    assert (two[2], four[2]) == (2, 4)
    ours_per_layer = (four[0] - two[0]) / (four[2] - two[2])
    generate_per_layer = (four[1] - two[1]) / (four[2] - two[2])
    assert 50 < generate_per_layer and ours_per_layer <= generate_per_layer, (ours_per_layer, generate_per_layer)
