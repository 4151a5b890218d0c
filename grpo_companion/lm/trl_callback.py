r"""The book's measurements on a TRL run: a `TrainerCallback` a reader can attach to their own.

TRL's `GRPOTrainer` logs what `trainer.METRICS` names but shows a callback neither the rewards of
a group nor the advantages. Two hooks bring them out: `BookMeasurements.recording(reward_func)`
wraps any TRL reward function and stores the rewards it returns (public API), and
`MeasuredGRPOTrainer`, a thin `GRPOTrainer` subclass, hands each generation batch to the
callback. It overrides `_generate_and_score_completions`, a PRIVATE method of TRL, checked
against `TRL_VERSION` only (tests/lm/test_trl_engine.py pins it); the batch is the dict that method
returns, rows prompt-major, G = num_generations per prompt.

Per generation batch the callback records, besides TRL's logs, the all-correct and all-wrong
fractions of groups and `jensen_zero_std` (chapter 6; `batch_measurements`), the share of
completion tokens with zero advantage, and every `rank_every` batches chapter 7's effective
ranks of the first group's per-rollout score rows (`first_group_ranks`). With several processes
each measures the groups wholly on its slice of the batch (per-process batch sizes that are
multiples of G keep every group whole); the main process's values are recorded, and only it
evaluates (with DDP; under FSDP or ZeRO-3 pass evaluate=None).

Chapter: :doc:`/book/11_gsm8k` (TRL as the engine)
"""

import torch
from transformers import TrainerCallback
from trl import GRPOTrainer

from grpo_companion.core.advantages import zero_advantage_fractions
from grpo_companion.core.spectra import gram_singular_values, rank_measures
from grpo_companion.lm.rollouts import Rollouts
from grpo_companion.lm.streaming_gram import rollout_gram

TRL_VERSION = "1.16.0"  # `_generate_and_score_completions` was read in this version
BOOK_METRICS = ("jensen_zero_std",)  # besides the companion's METRICS it fills in
RANK_METRICS = ("rank/entropy", "rank/stable", "rank/energy_90", "rank/energy_99")


class BookMeasurements(TrainerCallback):
    """Collects per-batch measurements (`batch_measurements`, `first_group_ranks`) and held-out
    accuracies.

    num_generations: G. rank_every: measure ranks every that many batches (0: never).
    evaluate: optional ``evaluate(model) -> float``, called after the updates of batch s when
    s is a multiple of `eval_every` or the last batch. num_iterations: TRL optimizer steps per
    batch (mu). `records[s]` holds batch s's measurements (s = 1, 2, ...).
    """

    def __init__(
        self,
        num_generations: int,
        *,
        rank_every: int = 0,
        evaluate=None,
        eval_every: int = 1,
        num_iterations: int = 1,
    ):
        self.num_generations = num_generations
        self.rank_every = rank_every
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.num_iterations = num_iterations
        self.records: dict[int, dict] = {}
        self.rewards: list[float] = []  # of the completions scored since the last batch

    def recording(self, reward_func):
        """`reward_func` (TRL's signature), storing the rewards it returns for the callback."""

        def recorded(*args, **kwargs):
            rewards = reward_func(*args, **kwargs)
            self.rewards.extend(rewards)
            return rewards

        recorded.__name__ = getattr(reward_func, "__name__", "reward")
        return recorded

    def observe_batch(self, model, batch: dict, temperature: float) -> dict:
        """Measure one generation batch (the dict of `_generate_and_score_completions`)."""
        G = self.num_generations
        record = batch_measurements(self.rewards, batch["advantages"], batch["completion_mask"], G)
        self.rewards = []
        step = len(self.records) + 1
        if self.rank_every and step % self.rank_every == 0:
            record.update(first_group_ranks(model, batch, G, temperature))
        self.records[step] = record
        return record

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.evaluate is None or state.global_step % self.num_iterations:
            return
        step = state.global_step // self.num_iterations
        last = state.max_steps // self.num_iterations
        if (step % self.eval_every == 0 or step == last) and state.is_world_process_zero:
            was_training = model.training
            model.eval()
            self.records.setdefault(step, {})["eval_accuracy"] = self.evaluate(model)
            model.train(was_training)


def batch_measurements(rewards, advantages, completion_mask, num_generations: int) -> dict:
    """all_correct, all_wrong, jensen_zero_std, zero_advantage_token_share of one batch.

    jensen_zero_std is the mean over groups of p^G + (1 - p)^G at the group's empirical pass
    rate p: a plug-in estimate of the degenerate rate of fresh groups, biased (a degenerate
    group's own p is 0 or 1 and gives a term of 1); chapter 6 derives the exact expectation.
    zero_advantage_token_share counts completion tokens whose advantage is 0 (zero-std groups,
    and mean-valued completions): they carry no policy gradient.

    rewards: N = B * G floats, prompt-major (an empty list: no reward seen, those three are
    None); advantages: (N,); completion_mask: (N, T)."""
    zero = zero_advantage_fractions(advantages, completion_mask)
    record = {"zero_advantage_token_share": zero["tokens"]}
    if len(rewards) == 0 or len(rewards) % num_generations:
        return {**record, "all_correct": None, "all_wrong": None, "jensen_zero_std": None}
    groups = torch.tensor(rewards, dtype=torch.float64).view(-1, num_generations)  # (B, G)
    p = groups.mean(dim=1)
    # `core.exact.degenerate_rate`'s f(p), written on the tensor: numpy's pow differs in the last
    # bit from torch's, and the recorded values stay those of earlier runs.
    return {
        **record,
        "all_correct": (groups == 1).all(dim=1).double().mean().item(),
        "all_wrong": (groups == 0).all(dim=1).double().mean().item(),
        "jensen_zero_std": (p**num_generations + (1 - p) ** num_generations).mean().item(),
    }


def group_rollouts(batch: dict, num_generations: int, temperature: float) -> Rollouts:
    """The first group of a TRL generation batch as the companion's `Rollouts` (no rewards)."""
    rows = slice(0, num_generations)
    completion_mask = batch["completion_mask"][rows]
    lengths = completion_mask.sum(dim=1)
    return Rollouts(
        prompt_ids=batch["prompt_ids"][:1],
        prompt_mask=batch["prompt_mask"][:1],
        completion_ids=batch["completion_ids"][rows],
        completion_mask=completion_mask,
        log_probs=None,
        lengths=lengths,
        truncated=torch.zeros_like(lengths, dtype=torch.bool),  # not used by the Gram
        texts=[""] * num_generations,
        rewards=torch.zeros(1, num_generations),
        num_generations=num_generations,
        temperature=temperature,
    )


def first_group_ranks(model, batch: dict, num_generations: int, temperature: float) -> dict:
    """{"rank/<measure>": value} of the first group's per-rollout gradients (chapter 7)."""
    was_training = model.training
    model.eval()  # per-rollout rows need no dropout
    try:
        gram = rollout_gram(model, group_rollouts(batch, num_generations, temperature))
    finally:
        model.train(was_training)
    measures = rank_measures(gram_singular_values(gram.cpu()))
    return {f"rank/{name}": float(value) for name, value in measures.items()}


class MeasuredGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` that hands each training generation batch to a `BookMeasurements`
    (`measurements=`, also added as a callback). Wrap the reward function with
    ``measurements.recording(...)`` for the reward-based measurements."""

    def __init__(self, *args, measurements: BookMeasurements, **kwargs):
        super().__init__(*args, **kwargs)
        self.measurements = measurements
        self.add_callback(measurements)

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training:  # not TRL's own evaluation
            self.measurements.observe_batch(self.model, batch, self.temperature)
        return batch
