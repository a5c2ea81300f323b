"""Reference StrBuild rewards, for tests/test_strbuild_reward_paper.py (task.reward.variant=paper).

Runs the MAGRPO training entry point of OpenMLRL/LLM_Collab_Minecraft (str_build/train/train_magrpo.py,
`main()` with its own config str_build/configs/str_build_magrpo_config.yaml and a few overrides) up
to the trainer, as scripts/reference_fixtures/strbuild_prompts.py does, and keeps what it hands to
comlrl's MAGRPOTrainer: the reward function (`get_reward_function` of
str_build/rewards/str_builder_reward.py over the utilities of str_build/utils/str_builder.py), the
reward processor (shift -2) and the dataset items (built by its own `load_tasks_from_csv`). Then it
scores generated joint actions the way comlrl 1.4.3 scores a node: `call_reward_function` with
that turn's completions only and `batch_items=[item]` (comlrl/trainers/reinforce/magrpo.py
`_compute_rewards`; a tree node's reward never sees the earlier turns' completions). A case is a
target with 1-4 turns of joint actions; every turn is scored on its own.

Settings (dataset.spacing, palettes task.block_agent1/2, magrpo.num_agents) vary per group of
cases: the configs' (spacing 2, [oak_planks, stone, air] / [white_concrete, obsidian, air]), the
project's default wall (spacing 1) and wool palettes, one builder, and palettes whose colour keys
alias (spruce_planks ~ oak_planks, cobblestone ~ stone). Targets: the configs' data.csv strings
plus a few others (written to a temporary CSV the entry point loads). Completions are built from
each target's own cells (the item's target_rows_topdown) with a seeded generator: perfect and
partial builds, extra and same-colour blocks, missing palettes, `air`, block-name case, list
markers, code fences, malformed and out-of-box commands, the per-agent command cap (150 of 300)
and prose.

Writes tests/fixtures/strbuild_reward_paper.jsonl.gz: a first line {"meta": ...}, then one line
per case:

    {"id", "group", "spacing", "num_agents", "palettes" (the config's block lists, air included),
     "target", "kind", "turns": [[completion per agent], ...],
     "rewards": [the reference reward per turn, unshifted],
     "shifted": [after the config's reward processor],
     "metrics": [per turn, what score_str_builder returned: target_total, covered, extra_blocks,
                 coverage_ratio, extra_ratio, adjacent_same_color_pairs, adjacent_color_pairs,
                 adjacent_same_color_ratio, missing_agent_palette_count, score_total],
     "iou": [per turn, the reference's logged iou]}

Generated against commit 9c2e006d689b79c5caa0504e1878575d50a5f547 (REF_COMMIT; another commit is
refused unless --commit names it). To regenerate:

    git clone https://github.com/OpenMLRL/LLM_Collab_Minecraft /tmp/ref_minecraft
    git -C /tmp/ref_minecraft checkout 9c2e006d689b79c5caa0504e1878575d50a5f547
    .venv/bin/python scripts/reference_fixtures/strbuild_rewards.py /tmp/ref_minecraft

(the project venv with the `bench` extra: the entry point imports comlrl 1.4.3, datasets,
transformers, torch and yaml; nothing is downloaded). The reference code stays outside this
repository.
"""

from __future__ import annotations

import gzip
import importlib
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import git_commit  # noqa: E402
from strbuild_prompts import PACKAGE, checkout_args, install_package, run_main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "strbuild_reward_paper.jsonl.gz"
REF_COMMIT = "9c2e006d689b79c5caa0504e1878575d50a5f547"
SEED = 20240533

CONFIG_PALETTES = (["oak_planks", "stone", "air"], ["white_concrete", "obsidian", "air"])
# (group, spacing, num_agents, palettes)
GROUPS = [
    ("config", 2, 2, CONFIG_PALETTES),
    ("spacing1", 1, 2, CONFIG_PALETTES),
    ("one_builder", 2, 1, CONFIG_PALETTES[:1]),
    ("wool", 1, 2, (["red_wool", "orange_wool", "yellow_wool", "air"], ["blue_wool", "cyan_wool", "purple_wool", "air"])),
    ("alias", 2, 2, (["oak_planks", "spruce_planks", "air"], ["stone", "cobblestone", "air"])),
]
TARGETS = ["I", "C", "M", "L", "MC", "CM", "LI", "LLM", "ICML", "CLIM", "A", "HI", "ZOO", "O K"]
CASES_PER_TARGET = 14  # random kinds per (group, target), on top of the fixed kinds


# ------------------------------------------------------------------------------- geometry
def cells(item: dict[str, Any]) -> list[tuple[int, int]]:
    """The item's target cells (x, y), from its rows (top row first)."""
    rows = item["target_rows_topdown"]
    h = len(rows)
    return [(x, h - 1 - r) for r, row in enumerate(rows) for x, ch in enumerate(row) if ch == "#"]


def box(item: dict[str, Any]) -> tuple[int, int]:
    """(width, height) of the item's wall."""
    return item["local_bbox_to"][0] + 1, item["local_bbox_to"][1] + 1


def background(item: dict[str, Any]) -> list[tuple[int, int]]:
    w, h = box(item)
    target = set(cells(item))
    return [(x, y) for x in range(w) for y in range(h) if (x, y) not in target]


def blocks(palettes, agent: int) -> list[str]:
    return [b for b in palettes[agent] if b != "air"]


def cmd(x, y, block, z=0, style="/setblock") -> str:
    return f"{style} {x} {y} {z} {block}"


# ------------------------------------------------------------------------------- completions
def perfect(item, palettes, rng) -> list[str]:
    """Agent a builds the cells with (x + y) % n == a, its blocks alternating."""
    n = len(palettes)
    out = [[] for _ in range(n)]
    for x, y in cells(item):
        a = (x + y) % n
        b = blocks(palettes, a)
        out[a].append(cmd(x, y, b[(x // n + y) % len(b)]))
    return ["\n".join(c) for c in out]


def one_agent_builds(item, palettes, rng) -> list[str]:
    b = blocks(palettes, 0)
    text = "\n".join(cmd(x, y, b[(x + y) % len(b)]) for x, y in cells(item))
    return [text] + [""] * (len(palettes) - 1)


def one_block_each(item, palettes, rng) -> list[str]:
    """Every agent uses only its first block: palettes incomplete, neighbours often the same."""
    n = len(palettes)
    return ["\n".join(cmd(x, y, blocks(palettes, a)[0]) for x, y in cells(item) if (x + y) % n == a)
            for a in range(n)]


def partial(item, palettes, rng) -> list[str]:
    n = len(palettes)
    out = [[] for _ in range(n)]
    for x, y in cells(item):
        if rng.random() < rng.choice([0.3, 0.6, 0.9]):
            a = rng.randrange(n)
            out[a].append(cmd(x, y, rng.choice(blocks(palettes, a))))
    return ["\n".join(c) for c in out]


def with_extras(item, palettes, rng) -> list[str]:
    base = perfect(item, palettes, rng)
    bg = background(item)
    out = []
    for a, text in enumerate(base):
        extra = [cmd(x, y, rng.choice(blocks(palettes, a))) for x, y in rng.sample(bg, min(len(bg), rng.randint(1, 12)))]
        out.append("\n".join([text, *extra]) if rng.random() < 0.5 else "\n".join([*extra, text]))
    return out


def fill_box(item, palettes, rng) -> list[str]:
    """Agent 1 fills the whole wall; the others place nothing or remove some cells with air."""
    w, h = box(item)
    b = blocks(palettes, 0)
    first = "\n".join(cmd(x, y, b[(x + y) % len(b)]) for x in range(w) for y in range(h))
    rest = ["\n".join(cmd(x, y, "air") for x, y in rng.sample(background(item), min(5, len(background(item)))))
            for _ in range(len(palettes) - 1)]
    return [first, *rest]


def air_removes(item, palettes, rng) -> list[str]:
    """Agent 1 builds everything, agent 2 removes some target cells (and agent 1 removes some of its own)."""
    n = len(palettes)
    target = cells(item)
    b = blocks(palettes, 0)
    first = [cmd(x, y, b[(x + y) % len(b)]) for x, y in target]
    first += [cmd(x, y, "air") for x, y in rng.sample(target, min(2, len(target)))]
    out = ["\n".join(first)]
    for a in range(1, n):
        out.append("\n".join(cmd(x, y, "air") for x, y in rng.sample(target, min(4, len(target)))))
    return out


def decorated(item, palettes, rng) -> list[str]:
    """The perfect build with list markers, slashes, case and prefixes varied line by line."""
    markers = ["", "1. ", "2) ", "- ", "* ", "-- ", "** ", "10. ", "  3.", "•", "a) "]
    styles = ["/setblock", "setblock", "/SetBlock", "/SETBLOCK", "/ setblock", "//setblock", "\\setblock"]
    out = []
    for text in perfect(item, palettes, rng):
        lines = []
        for line in text.splitlines():
            _, x, y, z, block = line.split()
            if rng.random() < 0.2:
                block = rng.choice([block.capitalize(), block.upper(), f"minecraft:{block}", f"Minecraft:{block}",
                                    f" minecraft:{block}", f"{block}[]"])
            style = rng.choice(styles) if rng.random() < 0.4 else "/setblock"
            lines.append(rng.choice(markers) + f"{style} {x} {y} {z} {block}")
        out.append("\n".join(lines))
    return out


def fenced(item, palettes, rng) -> list[str]:
    out = []
    for text in perfect(item, palettes, rng):
        lines = text.splitlines()
        cut = rng.randint(0, len(lines))
        inside, outside = "\n".join(lines[:cut]), "\n".join(lines[cut:])
        tag = rng.choice(["", "mcfunction", "text", "bash", "minecraft-commands", "1"])
        shape = rng.choice(["plain", "second_fence", "unclosed", "prose_around", "inline"])
        if shape == "plain":
            out.append(f"```{tag}\n{inside}\n```\n{outside}")
        elif shape == "second_fence":
            out.append(f"Here:\n```{tag}\n{inside}\n```\nand\n```\n{outside}\n```")
        elif shape == "unclosed":
            out.append(f"```{tag}\n{inside}\n{outside}")
        elif shape == "prose_around":
            out.append(f"Sure! My commands:\n```{tag}\n{text}\n```\nDone.")
        else:
            out.append(f"```{tag} {inside}```\n{outside}")
    return out


def malformed(item, palettes, rng) -> list[str]:
    """Lines that the reference rejects or reads in surprising ways, mixed into a partial build."""
    w, h = box(item)
    out = []
    for a, text in enumerate(partial(item, palettes, rng)):
        b = rng.choice(blocks(palettes, a))
        other = rng.choice(blocks(palettes, (a + 1) % len(palettes))) if len(palettes) > 1 else "dirt"
        x, y = rng.choice(cells(item))
        odd = [cmd(f"~{x}", y, b), cmd(x, f"^{y}", b), cmd(f"+{x}", y, b), cmd(x, y, b, z="-0"),
               cmd(f"{x}.0", y, b), cmd(x, y, b, z=1), cmd(w, 0, b), cmd(0, h, b), cmd(-1, 0, b),
               cmd(x, y, other), cmd(x, y, "dirt"), f"/setblock {x} {y} 0", f"/setblock {x} {y} 0 {b} replace",
               f"/fill 0 0 0 {w - 1} {h - 1} 0 {b}", f"/setblock {x} {y} 0 {b} keep extra", "/setblock",
               f"/setblock\t{x}\t{y}\t0\t{b}", f"/setblock {x}  {y} 0  {b}", cmd(f"0_{x}" if x < 10 else x, y, b),
               f"/setblock ١ {y} 0 {b}", "I will now place the blocks.", f"`/setblock {x} {y} 0 {b}`",
               cmd(x, y, "AIR"), cmd(x, y, "minecraft:air"), cmd(x, y, "cave_air")]
        lines = text.splitlines() + rng.sample(odd, rng.randint(3, 10))
        rng.shuffle(lines)
        sep = rng.choice(["\n", "\r\n", "\n\n"])
        out.append(sep.join(lines))
    return out


def over_cap(item, palettes, rng) -> list[str]:
    """More commands than the per-agent cap (300 // agents): what comes after the cap is dropped,
    also when it is the only correct part; rejected lines do not count towards the cap."""
    w, h = box(item)
    out = []
    for a in range(len(palettes)):
        b = blocks(palettes, a)
        filler = [cmd(x, y, b[0]) for x, y in background(item)]
        filler = (filler * (400 // max(len(filler), 1) + 1))[:rng.choice([149, 150, 151, 160, 299, 300, 320])]
        prose = ["not a command"] * rng.randint(0, 20)
        tail = [cmd(x, y, b[(x + y) % len(b)]) for x, y in cells(item) if (x + y) % len(palettes) == a]
        lines = prose + filler + tail if rng.random() < 0.7 else tail + filler
        out.append("\n".join(lines))
    return out


def duplicates(item, palettes, rng) -> list[str]:
    """The same cell set several times: the last write wins (agent 1's lines before agent 2's)."""
    out = []
    target = cells(item)
    for a in range(len(palettes)):
        lines = []
        for x, y in rng.sample(target, min(len(target), 8)):
            for _ in range(rng.randint(1, 3)):
                lines.append(cmd(x, y, rng.choice(blocks(palettes, a) + ["air"])))
        out.append("\n".join(lines))
    return out


def nothing(item, palettes, rng) -> list[str]:
    return [rng.choice(["", "   \n\t", "I cannot do that.", "```\n```", "```mcfunction\n```"]) for _ in palettes]


def random_commands(item, palettes, rng) -> list[str]:
    """Commands at random cells of a box larger than the wall, random blocks of any palette."""
    w, h = box(item)
    every = [b for p in palettes for b in p]
    return ["\n".join(cmd(rng.randint(-1, w), rng.randint(-1, h), rng.choice(every), z=rng.choice([0, 0, 0, 1]))
                      for _ in range(rng.randint(0, 40))) for _ in palettes]


FIXED: dict[str, Callable] = {"perfect": perfect, "one_agent_builds": one_agent_builds, "one_block_each": one_block_each,
                              "fill_box": fill_box, "air_removes": air_removes, "nothing": nothing}
RANDOM: dict[str, Callable] = {"partial": partial, "with_extras": with_extras, "decorated": decorated,
                               "fenced": fenced, "malformed": malformed, "over_cap": over_cap,
                               "duplicates": duplicates, "random_commands": random_commands}


# ------------------------------------------------------------------------------- the reference
def reference_scorer(checkout: Path, group: tuple, csv_path: Path):
    """(score(item, joint) -> (reward, shifted, metrics, iou), items by target) for one group."""
    name, spacing, num_agents, palettes = group
    overrides = [f"dataset.csv_path={csv_path}", "dataset.train_split=[:]", "dataset.eval_split=null",
                 f"dataset.spacing={spacing}", f"magrpo.num_agents={num_agents}",
                 f"task.block_agent1={json.dumps(palettes[0])}"]
    if num_agents > 1:
        overrides.append(f"task.block_agent2={json.dumps(palettes[1])}")
    kw, _ = run_main(checkout, "magrpo", overrides)
    reward_func, processor = kw["reward_func"], kw["reward_processor"]
    items = {row["string"]: dict(row) for row in kw["train_dataset"]}
    reward_module = importlib.import_module(f"{PACKAGE}.str_build.rewards.str_builder_reward")
    from comlrl.utils.reward_utils import call_reward_function

    captured: list[dict] = []
    original = reward_module.score_str_builder

    def capture(**kwargs):
        metrics = original(**kwargs)
        captured.append(dict(metrics))
        return metrics

    def score(item, joint):
        captured.clear()
        reward_module.score_str_builder = capture
        try:
            [reward] = call_reward_function(reward_func, [item["prompt"]], [[c] for c in joint],
                                            num_agents=num_agents, batch_items=[item])
        finally:
            reward_module.score_str_builder = original
        [metrics] = captured
        keep = ("target_total", "covered", "extra_blocks", "coverage_ratio", "extra_ratio", "adjacent_same_color_pairs",
                "adjacent_color_pairs", "adjacent_same_color_ratio", "missing_agent_palette_count", "score_total")
        return reward, processor(reward), {k: metrics[k] for k in keep}, reward_module._compute_iou(metrics)

    return score, items


def cases_for(group: tuple, items: dict[str, dict], rng: random.Random) -> list[tuple[str, str, list[list[str]]]]:
    """(target, kind, turns) of one group: the fixed kinds as one-turn cases, random kinds in
    sequences of 1-4 turns (turn t > 1 scores its own joint action only)."""
    palettes = group[3]
    out = []
    for target in TARGETS:
        item = items[target]
        for kind, make in FIXED.items():
            out.append((target, kind, [make(item, palettes, rng)]))
        for _ in range(CASES_PER_TARGET):
            n_turns = rng.choice([1, 1, 2, 2, 3, 4])
            kinds = [rng.choice(list(RANDOM)) for _ in range(n_turns)]
            turns = [RANDOM[k](item, palettes, rng) for k in kinds]
            out.append((target, "+".join(kinds), turns))
    return out


def main() -> None:
    args = checkout_args(__doc__, OUT)
    checkout = args.checkout
    commit = args.commit or git_commit(checkout)
    if commit != REF_COMMIT:
        sys.exit(f"{checkout} is at {commit}, the fixtures are of {REF_COMMIT}: check that commit out "
                 "(or pass --commit for a copy that is not a git work tree)")
    install_package(checkout)
    rng = random.Random(SEED)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "targets.csv"
        csv_path.write_text("string,difficulty\n" + "".join(f'"{t}",1\n' for t in TARGETS), encoding="utf-8")
        for group in GROUPS:
            name, spacing, num_agents, palettes = group
            score, items = reference_scorer(checkout, group, csv_path)
            for target, kind, turns in cases_for(group, items, rng):
                scored = [score(items[target], joint) for joint in turns]
                rows.append({"id": len(rows), "group": name, "spacing": spacing, "num_agents": num_agents,
                             "palettes": [list(p) for p in palettes], "target": target, "kind": kind,
                             "turns": turns, "rewards": [s[0] for s in scored], "shifted": [s[1] for s in scored],
                             "metrics": [s[2] for s in scored], "iou": [s[3] for s in scored]})
    meta = {"source": "OpenMLRL/LLM_Collab_Minecraft", "commit": commit, "seed": SEED,
            "files": ["str_build/train/train_magrpo.py", "str_build/rewards/str_builder_reward.py",
                      "str_build/utils/str_builder.py", "str_build/configs/str_build_magrpo_config.yaml"],
            "caller": "comlrl 1.4.3 comlrl.utils.reward_utils.call_reward_function (as MAGRPOTrainer._compute_rewards)",
            "groups": [g[0] for g in GROUPS], "rows": len(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [{"meta": meta}, *rows])
    with gzip.GzipFile(args.out, "wb", mtime=0) as gz:  # mtime 0: the same bytes on every run
        gz.write(text.encode("utf-8"))
    print(f"wrote {len(rows)} cases ({sum(len(r['turns']) for r in rows)} scored turns) to {args.out}")


if __name__ == "__main__":
    main()
