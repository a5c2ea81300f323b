"""Issue 42, items 6-9 ("every mistake named"), as attack classes with variants: each mistake gets one
line that names the fix and a non-zero exit (2 for bad input), never a traceback, silence or exit 0;
a command refused before its run started leaves no run dir it made; plugins never load from a
`.dist-info` in the current directory. Where a variant depends on who runs it, it runs as root and as
an ordinary user (nobody, through setpriv)."""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import VENV_BIN, compose_config, pythonpath, torchrun
from test_bad_input import one_error_line, run_cli

TESTS = Path(__file__).resolve().parent
PYTHON = str(VENV_BIN / "python")


def as_nobody(command: list[str]) -> list[str]:
    """`command` run as the user nobody when this is root (root reads and writes anywhere)."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to run as an ordinary user")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]


def world_dir(prefix: str) -> Path:
    """A fresh dir under /tmp that the user nobody can enter and write (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o777)
    return d


# ============================================================== 6. a group option that no config provides
class TestMisspeltGroupOption:
    """An `optional` group (experiment, sweep, local) skipped a misspelt option silently and trained the
    default config with exit 0; the other groups printed Hydra's multi-line listing."""

    def test_a_misspelt_preset_is_one_line_and_makes_no_dir(self, tmp_path):
        line = one_error_line(run_cli(["experiment=magrpo_humaneval_papr"], tmp_path, timeout=120))  # it trained
        assert "experiment=magrpo_humaneval_papr is no experiment option: did you mean " \
               "experiment=magrpo_humaneval_paper" in line
        assert not (tmp_path / "outputs").exists()

    @pytest.mark.parametrize("args,expected", [
        (["sweep=magrpo_codin"], "sweep=magrpo_codin is no sweep option: did you mean sweep=magrpo_coding"),
        (["local=mine"], "local=mine is no local option: there is none to pick; copy local/default.example.yaml to "
                         "local/mine.yaml in "),
        (["debug=tiyn"], "debug=tiyn is no debug option: did you mean debug=tiny?"),
        (["algo=magrp"], "algo=magrp is no algo option: did you mean algo=magrpo"),
        (["trainer=big"], "trainer=big is no trainer option: the options are default, gpu"),
        (["logger=nonee"], "did you mean logger=none?"),
        (["experiment=zzzz"], "experiment=zzzz is no experiment option: no option is close; all "),
        (["-m", "experiment=magrpo_tldr_paper,magrpo_tldr_papr"],
         "experiment=magrpo_tldr_paper,magrpo_tldr_papr names experiment=magrpo_tldr_papr, which is no experiment "
         "option: did you mean experiment=magrpo_tldr_paper"),
        (["-m", "sweep=choice(magrpo_coding,magrpo_writng)"], "did you mean sweep=magrpo_writing"),
        (["+experiment=magrpo_tldr_papr"], "did you mean experiment=magrpo_tldr_paper"),
        (["seed=1", "experiment=magrpo_tldr_papr", "--cfg", "job"], "did you mean experiment=magrpo_tldr_paper"),
    ])
    def test_every_group_names_the_closest_options(self, args, expected):
        from marl_llm.configure import group_choice_error, register_configs

        register_configs()
        assert expected in (group_choice_error(args) or "")

    @pytest.mark.parametrize("args", [[], ["experiment=magrpo_tldr_paper"], ["experiment=null"], ["~experiment"],
                                      ["-m", "sweep=magrpo_coding", "seed=0,1"], ["seed=3", "algo.num_turns=1"],
                                      ["algo=magrpo_schema"], ["-cn", "another", "experiment=whatever"]])
    def test_what_exists_or_is_left_unset_passes(self, args):
        from marl_llm.configure import group_choice_error, register_configs

        register_configs()
        assert group_choice_error(args) is None

    def test_an_option_on_a_plugins_search_path_or_config_dir_counts(self, tmp_path):
        from marl_llm.configure import group_choice_error, register_configs

        register_configs()
        (tmp_path / "experiment").mkdir()
        (tmp_path / "experiment" / "my_preset.yaml").write_text("# @package _global_\nseed: 7\n")
        on_path = f"hydra.searchpath=['file://{tmp_path}']"
        assert group_choice_error([on_path, "experiment=my_preset"]) is None
        assert group_choice_error(["-cd", str(tmp_path), "experiment=my_preset"]) is None
        assert "did you mean experiment=my_preset?" in group_choice_error([on_path, "experiment=my_prest"])
        assert "did you mean" not in (group_choice_error(["experiment=my_preset"]) or "did you mean")

    def test_the_python_api_and_the_plan_refuse_it_too(self, capsys):
        from marl_llm.cli import plan
        from marl_llm.config import UserError

        with pytest.raises(UserError, match="did you mean experiment=magrpo_humaneval_paper"):
            compose_config(["experiment=magrpo_humaneval_papr"])
        with pytest.raises(SystemExit) as stop:
            plan.main(["experiment=magrpo_humaneval_papr"])
        assert stop.value.code == 2 and "did you mean experiment=magrpo_humaneval_paper" in capsys.readouterr().err


# ===================================================== 7. what the user's environment does to the run
def env_task(*overrides: str):
    from marl_llm.tasks.base import build_task

    return build_task(compose_config(["task=env", "task.env=guess_env:Guess", "run_dir=/tmp/x", *overrides]).task)


# sys.exit() is SystemExit(None), or SystemExit(0) where wandb's exit hook has replaced sys.exit (a run
# with logger=wandb, and this process once a test has started W&B).
EXITS = {"sys.exit()": r"SystemExit\((None|0)\)", "exit(3)": r"SystemExit\(3\)",
         "raise SystemExit('bye')": r"SystemExit\('bye'\)"}


def exiting(code: str):
    def method(*args, **kwargs):
        exec(code, {"sys": sys})
    return method


class TestEnvironmentEscapes:
    """task=env: an exit() in the environment's code ended the run with exit code 0, no metrics and no
    line; a 20 MiB observation decoded for minutes."""

    @pytest.mark.parametrize("code", EXITS)
    def test_an_exit_in_any_method_is_one_line_naming_it(self, code):
        from marl_llm.config import UserError
        from marl_llm.tasks.base import Turn
        from marl_llm.tasks.env import _Call

        task = env_task()
        problem = task.load_split("train")[0]
        history = [[[Turn("p", "4")], [Turn("p", "5")]]]
        env = task.make()
        cases = {"reset": lambda: task._call(_Call(type("E", (), {"reset": exiting(code)})(), "reset", 7), 7),
                 "step": lambda: (setattr(task, "make", lambda: type("E", (), {"reset": lambda s, seed: ["a", "b"],
                                                                              "step": exiting(code)})()),
                                  task.history_rewards([problem], history)),
                 "constructor": lambda: (setattr(task, "factory", exiting(code)), type(task).make(task)),
                 "deepcopy": lambda: (setattr(type(env), "__deepcopy__", exiting(code)), task._fork(env, 3))}
        expected = {"reset": r"E.reset\(seed=7\) raised ",
                    "step": r"E.step\(\) at turn 1 of the episode of seed 0 raised ",
                    "constructor": r"creating it with task.env_kwargs=\{\} raised ",
                    "deepcopy": r"copy.deepcopy of Guess \(seed 3\) raised "}
        try:
            for method, call in cases.items():
                with pytest.raises(UserError, match=rf"task.env=guess_env:Guess: {expected[method]}{EXITS[code]}") as err:
                    call()
                assert "it called exit() or sys.exit()" in str(err.value) and "\n" not in str(err.value)
                # the line of the code that exited (here: exiting()), relative to the current directory
                assert f"at {os.path.relpath(__file__)}:" in str(err.value)
        finally:
            if "__deepcopy__" in vars(type(env)):
                delattr(type(env), "__deepcopy__")

    def test_ctrl_c_in_the_environment_is_still_the_runs_interruption(self):
        from marl_llm.tasks.base import Turn

        task = env_task()
        problem = task.load_split("train")[0]

        def pressed(self, actions):
            raise KeyboardInterrupt
        task.make = lambda: type("E", (), {"reset": lambda s, seed: ["a", "b"], "step": pressed})()
        with pytest.raises(KeyboardInterrupt):
            task.history_rewards([problem], [[[Turn("p", "4")], [Turn("p", "5")]]])

    def test_a_huge_observation_fails_fast_naming_the_method_agent_and_limit(self):
        from marl_llm.config import UserError
        from marl_llm.tasks.base import Turn

        start = time.monotonic()
        huge = (r"task.env=guess_env:Guess: Guess.reset\(seed=0\) \(.*guess_env.py:\d+\) in the dry run before "
                r"training returned a 20,971,520-character observation for agent guesser, more than "
                r"task.max_observation_chars=1,000,000: return a shorter prompt .* or raise task.max_observation_chars")
        with pytest.raises(UserError, match=huge):
            env_task("task.env_kwargs.mode=huge_reset")  # the dry run at build, before any model loads
        with pytest.raises(UserError, match=r"Guess.step\(\) .* in the dry run before training, with placeholder "
                                            r"actions, returned a 20,971,520-character observation for agent helper"):
            env_task("task.env_kwargs.mode=huge_step")
        task = env_task("task.env_kwargs.mode=late_huge_step")  # during training: the same line
        with pytest.raises(UserError, match=r"Guess.step\(\) \(.*guess_env.py:\d+\) at turn 1 of the episode of seed 0 "
                                            r"returned a 20,971,520-character observation for agent helper"):
            task.history_rewards(task.load_split("train")[:1], [[[Turn("p", "4")], [Turn("p", "5")]]])
        assert time.monotonic() - start < 30

    def test_the_limit_is_a_setting(self):
        from marl_llm.config import UserError
        from marl_llm.configure import validate

        with pytest.raises(UserError, match=r"returned a \d\d-character observation for agent guesser, more than "
                                            r"task.max_observation_chars=30"):
            env_task("task.max_observation_chars=30")
        assert env_task("task.max_observation_chars=1000").agent_names == ("guesser", "helper")
        with pytest.raises(UserError, match="task.max_observation_chars: must be >= 1"):
            validate(compose_config(["task=env", "task.env=guess_env:Guess", "run_dir=/tmp/x",
                                     "task.max_observation_chars=0"]))

    def test_through_the_console_script_before_models_load(self, tmp_path):
        env = {"PYTHONPATH": pythonpath(TESTS)}
        for mode, expected in (("reset_exits", "task.env=guess_env:Guess: Guess.reset(seed=0) in the dry run before "
                                               "training raised SystemExit(0) (it called exit() or sys.exit()"),
                               ("huge_reset", "in the dry run before training returned a 20,971,520-character "
                                              "observation for agent guesser, more than "
                                              "task.max_observation_chars=1,000,000")):
            out = run_cli(["task=env", "task.env=guess_env:Guess", f"task.env_kwargs.mode={mode}", "logger=none",
                           f"hydra.run.dir={tmp_path / mode}"], tmp_path, env, timeout=120)
            assert expected in one_error_line(out)
            assert not (tmp_path / mode).exists()  # refused before the run started: its dir is taken back

    def test_an_exit_in_step_during_training_is_one_line_and_the_run_dir_stays(self, tmp_path, tiny_model_dir):
        """The issue's case: sys.exit(0) in step(). The run had started (its marker, config.yaml): its dir
        is kept as it is."""
        from test_env_task import tiny

        run_dir = tmp_path / "run"
        # late_: it exits on a model's text, not on the dry run's placeholders
        out = run_cli(["algo=magrpo", "task.env_kwargs.mode=late_step_exits",
                       *tiny(tiny_model_dir, run_dir, "algo.num_generations=2", "trainer.eval_before=false")],
                      tmp_path, {"PYTHONPATH": pythonpath(TESTS)})
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        line = out.stderr.strip().splitlines()[-1]
        assert line.startswith("error: task.env=guess_env:Guess: Guess.step() at turn 1 of the episode of seed ")
        assert "raised SystemExit(0) (it called exit() or sys.exit()" in line and "guess_env.py:" in line
        assert {".marl-llm-run", "config.yaml", ".hydra", "cli.log"} <= {p.name for p in run_dir.iterdir()}


# =========================================== 8. plugins from a `.dist-info` in the current directory
def plant(where: Path, marker: Path) -> Path:
    """A distribution `evil` in `where` (what a download or a checkout may hold) that declares a
    marl_llm.plugins entry point whose module writes `marker` when imported."""
    dist = where / "evil-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[marl_llm.plugins]\nevil = evil_plugin\n")
    (where / "evil_plugin.py").write_text(f"open({str(marker)!r}, 'w').write('loaded')\n")
    return dist


LOAD = "from marl_llm.plugins import load_plugins; load_plugins(); print('plugins loaded')"


class TestPluginsFromTheCurrentDirectory:
    """`python -m marl_llm` (and `torchrun -m marl_llm`, the multi-GPU launch) put the current directory
    on sys.path, and importlib.metadata read entry points from a .dist-info there."""

    def check_skipped(self, out: subprocess.CompletedProcess, marker: Path, dist: Path) -> None:
        assert out.returncode == 0, out.stderr[-3000:]
        assert not marker.exists(), "the plugin in the current directory was loaded"
        warning = [line for line in out.stderr.splitlines() if "marl_llm.plugins entry point" in line]
        assert len(warning) == 1 and f"evil = evil_plugin that evil declares in the current directory ({dist})" in \
            warning[0] and "plugins=[evil_plugin]" in warning[0], out.stderr[-3000:]

    def test_python_m_as_root(self, tmp_path):
        dist = plant(tmp_path / "cwd", tmp_path / "marker")
        out = subprocess.run([PYTHON, "-m", "marl_llm", "--cfg", "job"], cwd=tmp_path / "cwd", capture_output=True,
                             text=True, timeout=300)
        self.check_skipped(out, tmp_path / "marker", dist)

    def test_python_m_as_an_ordinary_user(self):
        base = world_dir("marl-llm-cwd-")
        try:
            dist = plant(base / "cwd", base / "marker")
            for p in [base / "cwd", dist, *dist.iterdir(), base / "cwd" / "evil_plugin.py"]:
                p.chmod(0o777 if p.is_dir() else 0o666)
            out = subprocess.run(as_nobody([PYTHON, "-m", "marl_llm", "--cfg", "job"]), cwd=base / "cwd",
                                 capture_output=True, text=True, timeout=300, env={**os.environ, "HOME": str(base)})
            self.check_skipped(out, base / "marker", dist)
        finally:
            shutil.rmtree(base)

    def test_torchrun_m(self, tmp_path):
        dist = plant(tmp_path / "cwd", tmp_path / "marker")
        out = subprocess.run(torchrun(1, "-m", "marl_llm", "--cfg", "job"), cwd=tmp_path / "cwd", capture_output=True,
                             text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.check_skipped(out, tmp_path / "marker", dist)

    def test_python_c_and_an_empty_pythonpath_element(self, tmp_path):
        """`python -c` puts '' (the current directory) on sys.path; so does an empty PYTHONPATH element
        (`PYTHONPATH=:/x`), for the console script too."""
        dist = plant(tmp_path / "cwd", tmp_path / "marker")
        out = subprocess.run([PYTHON, "-c", LOAD], cwd=tmp_path / "cwd", capture_output=True, text=True, timeout=300)
        self.check_skipped(out, tmp_path / "marker", dist)
        out = subprocess.run([str(VENV_BIN / "marl-llm"), "--cfg", "job"], cwd=tmp_path / "cwd", capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PYTHONPATH": ":" + pythonpath()})
        self.check_skipped(out, tmp_path / "marker", dist)

    def test_the_same_distribution_installed_on_pythonpath_loads(self, tmp_path):
        """The planted plugin is a working one: from a PYTHONPATH dir that is not the current one it
        loads (so the tests above show a refusal, not a broken plant)."""
        plant(tmp_path / "site", tmp_path / "marker")
        (tmp_path / "elsewhere").mkdir()
        out = subprocess.run([PYTHON, "-c", LOAD], cwd=tmp_path / "elsewhere", capture_output=True, text=True,
                             timeout=300, env={**os.environ, "PYTHONPATH": pythonpath(tmp_path / "site")})
        assert out.returncode == 0 and "plugins loaded" in out.stdout, out.stderr[-3000:]
        assert (tmp_path / "marker").read_text() == "loaded" and "warning" not in out.stderr


# ====================================================================== 9. one line each, not a traceback
class TestOneLineEach:
    def test_plan_with_a_model_path_that_does_not_exist(self, tmp_path):
        out = subprocess.run([str(VENV_BIN / "marl-llm-plan"), "model.path=/nonexistent"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
        assert "model.path='/nonexistent': no such directory (/nonexistent)" in one_error_line(out)

    @pytest.mark.parametrize("args,expected", [
        (["plan.gpus=0"], "invalid config value plan.gpus: 0 GPUs hold nothing: plan for >= 1 GPU"),
        (["plan.gpus=-2"], "invalid config value plan.gpus: -2 GPUs hold nothing"),
        (["plan.gpu_gib=-5"], "invalid config value plan.gpu_gib: -5.0 GiB per GPU holds nothing"),
        (["plan.gpu_gib=0"], "invalid config value plan.gpu_gib: 0.0 GiB per GPU holds nothing"),
        (["plan.gpus=banana"], "Error merging override plan.gpus=banana: Value 'banana' of type 'str' could not be "
                               "converted to Integer"),
        (["plan.gpu_gib=lots"], "Error merging override plan.gpu_gib=lots: Value 'lots' of type 'str' could not be "
                                "converted to Float"),
        (["model=local", "model.path=/"], "model.path='/' is not a Hugging Face checkpoint directory"),
        (["model.agent_bases=[/nonexistent/a,/nonexistent/b]"], "model.agent_bases entry '/nonexistent/a': no such "
                                                                "directory"),
        (["task=tldr", "task.data.train_split=train[:5000]"], "Hydra cannot read 'task.data.train_split=train[:5000]'"),
        (["algo=magrpo", "algo=at_grpo"], "algo is given twice"),
    ])
    def test_plan_bad_values(self, args, expected, capsys):
        from marl_llm.cli import plan

        with pytest.raises(SystemExit) as stop:
            plan.main(args)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "Traceback" not in err
        assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err

    def test_the_console_script_sweep_with_cfg_and_an_unquoted_split(self, tmp_path):
        line = one_error_line(run_cli(["-m", "seed=0,1", "--cfg", "hydra"], tmp_path))
        assert "--multirun and --cfg cannot be combined" in line and "marl-llm --cfg job seed=0" in line
        line = one_error_line(run_cli(["task=tldr", "task.data.train_split=train[:5000]"], tmp_path))
        assert "Hydra cannot read 'task.data.train_split=train[:5000]' (mismatched input '['" in line
        fix = line.rsplit(": ", 1)[1]
        assert fix == "'task.data.train_split=\"train[:5000]\"'"
        (arg,) = shlex.split(fix)  # the fix, as the shell passes it, is what Hydra reads as the split
        assert compose_config(["task=tldr", arg, "run_dir=/tmp/x"]).task.data.train_split == "train[:5000]"
        assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()

    @pytest.mark.parametrize("args,expected", [
        (["-m", "seed=0,1", "--cfg", "hydra"], "--multirun and --cfg cannot be combined"),
        (["--cfg=job", "--multirun"], "--cfg and --multirun cannot be combined"),
        (["-i", "searchpath", "-c", "job"], "--info and --cfg cannot be combined"),
        (["--cfg", "job", "seed=1"], None), (["-m", "seed=0,1"], None), (["--info", "searchpath"], None),
    ])
    def test_hydras_commands_one_at_a_time(self, args, expected):
        from marl_llm.cli.train import exclusive_flags_error

        err = exclusive_flags_error(args)
        assert (err is None) if expected is None else (expected in err)

    @pytest.mark.parametrize("arg,fix", [
        ("task.data.eval_split=test[:8]", "'task.data.eval_split=\"test[:8]\"'"),
        ("logger.group=exp(1)", "'logger.group=\"exp(1)\"'"),
        ("task.data.train_split=train[10:]", "'task.data.train_split=\"train[10:]\"'"),
        ("logger.group=it's \"mine\"", None),  # both quotes in the value: no quoting to suggest
    ])
    def test_overrides_hydra_cannot_read(self, arg, fix):
        from marl_llm.cli.train import grammar_error

        err = grammar_error(["logger=none", arg])
        assert err.startswith(f"Hydra cannot read {arg!r} (")
        assert err.endswith(fix) if fix else "the override grammar" in err
        assert grammar_error(["logger=none", shlex.split(fix)[0]] if fix else ["logger=none"]) is None

    def test_report_names_the_file_that_is_not_utf8_or_not_json(self, tmp_path, capsys):
        from marl_llm.report.cli import main

        def run(name: str, metrics: bytes = b'{"step": 1, "train/reward": 0.5}\n',
                summary: bytes = b'{"after": {"reward": 1.0}}') -> Path:
            d = tmp_path / name
            d.mkdir()
            (d / "config.yaml").write_text("task:\n  name: tldr\nalgo:\n  name: magrpo\nseed: 0\n")
            (d / "metrics.jsonl").write_bytes(metrics)
            (d / "summary.json").write_bytes(summary)
            return d

        bad = {run("latin1", metrics=b'{"step": 1, "train/reward": 0.5}\n{"step": 2, "note": "caf\xe9"}\n'):
               "metrics.jsonl line 2 is not UTF-8 text (byte 0xe9 at byte 25)",
               run("cut", summary=b'{"after": {"rew'): "summary.json is not valid JSON (Unterminated string",
               run("utf16", summary='{"after": {}}'.encode("utf-16")): "summary.json is not UTF-8 text (byte 0xff at "
                                                                       "byte 1)"}
        for d, expected in bad.items():
            assert main([str(d), "--out", str(tmp_path / "out")]) == 2
            err = capsys.readouterr().err
            assert f"skipping {d}: unreadable ({d}/{expected}" in err and "Traceback" not in err, err
            assert err.strip().splitlines()[-1].startswith("error: no readable finished runs under ") and \
                "1 skipped as unreadable" in err
        good = run("good")
        assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0  # the others are skipped, each named
        err = capsys.readouterr().err
        assert all(f"{d}/" in err for d in bad) and str(good) not in err


# ================================================= 9. no run dir left behind by a command that failed
class TestNoEmptyRunDirs:
    """A command refused after Hydra made its run dir (a value only validation sees, a model path that is
    no checkpoint) left the dir with Hydra's record and the job log: 16 of the issue's 26 mistakes."""

    def test_console_refusals_take_back_the_dirs_they_made(self, tmp_path):
        one_error_line(run_cli(["logger=none", "seed=-1"], tmp_path))  # Hydra's default dir, under the cwd
        assert not (tmp_path / "outputs").exists()
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "README.txt").write_text("not weights")
        new = tmp_path / "new" / "nested" / "run"
        line = one_error_line(run_cli(["logger=none", "model=local", f"model.path={tmp_path / 'notes'}",
                                       f"hydra.run.dir={new}"], tmp_path))  # refused after the dir was claimed
        assert "is not a Hugging Face checkpoint directory" in line and not (tmp_path / "new").exists()
        mine = tmp_path / "mine"
        mine.mkdir()
        one_error_line(run_cli(["logger=none", "seed=-1", f"hydra.run.dir={mine}"], tmp_path))
        assert mine.is_dir()  # made by the user, not this command: kept
        assert (tmp_path / "notes" / "README.txt").read_text() == "not weights"

    def test_as_an_ordinary_user(self):
        base = world_dir("marl-llm-rundir-")
        try:
            out = subprocess.run(as_nobody([str(VENV_BIN / "marl-llm"), "logger=none", "seed=-1"]), cwd=base,
                                 capture_output=True, text=True, timeout=300, env={**os.environ, "HOME": str(base)})
            assert "seed" in one_error_line(out)
            assert sorted(os.listdir(base)) == []
        finally:
            shutil.rmtree(base)

    def made(self, tmp_path: Path, files: dict[str, str]) -> Path:
        """What Hydra and a refused run leave: tmp_path/a/b/run (a and b new), with `files`."""
        from marl_llm.cli.new_run_dir import RecordNewRunDir

        run_dir = tmp_path / "a" / "b" / "run"
        RecordNewRunDir().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}}}))
        for name, text in files.items():
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / name).write_text(text)
        return run_dir

    HYDRA = {".hydra/config.yaml": "seed: 0", ".hydra/hydra.yaml": "x", ".hydra/overrides.yaml": "[]",
             "cli.log": "", ".marl-llm-lock": "pid 1"}

    def test_only_what_the_command_wrote_goes(self, tmp_path):
        from marl_llm.cli.new_run_dir import take_back

        run_dir = self.made(tmp_path, self.HYDRA)
        take_back(str(run_dir))
        assert sorted(os.listdir(tmp_path)) == []  # the run dir, b and a: all three were this command's

    @pytest.mark.parametrize("extra", [{"metrics.jsonl": "{}"}, {".marl-llm-run": ""}, {"my_notes.txt": "mine"},
                                       {".hydra/extra.yaml": "x"}, {"wandb/run.log": "x"}])
    def test_anything_else_keeps_the_dir_as_it_is(self, tmp_path, extra):
        from marl_llm.cli.new_run_dir import take_back

        run_dir = self.made(tmp_path, {**self.HYDRA, **extra})
        before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
        take_back(str(run_dir))
        assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before

    def test_a_dir_another_process_holds_or_made_since_is_kept(self, tmp_path):
        from marl_llm.cli.new_run_dir import take_back

        run_dir = self.made(tmp_path, self.HYDRA)
        held = os.open(run_dir / ".marl-llm-lock", os.O_RDWR)
        fcntl.flock(held, fcntl.LOCK_EX)  # a run in it now
        try:
            take_back(str(run_dir))
        finally:
            os.close(held)
        assert (run_dir / ".hydra" / "config.yaml").exists()
        run_dir = self.made(tmp_path / "2", self.HYDRA)
        (tmp_path / "2" / "a" / "other").mkdir()  # another run's dir, made in a meanwhile
        take_back(str(run_dir))
        assert not (tmp_path / "2" / "a" / "b").exists() and (tmp_path / "2" / "a" / "other").is_dir()
        run_dir = self.made(tmp_path / "3", self.HYDRA)
        take_back(str(tmp_path / "3" / "elsewhere"))  # not the dir noted: nothing is touched
        assert (run_dir / "cli.log").exists()

    def test_a_dir_that_existed_before_is_never_removed(self, tmp_path):
        from marl_llm.cli.new_run_dir import RecordNewRunDir, take_back

        run_dir = tmp_path / "existing"
        run_dir.mkdir()
        RecordNewRunDir().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}}}))
        for name, text in self.HYDRA.items():
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / name).write_text(text)
        take_back(str(run_dir))
        assert (run_dir / "cli.log").exists() and (run_dir / ".hydra" / "config.yaml").exists()

