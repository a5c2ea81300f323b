"""The HumanEval task: data and splits, prompts, batched rewards, turn-2 prompts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf

from marl_llm.tasks import TASKS, build_task
from marl_llm.tasks.base import Turn
from marl_llm.tasks.humaneval import HumanEvalTask


def data_cfg(**overrides: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(source="packaged", hub_id="openai/openai_humaneval", files={},
                                train_split="test[33:163]", eval_split="test[:32]",
                                packaged_train_split="test[33:163]", packaged_eval_split="test[:32]")
    base.update(overrides)
    return SimpleNamespace(**base)


def make_cfg(data: SimpleNamespace | None = None, **overrides: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        name="humaneval",
        data=data or data_cfg(),
        feedback="detailed",
        sandbox=SimpleNamespace(timeout_s=2.0, memory_mb=512, max_procs=16, max_output_bytes=4096, workers=2),
    )
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    return HumanEvalTask(make_cfg())


def test_registered_and_built_from_omegaconf() -> None:
    assert TASKS["humaneval"] is HumanEvalTask
    cfg = OmegaConf.create(
        {"name": "humaneval", "data": vars(data_cfg()), "feedback": "plain",
         "sandbox": {"timeout_s": 3.0, "memory_mb": 700, "max_procs": 8, "max_output_bytes": 100, "workers": 3}}
    )  # fmt: skip
    t = build_task(cfg)
    assert isinstance(t, HumanEvalTask) and t.agent_names == ("aux", "main") and t.num_agents == 2
    limits = t.sandbox_limits()
    assert (limits.timeout_s, limits.memory_mb, limits.max_procs, limits.max_output_bytes) == (3.0, 700, 8, 100)
    assert t.sandbox_workers() == 3
    assert len(t.load_split("eval")) == 32


def test_split_sizes_and_order(task: HumanEvalTask) -> None:
    train, evals = task.load_split("train"), task.load_split("eval")
    assert (len(train), len(evals)) == (130, 32)
    assert [p.uid for p in evals[:11]] == [f"HumanEval/{i}" for i in range(11)]
    assert (train[0].uid, train[-1].uid) == ("HumanEval/33", "HumanEval/162")
    assert not {p.uid for p in train} & {p.uid for p in evals}
    assert set(evals[0].data) >= {"task_id", "prompt", "test", "entry_point"}


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("packaged_train_split", "test[33]", "task.data.packaged_train_split"),
        ("packaged_train_split", "test[100:50]", "task.data.packaged_train_split"),
        ("packaged_train_split", "test[0:500]", "only 164 rows"),
        ("packaged_eval_split", "test[0.5:32]", "task.data.packaged_eval_split"),
        ("packaged_eval_split", "train[:32]", "one split, 'test'"),
        ("packaged_eval_split", None, "task.data.packaged_eval_split"),
    ],
)
def test_bad_splits_name_the_key(key: str, value: Any, match: str) -> None:
    t = HumanEvalTask(make_cfg(data_cfg(**{key: value})))
    with pytest.raises(ValueError, match=match):
        t.load_split("train" if "train" in key else "eval")


def test_unknown_split_and_feedback_mode() -> None:
    with pytest.raises(ValueError, match="split"):
        HumanEvalTask(make_cfg()).load_split("test")
    with pytest.raises(ValueError, match="task.feedback"):
        HumanEvalTask(make_cfg(feedback="loud"))


def _rows(n: int) -> list[dict[str, str]]:
    return [
        {"task_id": f"Toy/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
         "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n", "entry_point": f"f{i}"}
        for i in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json", ".parquet"])
def test_local_data_file(tmp_path: Path, suffix: str) -> None:
    rows = _rows(12)
    path = tmp_path / f"data{suffix}"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if suffix.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text(text)
    t = HumanEvalTask(make_cfg(data_cfg(source="auto", files={"test": str(path)}, train_split="test[4:]",
                                        eval_split="test[:4]")))
    assert [p.uid for p in t.load_split("eval")] == ["Toy/0", "Toy/1", "Toy/2", "Toy/3"]
    assert [p.uid for p in t.load_split("train")][-1] == "Toy/11" and len(t.load_split("train")) == 8


def test_missing_or_bad_data_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope.jsonl.*does not exist"):
        HumanEvalTask(make_cfg(data_cfg(source="files", files={"test": str(tmp_path / "nope.jsonl")}))).load_split("eval")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "x", "prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl.*row 0 lacks the required field\(s\) \['test', 'entry_point'\]"):
        HumanEvalTask(make_cfg(data_cfg(source="files", files={"test": str(bad)}, eval_split="test"))).load_split("eval")
    with pytest.raises(ValueError, match="names split 'test'.*has only \\['train'\\]"):
        HumanEvalTask(make_cfg(data_cfg(source="auto", files={"train": str(bad)}))).load_split("eval")
    with pytest.raises(ValueError, match="task.data.source=packaged: set task.data.source=files"):
        HumanEvalTask(make_cfg(data_cfg(files={"test": str(bad)}))).load_split("eval")


def test_initial_prompts(task: HumanEvalTask) -> None:
    problem = task.load_split("eval")[0]
    aux, main = task.initial_prompts(problem)
    assert "has_close_elements" in aux and "def has_close_elements" in main
    assert "helper function named `aux`" in aux and "no markdown" in aux and "no tests" in aux
    assert "do not define `has_close_elements`" in aux
    assert "`aux(...)`" in main and "Do not define it yourself" in main
    assert "ONLY the function `has_close_elements`" in main and "no markdown" in main


AUX_0 = "def aux(a, b):\n    return abs(a - b)\n"
MAIN_0 = (
    "def has_close_elements(numbers, threshold):\n"
    "    for i in range(len(numbers)):\n"
    "        for j in range(i + 1, len(numbers)):\n"
    "            if aux(numbers[i], numbers[j]) < threshold:\n"
    "                return True\n"
    "    return False\n"
)


def test_joint_rewards_batch(task: HumanEvalTask) -> None:
    problems = task.load_split("eval")[:3]
    p2 = problems[2].data
    actions = [
        [f"```python\n{AUX_0}```", MAIN_0],  # cooperative and correct
        ["def aux(s):\n    return s", "Sorry, I can't."],  # no entry point
        ["def aux(x):\n    return x % 1.0", p2["prompt"] + "    return aux(number)\n"],  # thin wrapper
    ]
    rewards = task.joint_rewards(problems, actions)
    assert [r.total for r in rewards] == pytest.approx([4.0, 0.4, 3.0])
    assert [r.passed for r in rewards] == [True, False, True]
    with pytest.raises(ValueError):
        task.joint_rewards(problems[:1], [["only one"]])


def test_next_prompts_detailed(task: HumanEvalTask) -> None:
    problem = task.load_split("eval")[0]
    wrong_main = MAIN_0.replace("< threshold", "> threshold")
    reward = task.joint_rewards([problem], [[AUX_0, wrong_main]])[0]
    first = task.initial_prompts(problem)
    histories = [[Turn(first[0], f"```python\n{AUX_0}```")], [Turn(first[1], wrong_main)]]
    aux_next, main_next = task.next_prompts(problem, histories, reward)
    for base, text in zip(first, (aux_next, main_next)):
        assert text.startswith(base)
        assert text.endswith("Revise your function.")
        assert "Tests: " in text and "expected" not in text
        # has_close_elements answers yes/no: which inputs failed would be their answers
        assert "FAIL: candidate(" not in text and "Which tests failed is not shown" in text
    assert AUX_0.strip() in aux_next and "> threshold" not in aux_next
    assert "> threshold" in main_next and "def aux" not in main_next


def test_next_prompts_plain_mode() -> None:
    t = HumanEvalTask(make_cfg(feedback="plain"))
    problem = t.load_split("eval")[0]
    reward = t.joint_rewards([problem], [[AUX_0, MAIN_0]])[0]
    first = t.initial_prompts(problem)
    texts = t.next_prompts(problem, [[Turn(first[0], AUX_0)], [Turn(first[1], MAIN_0)]], reward)
    assert texts[1] == f"{first[1]}\n\nYour previous code:\n```python\n{MAIN_0.strip()}\n```\n\nRevise your function."
    assert "Tests:" not in texts[0]
