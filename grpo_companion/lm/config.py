"""GRPO's settings under TRL's names: `GRPOConfig`, its checks, and what it passes to the loss.

`GRPOConfig` holds every setting of `trainer.train` and `trainer.grpo_step`, named as in TRL's
``GRPOConfig`` where TRL has the setting, and refuses when it is built a setting or a combination
the trainer does not define; its docstring says where the bookkeeping differs from TRL's.
`loss_options` is the part of it that `losses.grpo_loss` takes.

Chapter: :doc:`/book/04_testbed` (section 3)
"""

from dataclasses import dataclass

from grpo_companion.core.advantages import METHODS, SCALE_REWARDS, SCALE_REWARDS_ALIASES
from grpo_companion.core.importance import (
    IMPORTANCE_SAMPLING_LEVELS,
    VLLM_IMPORTANCE_SAMPLING_MODES,
)
from grpo_companion.core.losses import LOSS_TYPES

# One advantage per completion; per token from the steps; the steps' labels shuffled within each
# group (a placebo); the steps' advantages divided by their number.
CREDITS = ("outcome", "process", "process_placebo", "process_per_step", "value")


# The defaults of `GRPOConfig` that differ from TRL 1.16's in what a step computes: {name: (ours,
# TRL's)}. tests/lm/test_trl_defaults.py compares every shared field with TRL's own dataclass.
DEFAULTS_UNLIKE_TRL = {
    "loss_type": ("grpo", "dapo"),
    "max_completion_length": (256, 512),
    "use_bias_correction_kl": (False, True),
    "vllm_importance_sampling_correction": (False, True),
}
# ... and those that only run the run: how long, when to save, the seed.
RUN_DEFAULTS_UNLIKE_TRL = {"max_steps": (100, -1), "save_steps": (0, 500), "seed": (0, 42)}


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO hyper-parameters, with TRL's names where TRL has the setting.

    Where the bookkeeping differs from TRL's: TRL's ``per_device_train_batch_size`` counts
    *completions* and a TRL step is one optimizer update; here a step is one batch of rollouts,
    ``per_step_prompts * num_generations`` completions (TRL: ``per_device_train_batch_size *
    gradient_accumulation_steps`` on one process with ``steps_per_generation =
    gradient_accumulation_steps``, TRL's default: one generation batch per optimizer update),
    followed by ``num_iterations`` full-batch updates. So with ``num_iterations = 1`` the two
    count steps alike. ``micro_batch_size`` (completions per forward-backward pass) is TRL's
    ``per_device_train_batch_size``. For every loss type but "bnpo" it changes memory, not the
    gradient: micro-batch losses are weighted by their share of the loss's normaliser. (And
    speed: micro-batches of whole groups, a multiple of ``num_generations``, run each prompt once
    for its group, `scoring.completion_logits`; the gradient is the same to float32 rounding.)
    "bnpo" is TRL's (and verl's legacy "token-mean"): each micro-batch's token mean, averaged
    over the micro-batches, so there ``micro_batch_size`` changes the gradient whenever the
    micro-batches hold different numbers of tokens. ``rollout_batch_size`` is the same for
    sampling; it changes which random numbers each completion draws (not their distribution), so
    it is part of what a seed reproduces. ``length_bucket_size`` (not in TRL, which pads every
    completion of a micro-batch to the longest, or with ``padding_free`` flattens them for flash
    attention): with whole groups, each micro-batch's completions run sorted by length, this many
    at a time, each bucket padded to its own longest (`scoring.completion_logits`): the same
    gradient to float32 rounding for about a quarter less work on chapter 11's batches; None pads
    as TRL does.

    The defaults that differ from TRL 1.16's in what a step computes (`DEFAULTS_UNLIKE_TRL`,
    held to TRL's `GRPOConfig` by tests/lm/test_trl_defaults.py): ``loss_type`` "grpo" (TRL
    "dapo"), ``max_completion_length`` 256 (TRL 512), ``use_bias_correction_kl`` False (TRL
    True: it changes the gradient only when beta > 0, and then only off-policy or once the policy
    has left the reference) and ``vllm_importance_sampling_correction`` False (TRL True; there is
    no vLLM here); besides, the run's ``max_steps``, ``save_steps`` and ``seed``. Set them to
    TRL's values to match TRL.

    ``credit="process"`` is not in TRL, whose advantages are one per sequence: it is
    DeepSeekMath's process supervision (Shao et al. 2024, sec. 4.1.3), each step of the
    reference solution rewarded where the completion writes it, the group's step rewards
    normalised together, and a token's advantage the sum of those of the steps that end at or
    after it (`advantages.process_advantages`). It needs the training problems' answer fields
    (`trainer.train` passes them to `trainer.grpo_step`). ``"process_placebo"`` shuffles the
    worked steps' rewards within each group (`advantages.shuffle_step_rewards`: the same density
    and multiset of labels, no information); ``"process_per_step"`` gives each token the mean
    instead of the sum of the normalised rewards of the steps still ahead
    (`advantages.per_step_process_advantages`). ``"value"`` gives each token the GAE advantage
    of a critic learned from outcome rewards only (`critic.Critic`, which `trainer.grpo_step`
    then takes): credit without step labels.

    A sampler that is not the policy (TRL's vLLM importance sampling, chapter 13): ``top_p < 1``
    samples from the renormalised nucleus while the loss differentiates the full softmax, as TRL
    with vLLM does. ``vllm_importance_sampling_correction=True`` then computes pi_old's
    log-probs before the update, the sampler's own (`trainer.sampling_log_probs`), and TRL's
    weights (``vllm_importance_sampling_mode``, ``_clip_max``, ``_clip_min``;
    `core.importance.vllm_importance_weights`), and multiplies each token's policy loss by its
    weight, as TRL does (through the advantage, `core.importance.weighted_advantages`; so a
    token of weight 0 never counts as clipped in "clip_ratio/*", where TRL counts it). Off by
    default (TRL's default is True, but applies only with vLLM): the step is then the same as
    without these settings.
    """

    # Sampling
    num_generations: int = 8  # G, completions per prompt
    per_step_prompts: int = 16  # B; TRL: per_device_train_batch_size * grad_accum = B * G
    max_completion_length: int = 256
    temperature: float = 1.0
    # Advantages (advantages.py)
    method: str = "grpo"  # one of advantages.METHODS
    scale_rewards: str | bool = "group"  # TRL's True / False mean "group" / "none"
    filter_degenerate: bool = False  # drop zero-std groups from the loss (DAPO)
    mask_truncated_completions: bool = False  # truncated completions out of the loss (DAPO)
    credit: str = "outcome"  # or "process": step-level credit (not in TRL; docstring)
    # Loss (losses.py)
    loss_type: str = "grpo"
    beta: float = 0.0  # KL coefficient; 0 means no reference model is kept
    use_bias_correction_kl: bool = False  # KL times the ratio pi/pi_old; TRL 1.16's default: True
    kl_clamp: bool = False  # verl's bounds on k3 (kl.kl_penalty); not in TRL
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (symmetric clipping)
    delta: float | None = None  # two-sided clipping (verl: dual-clip clip_ratio_c)
    importance_sampling_level: str = "token"  # "sequence": GSPO
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's off-policy sequence mask
    # A sampler that is not the policy, and TRL's correction for it (docstring)
    top_p: float = 1.0  # the sampler's nucleus; the loss's log-probs stay the full softmax's
    vllm_importance_sampling_correction: bool = False  # TRL: True, applied with vLLM only
    vllm_importance_sampling_mode: str = "sequence_mask"  # core.importance's modes
    vllm_importance_sampling_clip_max: float | None = 3.0  # TRL's deprecated name: ..._cap
    vllm_importance_sampling_clip_min: float | None = None
    sapo_temperature_pos: float = 1.0  # loss_type "sapo" only
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0  # loss_type "vespo" only
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    alpha: float | None = None  # loss_type "length_alpha" only (not in TRL)
    # Optimisation
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_iterations: int = 1  # mu, updates per batch of rollouts
    micro_batch_size: int = 64  # completions per forward-backward pass; see the docstring
    rollout_batch_size: int = 64  # completions per `generate` call
    length_bucket_size: int | None = 16  # completions per length bucket; see the docstring
    max_steps: int = 100
    # Bookkeeping
    eval_every: int = 10
    save_steps: int = 0  # checkpoint every save_steps steps (and at the end); 0: never
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # as TRL's GRPOConfig does
            object.__setattr__(self, "scale_rewards", SCALE_REWARDS_ALIASES[self.scale_rewards])
        for name, allowed in [
            ("method", METHODS),
            ("scale_rewards", SCALE_REWARDS),
            ("loss_type", LOSS_TYPES),
            ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
            ("credit", CREDITS),
            ("vllm_importance_sampling_mode", VLLM_IMPORTANCE_SAMPLING_MODES),
        ]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in (
            "num_generations",
            "per_step_prompts",
            "max_completion_length",
            "num_iterations",
            "micro_batch_size",
            "rollout_batch_size",
            "max_steps",
            "eval_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.length_bucket_size is not None and self.length_bucket_size < 1:
            size = self.length_bucket_size
            raise ValueError(f"length_bucket_size must be None or >= 1, got {size}")
        if self.num_generations < 2:
            raise ValueError(f"a group needs num_generations >= 2, got {self.num_generations}")
        for name in ("save_steps", "beta"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("temperature", "learning_rate", "epsilon"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self._check_sampler_correction()
        process_settings = {"method": "grpo", "scale_rewards": "group", "filter_degenerate": False,
                            "importance_sampling_level": "token"}  # fmt: skip
        changed = [name for name, value in process_settings.items() if getattr(self, name) != value]
        if self.credit != "outcome" and changed:
            # Process credit normalises step rewards as "grpo" does rewards; a group whose
            # outcomes agree can have mixed steps (what would filter_degenerate drop?); GSPO has
            # one ratio per sequence, the advantages here are per token.
            raise ValueError(
                f"credit={self.credit!r} needs {process_settings}; got "
                + ", ".join(f"{name}={getattr(self, name)!r}" for name in changed)
            )

    def _check_sampler_correction(self):
        """The sampler's and TRL's checks on the vLLM importance-sampling settings."""
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min ({low}) must be less than "
                f"vllm_importance_sampling_clip_max ({high})"
            )
        if not self.vllm_importance_sampling_correction:
            return
        mode = self.vllm_importance_sampling_mode
        if mode.endswith("truncate") and low is None and high is None:
            raise ValueError(f"vllm_importance_sampling_mode {mode!r} needs clip_min or clip_max")
        if self.loss_type == "vespo":
            # TRL routes the ratio into VESPO's own weights instead of multiplying the loss.
            raise ValueError("vllm_importance_sampling_correction is not implemented for vespo")
        if self.importance_sampling_level == "sequence" and mode.startswith("token"):
            # GSPO's one ratio per sequence needs one advantage per sequence (losses.py).
            raise ValueError(
                f"importance_sampling_level='sequence' needs a sequence mode, not {mode!r}"
            )


def loss_options(config: GRPOConfig) -> dict:
    """The keyword arguments of `losses.grpo_loss` that `config` sets (but the batch's sizes)."""
    names = (
        "beta", "epsilon", "epsilon_high", "loss_type", "alpha", "use_bias_correction_kl",
        "kl_clamp", "delta", "importance_sampling_level", "off_policy_mask_threshold",
    )  # fmt: skip
    options = {name: getattr(config, name) for name in names}
    if config.loss_type == "sapo":
        options.update(sapo_temperature_pos=config.sapo_temperature_pos,
                       sapo_temperature_neg=config.sapo_temperature_neg)  # fmt: skip
    if config.loss_type == "vespo":
        options.update({name: getattr(config, name) for name in (
            "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")})  # fmt: skip
    return options
