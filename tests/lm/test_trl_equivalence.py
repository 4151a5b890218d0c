"""Our GRPO held to TRL's `GRPOTrainer` by a test.

Both trainers learn from one FIXED batch on copies of the same random tiny Llama: B = 3 prompts of
different lengths (so prompts are left-padded), G = 4 completions each of lengths 1..8 (some end
with EOS and are right-padded after it, some are truncated at max_completion_length = 8), and fixed
rewards (two mixed groups, one all-equal group). For each configuration we compare

    advantages   TRL's `inputs["advantages"]`     vs  `group_advantages(rewards, ...)`
    loss         TRL's `compute_loss`, summed over the micro-batches of an optimizer step,
                 averaged over the optimizer steps      vs  `grpo_step`'s record["loss"]
    gradient     every parameter's gradient at every optimizer step           vs  ours
    frac_reward_zero_std   TRL's logged metric                                vs  ours

How TRL is driven (TRL 1.16.0, pinned: `test_trl_is_the_pinned_version`). No private method is
called; public API plus one patched module global:
  - `GRPOTrainer(..., rollout_func=...)` returns the fixed prompt and completion ids instead of
    generating (TRL calls this API experimental); a reward function returns the fixed rewards.
  - `trainer.train()` runs the optimizer steps, with `optimizers=(Recorder, scheduler)`: the
    Recorder's `step()` stores each parameter's gradient, then adds a fixed perturbation to the
    weights, so a second iteration on the batch sees a policy ratio away from 1 (and some clipped
    tokens), identically in both trainers. `max_grad_norm=0` turns TRL's clipping off.
  - a `GRPOTrainer` subclass overrides the public `compute_loss` to record each micro-batch's
    inputs (advantages) and loss.
  - `trl.trainer.grpo_trainer.shuffle_sequence_dict` is patched to the identity: TRL shuffles the
    completions of a generation batch before splitting it into gradient-accumulation micro-batches,
    and with "bnpo" the gradient depends on which completions share a micro-batch. Unshuffled,
    TRL's micro-batches are the contiguous slices our `micro_batch_size` takes.
  - `shuffle_dataset=False` keeps the prompts in order; TRL's reference model is loaded from
    `model.config._name_or_path`, which points at a saved copy of the initial weights.
Ours is driven through `trainer.grpo_step` with `generate_rollouts` and `batch_indices` patched to
return the same fixed batch in the same order, and the same Recorder as optimizer.

Tolerance: float32 throughout (bf16=False, use_cpu=True). TRL computes log-probs with its fused LM
head and default position ids, ours from the full logits with explicit position_ids: the same
numbers up to float32 rounding (the differences observed where conventions agree are <= 1.2e-7).
We assert max |difference| <= ATOL = 1e-6 on advantages, losses and every gradient entry (rtol 0;
all values here are O(1) or smaller).

Every case passes, including the settings where the two once differed (bnpo per micro-batch,
scale_rewards True/False, the batch frac_reward_zero_std, use_bias_correction_kl); the cases
cover TRL's policy-loss variants (delta, importance_sampling_level="sequence",
mask_truncated_completions, cispo, sapo, luspo, vespo, off_policy_mask_threshold), each set by
the same name in both configs.
`pytest -s` prints the max |difference| per case (`test_report_differences`).
"""

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import trl.trainer.grpo_trainer as trl_grpo_module  # noqa: E402
from trl import GRPOConfig as TRLConfig  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from grpo_companion.core.advantages import group_advantages  # noqa: E402
from grpo_companion.lm import trainer as our_trainer  # noqa: E402
from grpo_companion.lm.config import GRPOConfig  # noqa: E402
from grpo_companion.lm.rollouts import Rollouts  # noqa: E402
from grpo_companion.lm.scoring import sequence_log_probs  # noqa: E402

# transformers 5 renamed gradient checkpointing, which TRL 1.16 still sets (to False, here).
pytestmark = [
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

TRL_VERSION = "1.16.0"
ATOL = 1e-6  # float32; see the module docstring

G = 4  # num_generations
MAX_LEN = 8  # max_completion_length
PROMPT_LENGTHS = (3, 5, 4)
# Completion lengths; MAX_LEN means truncated (no EOS), shorter ones end with EOS.
COMPLETION_LENGTHS = ((8, 3, 5, 1), (2, 8, 6, 4), (7, 4, 8, 2))
REWARDS = ((1.0, 0.0, 0.5, 0.0), (0.2, 0.9, 0.9, 0.1), (1.0, 1.0, 1.0, 1.0))
B = len(PROMPT_LENGTHS)
PERTURBATION = 0.05  # std of the fixed weight change each optimizer step makes


# --- the fixed batch ------------------------------------------------------------------------


@dataclass(frozen=True)
class FixedBatch:
    prompts: list  # B prompt strings (keys only: never tokenized)
    prompt_ids: list  # B lists of token ids
    completion_ids: list  # B lists of G lists of token ids, EOS included where there is one
    rewards: torch.Tensor  # (B, G)
    pad_token_id: int

    def reward_of(self, prompt: str, completion_ids) -> float:
        b = self.prompts.index(prompt)
        return float(self.rewards[b, self.completion_ids[b].index(list(completion_ids))])

    def rollouts(self, prompts: list[str], device) -> Rollouts:
        """Our `Rollouts` of the batch, groups in the order of `prompts`."""
        order = [self.prompts.index(p) for p in prompts]
        width = max(len(self.prompt_ids[b]) for b in order)
        prompt_ids = torch.full((len(order), width), self.pad_token_id)
        prompt_mask = torch.zeros((len(order), width), dtype=torch.long)
        for row, b in enumerate(order):
            ids = self.prompt_ids[b]
            prompt_ids[row, width - len(ids) :] = torch.tensor(ids)
            prompt_mask[row, width - len(ids) :] = 1
        completions = [c for b in order for c in self.completion_ids[b]]
        longest = max(len(c) for c in completions)
        completion_ids = torch.full((len(completions), longest), self.pad_token_id)
        completion_mask = torch.zeros((len(completions), longest), dtype=torch.long)
        for row, ids in enumerate(completions):
            completion_ids[row, : len(ids)] = torch.tensor(ids)
            completion_mask[row, : len(ids)] = 1
        lengths = completion_mask.sum(1)
        return Rollouts(
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            completion_ids=completion_ids.to(device),
            completion_mask=completion_mask.to(device),
            log_probs=None,
            lengths=lengths.to(device),
            truncated=(lengths == MAX_LEN).to(device),
            texts=[""] * len(completions),
            rewards=self.rewards[order].to(device),
            num_generations=G,
            temperature=1.0,
        )


def make_batch(tokenizer) -> FixedBatch:
    generator = torch.Generator().manual_seed(19)
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])

    def tokens(n):
        return ordinary[torch.randint(len(ordinary), (n,), generator=generator)].tolist()

    completion_ids = []
    for lengths in COMPLETION_LENGTHS:
        eos = [tokenizer.eos_token_id]
        group = [tokens(n) if n == MAX_LEN else tokens(n - 1) + eos for n in lengths]
        assert len({tuple(c) for c in group}) == G  # rewards are looked up by completion
        completion_ids.append(group)
    return FixedBatch(
        prompts=[f"prompt {b}" for b in range(B)],
        prompt_ids=[tokens(n) for n in PROMPT_LENGTHS],
        completion_ids=completion_ids,
        rewards=torch.tensor(REWARDS),
        pad_token_id=tokenizer.pad_token_id,
    )


# --- the optimizer both trainers use --------------------------------------------------------


class Recorder(torch.optim.Optimizer):
    """Stores the gradient at each step, then moves the weights by a fixed perturbation."""

    def __init__(self, model, perturbation: dict):
        self.names = [name for name, _ in model.named_parameters()]
        super().__init__([p for _, p in model.named_parameters()], {"lr": 0.0})
        self.perturbation = perturbation
        self.grads = []

    @torch.no_grad()
    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        self.grads.append(
            {
                name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for name, p in zip(self.names, params)
            }
        )
        for name, p in zip(self.names, params):
            p.add_(self.perturbation[name])


def make_perturbation(model) -> dict:
    generator = torch.Generator().manual_seed(1919)
    return {
        name: PERTURBATION * torch.randn(p.shape, generator=generator)
        for name, p in model.named_parameters()
    }


# --- running both ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    loss_type: str = "grpo"
    scale_rewards: object = "group"  # str or bool (TRL accepts True/False)
    beta: float = 0.0
    bias_correction_kl: bool = True  # TRL's use_bias_correction_kl (default True in 1.16)
    num_iterations: int = 1
    grad_accum: int = 1  # TRL gradient_accumulation_steps; our micro_batch_size: B * G / grad_accum
    steps: int = 1  # rounds of (fixed) rollouts, each followed by num_iterations optimizer steps
    max_completion_length: int = MAX_LEN  # > MAX_LEN: the longest completion is shorter than it
    options: tuple = ()  # (name, value) pairs of settings both GRPOConfigs have under one name

    @property
    def id(self) -> str:
        parts = [self.loss_type, f"scale_{self.scale_rewards}", f"beta{self.beta}"]
        if self.beta:
            parts.append("biascorr" if self.bias_correction_kl else "nobiascorr")
        parts += [f"iter{self.num_iterations}", f"ga{self.grad_accum}"]
        if self.steps > 1:
            parts.append(f"steps{self.steps}")
        if self.max_completion_length != MAX_LEN:
            parts.append(f"maxlen{self.max_completion_length}")
        parts += [f"{name}={value}" for name, value in self.options]
        return "-".join(parts)


@dataclass
class Result:
    advantages: torch.Tensor  # (B * G,) of the first round
    loss: float  # mean over optimizer steps of the step's loss
    grads: list  # one {name: gradient} per optimizer step
    frac_reward_zero_std: float  # of the first round
    clip_ratio: float | None = None  # TRL only: fraction of clipped tokens, mean over the steps
    logged: dict | None = None  # TRL only: its log of the first optimizer step


class RecordingGRPOTrainer(GRPOTrainer):
    """Records the inputs and loss of every micro-batch (`compute_loss` is public API)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.recorded.append((inputs, loss.detach().clone()))
        return loss


def fixed_rollout_func(batch: FixedBatch, sampled=None):
    """TRL's ``rollout_func`` returning the fixed completions, each prompt's G in order (TRL asks
    for each prompt G times in a row); with `sampled`, (B * G, T) in the batch's order, its rows
    as the sampler's "logprobs", as vLLM reports them."""

    def rollout_func(prompts, trainer):
        seen, prompt_ids, completion_ids, logprobs = {}, [], [], []
        for prompt in prompts:
            b = batch.prompts.index(prompt)
            k = seen[prompt] = seen.get(prompt, -1) + 1
            prompt_ids.append(batch.prompt_ids[b])
            completion_ids.append(batch.completion_ids[b][k % G])
            if sampled is not None:
                logprobs.append(sampled[b * G + k % G, : len(completion_ids[-1])].tolist())
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": None if sampled is None else logprobs,
        }

    return rollout_func


def fixed_reward_func(batch: FixedBatch):
    """A TRL reward function returning the batch's fixed rewards."""

    def fixed_reward(prompts, completions, completion_ids, **kwargs):
        return [batch.reward_of(p, c) for p, c in zip(prompts, completion_ids)]

    return fixed_reward


def train_trl(
    model, tokenizer, batch: FixedBatch, args, reward_funcs, *, optimizer=None, sampled=None
) -> RecordingGRPOTrainer:
    """TRL's trainer after `trainer.train()` on the fixed batch (`fixed_rollout_func`), unshuffled
    (the module docstring), with `optimizer` at a constant learning rate if given. TRL corrects
    only the completions of its vLLM engine: with `sampled` the batch plays that part
    (``use_vllm`` set, and a stand-in ``vllm_generation`` whose ``sync_weights`` does nothing)."""
    optimizers = (None, None)
    if optimizer is not None:
        optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
        patch.setattr(trl_grpo_module, "shuffle_sequence_dict", lambda generation: generation)
        trainer = RecordingGRPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_dict({"prompt": batch.prompts}),
            rollout_func=fixed_rollout_func(batch, sampled),
            optimizers=optimizers,
        )
        if sampled is not None:
            trainer.use_vllm = True
            trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
            trainer._last_loaded_step = -1
        trainer.recorded = []
        trainer.train()
    return trainer


def train_trl_case(case: Case, model, tokenizer, batch: FixedBatch, output_dir, sampled=None):
    """(trainer, its Recorder): `train_trl` with the settings of `case`, the fixed rewards and a
    `Recorder`, one generation batch of B * G rollouts per optimizer step (TRL's default)."""
    # TRL builds its reference model from `model.config._name_or_path`: save the initial weights.
    model.save_pretrained(output_dir / "initial")
    model.config._name_or_path = str(output_dir / "initial")
    args = TRLConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        num_generations=G,
        per_device_train_batch_size=B * G // case.grad_accum,
        gradient_accumulation_steps=case.grad_accum,
        num_iterations=case.num_iterations,
        max_steps=case.steps * case.num_iterations,
        max_completion_length=case.max_completion_length,
        temperature=1.0,
        loss_type=case.loss_type,
        scale_rewards=case.scale_rewards,
        beta=case.beta,
        use_bias_correction_kl=case.bias_correction_kl,
        epsilon=0.2,
        max_grad_norm=0.0,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        **dict(case.options),
    )
    assert args.steps_per_generation == args.gradient_accumulation_steps == case.grad_accum
    optimizer = Recorder(model, make_perturbation(model))
    trainer = train_trl(
        model,
        tokenizer,
        batch,
        args,
        fixed_reward_func(batch),
        optimizer=optimizer,
        sampled=sampled,
    )
    return trainer, optimizer


def run_trl(case: Case, model, tokenizer, batch: FixedBatch, output_dir) -> Result:
    trainer, optimizer = train_trl_case(case, model, tokenizer, batch, output_dir)
    num_steps = case.steps * case.num_iterations
    assert len(optimizer.grads) == num_steps
    assert len(trainer.recorded) == num_steps * case.grad_accum
    first = trainer.recorded[: case.grad_accum]  # the micro-batches of the first step, in order
    step_losses = [
        sum(loss.item() for _, loss in trainer.recorded[i : i + case.grad_accum])
        for i in range(0, len(trainer.recorded), case.grad_accum)
    ]
    logged = [log for log in trainer.state.log_history if "grad_norm" in log]
    assert len(logged) == num_steps  # logging_steps=1: one record per optimizer step
    return Result(
        advantages=torch.cat([inputs["advantages"] for inputs, _ in first]),
        loss=sum(step_losses) / len(step_losses),
        grads=optimizer.grads,
        frac_reward_zero_std=logged[0]["frac_reward_zero_std"],
        clip_ratio=sum(log.get("clip_ratio/region_mean", 0.0) for log in logged) / num_steps,
        logged=logged[0],
    )


def our_config(case: Case) -> GRPOConfig:
    """Our config of `case`: one step on the B prompts, micro-batches of B * G / grad_accum
    completions, gradient clipping off (TRL's ``max_grad_norm=0``)."""
    return GRPOConfig(
        num_generations=G,
        per_step_prompts=B,
        max_completion_length=case.max_completion_length,
        temperature=1.0,
        use_bias_correction_kl=case.bias_correction_kl,
        **dict(case.options),
        scale_rewards=case.scale_rewards,
        loss_type=case.loss_type,
        beta=case.beta,
        epsilon=0.2,
        num_iterations=case.num_iterations,
        micro_batch_size=B * G // case.grad_accum,
        rollout_batch_size=B * G,
        max_grad_norm=1e30,
        max_steps=1,
    )


def run_ours(case: Case, model, tokenizer, batch: FixedBatch) -> Result:
    config = our_config(case)
    advantages = group_advantages(batch.rewards, "grpo", scale_rewards=case.scale_rewards).flatten()

    def fixed_rollouts(model, tokenizer, prompts, golds, *, compute_log_probs=True, **settings):
        rollouts = batch.rollouts(prompts, model.device)
        if compute_log_probs:
            with torch.no_grad():
                rollouts.log_probs = sequence_log_probs(
                    model, rollouts.input_ids, rollouts.attention_mask, rollouts.completion_mask
                )
        return rollouts

    reference = None
    if case.beta > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = Recorder(model, make_perturbation(model))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(our_trainer, "generate_rollouts", fixed_rollouts)
        patch.setattr(
            our_trainer,
            "batch_indices",
            lambda step, num_examples, per_step, seed: list(range(per_step)),
        )
        records = [
            our_trainer.grpo_step(
                model,
                tokenizer,
                reference,
                optimizer,
                batch.prompts,
                [str(b) for b in range(B)],
                config,
                step,
                None,
            )
            for step in range(1, case.steps + 1)
        ]
    return Result(
        advantages=advantages,
        loss=sum(r["loss"] for r in records) / case.steps,
        grads=optimizer.grads,
        frac_reward_zero_std=records[0]["frac_reward_zero_std"],
    )


# --- the cases ------------------------------------------------------------------------------

LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")  # the loss types both libraries have

CASES = list(
    dict.fromkeys(
        [  # (dict.fromkeys drops repeats, keeping the order)
            # every shared loss_type with every scale_rewards: on-policy, one batch, one micro-batch
            *[
                Case(loss_type=t, scale_rewards=s)
                for t in LOSS_TYPES
                for s in ("group", "batch", "none")
            ],
            *[Case(scale_rewards=s) for s in (True, False)],  # TRL's aliases of "group" and "none"
            # a second iteration on the batch: ratio != 1, some tokens clipped
            *[Case(loss_type=t, num_iterations=2) for t in LOSS_TYPES],
            # the KL term, with and without TRL's bias correction, where the policy has left the
            # reference: a second iteration on the batch, or (on-policy) a second batch after one
            # update
            *[
                Case(loss_type=t, beta=0.04, bias_correction_kl=bc, num_iterations=2)
                for t in LOSS_TYPES
                for bc in (True, False)
            ],
            *[
                Case(beta=0.04, bias_correction_kl=bc, steps=s)
                for bc in (True, False)
                for s in (1, 2)
            ],
            # gradient accumulation: 2 micro-batches of 6 completions (the middle group straddles
            # them)
            *[Case(loss_type=t, grad_accum=2) for t in LOSS_TYPES],
            *[
                Case(
                    loss_type=t,
                    grad_accum=2,
                    num_iterations=2,
                    beta=0.04,
                    bias_correction_kl=False,
                    scale_rewards="batch",
                )
                for t in LOSS_TYPES
            ],
            # dr_grpo's normaliser is max_completion_length, not the longest completion of the batch
            Case(loss_type="dr_grpo", max_completion_length=12),
            Case(loss_type="dr_grpo", max_completion_length=12, grad_accum=2),
            # TRL's policy-loss variants, off-policy (a second iteration) so that ratios leave 1
            *[
                Case(loss_type=t, num_iterations=2, options=options)
                for t, options in [
                    (
                        "grpo",
                        (("delta", 1.1),),
                    ),  # two-sided clipping caps some negative-advantage ratios
                    ("grpo", (("importance_sampling_level", "sequence"),)),  # GSPO
                    ("luspo", (("importance_sampling_level", "sequence"),)),
                    ("grpo", (("mask_truncated_completions", True),)),
                    ("dapo", (("mask_truncated_completions", True),)),
                    ("grpo", (("off_policy_mask_threshold", 0.001),)),
                ]
            ],
            *[Case(loss_type=t, num_iterations=2) for t in ("cispo", "sapo", "luspo", "vespo")],
            Case(loss_type="cispo", num_iterations=2, options=(("epsilon_high", 1.0),)),
            *[
                Case(loss_type=t, grad_accum=2, num_iterations=2, beta=0.04)
                for t in ("cispo", "sapo", "luspo", "vespo")
            ],
            Case(
                num_iterations=2,
                beta=0.04,
                grad_accum=2,
                options=(("importance_sampling_level", "sequence"), ("delta", 1.1)),
            ),
        ]
    )
)


def parametrize(quantity: str):
    return pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])


def memoised_results(run_trl, run_ours, random_tiny, tmp_path_factory):
    """get(case) -> (run_trl's result, run_ours's), on copies of `random_tiny` and the fixed
    batch, each trainer run once per case for all the tests that ask."""
    model, tokenizer = random_tiny
    batch = make_batch(tokenizer)
    cache = {}

    def get(case: Case):
        if case not in cache:
            ours = run_ours(case, copy.deepcopy(model), tokenizer, batch)
            output_dir = tmp_path_factory.mktemp("trl")
            theirs = run_trl(case, copy.deepcopy(model), tokenizer, batch, output_dir)
            cache[case] = theirs, ours
        return cache[case]

    return get


@pytest.fixture(scope="module")
def results(random_tiny, tmp_path_factory):
    """Memoised (trl, ours) results per case: each case runs each trainer once for all tests."""
    return memoised_results(run_trl, run_ours, random_tiny, tmp_path_factory)


def max_grad_difference(theirs: Result, ours: Result) -> float:
    assert len(theirs.grads) == len(ours.grads)
    return max(
        (theirs_step[name] - ours_step[name]).abs().max().item()
        for theirs_step, ours_step in zip(theirs.grads, ours.grads)
        for name in theirs_step
    )


def test_trl_is_the_pinned_version():
    """The conventions below were checked against this TRL; re-check them on any other."""
    assert trl.__version__ == TRL_VERSION


@parametrize("advantages")
def test_advantages_equal_trl(case, results):
    theirs, ours = results(case)
    assert (theirs.advantages - ours.advantages).abs().max().item() <= ATOL


@parametrize("loss")
def test_loss_equals_trl(case, results):
    theirs, ours = results(case)
    assert abs(theirs.loss - ours.loss) <= ATOL


@parametrize("gradient")
def test_gradient_equals_trl(case, results):
    theirs, ours = results(case)
    assert max_grad_difference(theirs, ours) <= ATOL


@parametrize("frac_reward_zero_std")
def test_frac_reward_zero_std_equals_trl(case, results):
    theirs, ours = results(case)
    assert theirs.frac_reward_zero_std == pytest.approx(ours.frac_reward_zero_std, abs=ATOL)


def test_second_iteration_is_off_policy(results):
    """The Recorder's perturbation moves the policy before the second iteration on the batch,
    so the num_iterations = 2 cases test the ratio and clipping, not only on-policy gradients."""
    theirs, ours = results(Case(num_iterations=2))
    assert theirs.clip_ratio > 0.05  # mean over the two steps; the first clips nothing
    first, second = ours.grads
    assert max((first[name] - second[name]).abs().max().item() for name in first) > 1e-3


def test_history_uses_trls_metric_names(results, random_tiny):
    """Our history's names for what TRL also logs are TRL's logged names, and
    the rollout metrics under them are TRL's values."""
    theirs, _ = results(Case(beta=0.04, num_iterations=2))
    # The book's own: the degenerate groups split by reward, the zero-advantage token share
    # (a TRL run gets it from `lm.trl_callback`), and the held-out accuracy.
    ours_only = {"step", "all_correct", "all_wrong", "zero_advantage_token_share", "eval_accuracy"}
    shared = set(our_trainer.METRICS) - ours_only
    assert shared <= set(theirs.logged), sorted(shared - set(theirs.logged))
    batch = make_batch(random_tiny[1])
    metrics = our_trainer.rollout_metrics(batch.rollouts(batch.prompts, "cpu"), "group")
    for name, value in metrics.items():
        if name not in ours_only:
            assert theirs.logged[name] == pytest.approx(value, abs=ATOL), name


def test_report_differences(results, capsys):
    """Max |TRL - ours| per case (advantages, loss, gradient); shown with `pytest -s`."""
    rows = []
    for case in CASES:
        theirs, ours = results(case)
        rows.append(
            (
                case.id,
                (theirs.advantages - ours.advantages).abs().max().item(),
                abs(theirs.loss - ours.loss),
                max_grad_difference(theirs, ours),
            )
        )
    with capsys.disabled():
        print(f"\n{'case':78} {'advantages':>10} {'loss':>9} {'gradient':>9}")
        for name, *differences in rows:
            print(f"{name:78} " + " ".join(f"{d:9.1e}" for d in differences))
    assert max(max(row[1:]) for row in rows) <= ATOL


def test_each_variant_changes_the_step(results):
    """The variant cases are not vacuous: each option changes TRL's gradient on this batch (so the
    agreement above tests the option, not the plain loss)."""
    for case in CASES:
        if case.options and case.grad_accum == 1:
            plain = Case(loss_type=case.loss_type, num_iterations=case.num_iterations)
            with_option, without = results(case)[0], results(plain)[0]
            assert max_grad_difference(with_option, without) > 1e-4, case.id


# --- several reward functions: TRL's multi_objective_aggregation (book/variants.md) ----------


@pytest.mark.parametrize("aggregation", ["normalize_then_sum", "sum_then_normalize"])
def test_multi_objective_aggregation_equals_gdpo_and_group_advantages(
    aggregation, random_tiny, tmp_path
):
    """Two reward functions, the fixed rewards and a length reward L / MAX_LEN, weighted 1 and
    0.5: TRL's advantages are `gdpo_advantages` of the two ("normalize_then_sum", GDPO) or
    `group_advantages` of their weighted sum ("sum_then_normalize", the default)."""
    from grpo_companion.core.verl_estimators import gdpo_advantages

    model, tokenizer = random_tiny
    batch = make_batch(tokenizer)
    weights = (1.0, 0.5)

    def length_reward(prompts, completions, completion_ids, **kwargs):
        return [len(c) / MAX_LEN for c in completion_ids]

    args = TRLConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, fp16=False, report_to=[],
        disable_tqdm=True, save_strategy="no", logging_steps=1, seed=0, num_generations=G,
        per_device_train_batch_size=B * G, max_steps=1, max_completion_length=MAX_LEN,
        reward_weights=list(weights), multi_objective_aggregation=aggregation,
        gradient_checkpointing=False, shuffle_dataset=False, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = train_trl(
        copy.deepcopy(model), tokenizer, batch, args, [fixed_reward_func(batch), length_reward]
    )
    theirs = torch.cat([inputs["advantages"] for inputs, _ in trainer.recorded])
    lengths = torch.tensor([[len(c) / MAX_LEN for c in group] for group in batch.completion_ids])
    rewards = torch.stack([batch.rewards, lengths], dim=-1)  # (B, G, 2)
    if aggregation == "normalize_then_sum":
        ours = gdpo_advantages(rewards, torch.tensor(weights))
    else:
        ours = group_advantages((rewards * torch.tensor(weights)).sum(-1))
    torch.testing.assert_close(theirs, ours.flatten(), rtol=0, atol=ATOL)
    # GDPO gives the all-equal third group (fixed rewards 1) advantages from its lengths alone,
    # normalised within the group to the scale of the other reward.
    assert ours[2].abs().max() > 0.5


# --- the micro model (lm/micro.py): the same step as TRL's on its own tokenizer --------------

MICRO_CASES = [Case(), Case(loss_type="dr_grpo"), Case(num_iterations=2), Case(beta=0.04, steps=2)]


@pytest.fixture(scope="module")
def micro_results(tmp_path_factory):
    from grpo_companion.lm import micro

    tokenizer = micro.build_tokenizer()
    model = micro.build_model(micro.MicroSpec(), tokenizer)
    return memoised_results(run_trl, run_ours, (model, tokenizer), tmp_path_factory)


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in MICRO_CASES])
def test_the_micro_models_step_equals_trl(case, micro_results):
    theirs, ours = micro_results(case)
    assert (theirs.advantages - ours.advantages).abs().max().item() <= ATOL
    assert abs(theirs.loss - ours.loss) <= ATOL
    assert max_grad_difference(theirs, ours) <= ATOL
