r"""The constant baselines of chapter 8: the optimal b* against the mean reward, the group's
estimates of E[r], and where the KL penalty goes.

For one sample's estimate g_b = (r - b) s, s = grad log pi, the constant baseline of least
variance is b* = E[||s||^2 r] / E||s||^2, and b* - E[r] = Cov(||s||^2, r) / E||s||^2:
`baseline_gap` measures the gap and what it costs on the cases of `baseline_cases`
(`uncorrelated_reward` and `rank_reward` build a reward where it vanishes and rewards where it is
large). `group_variances` gives the closed-form variances of the G-sample estimators with the
baseline known (the oracles), left out (RLOO) or including the sample itself, which is
(1 - 1/G) times RLOO in every group. `kl_placement` puts beta KL(pi || pi_ref) in the reward or
in the loss and measures the expected update exactly. Everything is a sum over chapter 1's
enumerable sequence policy (`grpo_companion.core.policy_gradient.SequencePolicy`). The
per-token baselines and verl's are in `grpo_companion.chapters.baselines.tokens`, the figures in
`grpo_companion.chapters.baselines.plots`.

Chapter: :doc:`/book/08_baselines` (section 1: the gap as a covariance; sections 2 and 3: where
it holds, and leave-one-out against mean-including-self; section 6: the KL penalty in the reward
or in the loss)
"""

import torch
from torch import Tensor

from grpo_companion.core.group_estimators import sample_group_estimates
from grpo_companion.core.kl import exact_kl, kl_estimate_gradients, kl_in_reward, kl_penalty
from grpo_companion.core.policy_gradient import (
    SequencePolicy,
    estimator_variance,
    optimal_baseline,
    sum_mod_reward,
)


def squared_score_norms(policy: SequencePolicy, logits: Tensor) -> Tensor:
    """||s(y)||^2 for every sequence, `(num_sequences,)`."""
    return policy.scores(logits, policy.all_sequences()).square().sum(dim=1)


def baseline_gap(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> dict[str, float]:
    """The optimal constant baseline against the mean reward, `rewards: (num_sequences,)`.

    Returns mean_reward E[r], optimal_baseline b*, gap b* - E[r], covariance Cov(||s||^2, r),
    correlation (their correlation coefficient; nan when either is constant, up to rounding),
    mean_squared_norm E||s||^2, variance_at_mean Var[g_E[r]], variance_at_optimal Var[g_b*] and
    excess_variance Var[g_E[r]] / Var[g_b*] - 1: what using the mean costs, relative to b*.
    """
    probs = policy.probs(logits).detach()
    norms = squared_score_norms(policy, logits)
    mean_reward = float(probs @ rewards)
    mean_squared_norm = float(probs @ norms)
    covariance = float(probs @ ((norms - mean_squared_norm) * (rewards - mean_reward)))
    norm_variance = float(probs @ (norms - mean_squared_norm) ** 2)
    reward_variance = float(probs @ (rewards - mean_reward) ** 2)
    # A constant norm or reward has no correlation; rounding would otherwise invent one.
    constant = (
        norm_variance <= (1e-12 * mean_squared_norm) ** 2
        or reward_variance <= (1e-12 * (1 + abs(mean_reward))) ** 2
    )
    b_star = optimal_baseline(policy, logits, rewards)
    variance_at_mean = float(estimator_variance(policy, logits, rewards, mean_reward))
    variance_at_optimal = float(estimator_variance(policy, logits, rewards, b_star))
    return {
        "mean_reward": mean_reward,
        "optimal_baseline": b_star,
        "gap": b_star - mean_reward,
        "covariance": covariance,
        "correlation": float("nan")
        if constant
        else covariance / (norm_variance * reward_variance) ** 0.5,
        "mean_squared_norm": mean_squared_norm,
        "variance_at_mean": variance_at_mean,
        "variance_at_optimal": variance_at_optimal,
        "excess_variance": variance_at_mean / variance_at_optimal - 1,
    }


def uncorrelated_reward(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> Tensor:
    """`rewards` minus its regression on ||s||^2 under pi: Cov(||s||^2, r') = 0, E[r'] = E[r].

    r' = r - c (||s||^2 - E||s||^2) with c = Cov(||s||^2, r) / Var[||s||^2]; `(num_sequences,)`.
    A reward constructed so that the mean reward is the optimal baseline.
    """
    probs = policy.probs(logits).detach()
    norms = squared_score_norms(policy, logits)
    centered_norms = norms - probs @ norms
    slope = (probs @ (centered_norms * rewards)) / (probs @ centered_norms.square())
    return rewards - slope * centered_norms


def rank_reward(policy: SequencePolicy, logits: Tensor, num_rewarded: int, rarest: bool) -> Tensor:
    """Reward 1 on the `num_rewarded` least likely sequences (`rarest=True`) or most likely ones,
    0 elsewhere, `(num_sequences,)`: a prompt whose right answers the policy finds hard or easy."""
    if not 0 < num_rewarded < policy.num_sequences:
        raise ValueError(
            f"num_rewarded must be in 1..{policy.num_sequences - 1}, got {num_rewarded}"
        )
    order = policy.probs(logits).detach().argsort(descending=not rarest)
    rewards = torch.zeros(policy.num_sequences, dtype=torch.float64)
    rewards[order[:num_rewarded]] = 1.0
    return rewards


def group_variances(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor, group_size: int
) -> dict[str, float]:
    """Variances of G-sample gradient estimators, in closed form (chapter 8, section 3).

    Returns oracle_optimal Var[g_b*] / G and oracle_mean Var[g_E[r]] / G (baselines known exactly),
    rloo (leave-one-out, unbiased), mean_self (mean including self, "dr_grpo") and
    mean_self_mse, its variance plus its squared bias ||grad J||^2 / G^2.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a leave-one-out baseline, got {group_size}")
    probs = policy.probs(logits).detach()
    mean_reward = float(probs @ rewards)
    reward_variance = float(probs @ (rewards - mean_reward) ** 2)
    mean_squared_norm = float(probs @ squared_score_norms(policy, logits))
    squared_gradient_norm = float(policy.exact_gradient(logits, rewards).square().sum())
    variance_at_mean = float(estimator_variance(policy, logits, rewards, mean_reward))
    rloo = variance_at_mean / group_size + (
        reward_variance * mean_squared_norm + squared_gradient_norm
    ) / (group_size * (group_size - 1))
    mean_self = (1 - 1 / group_size) ** 2 * rloo
    b_star = optimal_baseline(policy, logits, rewards)
    return {
        "oracle_optimal": float(estimator_variance(policy, logits, rewards, b_star)) / group_size,
        "oracle_mean": variance_at_mean / group_size,
        "rloo": rloo,
        "mean_self": mean_self,
        "mean_self_mse": mean_self + squared_gradient_norm / group_size**2,
    }


# -- the chapter's comparisons, built from the functions above --------------------------------


def baseline_cases(
    policy: SequencePolicy, logits: Tensor, peaked_logits: Tensor, num_rewarded: int
) -> dict[str, tuple[str, Tensor, Tensor]]:
    """The six (policy, reward) cases of section 2: key -> (label, logits, rewards), the rewards
    `(num_sequences,)`. `logits` is chapter 1's policy, `peaked_logits` a more confident one."""
    sum_mod = sum_mod_reward(policy.all_sequences(), policy.vocab_size)
    uniform = torch.zeros(policy.logits_shape, dtype=torch.float64)
    uncorrelated = uncorrelated_reward(policy, logits, sum_mod)
    rare = rank_reward(policy, logits, num_rewarded, rarest=True)
    likely = rank_reward(policy, logits, num_rewarded, rarest=False)
    return {
        "uniform": ("uniform policy, sum-mod reward", uniform, sum_mod),
        "chapter1": ("chapter 1 policy, sum-mod reward", logits, sum_mod),
        "uncorrelated": ("chapter 1 policy, uncorrelated reward", logits, uncorrelated),
        "peaked": ("peaked policy, sum-mod reward", peaked_logits, sum_mod),
        "rare": ("rare answers rewarded", logits, rare),
        "likely": ("likely answers rewarded", logits, likely),
    }


def gap_table(gaps: dict[str, dict], cases: dict):
    """`baseline_gap` of every case as a DataFrame indexed by the case labels, with the identity's
    right-hand side Cov / E||s||^2 next to the gap."""
    import pandas as pd

    table = pd.DataFrame({label: gaps[key] for key, (label, _, _) in cases.items()}).T
    table["Cov / E||s||^2"] = table["covariance"] / table["mean_squared_norm"]
    return table


def variance_curve(
    policy: SequencePolicy, logits: Tensor, rewards: Tensor, gap: dict, num_baselines: int
) -> tuple[Tensor, Tensor]:
    """Var[g_b] / Var[g_b*] at `num_baselines` constant baselines b around b*, in a window wide
    enough to show b*, E[r] and the parabola's curvature; `gap` is `baseline_gap`'s dict."""
    half_width = max(3 * abs(gap["gap"]), 0.1)
    baselines = torch.linspace(
        gap["optimal_baseline"] - half_width,
        gap["optimal_baseline"] + half_width,
        num_baselines,
        dtype=torch.float64,
    )
    variance = estimator_variance(policy, logits, rewards, baselines) / gap["variance_at_optimal"]
    return baselines, variance


def group_variance_table(
    policy: SequencePolicy,
    logits: Tensor,
    rewards: Tensor,
    group_sizes,
    num_groups: int,
    generator: torch.Generator,
):
    """`group_variances` at each G, next to the variance of `num_groups` sampled RLOO estimates
    (`sample_group_estimates`, G by G from one `generator`): a DataFrame indexed by G, with the
    ratios the chapter reads (Monte Carlo / closed form - 1, rloo / oracle E[r], mean-self MSE /
    rloo)."""
    import pandas as pd

    rows = []
    for size in group_sizes:
        closed = group_variances(policy, logits, rewards, size)
        estimates = sample_group_estimates(
            policy, logits, rewards, size, num_groups, generator, "rloo"
        )
        rows.append({"G": size, **closed, "rloo, Monte Carlo": float(estimates.var(dim=0).sum())})
    groups = pd.DataFrame(rows).set_index("G")
    groups["Monte Carlo / closed form - 1"] = groups["rloo, Monte Carlo"] / groups["rloo"] - 1
    groups["rloo / oracle E[r]"] = groups["rloo"] / groups["oracle_mean"]
    groups["mean-self MSE / rloo"] = groups["mean_self_mse"] / groups["rloo"]
    return groups


# -- where the KL penalty goes ----------------------------------------------------------------


def shrinkage_with_kl_cosine(
    true_gradient: Tensor, kl_gradient: Tensor, beta: float, group_size: int
) -> float:
    """cos((1 - 1/G) grad J - beta E[grad k], grad J - beta E[grad k]), both `(num_params,)`:
    the expected updates of the mean-including-self baseline and of RLOO with the KL estimate in
    the loss, which the shrinkage leaves out (1 without a KL term; chapter 8, section 6)."""
    shrunk = (1 - 1 / group_size) * true_gradient - beta * kl_gradient
    rloo = true_gradient - beta * kl_gradient
    return float(shrunk @ rloo / (shrunk.norm() * rloo.norm()))


def kl_placement(
    policy: SequencePolicy, logits: Tensor, ref_logits: Tensor, rewards: Tensor, beta: float
) -> dict[str, float]:
    """Where beta KL(pi || pi_ref) goes, exactly (chapter 8, section 6). One-sample updates with
    the oracle baseline (the group baselines scale the mean as in section 3):

    reward: (r' - E r') s with r' = r - beta k1;  loss_k3 / loss_k1: (r - E r) s - beta grad k.

    In the loss the estimate k(y) = sum_t k(x_t), x_t = log pi(y_t | .) - log pi_ref(y_t | .), is
    differentiated through log pi: grad k = sum_t k'(x_t) s_t, with k' = 1 for k1 (so
    E[grad k1] = E[s] = 0) and k' = 1 - pi_ref / pi for k3 (k3 without the ratio, TRL's
    use_bias_correction_kl=False).

    Returns floats: "divergence" KL(pi || pi_ref); "reward_error"
    max |E[g] - (grad J - beta grad KL)|;
    "loss_k1_norm" ||E[grad k1]||; "loss_k3_cosine" cos(E[grad k3], grad KL); "loss_k3_ratio"
    ||E[grad k3]|| / ||grad KL||; "reward_variance", "loss_k3_variance": Var[g] over Var[g] at
    beta = 0 (E||g - E g||^2).
    """
    sequences = policy.all_sequences()
    probs = policy.probs(logits).detach()
    token_log_probs = policy.token_log_probs(logits, sequences)
    k1 = kl_penalty(token_log_probs, policy.token_log_probs(ref_logits, sequences), "k1").sum(1)
    theta = logits.detach().requires_grad_(True)
    ref_log_probs = policy.log_prob(ref_logits, sequences).detach()
    kl = exact_kl(policy.log_prob(theta, sequences), ref_log_probs)
    (grad_kl,) = torch.autograd.grad(kl, theta)
    grad_kl = grad_kl.flatten()
    scores = policy.scores(logits, sequences)

    def moments(estimates):  # (num_sequences, num_params) -> mean, E||g - E g||^2
        mean = probs @ estimates
        return mean, float(probs @ (estimates - mean).square().sum(dim=1))

    shaped = kl_in_reward(rewards[None], k1[None], beta)[0]
    plain_mean, plain_variance = moments((rewards - probs @ rewards)[:, None] * scores)
    reward_mean, reward_variance = moments((shaped - probs @ shaped)[:, None] * scores)
    k3 = kl_estimate_gradients(policy, logits, ref_logits, "k3")
    _, loss_variance = moments((rewards - probs @ rewards)[:, None] * scores - beta * k3)
    expected_k1 = probs @ kl_estimate_gradients(policy, logits, ref_logits, "k1")
    expected_k3 = probs @ k3
    return {
        "divergence": float(kl.detach()),
        "reward_error": float((reward_mean - (plain_mean - beta * grad_kl)).abs().max()),
        "loss_k1_norm": float(expected_k1.norm()),
        "loss_k3_cosine": float(expected_k3 @ grad_kl / (expected_k3.norm() * grad_kl.norm())),
        "loss_k3_ratio": float(expected_k3.norm() / grad_kl.norm()),
        "reward_variance": reward_variance / plain_variance,
        "loss_k3_variance": loss_variance / plain_variance,
    }
