"""transformers' KV-cache argument, across the versions marl-llm supports.

transformers 5.24 renamed a model's cache argument and output field from `past_key_values` to
`cache`: `model(..., cache=c)` and `out.cache`. The old name still works there but warns (a
FutureWarning per call site and a logged line) and goes away in 5.40; before 5.24 only the old
name exists (the GPU kit's machine has 5.17). Which name this transformers uses is read once,
from the fields of its causal-LM output class, and every call here goes through it:

    out = model(input_ids=ids, use_cache=True, **cache_kwargs(None))
    cache = output_cache(out)
    out = model(input_ids=next_ids, use_cache=True, **cache_kwargs(cache))

Tested on transformers 5.24 (the name `cache`) and 5.17 (`past_key_values`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

_NAME: list[str] = []  # read once (a plain global, not functools.cache: the compiled decode step calls it)


def cache_name() -> str:
    """"cache" where transformers has renamed the cache argument (5.24 on), else "past_key_values"."""
    if not _NAME:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
        _NAME.append("cache" if "cache" in fields else "past_key_values")
    return _NAME[0]


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to a model's forward (nothing for None)."""
    return {} if cache is None else {cache_name(): cache}


def output_cache(out: Any) -> Any:
    """The KV cache a forward pass returned (None when it kept none)."""
    return getattr(out, cache_name(), None)


def call_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a forward hook's keyword arguments carry, under either name."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache
