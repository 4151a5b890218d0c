r"""Chapter 6, section 4: Sign against Dr. GRPO at each method's tuned step size, in two toys.

Exact (`error_grid`): chapter 9's `best_step_error`, the error left after one step of a method at
its best step size, over prompts p ~ Beta(m kappa, (1 - m) kappa) and score noise v; it reuses
`exact.errors_against_score_noise`. Sign's and Dr. GRPO's expected updates are parallel, so once
each has its own step size only their variances differ.

Stochastic (`train_linear_logit`): P prompts share d parameters, prompt j passing with
probability p_j = sigmoid(c_j + phi_j . theta), theta_0 = 0, with offsets c_j at the quantiles
of a Beta (`flow.beta_prompts`) and fixed features phi_j ~ N(0, I / d). A completion is one
answer bit, so its score is (r - p_j) phi_j and J = mean_j p_j is exact; shared parameters give
the learning rate a finite optimum. A step draws B prompts (without replacement) and G
completions of each, averages the groups' estimates and takes an Adam step. For run seed s the
prompt draws and the uniforms u (correct iff u < p_j) come from one generator seeded (s,),
shared by every method and learning rate and independent of how many seeds run. The learning
rate is tuned per method on `tune_seeds` and measured on separate `eval_seeds`.

Chapter: :doc:`/book/06_sparsity` (section 4, "Sign at each method's tuned step size")
"""

import numpy as np
import pandas as pd
from scipy.special import expit, logit

from grpo_companion.chapters.sparsity.flow import beta_prompts
from grpo_companion.chapters.sparsity.rate import beta_concentration_for
from grpo_companion.core.exact import (
    beta_quadrature,
    binary_group_advantages,
    errors_against_score_noise,
    estimator_moments,
)
from grpo_companion.core.exact import degenerate_rate as exact_degenerate_rate
from grpo_companion.core.stats import mean_interval, seeds_for_power

ZOO = {"Dr. GRPO": ("dr_grpo", {}), "GRPO": ("grpo", {}), "Sign": ("sign", {})}


# --- Sign-E: the exact best-step comparison ---------------------------------------------------


def error_grid(means, degenerate_rate: float, group_size: int, noises, zoo=None) -> pd.DataFrame:
    """`best_step_error`'s error at the best step of every method in `zoo` (default: Dr. GRPO,
    GRPO, Sign), on a Beta of each mean in `means` with degenerate rate `degenerate_rate` at
    G = `group_size` (`beta_concentration_for`), at each score noise v in `noises`.

    Returns a DataFrame indexed by (mean, method), one column per v, plus "kappa" and
    "all-correct share" (E[p^G], the share of all-correct groups)."""
    zoo = ZOO if zoo is None else zoo
    rows = []
    for mean in means:
        kappa = beta_concentration_for(degenerate_rate, mean, group_size)
        pass_rates, weights = beta_quadrature(mean * kappa, (1 - mean) * kappa)
        errors = errors_against_score_noise(pass_rates, weights, group_size, zoo, noises)
        for label, values in errors.items():
            rows.append({"mean": mean, "method": label, "kappa": kappa,
                         "all-correct share": float(weights @ pass_rates**group_size),
                         **{f"v = {v:g}": float(e) for v, e in zip(noises, values)}})  # fmt: skip
    return pd.DataFrame(rows).set_index(["mean", "method"])


def sign_wins(table: pd.DataFrame, noises, against: str = "Dr. GRPO") -> dict:
    """Where Sign's error at the best step is below `against`'s: mean -> list of v."""
    out = {}
    for mean in table.index.get_level_values("mean").unique():
        sign, other = table.loc[(mean, "Sign")], table.loc[(mean, against)]
        out[float(mean)] = [v for v in noises if sign[f"v = {v:g}"] < other[f"v = {v:g}"]]
    return out


# --- Sign-S: the linear-logit toy -------------------------------------------------------------


def linear_logit_prompts(mean: float, concentration: float, num_prompts: int, num_features: int,
                         seed: int) -> dict:  # fmt: skip
    """Offsets c (P,) with sigmoid(c) at the Beta quantiles, features phi (P, d) ~ N(0, I/d)
    drawn from a generator seeded (seed, 1); the pass rates are clipped to [1e-4, 1 - 1e-4]."""
    start = np.clip(beta_prompts(mean, concentration, num_prompts), 1e-4, 1 - 1e-4)
    rng = np.random.default_rng((seed, 1))
    features = rng.standard_normal((num_prompts, num_features)) / np.sqrt(num_features)
    return {"offsets": logit(start), "features": features}


def pass_rates(prompts: dict, theta: np.ndarray) -> np.ndarray:
    """sigmoid(c_j + phi_j . theta) for theta (..., d): (..., P)."""
    return expit(prompts["offsets"] + theta @ prompts["features"].T)


def common_draws(seeds, num_steps: int, num_prompts: int, batch_prompts: int, group_size: int):
    """Per run seed s, from a generator seeded (s,): the prompts of every step (S, T, B), drawn
    without replacement, and the uniforms (S, T, B, G) that decide each completion."""
    indices, uniforms = [], []
    for s in seeds:
        rng = np.random.default_rng((int(s),))
        keys = rng.random((num_steps, num_prompts))
        indices.append(np.argsort(keys, axis=1)[:, :batch_prompts])
        uniforms.append(rng.random((num_steps, batch_prompts, group_size)))
    return np.stack(indices), np.stack(uniforms)


def advantage_tables(methods, group_size: int) -> np.ndarray:
    """(M, 2, G + 1): a_incorrect(k), a_correct(k) of each method (`binary_group_advantages`;
    the entries of impossible completions set to 0)."""
    tables = []
    for method in methods:
        a_correct, a_incorrect = binary_group_advantages(group_size, method)
        tables.append(np.nan_to_num(np.stack([a_incorrect, a_correct])))
    return np.stack(tables)


def batch_gradient(prompts: dict, theta, indices, uniforms, tables) -> np.ndarray:
    """The estimate of grad J of one step, for theta (M, ..., d) with method m's advantages
    `tables[m]`; indices (..., B) and uniforms (..., B, G) broadcast against theta's middle axes.

    Returns (M, ..., d): mean over the batch of (1/G) sum_i A_i (r_i - p_j) phi_j."""
    features = prompts["features"][indices]  # (..., B, d)
    logits = prompts["offsets"][indices] + np.einsum("m...d,...bd->m...b", theta, features)
    p = expit(logits)
    rewards = (uniforms < p[..., None]).astype(np.float64)  # (M, ..., B, G)
    k = rewards.sum(-1).astype(int)
    flat = k.reshape(k.shape[0], -1)
    a_incorrect = np.take_along_axis(tables[:, 0], flat, axis=1).reshape(k.shape)
    a_correct = np.take_along_axis(tables[:, 1], flat, axis=1).reshape(k.shape)
    advantages = np.where(rewards > 0, a_correct[..., None], a_incorrect[..., None])
    weight = (advantages * (rewards - p[..., None])).mean(-1)  # (M, ..., B)
    return np.einsum("m...b,...bd->m...d", weight, features) / indices.shape[-1]


def expected_gradient(prompts: dict, theta: np.ndarray, method: str, group_size: int):
    """E over prompts (uniform) and groups of `batch_gradient` at one theta (d,):
    mean_j m(p_j) phi_j with m = `estimator_moments`' exact mean."""
    p = pass_rates(prompts, theta)
    mean = estimator_moments(p, group_size, method)["mean"]
    return mean @ prompts["features"] / len(p)


def train_linear_logit(prompts: dict, methods, learning_rates, seeds, num_steps: int,
                       batch_prompts: int, group_size: int, record_every: int = 10,
                       betas=(0.9, 0.999), eps: float = 1e-8) -> dict:  # fmt: skip
    """Adam on every (method, learning rate, seed) at once, with common random numbers.

    Returns "J" (M, L, S, num_records) exact J after steps 0, record_every, ..., num_steps;
    "steps" (num_records,), "rollouts" (num_records,)."""
    methods, lrs = list(methods), np.asarray(learning_rates, dtype=np.float64)
    num_prompts, dim = prompts["features"].shape
    indices, uniforms = common_draws(seeds, num_steps, num_prompts, batch_prompts, group_size)
    tables = advantage_tables(methods, group_size)
    theta = np.zeros((len(methods), len(lrs), len(seeds), dim))
    first, second = np.zeros_like(theta), np.zeros_like(theta)
    step_size = lrs[None, :, None, None]
    records, steps = [pass_rates(prompts, theta).mean(-1)], [0]
    for t in range(num_steps):
        grad = batch_gradient(prompts, theta, indices[:, t], uniforms[:, t], tables)
        first = betas[0] * first + (1 - betas[0]) * grad
        second = betas[1] * second + (1 - betas[1]) * grad**2
        corrected = (first / (1 - betas[0] ** (t + 1)), second / (1 - betas[1] ** (t + 1)))
        theta = theta + step_size * corrected[0] / (np.sqrt(corrected[1]) + eps)
        if (t + 1) % record_every == 0 or t + 1 == num_steps:
            records.append(pass_rates(prompts, theta).mean(-1))
            steps.append(t + 1)
    steps = np.array(steps)
    return {"J": np.stack(records, axis=-1), "steps": steps,
            "rollouts": steps * batch_prompts * group_size}  # fmt: skip


def tuned_comparison(runs: dict, methods, learning_rates, num_tune: int, reference: str,
                     other: str) -> dict:  # fmt: skip
    """Tune each method's learning rate on the first `num_tune` seeds (highest mean final J),
    then compare on the rest, paired by seed.

    Returns "best_index" (method -> grid index), "inside" (1 if every optimum is strictly inside
    the grid, else 0), "final" (method -> (S_eval,) final J at its tuned lr), "gain" (method ->
    mean_interval of final - start J on the evaluation seeds), "difference" (mean_interval of
    other - reference, df = n - 1), "reference_tune_gain" (reference's mean gain on the tuning
    seeds at its tuned lr)."""
    methods = list(methods)
    J = runs["J"]
    final, start = J[..., -1], J[..., 0]
    best = {m: int(np.argmax(final[i, :, :num_tune].mean(-1))) for i, m in enumerate(methods)}
    num_lrs = len(learning_rates)
    chosen = {m: final[i, best[m], num_tune:] for i, m in enumerate(methods)}
    gain = {
        m: mean_interval(chosen[m] - start[i, best[m], num_tune:]) for i, m in enumerate(methods)
    }
    r = methods.index(reference)
    return {
        "best_index": best,
        "best_lr": {m: float(learning_rates[best[m]]) for m in methods},
        "inside": int(all(0 < best[m] < num_lrs - 1 for m in methods)),
        "final": chosen,
        "gain": gain,
        "difference": mean_interval(chosen[other] - chosen[reference]),
        "reference_tune_gain": float(
            np.mean(final[r, best[reference], :num_tune] - start[r, best[reference], :num_tune])
        ),
        "mean_final": {m: final[i, :, :num_tune].mean(-1) for i, m in enumerate(methods)},
    }


def toy_regime(
    name: str, mean: float, degenerate_rate: float, toy: dict, learning_rates, methods,
    reference: str, other: str, group_size: int, seed: int,
) -> dict:  # fmt: skip
    """Sign-S in one regime: the prompts, the runs, the tuned comparison and the prediction.

    `toy`: "prompts", "features", "batch_prompts", "steps", "tune_seeds", "eval_seeds",
    "record_every". Runs seeds seed, seed + 1, ... (tuning first, then evaluation).

    Returns {"records": the chapter's values, prefixed "tabular_<name>_" (and
    "predicted_tabular_<name>_<other>_minus_<reference>"), "runs", "comparison"}. The prediction
    is Dr. GRPO's mean gain on the tuning seeds times the ratio of the two methods'
    `sparsity_lm.best_step_progress` on the same Beta, less 1 (`predicted_difference`)."""
    from grpo_companion.chapters.sparsity.remedies import best_step_progress, predicted_difference
    from grpo_companion.core.stats import interval_words

    kappa = beta_concentration_for(degenerate_rate, mean, group_size)
    prompts = linear_logit_prompts(mean, kappa, toy["prompts"], toy["features"], seed)
    seeds = range(seed, seed + toy["tune_seeds"] + toy["eval_seeds"])
    runs = train_linear_logit(
        prompts, methods, learning_rates, seeds, toy["steps"], toy["batch_prompts"], group_size,
        toy.get("record_every", 10),
    )  # fmt: skip
    comparison = tuned_comparison(
        runs, methods, learning_rates, toy["tune_seeds"], reference, other
    )
    progress = {m: best_step_progress(mean, kappa, group_size, m) for m in methods}
    predicted = predicted_difference(
        comparison["reference_tune_gain"], progress[other], progress[reference]
    )
    start = pass_rates(prompts, np.zeros(toy["features"]))
    difference = comparison["difference"]
    sd = float(np.std(comparison["final"][other] - comparison["final"][reference], ddof=1))
    key = f"tabular_{name}"
    diff_key = f"{key}_{other}_minus_{reference}"
    records = {
        f"{key}_mean": mean,
        f"{key}_concentration": kappa,
        f"{key}_start_pass_rate": float(start.mean()),
        f"{key}_all_correct_share": float(np.mean(start**group_size)),
        f"{key}_degenerate_rate": float(np.mean(exact_degenerate_rate(start, group_size))),
        f"{key}_lr_inside": comparison["inside"],
        **{f"{key}_{m}_lr": comparison["best_lr"][m] for m in methods},
        **{f"{key}_{m}_final": float(comparison["final"][m].mean()) for m in methods},
        **{f"{key}_{m}_gain": comparison["gain"][m]["mean"] for m in methods},
        **{f"{key}_{m}_gain_low": comparison["gain"][m]["low"] for m in methods},
        **{f"{key}_{m}_gain_high": comparison["gain"][m]["high"] for m in methods},
        **{f"{key}_{m}_progress": progress[m] for m in methods},
        f"{key}_reference_tune_gain": comparison["reference_tune_gain"],
        diff_key: difference["mean"],
        f"{diff_key}_low": difference["low"],
        f"{diff_key}_high": difference["high"],
        f"{diff_key}_df": difference["n"] - 1,
        f"{diff_key}_sd": sd,
        f"{key}_seeds_needed": seeds_for_power(sd, predicted),
        f"predicted_{diff_key}": predicted,
        f"predicted_{diff_key}_how": (
            f"chapter 9's exact best-step model (no score noise, as in this toy) on the Beta of "
            f"mean {mean:g} and degenerate rate {degenerate_rate:g}: Dr. GRPO's mean gain on the "
            f"{toy['tune_seeds']} tuning seeds at its tuned learning rate times the ratio of the "
            f"two methods' progress at their best step sizes, less 1"
        ),
        f"{diff_key}_words": interval_words(
            difference["low"],
            difference["high"],
            predicted,
            supports="lies above 0: Sign's gain exceeds Dr. GRPO's",
            contradicts="lies short of the predicted difference",
        ),  # fmt: skip
    }
    return {"records": records, "runs": runs, "comparison": comparison}
