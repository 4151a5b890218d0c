"""TRL's GRPOTrainer as the engine (`lm.trl_engine`) and the book's measurements on a TRL run
(`lm.trl_callback`), on the random tiny Llama: 2 steps, G = 4, 4 prompts, 8 new tokens."""

import copy
import json
from dataclasses import replace

import pytest
import torch

trl = pytest.importorskip("trl")

from grpo_companion.core.spectra import gram_singular_values, rank_measures  # noqa: E402
from grpo_companion.lm import trl_callback, trl_engine  # noqa: E402
from grpo_companion.lm.config import GRPOConfig  # noqa: E402
from grpo_companion.lm.gsm8k import load_gsm8k  # noqa: E402
from grpo_companion.lm.models import ModelUnavailableError, load_policy  # noqa: E402
from grpo_companion.lm.rollouts import generate_rollouts  # noqa: E402
from grpo_companion.lm.streaming_gram import rollout_gram  # noqa: E402
from grpo_companion.lm.trainer import METRICS, train  # noqa: E402
from grpo_companion.lm.trl_engine import RunSettingsError, check_run_settings  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

CONFIG = GRPOConfig(
    num_generations=4, per_step_prompts=4, max_completion_length=8, max_steps=2, eval_every=2,
    learning_rate=1e-3, beta=0.04, micro_batch_size=16, rollout_batch_size=16,
)  # fmt: skip
SAMPLE = "tests/data/gsm8k_sample.jsonl"


def surface_reward(completion: str, gold: str) -> float:
    """Mixed within groups on the random tiny Llama's random tokens."""
    return float(len(completion) % 2 == 0)


@pytest.fixture(scope="module")
def data():
    train = load_gsm8k("train", source="arithmetic", num_examples=4, seed=0)
    return train, load_gsm8k("test", source="arithmetic", num_examples=2, seed=0)


@pytest.fixture(scope="module")
def histories(random_tiny, data, tmp_path_factory):
    model, tokenizer = random_tiny
    ours = train(copy.deepcopy(model), tokenizer, *data, CONFIG, reward_fn=surface_reward,
                 progress=False)  # fmt: skip
    theirs = trl_engine.train_with_trl(
        copy.deepcopy(model), tokenizer, *data, CONFIG, reward_fn=surface_reward,
        checkpoint_dir=tmp_path_factory.mktemp("trl"), progress=False, rank_every=1,
    )  # fmt: skip
    return ours, theirs


def test_trl_is_the_pinned_version():
    """`MeasuredGRPOTrainer` overrides a private TRL method read in this version."""
    assert trl.__version__ == trl_callback.TRL_VERSION


def test_trl_config_maps_the_settings():
    config = replace(CONFIG, num_iterations=2, micro_batch_size=4, save_steps=3, epsilon_high=0.3)
    args = trl_engine.trl_config(config, "/tmp/unused")
    for name in trl_engine.SAME_NAME:
        assert getattr(args, name) == getattr(config, name), name
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16  # B * G
    assert args.gradient_accumulation_steps == args.steps_per_generation == 4
    assert (args.max_steps, args.save_steps) == (4, 6)  # counted in optimizer steps
    assert args.lr_scheduler_type == "constant" and args.use_cpu and not args.bf16


def test_batch_layout_splits_a_step_over_the_processes():
    """Under accelerate launch on 2 processes a step still has B * G = 16 completions."""
    assert trl_engine.batch_layout(replace(CONFIG, micro_batch_size=4), 2) == (4, 2)
    assert trl_engine.batch_layout(CONFIG, 2) == (8, 1)  # micro_batch_size 16 > 16 / 2
    with pytest.raises(RunSettingsError):
        trl_engine.batch_layout(replace(CONFIG, micro_batch_size=4), 3)


@pytest.mark.parametrize(
    "change", [{"filter_degenerate": True}, {"method": "rloo"}, {"kl_clamp": True},
               {"micro_batch_size": 3}],
)  # fmt: skip
def test_trl_config_refuses_what_trl_lacks(change):
    with pytest.raises(RunSettingsError):
        trl_engine.trl_config(replace(CONFIG, **change), "/tmp/unused")


def test_history_has_the_companion_keys(histories):
    ours, theirs = histories
    assert len(ours) == len(theirs) == CONFIG.max_steps + 1
    for record in theirs:
        assert set(METRICS) <= set(record)
    extra = set(trl_callback.BOOK_METRICS) | set(trl_callback.RANK_METRICS)
    assert set(theirs[1]) == set(METRICS) | extra
    # The same keys measured (not None) in both, at every step.
    for mine, other in zip(ours, theirs):
        assert {k for k in METRICS if mine[k] is None} == {k for k in METRICS if other[k] is None}


# How close a TRL history's value must be to the companion's, averaged over the steps: both
# see the same 4 prompts each step from the same initial weights, through different random
# streams. (absolute, relative) tolerance. The surface reward is a fair coin per completion: a
# mean over 2 x 16 completions has standard error 0.09, a difference of two 0.125, so 0.45 is
# about 3.5 standard errors; the group fractions (8 groups) are sanity bounds only. The loss is
# a sum of signed terms near 0. Measured (seed 0): reward 0.44 vs 0.66, entropy 4.338 both,
# grad_norm 0.604 vs 0.628, kl 1.03e-4 vs 1.24e-4, mean_length 7.78 vs 7.81.
TOLERANCES = {
    "reward": (0.45, 0), "reward_std": (0.2, 0), "frac_reward_zero_std": (0.3, 0),
    "all_correct": (0.3, 0), "all_wrong": (0.3, 0), "zero_advantage_token_share": (0.3, 0),
    "loss": (1e-3, 0), "kl": (0, 1.0),
    "clip_ratio/region_mean": (0.05, 0), "clip_ratio/low_mean": (0.05, 0),
    "clip_ratio/high_mean": (0.05, 0), "entropy": (0, 0.02), "grad_norm": (0, 0.5),
    "completions/mean_length": (0, 0.2), "completions/min_length": (3, 0),
    "completions/max_length": (0, 0.0), "completions/clipped_ratio": (0.3, 0),
    "completions/mean_terminated_length": (8, 0), "num_tokens": (0, 0.1),
    "eval_accuracy": (1, 0),
}  # fmt: skip


def test_history_values_are_of_the_same_order(histories, capsys):
    """Each metric's mean over the steps, companion vs TRL, within `TOLERANCES` (printed by
    `pytest -s`); the accuracy before training is measured identically, so equal."""
    ours, theirs = histories
    assert set(TOLERANCES) == set(METRICS[1:])
    rows = []
    for name, (absolute, relative) in TOLERANCES.items():
        mine = [r[name] for r in ours[1:] if r[name] is not None]
        other = [r[name] for r in theirs[1:] if r[name] is not None]
        rows.append((name, sum(mine) / len(mine), sum(other) / len(other), absolute, relative))
    with capsys.disabled():
        print(f"\n{'metric (mean over steps)':36} {'companion':>11} {'trl':>11}")
        for name, mine, other, _, _ in rows:
            print(f"{name:36} {mine:11.4g} {other:11.4g}")
    far = [row[0] for row in rows if row[2] != pytest.approx(row[1], abs=row[3], rel=row[4])]
    assert not far
    assert theirs[0]["eval_accuracy"] == ours[0]["eval_accuracy"]


def test_num_iterations_updates_make_one_record(random_tiny, data, tmp_path):
    """mu = 2 TRL optimizer steps on one batch are one companion step: one record, the rollout
    metrics of the batch and the per-update metrics averaged over the two updates."""
    model, tokenizer = random_tiny
    config = replace(CONFIG, num_iterations=2, max_steps=1, eval_every=1)
    history = trl_engine.train_with_trl(
        copy.deepcopy(model), tokenizer, *data, config, reward_fn=surface_reward,
        checkpoint_dir=tmp_path, progress=False,
    )  # fmt: skip
    assert [record["step"] for record in history] == [0, 1]
    assert history[1]["reward"] is not None and history[1]["eval_accuracy"] is not None
    assert history[1]["clip_ratio/region_mean"] is not None and history[1]["grad_norm"] > 0


def test_book_measurements_are_consistent(histories):
    _, theirs = histories
    for record in theirs[1:]:
        assert record["all_correct"] + record["all_wrong"] == pytest.approx(
            record["frac_reward_zero_std"]
        )  # binary rewards: zero-std groups are all-correct or all-wrong
        assert record["jensen_zero_std"] >= 2 ** (1 - CONFIG.num_generations) - 1e-12
        assert 0 <= record["zero_advantage_token_share"] <= 1
        assert 1 <= record["rank/entropy"] <= CONFIG.num_generations


def test_batch_measurements_by_hand():
    rewards = [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0]  # all correct, all wrong, p = 1/4
    advantages = torch.tensor([0.0] * 8 + [1.5, -0.5, -0.5, -0.5])
    mask = torch.ones(12, 3)
    mask[8, 2] = 0  # the one completion with a nonzero advantage... and 2 tokens
    record = trl_callback.batch_measurements(rewards, advantages, mask, 4)
    assert record["all_correct"] == record["all_wrong"] == pytest.approx(1 / 3)
    assert record["jensen_zero_std"] == pytest.approx((1 + 1 + 0.25**4 + 0.75**4) / 3)
    assert record["zero_advantage_token_share"] == pytest.approx(24 / 35)


def test_callback_ranks_equal_the_spectrum_of_the_same_group(random_tiny, data):
    """The callback's ranks of a TRL-format batch equal `rank_measures` of `rollout_gram` on the
    same group as the companion's `Rollouts`."""
    model, tokenizer = random_tiny
    from grpo_companion.lm.gsm8k import build_prompts

    prompts, golds = build_prompts(tokenizer, data[0])
    rollouts = generate_rollouts(model, tokenizer, prompts[:1], golds[:1], num_generations=4,
                                 max_completion_length=8, temperature=1.0, seed=0,
                                 reward_fn=surface_reward)  # fmt: skip
    batch = {  # TRL's layout: one prompt row per completion
        "prompt_ids": rollouts.prompt_ids.repeat(4, 1),
        "prompt_mask": rollouts.prompt_mask.repeat(4, 1),
        "completion_ids": rollouts.completion_ids,
        "completion_mask": rollouts.completion_mask,
    }
    ranks = trl_callback.first_group_ranks(model, batch, 4, 1.0)
    expected = rank_measures(gram_singular_values(rollout_gram(model, rollouts)))
    assert ranks == {f"rank/{k}": pytest.approx(v.item(), abs=1e-12) for k, v in expected.items()}
    assert ranks["rank/entropy"] > 1.5  # random completions: not a vacuous rank-one group


def test_gpu_profile_path_with_stand_ins(random_tiny, tmp_path, monkeypatch):
    """Chapter 11's gpu-profile path (a Hugging Face model by name, GSM8K from files, the check
    before any work) on the CPU, through both engines: the tiny Llama saved as a local folder
    stands in for nvidia/Nemotron-Mini-4B-Instruct, a JSONL file for the hub dataset."""
    model, tokenizer = random_tiny
    folder = tmp_path / "stand-in"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    check_run_settings(engine="trl", device="cpu", model_name=str(folder), beta=CONFIG.beta)
    train_data = load_gsm8k("train", source="jsonl", path=SAMPLE, num_examples=4)
    eval_data = load_gsm8k("test", source="jsonl", path=SAMPLE, num_examples=2)
    config = replace(CONFIG, max_steps=1, eval_every=1)
    for engine in trl_engine.ENGINES:
        policy, policy_tokenizer = load_policy(str(folder), progress=False, dtype="float32")
        history = trl_engine.engine_train(engine)(
            policy, policy_tokenizer, train_data, eval_data, config, progress=False,
            reward_fn=surface_reward,
            checkpoint_dir=tmp_path / engine if engine == "trl" else None,
        )  # fmt: skip
        assert [record["step"] for record in history] == [0, 1], engine
        assert history[1]["grad_norm"] > 0, engine
    # Loading a hub id by name offline fails fast, naming the offline choices.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailableError, match="tiny-llama"):
        load_policy("nvidia/Nemotron-Mini-4B-Instruct")


def a_64_gib_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    properties = type("Properties", (), {"total_memory": 2**36})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"engine": "verl"}, "unknown engine"),
        ({"engine": "trl", "no_trl": True}, "needs TRL"),
        ({"device": "cuda"}, "no CUDA GPU"),
        ({"engine": "trl", "device": "cpu", "use_vllm": True}, "use_vllm needs"),
        ({"engine": "companion", "device": "cuda", "use_vllm": True, "cuda": True}, "use_vllm"),
        ({"device": "cuda", "cuda": True, "num_parameters": 4_200_000_000, "beta": 0.04},
         "needs about 78 GiB"),
        # On a GPU machine without the hub, the gpu profile's model and data stop in the first
        # cell, not in the cell that loads them.
        ({"device": "cuda", "cuda": True, "offline": True,
          "model_name": "nvidia/Nemotron-Mini-4B-Instruct"}, "Offline: 'tiny-llama'"),
        ({"device": "cuda", "cuda": True, "offline": True, "model_name": "tiny-llama",
          "num_parameters": 1, "data_source": "hub"}, "offline sources: 'arithmetic'"),
    ],
)  # fmt: skip
def test_check_run_settings_refuses_in_one_line(settings, message, monkeypatch, tmp_path):
    settings = dict(settings)
    if settings.pop("no_trl", False):
        monkeypatch.setattr(trl_engine, "_importable", lambda name: name != "trl")
    if settings.pop("offline", False):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
        monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path)
    if settings.pop("cuda", False):
        a_64_gib_gpu(monkeypatch)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RunSettingsError, match=message) as error:
        check_run_settings(**settings)
    assert "\n" not in str(error.value)


def test_check_run_settings_passes_what_runs(monkeypatch, random_tiny, tmp_path):
    a_64_gib_gpu(monkeypatch)
    check_run_settings(engine="companion", device="cpu")
    model, tokenizer = random_tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("tiny-llama", "smollm2-135m", str(tmp_path)):  # no hub needed for these
        check_run_settings(engine="trl", device="cuda", model_name=name, num_parameters=1)
    check_run_settings(engine="trl", device="cuda", num_parameters=135_000_000, beta=0.04)


def test_main_help(capsys):
    with pytest.raises(SystemExit):
        trl_engine.main(["--help"])
    assert "accelerate launch --num_processes N" in capsys.readouterr().out


def test_main_trains_a_local_model_on_a_jsonl_file(random_tiny, tmp_path):
    """The script `accelerate launch` runs, here on one CPU process: 1 step, history.json."""
    model, tokenizer = random_tiny
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    grpo = {"num_generations": 4, "per_step_prompts": 2, "max_completion_length": 8,
            "max_steps": 1, "beta": 0.0}  # fmt: skip
    history = trl_engine.main([
        "--model", str(tmp_path / "model"), "--data-source", "jsonl", "--data-path", SAMPLE,
        "--num-train-prompts", "2", "--num-eval-prompts", "2", "--device", "cpu",
        "--grpo", json.dumps(grpo), "--output-dir", str(tmp_path / "run"),
    ])  # fmt: skip
    written = json.loads((tmp_path / "run" / "history.json").read_text())
    assert written["history"] == history and len(history) == 2
    assert written["config"]["max_steps"] == 1 and history[1]["kl"] is None
