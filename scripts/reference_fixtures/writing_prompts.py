"""Reference prompts of the writing agents, for tests/test_writing_prompts_paper.py.

Runs the per-agent prompt formatters of OpenMLRL/LLM_Collab_Writing (train_magrpo.py and
train_maac.py, which define the same four; train_iac.py too when present) on every row of the
packaged offline samples (src/marl_llm/samples/{tldr,arxiv}/*.jsonl) and on crafted rows (empty,
whitespace-only, missing or null field, non-ASCII, control characters, braces, a list value, very
long text), and writes tests/fixtures/writing_prompts_paper.jsonl: a first line {"meta": ...}, then
one line per row {"task", "source", "row", "prompts": [agent 1's prompt, agent 2's prompt]}. The
trainers must agree on every row (the script stops otherwise). The reference code is imported from
the given checkout and never enters this repository.

Generated against commit 7e59995e20251de8819bdf2a57d8296193cb2b03. To regenerate:

    git clone https://github.com/OpenMLRL/LLM_Collab_Writing /tmp/ref_writing
    git -C /tmp/ref_writing checkout 7e59995e20251de8819bdf2a57d8296193cb2b03
    python scripts/reference_fixtures/writing_prompts.py /tmp/ref_writing

Only the trainer scripts are read; their third-party and sibling imports (torch, transformers,
datasets, wandb, comlrl, config, rewards, loggers) are replaced by empty stubs, since the
formatters use none of them, so any Python 3.9+ runs this without the project venv. --commit
records the commit when the checkout is not a git work tree. --write-data also rewrites the
templates in src/marl_llm/tasks/writing_prompts_paper.json from the reference (the formatters
evaluated on a sentinel value), for a new reference commit.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import json
import sys
import types
from pathlib import Path

from checkout import git_commit  # scripts/reference_fixtures/checkout.py
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "src/marl_llm/samples"
DATA_FILE = REPO / "src/marl_llm/tasks/writing_prompts_paper.json"
OUT = REPO / "tests/fixtures/writing_prompts_paper.jsonl"

TRAINERS = ("train_magrpo.py", "train_maac.py", "train_iac.py")  # the first two must exist
# Agent 1, agent 2 formatter of each task, as the trainers' get_formatters() returns them.
TASK_TYPES = ("tldr", "arxiv")
# Top-level modules the trainer scripts import that the formatters do not need.
STUBBED = {"torch", "transformers", "datasets", "wandb", "comlrl", "config", "rewards", "loggers", "numpy"}
SENTINEL = "\x00SOURCE-TEXT-SENTINEL\x00"
PLACEHOLDER = "{text}"


class _Stub(types.ModuleType):
    """A module (and package) whose every attribute is a do-nothing callable placeholder."""

    __path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Stub(self.__name__ + "()")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def load_trainer(path: Path) -> types.ModuleType:
    """Import one trainer script with its unneeded imports stubbed; sys.modules is restored after."""
    before = set(sys.modules)
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        spec = importlib.util.spec_from_file_location(f"_reference_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if name.split(".")[0] in STUBBED:
                del sys.modules[name]
    return module


def reference_formatters(checkout: Path) -> dict[str, dict[str, list[Callable]]]:
    """{trainer file: {task: [agent 1 formatter, agent 2 formatter]}} from get_formatters()."""
    out = {}
    for name in TRAINERS:
        path = checkout / name
        if not path.exists():
            if name in TRAINERS[:2]:
                sys.exit(f"{path} not found: is {checkout} a checkout of OpenMLRL/LLM_Collab_Writing?")
            continue
        module = load_trainer(path)
        out[name] = {task: list(module.get_formatters(task)) for task in TASK_TYPES}
        for task, fmts in out[name].items():
            if len(fmts) != 2:
                sys.exit(f"{name}: get_formatters({task!r}) returned {len(fmts)} formatters, expected 2")
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def crafted_rows(field: str) -> list[tuple[str, dict]]:
    """Rows that probe the edges: (kind, row)."""
    long_text = " ".join(f"Sentence {i} of a very long source text, with words, numbers ({i * 7}) and punctuation;"
                         for i in range(120))
    return [
        ("empty", {field: ""}),
        ("whitespace", {field: "  \n\t \r\n  "}),
        ("single_space", {field: " "}),
        ("missing_field", {"other": "a row without the field"}),
        ("null", {field: None}),
        ("padded", {field: "\n\n  A post with leading and trailing whitespace.  \n\n"}),
        ("non_ascii", {field: "Café naïve résumé — “quoted” ‘text’ … 日本語のテキスト, Ελληνικά, עברית, "
                              "emoji 🙂🚀, e\u0301 combining, nbsp\u00a0here, zero\u200bwidth, ﬁ ligature, x² ½"}),
        ("control_chars", {field: "line1\r\nline2\x00\x0b\x0c\x1b[31mred\x1b[0m\x85\u2028\u2029end\t"}),
        ("braces", {field: "Curly {text} {abstract} {prompt} {0} {} {{x}} %s %(name)s $x ${y} \\n"}),
        ("tldr_suffix", {field: "SUBREDDIT: r/test\n\nTITLE: A title\n\nPOST: Body text here.\n\nTL;DR:"}),
        ("list_value", {field: ["First sentence of the abstract.", "Second sentence."]}),
        ("very_long", {field: long_text}),
    ]


def build_rows(formatters: dict[str, dict[str, list[Callable]]], fields: dict[str, str]) -> list[dict]:
    rows = []
    for task in TASK_TYPES:
        inputs: list[tuple[str, dict]] = []
        for path in sorted((SAMPLES / task).glob("*.jsonl")):
            inputs += [(f"samples/{task}/{path.name}:{i}", row) for i, row in enumerate(read_jsonl(path))]
        inputs += [(f"crafted:{kind}", row) for kind, row in crafted_rows(fields[task])]
        for source, row in inputs:
            results = {name: [f(dict(row)) for f in fmts[task]] for name, fmts in formatters.items()}
            first = next(iter(results.values()))
            for name, prompts in results.items():
                if prompts != first:
                    sys.exit(f"{name} disagrees with {next(iter(results))} on {task} {source}")
            rows.append({"task": task, "source": source, "row": row, "prompts": first})
    return rows


def reference_field(fmt: Callable, candidates: list[str]) -> str:
    """The row field a formatter reads: the one candidate whose value shows up in its prompt."""
    found = [f for f in candidates if SENTINEL in fmt({f: SENTINEL})]
    if len(found) != 1:
        sys.exit(f"{fmt.__name__}: reads {found or 'none'} of {candidates}")
    return found[0]


def templates(formatters: dict[str, list[Callable]], candidates: list[str]) -> dict[str, dict]:
    """Per task: the field read, the prompt of a row without it, and each agent's template."""
    out = {}
    for task in TASK_TYPES:
        fmts = formatters[task]
        fields = {reference_field(f, candidates) for f in fmts}
        if len(fields) != 1:
            sys.exit(f"{task}: the agents read different fields {sorted(fields)}")
        field = fields.pop()
        empty = {f({field: ""}) for f in fmts}
        if len(empty) != 1:
            sys.exit(f"{task}: the agents answer an empty row differently")
        agents = []
        for f in fmts:
            text = f({field: SENTINEL})
            if text.count(SENTINEL) != 1 or PLACEHOLDER in text:
                sys.exit(f"{f.__name__}: the source text is not inserted exactly once")
            agents.append(text.replace(SENTINEL, PLACEHOLDER))
        out[task] = {"field": field, "if_empty": empty.pop(), "agents": agents,
                     "formatters": [f.__name__ for f in fmts]}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="the reference repository checkout (with train_magrpo.py)")
    ap.add_argument("--commit", help="the checkout's commit, when it is not a git work tree")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--write-data", action="store_true",
                    help=f"also rewrite the templates in {DATA_FILE.relative_to(REPO)}")
    args = ap.parse_args(argv)
    commit = args.commit or git_commit(args.checkout)
    if commit is None:
        sys.exit("cannot tell the reference commit: pass --commit")
    formatters = reference_formatters(args.checkout)
    first = formatters[TRAINERS[0]]
    found = templates(first, ["prompt", "abstract_text", "abstract", "text", "article", "post"])
    if args.write_data:
        data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
        data["reference"] = {"repo": "OpenMLRL/LLM_Collab_Writing", "commit": commit, "files": sorted(formatters)}
        data["tasks"] = found
        DATA_FILE.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        print(f"{DATA_FILE}: templates of {', '.join(found)}")
    rows = build_rows(formatters, {task: spec["field"] for task, spec in found.items()})
    meta = {"reference": "OpenMLRL/LLM_Collab_Writing", "commit": commit, "trainers": sorted(formatters),
            "formatters": {task: spec["formatters"] for task, spec in found.items()},
            "fields": {task: spec["field"] for task, spec in found.items()}, "rows": len(rows),
            "generator": "scripts/reference_fixtures/writing_prompts.py"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        # ASCII with escapes: no raw U+2028 / U+0085 that a line splitter could take for a newline.
        f.write(json.dumps({"meta": meta}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    counts = ", ".join(f"{t}: {sum(r['task'] == t for r in rows)}" for t in TASK_TYPES)
    print(f"{args.out}: {len(rows)} rows ({counts}) from {', '.join(sorted(formatters))}")


if __name__ == "__main__":
    main()
