r"""Chapter 3: credit assignment -- which tokens of a completion earned its reward?

Outcome reward collapses credit to one scalar per rollout.  For a group of G completions
o_1..o_G of a prompt q with rewards r_i and advantages A_i (``advantages.group_advantages``),
GRPO's estimator is, up to how tokens are averaged,

    g = sum_i sum_t A_i * grad log pi(o_{i,t} | q, o_{i,<t}):

the coefficient of every token score of completion i is the same number A_i.  The
token-by-advantage matrix (`token_advantages`, (N, T)) is constant along each row, so the
coefficients carry no information about WHICH tokens mattered.  The estimator is still
unbiased: that information is only recovered in expectation, by averaging over many rollouts
in which the tokens that matter co-occur with reward.  What it costs is variance.

Token-level credit.  The value of a prefix s_t = (q, o_<t) under the policy,

    V(s_t) = E[r | s_t] = P(correct | q, o_<t),

gives each token its advantage  delta_t = Q(s_t, o_t) - V(s_t) = V(s_{t+1}) - V(s_t),
which sums telescopically to r - V(s_0) along each completion.  The estimator

    g_token = sum_t delta_t * grad log pi(o_t | s_t)

is unbiased as well (E[r | s_t, o_t] = Q(s_t, o_t), and E[V(s_t) grad log pi(o_t | s_t) | s_t] = 0),
and puts each token's weight where the reward was decided.

Two ways to get delta:
- on a language model, `prefix_values` estimates V(s_t) by Monte Carlo: K continuations sampled
  from every prefix of every rollout, scored with the same reward (a "rollout value", as in VinePPO);
- on chapter 1's enumerable `SequencePolicy`, `exact_prefix_values` computes V exactly, and
  `exact_moments` gives the exact mean and variance of any per-sequence estimator, so the two
  estimators' variances (and hence the samples each needs for the same accuracy) can be compared.

`token_classes` sorts the tokens of arithmetic worked answers ("12+5=17\n17-3=14\n#### 14") into
operands, intermediate results, the last worked result, the final answer and format, to see
where credit lies.
"""

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from grpo_companion.lm import gsm8k
from grpo_companion.core.policy_gradient import SequencePolicy

# rollouts' sampler, with every logits processor off; shared so that a resampled continuation
# comes from exactly the distribution the rollouts were drawn from.
from grpo_companion.lm.rollouts import (
    Rollouts,
    cut_at_eos,
    sampling_config,
    seeded,
    stop_token_ids,
)

TOKEN_CLASSES = ("operand", "result", "last_result", "answer", "format")
_RESULT = re.compile(r"=\s*(-?\d+)")


def token_advantages(advantages: Tensor, completion_mask: Tensor) -> Tensor:
    """GRPO's token-by-advantage matrix: A_i on every token of completion i, 0 on padding.

    advantages: (N,) one per rollout; completion_mask: (N, T). Returns (N, T).
    """
    return advantages.reshape(-1, 1) * completion_mask.to(advantages.dtype)


def row_spread(matrix: Tensor, mask: Tensor) -> Tensor:
    """max - min of each row over its masked-in entries, (N,); 0 for an empty row.

    0 on every row of `token_advantages`: that is "credit collapses to one scalar".
    """
    mask = mask.bool()
    largest = matrix.masked_fill(~mask, -torch.inf).amax(dim=1)
    smallest = matrix.masked_fill(~mask, torch.inf).amin(dim=1)
    return torch.where(mask.any(dim=1), largest - smallest, 0.0)


def select_groups(rollouts: Rollouts, groups: list[int]) -> Rollouts:
    """The rollouts of the given groups (prompt indices), in that order, trimmed to the
    longest selected completion."""
    size = rollouts.num_generations
    rows = torch.tensor([group * size + j for group in groups for j in range(size)])
    width = int(rollouts.lengths[rows].max())
    return replace(
        rollouts,
        prompt_ids=rollouts.prompt_ids[groups],
        prompt_mask=rollouts.prompt_mask[groups],
        completion_ids=rollouts.completion_ids[rows, :width],
        completion_mask=rollouts.completion_mask[rows, :width],
        log_probs=rollouts.log_probs[rows, :width],
        lengths=rollouts.lengths[rows],
        truncated=rollouts.truncated[rows],
        texts=[rollouts.texts[row] for row in rows.tolist()],
        rewards=rollouts.rewards[groups],
    )


@dataclass
class PrefixValues:
    """Monte Carlo values of every prefix of N rollouts.

    values: (N, T + 1); column t estimates V(q, o_<t), the probability of reward 1 after the
        first t completion tokens. Columns t >= length hold the rollout's own reward: the
        completion is over, its value is known.
    standard_errors: (N, T + 1) of each estimate (sample std / sqrt(K), 0 where known).
    num_resamples: K, continuations per prefix.
    """

    values: Tensor
    standard_errors: Tensor
    num_resamples: int

    @property
    def credit(self) -> Tensor:
        """delta_t = V(s_{t+1}) - V(s_t), (N, T): each token's estimated advantage, 0 after
        the end. Along a row it sums to r - V(s_0) exactly."""
        return self.values.diff(dim=1)

    @property
    def credit_standard_errors(self) -> Tensor:
        """(N, T); the two values of a difference come from independent samples."""
        return (self.standard_errors[:, 1:].square() + self.standard_errors[:, :-1].square()).sqrt()

    @property
    def squared_credit(self) -> Tensor:
        """(N, T) unbiased estimate of delta_t^2: delta_hat^2 minus its noise variance.

        |delta_hat| alone is biased up by the Monte Carlo noise, most where the true credit
        is 0; this estimate is not (it can be negative on a single token; sums are what count).
        """
        return self.credit.square() - self.credit_standard_errors.square()


@torch.no_grad()
def prefix_values(
    model,
    tokenizer,
    rollouts: Rollouts,
    golds: list[str],
    *,
    num_resamples: int,
    max_completion_length: int,
    seed: int,
    batch_size: int = 512,
    reward_fn=gsm8k.reward,
    progress: bool = False,
) -> PrefixValues:
    """Estimate V(q, o_<t) for every rollout and every t by resampling from the prefix.

    From each prefix (prompt and the first t completion tokens, t < length) K = `num_resamples`
    continuations of at most ``max_completion_length - t`` tokens are sampled at the rollouts'
    temperature, so a completion is never longer than the rollouts' own limit, and
    ``reward_fn(prefix text + continuation text, gold)`` is averaged.

    Args:
        rollouts: from `rollouts.generate_rollouts` with this `max_completion_length`.
        golds: one per prompt, as given to `generate_rollouts`.
        seed: seeds the sampler; the global torch RNG is left as it was.
        batch_size: continuations per `generate` call.
    """
    completion_ids, lengths = rollouts.completion_ids, rollouts.lengths
    num_rollouts, width = completion_ids.shape
    if num_resamples < 2:
        raise ValueError(f"num_resamples must be >= 2 for a standard error, got {num_resamples}")
    if int(lengths.max()) > max_completion_length:
        raise ValueError("a rollout is longer than max_completion_length")
    rewards = rollouts.rewards.reshape(-1).to(torch.float32).cpu()
    values = rewards[:, None].repeat(1, width + 1)
    standard_errors = torch.zeros(num_rollouts, width + 1)
    prompt_width = rollouts.prompt_ids.shape[1]
    input_ids, attention_mask = rollouts.input_ids, rollouts.attention_mask
    eos_token_ids = stop_token_ids(model, tokenizer)
    prompt_of = rollouts.prompt_index.tolist()
    with seeded(seed, model.device):
        for t in tqdm(range(width), desc="prefix values", disable=not progress):
            rows = torch.nonzero(lengths > t).squeeze(1)
            config = sampling_config(
                model,
                tokenizer,
                do_sample=True,
                temperature=rollouts.temperature,
                top_p=1.0,
                num_return_sequences=1,
                max_new_tokens=max_completion_length - t,
            )
            chunks = [
                _continue(
                    model,
                    input_ids[chunk, : prompt_width + t],
                    attention_mask[chunk, : prompt_width + t],
                    config,
                    num_resamples,
                )
                for chunk in rows.split(max(1, batch_size // num_resamples))
            ]
            longest = max(chunk.shape[1] for chunk in chunks)
            continuations = torch.cat(
                [
                    F.pad(chunk, (0, longest - chunk.shape[1]), value=config.pad_token_id)
                    for chunk in chunks
                ]
            )
            continuations, *_ = cut_at_eos(continuations, eos_token_ids, tokenizer.pad_token_id)
            prefixes = completion_ids[rows, :t].repeat_interleave(num_resamples, dim=0)
            texts = tokenizer.batch_decode(
                torch.cat([prefixes, continuations], dim=1), skip_special_tokens=True
            )
            golds_of_rows = [golds[prompt_of[row]] for row in rows.tolist()]
            scores = torch.tensor(
                [reward_fn(text, golds_of_rows[k // num_resamples]) for k, text in enumerate(texts)]
            ).view(len(rows), num_resamples)
            values[rows.cpu(), t] = scores.mean(dim=1)
            standard_errors[rows.cpu(), t] = scores.std(dim=1) / num_resamples**0.5
    return PrefixValues(values, standard_errors, num_resamples)


def _continue(
    model, input_ids: Tensor, attention_mask: Tensor, config, num_resamples: int
) -> Tensor:
    """(n * K, new) continuations, K per row of the left-padded `input_ids: (n, width)`.

    The prefix is run through the model once and its KV cache copied K times, rather than
    `generate(num_return_sequences=K)` running it K times: same samples, a few times faster.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    cache = model(
        input_ids=input_ids[:, :-1],
        attention_mask=attention_mask[:, :-1],
        position_ids=position_ids[:, :-1],
        use_cache=True,
    ).cache
    cache.batch_repeat_interleave(num_resamples)
    output = model.generate(
        input_ids=input_ids.repeat_interleave(num_resamples, dim=0),
        attention_mask=attention_mask.repeat_interleave(num_resamples, dim=0),
        cache=cache,
        generation_config=config,
    )
    return output[:, input_ids.shape[1] :]


def token_classes(tokenizer, completion_ids: Tensor, completion_mask: Tensor) -> Tensor:
    """Index into `TOKEN_CLASSES` of each completion token, (N, T); -1 on padding.

    A token holding a digit is an "answer" digit on a line with "####"; right of an "=" it is a
    "last_result" digit on the last line with an "=" (the one the answer copies) and a "result"
    digit on an earlier one (an intermediate result such as the 17 of "12+5=17"); otherwise it
    is an "operand". Every other token (operators, "=", newlines, "#", EOS) is "format". Spans
    are found by decoding growing prefixes, so multi-character tokens of any tokenizer work.
    """
    classes = torch.full(completion_ids.shape, -1, dtype=torch.long)
    for row, (ids, mask) in enumerate(zip(completion_ids.tolist(), completion_mask.tolist())):
        ids = [token for token, keep in zip(ids, mask) if keep]
        texts = [tokenizer.decode(ids[:t], skip_special_tokens=True) for t in range(len(ids) + 1)]
        text = texts[-1]
        worked = [i for i, line in enumerate(text.split("\n")) if "=" in line]
        for t in range(len(ids)):
            start, end = len(texts[t]), len(texts[t + 1])
            digits = [c for c in range(start, end) if text[c].isdigit()]
            if not digits:
                label = "format"
            else:
                line = text[text.rfind("\n", 0, digits[0]) + 1 : digits[0]]
                if "####" in line:
                    label = "answer"
                elif "=" not in line:
                    label = "operand"
                else:
                    last = text.count("\n", 0, digits[0]) == worked[-1]
                    label = "last_result" if last else "result"
            classes[row, t] = TOKEN_CLASSES.index(label)
    return classes


def intermediate_results(text: str) -> list[str]:
    """The numbers right of "=" in the worked lines of `text`, in order: "12+5=17\n17-3=14\n#### 14"
    gives ["17", "14"]. Compare a completion's with its gold answer's to find a right final
    answer reached through wrong steps, which an outcome reward rewards all the same."""
    matches = (_RESULT.search(line) for line in text.splitlines() if "####" not in line)
    return [match.group(1) for match in matches if match]


def class_shares(weights: Tensor, classes: Tensor) -> Tensor:
    """Share of the total weight on each of `TOKEN_CLASSES`, (num_classes,).

    weights, classes: (N, T), classes -1 where ignored. All zeros when the total is not
    positive (no token carries any credit, e.g. a policy that never succeeds).
    """
    totals = torch.stack([weights[classes == k].sum() for k in range(len(TOKEN_CLASSES))]).to(
        torch.float64
    )
    total = totals.sum()
    return totals / total if total > 0 else torch.zeros_like(totals)


# --- exact version on chapter 1's enumerable policy ------------------------------------------


def answer_reward(sequences: Tensor, vocab_size: int, positions: list[int]) -> Tensor:
    """Binary reward, (n,): 1 when the last token equals the sum of the tokens at `positions`
    mod `vocab_size`. Those positions are the "intermediate results" the answer depends on;
    the others are filler that matters only through what the policy writes next."""
    answer = sequences[:, positions].sum(dim=1) % vocab_size
    return (sequences[:, -1] == answer).to(torch.float64)


def exact_prefix_values(policy: SequencePolicy, logits: Tensor, rewards: Tensor) -> Tensor:
    """V(y_<t) = E[r | y_<t] for every sequence and t = 0..length, (num_sequences, length + 1).

    Sequences are numbered lexicographically, so those sharing the first t tokens are the
    consecutive blocks of vocab_size ** (length - t): each value is a block's
    probability-weighted mean reward. Column 0 is J, the last column r itself.
    """
    probs = policy.probs(logits)
    columns = []
    for t in range(policy.length + 1):
        block = policy.vocab_size ** (policy.length - t)
        mass = probs.view(-1, block).sum(dim=1)
        value = (probs * rewards).view(-1, block).sum(dim=1) / mass
        columns.append(value.repeat_interleave(block))
    return torch.stack(columns, dim=1)


def token_scores(policy: SequencePolicy, logits: Tensor, sequences: Tensor) -> Tensor:
    """grad log pi(y_t | y_<t) of each token, (n, length, num_params), by autograd."""
    jacobian = torch.autograd.functional.jacobian(
        lambda z: policy.token_log_probs(z, sequences), logits, vectorize=True
    )
    return jacobian.flatten(start_dim=2)


def per_sequence_estimates(coefficients: Tensor, scores: Tensor) -> Tensor:
    """g(y) = sum_t c_t(y) grad log pi(y_t | y_<t): one single-sample estimate per sequence.

    coefficients: (n, length), e.g. `token_advantages` (outcome) or a diff of
    `exact_prefix_values` (token level); scores: (n, length, num_params). Returns (n, num_params).
    """
    return torch.einsum("nt,ntp->np", coefficients, scores)


def exact_moments(probs: Tensor, estimates: Tensor) -> tuple[Tensor, Tensor]:
    """Mean (num_params,) and variance (trace of the covariance) of a single-sample estimator
    taking the value estimates[y] with probability probs[y]. Divide the variance by n for the
    mean of n samples."""
    mean = probs @ estimates
    variance = probs @ estimates.square().sum(dim=1) - mean.square().sum()
    return mean, variance


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
