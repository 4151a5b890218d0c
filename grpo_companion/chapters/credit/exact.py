r"""Chapter 5, section 2: credit assignment exactly, on chapter 1's enumerable sequence policy.

The reward (`answer_reward`) is 1 when the last token equals the sum of the tokens at some
"result" positions, like a final answer that depends on intermediate results; the other
positions are filler. `policy_gradient.exact_prefix_values` gives V(y_<t) for every prefix, so
the outcome estimator sum_t (r - J) s_t and the token-level one sum_t delta_t s_t, with
delta_t = V(y_<t+1) - V(y_<t) and s_t = grad log pi(y_t | y_<t), can both be enumerated:
`per_sequence_estimates` gives each sequence's single-sample estimate, `exact_moments` the exact
mean and variance, `compare_estimators` their bias and variance ratio, and `sampled_errors`
checks them by sampling. `position_credit` says where E[delta_t^2] lies.
"""

import pandas as pd
import torch
from torch import Tensor

from grpo_companion.core.policy_gradient import SequencePolicy


def answer_reward(sequences: Tensor, vocab_size: int, positions: list[int]) -> Tensor:
    """Binary reward, (n,): 1 when the last token equals the sum of the tokens at `positions`
    mod `vocab_size`. Those positions are the "intermediate results" the answer depends on;
    the others are filler that matters only through what the policy writes next."""
    answer = sequences[:, positions].sum(dim=1) % vocab_size
    return (sequences[:, -1] == answer).to(torch.float64)


def position_roles(length: int, result_positions: list[int]) -> list[str]:
    """The role of each position of the toy sequences: the last is the "answer", those of
    `result_positions` a "result", the others "filler"."""
    return [
        "answer" if t == length - 1 else "result" if t in result_positions else "filler"
        for t in range(length)
    ]


def position_credit(
    probs: Tensor, token_coefficients: Tensor, result_positions: list[int]
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Where the exact credit lies: E[delta_t^2] by position, and its shares.

    probs: (n,) of the sequences; token_coefficients: (n, length), their exact delta_t. Returns a
    table by position (role, E[delta_t^2], share) and the share of each role:
    "credit_share_results" (the result positions together), "credit_share_answer" (the last
    position) and "credit_share_filler" (the rest).
    """
    squared = probs @ token_coefficients.square()
    shares = squared / squared.sum()
    length = token_coefficients.shape[1]
    table = pd.DataFrame(
        {
            "role": position_roles(length, result_positions),
            "E[delta_t^2]": squared.numpy(),
            "share": shares.numpy(),
        },
        index=pd.Index(range(length), name="position"),
    )
    results, answer = shares[result_positions].sum().item(), shares[-1].item()
    filler = 1 - results - answer
    return table, {
        "credit_share_results": results,
        "credit_share_answer": answer,
        "credit_share_filler": filler,
    }


def token_scores(policy: SequencePolicy, logits: Tensor, sequences: Tensor) -> Tensor:
    """grad log pi(y_t | y_<t) of each token, (n, length, num_params), by autograd."""
    jacobian = torch.autograd.functional.jacobian(
        lambda z: policy.token_log_probs(z, sequences), logits, vectorize=True
    )
    return jacobian.flatten(start_dim=2)


def per_sequence_estimates(coefficients: Tensor, scores: Tensor) -> Tensor:
    """g(y) = sum_t c_t(y) grad log pi(y_t | y_<t): one single-sample estimate per sequence.

    coefficients: (n, length), e.g. `token_advantages` (outcome) or a diff of
    `policy_gradient.exact_prefix_values` (token level); scores: (n, length, num_params).
    Returns (n, num_params).
    """
    return torch.einsum("nt,ntp->np", coefficients, scores)


def exact_moments(probs: Tensor, estimates: Tensor) -> tuple[Tensor, Tensor]:
    """Mean (num_params,) and variance (trace of the covariance) of a single-sample estimator
    taking the value estimates[y] with probability probs[y]. Divide the variance by n for the
    mean of n samples."""
    mean = probs @ estimates
    variance = probs @ estimates.square().sum(dim=1) - mean.square().sum()
    return mean, variance


def compare_estimators(exact: Tensor, moments: dict[str, tuple[Tensor, Tensor]]) -> dict:
    """Bias and variance of single-sample estimators against the exact gradient (num_params,).

    moments: name -> `exact_moments` (mean, variance), with names "outcome" and "token". Returns
    "gradient_norm", "<name>_bias" (||mean - exact||: rounding error for an unbiased estimator),
    "<name>_variance", and "variance_ratio" (outcome over token: the factor in rollouts that the
    outcome estimator needs for the same mean squared error).
    """
    records = {"gradient_norm": exact.norm().item()}
    for name, (mean, variance) in moments.items():
        records[f"{name}_bias"] = (mean - exact).norm().item()
        records[f"{name}_variance"] = variance.item()
    records["variance_ratio"] = (moments["outcome"][1] / moments["token"][1]).item()
    return records


def sampled_errors(
    probs: Tensor,
    estimates: Tensor,
    exact: Tensor,
    sample_sizes: list[int],
    num_repeats: int,
    seed: int,
) -> Tensor:
    """||mean of n sampled estimates - exact||^2, (len(sample_sizes), num_repeats).

    Counting how often each sequence is drawn turns a sample mean into one matmul.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in sample_sizes:
        draws = torch.multinomial(probs, n * num_repeats, replacement=True, generator=generator)
        counts = torch.zeros(num_repeats, len(probs), dtype=estimates.dtype)
        counts.scatter_add_(
            1, draws.view(num_repeats, n), torch.ones(num_repeats, n, dtype=estimates.dtype)
        )
        rows.append((counts / n @ estimates - exact).square().sum(dim=1))
    return torch.stack(rows)
