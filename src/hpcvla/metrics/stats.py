"""Small-sample statistics: Student-t critical values, a mean's interval over seeds and
Welch's interval for a difference of means (comparing seeds), Wilson's interval for a success
rate (evaluation), and the difference of two policies' success on the same episodes
(evaluation, paired)."""

from __future__ import annotations

import math

import numpy as np

# 0.975 quantiles of Student's t (two-sided 95 %), by degrees of freedom (1..30; normal beyond)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t_critical(df: int) -> float:
    """The two-sided 95 % critical value of Student's t with `df` >= 1 degrees of freedom
    (the normal's beyond 30)."""
    if df < 1:
        raise ValueError(f"Student's t with {df} degrees of freedom: at least 1")
    return T975[df - 1] if df <= 30 else 1.96


def mean_interval(values) -> tuple[float, float, float]:
    """The mean of `values` (one per seed) and its 95 % Student-t interval: mean ± t(0.975,
    n-1) · sd / sqrt(n); t rather than 1.96 because n is a handful of seeds (4.30 at n = 3).
    One value has no interval: (mean, mean, mean)."""
    v = np.asarray(values, float)
    mean = float(v.mean())
    if len(v) < 2:
        return mean, mean, mean
    half = t_critical(len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return mean, mean - half, mean + half


def welch_interval(a, b) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its 95 % Welch confidence interval."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    diff = a.mean() - b.mean()
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = t_critical(max(1, int(df)))  # (df >= 1 exactly; its float may round below)
    return diff, diff - t * se, diff + t * se


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a success rate (successes of n): unlike the normal
    approximation it stays inside [0, 1] and is not empty at 0 or n successes, which per
    task success rates of 50 episodes often are."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    scale = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / scale
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / scale
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(before, after, z: float = 1.96) -> dict:
    """`after`'s success rate minus `before`'s where the i-th outcomes of both are one
    episode's (the same task and initial state): the difference, its 95 % interval for
    matched proportions by Agresti and Min (2005: the Wald interval with half an episode
    added to each of the four outcome pairs), the episodes gained (failed before, succeeded
    after) and lost, and McNemar's exact two-sided p-value (the discordant episodes as a fair
    coin's tosses). Paired, the states' own difficulty drops out: the interval is narrower
    than two rates' intervals side by side suggest."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired outcomes: {len(before)} and {len(after)} episodes; "
                         "give one outcome of each policy per episode, at least one")
    n = len(before)
    gained = sum(1 for b, a in zip(before, after) if a and not b)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    g, lo_, m = gained + 0.5, lost + 0.5, n + 2  # Agresti-Min: +1/2 to each pair's count
    centre = (g - lo_) / m
    half = z * math.sqrt((g + lo_) - (g - lo_) ** 2 / m) / m
    tosses = gained + lost
    tail = sum(math.comb(tosses, i) for i in range(min(gained, lost) + 1)) / 2 ** tosses
    return {"episodes": n, "difference": (gained - lost) / n,
            "ci95": [max(-1.0, centre - half), min(1.0, centre + half)],
            "gained": gained, "lost": lost, "mcnemar_p": min(1.0, 2 * tail)}


def known_mean(values: list) -> float | None:
    """The mean of the figures known: None is one not known (an evaluation every episode of
    which was an env fault, a rolling rate before any episode ended); None if none is."""
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def known_difference(a: list, b: list, name: str = "difference") -> dict | None:
    """`a`'s mean minus `b`'s over their figures known (None left out: known_mean), as
    {name: it, "ci95": its 95 % Welch interval (the difference itself where a side has one
    figure), "seeds": how many of each}; None where a side has none."""
    a, b = [v for v in a if v is not None], [v for v in b if v is not None]
    if not a or not b:
        return None
    diff, low, high = welch_interval(a, b) if min(len(a), len(b)) > 1 else (
        float(np.mean(a) - np.mean(b)),) * 3
    return {name: diff, "ci95": [low, high], "seeds": [len(a), len(b)]}
