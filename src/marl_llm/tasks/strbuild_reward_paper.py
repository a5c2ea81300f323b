"""StrBuild's reward as the CoLLM reference computes it (task.reward.variant=paper).

The reference (OpenMLRL/LLM_Collab_Minecraft, str_build/rewards/str_builder_reward.py over the
utilities of str_build/utils/str_builder.py, commit 9c2e006) scores one turn's joint action on
an empty wall: each agent's completion is read as command lines, its accepted `/setblock`
commands are applied in agent order (agent 1's, then agent 2's), and the wall's bounding box is
scored:

    reward = 2 * coverage - 1.5 * extra_ratio - adjacency_ratio - 0.25 * incomplete_palettes

    coverage          target cells holding a block / target cells
    extra_ratio       background cells holding a block / background cells (the box minus the target)
    adjacency_ratio   of all pairs of horizontally or vertically adjacent blocks (any cells), the
                      share whose two blocks have the same colour key (colour_key: oak_planks and
                      spruce_planks are both "wood", stone and cobblestone "stone")
    incomplete_palettes  agents not every block of whose palette is on the wall

Reading a completion: only the first fenced block when the text has one (its language tag line
dropped), each line stripped of one list marker (`1.`, `2)`, `-`, `*`); a line is a command when
its first word, after an optional leading `/`, is `setblock` in any case and it has at least four
more words: three integers (Python's int(): `+3` and `0_1` count, `~` and `^` do not) and a block
name that, stripped of a `minecraft:` prefix, is one of the agent's blocks or `air`, exactly (case
matters), inside the box [0, W-1] x [0, 4] x [0, 0]. An agent's commands past its cap (300 split
over the agents, the first taking the remainder: 150 each) are dropped; rejected lines do not
count. `air` empties a cell (a later agent can remove an earlier one's block).

What differs from marl-llm's own reward (StrBuildEnv, variant `fixed`) is listed in
docs/rewards_strbuild.md; the reference's outputs on 1,400 generated cases are
tests/fixtures/strbuild_reward_paper.jsonl.gz. No code of the reference is used here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

AIR_NAMES = frozenset({"air", "cave_air", "void_air"})
HEIGHT = 5
# The reference config's task.max_commands: the cap over all agents of one turn.
TOTAL_COMMANDS = 300

_LIST_MARKER = re.compile(r"^\s*(?:[-*]+|\d+[.)])\s*")
_FENCE_TAG = re.compile(r"^\s*[a-zA-Z0-9_-]+\s*\n")
# Colour keys: whole names first, then suffixes; any other block is its own key.
_COLOUR_OF = {"oak_planks": "wood", "oak_wood": "wood", "stone": "stone", "cobblestone": "stone",
              "smooth_stone": "stone", "stone_bricks": "stone", "white_concrete": "concrete", "obsidian": "obsidian"}
_COLOUR_SUFFIXES = (("_planks", "wood"), ("_wood", "wood"), ("_stone", "stone"), ("_stone_bricks", "stone"),
                    ("_concrete", "concrete"))

Pos = tuple[int, int, int]


def block_id(name: str) -> str:
    """A block name as the reference compares it: stripped, without one `minecraft:` prefix, case kept."""
    s = (name or "").strip()
    return s[len("minecraft:"):] if s.startswith("minecraft:") else s


def colour_key(name: str) -> str:
    """The adjacency penalty's notion of "the same block" (lower-cased, textures grouped)."""
    s = block_id(name).lower()
    if s in _COLOUR_OF:
        return _COLOUR_OF[s]
    for suffix, key in _COLOUR_SUFFIXES:
        if s.endswith(suffix):
            return key
    return s


def command_caps(num_agents: int, total: int = TOTAL_COMMANDS) -> list[int]:
    """Each agent's command cap: total // agents (at least 1), the first agent taking the remainder."""
    caps = [max(1, total // num_agents)] * num_agents
    caps[0] += total % num_agents
    return caps


def command_lines(text: str) -> list[str]:
    """The completion's candidate command lines: inside the first code fence when there is a
    whole one (its language tag dropped), stripped, one list marker removed, blank lines skipped."""
    raw = (text or "").strip()
    parts = raw.split("```") if "```" in raw else []
    if len(parts) >= 3:
        raw = _FENCE_TAG.sub("", parts[1].strip(), count=1).strip()
    lines = []
    for line in raw.splitlines():
        s = _LIST_MARKER.sub("", line.strip(), count=1).strip()
        if s:
            lines.append(s)
    return lines


def _coordinate(token: str) -> int | None:
    if token.startswith(("~", "^")):
        return None
    try:
        return int(token)
    except ValueError:
        return None


def accepted_commands(text: str, blocks: Iterable[str], width: int, cap: int) -> list[tuple[Pos, str]]:
    """The agent's commands that reach the wall, in order: (position, block), `air` included."""
    allowed = {block_id(b) for b in blocks} | {"air"}
    out: list[tuple[Pos, str]] = []
    for line in command_lines(text):
        if len(out) >= cap:
            break  # later lines are all dropped (nothing after the cap can be accepted)
        words = (line[1:].lstrip() if line.startswith("/") else line).split()
        if len(words) < 5 or words[0].lower() != "setblock":
            continue
        x, y, z = (_coordinate(w) for w in words[1:4])
        block = block_id(words[4])
        if x is None or y is None or z is None or block not in allowed:
            continue
        if 0 <= x < width and 0 <= y < HEIGHT and z == 0:
            out.append(((x, y, z), block))
    return out


def _palette(blocks: Iterable[str]) -> set[str]:
    """An agent's placeable blocks as the palette check reads them (air and blanks left out)."""
    names = {block_id(b).strip() for b in blocks}
    return {b for b in names if b and b not in AIR_NAMES}


@dataclass(frozen=True)
class PaperScore:
    """One joint action's reference score and its parts (the reference's score_str_builder)."""

    reward: float
    coverage: float
    extra_ratio: float
    adjacency_ratio: float
    incomplete_palettes: int
    covered: int
    extra_blocks: int
    target_total: int
    iou: float  # covered / (target cells + extra blocks), as the reference logs it
    wall: dict[Pos, str]  # the built cells (air removed)


def score(completions: Sequence[str], palettes: Sequence[Sequence[str]], target: frozenset[Pos] | set[Pos],
          width: int, total_commands: int = TOTAL_COMMANDS) -> PaperScore:
    """Score one turn's joint action (agent i's completion with palette i) on an empty wall of
    `width` x 5 cells whose letters are `target`."""
    wall: dict[Pos, str] = {}
    for text, blocks, cap in zip(completions, palettes, command_caps(len(palettes), total_commands)):
        for pos, block in accepted_commands(text, blocks, width, cap):
            wall[pos] = block
    wall = {p: b for p, b in wall.items() if b not in AIR_NAMES}
    target_total = len(target)
    covered = sum(1 for p in target if p in wall)
    extra = sum(1 for p in wall if p not in target)
    background = width * HEIGHT - target_total
    coverage = covered / target_total if target_total else 0.0
    extra_ratio = extra / background if background > 0 else 0.0
    colours = {p: colour_key(b) for p, b in wall.items()}
    pairs = same = 0
    for (x, y, z), colour in colours.items():
        for neighbour in ((x + 1, y, z), (x, y + 1, z)):
            if neighbour in colours:
                pairs += 1
                same += colours[neighbour] == colour
    adjacency = same / pairs if pairs else 0.0
    on_wall = set(wall.values())
    incomplete = sum(1 for blocks in palettes if not _palette(blocks) <= on_wall)
    reward = 2.0 * coverage - 1.5 * extra_ratio - 1.0 * adjacency - 0.25 * float(incomplete)
    union = target_total + extra
    return PaperScore(reward, coverage, extra_ratio, adjacency, incomplete, covered, extra, target_total,
                      covered / union if union > 0 else 0.0, wall)
