r"""Spectra of matrices given by their Gram matrices: singular values and effective ranks.

A matrix M `(R, P)` with P far larger than R (one row per completion, one column per
parameter) is measured through its Gram matrix G = M M^T `(R, R)`: sigma(M) = sqrt(eig(G)).
Row operations act on G directly, so one Gram matrix of score rows S serves every matrix built
from S by mixing its rows: diag(w) S (`weighted_gram`) and E S (`mixed_gram`).

Three effective ranks summarise a spectrum (`rank_measures`): the entropy effective rank, the
stable rank, and the energy ranks at 90% and 99%; each takes singular values `(..., k)` and
returns `(...)`, and the zero matrix has rank 0 under all of them.

One closed form gives the null model's stable rank of the per-completion gradient rows
(`orthogonal_stable_rank`), the yardstick chapter 7 measures diag(A) S against.
"""

import torch
from torch import Tensor

RANK_MEASURES = ("entropy", "stable", "energy_90", "energy_99")

# ---------------------------------------------------------------------------------------------
# Gram matrices of row-mixed matrices, and their singular values


def weighted_gram(gram: Tensor, weights: Tensor) -> Tensor:
    """Gram matrix of the weighted rows diag(w) S from that of S: diag(w) G diag(w), `(..., R, R)`
    for `gram: (..., R, R)`, `weights: (..., R)`.

    With w = A it is W W^T; one score Gram serves every advantage method."""
    weights = weights.to(gram.dtype)
    return weights[..., :, None] * gram * weights[..., None, :]


def gram_singular_values(gram: Tensor) -> Tensor:
    """Singular values of M `(R, P)` from G = M M^T `(R, R)`: sqrt(eigvalsh(G)), descending.

    Rounding leaves eigenvalues of a singular G at about -eps * ||G||; they are clamped to 0."""
    eigenvalues = torch.linalg.eigvalsh(gram)
    return eigenvalues.clamp(min=0).sqrt().flip(-1)


def mixed_gram(gram: Tensor, mixing: Tensor) -> Tensor:
    """Gram matrix of the rows E S from that of S: E G E^T, `mixing: (..., k, R)`, `gram:
    (..., R, R)` -> `(..., k, k)`."""
    mixing = mixing.to(gram.dtype)
    return mixing @ gram @ mixing.transpose(-1, -2)


def diagonal_blocks(gram: Tensor, block_size: int) -> Tensor:
    """`(N, N)` -> `(N / block_size, block_size, block_size)`: the Gram matrix of each prompt's
    rollouts (prompt-major, `block_size` per prompt)."""
    num_blocks = gram.shape[0] // block_size
    if num_blocks * block_size != gram.shape[0]:
        raise ValueError(f"{gram.shape[0]} rollouts are not blocks of {block_size}")
    blocks = gram.view(num_blocks, block_size, num_blocks, block_size)
    return blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1)


# ---------------------------------------------------------------------------------------------
# Effective rank of a spectrum. Each takes singular values `(..., k)` (any order) and returns
# `(...)`; the zero matrix has rank 0 under all three.


def rank_measures(singular_values: Tensor) -> dict[str, Tensor]:
    """{measure: `(...)`} of singular values `(..., k)`, one entry per name in `RANK_MEASURES`:
    `effective_rank`, `stable_rank`, and `energy_rank` at 0.9 and 0.99."""
    return {
        "entropy": effective_rank(singular_values),
        "stable": stable_rank(singular_values),
        "energy_90": energy_rank(singular_values, 0.9),
        "energy_99": energy_rank(singular_values, 0.99),
    }


def effective_rank(singular_values: Tensor) -> Tensor:
    """Entropy effective rank exp(H(p)), p_k = sigma_k / sum_j sigma_j, H = -sum p log p.

    Chapter: :doc:`/book/07_rank`

    Roy and Vetterli (2007), "The effective rank: a measure of effective dimensionality",
    EUSIPCO. Real-valued, 1 <= erank <= rank, equal to the rank iff the nonzero singular values
    are equal (n equal ones give n). Sensitive to a floor of tiny singular values: -p log p
    has infinite slope at 0, so rounding noise at relative size eps adds ~ eps log(1/eps)
    each (a float32 rank-one matrix reads 1.0000014).
    """
    total = singular_values.sum(dim=-1, keepdim=True)
    p = singular_values / torch.where(total > 0, total, 1)
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # 0 log 0 = 0
    return torch.where(total[..., 0] > 0, entropy.exp(), 0)


def stable_rank(singular_values: Tensor) -> Tensor:
    """||M||_F^2 / ||M||_2^2 = sum sigma^2 / max sigma^2.

    Rudelson and Vershynin (2007), "Sampling from large matrices: an approach through geometric
    functional analysis", J. ACM 54(4). 1 <= srank <= rank; insensitive to tiny singular values
    (they enter squared), dominated by the largest.
    """
    return _relative_to_largest(singular_values).square().sum(dim=-1)


def energy_rank(singular_values: Tensor, threshold: float = 0.9) -> Tensor:
    """Smallest k whose k largest singular values hold `threshold` of sum sigma^2, int64.

    The cumulative-percentage-of-total-variation rule for the number of principal components,
    Jolliffe (2002), "Principal Component Analysis", 2nd ed., section 6.1.1; 90% and 99% here.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    squares = _relative_to_largest(singular_values).square().sort(dim=-1, descending=True).values
    cumulative = squares.cumsum(dim=-1)
    total = cumulative[..., -1:]
    # Rounding can leave the full cumulative sum a hair under threshold * total when
    # threshold = 1; the clamp makes that k = all singular values.
    k = (cumulative < threshold * total).sum(dim=-1) + 1
    return torch.where(total[..., 0] > 0, k.clamp(max=squares.shape[-1]), 0)


def _relative_to_largest(singular_values: Tensor) -> Tensor:
    """sigma / max sigma (zeros stay zeros), so that squaring neither under- nor overflows."""
    top = singular_values.amax(dim=-1, keepdim=True)
    return singular_values / torch.where(top > 0, top, 1)


# ---------------------------------------------------------------------------------------------
# The null model of chapter 7: orthogonal score rows of equal norm


def orthogonal_stable_rank(group_size, num_correct) -> Tensor:
    """Stable rank of diag(A) S for orthogonal, equal-norm score rows S `(G, P)`, binary
    rewards with k = `num_correct` right (0 < k < G) and zero-sum advantages equal within a
    reward class (grpo, dr_grpo, rloo): G min(k, G - k) / max(k, G - k), float64, elementwise
    over numbers or tensors of G and k.

    Chapter: :doc:`/book/07_rank` (section 7, "per reading")

    The singular values are |A_i| ||s||; zero sum makes |a_1| / |a_0| = (G - k) / k, so the
    minority class carries the largest ones and sum sigma^2 / max sigma^2 is the formula: G
    for a balanced group, G / (G - 1) for a lone minority.
    """
    size = torch.as_tensor(group_size, dtype=torch.float64)
    correct = torch.as_tensor(num_correct, dtype=torch.float64)
    return size * torch.minimum(correct, size - correct) / torch.maximum(correct, size - correct)
