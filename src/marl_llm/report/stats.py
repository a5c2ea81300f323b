"""Statistics over runs: mean and sample std, the interquartile mean (IQM) and its stratified
bootstrap confidence interval (rliable's recipe), with the fixed settings every report states."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

# Intervals of the headline metric, rliable's recipe (Agarwal et al. 2021): the interquartile mean over
# runs and a percentile bootstrap that resamples runs within each task (stratified). Fixed seed: the
# report is reproducible byte for byte.
CI_LEVEL = 0.95
CI_RESAMPLES = 2000
CI_SEED = 0
CI_DESCRIPTION = (f"IQM (interquartile mean: the mean of the middle 50% of runs, the plain mean below 4 runs) "
                  f"with a {CI_LEVEL:.0%} percentile bootstrap confidence interval: runs resampled with "
                  f"replacement within each task (stratified bootstrap, as rliable), {CI_RESAMPLES} resamples, "
                  f"seed {CI_SEED}")


def mean_std(values: Sequence[float]) -> tuple[float, float | None] | None:
    """Mean and sample std (n - 1 denominator: the runs are a sample of seeds); std None for one value,
    which says nothing about the spread."""
    if not values:
        return None
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def iqm(scores: Any) -> Any:
    """Interquartile mean along the last axis: the mean of the middle 50% after cutting int(n/4) scores
    at each end (rliable's ``aggregate_iqm``, scipy's ``trim_mean(x, 0.25)``); the mean for n < 4."""
    x = np.sort(np.asarray(scores, dtype=float), axis=-1)
    cut = int(0.25 * x.shape[-1])
    return x[..., cut:x.shape[-1] - cut].mean(axis=-1)


def stratified_bootstrap_ci(strata: Sequence[Sequence[float]], statistic=iqm, level: float = CI_LEVEL,
                            resamples: int = CI_RESAMPLES, seed: int = CI_SEED) -> tuple[float, float] | None:
    """Percentile bootstrap CI of `statistic` over the pooled scores, each resample drawing every stratum's
    scores (one stratum per task: its runs) with replacement, as rliable's StratifiedBootstrap does.
    None below two scores: one run has no interval."""
    arrays = [np.asarray(s, dtype=float) for s in strata if len(s)]
    if sum(a.size for a in arrays) < 2:
        return None
    rng = np.random.default_rng(seed)
    pooled = np.concatenate([a[rng.integers(0, a.size, size=(resamples, a.size))] for a in arrays], axis=1)
    stats = statistic(pooled)
    low, high = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)
