"""The claims ledger: what the paper and related work claim, where the book tests each claim, and
a verdict computed from the measurement, never typed.

A `Claim` is data: its statement and source, the number the source reports (if any), the chapter
and figure that test it, and its verdict rule. A rule is a list of `Check`s, each an arithmetic
expression over the chapter's recorded values (`_build/results/<chapter>.json`, `values`) with
bounds, for instance `Check("max(effective_ranks)", high=2.5)`. The verdict is

- "needs hardware or data this run lacked" when the run's setup, as the results record it
  (`profile`, or a value such as `model_name`), is not the `requires` of the claim;
- "reproduced" when every check of `reproduced` holds;
- "reproduced qualitatively" when every check of `qualitatively` holds (a looser rule, optional);
- "not reproduced" otherwise.

Adding a claim is a few lines of data in `CLAIMS`; `tests/test_claims.py` checks that every
chapter and figure a claim names exists in the book. Chapter 10 (`book/12_report.md`) renders the
ledger from the registry and the results of the build it is given (its `build_dir` parameter,
injected by the pipeline) and writes the same ledger for machines to `<build_dir>/results/claims.json`.
A claim whose chapter has no results, failed in its last run, or lacks the key or figure the claim
names raises `ClaimError` with a one-line message, so the chapter, and `make book`, fail.
"""

import ast
import json
import math
import operator
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPRODUCED = "reproduced"
QUALITATIVE = "reproduced qualitatively"
NOT_REPRODUCED = "not reproduced"
NEEDS_SETUP = "needs hardware or data this run lacked"
VERDICTS = (REPRODUCED, QUALITATIVE, NOT_REPRODUCED, NEEDS_SETUP)

SOURCES = {
    "paper": "the paper: On the Policy Gradient Foundations of Group Relative Policy Optimization: "
    "Credit Assignment, Gradient Sparsity, and Rank Collapse (arXiv 2606.29238, 2026)",
    "rloo": "Kool, van Hoof and Welling, Buy 4 REINFORCE Samples, Get a Baseline for Free! "
    "(ICLR workshop, 2019); Ahmadian et al., Back to Basics: Revisiting REINFORCE Style "
    "Optimization for Learning from Human Feedback in LLMs (arXiv 2402.14740, 2024)",
    "dr_grpo": "Liu et al., Understanding R1-Zero-Like Training: A Critical Perspective "
    "(Dr. GRPO, arXiv 2503.20783, 2025)",
    "length_alpha": "Ding et al., On the Impossibility of Unbiased and Length-Invariant Policy "
    "Optimization with Outcome Rewards (viXra 2605.0117, 2026)",
    "degeneracy": "related work on GRPO's degenerate groups, as summarised in the project's "
    "design notes (../shared/DESIGN.md): the Jensen bound on the degenerate-group rate, and "
    "0.69 observed at G = 4 in one logged GSM8K run of a 9B model",
    "u_statistic": "Zhou et al., Demystifying Group Relative Policy Optimization: Its Policy "
    "Gradient is a U-Statistic (arXiv 2603.01162, 2026)",
}


class ClaimError(Exception):
    """A claim that cannot be judged: its chapter, result key or figure is missing."""


# The expressions of a check: numbers, result keys, + - * / **, and these functions.
FUNCTIONS = {"abs": abs, "min": min, "max": max, "len": len, "sum": sum}
OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: a / b if b else math.nan,  # undefined: passes no check
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def expression_keys(expression: str) -> list[str]:
    """The result keys `expression` reads, in order of first use."""
    tree = ast.parse(expression, mode="eval")
    functions = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    names = sorted(
        (node.col_offset, node.id)
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and id(node) not in functions
    )
    return list(dict.fromkeys(name for _, name in names))


def evaluate_expression(expression: str, values: dict):
    """`expression` with each key replaced by `values[key]`; only the grammar above."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](walk(node.operand))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in FUNCTIONS
            and not node.keywords
        ):
            return FUNCTIONS[node.func.id](*(walk(argument) for argument in node.args))
        if isinstance(node, ast.Subscript):
            return walk(node.value)[walk(node.slice)]
        raise ValueError(f"unsupported in a check: {ast.unparse(node)!r} in {expression!r}")

    return walk(ast.parse(expression, mode="eval"))


@dataclass(frozen=True)
class Check:
    """`low <= expression <= high`, the expression over one chapter's recorded values."""

    expression: str
    low: float = -math.inf
    high: float = math.inf

    def __str__(self) -> str:
        if self.low == -math.inf:
            return f"{self.expression} ≤ {self.high:g}"
        if self.high == math.inf:
            return f"{self.expression} ≥ {self.low:g}"
        return f"{self.low:g} ≤ {self.expression} ≤ {self.high:g}"


def near(expression: str, target: float, tolerance: float) -> Check:
    """`expression` within `tolerance` of `target` (a source's number, or a theoretical value)."""
    sign = "+" if target < 0 else "-"
    return Check(f"abs({expression} {sign} {abs(target)!r})", high=tolerance)


@dataclass(frozen=True)
class Claim:
    """One row of the ledger. `measured` is the expression shown as the measured value;
    `requires` maps `profile` or a recorded value (`model_name`, `data_source`) to what the
    source measured on (a tuple: any of its values);
    source measured on; `notes` justify the thresholds."""

    id: str
    statement: str
    source: str
    chapter: str
    figure: str
    measured: str
    reproduced: tuple[Check, ...]
    qualitatively: tuple[Check, ...] = ()
    source_value: float | None = None
    requires: dict = field(default_factory=dict)
    notes: str = ""

    @property
    def keys(self) -> list[str]:
        expressions = [self.measured, *(c.expression for c in self.reproduced + self.qualitatively)]
        keys = [key for expression in expressions for key in expression_keys(expression)]
        return list(dict.fromkeys(keys + [key for key in self.requires if key != "profile"]))


# Exact computations (sums over every outcome) agree with their closed forms to float64
# rounding, a few 1e-16 in these chapters: 1e-9 leaves room for accumulation, none for a bug.
EXACT = 1e-9

CLAIMS = (
    Claim(
        id="P1_policy_gradient",
        statement="The policy gradient theorem: REINFORCE, r(y) ∇log π(y), is an unbiased "
        "estimate of ∇J, with an error that falls like n^(-1/2).",
        source="paper",
        chapter="01_policy_gradient",
        figure="error_vs_samples",
        measured="error_slope",
        reproduced=(
            Check("bandit_max_abs_error", high=EXACT),
            Check("bias_in_standard_errors", high=3.0),
            near("error_slope", -0.5, 0.1),
        ),
        notes="The closed form of the bandit gradient against autograd is exact; the pooled "
        "estimate of an unbiased estimator sits about one standard error from ∇J (3 allows "
        "for chance, a bias would grow like √N); the fitted slope of log-error against log-n "
        "is -1/2 in theory, ±0.1 for the Monte Carlo noise of a few hundred repeats.",
    ),
    Claim(
        id="P1_group_mean_baseline",
        statement="GRPO's group-mean baseline is REINFORCE with a baseline: the expected update "
        "points along ∇J, shrunk by exactly (1 - 1/G) because the mean includes the sample "
        "itself.",
        source="paper",
        chapter="02_group_baseline",
        figure="gradient_weight_vs_group_size",
        measured="max_error_mean_self",
        reproduced=(Check("max_residual", high=EXACT), Check("max_error_mean_self", high=EXACT)),
        qualitatively=(Check("max_residual", high=EXACT),),
        notes="Exact expectations over every group: the component orthogonal to ∇J "
        "(max_residual) and the gap between the weight and 1 - 1/G are rounding. Qualitatively: "
        "aligned with ∇J but with another factor.",
    ),
    Claim(
        id="P2_credit_collapse",
        statement="Under outcome-only reward every token of a rollout receives the same "
        "advantage: token-level credit collapses to one scalar per rollout, although the "
        "tokens' actual contributions differ.",
        source="paper",
        chapter="05_credit",
        figure="tiny_llama_token_advantages",
        measured="token_advantage_max_row_spread",
        reproduced=(
            Check("token_advantage_max_row_spread", high=EXACT),
            Check("credit_mean_row_spread / mean_credit_standard_error", low=3.0),
        ),
        notes="GRPO's token-by-advantage matrix must be constant along every row (spread 0 up "
        "to rounding), while the resampled token credit of the same rollouts must vary along "
        "a row by more than 3 of its per-token standard errors, so the collapse discards a "
        "real signal rather than noise.",
    ),
    Claim(
        id="P6_credit_bottleneck",
        statement="Credit assignment is the bottleneck for multi-step reasoning: the single "
        "scalar per rollout costs variance, and the tokens that decide the outcome are the "
        "intermediate steps.",
        source="paper",
        chapter="05_credit",
        figure="credit_by_token_class",
        measured="toy_variance_ratio",
        reproduced=(
            Check("toy_variance_ratio", low=1.5),
            Check("credit_share_result", low=0.25),
        ),
        qualitatively=(
            Check("toy_variance_ratio", low=1.5),
            Check("credit_share_result_and_answer / token_share_result_and_answer", low=2.0),
        ),
        notes="Reproduced: on the exact toy, outcome advantages need at least 1.5 times the "
        "rollouts of exact token advantages for the same error, and intermediate results "
        "(not the last one) carry at least a quarter of the squared token credit of the "
        "tiny Llama's rollouts. Qualitatively: the cost holds and the credit concentrates on "
        "computed digits (at least twice their share of the tokens), wherever in the chain.",
    ),
    Claim(
        id="P3_sparsity_grows",
        statement="Zero-advantage groups make the gradient sparse, and the sparsity intensifies "
        "over training as prompts become all-correct.",
        source="paper",
        chapter="06_sparsity",
        figure="sparsity_over_training",
        measured="all_correct_slope_mean",
        reproduced=(Check("all_correct_slope_low", low=1e-12),),
        notes="The all-correct fraction's least-squares slope per step, with a t interval over "
        "seeds (runs, not steps, are the independent units): the lower end must be above 0 "
        "(1e-12: a run with no all-correct group at all has an interval of exactly 0).",
    ),
    Claim(
        id="R_degeneracy_jensen",
        statement="When pass rates vary across prompts, the degenerate-group rate "
        "E[p^G + (1-p)^G] is at least the i.i.d. prediction at the mean pass rate (Jensen).",
        source="degeneracy",
        chapter="06_sparsity",
        figure="degenerate_rate_theory",
        measured="jensen_gap_min",
        reproduced=(
            Check("jensen_gaps_below_rounding", high=0),
            Check("monte_carlo_max_z", high=4.0),
        ),
        notes="No random pass-rate distribution may give a gap below -1e-12 (rounding), and "
        "the closed forms must lie within 4 standard errors of Monte Carlo everywhere.",
    ),
    Claim(
        id="P4_rank_two_small_models",
        statement="The GRPO gradient matrix of a group (row i: A_i ∇log π(y_i | x)) has "
        "effective rank about 2 regardless of the group size R ∈ {2, 4, 8}, from the "
        "zero-sum constraint on advantages (tested here on the tiny Llama).",
        source="paper",
        chapter="07_rank",
        figure="language_model_ranks",
        measured='effective_rank_weighted["tiny-llama"]["8"]',
        source_value=2.0,
        reproduced=tuple(
            near(f'effective_rank_weighted["tiny-llama"]["{r}"]', 2.0, 0.5) for r in (2, 4, 8)
        ),
        qualitatively=tuple(
            near(f'effective_rank_level_sums["tiny-llama"]["{r}"]', 2.0, 0.5) for r in (2, 4, 8)
        ),
        requires={"profile": ("cpu", "gpu")},
        notes="Mean entropy effective rank over groups, binary rewards, before training, "
        "within 0.5 of 2 at R = 2, 4 and 8 (chapter 5's own tolerance). Qualitatively: only "
        "the 2-row matrix of the summed scores of correct and of incorrect completions, whose "
        "difference of centroids the group gradient is, stays about 2 — a different matrix. "
        "The smoke profile's tiny Llama (30 warm-start steps) never answers right: it has no "
        "group with mixed rewards to measure.",
    ),
    Claim(
        id="P4_rank_two_sequence_policy",
        statement="The same rank-2 claim on the smallest model it can hold for: chapter 1's "
        "enumerable softmax sequence policy with a binary reward.",
        source="paper",
        chapter="07_rank",
        figure="sequence_policy_ranks",
        measured='effective_rank_weighted["sequence policy"]["8"]',
        source_value=2.0,
        reproduced=tuple(
            near(f'effective_rank_weighted["sequence policy"]["{r}"]', 2.0, 0.5)
            for r in (2, 4, 8)
        ),
        qualitatively=tuple(
            near(f'effective_rank_level_sums["sequence policy"]["{r}"]', 2.0, 0.5)
            for r in (2, 4, 8)
        ),
        notes="The tiny Llama's rule, on sampled groups of the sequence policy before its "
        "gradient-ascent steps.",
    ),
    Claim(
        id="P4_rank_two_nemotron",
        statement="The same rank-2 claim on the paper's own setting: Nemotron-4B on GSM8K.",
        source="paper",
        chapter="07_rank",
        figure="language_model_ranks",
        measured='effective_rank_weighted["nvidia/Nemotron-Mini-4B-Instruct"]["8"]',
        source_value=2.0,
        reproduced=tuple(
            near(f'effective_rank_weighted["nvidia/Nemotron-Mini-4B-Instruct"]["{r}"]', 2.0, 0.5)
            for r in (2, 4, 8)
        ),
        qualitatively=tuple(
            near(f'effective_rank_level_sums["nvidia/Nemotron-Mini-4B-Instruct"]["{r}"]', 2.0, 0.5)
            for r in (2, 4, 8)
        ),
        requires={"profile": "gpu"},
        notes="Only the gpu profile loads Nemotron-Mini-4B and the real GSM8K; the rule is the "
        "small models' one.",
    ),
    Claim(
        id="P3_sparsity_grows_gsm8k",
        statement="Sparsity intensifies over training on the paper's setting: the all-correct "
        "fraction of groups grows while Nemotron-4B trains with GRPO on GSM8K.",
        source="paper",
        chapter="11_gsm8k",
        figure="learning_curves",
        measured="all_correct_last - all_correct_first",
        reproduced=(Check("all_correct_last - all_correct_first", low=0.05),),
        requires={
            "profile": "gpu",
            "model_name": "nvidia/Nemotron-Mini-4B-Instruct",
            "data_source": "hub",
        },
        notes="The mean all-correct fraction of the last tenth of the steps must exceed that of "
        "the first tenth by 0.05. Chapter 4 tests the same claim on the tiny Llama.",
    ),
    Claim(
        id="P5_baseline_condition",
        statement="The group mean estimates E[r], which is the variance-optimal constant "
        "baseline exactly when the squared score norm is uncorrelated with the reward: "
        "b* - E[r] = Cov(‖s‖², r) / E‖s‖².",
        source="paper",
        chapter="08_baselines",
        figure="variance_vs_baseline_cases",
        measured="max_identity_error",
        reproduced=(
            Check("max_identity_error", high=EXACT),
            Check("abs(gap_uniform)", high=EXACT),
            Check("abs(gap_uncorrelated)", high=EXACT),
            Check("abs(gap_chapter1)", low=1e-6),
        ),
        notes="The identity and the two cases where the condition holds (uniform policy, "
        "decorrelated reward) are exact; where it fails (chapter 1's policy) the gap must be "
        "visible, else the condition would be vacuous.",
    ),
    Claim(
        id="P5_large_groups",
        statement="Estimating the baseline from the group costs little: leave-one-out's "
        "variance approaches that of the oracle baseline E[r] as G grows.",
        source="paper",
        chapter="08_baselines",
        figure="group_estimator_variance",
        measured="rloo_over_oracle_largest",
        reproduced=(
            Check("rloo_over_oracle_largest", high=1.1),
            Check("rloo_over_oracle_smallest - rloo_over_oracle_largest", low=0.0),
            Check("max_monte_carlo_relative_error", high=0.1),
        ),
        notes="Within 10% of the oracle at the largest G of the run (32 or more), and closer "
        "than at the smallest; the closed form is cross-checked by Monte Carlo to 10% (a few "
        "thousand groups per G).",
    ),
    Claim(
        id="P3_zero_advantage_groups",
        statement="A group whose rewards are all equal gets zero advantage and adds nothing to "
        "GRPO's update: dropping such groups (DAPO's dynamic sampling) leaves the expected "
        "update per drawn group unchanged. (The first half of claim 3; its growth over "
        "training is chapter 4's.)",
        source="paper",
        chapter="09_advantage_zoo",
        figure="weight_vs_pass_rate",
        measured="dapo_max_abs_difference_from_grpo",
        reproduced=(Check("dapo_max_abs_difference_from_grpo", high=EXACT),),
        notes="Exact sums over the number of correct completions: any difference is rounding.",
    ),
    Claim(
        id="R_rloo_unbiased",
        statement="The leave-one-out baseline (RLOO) gives an unbiased estimate of ∇J for "
        "every group size.",
        source="rloo",
        chapter="02_group_baseline",
        figure="gradient_weight_vs_group_size",
        measured="max_error_rloo",
        reproduced=(Check("max_error_rloo", high=EXACT), Check("max_residual", high=EXACT)),
        notes="Exact expectations over every group of the enumerable policy.",
    ),
    Claim(
        id="R_dr_grpo_difficulty_bias",
        statement="Dividing by the group's standard deviation (GRPO) gives hard and easy "
        "prompts more weight than medium ones; without it (Dr. GRPO, RLOO) every prompt "
        "weighs the same.",
        source="dr_grpo",
        chapter="09_advantage_zoo",
        figure="weight_vs_pass_rate",
        measured="grpo_hard_over_middle",
        reproduced=(
            Check("grpo_hard_over_middle", low=1.1),
            near("rloo_hard_over_middle", 1.0, EXACT),
        ),
        notes="A prompt at the chapter's hard pass rate must get at least 10% more weight "
        "than one at p = 1/2 under GRPO; RLOO (Dr. GRPO times G/(G-1)) exactly the same.",
    ),
    Claim(
        id="R_dr_grpo_length_bias",
        statement="GRPO's per-completion 1/|o| weights each token of a long wrong completion "
        "less than each token of a short one, by the ratio of their lengths: wrong answers "
        "are penalised less for being long.",
        source="dr_grpo",
        chapter="02_group_baseline",
        figure="token_weights",
        measured="grpo_short_over_long_wrong",
        reproduced=(
            near("grpo_short_over_long_wrong / length_ratio", 1.0, EXACT),
            Check("length_ratio", low=1.5),
        ),
        notes="Autograd on the aggregated loss: the push ratio equals the length ratio up to "
        "rounding, on completions of clearly different lengths.",
    ),
    Claim(
        id="R_length_alpha",
        statement="In the length weighting f_α(L) = L^(α-1) (α = 0 GRPO, α = 1 Dr. GRPO), only "
        "α = 1 is unbiased and only α = 0 gives every completion the same token weight: no "
        "member is both unbiased and length invariant.",
        source="length_alpha",
        chapter="09_advantage_zoo",
        figure="length_tradeoff",
        measured="unbiased_alpha",
        reproduced=(
            near("unbiased_alpha", 1.0, EXACT),
            near("token_invariant_alpha", 0.0, EXACT),
            Check("angle_grpo_group_mean", low=0.01),
            near("dr_grpo_token_weight_ratio * short_length / long_length", 1.0, EXACT),
        ),
        qualitatively=(Check("abs(unbiased_alpha - token_invariant_alpha)", low=0.05),),
        notes="Searched over a grid of α that contains 0 and 1; GRPO's bias angle must be "
        "visible (0.01 degrees). Qualitatively: the unbiased and the invariant α differ, "
        "but not where the source puts them.",
    ),
    Claim(
        id="R_u_statistic",
        statement="GRPO's mean-centred gradient is (1 - 1/G) times a U-statistic of order 2 "
        "(kernel ½(r - r')(s - s'), RLOO's estimator), whose MSE has Hoeffding's closed form.",
        source="u_statistic",
        chapter="10_group_size",
        figure="mse_vs_group_size",
        measured="u_statistic_identity_error",
        reproduced=(
            Check("u_statistic_identity_error", high=EXACT),
            Check("max_formula_gap", high=EXACT),
            Check("max_abs_z", high=4.0),
        ),
        notes="The identity and the closed forms are exact; the Monte Carlo MSEs (about 50 "
        "points) must lie within 4 standard errors of the exact curves.",
    ),
    Claim(
        id="R_oracle_property",
        statement="Oracle property: GRPO's MSE approaches that of the oracle that knows the "
        "true value as baseline; the relative excess decays like 1/G.",
        source="u_statistic",
        chapter="10_group_size",
        figure="mse_vs_group_size",
        measured="rloo_excess_largest",
        reproduced=(
            Check(
                "rloo_excess_times_g_largest / (rloo_excess_smallest * smallest_group_size)",
                high=1.0,
            ),
            Check("oracle_check_error", high=EXACT),
        ),
        notes="G times the relative excess at the largest G must not exceed its value at the "
        "smallest G (a 1/G decay or faster); 4ζ₁ must equal the oracle's variance exactly.",
    ),
    Claim(
        id="R_universal_group_size",
        statement="At a fixed budget of N = B × G completions per step the optimal group size "
        "is universal.",
        source="u_statistic",
        chapter="10_group_size",
        figure="best_group_size_vs_pass_rates",
        measured="rloo_best_group_size",
        reproduced=(
            Check("rloo_best_group_sizes_distinct", high=1),
            Check("best_group_size_max / best_group_size_min", high=1.5),
        ),
        qualitatively=(Check("rloo_best_group_sizes_distinct", high=1),),
        notes="Universal: one best G (of RLOO, unbiased) at every budget, and within a factor "
        "1.5 across the prompt distributions of the heat map (the MSE is flat near its "
        "minimum). Qualitatively: budget-free but not distribution-free.",
    ),
)


def _finite(value: float) -> float | None:
    """JSON has no NaN: an undefined measurement (a ratio of zeros) is recorded as None."""
    return value if math.isfinite(value) else None


def setup_of(results: dict, key: str):
    """What the run was: `profile`, or a recorded value such as `model_name`."""
    return results["profile"] if key == "profile" else results["values"][key]


def judge(claim: Claim, results: dict) -> dict:
    """The verdict of `claim` on one chapter's results (the JSON of `ChapterReport.write`),
    with the measured value and every check's value. The keys must be present."""
    values = results["values"]

    def run(checks):
        rows = []
        for check in checks:
            value = float(evaluate_expression(check.expression, values))
            rows.append(
                {
                    "expression": check.expression,
                    "value": _finite(value),
                    "low": None if check.low == -math.inf else check.low,
                    "high": None if check.high == math.inf else check.high,
                    "passed": check.low <= value <= check.high,
                }
            )
        return rows

    mismatched = {
        key: setup_of(results, key)
        for key, wanted in claim.requires.items()
        if setup_of(results, key) not in (wanted if isinstance(wanted, tuple) else (wanted,))
    }
    if mismatched:
        # Another setup's numbers say nothing about this claim, and may not exist at all (the
        # value of a model the run did not load): nothing is measured, nothing is checked.
        return {
            "verdict": NEEDS_SETUP,
            "measured_value": None,
            "checks": {"reproduced": [], "qualitatively": []},
            "setup_mismatch": mismatched,
        }
    reproduced, qualitatively = run(claim.reproduced), run(claim.qualitatively)
    if all(row["passed"] for row in reproduced):
        verdict = REPRODUCED
    elif qualitatively and all(row["passed"] for row in qualitatively):
        verdict = QUALITATIVE
    else:
        verdict = NOT_REPRODUCED
    return {
        "verdict": verdict,
        "measured_value": _finite(float(evaluate_expression(claim.measured, values))),
        "checks": {"reproduced": reproduced, "qualitatively": qualitatively},
        "setup_mismatch": mismatched,
    }


def chapter_results(build_dir: Path, claim: Claim) -> dict:
    """The results a claim reads, after checking that its chapter ran, did not fail last,
    and recorded every key and figure the claim names."""
    build_dir = Path(build_dir)
    chapter, first_key = claim.chapter, (claim.keys or [claim.measured])[0]
    path = build_dir / "results" / f"{chapter}.json"
    failed = build_dir / "failed" / f"{chapter}.ipynb"
    where = f"claim {claim.id}: chapter {chapter}"
    if failed.exists():
        raise ClaimError(
            f"{where} failed in its last run ({failed}), so key {first_key!r} would be stale"
        )
    if not path.exists():
        raise ClaimError(
            f"{where} has no results ({path}) for key {first_key!r}; "
            f"run `python -m grpo_companion run {chapter}` first"
        )
    results = json.loads(path.read_text())
    for key in claim.keys:
        if key not in results["values"]:
            raise ClaimError(f"{where} recorded no key {key!r} in {path}")
    figure = build_dir / "figures" / chapter / f"{claim.figure}.png"
    if claim.figure not in results["figures"] or not figure.exists():
        raise ClaimError(f"{where} has no figure {claim.figure!r} ({figure}); key {first_key!r}")
    return results


def ledger(build_dir: Path, claims=CLAIMS) -> dict:
    """Every claim judged on the results under `build_dir`: the ledger chapter 10 renders and
    `claims.json` holds. Raises `ClaimError` on the first claim that cannot be judged."""
    rows = []
    for claim in claims:
        results = chapter_results(build_dir, claim)
        judged = judge(claim, results)
        rows.append(
            {
                "id": claim.id,
                "statement": claim.statement,
                "source": claim.source,
                "source_citation": SOURCES[claim.source],
                "source_value": claim.source_value,
                "chapter": claim.chapter,
                "figure": claim.figure,
                "figure_path": f"figures/{claim.chapter}/{claim.figure}.png",
                "results_key": claim.measured,
                "measured_value": judged["measured_value"],
                "verdict": judged["verdict"],
                "checks": judged["checks"],
                "requires": dict(claim.requires),
                "setup_mismatch": judged["setup_mismatch"],
                "profile": results["profile"],
                "seed": results["seed"],
                "model_name": results["values"].get("model_name"),
                "notes": claim.notes,
            }
        )
    counts = Counter(row["verdict"] for row in rows)
    return {
        "verdicts": list(VERDICTS),
        "summary": {verdict: counts[verdict] for verdict in VERDICTS},
        "profiles": sorted({row["profile"] for row in rows}),
        "claims": rows,
    }


def write_ledger(table: dict, path: Path) -> Path:
    """Write the ledger as JSON, replacing any earlier one in a single move."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text(json.dumps(table, indent=2, ensure_ascii=False) + "\n")
    os.replace(scratch, path)
    return path


def _cell(text: str) -> str:
    """Text for a table cell: a `|` of the text (as in |o|) must not end the cell."""
    return text.replace("|", "\\|")


def _number(value) -> str:
    return "—" if value is None else f"{value:.3g}"


def markdown_table(table: dict, figures_prefix: str = "../figures") -> str:
    """The ledger as a MyST table: each row links its chapter (`{doc}`) and its figure's PNG
    (a local link, which Sphinx checks and copies)."""
    lines = [
        "| claim | verdict | measured | source reports | source | tested in | profile, model |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in table["claims"]:
        figure = f"{figures_prefix}/{row['chapter']}/{row['figure']}.png"
        lines.append(
            f"| **{row['id']}**: {_cell(row['statement'])} | **{row['verdict']}** "
            f"| `{row['results_key']}` = {_number(row['measured_value'])} "
            f"| {_number(row['source_value'])} | {row['source']} "
            f"| {{doc}}`{row['chapter']}`, figure [{row['figure']}]({figure}) "
            f"| {row['profile']}, {row['model_name'] or 'no model'} |"
        )
    return "\n".join(lines)


def markdown_checks(table: dict) -> str:
    """Every check of every claim with its measured value, and the reasons for the bounds."""
    lines = ["| claim | rule | check | value | holds |", "|---|---|---|---|---|"]
    for row in table["claims"]:
        for tier, checks in row["checks"].items():
            for check in checks:
                bound = Check(
                    check["expression"],
                    -math.inf if check["low"] is None else check["low"],
                    math.inf if check["high"] is None else check["high"],
                )
                lines.append(
                    f"| {row['id']} | {tier} | `{bound}` | {_number(check['value'])} "
                    f"| {'yes' if check['passed'] else 'no'} |"
                )
    lines.append("")
    lines += [f"- **{row['id']}**: {row['notes']}" for row in table["claims"] if row["notes"]]
    return "\n".join(lines)
