"""The package's layout: modules import each other one way only (no import cycles, counting imports
inside functions and under TYPE_CHECKING, which a reader follows just the same)."""

from __future__ import annotations

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
