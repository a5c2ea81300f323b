"""Placement (`trainer.placement`) and work splitting (`trainer.work_split`) on CPU (gloo): one
prompt per step on 2 ranks, its joint actions shared, equals one process; each policy on its own
group of ranks (placement=groups) equals one process; one process with a device per policy
(placement=devices, two CPU "devices" here: the assignment, not real GPUs) equals the default; and
a placement that does not fit the world is refused in one line that names the fix.

Precision of the runs compared with one process: both in float64 (model.dtype=float64), so no
CPU's summation order shows; the ranks sum their shares of a batch in another order than one
process, ~float64's eps (1.1e-16) of the gradients' O(1) scale, which Adam amplifies in a
near-zero entry by at most lr / eps_adam per step. 2 steps of LoRA at lr 1e-3:
1.1e-16 x 1e5 x 2 ~ 2e-11, asserted LORA_ATOL = 1e-9; 2 steps of full fine-tuning at lr 1e-4:
1.1e-16 x 1e4 x 2 ~ 2e-12, asserted FULL_ATOL = 1e-10 (50-fold margins; float32 would differ by
~1e-6). Logged gradient norms: GRAD_REL = 1e-9 (step 1's a reduction compared directly, step 2's
taken at parameters within the ATOL).

Summation orders (`cross_order`): the ranks run under the Makefile's NUMERICS_ENV (one thread,
ATen's scalar kernels, MKL's conservative code path) and the one-process runs in the pytest
process's order, so every run of these tests compares the two summation orders; make test's
rerun under NUMERICS_ENV skips them (docs/development.md#numerics-on-other-cpus)."""

from __future__ import annotations

import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import VENV_BIN, compose_config, ranks_env, torchrun
from test_distributed import env
from test_sharded_training import agents, worst
from test_trainer import adapters, metrics

LORA_ATOL = 1e-9  # float64 eps 1.1e-16 x Adam's lr / eps_adam (1e-3 / 1e-8) x 2 steps ~ 2e-11 (module docstring)
FULL_ATOL = 1e-10  # 1.1e-16 x 1e-4 / 1e-8 x 2 steps ~ 2e-12
GRAD_REL = 1e-9
LORA_MOVED = 1e-4  # a tenth of one Adam step at lr 1e-3
F64 = "model.dtype=float64"


def cli(ranks: int) -> list[str]:
    return ([str(VENV_BIN / "marl-llm")] if ranks == 1 else
            torchrun(ranks, "-m", "marl_llm"))


def run(ranks, run_dir, *args):
    out = subprocess.run([*cli(ranks), *args, f"run_dir={run_dir}"], env=ranks_env(env()) if ranks > 1 else env(),
                         capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def common(model_dir):
    return ["model=local", f"model.path={model_dir}", "logger=none", "algo.sampling.max_new_tokens=8",
            "algo.sampling.top_p=1.0", "trainer.max_steps=2", "trainer.eval_before=false", "trainer.prompts_per_step=1",
            "algo=magrpo",
            "algo.num_turns=2", "algo.num_generations=2", "algo.baseline=raw"]


@pytest.mark.numerics
@pytest.mark.cross_order
@pytest.mark.slow
def test_one_prompt_on_two_ranks_shares_its_joint_actions_and_equals_one_process(tiny_model_dir, tmp_path):
    """One prompt per step on 2 ranks that share its joint actions against one process, both in
    float64 (the ranks under NUMERICS_ENV, one process in the machine's summation order): equal rewards,
    token counts and evaluation, grad norms to GRAD_REL, LoRA adapters after
    2 steps at lr 1e-3 to LORA_ATOL (module docstring)."""
    args = [*common(tiny_model_dir), F64, "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]",
            "algo.learning_rate=1e-3", "trainer.eval_after=true", "trainer.eval_max_problems=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    run(1, one, *args)
    out = run(2, two, *args)
    assert "the 2 ranks share each step's joint actions (trainer.work_split=joint_actions)" in out.stdout
    m1, m2 = metrics(one), metrics(two)
    assert len(m1) == len(m2) == 2
    for a, b in zip(m1, m2):  # the same tree (2 + 4 joint actions of one prompt), counted once
        assert a["train/reward"] == b["train/reward"] and a["train/num_tokens"] == b["train/num_tokens"]
        norms = [k for k in a if k.endswith("grad_norm")]
        assert norms and all(a[k] == pytest.approx(b[k], rel=GRAD_REL, abs=1e-30) for k in norms)
    a1, a2 = adapters(one), adapters(two)
    assert max(float((a1[k][n] - a2[k][n]).abs().max()) for k in a1 for n in a1[k]) <= LORA_ATOL
    assert max(float(a1[k][n].abs().max()) for k in a1 for n in a1[k] if "lora_B" in n) > LORA_MOVED  # it trained
    e1, e2 = metrics(one, "eval"), metrics(two, "eval")  # every rank took its share of the evaluation
    assert e1[-1]["eval/reward"] == e2[-1]["eval/reward"]


@pytest.mark.numerics
@pytest.mark.cross_order
@pytest.mark.slow
def test_each_policy_on_its_own_group_of_ranks_equals_one_process(tiny_model_dir, tmp_path):
    """Each fully fine-tuned policy on its own rank (placement=groups, FSDP) against both on one
    process, both in float64 (the ranks under NUMERICS_ENV, one process in the machine's summation
    order): the exported weights after 2 steps at lr 1e-4 agree to FULL_ATOL,
    the grad norms to GRAD_REL (module docstring)."""
    args = [*common(tiny_model_dir), F64, "algo.lora=null", "algo.learning_rate=1e-4",
            "trainer.eval_after=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    run(1, one, *args)
    out = run(2, two, *args, "trainer.placement=groups", "trainer.fsdp=true")
    assert "placement=groups: aux on ranks 0-0; main on ranks 1-1" in out.stdout
    # Each rank wrote the shards of its own policy.
    meta = torch.load(two / "checkpoint" / "meta.pt", weights_only=True)
    assert meta["parts"] == ["policy/0/agent_aux", "policy/1/agent_main"]
    a1, a2 = agents(one), agents(two)
    assert sorted(a2) == ["aux", "main"] and worst(a1, a2) < FULL_ATOL, worst(a1, a2)
    base = load_file(tiny_model_dir / "model.safetensors")
    assert max(float((a1["aux"][n] - base[n]).abs().max()) for n in base) > 1e-5  # it trained (lr 1e-4)
    for a, b in zip(metrics(one), metrics(two)):
        assert a["train/aux/grad_norm"] == pytest.approx(b["train/aux/grad_norm"], rel=GRAD_REL)
        assert a["train/main/grad_norm"] == pytest.approx(b["train/main/grad_norm"], rel=GRAD_REL)


@pytest.mark.slow
def test_a_device_per_policy_on_one_process(tiny_model_dir, tmp_path):
    args = [*common(tiny_model_dir), "algo.lora=null", "algo.learning_rate=1e-4",
            "trainer.eval_after=false", "trainer.max_steps=1"]
    shared, devices = tmp_path / "shared", tmp_path / "devices"
    run(1, shared, *args)
    out = run(1, devices, *args, "trainer.placement=devices", "trainer.placement_devices=[cpu,cpu]")
    assert "placement=devices: aux on cpu, main on cpu" in out.stdout
    assert worst(agents(shared), agents(devices)) == 0.0  # the same computation, wherever it is placed


# ------------------------------------------------------------------------------------- refusals
def cfg_of(*overrides: str):
    return compose_config(["run_dir=/tmp/placement", *overrides])


@pytest.mark.parametrize("overrides, world, gpus, message", [
    (["trainer.placement=nowhere"], 2, 0, "trainer.placement=nowhere is not one of shared, groups, devices"),
    (["trainer.work_split=rows"], 2, 0, "trainer.work_split=rows is not one of auto, prompts, joint_actions"),
    (["trainer.placement=groups", "trainer.fsdp=true"], 2, 0, "LoRA policies share one base"),
    (["trainer.placement=groups", "algo.lora=null"], 2, 0, "set trainer.fsdp=true"),
    (["trainer.placement=groups", "algo.lora=null", "trainer.fsdp=true"], 3, 0,
     "give 2 group sizes summing to 3 (e.g. trainer.placement_groups=[2,1])"),
    (["trainer.placement=groups", "algo.lora=null", "trainer.fsdp=true", "trainer.placement_groups=[3,2]"], 4, 0,
     "trainer.placement_groups=[3, 2] does not fit 2 policies on 4 processes"),
    (["trainer.placement=groups", "algo.lora=null", "trainer.fsdp=true", "trainer.work_split=prompts"], 2, 0,
     "set trainer.work_split=joint_actions"),
    (["trainer.placement=groups", "algo.lora=null", "trainer.fsdp=true", "algo.kl_coef=0.1"], 2, 0,
     "use trainer.placement=shared, or algo.kl_coef=0"),
    (["trainer.placement=devices", "algo.lora=null"], 2, 2, "but 2 processes were started: run one process"),
    (["trainer.placement=devices"], 1, 2, "LoRA policies share one base: set algo.lora=null"),
    (["trainer.placement=devices", "algo.lora=null"], 1, 0, "this process sees 0: use trainer.placement=shared"),
    (["trainer.work_split=prompts", "trainer.prompts_per_step=3"], 2, 0,
     "trainer.prompts_per_step=3 does not split over 2 processes: use a multiple of 2, or trainer.work_split="),
])
def test_a_placement_that_does_not_fit_is_refused_in_one_line(overrides, world, gpus, message):
    from marl_llm.config import UserError
    from marl_llm.distributed import placement

    cfg = cfg_of(*overrides)
    with pytest.raises(UserError) as err:
        placement.check(cfg, world, 2, gpus)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, world, gpus", [
    ([], 2, 0), (["trainer.placement=groups", "algo.lora=null", "trainer.fsdp=true"], 2, 0),
    (["trainer.placement=groups", "algo.lora=null", "trainer.fsdp=true", "trainer.placement_groups=[3,1]"], 4, 0),
    (["trainer.placement=devices", "algo.lora=null"], 1, 2),
    (["trainer.placement=devices", "algo.lora=null", "trainer.placement_devices=[cpu,cpu]"], 1, 0),
    (["trainer.prompts_per_step=3"], 2, 0),  # auto: the ranks share the joint actions
])
def test_placements_that_fit_pass(overrides, world, gpus):
    from marl_llm.distributed import placement

    placement.check(cfg_of(*overrides), world, 2, gpus)


@pytest.mark.parametrize("setting, mode, prompts, world, split", [
    ("auto", "shared", 4, 2, "prompts"), ("auto", "shared", 1, 2, "joint_actions"),
    ("auto", "groups", 4, 2, "joint_actions"), ("prompts", "shared", 4, 2, "prompts"),
    ("joint_actions", "shared", 4, 2, "joint_actions"), ("joint_actions", "shared", 4, 1, "prompts")])
def test_work_split_auto_picks_prompts_only_where_they_divide(setting, mode, prompts, world, split):
    from marl_llm.distributed.placement import resolve_split

    assert resolve_split(setting, mode, prompts, world) == split


def test_a_split_rollout_gives_each_rank_its_share_of_the_requests_of_each_policy():
    from marl_llm.distributed import data_parallel as distributed
    from marl_llm.distributed.placement import Placement

    placement = Placement("groups", "joint_actions", ranks={(0, "agent_a"): [0, 1], (1, "agent_b"): [2, 3, 4]})
    items = list(range(7))
    shares = {}
    for rank in range(5):
        distributed.set_world(distributed.World(rank, 5))
        try:
            shares[rank] = (placement.share(items, (0, "agent_a")), placement.share(items, (1, "agent_b")))
        finally:
            distributed.set_world(distributed.World())
    assert [shares[r][0] for r in range(5)] == [[0, 1, 2], [3, 4, 5, 6], [], [], []]
    assert [shares[r][1] for r in range(5)] == [[], [], [0, 1], [2, 3], [4, 5, 6]]
