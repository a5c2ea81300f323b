"""task.prompts=paper for StrBuild: the CoLLM reference's prompts, byte for byte.

tests/fixtures/strbuild_prompts_paper.jsonl holds what the reference builds (its train_magrpo.py
and train_maac.py, up to the trainer; scripts/reference_fixtures/strbuild_prompts.py): turn 1 per
agent (the [system, user] chat messages) and turns 2-4 after crafted completions (the raw text),
for the reference's letter spacing (2, task.letter_gap=2) and the default wall's (1).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import compose_config
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.models.prompting import Message, PromptFormat, encode_prompt
from marl_llm.tasks import build_task
from marl_llm.tasks.base import Problem, Turn

FIXTURE = Path(__file__).parent / "fixtures" / "strbuild_prompts_paper.jsonl"
PALETTES = "task.palettes=[[oak_planks,stone],[white_concrete,obsidian]]"
ONE_PALETTE = "task.palettes=[[oak_planks,stone]]"
PRESETS = ("magrpo_strbuild_paper", "collm_cc_strbuild_paper", "collm_dc_strbuild_paper")


def load():
    lines = FIXTURE.read_text(encoding="utf-8").splitlines()
    return json.loads(lines[0])["meta"], [json.loads(line) for line in lines[1:]]


META, ROWS = load()
_TASKS: dict[int, object] = {}


def paper_task(num_agents: int, letter_gap: int = 1):
    if (num_agents, letter_gap) not in _TASKS:
        cfg = compose_config(["task=strbuild", "run_dir=/tmp/x", "task.prompts=paper", f"task.letter_gap={letter_gap}",
                              PALETTES if num_agents == 2 else ONE_PALETTE])
        _TASKS[num_agents, letter_gap] = build_task(cfg.task)
    return _TASKS[num_agents, letter_gap]


def prompt_of(row, letter_gap: int | None = None) -> Message:
    """What the paper task writes for the row's target, agent and turn (on a wall with the row's
    letter spacing unless `letter_gap` is given)."""
    task = paper_task(row["num_agents"], row["spacing"] if letter_gap is None else letter_gap)
    problem = Problem(uid="p", data={"target": row["target"]})
    if row["turn"] == 1:
        return task.initial_prompts(problem)[row["agent"]]
    histories = [[Turn("", joint[i]) for joint in row["completions"]] for i in range(row["num_agents"])]
    return task.next_prompts(problem, histories, task.replay(problem, histories))[row["agent"]]


def test_fixture_covers_the_reference_settings():
    assert META["commit"] == "9c2e006d689b79c5caa0504e1878575d50a5f547"
    assert {(r["spacing"], r["num_agents"]) for r in ROWS} == {(2, 2), (1, 2), (1, 1)}
    assert {r["turn"] for r in ROWS} == {1, 2, 3, 4}
    # Turn 1 goes through the chat template as [system, user] (the plain rendering: system + blank
    # line + user); later turns are raw text, no template.
    for r in ROWS:
        assert r["chat_template"] == (r["turn"] == 1)
        if r["turn"] == 1:
            assert [m["role"] for m in r["messages"]] == ["system", "user"] and r["raw"] is None
            assert r["message"] == r["messages"][0]["content"] + "\n\n" + r["messages"][1]["content"]
        else:
            assert r["messages"] is None and r["raw"] == r["message"]


@pytest.mark.parametrize("row", ROWS,
                         ids=lambda r: f"s{r['spacing']}-n{r['num_agents']}-{r['target']}-a{r['agent']}-t{r['turn']}")
def test_paper_prompts_equal_the_reference(row):
    """Byte-equal, part by part: turn 1 is the reference's user message with its system message,
    later turns its raw text, sent without the chat template (task.letter_gap = the row's spacing)."""
    ours = prompt_of(row)
    assert isinstance(ours, Message)
    if row["turn"] == 1:
        system, user = (m["content"] for m in row["messages"])
        assert (ours.system, str(ours), ours.raw) == (system, user, False)
    else:
        assert (ours.system, str(ours), ours.raw) == (None, row["raw"], True)


def test_letter_spacing_matters_for_longer_targets():
    """The fixtures are sensitive to the spacing: the default 1-column wall does not give the
    reference's 2-column prompts for multi-letter targets (bounding box, letter positions)."""
    rows = [r for r in ROWS if r["spacing"] == 2 and len(r["target"]) > 1]
    assert rows
    for r in rows:
        ref = r["messages"][1]["content"] if r["turn"] == 1 else r["raw"]
        assert str(prompt_of(r, letter_gap=1)) != ref and str(prompt_of(r)) == ref


@pytest.fixture(scope="module")
def templated_tokenizer():
    """The embedded SmolLM2 tokenizer with its chat template on (model.chat_template=true)."""
    from transformers import AutoTokenizer

    from marl_llm.models.loading import embedded_checkpoint

    tok = AutoTokenizer.from_pretrained(embedded_checkpoint())
    assert tok.chat_template
    tok.prompt_format = PromptFormat(True)
    return tok


@pytest.mark.parametrize("target", ["LI", "I"])
def test_encoded_like_the_reference(templated_tokenizer, target):
    """With the chat template on, turn 1 is the template of the reference's [system, user] messages
    and later turns the plain ids of its raw text."""
    tok = templated_tokenizer
    rows = [r for r in ROWS if (r["spacing"], r["num_agents"], r["target"]) == (2, 2, target)]
    assert {r["turn"] for r in rows} == {1, 2, 3, 4}
    for r in rows:
        ids = encode_prompt(tok, prompt_of(r))
        if r["turn"] == 1:
            expected = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
            assert r["messages"][0]["content"] in tok.decode(ids)
        else:
            expected = tok(r["raw"], add_special_tokens=True)["input_ids"]
            assert "<|im_start|>" not in tok.decode(ids)
        assert ids == list(expected)


def test_presets_train_with_the_reference_prompts_and_targets():
    for preset in PRESETS:
        cfg = compose_config([f"experiment={preset}", "run_dir=/tmp/x"])
        validate(cfg)
        assert cfg.task.prompts == "paper" and cfg.task.letter_gap == 2
        task = build_task(cfg.task)
        assert [p.data["target"] for p in task.load_split("train")] == ["I", "C", "M", "L", "MC", "CM", "LI", "LLM"]
        assert [p.data["target"] for p in task.load_split("eval")] == ["ICML", "CLIM"]
        for target in ("I", "LLM"):
            first = task.initial_prompts(Problem(uid="p", data={"target": target}))
            ref = [r["messages"] for r in ROWS if (r["spacing"], r["num_agents"], r["target"], r["turn"])
                   == (2, 2, target, 1)]
            assert [[{"role": "system", "content": m.system}, {"role": "user", "content": str(m)}]
                    for m in first] == ref


def test_switch_default_and_validation():
    cfg = compose_config(["task=strbuild", "run_dir=/tmp/x"])
    assert cfg.task.prompts == "own"
    bad = compose_config(["task=strbuild", "run_dir=/tmp/x", "task.prompts=reference"])
    with pytest.raises(UserError, match="task.prompts"):
        validate(bad)
    three = compose_config(["task=strbuild", "run_dir=/tmp/x", "task.prompts=paper",
                            "task.palettes=[[a_wool],[b_wool],[c_wool]]"])
    with pytest.raises(UserError, match="1 or 2 builders"):
        build_task(three.task)
    assert cfg.task.letter_gap == 1
    negative = compose_config(["task=strbuild", "run_dir=/tmp/x", "task.letter_gap=-1"])
    with pytest.raises(UserError, match="task.letter_gap"):
        validate(negative)
    with pytest.raises(UserError, match="task.letter_gap"):
        build_task(negative.task)


# sha256 of the own prompts below, as the task wrote them before task.prompts existed.
OWN_SHA256 = "8579248ebb1ed48d21c3edd228850f23d2e0e957cbd90bc5caff1857849aeb62"


@pytest.mark.parametrize("extra", [[], ["task.prompts=own"], ["task.prompts=own", "task.letter_gap=1"]])
def test_own_prompts_unchanged(extra):
    task = build_task(compose_config(["task=strbuild", "run_dir=/tmp/x", *extra]).task)
    out = []
    for target in ("I", "LI", "ICML"):
        p = Problem(uid="x", data={"target": target})
        out += task.initial_prompts(p)
        hist = [[Turn("", "/setblock 0 4 0 red_wool\n/setblock 1 4 0 blue_wool\n/bad")],
                [Turn("", "/setblock 1 4 0 blue_wool\n/setblock 40 0 0 cyan_wool")]]
        out += task.next_prompts(p, hist, task.replay(p, hist))
    assert hashlib.sha256("\x00".join(out).encode()).hexdigest() == OWN_SHA256


def test_prompt_data_ships_in_the_package():
    import fnmatch
    import tomllib

    from marl_llm.tasks.strbuild import PAPER_PROMPTS, paper_prompts

    repo = Path(__file__).resolve().parents[1]
    pkg_data = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = pkg_data.get("marl_llm.tasks", []) + pkg_data.get("*", [])  # its own globs or every package's
    assert any(fnmatch.fnmatch(PAPER_PROMPTS, g) for g in globs)
    assert paper_prompts()["system"].startswith("You are a Minecraft building agent.")
