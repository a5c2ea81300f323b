"""Composing and checking a run's config, the same way for the console scripts, the Python API
and the tests.

`register_configs` loads the algorithms, tasks and plugins (marl_llm.plugins) and stores every
schema in Hydra's ConfigStore: the shared ones (marl_llm.config) and each registered algorithm's
and task's (`<group>/<name>_schema`, named first in the option's YAML). `compose_config` composes
conf/ (plus the plugins' search path) for a list of overrides. `validate` checks what types cannot:
the shared keys, the names that registries define (baselines, losses, aggregations), and the chosen
algorithm's and task's own `check`.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from marl_llm.config import SHARED_SCHEMAS, RootConfig, UserError, check_choice
from marl_llm.config_checks import check_agent_sampling, check_shared
from marl_llm.config_keys import chosen_schemas, walk_key
from marl_llm.plugins import load_plugins
from marl_llm.registry import SCHEMAS


def config_dir() -> str:
    """conf/ as shipped in the package (wheel or editable install), else the source checkout's."""
    spec = importlib.util.find_spec("marl_llm.conf")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(list(spec.submodule_search_locations)[0]).resolve())
    return str(Path(__file__).resolve().parents[2] / "conf")


def default_dir_pattern(kind: str) -> str:
    """Hydra's default `hydra.<kind>.dir` (kind: run | sweep) as conf/hydra/default.yaml writes it,
    unresolved (outputs/${now:...})."""
    return str(OmegaConf.to_container(OmegaConf.load(Path(config_dir()) / "hydra" / "default.yaml"))[kind]["dir"])


def default_run_dir(when: datetime) -> str:
    """The run dir Hydra names for a run started at `when` (the `${now:<format>}` parts filled in)."""
    return re.sub(r"\$\{now:([^}]*)\}", lambda m: when.strftime(m.group(1)), default_dir_pattern("run"))


# ------------------------------------------------------------------------------- the ConfigStore
# The job log's line format (the Python API's run log writes the same).
JOB_LOG_FORMAT = "[%(asctime)s][%(levelname)s][%(name)s] %(message)s"
# hydra/job_logging=marl_llm (chosen in conf/config.yaml): the console shows the trainer's lines as
# `[marl-llm] <message>` (Hydra's default prefixes each with a date, the logger name and the level),
# and the job log <run dir>/cli.log keeps the same lines with their time and level (a fixed name: Hydra's
# default, <job name>.log, would follow the console script's module name).
JOB_LOGGING = {
    "version": 1,
    "formatters": {"console": {"format": "[marl-llm] %(message)s"},
                   "file": {"format": JOB_LOG_FORMAT}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "console", "stream": "ext://sys.stdout"},
                 "file": {"class": "logging.FileHandler", "formatter": "file",
                          "filename": "${hydra.runtime.output_dir}/cli.log"}},
    "root": {"level": "INFO", "handlers": ["console", "file"]},
    "disable_existing_loggers": False,
}


def register_configs(plugins: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Load the built-in options and the plugins, store every schema in the ConfigStore; returns
    the Hydra search path entries the plugins declare (plugins.load_plugins)."""
    searchpath = load_plugins(plugins)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=RootConfig)
    for group, schema in SHARED_SCHEMAS.items():
        if group != "cluster":  # a section of the root config, not a group with options
            cs.store(group=group, name=f"{group}_schema", node=schema)
    for group, options in SCHEMAS.items():
        for name, schema in options.items():
            cs.store(group=group, name=f"{name}_schema", node=schema)
    cs.store(group="hydra/job_logging", name="marl_llm", node=JOB_LOGGING, provider="marl_llm")
    return searchpath


# ------------------------------------------------------------------------------------ overrides
def _parse(override: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override)


def plugins_from_overrides(args: list[str]) -> list[str]:
    """The modules a `plugins=[a,b]` (or `plugins=a`) override names, before Hydra composes."""
    names: list[str] = []
    for a in args:
        if a.split("=", 1)[0].lstrip("+") != "plugins" or "=" not in a:
            continue
        try:
            value = _parse(a).value()
        except Exception as err:  # noqa: BLE001  (Hydra's parse error)
            raise UserError(f"cannot read {a!r}: {err}; write plugins=[module] or plugins=[a,b]") from None
        if not isinstance(value, (str, list)):
            raise UserError(f"{a!r}: plugins are loaded before the config is composed and cannot be swept; "
                            "name them all in one list, plugins=[a,b]")
        names += [value] if isinstance(value, str) else [str(v) for v in value]
    return names


# Hydra's flags that take a value (`--cfg job`; `--info` may): that value is not an override.
VALUE_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-c", "--cfg", "-p", "--package",
               "--experimental-rerun")
INFO_VALUES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")


def _is_override(args: list[str], i: int) -> bool:
    a, before = args[i], args[i - 1] if i else ""
    return not a.startswith("-") and before not in VALUE_FLAGS and not (before in ("-i", "--info") and a in INFO_VALUES)


def add_overrides(args: list[str], extra: list[str]) -> list[str]:
    """`args` with the overrides `extra` placed just before the first override given (or first of
    all): Hydra's argparse reads the overrides as one run of positional arguments, and refuses one
    placed after a flag that follows them (`task=x --help hydra.searchpath=[...]`), or takes it as
    the value of `--info`."""
    at = next((i for i in range(len(args)) if _is_override(args, i)), 0)
    return [*args[:at], *extra, *args[at:]]


def plugin_overrides(args: list[str], searchpath: list[str]) -> list[str]:
    """`args` as Hydra takes them: `plugins=a` as the list `plugins=[a]`, and the plugins' search path
    entries added to `hydra.searchpath` (merged with one given there; add_overrides places it)."""
    out = []
    for a in args:
        key, eq, value = a.partition("=")
        if eq and key.lstrip("+") == "plugins" and not value.strip().startswith("["):
            a = f"{key}=[{value}]"
        out.append(a)
    if not searchpath:
        return out
    given: list[str] = []
    for a in [a for a in out if a.partition("=")[0].lstrip("+") == "hydra.searchpath"]:
        value = _parse(a).value()
        given += [value] if isinstance(value, str) else [str(v) for v in value]
        out.remove(a)
    entries = given + [p for p in searchpath if p not in given]
    return add_overrides(out, ["hydra.searchpath=[" + ",".join(f"'{p}'" for p in entries) + "]"])


def option_schemas(args: list[str]) -> tuple[dict[str, Any], bool]:
    """config_keys.chosen_schemas, with the built-in options and the named plugins registered first."""
    load_plugins(plugins_from_overrides(args))
    return chosen_schemas(args)


def map_overrides(args: list[str]) -> list[str]:
    """`algo.policy_map={tool:a,plan:b}` or `task.data.files.train=x.jsonl`: keys of a map field
    (empty by default) are new to Hydra's struct config, which would refuse them; `++` sets them."""
    schemas, preset = option_schemas(args)
    out = []
    for a in args:
        if not a.startswith(("-", "+", "~", "hydra.")) and "=" in a:
            if walk_key(a.split("=", 1)[0], schemas, preset)[0] == "map":
                a = "++" + a
        out.append(a)
    return out


class NoSuchOption(UserError):
    """A group option that no config provides (group_choice_error's line). Where Hydra's own
    "missing config" was expected (an option registered in code, with no YAML), catch this too."""


def compose_config(overrides: list[str]) -> DictConfig:
    """The real config from conf/ for these overrides, as the console script composes it, plugins
    included (no validation: callers validate, or test invalid values). A group option that no
    config provides is a NoSuchOption (a UserError: group_choice_error)."""
    from hydra import compose, initialize_config_dir

    searchpath = register_configs(plugins_from_overrides(overrides))
    args = map_overrides(plugin_overrides(overrides, searchpath))
    with initialize_config_dir(config_dir(), version_base="1.3"):
        err = group_choice_error(args)
        if err:
            raise NoSuchOption(err)
        return compose("config", overrides=args)


# Hydra's flags that name another primary config: its groups are not conf/'s, so they are left to Hydra.
OTHER_PRIMARY_FLAGS = ("-cp", "--config-path", "-cn", "--config-name")


def _searchpath_override(args: list[str]) -> list[str]:
    """The `hydra.searchpath=[...]` override that makes Hydra's config loader see every group the
    command sees: the one given (plugin_overrides merged the plugins' entries into it) and a
    `--config-dir` (-cd), which Hydra adds to the search path itself."""
    entries: list[str] = []
    for i, a in enumerate(args):
        if a.partition("=")[0].lstrip("+") == "hydra.searchpath":
            try:
                value = _parse(a).value()
            except Exception:  # noqa: BLE001  (Hydra's parse error: Hydra says it)
                continue
            entries += [value] if isinstance(value, str) else [str(v) for v in value or ()]
        elif a in ("-cd", "--config-dir") and i + 1 < len(args):
            entries.append(f"file://{os.path.abspath(args[i + 1])}")
        elif a.startswith("--config-dir="):
            entries.append(f"file://{os.path.abspath(a.split('=', 1)[1])}")
    return ["hydra.searchpath=[" + ",".join(f"'{e}'" for e in entries) + "]"] if entries else []


def _public(option: str) -> bool:
    """An option a user picks (not a preset's private part `_*`, a schema `*_schema` or an example)."""
    return not option.startswith("_") and not option.endswith(("_schema", ".example"))


def group_choice_error(args: list[str]) -> str | None:
    """A config group option on the command line that no config provides (`experiment=magrpo_humaneval_papr`):
    the line that names the closest options, or None. Why: for an `optional` group in conf/config.yaml's
    defaults (experiment, sweep, local) Hydra skips a missing option silently and runs the default
    config; for the others it prints a multi-line listing. Only what the command line names is checked:
    an optional group left unset stays optional (conf/local/default.yaml may be absent). Call with
    Hydra's global state initialized (compose_config), or it is initialized here for the check."""
    from hydra.core.global_hydra import GlobalHydra

    if any(a in OTHER_PRIMARY_FLAGS or a.startswith(tuple(f + "=" for f in OTHER_PRIMARY_FLAGS)) for a in args):
        return None
    chosen = []
    for i, a in enumerate(args):
        if not _is_override(args, i) or "=" not in a:
            continue
        try:
            override = _parse(a)
        except Exception:  # noqa: BLE001  (Hydra's parse error: train.grammar_error says it)
            continue
        if override.is_delete() or override.key_or_group.startswith("hydra") or "." in override.key_or_group:
            continue
        chosen.append((a, override))
    if not chosen:
        return None
    if not GlobalHydra.instance().is_initialized():
        from hydra import initialize_config_dir

        with initialize_config_dir(config_dir(), version_base="1.3"):
            return group_choice_error(args)
    from hydra.core.object_type import ObjectType

    group_options = group_lister(GlobalHydra.instance().config_loader(), _searchpath_override(args))
    for a, override in chosen:
        group = override.key_or_group
        parent = group.rpartition("/")[0]
        if group not in [f"{parent}/{g}" if parent else g for g in group_options(parent, ObjectType.GROUP)]:
            continue  # not a group: a plain key (seed=1), which unknown_key_error checks
        options = group_options(group, ObjectType.CONFIG)
        for value in _choices(override):
            if value is None or "${" in value or value in options:
                continue
            public = [o for o in options if _public(o)]
            close = difflib.get_close_matches(value, public, n=3, cutoff=0.6)
            what = f"{group}={value}" if len(_choices(override)) == 1 else f"{a} names {group}={value}, which"
            if not public:
                examples = [o for o in options if o.endswith(".example")]
                make = f"copy {group}/{examples[0]}.yaml to {group}/{value}.yaml" if examples else \
                    f"write {group}/{value}.yaml"
                return f"{what} is no {group} option: there is none to pick; {make} in {config_dir()}, or drop {a}"
            if close:
                others = f" (or {', '.join(close[1:])})" if len(close) > 1 else ""
                hint = f"did you mean {group}={close[0]}{others}?"
                if len(public) <= 12:  # a short list is shown whole
                    hint += f" The options are {', '.join(public)}"
            elif len(public) <= 12:
                hint = f"the options are {', '.join(public)}"
            else:
                hint = f"no option is close; all {len(public)}: marl-llm --help"
            return f"{what} is no {group} option: {hint}"
    return None


def group_lister(loader: Any, overrides: list[str]) -> Any:
    """`loader.get_group_options(group, kind, overrides=overrides)` as a function of (group, kind)
    that reads one copy of Hydra's config repository for all its calls. Why: each call of Hydra's
    own copies the whole repository, the ConfigStore with every registered schema included (~0.1 s
    of CPU); `--help` lists ~25 groups, Hydra's help made ~140 such copies (cli/help.py)."""
    make_repository = getattr(loader, "_parse_overrides_and_create_caching_repo", None)  # Hydra 1.3's
    if make_repository is None:  # another Hydra: its public call, a copy each
        return lambda group, kind: loader.get_group_options(group, kind, overrides=overrides)
    _, repository = make_repository(None, overrides)
    return repository.get_group_options


def _choices(override: Any) -> list[str | None]:
    """The option names an override picks: one, a list (`group=[a,b]`), or a sweep's choices
    (`-m group=a,b`; glob and range sweeps are left to Hydra)."""
    from hydra.core.override_parser.types import ChoiceSweep

    value = override.value()
    if isinstance(value, ChoiceSweep):
        return [None if v is None else str(v) for v in value.list]
    if override.is_sweep_override():
        return []
    if isinstance(value, list):
        return [None if v is None else str(v) for v in value]
    return [None if value is None else str(value)] if not isinstance(value, dict) else []


# ------------------------------------------------------------------------------------ resolvers
RUN_DIR_NOT_MADE = "<made when the run starts: hydra.run.dir>"


def run_dir_of_job() -> str:
    """`run_dir`: the dir Hydra made for this job. `--cfg job --resolve` and `--info` print the config
    without making one; they show this placeholder instead of failing. Outside Hydra (compose in
    tests and tools) it fails as before: such callers set run_dir themselves."""
    from hydra.core.hydra_config import HydraConfig

    made = OmegaConf.select(HydraConfig.get(), "runtime.output_dir", default=None)  # None or ??? until made
    return RUN_DIR_NOT_MADE if made is None else str(made)


def model_dir_name(path: Any) -> str:
    """`model=local`'s name: its checkpoint directory's name (`/data/Qwen2.5-Coder-3B` ->
    Qwen2.5-Coder-3B), so that runs, W&B names and reports say which model it is."""
    return Path(os.path.expanduser(str(path))).name or str(path)


def data_split(role: str, train_split: str, eval_split: str, files: Any) -> str:
    from marl_llm.tasks.data import default_split

    return default_split(role, train_split, eval_split, dict(files or {}))


def public_config_groups(searchpath: Any = None) -> str:
    """The `--help` listing of the groups a user picks from: Hydra's own listing without the
    private parts (`_matched_*`, shared by presets), the dataclass schemas (`*_schema`) and
    example files, plus the launcher presets (`hydra/launcher`). `searchpath`: hydra.searchpath
    (the plugins' YAML dirs; Hydra's own listing leaves them out)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if not GlobalHydra.instance().is_initialized():  # the help template resolved outside Hydra
        return "(the groups: marl-llm --help)"
    overrides = ["hydra.searchpath=[" + ",".join(f"'{p}'" for p in searchpath) + "]"] if searchpath else []
    group_options = group_lister(GlobalHydra.instance().config_loader(), overrides)

    def groups(parent: str = "") -> list[str]:
        found = []
        for child in group_options(parent, ObjectType.GROUP):
            name = f"{parent}/{child}" if parent else child
            found += [name, *groups(name)]
        return found

    lines = []
    for group in sorted(g for g in groups() if not g.startswith("hydra") or g == "hydra/launcher"):
        options = [o for o in sorted(group_options(group, ObjectType.CONFIG))
                   if not o.startswith("_") and not o.endswith(("_schema", ".example"))]
        if options:
            lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)


# A sweep subdir's overrides part, in bytes: file systems refuse a name past 255 (NAME_MAX), which
# a dozen overrides reach; room is left for the suffix below.
SWEEP_NAME_MAX = 200


def sweep_subdir(overrides: str, seed: Any) -> str:
    """<overrides>/seed=<s>, so that the seeds of one configuration sit side by side (a seed-only
    sweep: seed=<s>, not an absolute "/seed=<s>"). Overrides longer than SWEEP_NAME_MAX bytes keep
    their first whole ones and end in `,+<n more>-<hash of them all>`: one dir per configuration,
    the same one for the same command (a relaunched sweep finds its runs); the run dir's
    .hydra/overrides.yaml lists them all."""
    if not overrides:
        return f"seed={seed}"
    name = str(overrides)
    if len(name.encode()) > SWEEP_NAME_MAX:
        import hashlib

        items = re.split(r",(?![^\[\]{}()]*[\]})])", name)  # commas outside [...], {...}, (...)
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        kept: list[str] = []
        while len(items) > len(kept) and len(",".join([*kept, items[len(kept)]]).encode()) <= SWEEP_NAME_MAX - 30:
            kept.append(items[len(kept)])
        name = ",".join([*kept, f"+{len(items) - len(kept)}more-{digest}"])
    return f"{name}/seed={seed}"


OmegaConf.register_new_resolver("marl_llm_sweep_subdir", sweep_subdir, replace=True)
OmegaConf.register_new_resolver("marl_llm_run_dir", run_dir_of_job, replace=True)
OmegaConf.register_new_resolver("marl_llm_model_dir_name", model_dir_name, replace=True)
OmegaConf.register_new_resolver("marl_llm_data_split", data_split, replace=True)
OmegaConf.register_new_resolver("marl_llm_config_groups", public_config_groups, replace=True)


# ----------------------------------------------------------------------------------- validation
# TRL's GRPOConfig.loss_type values and the aggregation here that matches each (dr_grpo divides
# the sum by a constant, the nearest is the plain sum).
TRL_LOSS_TYPES = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dapo": "token_mean", "dr_grpo": "seq_sum"}


def check_run_does_something(cfg: DictConfig) -> None:
    """No training step and no evaluation: a training run (`train`; marl-llm-eval evaluates by
    itself) would only load the model, then fail to summarise what it never did."""
    from marl_llm.algos.base import ALGORITHMS

    trainable = ALGORITHMS[cfg.algo.name].trainable
    t = cfg.trainer
    trains = trainable and t.max_steps > 0
    if not trains and not (t.eval_before or t.eval_after):
        what = f"trainer.max_steps={t.max_steps}" if trainable else f"algo={cfg.algo.name} (evaluation only)"
        raise UserError(f"{what} with trainer.eval_before=false and trainer.eval_after=false does nothing: train "
                        "(trainer.max_steps >= 1) or evaluate (trainer.eval_after=true)")


def check_allowed_changes(cfg: DictConfig) -> None:
    """trainer.resume_allow_changes names keys of the config (or `all`). A resume checks them
    against the checkpoint's config too (a key only it has is fine), so here only a fresh run's."""
    allowed = [str(a) for a in (cfg.trainer.get("resume_allow_changes") or [])]
    if not allowed or str(cfg.trainer.resume).lower() in ("true", "1", "yes", "if_possible"):
        return
    keys = _leaves(OmegaConf.to_container(cfg, resolve=False))
    unknown = [a for a in allowed if a != "all" and not any(k == a or k.startswith(a + ".") for k in keys)]
    if unknown:
        raise UserError(f"trainer.resume_allow_changes names {', '.join(unknown)}, which is no config key: name keys "
                        "(algo.learning_rate) or sections (algo), or [all]")


def _leaves(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict) or not tree:
        return [prefix]
    return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{prefix}.{k}" if prefix else str(k))]


def validate(cfg: DictConfig) -> None:
    """Check values that types cannot: raises UserError naming the key and the valid range."""
    from marl_llm.registry import AGGREGATIONS, ALGORITHMS, POLICY_LOSSES
    from marl_llm.tasks.base import TASKS
    from marl_llm.tasks.data import parse_split

    load_plugins(list(cfg.get("plugins") or ()))  # a config read back from a run dir names its plugins
    algo, task = cfg.algo.name, cfg.task.name
    if algo not in ALGORITHMS:
        raise UserError(f"algo={algo} is not a registered algorithm ({', '.join(sorted(ALGORITHMS))}): load the module "
                        "that registers it with plugins=[module] or an entry point (docs/extending.md)")
    if task not in TASKS:
        raise UserError(f"task={task} is not a registered task ({', '.join(sorted(TASKS))}): load the module that "
                        "registers it with plugins=[module] or an entry point (docs/extending.md)")
    check_shared(cfg)
    check_allowed_changes(cfg)
    loss_type = cfg.algo.get("loss_type")
    if loss_type in TRL_LOSS_TYPES and loss_type not in POLICY_LOSSES:
        raise UserError(f"invalid config value algo.loss_type: {loss_type!r} is TRL's name for how the per-token loss "
                        f"is aggregated; here algo.loss_type is the per-token surrogate ({', '.join(POLICY_LOSSES)}) "
                        f"and the aggregation is algo.loss_aggregation: use algo.loss_aggregation="
                        f"{TRL_LOSS_TYPES[loss_type]} (and algo.loss_type=ppo_clip with algo.clip_eps for TRL's "
                        "clipped surrogate)")
    if loss_type is not None:
        check_choice(cfg, "algo.loss_type", POLICY_LOSSES)
    if "loss_aggregation" in cfg.algo:
        check_choice(cfg, "algo.loss_aggregation", AGGREGATIONS)
    if "data" in cfg.task:
        for key in ("train_split", "eval_split", "packaged_train_split", "packaged_eval_split"):
            parse_split(cfg.task.data[key], f"task.data.{key}")
    task_agents = getattr(TASKS[task], "agents_for", lambda _: None)(cfg.task)
    algo_schema = SCHEMAS["algo"].get(algo)
    check_agent_sampling(cfg, getattr(algo_schema, "agents_for", lambda agents: agents)(task_agents))
    for schema in (algo_schema, SCHEMAS["task"].get(task)):
        if hasattr(schema, "check"):
            schema.check(cfg)
