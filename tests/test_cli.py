"""End to end: the real `marl-llm` console script in a subprocess, from a foreign directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import IMPORT_TIMES, REPO, VENV_BIN, imported_modules

CLI = str(VENV_BIN / "marl-llm")


def run(args, cwd, env=None, timeout=600):
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=full_env, timeout=timeout)


def tiny_args(model_dir, *extra):
    return ["model=local", f"model.path={model_dir}", "algo.num_generations=2", "algo.sampling.max_new_tokens=6",
            "algo.lora.r=4", "trainer.max_steps=1", "trainer.eval_max_problems=2", *extra]


def test_help_lists_groups_and_options(tmp_path):
    out = run([CLI, "--help"], tmp_path)
    assert out.returncode == 0
    listing = out.stdout.split("== Config ==")[0]  # the groups section, before the composed config
    groups = {line.split(":")[0]: line.split(":", 1)[1] for line in listing.splitlines()
              if line.split(":")[0] in ("algo", "task", "model")}
    assert {"magrpo", "single", "parallel", "sequential", "discussion"} <= set(groups["algo"].replace(",", " ").split())
    assert {"humaneval", "coophumaneval", "tldr", "arxiv"} <= set(groups["task"].replace(",", " ").split())
    assert {"smollm2_135m", "qwen2_5_coder_3b"} <= set(groups["model"].replace(",", " ").split())


@pytest.mark.parametrize("args,says", [
    (["--help"], "== Configuration groups =="), (["-h"], "== Configuration groups =="),
    (["--hydra-help"], "== Flags =="),
    (["trainer.max_stepz=1"], "error: unknown config key trainer.max_stepz (TrainerConfig). Did you mean "
                              "trainer.max_steps?"),
])
def test_help_and_a_misspelled_key_import_no_torch(args, says, tmp_path):
    """What must take well under a second (issue #44 item 10): the help, which rendered by Hydra took
    3.5-4 s of CPU, and a typo, each through the real console script."""
    imported, out = imported_modules(run([CLI, *args], tmp_path, IMPORT_TIMES))
    assert says in out.stdout + out.stderr, out.stderr[-3000:]
    assert "hydra" in imported and "torch" not in imported and "transformers" not in imported


@pytest.mark.parametrize("args", [["--help"], ["--hydra-help"],
                                  ["algo=at_grpo", "task=sokoban", "--help", "--resolve"]])
def test_the_help_is_hydras_own_text(args, tmp_path):
    """cli/help.py prints Hydra's help text itself, without Hydra's ~140 copies of its config
    repository: the same text as Hydra's own path prints (print_help disabled: Hydra renders)."""
    hydras = run([sys.executable, "-c", "import sys\nimport marl_llm.cli.help as h\nh.print_help = lambda args: False\n"
                  f"sys.argv = ['marl-llm', *{args!r}]\nfrom marl_llm.cli.launch import main\nmain()"], tmp_path)
    ours = run([CLI, *args], tmp_path)
    assert ours.returncode == hydras.returncode == 0, ours.stderr[-2000:] + hydras.stderr[-2000:]
    assert ours.stdout == hydras.stdout
    assert ("== Config ==" if "--help" in args else "== Flags ==") in ours.stdout


# Counts the copies of Hydra's config repository (each copies the ConfigStore, every registered
# schema included: ~0.1 s of CPU) that a console-script command makes, printed at exit.
COUNT_REPOSITORY_COPIES = """
import atexit, sys
from hydra._internal.config_repository import CachingConfigRepository
copies = []
copy_repository = CachingConfigRepository.__init__
CachingConfigRepository.__init__ = lambda self, *a, **k: copies.append(1) or copy_repository(self, *a, **k)
atexit.register(lambda: print("COPIES", len(copies)))
sys.argv = ["marl-llm", *sys.argv[1:]]
from marl_llm.cli.launch import main
main()
"""


@pytest.mark.parametrize("args", [["--help"], ["--hydra-help"], ["task=env", "model=local", "algo=at_grpo", "--help"]])
def test_the_help_copies_hydras_config_repository_only_a_few_times(args, tmp_path):
    """Where Hydra's help spent its 3.5-4 s: 147 copies of the repository for `--help`, 112 for
    `--hydra-help`, one per listed group and kind. Counted, not timed (timings are noisy)."""
    out = run([sys.executable, "-c", COUNT_REPOSITORY_COPIES, *args], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    copies = int(next(line for line in out.stdout.splitlines() if line.startswith("COPIES ")).split()[1])
    assert 1 <= copies <= 3


def test_cfg_job_shows_overrides(tmp_path):
    out = run([CLI, "--cfg", "job", "model=qwen3_1_7b", "algo.num_generations=8", "trainer.max_steps=50", "seed=1"],
              tmp_path)
    assert out.returncode == 0, out.stderr
    assert "num_generations: 8" in out.stdout and "max_steps: 50" in out.stdout and "seed: 1" in out.stdout
    assert "hub_id: Qwen/Qwen3-1.7B" in out.stdout


def test_tiny_run_end_to_end_with_offline_wandb(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    out = subprocess.run([CLI, *tiny_args(tiny_model_dir, "logger=wandb", f"hydra.run.dir={run_dir}")], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "eval @ step 0" in out.stdout and "step 1/1" in out.stdout
    assert "FutureWarning" not in out.stderr + out.stdout  # e.g. transformers' deprecated past_key_values
    assert out.stdout.count("KV cache budget") == 1
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/reward" in r for r in rows) and any("eval/pass@1" in r for r in rows)
    assert (run_dir / "checkpoint.pt").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "W&B should have logged offline"


def test_multirun_sweeps_seeds(tiny_model_dir, tmp_path):
    sweep = tmp_path / "multirun" / "sweep1"
    out = run([CLI, "-m", "seed=0,1", *tiny_args(tiny_model_dir, "logger=wandb", "trainer.eval_before=false",
                                                 "trainer.eval_after=false", f"hydra.sweep.dir={sweep}")], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = sorted(sweep.rglob("metrics.jsonl"))
    assert len(metrics) == 2
    assert {p.parent.name for p in metrics} == {"seed=0", "seed=1"}
    # The sweep's runs share one W&B group; each run's name and tags say algorithm, task, model, seed.
    runs = [json.loads(p.with_name("wandb.json").read_text()) for p in metrics]
    model = tiny_model_dir.name  # model=local is named after its checkpoint dir
    assert len({r["group"] for r in runs}) == 1 and runs[0]["group"].startswith(f"magrpo-humaneval-{model}-")
    assert {r["name"] for r in runs} == {f"magrpo-humaneval-{model}-seed0", f"magrpo-humaneval-{model}-seed1"}
    for r in runs:
        assert {"algo:magrpo", "task:humaneval", f"model:{model}", "sweep:multirun/sweep1"} <= set(r["tags"])
        assert f"seed:{r['name'][-1]}" in r["tags"] and len(r["id"]) > 4


def test_a_single_runs_group_is_shared_by_its_seeds():
    from omegaconf import OmegaConf

    from marl_llm.runs.loggers import config_hash, run_identity

    cfg = OmegaConf.create({"algo": {"name": "collm_cc"}, "task": {"name": "strbuild"}, "model": {"name": "smollm2-135m"},
                            "seed": 3, "logger": {"group": None, "tags": ["paper"]}})
    ident = run_identity(cfg)
    assert ident["group"] == f"collm_cc-strbuild-smollm2-135m-{config_hash(cfg)}"
    assert ident["name"] == "collm_cc-strbuild-smollm2-135m-seed3"
    cfg.seed = 4
    assert run_identity(cfg)["group"] == ident["group"]  # the seeds of one setting share the group
    cfg.seed = 3
    assert ident["tags"] == ["algo:collm_cc", "task:strbuild", "model:smollm2-135m", "seed:3", "paper"]
    cfg.logger.group = "ablation"
    assert run_identity(cfg, "multirun/2026-11-22/10-00-00")["group"] == "ablation"  # an explicit group wins


def test_non_editable_install_finds_its_config(tmp_path):
    target = tmp_path / "site"
    out = run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
               str(target), str(REPO)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert (target / "marl_llm" / "conf" / "algo" / "magrpo.yaml").is_file()
    # The offline data samples and the `evaluate` metric scripts are package data too.
    for sample in ("tldr/train.jsonl", "tldr/test.jsonl", "arxiv/train.jsonl", "arxiv/val.jsonl",
                   "coophumaneval/test.jsonl"):
        assert (target / "marl_llm" / "samples" / sample).is_file(), sample
    for metric in ("writing_reward/writing_reward.py", "pass_at_k/pass_at_k.py"):
        assert (target / "marl_llm" / "metrics" / metric).is_file(), metric
    env = {"PYTHONPATH": str(target)}
    where = run([sys.executable, "-c", "import marl_llm.cli.train as c; print(c.__file__); print(c.config_dir())"], tmp_path, env)
    assert where.stdout.splitlines() == [str(target / "marl_llm" / "cli" / "train.py"), str(target / "marl_llm" / "conf")]
    out = run([str(target / "bin" / "marl-llm"), "--cfg", "job", "algo.baseline=rloo"], tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert "baseline: rloo" in out.stdout


def test_hub_model_offline_suggests_model_path(tmp_path):
    out = run([CLI, "model=qwen3_1_7b", "logger=none", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path,
              {"HF_HUB_OFFLINE": "1"}, timeout=300)
    assert out.returncode == 2
    assert "model.path=" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_embedded_model_one_step(tmp_path):
    """The real default job on the embedded SmolLM2-135M: one step, small G, few tokens, one held-out
    problem (its two turns; the update over the ~450-token prompts is most of the time)."""
    run_dir = tmp_path / "run"
    out = run([CLI, "algo=magrpo", "task=humaneval", "logger=none", "algo.num_generations=2",
               "algo.sampling.max_new_tokens=8", "trainer.max_steps=1", "trainer.eval_max_problems=1",
               "trainer.eval_before=false",
               f"hydra.run.dir={run_dir}", f"trainer.summary_file={tmp_path / 'summary.md'}"], tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "smollm2-135m-instruct" in out.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert "pass@1" in summary and "marl-llm algo=magrpo task=humaneval" in summary
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_row = next(r for r in rows if "train/reward" in r)
    assert 0.0 <= train_row["train/reward"] <= 4.0 and train_row["train/aux/num_tokens"] > 0


def test_embedded_model_tldr_step_and_report(tmp_path):
    """TLDR on the embedded model from the offline sample, then marl-llm-report on the run."""
    run_dir = tmp_path / "runs" / "magrpo"
    out = run([CLI, "algo=magrpo", "task=tldr", "algo.num_turns=1", "logger=none", "algo.num_generations=2",
               "algo.sampling.max_new_tokens=16", "trainer.max_steps=1", "trainer.eval_max_problems=1",
               f"hydra.run.dir={run_dir}"], tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "data for task tldr: packaged (hub dataset trl-lib/tldr not reachable" in out.stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_row = next(r for r in rows if "train/reward" in r)
    assert 0.0 <= train_row["train/reward"] <= 3.0 and "train/rewards/length_ungated/mean" in train_row
    report = run([str(VENV_BIN / "marl-llm-report"), str(tmp_path / "runs"), "--out", str(tmp_path / "out")], tmp_path)
    assert report.returncode == 0, report.stderr
    table = (tmp_path / "out" / "tldr.md").read_text()
    assert "| magrpo | 1 | 1 |" in table and (tmp_path / "out" / "tldr_eval_reward.png").is_file()


def test_unreachable_wandb_never_stops_training(tiny_model_dir, tmp_path):
    """logger.mode=online with no API key (and no network): a warning, then training as usual."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_API_KEY="", WANDB_BASE_URL="http://127.0.0.1:9", HOME=str(tmp_path))
    out = subprocess.run([CLI, *tiny_args(tiny_model_dir, "logger=wandb", "logger.mode=online",
                                          "trainer.eval_before=false", f"hydra.run.dir={run_dir}")],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "W&B unavailable" in out.stderr
    assert any("train/reward" in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())


def test_map_fields_take_new_keys_in_the_plain_form(tmp_path):
    from marl_llm.cli.train import map_overrides

    args = ["algo=at_grpo", "algo.policy_map={tool:a,plan:b}", "task=tldr", "task.data.files.train=/x.jsonl",
            "algo.learning_rate=1e-4", "+extra=1"]
    assert map_overrides(args) == ["algo=at_grpo", "++algo.policy_map={tool:a,plan:b}", "task=tldr",
                                   "++task.data.files.train=/x.jsonl", "algo.learning_rate=1e-4", "+extra=1"]
    out = run([CLI, "--cfg", "job", "algo.agent_sampling={main:{temperature:0.9}}"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "main:\n      temperature: 0.9" in out.stdout


def test_embedded_model_actor_critic_on_strbuild(tmp_path):
    """CoLLM-CC from its matched-budget preset on the embedded model: one short step on StrBuild."""
    run_dir = tmp_path / "run"
    # One turn of one prompt: its update (the critic over both agents' ~450-token prompts, on the
    # 135M model) is most of the time; multi-turn actor-critic runs on the tiny model in test_collm.
    out = run([CLI, "experiment=matched_strbuild_collm_cc", "algo.num_turns=1", "trainer.prompts_per_step=1",
               "algo.sampling.max_new_tokens=16", "trainer.max_steps=1", "task.num_eval=1", "trainer.eval_before=false",
               f"hydra.run.dir={run_dir}"], tmp_path, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_row = next(r for r in rows if "train/reward" in r)
    assert -2.75 <= train_row["train/reward"] <= 2.0 and train_row["train/joint_actions"] == 1
    assert "train/critic/vf_loss" in train_row and "train/builder2/loss" in train_row
    assert "eval/success_rate" in rows[-1] and "eval/rewards/coverage/mean" in rows[-1]
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert set(ckpt["algorithm"]["critics"]) == {"critic"}


def test_a_named_run_dir_that_holds_a_run_is_refused_before_anything_is_written(tiny_model_dir, tmp_path):
    """Re-running a command with hydra.run.dir= of a finished run: one line naming the fix, exit 2,
    and not a byte of that run changes (not even Hydra's own .hydra/ files or its log)."""
    run_dir = tmp_path / "run"
    args = [CLI, *tiny_args(tiny_model_dir, "logger=none", "trainer.eval_before=false", "trainer.eval_after=false",
                            f"hydra.run.dir={run_dir}")]
    assert run(args, tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert run_dir / ".hydra" / "overrides.yaml" in before
    again = run([*args, "seed=7"], tmp_path)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip().count("\n") == 0 and "already holds a run" in again.stderr
    assert "trainer.resume=true" in again.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
