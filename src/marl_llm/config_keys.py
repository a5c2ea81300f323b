"""Dotted config keys against the schemas, before Hydra composes: which schema each group's option
has, and what a key names in it ("ok", a free-form map, unknown with a "did you mean", or not
checkable here). The CLI checks its overrides with it, configure marks map keys for `++`, and a
resume asks whether a changed key still exists. Light (no torch), as config.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict

from marl_llm.config import SHARED_SCHEMAS
from marl_llm.registry import SCHEMAS
from marl_llm.tool_names import other_tools_name


def chosen_schemas(args: list[str]) -> tuple[dict[str, Any], bool]:
    """Top-level schema per config group for these overrides (None for an option whose schema is
    not registered), and whether a preset is chosen (experiment=, sweep=)."""
    chosen = {"algo": "magrpo", "task": "humaneval"}
    for a in args:
        group, _, option = a.partition("=")
        if group in chosen:
            chosen[group] = option
    schemas: dict[str, Any] = dict(SHARED_SCHEMAS)
    schemas["algo"] = SCHEMAS["algo"].get(chosen["algo"])
    schemas["task"] = SCHEMAS["task"].get(chosen["task"])
    return schemas, any(a.startswith(("experiment=", "sweep=")) for a in args)


def walk_key(key: str, schemas: dict[str, Any], preset: bool) -> tuple[str, Any, str | None]:
    """Follow a dotted key through the schemas: ("ok" | "map" | "unknown" | "skip", its type, error)."""
    parts = key.split(".")
    head = parts[0]
    if head not in schemas or (preset and head in ("algo", "task")):
        return "skip", None, None
    schema, path = schemas[head], head
    for part in parts[1:]:
        if typing.get_origin(schema) is dict or schema in (dict, Dict):
            return "map", schema, None
        if schema is None or not dataclasses.is_dataclass(schema):
            return "skip", None, None
        names = [f.name for f in dataclasses.fields(schema)]
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1)
            known = other_tools_name(part, lambda k: k.startswith("hydra.") or "." not in k
                                     or walk_key(k, schemas, False)[0] in ("ok", "map"))
            hint = known or (f" Did you mean {path}.{close[0]}?" if close else "")
            return "unknown", None, (f"unknown config key {path}.{part} ({schema.__name__}).{hint} "
                                     f"Valid keys of {path}: {', '.join(names)}")
        schema = typing.get_type_hints(schema).get(part)
        if typing.get_origin(schema) is typing.Union:  # Optional[Dict[...]]
            schema = next((t for t in typing.get_args(schema) if t is not type(None)), schema)
        path = f"{path}.{part}"
    return ("map" if typing.get_origin(schema) is dict else "ok"), schema, None
