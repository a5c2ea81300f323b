"""Writing reward levels (TLDR summarization / arXiv expansion) as an `evaluate` metric.

Config name `tldr` (default) or `arxiv` picks the task's bands, the same defaults as
conf/task/<name>.yaml. Inputs: `first` (agent 1's texts) and `second` (agent 2's texts);
`variant`: `fixed` (default, marl-llm's reward) or `paper` (the reference trainers' reward,
quirks included, as task.reward.variant=paper: docs/rewards_writing.md; texts scored as given,
unstripped, and `transition_form` does not apply). Returns the mean total `reward` (max 3.0),
`reward_ungated`, every level gated and ungated (`structure`, `structure_ungated`, ...), and
`rewards` (the per-example totals).
"""

import datasets
import evaluate

from marl_llm.tasks.writing_reward import LEVEL_MAX, WritingRewardSpec, score_writing
from marl_llm.tasks.writing_reward_paper import PaperRewardSpec, score_writing_paper



def task_spec(task):
    """The bands of conf/task/<task>.yaml (the package's own config), so both stay in step."""
    from importlib import resources

    from omegaconf import OmegaConf

    cfg = OmegaConf.load(str(resources.files("marl_llm.conf").joinpath("task", f"{task}.yaml")))
    return WritingRewardSpec.from_cfg(cfg.reward)


class WritingReward(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="Liu et al., LLM Collaboration With Multi-Agent Reinforcement Learning, arXiv 2508.04652",
            inputs_description="first: list of agent-1 texts; second: list of agent-2 texts; "
                               "transition_form: 'linear' (default) or 'log'; variant: 'fixed' (default) or 'paper'",
            features=datasets.Features({"first": datasets.Value("string"), "second": datasets.Value("string")}),
        )

    def _compute(self, first, second, transition_form="linear", variant="fixed"):
        name = self.config_name if self.config_name in ("tldr", "arxiv") else "tldr"
        if variant == "paper":
            paper = PaperRewardSpec.for_task(name)
            scores = [score_writing_paper(a, b, paper) for a, b in zip(first, second)]
        elif variant == "fixed":
            spec = WritingRewardSpec(**{**task_spec(name).__dict__, "transition_form": transition_form})
            scores = [score_writing(a, b, spec) for a, b in zip(first, second)]
        else:
            raise ValueError(f"variant={variant!r}: use 'fixed' (marl-llm's reward) or 'paper' (the reference's)")
        n = max(len(scores), 1)
        out = {"reward": sum(s.total for s in scores) / n,
               "reward_ungated": sum(sum(s.ungated.values()) for s in scores) / n}
        for level in LEVEL_MAX:
            out[level] = sum(s.levels[level] for s in scores) / n
            out[f"{level}_ungated"] = sum(s.ungated[level] for s in scores) / n
        out["rewards"] = [s.total for s in scores]
        return out
