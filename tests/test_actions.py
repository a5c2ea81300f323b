"""Parsing move lists out of model output: never raises, malformed output gives no moves."""

from __future__ import annotations

import pytest

from marl_llm.envs.actions import MAX_ACTIONS, parse_action_list, parse_final_actions


@pytest.mark.parametrize("text,moves", [
    ('["U", "R", "R"]', ["U", "R", "R"]),
    ("['up', 'Left']", ["U", "L"]),
    ("U, D, L, R", ["U", "D", "L", "R"]),
    ("up down", ["U", "D"]),
    ("[U, R", ["U", "R"]),  # an unclosed list: lenient
    ('The moves are: ["D","D"] and done', ["D", "D"]),
    ('```\n["R"]\n```', ["R"]),
])
def test_well_formed_lists(text, moves):
    assert parse_action_list(text) == (moves, None)


@pytest.mark.parametrize("text", ["", "   ", "I think we should go north", '["U", "jump"]', "[1, 2]",
                                  None, '{"moves": 3}'])
def test_malformed_output_gives_no_moves_and_a_reason(text):
    moves, reason = parse_action_list(text)
    assert moves == [] and reason


def test_final_line_of_the_plan_agent():
    text = 'Let me think.\n#### ["L"]\nActually no.\n#### ["U", "U"]\n'
    assert parse_final_actions(text) == (["U", "U"], None)
    assert parse_final_actions("no marker here") == ([], "no line starting with ####")
    assert parse_final_actions("#### go up")[0] == []


def test_overlong_lists_are_capped():
    moves, _ = parse_action_list(str(["U"] * (MAX_ACTIONS + 50)))
    assert len(moves) == MAX_ACTIONS
