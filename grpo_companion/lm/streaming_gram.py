"""The Gram matrix of a batch's score rows, streamed: S S^T without ever holding S.

`score_grams` accumulates G = S S^T = sum over parameters p of S_p S_p^T during ONE batched
forward and backward pass. A hook on each module that owns a selected parameter keeps its input
and receives the gradient of its output; a rollout's gradient of a Linear or Embedding weight is
then a sum of outer products over the rollout's tokens (Goodfellow 2015, "Efficient
per-example gradient computations"), and G is formed from them in one of two ways:

  materialise  form the per-rollout gradient chunk by chunk (at most `max_block_elements`
               numbers), add B B^T to G, free B;
  ghost        never form a gradient: inner products of the token factors (the "ghost norm" of
               Li et al. 2022, for every pair of rollouts).

"auto" picks the cheaper one per parameter (the layerwise choice of Bu et al. 2022): short groups
and the vocabulary matrix go ghost, long completions materialise. Other small parameters (norm
scales) get a backward pass through their module per rollout. The backward is taken with respect
to the input embeddings only, so memory is the activations of the pass plus O(R^2). G is
accumulated in float64: squaring costs precision for the small singular values. `rollout_gram`
applies it to a `rollouts.Rollouts` batch; `grams_by_layer` sums the per-parameter Grams.
The materialised rows themselves are `grpo_companion.lm.gradients.score_rows`.

Chapter: :doc:`/book/07_rank`
"""

from functools import reduce

import torch
from torch import Tensor, nn

from grpo_companion.core.spectra import weighted_gram
from grpo_companion.lm.gradients import causal_attention_mask, layer_of, select_parameters
from grpo_companion.lm.scoring import sequence_log_probs


def grams_by_layer(grams: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-parameter Gram matrices summed into per-layer ones (Grams of column blocks add)."""
    layers = {}
    for name, gram in grams.items():
        layers[layer_of(name)] = layers.get(layer_of(name), 0) + gram
    return layers


class _Call:
    """One forward call of a module owning selected parameters: its input, then its output's
    gradient, per rollout along dimension 0."""

    def __init__(self, module: nn.Module, inputs: Tensor):
        self.module, self.inputs, self.grad = module, inputs, None


GRAM_METHODS = ("auto", "ghost", "materialise")


def score_grams(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    *,
    include: str | None = None,
    temperature: float = 1.0,
    method: str = "auto",
    max_block_elements: int = 2**22,
) -> dict[str, Tensor]:
    """Per-parameter Gram matrices of the score rows, {name: S_p S_p^T `(R, R)` float64}, from
    one batched forward and backward pass, never holding S (see the module docstring).

    Their sum is S S^T of `score_rows(..., include=include)`; `grams_by_layer` sums per layer.
    `method` picks how a Linear or Embedding weight's Gram is formed: "ghost", "materialise"
    (in row chunks of at most `max_block_elements` numbers) or "auto", the cheaper one: ghost
    costs about (RT)^2 (rows + cols) multiply-adds, materialising RT rows cols in slower thin
    products, so ghost when RT (rows + cols) <= 2 rows cols. A tied weight sums both uses, cross
    terms included. Any other module owning a selected parameter (a norm) must take the batch as
    its only positional argument.
    """
    if method not in GRAM_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {GRAM_METHODS}")
    params = select_parameters(model, include)
    if any(p.dim() == 0 for p in params.values()):
        raise NotImplementedError("scalar parameters; select them out with `include`")
    # Every (module, attribute) holding a selected parameter: a tied weight has two owners.
    owners = {name: [] for name in params}
    by_id = {id(p): name for name, p in params.items()}
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            if id(p) in by_id:
                owners[by_id[id(p)]].append((module, attr))
    owned_by = {}  # module -> names of the selected parameters it owns
    for name, module_attrs in owners.items():
        for module, _ in module_attrs:
            owned_by.setdefault(module, []).append(name)

    num_rollouts = input_ids.shape[0]
    grams = {
        name: torch.zeros(num_rollouts, num_rollouts, dtype=torch.float64, device=p.device)
        for name, p in params.items()
    }
    calls = {module: [] for module in owned_by}
    pending = set(params)

    def flush(name, complete_only):
        uses = [(attr, c) for module, attr in owners[name] for c in calls[module]]
        if complete_only and any(c.grad is None for _, c in uses):
            return  # a tied weight waits for its other use
        # At the end, a use whose output never reached the log-probs contributes zero.
        uses = [(attr, c) for attr, c in uses if c.grad is not None]
        if uses:
            grams[name] += _parameter_gram(params[name], uses, method, max_block_elements)
        pending.discard(name)
        for module, _ in owners[name]:  # drop activations nobody needs any more
            if pending.isdisjoint(owned_by[module]):
                calls[module].clear()

    def on_forward(module, args, output):
        call = _Call(module, args[0])
        calls[module].append(call)
        if output.grad_fn is None:  # a frozen embedding: its output starts the graph
            output.requires_grad_()

        def on_grad(grad_output):
            call.grad = grad_output
            for name in owned_by[module]:
                if name in pending:
                    flush(name, complete_only=True)

        output.register_hook(on_grad)

    handles = [module.register_forward_hook(on_forward) for module in owned_by]
    try:
        with torch.enable_grad():
            embeds = model.get_input_embeddings()(input_ids)
            if not embeds.requires_grad:  # a frozen, unselected embedding
                embeds.requires_grad_()
            log_probs = sequence_log_probs(
                model,
                input_ids,
                attention_mask,
                completion_mask,
                temperature,
                causal_mask=causal_attention_mask(attention_mask, model.dtype),
                inputs_embeds=embeds,
            )
            # Rollouts don't interact, so the gradient of the sum, split by rollout along
            # dimension 0 of every activation, is each rollout's own gradient. Asking for the
            # embeddings' gradient only: autograd skips every parameter gradient.
            torch.autograd.grad(log_probs.sum(), embeds)
        for name in list(pending):  # parameters some call of which got no gradient
            flush(name, complete_only=False)
    finally:
        for handle in handles:
            handle.remove()
    return grams


def _parameter_gram(param: Tensor, uses, method: str, max_block_elements: int) -> Tensor:
    """S_p S_p^T `(R, R)` float64 of one parameter from its uses [(attribute, call)]. Float64,
    since squaring costs precision: a singular value sigma of S comes out of the Gram with
    relative error ~ eps (sigma_max / sigma)^2."""
    if not all(isinstance(call.module, (nn.Linear, nn.Embedding)) for _, call in uses):
        block = reduce(torch.add, (_module_backward(call, attr) for attr, call in uses))
        block = block.flatten(start_dim=1).double()
        return block @ block.T
    factors = [_factors(call, attr) for attr, call in uses]
    if method == "auto":
        tokens = sum(right.shape[0] * right.shape[1] for _, right in factors)  # R T
        rows, cols = param.shape[0], param[0].numel()
        method = "ghost" if tokens * (rows + cols) <= 2 * rows * cols else "materialise"
    if method == "ghost":
        return _ghost_gram(factors)
    return _materialised_gram(factors, param.shape[0], max_block_elements)


def _factors(call: _Call, attr: str) -> tuple[Tensor, Tensor]:
    """(left, right) such that rollout i's gradient of the parameter is
    sum_t left_it (outer) right_it: left `(R, T, rows)`, or `(R, T)` token ids standing for
    one-hot rows; right `(R, T, cols)`."""
    module, inputs, grad_output = call.module, call.inputs, call.grad
    if isinstance(module, nn.Embedding):
        if module.scale_grad_by_freq or module.max_norm is not None:
            raise NotImplementedError("Embedding with scale_grad_by_freq or max_norm")
        # y_t = W[id_t]: dW = sum_t onehot(id_t) (outer) D_t, and the padding row gets none.
        if module.padding_idx is not None:
            grad_output = grad_output * (inputs != module.padding_idx).unsqueeze(-1)
        return inputs, grad_output
    # y_t = W x_t + b on every token: dW = sum_t D_t (outer) x_t, db = sum_t D_t (outer) 1.
    d = grad_output.flatten(1, -2)
    if attr == "bias":
        return d, d.new_ones(*d.shape[:2], 1)
    return d, inputs.flatten(1, -2)


def _ghost_gram(factors: list[tuple[Tensor, Tensor]]) -> Tensor:
    """<sum_t a_t (outer) b_t, sum_u a'_u (outer) b'_u> = sum_{t,u} (a_t . a'_u)(b_t . b'_u)
    for every pair of rollouts and of uses, without forming a gradient. G is symmetric: each
    pair of uses is taken once, and a use with itself only for rollouts i <= j: (R + 1) / 2R
    of the arithmetic of whole (RT x RT) products."""
    num_rollouts = factors[0][1].shape[0]
    gram = torch.zeros(num_rollouts, num_rollouts, dtype=torch.float64, device=factors[0][1].device)
    for a, (left_a, right_a) in enumerate(factors):
        for b, (left_b, right_b) in enumerate(factors[a:], start=a):
            block = torch.zeros_like(gram)
            for i in range(num_rollouts):
                j = i if a == b else 0
                products = _token_inner(left_a[i], left_b[j:]) * _token_inner(
                    right_a[i], right_b[j:]
                )
                # Summed in float64: the T^2 terms cancel, their sum can be far smaller.
                block[i, j:] = products.view(right_a.shape[1], num_rollouts - j, -1).sum(
                    (0, 2), dtype=torch.float64
                )
            gram += block + block.triu(1).T if a == b else block + block.T
    return gram


def _token_inner(a: Tensor, b: Tensor) -> Tensor:
    """Inner products of the per-token factors `(..., T, K)` of a and b, `(tokens of a,
    tokens of b)`; integer factors `(..., T)` are token ids standing for one-hot rows."""
    a = a.flatten(0, -2) if a.is_floating_point() else a.flatten()
    b = b.flatten(0, -2) if b.is_floating_point() else b.flatten()
    if a.is_floating_point() and b.is_floating_point():
        return a @ b.T
    if a.is_floating_point():  # <a_t, onehot(b_u)> = a_t[b_u]
        return a[:, b]
    if b.is_floating_point():
        return b[:, a].T
    return a[:, None] == b[None, :]


def _materialised_gram(factors, num_rows: int, max_block_elements: int) -> Tensor:
    """sum of B B^T over row chunks B `(R, rows, cols)` of the per-rollout gradients."""
    num_rollouts, _, cols = factors[0][1].shape
    chunk = max(1, max_block_elements // (num_rollouts * cols))
    gram = torch.zeros(num_rollouts, num_rollouts, dtype=torch.float64, device=factors[0][1].device)
    for start in range(0, num_rows, chunk):
        rows = range(start, min(start + chunk, num_rows))
        block = reduce(torch.add, (_gradient_rows(*f, rows) for f in factors))
        # float64: a float32 product over a million columns keeps about 5 digits.
        block = block.flatten(start_dim=1).double()
        gram += block @ block.T
    return gram


def _gradient_rows(left: Tensor, right: Tensor, rows: range) -> Tensor:
    """Rows `rows` of sum_t left_t (outer) right_t per rollout, `(R, len(rows), cols)`."""
    if left.is_floating_point():
        return torch.bmm(left[..., rows.start : rows.stop].transpose(1, 2), right)
    inside = (left >= rows.start) & (left < rows.stop)
    rollout = torch.arange(left.shape[0], device=left.device)[:, None].expand_as(left)
    block = right.new_zeros(left.shape[0], len(rows), right.shape[-1])
    return block.index_put_(
        (rollout[inside], left[inside] - rows.start), right[inside], accumulate=True
    )


def _module_backward(call: _Call, attr: str) -> Tensor:
    """Per-rollout gradient `(R, *shape)` of `call.module.<attr>` by the module's own backward on
    each rollout's slice, for small modules (a norm's scale). `forward`, not `__call__`, so that
    the hooks don't see these calls. (One backward with R one-hot cotangents,
    `is_grads_batched`, does R times the arithmetic and was slower.)"""
    module, inputs, grad_output = call.module, call.inputs, call.grad
    param = getattr(module, attr)
    requires_grad = param.requires_grad
    param.requires_grad_(True)
    try:
        with torch.enable_grad():
            return torch.stack(
                [
                    torch.autograd.grad(
                        module.forward(inputs[i : i + 1].detach()), param, grad_output[i : i + 1]
                    )[0]
                    for i in range(inputs.shape[0])
                ]
            )
    finally:
        param.requires_grad_(requires_grad)


def rollout_gram(model: nn.Module, rollouts, length_normalised: bool = True) -> Tensor:
    """`(N, N)` float64 Gram matrix of the score rows of a `rollouts.Rollouts` batch, all
    parameters, by `score_grams` in one pass; rows divided by the completion's length L_i when
    `length_normalised` (loss_type "grpo" weighs rollout i's log-prob by 1 / L_i, so these are
    the rows whose advantage-weighted sum is the gradient). Rollouts are prompt-major:
    `diagonal_blocks(gram, rollouts.num_generations)` are the per-prompt Grams."""
    grams = score_grams(
        model,
        rollouts.input_ids,
        rollouts.attention_mask,
        rollouts.completion_mask,
        temperature=rollouts.temperature,
    )
    gram = sum(grams.values())
    if not length_normalised:
        return gram
    return weighted_gram(gram, 1 / rollouts.completion_mask.sum(dim=1).clamp(min=1))
