"""Sokoban: procedurally generated levels, solvable by construction, with the AT-GRPO rewards.

Level generator (`SokobanEnv.reset(seed)`, deterministic: one `random.Random(seed)` stream,
the global `random` module is never touched):

1. Room topology. A `size` x `size` map starts as all wall. A random walk over the interior
   (the outer ring always stays wall) carves floor: it starts on a random interior cell, keeps
   its direction and turns with probability 0.35 at each step, and stops once a target share of
   the interior (drawn in [0.55, 0.8]) is floor. A walk leaves a connected, irregular room.
2. Solved state. `num_boxes` goals are drawn among the floor cells, a box is put on each goal,
   and the player on a random other floor cell.
3. Reverse play. For `generator_steps` steps (default 3 * interior cells) the player makes a
   random reverse move: it walks one cell in a random direction (only onto free floor) and,
   if a box stands right behind it (on the opposite side of the move), pulls that box along into
   the cell it left with probability 0.75. A pull undone forward is a push, so the reversed
   sequence of pulls/walks solves the level: it is solvable by construction.
4. A few (0 to size // 2) random plain walks of the player (no boxes touched: reversible).
5. Checks, with rejection and retry on the same Random stream (so still deterministic): a level
   where no box left the goals (i.e. already solved), where the BFS solver finds no solution
   within its state cap, or whose shortest solution has fewer than `min_solution_length` (3)
   moves (trivial) is rejected. Four reverse plays are made from each solved state and the
   accepted one with the longest shortest solution is kept (as gym-sokoban keeps its
   best-scored reverse play). Each room gets up to 8 solved-state draws, then a new room is
   carved; the generator gives up (RuntimeError) only after 2000 rooms, which does not happen
   for valid sizes (>= 5). Typical shortest solutions: 3-9 moves at size 6 with one box (mean
   about 5), 3-16 at size 7 with two boxes.

Rewards of a move (AT-GRPO note): -0.01 for a valid move (walk or push), -0.05 for an invalid
move (into a wall, pushing a box into a wall/box, or an unknown action token: the state does not
change but the move counts toward the cap; no shaping is added to an invalid move); +1 when a box
is pushed onto a goal, -0.5 when a box is pushed off a goal (goal to goal: neither); on every
valid move a shaping term 0.1 * (0.99 * phi' - phi), phi = -sum over boxes of the Manhattan
distance to the nearest goal (phi before, phi' after the move); +10 and done (success) when all
boxes are on goals; when the move count reaches `max_moves` without a solution: -5 and done, not
a success. Moves after the episode ends are not applied.

Solver: breadth-first search over (player, boxes) states where a move is a player step (walk or
push), so the answer counts all player moves. Boxes pushed onto "dead" cells (from which no goal
can be reached by pushes even on an empty board) are pruned, which keeps it exact. The search
stops after SOLVER_MAX_STATES (200,000) visited states and then reports None ("no solution
found"); the generated levels (size <= 8, a few boxes) stay far below that.
"""

from __future__ import annotations

import random
from collections import deque

from marl_llm.envs.base import MOVES, GridEnv, StepResult

SOLVER_MAX_STATES = 200_000

WALL, FLOOR, GOAL, BOX, PLAYER, BOX_ON_GOAL, PLAYER_ON_GOAL = "#", " ", ".", "$", "@", "*", "+"
LEGEND = ("Legend: # wall, (space) floor, . goal, $ box, @ player, * box on goal, "
          "+ player on goal")

R_VALID = -0.01
R_INVALID = -0.05
R_BOX_ON_GOAL = 1.0
R_BOX_OFF_GOAL = -0.5
R_SOLVED = 10.0
R_TIMEOUT = -5.0
SHAPING_SCALE = 0.1
SHAPING_GAMMA = 0.99

_DIRS = [(-1, 0), (1, 0), (0, -1), (0, 1)]
_ORDER = ["U", "D", "L", "R"]
_WORDS = {"U": "U", "UP": "U", "D": "D", "DOWN": "D", "L": "L", "LEFT": "L", "R": "R", "RIGHT": "R"}

_TURN_PROB = 0.35
_PULL_PROB = 0.75
_CANDIDATES = 4
_DRAWS_PER_ROOM = 8
_MAX_ROOMS = 2000

Cell = tuple[int, int]


def _add(a: Cell, d: Cell) -> Cell:
    return (a[0] + d[0], a[1] + d[1])


def potential(boxes, goals) -> int:
    """phi = -sum over boxes of the Manhattan distance to the nearest goal."""
    if not goals:
        return 0
    return -sum(min(abs(b[0] - g[0]) + abs(b[1] - g[1]) for g in goals) for b in boxes)


def _solve_bfs(height: int, width: int, walls, goals, boxes, player,
               max_states: int = SOLVER_MAX_STATES) -> list[str] | None:
    """Shortest move list from (player, boxes) to all boxes on goals, or None (unsolvable, or
    more than `max_states` states visited)."""
    goal_set = frozenset(goals)
    if boxes and set(boxes) <= goal_set:
        return []

    def idx(c: Cell) -> int:
        return c[0] * width + c[1]

    n = height * width
    free = [False] * n
    for r in range(height):
        for c in range(width):
            if (r, c) not in walls:
                free[r * width + c] = True
    # Neighbours in U, D, L, R order: -1 where the step leaves the grid or hits a wall.
    nbr = [[-1] * 4 for _ in range(n)]
    for r in range(height):
        for c in range(width):
            i = r * width + c
            if not free[i]:
                continue
            for k, (dr, dc) in enumerate(_DIRS):
                rr, cc = r + dr, c + dc
                if 0 <= rr < height and 0 <= cc < width and free[rr * width + cc]:
                    nbr[i][k] = rr * width + cc
    # Live cells: a box there can still be pushed to some goal (ignoring other boxes).
    # Reverse: a box at y came from x = y - d with the player at x - d, both free.
    opposite = [1, 0, 3, 2]
    live = [False] * n
    stack = [idx(g) for g in goal_set]
    for g in stack:
        live[g] = True
    while stack:
        y = stack.pop()
        for k in range(4):
            x = nbr[y][opposite[k]]
            if x < 0:
                continue
            p = nbr[x][opposite[k]]
            if p < 0 or live[x]:
                continue
            live[x] = True
            stack.append(x)
    goal_idx = frozenset(idx(g) for g in goal_set)
    start = (idx(player), tuple(sorted(idx(b) for b in boxes)))
    parent: dict = {start: None}
    queue = deque([start])
    found = None
    while queue:
        state = queue.popleft()
        p, bx = state
        bset = set(bx)
        for k in range(4):
            q = nbr[p][k]
            if q < 0:
                continue
            if q in bset:
                b2 = nbr[q][k]
                if b2 < 0 or b2 in bset or not live[b2]:
                    continue
                nb = tuple(sorted([b for b in bx if b != q] + [b2]))
                new = (q, nb)
                if new in parent:
                    continue
                parent[new] = (state, k)
                if all(b in goal_idx for b in nb):
                    found = new
                    break
            else:
                new = (q, bx)
                if new in parent:
                    continue
                parent[new] = (state, k)
            queue.append(new)
            if len(parent) > max_states:
                return None
        if found is not None:
            break
    if found is None:
        return None
    path = []
    s = found
    while parent[s] is not None:
        s, k = parent[s]
        path.append(_ORDER[k])
    path.reverse()
    return path


class SokobanEnv(GridEnv):
    """One Sokoban episode. Plain-attribute state (copy() is a deepcopy):
    walls / goals (frozensets of (row, col)), boxes (set), player (row, col), moves (moves
    applied, valid or not), total_reward, and the done/success flags."""

    # Generated levels need at least this many moves (a one-push level is trivial).
    min_solution_length = 3

    def __init__(self, size: int = 6, num_boxes: int = 1, max_moves: int = 200,
                 generator_steps: int | None = None):
        if size < 5:
            raise ValueError("size must be >= 5 (a 3x3 interior is needed to pull a box)")
        if num_boxes < 1 or num_boxes > (size - 2) ** 2 - 3:
            raise ValueError(f"num_boxes must be in [1, {(size - 2) ** 2 - 3}] for size {size}")
        if max_moves < 1:
            raise ValueError("max_moves must be >= 1")
        self.size = size
        self.height = size
        self.width = size
        self.num_boxes = num_boxes
        self.max_moves = max_moves
        self.generator_steps = generator_steps if generator_steps is not None else 3 * (size - 2) ** 2
        self.seed: int | None = None
        self.walls: frozenset = frozenset()
        self.goals: frozenset = frozenset()
        self.boxes: set = set()
        self.player: Cell | None = None
        self.moves = 0
        self.total_reward = 0.0
        self._done = False
        self._success = False
        self._fixed: tuple | None = None  # (walls, goals, boxes, player) of a hand-made level
        self._solution_cache: tuple | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_ascii(cls, rows, max_moves: int = 200) -> SokobanEnv:
        """A hand-made level from ASCII rows (a list of strings or one multi-line string) with
        the render symbols; cells outside the given rows count as wall. `reset()` restores it."""
        if isinstance(rows, str):
            rows = rows.splitlines()
        rows = [r for r in rows if r.strip() != ""]
        if not rows:
            raise ValueError("empty map")
        height, width = len(rows), max(len(r) for r in rows)
        walls, goals, boxes, players = set(), set(), set(), []
        for r in range(height):
            line = rows[r].ljust(width, WALL)
            for c, ch in enumerate(line):
                cell = (r, c)
                if ch == WALL:
                    walls.add(cell)
                elif ch in (FLOOR, "_", "-"):
                    pass
                elif ch == GOAL:
                    goals.add(cell)
                elif ch == BOX:
                    boxes.add(cell)
                elif ch == PLAYER:
                    players.append(cell)
                elif ch == BOX_ON_GOAL:
                    boxes.add(cell)
                    goals.add(cell)
                elif ch == PLAYER_ON_GOAL:
                    players.append(cell)
                    goals.add(cell)
                else:
                    raise ValueError(f"unknown map symbol {ch!r}")
        if len(players) != 1:
            raise ValueError(f"need exactly one player, found {len(players)}")
        if not boxes or len(boxes) != len(goals):
            raise ValueError(f"need as many goals as boxes (>= 1): {len(boxes)} boxes, {len(goals)} goals")
        env = cls.__new__(cls)
        GridEnv.__init__(env)
        env.size = max(height, width)
        env.height, env.width = height, width
        env.num_boxes = len(boxes)
        env.max_moves = max_moves
        env.generator_steps = 0
        env.seed = None
        env._fixed = (frozenset(walls), frozenset(goals), frozenset(boxes), players[0])
        env._solution_cache = None
        env.reset(0)
        return env

    def reset(self, seed: int = 0) -> None:
        """Generate the level of `seed` (a hand-made level is restored instead)."""
        if self._fixed is not None:
            walls, goals, boxes, player = self._fixed
        else:
            walls, goals, boxes, player = self._generate(seed)
        self.seed = seed
        self.walls = frozenset(walls)
        self.goals = frozenset(goals)
        self.boxes = set(boxes)
        self.player = player
        self.moves = 0
        self.total_reward = 0.0
        self._done = False
        self._success = False

    def _random_room(self, rng: random.Random) -> set:
        lo, hi = 1, self.size - 2
        n_interior = (hi - lo + 1) ** 2
        target = max(self.num_boxes + 3, round(n_interior * rng.uniform(0.55, 0.8)))
        pos = (rng.randint(lo, hi), rng.randint(lo, hi))
        floor = {pos}
        d = rng.choice(_DIRS)
        steps = 0
        while len(floor) < target and steps < 50 * n_interior:
            steps += 1
            if rng.random() < _TURN_PROB:
                d = rng.choice(_DIRS)
            nxt = _add(pos, d)
            if lo <= nxt[0] <= hi and lo <= nxt[1] <= hi:
                pos = nxt
                floor.add(pos)
        return floor

    def _reverse_play(self, rng: random.Random, floor: set, goals: list, player: Cell):
        boxes = set(goals)
        for _ in range(self.generator_steps):
            d = rng.choice(_DIRS)
            nxt = _add(player, d)
            if nxt not in floor or nxt in boxes:
                continue
            behind = (player[0] - d[0], player[1] - d[1])
            if behind in boxes and rng.random() < _PULL_PROB:
                boxes.remove(behind)
                boxes.add(player)
            player = nxt
        for _ in range(rng.randint(0, self.size // 2)):
            d = rng.choice(_DIRS)
            nxt = _add(player, d)
            if nxt in floor and nxt not in boxes:
                player = nxt
        return boxes, player

    def _generate(self, seed: int):
        rng = random.Random(seed)
        all_cells = {(r, c) for r in range(self.size) for c in range(self.size)}
        for _ in range(_MAX_ROOMS):
            floor = self._random_room(rng)
            if len(floor) < self.num_boxes + 3:
                continue
            walls = frozenset(all_cells - floor)
            cells = sorted(floor)
            for _ in range(_DRAWS_PER_ROOM):
                goals = rng.sample(cells, self.num_boxes)
                player0 = rng.choice([c for c in cells if c not in goals])
                best = None
                for _ in range(_CANDIDATES):
                    boxes, player = self._reverse_play(rng, floor, goals, player0)
                    if boxes == set(goals):
                        continue  # no box left the goals: already solved
                    sol = _solve_bfs(self.size, self.size, walls, goals, boxes, player)
                    if sol is None or len(sol) < self.min_solution_length:
                        continue  # no solution found (cap), or too short (trivial)
                    if best is None or len(sol) > len(best[2]):
                        best = (boxes, player, sol)
                if best is not None:
                    boxes, player, sol = best
                    self._solution_cache = ((player, frozenset(boxes), SOLVER_MAX_STATES), tuple(sol))
                    return walls, frozenset(goals), frozenset(boxes), player
        raise RuntimeError(f"no solvable Sokoban level found for seed {seed}")

    # ------------------------------------------------------------------ dynamics
    def boxes_on_goals(self) -> int:
        return sum(1 for b in self.boxes if b in self.goals)

    def is_solved(self) -> bool:
        return bool(self.boxes) and self.boxes <= self.goals

    def _blocked(self, cell: Cell) -> bool:
        r, c = cell
        return cell in self.walls or not (0 <= r < self.height and 0 <= c < self.width)

    def _move(self, action: str) -> tuple[float, bool]:
        """One move: (reward, valid). Does not handle the terminal conditions."""
        d = MOVES.get(_WORDS.get(str(action).strip().upper(), ""))
        if d is None:
            return R_INVALID, False
        nxt = _add(self.player, d)
        if self._blocked(nxt):
            return R_INVALID, False
        phi = potential(self.boxes, self.goals)
        reward = R_VALID
        if nxt in self.boxes:
            beyond = _add(nxt, d)
            if self._blocked(beyond) or beyond in self.boxes:
                return R_INVALID, False
            self.boxes.remove(nxt)
            self.boxes.add(beyond)
            if beyond in self.goals and nxt not in self.goals:
                reward += R_BOX_ON_GOAL
            elif nxt in self.goals and beyond not in self.goals:
                reward += R_BOX_OFF_GOAL
        self.player = nxt
        phi2 = potential(self.boxes, self.goals)
        reward += SHAPING_SCALE * (SHAPING_GAMMA * phi2 - phi)
        return reward, True

    def step(self, actions: list[str]) -> StepResult:
        if self.player is None:
            raise RuntimeError("call reset(seed) first")
        res = StepResult()
        for action in actions:
            if self._done:
                break
            reward, valid = self._move(action)
            self.moves += 1
            res.applied += 1
            if valid:
                res.valid += 1
            else:
                res.invalid += 1
            if self.is_solved():
                reward += R_SOLVED
                self._done, self._success = True, True
            elif self.moves >= self.max_moves:
                reward += R_TIMEOUT
                self._done, self._success = True, False
            res.reward += reward
        self.total_reward += res.reward
        res.done, res.success = self._done, self._success
        res.info = {"moves": self.moves, "boxes_on_goals": self.boxes_on_goals(),
                    "num_boxes": len(self.boxes)}
        return res

    # ------------------------------------------------------------------ observation
    def grid_rows(self) -> list[str]:
        rows = []
        for r in range(self.height):
            line = []
            for c in range(self.width):
                cell = (r, c)
                if cell in self.walls:
                    ch = WALL
                elif cell in self.boxes:
                    ch = BOX_ON_GOAL if cell in self.goals else BOX
                elif cell == self.player:
                    ch = PLAYER_ON_GOAL if cell in self.goals else PLAYER
                elif cell in self.goals:
                    ch = GOAL
                else:
                    ch = FLOOR
                line.append(ch)
            rows.append("".join(line))
        return rows

    def render(self) -> str:
        if self.player is None:
            raise RuntimeError("call reset(seed) first")
        return "\n".join(self.grid_rows() + [LEGEND, f"Boxes on goals: {self.boxes_on_goals()}/{len(self.boxes)}"])

    # ------------------------------------------------------------------ solver
    def solve(self, max_states: int = SOLVER_MAX_STATES) -> list[str] | None:
        """A shortest move list from the current state (BFS over player steps), [] if solved,
        None if unsolvable or if more than `max_states` states were visited."""
        if self.player is None:
            raise RuntimeError("call reset(seed) first")
        key = (self.player, frozenset(self.boxes), max_states)
        if self._solution_cache is not None and self._solution_cache[0] == key:
            sol = self._solution_cache[1]
            return None if sol is None else list(sol)
        sol = _solve_bfs(self.height, self.width, self.walls, self.goals, self.boxes, self.player,
                         max_states)
        self._solution_cache = (key, None if sol is None else tuple(sol))
        return sol

    def optimal_length(self) -> int | None:
        sol = self.solve()
        return None if sol is None else len(sol)


def from_ascii(rows, max_moves: int = 200) -> SokobanEnv:
    return SokobanEnv.from_ascii(rows, max_moves=max_moves)


def parse_grid(text: str, max_moves: int = 200) -> SokobanEnv:
    """A hand-made level from a multi-line ASCII map (see SokobanEnv.from_ascii)."""
    return SokobanEnv.from_ascii(text.splitlines(), max_moves=max_moves)
