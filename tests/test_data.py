"""Task data: split expressions, the source choice (never silently a sample when the hub was asked
for), local files in every format, bad input, the offline samples and the writing tasks' prompts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf

from marl_llm.config import UserError
from marl_llm.tasks import build_task
from marl_llm.tasks.data import Split, TaskData, packaged_file, parse_split, read_file, select
from marl_llm.tasks.writing import SINGLE_SEPARATOR

from conftest import compose_config


def data_cfg(**kw: Any) -> SimpleNamespace:
    base = dict(source="auto", hub_id="someone/dataset", files={}, train_split="train[:1000]",
                eval_split="test[:1000]", packaged_train_split="train", packaged_eval_split="test")
    base.update(kw)
    return SimpleNamespace(**base)


def task_cfg(name: str, **data: Any):
    cfg = compose_config([f"task={name}", "run_dir=/tmp/x"]).task
    for k, v in data.items():
        OmegaConf.update(cfg, f"data.{k}", v)
    return cfg


# ------------------------------------------------------------------------------------ splits
@pytest.mark.parametrize("expr,expected", [
    ("train", Split("train")), ("test[:32]", Split("test", None, 32)), ("test[16:]", Split("test", 16, None)),
    ("train[0:1000]", Split("train", 0, 1000)), (" val [ 3 : 9 ] ", Split("val", 3, 9)),
])
def test_parse_split(expr, expected):
    assert parse_split(expr) == expected


@pytest.mark.parametrize("expr", ["train[5]", "test[-3:]", "test[1.5:2]", "test[9:3]", "", None, 7, "a b"])
def test_bad_split_expressions_name_the_key(expr):
    with pytest.raises(UserError, match="task.data.eval_split"):
        parse_split(expr, "task.data.eval_split")


def test_select_refuses_overlong_and_empty_slices():
    rows = [{"i": i} for i in range(5)]
    assert select(rows, Split("t", 1, 3), "f", "k") == rows[1:3]
    with pytest.raises(UserError, match=r"asks for rows up to 1000.*only 5 rows: use e.g. t\[0:5\]"):
        select(rows, Split("t", None, 1000), "file x", "task.data.train_split")
    with pytest.raises(UserError, match="selects no rows"):
        select(rows, Split("t", 5, None), "file x", "task.data.train_split")
    with pytest.raises(UserError, match="selects no rows"):
        select([], Split("t"), "file x", "task.data.train_split")


# ----------------------------------------------------------------------------------- sources
def test_auto_offline_falls_back_to_the_sample_and_says_why(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logs: list[str] = []
    data = TaskData(data_cfg(), "tldr", ("prompt",), log=logs.append)
    assert len(data.split("train")) == 32 and len(data.split("eval")) == 16
    assert len(logs) == 1 and "packaged" in logs[0] and "HF_HUB_OFFLINE=1" in logs[0] and "source=hub" in logs[0]


def test_asking_for_the_hub_offline_is_an_error_not_a_sample(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = TaskData(data_cfg(source="hub"), "tldr", ("prompt",), log=lambda s: None)
    with pytest.raises(UserError, match="source=hub: the hub is not reachable.*HF_HUB_OFFLINE"):
        data.split("train")


def test_files_with_hub_or_packaged_source_is_an_error(tmp_path):
    with pytest.raises(UserError, match="task.data.files is set but task.data.source=hub"):
        TaskData(data_cfg(source="hub", files={"train": "x"}), "tldr", ()).split("train")


def _write(path: Path, rows: list[dict], fmt: str) -> Path:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_local_files_by_split_name(tmp_path, fmt):
    train = _write(tmp_path / f"train.{fmt}", [{"prompt": f"post {i}"} for i in range(6)], fmt)
    test = _write(tmp_path / f"test.{fmt}", [{"prompt": f"held-out {i}"} for i in range(3)], fmt)
    logs: list[str] = []
    data = TaskData(data_cfg(files={"train": str(train), "test": str(test)}, train_split="train[2:]",
                             eval_split="test"), "tldr", ("prompt",), log=logs.append)
    assert [r["prompt"] for r in data.split("train")] == [f"post {i}" for i in range(2, 6)]
    assert len(data.split("eval")) == 3 and "files" in logs[0]


def test_missing_field_names_the_field_and_the_file(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"prompt": "a"}, {"text": "b"}], "jsonl")
    data = TaskData(data_cfg(source="files", files={"train": str(path)}, train_split="train"), "tldr", ("prompt",),
                    log=lambda s: None)
    with pytest.raises(UserError, match=r"file .*t\.jsonl.*row 1 lacks the required field\(s\) \['prompt'\]"):
        data.split("train")


def test_split_larger_than_the_file_and_unknown_split_name(tmp_path):
    path = _write(tmp_path / "t.jsonl", [{"prompt": "a"}] * 4, "jsonl")
    data = TaskData(data_cfg(files={"train": str(path)}), "tldr", ("prompt",), log=lambda s: None)
    with pytest.raises(UserError, match=r"train_split='train\[:1000\]'.*only 4 rows"):
        data.split("train")
    with pytest.raises(UserError, match="names split 'test'.*add test: <file>"):
        data.split("eval")


def compose_with_files(task: str, files: dict[str, Path | str], *extra: str):
    """The task config as `marl-llm task=<task> task.data.files={...} <extra>` composes it."""
    from marl_llm.cli.train import map_overrides

    listed = ",".join(f"{k}:{v}" for k, v in files.items())
    args = [f"task={task}", f"task.data.files={{{listed}}}", *extra, "run_dir=/tmp/x"]
    return compose_config(map_overrides(args)).task


@pytest.mark.parametrize("task,names,train,held_out", [
    ("tldr", ("train", "test"), "train", "test"), ("arxiv", ("train", "val"), "train", "val"),
    # The papers slice one split for both: a train file is read whole, else eval keeps the
    # papers' first rows and training takes the rest (never an overlap).
    ("humaneval", ("train", "test"), "train", "test"), ("humaneval", ("test",), "test[32:]", "test[:32]"),
    ("coophumaneval", ("test",), "test[16:]", "test[:16]"),
])
def test_own_files_default_to_the_whole_files(task, names, train, held_out):
    cfg = compose_with_files(task, {name: f"/d/{name}.jsonl" for name in names})
    assert (cfg.data.train_split, cfg.data.eval_split) == (train, held_out)


def test_a_small_own_file_trains_unless_the_user_sized_the_split(tmp_path):
    """The papers' train[:1000] refused every smaller file; without files it is still the split."""
    train = _write(tmp_path / "train.jsonl", [{"prompt": f"post {i}"} for i in range(3)], "jsonl")
    test = _write(tmp_path / "test.jsonl", [{"prompt": f"held-out {i}"} for i in range(2)], "jsonl")
    cfg = compose_with_files("tldr", {"train": train, "test": test})
    data = TaskData(cfg.data, "tldr", ("prompt",), log=lambda s: None)
    assert len(data.split("train")) == 3 and len(data.split("eval")) == 2
    assert compose_config(["task=tldr", "run_dir=/tmp/x"]).task.data.train_split == "train[:1000]"
    sized = compose_with_files("tldr", {"train": train, "test": test}, "task.data.train_split='train[:1000]'")
    with pytest.raises(UserError, match=r"train_split='train\[:1000\]'.*only 3 rows"):
        TaskData(sized.data, "tldr", ("prompt",), log=lambda s: None).split("train")


@pytest.mark.parametrize("content,match", [("{not json\n", "line 1 is not valid JSON"), ("", None)])
def test_corrupt_or_empty_file(tmp_path, content, match):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    data = TaskData(data_cfg(files={"train": str(path)}, train_split="train"), "tldr", ("prompt",),
                    log=lambda s: None)
    with pytest.raises(UserError, match=match or "selects no rows"):
        data.split("train")


def test_unsupported_file_format(tmp_path):
    (tmp_path / "t.csv").write_text("prompt\nx\n")
    with pytest.raises(UserError, match=r"unsupported format; use one of \.jsonl"):
        read_file(tmp_path / "t.csv")


# ---------------------------------------------------------------------------- the samples
@pytest.mark.parametrize("task,split,n,field", [("tldr", "train", 32, "prompt"), ("tldr", "test", 16, "prompt"),
                                                ("arxiv", "train", 28, "abstract_text"),
                                                ("arxiv", "val", 12, "abstract_text"),
                                                ("coophumaneval", "test", 20, "entry_point")])
def test_offline_samples_ship_in_the_package(task, split, n, field):
    rows = read_file(packaged_file(task, split))
    assert len(rows) == n and all(r[field] for r in rows)
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == n


@pytest.mark.parametrize("name,agents,n_train,n_eval", [("tldr", ("concise", "detailed"), 32, 16),
                                                        ("arxiv", ("background", "methods"), 28, 12),
                                                        ("coophumaneval", ("aux", "main"), 12, 8)])
def test_tasks_load_their_offline_sample(name, agents, n_train, n_eval):
    task = build_task(task_cfg(name))
    train, evals = task.load_split("train"), task.load_split("eval")
    assert task.agent_names == agents and (len(train), len(evals)) == (n_train, n_eval)
    assert not {p.uid for p in train} & {p.uid for p in evals}
    prompts = task.initial_prompts(evals[0])
    assert len(prompts) == 2 and prompts[0] != prompts[1]


def test_writing_prompts_show_the_text_without_the_completion_cue():
    task = build_task(task_cfg("tldr"))
    problem = task.load_split("eval")[0]
    concise, detailed = task.initial_prompts(problem)
    assert "POST:" in concise and not concise.rstrip().endswith("TL;DR:")
    assert "concise" in concise and "transition words" in detailed


def test_writing_single_agent_split():
    task = build_task(task_cfg("tldr"))
    assert task.split_single(f"[PART 1] short one.\n{SINGLE_SEPARATOR}\nlonger two.") == ["short one.", "longer two."]
    assert task.split_single("no separator at all") == ["no separator at all", ""]
    assert SINGLE_SEPARATOR in task.single_prompt(task.load_split("eval")[0])


def test_writing_task_scores_through_the_configured_bands():
    task = build_task(task_cfg("arxiv"))
    r = task.joint_rewards([task.load_split("eval")[0]], [["too short", "also short"]])[0]
    assert r.total == 0.0 and r.info["stopped_at"] == "structure"
    with pytest.raises(ValueError, match="expected 2 actions"):
        task.joint_rewards([task.load_split("eval")[0]], [["one"]])


def test_code_single_agent_split_moves_aux_and_imports():
    task = build_task(task_cfg("coophumaneval"))
    aux, main = task.split_single("```python\nimport math\n\ndef aux(x):\n    return x\n\ndef f(y):\n    return aux(y)\n```")
    assert aux == "import math\n\ndef aux(x):\n    return x" and main == "def f(y):\n    return aux(y)"
    assert task.split_single("def f(:\n") == ["", "def f(:\n"]  # unparsable: all to main
