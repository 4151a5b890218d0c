r"""Per-example gradients of a language model: the score rows of a batch of rollouts.

Rollout i (a prompt x_i and completion y_i) has the score row

    s_i = grad_theta log pi(y_i | x_i) = sum_t grad_theta log pi(y_it | x_i, y_i<t)

(t over the completion's tokens, the prompt's masked out; log pi is
`scoring.sequence_log_probs` with `causal_attention_mask`), over all P parameters or a chosen
subset (`select_parameters`: a regex on parameter names, one layer, one matrix). Stacked for R
rollouts they are the score matrix S `(R, P)`. `score_rows` materialises S, by `torch.func`
(vmap of grad, small models) or one backward pass per row (large models), for
`torch.linalg.svdvals`; the same singular values come from the Gram matrix S S^T, which
`grpo_companion.lm.streaming_gram` accumulates without holding S. In float32 LAPACK's SVD of a
wide S is off by a few percent, so take `svdvals(rows.double())` as a reference. Per-rollout
rows need the rollouts not to interact in the forward pass (no batch norm, and dropout off:
call `model.eval()`).

"Gradient matrix" can also mean the (out, in) gradient of one weight matrix, a batch gradient
and not per-rollout rows; `weight_gradient_spectra` gives its singular values.

Chapter: :doc:`/book/07_rank`
"""

import re

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from grpo_companion.lm.scoring import sequence_log_probs

# ---------------------------------------------------------------------------------------------
# Which parameters


def select_parameters(model: nn.Module, include: str | None = None) -> dict[str, nn.Parameter]:
    """The parameters whose names match the regex `include` (`re.search`; None: all).

    Names include tied aliases ("lm_head.weight" for a tied embedding), but each parameter
    appears once, under its first name: a tied weight is one parameter, and its gradient sums
    both uses. Order is `named_parameters` order, the column order of `score_rows`.
    """
    selected, seen = {}, set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen or (include is not None and not re.search(include, name)):
            continue
        seen.add(id(param))
        selected[name] = param
    if not selected:
        raise ValueError(f"no parameter name matches {include!r}")
    return selected


def layer_of(name: str) -> str:
    """ "model.layers.3.mlp.up_proj.weight" -> "model.layers.3"; names outside a layer stay."""
    match = re.match(r"(.*\.layers\.\d+)\.", name)
    return match.group(1) if match else name


# ---------------------------------------------------------------------------------------------
# log pi(y | x): `scoring.sequence_log_probs` with an explicit causal mask


def causal_attention_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """`(N, 1, L, L)` additive mask of `attention_mask: (N, L)`, for
    `scoring.sequence_log_probs(..., causal_mask=...)`: 0 where query t may see key u (u <= t,
    u not padding), else the most negative number of `dtype`.

    Built here rather than by transformers for two reasons. Its sdpa mask branches on the data
    (`mask.all()`), which `vmap` rejects; its eager mask leaves the query rows of left padding
    with no key at all, and the float32 softmax of a float64 model turns that row into NaN,
    which the padded keys then carry into every real token. Letting a padding query see
    itself fixes both and changes no real token (a real query never sees a padding key).
    """
    length = attention_mask.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=attention_mask.device)
    allowed = causal & (attention_mask[..., None, :].bool() | diagonal)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[..., None, :, :]


# ---------------------------------------------------------------------------------------------
# Materialised rows


def score_rows(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    include: str | None = None,
    method: str = "vmap",
    temperature: float = 1.0,
) -> Tensor:
    """Score rows S, `(R, P)`: row i is grad log pi(y_i | x_i) over `select_parameters(include)`,
    flattened and concatenated in that order. Inputs as in
    `scoring.sequence_log_probs`.

    method "vmap": `torch.func.vmap(grad(...))`, all rows in one vectorised pass; holds R
    gradients at once plus R sets of activations, for small models. Build them with
    `attn_implementation="eager"`: vmap has no rule for sdpa and loops over the rollouts
    inside attention instead (with a UserWarning).
    method "loop": one forward and backward pass per row, for large models.
    The weighted rows are `advantages[:, None] * rows`.
    """
    params = {name: p.detach() for name, p in select_parameters(model, include).items()}

    def log_prob(params, ids, mask, completion):  # one rollout, batch dimension restored
        log_probs = sequence_log_probs(
            model,
            ids[None],
            mask[None],
            completion[None],
            temperature,
            causal_mask=causal_attention_mask(mask[None], model.dtype),
            params=params,
        )
        return log_probs.sum(dim=1)[0]

    if method == "vmap":
        grads = vmap(grad(log_prob), in_dims=(None, 0, 0, 0))(
            params, input_ids, attention_mask, completion_mask
        )
        return torch.cat([g.flatten(start_dim=1) for g in grads.values()], dim=1)
    if method == "loop":
        first = next(iter(params.values()))
        rows = first.new_empty(input_ids.shape[0], sum(p.numel() for p in params.values()))
        params = {name: p.requires_grad_() for name, p in params.items()}
        for i in range(input_ids.shape[0]):
            row = torch.autograd.grad(
                log_prob(params, input_ids[i], attention_mask[i], completion_mask[i]),
                list(params.values()),
            )
            torch.cat([g.flatten() for g in row], out=rows[i])
        return rows
    raise ValueError(f"unknown method {method!r}; expected 'vmap' or 'loop'")


# ---------------------------------------------------------------------------------------------
# The other "gradient matrix": the batch gradient of one weight matrix


def weight_gradient_spectra(model: nn.Module, loss: Tensor, names: list[str]) -> dict[str, Tensor]:
    """{name: singular values, descending} of d loss / d W for each 2-D parameter in `names`.

    `loss` is a scalar still attached to its graph (e.g. a group's GRPO loss); this is the
    gradient an optimiser sees for the (out, in) matrix W, summed over the batch, whose rank is
    bounded by the number of tokens and not by the group size. Parameter `.grad`s stay as they
    are.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [name for name in names if name not in params]
    if missing:
        raise KeyError(f"no parameters named {missing}")
    not_matrices = [name for name in names if params[name].dim() != 2]
    if not_matrices:
        raise ValueError(f"not weight matrices (2-D): {not_matrices}")
    grads = torch.autograd.grad(loss, [params[name] for name in names])
    return {name: torch.linalg.svdvals(g.double()) for name, g in zip(names, grads)}


def representative_matrices(model: nn.Module) -> list[str]:
    """Three weight matrices of a Llama-like model: the first layer's query projection, the
    last layer's MLP down projection and the output head (those that exist)."""
    names = [name for name, p in model.named_parameters(remove_duplicate=False) if p.dim() == 2]
    picks = [
        [name for name in names if "q_proj" in name][:1],
        [name for name in names if "down_proj" in name][-1:],
        [name for name in names if name.startswith("lm_head")][:1],
    ]
    return [name for pick in picks for name in pick]
