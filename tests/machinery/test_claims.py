"""The claims ledger: the engine on hand-built results (each of the five verdicts reachable, a
clear one-line error for a missing chapter, failed chapter, key or figure, the schema of
claims.json), and the data, without running a chapter: every claim of `book/claims.toml` cites
works of `book/references.bib` and reads only keys and figures its chapter's code declares
(`declarations.declare`), every chapter declares, a renamed key fails in seconds, and every
rule can fail for the right reason: each claim's example values that support it, contradict it,
cannot decide it, lie outside its regime or come from a run that did not learn get their
verdicts, and only an explicit contradiction gives "not reproduced". Also the exercises every
chapter must end with."""

import functools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from grpo_companion.core.stats import interval_reading, interval_words
from grpo_companion.machinery.checks import evaluate_expression, expression_keys
from grpo_companion.machinery.claims import (
    EXAMPLES,
    GATE_EXAMPLES,
    INCONCLUSIVE,
    NEEDS_SETUP,
    NOT_REPRODUCED,
    QUALITATIVE,
    REPRODUCED,
    TIERS,
    VERDICTS,
    Check,
    Claim,
    ClaimError,
    judge,
    ledger,
    load_claims,
    load_tolerances,
    markdown_checks,
    markdown_table,
    near,
    write_ledger,
)
from grpo_companion.machinery.declarations import (
    DeclarationError,
    declare,
    is_declared,
    mismatches,
    undeclared_references,
)
from grpo_companion.machinery.pipeline import Project

ROOT = Path(__file__).resolve().parents[2]
CLAIMS_FILE = ROOT / "book" / "claims.toml"
CLAIMS = load_claims(CLAIMS_FILE)


@functools.cache
def declarations() -> dict:
    """What every chapter's code records, read from the code (no chapter runs)."""
    project = Project(ROOT)
    return {chapter: declare(project.source(chapter)) for chapter in project.chapters}


RANK_CLAIM = Claim(
    id="rank_two",
    statement="effective rank about 2 at every R",
    sources=("mishra2026foundations",),
    chapter="07_rank",
    figure="effective_rank",
    measured="max(effective_ranks)",
    source_value=2.0,
    reproduced=(near("min(effective_ranks)", 2.0, 0.5), near("max(effective_ranks)", 2.0, 0.5)),
    qualitatively=(Check("max(effective_ranks) - min(effective_ranks)", high=1.0),),
    contradicted=(Check("max(effective_ranks) - min(effective_ranks)", high=1.0, outside=True),),
    requires={"model_name": "nvidia/Nemotron-Mini-4B-Instruct", "profile": "gpu"},
)


def results(values, profile="gpu", chapter="07_rank", figures=("effective_rank",)):
    return {
        "chapter": chapter,
        "profile": profile,
        "seed": 0,
        "values": values,
        "figures": list(figures),
    }


def test_expressions_read_keys_and_refuse_anything_else():
    values = {"a": 3.0, "ranks": [1.5, 2.5], "table": {"x": 4}}
    assert expression_keys("abs(a - max(ranks)) / table['x']") == ["a", "ranks", "table"]
    assert evaluate_expression("abs(a - max(ranks)) / table['x']", values) == 0.125
    assert evaluate_expression("-a ** 2 + len(ranks) + ranks[1]", values) == -4.5
    for bad in ("a.real", "__import__('os')", "a if a else 0", "open('x')", "[a][0]"):
        with pytest.raises(ValueError, match="unsupported"):
            evaluate_expression(bad, values)


def test_near_states_its_tolerance_and_reads_negative_targets():
    assert str(near("slope", -0.5, 0.1)) == "abs(slope + 0.5) ≤ 0.1"
    check = near("slope", -0.5, 0.1)
    assert evaluate_expression(check.expression, {"slope": -0.45}) == pytest.approx(0.05)
    assert str(Check("x", 1.0, 2.0)) == "1 ≤ x ≤ 2" and str(Check("x", low=1e-6)) == "x ≥ 1e-06"


@pytest.mark.parametrize(
    ("ranks", "profile", "model", "verdict"),
    [
        ([1.9, 2.1, 2.3], "gpu", "nvidia/Nemotron-Mini-4B-Instruct", REPRODUCED),
        ([2.6, 2.9, 3.1], "gpu", "nvidia/Nemotron-Mini-4B-Instruct", QUALITATIVE),
        ([1.0, 2.0, 4.0], "gpu", "nvidia/Nemotron-Mini-4B-Instruct", NOT_REPRODUCED),
        # the checks would pass: the setup, as the results record it, decides first
        ([1.9, 2.1, 2.3], "cpu", "nvidia/Nemotron-Mini-4B-Instruct", NEEDS_SETUP),
        ([1.9, 2.1, 2.3], "gpu", "tiny-llama", NEEDS_SETUP),
    ],
)
def test_every_verdict_is_reachable_and_computed_from_the_results(ranks, profile, model, verdict):
    judged = judge(RANK_CLAIM, results({"effective_ranks": ranks, "model_name": model}, profile))
    assert judged["verdict"] == verdict
    if verdict == NEEDS_SETUP:  # another setup's numbers are neither shown nor checked
        assert judged["setup_mismatch"] in ({"profile": "cpu"}, {"model_name": "tiny-llama"})
        assert judged["measured_value"] is None and judged["checks"]["reproduced"] == []
        return
    assert judged["measured_value"] == max(ranks)
    reproduced = judged["checks"]["reproduced"]
    assert [row["value"] for row in reproduced] == pytest.approx(
        [abs(min(ranks) - 2), abs(max(ranks) - 2)]
    )
    assert all(row["low"] is None and row["high"] == 0.5 for row in reproduced)


def test_a_mismatched_setup_needs_no_value_of_the_missing_model():
    claim = replace(RANK_CLAIM, measured='ranks_by_model["nemotron"]')
    judged = judge(
        claim,
        results(
            {"ranks_by_model": {"tiny": 3.0}, "model_name": "tiny-llama", "effective_ranks": [3.0]},
            "cpu",
        ),
    )
    assert judged["verdict"] == NEEDS_SETUP


def test_a_registry_rule_on_hand_built_values():
    universal = next(claim for claim in CLAIMS if claim.id == "R_universal_group_size")
    values = {"rloo_best_group_size": 12, "best_group_size_min": 10.0}
    values |= {"largest_budget": 4096, "smallest_budget": 64}
    for distinct, largest, verdict in [
        (1, 12.0, REPRODUCED),
        (1, 50.0, QUALITATIVE),
        (2, 12.0, NOT_REPRODUCED),
    ]:
        hand_built = results(
            {**values, "rloo_best_group_sizes_distinct": distinct, "best_group_size_max": largest},
            "cpu",
            "10_group_size",
            ["best_group_size_vs_pass_rates"],
        )
        assert judge(universal, hand_built)["verdict"] == verdict


def write_build(build_dir: Path, chapter_results: dict, figure_files=True) -> Path:
    for chapter, result in chapter_results.items():
        (build_dir / "results").mkdir(parents=True, exist_ok=True)
        (build_dir / "results" / f"{chapter}.json").write_text(json.dumps(result))
        if figure_files:
            for figure in result["figures"]:
                path = build_dir / "figures" / chapter / f"{figure}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"png")
    return build_dir


GOOD = results({"effective_ranks": [2.0, 2.1], "model_name": "tiny-llama"}, "cpu")


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("no chapter", "claim rank_two: chapter 07_rank has no results"),
        ("failed", "claim rank_two: chapter 07_rank failed in its last run"),
        ("no key", "claim rank_two: chapter 07_rank recorded no key 'effective_ranks'"),
        ("no model", "claim rank_two: chapter 07_rank recorded no key 'model_name'"),
        ("figure not recorded", "claim rank_two: chapter 07_rank has no figure 'effective_rank'"),
        ("figure file missing", "claim rank_two: chapter 07_rank has no figure 'effective_rank'"),
    ],
)
def test_a_claim_that_cannot_be_judged_names_claim_chapter_and_key(tmp_path, broken, message):
    values = dict(GOOD["values"])
    figures = GOOD["figures"]
    if broken == "no key":
        del values["effective_ranks"]
    if broken == "no model":
        del values["model_name"]
    if broken == "figure not recorded":
        figures = []
    build = write_build(
        tmp_path,
        {}
        if broken == "no chapter"
        else {"07_rank": {**GOOD, "values": values, "figures": figures}},
        figure_files=broken != "figure file missing",
    )
    if broken == "failed":
        (build / "failed").mkdir()
        (build / "failed" / "07_rank.ipynb").write_text("{}")
    # the claim's setup is the run's: a claim of another setup reads no key (below)
    claim = replace(RANK_CLAIM, requires={"profile": "cpu", "model_name": "tiny-llama"})
    with pytest.raises(ClaimError) as error:
        ledger(build, [claim])
    text = str(error.value)
    assert text.startswith(message) and "\n" not in text
    assert "'effective_ranks'" in text or "'model_name'" in text  # the key is named


def test_a_claim_of_another_setup_reads_no_key_of_the_run(tmp_path):
    """The tiny Llama's run records no Nemotron key; the Nemotron claim needs the setup first."""
    values = {"model_name": "tiny-llama"}
    build = write_build(tmp_path, {"07_rank": {**GOOD, "values": values}})
    (row,) = ledger(build, [RANK_CLAIM])["claims"]
    assert row["verdict"] == NEEDS_SETUP


def test_claims_json_schema(tmp_path):
    other = Claim(
        id="slope",
        statement="error falls like n^(-1/2)",
        sources=("mishra2026foundations",),
        chapter="01_policy_gradient",
        figure="error_vs_samples",
        measured="error_slope",
        reproduced=(near("error_slope", -0.5, 0.1),),
        contradicted=(near("error_slope", -0.5, 0.1, outside=True),),
    )
    build = write_build(
        tmp_path,
        {
            "07_rank": GOOD,
            "01_policy_gradient": results(
                {"error_slope": -0.3}, "smoke", "01_policy_gradient", ["error_vs_samples"]
            ),
        },
    )
    table = ledger(build, [RANK_CLAIM, other])
    path = write_ledger(table, build / "results" / "claims.json")

    def no_infinity(name):
        raise AssertionError(f"claims.json holds {name}")

    stored = json.loads(path.read_text(), parse_constant=no_infinity)
    assert stored == json.loads(json.dumps(table))
    assert stored["verdicts"] == list(VERDICTS)
    assert stored["summary"] == {
        REPRODUCED: 0,
        QUALITATIVE: 0,
        INCONCLUSIVE: 0,
        NOT_REPRODUCED: 1,
        NEEDS_SETUP: 1,
    }
    assert stored["profiles"] == ["cpu", "smoke"]
    rank, slope = stored["claims"]
    assert rank["verdict"] == NEEDS_SETUP and rank["setup_mismatch"] == {
        "model_name": "tiny-llama",
        "profile": "cpu",
    }
    assert rank["model_name"] == "tiny-llama" and rank["source_value"] == 2.0
    assert slope["verdict"] == NOT_REPRODUCED and slope["measured_value"] == -0.3
    assert slope["figure_path"] == "figures/01_policy_gradient/error_vs_samples.png"
    for row in stored["claims"]:
        assert set(row) >= {
            "id",
            "statement",
            "sources",
            "source_value",
            "chapter",
            "figure",
            "measured",
            "measured_value",
            "verdict",
            "checks",
            "profile",
            "seed",
            "model_name",
            "notes",
            "reason",
            "rules",
            "predicted_value",
            "prediction_how",
        }
        for check in row["checks"]["reproduced"] + row["checks"]["qualitatively"]:
            assert set(check) == {"expression", "rule", "value", "low", "high", "passed"}
    assert slope["checks"]["reproduced"] == [
        {
            "expression": "abs(error_slope + 0.5)",
            "rule": "abs(error_slope + 0.5) ≤ 0.1",
            "value": pytest.approx(0.2),
            "low": None,
            "high": 0.1,
            "passed": False,
        }
    ]
    stored["claims"][0]["statement"] = "the length |o| of a completion"
    markdown = markdown_table(stored)
    assert markdown.count("\n") == 3  # header, rule, two rows
    assert [len(re.findall(r"(?<!\\)\|", line)) for line in markdown.splitlines()] == [9] * 4
    assert "*reproduced if* `abs(error_slope + 0.5) ≤ 0.1`" in markdown
    assert "{doc}`07_rank`, figure [effective_rank](../figures/07_rank/effective_rank.png)" in (
        markdown
    )
    assert "| {cite:p}`mishra2026foundations` |" in markdown
    checks = markdown_checks(stored)
    assert "| slope | reproduced | `abs(error_slope + 0.5) ≤ 0.1` | 0.2 | no |" in checks


class _One(float):
    """1.0 that also stands for a table of results: any subscript of it is itself."""

    def __getitem__(self, key):
        return self


def bibtex_keys(path: Path) -> set[str]:
    """The keys of a .bib file, parsed as sphinxcontrib-bibtex parses it (pybtex): a syntax
    error fails here, not in the HTML build."""
    from pybtex.database import parse_file

    entries = parse_file(str(path), bib_format="bibtex").entries
    assert all("title" in entry.fields and "year" in entry.fields for entry in entries.values())
    return set(entries)


def test_the_ledger_file_loads_every_claim_well_formed():
    ids = [claim.id for claim in CLAIMS]
    assert len(ids) >= 24 and len(ids) == len(set(ids))
    assert all(claim_id.isidentifier() for claim_id in ids)
    cited = bibtex_keys(ROOT / "book" / "references.bib")
    assert {"mishra2026foundations", "nie2026starvation"} <= cited
    assert load_tolerances(CLAIMS_FILE) == {"exact": 1e-9}
    for claim in CLAIMS:
        assert claim.sources and set(claim.sources) <= cited, claim.id
        assert claim.statement and claim.notes and claim.reproduced
        assert claim.qualitatively != claim.reproduced
        # "not reproduced" needs an explicit contradiction; an exact identity has no gates
        assert claim.contradicted or claim.pending, claim.id
        assert not (claim.never_inconclusive and (claim.gates or claim.pending)), claim.id
        gates = ("regime", "learned", "comparator", "measured")
        assert all(name in gates for name, _ in claim.gates), claim.id
        ones = {key: _One(1.0) for key in claim.keys}
        checks = [check for tier in TIERS for check in claim.checks(tier)]
        for check in checks:
            assert check.low <= check.high and min(abs(check.low), abs(check.high)) < float("inf")
            evaluate_expression(check.expression, ones)  # the grammar accepts it
            evaluate_expression(claim.measured, ones)


def test_the_toml_forms_of_a_check():
    first = CLAIMS[0]  # P1_policy_gradient, as written in claims.toml
    assert first.id == "P1_policy_gradient" and first.sources == ("mishra2026foundations",)
    assert first.reproduced == (
        Check("bandit_max_abs_error", high=1e-9),  # high = "exact", a named tolerance
        Check("bias_in_standard_errors", high=3.0),
        Check("abs(error_slope + 0.5)", high=0.1),  # near = ..., target = -0.5, within = 0.1
    )
    rank = next(claim for claim in CLAIMS if claim.id == "P4_rank_two_small_models")
    assert rank.requires == {"profile": ["cpu", "gpu"]}
    assert rank.keys == [
        "weighted_entropy_change_tiny_llama",
        "predicted_weighted_entropy_change_tiny_llama",
        "mixed_groups_tiny_llama",
        "weighted_entropy_change_tiny_llama_low",
        "weighted_entropy_change_tiny_llama_high",
    ]
    assert rank.gates[0] == ("regime", Check("mixed_groups_tiny_llama", low=1.0))


def test_every_claim_reads_what_its_chapter_declares():
    assert undeclared_references(CLAIMS, declarations()) == []


def test_every_chapter_declares_its_results():
    for chapter, declared in declarations().items():
        assert declared["values"] and declared["required"], chapter
        assert set(declared["required"]) <= set(declared["values"]), chapter
        for kind in ("values", "figures", "required"):
            assert len(set(declared[kind])) == len(declared[kind]), f"{chapter}: repeated {kind}"


LITERAL_RECORD = re.compile(r'report\.record\(\s*"([^"{}]+)"')
# The name is the last argument, with the trailing comma ruff format adds to a call it splits.
LITERAL_FIGURE = re.compile(
    r'report\.figure\((?:[^()]|\([^()]*(?:\([^()]*\))*[^()]*\))*?,\s*"([^"]+)",?\s*\)'
)


@pytest.mark.parametrize("chapter", Project(ROOT).chapters)
def test_every_literal_key_and_figure_of_a_chapter_is_declared(chapter):
    source = (ROOT / "book" / f"{chapter}.md").read_text()
    declared = declarations()[chapter]
    keys, figures = LITERAL_RECORD.findall(source), LITERAL_FIGURE.findall(source)
    assert keys, chapter
    assert [key for key in keys if not is_declared(key, declared["values"])] == []
    assert [name for name in figures if not is_declared(name, declared["figures"])] == []


def test_a_renamed_key_or_figure_fails_without_running_a_chapter(tmp_path):
    text = CLAIMS_FILE.read_text()
    renamed = tmp_path / "claims.toml"
    renamed.write_text(text.replace('"error_slope"', '"error_exponent"', 1))
    problems = undeclared_references(load_claims(renamed), declarations())
    assert problems == [
        "claim P1_policy_gradient: chapter 01_policy_gradient declares no key 'error_exponent'"
    ]
    renamed.write_text(text.replace('figure = "error_vs_samples"', 'figure = "error_plot"', 1))
    assert undeclared_references(load_claims(renamed), declarations()) == [
        "claim P1_policy_gradient: chapter 01_policy_gradient declares no figure 'error_plot'"
    ]
    # a key renamed where the chapter records it: the declaration follows the code
    page = tmp_path / "02_group_baseline.md"
    source = (ROOT / "book" / "02_group_baseline.md").read_text()
    assert source.count('report.record("max_error_rloo"') == 1
    page.write_text(source.replace('report.record("max_error_rloo"', 'report.record("rloo_error"'))
    renamed_chapter = {**declarations(), "02_group_baseline": declare(page)}
    assert undeclared_references(CLAIMS, renamed_chapter) == [
        "claim R_rloo_unbiased: chapter 02_group_baseline declares no key 'max_error_rloo'"
    ]


def test_a_bad_claim_in_the_file_names_the_claim(tmp_path):
    bad = tmp_path / "claims.toml"
    bad.write_text(CLAIMS_FILE.read_text().replace('measured = "error_slope"', 'measure = "x"', 1))
    with pytest.raises(ClaimError, match="claim P1_policy_gradient: .*measure"):
        load_claims(bad)


def test_declare_reads_literals_loops_and_the_dicts_functions_return(tmp_path):
    page = tmp_path / "99_page.md"
    page.write_text(
        (ROOT / "book" / "01_policy_gradient.md").read_text().split("\n# ")[0]
        + "\n# Page\n\n```{code-cell} ipython3\n"
        "from grpo_companion.chapters.sparsity.remedies import tuning_records\n"
        "from grpo_companion.chapters.sparsity.easy_start import easy_summary\n"
        'report.record("plain", 1)\n'
        'for name in ("a", "b"):\n    report.record(f"loop_{name}", 2)\n'
        'for key, value in {"x_one": 1, **{f"extra_{m}": 2 for m in methods}}.items():\n'
        "    report.record(key, value)\n"
        "if extra:\n    report.record('optional_key', 3)\n"
        "records = tuning_records(choice)\nrecords['added_key'] = 4\n"
        "report.record_all(records)\n"
        'report.record_all(easy_summary(table, "easy"), prefix="p_")\n'
        'report.figure(figure, "plot")\n```\n'
    )
    declared = declare(page)
    assert {"plain", "loop_a", "loop_b", "x_one", "extra_*", "optional_key", "added_key"} <= set(
        declared["values"]
    )
    # a function's returned keys, with the literal argument it was called with
    assert {"*_learning_rate", "*_lr_inside", "remedy_lr_inside"} <= set(declared["values"])
    assert "p_easy_pass_rate_first" in declared["values"]
    assert declared["figures"] == ["plot"]
    assert declared["required"] == ["loop_a", "loop_b", "plain"]
    page.write_text(page.read_text().replace('report.record("plain", 1)', "report.record(k, 1)"))
    with pytest.raises(DeclarationError, match="line .*cannot tell which key `k`"):
        declare(page)


def test_declared_names_plain_and_glob():
    declaration = {"values": ["a", "rank_*"], "figures": ["plot"], "required": ["a"]}
    recorded = {"values": {"a": 1, "rank_x": 2, "rank_y": 3}, "figures": ["plot"]}
    assert mismatches(declaration, recorded) == []
    # a glob declares a family of any size; a required name must be recorded
    assert mismatches(declaration, {"values": {"a": 1}, "figures": ["plot"]}) == []
    assert mismatches(declaration, {"values": {"b": 1, "rank_x": 0}, "figures": ["plot", "x"]}) == [
        "undeclared key 'b'",
        "undeclared figure 'x'",
        "declared key 'a' not recorded",
    ]


EXERCISE = re.compile(r"^\d+\. ", re.MULTILINE)
SOLUTION = re.compile(r"`{3,}\{admonition\} Solution\n\s*:class: dropdown\n")


@pytest.mark.parametrize("chapter", Project(ROOT).chapters)
def test_every_chapter_ends_with_two_or_three_exercises(chapter):
    text = (ROOT / "book" / f"{chapter}.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    assert sections[-1].startswith("Exercises\n"), f"{chapter}: the last section is not Exercises"
    exercises = EXERCISE.split(sections[-1])[1:]
    assert 2 <= len(exercises) <= 3, f"{chapter}: {len(exercises)} exercises"
    assert all(SOLUTION.search(exercise) for exercise in exercises), (
        f"{chapter}: every exercise needs a dropdown solution"
    )
    assert any("python -m grpo_companion run" in exercise for exercise in exercises), (
        f"{chapter}: no exercise changes a papermill parameter"
    )


def test_an_undefined_ratio_passes_no_check_and_is_recorded_as_none():
    claim = replace(
        RANK_CLAIM,
        measured="spread / noise",
        requires={},
        reproduced=(Check("spread / noise", low=3.0),),
        qualitatively=(),
    )
    judged = judge(claim, results({"spread": 0.0, "noise": 0.0, "effective_ranks": [1.0]}, "cpu"))
    assert judged["verdict"] == INCONCLUSIVE  # 0/0 is no evidence, for or against
    assert judged["measured_value"] is None and judged["checks"]["reproduced"][0]["value"] is None


# --- every rule can fail for the right reason ---------------------------------------------------


def example_results(claim: Claim, values: dict) -> dict:
    """A chapter's results holding `values`, in the setup the claim requires (its first one)."""
    first = {
        key: wanted[0] if isinstance(wanted, list) else wanted
        for key, wanted in claim.requires.items()
    }
    values = {**{key: value for key, value in first.items() if key != "profile"}, **values}
    return results(values, first.get("profile", "cpu"), claim.chapter, [claim.figure])


# The claims judged on training runs: each must gate on the regime and on the reference arm
# having learned, so that neither a run outside the claim's regime nor one that did not move the
# model reads as a contradiction.
TRAINED = {
    "P6_credit_bottleneck",
    "P3_sparsity_grows",
    "R_sign_beats_dr_grpo",
    "P3_sparsity_grows_gsm8k",
    "P6_credit_micro",
    "P3_sparsity_grows_micro",
    "R_sign_beats_dr_grpo_micro",
    "R_lora_rank_two_matches_full_micro",
    "R_sign_tuned_tabular",
    "P6_credit_toy",
    "R_lora_rank_two_matches_full",
}


def test_every_claim_carries_the_examples_its_kind_needs():
    for claim in CLAIMS:
        gates = {name for name, _ in claim.gates}
        if claim.pending:
            wanted = {"underpowered"}
        elif claim.never_inconclusive:
            wanted = {"supporting", "contradicting"}
        else:
            wanted = {"supporting", "contradicting", "underpowered"}
            wanted |= {name for name, gate in GATE_EXAMPLES.items() if gate in gates}
        if claim.id in TRAINED:
            assert {"regime", "learned"} <= gates, claim.id
        assert set(claim.examples) == wanted, claim.id
        for name, values in claim.examples.items():
            missing = [key for key in claim.keys if key not in values and key not in claim.requires]
            assert missing == [], f"{claim.id}: example {name} lacks {missing}"


def _not_measured(values: dict) -> dict:
    """An example's values with TOML's `nan` ("not measured") as a chapter records it: None."""
    return {key: None if value != value else value for key, value in values.items()}


@pytest.mark.parametrize("claim", CLAIMS, ids=[claim.id for claim in CLAIMS])
def test_each_rule_gives_each_example_its_verdict(claim):
    judged = {
        name: judge(claim, example_results(claim, _not_measured(values)))
        for name, values in claim.examples.items()
    }
    verdicts = {name: row["verdict"] for name, row in judged.items()}
    if claim.pending:  # no experiment can decide it yet: inconclusive, with the reason
        assert verdicts == {"underpowered": INCONCLUSIVE}
        assert judged["underpowered"]["reason"] == claim.pending
        return
    assert verdicts == {name: EXAMPLES[name] for name in claim.examples}
    # each gate example is stopped by its own gate; the underpowered one by no gate at all
    for name, gate in GATE_EXAMPLES.items():
        if name in judged:
            assert judged[name]["reason"].startswith(f"gate {gate}:"), (name, judged[name])
    if "underpowered" in judged:
        assert judged["underpowered"]["reason"] == "neither reproduced nor contradicted"
    assert judged["contradicting"]["reason"].startswith("contradicted: ")


@pytest.mark.parametrize(
    "claim_id, tuned, learned",
    [("R_sign_beats_dr_grpo", "dr_grpo_tune_learned", {"dr_grpo_accuracy_gain_low": -0.01}),
     ("P6_credit_bottleneck", "credit_outcome_tune_learned", {"credit_outcome_learned_count": 1}),
     ("R_lora_rank_two_matches_full", "lora_full_tune_learned", {"lora_full_gain_low": -0.01})],
)  # fmt: skip
def test_both_learned_gates_of_a_tuned_rule_can_stop_it(claim_id, tuned, learned):
    """The no-learning example stops at the tuning's gate; a tuning that learned whose comparison
    runs did not stops at the comparison's own learned gate, further down."""
    claim = next(claim for claim in CLAIMS if claim.id == claim_id)
    supporting = _not_measured(claim.examples["supporting"])
    for values in ({**supporting, tuned: 0}, {**supporting, **learned}):
        row = judge(claim, example_results(claim, values))
        assert row["verdict"] == INCONCLUSIVE and row["reason"].startswith("gate learned:"), row
    row = judge(claim, example_results(claim, {**supporting, tuned: None}))
    assert row["verdict"] == INCONCLUSIVE and row["reason"].startswith("gate learned:"), row


@pytest.mark.parametrize("claim", CLAIMS, ids=[claim.id for claim in CLAIMS])
def test_missing_evidence_is_never_a_contradiction(claim):
    """Every value the rule reads, not measured: no claim may read that as "not reproduced"."""
    if claim.pending:
        return
    values = {key: None for key in claim.keys if key not in claim.requires}
    verdict = judge(claim, example_results(claim, values))["verdict"]
    assert verdict == INCONCLUSIVE


def test_a_gate_comes_before_a_vacuous_pass_and_names_itself():
    claim = replace(
        RANK_CLAIM,
        requires={},
        gates=(("regime", Check("groups", low=1)),),
        reproduced=(Check("max(effective_ranks)", high=2.5),),
        contradicted=(Check("max(effective_ranks)", high=2.5, outside=True),),
        qualitatively=(),
    )
    empty = judge(claim, results({"effective_ranks": [0.0], "groups": 0}, "cpu"))
    assert empty["verdict"] == INCONCLUSIVE
    assert empty["reason"] == "gate regime: groups ≥ 1 failed"
    assert empty["checks"]["gates"][0]["gate"] == "regime"
    measured = judge(claim, results({"effective_ranks": [2.1], "groups": 5}, "cpu"))
    assert measured["verdict"] == REPRODUCED and measured["reason"] == ""
    wrong = judge(claim, results({"effective_ranks": [6.0], "groups": 5}, "cpu"))
    assert wrong["verdict"] == NOT_REPRODUCED
    assert wrong["reason"] == "contradicted: max(effective_ranks) > 2.5"
    # neither supported nor contradicted (nothing measured): inconclusive, not a contradiction
    unknown = judge(claim, results({"effective_ranks": [None], "groups": 5}, "cpu"))
    assert unknown["verdict"] == INCONCLUSIVE
    assert unknown["reason"] == "neither reproduced nor contradicted"


def test_a_rule_that_both_reproduces_and_contradicts_is_refused():
    claim = replace(
        RANK_CLAIM,
        requires={},
        reproduced=(Check("x", high=2.0),),
        contradicted=(Check("x", low=1.0),),
    )
    with pytest.raises(ClaimError, match="both reproduces and contradicts"):
        judge(claim, results({"x": 1.5}, "cpu"))


def test_outside_reads_as_the_negation_of_a_measured_check():
    assert str(Check("x", high=2.0, outside=True)) == "x > 2"
    assert str(Check("x", low=1.0, outside=True)) == "x < 1"
    assert str(Check("x", 1.0, 2.0, outside=True)) == "x outside [1, 2]"
    for value, holds in [(0.5, True), (1.5, False), (2.5, True), (None, False)]:
        assert Check("x", 1.0, 2.0, outside=True).judge({"x": value})["passed"] is holds


@pytest.mark.parametrize(
    ("low", "high", "predicted", "reading"),
    [
        (0.01, 0.2, 0.05, 1),  # above 0: supports the predicted rise
        (-0.02, 0.03, 0.05, -1),  # holds 0, excludes the predicted 0.05: contradicts
        (-0.2, 0.2, 0.05, 0),  # holds both: neither
        (-0.3, -0.1, 0.05, -1),  # the other side of 0
        (-0.2, -0.01, -0.05, 1),  # a predicted fall, seen
        (None, None, 0.05, 0),  # one seed: no interval
    ],
)
def test_the_ledger_and_the_chapters_read_an_interval_with_one_function(
    low, high, predicted, reading
):
    assert interval_reading(low, high, predicted) == reading
    values = {"low": low, "high": high, "predicted": predicted}
    assert evaluate_expression("reading(low, high, predicted)", values) == reading
    words = interval_words(low, high, predicted, supports="rises", contradicts="does not rise")
    expected = {1: "rises", -1: "does not rise"}.get(reading)
    assert words == (expected or "can neither support nor contradict the predicted effect")


def test_known_and_missing_values_in_expressions():
    values = {"ranks": {"a": {"high": 1.5}}, "none": None}
    assert evaluate_expression('known(ranks["a"]["high"])', values) == 1.0
    assert evaluate_expression('known(ranks["b"]["high"])', values) == 0.0
    assert evaluate_expression("known(none)", values) == 0.0
    # a missing subscript outside known() is "not measured": the check fails, the value is None
    judged = Check('ranks["b"]["high"]', high=0.5).judge(values)
    assert judged["passed"] is False and judged["value"] is None
    # min and max propagate NaN whatever the order (Python's min(1, nan) is 1)
    for expression in ("min(1, none)", "min(none, 1)", "max(2, none)"):
        assert evaluate_expression(expression, values) != evaluate_expression(expression, values)


def test_every_claim_has_a_key_equation_for_the_summary_page():
    from grpo_companion.machinery.claims import markdown_summary

    assert all(claim.equation and "$" not in claim.equation for claim in CLAIMS)
    # A `|` would end a table cell, and escaping it inside math turns it into a norm sign.
    assert not [claim.id for claim in CLAIMS if "|" in claim.equation]
    row = {
        "id": "X",
        "chapter": "05_credit",
        "equation": r"a^2",
        "measured": "k",
        "measured_value": 0.5,
        "prediction": "predicted_k",
        "predicted_value": 0.25,
        "verdict": INCONCLUSIVE,
        "reason": "gate regime: p ≥ 0.5 failed",
    }
    lines = markdown_summary({"claims": [row, {**row, "prediction": ""}]}).splitlines()
    # the verdict beside the claim's name, short enough to see without scrolling
    badge = "{bdg-warning}`inconclusive: regime`"
    assert lines[2] == f"| **X**, {{doc}}`5 <05_credit>` | {badge} | 0.25 → 0.5 |"
    assert lines[3] == f"| **X**, {{doc}}`5 <05_credit>` | {badge} | — → 0.5 |"
