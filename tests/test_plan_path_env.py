"""Plan-Path environment: generation, rewards, termination, copying, rendering."""

from __future__ import annotations

import copy
import random

import pytest

from marl_llm.envs.base import MOVES
from marl_llm.envs.plan_path import PlanPathEnv

# S=(0,0), G=(0,3); the wall column forces a detour: Manhattan 3, BFS length 7.
DETOUR = ["S.#G",
          "..#.",
          "...."]


def manhattan(a, b):
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def expected_reward(start, goal, moves, walls, rows, cols, optimal_len):
    """Independent re-computation of the reward of a move list (stops at the goal)."""
    pos, total, n = start, 0.0, 0
    for m in moves:
        n += 1
        dr, dc = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}[m]
        nxt = (pos[0] + dr, pos[1] + dc)
        if not (0 <= nxt[0] < rows and 0 <= nxt[1] < cols) or nxt in walls:
            total += -0.1
            continue
        total += -0.01 + 1.0 * (0.99 * -manhattan(nxt, goal) - (-manhattan(pos, goal)))
        pos = nxt
        if pos == goal:
            total += 1.0 + (0.5 if n == optimal_len else 0.0)
            break
    return total


def fresh(seed):
    env = PlanPathEnv()
    env.reset(seed)
    return env


def test_determinism_per_seed_and_no_global_random():
    random.seed(1)
    a = fresh(7).render()
    random.seed(12345)
    b = fresh(7).render()
    assert a == b
    env = PlanPathEnv()
    env.reset(3)
    env.step(["U", "R"])
    env.reset(7)  # reset also restarts the episode
    assert env.render() == a and env.moves == 0 and not env.done
    renders = {fresh(s).render() for s in range(20)}
    assert len(renders) == 20


def test_generated_levels_valid():
    fractions = []
    for seed in range(300):
        env = fresh(seed)
        assert env.start != env.goal
        assert env.start not in env.walls and env.goal not in env.walls
        assert all(0 <= r < 10 and 0 <= c < 10 for r, c in env.walls)
        n = env.optimal_length()
        assert n is not None and n >= 1
        assert env.start_optimal == n
        assert n >= manhattan(env.start, env.goal)
        fractions.append(len(env.walls) / 100)
    mean = sum(fractions) / len(fractions)
    assert 0.18 <= mean <= 0.26, mean


def test_shortest_path_solves_generated_levels():
    for seed in range(0, 300, 7):
        env = fresh(seed)
        path = env.shortest_path()
        assert len(path) == env.optimal_length()
        res = env.step(path)
        assert res.done and res.success and env.success
        assert res.info["optimal"] is True
        assert res.applied == len(path) and res.invalid == 0
        walls, rows = env.walls, env.rows
        assert res.reward == pytest.approx(
            expected_reward(env.start, env.goal, path, walls, rows, env.cols, env.start_optimal))


def test_from_ascii_map():
    env = PlanPathEnv.from_ascii(DETOUR)
    assert (env.rows, env.cols) == (3, 4)
    assert env.start == (0, 0) and env.goal == (0, 3)
    assert env.walls == {(0, 2), (1, 2)}
    assert env.optimal_length() == 7 and env.start_optimal == 7
    with pytest.raises(ValueError):
        PlanPathEnv.from_ascii(["S..", "..."])  # no goal
    blocked = PlanPathEnv.from_ascii(["S#G"])
    assert blocked.optimal_length() is None and blocked.shortest_path() is None


def test_optimal_path_exact_reward():
    env = PlanPathEnv.from_ascii(DETOUR)
    path = env.shortest_path()
    assert len(path) == 7
    # Walk it independently: each move must be legal and end on the goal.
    pos = env.start
    for m in path:
        pos = (pos[0] + MOVES[m][0], pos[1] + MOVES[m][1])
        assert pos not in env.walls
    assert pos == env.goal
    res = env.step(path)
    assert res.success and res.done and res.info["optimal"] is True
    expected = expected_reward((0, 0), (0, 3), path, {(0, 2), (1, 2)}, 3, 4, 7)
    assert res.reward == pytest.approx(expected)
    # Hand value: Manhattan distances along D,D,R,R,R,U,U are 3,4,5,4,3,2,1,0; shaping terms
    # -0.96 -0.95 +1.04 +1.03 +1.02 +1.01 +1.00 = 3.19; total -0.07 + 3.19 + 1 + 0.5 = 4.62.
    shaping = sum(0.99 * -b + a for a, b in [(3, 4), (4, 5), (5, 4), (4, 3), (3, 2), (2, 1), (1, 0)])
    assert res.reward == pytest.approx(-0.07 + shaping + 1.5)
    assert res.reward == pytest.approx(4.62)
    assert env.pos == env.goal and env.path[-1] == env.goal and len(env.path) == 8


def test_optimal_path_split_over_turns_still_optimal():
    env = PlanPathEnv.from_ascii(DETOUR)
    r1 = env.step(["D", "D", "R"])
    r2 = env.step(["R", "R", "U", "U"])
    assert r2.success and r2.info["optimal"] is True
    assert "optimal" not in r1.info
    assert r1.reward + r2.reward == pytest.approx(4.62)


def test_non_optimal_path_gets_no_bonus():
    moves = ["D", "D", "R", "L", "R", "R", "R", "U", "U"]
    env = PlanPathEnv.from_ascii(DETOUR)
    res = env.step(moves)
    assert res.success and res.info["optimal"] is False
    expected = expected_reward((0, 0), (0, 3), moves, {(0, 2), (1, 2)}, 3, 4, 7)
    assert res.reward == pytest.approx(expected)
    optimal = PlanPathEnv.from_ascii(DETOUR).step(["D", "D", "R", "R", "R", "U", "U"]).reward
    # The detour R,L at distance 5 adds -0.02 + shaping (0.99*-4+5) + (0.99*-5+4) = -0.02 + 0.09; no +0.5.
    assert res.reward == pytest.approx(optimal - 0.5 + 0.07)


def test_invalid_move_breaks_optimality():
    env = PlanPathEnv.from_ascii(DETOUR)
    res = env.step(["U", "D", "D", "R", "R", "R", "U", "U"])  # one bump, then an optimal path
    assert res.success and res.info["optimal"] is False and res.invalid == 1
    assert res.reward == pytest.approx(4.62 - 0.5 - 0.1)


def test_invalid_moves_penalised_position_unchanged():
    env = PlanPathEnv.from_ascii(DETOUR)
    for move in ["U", "L"]:  # off the grid
        res = env.step([move])
        assert res.reward == pytest.approx(-0.1)
        assert res.invalid == 1 and res.valid == 0 and res.applied == 1
        assert env.pos == (0, 0)
    env.step(["R"])
    assert env.pos == (0, 1)
    res = env.step(["R"])  # into the wall at (0, 2)
    assert res.reward == pytest.approx(-0.1) and env.pos == (0, 1) and res.invalid == 1
    assert env.moves == 4 and env.invalid_moves == 3 and env.valid_moves == 1
    assert env.path == [(0, 0), (0, 1)]
    res = env.step(["up", "X"])  # unknown token counts as an invalid move; lower-case word is not a move letter
    assert res.invalid == 2 and res.reward == pytest.approx(-0.2)
    assert not env.done


def test_move_cap_is_not_success():
    env = PlanPathEnv.from_ascii(DETOUR, max_moves=3)
    res = env.step(["D", "U", "D", "D"])
    assert res.done and not res.success and not env.success
    assert res.applied == 3 and env.moves == 3 and env.pos == (1, 0)
    assert res.info.get("move_cap") is True and "optimal" not in res.info
    # Invalid moves count toward the cap too.
    env = PlanPathEnv.from_ascii(DETOUR, max_moves=2)
    res = env.step(["U", "L", "D"])
    assert res.done and not res.success and res.applied == 2 and env.pos == (0, 0)
    # Reaching the goal on the last allowed move is a success.
    env = PlanPathEnv.from_ascii(["SG"], max_moves=1)
    res = env.step(["R"])
    assert res.done and res.success and res.info["optimal"] is True
    assert res.reward == pytest.approx(-0.01 + 1.0 + 1.0 + 0.5)


def test_default_cap_on_generated_level():
    env = fresh(0)
    res = env.step(["U", "D"] * 60)
    assert env.done and not env.success
    assert res.applied == 100 and env.moves == 100


def test_moves_after_done_ignored():
    env = PlanPathEnv.from_ascii(DETOUR)
    env.step(env.shortest_path() + ["L", "L"])
    assert env.done and env.pos == env.goal and env.moves == 7
    res = env.step(["D", "L"])
    assert res.applied == 0 and res.reward == 0.0 and res.done and res.success
    assert res.info["ignored"] == 2
    assert env.pos == env.goal and env.moves == 7


def test_copy_independent():
    env = fresh(11)
    before = env.render()
    clone = env.copy()
    path = clone.shortest_path()
    res_clone = clone.step(path)
    assert clone.done and clone.success
    assert env.render() == before and not env.done and env.moves == 0 and env.pos == env.start
    assert env.path == [env.start] and env.actions_taken == []
    res = env.step(path)
    assert res.reward == pytest.approx(res_clone.reward) and res.success
    # Resetting a copy must not change the original's level, and deepcopy works too.
    other = env.copy()
    other.reset(12)
    assert env.render().splitlines()[:10] == clone.render().splitlines()[:10]
    deep = copy.deepcopy(env)
    assert deep.render() == env.render() and deep.path is not env.path


def test_render():
    env = PlanPathEnv.from_ascii(DETOUR)
    text = env.render()
    lines = text.splitlines()
    assert lines[:3] == ["@.#G", "..#.", "...."]
    assert "@" in text and "G" in text and "S" not in "".join(lines[:3])
    assert "Position: (0, 0)" in lines and "Goal: (0, 3)" in lines
    assert any(line.startswith("Legend") for line in lines)
    env.step(["D"])
    lines = env.render().splitlines()
    assert lines[:3] == ["S.#G", "@.#.", "...."]
    assert "Position: (1, 0)" in lines
    gen = fresh(4)
    grid = gen.render().splitlines()[:10]
    assert sum(row.count("#") for row in grid) == len(gen.walls)
    r, c = gen.pos
    assert grid[r][c] == "@" and grid[gen.goal[0]][gen.goal[1]] == "G"
    assert f"Position: ({r}, {c})" in gen.render()


def test_step_before_reset_raises():
    with pytest.raises(RuntimeError):
        PlanPathEnv().step(["U"])
