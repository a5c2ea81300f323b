"""Parsing action lists out of model output. Models write anything, so parsing never raises:
malformed output gives an empty list (the environment then sees no move) and a reason."""

from __future__ import annotations

import json
import re

from marl_llm.envs.base import MOVES

_WORDS = {"U": "U", "UP": "U", "D": "D", "DOWN": "D", "L": "L", "LEFT": "L", "R": "R", "RIGHT": "R"}
_FINAL = re.compile(r"^\s*####\s*(.*)$", re.MULTILINE)
MAX_ACTIONS = 200


def normalize(tokens: list[object]) -> list[str] | None:
    """["up", "R", "Left"] -> ["U", "R", "L"]; None if any token is not a move."""
    out = []
    for tok in tokens:
        move = _WORDS.get(str(tok).strip().upper())
        if move is None:
            return None
        out.append(move)
    return out


def parse_action_list(text: str) -> tuple[list[str], str | None]:
    """A list of moves from `text`: a JSON list (["U","R"]) or a comma/space separated sequence of
    U/D/L/R/up/down/left/right. Returns (moves, None) or ([], reason). At most MAX_ACTIONS."""
    text = (text or "").strip().strip("`").strip()
    if not text:
        return [], "no actions"
    m = re.search(r"\[[^\[\]]*\]", text)
    if m:
        try:
            value = json.loads(m.group(0).replace("'", '"'))
        except json.JSONDecodeError:
            value = None
        if isinstance(value, list):
            moves = normalize(value)
            if moves is None:
                return [], f"not a list of moves: {m.group(0)[:80]}"
            return moves[:MAX_ACTIONS], None
    tokens = [t for t in re.split(r"[\s,;]+", text.strip("[]()")) if t]
    moves = normalize(tokens)
    if moves is None or not moves:
        return [], f"no action list found in: {text[:80]!r}"
    return moves[:MAX_ACTIONS], None


def parse_final_actions(text: str) -> tuple[list[str], str | None]:
    """The plan agent's answer: the moves on its last line starting with `####`."""
    found = _FINAL.findall(text or "")
    if not found:
        return [], "no line starting with ####"
    return parse_action_list(found[-1])


assert set(_WORDS.values()) == set(MOVES)
