"""Stop rules: where a completion ends besides its end-of-sequence token (`algo.sampling.stop`).

A rule reads the completion's text so far and returns the character index where the completion
ends, or None while it goes on. The decode loop asks it every few tokens (rollout/decode.py: at
each of its compaction checks, so a stopped row leaves the batch) and the completion is then cut
(`cut_at_stop`): its ids through the token that reached the end, its text up to the end exactly
(as vLLM's stop strings cut the text but keep the token). The rule's cut also applies to vLLM's
completions (trainer.rollout=vllm), after they are generated.

    code    the end of the first fenced code block (its closing ```), or else of the first top-level
            function: after a `def` at column 0 and an indented body, the first non-empty line at
            column 0 (a second def, a test call, a print, prose, a closing fence) ends it, unwritten.

Register your own with `@register_stop_rule("name")` on a function `text -> int | None`.
Light on purpose (no torch): config validation reads STOP_RULES.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from marl_llm.registry import registrar

StopRule = Callable[[str], "int | None"]

STOP_RULES: dict[str, StopRule] = {}

# `@register_stop_rule("name")` on `fn(text) -> end index | None`: chosen with algo.sampling.stop=name.
register_stop_rule = registrar(STOP_RULES, "stop rule")

_DEF = re.compile(r"(?:async[ \t]+)?def[ \t]")


@register_stop_rule("code")
def code_end(text: str) -> int | None:
    """The end of the first fenced block (after its closing ```) or top-level function (the start
    of the first non-empty column-0 line after its indented body); None while neither has ended."""
    state, pos = "before", 0  # before -> fence | header -> body
    for line in text.splitlines(keepends=True):
        start, pos = pos, pos + len(line)
        stripped = line.strip()
        if state == "fence":
            if stripped.startswith("```"):
                return start + line.index("```") + 3
        elif state == "before":
            if stripped.startswith("```"):
                state = "fence"
            elif _DEF.match(line):
                state = "header"
        elif line[:1] in (" ", "\t"):
            if stripped:
                state = "body"
        elif stripped and state == "body":
            return start
    return None


def stop_position(rule: str | None, text: str) -> int | None:
    """Where `rule` ends `text` (None: no rule, or not yet)."""
    if rule is None:
        return None
    try:
        fn = STOP_RULES[rule]
    except KeyError:
        raise ValueError(f"unknown stop rule {rule!r}; registered: {sorted(STOP_RULES)}") from None
    return fn(text)


def cut_at_stop(tokenizer: Any, ids: list[int], rule: str | None) -> tuple[int, str] | None:
    """(the number of ids through the token that reaches the rule's end, the text up to that end),
    or None when the rule does not end the completion. The prefix is found by bisection over the
    decoded prefixes (a prefix's text only grows with its length)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    end = stop_position(rule, text)
    if end is None:
        return None
    lo, hi = 1, len(ids)  # the shortest prefix whose text reaches `end`
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo, text[:end]
