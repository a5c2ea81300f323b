"""StrBuild: two agents spell a string in 5x5 block letters with Minecraft-style commands.

A text-only re-creation of the CoLLM StrBuild domain (no Minecraft involved). The target string
(uppercase letters and spaces) is drawn with the 5x5 bitmap font `FONT` on a vertical 2-D wall:

* letters go left to right, 5 columns each, with `letter_gap` empty columns between letters
  (default GAP = 1; the CoLLM reference's configs leave 2, `dataset.spacing: 2`), so letter `i`
  occupies x = (5+g)*i .. (5+g)*i+4 and the wall is W = (5+g)*n - g columns wide for n
  characters (g = letter_gap; with g = 1: x = 6*i .. 6*i+4, W = 6*n - 1);
* x is the column (0..W-1, left to right), y the height (0 = bottom row .. 4 = top row; bitmap
  row r maps to y = 4 - r), z is always 0;
* in-bounds cells are 0 <= x < W, 0 <= y < 5, z == 0; anything else is rejected.

Each agent owns a palette of block names (palettes are disjoint). On its turn an agent writes
text; every line `/setblock <x> <y> <z> <block>` (see `parse_commands`) is a command, applied in
order to the shared state (a dict (x, y, z) -> block). A command is rejected (not applied) when
malformed, out of bounds, or when its block is not in the agent's palette; the block `air`
removes whatever is at the position (any agent may remove any block).

After both agents acted, `end_turn()` scores the state (reward of the turn):

    reward = 2 * coverage - 1.5 * extra_ratio - adjacency_ratio - 0.25 * absent_agents

* coverage      = |built & target| / |target|
* extra_ratio   = |built - target| / |target|
* adjacency_ratio: the paper only names an "adjacency" term. Our interpretation: among all
  4-neighbour pairs (horizontal or vertical) of cells that are both target cells and both
  built, the fraction whose two blocks are the SAME block type (0 when there is no such pair).
  It rewards alternating materials between neighbours, i.e. real collaboration of the two
  agents (a checkerboard of the two agents' blocks scores 0).
* absent_agents = number of agents none of whose palette blocks appears anywhere in the build.

success = coverage >= success_coverage and extra_ratio <= success_max_extra; the episode is
done on success (unless `end_on_success=False`) or when `max_turns` turns have been ended. The
CoLLM reference's own reward differs in several ways (tasks/strbuild_reward_paper.py). `step` / `end_turn` after the end
of the episode raise RuntimeError. All state lives in plain attributes (`copy.deepcopy` works).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

# 5x5 bitmap font: each glyph is 5 rows (top to bottom) of 5 chars, '#' filled, '.' empty.
FONT: dict[str, tuple[str, ...]] = {
    "A": (".###.", "#...#", "#####", "#...#", "#...#"),
    "B": ("####.", "#...#", "####.", "#...#", "####."),
    "C": (".####", "#....", "#....", "#....", ".####"),
    "D": ("####.", "#...#", "#...#", "#...#", "####."),
    "E": ("#####", "#....", "####.", "#....", "#####"),
    "F": ("#####", "#....", "####.", "#....", "#...."),
    "G": (".####", "#....", "#..##", "#...#", ".###."),
    "H": ("#...#", "#...#", "#####", "#...#", "#...#"),
    "I": ("#####", "..#..", "..#..", "..#..", "#####"),
    "J": ("#####", "...#.", "...#.", "#..#.", ".##.."),
    "K": ("#...#", "#..#.", "###..", "#..#.", "#...#"),
    "L": ("#....", "#....", "#....", "#....", "#####"),
    "M": ("#...#", "##.##", "#.#.#", "#...#", "#...#"),
    "N": ("#...#", "##..#", "#.#.#", "#..##", "#...#"),
    "O": (".###.", "#...#", "#...#", "#...#", ".###."),
    "P": ("####.", "#...#", "####.", "#....", "#...."),
    "Q": (".###.", "#...#", "#.#.#", "#..#.", ".##.#"),
    "R": ("####.", "#...#", "####.", "#..#.", "#...#"),
    "S": (".####", "#....", ".###.", "....#", "####."),
    "T": ("#####", "..#..", "..#..", "..#..", "..#.."),
    "U": ("#...#", "#...#", "#...#", "#...#", ".###."),
    "V": ("#...#", "#...#", "#...#", ".#.#.", "..#.."),
    "W": ("#...#", "#...#", "#.#.#", "##.##", "#...#"),
    "X": ("#...#", ".#.#.", "..#..", ".#.#.", "#...#"),
    "Y": ("#...#", ".#.#.", "..#..", "..#..", "..#.."),
    "Z": ("#####", "...#.", "..#..", ".#...", "#####"),
    " ": (".....", ".....", ".....", ".....", "....."),
}

GLYPH = 5          # glyph width and height
GAP = 1            # empty columns between letters (the default letter_gap)
HEIGHT = GLYPH
MAX_COMMANDS = 500
LIST_CAP = 40      # entries per list in feedback()
AIR = "air"

DEFAULT_PALETTES = (("red_wool", "orange_wool", "yellow_wool"),
                    ("blue_wool", "cyan_wool", "purple_wool"))

Pos = tuple[int, int, int]


class Command(NamedTuple):
    x: int
    y: int
    z: int
    block: str   # lower-case, without a "minecraft:" prefix ("air" = remove)
    line: str    # the source line, stripped


_SETBLOCK = re.compile(r"^/setblock(?:\s+(.*))?$", re.IGNORECASE)
_INT = re.compile(r"^[+-]?\d+$")
_BLOCK = re.compile(r"^[a-z0-9_]+$")


def parse_commands(text: str) -> tuple[list[Command], list[tuple[str, str]]]:
    """Parse `/setblock x y z block` lines out of free text.

    Returns (commands, errors); errors are (line, reason). Lines are stripped (also of
    surrounding backticks); empty lines and lines not starting with '/' are ignored (prose).
    A line starting with '/' that is not a well-formed setblock command is an error. Block names
    are case-insensitive and may carry a `minecraft:` prefix. At most MAX_COMMANDS commands are
    returned; the rest is reported as one error. Never raises.
    """
    commands: list[Command] = []
    errors: list[tuple[str, str]] = []
    overflow = 0
    if not isinstance(text, str):
        return commands, [(repr(text)[:80], "input is not text")]
    for raw in text.splitlines():
        line = raw.strip().strip("`").strip()
        if not line.startswith("/"):
            continue
        m = _SETBLOCK.match(line)
        if m is None:
            cmd = line.split()[0] if line.split() else line
            errors.append((line, f"unsupported command {cmd!r} (only /setblock x y z block)"))
            continue
        args = (m.group(1) or "").split()
        if len(args) != 4:
            errors.append((line, f"expected 4 arguments (x y z block), got {len(args)}"))
            continue
        bad = [a for a in args[:3] if not _INT.match(a)]
        if bad:
            errors.append((line, f"coordinate {bad[0]!r} is not an integer"))
            continue
        block = args[3].lower()
        block = block.removeprefix("minecraft:")
        if not _BLOCK.match(block):
            errors.append((line, f"invalid block name {args[3]!r}"))
            continue
        if len(commands) >= MAX_COMMANDS:
            overflow += 1
            continue
        x, y, z = (int(a) for a in args[:3])
        commands.append(Command(x, y, z, block, line))
    if overflow:
        errors.append(("", f"command cap of {MAX_COMMANDS} reached; {overflow} more ignored"))
    return commands, errors


def _capped(items: list[str], cap: int = LIST_CAP) -> str:
    if not items:
        return "none"
    text = ", ".join(items[:cap])
    if len(items) > cap:
        text += f" ... and {len(items) - cap} more"
    return text


def _fmt(p: Pos) -> str:
    return f"({p[0]},{p[1]},{p[2]})"


@dataclass
class TurnResult:
    reward: float
    coverage: float
    extra_ratio: float
    adjacency_ratio: float
    absent_agents: int
    success: bool
    done: bool
    turn: int = 0                       # number of turns ended so far (1 after the first)
    info: dict = field(default_factory=dict)


class StrBuildEnv:
    def __init__(self, target: str,
                 palettes: tuple[tuple[str, ...], ...] = DEFAULT_PALETTES,
                 max_turns: int = 4, success_coverage: float = 0.95,
                 success_max_extra: float = 0.05, letter_gap: int = GAP, end_on_success: bool = True):
        if not isinstance(target, str):
            raise TypeError("target must be a string")
        for ch in target:
            if ch not in FONT:
                raise ValueError(f"target may contain only uppercase letters A-Z and spaces; "
                                 f"got {ch!r}")
        if not target.strip():
            raise ValueError("target must contain at least one letter")
        pals = tuple(tuple(b.lower().removeprefix("minecraft:") for b in p) for p in palettes)
        if not pals or any(not p for p in pals):
            raise ValueError("need at least one agent, each with a non-empty palette")
        seen: set[str] = set()
        for p in pals:
            if AIR in p:
                raise ValueError("'air' cannot be in a palette (it is the remove command)")
            if seen & set(p):
                raise ValueError(f"palettes must be disjoint; shared: {sorted(seen & set(p))}")
            seen |= set(p)
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if isinstance(letter_gap, bool) or not isinstance(letter_gap, int) or letter_gap < 0:
            raise ValueError(f"letter_gap must be an integer >= 0, got {letter_gap!r}")
        self.target = target
        self.palettes = pals
        self.n_agents = len(pals)
        self.max_turns = max_turns
        self.success_coverage = success_coverage
        self.success_max_extra = success_max_extra
        self.letter_gap = letter_gap
        # False: success is reported but does not end the episode (only max_turns does), as in
        # the CoLLM reference, whose episodes end at the horizon or the trainer's early termination.
        self.end_on_success = end_on_success
        self.width = len(target) * (GLYPH + letter_gap) - letter_gap
        self._target = self._compute_target()
        self.state: dict[Pos, str] = {}
        self.turn = 0
        self.done = False
        self.success = False
        self.pending_rejected: list[list[tuple[str, str]]] = [[] for _ in pals]
        self.last_rejected: list[list[tuple[str, str]]] = [[] for _ in pals]
        self.last_result: TurnResult | None = None

    # ----- geometry -------------------------------------------------------------------------
    def _compute_target(self) -> frozenset[Pos]:
        cells = set()
        for i, ch in enumerate(self.target):
            x0 = i * (GLYPH + self.letter_gap)
            for r, row in enumerate(FONT[ch]):
                for c, v in enumerate(row):
                    if v == "#":
                        cells.add((x0 + c, HEIGHT - 1 - r, 0))
        return frozenset(cells)

    def target_cells(self) -> frozenset[Pos]:
        return self._target

    def in_bounds(self, x: int, y: int, z: int) -> bool:
        return 0 <= x < self.width and 0 <= y < HEIGHT and z == 0

    def owner(self, block: str) -> int | None:
        for i, p in enumerate(self.palettes):
            if block in p:
                return i
        return None

    # ----- acting ---------------------------------------------------------------------------
    def step(self, agent: int, text: str) -> dict:
        """Parse `text` and apply agent `agent`'s commands in order.

        Returns {"applied": [Command], "rejected": [(line, reason)]}; parse errors are included
        among the rejections. Rejections are also kept for this agent's next feedback().
        """
        if self.done:
            raise RuntimeError("episode is over")
        if not 0 <= agent < self.n_agents:
            raise ValueError(f"agent must be in 0..{self.n_agents - 1}")
        commands, errors = parse_commands(text)
        applied: list[Command] = []
        rejected: list[tuple[str, str]] = list(errors)
        palette = self.palettes[agent]
        for cmd in commands:
            if not self.in_bounds(cmd.x, cmd.y, cmd.z):
                rejected.append((cmd.line, (f"out of bounds (need 0<=x<{self.width}, "
                                            f"0<=y<{HEIGHT}, z=0)")))
                continue
            pos = (cmd.x, cmd.y, cmd.z)
            if cmd.block == AIR:
                self.state.pop(pos, None)
            elif cmd.block in palette:
                self.state[pos] = cmd.block
            else:
                rejected.append((cmd.line, (f"block {cmd.block!r} is not in your palette "
                                            f"{list(palette)}")))
                continue
            applied.append(cmd)
        self.pending_rejected[agent].extend(rejected)
        return {"applied": applied, "rejected": rejected}

    # ----- scoring --------------------------------------------------------------------------
    def same_block_pairs(self) -> list[tuple[Pos, Pos]]:
        return [(a, b) for a, b in self._target_pairs() if self.state[a] == self.state[b]]

    def _target_pairs(self) -> list[tuple[Pos, Pos]]:
        """4-neighbour pairs (each once) of cells that are both built and both target."""
        pairs = []
        for (x, y, z) in sorted(self._target):
            if (x, y, z) not in self.state:
                continue
            for nb in ((x + 1, y, z), (x, y + 1, z)):
                if nb in self._target and nb in self.state:
                    pairs.append(((x, y, z), nb))
        return pairs

    def metrics(self) -> dict:
        built = set(self.state)
        n_target = len(self._target)
        coverage = len(built & self._target) / n_target
        extra_ratio = len(built - self._target) / n_target
        pairs = self._target_pairs()
        same = sum(1 for a, b in pairs if self.state[a] == self.state[b])
        adjacency_ratio = same / len(pairs) if pairs else 0.0
        used = set(self.state.values())
        absent = sum(1 for p in self.palettes if not used & set(p))
        reward = 2 * coverage - 1.5 * extra_ratio - adjacency_ratio - 0.25 * absent
        success = coverage >= self.success_coverage and extra_ratio <= self.success_max_extra
        return {"reward": reward, "coverage": coverage, "extra_ratio": extra_ratio,
                "adjacency_ratio": adjacency_ratio, "absent_agents": absent,
                "success": success}

    def end_turn(self) -> TurnResult:
        if self.done:
            raise RuntimeError("episode is over")
        m = self.metrics()
        self.turn += 1
        self.success = m["success"]
        self.done = (self.success and self.end_on_success) or self.turn >= self.max_turns
        self.last_rejected = self.pending_rejected
        self.pending_rejected = [[] for _ in range(self.n_agents)]
        self.last_result = TurnResult(done=self.done, turn=self.turn, **m)
        return self.last_result

    # ----- observations ---------------------------------------------------------------------
    def target_ascii(self) -> str:
        rows = []
        for y in range(HEIGHT - 1, -1, -1):
            cells = "".join("#" if (x, y, 0) in self._target else "." for x in range(self.width))
            rows.append(f"y={y} {cells}")
        return "\n".join(rows)

    def _x_ruler(self) -> str:
        return "x:  " + "".join(str(x % 10) for x in range(self.width))

    def block_letters(self) -> dict[str, str]:
        """Letter used by render() for each palette block: A, B, C, ... in palette order."""
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        blocks = [b for p in self.palettes for b in p]
        return {b: (letters[i] if i < len(letters) else "?") for i, b in enumerate(blocks)}

    def render(self) -> str:
        """ASCII of the current build, top row (y=4) first, x left to right.

        A built block shows its letter from `block_letters()` (uppercase on a target cell,
        lowercase off target = extra block); '+' is a target cell not built yet; '.' is an
        empty non-target cell. A legend line follows.
        """
        letters = self.block_letters()
        rows = []
        for y in range(HEIGHT - 1, -1, -1):
            row = []
            for x in range(self.width):
                pos = (x, y, 0)
                if pos in self.state:
                    ch = letters[self.state[pos]]
                    row.append(ch if pos in self._target else ch.lower())
                else:
                    row.append("+" if pos in self._target else ".")
            rows.append(f"y={y} " + "".join(row))
        rows.append(self._x_ruler())
        legend = ", ".join(f"{v}={k}" for k, v in letters.items() if k in self.state.values())
        rows.append(f"Legend: {legend} (lowercase: off target), + target not built, . empty")
        return "\n".join(rows)

    def feedback(self, agent: int) -> str:
        """Agent `agent`'s observation: its palette, the target wall, the build so far and what is
        wrong with it (kept short: it is part of every prompt)."""
        m = self.metrics()
        built = set(self.state)
        missing = sorted(self._target - built, key=lambda p: (p[0], p[1]))
        extra = sorted(built - self._target, key=lambda p: (p[0], p[1]))
        same = [f"{_fmt(a)}-{_fmt(b)} ({self.state[a]})" for a, b in self.same_block_pairs()]
        rejected = [f"{line or '(cap)'} -> {reason}" for line, reason in self.last_rejected[agent]]
        palette = self.palettes[agent]
        lines = [
            f"Your blocks: {', '.join(palette)} ('air' removes a block).",
            (f"Target {self.target!r}: a block on every '#' (x = column 0..{self.width - 1}, y = row 0 (bottom) .. "
             f"{HEIGHT - 1} (top), z = 0):"),
            self.target_ascii(),
            self._x_ruler(),
        ]
        if self.state:
            lines += [f"Turn {self.turn}/{self.max_turns}. Built so far:", self.render()]
        else:
            lines.append(f"Turn {self.turn}/{self.max_turns}. Nothing built yet.")
        lines += [
            f"Missing target positions ({len(missing)}): {_capped([_fmt(p) for p in missing])}",
            f"Extra non-target blocks ({len(extra)}): {_capped([_fmt(p) for p in extra])}",
            f"Adjacent target blocks of the same type ({len(same)}): {_capped(same)}",
            f"Your rejected commands last turn ({len(rejected)}): {_capped(rejected)}",
            (f"coverage={m['coverage']:.2f} extra_ratio={m['extra_ratio']:.2f} "
             f"adjacency_ratio={m['adjacency_ratio']:.2f} absent_agents={m['absent_agents']}"),
        ]
        return "\n".join(lines)
