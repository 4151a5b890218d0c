r"""GSM8K data, answer extraction and the binary reward.

Every source gives a ``datasets.Dataset`` with GSM8K's schema: ``question`` and ``answer``
strings, the answer being reasoning lines followed by a final line ``#### N``.

Answers follow lm-evaluation-harness (``lm_eval/tasks/gsm8k/gsm8k.yaml``):
    strict    regex ``#### (\-?[0-9\.\,]+)``, first match (``findall(...)[0]``)
    flexible  regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, last match (``group_select: -1``)
Both are normalised like lm-eval's ``regexes_to_ignore``: every "," and "$" removed, then one
trailing "."; the gold answer is what follows the *last* "#### " (lm-eval's ``(?s).*#### ``).
Two deliberate differences: (1) equality is numeric, so "5", "5.0" and "005" are equal where
lm-eval's string match says no; (2) ``extract_answer`` returns None when the normalised match
is not a number ("..", "1.2.3"), which lm-eval would compare as a string and mark wrong anyway.
Digits are ASCII only, as in lm-eval's ``[0-9]``: "٣" is not a number. Numbers of any length
are compared exactly, as strings. Model output is untrusted: nothing is evaluated, every
function of it runs in linear time and never raises on a string.
"""

import hashlib
import json
import operator
import random
import re
import socket
import urllib.parse
import urllib.request
from pathlib import Path

import datasets

SOURCES = ("hub", "jsonl", "gsm_symbolic", "arithmetic")
SPLITS = ("train", "test")
MODES = ("strict", "flexible")
GSM8K_SIZES = {"train": 7473, "test": 1319}  # openai/gsm8k, config "main"
TEST_FRACTION = 0.15  # share of generated questions reserved for "test" (GSM8K: 1319/8792)

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval's strict-match pattern, verbatim
# lm-eval's flexible pattern matches, in effect, whole runs of [$0-9.,] of length >= 2 or a
# single digit, with a "-" just before the run included. Searching the *reversed* text for
# such a run finds the last match in one linear C-level scan, without building a list of all
# matches. tests/lm/test_gsm8k.py checks this against lm-eval's findall()[-1] with hypothesis.
# Written as "a run character, then more of them or a lookbehind that it was a digit" (rather
# than "[$0-9.,]{2,}|[0-9]") so that re skips non-candidates fast: ~5x on megabytes of prose.
_FLEXIBLE_REVERSED = re.compile(r"[$0-9.,](?:[$0-9.,]+|(?<=[0-9]))")
_NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]+)?|\.[0-9]+)")
_SYMBOLIC_SUFFIX = " Give the result as your final answer. Do not include units."


class GSM8KUnavailableError(RuntimeError):
    """The real GSM8K cannot be loaded (no network, no cache); the message names alternatives."""


def _normalise(match: str) -> str | None:
    """lm-eval's ``regexes_to_ignore`` on an extracted match; None if it is not a number."""
    s = match.strip().replace(",", "").replace("$", "")
    s = s.removesuffix(".")  # one trailing period, lm-eval's "\.$"
    return s if _NUMBER.fullmatch(s) else None


def _canonical(number: str) -> str:
    """Exact canonical form of a ``_NUMBER`` string: "-007.50" -> "-7.5", "-0.0" -> "0"."""
    sign, digits = ("-", number[1:]) if number.startswith("-") else ("", number)
    whole, _, frac = digits.partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    body = whole + ("." + frac if frac else "")
    return body if body == "0" else sign + body


def extract_answer(text: str, mode: str = "strict") -> str | None:
    """The model's final answer in ``text`` (see the module docstring), normalised, or None."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if mode == "strict":
        match = _STRICT.search(text)  # the first match, as lm-eval's findall()[0]
        return _normalise(match.group(1)) if match else None
    reversed_text = text[::-1]
    match = _FLEXIBLE_REVERSED.search(reversed_text)
    if match is None:
        return None
    dash = "-" if reversed_text[match.end() : match.end() + 1] == "-" else ""
    return _normalise(dash + match.group()[::-1])


def answer_span(text: str) -> tuple[int, int] | None:
    """Start and end of the line that holds the strict answer (the first "#### N"), or None."""
    match = _STRICT.search(text)
    if match is None:
        return None
    start = text.rfind("\n", 0, match.start()) + 1
    end = text.find("\n", match.end())
    return start, len(text) if end < 0 else end


def gold_answer(answer_field: str) -> str:
    """The normalised number after the last "#### " of a GSM8K answer; ValueError if none."""
    _, sep, tail = answer_field.rpartition("#### ")
    number = _normalise(tail) if sep else None
    if number is None:
        raise ValueError(f"answer does not end in '#### <number>': {answer_field[-80:]!r}")
    return number


def reward(completion: str, gold: str, mode: str = "strict") -> float:
    """1.0 if the answer extracted from ``completion`` equals the number ``gold``, else 0.0."""
    gold_number = _normalise(gold)
    if gold_number is None:  # gold is trusted data: a bad one is a bug, not a wrong answer
        raise ValueError(f"gold must be a number such as gold_answer() returns, got {gold!r}")
    predicted = extract_answer(completion, mode)
    return float(predicted is not None and _canonical(predicted) == _canonical(gold_number))


def graded_reward(completion: str, gold: str) -> float:
    """A continuous reward in [0, 1]: 1 / (1 + |x - gold| / max(1, |gold|)) for the last number
    x of the completion (`extract_answer(..., "flexible")`), 0 if it has none. Exact
    answers get 1, and being close is worth more than being far."""
    answer = extract_answer(completion, "flexible")
    if answer is None:
        return 0.0
    target = float(gold)
    return 1 / (1 + abs(float(answer) - target) / max(1.0, abs(target)))


def _derived_seed(seed: int, source: str, split: str) -> int:
    # A hash, not seed + offset: reasoning-gym seeds item i with Random(seed + i), so nearby
    # seeds would share items.
    digest = hashlib.sha256(f"{source}/{split}/{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _split_of(question: str) -> str:
    # The split is a function of the question text alone, so "train" and "test" are disjoint
    # for every seed without generating both.
    digest = hashlib.sha256(question.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") < TEST_FRACTION * 2**64 else "train"


def _take_distinct(candidates, split: str, n: int, source: str) -> datasets.Dataset:
    """The first n distinct (question, answer) candidates whose question belongs to split."""
    rows, seen = {"question": [], "answer": []}, set()
    for question, answer in candidates:
        if question not in seen and _split_of(question) == split:
            seen.add(question)
            rows["question"].append(question)
            rows["answer"].append(answer)
            if len(seen) == n:
                return datasets.Dataset.from_dict(rows)
    raise ValueError(f"{source}: only {len(seen)} distinct {split} problems; ask for fewer")


_PEOPLE = {"Tom": "he", "Ann": "she", "Sam": "he", "Mia": "she", "Ben": "he", "Zoe": "she"}
_THINGS = ("apples", "pens", "cards", "books", "eggs", "coins", "shells", "toys")
# Operations on a running total that starts at {a}, and the story that asks for them.
_TEMPLATES = {
    "+b-c": "{n} has {a} {x}. {P} buys {b} more and gives {c} away.",
    "-b+c": "{n} has {a} {x}. {P} gives {b} to a friend and then finds {c} more.",
    "*b-c": "{n} buys {a} bags with {b} {x} in each bag. {P} gives {c} {x} away.",
    "+b-c+d": "{n} has {a} {x}. {P} gets {b} more, loses {c}, and then buys {d} more.",
    "*b/c": "{n} has {a} boxes with {b} {x} in each box. {P} shares them equally among {c} friends.",  # noqa: E501
}
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def _arithmetic_problems(rng: random.Random):
    """Endless short word problems; all numbers and intermediate results lie in 0..99."""
    while True:
        ops, story = rng.choice(list(_TEMPLATES.items()))
        name, thing = rng.choice(list(_PEOPLE)), rng.choice(_THINGS)
        small = ops[0] == "*"  # products of one-digit factors stay below 100
        values = {"a": rng.randint(2, 9) if small else rng.randint(2, 20)}
        total, lines = values["a"], []
        for op, var in zip(ops[::2], ops[1::2]):
            y = values[var] = rng.randint(2, 9) if op in "*/" else rng.randint(1, 20)
            if op == "/" and total % y:
                break  # the answers are whole numbers: draw again
            lines.append(f"{total}{op}{y}={_OPS[op](total, y)}")
            total = _OPS[op](total, y)
            if not 0 <= total <= 99:
                break
        else:
            pronoun = _PEOPLE[name]
            ask = "each friend get" if op == "/" else f"{pronoun} have now"
            question = story.format(n=name, P=pronoun.capitalize(), x=thing, **values)
            question += f" How many {thing} does {ask}?"
            yield question, "\n".join(lines) + f"\n#### {total}"


# Chain problems (`load_arithmetic_chains`): the clauses of the warm start's "+b-c+d" story
# ("gets 5 more, loses 3, and then buys 4 more"), continued in its words.
_CHAIN_CLAUSES = ("gets {y} more", "loses {y}", "buys {y} more", "gives {y} away")


def _chain_problems(rng: random.Random, num_steps: int):
    """Endless problems of `num_steps` steps that add and subtract in turn, numbers drawn as
    `_arithmetic_problems` draws them (a start in 2..20, steps of 1..20, a problem that leaves
    0..99 drawn again), so that 2 and 3 steps are its "+b-c" and "+b-c+d" problems."""
    while True:
        name, thing = rng.choice(list(_PEOPLE)), rng.choice(_THINGS)
        start = total = rng.randint(2, 20)
        lines, values = [], []
        for j in range(num_steps):
            op, y = "+-"[j % 2], rng.randint(1, 20)
            lines.append(f"{total}{op}{y}={_OPS[op](total, y)}")
            total = _OPS[op](total, y)
            values.append(y)
            if not 0 <= total <= 99:
                break
        else:
            if num_steps == 1:
                story = f"buys {values[0]} more"
            elif num_steps == 2:
                story = f"buys {values[0]} more and gives {values[1]} away"  # "+b-c"
            else:
                clauses = [_CHAIN_CLAUSES[j % 4].format(y=y) for j, y in enumerate(values)]
                story = ", ".join(clauses[:-1]) + f", and then {clauses[-1]}"
            pronoun = _PEOPLE[name]
            question = (
                f"{name} has {start} {thing}. {pronoun.capitalize()} {story}. "
                f"How many {thing} does {pronoun} have now?"
            )
            yield question, "\n".join(lines) + f"\n#### {total}"


def load_arithmetic_chains(
    split: str, num_steps: int, num_examples: int, seed: int = 0
) -> datasets.Dataset:
    """Word problems of exactly `num_steps` steps, GSM8K's schema, one worked line per step.

    "Tom has 12 apples. He gets 5 more, loses 3, and then buys 4 more. How many apples does he
    have now?" with the answer "12+5=17\n17-3=14\n14+4=18\n#### 18": the steps add and
    subtract in turn, each 1..20, and every number lies in 0..99. The stories are those of the
    "arithmetic" source (`load_gsm8k`), on which the tiny Llama was warm-started: 2 and 3 steps
    are its "+b-c" and "+b-c+d" problems, 1 step ("He buys 5 more.") and 4 or more (the list of
    clauses continued: "..., buys 4 more, and then gives 2 away.") the nearest stories in its
    words, which the warm start never saw. Train and test never share a question, for any
    seed (the same split rule as the other generated sources).
    """
    if type(num_steps) is not int or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if type(num_examples) is not int or num_examples <= 0:
        raise ValueError(f"num_examples must be a positive int, got {num_examples!r}")
    source = f"arithmetic_chains/{num_steps}"
    problems = _chain_problems(random.Random(_derived_seed(seed, source, split)), num_steps)
    candidates = (next(problems) for _ in range(20 * num_examples + 1000))
    return _take_distinct(candidates, split, num_examples, source)


def _symbolic_problems(seed: int, cap: int):
    """reasoning-gym's GSM8K templates as (question, answer ending in '#### N')."""
    import reasoning_gym  # imported here: only this source needs it

    for item in reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=cap):
        question = item["question"].removesuffix(_SYMBOLIC_SUFFIX)  # prompting is not data
        cot = item["metadata"]["answer_cot"]  # ends in "#### N", sometimes "#### 44.0"
        yield question, cot[: cot.rindex("#### ")] + f"#### {item['answer']}"


def _read_jsonl(path: Path) -> datasets.Dataset:
    """GSM8K's own JSONL format; errors name the file and the 1-based line."""
    rows = {"question": [], "answer": []}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}, line {lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                if not line.strip():
                    continue  # blank lines, e.g. a trailing one, are not examples
                record = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{where}: not a JSON line ({err})") from err
            for field in ("question", "answer"):
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    message = f"{where}: expected an object with a string {field!r}"
                    raise ValueError(message)  # noqa: TRY004 - one error type for bad files
                rows[field].append(record[field])
            try:
                gold_answer(record["answer"])
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
    if not rows["question"]:
        raise ValueError(f"{path}: no examples (empty file)")
    return datasets.Dataset.from_dict(rows)


def _unavailable(cause: Exception) -> GSM8KUnavailableError:
    from huggingface_hub import constants

    return GSM8KUnavailableError(
        f"Cannot load 'openai/gsm8k' (config 'main') from the Hugging Face Hub at "
        f"{constants.ENDPOINT} and found no cached copy ({cause!r}). Offline, use:\n"
        "  load_gsm8k(split, source='jsonl', path='.../grade_school_math/data')"
        "  # GSM8K's own {train,test}.jsonl\n"
        "  load_gsm8k(split, source='gsm_symbolic')  # GSM8K templates from reasoning-gym\n"
        "  load_gsm8k(split, source='arithmetic')    # the book's small generated problems\n"
        "With a cached copy, HF_HUB_OFFLINE=1 skips the network retries."
    )


def check_hub_available(timeout: float = 5.0) -> None:
    """Raise GSM8KUnavailableError at once when ``source="hub"`` cannot load here: no cached
    copy, and the hub does not answer one TCP handshake within `timeout` seconds.

    datasets alone retries a dead network for about 25 s before failing. In offline mode
    (HF_HUB_OFFLINE) only the cache counts; behind a proxy (which cannot be probed) the check
    passes and datasets decides.
    """
    from huggingface_hub import constants

    if (Path(datasets.config.HF_DATASETS_CACHE) / "openai___gsm8k").exists():
        return
    if constants.HF_HUB_OFFLINE:
        offline = OSError("HF_HUB_OFFLINE is set")
        raise _unavailable(offline) from offline
    if urllib.request.getproxies():
        return
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except (OSError, ValueError) as err:  # ValueError: a malformed port in HF_ENDPOINT
        raise _unavailable(err) from err


def _load_hub(split: str, timeout: float) -> datasets.Dataset:
    """``openai/gsm8k`` via datasets, or one GSM8KUnavailableError naming the offline sources."""
    check_hub_available(timeout)
    try:
        dataset = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except OSError as err:  # ConnectionError, OfflineModeIsEnabled, "not cached" are OSErrors
        raise _unavailable(err) from err
    return dataset.select_columns(["question", "answer"])


def load_gsm8k(
    split: str,
    source: str = "hub",
    *,
    path: str | Path | None = None,
    num_examples: int | None = None,
    skip: int = 0,
    seed: int = 0,
    hub_timeout: float = 5.0,
) -> datasets.Dataset:
    """GSM8K-schema problems: columns ``question`` and ``answer`` (ending in ``#### N``).

    Args:
        split: "train" or "test".
        source: "hub" (``openai/gsm8k``, 7473/1319 examples, downloaded or cached), "jsonl"
            (``path``: a file, or a folder with ``{split}.jsonl``), "gsm_symbolic"
            (reasoning-gym) or "arithmetic" (this module's generator).
        num_examples: "hub"/"jsonl": the first n examples (lm-eval's ``--limit``); generated
            sources: how many distinct problems (default: GSM8K's size for the split).
        skip: start after the split's first `skip` problems (same source and seed), so that
            ``load_gsm8k("train", skip=k)`` is disjoint from ``load_gsm8k("train",
            num_examples=k)``:
            a validation set drawn from the training split, which leaves the test split unseen.
        seed: generated sources only. Train and test questions never overlap, for any seed.
        hub_timeout: seconds to wait for the Hub's TCP handshake before giving up.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; valid sources: {', '.join(SOURCES)}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num_examples is not None and (type(num_examples) is not int or num_examples <= 0):
        raise ValueError(f"num_examples must be a positive int or None, got {num_examples!r}")
    if type(skip) is not int or skip < 0:
        raise ValueError(f"skip must be a non-negative int, got {skip!r}")
    if (path is None) == (source == "jsonl"):
        raise ValueError("path is required for source='jsonl' and only allowed with it")
    if source in ("hub", "jsonl"):
        if source == "hub":
            dataset = _load_hub(split, hub_timeout)
        else:
            path = Path(path)
            dataset = _read_jsonl(path / f"{split}.jsonl" if path.is_dir() else path)
        stop = len(dataset) if num_examples is None else skip + num_examples
        if stop > len(dataset) or skip >= len(dataset):
            raise ValueError(
                f"skip={skip} and num_examples={num_examples} ask for more than the "
                f"{len(dataset)} examples available"
            )
        return dataset if (skip, stop) == (0, len(dataset)) else dataset.select(range(skip, stop))
    n = skip + (num_examples or GSM8K_SIZES[split])
    seed = _derived_seed(seed, source, split)
    cap = 20 * n + 1000  # candidates to try before declaring the problem space exhausted
    if source == "gsm_symbolic":
        candidates = _symbolic_problems(seed, cap)
    else:
        problems = _arithmetic_problems(random.Random(seed))
        candidates = (next(problems) for _ in range(cap))
    problems = _take_distinct(candidates, split, n, source)
    return problems.select(range(skip, n)) if skip else problems


# What the chat models are told; the tiny Llama's template ignores it (it only knows one format).
SYSTEM_PROMPT = "Solve the math problem step by step. End with the final answer as '#### <number>'."


def format_prompt(tokenizer, question: str) -> str:
    """The prompt for `question` in the model's own format, as text.

    The format is the tokenizer's chat template, so this one function serves every model
    (training, rollouts, evaluation). The text holds the special tokens: tokenize it with
    ``add_special_tokens=False``.
    """
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def build_prompts(tokenizer, problems) -> tuple[list[str], list[str]]:
    """Prompts and gold answers of a batch of problems, the one way every chapter builds them.

    problems: rows with "question" and "answer" (a `datasets.Dataset` from `gsm8k.load_gsm8k`,
    or a dict of two lists). Returns (prompts, golds), each of length len(problems): the
    prompt is `format_prompt(tokenizer, question)`, the gold is `gsm8k.gold_answer(answer)`.
    """
    return (
        [format_prompt(tokenizer, question) for question in problems["question"]],
        [gold_answer(answer) for answer in problems["answer"]],
    )
