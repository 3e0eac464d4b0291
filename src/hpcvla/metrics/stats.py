"""Small-sample statistics for comparing seeds: Student-t critical values and Welch's
interval for a difference of means."""

from __future__ import annotations

import math

import numpy as np

# two-sided 97.5 % quantiles of Student's t, by degrees of freedom (1..30; normal beyond)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def welch_interval(a, b) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its 95 % Welch confidence interval."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    diff = a.mean() - b.mean()
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = T975[min(int(df), 30) - 1] if df < 31 else 1.96
    return diff, diff - t * se, diff + t * se
