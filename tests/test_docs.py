"""The docs stay usable: every relative link lands on a file (and heading), every config key is in
the configuration reference, and the README stays a short newcomer's page. No model is loaded."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig

from conftest import compose_config

REPO = Path(__file__).resolve().parents[1]
DOC_PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
CONFIG_REFERENCE = REPO / "docs" / "configuration.md"
README_MAX_LINES = 300

FENCED_BLOCK = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(markdown: str) -> str:
    """The text outside fenced code blocks: a `# comment` in a YAML block is not a heading."""
    return FENCED_BLOCK.sub("", markdown)


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lowercase, punctuation dropped (word characters, spaces and
    hyphens kept), each space a hyphen. Link text inside the heading counts as its text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    """Every heading id of a page, with GitHub's -1, -2, ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(prose(page.read_text())):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
        seen[anchor] = count + 1
    return anchors


def relative_links(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", prose(page.read_text()))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)]


def test_the_anchor_rule_matches_githubs():
    assert github_anchor("FSDP: a base that does not fit one GPU (`trainer.fsdp=true`)") == \
        "fsdp-a-base-that-does-not-fit-one-gpu-trainerfsdptrue"
    assert github_anchor("Prompts: `task.prompts = own | paper`") == "prompts-taskprompts--own--paper"
    assert github_anchor("Reports: `marl-llm-report` / `make report`") == "reports-marl-llm-report--make-report"


def test_every_relative_link_resolves():
    broken = []
    for page in DOC_PAGES:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not dest.exists():
                broken.append(f"{where} -> no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                broken.append(f"{where} -> no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def is_map_field(node: DictConfig) -> bool:
    """A Dict[str, ...] field (algo.agent_sampling, task.data.files, ...), whose keys are the
    user's, as opposed to a section typed by a dataclass schema."""
    object_type = node._metadata.object_type
    return object_type is None or object_type is dict


def leaf_keys(node: DictConfig, prefix: str = "") -> set[str]:
    """The dotted leaf keys of a composed config; a map field counts as one key."""
    keys = set()
    for name in node:
        child = node._get_node(name)
        dotted = f"{prefix}{name}"
        if isinstance(child, DictConfig) and not child._is_none() and not is_map_field(child):
            keys |= leaf_keys(child, dotted + ".")
        else:
            keys.add(dotted)
    return keys


def option_names(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml") if not p.stem.startswith("_"))


def test_every_config_key_is_in_the_configuration_reference():
    # Every algorithm with one task and every task with one algorithm: an option's keys do not
    # depend on the other group's choice (only debug=tiny picks files by the pair), and the 72 pairs
    # took 36 s of the suite.
    algos, tasks = option_names("algo"), option_names("task")
    pairs = {(algo, tasks[0]) for algo in algos} | {(algos[0], task) for task in tasks}
    keys: set[str] = set()
    for algo, task in sorted(pairs):
        keys |= leaf_keys(compose_config([f"algo={algo}", f"task={task}", "run_dir=/tmp/docs"]))
    assert {"seed", "trainer.save_every", "model.path", "logger.mode", "cluster.partition", "algo.num_generations",
            "algo.agent_sampling", "task.data.files", "algo.critic.placement"} <= keys  # the walk found the tree
    documented = set(re.findall(r"`([^`\s]+)`", CONFIG_REFERENCE.read_text()))
    missing = sorted(keys - documented)
    assert not missing, f"{len(missing)} config keys not in backticks in docs/configuration.md: {', '.join(missing)}"


def test_the_readme_is_a_short_page():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"
