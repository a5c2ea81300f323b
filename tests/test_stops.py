"""Stop rules (algo.sampling.stop, rollout/stops.py): where `code` ends a completion, how the ids and
text are cut, and that the decode loop lets a stopped row leave at its next check."""

from __future__ import annotations

import pytest

from conftest import compose_config, make_policies
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.rollout.base import GenRequest
from marl_llm.rollout.decode import COMPACT_EVERY, HFRollout
from marl_llm.rollout.sampling import SamplingParams
from marl_llm.rollout.stops import STOP_RULES, code_end, cut_at_stop, register_stop_rule


@pytest.mark.parametrize("text,kept", [
    # a function, then code at column 0: ends before it
    ("def f(x):\n    return x\n\nprint(f(1))\n", "def f(x):\n    return x\n\n"),
    ("def aux(a):\n    '''doc\n    more'''\n    return a\ndef main():\n    pass\n", "def aux(a):\n    '''doc\n    more'''\n    return a\n"),
    # prose and imports before the function do not end it
    ("Here is the helper:\nimport math\n\ndef aux(n):\n    return math.sqrt(n)\nThat is all.", "Here is the helper:\nimport math\n\ndef aux(n):\n    return math.sqrt(n)\n"),
    # a fenced block: through its closing fence
    ("Sure:\n```python\ndef f():\n    return 1\n\nf()\n```\nMore text", "Sure:\n```python\ndef f():\n    return 1\n\nf()\n```"),
    ("async def g():\n\tawait x\n# done\n", "async def g():\n\tawait x\n"),
])
def test_code_ends_at_the_first_block_or_function(text, kept):
    assert text[:code_end(text)] == kept


@pytest.mark.parametrize("text", [
    "def f(x):\n    '''a docstring that goes on\n    and on",   # still inside the function
    "def f(x):\n",                                              # no body yet
    "def f(x):\n    return x\n\n",                              # blank lines: may go on
    "Sure:\n```python\ndef f():\n    return 1\n",               # the block is open
    "Just prose, no code.\nNone at all.\n",
])
def test_code_does_not_end_an_unfinished_completion(text):
    assert code_end(text) is None


def test_the_cut_keeps_the_token_that_reached_the_end_and_the_text_up_to_it(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "def f(x):\n    return x + 1\nprint(f(2))\nprint(3)\n"
    ids = tok.encode(text, add_special_tokens=False)
    n, cut = cut_at_stop(tok, ids, "code")
    assert cut == "def f(x):\n    return x + 1\n"
    assert len(tok.decode(ids[:n])) >= len(cut) > len(tok.decode(ids[:n - 1]))
    assert cut_at_stop(tok, ids[:5], "code") is None and cut_at_stop(tok, ids, None) is None


def test_a_stopped_row_leaves_the_batch_at_the_next_check_and_is_cut(tiny_model_dir):
    policies = make_policies(tiny_model_dir)
    rollout = HFRollout(policies)
    long = SamplingParams(temperature=0.0, max_new_tokens=3 * COMPACT_EVERY)
    free = rollout.generate([GenRequest(0, "hello", long), GenRequest(1, "other", long)])
    asked: list[int] = []

    @register_stop_rule("test_ten_chars")
    def ten_chars(text):
        asked.append(len(text))
        return 10 if len(text) >= 10 else None

    try:
        stopped = rollout.generate([GenRequest(0, "hello", SamplingParams(temperature=0.0, max_new_tokens=3 * COMPACT_EVERY,
                                                                          stop="test_ten_chars")),
                                    GenRequest(1, "other", long)])
    finally:
        STOP_RULES.pop("test_ten_chars")
    assert free[0].text[:10] == stopped[0].text and len(free[0].text) > 10 and not stopped[0].truncated
    n = len(stopped[0].completion_ids)
    assert stopped[0].completion_ids.tolist() == free[0].completion_ids[:n].tolist() and n < COMPACT_EVERY
    assert stopped[1].completion_ids.tolist() == free[1].completion_ids.tolist()  # the other row is unaffected
    # asked once in the loop (the first check, 16 tokens in: the rule had ended the row, which left the
    # batch) and once by the cut
    assert asked[0] >= 10 and len(asked) == 2


def test_an_unknown_stop_rule_is_named_with_the_registered_ones():
    cfg = compose_config(["run_dir=/tmp/x", "algo.sampling.stop=cod"])
    with pytest.raises(UserError, match=r"algo.sampling.stop: 'cod' is not a stop rule; registered: code"):
        validate(cfg)
    cfg = compose_config(["run_dir=/tmp/x", "+algo.agent_sampling.aux.stop=nope"])
    with pytest.raises(UserError, match=r"algo.agent_sampling.aux.stop: 'nope' is not a stop rule"):
        validate(cfg)
    validate(compose_config(["run_dir=/tmp/x", "algo.sampling.stop=code"]))
