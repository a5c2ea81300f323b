"""Who a run is and what it ran: W&B names, groups and tags by what differs; model=local named
after its dir; the code version and git commit with every run; TRL's `num_tokens`; the
`wandb sync` command that finds a sweep's runs; `--cfg job --resolve`; `--help` without the
private presets; `make clean` keeping the runs."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import REPO, VENV_BIN, compose_config

CLI = str(VENV_BIN / "marl-llm")


def run(args, cwd, env=None, timeout=300):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def small_cfg(**changes):
    """A plain config with the keys run_identity and config_hash read."""
    cfg = OmegaConf.create({"algo": {"name": "magrpo", "learning_rate": 5e-5}, "task": {"name": "tldr"},
                            "model": {"name": "Qwen3-1.7B"}, "seed": 0, "run_dir": "/runs/a",
                            "logger": {"group": None, "tags": [], "project": "p"},
                            "trainer": {"max_steps": 10, "resume": False, "save_every": 0}})
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    return cfg


# ---------------------------------------------------------------------------- names and groups
def test_the_group_is_the_config_but_the_seed():
    from marl_llm.runs.loggers import config_hash, run_identity

    base = run_identity(small_cfg())
    assert base["group"] == f"magrpo-tldr-Qwen3-1.7B-{config_hash(small_cfg())}" and len(config_hash(small_cfg())) == 8
    # Seeds, run dirs, logging and resume settings: the same experiment, one group.
    same = small_cfg(**{"seed": 7, "run_dir": "/runs/b", "logger.project": "q", "trainer.resume": True,
                        "trainer.save_every": 5})
    assert run_identity(same)["group"] == base["group"]
    # Anything that changes what is trained: another group.
    for change in ({"algo.learning_rate": 1e-4}, {"trainer.max_steps": 20}, {"model.name": "Qwen3-8B"}):
        assert run_identity(small_cfg(**change))["group"] != base["group"], change
    assert run_identity(small_cfg(**{"logger.group": "ablation"}))["group"] == "ablation"  # an explicit group wins


def test_names_and_tags_say_what_differs():
    from marl_llm.runs.loggers import run_identity

    single = run_identity(small_cfg(**{"seed": 3, "logger.tags": ["paper"]}))
    assert single["name"] == "magrpo-tldr-Qwen3-1.7B-seed3"
    assert single["tags"] == ["algo:magrpo", "task:tldr", "model:Qwen3-1.7B", "seed:3", "paper"]
    swept = run_identity(small_cfg(seed=1), "multirun/2026-01-02/03-04-05-000006",
                         ["algo.baseline=rloo", "algo.learning_rate=0.0001"])
    assert swept["name"] == "algo.baseline=rloo algo.learning_rate=0.0001 seed=1"
    assert {"sweep:2026-01-02/03-04-05-000006", "algo.baseline=rloo", "seed:1"} <= set(swept["tags"])
    # W&B refuses a tag over 64 characters, and with it the whole run.
    long = run_identity(small_cfg(), "multirun/d/t", ["task.data.files.train=/" + "x" * 100])
    assert all(len(t) <= 64 for t in long["tags"])


def test_swept_keys_come_from_the_command_line_and_sweep_presets(tmp_path):
    from marl_llm.runs.loggers import swept_keys

    (tmp_path / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task: ['seed=0,1', 'algo.baseline=mean,rloo', 'trainer.max_steps=5',"
        " 'algo.learning_rate=range(1,3)']\n"
        "  sweeper:\n    params:\n      experiment: magrpo_tldr_paper,magrpo_arxiv_paper\n      model: local\n")
    assert swept_keys(str(tmp_path)) == {"seed", "algo.baseline", "algo.learning_rate", "experiment"}
    assert swept_keys(str(tmp_path / "nowhere")) is None  # then a job is named by all its overrides


STUB = """\
import json, os, sys
import hydra
from marl_llm.configure import config_dir, register_configs  # and the resolvers
from marl_llm.runs.loggers import run_identity, sweep_dir, swept_overrides

register_configs()

@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def main(cfg):
    sweep = sweep_dir()
    with open(os.environ["IDENTITIES"], "a") as f:
        f.write(json.dumps(run_identity(cfg, sweep, swept_overrides(sweep))) + "\\n")

main()
"""


def test_a_sweep_preset_names_its_jobs_by_experiment(tmp_path):
    """`-m sweep=<preset>` (the sweep in hydra.sweeper.params) through Hydra's real sweeper, with a
    task function that records each job's identity instead of training."""
    (tmp_path / "stub.py").write_text(STUB)
    out = run([sys.executable, str(tmp_path / "stub.py"), "-m", "sweep=magrpo_writing", "seed=0",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", "logger=none"], tmp_path,
              env={"IDENTITIES": str(tmp_path / "ids.jsonl")})
    assert out.returncode == 0, out.stderr[-3000:]
    ids = [json.loads(line) for line in (tmp_path / "ids.jsonl").read_text().splitlines()]
    assert sorted(i["name"] for i in ids) == ["experiment=magrpo_arxiv_paper seed=0",
                                             "experiment=magrpo_tldr_paper seed=0"]
    assert len({i["group"] for i in ids}) == 2  # different tasks: never one group
    assert all(i["group"].startswith("magrpo-") and "model:Qwen3-1.7B" in i["tags"] for i in ids)


@pytest.mark.slow
def test_a_sweep_end_to_end_names_groups_records_the_code_and_syncs(tiny_model_dir, tmp_path):
    """`marl-llm -m seed=0,1 algo.baseline=mean,rloo` on the tiny model with offline W&B: the runs
    are named by baseline and seed, each baseline's seeds share a group, every run records the
    code it ran, and the printed `wandb sync` command finds all four runs."""
    sweep = tmp_path / "multirun" / "sweep1"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [CLI, "-m", "seed=0,1", "algo.baseline=mean,rloo", "model=local", f"model.path={tiny_model_dir}",
         "algo.num_generations=2", "algo.sampling.max_new_tokens=6", "algo.lora.r=4", "algo.num_turns=1",
         "trainer.max_steps=1", "trainer.eval_before=false", "trainer.eval_after=false", "logger=wandb",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {p.parent: json.loads(p.read_text()) for p in sweep.rglob("wandb.json")}
    assert sorted(r["name"] for r in runs.values()) == [
        "algo.baseline=mean seed=0", "algo.baseline=mean seed=1", "algo.baseline=rloo seed=0",
        "algo.baseline=rloo seed=1"]
    groups = {r["name"].split()[0]: r["group"] for r in runs.values()}
    assert len(set(groups.values())) == 2 and len({r["group"] for r in runs.values()}) == 2
    model = tiny_model_dir.name  # model=local: named after its dir
    assert all(r["group"].startswith(f"magrpo-humaneval-{model}-") for r in runs.values())
    for run_dir, r in runs.items():
        assert {f"model:{model}", "sweep:multirun/sweep1", r["name"].split()[0]} <= set(r["tags"])
        version = json.loads((run_dir / "version.json").read_text())
        assert version["marl_llm"] and version["torch"]
        if (REPO / ".git").exists():  # the tests run the package from this checkout
            head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
            assert version["git_commit"] == head.stdout.strip() and isinstance(version["git_dirty"], bool)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = next(row for row in rows if "train/num_tokens" in row)
        assert train["train/num_tokens"] == train["train/prompt_tokens"] + train["train/completion_tokens"] > 0
    # The sweep-wide command each job prints finds every run (`wandb sync <sweep dir>` finds none).
    line = next(x for x in out.stdout.splitlines() if "every run of the sweep:" in x)
    command = line.split("every run of the sweep: ", 1)[1].rstrip(")")
    assert command == f"find {shlex.quote(str(sweep))} -type d -name wandb -prune -exec wandb sync {{}} +"
    dry = run(["bash", "-c", command.replace("wandb sync", f"{VENV_BIN / 'wandb'} sync --dry-run")], tmp_path, env)
    assert "Would sync 4 run(s)" in dry.stdout + dry.stderr, dry.stdout + dry.stderr


# ------------------------------------------------------------------------------------ model name
def test_a_local_model_is_named_after_its_directory():
    cfg = compose_config(["model=local", "model.path=/data/Qwen2.5-Coder-3B/", "run_dir=/tmp/x"])
    assert cfg.model.name == "Qwen2.5-Coder-3B"
    assert compose_config(["model=local", "model.path='~/ckpt/my-model'", "run_dir=/tmp/x"]).model.name == "my-model"
    # Presets keep their own names.
    assert compose_config(["model=qwen3_1_7b", "run_dir=/tmp/x"]).model.name == "Qwen3-1.7B"


# ------------------------------------------------------------------------------------- the code
def test_every_run_records_its_code_and_each_later_start(tmp_path):
    import marl_llm
    from marl_llm.runs.loggers import RunLogger

    cfg = compose_config(["logger=none", f"run_dir={tmp_path}"])
    RunLogger(cfg, tmp_path)
    first = json.loads((tmp_path / "version.json").read_text())
    assert first["marl_llm"] == marl_llm.__version__ and "later_starts" not in first
    assert set(first) >= {"git_commit", "git_dirty", "python", "torch", "transformers", "peft", "started"}
    RunLogger(cfg, tmp_path)  # a resume in the same dir
    again = json.loads((tmp_path / "version.json").read_text())
    assert again["started"] == first["started"] and len(again["later_starts"]) == 1


# ------------------------------------------------------------------------------- TRL num_tokens
def test_num_tokens_is_trls_running_total_and_a_resume_continues_it(tmp_path):
    from marl_llm.runs.loggers import RunLogger

    cfg = compose_config(["logger=none", f"run_dir={tmp_path}"])
    step = {"aux/num_tokens": 10.0, "aux/prompt_tokens": 100.0, "main/num_tokens": 20.0, "main/prompt_tokens": 200.0,
            "num_tokens": 30.0, "prompt_tokens": 150.0, "reward": 1.0}  # the trainer's team prompt count: a mean
    logger = RunLogger(cfg, tmp_path)
    logger.log("train", step, 1)
    logger.log("eval", {"reward": 0.5}, 1)
    logger.log("train", step, 2)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train/completion_tokens"] == 30 and rows[0]["train/prompt_tokens"] == 300  # the policies' sum
    assert rows[0]["train/num_tokens"] == 330 and rows[0]["train/aux/num_tokens"] == 110
    assert rows[2]["train/num_tokens"] == 660 and rows[2]["train/main/num_tokens"] == 440
    assert rows[2]["train/main/completion_tokens"] == 20 and "eval/num_tokens" not in rows[1]
    # A resume (a new logger on the same dir) goes on from the total logged before its step.
    RunLogger(cfg, tmp_path).log("train", step, 3)
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["train/num_tokens"] == 990 and last["train/aux/num_tokens"] == 330


def test_a_resume_of_a_run_logged_before_the_running_total(tmp_path):
    """Older rows held one step's completion tokens as num_tokens: a resume adds them up."""
    from marl_llm.runs.loggers import tokens_seen_before

    rows = [{"step": 1, "train/num_tokens": 30.0, "train/aux/num_tokens": 10.0},
            {"step": 2, "train/num_tokens": 40.0, "train/aux/num_tokens": 15.0}, {"step": 2, "eval/reward": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tokens_seen_before(tmp_path / "metrics.jsonl", 3) == {"": 70.0, "aux/": 25.0}
    assert tokens_seen_before(tmp_path / "metrics.jsonl", 2) == {"": 30.0, "aux/": 10.0}


def test_the_update_counts_prompt_tokens(tiny_model_dir):
    import torch

    from marl_llm.algos.update import UpdateSettings, policy_update
    from marl_llm.rollout.base import Completion

    from conftest import make_policies

    policies = make_policies(tiny_model_dir)
    key = policies.trainable_adapters()[0]
    comps = [Completion(torch.tensor([1, 2, 3]), torch.tensor([4, 5]), "ab", truncated=False),
             Completion(torch.tensor([1, 2, 3, 6]), torch.tensor([7]), "c", truncated=True)]
    stats = policy_update(policies, 0, key, comps, torch.tensor([1.0, -1.0]), UpdateSettings(), micro_batch_size=2)
    assert stats["prompt_tokens"] == 7 and stats["num_tokens"] == 3


# ------------------------------------------------------------------------------ smaller frictions
def test_cfg_job_resolve_prints_the_config(tmp_path):
    out = run([CLI, "--cfg", "job", "--resolve", "model=local", "model.path=/data/Qwen2.5-Coder-3B"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "run_dir: '<made when the run starts: hydra.run.dir>'" in out.stdout
    assert "name: Qwen2.5-Coder-3B" in out.stdout and "${" not in out.stdout
    assert not (tmp_path / "outputs").exists()  # printing makes no run dir


def test_help_lists_what_a_user_picks_and_hides_the_private_parts(tmp_path):
    out = run([CLI, "--help"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    groups = out.stdout.split("== Config ==")[0]
    assert "_matched" not in groups and "_schema" not in groups and "default.example" not in groups
    listed = {line.split(":")[0]: line.split(": ", 1)[1].split(", ") for line in groups.splitlines()
              if ": " in line and not line.startswith(("Usage", "Sweeps", "marl-llm"))}
    assert {"matched_tldr_magrpo", "magrpo_humaneval_paper"} <= set(listed["experiment"])
    assert {"slurm", "slurm_gres", "local"} <= set(listed["hydra/launcher"])
    assert listed["algo"] == ["at_grpo", "collm_cc", "collm_dc", "discussion", "magrpo", "parallel", "sequential",
                              "single"]
    # What is hidden still works by name.
    assert compose_config(["experiment=_matched_tldr", "run_dir=/tmp/x"]).task.name == "tldr"
    assert compose_config(["algo=magrpo_schema", "run_dir=/tmp/x"]).algo.name == "magrpo"


def test_make_clean_keeps_the_runs(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make")
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    keep = ["outputs/2026-01-01/run/metrics.jsonl", "multirun/2026-01-01/s/seed=0/metrics.jsonl",
            "outputs/x/__pycache__/kept.pyc", "src/marl_llm/cli/train.py"]
    gone = [".venv/bin/python", "build/lib/x.py", "dist/x.whl", ".pytest_cache/v", "src/marl_llm.egg-info/PKG-INFO",
            "src/marl_llm/__pycache__/cli.pyc", "tests/__pycache__/t.pyc"]
    for rel in keep + gone:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    out = run(["make", "-s", "clean"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert [rel for rel in keep if not (tmp_path / rel).exists()] == []
    assert [rel for rel in gone if (tmp_path / rel).exists()] == []
