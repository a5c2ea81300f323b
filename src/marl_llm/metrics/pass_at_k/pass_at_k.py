"""pass@k of HumanEval-style programs, run in marl-llm's sandbox, as an `evaluate` metric.

Inputs: `predictions` (per problem, a list of n candidate programs), `references` (per problem,
the test code defining `check(candidate)`), `entry_points` (per problem, the function `check`
receives), `k` (list of k values, each <= n). Returns {"pass@<k>": mean unbiased estimate}
(Chen et al. 2021) and `passed` (per problem, per candidate). Unlike evaluate's `code_eval`,
programs never run in the calling process: each runs in a separate sandboxed process.
"""

import datasets
import evaluate

from marl_llm.training.rollout_metrics import mean_pass_at_k
from marl_llm.sandbox import SandboxLimits, run_tests_many


def _passed(outcome):
    return outcome.tests_total > 0 and outcome.tests_passed == outcome.tests_total


class PassAtK(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation="Chen et al., Evaluating Large Language Models Trained on Code, arXiv 2107.03374",
            inputs_description="predictions: list of lists of programs; references: list of test code; "
                               "entry_points: list of names; k: list of ints; timeout_s: per-test seconds",
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("string")),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references, entry_points=None, k=(1,), timeout_s=5.0, workers=2):
        if entry_points is None or len(entry_points) != len(references):
            raise ValueError("pass_at_k needs entry_points: one function name per problem (what check() tests)")
        jobs = [(program, test, entry) for cands, test, entry in zip(predictions, references, entry_points)
                for program in cands]
        outcomes = iter(run_tests_many(jobs, SandboxLimits(timeout_s=timeout_s), workers=workers))
        passed = [[_passed(next(outcomes)) for _ in cands] for cands in predictions]
        counts = [(len(p), sum(p)) for p in passed]
        out = {f"pass@{kk}": mean_pass_at_k(counts, kk) for kk in k}
        out["passed"] = passed
        return out
