"""Reference StrBuild prompts, for tests/test_strbuild_prompts_paper.py (task.prompts=paper).

Runs the training entry points of OpenMLRL/LLM_Collab_Minecraft (str_build/train/train_magrpo.py
and train_maac.py, `main()` with their own configs str_build/configs/str_build_{magrpo,maac}_config.yaml)
up to the trainer: the model loaders return placeholders, the tokenizer only records the chat
messages it is given, and the comlrl trainer class is replaced by one that keeps its arguments.
With the formatters and the `external_transition` (external mode position_feedback,
original_prompt and previous_response on) the script builds, per target of
str_build/dataset/data.csv and per agent:

* turn 1: the formatter's output, once with a chat template (the recorded chat messages, roles
  and contents: [system, user]) and once without (the reference's plain rendering, system + blank
  line + user);
* turns 2-4 after crafted completions: the external transition's prompt, passed through the
  formatter as comlrl does (a multi-line prompt bypasses the chat template: raw text, recorded
  as `raw`).

Position feedback reads no world state (only the target's letter positions and the previous
commands), so no Minecraft server and no block states are needed. Both trainers must produce the
same strings (checked). Writes tests/fixtures/strbuild_prompts_paper.jsonl: a first line
{"meta": ...}, then one line per prompt:

    {"trainer", "spacing", "num_agents", "target", "agent" (0-based), "turn" (1-based),
     "completions" (every agent's previous completion per earlier turn), "chat_template"
     (whether the reference applied one), "messages" (turn 1: the chat messages given to the
     template, [{"role": "system", "content": ...}, {"role": "user", "content": ...}]; later
     turns: null), "raw" (later turns: the exact prompt text the reference tokenizes without a
     template; turn 1: null), "message" (turn 1: the plain rendering; later turns: = raw)}

`spacing` is the reference's dataset.spacing (marl-llm's task.letter_gap): 2 in its configs,
1 is marl-llm's default wall (one empty column between letters); with one letter both agree.

Generated against commit 9c2e006d689b79c5caa0504e1878575d50a5f547. To regenerate:

    git clone https://github.com/OpenMLRL/LLM_Collab_Minecraft /tmp/ref_minecraft
    git -C /tmp/ref_minecraft checkout 9c2e006d689b79c5caa0504e1878575d50a5f547
    .venv/bin/python scripts/reference_fixtures/strbuild_prompts.py /tmp/ref_minecraft

(the project venv with the `bench` extra: the reference imports comlrl 1.4.3, datasets,
transformers, torch and yaml; nothing is downloaded). --commit records the commit
when the checkout is not a git work tree. The reference code stays outside this repository.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "strbuild_prompts_paper.jsonl"
PACKAGE = "LLM_Collab_Minecraft"  # the name the reference imports itself under
TEMPLATE_MARK = "\x00chat-template\x00"

# Crafted completions per agent for turns 1-3 (the prompts of turns 2-4 show the previous one,
# stripped, or nothing when it is blank).
COMPLETIONS = [
    ["/setblock 0 4 0 oak_planks\n/setblock 2 4 0 stone\n/setblock 4 4 0 oak_planks\n",
     "```\n/setblock 1 4 0 white_concrete\n/setblock 3 4 0 obsidian\n```\n"],
    ["  \n\t",
     "Sure! Here are my commands:\n/setblock 2 0 0 minecraft:obsidian\n/setblock 9 9 9 white_concrete  \n"],
    ["/setblock 0 0 0 oak_planks\r\n/setblock 1 0 0 stone\t",
     ""],
]
# Targets that get turns 2-4 (every target gets turn 1).
MULTI_TURN_TARGETS = ("I", "LI", "ICML")


class RecordingTokenizer:
    """Stands in for the Qwen tokenizer: the chat template serializes the messages it is given."""

    pad_token = None
    eos_token = "<eos>"

    def __init__(self) -> None:
        self.chat_template = "recorded"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        assert not tokenize and add_generation_prompt
        return TEMPLATE_MARK + json.dumps(messages)


class _Captured(Exception):
    pass


class CapturingTrainer:
    last: dict[str, Any] = {}

    def __init__(self, **kwargs: Any) -> None:
        CapturingTrainer.last = kwargs

    def train(self) -> None:
        raise _Captured


def install_package(checkout: Path) -> None:
    """Make `import LLM_Collab_Minecraft.str_build...` resolve to the checkout."""
    spec = importlib.util.spec_from_file_location(PACKAGE, checkout / "__init__.py",
                                                  submodule_search_locations=[str(checkout)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)


def run_main(checkout: Path, trainer: str, overrides: list[str]) -> tuple[dict[str, Any], RecordingTokenizer]:
    import importlib

    import transformers

    module = importlib.import_module(f"{PACKAGE}.str_build.train.train_{trainer}")
    tokenizer = RecordingTokenizer()
    transformers.AutoTokenizer.from_pretrained = staticmethod(lambda *a, **k: tokenizer)
    transformers.AutoModelForCausalLM.from_pretrained = staticmethod(lambda *a, **k: types.SimpleNamespace())
    module.AutoTokenizer = transformers.AutoTokenizer
    if hasattr(module, "AutoModelForCausalLM"):
        module.AutoModelForCausalLM = transformers.AutoModelForCausalLM
    setattr(module, "MAGRPOTrainer" if trainer == "magrpo" else "MAACTrainer", CapturingTrainer)
    config = checkout / "str_build" / "configs" / f"str_build_{trainer}_config.yaml"
    argv = sys.argv
    sys.argv = [f"train_{trainer}.py", "--config", str(config), "--override", "wandb.enabled=false", *overrides]
    try:
        module.main()
    except _Captured:
        pass
    else:
        raise RuntimeError(f"train_{trainer}.main() returned before training")
    finally:
        sys.argv = argv
    return dict(CapturingTrainer.last), tokenizer


def records(checkout: Path, trainer: str, spacing: int, num_agents: int) -> list[dict[str, Any]]:
    key = "magrpo" if trainer == "magrpo" else "maac"
    kw, tokenizer = run_main(checkout, trainer, [f"dataset.spacing={spacing}", f"{key}.num_agents={num_agents}"])
    formatters, transition = kw["formatters"], kw["external_transition"]
    items = [dict(row) for ds in (kw["train_dataset"], kw["eval_dataset"]) for row in ds]
    out = []

    def record(item, agent, turn, completions, text, messages):
        return {"trainer": trainer, "spacing": spacing, "num_agents": num_agents, "target": item["string"],
                "agent": agent, "turn": turn, "completions": completions,
                "chat_template": messages is not None, "messages": messages,
                "raw": text if messages is None else None, "message": text}

    for item in items:
        first = []
        for agent in range(num_agents):
            tokenizer.chat_template = "recorded"
            templated = formatters[agent](item)
            assert templated.startswith(TEMPLATE_MARK), "turn 1 is expected to use the chat template"
            messages = json.loads(templated[len(TEMPLATE_MARK):])
            assert [m["role"] for m in messages] == ["system", "user"]
            tokenizer.chat_template = None
            plain = formatters[agent](item)
            tokenizer.chat_template = "recorded"
            first.append(templated)
            out.append(record(item, agent, 1, [], plain, messages))
        if item["string"] not in MULTI_TURN_TARGETS:
            continue
        prompt_history = [[p] for p in first]
        response_history: list[list[str]] = [[] for _ in range(num_agents)]
        for t, joint in enumerate(COMPLETIONS, start=2):
            joint = joint[:num_agents]
            for a in range(num_agents):
                response_history[a].append(joint[a])
            nxt = transition(prompt=item["prompt"], agent_completions=list(joint), num_agents=num_agents,
                             prompt_history_per_agent=[list(h) for h in prompt_history],
                             response_history_per_agent=[list(h) for h in response_history])
            for agent in range(num_agents):
                seen = formatters[agent]({**item, "prompt": nxt[agent]})
                assert not seen.startswith(TEMPLATE_MARK)
                out.append(record(item, agent, t, [list(c[:num_agents]) for c in COMPLETIONS[:t - 1]], seen, None))
                prompt_history[agent].append(seen)
    return out


def commit_of(checkout: Path, given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def checkout_args(doc: str, out: Path) -> argparse.Namespace:
    """The command line of a LLM_Collab_Minecraft fixture script: checkout (resolved), --commit, --out."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a LLM_Collab_Minecraft checkout (its root directory)")
    parser.add_argument("--commit", help="the checkout's commit, when it is not a git work tree")
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    args.checkout = args.checkout.resolve()
    return args


def main() -> None:
    args = checkout_args(__doc__, OUT)
    checkout = args.checkout
    install_package(checkout)
    rows = []
    # Two agents (the configs): both spacings; one agent: the project's spacing, multi-turn targets.
    for spacing, num_agents in ((2, 2), (1, 2), (1, 1)):
        by_trainer = {t: records(checkout, t, spacing, num_agents) for t in ("magrpo", "maac")}
        same = [{k: v for k, v in r.items() if k != "trainer"} for r in by_trainer["magrpo"]]
        assert same == [{k: v for k, v in r.items() if k != "trainer"} for r in by_trainer["maac"]], \
            "train_magrpo.py and train_maac.py build different prompts"
        rows += [{"trainer": "magrpo+maac", **r} for r in same
                 if num_agents == 2 or r["target"] in MULTI_TURN_TARGETS]
    meta = {"source": "OpenMLRL/LLM_Collab_Minecraft", "commit": commit_of(checkout, args.commit),
            "files": ["str_build/train/train_magrpo.py", "str_build/train/train_maac.py",
                      "str_build/utils/prompting.py", "str_build/external/position_feedback.py",
                      "str_build/utils/str_builder.py", "str_build/dataset/data.csv",
                      "str_build/configs/str_build_magrpo_config.yaml", "str_build/configs/str_build_maac_config.yaml"],
            "completions": COMPLETIONS, "rows": len(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
