r"""Chapter 5, section 6: credit separated from information, exactly, on a k-step chain.

A policy writes k tokens, one per step, each from a vocabulary of `vocab_size`, with its own
softmax logits per step (theta_j, a row of `vocab_size`; token 0 is the right one). The reward
is 1 when every step is right, so J = prod_j q_j with q_j = softmax(theta_j)[0], and the value
of a prefix is known exactly: V(s_j) = 1[steps < j all right] * prod_{i >= j} q_i
(`chain_values`). Three arms turn the same G rollouts into token coefficients
(`chain_advantages`):

    outcome   GRPO's group advantage of the final reward, the same on every step;
    token     oracle credit from the same outcome reward, delta_j = V(s_{j+1}) - V(s_j), V under
              the current policy (a perfect critic: credit assignment, no step labels);
    process   the chapter's process rule (`advantages.process_advantages`): step j rewarded
              1[step j right], the outcome as a last step, all normalised together per group,
              a token's advantage the sum over the steps that end at or after it.

`train_chain` trains the three arms for every learning rate of a grid and every seed at once
(Adam, one group of G rollouts per update) and returns the rollouts each needed to reach
J >= target. Common random numbers: the uniforms that draw the rollouts come from one generator
per k and are shared by every arm and learning rate, so seed s of every arm sees the same draws
(`sample_actions` maps them to tokens through each policy's own probabilities).
`best_learning_rates` picks each arm's rate, `toy_summary` the medians, ratios, the slope of
log(outcome / token) over k and the share of the process arm's gain that oracle credit captures,
with intervals from a bootstrap over seeds.
"""

import numpy as np

from grpo_companion.core.stats import interval_reading, interval_words

ARMS = ("outcome", "token", "process")
EPS = 1e-4  # the group normalisation's, as `group_advantages` "grpo" and `process_advantages`
ADAM = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def sample_actions(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Tokens by inverse CDF: probs (..., k, V) of each policy, uniforms (S, G, k) shared by all
    of them; probs' leading axes end in S. Returns (..., S, G, k) ints in [0, V)."""
    cdf = np.cumsum(probs, axis=-1)[..., None, :, :-1]  # (..., S, 1, k, V - 1)
    return (uniforms[..., None] > cdf).sum(axis=-1)


def chain_values(probs: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """Exact prefix values, (..., G, k + 1): probs (..., k, V), actions (..., G, k). Column j is
    the value after j steps, V(s_{j+1}) in chapter 5's notation: column 0 is V(s_1) = J, the
    last V(s_{k+1}) = the reward."""
    right = actions == 0
    alive = np.concatenate([np.ones_like(right[..., :1]), np.cumprod(right, axis=-1)], axis=-1)
    q = probs[..., 0]
    tail = np.concatenate(
        [np.cumprod(q[..., ::-1], axis=-1)[..., ::-1], np.ones_like(q[..., :1])], axis=-1
    )
    return alive * tail[..., None, :]


def _normalise(x: np.ndarray) -> np.ndarray:
    """(x - mean) / (Bessel std + EPS) over the last axis (a group's rewards)."""
    return (x - x.mean(axis=-1, keepdims=True)) / (x.std(axis=-1, ddof=1, keepdims=True) + EPS)


def chain_advantages(arm: str, probs: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """Each arm's coefficient of the score of step j of rollout i, (..., G, k); the group is
    axis -2 of `actions` (..., G, k), probs (..., k, V)."""
    values = chain_values(probs, actions)
    reward = values[..., -1]
    k = actions.shape[-1]
    if arm == "outcome":
        return np.repeat(_normalise(reward)[..., None], k, axis=-1)
    if arm == "token":
        return np.diff(values, axis=-1)
    if arm == "process":
        steps = np.concatenate([(actions == 0).astype(float), reward[..., None]], axis=-1)
        shape = steps.shape
        normalised = _normalise(steps.reshape(*shape[:-2], -1)).reshape(shape)
        at_ends = normalised[..., :k].copy()
        at_ends[..., -1] += normalised[..., k]  # the outcome ends at the last token
        return np.cumsum(at_ends[..., ::-1], axis=-1)[..., ::-1]
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


def score_gradient(probs: np.ndarray, actions: np.ndarray, coefficients: np.ndarray) -> np.ndarray:
    """(1/G) sum_i sum_j c_ij grad log pi(a_ij) for per-step softmax logits: (..., k, V)."""
    onehot = actions[..., None] == np.arange(probs.shape[-1])
    weighted = (coefficients[..., None] * onehot).sum(axis=-3)
    return (weighted - probs * coefficients.sum(axis=-2)[..., None]) / actions.shape[-2]


def train_chain(
    k: int,
    learning_rates: list[float],
    num_seeds: int,
    group_size: int,
    vocab_size: int,
    max_rollouts: int,
    target: float,
    seed: int,
) -> np.ndarray:
    """Rollouts each (arm, learning rate, seed) needed to reach J >= target, (3, L, S) float,
    inf where the budget of `max_rollouts` ran out first.

    Every run starts from the uniform policy (J = vocab_size^-k) and takes Adam ascent steps
    (`ADAM`) on one group of `group_size` rollouts per update; the uniforms of update t are one
    (S, G, k) draw of `np.random.default_rng([seed, k])`, shared by every arm and rate.
    """
    num_lrs = len(learning_rates)
    lrs = np.asarray(learning_rates, dtype=float)[None, :, None, None, None]
    theta = np.zeros((len(ARMS), num_lrs, num_seeds, k, vocab_size))
    first, second = np.zeros_like(theta), np.zeros_like(theta)
    rng = np.random.default_rng([seed, k])
    reached = np.full(theta.shape[:3], np.inf)
    b1, b2, eps = ADAM["beta1"], ADAM["beta2"], ADAM["eps"]
    probs = softmax(theta)
    for update in range(1, max_rollouts // group_size + 1):
        uniforms = rng.random((num_seeds, group_size, k))
        actions = sample_actions(probs, uniforms)  # (3, L, S, G, k)
        gradient = np.stack(
            [
                score_gradient(probs[a], actions[a], chain_advantages(arm, probs[a], actions[a]))
                for a, arm in enumerate(ARMS)
            ]
        )
        first = b1 * first + (1 - b1) * gradient
        second = b2 * second + (1 - b2) * gradient**2
        step = (first / (1 - b1**update)) / (np.sqrt(second / (1 - b2**update)) + eps)
        theta = theta + lrs * step
        probs = softmax(theta)
        now = (probs[..., 0].prod(axis=-1) >= target) & np.isinf(reached)
        reached[now] = update * group_size
        if np.isfinite(reached).all():
            break
    return reached


def best_learning_rates(rollouts: np.ndarray, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """Per arm, the grid's best rate: the smallest whose median rollouts over seeds is within a
    factor 1 + tolerance of the grid's best median (a larger rate that is no faster than that is
    no better; it ends the plateau that one update per stage reaches). rollouts (3, L, S).
    Returns the index (3,) and whether it lies strictly inside the grid (3,) bool: not the first
    rate, and a larger rate of the grid is no better than it."""
    medians = np.median(rollouts, axis=-1)  # (3, L)
    best = medians.min(axis=1, keepdims=True)
    index = np.argmax(medians <= best * (1 + tolerance), axis=1)
    inside = (index > 0) & (index < rollouts.shape[1] - 1)
    return index, inside


def _slope(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slope of y (..., K) on x (K,)."""
    xc = x - x.mean()
    return (y * xc).sum(axis=-1) / (xc**2).sum()


def toy_summary(
    step_counts: list[int],
    runs: dict[int, np.ndarray],
    learning_rates: list[float],
    tolerance: float,
    max_rollouts: int,
    num_bootstrap: int,
    seed: int,
) -> dict:
    """The chapter's records from `train_chain`'s results per k (runs[k]: (3, L, S)).

    Per arm and k at the arm's best rate for that k: median rollouts to target with a 95%
    percentile-bootstrap interval over seeds, the share of seeds that reached it. The ratios
    outcome / token and outcome / process of the medians, the least-squares slope of
    log(outcome / token) over k, and the share of the process arm's saving that oracle credit
    captures at the largest k, (O - T) / (O - P), each with an interval from the same bootstrap
    (seeds resampled jointly across arms and k: common random numbers pair them). The prediction:
    outcome / token = k (exercise 1: under the uniform policy the outcome estimator's variance is
    `length` times the token-level one's, and rollouts scale with variance), a slope of log k
    over k.
    """
    ks = np.asarray(step_counts, dtype=float)
    best, inside, chosen = {}, {}, []
    for k in step_counts:
        index, ok = best_learning_rates(runs[k], tolerance)
        best[k], inside[k] = index, ok
        chosen.append(runs[k][np.arange(len(ARMS)), index])  # (3, S)
    chosen = np.stack(chosen, axis=1)  # (3, K, S)
    num_seeds = chosen.shape[-1]
    draws = np.random.default_rng(seed).integers(0, num_seeds, size=(num_bootstrap, num_seeds))
    boot = np.median(chosen[:, :, draws], axis=-1)  # (3, K, B)
    medians = np.median(chosen, axis=-1)  # (3, K)

    def ratio(a, b):
        with np.errstate(invalid="ignore", divide="ignore"):
            return a / b

    def bounds(samples):
        finite = samples[np.isfinite(samples)]
        if len(finite) < 0.95 * len(samples):  # too many resamples without a median
            return None, None
        return float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))

    out_token, out_process = ratio(medians[0], medians[1]), ratio(medians[0], medians[2])
    with np.errstate(invalid="ignore", divide="ignore"):
        log_ratio, boot_log_ratio = np.log(out_token), np.log(ratio(boot[0], boot[1]))
    slope = float(_slope(ks, log_ratio))
    boot_slope = _slope(ks, boot_log_ratio.T)
    share = float(ratio(medians[0, -1] - medians[1, -1], medians[0, -1] - medians[2, -1]))
    boot_share = ratio(boot[0, -1] - boot[1, -1], boot[0, -1] - boot[2, -1])
    slope_low, slope_high = bounds(boot_slope)
    share_low, share_high = bounds(boot_share)
    predicted = float(_slope(ks, np.log(ks)))
    records = {
        "toy_chain_step_counts": list(step_counts),
        "toy_chain_num_seeds": num_seeds,
        "toy_chain_learning_rates": list(learning_rates),
        "toy_chain_max_rollouts": max_rollouts,
        "toy_chain_best_lr": {
            arm: {str(k): learning_rates[int(best[k][a])] for k in step_counts}
            for a, arm in enumerate(ARMS)
        },
        "toy_chain_lr_inside_count": int(sum(inside[k].sum() for k in step_counts)),
        "toy_chain_lr_cells": len(ARMS) * len(step_counts),
        "toy_chain_lr_outside": [
            f"{arm}, k = {k}" for k in step_counts for a, arm in enumerate(ARMS) if not inside[k][a]
        ],
    }
    records["toy_chain_lr_all_inside"] = int(
        records["toy_chain_lr_inside_count"] == records["toy_chain_lr_cells"]
    )
    for a, arm in enumerate(ARMS):
        rows = {}
        for i, k in enumerate(step_counts):
            low, high = bounds(boot[a, i])
            rows[str(k)] = {
                "median": _finite(medians[a, i]),
                "low": low,
                "high": high,
                "reached": float(np.isfinite(chosen[a, i]).mean()),
            }
        records[f"toy_chain_{arm}"] = rows
    records["toy_chain_reached_k1_min"] = min(
        records[f"toy_chain_{arm}"][str(step_counts[0])]["reached"] for arm in ARMS
    )
    records["toy_chain_outcome_over_token"] = {
        str(k): _finite(v) for k, v in zip(step_counts, out_token)
    }
    records["toy_chain_outcome_over_process"] = {
        str(k): _finite(v) for k, v in zip(step_counts, out_process)
    }
    records["toy_chain_log_ratio_slope"] = _finite(slope)
    records["toy_chain_log_ratio_slope_low"] = slope_low
    records["toy_chain_log_ratio_slope_high"] = slope_high
    records["predicted_toy_chain_log_ratio_slope"] = predicted
    records["predicted_toy_chain_log_ratio_slope_how"] = (
        f"the least-squares slope of log k over k = {step_counts[0]}..{step_counts[-1]}, "
        f"{predicted:.3f}: outcome needing k times the rollouts of oracle credit, as the "
        "outcome estimator's variance is k times the token-level one's under the uniform policy "
        "(exercise 1) and rollouts to a given accuracy scale with variance"
    )
    records["toy_chain_largest_k"] = step_counts[-1]
    records["toy_chain_outcome_over_token_last"] = _finite(out_token[-1])
    records["toy_chain_outcome_over_process_last"] = _finite(out_process[-1])
    process_low, process_high = bounds(ratio(boot[0, -1], boot[2, -1]))
    records["toy_chain_outcome_over_process_last_low"] = process_low
    records["toy_chain_outcome_over_process_last_high"] = process_high
    records["toy_chain_token_share"] = _finite(share)
    records["toy_chain_token_share_low"] = share_low
    records["toy_chain_token_share_high"] = share_high
    records["toy_chain_share_threshold"] = 0.5
    records["toy_chain_prediction"] = interval_words(
        slope_low,
        slope_high,
        predicted,
        supports="lies above 0: outcome's cost relative to oracle credit grows with k",
        contradicts="lies below the predicted slope without lying above 0: "
        "outcome's cost relative to oracle credit does not grow as predicted",
    )
    records["toy_chain_verdict"] = chain_verdict(records)
    return records


def chain_verdict(records: dict) -> str:
    """The ledger's rule for this experiment, in words (book/claims.toml, P6_credit_toy): gates
    (every arm's best rate inside its grid; every arm reached the target in most seeds at the
    smallest k), then reproduced (the slope's interval supports the predicted growth and the
    share's interval lies above the threshold), then not reproduced (the slope's interval
    contradicts the prediction or the share's lies below the threshold, while the process arm
    is faster than outcome: the interval of O / P at the largest k above 1)."""
    if records["toy_chain_lr_all_inside"] != 1:
        return "inconclusive: a best learning rate sits at the edge of its grid"
    if records["toy_chain_reached_k1_min"] < 0.5:
        return "inconclusive: an arm did not learn at the smallest k"
    reading = interval_reading(
        records["toy_chain_log_ratio_slope_low"],
        records["toy_chain_log_ratio_slope_high"],
        records["predicted_toy_chain_log_ratio_slope"],
    )
    threshold = records["toy_chain_share_threshold"]
    share_low, share_high = (
        records["toy_chain_token_share_low"],
        records["toy_chain_token_share_high"],
    )
    process_low = records["toy_chain_outcome_over_process_last_low"]
    if reading == 1 and share_low is not None and share_low > threshold:
        return "reproduced"
    slow_token = reading == -1 or (share_high is not None and share_high < threshold)
    if slow_token and process_low is not None and process_low > 1:
        return "not reproduced"
    return "inconclusive: neither reproduced nor contradicted"


def _finite(value) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None
