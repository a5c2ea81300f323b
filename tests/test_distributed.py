"""Data-parallel training on CPU (gloo, 2 processes), with and without FSDP: the adapters after N
steps match a single-process run with the same global batch and seed; rank 0 alone writes the
run dir; the gradient sync is the batch-weighted mean over ranks of the trainable parameters'
gradients.

Precision: the 2-rank and the 1-process runs both train in float64 (model.dtype=float64: the
base, LoRA adapters, norms, critic head and gradient-sync buffer), so no CPU's summation order
shows. Each rank sums its half of the batch's gradient and the all-reduce adds the halves, which
rounds differently from one process's single sum: ~float64's eps (1.1e-16) of the gradients'
scale (O(1) or less here). Adam divides by sqrt(v) + eps_adam, which amplifies such an error in a
near-zero gradient entry by at most lr / eps_adam = 1e-3 / 1e-8 = 1e5 per step, so after STEPS = 2
steps the adapters may differ by ~1.1e-16 x 1e5 x 2 ~ 2e-11. Asserted: ATOL = 1e-9 (a 50-fold
margin), while the updates themselves are of order lr = 1e-3 (checked: the LoRA B matrices, zero
at init, moved by more than a tenth of that) and float32 rounding would already differ by ~1e-6.
Seen: at most 4.7e-15. The logged gradient norms agree to GRAD_REL = 1e-9 of their value: step 1's
is a reduction compared directly (FLOAT64_REL, 1e-12), step 2's is taken at parameters that differ
by at most ATOL, through an O(1) sensitivity.

Summation orders (`cross_order`): the ranks run under the Makefile's NUMERICS_ENV (one thread,
ATen's scalar kernels, MKL's conservative code path) and the one-process runs in the pytest
process's order, so every run of these tests compares the two summation orders; make test's
rerun under NUMERICS_ENV skips them (docs/development.md#numerics-on-other-cpus).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
import torch

from conftest import VENV_BIN, rank_port, ranks_env, torchrun
from test_trainer import adapters, metrics

ATOL = 1e-9  # float64 eps 1.1e-16 x Adam's lr / eps_adam (1e5) x STEPS (2) ~ 2e-11, see the docstring
GRAD_REL = 1e-9
MOVED = 1e-4  # a tenth of one Adam step at lr 1e-3
STEPS = 2


def env():
    # One thread per rank: two ranks on two cores.
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run_args(model_dir, *extra):
    return ["model=local", f"model.path={model_dir}", "model.dtype=float64", "logger=none", "algo.sampling.max_new_tokens=8",
            "algo.sampling.top_p=1.0", "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", "algo.learning_rate=1e-3",
            f"trainer.max_steps={STEPS}", "trainer.eval_before=false", "trainer.eval_after=false",
            "trainer.prompts_per_step=4", *extra]


# MAGRPO with the raw baseline (advantage = shifted reward, never all zero even when the tiny
# model's rewards are), and CoLLM-CC (normalized advantages pooled over ranks, a critic synced too).
SETTINGS = {
    "magrpo": ["algo=magrpo", "algo.num_turns=1", "algo.num_generations=2", "algo.baseline=raw"],
    "collm_cc": ["algo=collm_cc", "task=tldr", "algo.num_turns=1"],
}
LAUNCHERS = {
    "torchrun": lambda: torchrun(2, "-m", "marl_llm"),
    # --multi_gpu is accelerate's torchrun-style launcher; on a CPU machine its ranks use gloo.
    "accelerate": lambda: [str(VENV_BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--main_process_port", str(rank_port()), "--mixed_precision", "no",
                           "--dynamo_backend", "no", "-m", "marl_llm"],
}


def launch(launcher, args, cwd):
    cmd = [*LAUNCHERS[launcher](), *args]
    return subprocess.run(cmd, cwd=cwd, env=ranks_env(env()), capture_output=True, text=True, timeout=600)


_ONE_PROCESS: dict[tuple[str, ...], object] = {}


def one_process(args: list[str], tmp_path_factory):
    """The run dir of the one-process reference run of `args`, run once per pytest worker: the
    2-rank tests of one setting (torchrun, accelerate, a submitit job) compare with the same run."""
    key = tuple(args)
    if key not in _ONE_PROCESS:
        one = tmp_path_factory.mktemp("one_process")
        single = subprocess.run([str(VENV_BIN / "marl-llm"), *args, f"run_dir={one}"], env=env(), capture_output=True,
                                text=True, timeout=600)
        assert single.returncode == 0, single.stderr[-3000:]
        _ONE_PROCESS[key] = one
    return _ONE_PROCESS[key]


# FSDP (trainer.fsdp=true) also evaluates after training: rank 0 alone runs those passes while
# the other rank serves its share of the sharded base.
FSDP = ["trainer.eval_after=true", "trainer.eval_max_problems=2"]


@pytest.mark.numerics
@pytest.mark.cross_order
@pytest.mark.slow
@pytest.mark.parametrize("algo,launcher,fsdp", [("magrpo", "torchrun", False), ("collm_cc", "accelerate", False),
                                                ("magrpo", "accelerate", True), ("collm_cc", "torchrun", True)])
def test_two_processes_match_one_process(tiny_model_dir, tmp_path, tmp_path_factory, algo, launcher, fsdp):
    """Two computations of the same training: 2 data-parallel ranks (each half the batch, gradients
    all-reduced; with FSDP the frozen base sharded) against one process with the whole batch, both
    in float64 (the ranks under NUMERICS_ENV, one process in the machine's summation order); adapters and
    critics agree to ATOL, the metrics to GRAD_REL (module docstring)."""
    args = run_args(tiny_model_dir, *SETTINGS[algo], *(FSDP if fsdp else []))
    one = one_process(run_args(tiny_model_dir, *SETTINGS[algo]), tmp_path_factory)  # its evaluation is not compared
    # No run_dir: the ranks must agree on Hydra's time-stamped output dir by themselves.
    two = launch(launcher, [*args, f"trainer.fsdp={str(fsdp).lower()}"], tmp_path)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs  # one run dir for both ranks
    run = run_dirs[0]
    assert "2 data-parallel processes" in two.stdout
    assert ("FSDP: the models are sharded over 2 ranks" in two.stdout) == fsdp
    if fsdp:
        assert json.loads((run / "summary.json").read_text())["after"] is not None

    # Same samples, same losses, same gradients: the per-step metrics agree.
    m1, m2 = metrics(one), metrics(run)
    assert [r["step"] for r in m2] == list(range(1, STEPS + 1))
    for a, b in zip(m1, m2):
        assert a["train/num_tokens"] == b["train/num_tokens"] and a["train/reward"] == pytest.approx(b["train/reward"])
        grad_norms = [k for k in a if k.endswith("grad_norm")]
        assert grad_norms and all(a[k] == pytest.approx(b[k], rel=GRAD_REL, abs=1e-30) for k in grad_norms)
        assert any(a[k] > 0 for k in grad_norms)
    a1, a2 = adapters(one), adapters(run)
    assert a1.keys() == a2.keys()
    worst = max(float((a1[k][n] - a2[k][n]).abs().max()) for k in a1 for n in a1[k])
    assert worst <= ATOL, f"adapters differ by {worst:.3g} > {ATOL}"
    moved = max(float(a1[k][n].abs().max()) for k in a1 for n in a1[k] if "lora_B" in n)
    assert moved > MOVED  # LoRA B starts at zero: the runs really trained
    if algo == "collm_cc":
        c1 = torch.load(one / "checkpoint.pt", weights_only=False)["algorithm"]["critics"]
        c2 = torch.load(run / "checkpoint.pt", weights_only=False)["algorithm"]["critics"]
        for name in c1:
            for part in ("trunk", "head"):
                assert all(torch.allclose(c1[name][part][k], c2[name][part][k], atol=ATOL, rtol=0) for k in c1[name][part])

    # Rank 0 alone wrote: one config, one log line per step, one checkpoint, one summary.
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [".hydra", ".marl-llm-lock", ".marl-llm-run", "agents", "checkpoint.pt", "checkpoint.pt.sha256", "cli.log",
         "config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json", "version.json"])
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))
    assert sum(f"step {s}/{STEPS}:" in line for line in two.stdout.splitlines() for s in range(1, STEPS + 1)) == STEPS


@pytest.mark.numerics
@pytest.mark.cross_order
@pytest.mark.slow
def test_slurm_tasks_become_ranks(tiny_model_dir, tmp_path, tmp_path_factory):
    """A submitit job with 2 tasks (what hydra/launcher=slurm starts for 2 GPUs) is one 2-rank run:
    here through submitit's local executor, which exports the same job environment. Compared: its
    adapters against one process's, both in float64 (the ranks under NUMERICS_ENV, one process in the
    machine's summation order), to ATOL (module docstring)."""
    args = run_args(tiny_model_dir, *SETTINGS["magrpo"])
    one = one_process(args, tmp_path_factory)
    sweep = tmp_path / "sweep"
    out = subprocess.run([str(VENV_BIN / "marl-llm"), "-m", "hydra/launcher=local", "hydra.launcher.tasks_per_node=2",
                          "hydra.launcher.gpus_per_node=0", f"hydra.sweep.dir={sweep}", *args, "seed=0"],
                         cwd=tmp_path, env=ranks_env(env()), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = [p.parent for p in sweep.rglob("checkpoint.pt")]
    assert len(runs) == 1
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.out"))
    assert "global_rank=1(2)" in logs and logs.count("2 data-parallel processes") == 1
    assert [r["step"] for r in metrics(runs[0])] == list(range(1, STEPS + 1))
    a1, a2 = adapters(one), adapters(runs[0])
    assert max(float((a1[k][n] - a2[k][n]).abs().max()) for k in a1 for n in a1[k]) <= ATOL
    assert max(float(a1[k][n].abs().max()) for k in a1 for n in a1[k] if "lora_B" in n) > MOVED  # it trained


SYNC_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from marl_llm.distributed import data_parallel as distributed
    from marl_llm.algos.returns import normalize_per_group

    w = distributed.init(timeout_min=5, cpu=True)
    r = w.rank
    # Rank r: a batch of weight 1 + 2r with gradient (r + 1) * ones; a parameter without a gradient on rank 0.
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    a.grad = torch.full((3,), float(r + 1))
    if r == 1:
        b.grad = torch.full((2,), 4.0)
    total = distributed.sync_gradients([a, b], weight=1 + 2 * r)
    # Advantages normalized per group over both ranks' samples: rank 0 holds [0, 1], rank 1 [2, 3].
    adv = normalize_per_group(torch.tensor([2.0 * r, 2.0 * r + 1]), [(0, 0), (0, 0)])
    metrics = distributed.reduce_metrics({"reward": float(r), "num_tokens": 10.0 * (r + 1),
                                          "completions/max_length": 3.0 + r, f"turn_{r}/reward": 1.0})
    # One file per rank: the ranks' stdout lines may interleave in the shared pipe.
    with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
        json.dump({"rank": r, "total": total, "a": a.grad.tolist(), "b": b.grad.tolist(),
                   "adv": adv.tolist(), "metrics": metrics}, f)
    distributed.shutdown()
""")


def run_on_two_ranks(script_text: str, tmp_path) -> list[dict]:
    """Run a script under torchrun with 2 processes; each writes <tmp_path>/rank<r>.json."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    out = subprocess.run(torchrun(2, str(script), str(tmp_path)), env=env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]


def test_gradient_sync_is_the_batch_weighted_mean_over_ranks(tmp_path):
    results = run_on_two_ranks(SYNC_SCRIPT, tmp_path)
    assert sorted(r["rank"] for r in results) == [0, 1]
    # (x - 1.5) / std over [0, 1, 2, 3]
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / torch.tensor([0.0, 1, 2, 3]).std(unbiased=False)
    for r in results:
        assert r["total"] == 4  # weights 1 + 3
        assert r["a"] == pytest.approx([(1 * 1 + 3 * 2) / 4] * 3)  # (w0 g0 + w1 g1) / (w0 + w1)
        assert r["b"] == pytest.approx([3 * 4 / 4] * 2)  # rank 0's missing gradient counts as zero
        assert r["adv"] == pytest.approx(expected[2 * r["rank"]:2 * r["rank"] + 2].tolist(), abs=1e-6)
        m = r["metrics"]
        assert m["reward"] == 0.5 and m["num_tokens"] == 30 and m["completions/max_length"] == 4
        assert m["turn_0/reward"] == 1 and m["turn_1/reward"] == 1  # a key one rank lacks: that rank is not counted


BUCKET_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch.overrides import TorchFunctionMode
    from marl_llm.distributed import data_parallel as distributed

    def concatenated_sync(params, weight):  # the sync before buckets: one whole-model cat, then clones
        flat = [(p.grad.detach().float() if p.grad is not None else torch.zeros(p.shape)).flatten() for p in params]
        buf = torch.cat(flat + [torch.ones(1)]) * weight
        torch.distributed.all_reduce(buf)
        total = float(buf[-1])
        if total > 0:
            buf /= total
        offset = 0
        for p in params:
            p.grad = buf[offset:offset + p.numel()].view_as(p).to(p.dtype).clone()
            offset += p.numel()
        return total

    class Cats(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.n = 0
        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.n += getattr(func, "__name__", "") in ("cat", "concat", "clone")
            return func(*args, **(kwargs or {}))

    w = distributed.init(timeout_min=5, cpu=True)
    r = w.rank
    distributed.BUCKET_ELEMENTS = 7  # several buckets, and parameters larger than one
    def params():
        gen = torch.Generator().manual_seed(r)
        shapes = [(3, 4), (5,), (2, 2), (9,), (1,), (4, 3)]
        out = [torch.zeros(s, requires_grad=True) for s in shapes]
        out.append(torch.zeros(6, dtype=torch.bfloat16, requires_grad=True))
        for i, p in enumerate(out):
            if not (r == 0 and i == 2):  # a parameter without a gradient on rank 0
                p.grad = (torch.randn(p.shape, generator=gen) * 10 ** (i % 3 - 1)).to(p.dtype)
        out[5].grad = out[5].grad.t().contiguous().t()  # a non-contiguous gradient
        return out
    new, old = params(), params()
    with Cats() as cats:
        total = distributed.sync_gradients(new, weight=1 + 2 * r)
    assert concatenated_sync(old, 1 + 2 * r) == total
    with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
        json.dump({"equal": [torch.equal(a.grad, b.grad) and a.grad.dtype == b.grad.dtype for a, b in zip(new, old)],
                   "cats": cats.n, "total": total}, f)
    distributed.shutdown()
""")


def test_bucketed_gradient_sync_equals_the_concatenated_one_bitwise(tmp_path):
    """Buckets smaller than some parameters, a bf16 gradient, a non-contiguous one and a missing
    one: the same gradients to the bit as the whole-model cat it replaced, with no cat or clone."""
    results = run_on_two_ranks(BUCKET_SCRIPT, tmp_path)
    assert len(results) == 2
    for r in results:
        assert r["total"] == 4 and all(r["equal"]) and r["cats"] == 0, r


@pytest.mark.parametrize("extra,message", [
    (["trainer.prompts_per_step=3", "trainer.work_split=prompts"],
     "trainer.prompts_per_step=3 does not split over 2 processes"),
    (["trainer.placement=groups"], "trainer.placement=groups gives each policy its own ranks, but LoRA policies"),
    (["-m", "seed=0,1"], "never inside torchrun"),
    (["model.device=cuda:0"], "puts every rank on GPU 0: use model.device=cuda"),
])
def test_bad_multiprocess_input_names_the_fix(tiny_model_dir, tmp_path, extra, message):
    args = [a for a in run_args(tiny_model_dir) if not a.startswith("trainer.prompts_per_step")] + extra
    out = launch("torchrun", [*args, f"run_dir={tmp_path / 'run'}"], tmp_path)
    assert out.returncode != 0
    assert message in out.stderr and "src/marl_llm" not in out.stderr  # a message, no traceback of ours


def test_only_trainable_adapter_parameters_are_synced(tiny_model_dir):
    from conftest import make_policies

    policies = make_policies(tiny_model_dir)
    params = policies.trainable_parameters()
    lora = {id(p) for m in policies.models for n, p in m.named_parameters() if "lora_" in n}
    assert params and all(id(p) in lora and p.requires_grad for p in params)
    frozen = [p for m in policies.models for n, p in m.named_parameters() if "lora_" not in n]
    assert frozen and not any(p.requires_grad for p in frozen)
