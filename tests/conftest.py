"""Shared fixtures: a tiny random-weight Llama (built from a config, seconds to run) that uses the
embedded SmolLM2 tokenizer and chat template (pad == eos), and helpers to compose the real config."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# Tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# The parallel part of make test (pytest-xdist, PYTEST_WORKERS processes on as many cores): every
# worker's torch, and every console script and rank it starts with more than one thread, shares the
# cores with the other worker's. libgomp's threads spin while they wait for work (OMP_WAIT_POLICY's
# default), and a spinning thread holds the core that the thread it waits for needs: a tiny
# model's step took 20-50 times as long (e.g. an update 5.3 s instead of 0.15 s). PASSIVE waits
# sleep instead. The threads, and so every sum's order and every result, stay the same. Set here,
# before anything loads torch (and libgomp reads it), and inherited by every subprocess; the
# `exclusive` tests, which run alone, keep the default.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# Test files that start first under `--dist loadfile` (make test's parallel part), in this order:
# xdist hands files out by their number of tests, most first, so these few long ones came last and
# ran alone at the end. The `slurm` tests (minutes of jobs on a scheduler, whose worker mostly
# waits: make test gives the parallel part one worker more for them) start first on one worker; then
# the long few-test files, so that many short files end the run on every worker.
FIRST_FILES = ("test_slurm_cluster.py", "test_bench.py", "test_sharded_training.py", "test_bench_peers.py",
               "test_fsdp.py", "test_sharded_loading.py", "test_bench_gpu.py", "test_docs.py", "test_trainer.py",
               "test_bench_reward_hacks.py", "test_bench_collm_cost.py", "test_main_job.py")


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, FIRST_FILES handed out before the rest."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FirstFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            first = {Path(s.split("::")[0]).name: s for s in self.workqueue}
            for name in reversed(FIRST_FILES):
                if name in first:
                    self.workqueue.move_to_end(first[name], last=False)
            super()._assign_work_unit(node)

    return FirstFilesFirst(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (CI=true, as root) the local SLURM cluster must run: a skipped `slurm` test fails,
    with the skip's reason (scripts/slurm_local.py's one line)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("slurm") and os.environ.get("CI", "").lower() == "true":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"CI=true: the slurm tests must run here, but: {reason}"


# MARL_LLM_TEST_DEVICE=cuda runs the in-process tests' models on CUDA (the tiny model in bf16:
# model.dtype=auto); default cpu, so a GPU machine runs the same suite as CI unless asked.
TEST_DEVICE = os.environ.get("MARL_LLM_TEST_DEVICE", "cpu")


def rank_port() -> int:
    """The rendezvous port of the gloo ranks a test starts: one per pytest-xdist worker (gw0, gw1, ...),
    so ranks of tests that run at the same time on two workers never meet. torchrun's own default,
    29500, is every run's."""
    return 29500 + 10 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


def torchrun(ranks: int, *target: str) -> list[str]:
    """The command that runs `target` (a script and its arguments, or `-m marl_llm` and overrides) on
    `ranks` gloo ranks under torchrun, on this worker's port (rank_port)."""
    return [str(VENV_BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(rank_port()), *target]


def numerics_env() -> dict[str, str]:
    """The Makefile's NUMERICS_ENV (its `?=` default) as variables: make test's second summation order
    (docs/development.md#numerics-on-other-cpus)."""
    import shlex

    line = next(line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("NUMERICS_ENV ?="))
    return dict(word.split("=", 1) for word in shlex.split(line.split("?=", 1)[1]))


def ranks_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for the gloo ranks of a `cross_order` test: NUMERICS_ENV, the other summation order, while
    its one-process reference runs in the order of the pytest process. Such a test compares runs
    in the two orders (both in float64) each time it runs, so the rerun under NUMERICS_ENV skips it."""
    return {**env, **numerics_env()}


def build_tiny_model(path: Path, seed: int = 0, layers: int = 2) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from marl_llm.models.loading import embedded_checkpoint

    tok = AutoTokenizer.from_pretrained(embedded_checkpoint())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


# Two computations of the same numbers compared in float64 on the tiny model agree to this fraction of
# the reference's largest element. Error bound: float64's eps (1.1e-16) x the terms summed into one
# element (at most a few thousand here: the 49,152-token vocabulary's softmax sums the most, in
# chunks) x their size relative to the result (cancelling terms, up to ~1e2 for small gradient
# elements): ~1e-12 at worst. A real difference between the paths (a wrong token, mask, position or
# chunk boundary) is of the order of the values themselves, and float32's rounding is ~1e-7: both
# fail it. Seen: at most ~1e-15.
FLOAT64_REL = 1e-12


def assert_close_to_scale(actual, expected, rel: float, what: str = "") -> None:
    """Compare a reduction's result (gradients, losses, log-probs, values) with its reference to
    within `rel` of the reference's largest element, not elementwise.

    Why: a matmul or a sum over a vocabulary is reassociated differently by each CPU code path
    (MKL on Intel and on AMD, AVX2 or AVX-512 kernels, OpenBLAS), so every element carries a
    rounding error of order eps x the size of the terms summed into it. An element that is small
    because its terms cancel (5e-3 beside elements of order 1) has the same absolute error as a
    large one; an elementwise rtol fails on it on another CPU while the math is identical.
    `MKL_CBWR=COMPATIBLE` reproduces such a code path on an Intel machine."""
    import torch

    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    diff = float((actual.detach().to(expected.dtype) - expected.detach()).abs().max()) if expected.numel() else 0.0
    assert diff <= rel * max(scale, 1e-30), f"{what}: max |difference| {diff:.3g} > {rel:g} x max |reference| {scale:.3g}"


def pythonpath(*dirs) -> str:
    """PYTHONPATH for a subprocess that imports from `dirs` and from this process's PYTHONPATH
    (a checkout run against another checkout's venv sets it to its own src/)."""
    return os.pathsep.join([*(str(d) for d in dirs), *filter(None, [os.environ.get("PYTHONPATH")])])


# A subprocess's environment that makes Python write one `import time:` line per module it imports
# to stderr (`python -X importtime`): what a console-script command imported (imported_modules).
IMPORT_TIMES = {"PYTHONPROFILEIMPORTTIME": "1"}


def imported_modules(out):
    """(the modules that a process run with IMPORT_TIMES imported, its result with those lines taken
    out of its stderr): a command that must stay light asserts "torch" not in the first, and reads
    its own lines from the second as usual. Python times `import` statements only: a module that
    importlib.import_module loads (a plugin, task.env's module) is not listed, what it imports is."""
    import subprocess

    lines = out.stderr.splitlines(keepends=True)
    modules = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    rest = "".join(line for line in lines if not line.startswith("import time:"))
    return modules, subprocess.CompletedProcess(out.args, out.returncode, out.stdout, rest)


def compose_config(overrides: list[str]):
    """The real config from conf/, as the CLI composes it (run_dir set explicitly)."""
    from marl_llm.configure import compose_config as compose

    return compose(overrides)


def required_settings(group: str, option: str) -> list[str]:
    """What an option needs on top of its YAML to compose and validate: the keys it has no default for."""
    return {("model", "local"): ["model.path=/some/dir"],
            ("task", "team"): ["task.prompts=my_team:prompts", "task.reward=my_team:reward"],
            ("task", "env"): ["task.env=guess_env:Guess"]}.get((group, option), [])


def tiny_overrides(model_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """A training config that runs in seconds on the tiny model. top_p=1: the random model's nucleus
    is its whole 49,152-token vocabulary, whose sort per token was 2/3 of a rollout's time (a
    trained model's nucleus is a few candidates: rollout/sampling.py); tests of top-p set their own."""
    return ["model=local", f"model.path={model_dir}", f"model.device={TEST_DEVICE}", "logger=none", f"run_dir={run_dir}",
            "algo.num_generations=2", "algo.sampling.max_new_tokens=6", "algo.sampling.top_p=1.0", "algo.lora.r=4",
            "algo.lora.target_modules=[q_proj,v_proj]", "trainer.max_steps=1", "trainer.eval_max_problems=2",
            "task.data.train_split='test[33:37]'", *extra]


def make_policies(model_dir: Path, agents=("aux", "main"), adapters: str = "per_agent", agent_bases=None,
                  lr: float = 1e-2, seed: int = 0, policy_map=None, attn_implementation: str | None = "sdpa",
                  dtype: str = "auto"):
    """AgentPolicies on the tiny model, with LoRA B matrices made non-zero so adapters matter.
    dtype="float64": the equivalence tests' precision (FLOAT64_REL)."""
    import torch
    from omegaconf import OmegaConf

    from marl_llm.models.policies import AgentPolicies

    model_cfg = OmegaConf.create(dict(name="tiny", path=str(model_dir), embedded=False, hub_id=None, dtype=dtype,
                                      device=TEST_DEVICE, attn_implementation=attn_implementation,
                                      trust_remote_code=False, agent_bases=agent_bases))
    algo_cfg = OmegaConf.create(dict(adapters=adapters, learning_rate=lr, weight_decay=0.0, policy_map=policy_map or {},
                                     lora=dict(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])))
    policies = AgentPolicies(tuple(agents), model_cfg, algo_cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key in policies.trainable_adapters():
            for p in policies.adapter_parameters(*key):
                if "lora_B" in [part for part in p_name_parts(policies, key, p)]:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return policies


def p_name_parts(policies, key, param):
    for name, p in policies.models[key[0]].named_parameters():
        if p is param:
            return name.split(".")
    return []


def as_ordinary_uid(argv: list[str], uid: int) -> list[str]:
    """argv run as `uid` with no capabilities (setpriv), in a private mount namespace where an
    interpreter under /root (pyenv), which an ordinary uid cannot enter, stays reachable: /root
    becomes a traversable tmpfs holding the same tree. Needs root, unshare and setpriv."""
    import os
    import sys

    real = os.path.realpath(sys.executable)
    script = "mount --make-rprivate /\n"
    if real.startswith("/root/"):
        top = "/root/" + real.split("/")[2]
        script += (f"mkdir -p /run/marl-keep && mount --bind {top} /run/marl-keep\n"
                   f"mount -t tmpfs -o mode=755,size=1m tmpfs /root\nmkdir -p {top}\n"
                   f"mount --move /run/marl-keep {top}\n")
    script += f'exec setpriv --reuid={uid} --regid={uid} --clear-groups --inh-caps=-all --bounding-set=-all "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh", *argv]
