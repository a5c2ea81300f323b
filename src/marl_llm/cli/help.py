"""`marl-llm --help` (-h) and `--hydra-help`: the text Hydra prints, in a fraction of its time.

Why: Hydra's help (hydra._internal.hydra.Hydra.app_help and hydra_help, with get_help) lists the
config groups with one `get_group_options` call per group and kind, and each call copies the
whole config repository, the ConfigStore with every registered schema included; it also builds
both of its group listings ($APP_CONFIG_GROUPS, $HYDRA_CONFIG_GROUPS) whether the template names
them or not. `marl-llm --help` made ~140 such copies: 3.5-4 s of CPU. Here the config is composed
once, as Hydra composes it for help, every listing reads one copy of the repository
(configure.group_lister), and a template's `$NAME` is filled only when the template names it.

A command this does not cover (another primary config or an added config dir: -cp, -cn, -cd; a
config that does not compose) is left to Hydra, which prints the same help, or its own error.
"""

from __future__ import annotations

import copy
import functools
import string
from collections.abc import Callable
from typing import Any

HELP_FLAGS = ("--help", "-h", "--hydra-help")
# Hydra's job name for the console script (its task function is in cli/train.py): the composed
# hydra config that --hydra-help prints names it.
JOB_NAME = "train"


def asks_for_help(args: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in args)


def print_help(args: list[str]) -> bool:
    """Print the help that `args` ask Hydra for; False (nothing printed) where Hydra is to print it."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parsed = parser.parse_args(args)  # as hydra.main parses them (its usage line and exit code 2 on a bad flag)
    other_config = parsed.config_path or parsed.config_name or parsed.config_dir or parsed.experimental_rerun
    if not (parsed.help or parsed.hydra_help) or other_config or (parsed.resolve and not parsed.help):
        return False
    try:
        text = _render(parsed, parser)
    except Exception:  # noqa: BLE001  (a config that does not compose: Hydra's own error says why)
        return False
    print(text)
    return True


def _render(parsed: Any, parser: Any) -> str:
    """Hydra.app_help's text (hydra_help's for --hydra-help), composed and filled in as it does."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from marl_llm.configure import config_dir, group_lister

    with initialize_config_dir(config_dir(), version_base="1.3", job_name=JOB_NAME):
        hydra = GlobalHydra.instance().hydra
        cfg = hydra.compose_config(config_name="config" if parsed.help else None, overrides=parsed.overrides,
                                   run_mode=RunMode.RUN)
        if parsed.help:
            HydraConfig.instance().set_config(cfg)
            help_cfg, resolve = cfg.hydra.help, parsed.resolve
            shown = hydra.get_sanitized_cfg(copy.deepcopy(cfg), "job")
        else:
            help_cfg, shown, resolve = cfg.hydra.hydra_help, hydra.get_sanitized_hydra_cfg(cfg), False
        # Hydra lists the groups of its own search path, without the command's overrides; the copy of
        # the repository is made only for a template that names a listing.
        group_options = functools.cache(lambda: group_lister(hydra.config_loader, []))
        return string.Template(help_cfg.template).substitute(_Filled({
            "FLAGS_HELP": lambda: hydra.format_args_help(parser),
            "HYDRA_CONFIG_GROUPS": lambda: _config_groups(group_options(), _is_hydra_group),
            "APP_CONFIG_GROUPS": lambda: _config_groups(group_options(), lambda g: not _is_hydra_group(g)),
            "CONFIG": lambda: _to_yaml(shown, resolve),
        }))


class _Filled(dict):
    """The template's values, each computed when the template names it (its missing names raise
    KeyError, as in Hydra's)."""

    def __init__(self, makers: dict[str, Callable[[], str]]):
        super().__init__()
        self.makers = makers

    def __missing__(self, name: str) -> str:
        self[name] = self.makers[name]()
        return self[name]


def _is_hydra_group(group: str) -> bool:
    return group.startswith("hydra/") or group == "hydra"


def _config_groups(group_options: Callable[[str, Any], list[str]], predicate: Callable[[str], bool]) -> str:
    """Hydra's format_config_groups (compact): `group: option, option` per line, sorted."""
    from hydra.core.object_type import ObjectType

    def with_configs(parent: str = "") -> list[str]:  # Hydra's list_all_config_groups
        found = []
        for child in group_options(parent, ObjectType.GROUP):
            group = f"{parent}/{child}" if parent else child
            if group_options(group, ObjectType.CONFIG):
                found.append(group)
            if group_options(group, ObjectType.GROUP):
                found += with_configs(group)
        return found

    return "".join(f"{group}: {', '.join(sorted(group_options(group, ObjectType.CONFIG)))}\n"
                   for group in sorted(g for g in with_configs() if predicate(g)))


def _to_yaml(cfg: Any, resolve: bool) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=resolve)
