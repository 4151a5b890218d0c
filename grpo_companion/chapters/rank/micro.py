r"""Chapter 7, section 11: LoRA of rank 1, 2 and 8 against full fine-tuning, decided on the micro
model (`lm.micro`) by a non-inferiority test.

Every arm trains from one warm start of the micro model with GRPO on fresh prompts
(`lm.micro.grpo_run`), full fine-tuning or adapters on every projection (`lora.add_adapters`),
each at its own rate tuned by `lm.compare` on pilot seeds. The claim "rank 2 reaches full
fine-tuning's gain" is an "about the same" claim, so it gets a margin stated before the
confirmation: M = `margin_share` x the pilot's full fine-tuning gain in exact validation J
(`non_inferiority_margin`). An adapter is non-inferior when the one-sided 95% lower bound of
its paired difference from full fine-tuning (the two-sided 90% t interval's lower end) lies
above -M, and measurably inferior when the one-sided upper bound lies below -M.
"""

from grpo_companion.chapters.rank.lora import add_adapters, arm_name, seeds_for_margin
from grpo_companion.core.stats import mean_interval
from grpo_companion.lm import micro
from grpo_companion.lm.compare import paired_differences
from grpo_companion.lm.config import GRPOConfig


def lora_runner(start: micro.Start, grpo: dict, alpha: float, measure: str):
    """run(arm, learning_rate, seed) for `lm.compare`: arm "full" or "r<rank>" (`arm_name`),
    trained from the start's weights with `grpo` (GRPOConfig fields) and measured exactly on its
    `measure` prompts ("validation" or "test"). Returns {"start", "final", "gain"} in mean J,
    and "parameters" trained."""
    data = {"validation": start.validation, "test": start.test}[measure]
    tokenizer = micro.build_tokenizer()

    def run(arm: str, learning_rate: float, seed: int) -> dict:
        model = micro.build_model(start.spec, tokenizer)
        model.load_state_dict(start.state)
        if arm != arm_name(0):
            model = add_adapters(model, int(arm[1:]), alpha, seed)
        config = GRPOConfig(**{**grpo, "learning_rate": learning_rate, "seed": seed})
        curve = micro.grpo_run(model, tokenizer, config, start.num_steps, data,
                               modulus=start.modulus)  # fmt: skip
        first, last = curve["pass_rate"][0], curve["pass_rate"][-1]
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {"start": first, "final": last, "gain": last - first, "parameters": trained}

    return run


def non_inferiority_margin(pilot, margin_share: float) -> dict:
    """M = `margin_share` x full fine-tuning's mean gain on the pilot (its tuning runs at
    the chosen rate): {"full_gain", "margin"}; the margin is 0 when full fine-tuning gained
    nothing (no gain to be inferior to)."""
    full_gain = float(pilot.loc[pilot["arm"] == arm_name(0), "gain"].mean())
    return {"full_gain": full_gain, "margin": max(0.0, margin_share * full_gain)}


def plan_seeds(pilot, rank: int, margin: float, max_seeds: int, min_seeds: int = 3) -> dict:
    """Power before seeds, from the pilot alone: the per-seed SD of the rank's paired difference
    from full fine-tuning, the seeds `lora.seeds_for_margin` asks for at 90% (a true difference
    of 0 shown non-inferior at `margin` with 80% power; max_seeds + 1 when no number up to
    100,000 does), and the seeds to run, that many within [min_seeds, max_seeds]."""
    sd = float(paired_differences(pilot, arm_name(rank), arm_name(0), "gain").std(ddof=1))
    needed = seeds_for_margin(sd, margin, confidence=0.90)
    needed = max_seeds + 1 if needed is None else needed
    return {"sd": sd, "needed": needed, "run": int(min(max(needed, min_seeds), max_seeds))}


def lora_records(tuning, pilot_margin: dict, table, ranks, max_seeds: int) -> dict:
    """Per rank r: the paired difference from full fine-tuning in test J (mean, the two-sided
    90% t interval, whose ends are the one-sided 95% bounds), its tuned rate and whether it
    lies inside the grid, and the seeds the pilot's SD asks for (`lora.seeds_for_margin` at 90%:
    a true difference of 0 shown non-inferior with 80% power); full fine-tuning's gain with its
    95% interval, and the margin."""
    full = table.loc[table["arm"] == arm_name(0), "gain"].to_numpy()
    full_gain = mean_interval(full)
    pilot = tuning.at_choice()
    records = {
        "micro_lora_margin": pilot_margin["margin"],
        "micro_lora_pilot_full_gain": pilot_margin["full_gain"],
        "micro_lora_full_gain": full_gain["mean"],
        "micro_lora_full_gain_low": full_gain["low"],
        "micro_lora_full_gain_high": full_gain["high"],
        "micro_lora_full_learning_rate": tuning.rates[arm_name(0)],
        "micro_lora_full_lr_inside": int(tuning.choice[arm_name(0)]["inside"]),
        "micro_lora_full_tune_learned": int(bool(tuning.choice[arm_name(0)]["learned"])),
        "micro_lora_seeds_run": int(len(full)),
    }
    for rank in ranks:
        arm = arm_name(rank)
        difference = mean_interval(paired_differences(table, arm, arm_name(0), "gain"), 0.90)
        planned = plan_seeds(pilot, rank, pilot_margin["margin"], max_seeds)
        records.update({
            f"micro_lora_r{rank}_minus_full": difference["mean"],
            f"micro_lora_r{rank}_minus_full_lower": difference["low"],
            f"micro_lora_r{rank}_minus_full_upper": difference["high"],
            f"micro_lora_r{rank}_learning_rate": tuning.rates[arm],
            f"micro_lora_r{rank}_lr_inside": int(tuning.choice[arm]["inside"]),
            f"micro_lora_r{rank}_pilot_sd": planned["sd"],
            f"micro_lora_r{rank}_seeds_needed": planned["needed"],
        })  # fmt: skip
    return records
