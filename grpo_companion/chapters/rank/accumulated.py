r"""Chapter 7, section 10: the rank of the accumulated update of a GRPO run.

Over a full-fine-tuning run every weight matrix W of the attention and MLP projections (q, k, v,
o, gate, up, down in each layer) moves by

    Delta W_t = W_t - W_0          (the accumulated update after t steps)

while each step sees its gradient G_t = d loss / d W (`trainer.grpo_step`). Both are measured
by their singular values through `core.spectra`'s stable rank and entropy effective rank, and by
the share of the top singular direction, sigma_1^2 / sum_k sigma_k^2 (`top_share`, which is
1 / stable rank; the top r directions: `top_share(..., r)`). Related work measures the same
updates in its own terms, which `changed_fraction` (the share of parameters that moved, in
float32 and after rounding both ends to bfloat16), `numerical_rank_fraction` (the numerical
rank of Delta W over its largest possible rank) and `truncated_weights` (W_0 plus the best
rank-r part of Delta W, whose held-out accuracy says how much of the gain r directions carry)
compute here.
"""

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from grpo_companion.core.spectra import effective_rank, stable_rank
from grpo_companion.core.stats import mean_interval

LAYER_TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MATRICES = ("gradient", "accumulated")  # G_t and W_t - W_0


def projection_names(model: nn.Module) -> list[str]:
    """Names of the weight matrices of every attention and MLP projection of a Llama-like model
    (`LAYER_TYPES`), in `named_parameters` order."""
    return [
        name
        for name, parameter in model.named_parameters()
        if parameter.dim() == 2 and name.rsplit(".", 2)[-2] in LAYER_TYPES
    ]


def layer_type(name: str) -> str:
    """The projection a weight belongs to: "up_proj" for "model.layers.2.mlp.up_proj.weight"."""
    return name.rsplit(".", 2)[-2]


def layer_index(name: str) -> int:
    """The layer a weight belongs to: 2 for "model.layers.2.mlp.up_proj.weight"."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def top_share(singular_values: Tensor, rank: int = 1) -> Tensor:
    """Share of sum_k sigma_k^2 held by the `rank` largest singular values, `(..., k)` -> `(...)`:
    the energy of the best rank-r approximation (Eckart-Young). 1 / stable rank for r = 1; 0 for
    the zero matrix."""
    squares = singular_values.square().sort(dim=-1, descending=True).values
    total = squares.sum(dim=-1)
    top = squares[..., :rank].sum(dim=-1)
    return torch.where(total > 0, top / torch.where(total > 0, total, 1), 0)


def spectrum_measures(singular_values: Tensor) -> dict[str, float]:
    """{"stable", "entropy", "top_share"} of one matrix's singular values `(k,)`."""
    return {
        "stable": stable_rank(singular_values).item(),
        "entropy": effective_rank(singular_values).item(),
        "top_share": top_share(singular_values).item(),
    }


def matrix_spectra(model: nn.Module, initial: dict[str, Tensor], step: int) -> list[dict]:
    """One row per (matrix, kind) for the projections named in `initial` ({name: W_0}): the
    singular values, descending, of the gradient the last step left in `.grad` and of
    W_t - W_0, with the step, the layer type and index, and the matrix's shape. Computed in
    float32 (errors about 1e-7 of the largest, far below `numerical_rank_fraction`'s tolerance),
    returned as float64. A clipped gradient is the same matrix scaled: its spectrum's shape is
    unchanged."""
    parameters = dict(model.named_parameters())
    rows = []
    for name, start in initial.items():
        parameter = parameters[name]
        matrices = {"gradient": parameter.grad, "accumulated": parameter.detach() - start}
        for kind, matrix in matrices.items():
            values = torch.linalg.svdvals(matrix.float()).double() if matrix is not None else None
            rows.append(
                {
                    "step": step,
                    "matrix": name,
                    "layer_type": layer_type(name),
                    "layer": layer_index(name),
                    "kind": kind,
                    "shape": tuple(start.shape),
                    "singular_values": None if values is None else values.cpu().numpy(),
                }
            )
    return rows


def spectra_frame(rows: list[dict]) -> pd.DataFrame:
    """`matrix_spectra` rows (with a "seed" column added by the caller) with their
    `spectrum_measures` as columns stable, entropy, top_share; the singular values dropped."""
    frame = pd.DataFrame(rows)
    measures = [
        spectrum_measures(torch.as_tensor(values))
        if values is not None
        else dict.fromkeys(("stable", "entropy", "top_share"), np.nan)
        for values in frame["singular_values"]
    ]
    return pd.concat([frame.drop(columns="singular_values"), pd.DataFrame(measures)], axis=1)


def mean_normalised_spectrum(rows: list[dict], kind: str, kind_of_layer: str, step: int,
                             length: int) -> np.ndarray:  # fmt: skip
    """Mean over the matrices of one layer type (all layers, all seeds) of sigma_k / sigma_1,
    k = 1..`length`, of the `kind` matrix at `step`: the shape of the spectrum, whatever its
    scale. `rows` are `matrix_spectra` rows."""
    spectra = [
        row["singular_values"][:length] / row["singular_values"][0]
        for row in rows
        if row["kind"] == kind
        and row["layer_type"] == kind_of_layer
        and row["step"] == step
        and row["singular_values"] is not None
        and row["singular_values"][0] > 0
    ]
    return np.mean(spectra, axis=0) if spectra else np.full(length, np.nan)


def numerical_rank_fraction(singular_values, shape: tuple[int, int]) -> float:
    """Numerical rank of a float32 (out, in) matrix over min(out, in): the singular values above
    sigma_1 max(out, in) eps_float32 (`torch.linalg.matrix_rank`'s default tolerance). About 1
    for a generic dense update, however concentrated its energy (Mukherjee et al. measure this)."""
    values = np.asarray(singular_values, dtype=np.float64)
    if values.size == 0 or values[0] == 0:
        return 0.0
    tolerance = values[0] * max(shape) * torch.finfo(torch.float32).eps
    return float((values > tolerance).sum() / min(shape))


def changed_fraction(initial: dict[str, Tensor], final: dict[str, Tensor],
                     dtype: torch.dtype | None = None) -> float:  # fmt: skip
    """Share of the entries of the tensors `initial` that differ in `final` ({name: tensor}),
    compared as stored (`dtype` None) or after rounding both to `dtype` (bfloat16: the
    precision RL checkpoints are often saved in, where an update below half a unit in the last
    place of the weight disappears)."""
    changed = total = 0
    for name, start in initial.items():
        end = final[name]
        if dtype is not None:
            start, end = start.to(dtype), end.to(dtype)
        changed += (start != end).sum().item()
        total += start.numel()
    return changed / total


def truncated_weights(initial: dict[str, Tensor], final: dict[str, Tensor],
                      rank: int) -> dict[str, Tensor]:  # fmt: skip
    """{name: W_0 + the best rank-`rank` approximation of W_T - W_0} (truncated SVD, float64,
    back to W_0's dtype): the run's update with only its top `rank` directions per matrix."""
    weights = {}
    for name, start in initial.items():
        delta = (final[name] - start).double()
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        low_rank = (u[:, :rank] * s[:rank]) @ vh[:rank]
        weights[name] = (start.double() + low_rank).to(start.dtype)
    return weights


def truncation_records(full_runs: dict, ranks, initial_accuracy: float,
                       confidence: float = 0.95) -> dict:  # fmt: skip
    """How much of full fine-tuning's held-out gain the top r directions of its update carry,
    from tracked runs ({seed: result with "accuracy" and "truncated_accuracy" {r: accuracy}}):
    per r in `ranks`, "accumulated_rank<r>_minus_full" (+ "_low", "_high": the paired t interval
    over seeds of truncated minus full accuracy) and "accumulated_rank<r>_recovered", the mean
    gain of the truncated models over the mean gain of the full ones: None unless the full
    runs' gain has a t interval above 0 (a share of no gain is no measurement)."""
    seeds = sorted(full_runs)
    full = np.array([full_runs[s]["accuracy"] for s in seeds])
    full_gain = mean_interval(full - initial_accuracy, confidence)
    learned = full_gain["low"] is not None and full_gain["low"] > 0
    records = {}
    for rank in ranks:
        truncated = np.array([full_runs[s]["truncated_accuracy"][rank] for s in seeds])
        difference = mean_interval(truncated - full, confidence)
        key = f"accumulated_rank{rank}"
        records[f"{key}_minus_full"] = difference["mean"]
        records[f"{key}_minus_full_low"] = difference["low"]
        records[f"{key}_minus_full_high"] = difference["high"]
        records[f"{key}_recovered"] = (
            float((truncated.mean() - initial_accuracy) / full_gain["mean"]) if learned else None
        )
    return records
