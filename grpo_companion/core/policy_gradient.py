"""Chapter 1: the policy gradient theorem, checked on a policy small enough to enumerate.

`SequencePolicy` is tabular and autoregressive: `length` tokens from a vocabulary of
`vocab_size`, token t drawn from softmax(logits[t, y_{t-1}]) with y_0 = BOS, a reward on the
whole sequence. Its vocab_size ** length sequences make J = sum_y pi(y) r(y) and its gradient
exact sums, and autograd on J gives the true gradient that every estimator of the book is
checked against; with length = 1 it is the softmax bandit. The module holds the REINFORCE
estimator with a constant baseline, its exact variance as a function of the baseline, the
variance-optimal baseline b* = E[||s||^2 r] / E[||s||^2], and the exact values of prefixes
used by chapter 5.

Chapter: :doc:`/book/01_policy_gradient` (the score-function identity; section 3: baselines and
b*).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequencePolicy:
    """pi(y) = prod_t softmax(logits[t, y_{t-1}])[y_t], over all sequences y of `length` tokens.

    `logits: (length, vocab_size + 1, vocab_size)`; the extra context row is BOS.  Sequences are
    numbered in lexicographic order (base-`vocab_size` digits), so a reward is a table
    `rewards: (num_sequences,)` indexed like `all_sequences()`.
    """

    vocab_size: int
    length: int

    def __post_init__(self):
        if self.vocab_size < 2 or self.length < 1:
            raise ValueError(
                f"need vocab_size >= 2 and length >= 1, got {self.vocab_size}, {self.length}"
            )

    @property
    def num_sequences(self) -> int:
        return self.vocab_size**self.length

    @property
    def logits_shape(self) -> tuple[int, int, int]:
        return (self.length, self.vocab_size + 1, self.vocab_size)

    def init_logits(self, seed: int, scale: float = 1.0) -> torch.Tensor:
        """Gaussian logits (float64), seeded; `scale` sets how peaked the policy is."""
        generator = torch.Generator().manual_seed(seed)
        return scale * torch.randn(self.logits_shape, generator=generator, dtype=torch.float64)

    def all_sequences(self) -> torch.Tensor:
        """`(num_sequences, length)` token ids; row k is sequence number k."""
        index = torch.arange(self.num_sequences)
        powers = self.vocab_size ** torch.arange(self.length - 1, -1, -1)
        return (index[:, None] // powers) % self.vocab_size

    def _contexts(self, sequences: torch.Tensor) -> torch.Tensor:
        bos = torch.full_like(sequences[:, :1], self.vocab_size)
        return torch.cat([bos, sequences[:, :-1]], dim=1)

    def token_log_probs(self, logits: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """log pi(y_t | y_{t-1}) of each token of `sequences: (n, length)`, returns `(n, length)`:
        the per-token log-probabilities a GRPO loss works on; differentiable in logits."""
        log_softmax = torch.log_softmax(logits, dim=-1)
        steps = torch.arange(self.length)
        return log_softmax[steps, self._contexts(sequences), sequences]

    def log_prob(self, logits: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """log pi(y) for `sequences: (n, length)`, returns `(n,)`; differentiable in logits."""
        return self.token_log_probs(logits, sequences).sum(dim=1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """pi(y) for every sequence, `(num_sequences,)`."""
        return self.log_prob(logits, self.all_sequences()).exp()

    def objective(self, logits: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """J = sum_y pi(y) r(y), exactly."""
        return self.probs(logits) @ rewards

    def exact_gradient(self, logits: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """grad J by autograd on the enumerated objective, flattened to `(num_params,)`."""
        logits = logits.detach().requires_grad_(True)
        (gradient,) = torch.autograd.grad(self.objective(logits, rewards), logits)
        return gradient.flatten()

    def scores(self, logits: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """Score vectors s(y) = grad log pi(y), `(n, num_params)`, in closed form.

        For a softmax, d log softmax(z)[a] / dz = onehot(a) - softmax(z); token t contributes
        that vector at row (t, y_{t-1}) and nothing elsewhere.
        """
        n = sequences.shape[0]
        contexts = self._contexts(sequences)
        steps = torch.arange(self.length)
        probs = torch.softmax(logits, dim=-1)[steps, contexts]  # (n, length, vocab)
        token_scores = torch.nn.functional.one_hot(sequences, self.vocab_size).to(probs) - probs
        scores = torch.zeros((n, *self.logits_shape), dtype=logits.dtype)
        scores[torch.arange(n)[:, None], steps, contexts] = token_scores
        return scores.flatten(start_dim=1)

    def sample(
        self, logits: torch.Tensor, num_samples: int, generator: torch.Generator
    ) -> torch.Tensor:
        """Sequence numbers `(num_samples,)` drawn i.i.d. from pi.

        Sampling the enumerated joint distribution is the same distribution as sampling token
        by token, and lets the estimators below index precomputed score tables.
        """
        return torch.multinomial(
            self.probs(logits), num_samples, replacement=True, generator=generator
        )


def exact_prefix_values(
    policy: SequencePolicy, logits: torch.Tensor, rewards: torch.Tensor
) -> torch.Tensor:
    """E[r | first j tokens] at every sequence for j = 0..length, `(num_sequences, length + 1)`.

    Column j is V(s_{j+1}) in chapter 5's notation (tokens numbered from 1, s_1 the empty
    prefix): column 0 is V(s_1) = J, the last column r itself, and the differences along a row
    are the token advantages delta_t = V(s_{t+1}) - V(s_t). `rewards: (num_sequences,)` indexed
    like `all_sequences()` (any per-sequence quantity gives its conditional mean). Sequences are
    numbered lexicographically, so a prefix of j tokens is the leading j base-`vocab_size` digits.
    """
    probs = policy.probs(logits).detach()
    numbers = torch.arange(policy.num_sequences)
    columns = []
    for t in range(policy.length + 1):
        prefix = numbers // policy.vocab_size ** (policy.length - t)
        mass = torch.zeros(policy.vocab_size**t, dtype=probs.dtype).index_add_(0, prefix, probs)
        total = torch.zeros_like(mass).index_add_(0, prefix, probs * rewards)
        columns.append((total / mass)[prefix])
    return torch.stack(columns, dim=1)


def softmax_policy_gradient(logits: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """Closed form for a softmax bandit, `logits, rewards: (num_actions,)`:
    dJ/dlogits_a = pi_a (r_a - J).  The exact gradient is the reward's deviation from its mean,
    weighted by the action probability: a baseline appears in the exact gradient already."""
    probs = torch.softmax(logits, dim=-1)
    return probs * (rewards - probs @ rewards)


def sum_mod_reward(sequences: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Binary outcome reward, `(n,)`: 1 when the last token equals the sum of the others mod
    `vocab_size` -- a final answer that is right or wrong as a whole, like GSM8K's."""
    answer = sequences[:, :-1].sum(dim=1) % vocab_size
    return (sequences[:, -1] == answer).to(torch.float64)


def reinforce_gradient(scores: torch.Tensor, rewards: torch.Tensor, baseline=0.0) -> torch.Tensor:
    """g_b = (1/n) sum_i (r_i - b) s_i for `scores: (n, num_params)`, `rewards: (n,)`.

    Chapter: :doc:`/book/01_policy_gradient`
    """
    return ((rewards - baseline)[:, None] * scores).mean(dim=0)


def estimator_variance(
    policy: SequencePolicy, logits: torch.Tensor, rewards: torch.Tensor, baselines
) -> torch.Tensor:
    """Exact Var[g_b] = E[(r - b)^2 ||s||^2] - ||grad J||^2 of one sample's estimate, enumerated.

    `rewards: (num_sequences,)`; `baselines`: a number or a tensor `(num_baselines,)`; returns
    the same shape as `baselines`.  Divide by n for the variance of the n-sample mean.
    """
    baselines = torch.as_tensor(baselines, dtype=torch.float64)
    probs = policy.probs(logits)
    squared_norms = policy.scores(logits, policy.all_sequences()).square().sum(dim=1)
    deviations = rewards - baselines[..., None]
    second_moment = (probs * squared_norms * deviations.square()).sum(dim=-1)
    return second_moment - policy.exact_gradient(logits, rewards).square().sum()


def optimal_baseline(policy: SequencePolicy, logits: torch.Tensor, rewards: torch.Tensor) -> float:
    """b* = E[||s||^2 r] / E[||s||^2], the constant baseline of least variance: argmin Var[g_b].

    Chapter: :doc:`/book/01_policy_gradient`
    """
    probs = policy.probs(logits)
    squared_norms = policy.scores(logits, policy.all_sequences()).square().sum(dim=1)
    return float((probs * squared_norms) @ rewards / (probs @ squared_norms))


def reinforce_estimates(
    policy: SequencePolicy,
    logits: torch.Tensor,
    rewards: torch.Tensor,
    num_samples: int,
    num_repeats: int,
    generator: torch.Generator,
    baseline: float = 0.0,
) -> torch.Tensor:
    """`num_repeats` independent REINFORCE estimates g_b, each from `num_samples` fresh samples:
    `(num_repeats, num_params)`.

    Equal to `reinforce_gradient` on the drawn samples; counting how often each sequence was
    drawn turns each sample mean into one matmul, so millions of samples cost no memory.
    """
    probs = policy.probs(logits)
    score_table = policy.scores(logits, policy.all_sequences())
    frequencies = torch.stack(
        [
            torch.bincount(
                torch.multinomial(probs, num_samples, replacement=True, generator=generator),
                minlength=policy.num_sequences,
            ).to(rewards.dtype)
            / num_samples
            for _ in range(num_repeats)
        ]
    )
    return (frequencies * (rewards - baseline)) @ score_table


def monte_carlo_errors(
    policy: SequencePolicy,
    logits: torch.Tensor,
    rewards: torch.Tensor,
    sample_sizes: list[int],
    num_repeats: int,
    seed: int,
    baseline: float = 0.0,
) -> torch.Tensor:
    """||g_n - grad J|| for n in `sample_sizes`, `num_repeats` independent estimates each.

    Returns `(len(sample_sizes), num_repeats)`, reproducible from `seed`.
    """
    generator = torch.Generator().manual_seed(seed)
    exact = policy.exact_gradient(logits, rewards)
    return torch.stack(
        [
            (
                reinforce_estimates(policy, logits, rewards, n, num_repeats, generator, baseline)
                - exact
            ).norm(dim=1)
            for n in sample_sizes
        ]
    )
