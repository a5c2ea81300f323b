"""Where a base model comes from (model.path, model.hub_id, model.embedded, model.agent_bases), and
the checks of it that need no torch: a dir that is no Hugging Face checkpoint, a file, a path that
does not exist, a hub id that is neither in the local Hugging Face cache nor reachable.

Light on purpose (no torch, no transformers): models/loading.py loads from what these return, and
the console script runs `check_sources` before it imports the trainer (marl_llm/preflight.py), so
that a wrong model setting is refused in about a second rather than after the imports.
"""

from __future__ import annotations

import os
import re
from typing import Any

from marl_llm.config import UserError

# The spec of the embedded default model (model.embedded=true, or an agent_bases entry).
EMBEDDED = "embedded"
# What the hub accepts as a model id: `org/name` or a bare `name`. Anything else that is no local
# directory (./x, ../x, /x, ~/x, a/b/c, a name with spaces) is a path that does not exist.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
# A checkpoint dir's tokenizer has at least one of these (fast, sentencepiece, BPE, WordPiece; a
# remote-code tokenizer names its own files in tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
EMBEDDED_FIX = "or use the embedded default model (model=smollm2_135m)"


def check_checkpoint_dir(path: str, what: str) -> None:
    """Refuse a dir that is not a Hugging Face checkpoint before transformers fails on it with a
    tokenizer traceback; `what` names the setting, e.g. model.path='/x'."""
    missing = [] if os.path.isfile(os.path.join(path, "config.json")) else ["config.json"]
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        missing.append(f"tokenizer files ({', '.join(TOKENIZER_FILES)})")
    if missing:
        raise UserError(f"{what} is not a Hugging Face checkpoint directory: it has no {' and no '.join(missing)}. "
                        f"Point it at the directory that save_pretrained wrote the model and its tokenizer to, "
                        f"{EMBEDDED_FIX}")


def base_spec(spec: str | None, cfg: Any) -> tuple[str, str]:
    """(the spec, the setting it came from) of one base model: `spec` is a model.agent_bases entry,
    or None for the model section's own (model.path, else model.embedded, else model.hub_id)."""
    if spec is not None:
        return spec, f"model.agent_bases entry {spec!r}"
    if cfg.path:
        return cfg.path, f"model.path={cfg.path!r}"
    if cfg.embedded:
        return EMBEDDED, "model.embedded=true"
    return cfg.hub_id, f"model.hub_id={cfg.hub_id!r}"


def local_or_hub(spec: str, what: str) -> tuple[str, bool]:
    """(what to pass to from_pretrained, is it local) for a spec other than the embedded model: a
    local dir (checked), or a hub id (model.hub_id always; model.path and model.agent_bases entries
    only in the hub's org/name form, else a path that must exist)."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        check_checkpoint_dir(path, what)
        return path, True
    if what.startswith("model.hub_id"):
        return spec, False
    if os.path.exists(path):
        raise UserError(f"{what} is a file: pass the directory of a Hugging Face checkpoint (the one with "
                        f"config.json), {EMBEDDED_FIX}")
    if HUB_ID.fullmatch(spec) is None:
        raise UserError(f"{what}: no such directory ({os.path.abspath(path)}): pass model.path=<dir of a Hugging Face "
                        f"checkpoint> or model.hub_id=<org/name> for a hub model, {EMBEDDED_FIX}")
    return spec, False


def not_in_cache_error(source: str, what: str, offline: str) -> UserError:
    """A hub model that is not in the local cache while the hub is not reachable (`offline`: why)."""
    # model.path / agent_bases in the org/name form: it may have been meant as a local dir.
    not_local = "" if what.startswith("model.hub_id") else f" (no local directory {os.path.abspath(source)} either)"
    return UserError(f"model {source!r}{not_local} is not in the local Hugging Face cache and the hub is not "
                     f"reachable ({offline}): download it where the hub is reachable and pass "
                     f"model.path=<its local dir>, {EMBEDDED_FIX}")


def in_hub_cache(repo_id: str) -> bool:
    """The hub model's config.json is in the local Hugging Face cache (its default revision)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id: from_pretrained says what is wrong with it
        return True


def bases(model_cfg: Any) -> list[str | None]:
    """The base specs a run loads (models/policies.py): one per model.agent_bases entry, else the
    model section's own (None)."""
    return [str(s) for s in model_cfg.agent_bases] if model_cfg.get("agent_bases") else [None]


def check_sources(model_cfg: Any) -> None:
    """Refuse, before any import of torch, what loading the run's base models would refuse at
    once: a local dir that is no checkpoint, a file, a path that does not exist, a hub id neither
    cached nor reachable (the same lines as models.loading.load_base). The embedded model is left
    to the run (converted once, on first use)."""
    from marl_llm.tasks.data import hub_offline_reason

    for spec in bases(model_cfg):
        spec, what = base_spec(spec, model_cfg)
        if spec == EMBEDDED:
            continue
        source, local = local_or_hub(spec, what)
        if local or in_hub_cache(source):
            continue
        offline = hub_offline_reason(("HF_HUB_OFFLINE",))  # a probe of the hub, seconds at most
        if offline:
            raise not_in_cache_error(source, what, offline)
