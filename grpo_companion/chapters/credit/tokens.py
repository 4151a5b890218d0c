r"""Chapter 5: credit assignment on the language model -- which tokens of a completion earned its
reward?

Under an outcome reward GRPO puts the same advantage A_i on every token score of completion i:
the token-by-advantage matrix (`token_advantages`, (N, T)) is constant along each row
(`row_spread` is 0), so the coefficients say nothing about which tokens mattered. Token-level
credit uses the value of a prefix, V(s_t) = P(correct | q, o_<t), and gives token t the advantage
delta_t = V(s_{t+1}) - V(s_t); along a completion the deltas sum to r - V(s_1), s_1 = (q) the
prompt.

`prefix_values` estimates V by Monte Carlo on a language model: K continuations sampled from
every prefix of every rollout, scored with the same reward (a "rollout value", as in VinePPO).
Column j of its `PrefixValues.values` is the value after the first j completion tokens, V(s_{j+1})
in the chapter's notation, so column 0 is V(s_1). `token_classes` sorts the tokens of worked
answers ("12+5=17\n17-3=14\n#### 14") into operands, intermediate results, the last worked
result, the final answer and format, to see where credit lies. The exact counterpart on chapter
1's enumerable policy is `grpo_companion.chapters.credit.exact`.

Chapter: :doc:`/book/05_credit` (section 1: the two estimators and why both are unbiased;
sections 3 and 4: real rollouts and where the credit lies).
"""

import re
from dataclasses import dataclass, replace

import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from grpo_companion.core.stats import expected_normal_range
from grpo_companion.lm import gsm8k

# rollouts' sampler, with every logits processor off; shared so that a resampled continuation
# comes from exactly the distribution the rollouts were drawn from.
from grpo_companion.lm.rollouts import (
    Rollouts,
    cut_at_eos,
    generate_groups,
    sampling_config,
    seeded,
    stop_token_ids,
)

TOKEN_CLASSES = ("operand", "result", "last_result", "answer", "format")
# The digits that a worked line or the answer computes.
COMPUTED_CLASSES = ["result", "last_result", "answer"]
# Columns of `class_share_table`, by the prefix of their recorded keys.
SHARE_COLUMNS = {"token": "tokens", "outcome": "outcome A^2", "credit": "credit delta^2"}
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


def choose_groups(rewards: Tensor, num_groups: int) -> tuple[list[int], dict]:
    """The first `num_groups` groups of rewards (num_prompts, G), mixed groups (some right, some
    wrong) before the others, each kind in its original order: no other selection.

    Returns the chosen indices and what the choice saw: "mixed_groups" and "sampled_groups"
    (counts), "pass_rate" (of all rollouts), "num_chosen_groups", "chosen_mixed_groups".
    """
    mixed = (rewards.std(dim=1) > 0).tolist()
    chosen = sorted(range(len(mixed)), key=lambda group: not mixed[group])[:num_groups]
    return chosen, {
        "mixed_groups": sum(mixed),
        "sampled_groups": len(mixed),
        "pass_rate": rewards.mean().item(),
        "num_chosen_groups": len(chosen),
        "chosen_mixed_groups": sum(mixed[group] for group in chosen),
    }


@dataclass
class PrefixValues:
    """Monte Carlo values of every prefix of N rollouts.

    values: (N, T + 1); column j estimates the probability of reward 1 after the first j
        completion tokens, V(s_{j+1}) in chapter 5's notation (column 0: V(s_1), the prompt's
        value). Columns j >= length hold the rollout's own reward: the completion is over, its
        value is known.
    standard_errors: (N, T + 1) of each estimate (sample std / sqrt(K), 0 where known).
    num_resamples: K, continuations per prefix.
    """

    values: Tensor
    standard_errors: Tensor
    num_resamples: int

    @property
    def credit(self) -> Tensor:
        """delta_t = V(s_{t+1}) - V(s_t), (N, T): each token's estimated advantage, 0 after
        the end. Along a row it sums to r - V(s_1) exactly (V(s_1): the prompt's value)."""
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
    """Estimate the value of every prefix of every rollout by resampling from the prefix.

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
                num_return_sequences=num_resamples,
                max_new_tokens=max_completion_length - t,
            )
            chunks = [
                # Each prefix runs through the model once, its cache copied K times.
                generate_groups(
                    model,
                    input_ids[chunk, : prompt_width + t],
                    attention_mask[chunk, : prompt_width + t],
                    config,
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


def noise_row_range(standard_errors: Tensor, mask: Tensor) -> float:
    """The mean over completions of the max - min that independent noise of the given standard
    errors would spread over its T tokens: `expected_normal_range(T)` times the completion's
    mean standard error (equal errors make it exact; the ledger compares the credit's spread
    with it). standard_errors, mask: (N, T)."""
    mask = mask.bool()
    lengths = mask.sum(dim=1)
    mean_errors = (standard_errors * mask).sum(dim=1) / lengths.clamp(min=1)
    ranges = torch.tensor([expected_normal_range(int(n)) for n in lengths], dtype=mean_errors.dtype)
    return (ranges * mean_errors).mean().item()


def prefix_value_summary(estimate: PrefixValues, rollouts: Rollouts) -> dict:
    """What the estimate of `prefix_values` cost, how noisy it is, and a consistency check.

    Returns "num_resamples" (K) and "num_continuations" (sampled in all); the mean standard
    error of a token's credit "mean_credit_standard_error", and "credit_mean_row_spread", the
    mean max - min of the credit along a completion; "credit_noise_row_range", the mean spread
    that pure noise of the measured size would give (`noise_row_range`); the two estimates of
    each group's V(prompt), "prompt_values" (the mean of its G resampled V(s_1)) and
    "group_pass_rates", (num_groups,),
    and "prompt_value_max_gap_in_errors": their largest gap in units of the pass rate's binomial
    standard error (the larger of the two noises).
    """
    mask = rollouts.completion_mask.bool()
    group_size = rollouts.rewards.shape[1]
    prompt_values = estimate.values[:, 0].view(-1, group_size).mean(dim=1)
    pass_rates = rollouts.rewards.mean(dim=1)
    pass_rate_errors = (prompt_values * (1 - prompt_values) / group_size).sqrt()
    gaps = (pass_rates - prompt_values).abs() / pass_rate_errors.clamp(min=1e-12)
    return {
        "num_resamples": estimate.num_resamples,
        "num_continuations": int(rollouts.lengths.sum()) * estimate.num_resamples,
        "mean_credit_standard_error": estimate.credit_standard_errors[mask].mean().item(),
        "credit_mean_row_spread": row_spread(estimate.credit, mask).mean().item(),
        "credit_noise_row_range": noise_row_range(estimate.credit_standard_errors, mask),
        "prompt_values": prompt_values,
        "group_pass_rates": pass_rates,
        "prompt_value_max_gap_in_errors": gaps.max().item(),
    }


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


def rewarded_wrong_steps(rollouts: Rollouts, reference_answers: list[str]) -> dict[str, int]:
    """How many rollouts are rewarded ("rewarded_rollouts"), and how many of those have
    `intermediate_results` that differ from their reference solution's, one worked answer per
    group ("rewarded_with_wrong_steps"): an outcome reward rewards them all the same.
    """
    steps = [intermediate_results(answer) for answer in reference_answers]
    groups = rollouts.prompt_index.tolist()
    wrong = [intermediate_results(text) != steps[g] for g, text in zip(groups, rollouts.texts)]
    rewarded = rollouts.rewards.reshape(-1).bool().tolist()
    return {
        "rewarded_rollouts": sum(rewarded),
        "rewarded_with_wrong_steps": sum(r and w for r, w in zip(rewarded, wrong)),
    }


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


def class_share_table(
    mask: Tensor, outcome_advantages: Tensor, squared_credit: Tensor, classes: Tensor
) -> pd.DataFrame:
    """`class_shares` of the tokens, of the outcome advantages' A_i^2 and of the credit's
    delta_t^2, a column each (`SHARE_COLUMNS`), indexed by `TOKEN_CLASSES`.

    mask, outcome_advantages (`token_advantages`), squared_credit
    (`PrefixValues.squared_credit`), classes (`token_classes`): (N, T).
    """
    weights = [mask.double(), outcome_advantages.square().double(), squared_credit.double()]
    return pd.DataFrame(
        {
            column: class_shares(w, classes).numpy()
            for column, w in zip(SHARE_COLUMNS.values(), weights)
        },
        index=pd.Index(TOKEN_CLASSES, name="token class"),
    )


def class_share_records(shares: pd.DataFrame) -> dict[str, float]:
    """`<kind>_share_<class>` for each kind of `SHARE_COLUMNS` and class of `TOKEN_CLASSES`, and
    `<kind>_share_result_and_answer`, the share of the `COMPUTED_CLASSES` together."""
    records = {}
    for kind, column in SHARE_COLUMNS.items():
        for name in TOKEN_CLASSES:
            records[f"{kind}_share_{name}"] = shares.loc[name, column]
        records[f"{kind}_share_result_and_answer"] = shares.loc[COMPUTED_CLASSES, column].sum()
    return records
