"""Taking the trained agents away (issue 19): <run_dir>/agents/ holds each trained policy in the
format its users load (a peft adapter dir, or a whole transformers model with algo.lora=null) that
gives the trained policy's logits; `marl-llm-eval` evaluates a run's agents on another task or
split into a new dir and leaves the run's files as they were; bad input is one `error:` line."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from conftest import (FLOAT64_REL, TEST_DEVICE, VENV_BIN, assert_close_to_scale, compose_config, make_policies,
                      tiny_overrides)
from marl_llm.cli import eval as eval_cli
from marl_llm.config import UserError
from marl_llm.runs.export import MANIFEST, export_agents, load_agents, read_manifest
from marl_llm.models.policies import AgentPolicies

IDS = torch.tensor([[1, 5, 9, 42, 7, 300, 12, 8]])


def logits(model) -> torch.Tensor:
    """The logits of IDS: fp32 at least, fp64 for a float64 model."""
    with torch.no_grad():
        out = model(input_ids=IDS.to(model.device)).logits
    return out.to(torch.promote_types(out.dtype, torch.float32)).cpu()


def base_model(path, dtype=torch.float64):
    """A checkpoint as its users load it; float64 by default (the tests compare its logits with the
    policy's in float64, to FLOAT64_REL), with the norms in float64 as loading makes them."""
    from transformers import AutoModelForCausalLM

    from marl_llm.models.loading import norms_in_float64

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if dtype == torch.float64:
        norms_in_float64(model)
    return model


def agent_logits(policies, i) -> torch.Tensor:
    with policies.acting(i) as model:
        model.eval()  # acting() switches to train mode; dropout is 0 anyway
        return logits(model)


def files_state(run_dir):
    """(bytes, mtime) of every file of the run outside evals/."""
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*"))
            if p.is_file() and "evals" not in p.relative_to(run_dir).parts}


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory):
    """One step of the real console script. The raw baseline makes the adapters move although the
    tiny model's rewards are all equal; a large learning rate makes the move show in the logits."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    args = tiny_overrides(tiny_model_dir, run_dir, f"hydra.run.dir={run_dir}", "algo.baseline=raw",
                          "algo.learning_rate=0.05", "trainer.eval_before=false", "trainer.eval_after=false")
    proc = subprocess.run([str(VENV_BIN / "marl-llm"), *args], cwd=run_dir.parent, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"agents of step 1 written to {run_dir / 'agents'}" in proc.stdout
    return run_dir


@pytest.mark.numerics
def test_training_exports_peft_adapters_that_give_the_trained_policys_logits(trained_run, tiny_model_dir):
    """The exported peft adapter on its base vs the policy rebuilt from the run's config and
    checkpoint: logits, both loaded in float64 (the fp32-trained weights are exact in it), to
    FLOAT64_REL of the largest logit; training moved them by far more."""
    from peft import PeftModel

    agents = trained_run / "agents"
    manifest = json.loads((agents / MANIFEST).read_text())
    assert manifest["kind"] == "lora" and manifest["step"] == 1 and manifest["task"] == "humaneval"
    assert [(a["name"], a["dir"]) for a in manifest["agents"]] == [("aux", "aux"), ("main", "main")]
    assert {a["base_model"] for a in manifest["agents"]} == {str(tiny_model_dir.absolute())}
    for name in ("aux", "main"):
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"} <= {
            p.name for p in (agents / name).iterdir()}
        config = json.loads((agents / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tiny_model_dir.absolute()) and config["r"] == 4
    assert not [p for p in trained_run.iterdir() if p.name.startswith(".agents")]  # no temp dir left

    # The policy as training left it: the run's config, the checkpoint's adapters.
    cfg = OmegaConf.load(trained_run / "config.yaml")
    cfg.model.dtype = "float64"
    policies = AgentPolicies(("aux", "main"), cfg.model, cfg.algo, cfg.seed)
    ckpt = torch.load(trained_run / "checkpoint.pt", weights_only=True)
    policies.load_adapter_state(ckpt["adapters"])
    base_logits = logits(base_model(tiny_model_dir))
    for i, name in enumerate(("aux", "main")):
        loaded = PeftModel.from_pretrained(base_model(manifest["agents"][i]["base_model"]), agents / name).eval()
        expected = agent_logits(policies, i)
        assert expected.dtype == torch.float64
        assert (expected - base_logits).abs().max() > 1e-4, "the adapter should have moved in training"
        assert_close_to_scale(logits(loaded), expected, FLOAT64_REL, f"{name} logits")


@pytest.mark.numerics
def test_export_round_trip_per_agent_and_shared(tiny_model_dir, tmp_path):
    """The exported adapters on their base (peft) vs the policies: logits, float64, to
    FLOAT64_REL of the largest logit; loaded back into other policies: the same weights, bitwise."""
    from peft import PeftModel

    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path))
    for adapters in ("per_agent", "shared"):
        run_dir = tmp_path / adapters
        run_dir.mkdir()
        # random LoRA B: the adapters matter
        policies = make_policies(tiny_model_dir, adapters=adapters, dtype="float64")
        agents = export_agents(run_dir, cfg, policies, step=7)
        manifest = read_manifest(agents)
        dirs = ["aux", "main"] if adapters == "per_agent" else ["shared", "shared"]
        assert [a["dir"] for a in manifest["agents"]] == dirs and manifest["step"] == 7
        assert sorted(p.name for p in agents.iterdir()) == sorted({*dirs, MANIFEST})
        for i, a in enumerate(manifest["agents"]):
            loaded = PeftModel.from_pretrained(base_model(a["base_model"]), agents / a["dir"]).eval()
            expected = agent_logits(policies, i)
            assert expected.dtype == torch.float64
            assert_close_to_scale(logits(loaded), expected, FLOAT64_REL, f"{a['name']} logits")
        # And back: another team (other random adapters) loads the export exactly.
        other = make_policies(tiny_model_dir, adapters=adapters, seed=1, dtype="float64")
        load_agents(other, agents, manifest, ["aux", "main"])
        want, got = policies.adapter_state(), other.adapter_state()
        assert want.keys() == got.keys() and all(torch.equal(want[k][n], got[k][n]) for k in want for n in want[k])


def test_exported_files_follow_the_umask(tiny_model_dir, tmp_path):
    """safetensors writes 0600 and mkdtemp makes 0700: the export gives every file and dir the
    modes the umask asks for (here group-writable, as a shared project dir has it)."""
    cfg = compose_config(tiny_overrides(tiny_model_dir, tmp_path))
    old = os.umask(0o002)
    try:
        agents = export_agents(tmp_path, cfg, make_policies(tiny_model_dir), step=1)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in [agents, *agents.rglob("*")]}
    assert "agents/aux/adapter_model.safetensors" in modes
    assert {m for p, m in modes.items() if (tmp_path / p).is_file()} == {0o664}
    assert {m for p, m in modes.items() if (tmp_path / p).is_dir()} == {0o775}


@pytest.mark.numerics
def test_full_fine_tune_exports_whole_models_and_replaces_an_earlier_export(tiny_model_dir, tmp_path):
    """Exported whole models vs the fully fine-tuned policies, and policies loaded back from the
    export vs the originals: logits, float64 (model.dtype=float64), to FLOAT64_REL of the largest
    logit; only the changed policy differs from the base, by far more."""
    from transformers import AutoTokenizer

    cfg = compose_config([o for o in tiny_overrides(tiny_model_dir, tmp_path) if not o.startswith("algo.lora")]
                         + ["algo.lora=null", "model.dtype=float64"])
    policies = AgentPolicies(("aux", "main"), cfg.model, cfg.algo, cfg.seed)
    with torch.no_grad():  # make agent aux's model its own
        policies.models[0].get_input_embeddings().weight.mul_(1.5)
    export_agents(tmp_path, cfg, policies, step=1)
    agents = export_agents(tmp_path, cfg, policies, step=2)  # replaces the first export
    manifest = read_manifest(agents)
    assert manifest["kind"] == "full" and manifest["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".agents", "agents"))) == ["agents"]
    base_logits = logits(base_model(tiny_model_dir))
    for i, name in enumerate(("aux", "main")):
        loaded = base_model(agents / name).eval()
        expected = agent_logits(policies, i)
        assert expected.dtype == torch.float64
        assert_close_to_scale(logits(loaded), expected, FLOAT64_REL, f"{name} logits")
        assert ((expected - base_logits).abs().max() > 1e-3) == (name == "aux")
        assert AutoTokenizer.from_pretrained(agents / name).eos_token is not None
    other = AgentPolicies(("aux", "main"), cfg.model, cfg.algo, cfg.seed)
    load_agents(other, agents, manifest, ["aux", "main"])
    assert_close_to_scale(agent_logits(other, 0), agent_logits(policies, 0), FLOAT64_REL, "reloaded logits")


@pytest.mark.numerics
def test_checkpoint_weights_load_into_another_tasks_agents_by_position(tiny_model_dir):
    """Another team's agents loaded from a checkpoint by position vs the trained agents: logits,
    float64, to FLOAT64_REL of the largest logit."""
    trained = make_policies(tiny_model_dir, dtype="float64")  # aux, main
    team = make_policies(tiny_model_dir, agents=("tool", "plan"), seed=3, dtype="float64")
    ckpt = {"path": "checkpoint.pt", "weights": "lora", "adapters": trained.adapter_state()}
    eval_cli.load_checkpoint_weights(team, ckpt, ["aux", "main"])
    for i in range(2):
        assert_close_to_scale(agent_logits(team, i), agent_logits(trained, i), FLOAT64_REL, f"agent {i} logits")
    with pytest.raises(UserError, match="holds full models but this config builds LoRA adapters"):
        eval_cli.load_checkpoint_weights(team, {**ckpt, "weights": "full"}, ["aux", "main"])


def evals(run_dir) -> set:
    return set((run_dir / "evals").iterdir()) if (run_dir / "evals").exists() else set()


def test_marl_llm_eval_on_another_task_writes_its_own_dir_and_leaves_the_run_alone(trained_run):
    before, evals_before = files_state(trained_run), evals(trained_run)
    proc = subprocess.run([str(VENV_BIN / "marl-llm-eval"), str(trained_run), "task=coophumaneval",
                           "trainer.eval_max_problems=1", "trainer.threads=1"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert files_state(trained_run) == before  # checkpoint, config.yaml, logs, agents: same bytes and mtimes
    (out,) = evals(trained_run) - evals_before
    result = json.loads((out / "metrics.json").read_text())
    assert result["task"] == "coophumaneval" and result["eval_problems"] == 1
    assert result["weights"]["source"] == "agents" and result["weights"]["step"] == 1
    assert result["overrides"] == ["task=coophumaneval", "trainer.eval_max_problems=1", "trainer.threads=1"]
    # trainer.threads holds for the evaluation as for a run (it took every core before).
    assert result["threads"] == {"setting": 1, "start": 1, "end": 1} and "torch threads: 1\n" in proc.stdout
    assert "pass@1" in result["metrics"] and f"metrics: {out / 'metrics.json'}" in proc.stdout
    assert OmegaConf.load(out / "config.yaml").task.name == "coophumaneval"
    assert len((out / "samples.jsonl").read_text().splitlines()) == 1


def test_eval_from_checkpoint_equals_eval_from_agents(trained_run, tmp_path, capsys):
    results = []
    for weights in ("checkpoint", "agents"):
        out = tmp_path / weights
        eval_cli.main([str(trained_run), "--weights", weights, "--split", "train", "--out", str(out),
                       "trainer.eval_max_problems=2", f"model.device={TEST_DEVICE}"])
        results.append(json.loads((out / "metrics.json").read_text()))
    assert [r["weights"]["source"] for r in results] == ["checkpoint", "agents"]
    assert results[0]["data"]["eval_split"] == results[0]["data"]["train_split"] == "test[33:37]"
    assert results[0]["metrics"] == results[1]["metrics"]
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("case, args, message", [
    ("missing", [], "no such run directory"),
    ("untrained", [], "holds no trained agents"),
    ("untrained", ["--weights", "agents"], "--weights checkpoint"),
    ("run", ["algo=at_grpo"], "evaluates the run's own agents"),
    ("run", ["trainer.eval_max_problem=3"], "Did you mean trainer.eval_max_problems?"),
    ("run", ["trainer.eval_max_problems=many"], "could not be converted"),
    ("run", ["task=nosuch"], "choose one of"),
])
def test_bad_input_is_one_error_line(trained_run, tmp_path, capsys, case, args, message):
    run_dir = {"missing": tmp_path / "nope", "untrained": tmp_path / "untrained", "run": trained_run}[case]
    if case == "untrained":
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text((trained_run / "config.yaml").read_text())
    before, evals_before = files_state(trained_run), evals(trained_run)
    with pytest.raises(SystemExit) as stop:
        eval_cli.main([str(run_dir), *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert files_state(trained_run) == before and evals(trained_run) == evals_before
    if case == "untrained":
        assert os.listdir(run_dir) == ["config.yaml"]


def test_a_history_of_the_agents_keeps_the_newest_and_evaluates_by_step(tiny_model_dir, tmp_path, capsys):
    """trainer.history_every=1, history_keep=2 over 3 steps: checkpoint-2 and checkpoint-3 are kept
    (checkpoint-1 removed), each the agents of its step; marl-llm-eval --step picks one."""
    from safetensors.torch import load_file

    from marl_llm.training.trainer import train

    run_dir = tmp_path / "run"
    train(compose_config(tiny_overrides(tiny_model_dir, run_dir, "trainer.max_steps=3", "trainer.history_every=1",
                                        "trainer.history_keep=2", "algo.baseline=raw", "algo.learning_rate=0.05",
                                        "trainer.eval_before=false", "trainer.eval_after=false")))
    history = run_dir / "checkpoints"
    assert sorted(p.name for p in history.iterdir()) == ["checkpoint-2", "checkpoint-3"]  # no temp dirs either
    assert [read_manifest(history / f"checkpoint-{s}")["step"] for s in (2, 3)] == [2, 3]
    weights = {s: load_file(history / f"checkpoint-{s}" / "aux" / "adapter_model.safetensors") for s in (2, 3)}
    final = load_file(run_dir / "agents" / "aux" / "adapter_model.safetensors")
    assert any(not torch.equal(weights[2][k], weights[3][k]) for k in weights[3])  # step 3 trained on from step 2
    assert all(torch.equal(weights[3][k], final[k]) for k in final)  # the last one is the final export
    assert "agents of step 2 kept as" in capsys.readouterr().out
    # The tokenizer is on the disk once for the whole history (checkpoint-1's removal left its links
    # whole), each policy dir still a complete one; agents/ has copies of its own, for users to take.
    tokenizers = [history / f"checkpoint-{s}" / agent / "tokenizer.json" for s in (2, 3) for agent in ("aux", "main")]
    assert len({(p.stat().st_dev, p.stat().st_ino) for p in tokenizers}) == 1
    assert not any((run_dir / "agents" / agent / "tokenizer.json").samefile(tokenizers[0]) for agent in ("aux", "main"))
    assert not (run_dir / "agents" / "aux" / "tokenizer.json").samefile(run_dir / "agents" / "main" / "tokenizer.json")
    final_files = sorted(p.name for p in (run_dir / "agents" / "main").iterdir()
                         if p.name.startswith(("tokenizer", "chat_template")))
    assert filecmp.cmpfiles(history / "checkpoint-3" / "main", run_dir / "agents" / "main", final_files,
                            shallow=False)[0] == final_files
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(history / "checkpoint-3" / "main").chat_template  # with every file it needs

    out = tmp_path / "eval2"
    eval_cli.main([str(run_dir), "--step", "2", "--out", str(out), "trainer.eval_max_problems=1",
                   f"model.device={TEST_DEVICE}"])
    result = json.loads((out / "metrics.json").read_text())
    assert result["weights"]["step"] == 2 and result["weights"]["path"].endswith("checkpoints/checkpoint-2")
    for args, message in ((["--step", "1"], "has no agents of step 1 (it has the agents of steps 2, 3)"),
                          (["--step", "3", "--weights", "checkpoint"], "drop --weights checkpoint")):
        with pytest.raises(SystemExit):
            eval_cli.main([str(run_dir), *args, "--out", str(tmp_path / "bad")])
        assert message in capsys.readouterr().err and not (tmp_path / "bad").exists()
