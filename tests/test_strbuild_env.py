import copy
import string

import pytest

from marl_llm.envs.strbuild import (
    FONT,
    MAX_COMMANDS,
    StrBuildEnv,
    TurnResult,
    parse_commands,
)

RED, ORANGE, BLUE, CYAN = "red_wool", "orange_wool", "blue_wool", "cyan_wool"


def cmds(cells, block):
    return "\n".join(f"/setblock {x} {y} {z} {block}" for x, y, z in cells)


def font_cells(ch, x0):
    return {(x0 + c, 4 - r, 0) for r, row in enumerate(FONT[ch])
            for c, v in enumerate(row) if v == "#"}


# ----- font / layout --------------------------------------------------------------------------
def test_font_letters_are_5x5_and_non_empty():
    for ch in string.ascii_uppercase:
        glyph = FONT[ch]
        assert len(glyph) == 5, ch
        assert all(len(row) == 5 and set(row) <= {"#", "."} for row in glyph), ch
        assert any("#" in row for row in glyph), ch
    assert all(row == "....." for row in FONT[" "])


def test_target_cells_hi():
    env = StrBuildEnv("HI")
    expected = font_cells("H", 0) | font_cells("I", 6)
    n = sum(row.count("#") for row in FONT["H"] + FONT["I"])
    cells = env.target_cells()
    assert len(cells) == n
    assert cells == expected
    assert env.width == 11
    assert min(x for x, _, _ in cells if x >= 5) == 6        # second letter starts at x=6
    assert not any(x == 5 for x, _, _ in cells)              # gap column
    # H's top-left pixel is at the top row (y=4), I's top bar spans x=6..10 at y=4
    assert (0, 4, 0) in cells and all((x, 4, 0) in cells for x in range(6, 11))


def test_bad_targets_and_palettes():
    with pytest.raises(ValueError, match="'h'"):
        StrBuildEnv("hI")
    with pytest.raises(ValueError, match="'1'"):
        StrBuildEnv("A1")
    with pytest.raises(ValueError):
        StrBuildEnv("HI", palettes=(("red_wool",), ("red_wool", "blue_wool")))
    StrBuildEnv("A B")  # spaces fine



# ----- letter gap (task.letter_gap; the CoLLM reference's configs leave 2 columns) -----------------
def test_letter_gap_two_cells_and_bounds():
    env = StrBuildEnv("HI", letter_gap=2)
    assert env.letter_gap == 2 and env.width == 12
    assert env.target_cells() == font_cells("H", 0) | font_cells("I", 7)
    assert not any(x in (5, 6) for x, _, _ in env.target_cells())  # two gap columns
    assert env.in_bounds(11, 4, 0) and not env.in_bounds(12, 0, 0) and not env.in_bounds(-1, 0, 0)
    info = env.step(0, "/setblock 12 0 0 red_wool\n/setblock 11 0 0 red_wool\n/setblock 6 0 0 red_wool")
    assert [line for line, _ in info["rejected"]] == ["/setblock 12 0 0 red_wool"]
    assert "0<=x<12" in info["rejected"][0][1]
    assert env.state == {(11, 0, 0): RED, (6, 0, 0): RED}
    fb = env.feedback(0)
    assert "x = column 0..11" in fb and "#...#..#####" in fb  # top row of "HI" with two gap columns
    assert all(len(row) == 4 + 12 for row in env.render().split("\n")[:5])
    three = StrBuildEnv("LIL", letter_gap=2)
    assert three.width == 3 * 7 - 2 and three.target_cells() == (
        font_cells("L", 0) | font_cells("I", 7) | font_cells("L", 14))


def test_letter_gap_zero_and_invalid():
    env = StrBuildEnv("HI", letter_gap=0)
    assert env.width == 10 and env.target_cells() == font_cells("H", 0) | font_cells("I", 5)
    assert StrBuildEnv("HI").width == 11 and StrBuildEnv("HI").letter_gap == 1  # the default
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="letter_gap"):
            StrBuildEnv("HI", letter_gap=bad)


def test_letter_gap_two_perfect_build_iou_is_one():
    env = StrBuildEnv("ICML", letter_gap=2)
    target = sorted(env.target_cells())
    env.step(0, cmds([p for p in target if (p[0] + p[1]) % 2 == 0], RED))
    env.step(1, cmds([p for p in target if (p[0] + p[1]) % 2 == 1], BLUE))
    r = env.end_turn()
    built = set(env.state)
    assert len(built & env.target_cells()) / len(built | env.target_cells()) == 1.0
    assert r.coverage == 1.0 and r.extra_ratio == 0.0 and r.adjacency_ratio == 0.0 and r.success
    # the same commands on the default 1-column wall: the later letters are off target
    narrow = StrBuildEnv("ICML")
    narrow.step(0, cmds(target, RED))
    assert narrow.metrics()["coverage"] < 1.0 and narrow.metrics()["extra_ratio"] > 0.0

# ----- parser ---------------------------------------------------------------------------------
def test_parser_good_lines_and_prose():
    text = """Sure! I will build the H now.
/setblock 0 4 0 red_wool
   /setblock   1    2   0    minecraft:Orange_Wool
/SETBLOCK -3 0 -1 RED_WOOL
/setblock 2 2 0 air

That's it."""
    commands, errors = parse_commands(text)
    assert errors == []
    assert [(c.x, c.y, c.z, c.block) for c in commands] == [
        (0, 4, 0, "red_wool"), (1, 2, 0, "orange_wool"), (-3, 0, -1, "red_wool"),
        (2, 2, 0, "air")]


def test_parser_errors():
    commands, errors = parse_commands(
        "/setblock 1 two 0 red_wool\n/fill 0 0 0 4 4 0 red_wool\n/setblock 1 2 red_wool\n"
        "/setblock ~1 0 0 red_wool\n/setblock 0 0 0 red_wool")
    assert len(commands) == 1
    assert len(errors) == 4
    assert "two" in errors[0][1]
    assert "/fill" in errors[1][1]
    assert "4 arguments" in errors[2][1]
    assert parse_commands(None) == ([], [("None", "input is not text")])


def test_parser_cap():
    text = "\n".join(f"/setblock {i % 10} 0 0 red_wool" for i in range(MAX_COMMANDS + 20))
    commands, errors = parse_commands(text)
    assert len(commands) == MAX_COMMANDS == 500
    assert len(errors) == 1 and "20 more" in errors[0][1]


# ----- step -----------------------------------------------------------------------------------
def test_palette_enforcement_and_air():
    env = StrBuildEnv("HI")
    info = env.step(0, "/setblock 0 0 0 blue_wool\n/setblock 1 0 0 red_wool")
    assert [(c.x, c.block) for c in info["applied"]] == [(1, "red_wool")]
    assert len(info["rejected"]) == 1 and "palette" in info["rejected"][0][1]
    assert env.state == {(1, 0, 0): RED}
    # air removes, also another agent's block
    env.step(1, "/setblock 1 0 0 air")
    assert env.state == {}


def test_out_of_bounds_rejected():
    env = StrBuildEnv("HI")  # width 11, height 5
    bad = ["/setblock 11 0 0 red_wool", "/setblock -1 0 0 red_wool",
           "/setblock 0 5 0 red_wool", "/setblock 0 0 1 red_wool"]
    info = env.step(0, "\n".join(bad + ["/setblock 10 4 0 red_wool"]))
    assert len(info["rejected"]) == 4
    assert all("out of bounds" in r for _, r in info["rejected"])
    assert env.state == {(10, 4, 0): RED}


# ----- rewards --------------------------------------------------------------------------------
def test_perfect_checkerboard_build():
    env = StrBuildEnv("HI")
    target = sorted(env.target_cells())
    a = [p for p in target if (p[0] + p[1]) % 2 == 0]
    b = [p for p in target if (p[0] + p[1]) % 2 == 1]
    env.step(0, cmds(a, RED))
    env.step(1, cmds(b, BLUE))
    # independently: 4-neighbours always differ in parity, so no same-block pair
    same = sum(1 for (x, y, z) in target for nb in ((x + 1, y, z), (x, y + 1, z))
               if nb in env.target_cells() and ((x + y) % 2 == (nb[0] + nb[1]) % 2))
    assert same == 0
    r = env.end_turn()
    assert isinstance(r, TurnResult)
    assert r.coverage == 1.0 and r.extra_ratio == 0.0 and r.adjacency_ratio == 0.0
    assert r.absent_agents == 0
    assert r.reward == pytest.approx(2.0)
    assert r.success and r.done and env.done
    with pytest.raises(RuntimeError):
        env.step(0, "")


def test_half_build_one_agent():
    env = StrBuildEnv("HI")
    target = sorted(env.target_cells())
    half = target[: len(target) // 2]
    # alternate agent 0's own two blocks so adjacency can be computed by hand
    red = [p for p in half if (p[0] + p[1]) % 2 == 0]
    orange = [p for p in half if (p[0] + p[1]) % 2 == 1]
    env.step(0, cmds(red, RED) + "\n" + cmds(orange, ORANGE))
    env.step(1, "I'll wait this turn.")
    r = env.end_turn()
    cov = len(half) / len(target)
    assert r.coverage == pytest.approx(cov)
    assert r.adjacency_ratio == 0.0
    assert r.absent_agents == 1
    assert r.reward == pytest.approx(2 * cov - 0.25)
    assert not r.success and not r.done


def test_extra_blocks_term():
    env = StrBuildEnv("I")
    target = sorted(env.target_cells())
    red = [p for p in target if (p[0] + p[1]) % 2 == 0]
    blue = [p for p in target if (p[0] + p[1]) % 2 == 1]
    extras = [(0, 1, 0), (0, 2, 0), (4, 2, 0)]  # empty cells of "I"
    assert not set(extras) & env.target_cells()
    env.step(0, cmds(red, RED) + "\n" + cmds(extras, RED))
    env.step(1, cmds(blue, BLUE))
    r = env.end_turn()
    extra = 3 / len(target)
    assert r.coverage == 1.0 and r.extra_ratio == pytest.approx(extra)
    assert r.reward == pytest.approx(2 - 1.5 * extra)
    assert r.success == (extra <= 0.05)  # 3/13 > 0.05
    assert not r.success


def test_same_block_adjacency_term():
    env = StrBuildEnv("L")  # column x=0, y=0..4, plus bottom row x=0..4 at y=0
    target = env.target_cells()
    assert len(target) == 9
    env.step(0, cmds(target, RED))
    env.step(1, "/setblock 0 4 0 blue_wool")  # overwrite the top of the stem
    r = env.end_turn()
    # pairs: vertical stem (0,0)-(0,1)..(0,3)-(0,4): 4; bottom row: 4 -> 8 pairs,
    # only (0,3)-(0,4) differs -> 7/8 same
    assert r.adjacency_ratio == pytest.approx(7 / 8)
    assert r.absent_agents == 0
    assert r.reward == pytest.approx(2 - 7 / 8)
    assert r.success  # adjacency does not affect success
    assert len(env.same_block_pairs()) == 7


def test_max_turns():
    env = StrBuildEnv("HI", max_turns=4)
    results = []
    for t in range(4):
        env.step(0, f"/setblock 0 {t} 0 red_wool")
        env.step(1, "")
        results.append(env.end_turn())
    assert [r.done for r in results] == [False, False, False, True]
    assert not any(r.success for r in results)
    assert results[-1].turn == 4
    with pytest.raises(RuntimeError):
        env.end_turn()


# ----- observations ---------------------------------------------------------------------------
def test_feedback_and_render():
    env = StrBuildEnv("HI")
    env.step(0, "/setblock 0 0 0 red_wool\n/setblock 0 0 0 blue_wool\n/fill 0 0 0 1 1 0 x\n"
                "/setblock 5 0 0 red_wool")
    env.step(1, "/setblock 0 1 0 blue_wool")
    env.end_turn()
    fb0 = env.feedback(0)
    assert "red_wool" in fb0 and "blue_wool" not in fb0.split("\n")[0]
    assert "(0,4,0)" in fb0  # a missing position
    assert "Turn 1/4. Built so far:" in fb0 and "A=red_wool" in fb0 and "E=cyan_wool" not in fb0
    assert "Missing target positions (" + str(len(env.target_cells()) - 2) + ")" in fb0
    assert "not in your palette" in fb0 and "/fill" in fb0
    assert "Extra non-target blocks (1): (5,0,0)" in fb0
    assert "#...#.#####" in fb0  # target drawing, top row of "HI"
    fb1 = env.feedback(1)
    assert "Your rejected commands last turn (0): none" in fb1
    rows = env.render().split("\n")
    assert rows[0].startswith("y=4 ") and rows[4].startswith("y=0 ")
    assert rows[4][4:] == "A...+a+++++"
    assert rows[3][4:4 + 1] == "D"


def test_feedback_list_cap():
    env = StrBuildEnv("HELLO WORLD")
    assert len(env.target_cells()) > 40
    fb = env.feedback(0)
    assert f"... and {len(env.target_cells()) - 40} more" in fb and "Nothing built yet." in fb


def test_deepcopy_independent():
    env = StrBuildEnv("HI")
    env.step(0, "/setblock 0 0 0 red_wool")
    clone = copy.deepcopy(env)
    clone.step(1, "/setblock 0 1 0 blue_wool\n/setblock 0 0 0 air\n/setblock 99 0 0 blue_wool")
    clone.end_turn()
    assert env.state == {(0, 0, 0): RED}
    assert env.turn == 0 and clone.turn == 1
    assert env.pending_rejected == [[], []]
    assert env.metrics()["coverage"] == pytest.approx(1 / len(env.target_cells()))
