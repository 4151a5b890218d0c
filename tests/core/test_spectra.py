"""`core.spectra`: singular values from Gram matrices, and the three effective ranks on spectra
with known answers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_companion.core.spectra import (
    RANK_MEASURES,
    diagonal_blocks,
    effective_rank,
    energy_rank,
    gram_singular_values,
    mixed_gram,
    orthogonal_stable_rank,
    rank_measures,
    stable_rank,
    weighted_gram,
)


def test_weighted_gram_is_gram_of_weighted_rows():
    rows = torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    advantages = torch.tensor([1.5, -0.5, 0.0, -1.0])
    weighted = advantages[:, None].double() * rows
    torch.testing.assert_close(weighted_gram(rows @ rows.T, advantages), weighted @ weighted.T)


def _with_singular_values(values, rows=6, cols=9, seed=0):
    """U diag(values) V^T with random orthonormal U (rows, k) and V (cols, k)."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(values), dtype=torch.float64, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(cols, len(values), dtype=torch.float64, generator=generator))
    return u @ torch.diag(torch.tensor(values, dtype=torch.float64)) @ v.T


def test_known_spectra():
    identity = torch.linalg.svdvals(torch.eye(10, dtype=torch.float64))
    assert effective_rank(identity).item() == pytest.approx(10)
    assert stable_rank(identity).item() == pytest.approx(10)
    assert energy_rank(identity, 0.9).item() == 9
    assert energy_rank(identity, 0.99).item() == 10

    column, row = torch.arange(1.0, 7).double(), torch.arange(1.0, 10).double()
    rank_one = torch.linalg.svdvals(torch.outer(column, row))
    assert effective_rank(rank_one).item() == pytest.approx(1, abs=1e-12)
    assert stable_rank(rank_one).item() == pytest.approx(1)
    assert energy_rank(rank_one, 0.99).item() == 1

    two = torch.linalg.svdvals(_with_singular_values([2.0, 2.0]))
    assert effective_rank(two).item() == pytest.approx(2)
    assert stable_rank(two).item() == pytest.approx(2)
    assert energy_rank(two, 0.5).item() == 1 and energy_rank(two, 0.9).item() == 2

    # sigma = 3, 2, 1, 0.5: p = sigma / 6.5, squares 9, 4, 1, 0.25 of 14.25.
    sigma = torch.linalg.svdvals(_with_singular_values([0.5, 3.0, 1.0, 2.0]))
    p = [3 / 6.5, 2 / 6.5, 1 / 6.5, 0.5 / 6.5]
    entropy = -sum(q * math.log(q) for q in p)
    assert effective_rank(sigma).item() == pytest.approx(math.exp(entropy))
    assert effective_rank(sigma).item() == pytest.approx(3.33607, abs=1e-5)
    assert stable_rank(sigma).item() == pytest.approx(14.25 / 9)
    assert energy_rank(sigma, 0.9).item() == 2  # 13 / 14.25 = 0.912
    assert energy_rank(sigma, 0.99).item() == 4  # 14 / 14.25 = 0.982 < 0.99

    zero = torch.zeros(3, dtype=torch.float64)
    assert [f(zero).item() for f in (effective_rank, stable_rank, energy_rank)] == [0, 0, 0]
    batched = torch.stack([identity[:3], zero])  # (2, 3) -> (2,)
    assert effective_rank(batched).tolist() == pytest.approx([3, 0])
    assert energy_rank(batched, 1.0).tolist() == [3, 0]
    with pytest.raises(ValueError, match="threshold"):
        energy_rank(identity, 0.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.just(0.0) | st.floats(1e-300, 1e300), min_size=1, max_size=12),
    st.floats(1e-3, 1e3),
)
def test_rank_measures_lie_between_one_and_the_rank(values, scale):
    sigma = torch.tensor(values, dtype=torch.float64)
    rank = int((sigma > 0).sum())
    for measure in (effective_rank, stable_rank, lambda s: energy_rank(s, 0.99)):
        value = measure(sigma).item()
        assert (value == 0) if rank == 0 else (1 - 1e-9 <= value <= rank + 1e-9)
        assert measure(scale * sigma).item() == pytest.approx(value, rel=1e-9)


def test_gram_singular_values_of_rank_deficient_matrix():
    m = _with_singular_values([5.0, 1e-3, 0.0, 0.0], rows=4)
    sigma = gram_singular_values(m @ m.T)
    assert sigma.isfinite().all() and sigma[0] == sigma.max()
    torch.testing.assert_close(sigma, torch.tensor([5.0, 1e-3, 0, 0]).double(), atol=1e-7, rtol=0)


def test_mixed_gram_is_gram_of_mixed_rows():
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(5, 7, dtype=torch.float64, generator=generator)
    mixing = torch.tensor([[1, 1, 0, 0, 1], [0, 0, 1, 1, 0]])  # sums of rows {0, 1, 4}, {2, 3}
    mixed = mixing.double() @ rows
    torch.testing.assert_close(mixed_gram(rows @ rows.T, mixing), mixed @ mixed.T)
    # Batched: a stack of Grams and a stack of mixing matrices.
    batched = mixed_gram((rows @ rows.T).expand(3, 5, 5), mixing.expand(3, 2, 5))
    torch.testing.assert_close(batched, (mixed @ mixed.T).expand(3, 2, 2))


def test_diagonal_blocks():
    gram = torch.arange(36.0).view(6, 6)
    blocks = diagonal_blocks(gram, 3)
    assert blocks.shape == (2, 3, 3)
    torch.testing.assert_close(blocks[0], gram[:3, :3])
    torch.testing.assert_close(blocks[1], gram[3:, 3:])
    with pytest.raises(ValueError, match="blocks"):
        diagonal_blocks(gram, 4)


def test_rank_measures_of_a_known_spectrum():
    sigma = torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)  # squares 9, 4, 1, 0.25
    measures = rank_measures(sigma)
    assert tuple(measures) == RANK_MEASURES
    p = sigma / sigma.sum()
    assert measures["entropy"].item() == pytest.approx(math.exp(-(p * p.log()).sum().item()))
    assert measures["stable"].item() == pytest.approx(14.25 / 9)
    assert measures["energy_90"].item() == 2 and measures["energy_99"].item() == 4


@pytest.mark.parametrize("size", [2, 4, 8, 16])
def test_orthogonal_stable_rank_is_the_numerical_one(size):
    from grpo_companion.core.advantages import group_advantages

    q, _ = torch.linalg.qr(torch.randn(50, size, dtype=torch.float64))
    scores = q.T * 3.0  # orthogonal rows of equal norm
    for k in range(1, size):
        rewards = (torch.arange(size) < k).double()
        a = group_advantages(rewards[None], "grpo")[0]
        sigma = torch.linalg.svdvals(a[:, None] * scores)
        assert stable_rank(sigma).item() == pytest.approx(orthogonal_stable_rank(size, k).item())
    assert orthogonal_stable_rank(size, size // 2).item() == pytest.approx(size)
    assert orthogonal_stable_rank(size, 1).item() == pytest.approx(size / (size - 1))
