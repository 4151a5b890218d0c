r"""Chapter 6, section 6: Sign against Dr. GRPO at G = 4, and sparsity over training, decided on
the micro model (`lm.micro`), whose pass rates are exact.

A regime is a warm start of the micro model to a chosen mean pass rate on k-step running sums
(`lm.micro.held_out_start`), with held-out prompts split into validation (the tuning's measure)
and test (the comparison's): exact J, no sampling noise in any measurement. Every arm trains
from the same weights on fresh training prompts (`lm.micro.arm_runner`), tuned and compared by
`lm.compare`. The regime is read before any training: the all-correct share of groups of G is
E_x[J(x)^G] over the test prompts, exactly (`start_shares`).

Sparsity's prediction is the exact expected GRPO flow (section 3, `flow.flow_to_pass_rate`) run
from the test prompts' own starting pass rates (no fitted Beta) until their mean has gained
what the pilot's GRPO runs gained on the validation prompts: fixed before any confirmatory run.
"""

import numpy as np
import torch

from grpo_companion.chapters.sparsity.flow import flow_to_pass_rate, predicted_change
from grpo_companion.core.stats import mean_interval
from grpo_companion.lm.compare import paired_effect


def start_shares(pass_rates: torch.Tensor, group_size: int) -> dict:
    """Exact shares of groups of G at the start: "all_correct" E[J^G], "all_wrong" E[(1-J)^G],
    "degenerate" (their sum), and "pass_rate" E[J]."""
    rates = pass_rates.double()
    all_correct = float((rates**group_size).mean())
    all_wrong = float(((1 - rates) ** group_size).mean())
    return {"pass_rate": float(rates.mean()), "all_correct": all_correct,
            "all_wrong": all_wrong, "degenerate": all_correct + all_wrong}  # fmt: skip


def flow_prediction(start, group_size: int, gain: float, sharings, *, step_size: float,
                    max_steps: int) -> dict:  # fmt: skip
    """The exact flow's change of D from the pass rates `start` (N,) until their mean has risen
    by `gain`, under every sharing; "degenerate": the change closest to 0 over the sharings
    (the least any of them predicts), "by_sharing": sharing -> that sharing's change."""
    start = np.asarray(start, dtype=np.float64).clip(1e-9, 1 - 1e-9)
    target = float(start.mean() + gain)
    by_sharing = {}
    for sharing in sharings:
        end = flow_to_pass_rate(start, group_size, sharing, target, step_size=step_size,
                                max_steps=max_steps)  # fmt: skip
        by_sharing[sharing] = predicted_change(start, end, group_size)["degenerate"]
    least = min(by_sharing.values(), key=abs)
    return {"degenerate": least, "by_sharing": by_sharing, "target": target}


def _arm(table, arm: str, column: str):
    return table.loc[table["arm"] == arm, column].to_numpy()


def sign_records(shares: dict, tuning, plan: dict, table, prefix: str) -> dict:
    """One regime's Sign comparison: its start (exact shares), the tuning's choice, the plan
    made from the pilot, and the confirmation's paired interval of Sign minus Dr. GRPO and Dr.
    GRPO's own gain (t intervals over seeds; the test prompts are the whole measure, exact)."""
    effect = paired_effect(table, "sign", "dr_grpo", "gain")
    reference = mean_interval(_arm(table, "dr_grpo", "gain"))
    sign = mean_interval(_arm(table, "sign", "gain"))
    choice = tuning.choice
    return {
        f"{prefix}pass_rate": shares["pass_rate"],
        f"{prefix}all_correct_share": shares["all_correct"],
        f"{prefix}all_wrong_share": shares["all_wrong"],
        f"{prefix}dr_grpo_learning_rate": choice["dr_grpo"]["learning_rate"],
        f"{prefix}sign_learning_rate": choice["sign"]["learning_rate"],
        f"{prefix}lr_inside": int(choice["dr_grpo"]["inside"] and choice["sign"]["inside"]),
        f"{prefix}dr_grpo_tune_learned": int(choice["dr_grpo"]["learned"]),
        f"{prefix}predicted_sign_minus_dr_grpo": plan["predicted"],
        f"{prefix}pilot_sd": plan["sd"],
        f"{prefix}seeds_needed": plan["needed"],
        f"{prefix}seeds_run": int(effect["n"]),
        f"{prefix}sign_minus_dr_grpo": effect["mean"],
        f"{prefix}sign_minus_dr_grpo_low": effect["low"],
        f"{prefix}sign_minus_dr_grpo_high": effect["high"],
        f"{prefix}dr_grpo_gain": reference["mean"],
        f"{prefix}dr_grpo_gain_low": reference["low"],
        f"{prefix}dr_grpo_gain_high": reference["high"],
        f"{prefix}sign_gain": sign["mean"],
    }


def sparsity_records(tuning, table, prediction: dict, needed: int, pilot_sd: float) -> dict:
    """GRPO's runs in the source regime as a test of "sparsity intensifies": the exact change of
    D on the test prompts (t interval over the confirmation seeds), the pass rate's gain, and the
    flow's prediction with the seeds it asks for."""
    change = mean_interval(_arm(table, "grpo", "degenerate_change"))
    gain = mean_interval(_arm(table, "grpo", "gain"))
    choice = tuning.choice["grpo"]
    return {
        "micro_grpo_learning_rate": choice["learning_rate"],
        "micro_grpo_lr_inside": int(choice["inside"]),
        "micro_degenerate_start": float(np.mean(_arm(table, "grpo", "degenerate_start"))),
        "micro_degenerate_change": change["mean"],
        "micro_degenerate_change_low": change["low"],
        "micro_degenerate_change_high": change["high"],
        "micro_grpo_gain": gain["mean"],
        "micro_grpo_gain_low": gain["low"],
        "micro_predicted_degenerate_change": prediction["degenerate"],
        "micro_flow_target": prediction["target"],
        "micro_degenerate_seeds_needed": needed,
        "micro_degenerate_pilot_sd": pilot_sd,
        "micro_degenerate_seeds_run": int(change["n"]),
    }
