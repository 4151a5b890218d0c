"""The exercises whose solutions predict what a parameter change does, each checked by calling the
chapter's module functions at small size with the changed parameter (not by running the notebook).

Covered (chapter, exercise): 01-1, 02-1, 03-1, 03-2, 03-3, 04-1 (its mechanism only), 05-1,
06-1, 06-3 (the truncation part, at smoke size), 07-1 (the sequence policy, and the mechanism on
a random language model), 07-3, 08-1, 09-1, 09-3, 10-1, 11-1 (its mechanism only), 12-1, 12-3 (its
solution's ledger entry reads only declared keys). The language-model exercises are checked on
the random tiny Llama of `conftest.py` (06-3 on SmolLM2-135M itself): what their solutions say
of a trained model is not, and each test's docstring says what it checks. 06-1 is checked on
the i.i.d. rates its solution quotes (one batch's `batch_degenerate` is too noisy to assert).
Exercises that ask for a derivation or a reading rather than a prediction (such as 04-2, 08-3,
11-3, 12-2) are outside this file's scope.
"""

import copy
import re
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from grpo_companion.chapters.advantage_zoo.length import TwoLengthToy
from grpo_companion.chapters.baselines.optimal import baseline_cases, baseline_gap
from grpo_companion.chapters.credit import exact as credit_exact
from grpo_companion.chapters.group_baseline.exact import prompt_weights
from grpo_companion.chapters.group_size.budget import (
    best_group_sizes,
    rloo_best_group_size,
    rloo_best_group_size_table,
)
from grpo_companion.chapters.grpo_loss.kl import kl_divergence, kl_estimator_moments
from grpo_companion.chapters.grpo_loss.loss import batch_loss, first_step_loss, length_bias_group
from grpo_companion.chapters.rank import groups as rank_groups
from grpo_companion.chapters.rank import measure as rank
from grpo_companion.chapters.rank import verdict as rank_verdict
from grpo_companion.chapters.sparsity.rate import iid_degenerate_rate
from grpo_companion.core.advantages import group_advantages, zero_std_groups
from grpo_companion.core.exact import best_step_error, beta_quadrature, estimator_moments
from grpo_companion.core.policy_gradient import (
    SequencePolicy,
    estimator_variance,
    exact_prefix_values,
    optimal_baseline,
    reinforce_gradient,
    sum_mod_reward,
)
from grpo_companion.lm.gsm8k import build_prompts, load_gsm8k
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.trainer_metrics import rollout_metrics
from grpo_companion.machinery.claims import QUALITATIVE, REPRODUCED, judge, load_claims
from grpo_companion.machinery.declarations import declare, undeclared_references

ROOT = Path(__file__).resolve().parents[2]


def _odd_length(text: str, gold: str) -> float:
    """A reward on a completion's surface, 1 for an odd number of characters: a random model
    never answers right, so a correctness reward would leave every group all wrong."""
    return float(len(text) % 2)


def _arithmetic_prompts(tokenizer, num_prompts):
    """Prompts and golds of the first `num_prompts` training problems of the arithmetic source."""
    data = load_gsm8k("train", source="arithmetic", num_examples=num_prompts, seed=0)
    return build_prompts(tokenizer, data)


def _kl_moments(scale):
    """Chapter 3's section 4 at one distance: relative std and bias of each estimator."""
    policy = SequencePolicy(vocab_size=2, length=3)
    ref_logits = policy.init_logits(0, scale=1.5)
    logits = ref_logits + scale * policy.init_logits(2)
    kl = kl_divergence(policy, logits, ref_logits)
    moments = kl_estimator_moments(policy, logits, ref_logits)
    return {
        estimator: {"std": m["variance"] ** 0.5 / kl, "bias": m["bias"] / kl}
        for estimator, m in moments.items()
    }


def test_01_exercise_1_a_peaked_policy_moves_the_gap_either_way_depending_on_the_seed():
    def gap_and_gain(seed, logit_scale):
        policy = SequencePolicy(vocab_size=4, length=3)
        logits = policy.init_logits(seed, scale=logit_scale)
        rewards = sum_mod_reward(policy.all_sequences(), 4)
        mean = float(policy.objective(logits, rewards))
        b_star = optimal_baseline(policy, logits, rewards)
        variance_mean = float(estimator_variance(policy, logits, rewards, mean))
        variance_optimal = float(estimator_variance(policy, logits, rewards, b_star))
        return b_star - mean, 1 - variance_optimal / variance_mean

    (gap, gain), (peaked_gap, peaked_gain) = gap_and_gain(0, 1.5), gap_and_gain(0, 4.0)
    assert abs(peaked_gap) > abs(gap) and peaked_gain > gain  # seed 0: both grow
    for seed in (1, 2):  # both shrink
        (gap, gain), (peaked_gap, peaked_gain) = gap_and_gain(seed, 1.5), gap_and_gain(seed, 4.0)
        assert abs(peaked_gap) < abs(gap) and peaked_gain < gain, seed
    assert gap_and_gain(4, 1.5)[0] < 0 < gap_and_gain(4, 4.0)[0]  # seed 4: the sign flips


def test_02_exercise_1_at_group_size_2_every_weight_is_flat():
    # Section 3's table at group_size 2, on three of its prompts (exact sums over every group).
    policy = SequencePolicy(vocab_size=2, length=3)
    rewards = sum_mod_reward(policy.all_sequences(), 2)
    table = prompt_weights(policy, rewards, 2, 3, seed=0, logit_scale=2.0)
    assert table["w dr_grpo"].to_numpy() == pytest.approx(0.5, abs=1e-9)
    assert table["w rloo"].to_numpy() == pytest.approx(1.0, abs=1e-9)
    # grpo = dr_grpo / (1/sqrt 2 + 1e-4), ~0.707 whatever the pass rate
    assert table["w grpo"].to_numpy() == pytest.approx(0.5 / (2**-0.5 + 1e-4), abs=1e-9)
    assert table["pass rate p"].max() - table["pass rate p"].min() > 0.05


def test_03_exercise_1_far_from_the_reference_k3_spreads_more_and_k2_bias_shrinks():
    page_largest, farther, nearer, page_smallest = (
        _kl_moments(scale) for scale in (2.0, 3.0, 0.05, 0.1)
    )
    assert farther["k3"]["std"] > 2 * farther["k1"]["std"]  # "several times k1's"
    assert abs(farther["k2"]["bias"]) < abs(page_largest["k2"]["bias"])
    assert nearer["k1"]["std"] > page_smallest["k1"]["std"]
    # near the reference k2 and k3 are close to unbiased, with a spread far below k1's
    assert abs(nearer["k2"]["bias"]) < 0.01
    assert max(nearer["k2"]["std"], nearer["k3"]["std"]) < nearer["k1"]["std"] / 10


def test_03_exercise_2_shorter_long_completions():
    group, losses = length_bias_group(50, 100, 512)
    _, page_losses = length_bias_group(50, 400, 512)
    push = group["push per token, grpo"]
    assert push["short, wrong"] / push["long, wrong"] == pytest.approx(2.0)
    assert abs(losses["dr_grpo"]) < abs(page_losses["dr_grpo"])  # towards zero


def test_03_exercise_3_dapo_matches_grpo_at_one_length():
    # Every completion has L tokens: the dapo gradient is grpo's, -g / L.
    policy = SequencePolicy(vocab_size=2, length=3)
    logits = policy.init_logits(0, scale=1.5)
    rewards = sum_mod_reward(policy.all_sequences(), 2)
    draws = policy.sample(logits, 32, torch.Generator().manual_seed(0))
    advantages = group_advantages(rewards[draws].view(8, 4)).flatten()
    sequences = policy.all_sequences()[draws]
    _, grpo_gradient = first_step_loss(policy, logits, sequences, advantages)
    leaf = logits.clone().requires_grad_(True)
    loss, _ = batch_loss(policy, leaf, logits, sequences, advantages, loss_type="dapo")
    (dapo_gradient,) = torch.autograd.grad(loss, leaf)
    g = reinforce_gradient(policy.scores(logits, policy.all_sequences())[draws], advantages)
    assert dapo_gradient.flatten() == pytest.approx(grpo_gradient, abs=1e-14)
    assert grpo_gradient == pytest.approx(-g / 3, abs=1e-14)


def test_04_exercise_1_a_colder_confident_policy_has_fewer_mixed_groups(random_tiny):
    """The mechanism of the solution, not the warm-started model's count.

    Checked: (1) sampling at temperature T draws from softmax(z / T), the policy's p^(1/T)
    renormalised, and the chance that G = 8 draws of a token all agree, sum_a p_T(a)^G, is
    larger at T = 0.3 than at T = 1 for the first completion token of every prompt (it rises as
    T falls, for any logits); (2) `first_batch_mixed_groups` as the chapter computes it (G = 8
    completions of each of 16 prompts by `generate_rollouts`, groups not `zero_std_groups`)
    falls from T = 1 to T = 0.3 on a confident stand-in for a trained policy: the random tiny
    Llama with its logits multiplied by 30 (its final norm's weight; top token ~0.6), under a
    reward on the completion's surface (`_odd_length`).
    Not checked: the warm-started tiny Llama's own count on arithmetic problems (a trained
    checkpoint), nor that every policy loses mixed groups: on the near-uniform random model
    itself (logits spread ~0.1) the temperature barely changes the samples.
    """
    model, tokenizer = random_tiny
    confident = copy.deepcopy(model)
    with torch.no_grad():
        confident.model.norm.weight.mul_(30.0)
    prompts, golds = _arithmetic_prompts(tokenizer, 16)
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    for policy in (model, confident):
        with torch.no_grad():
            logits = policy(**inputs).logits[:, -1].double()
        probs = {T: torch.softmax(logits / T, dim=-1) for T in (1.0, 0.3)}
        powered = probs[1.0] ** (1 / 0.3)
        assert probs[0.3] == pytest.approx(powered / powered.sum(-1, keepdim=True), rel=1e-9)
        agree = {T: (p**8).sum(-1) for T, p in probs.items()}
        assert (agree[0.3] > agree[1.0]).all()

    def mixed_groups(temperature):
        first = generate_rollouts(
            confident,
            tokenizer,
            prompts,
            golds,
            num_generations=8,
            max_completion_length=4,
            temperature=temperature,
            seed=0,
            reward_fn=_odd_length,
            compute_log_probs=False,
        )
        return int((~zero_std_groups(first.rewards)).sum())

    assert mixed_groups(0.3) < mixed_groups(1.0)


def test_05_exercise_1_a_uniform_policy_gives_a_variance_ratio_of_length():
    vocab_size, length = 4, 5
    policy = SequencePolicy(vocab_size, length)
    logits = policy.init_logits(0, scale=0.0)
    sequences = policy.all_sequences()
    rewards = credit_exact.answer_reward(sequences, vocab_size, [1, 3])
    values = exact_prefix_values(policy, logits, rewards)
    outcome = (rewards - values[0, 0])[:, None].expand(-1, length)
    coefficients = {"outcome": outcome, "token": values.diff(dim=1)}
    scores = credit_exact.token_scores(policy, logits, sequences)
    moments = {
        name: credit_exact.exact_moments(
            policy.probs(logits), credit_exact.per_sequence_estimates(c, scores)
        )
        for name, c in coefficients.items()
    }
    exact = policy.exact_gradient(logits, rewards)
    records = credit_exact.compare_estimators(exact, moments)
    assert records["variance_ratio"] == pytest.approx(length, rel=1e-9)


def _sequence_policy_classes(group_sizes, sequence_prompts):
    """Chapter 7's verdict classes of the sequence policy's per-group candidates (sections 2
    and 6 with the chapter's parameters; the stacked group gradients of section 5 left out):
    {(reward, stage, candidate): (class, low, high)}, the rows of `group_rank_frame`, and the
    largest probability of one sequence under the late policy."""
    policy = SequencePolicy(vocab_size=3, length=3)
    initial = policy.init_logits(seed=0, scale=1.0)
    tables = rank_groups.sequence_reward_tables(policy, 0)
    late = initial.clone()
    for _ in range(30):
        late += 2.0 * policy.exact_gradient(late, tables["binary"]).view_as(late)
    frame, _ = rank_groups.sequence_policy_ranks(
        policy, {"early": initial, "late": late}, tables, group_sizes, sequence_prompts, 1, seed=1
    )
    by = ["model", "stage", "reward", "candidate", "group_size"]
    summary = rank_verdict.summarise_ranks(frame, by)
    classes = {}
    for reward in tables:
        rows, _ = rank_verdict.verdict(summary[summary["reward"] == reward])
        for row in rows:
            key = (reward, row["stage"], row["candidate"])
            classes[key] = (row["class"], row["low"], row["high"])
    return classes, frame, float(policy.probs(late).max())


def test_07_exercise_1_only_the_late_sequence_policy_changes_class():
    """The page's classes (group sizes [2, 4, 8, 16], 400 prompts) against the rerun's ([2, 4],
    100 prompts) on the sequence policy, for both rewards of section 2. Not checked: the
    language models of the chapter (the next test checks the mechanism on a random one) and
    the stacked group gradients of section 5."""
    page, _, late_top = _sequence_policy_classes([2, 4, 8, 16], 400)
    rerun, frame, _ = _sequence_policy_classes([2, 4], 100)
    # A mixed binary group of two: rows of equal |A|, so weighted has the scores' exact rank.
    pair = frame[(frame["group_size"] == 2) & frame["mixed"] & (frame["reward"] == "binary")]
    pair = pair.pivot_table(
        index=["stage", "prompt", "group"], columns="candidate", values="entropy"
    )
    assert len(pair) > 100
    assert pair["weighted"].to_numpy() == pytest.approx(pair["scores"].to_numpy(), rel=1e-9)
    for reward in ("binary", "uniform"):  # before training nothing changes class
        for candidate in ("scores", "weighted"):
            key = (reward, "early", candidate)
            assert page[key][0] == rerun[key][0] == "grows with R"
    assert page["binary", "early", "level_sums"][0] == "about 2"
    assert rerun["binary", "early", "level_sums"][0] == "about 2"
    assert 3 < rerun["binary", "early", "weighted"][2] < 3.5  # "about 3" at G = 4
    # after training one sequence has most of the mass: every per-group mean below 1.75 at G <= 4
    assert late_top == pytest.approx(0.89, abs=0.005)
    late = [value for key, value in rerun.items() if key[1] == "late"]
    assert max(high for _, _, high in late) < 1.75
    assert page["binary", "late", "scores"][0] == "grows with R"
    assert page["binary", "late", "scores"][2] == pytest.approx(2.5, abs=0.1)
    assert rerun["binary", "late", "scores"][0] == "at most 2"
    assert page["binary", "late", "weighted"][0] == "at most 2"
    assert rerun["binary", "late", "weighted"][0] == "about 1"  # by the third decimal:
    assert rerun["binary", "late", "weighted"][1:] == pytest.approx((1.32, 1.50), abs=0.005)
    assert page["binary", "late", "level_sums"][0] == rerun["binary", "late", "level_sums"][0]
    for candidate, before, after in [
        ("level_sums", "grows with R", "at most 2"),
        ("scores", "grows with R", "at most 2"),
        ("weighted", "at most 2", "about 1"),
    ]:
        key = ("uniform", "late", candidate)
        assert (page[key][0], rerun[key][0]) == (before, after)
    only_two, _, _ = _sequence_policy_classes([2], 100)
    assert {row[0] for row in only_two.values()} == {"one R only"}


def test_07_exercise_1_a_language_models_weighted_rows_grow_from_2(random_tiny):
    """The solution's mechanism on a language model at G in {2, 4}: a group of two has rows of
    equal |A|, so its weighted rows have exactly the scores' effective rank, near 2, and at
    G = 4 they have about 3 to 4: class `grows with R`. Checked on the random tiny Llama with
    `rank.measure`'s uniform reward (its binary rewards are all wrong: no mixed group). Not
    checked: the trained tiny Llama or SmolLM2 of the chapter, with binary rewards."""
    model, tokenizer = random_tiny
    problems = load_gsm8k("test", source="arithmetic", num_examples=4, seed=0)
    spec = {
        "name": "tiny",
        "max_completion_length": 8,
        "reward_mode": "strict",
        "weight_gradient_groups": 1,
    }
    result = rank.measure(model, tokenizer, spec, "early", problems, group_sizes=[2, 4], seed=0)
    frame = pd.concat(result["frames"])
    frame = frame[frame["reward"] == "uniform"]
    pair = frame[frame["group_size"] == 2].pivot_table(
        index=["prompt", "group"], columns="candidate", values="entropy"
    )
    assert pair["weighted"].to_numpy() == pytest.approx(pair["scores"].to_numpy(), rel=1e-6)
    assert pair["weighted"].to_numpy() == pytest.approx(2.0, abs=0.05)
    summary = rank_verdict.summarise_ranks(
        frame, ["model", "stage", "reward", "candidate", "group_size"]
    )
    rows, _ = rank_verdict.verdict(summary)
    weighted = next(row for row in rows if row["candidate"] == "weighted")
    assert weighted["class"] == "grows with R" and 3 <= weighted["high"] <= 4


def test_07_exercise_3_a_thresholded_random_reward_caps_only_the_level_sums_at_2():
    """Uniform rewards thresholded at 0.5 are binary and carry no information about the text:
    the level sums (and the group gradient, in their span) have rank at most 2, while the
    per-completion rows keep the scores' rank, G here. Random score rows, 50 groups of 8."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        scores = torch.randn(8, 40, dtype=torch.float64, generator=generator)
        rewards = (torch.rand(8, dtype=torch.float64, generator=generator) > 0.5).double()
        if rewards.std() == 0:
            continue
        advantages = group_advantages(rewards[None], "grpo")[0]
        ranks = {
            name: torch.linalg.matrix_rank(matrix).item()
            for name, matrix in rank_groups.candidate_matrices(scores, rewards, advantages).items()
        }
        assert ranks == {"scores": 8, "weighted": 8, "level_sums": 2}
        gradient = (advantages[:, None] * scores).sum(dim=0)
        level_sums = rank_groups.class_sums(scores, rewards)
        coefficients = torch.linalg.lstsq(level_sums.T, gradient[:, None]).solution
        assert level_sums.T @ coefficients[:, 0] == pytest.approx(gradient, abs=1e-10)


def test_08_exercise_1_rewarding_48_of_64_mirrors_the_other_case_at_16():
    policy = SequencePolicy(vocab_size=4, length=3)
    theta = policy.init_logits(0, scale=1.5)
    peaked = policy.init_logits(0, scale=3.0)
    gaps = {}
    for num_rewarded in (16, 48):
        cases = baseline_cases(policy, theta, peaked, num_rewarded)
        for key in ("rare", "likely"):
            _, logits, rewards = cases[key]
            gaps[key, num_rewarded] = baseline_gap(policy, logits, rewards)
    assert gaps["rare", 48]["gap"] > 0 > gaps["likely", 48]["gap"]  # the signs stay
    for key, mirror in [("rare", "likely"), ("likely", "rare")]:  # r -> 1 - r
        assert gaps[key, 48]["gap"] == pytest.approx(-gaps[mirror, 16]["gap"], rel=1e-9)
        assert gaps[key, 48]["excess_variance"] == pytest.approx(
            gaps[mirror, 16]["excess_variance"], rel=1e-9
        )
    assert gaps["rare", 48]["excess_variance"] > gaps["rare", 16]["excess_variance"]  # grows
    assert gaps["likely", 48]["excess_variance"] < gaps["likely", 16]["excess_variance"]


def test_09_exercise_1_without_score_noise_sign_has_the_least_error_at_the_best_step():
    pass_rates, weights = beta_quadrature(1.0, 1.0)
    errors = {
        method: best_step_error(pass_rates, weights, 8, method, score_noise=0.0)["relative_error"]
        for method in ("sign", "rloo", "grpo", "dr_grpo")
    }
    assert min(errors, key=errors.get) == "sign"
    noisy = {
        method: best_step_error(pass_rates, weights, 8, method, score_noise=4.0)["relative_error"]
        for method in ("sign", "rloo")
    }
    assert noisy["sign"] > noisy["rloo"]  # the effect disappears with score noise


def test_09_exercise_3_the_baseline_push_on_long_logit_changes_sign_at_alpha_1():
    toy = TwoLengthToy(4, 16, 0.0, 2.0)
    assert toy.baseline_push(0.0, 0.5)[0] > 0  # towards the long form
    assert toy.baseline_push(2.0, 0.5)[0] < 0
    assert toy.baseline_push(1.0, 0.5) == pytest.approx(np.zeros(2), abs=1e-15)


def test_10_exercise_1_medium_prompts_raise_rloos_best_group_size():
    page = rloo_best_group_size(*beta_quadrature(1.0, 1.0), score_noise=4.0)
    medium = rloo_best_group_size(*beta_quadrature(8.0, 8.0), score_noise=4.0)
    assert medium > page


def test_11_exercise_1_groups_of_two_are_degenerate_far_more_often(random_tiny):
    """The solution's arithmetic, and the trainer's `frac_reward_zero_std` on 128 completions
    as 64 groups of two against 16 groups of eight.

    Checked: p^2 + (1 - p)^2 >= 1/2 and > p^8 + (1 - p)^8 at every pass rate strictly between
    0 and 1 (`estimator_moments`' degenerate rate), and the fraction `rollout_metrics` logs
    jumps from G = 8 to G = 2 on the random tiny Llama's completions under a reward on their
    surface (`_odd_length`, pass rate near 1/2). Not checked: the size of the jump on the
    trained tiny Llama's GSM8K pass rates (a trained checkpoint); the inequality holds at any p.
    """
    pass_rates = np.linspace(0.01, 0.99, 99)
    pairs = estimator_moments(pass_rates, 2)["degenerate_rate"]
    eights = estimator_moments(pass_rates, 8)["degenerate_rate"]
    assert (pairs >= 0.5 - 1e-12).all() and (pairs > eights).all()
    model, tokenizer = random_tiny
    prompts, golds = _arithmetic_prompts(tokenizer, 64)

    def zero_std(num_prompts, num_generations):
        rollouts = generate_rollouts(
            model,
            tokenizer,
            prompts[:num_prompts],
            golds[:num_prompts],
            num_generations=num_generations,
            max_completion_length=4,
            seed=0,
            batch_size=128,
            reward_fn=_odd_length,
        )
        assert rollouts.rewards.numel() == 128
        return rollout_metrics(rollouts, "group")["frac_reward_zero_std"]

    assert zero_std(64, 2) > zero_std(16, 8) + 0.25


def test_12_exercise_1_one_prompt_distribution_makes_the_universal_claim_reproduced():
    # Chapter 10's records at smoke size (budgets, largest G) on its Beta(1, 1) prompts, then the
    # heat map over the page's distributions and over the rerun's single one.
    claim = next(
        claim
        for claim in load_claims(ROOT / "book" / "claims.toml")
        if claim.id == "R_universal_group_size"
    )
    budgets = [64, 256, 4096]
    nodes, weights = beta_quadrature(1.0, 1.0)
    best = best_group_sizes(nodes, weights, budgets, 64, {"RLOO = U": "rloo"}, score_noise=4.0)
    rloo = best["RLOO = U"]

    def verdict(means, concentrations):
        table = rloo_best_group_size_table(means, concentrations, score_noise=4.0)
        values = {
            "rloo_best_group_size": rloo[256],
            "rloo_best_group_sizes_distinct": len(set(rloo.values())),
            "best_group_size_max": float(table.max()),
            "best_group_size_min": float(table.min()),
            "largest_budget": budgets[-1],
            "smallest_budget": budgets[0],
        }
        return judge(claim, {"values": values, "profile": "cpu"})["verdict"]

    page_means = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert len(set(rloo.values())) == 1  # RLOO's best G is the same at every budget
    assert verdict(page_means, [1.0, 2.0, 4.0, 8.0, 16.0]) == QUALITATIVE
    assert verdict([0.5], [2.0]) == REPRODUCED


def test_12_exercise_3_the_solution_entry_loads_and_reads_declared_keys(tmp_path):
    text = (ROOT / "book" / "12_report.md").read_text()
    exercise = text[text.index("3. Chapter 7 records") :]
    entry = re.search(r"```toml\n(.*?)```", exercise, re.DOTALL).group(1)
    entry = "\n".join(line.removeprefix("   ") for line in entry.splitlines())
    path = tmp_path / "claims.toml"
    path.write_text(entry)
    tomllib.loads(entry)
    claims = load_claims(path)
    assert [claim.id for claim in claims] == ["P4_rank_two_smollm2"]
    declarations = {"07_rank": declare(ROOT / "book" / "07_rank.md")}
    assert undeclared_references(claims, declarations) == []
    ledger = {claim.id for claim in load_claims(ROOT / "book" / "claims.toml")}
    assert "P4_rank_two_nemotron" in ledger


def test_06_exercise_1_doubling_g_lowers_the_degenerate_rate_at_every_pass_rate():
    """G = 8 is degenerate less often than G = 4 at every p, with the solution's two examples."""
    p = np.linspace(0, 1, 1001)
    at_4, at_8 = (iid_degenerate_rate(p, g)["degenerate"] for g in (4, 8))
    assert (at_8 <= at_4 + 1e-15).all() and (at_8[1:-1] < at_4[1:-1]).all()
    rates = {g: iid_degenerate_rate([0.1, 0.5], g)["degenerate"] for g in (4, 8)}
    np.testing.assert_allclose(rates[4], [0.6562, 0.125], atol=1e-4)
    np.testing.assert_allclose(rates[8], [0.4305, 0.0078], atol=1e-4)


def test_06_exercise_3_room_to_finish_lowers_smollm2s_truncation():
    """Section 5 at smoke size (2 GSM8K-template problems, 2 samples each, to keep it near 30 s)
    with the exercise's 256 new tokens against the smoke profile's 8: the truncated fraction
    falls and more completions finish. What the solution says of the pass rate is a
    measurement, not a prediction this test can assert: at cpu size (8 problems, 256 tokens) 9
    of 32 completions finished and none was right, so `small_all_wrong` stayed at 1 (measured
    2026-12-04)."""
    from grpo_companion.chapters.sparsity import lm_runs as sparsity_lm
    from grpo_companion.lm.models import load_policy

    model, tokenizer = load_policy("smollm2-135m", progress=False)
    prompts, golds = build_prompts(
        tokenizer, load_gsm8k("test", source="gsm_symbolic", num_examples=2, seed=0)
    )
    measured = {
        length: sparsity_lm.sample_sparsity(
            generate_rollouts(model, tokenizer, prompts, golds, num_generations=2,
                              max_completion_length=length, seed=0)
        )
        for length in (8, 256)
    }  # fmt: skip
    assert measured[8]["small_truncated_fraction"] == 1.0
    assert measured[256]["small_truncated_fraction"] < 1.0
    assert measured[256]["small_num_finished"] > measured[8]["small_num_finished"]
