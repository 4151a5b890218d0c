r"""Chapter 5: the singular values of GRPO's gradient, and which matrix has rank 2.

For one prompt x we sample a group of R completions y_1..y_R. Completion i has the score row

    s_i = grad_theta log pi(y_i | x) = sum_t grad_theta log pi(y_it | x, y_i<t)

(t over the completion's tokens, the prompt's masked out) and the advantage-weighted row
A_i s_i; stacked, they are

    scores    S = [s_1; ...; s_R]         (R, P)
    weighted  W = diag(A) S = [A_i s_i]   (R, P)
    gradient  g = W^T 1 = S^T A           (P,)   the group's policy gradient, up to the loss's
                                                 normaliser (fold 1/(R L_i) into A for "grpo")

over all P parameters or a chosen subset (a regex on parameter names: one layer, one matrix).
"Gradient matrix" can also mean the (out, in) gradient of one weight matrix, a batch gradient
and not per-rollout rows; `weight_gradient_spectra` gives its singular values.

Which matrix has rank <= 2. Take binary rewards r in {0, 1}^R, k correct with 0 < k < R, and
write 1_c, 1_w for the indicators of the correct and the incorrect completions. Every method of
`advantages.METHODS` gives equal rewards of a group equal advantages: A = a_1 1_c + a_0 1_w.

  1. g lies in span{S^T 1_c, S^T 1_w}, the row space of the class-sum matrix
     C = [1_c^T S; 1_w^T S] (2, P), whatever R:  g = S^T A = a_1 S^T 1_c + a_0 S^T 1_w.
     So the matrix of rank <= 2 is C (equivalently W with its rows summed within each reward
     class), not W.
  2. If the advantages are zero-sum (grpo, dr_grpo, rloo, softmax), k a_1 + (R - k) a_0 = 0 and
         g = a_1 k m_c + a_0 (R - k) m_w = k a_1 (m_c - m_w),
     m_c, m_w the mean scores of the correct and the incorrect completions: g is a multiple of
     the difference of the two centroids, c = k a_1 = k (R - k) / R for dr_grpo, divided by
     (std + eps) for grpo, k (R - k) / (R - 1) for rloo.
  3. W itself is NOT rank 2: rank(W) = rank(S_nz), S_nz the rows of S with A_i != 0. Proof:
     the zero rows of W add nothing to its row space, and the others are diag(A_nz) S_nz with
     diag(A_nz) invertible, which preserves rank. In a mixed binary group no advantage is 0
     (for the methods above), so rank(W) = rank(S), generically min(R, dim span{all scores}):
     it grows with R.
     Its Gram matrix is W W^T = diag(A) S S^T diag(A) (`weighted_gram`).
  4. Across groups nothing stays at 2: the (B, P) matrix of B groups' gradients has rows
     c_b (m_c,b - m_w,b), one direction per group, rank <= B. Rank 2 (item 1), or 1 (item 2),
     is a statement about one group's gradient, and it holds for any R.

The singular values of a group's rows come two ways. Materialised (`score_rows`, then
`torch.linalg.svdvals`): per-rollout gradients by `torch.func` (vmap of grad, small models) or
by one backward pass per row (large models); M (R, P) is held, 4.3 GB at R = 8, P = 135M in
float32. Streaming (`score_grams`): the R x R Gram matrix G = S S^T = sum over parameters p of
S_p S_p^T, accumulated during ONE batched forward and backward pass. A hook on each module that
owns a selected parameter keeps its input X and receives the gradient D of its output; a
rollout's gradient of a Linear weight is then sum_t D_t x_t^T, and of an Embedding
sum_t onehot(id_t) D_t^T: sums of outer products a_t b_t^T over the rollout's tokens
(Goodfellow 2015, "Efficient per-example gradient computations"). Two ways to G from them:

  materialise  form rows chunk by chunk of every rollout's gradient (at most
               `max_block_elements` numbers), add B B^T to G, free B;
  ghost        never form a gradient: <sum_t a_t b_t^T, sum_u a'_u b'_u^T>
               = sum_{t,u} (a_t . a'_u)(b_t . b'_u), two (RT x RT) products of token factors
               (the "ghost norm" of Li et al. 2022, "Large language models can be strong
               differentially private learners", here for every pair of rollouts).

Ghost costs about (RT)^2 (rows + cols) multiply-adds in square products (half that, using the
symmetry of G), materialising RT rows cols in thin ones that run about half as fast on a
CPU; "auto" takes ghost when
RT (rows + cols) <= 2 rows cols (the layerwise choice of Bu et al. 2022, "Scalable and efficient
training of large convolutional neural networks with differential privacy"): short groups and
the vocabulary matrix go ghost, long completions materialise. A tied embedding sums both uses
(the cross terms included). Norm scales and other small parameters get a backward pass through
their module per rollout. The backward is taken with respect to the input embeddings only, so
no parameter gradient is ever formed: memory is the activations of the pass (those of a GRPO
step on the group) plus O(R^2) plus one chunk or one (RT x RT) product.
sigma(S) = sqrt(eigvalsh(G)). Squaring costs precision for the small singular values (relative
error ~ eps * (sigma_max / sigma)^2), so G is accumulated in float64. That is more accurate
than the materialised route in float32: LAPACK's SVD of a float32 (8, 135M) matrix is off by
a few percent (the benchmark measures it), so `svdvals(rows.double())` for a reference.

Per-rollout rows need the rollouts not to interact in the forward pass (no batch norm, and
dropout off: call `model.eval()`).
"""

import re
from functools import reduce

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from grpo_companion.core.stats import mean_interval

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
    """"model.layers.3.mlp.up_proj.weight" -> "model.layers.3"; names outside a layer stay."""
    match = re.match(r"(.*\.layers\.\d+)\.", name)
    return match.group(1) if match else name


def grams_by_layer(grams: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-parameter Gram matrices summed into per-layer ones (Grams of column blocks add)."""
    layers = {}
    for name, gram in grams.items():
        layers[layer_of(name)] = layers.get(layer_of(name), 0) + gram
    return layers


# ---------------------------------------------------------------------------------------------
# log pi(y | x)


def completion_log_probs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    *,
    params: dict[str, Tensor] | None = None,
    inputs_embeds: Tensor | None = None,
) -> Tensor:
    """log pi(y_i | x_i) = sum of the completion's token log-probs, `(N,)`.

    `input_ids, attention_mask: (N, L)`, a left-padded prompt then T completion tokens;
    `completion_mask: (N, T)`, 1 on the tokens that count. Conventions of
    `rollouts.sequence_log_probs`: positions count real tokens only, logits / temperature.
    `params` replace the model's own (`torch.func.functional_call`); `inputs_embeds` replaces
    the embedding lookup (the streaming path differentiates with respect to it).
    """
    completion_length = completion_mask.shape[1]
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    inputs = {
        "input_ids": None if inputs_embeds is not None else input_ids,
        "inputs_embeds": inputs_embeds,
        "attention_mask": _additive_causal_mask(attention_mask, model.dtype),
        "position_ids": position_ids,
        "logits_to_keep": completion_length + 1,  # the lm head only runs where it is needed
    }
    logits = (functional_call(model, params, (), inputs) if params else model(**inputs)).logits
    # Logits at position t predict token t + 1; the last position predicts nothing. At least
    # float32 (a bfloat16 model's logits are upcast); float64 stays float64.
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1:  # else skip a copy of the largest activation
        logits = logits / temperature
    targets = input_ids[:, -completion_length:]
    token_log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return (token_log_probs * completion_mask).sum(dim=1)


def _additive_causal_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """`(N, 1, L, L)`: 0 where query t may see key u (u <= t, u not padding), else the most
    negative number of `dtype`.

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
    flattened and concatenated in that order. Inputs as in `completion_log_probs`.

    method "vmap": `torch.func.vmap(grad(...))`, all rows in one vectorised pass; holds R
    gradients at once plus R sets of activations, for small models. Build them with
    `attn_implementation="eager"`: vmap has no rule for sdpa and loops over the rollouts
    inside attention instead (with a UserWarning).
    method "loop": one forward and backward pass per row, for large models.
    The weighted rows are `advantages[:, None] * rows`.
    """
    params = {name: p.detach() for name, p in select_parameters(model, include).items()}

    def log_prob(params, ids, mask, completion):  # one rollout, batch dimension restored
        return completion_log_probs(
            model, ids[None], mask[None], completion[None], temperature, params=params
        )[0]

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
# Streaming Gram matrix


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
    (in row chunks of at most `max_block_elements` numbers) or "auto", the cheaper one. Any
    other module owning a selected parameter (a norm) must take the batch as its only
    positional argument.
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
            log_probs = completion_log_probs(
                model, input_ids, attention_mask, completion_mask, temperature,
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
    """S_p S_p^T `(R, R)` float64 of one parameter from its uses [(attribute, call)]."""
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
            return torch.stack([
                torch.autograd.grad(
                    module.forward(inputs[i : i + 1].detach()), param, grad_output[i : i + 1]
                )[0]
                for i in range(inputs.shape[0])
            ])
    finally:
        param.requires_grad_(requires_grad)


def weighted_gram(gram: Tensor, weights: Tensor) -> Tensor:
    """Gram matrix of the weighted rows diag(w) S from that of S: diag(w) G diag(w), `(..., R, R)`
    for `gram: (..., R, R)`, `weights: (..., R)`.

    With w = A it is W W^T; one score Gram serves every advantage method."""
    weights = weights.to(gram.dtype)
    return weights[..., :, None] * gram * weights[..., None, :]


def gram_singular_values(gram: Tensor) -> Tensor:
    """Singular values of M `(R, P)` from G = M M^T `(R, R)`: sqrt(eigvalsh(G)), descending.

    Rounding leaves eigenvalues of a singular G at about -eps * ||G||; they are clamped to 0."""
    eigenvalues = torch.linalg.eigvalsh(gram)
    return eigenvalues.clamp(min=0).sqrt().flip(-1)


# ---------------------------------------------------------------------------------------------
# Effective rank of a spectrum. Each takes singular values `(..., k)` (any order) and returns
# `(...)`; the zero matrix has rank 0 under all three.


def effective_rank(singular_values: Tensor) -> Tensor:
    """Entropy effective rank exp(H(p)), p_k = sigma_k / sum_j sigma_j, H = -sum p log p.

    Roy and Vetterli (2007), "The effective rank: a measure of effective dimensionality",
    EUSIPCO. Real-valued, 1 <= erank <= rank, equal to the rank iff the nonzero singular values
    are equal (n equal ones give n). Sensitive to a floor of tiny singular values: -p log p
    has infinite slope at 0, so rounding noise at relative size eps adds ~ eps log(1/eps)
    each (a float32 rank-one matrix reads 1.0000014).
    """
    total = singular_values.sum(dim=-1, keepdim=True)
    p = singular_values / torch.where(total > 0, total, 1)
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # 0 log 0 = 0
    return torch.where(total[..., 0] > 0, entropy.exp(), 0)


def stable_rank(singular_values: Tensor) -> Tensor:
    """||M||_F^2 / ||M||_2^2 = sum sigma^2 / max sigma^2.

    Rudelson and Vershynin (2007), "Sampling from large matrices: an approach through geometric
    functional analysis", J. ACM 54(4). 1 <= srank <= rank; insensitive to tiny singular values
    (they enter squared), dominated by the largest.
    """
    return _relative_to_largest(singular_values).square().sum(dim=-1)


def energy_rank(singular_values: Tensor, threshold: float = 0.9) -> Tensor:
    """Smallest k whose k largest singular values hold `threshold` of sum sigma^2, int64.

    The cumulative-percentage-of-total-variation rule for the number of principal components,
    Jolliffe (2002), "Principal Component Analysis", 2nd ed., section 6.1.1; 90% and 99% here.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    squares = _relative_to_largest(singular_values).square().sort(dim=-1, descending=True).values
    cumulative = squares.cumsum(dim=-1)
    total = cumulative[..., -1:]
    # Rounding can leave the full cumulative sum a hair under threshold * total when
    # threshold = 1; the clamp makes that k = all singular values.
    k = (cumulative < threshold * total).sum(dim=-1) + 1
    return torch.where(total[..., 0] > 0, k.clamp(max=squares.shape[-1]), 0)


def _relative_to_largest(singular_values: Tensor) -> Tensor:
    """sigma / max sigma (zeros stay zeros), so that squaring neither under- nor overflows."""
    top = singular_values.amax(dim=-1, keepdim=True)
    return singular_values / torch.where(top > 0, top, 1)


# ---------------------------------------------------------------------------------------------
# The other "gradient matrix": the batch gradient of one weight matrix


def weight_gradient_spectra(model: nn.Module, loss: Tensor, names: list[str]) -> dict[str, Tensor]:
    """{name: singular values, descending} of d loss / d W for each 2-D parameter in `names`.

    `loss` is a scalar still attached to its graph (e.g. a group's GRPO loss); this is the
    gradient an optimiser sees for the (out, in) matrix W, summed over the batch, whose rank is
    bounded by the number of tokens and not by R. Parameter `.grad`s are left untouched.
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


# ---------------------------------------------------------------------------------------------
# The mechanism (items 1-2 of the module docstring)


def group_gradient(scores: Tensor, advantages: Tensor) -> Tensor:
    """g = sum_i A_i s_i = S^T A, `(P,)`, for `scores: (R, P)`, `advantages: (R,)`."""
    return advantages.to(scores.dtype) @ scores


def class_sums(scores: Tensor, rewards: Tensor) -> Tensor:
    """C = [sum of the correct scores; sum of the incorrect scores], `(2, P)`, for binary
    `rewards: (R,)`. rank(C) <= 2 and the group gradient lies in its row space."""
    correct = _correct(rewards)
    return torch.stack([scores[correct].sum(dim=0), scores[~correct].sum(dim=0)])


def centroid_difference(scores: Tensor, rewards: Tensor) -> Tensor:
    """m_c - m_w, mean correct score minus mean incorrect score, `(P,)`, of a mixed group."""
    correct = _correct(rewards, mixed=True)
    return scores[correct].mean(dim=0) - scores[~correct].mean(dim=0)


def centroid_coefficient(rewards: Tensor, advantages: Tensor) -> float:
    """c = k a_1 with g = c (m_c - m_w), for a mixed group's binary `rewards: (R,)` and zero-sum
    `advantages` equal within each reward class: k (R - k) / R for dr_grpo."""
    correct = _correct(rewards, mixed=True)
    tolerance = 100 * torch.finfo(advantages.dtype).eps * advantages.abs().max().item()
    for same_class in (advantages[correct], advantages[~correct]):
        if (same_class - same_class[0]).abs().max() > tolerance:
            raise ValueError("advantages differ within a reward class")
    if abs(advantages.sum().item()) > len(advantages) * tolerance:
        raise ValueError(f"advantages are not zero-sum (sum {advantages.sum().item():.3g})")
    return correct.sum().item() * advantages[correct][0].item()


def _correct(rewards: Tensor, mixed: bool = False) -> Tensor:
    if rewards.dim() != 1 or not ((rewards == 0) | (rewards == 1)).all():
        raise ValueError("rewards must be one group's binary rewards, shape (R,), values {0, 1}")
    correct = rewards == 1
    if mixed and (correct.all() or not correct.any()):
        raise ValueError("a group with one reward value has no centroid difference")
    return correct


# ---------------------------------------------------------------------------------------------
# Which matrix? The candidates, measured on many groups


RANK_MEASURES = ("entropy", "stable", "energy_90", "energy_99")
GROUP_CANDIDATES = ("scores", "weighted", "level_sums")


def rank_measures(singular_values: Tensor) -> dict[str, Tensor]:
    """{measure: `(...)`} of singular values `(..., k)`: the four rank measures above."""
    return {
        "entropy": effective_rank(singular_values),
        "stable": stable_rank(singular_values),
        "energy_90": energy_rank(singular_values, 0.9),
        "energy_99": energy_rank(singular_values, 0.99),
    }


def mixed_gram(gram: Tensor, mixing: Tensor) -> Tensor:
    """Gram matrix of the rows E S from that of S: E G E^T, `mixing: (..., k, R)`, `gram:
    (..., R, R)` -> `(..., k, k)`."""
    mixing = mixing.to(gram.dtype)
    return mixing @ gram @ mixing.transpose(-1, -2)


def reward_levels(rewards: Tensor) -> Tensor:
    """Indicators of the distinct reward values of each group, `rewards: (..., R)` ->
    `(..., R, R)` bool: row j marks the completions with the j-th largest distinct reward;
    rows past the number of distinct values are zero.

    E S sums the score rows within each reward level. With binary rewards it is the class-sum
    matrix C (2 rows, 1 for a degenerate group); with continuous ones up to R rows. Any
    advantage that is a function of the reward puts the group gradient in its row space. The
    zero rows add zero singular values, which no rank measure counts.
    """
    ordered = rewards.sort(dim=-1, descending=True).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    # A repeated value becomes -inf, which sorts last and equals no reward: a zero row.
    levels = ordered.masked_fill(~first, -torch.inf).sort(dim=-1, descending=True).values
    return levels[..., :, None] == rewards[..., None, :]


def group_candidate_grams(gram: Tensor, rewards: Tensor, advantages: Tensor) -> dict[str, Tensor]:
    """The `(..., R, R)` Gram matrices of the three per-group candidates, from the Gram matrix of
    one group's score rows `gram: (..., R, R)`, `rewards, advantages: (..., R)`:

        scores      S          one score row per completion
        weighted    diag(A) S  one GRPO gradient row per completion: the rows whose sum is g
        level_sums  E S        the score rows summed within each reward level
                               (`reward_levels`; the class sums for binary rewards)
    """
    return {
        "scores": gram,
        "weighted": weighted_gram(gram, advantages),
        "level_sums": mixed_gram(gram, reward_levels(rewards)),
    }


def diagonal_blocks(gram: Tensor, block_size: int) -> Tensor:
    """`(N, N)` -> `(N / block_size, block_size, block_size)`: the Gram matrix of each prompt's
    rollouts (prompt-major, `block_size` per prompt)."""
    num_blocks = gram.shape[0] // block_size
    if num_blocks * block_size != gram.shape[0]:
        raise ValueError(f"{gram.shape[0]} rollouts are not blocks of {block_size}")
    blocks = gram.view(num_blocks, block_size, num_blocks, block_size)
    return blocks.diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def disjoint_groups(num_samples: int, group_size: int) -> Tensor:
    """`(num_samples // group_size, group_size)` indices: consecutive disjoint groups.

    M i.i.d. completions of one prompt split into M // R groups give M // R independent
    groups of R, so one batch of M samples per prompt serves every R dividing M."""
    if not 2 <= group_size <= num_samples:
        raise ValueError(f"need 2 <= group_size <= {num_samples}, got {group_size}")
    return torch.arange(num_samples - num_samples % group_size).view(-1, group_size)


def group_rank_frame(
    grams: Tensor, rewards: Tensor, group_sizes: list[int], method: str = "grpo"
):
    """Rank measures of every candidate of every group, a pandas DataFrame with one row per
    (group_size, prompt, group, candidate) and columns `mixed` (rewards not all equal) and
    `RANK_MEASURES`.

    `grams: (B, M, M)` Gram matrices of the (loss-normalised) score rows of M samples of each of
    B prompts, `rewards: (B, M)`. For each R in `group_sizes` the samples of a prompt are split
    into M // R disjoint groups (`disjoint_groups`) and `advantages.group_advantages(method)`
    computed per group.
    """
    import pandas as pd

    from grpo_companion.core.advantages import group_advantages

    num_prompts, num_samples = rewards.shape
    frames = []
    for group_size in group_sizes:
        index = disjoint_groups(num_samples, group_size)  # (K, R)
        group_rewards = rewards[:, index]  # (B, K, R)
        group_grams = grams[:, index[:, :, None], index[:, None, :]]  # (B, K, R, R)
        advantages = group_advantages(group_rewards.flatten(0, 1), method).view_as(group_rewards)
        mixed = (group_rewards != group_rewards[..., :1]).any(dim=-1)
        candidates = group_candidate_grams(group_grams, group_rewards, advantages)
        for candidate, gram in candidates.items():
            measures = rank_measures(gram_singular_values(gram))
            prompt, group = torch.meshgrid(
                torch.arange(num_prompts), torch.arange(index.shape[0]), indexing="ij"
            )
            frames.append(pd.DataFrame({
                "group_size": group_size, "prompt": prompt.flatten().numpy(),
                "group": group.flatten().numpy(), "candidate": candidate,
                "mixed": mixed.flatten().numpy(),
                **{name: value.flatten().double().numpy() for name, value in measures.items()},
            }))
    return pd.concat(frames, ignore_index=True)


def group_gradient_gram(gram: Tensor, advantages: Tensor, groups: Tensor) -> Tensor:
    """Gram matrix of the group gradients g_b = sum_{i in group b} A_i s_i, `(K, K)`, from that of
    all rollouts' score rows `gram: (N, N)`, `advantages: (N,)` and `groups: (K, R)` indices.

    The fifth candidate: the matrix whose rows are the gradients of many groups (of a batch,
    or of successive steps). Its rank is at most K, the number of groups, and not 2."""
    mixing = torch.zeros(groups.shape[0], gram.shape[0], dtype=gram.dtype, device=gram.device)
    mixing.scatter_(1, groups, advantages[groups].to(gram.dtype))
    return mixed_gram(gram, mixing)


def summarise_ranks(frame, by: list[str], measures=RANK_MEASURES, confidence: float = 0.95):
    """Mean and t-interval of each measure over the mixed groups, per `by` (+ measure): a
    DataFrame with columns `by`, measure, n, mean, low, high. Degenerate groups (all rewards
    equal) have no gradient at all and are left out; `n` says how many groups are in."""
    import pandas as pd

    rows = []
    for key, part in frame[frame["mixed"]].groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        for measure in measures:
            rows.append({**dict(zip(by, key)), "measure": measure,
                         **mean_interval(part[measure], confidence)})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# Rewards and losses for the language models


def graded_reward(completion: str, gold: str) -> float:
    """A continuous reward in [0, 1]: 1 / (1 + |x - gold| / max(1, |gold|)) for the last number
    x of the completion (`gsm8k.extract_answer(..., "flexible")`), 0 if it has none. Exact
    answers get 1, and being close is worth more than being far."""
    from grpo_companion.lm.gsm8k import extract_answer

    answer = extract_answer(completion, "flexible")
    if answer is None:
        return 0.0
    target = float(gold)
    return 1 / (1 + abs(float(answer) - target) / max(1.0, abs(target)))


def group_loss(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_mask: Tensor,
    advantages: Tensor,
) -> Tensor:
    """One group's on-policy GRPO loss (loss_type "grpo", beta 0) as far as its gradient goes:
    -(1/R) sum_i (A_i / L_i) log pi(y_i | x), L_i the completion's length. At ratio 1 the
    clipped surrogate has exactly this gradient. Inputs as in `completion_log_probs`."""
    log_probs = completion_log_probs(model, input_ids, attention_mask, completion_mask)
    lengths = completion_mask.sum(dim=1).clamp(min=1)
    return -(advantages.to(log_probs.dtype) / lengths * log_probs).mean()


# ---------------------------------------------------------------------------------------------
# The verdict, from the numbers


def classify_ranks(means: dict[int, float], target: float = 2.0, tolerance: float = 0.5) -> str:
    """What a candidate's mean effective rank does over R, `means: {R: mean}`:

        "about 2"       every mean within `tolerance` of `target`: the paper's claim
        "about 1"       every mean within `tolerance` of 1
        "at most 2"     every mean at most `target`, but not all near it (a bounded rank whose
                        two singular values differ)
        "grows with R"  the mean at the largest R exceeds that at the smallest by > tolerance
        "other"         none of these
        "one R only"    fewer than two group sizes measured: "regardless of R" is untested
    """
    if len(means) < 2:
        return "one R only"
    values = [means[size] for size in sorted(means)]
    if all(abs(value - target) <= tolerance for value in values):
        return "about 2"
    if all(abs(value - 1) <= tolerance for value in values):
        return "about 1"
    if max(values) <= target:
        return "at most 2"
    if values[-1] - values[0] > tolerance:
        return "grows with R"
    return "other"


def verdict(summary, measure: str = "entropy", tolerance: float = 0.5) -> tuple[list[dict], str]:
    """(one row per setting with its class, a paragraph) from a `summarise_ranks` table that
    has columns model, reward, stage, candidate, group_size, measure, mean.

    A setting is (model, reward, stage, candidate); its class is `classify_ranks` of its mean
    `measure` over the group sizes measured. The paragraph lists where "effective rank about 2
    regardless of R" holds and where it does not, with the measured range."""
    table = summary[summary["measure"] == measure]
    rows = []
    for (model, reward, stage, candidate), part in table.groupby(
        ["model", "reward", "stage", "candidate"], sort=False
    ):
        means = dict(zip(part["group_size"].astype(int), part["mean"].astype(float)))
        rows.append({
            "model": model, "reward": reward, "stage": stage, "candidate": candidate,
            "class": classify_ranks(means, tolerance=tolerance),
            "group_sizes": sorted(means), "low": min(means.values()), "high": max(means.values()),
        })

    def settings(rows):  # "candidate: model, stage, reward (low to high); ..."
        by_candidate = {}
        for row in rows:
            by_candidate.setdefault(row["candidate"], []).append(
                f"{row['model']}, {row['stage']}, {row['reward']} ({row['low']:.2f} to "
                f"{row['high']:.2f})")
        return "; ".join(f"{name} on {', '.join(items)}" for name, items in by_candidate.items())

    holds = [row for row in rows if row["class"] == "about 2"]
    fails = {}
    for row in rows:
        if row["class"] != "about 2":
            fails.setdefault(row["class"], []).append(row)
    sizes = sorted({size for row in rows for size in row["group_sizes"]})
    text = (f"Measured by the mean {measure} effective rank over groups at R = "
            f"{', '.join(map(str, sizes))}, and called \"about 2\" when every mean lies within "
            f"{tolerance} of 2, the claim holds for "
            + (settings(holds) if holds else "no matrix measured here") + ". ")
    for name, items in fails.items():
        text += f"It does not hold ({name}) for {settings(items)}. "
    return rows, text.strip()


def rollout_gram(model: nn.Module, rollouts, length_normalised: bool = True) -> Tensor:
    """`(N, N)` float64 Gram matrix of the score rows of a `rollouts.Rollouts` batch, all
    parameters, by `score_grams` in one pass; rows divided by the completion's length L_i when
    `length_normalised` (loss_type "grpo" weighs rollout i's log-prob by 1 / L_i, so these are
    the rows whose advantage-weighted sum is the gradient). Rollouts are prompt-major:
    `diagonal_blocks(gram, rollouts.num_generations)` are the per-prompt Grams."""
    grams = score_grams(model, rollouts.input_ids, rollouts.attention_mask,
                        rollouts.completion_mask, temperature=rollouts.temperature)
    gram = sum(grams.values())
    if not length_normalised:
        return gram
    return weighted_gram(gram, 1 / rollouts.completion_mask.sum(dim=1).clamp(min=1))


def representative_matrices(model: nn.Module) -> list[str]:
    """Three weight matrices of a Llama-like model: the first layer's query projection, the
    last layer's MLP down projection and the output head (those that exist)."""
    names = [name for name, p in model.named_parameters(remove_duplicate=False) if p.dim() == 2]
    picks = [[name for name in names if "q_proj" in name][:1],
             [name for name in names if "down_proj" in name][-1:],
             [name for name in names if name.startswith("lm_head")][:1]]
    return [name for pick in picks for name in pick]


def group_gradient_ranks(gram: Tensor, rewards: Tensor, group_sizes: list[int],
                         method: str = "grpo") -> list[dict]:
    """Rank measures of the fifth candidate, the `(K, P)` matrix of the gradients of all K
    groups of a batch, for each R: `gram: (N, N)` over all rollouts (prompt-major, M per
    prompt), `rewards: (B, M)`. Each prompt's samples are split as in `group_rank_frame`;
    `num_groups` counts the groups with a nonzero gradient (mixed rewards)."""
    from grpo_companion.core.advantages import group_advantages

    num_prompts, num_samples = rewards.shape
    rows = []
    for group_size in group_sizes:
        local = disjoint_groups(num_samples, group_size)  # (K, R) within a prompt
        groups = (torch.arange(num_prompts)[:, None, None] * num_samples + local).flatten(0, 1)
        group_rewards = rewards.flatten()[groups]
        advantages = torch.zeros(rewards.numel(), dtype=torch.float64)
        advantages[groups] = group_advantages(group_rewards.double(), method)
        sigma = gram_singular_values(group_gradient_gram(gram, advantages, groups))
        mixed = (group_rewards != group_rewards[:, :1]).any(dim=1)
        measures = {name: value.item() for name, value in rank_measures(sigma).items()}
        rows.append({"group_size": group_size, "num_groups": int(mixed.sum()), **measures})
    return rows
