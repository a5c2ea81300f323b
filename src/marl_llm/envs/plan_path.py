"""Plan-Path: walk from a start cell to a goal cell on a grid with random walls.

Level generation (`reset(seed)`) draws everything from `random.Random(seed)`: each cell of a
size×size grid is a wall with probability `wall_prob`; start and goal are two distinct free cells
with the goal reachable from the start (BFS). An unreachable pair is redrawn on the same grid a few
times, then the grid itself is redrawn (same Random stream, so still deterministic per seed).

Rewards, per move applied:
- valid move: −0.01 + 1.0·(0.99·φ' − φ), φ = −Manhattan(pos, goal);
- invalid move (off the grid or into a wall): −0.1; the position is unchanged (no shaping term,
  since nothing moved), and the move still counts toward the move cap;
- reaching the goal: +1, and +0.5 more when the moves taken so far in the episode (invalid ones
  included) equal the BFS length from the start; the episode ends with success;
- reaching `max_moves` moves without the goal: the episode ends, never a success.
Moves after the episode has ended are ignored.

Coordinates are (row, column), 0-based; "U" decreases the row, "R" increases the column (MOVES).
"""

from __future__ import annotations

import random
from collections import deque

from marl_llm.envs.base import MOVES, GridEnv, StepResult

Pos = tuple[int, int]

LEGEND = "Legend: # wall, . free, S start, G goal, @ you. Moves: U (row-1), D (row+1), L (col-1), R (col+1)."


class PlanPathEnv(GridEnv):
    STEP_PENALTY = 0.01
    INVALID_PENALTY = 0.1
    SHAPING_SCALE = 1.0
    GAMMA = 0.99
    GOAL_REWARD = 1.0
    OPTIMAL_BONUS = 0.5
    PAIR_TRIES = 20  # start/goal draws per grid before the grid is redrawn

    def __init__(self, size: int = 10, wall_prob: float = 0.22, max_moves: int = 100):
        if size < 2:
            raise ValueError(f"size must be >= 2, got {size}")
        if not 0.0 <= wall_prob < 1.0:
            raise ValueError(f"wall_prob must be in [0, 1), got {wall_prob}")
        if max_moves < 1:
            raise ValueError(f"max_moves must be >= 1, got {max_moves}")
        self.size = size
        self.wall_prob = wall_prob
        self.max_moves = max_moves
        self.rows = size
        self.cols = size
        self.seed: int | None = None
        self.walls: frozenset[Pos] = frozenset()
        self.start: Pos = (0, 0)
        self.goal: Pos = (0, 0)
        self.start_optimal: int | None = None  # BFS length from the start
        self._dist: dict[Pos, int] = {}  # BFS distance to the goal of every cell that can reach it
        self._fixed: tuple | None = None  # (walls, start, goal) of a hand-made map (from_ascii)
        self._ready = False  # reset() has been called
        self._begin_episode()

    # ------------------------------------------------------------------ level generation
    def reset(self, seed: int) -> None:
        """Generate the level of `seed`. A hand-made map (from_ascii) is restored instead; seed is kept."""
        self.seed = seed
        if self._fixed is not None:
            self.walls, self.start, self.goal = self._fixed
        else:
            self.walls, self.start, self.goal = self._generate(random.Random(seed))
        self._dist = self._bfs_from(self.goal)
        self.start_optimal = self._dist.get(self.start)
        self._ready = True
        self._begin_episode()

    def _generate(self, rng: random.Random) -> tuple[frozenset[Pos], Pos, Pos]:
        n = self.size
        while True:
            walls = frozenset((r, c) for r in range(n) for c in range(n) if rng.random() < self.wall_prob)
            free = [(r, c) for r in range(n) for c in range(n) if (r, c) not in walls]
            if len(free) < 2:
                continue
            for _ in range(self.PAIR_TRIES):
                start, goal = rng.sample(free, 2)
                if self._reachable(walls, start, goal):
                    return walls, start, goal

    def _reachable(self, walls: frozenset[Pos], a: Pos, b: Pos) -> bool:
        seen = {a}
        queue = deque([a])
        while queue:
            cur = queue.popleft()
            if cur == b:
                return True
            for nxt in self._neighbours(cur, walls):
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        return False

    def _neighbours(self, pos: Pos, walls: frozenset[Pos]):
        r, c = pos
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < self.rows and 0 <= nc < self.cols and (nr, nc) not in walls:
                yield (nr, nc)

    def _bfs_from(self, src: Pos) -> dict[Pos, int]:
        dist = {src: 0}
        queue = deque([src])
        while queue:
            cur = queue.popleft()
            for nxt in self._neighbours(cur, self.walls):
                if nxt not in dist:
                    dist[nxt] = dist[cur] + 1
                    queue.append(nxt)
        return dist

    def _begin_episode(self) -> None:
        self.pos: Pos = self.start
        self.moves = 0  # moves applied this episode, invalid ones included
        self.valid_moves = 0
        self.invalid_moves = 0
        self.actions_taken: list[str] = []
        self.path: list[Pos] = [self.start]  # positions visited (start included; unchanged on invalid)
        self.total_reward = 0.0
        self._done = False
        self._success = False
        self.reached_optimally = False

    @classmethod
    def from_ascii(cls, rows: list[str] | str, max_moves: int = 100) -> PlanPathEnv:
        """A hand-made map: `#` wall, `.` free, `S` start, `G` goal (exactly one each; rectangular
        maps allowed). The goal need not be reachable (then optimal_length() is None)."""
        if isinstance(rows, str):
            rows = [line for line in rows.strip("\n").splitlines()]
        rows = [line.strip() for line in rows if line.strip()]
        if not rows or len({len(line) for line in rows}) != 1:
            raise ValueError("from_ascii needs a non-empty rectangular map")
        walls, starts, goals = set(), [], []
        for r, line in enumerate(rows):
            for c, ch in enumerate(line):
                if ch == "#":
                    walls.add((r, c))
                elif ch == "S":
                    starts.append((r, c))
                elif ch == "G":
                    goals.append((r, c))
                elif ch != ".":
                    raise ValueError(f"unknown map character {ch!r} at ({r}, {c})")
        if len(starts) != 1 or len(goals) != 1:
            raise ValueError(f"need exactly one S and one G, got {len(starts)} and {len(goals)}")
        env = cls(size=max(2, max(len(rows), len(rows[0]))), wall_prob=0.0, max_moves=max_moves)
        env.rows, env.cols = len(rows), len(rows[0])
        env._fixed = (frozenset(walls), starts[0], goals[0])
        env.reset(0)
        return env

    def copy(self) -> PlanPathEnv:
        """An independent episode state. The level (walls frozenset, BFS table, fixed map) is never
        mutated in place (reset rebinds it), so it is shared; the episode's lists are copied."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.actions_taken = list(self.actions_taken)
        new.path = list(self.path)
        return new

    # ------------------------------------------------------------------ dynamics
    def _phi(self, pos: Pos) -> float:
        return -float(abs(pos[0] - self.goal[0]) + abs(pos[1] - self.goal[1]))

    def _check_ready(self) -> None:
        if not self._ready:
            raise RuntimeError("PlanPathEnv: call reset(seed) first")

    def step(self, actions: list[str]) -> StepResult:
        self._check_ready()
        res = StepResult()
        for action in actions:
            if self._done:
                break
            res.applied += 1
            self.moves += 1
            delta = MOVES.get(str(action).strip().upper())
            target = None
            if delta is not None:
                target = (self.pos[0] + delta[0], self.pos[1] + delta[1])
                if not (0 <= target[0] < self.rows and 0 <= target[1] < self.cols) or target in self.walls:
                    target = None
            if target is None:
                res.invalid += 1
                self.invalid_moves += 1
                reward = -self.INVALID_PENALTY
            else:
                res.valid += 1
                self.valid_moves += 1
                reward = -self.STEP_PENALTY + self.SHAPING_SCALE * (self.GAMMA * self._phi(target) - self._phi(self.pos))
                self.pos = target
                self.path.append(target)
            self.actions_taken.append(str(action))
            if self.pos == self.goal:
                reward += self.GOAL_REWARD
                self.reached_optimally = self.moves == self.start_optimal
                if self.reached_optimally:
                    reward += self.OPTIMAL_BONUS
                self._done = self._success = True
                res.info["optimal"] = self.reached_optimally
            elif self.moves >= self.max_moves:
                self._done = True
                res.info["move_cap"] = True
            res.reward += reward
        self.total_reward += res.reward
        if res.applied < len(actions):
            res.info["ignored"] = len(actions) - res.applied
        res.done, res.success = self._done, self._success
        res.info["position"] = self.pos
        res.info["moves"] = self.moves
        return res

    def optimal_length(self) -> int | None:
        """BFS distance from the current position to the goal (None if unreachable)."""
        return self._dist.get(self.pos)

    def shortest_path(self) -> list[str] | None:
        """A shortest move list from the current position to the goal (None if unreachable)."""
        d = self._dist.get(self.pos)
        if d is None:
            return None
        out, cur = [], self.pos
        while d > 0:
            for name, (dr, dc) in MOVES.items():
                nxt = (cur[0] + dr, cur[1] + dc)
                if self._dist.get(nxt) == d - 1:
                    out.append(name)
                    cur, d = nxt, d - 1
                    break
        return out

    # ------------------------------------------------------------------ observation
    def render(self) -> str:
        self._check_ready()
        lines = []
        for r in range(self.rows):
            row = []
            for c in range(self.cols):
                p = (r, c)
                if p == self.pos:
                    row.append("@")
                elif p in self.walls:
                    row.append("#")
                elif p == self.goal:
                    row.append("G")
                elif p == self.start:
                    row.append("S")
                else:
                    row.append(".")
            lines.append("".join(row))
        lines.append(LEGEND)
        lines.append(f"Position: ({self.pos[0]}, {self.pos[1]})")
        lines.append(f"Goal: ({self.goal[0]}, {self.goal[1]})")
        lines.append(f"Moves used: {self.moves}/{self.max_moves}")
        return "\n".join(lines)
