"""Exact moments vs Monte Carlo: the mean GRPO update E[g](p) on a grid of 1,000 pass rates.

Target (issue): `estimator_moments` evaluates a method on 1,000 pass rates for G up to 64 in
under a second on one core. Baseline: a Monte Carlo estimate of the same means, sampling
reward groups and calling `group_advantages` on them, with enough groups at each p that its
standard error is `--relative-error` times |E[g](p)|, i.e. n(p) = Var[g] / (rel * E[g])^2.
n(p) comes from the exact moments, so the Monte Carlo skips the pilot run it would need in
practice and its time is a lower bound. Where it would take longer than `--mc-budget` seconds,
its time is extrapolated from the per-group cost of a timed batch, marked "est.".

    python benchmarks/exact_vs_montecarlo.py
"""

import grpo_companion  # noqa: F401  first: pins the kernels before torch and numpy load

# isort: split

import argparse
import time

import numpy as np
import torch

from grpo_companion.core.advantages import group_advantages
from grpo_companion.core.exact import estimator_moments

TARGET_SECONDS = 1.0
METHOD = "grpo"


def time_exact(pass_rates, group_size, repeats=5):
    """Median wall time of one `estimator_moments` call on the whole grid, and its result."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        moments = estimator_moments(pass_rates, group_size, METHOD)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), moments


def sampled_mean(pass_rate, group_size, num_groups, generator, batch_size=2**16):
    """Monte Carlo mean of g = (1/G) sum_i A_i s_i over `num_groups` sampled groups."""
    total = 0.0
    for start in range(0, num_groups, batch_size):
        size = min(batch_size, num_groups - start)
        rewards = (torch.rand(size, group_size, generator=generator) < pass_rate).float()
        advantages = group_advantages(rewards, METHOD)
        scores = torch.where(rewards == 1, 1 - pass_rate, -pass_rate)
        total += (advantages * scores).mean(dim=1).double().sum().item()
    return total / num_groups


def seconds_per_group(group_size, generator, num_groups=2**18):
    start = time.perf_counter()
    sampled_mean(0.5, group_size, num_groups, generator)
    return (time.perf_counter() - start) / num_groups


def time_monte_carlo(pass_rates, group_size, moments, relative_error, budget, generator):
    """(seconds, total groups, mean over p of z^2), z = (MC mean - exact mean) / standard error.

    Mean z^2 is ~1 when both compute the same means (a max of |z| would not do: with one group
    at some p, z is far from normal). It is None when the time is extrapolated, not measured.
    """
    groups = np.ceil(moments["variance"] / (relative_error * moments["mean"]) ** 2).astype(int)
    estimate = groups.sum() * seconds_per_group(group_size, generator)
    if estimate > budget:
        return estimate, groups.sum(), None
    start = time.perf_counter()
    means = np.array(
        [sampled_mean(p, group_size, n, generator) for p, n in zip(pass_rates, groups)]
    )
    seconds = time.perf_counter() - start
    z = (means - moments["mean"]) / np.sqrt(moments["variance"] / groups)
    return seconds, groups.sum(), float(np.mean(z**2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--relative-error", type=float, default=1e-3)
    parser.add_argument(
        "--mc-budget",
        type=float,
        default=30.0,
        help="seconds of Monte Carlo to run before extrapolating instead",
    )
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2, 8, 16, 64])
    args = parser.parse_args()

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    pass_rates = (np.arange(1000) + 0.5) / 1000  # midpoints of 1,000 equal bins of (0, 1)
    print(
        f"method={METHOD!r}, {len(pass_rates)} pass rates, 1 thread, "
        f"MC to {args.relative_error:g} relative standard error at every p"
    )
    print(
        f"{'G':>3} {'exact s':>9} {'MC s':>14} {'MC/exact':>10} {'MC groups':>10} "
        f"{'MC z^2':>9}  target < {TARGET_SECONDS:g} s"
    )
    for group_size in args.group_sizes:
        exact_seconds, moments = time_exact(pass_rates, group_size)
        mc_seconds, groups, mean_z2 = time_monte_carlo(
            pass_rates, group_size, moments, args.relative_error, args.mc_budget, generator
        )
        mc_column = f"{mc_seconds:.3g}" + (" (est.)" if mean_z2 is None else "")
        z2_column = "-" if mean_z2 is None else f"{mean_z2:.2f}"
        verdict = "PASS" if exact_seconds < TARGET_SECONDS else "FAIL"
        print(
            f"{group_size:>3} {exact_seconds:>9.4f} {mc_column:>14} "
            f"{mc_seconds / exact_seconds:>10.3g} {groups:>10.3g} {z2_column:>9}  {verdict}"
        )


if __name__ == "__main__":
    main()
