"""Full fine-tuning sharded with FSDP, end to end through the console script on CPU (gloo): the
trained agents equal one process's, sharded checkpoints resume on the same number of ranks
exactly and on 1 and 4 ranks resharded, a kill -9 during a sharded save leaves the previous
checkpoint usable, and a separate critic (CoLLM-CC) trains sharded too.

Precision of the comparisons with one process (and of a resume on another number of ranks): both
sides train in float64 (model.dtype=float64), so no CPU's summation order shows. As in
test_distributed.py the ranks sum their shares of a batch in another order than one process,
~float64's eps (1.1e-16) of the gradients' O(1) scale, which Adam amplifies in a near-zero entry
by at most lr / eps_adam = 1e-4 / 1e-8 = 1e4 per step: after 2 steps ~1.1e-16 x 1e4 x 2 ~ 2e-12.
Asserted: ATOL = 1e-10 (a 50-fold margin; float32 would differ by ~1e-6), while the weights moved
by more than 1e-4. Logged gradient norms and critic losses: GRAD_REL = 1e-9 (step 1's a reduction
compared directly, step 2's taken at parameters within ATOL). A resume on the same 2 ranks runs
the same sums in the same order: bitwise the uninterrupted run.

Summation orders (`cross_order`): the ranks run under the Makefile's NUMERICS_ENV (one thread,
ATen's scalar kernels, MKL's conservative code path) and the one-process runs in the pytest
process's order, so every run of these tests compares the two summation orders; make test's
rerun under NUMERICS_ENV skips them (docs/development.md#numerics-on-other-cpus)."""

from __future__ import annotations

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import VENV_BIN, ranks_env, torchrun
from test_distributed import env
from test_trainer import metrics

pytestmark = pytest.mark.slow
ATOL = 1e-10  # float64 eps 1.1e-16 x Adam's lr / eps_adam (1e-4 / 1e-8) x 2 steps ~ 2e-12 (module docstring)
GRAD_REL = 1e-9
F64 = "model.dtype=float64"


def args(model_dir, *extra):
    return ["model=local", f"model.path={model_dir}", "logger=none", "algo.sampling.max_new_tokens=8",
            "algo.lora=null", "algo.sampling.top_p=1.0", "algo.learning_rate=1e-4", "trainer.eval_before=false",
            "trainer.eval_after=false", "trainer.prompts_per_step=4", "algo=magrpo", "algo.num_turns=1",
            "algo.num_generations=2", "algo.baseline=raw", "trainer.fsdp=true", *extra]


def run(ranks, model_dir, run_dir, *extra, fault=None):
    cmd = ([str(VENV_BIN / "marl-llm")] if ranks == 1 else
           torchrun(ranks, "-m", "marl_llm"))
    environ = ranks_env(env()) if ranks > 1 else env()
    environ = environ if fault is None else dict(environ, MARL_LLM_FAULT=fault)
    return subprocess.run([*cmd, *args(model_dir, *extra), f"run_dir={run_dir}"], env=environ, capture_output=True,
                          text=True, timeout=600)


def ok(out):
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def agents(run_dir):
    """The exported agents' weights: {agent: {name: tensor}}."""
    return {p.name: load_file(p / "model.safetensors") for p in sorted((run_dir / "agents").iterdir()) if p.is_dir()}


def worst(a, b):
    """The largest difference between two exports, over the tensors both hold (a tied LM head is
    written once by the sharded export, twice by save_pretrained on one process)."""
    assert a.keys() == b.keys()
    return max(float((a[k][n] - b[k][n]).abs().max()) for k in a for n in a[k] if n in b[k])


@pytest.mark.numerics
@pytest.mark.cross_order
def test_full_fine_tuning_on_two_ranks_equals_one_process_and_resumes_on_any_world_size(tiny_model_dir, tmp_path):
    """Full fine-tuning sharded over 2 ranks against one process, and a 2-rank checkpoint resumed
    on 1 and 4 ranks against the uninterrupted 2-rank run, all in float64 (the ranks under NUMERICS_ENV,
    one process in the machine's summation order): to ATOL (module
    docstring); resumed on the same 2 ranks: bitwise."""
    one, two = tmp_path / "one", tmp_path / "two"
    ok(run(1, tiny_model_dir, one, "trainer.max_steps=2", F64))
    out = ok(run(2, tiny_model_dir, two, "trainer.max_steps=2", F64))
    assert "FSDP: the models are sharded over 2 ranks" in out.stdout
    # Each rank wrote its own shards; no whole-model checkpoint.pt.
    files = sorted(p.name for p in (two / "checkpoint").iterdir())
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt", "COMPLETE", ".metadata"} <= set(files)
    assert not (two / "checkpoint.pt").exists()
    base = load_file(tiny_model_dir / "model.safetensors")
    a1, a2 = agents(one), agents(two)
    assert max(float((a1["aux"][n] - base[n]).abs().max()) for n in base) > 1e-4  # the run really trained
    assert worst(a1, a2) < ATOL, worst(a1, a2)
    for m1, m2 in zip(metrics(one), metrics(two)):
        assert m1["train/num_tokens"] == m2["train/num_tokens"]
        assert m1["train/grad_norm"] == pytest.approx(m2["train/grad_norm"], rel=GRAD_REL)
    # The exported full model loads as a plain transformers model.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(two / "agents" / "main")
    assert torch.allclose(loaded.model.embed_tokens.weight, a2["main"]["model.embed_tokens.weight"])

    # A checkpoint written on 2 ranks at step 1 resumes on 2 (exactly the uninterrupted run), 1 and 4.
    half = tmp_path / "half"
    ok(run(2, tiny_model_dir, half, "trainer.max_steps=1", F64))
    for ranks in (2, 1, 4):
        resumed = tmp_path / f"resumed_on_{ranks}"
        subprocess.run(["cp", "-r", str(half), str(resumed)], check=True)
        out = ok(run(ranks, tiny_model_dir, resumed, "trainer.max_steps=2", "trainer.resume=true", F64))
        assert f"resumed from {resumed / 'checkpoint'} at step 1" in out.stdout
        diff = worst(a2, agents(resumed))
        if ranks == 2:
            assert diff == 0.0, diff  # same shards, same order of sums: bitwise the uninterrupted run
        else:
            assert diff < ATOL, (ranks, diff)
        assert [r["step"] for r in metrics(resumed)] == [1, 2]


def test_kill_during_a_sharded_save_leaves_the_previous_checkpoint_usable(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    out = run(2, tiny_model_dir, run_dir, "trainer.max_steps=2", "trainer.save_every=1", fault="kill_in_checkpoint:2")
    assert out.returncode != 0
    # Step 1's checkpoint is complete; step 2's shards were written but never completed.
    assert (run_dir / "checkpoint" / "COMPLETE").read_text() == "step 1\n"
    assert (run_dir / ".checkpoint.tmp").is_dir() and not (run_dir / ".checkpoint.tmp" / "COMPLETE").exists()
    out = ok(run(2, tiny_model_dir, run_dir, "trainer.max_steps=2", "trainer.save_every=1", "trainer.resume=true"))
    assert f"resumed from {run_dir / 'checkpoint'} at step 1" in out.stdout
    assert (run_dir / "checkpoint" / "COMPLETE").read_text() == "step 2\n"
    assert (run_dir / "checkpoint.prev" / "COMPLETE").is_file()  # (the final save repeats step 2)
    assert not (run_dir / ".checkpoint.tmp").exists()


@pytest.mark.numerics
@pytest.mark.cross_order
def test_a_separate_critic_trains_sharded_and_equals_one_process(tiny_model_dir, tmp_path):
    """CoLLM-CC with a separate, fully trained critic sharded over 2 ranks against one process,
    both in float64 (the ranks under NUMERICS_ENV, one process in the machine's summation order): the
    critic's grad norms and losses to GRAD_REL, the agents after 2 steps at
    lr 1e-4 to ATOL (module docstring)."""
    critic = [F64, "algo=collm_cc", "task=tldr", "algo.critic.placement=separate", "algo.num_turns=1", "trainer.max_steps=2"]
    drop = ("algo=magrpo", "algo.num_generations", "algo.baseline")
    one, two = tmp_path / "one", tmp_path / "two"

    def critic_run(ranks, run_dir):
        cmd = ([str(VENV_BIN / "marl-llm")] if ranks == 1 else
               torchrun(ranks, "-m", "marl_llm"))
        base = [a for a in args(tiny_model_dir) if not a.startswith(drop)]
        return ok(subprocess.run([*cmd, *base, *critic, f"run_dir={run_dir}"],
                                 env=ranks_env(env()) if ranks > 1 else env(), capture_output=True,
                                 text=True, timeout=600))

    critic_run(1, one)
    out = critic_run(2, two)
    assert "sharded over 2 ranks" in out.stdout
    meta = torch.load(two / "checkpoint" / "meta.pt", weights_only=True)
    assert "critic/critic" in meta["parts"] and meta["algorithm"]["critics"]["critic"] == {"in_sharded_checkpoint": True}
    m1, m2 = metrics(one), metrics(two)
    for a, b in zip(m1, m2):
        for k in a:
            if k.endswith("critic/grad_norm") or k.endswith("critic/vf_loss"):
                assert a[k] == pytest.approx(b[k], rel=GRAD_REL, abs=1e-30), k
    a1, a2 = agents(one), agents(two)
    assert len(a1) == 2 and worst(a1, a2) < ATOL, worst(a1, a2)
    base = load_file(tiny_model_dir / "model.safetensors")
    assert max(float((a[n] - base[n]).abs().max()) for a in a1.values() for n in base) > 1e-5  # they trained (lr 1e-4)
