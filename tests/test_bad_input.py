"""Bad input gets one line that names the fix (exit code 2), never a traceback or a minute of retries."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import IMPORT_TIMES, REPO, VENV_BIN, compose_config, imported_modules

CLI = str(VENV_BIN / "marl-llm")


def run_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run([CLI, *args], cwd=cwd, capture_output=True, text=True, env=full_env, timeout=timeout)


def one_error_line(out: subprocess.CompletedProcess) -> str:
    """The run stopped with exit code 2 and exactly one line on stderr, `error: ...`."""
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    return lines[0]


def closed_port_url() -> str:
    """http://127.0.0.1:<a port nothing listens on>: a server that refuses at once, no network touched."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------------------------ 1. seed
def test_a_negative_seed_is_refused_before_anything_loads(tmp_path):
    line = one_error_line(run_cli(["logger=none", "seed=-1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path))
    assert "seed" in line and "[0, 2**32-1]" in line


@pytest.mark.parametrize("seed,ok", [(0, True), (2**32 - 1, True), (2**32, False), (-1, False)])
def test_seed_range_is_numpys(seed, ok):
    from marl_llm.config import UserError
    from marl_llm.configure import validate

    cfg = compose_config([f"seed={seed}", "run_dir=/tmp/x"])
    if ok:
        validate(cfg)
    else:
        with pytest.raises(UserError, match=r"seed: .*must be in \[0, 2\*\*32-1\]"):
            validate(cfg)


# --------------------------------------------------------------------- 2. and 6. model.path
def test_a_dir_that_is_not_a_model_names_what_is_missing(tmp_path):
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "README.txt").write_text("not weights")
    line = one_error_line(run_cli(["logger=none", "model=local", f"model.path={not_a_model}",
                                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, {"HF_HUB_OFFLINE": "1"}))
    assert "is not a Hugging Face checkpoint directory" in line
    assert "no config.json and no tokenizer files" in line and "model=smollm2_135m" in line


def test_a_dir_with_a_config_but_no_tokenizer_names_the_tokenizer(tmp_path, tiny_model_dir):
    from marl_llm.config import UserError
    from marl_llm.models.loading import check_checkpoint_dir

    check_checkpoint_dir(str(tiny_model_dir), "model.path='tiny'")  # a real checkpoint passes
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(UserError, match="model.path='x' is not a Hugging Face checkpoint directory: it has no "
                                        r"tokenizer files \(tokenizer.json") as err:
        check_checkpoint_dir(str(tmp_path), "model.path='x'")
    assert "config.json and" not in str(err.value)


def test_a_relative_path_that_does_not_exist_is_not_a_hub_id(tmp_path):
    """Not of the hub's org/name form: a path, which does not exist (no minute of hub retries)."""
    start = time.monotonic()
    line = one_error_line(run_cli(["logger=none", "model=local", "model.path=data/models/qwen",
                                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                                  {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": closed_port_url()}))
    assert time.monotonic() - start < 60
    assert f"no such directory ({tmp_path / 'data' / 'models' / 'qwen'})" in line and "model.path=<dir" in line


@pytest.mark.parametrize("spec,hub", [("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("gpt2", True),
                                      ("Qwen/Qwen3-1.7B", True), ("./qwen", False), ("../models/qwen", False),
                                      ("/no/such/dir", False), ("~/no-such-model-dir", False),
                                      ("data/models/qwen", False), ("my model", False)])
def test_which_missing_specs_are_hub_ids(spec, hub):
    from omegaconf import OmegaConf

    from marl_llm.config import UserError
    from marl_llm.models.loading import _source

    cfg = OmegaConf.create(dict(path=spec, embedded=False, hub_id=None))
    if hub:
        assert _source(None, cfg)[:2] == (spec, False)
        assert _source(spec, cfg)[:2] == (spec, False)  # a model.agent_bases entry alike
    else:
        with pytest.raises(UserError, match=r"model.path=.*: no such directory"):
            _source(None, cfg)


def test_an_existing_dir_wins_over_the_hub_id_form(tmp_path, tiny_model_dir, monkeypatch):
    from omegaconf import OmegaConf

    from marl_llm.models.loading import _source

    (tmp_path / "org").mkdir()
    shutil.copytree(tiny_model_dir, tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert _source(None, OmegaConf.create(dict(path="org/tiny", embedded=False, hub_id=None)))[:2] == ("org/tiny", True)


def test_model_sources_are_refused_before_torch_is_imported(tmp_path):
    """model.path, model.agent_bases and model.hub_id are checked before the console script imports
    the trainer (models/sources.py, marl_llm/preflight.py): the same lines as loading the model
    gives, in a second instead of ~6 s of imports."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_text("not a directory")
    no_checkpoint = (" is not a Hugging Face checkpoint directory: it has no config.json and no tokenizer files "
                     "(tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt, spiece.model). "
                     "Point it at the directory that save_pretrained wrote the model and its tokenizer to, or use the "
                     "embedded default model (model=smollm2_135m)")
    hub = closed_port_url()
    cases = [
        (["model=local", f"model.path={tmp_path / 'empty'}"], f"model.path='{tmp_path / 'empty'}'{no_checkpoint}"),
        (["model=local", f"model.path={tmp_path / 'weights.bin'}"],
         f"model.path='{tmp_path / 'weights.bin'}' is a file: pass the directory of a Hugging Face checkpoint (the one "
         "with config.json), or use the embedded default model (model=smollm2_135m)"),
        (["model=local", "model.path=data/models/qwen"],
         f"model.path='data/models/qwen': no such directory ({tmp_path / 'data' / 'models' / 'qwen'}): pass "
         "model.path=<dir of a Hugging Face checkpoint> or model.hub_id=<org/name> for a hub model, or use the embedded "
         "default model (model=smollm2_135m)"),
        ([f"model.agent_bases=[{tmp_path / 'empty'}]"], f"model.agent_bases entry '{tmp_path / 'empty'}'{no_checkpoint}"),
        (["model.hub_id=nosuch/model", "model.embedded=false"],
         f"model 'nosuch/model' is not in the local Hugging Face cache and the hub is not reachable (127.0.0.1 is "
         f"unreachable ([Errno 111] Connection refused)): download it where the hub is reachable and pass "
         "model.path=<its local dir>, or use the embedded default model (model=smollm2_135m)"),
    ]
    env = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf"), **IMPORT_TIMES}
    for args, expected in cases:
        imported, out = imported_modules(run_cli(["logger=none", *args, f"hydra.run.dir={tmp_path / 'run'}"],
                                                 tmp_path, env))
        assert one_error_line(out) == f"error: {expected}", args
        assert "omegaconf" in imported and "torch" not in imported and "transformers" not in imported, args
        assert not (tmp_path / "run").exists(), args


def test_the_preflight_finds_a_hub_model_in_the_local_cache_with_no_hub(tmp_path, tiny_model_dir):
    """A hub id in the local HF cache passes the check before the run with the hub unreachable (the
    run then loads it from the cache: test_a_hub_model_in_the_local_cache_loads_with_no_hub); one
    that is not there is refused, naming the hub's reason."""
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    script = ("import sys\n"
              "from omegaconf import OmegaConf\n"
              "from marl_llm.config import UserError\n"
              "from marl_llm.models.sources import check_sources\n"
              "for hub_id in ('org/tiny', 'org/other'):\n"
              "    try:\n"
              "        check_sources(OmegaConf.create(dict(path=None, embedded=False, hub_id=hub_id, agent_bases=None)))\n"
              "        print(hub_id, 'passes')\n"
              "    except UserError as err:\n"
              "        print(hub_id, err)\n"
              "print('torch' in sys.modules)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "", "HF_ENDPOINT": closed_port_url(), "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    cached, other, torch_loaded = out.stdout.strip().splitlines()
    assert cached == "org/tiny passes" and torch_loaded == "False"
    assert other.startswith("org/other model 'org/other' is not in the local Hugging Face cache and the hub is not "
                            "reachable (127.0.0.1 is unreachable")


# ------------------------------------------------------------------------------ 3. run dir
def test_a_run_dir_under_a_file_is_refused_before_hydra_starts(tmp_path):
    (tmp_path / "taken").write_text("a file")
    line = one_error_line(run_cli(["logger=none", f"hydra.run.dir={tmp_path / 'taken' / 'run'}"], tmp_path))
    assert f"hydra.run.dir={tmp_path / 'taken' / 'run'} cannot be created" in line
    assert f"{tmp_path / 'taken'} is a file, not a directory" in line and "hydra.run.dir=<dir>" in line
    assert not (tmp_path / "outputs").exists()


def test_run_dir_check_covers_sweeps_read_only_dirs_and_the_default(tmp_path, monkeypatch):
    from marl_llm.cli.train import run_dir_check
    from marl_llm.config import UserError

    (tmp_path / "taken").write_text("a file")
    with pytest.raises(UserError, match="hydra.sweep.dir=.* is a file, not a directory"):
        run_dir_check(["-m", f"hydra.sweep.dir={tmp_path / 'taken' / 'sweep'}/${{now:%H}}"])
    run_dir_check(["--cfg", "job", f"hydra.run.dir={tmp_path / 'taken' / 'run'}"])  # prints only: no dir made
    run_dir_check([f"hydra.run.dir='{tmp_path / 'new' / 'run'}'"])  # a dir that does not exist yet is fine
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").write_text("a file where the default run dirs go")
    with pytest.raises(UserError, match=r"outputs is a file.*set hydra.run.dir=<dir you can write>"):
        run_dir_check([])


def test_a_run_dir_in_a_read_only_dir_is_refused():
    """Root writes anywhere: as root the script runs as nobody (setpriv), in a dir nobody can reach."""
    base = Path(tempfile.mkdtemp(prefix="marl-llm-ro-", dir="/tmp"))
    read_only = base / "read_only"
    read_only.mkdir()
    try:
        base.chmod(0o755)
        read_only.chmod(0o555)
        command = [CLI, "logger=none", f"hydra.run.dir={read_only / 'run'}"]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("root writes into read-only dirs, and setpriv is missing to run as another user")
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        out = subprocess.run(command, cwd=base, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HOME": str(base)})
        line = one_error_line(out)
        assert f"hydra.run.dir={read_only / 'run'} cannot be created ({read_only} is not writable)" in line
        assert not (read_only / "run").exists()
    finally:
        read_only.chmod(0o755)
        shutil.rmtree(base)


# -------------------------------------------------------------------- 4. agent_sampling keys
def test_a_misspelled_agent_in_agent_sampling_lists_the_agents(tmp_path):
    line = one_error_line(run_cli(["logger=none", "algo.agent_sampling={mian:{temperature:0.9}}",
                                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path))
    assert "algo.agent_sampling.mian" in line and "whose agents are aux, main" in line


@pytest.mark.parametrize("overrides", [["task=humaneval"], ["task=coophumaneval"], ["task=tldr"], ["task=arxiv"],
                                       ["task=sokoban"], ["task=plan_path", "task.roles=[plan]"], ["task=strbuild"],
                                       ["task=strbuild", "task.palettes=[[a],[b],[c]]"],
                                       ["task=tldr", "algo=single"]])
def test_validate_knows_the_agents_the_tasks_have(overrides):
    """The agent names validation knows before the task loads (Task.agents_for, and the algorithm
    schema's agents_for where the algorithm changes who plays) are the loaded task's own."""
    from marl_llm.algos import algorithm_class
    from marl_llm.cli.train import map_overrides
    from marl_llm.config import UserError
    from marl_llm.configure import validate
    from marl_llm.registry import SCHEMAS
    from marl_llm.tasks import build_task

    cfg = compose_config([*overrides, "run_dir=/tmp/x"])
    task = algorithm_class(cfg.algo.name).task_view(build_task(cfg.task), cfg.algo)
    task_agents = type(build_task(cfg.task)).agents_for(cfg.task)
    known = getattr(SCHEMAS["algo"][cfg.algo.name], "agents_for", lambda agents: agents)(task_agents)
    assert known == tuple(task.agent_names)
    for agent in task.agent_names:
        per_agent = f"algo.agent_sampling.{agent}.top_p=0.5"
        validate(compose_config(map_overrides([*overrides, "run_dir=/tmp/x", per_agent])))
    with pytest.raises(UserError, match=f"whose agents are {', '.join(task.agent_names)}"):
        validate(compose_config(map_overrides([*overrides, "run_dir=/tmp/x", "algo.agent_sampling.nobody.top_p=0.5"])))


def test_agent_policies_refuse_sampling_for_agents_the_task_lacks(tiny_model_dir):
    """Any task (also one config.validate does not know): refused before the model loads."""
    from omegaconf import OmegaConf

    from marl_llm.config import UserError
    from marl_llm.models.policies import AgentPolicies

    model_cfg = OmegaConf.create(dict(name="x", path="/no/such/dir", embedded=False, hub_id=None, dtype="auto",
                                      device="cpu", attn_implementation=None, trust_remote_code=False,
                                      agent_bases=None))
    algo_cfg = OmegaConf.create(dict(adapters="per_agent", policy_map={}, agent_sampling={"writer": {"top_p": 0.5}},
                                     lora=dict(r=4, alpha=8, dropout=0.0, target_modules=["q_proj"])))
    with pytest.raises(UserError, match=r"algo.agent_sampling names \['writer'\].*\['red', 'blue'\]"):
        AgentPolicies(("red", "blue"), model_cfg, algo_cfg, 0)


# ------------------------------------------------------------------------ 5. empty data file
def test_an_empty_data_file_says_so(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = one_error_line(run_cli(["logger=none", "task=tldr", "algo.num_turns=1",
                                   f"task.data.files={{train:{empty},test:{empty}}}",
                                   "task.data.train_split='train[:100]'", f"hydra.run.dir={tmp_path / 'run'}"],
                                  tmp_path, {"HF_HUB_OFFLINE": "1"}))
    assert f"task.data.train_split='train[:100]' selects no rows: data file '{empty}' (task.data.files.train) is " \
           "empty." in line
    assert "[0:0]" not in line and "point task.data.files.train at a file with rows" in line


def test_selecting_from_an_empty_split_never_suggests_an_empty_slice():
    from marl_llm.config import UserError
    from marl_llm.tasks.data import parse_split, select

    with pytest.raises(UserError, match="selects no rows: split 'train' of the hub dataset x is empty") as err:
        select([], parse_split("train[:100]"), "the hub dataset x", "task.data.train_split")
    assert "[0:0]" not in str(err.value)
    with pytest.raises(UserError, match=r"has only 10 rows: use e.g. train\[0:10\]"):  # start past the end: from 0
        select([{}] * 10, parse_split("train[50:100]"), "file f", "task.data.train_split")
    with pytest.raises(UserError, match=r"use e.g. train\[5:10\]"):
        select([{}] * 10, parse_split("train[5:100]"), "file f", "task.data.train_split")


# --------------------------------------------------------------------- 7. hub model offline
def load_base_with_no_hub(tmp_path, hub_id: str, body: str) -> str:
    """Run `body` in a fresh interpreter where `cfg` names `hub_id` and the hub refuses connections
    (no HF_HUB_OFFLINE, no network touched); its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=closed_port_url(), HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1")
    script = ("import time, torch\n"
              "from omegaconf import OmegaConf\n"
              "from marl_llm.config import UserError\n"
              "from marl_llm.models.loading import load_base\n"
              f"cfg = OmegaConf.create(dict(name='m', path=None, embedded=False, hub_id={hub_id!r},"
              " trust_remote_code=False, attn_implementation=None))\n" + body)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_hub_model_with_no_hub_fails_within_seconds(tmp_path):
    """The hub client alone would retry for about a minute; the probe answers in seconds, with the fix."""
    out = load_base_with_no_hub(tmp_path, "Qwen/Qwen3-1.7B", (
        "start = time.monotonic()\n"
        "try:\n"
        "    load_base(None, cfg, torch.device('cpu'), torch.float32)\n"
        "except UserError as err:\n"
        "    print(f'{time.monotonic() - start:.2f}', err)\n"))
    seconds, message = out.strip().split(" ", 1)
    assert float(seconds) < 10
    assert "'Qwen/Qwen3-1.7B' is not in the local Hugging Face cache and the hub is not reachable" in message
    assert "model.path=<its local dir>" in message and "model=smollm2_135m" in message


def test_a_hub_model_with_no_hub_via_the_cli_is_one_line(tmp_path):
    env = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": closed_port_url(), "HF_HOME": str(tmp_path / "hf")}
    start = time.monotonic()
    line = one_error_line(run_cli(["logger=none", "model=qwen3_1_7b", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                                  env))
    assert time.monotonic() - start < 45  # startup and task data included; the retries alone took ~55 s
    assert "not in the local Hugging Face cache" in line and "model.path=" in line


def test_a_hub_model_in_the_local_cache_loads_with_no_hub(tmp_path, tiny_model_dir):
    """The probe sends an unreachable hub to the local HF cache, where a downloaded model is found."""
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    out = load_base_with_no_hub(tmp_path, "org/tiny", (
        "model, tok = load_base(None, cfg, torch.device('cpu'), torch.float32)\n"
        "print(model.config.hidden_size, tok.padding_side)\n"))
    assert out.split() == ["32", "left"]


# ------------------------------------------------------------------- 8. lookalike characters
def test_curly_quotes_are_named_before_hydra_parses(tmp_path):
    line = one_error_line(run_cli(["logger.group=\u201cexp\u201d", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path))
    assert "'logger.group=\u201cexp\u201d' has '\u201c' (LEFT DOUBLE QUOTATION MARK) at position 14" in line
    assert "type the ASCII '\"' instead (logger.group=\"exp\")" in line


@pytest.mark.parametrize("args,expected", [
    (["seed=\uff11\uff12"], "'\uff11' (FULLWIDTH DIGIT ONE) at position 6, which Hydra cannot read: type the ASCII "
                            "'1' instead (seed=12)"),
    (["trainer.max_steps=2", "logger.group=\u2018exp\u2019"], "'\u2018' (LEFT SINGLE QUOTATION MARK) at position 14"),
    (["trainer.max_steps\uff1d3"], "'\uff1d' (FULLWIDTH EQUALS SIGN) at position 18"),
    (["\u2014cfg", "job"], "type the ASCII '--' instead (--cfg)"),
    (["logger.group='\u5b9f\u9a13\uff11'"], None),  # inside a quoted value: text, as Hydra reads it
    (["logger.group=\"say \u201chi\u201d\""], None),
    (["seed=12", "--cfg", "job"], None),
])
def test_lookalike_characters(args, expected):
    from marl_llm.cli.train import lookalike_error

    err = lookalike_error(args)
    if expected is None:
        assert err is None
    else:
        assert expected in err


# ------------------------------------------------------------------ 9. the README's quoting
def test_the_readmes_split_example_survives_the_shell():
    """The example, split as bash splits it, composes to the split it shows."""
    from marl_llm.cli.train import map_overrides

    readme = (REPO / "README.md").read_text()
    example = re.search(r"quote twice on the\s+command line: `([^`]+)`", readme).group(1)
    (arg,) = shlex.split(example)
    assert compose_config(["task=tldr", arg, "run_dir=/tmp/x"]).task.data.eval_split == "test[:8]"
    files = re.search(r"local files by split name: `([^`]+)`", readme).group(1)
    cfg = compose_config(map_overrides(["task=tldr", *shlex.split(files), "run_dir=/tmp/x"]))
    assert dict(cfg.task.data.files) == {"train": "/d/train.jsonl", "test": "/d/test.parquet"}


# ----------------------------------------------------------------------- 10. W&B unreachable
def test_an_unreachable_wandb_server_warns_within_seconds(tmp_path, monkeypatch, capsys):
    from marl_llm.runs.loggers import RunLogger

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", closed_port_url())
    cfg = compose_config(["logger=wandb", f"run_dir={tmp_path}"])
    start = time.monotonic()
    logger = RunLogger(cfg, tmp_path)
    assert time.monotonic() - start < 15  # wandb.init alone waited ~60-72 s
    assert logger.wandb is None
    err = capsys.readouterr().err
    assert "warning: W&B unavailable (ConnectionError: W&B server http://127.0.0.1:" in err
    assert "logger.mode=offline" in err and err.strip().count("\n") == 0
    logger.log("train", {"reward": 1.0}, 1)  # training goes on with the local files
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


# ---------------------------------------------------------------- 11. issue 32's list, one line each
@pytest.mark.parametrize("args,expected", [
    (["trainer.max_steps=0", "trainer.eval_before=false", "trainer.eval_after=false"],
     "trainer.max_steps=0 with trainer.eval_before=false and trainer.eval_after=false does nothing: train "
     "(trainer.max_steps >= 1) or evaluate (trainer.eval_after=true)"),
    (["task.sandbox.max_procs=0"], "task.sandbox.max_procs: 0 allows no process: every program would fail"),
    (["task.sandbox.max_output_bytes=0"], "task.sandbox.max_output_bytes: 0 keeps no output"),
    (["task.sandbox.max_output_bytes=-5"], "use >= 1 (default 65536)"),
    (["algo.sampling.temperature=0"], "algo.sampling.temperature: temperature=0 samples greedily, so the 4 "
                                      "completions of a group (algo.num_generations=4) are identical"),
    (["algo.num_generations=100000"], "more than 65,536 is refused: use a smaller algo.num_generations"),
    (["hydra.run.dir="], "hydra.run.dir= is empty: name a directory (hydra.run.dir=<dir>), or leave hydra.run.dir out"),
    (["algo=magrpo", "algo=at_grpo"], "algo is given twice (algo=magrpo, then algo=at_grpo): Hydra would silently "
                                      "use the last; keep one (to run both, sweep them: marl-llm -m algo=magrpo,at_grpo)"),
    (["+foo=bar"], "'+foo=bar' adds a key no part of marl-llm reads (foo)"),
    (["trainer.resume_allow_changes=[algo.lr]"], "trainer.resume_allow_changes names algo.lr, which is no config key"),
    (["algo=at_grpo", "algo.num_generations=8"], "Did you mean algo.num_branches? (AT-GRPO's K candidates per agent "
                                                 "and turn, what MAGRPO and TRL call num_generations)"),
    (["algo.loss_type=dapo"], "'dapo' is TRL's name for how the per-token loss is aggregated; here algo.loss_type is "
                              "the per-token surrogate (reinforce, ppo_clip) and the aggregation is "
                              "algo.loss_aggregation: use algo.loss_aggregation=token_mean"),
    (["algo.beta=0.04"], "Did you mean algo.kl_coef? (TRL's KL coefficient)"),
])
def test_issue_32_bad_values_get_one_line_naming_the_fix(tmp_path, args, expected):
    named = [] if any(a.startswith("hydra.run.dir=") for a in args) else [f"hydra.run.dir={tmp_path / 'run'}"]
    line = one_error_line(run_cli(["logger=none", *args, *named], tmp_path))
    assert expected in line
    assert not (tmp_path / "run" / ".marl-llm-run").exists()


def test_a_run_dir_name_too_long_or_with_unquoted_non_ascii_gets_one_line(tmp_path):
    long = tmp_path / ("x" * 300)
    line = one_error_line(run_cli(["logger=none", f"hydra.run.dir={long}"], tmp_path))
    assert "cannot be created: its name xxxxxxxxxxxxxxxxxxxxxxxx... is 300 bytes, more than the 255 this file system " \
           "allows; use a shorter name" in line
    line = one_error_line(run_cli(["logger=none", f"hydra.run.dir={tmp_path}/runé"], tmp_path))
    assert "has 'é' (LATIN SMALL LETTER E WITH ACUTE)" in line and "which Hydra reads only inside quotes" in line
    assert f"quote the value for Hydra, \"hydra.run.dir='{tmp_path}/runé'\"" in line


def test_max_new_tokens_beyond_the_models_context_gets_one_line(tmp_path, tiny_model_dir):
    line = one_error_line(run_cli(["logger=none", "model=local", f"model.path={tiny_model_dir}", "model.device=cpu",
                                   "algo.sampling.max_new_tokens=100000000", f"hydra.run.dir={tmp_path / 'run'}"],
                                  tmp_path))
    assert "algo.sampling.max_new_tokens=100000000 is more than" in line
    assert "can attend to (1024 positions, prompt included): set it below 1024" in line
    assert not (tmp_path / "run" / ".marl-llm-run").exists()  # refused after the claim: given back


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("make,expected", [
    (lambda d: d, "is a directory: name the file in it (one of .jsonl, .jsonl.gz, .json, .parquet)"),
    (lambda d: write_jsonl(d / "n.jsonl", [{"prompt": 12345}]), "row 0 has prompt=12345 (int), but the task reads "
                                                                 "prompt as text: make it a string in the data"),
    (lambda d: write_jsonl(d / "e.jsonl", [{"prompt": "a post"}, {"prompt": "  "}]), "row 1 has an empty prompt: fill it "
                                                                                    "or drop the row"),
    (lambda d: (d / "u.jsonl").write_bytes('{"prompt": "x"}\n'.encode("utf-16-le")) and d / "u.jsonl",
     "holds NUL bytes: it looks like UTF-16 without a byte order mark; save it as UTF-8"),
])
def test_bad_data_files_get_one_line(tmp_path, make, expected):
    data = tmp_path / "data"
    data.mkdir()
    path = make(data)
    line = one_error_line(run_cli(["logger=none", "task=tldr", "algo.num_turns=1", "task.data.source=files",
                                   f"task.data.files={{train:{path},test:{path}}}", f"hydra.run.dir={tmp_path / 'run'}"],
                                  tmp_path, {"HF_HUB_OFFLINE": "1"}))
    assert expected in line


def test_data_files_with_a_byte_order_mark_are_read(tmp_path):
    """UTF-8 with a BOM (Windows editors) and UTF-16 with its BOM ("Unicode") read as their text."""
    import codecs

    from marl_llm.tasks.data import read_file

    rows = [{"prompt": "caf\u00e9"}]
    text = json.dumps(rows[0], ensure_ascii=False) + "\n"
    (tmp_path / "a.jsonl").write_bytes(codecs.BOM_UTF8 + text.encode("utf-8"))
    (tmp_path / "b.jsonl").write_bytes(text.encode("utf-16"))
    (tmp_path / "c.json").write_bytes(json.dumps(rows).encode("utf-16"))
    for name in ("a.jsonl", "b.jsonl", "c.json"):
        assert read_file(tmp_path / name) == rows


@pytest.mark.slow
def test_a_team_reward_that_raises_is_one_line(tmp_path, tiny_model_dir):
    (tmp_path / "my_team.py").write_text(
        "def prompts(row):\n    return ['Say a.', 'Say b.']\n\n"
        "def reward(row, texts):\n    return 1 / 0\n")
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"k": 1}, {"k": 2}])
    line = one_error_line(run_cli(["logger=none", "task=team", "algo.num_turns=1", "task.agents=[a,b]", "task.prompts=my_team:prompts",
                                   "task.reward=my_team:reward", f"task.data.files.train={rows}",
                                   "trainer.eval_before=false", "trainer.eval_after=false", "model=local",
                                   f"model.path={tiny_model_dir}", "model.device=cpu", "algo.num_generations=2",
                                   "algo.sampling.max_new_tokens=4", "algo.lora.r=4", "trainer.max_steps=1",
                                   f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                                  {"PYTHONPATH": str(tmp_path), "PYTHONWARNINGS": "ignore"}))
    assert "task.reward=my_team:reward raised ZeroDivisionError: division by zero on " in line
    assert "at my_team.py:5 in reward: fix the function" in line


def test_ranks_sharing_a_stderr_pipe_never_run_their_error_lines_together():
    """Two processes writing error lines to one pipe, unbuffered as torchrun's and srun's ranks run
    (PYTHONUNBUFFERED): each line arrives whole. print() wrote the text and its newline apart, and
    CI saw `...one)error: ...` on one line from two ranks."""
    writer = ("from marl_llm.config import print_stderr_line\n"
              "for _ in range(3000): print_stderr_line('error: ' + 'x' * 300)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    both = (f"{shlex.quote(sys.executable)} -c {shlex.quote(writer)} & "
            f"{shlex.quote(sys.executable)} -c {shlex.quote(writer)}; wait")
    out = subprocess.run(["bash", "-c", both], capture_output=True, text=True, env=env, timeout=120)
    lines = out.stderr.splitlines()
    assert len(lines) == 6000 and all(line == "error: " + "x" * 300 for line in lines)
