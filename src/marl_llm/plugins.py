"""Where the algorithms, tasks, baselines and losses come from.

Each registers itself when its module is imported (`@register_algorithm`, `@register_task`,
`@register_baseline`, `@register_loss`). Imported here, before a config is composed:

1. the package's own: every module of marl_llm.tasks, and marl_llm.algos.schemas, which declares
   the algorithms (and baselines, losses, ...) by name with their schemas: their modules import torch
   and load when first used (marl_llm.registry), so composing and checking a config stays light;
2. the modules that installed packages declare in the `marl_llm.plugins` entry-point group, e.g.
   in the plugin's pyproject.toml: [project.entry-points."marl_llm.plugins"] my_task = "my_pkg.task"
   (installed: site-packages, the user site, a PYTHONPATH dir; a `.dist-info` in the current
   directory, which `python -m` puts on sys.path, is named in a warning and not loaded);
3. the modules named by the `plugins` config key (`marl-llm plugins=[my_task] task=my_task`),
   importable from the installed packages or from PYTHONPATH.

A plugin module may set `CONFIG_SEARCHPATH` (a Hydra search path entry or a list of them, e.g.
"pkg://my_pkg.conf" or "file:///data/my_conf") where its YAML files live (conf/task/<name>.yaml,
...); they are added to `hydra.searchpath` (a pkg:// folder without __init__.py as its file:// path). `--config-dir <dir>` and `hydra.searchpath=[...]` work too.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import traceback
from types import ModuleType

from marl_llm.config import UserError

ENTRY_POINT_GROUP = "marl_llm.plugins"
# Every module of the tasks package (each light: no torch), and the algorithms' declarations (their
# modules import torch, so they are declared by name with their schemas and load when first used).
BUILTIN_PACKAGES = ("marl_llm.tasks",)
BUILTIN_MODULES = ("marl_llm.algos.schemas",)


@functools.cache
def _import_builtins() -> None:
    """Once per process (the CLI composes, checks overrides and validates: each loads the plugins)."""
    import pkgutil

    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    for package in BUILTIN_PACKAGES:
        pkg = importlib.import_module(package)
        for mod in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{package}.{mod.name}")


def _where(err: BaseException) -> str:
    """`file:line` of the innermost frame of the error (the plugin's own line, usually)."""
    frames = traceback.extract_tb(err.__traceback__)
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import_named(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise UserError(f"plugins: no module named {name!r} is importable: install its package, or put the "
                            f"directory that holds it on PYTHONPATH (PYTHONPATH=<dir> marl-llm plugins=[{name}] ...)"
                            ) from None
        raise UserError(f"plugins: importing {name!r} failed: {err}{_where(err)}") from None
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001  (the plugin's own error, named with its line)
        raise UserError(f"plugins: importing {name!r} failed: {type(err).__name__}: {err}{_where(err)}") from None


def _current_dir_entries() -> list[str]:
    """The sys.path entries that are the current directory: the one `python -m` puts first (so
    `python -m marl_llm`, `torchrun -m marl_llm` and `accelerate launch -m marl_llm`), the empty
    entry of `python -c` and the REPL, and one named on PYTHONPATH (".", or an empty element)."""
    cwd = os.path.realpath(os.getcwd())
    return [p for p in sys.path if os.path.realpath(p or ".") == cwd]


def _dist_name(dist: importlib.metadata.Distribution) -> str:
    return (dist.metadata["Name"] or "?") if dist.metadata is not None else "?"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: one installed distribution per normalized name


def _installed_entry_points() -> list[importlib.metadata.EntryPoint]:
    """The marl_llm.plugins entry points of the installed distributions (site-packages, the user
    site, PYTHONPATH): never of a `.dist-info` or `.egg-info` in the current directory, which any
    download or checkout can hold, and which `python -m` would otherwise load code from. Such a
    distribution's entry points are named in one warning line each, with what loads them."""
    here = _current_dir_entries()
    seen: set[str] = set()
    found = []
    for dist in importlib.metadata.distributions(path=[p for p in sys.path if p not in here]):
        name = _normalized(_dist_name(dist))
        if name in seen:  # shadowed by an earlier sys.path entry, as importlib.metadata.entry_points does
            continue
        seen.add(name)
        found += list(dist.entry_points.select(group=ENTRY_POINT_GROUP))
    if here:
        for dist in importlib.metadata.distributions(path=here[:1]):
            skipped = list(dist.entry_points.select(group=ENTRY_POINT_GROUP))
            if skipped:
                where = getattr(dist, "_path", None)  # the .dist-info dir (importlib.metadata's PathDistribution)
                where = os.path.abspath(where) if where else os.getcwd()
                print(f"warning: not loading the {ENTRY_POINT_GROUP} entry point(s) "
                      f"{', '.join(f'{ep.name} = {ep.value}' for ep in skipped)} that {_dist_name(dist)} declares in "
                      f"the current directory ({where}): plugins load from installed packages only; install it "
                      f"(pip install), or name its module: plugins=[{skipped[0].module}]", file=sys.stderr, flush=True)
    return found


@functools.cache
def _entry_point_modules() -> tuple[ModuleType, ...]:
    """Once per process (an error is not cached: it stops the run)."""
    modules = []
    for ep in _installed_entry_points():
        dist = getattr(ep, "dist", None)
        source = f" (declared by {_dist_name(dist)}, {getattr(dist, '_path', '?')})" if dist is not None else ""
        try:
            loaded = ep.load()
        except (Exception, SystemExit) as err:  # an exit() in the plugin would end the command silently
            raise UserError(f"the {ENTRY_POINT_GROUP} entry point {ep.name} = {ep.value}{source} failed to load: "
                            f"{type(err).__name__}: {err}{_where(err)}; fix or uninstall that package") from None
        modules.append(loaded if isinstance(loaded, ModuleType) else sys.modules[ep.module])
    return tuple(modules)


def load_plugins(names: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Import the built-in algorithms and tasks, the entry-point plugins and the modules `names`
    (each once: Python caches modules); returns the Hydra search path entries they declare."""
    _import_builtins()
    modules = [*_entry_point_modules(), *(_import_named(str(n)) for n in names)]
    searchpath: list[str] = []
    for module in modules:
        declared = getattr(module, "CONFIG_SEARCHPATH", None)
        for declared_entry in [declared] if isinstance(declared, str) else list(declared or ()):
            for entry in _readable_entries(str(declared_entry), module.__name__):
                if entry not in searchpath:
                    searchpath.append(entry)
    return searchpath


def _readable_entries(entry: str, module: str) -> list[str]:
    """A plugin's search path entry as Hydra reads it: `pkg://a.conf` whose folder has no
    __init__.py (a namespace package, which Hydra's pkg:// reader cannot open; it warned on every
    command) becomes `file://<that folder>`. An entry that names no folder is refused here, once,
    naming the plugin, instead of Hydra's warning on every command."""
    scheme, sep, where = entry.partition("://")
    if sep and scheme == "pkg":
        try:
            spec = importlib.util.find_spec(where)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"plugin {module}: CONFIG_SEARCHPATH {entry!r} names no importable package folder: point it "
                            f"at the folder that holds the YAML (pkg://<package>.<folder> or file://<dir>)")
        if spec.origin is None or not spec.origin.endswith("__init__.py"):  # a namespace package
            return [f"file://{folder}" for folder in spec.submodule_search_locations]
    elif sep and scheme == "file" and not os.path.isdir(where):
        raise UserError(f"plugin {module}: CONFIG_SEARCHPATH {entry!r} is not a folder: point it at the folder that "
                        "holds the YAML (conf/task/<name>.yaml, ...)")
    return [entry]
