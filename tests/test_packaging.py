"""The package as it ships: every directory of it listed for setuptools (else the wheel build warns
for each), the builder's conf/local/default.yaml left out, the description without relative links,
and each optional feature naming its extra in one line when that is missing. The wheel itself is
built and installed into a fresh venv by scripts/check_wheel.py (`make test` runs it after pytest)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from marl_llm import extras
from marl_llm.config import UserError

REPO = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def shipped_dirs() -> set[str]:
    """Package names of the directories that hold files to ship: src/marl_llm/**, conf/** and the
    Hydra launchers under src/hydra_plugins/ (a namespace package: itself holds no file)."""
    found = set()
    for root, package in ((REPO / "src" / "marl_llm", "marl_llm"), (REPO / "conf", "marl_llm.conf"),
                          (REPO / "src" / "hydra_plugins", "hydra_plugins")):
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            if "__pycache__" in d.parts or not any(f.is_file() and f.suffix != ".pyc" for f in d.iterdir()):
                continue
            found.add(".".join([package, *d.relative_to(root).parts]))
    return found


def test_every_shipped_directory_is_a_listed_package():
    """setuptools warns ("Package would be ignored") for each data directory its `packages` lack."""
    listed = set(pyproject()["tool"]["setuptools"]["packages"])
    assert listed == shipped_dirs()


def test_the_builders_local_settings_never_ship_and_the_license_is_spdx():
    setuptools = pyproject()["tool"]["setuptools"]
    assert setuptools["exclude-package-data"]["marl_llm.conf.local"] == ["default.yaml"]
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]


def test_the_package_description_has_no_relative_links():
    """PyPI shows the description without the repository around it: a relative link would break."""
    readme = REPO / pyproject()["project"]["readme"]
    links = re.findall(r"\]\(([^)]+)\)", readme.read_text())
    assert [link for link in links if not re.match(r"[a-z]+://|#", link)] == []


def test_optional_features_are_extras_and_the_default_install_holds_wandb():
    project = pyproject()["project"]
    default = " ".join(project["dependencies"])
    optional = project["optional-dependencies"]
    assert "wandb" in default  # the default logger
    for extra, modules in extras.EXTRAS.items():
        assert extra in optional, extra
        for module in modules:
            assert module not in default and any(req.startswith(module) for req in optional[extra]), (extra, module)
    assert optional["all"] == ["marl-llm[embedded,report,distributed,metrics]"]
    torch = next(r for r in project["dependencies"] if r.startswith("torch"))
    assert torch == "torch>=2.13,<2.14"  # the tested range, not any torch


@pytest.fixture
def without(monkeypatch):
    """Make the named modules look uninstalled to the extras checks."""
    real = importlib.util.find_spec

    def hide(*names):
        monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))

    return hide


def test_a_missing_extra_is_one_line_naming_it(without, tmp_path, monkeypatch):
    without("gguf", "accelerate", "evaluate")
    from marl_llm import metrics
    from marl_llm.models import loading

    monkeypatch.setenv("MARL_LLM_CACHE", str(tmp_path))  # nothing converted yet: the conversion needs gguf
    if importlib.util.find_spec(loading.EMBEDDED_PACKAGE) is not None:
        with pytest.raises(UserError, match=r"needs gguf, which is not installed: pip install 'marl-llm\[embedded\]'"):
            loading.embedded_checkpoint()
    with pytest.raises(UserError, match=r"needs evaluate, which is not installed: pip install 'marl-llm\[metrics\]'"):
        metrics.load("pass_at_k")
    monkeypatch.setenv("WORLD_SIZE", "2")
    from marl_llm.distributed import data_parallel

    with pytest.raises(UserError, match=r"a run of 2 data-parallel processes needs accelerate.*\[distributed\]"):
        data_parallel.init(1.0, cpu=True)


def test_report_without_matplotlib_writes_its_tables_and_says_why_no_plots(without, tmp_path, capsys):
    from marl_llm.report.cli import main
    from test_report import build_tldr

    without("matplotlib")
    build_tldr(tmp_path / "runs")
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tldr.md").is_file() and not list((tmp_path / "out").glob("*.png"))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "plots" in line]
    assert warnings == ["warning: no plots: marl-llm-report draws them with matplotlib, which is not installed: "
                        "pip install 'marl-llm[report]' (from a checkout: pip install -e '.[report]')"]


def test_bench_without_its_extra_is_one_line(without, capsys):
    from marl_llm.bench.__main__ import main

    without("comlrl", "trl")
    assert main(["--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "comlrl, trl are not installed: pip install 'marl-llm[bench]'" in err[0]
