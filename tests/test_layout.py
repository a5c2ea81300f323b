"""The package's layout: modules import each other one way only (no import cycles, counting imports
inside functions and under TYPE_CHECKING, which a reader follows just the same)."""

from __future__ import annotations

from pathlib import Path

import grimp


def test_no_import_cycles():
    graph = grimp.build_graph("marl_llm", cache_dir=None)
    cycles = sorted({tuple(sorted((a, b))) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                     if graph.find_shortest_chain(importer=b, imported=a)})
    assert cycles == [], f"modules that import each other (directly or through others): {cycles}"


def test_importing_a_module_of_the_package_stays_light():
    """`import marl_llm.<module>` pulls neither the API nor Hydra through marl_llm/__init__.py."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys, marl_llm.registry, marl_llm.version; "
                          "print(sorted(m for m in ('hydra', 'torch', 'marl_llm.api') if m in sys.modules))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


HEAVY = ("torch", "transformers", "peft", "datasets", "accelerate", "numpy")
TESTS = Path(__file__).resolve().parent


def modules_loaded_by(code: str, cwd: Path) -> tuple[list[str], str]:
    """The heavy modules a fresh interpreter (in `cwd`, the tests' dir on its path) has imported
    once `code` ran, printed at exit so that code ending in sys.exit counts too; and its output."""
    import os
    import subprocess
    import sys

    prelude = (f"import atexit, sys; atexit.register(lambda: print('LOADED', sorted(m for m in {HEAVY!r} "
               "if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300, cwd=cwd,
                         env={**os.environ, "PYTHONPATH": str(TESTS)})
    line = next((x for x in out.stdout.splitlines() if x.startswith("LOADED ")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-3000:]
    return eval(line[len("LOADED "):]), out.stdout + out.stderr


def test_composing_and_checking_every_option_imports_no_torch(tmp_path):
    """`marl-llm --cfg job` and a config error must take well under a second (issue 34): loading the
    built-ins (the tasks, and the algorithms, baselines, losses declared in algos/schemas.py),
    composing and validating a config of every algorithm and every task stays clear of torch,
    transformers and the rest. The implementations load when first looked up."""
    code = """
from pathlib import Path
from conftest import required_settings
from marl_llm.configure import compose_config, config_dir, validate
from marl_llm.registry import ALGORITHMS, BASELINES, POLICY_LOSSES, AGGREGATIONS, JOINT_MODES
for group, default in (("algo", "magrpo"), ("task", "humaneval")):
    for path in sorted((Path(config_dir()) / group).glob("*.yaml")):
        other = ["task=sokoban"] if path.stem == "at_grpo" else []
        validate(compose_config([f"{group}={path.stem}", *required_settings(group, path.stem), *other, "run_dir=/x"]))
assert {"magrpo", "at_grpo", "collm_cc", "single"} <= set(ALGORITHMS) and "rloo" in BASELINES
assert "ppo_clip" in POLICY_LOSSES and "token_mean" in AGGREGATIONS and "cross" in JOINT_MODES
print("validated")
"""
    loaded, output = modules_loaded_by(code, tmp_path)
    assert loaded == [] and "validated" in output, output[-3000:]


def test_the_console_scripts_config_paths_import_no_torch(tmp_path):
    """The console script's own path for `--cfg job` and for a value error (validation after
    composing), as it runs them."""
    for argv, said in ((["--cfg", "job"], "num_generations: 4"),
                       (["algo=collm_dc", "--cfg", "job", "--resolve"], "name: collm_dc"),
                       (["trainer.max_steps=-1", f"hydra.run.dir={tmp_path / 'run'}"], "trainer.max_steps")):
        code = f"import sys; sys.argv = ['marl-llm', *{argv!r}]\nfrom marl_llm.cli.train import main\nmain()"
        loaded, output = modules_loaded_by(code, tmp_path)
        assert loaded == [] and said in output, (argv, output[-3000:])


def test_every_declared_builtin_is_registered_by_its_module():
    """A declaration (algos/schemas.py) names the module whose decorator registers the object, with
    the same schema: looking each up imports its module and finds it there."""
    from marl_llm.plugins import load_plugins
    from marl_llm.registry import AGGREGATIONS, ALGORITHMS, BASELINES, JOINT_MODES, POLICY_LOSSES, SCHEMAS

    load_plugins()
    for table in (ALGORITHMS, BASELINES, JOINT_MODES, POLICY_LOSSES, AGGREGATIONS):
        for name in table:
            assert callable(table[name]), (table.kind, name)
    for name in ALGORITHMS:
        assert SCHEMAS["algo"][name]().name in (name, "???"), name  # ActorCriticConfig's name is MISSING


def test_no_file_over_500_lines_without_a_reason_at_its_top():
    """The issue's rule: no file over about 500 lines without a reason stated at its top (in the
    module docstring: "One file on purpose, ...")."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "marl_llm"
    long = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 520 and "One file on purpose" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(src)} ({text.count(chr(10))} lines)")
    assert long == [], f"split these, or say at their top why not: {long}"


def test_the_training_loop_reads_top_to_bottom_in_under_400_lines():
    """trainer.py keeps the loop and what it needs to read in order; OS helpers, the setup, the data
    order and the summary live in the modules their names say (training/, runs/)."""
    from pathlib import Path

    loop = Path(__file__).resolve().parents[1] / "src" / "marl_llm" / "training" / "trainer.py"
    assert loop.read_text().count("\n") < 400


def test_a_declared_entry_loads_its_module_on_first_lookup_only(tmp_path, monkeypatch):
    """Registry.declare: names and `in` never import; the first lookup imports the module, whose
    decorator fills the entry; another module may not take the name."""
    import sys

    import pytest

    from marl_llm.registry import Registry, registrar

    table = Registry("widget")
    monkeypatch.setattr(sys.modules[__name__], "WIDGETS", table, raising=False)
    (tmp_path / "widget_impl.py").write_text("import test_layout\nfrom marl_llm.registry import registrar\n\n"
                                             "@registrar(test_layout.WIDGETS, 'widget')('knob')\ndef knob():\n"
                                             "    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table.declare("knob", "widget_impl")
    assert "knob" in table and list(table) == ["knob"] and "widget_impl" not in sys.modules
    assert table["knob"]() == 42 and "widget_impl" in sys.modules
    with pytest.raises(ValueError, match="widget 'knob' is already registered"):
        registrar(table, "widget")("knob")(lambda: 0)  # defined here, not in widget_impl
    table.declare("dial", "widget_impl")  # a module that does not register it
    with pytest.raises(LookupError, match="widget_impl was declared to register the widget 'dial' but did not"):
        table["dial"]
