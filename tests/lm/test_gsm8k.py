"""Tests for grpo_companion.lm.gsm8k: lm-eval answer extraction, reward, and every data source."""

import operator
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_companion.lm import gsm8k
from grpo_companion.lm.gsm8k import (
    GSM8KUnavailableError,
    extract_answer,
    gold_answer,
    load_arithmetic_chains,
    load_gsm8k,
    reward,
)

DATA = Path(__file__).resolve().parents[1] / "data"
REPO = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)")


def lm_eval_extract(text, mode):
    """lm-evaluation-harness, literally: RegexFilter (findall, group_select, tuple handling,
    strip, fallback "[invalid]") then exact_match's regexes_to_ignore from gsm8k.yaml."""
    if mode == "strict":
        pattern, group_select = r"#### (\-?[0-9\.\,]+)", 0
    else:
        pattern, group_select = r"(-?[$0-9.,]{2,})|(-?[0-9]+)", -1
    match = re.findall(pattern, text)
    if not match:
        return "[invalid]"
    match = match[group_select]
    if isinstance(match, tuple):
        match = [m for m in match if m]
        match = match[0] if match else "[invalid]"
    match = match.strip()
    for ignore in [",", "\\$", "(?s).*#### ", "\\.$"]:
        match = re.sub(ignore, "", match)
    return match


def expected_from_lm_eval(text, mode):
    """Our contract: lm-eval's normalised string when it is a number, else None."""
    ref = lm_eval_extract(text, mode)
    return ref if NUMBER.fullmatch(ref) else None


# (text, mode, expected extract_answer). Each case is also checked against lm_eval_extract.
GOLDEN = [
    ("#### 1,234", "strict", "1234"),
    ("The answer is $18.", "flexible", "18"),
    ("The answer is $18.", "strict", None),  # strict needs "#### "
    ("#### -3", "strict", "-3"),
    ("The cost is 3.50", "flexible", "3.50"),
    ("no numbers here", "flexible", None),
    ("no numbers here", "strict", None),
    ("So 5 apples.\n#### 7\n#### 9", "strict", "7"),  # findall()[0]: the first ####
    ("#### 7 and then 9", "flexible", "9"),  # group_select -1: the last number
    ("#### $1,000.", "strict", None),  # "$" is not in the strict character class
    ("#### 1,000.", "strict", "1000"),  # commas and one trailing period removed
    ("Total: 72.", "flexible", "72"),
    ("He had 5 apples and ate 2...", "flexible", None),  # lm-eval compares "2.." (wrong)
    ("It costs -5 dollars", "flexible", "-5"),
    ("3-2=1", "flexible", "1"),
    ("12-7", "flexible", "-7"),  # lm-eval reads the subtraction as a negative number
    ("#### 5.", "strict", "5"),
    ("####5", "strict", None),  # lm-eval requires the space
    ("The answer:\n#### 5", "strict", "5"),
    ("Answer: 1.5.", "flexible", "1.5"),
    ("#### 1.2.3", "strict", None),
    ("The answer is 7,", "flexible", "7"),
    ("Step 1: 2 + 2 = 4", "flexible", "4"),
    ("#### -", "strict", None),
    ("#### ٣", "strict", None),  # Arabic-Indic digits are not [0-9]
    ("٣ apples", "flexible", None),
    ("#### ３", "strict", None),  # fullwidth digit
    ("#### 1٣", "strict", "1"),
    ("$$", "flexible", None),
    ("# 5", "strict", None),
    ("# 5", "flexible", "5"),
    ("#### 0.5", "strict", "0.5"),
    ("about .5 of it", "flexible", ".5"),
    ("#### 007", "strict", "007"),
    ("--5", "flexible", "-5"),
    ("", "strict", None),
    ("", "flexible", None),
]


@pytest.mark.parametrize("text, mode, expected", GOLDEN)
def test_golden_extraction(text, mode, expected):
    assert extract_answer(text, mode) == expected
    assert expected_from_lm_eval(text, mode) == expected


# Text built from the characters that matter to the two regexes.
tricky_text = st.lists(
    st.sampled_from(["#### ", "#", " ", "-", "$", ".", ",", "1", "23", "0", "x", "٣", "\n"]),
    max_size=40,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.one_of(tricky_text, st.text(max_size=80)), st.sampled_from(gsm8k.MODES))
def test_extraction_matches_lm_eval(text, mode):
    assert extract_answer(text, mode) == expected_from_lm_eval(text, mode)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(tricky_text, st.text()), st.integers(-(10**6), 10**6), st.sampled_from(gsm8k.MODES)
)
def test_reward_never_raises_and_agrees_with_lm_eval(text, gold, mode):
    r = reward(text, str(gold), mode)
    assert r in (0.0, 1.0)
    if lm_eval_extract(text, mode) == str(gold):  # lm-eval's exact match => our numeric match
        assert r == 1.0
    out = extract_answer(text, mode)
    assert out is None or NUMBER.fullmatch(out)


@pytest.mark.parametrize(
    "completion, gold, mode, expected",
    [
        ("#### 5", "5", "strict", 1.0),
        ("#### 5.0", "5", "strict", 1.0),  # lm-eval's string match would say 0
        ("#### 5.00", "5.0", "strict", 1.0),
        ("#### 3.50", "3.5", "strict", 1.0),
        ("#### 1,234", "1234", "strict", 1.0),
        ("#### 1234", "1,234", "strict", 1.0),
        ("#### 007", "7", "strict", 1.0),
        ("#### -0", "0", "strict", 1.0),
        ("#### .5", "0.5", "strict", 1.0),
        ("#### 6", "5", "strict", 0.0),
        ("#### -5", "5", "strict", 0.0),
        ("#### 50", "5", "strict", 0.0),
        ("#### 5.01", "5", "strict", 0.0),
        ("The answer is 5", "5", "strict", 0.0),
        ("The answer is 5", "5", "flexible", 1.0),
        ("#### 5 but really 6", "5", "flexible", 0.0),
        ("", "5", "strict", 0.0),
    ],
)
def test_reward(completion, gold, mode, expected):
    assert reward(completion, gold, mode) == expected


def test_huge_numbers_are_compared_exactly():
    # Numbers of any length stay strings: exact, linear time, no int()/float() limits.
    big = "1" + "0" * 5000
    assert extract_answer(f"#### {big}") == big
    assert reward(f"#### {big}.000", big) == 1.0
    assert reward(f"#### {big}1", big) == 0.0
    assert reward(f"#### {big}", "1" + "0" * 4999) == 0.0
    assert reward(f"The answer is {big}.", big, "flexible") == 1.0
    with pytest.raises(ValueError):
        reward("#### 5", "inf")  # the gold must be a plain number


def test_gold_answer():
    assert gold_answer("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert gold_answer("#### 1,000") == "1000"
    assert gold_answer("a\n#### 1\n#### 2") == "2"  # lm-eval's greedy "(?s).*#### "
    assert gold_answer("#### -3.5\n") == "-3.5"
    for bad in ["no marker 5", "#### ", "#### abc", "####5"]:
        with pytest.raises(ValueError, match="####"):
            gold_answer(bad)
    with pytest.raises(ValueError, match="gold"):
        reward("#### 5", "#### 5")


def test_bad_mode_and_type():
    with pytest.raises(ValueError, match="strict"):
        extract_answer("#### 5", "loose")
    with pytest.raises(TypeError):
        extract_answer(None)


# Smoke bound, not a benchmark: each call is linear and takes milliseconds; 2 s leaves room
# for a loaded 2-core machine.
_rng = random.Random(0)
JUNK = {
    "1, x1e6": "1," * 10**6,
    "#### x1e5": "#### " * 10**5,
    "#### x1e6": "#### " * 10**6,
    "-. x1e6": "-." * 10**6,
    "1- x1e6": "1-" * 10**6,
    "1 space x1e6": "1 " * 10**6,
    "$. x1e6": "$." * 10**6,
    "#### then 1,": "#### " + "1," * 10**6,
    "digits 1e6": "9" * 10**6,
    "#### digits 1e6": "#### " + "9" * 10**6 + ".",
    "random latin-1": _rng.randbytes(2 * 10**6).decode("latin-1"),
    "random surrogateescape": _rng.randbytes(10**6).decode("utf-8", "surrogateescape"),
}


@pytest.mark.parametrize("name", list(JUNK))
def test_adversarial_junk_is_fast(name):
    text = JUNK[name]
    for mode in gsm8k.MODES:
        start = time.perf_counter()
        extract_answer(text, mode)
        reward(text, "5", mode)
        assert time.perf_counter() - start < 2.0, (name, mode)


# ---------------------------------------------------------------- generated sources

FEATURES = datasets.Features(
    {"question": datasets.Value("string"), "answer": datasets.Value("string")}
)


@pytest.mark.parametrize("source, n", [("arithmetic", 300), ("gsm_symbolic", 100)])
def test_generated_sources(source, n):
    train = load_gsm8k("train", source, num_examples=n, seed=1)
    test = load_gsm8k("test", source, num_examples=n, seed=1)
    assert train.features == FEATURES and len(train) == len(test) == n
    assert load_gsm8k("train", source, num_examples=n, seed=1)[:] == train[:]  # deterministic
    other_seed = load_gsm8k("train", source, num_examples=n, seed=2)
    assert len(set(other_seed["question"]) & set(train["question"])) < n // 10
    assert not set(train["question"]) & set(test["question"])  # splits are disjoint
    assert len(set(train["question"])) == n  # no duplicates within a split
    for row in train:
        assert row["answer"].splitlines()[-1].startswith("#### ")
        assert reward(row["answer"], gold_answer(row["answer"])) == 1.0
    # skip=k continues the stream where num_examples=k stops: a validation set from the train split
    validation = load_gsm8k("train", source, num_examples=n // 2, skip=n // 2, seed=1)
    assert validation[:] == train.select(range(n // 2, n))[:]


def test_arithmetic_splits_disjoint_at_full_size():
    train, test = load_gsm8k("train", "arithmetic"), load_gsm8k("test", "arithmetic")
    assert (len(train), len(test)) == (7473, 1319)
    assert not set(train["question"]) & set(test["question"])


def test_arithmetic_worked_answers():
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
    dataset = load_gsm8k("test", "arithmetic", num_examples=500, seed=3)
    shapes = set()
    for row in dataset:
        *steps, final = row["answer"].split("\n")
        assert 2 <= len(steps) <= 3
        previous = None
        for step in steps:
            x, op, y, result = re.fullmatch(r"(\d+)([-+*/])(\d+)=(\d+)", step).groups()
            assert ops[op](int(x), int(y)) == int(result)
            assert op != "/" or int(x) % int(y) == 0
            assert previous in (None, x)  # each step continues from the last result
            previous = result
        assert final == f"#### {previous}"
        shapes.add("".join(re.findall(r"[-+*/]", row["answer"])))
        numbers = re.findall(r"\d+", row["question"] + row["answer"])
        assert all(len(number) <= 2 for number in numbers)
    assert len(shapes) >= 4  # a handful of templates shows up


def test_gsm_symbolic_conversion():
    import reasoning_gym

    for row in load_gsm8k("test", "gsm_symbolic", num_examples=50, seed=0):
        assert "Give the result as your final answer" not in row["question"]
    item = reasoning_gym.create_dataset("gsm_symbolic", seed=0, size=1)[0]
    assert item["metadata"]["answer_cot"].rstrip().splitlines()[-1].startswith("#### ")


# ---------------------------------------------------------------- JSONL


def test_jsonl_sample(tmp_path):
    dataset = load_gsm8k("test", "jsonl", path=DATA / "gsm8k_sample.jsonl")
    assert dataset.features == FEATURES and len(dataset) == 4  # the blank line is skipped
    assert [gold_answer(a) for a in dataset["answer"]] == ["36", "120", "1200", "25"]
    first_two = load_gsm8k("test", "jsonl", path=DATA / "gsm8k_sample.jsonl", num_examples=2)
    assert first_two[:] == dataset[:2]
    last_two = load_gsm8k("test", "jsonl", path=DATA / "gsm8k_sample.jsonl", skip=2)
    assert last_two[:] == dataset.select(range(2, 4))[:]
    (tmp_path / "train.jsonl").write_bytes((DATA / "gsm8k_sample.jsonl").read_bytes())
    assert len(load_gsm8k("train", "jsonl", path=tmp_path)) == 4  # a folder: {split}.jsonl


@pytest.mark.parametrize(
    "name, message",
    [
        ("gsm8k_malformed.jsonl", r"gsm8k_malformed\.jsonl, line 3: not a JSON line"),
        ("gsm8k_missing_field.jsonl", r"gsm8k_missing_field\.jsonl, line 2: .*'answer'"),
        ("gsm8k_empty.jsonl", r"gsm8k_empty\.jsonl: no examples"),
    ],
)
def test_jsonl_errors(name, message):
    with pytest.raises(ValueError, match=message):
        load_gsm8k("test", "jsonl", path=DATA / name)


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"question": "q", "answer": "#### 1"}\n[1, 2]\n', "line 2: expected an object"),
        (b'{"question": "q", "answer": "no marker"}\n', "line 1: answer does not end"),
        (b'{"question": "q", "answer": "#### 1"}\n\xff\xfe\n', "line 2: not a JSON line"),
        (b'{"question": 3, "answer": "#### 1"}\n', "line 1: .*'question'"),
        (b"\n\n", "no examples"),
    ],
)
def test_jsonl_bad_content(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_gsm8k("train", "jsonl", path=path)


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("train", "gsm9k"), {}, "hub, jsonl, gsm_symbolic, arithmetic"),
        (("validation", "arithmetic"), {}, "split"),
        (("train", "arithmetic"), {"num_examples": 0}, "num_examples"),
        (("train", "arithmetic"), {"num_examples": -3}, "num_examples"),
        (("train", "arithmetic"), {"num_examples": 2.5}, "num_examples"),
        (("train", "arithmetic"), {"num_examples": True}, "num_examples"),
        (("train", "jsonl"), {}, "path"),
        (("train", "arithmetic"), {"path": "x.jsonl"}, "path"),
        (
            ("test", "jsonl"),
            {"path": DATA / "gsm8k_sample.jsonl", "num_examples": 5},
            "the 4 examples",
        ),
        (("test", "jsonl"), {"path": DATA / "gsm8k_sample.jsonl", "skip": 4}, "skip=4"),
        (
            ("test", "jsonl"),
            {"path": DATA / "gsm8k_sample.jsonl", "skip": 3, "num_examples": 2},
            "skip=3",
        ),
        (("train", "arithmetic"), {"skip": -1}, "skip"),
        (("train", "arithmetic"), {"skip": 1.0}, "skip"),
    ],
)
def test_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_gsm8k(*args, **kwargs)


# ---------------------------------------------------------------- the Hub

_SCRIPT = """
import time
from grpo_companion.lm.gsm8k import GSM8KUnavailableError, load_gsm8k
start = time.perf_counter()
try:
    load_gsm8k("test")
except GSM8KUnavailableError as err:
    assert err.__cause__ is not None
    print(f"{time.perf_counter() - start:.3f}")
    print(err)
"""


def test_hub_unavailable_fails_fast_with_one_clear_error(tmp_path):
    # Offline mode, and a Hub endpoint that refuses connections; an empty cache for both. The
    # two interpreters run side by side: importing datasets/torch dominates their time.
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "TRANSFORMERS_")) and "proxy" not in k.lower()
    }
    clean.update(HF_HOME=str(tmp_path), HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    envs = [{**clean, "HF_HUB_OFFLINE": "1"}, {**clean, "HF_ENDPOINT": "http://127.0.0.1:9"}]
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for env in envs
    ]
    for run in runs:
        stdout, stderr = run.communicate(timeout=60)
        assert run.returncode == 0, stderr
        seconds, message = stdout.split("\n", 1)
        assert float(seconds) < 5.0  # datasets' own retries would take about 25 s
        for hint in ("source='jsonl'", "source='gsm_symbolic'", "source='arithmetic'"):
            assert hint in message
        assert "Traceback" not in stderr


def test_hub_real_gsm8k():
    try:
        test = load_gsm8k("test", hub_timeout=3.0)
    except GSM8KUnavailableError as err:
        pytest.skip(f"Hugging Face Hub unreachable here: {err.__cause__!r}")
    train = load_gsm8k("train")
    assert (len(train), len(test)) == (7473, 1319)
    assert test.features == FEATURES
    assert all(reward(a, gold_answer(a)) == 1.0 for a in test["answer"])


# ---------------------------------------------------------------- chain problems


@pytest.mark.parametrize("num_steps", [1, 2, 3, 4])
def test_arithmetic_chains_have_one_worked_line_per_step(num_steps):
    ops = {"+": operator.add, "-": operator.sub}
    train = load_arithmetic_chains("train", num_steps, 200, seed=1)
    test = load_arithmetic_chains("test", num_steps, 50, seed=1)
    assert train.features == FEATURES and (len(train), len(test)) == (200, 50)
    assert load_arithmetic_chains("train", num_steps, 200, seed=1)[:] == train[:]
    assert not set(train["question"]) & set(test["question"])  # splits are disjoint
    assert len(set(train["question"])) == 200
    for row in train:
        *steps, final = row["answer"].split("\n")
        assert len(steps) == num_steps
        start = re.match(r"[A-Z][a-z]+ has (\d+) ", row["question"]).group(1)
        previous = start
        for j, step in enumerate(steps):
            x, op, y, result = re.fullmatch(r"(\d+)([-+])(\d+)=(\d+)", step).groups()
            assert x == previous and ops[op](int(x), int(y)) == int(result)
            assert op == "+-"[j % 2]  # in turn, as the warm start's "+b-c+d"
            previous = result
        assert final == f"#### {previous}"
        numbers = [int(n) for n in re.findall(r"\d+", row["question"] + row["answer"])]
        assert all(0 <= n <= 99 for n in numbers)
        assert row["question"].endswith(" have now?")
        assert reward(row["answer"], gold_answer(row["answer"])) == 1.0


def test_arithmetic_chains_speak_the_warm_starts_words():
    """Every word of a chain question is a word of the "arithmetic" source's questions, on which
    the tiny Llama's word-level vocabulary was built."""
    known = {
        word
        for question in load_gsm8k("train", "arithmetic", num_examples=2000, seed=0)["question"]
        for word in re.findall(r"[A-Za-z]+", question)
    }
    for num_steps in (1, 2, 3, 4):
        for question in load_arithmetic_chains("train", num_steps, 100, seed=0)["question"]:
            assert set(re.findall(r"[A-Za-z]+", question)) <= known, question
    # 2 and 3 steps are the warm start's own "+b-c" and "+b-c+d" stories.
    question = load_arithmetic_chains("test", 2, 1, seed=0)["question"][0]
    assert re.fullmatch(
        r"\w+ has \d+ \w+\. \w+ buys \d+ more and gives \d+ away\. How .*", question
    )
    question = load_arithmetic_chains("test", 3, 1, seed=0)["question"][0]
    assert re.fullmatch(
        r"\w+ has \d+ \w+\. \w+ gets \d+ more, loses \d+, and then buys \d+ more\. How .*", question
    )


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_arithmetic_chains_need_at_least_one_step(bad):
    with pytest.raises(ValueError, match="num_steps must be an int >= 1"):
        load_arithmetic_chains("train", bad, 10)
