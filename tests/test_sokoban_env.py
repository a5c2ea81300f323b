"""SokobanEnv: deterministic solvable generator, exact per-move rewards, move cap, render, copy."""

from __future__ import annotations

import random
import time
from collections import deque

import pytest

from marl_llm.envs.base import MOVES
from marl_llm.envs.sokoban import SokobanEnv, from_ascii, parse_grid


def grid_of(env: SokobanEnv) -> list[str]:
    """The grid rows of render() (everything before the legend line)."""
    lines = env.render().split("\n")
    return lines[: lines.index(next(l for l in lines if l.startswith("Legend")))]


def reference_rewards(rows: list[str], moves: list[str]) -> tuple[float, bool]:
    """An independent re-implementation of the note's reward, run on the rendered grid."""
    walls, goals, boxes, player = set(), set(), set(), None
    for r, line in enumerate(rows):
        for c, ch in enumerate(line):
            if ch == "#":
                walls.add((r, c))
            if ch in ".*+":
                goals.add((r, c))
            if ch in "$*":
                boxes.add((r, c))
            if ch in "@+":
                player = (r, c)

    def phi(bs):
        return -sum(min(abs(b[0] - g[0]) + abs(b[1] - g[1]) for g in goals) for b in bs)

    total, solved = 0.0, False
    for m in moves:
        dr, dc = MOVES[m]
        nxt = (player[0] + dr, player[1] + dc)
        if nxt in walls:
            total += -0.05
            continue
        before = phi(boxes)
        r = -0.01
        if nxt in boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond in walls or beyond in boxes:
                total += -0.05
                continue
            boxes = (boxes - {nxt}) | {beyond}
            if beyond in goals and nxt not in goals:
                r += 1.0
            if nxt in goals and beyond not in goals:
                r -= 0.5
        player = nxt
        r += 0.1 * (0.99 * phi(boxes) - before)
        total += r
        if boxes <= goals:
            total += 10.0
            solved = True
            break
    return total, solved


def floor_connected(env: SokobanEnv) -> bool:
    floor = {(r, c) for r in range(env.height) for c in range(env.width) if (r, c) not in env.walls}
    seen, queue = {env.player}, deque([env.player])
    while queue:
        p = queue.popleft()
        for dr, dc in MOVES.values():
            q = (p[0] + dr, p[1] + dc)
            if q in floor and q not in seen:
                seen.add(q)
                queue.append(q)
    return seen == floor


# ---------------------------------------------------------------------------- generator


def test_generator_is_deterministic_and_uses_its_own_rng():
    a, b = SokobanEnv(size=6), SokobanEnv(size=6)
    random.seed(123)
    expected_next = random.random()
    random.seed(123)
    a.reset(42)
    assert random.random() == expected_next  # the global random stream was not touched
    b.reset(7)
    b.reset(42)
    assert a.render() == b.render()
    assert (a.player, a.boxes, a.goals, a.walls) == (b.player, b.boxes, b.goals, b.walls)
    renders = set()
    for seed in range(100):
        a.reset(seed)
        renders.add(a.render())
    assert len(renders) >= 90


@pytest.mark.parametrize("size,num_boxes,seeds", [(6, 1, range(200)), (7, 2, range(40)),
                                                  (5, 1, range(100000, 100050))])
def test_generated_levels_are_solvable_and_nontrivial(size, num_boxes, seeds):
    env = SokobanEnv(size=size, num_boxes=num_boxes)
    for seed in seeds:
        env.reset(seed)
        rows = grid_of(env)
        assert len(rows) == size and all(len(r) == size for r in rows)
        # outer wall, the right number of boxes/goals, one player, connected room
        assert rows[0] == rows[-1] == "#" * size and all(r[0] == r[-1] == "#" for r in rows)
        assert len(env.boxes) == len(env.goals) == num_boxes
        assert sum(r.count("@") + r.count("+") for r in rows) == 1
        assert floor_connected(env)
        assert not env.is_solved() and not env.done
        n = env.optimal_length()
        assert n is not None and n >= SokobanEnv.min_solution_length > 0
        sol = env.solve()
        assert len(sol) == n
        expected, solved = reference_rewards(rows, sol)
        assert solved
        res = env.step(sol)
        assert res.done and res.success and env.success
        assert res.applied == res.valid == n and res.invalid == 0
        assert res.reward == pytest.approx(expected, abs=1e-9)
        assert env.render().endswith(f"Boxes on goals: {num_boxes}/{num_boxes}")


def test_following_the_solution_shortens_it_by_one_each_move():
    env = SokobanEnv(size=7, num_boxes=2)
    env.reset(11)
    sol = env.solve()
    for i, move in enumerate(sol[:-1]):
        env.step([move])
        assert not env.done
        assert env.optimal_length() == len(sol) - i - 1


def test_generator_steps_and_validation():
    env = SokobanEnv(size=6, generator_steps=5)
    env.reset(3)
    assert env.optimal_length() >= 3
    with pytest.raises(ValueError):
        SokobanEnv(size=4)
    with pytest.raises(ValueError):
        SokobanEnv(size=6, num_boxes=0)


def test_generation_speed():
    env = SokobanEnv(size=6, num_boxes=1)
    t = time.perf_counter()
    for seed in range(100000, 100100):
        env.reset(seed)
    assert time.perf_counter() - t < 5.0


# ---------------------------------------------------------------------------- rewards


def test_push_onto_goal_solves_with_exact_reward():
    env = SokobanEnv.from_ascii(["#####", "#@$.#", "#####"], max_moves=200)
    assert env.optimal_length() == 1 and env.solve() == ["R"]
    res = env.step(["R", "L", "L"])
    # -0.01 valid, +1 onto goal, shaping 0.1*(0.99*0 - (-1)) = 0.1, +10 solved
    assert res.reward == pytest.approx(-0.01 + 1.0 + 0.1 + 10.0)
    assert (res.applied, res.valid, res.invalid, res.done, res.success) == (1, 1, 0, True, True)
    assert env.done and env.success and env.moves == 1
    assert grid_of(env) == ["#####", "# @*#", "#####"]
    # moves after done are ignored
    again = env.step(["L", "L"])
    assert (again.reward, again.applied, again.done, again.success) == (0.0, 0, True, True)
    assert env.moves == 1 and env.player == (1, 2)


def test_walk_shaping_then_push():
    env = parse_grid("######\n#@ $.#\n######")
    res = env.step(["R"])
    # walk: phi unchanged (-1): -0.01 + 0.1*(0.99*-1 + 1)
    assert res.reward == pytest.approx(-0.01 + 0.1 * (0.99 * -1 + 1))
    assert not res.done and res.valid == 1
    res = env.step(["R"])
    assert res.reward == pytest.approx(-0.01 + 1.0 + 0.1 + 10.0) and res.success


def test_invalid_moves_leave_state_and_count_toward_cap():
    env = from_ascii(["#####", "#@$.#", "#####"], max_moves=200)
    before = (env.player, set(env.boxes))
    res = env.step(["L"])
    assert res.reward == pytest.approx(-0.05)
    assert (res.applied, res.valid, res.invalid, res.done) == (1, 0, 1, False)
    assert (env.player, env.boxes) == before and env.moves == 1
    # pushing a box into a box is invalid too
    env2 = from_ascii(["######", "#@$*.#", "######"])
    res = env2.step(["R"])
    assert res.reward == pytest.approx(-0.05) and res.invalid == 1
    assert env2.boxes == {(1, 2), (1, 3)} and env2.player == (1, 1)
    # an unknown token is an invalid move
    assert env2.step(["X"]).invalid == 1 and env2.moves == 2


def test_push_off_goal_penalty():
    env = from_ascii(["######", "#@*  #", "######"])
    res = env.step(["R"])
    # -0.01, -0.5 off goal, shaping 0.1*(0.99*(-1) - 0)
    assert res.reward == pytest.approx(-0.01 - 0.5 + 0.1 * (0.99 * -1 - 0))
    assert not res.done and env.boxes == {(1, 3)}


def test_shaping_uses_nearest_goal_per_box():
    env = from_ascii(["########", "#@$ ..$#", "########"])
    res = env.step(["R"])
    # phi: -(2 + 1) -> -(1 + 1)
    assert res.reward == pytest.approx(-0.01 + 0.1 * (0.99 * -2 + 3))


def test_move_cap_is_never_a_success():
    env = from_ascii(["#####", "#@$.#", "#####"], max_moves=3)
    res = env.step(["L", "U", "D", "R"])
    assert res.done and not res.success and not env.success
    assert res.applied == 3 and res.invalid == 3
    assert res.reward == pytest.approx(3 * -0.05 - 5.0)
    assert env.boxes == {(1, 2)}  # the 4th move (the solving push) was not applied
    # the cap is counted across step() calls
    env = from_ascii(["######", "#@ $.#", "######"], max_moves=2)
    r1 = env.step(["L"])
    r2 = env.step(["R", "R"])
    assert r1.reward == pytest.approx(-0.05) and not r1.done
    assert r2.applied == 1 and r2.done and not r2.success
    assert r2.reward == pytest.approx(-0.01 + 0.1 * (0.99 * -1 + 1) - 5.0)


def test_solving_on_the_last_allowed_move_is_a_success():
    env = from_ascii(["######", "#@ $.#", "######"], max_moves=2)
    res = env.step(["R", "R"])
    assert res.done and res.success
    assert res.reward == pytest.approx(-0.01 + 0.1 * 0.01 + (-0.01 + 1.0 + 0.1 + 10.0))


def test_generated_level_move_cap():
    env = SokobanEnv(size=6, max_moves=5)
    env.reset(0)
    res = env.step(["U", "D"] * 10)
    assert res.applied == 5 and res.done and not res.success
    assert res.reward < -4.9


# ---------------------------------------------------------------------------- render, solver, copy


def test_render_symbols_and_progress_line():
    env = from_ascii(["######", "#+$* #", "######"])
    lines = env.render().split("\n")
    assert lines[:3] == ["######", "#+$* #", "######"]
    assert lines[3].startswith("Legend") and "* box on goal" in lines[3]
    assert lines[4] == "Boxes on goals: 1/2"
    env.reset(0)  # a hand-made level resets to itself
    assert env.render().split("\n")[:3] == lines[:3]
    with pytest.raises(ValueError):
        from_ascii(["#####", "#@@.#", "#####"])
    with pytest.raises(ValueError):
        from_ascii(["#####", "#@$ #", "#####"])  # no goal


def test_unsolvable_and_capped_solver():
    env = from_ascii(["#####", "#$@.#", "#####"])  # box stuck in a corner
    assert env.optimal_length() is None and env.solve() is None
    env = from_ascii(["#######", "#@    #", "#  $  #", "#    .#", "#######"])
    assert env.solve(max_states=3) is None
    assert env.optimal_length() is not None


def test_copy_is_independent():
    env = SokobanEnv(size=6)
    env.reset(5)
    snapshot = (env.render(), env.player, set(env.boxes), env.moves)
    twin = env.copy()
    res = twin.step(twin.solve())
    assert res.success and twin.done
    assert (env.render(), env.player, env.boxes, env.moves) == snapshot
    assert not env.done and env.boxes is not twin.boxes
    assert env.step(env.solve()).success
