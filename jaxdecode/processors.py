"""Logit processors: `[B, V]` logits in, `[B, V]` logits out; removed tokens become -inf.

`process_logits` applies them in this order (`process_f32`):

1. token sets: `banned_token_ids` -> -inf; a row with `allowed_token_ids` keeps only those;
2. `logit_bias`: added to the logits of its tokens;
3. penalties, from each row's token counts: `repetition_penalty` (HF: a seen token's logit is
   divided by it if positive, multiplied if negative), then `frequency_penalty * count` and
   `presence_penalty * (count > 0)` are subtracted (OpenAI/vLLM);
4. temperature; 5. top-k; 6. top-p; 7. min-p; 8. typical-p; 9. epsilon; 10. eta.

Steps 1-3 change the logits that everything after them sees, greedy rows (temperature 0)
included: a temperature-0 row takes the argmax of the biased and penalized logits. Each
truncation (5-10) acts on the distribution left by the steps before it, renormalized.

Semantics of the truncations (order-free, so that none of them needs a sort of the vocabulary;
p is the row's distribution at that step, H = -sum_j p_j log p_j its entropy in nats):

- top-k keeps token i iff fewer than k tokens have a strictly larger logit (boundary ties kept).
- top-p keeps token i iff the probability mass of the tokens strictly more probable than i is
  < p (the smallest nucleus reaching p, boundary ties kept, the most probable token always kept).
- min-p keeps token i iff p_i >= min_p * max_j p_j.
- typical-p keeps token i iff the mass of the tokens strictly more typical than i is < typical_p,
  where token j is more typical than i iff |-log p_j - H| < |-log p_i - H| (the most typical
  token is always kept; it need not be the most probable).
- epsilon keeps token i iff p_i >= epsilon_cutoff or p_i = max_j p_j.
- eta keeps token i iff p_i >= min(eta, sqrt(eta) * exp(-H)) or p_i = max_j p_j.

Each top-k/top-p kept set is an *upper set* of the row: every token whose logit is >= some
threshold, so top-k followed by top-p is one threshold per row. A row whose kept set provably
lies inside its 64 largest logits gets the threshold from those candidates
(`_thresholds_from_candidates`); any other row by a bisection over the 32 bits of the float32
order (`_largest_threshold`): 32 masked reductions over `[B, V]`. typical-p is an upper set in
the order of typicality and uses the same bisection. All are exact, need no sort and have no
data-dependent shapes; a step that no row uses is skipped (a `lax.cond` on the batch).

Numerics: all math runs in float32 whatever the input dtype; outputs are cast back to it.
Input hygiene, applied by every processor:

- NaN logits become -inf (a NaN is never selected);
- if a row has +inf logits, its distribution is uniform over them: +inf -> 0, the rest -> -inf;
- a row whose logits are all -inf (or NaN) stays all -inf: it has nothing selectable;
- a bias or penalty never turns -inf into a number, and saturates at the float32 range instead
  of overflowing to +-inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdecode.params import SamplingParams, as_field

_NEG_INF = float("-inf")
_TINY = float(jnp.finfo(jnp.float32).tiny)
_F32_MAX = float(jnp.finfo(jnp.float32).max)


# ---------------------------------------------------------------------------------------------
# Validation (Python, before anything is traced or compiled).


def check_logits(logits) -> tuple[int, int]:
  """Checks that `logits` is a floating `[B, V]` array with V >= 1; returns (B, V)."""
  shape = jnp.shape(logits)
  if len(shape) != 2:
    hint = " For one row use logits[None]." if len(shape) == 1 else (
        " For extra leading axes use jax.vmap." if len(shape) > 2 else "")
    raise ValueError(f"logits must have shape [B, V] (rank 2); got shape {shape}.{hint}")
  dtype = jnp.result_type(logits)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"logits must be a floating-point array (float32, bfloat16, float16, ...); "
                     f"got dtype {dtype}")
  if shape[1] < 1:
    raise ValueError(f"logits must have a vocabulary of at least one token; got shape {shape}")
  return shape


def check_row_param(name: str, value, batch_size: int) -> jax.Array:
  """Validates one per-row parameter (scalar or [B]) and broadcasts it to `[batch_size]`."""
  value = as_field(name, value)
  if value.shape not in ((), (batch_size,)):
    raise ValueError(f"{name} has shape {value.shape} but logits have {batch_size} rows; "
                     f"expected a scalar or shape ({batch_size},)")
  return jnp.broadcast_to(value, (batch_size,))


def check_counts(counts, batch_size: int, vocab_size: int) -> jax.Array:
  """Validates per-row token counts: an integer array `[B, V]`; returns it as int32."""
  shape, dtype = jnp.shape(counts), jnp.result_type(counts)
  if shape != (batch_size, vocab_size) or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"counts must be an integer array of shape ({batch_size}, {vocab_size}) "
                     f"(how often each row has seen each token; see jaxdecode.token_counts); "
                     f"got shape {shape} and dtype {dtype}")
  return jnp.asarray(counts, jnp.int32)


def check_call(logits, params, counts, *, caller: str):
  """The checks shared by `process_logits` and the samplers, before anything compiles.

  Returns `(params broadcast to the batch, int32 counts or None)`.
  """
  batch, vocab = check_logits(logits)
  if not isinstance(params, SamplingParams):
    raise ValueError(f"params must be a jaxdecode.SamplingParams; got {type(params).__name__}")
  broadcast = params.broadcast(batch, vocab)
  if counts is not None:
    counts = check_counts(counts, batch, vocab)
  elif params.penalized():
    raise ValueError(f"repetition_penalty, presence_penalty and frequency_penalty act on the "
                     f"tokens each row has seen: pass counts=[B, V] to {caller} (see "
                     f"jaxdecode.token_counts), or use jaxdecode.decode, which carries them")
  if params.min_new_tokens_set():
    raise ValueError(f"min_new_tokens={params.min_new_tokens_set()} needs the EOS ids and the "
                     f"step, which {caller} does not have; it applies in jaxdecode.decode")
  return broadcast, counts


def token_counts(tokens, vocab_size: int, mask=None) -> jax.Array:
  """How often each row holds each token id: `int32[B, V]` (the penalties' input).

  Args:
    tokens: `int[B, T]` token ids (e.g. left-padded prompts).
    vocab_size: V.
    mask: optional `bool[B, T]`, True on the tokens to count (e.g. `prompt_mask(lengths, T)`
      to skip padding). Ids outside `[0, V)` are not counted.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> jaxdecode.token_counts(jnp.array([[0, 2, 2], [1, 1, 3]]), 4).tolist()
    [[1, 0, 2, 0], [0, 2, 0, 1]]
  """
  if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"tokens must be an integer array [B, T]; got shape {jnp.shape(tokens)} "
                     f"and dtype {jnp.result_type(tokens)}")
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) \
      or vocab_size < 1:
    raise ValueError(f"vocab_size must be an integer >= 1; got {vocab_size!r}")
  if mask is not None and jnp.shape(mask) != jnp.shape(tokens):
    raise ValueError(f"mask must have the shape of tokens {jnp.shape(tokens)}; got "
                     f"{jnp.shape(mask)}")
  return _token_counts(jnp.asarray(tokens, jnp.int32),
                       None if mask is None else jnp.asarray(mask, bool), int(vocab_size))


@functools.partial(jax.jit, static_argnums=2)
def _token_counts(tokens, mask, vocab):
  ones = jnp.ones(tokens.shape, jnp.int32) if mask is None else mask.astype(jnp.int32)
  rows = lax.broadcasted_iota(jnp.int32, tokens.shape, 0)
  return jnp.zeros((tokens.shape[0], vocab), jnp.int32).at[rows, tokens].add(ones, mode="drop")


# ---------------------------------------------------------------------------------------------
# Float32 building blocks (traced; shapes in comments).


def prepare(logits: jax.Array) -> jax.Array:
  """float32 copy with the input hygiene rules above applied. [B, V] -> [B, V]."""
  x = logits.astype(jnp.float32)
  x = jnp.where(jnp.isnan(x), _NEG_INF, x)

  def uniform_over_pos_inf(x):
    has_pos_inf = jnp.any(x == jnp.inf, axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(has_pos_inf, jnp.where(x == jnp.inf, 0.0, _NEG_INF), x)

  return lax.cond(jnp.any(x == jnp.inf), uniform_over_pos_inf, lambda x: x, x)


def first_argmax(x: jax.Array) -> jax.Array:
  """Index of the row maximum, ties to the lowest index; NaN-free input. [B, V] -> int32[B].

  Two plain reductions (max, then min over the indices that reach it), which XLA runs faster
  than its variadic argmax. An all -inf row gives 0.
  """
  m = jnp.max(x, axis=-1, keepdims=True)
  iota = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1).astype(jnp.int32)


def _order_keys(x: jax.Array) -> jax.Array:
  """uint32 keys with the same order as the float32 values (-0.0 and +0.0 tie)."""
  x = jnp.where(x == 0, 0.0, x)  # -0.0 -> +0.0, so that equal floats get equal keys
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, weights, target: jax.Array) -> jax.Array:
  """Per row, the largest uint32 t with sum(weights[keys >= t]) >= target (0 if none does).

  Bisection from the most significant bit: 32 masked sums over [B, V]. Since the sum only
  changes at the data's keys, the answer is always one of them.

  Args:
    keys: uint32[B, V] order keys.
    weights: [B, V] or scalar non-negative weights (1 counts tokens; probabilities give mass).
    target: [B] amount to reach.

  Returns:
    uint32[B].
  """
  def body(i, t):
    candidate = t | (jnp.uint32(1) << jnp.asarray(31 - i, jnp.uint32))  # [B]
    reached = jnp.sum(jnp.where(keys >= candidate[:, None], weights, 0), axis=-1)
    return jnp.where(reached >= target, candidate, t)

  return lax.fori_loop(0, 32, body, jnp.zeros(keys.shape[:1], jnp.uint32))


def _unnormalized_probs(x: jax.Array):
  """exp(x - max) per row (0 for rows with nothing selectable), and the row max. [B, V]."""
  m = jnp.max(x, axis=-1, keepdims=True)
  e = jnp.where(m > _NEG_INF, jnp.exp(x - m), 0.0)
  return e, m


def apply_temperature(x: jax.Array, t: jax.Array) -> jax.Array:
  """x / t per row; t == 0 rows become a point mass on their greedy token. float32 [B, V]."""
  greedy_rows = (t == 0)[:, None]
  t_safe = jnp.where(greedy_rows, 1.0, t[:, None])
  scaled = jnp.where(x == _NEG_INF, _NEG_INF, x / t_safe)

  # A tiny temperature can overflow x / t to +inf; those rows use the equivalent (x - max) / t,
  # which is <= 0 everywhere (same distribution, no overflow).
  def fix_overflow(scaled):
    overflow = jnp.any(scaled == jnp.inf, axis=-1, keepdims=True)
    m = jnp.max(x, axis=-1, keepdims=True)
    shifted = jnp.where(x == _NEG_INF, _NEG_INF, (x - m) / t_safe)
    return jnp.where(overflow, shifted, scaled)

  scaled = lax.cond(jnp.any(t < 1), fix_overflow, lambda s: s, scaled)

  def point_mass(scaled):
    iota = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    one_hot = jnp.where(iota == first_argmax(x)[:, None], x, _NEG_INF)
    return jnp.where(greedy_rows, one_hot, scaled)

  # The conditions skip whole passes over [B, V] when no row needs them (traced, no retrace).
  return lax.cond(jnp.any(greedy_rows), point_mass, lambda s: s, scaled)


def _value_of_key(key: jax.Array) -> jax.Array:
  """Inverse of `_order_keys`: the float32 value with that order key."""
  positive = (key >> 31) == 1
  bits = jnp.where(positive, key ^ jnp.uint32(0x80000000), ~key)
  return lax.bitcast_convert_type(bits, jnp.float32)


def _thresholds_by_bisection(x, k, p):
  """top-k then top-p thresholds of every row by bisection over all V tokens (any k, any p)."""
  vocab = x.shape[-1]
  keys = _order_keys(x)
  k_active = (k > 0) & (k < vocab)
  no_cut = jnp.full(k.shape, _NEG_INF)
  tau_k = lax.cond(  # each bisection only when some row needs it
      jnp.any(k_active),
      lambda: jnp.where(k_active, _value_of_key(_largest_threshold(keys, jnp.int32(1), k)),
                        _NEG_INF),
      lambda: no_cut)
  e, _ = _unnormalized_probs(x)
  e = jnp.where(x >= tau_k[:, None], e, 0.0)  # the distribution after top-k
  target = jnp.maximum(p, _TINY) * jnp.sum(e, axis=-1)
  tau_p = lax.cond(jnp.any(p < 1),
                   lambda: jnp.where(p < 1, _value_of_key(_largest_threshold(keys, e, target)),
                                     _NEG_INF),
                   lambda: no_cut)
  return jnp.maximum(tau_k, tau_p)


def _thresholds_from_candidates(x, k, p, candidates: int):
  """top-k then top-p thresholds computed on each row's `candidates` largest logits.

  Returns `(tau, exact)`: `exact[b]` is True when row b's kept set provably lies inside its
  candidates (its threshold is above the smallest candidate, or the candidates are the whole
  vocabulary); only then is `tau[b]` the row's threshold. Whether a row is exact depends only on
  the row, so choosing between this and the bisection per row keeps rows independent.
  """
  vocab = x.shape[-1]
  # The barrier keeps XLA:CPU on its partial top-k kernel: when the top-k result fuses with its
  # consumers, XLA lowers it to a full sort of the vocabulary instead (~100x slower).
  values = lax.optimization_barrier(lax.top_k(x, candidates)[0])  # [B, K], descending
  m = values[:, :1]
  e = jnp.where(m > _NEG_INF, jnp.exp(values - m), 0.0)  # [B, K]
  k_active = (k > 0) & (k < vocab)
  tau_k = jnp.where(k_active, jnp.take_along_axis(values, jnp.clip(k, 1, candidates)[:, None] - 1,
                                                  axis=1)[:, 0], _NEG_INF)
  e = jnp.where(values >= tau_k[:, None], e, 0.0)  # after top-k
  # Z: the candidates' mass when top-k cut inside them, else the whole row's (a full pass over
  # the vocabulary, skipped when every row has top-k).
  z_row = lax.cond(jnp.any(~k_active), lambda: jnp.sum(_unnormalized_probs(x)[0], axis=-1),
                   lambda: jnp.zeros(k.shape, jnp.float32))
  z = jnp.where(k_active, jnp.sum(e, axis=-1), z_row)
  target = jnp.maximum(p, _TINY) * z
  # Mass strictly above each candidate: the exclusive cumulative mass at its value's first slot.
  iota = lax.broadcasted_iota(jnp.int32, values.shape, 1)
  new_value = jnp.concatenate([jnp.ones_like(values[:, :1], bool),
                               values[:, 1:] != values[:, :-1]], axis=1)
  first_slot = lax.cummax(jnp.where(new_value, iota, 0), axis=1)
  above = jnp.take_along_axis(jnp.cumsum(e, axis=1) - e, first_slot, axis=1)
  kept = (values >= tau_k[:, None]) & ((above < target[:, None]) | (p >= 1)[:, None])
  tau = jnp.min(jnp.where(kept, values, jnp.inf), axis=-1)
  tau = jnp.where(k_active | (p < 1), tau, _NEG_INF)
  # Exact when the kept set, and the top-k set that normalizes top-p, end above the last
  # candidate: then no token outside the candidates (not even a tie) belongs to either.
  inside = (tau > values[:, -1]) & (~k_active | (tau_k > values[:, -1]))
  exact = (candidates == vocab) | inside | (m[:, 0] == _NEG_INF)
  return tau, exact


_CANDIDATES = 64  # per-row candidates for the fast path (lax.top_k)


def apply_top_k_top_p(x: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
  """top-k (k <= 0 or k >= V keeps all) then top-p (p >= 1 keeps all) on the top-k survivors.

  Both kept sets are upper sets of the row, so the pair is one threshold per row. Rows whose
  kept set lies inside their 64 largest logits (any k <= 63, and top-p on a peaked distribution)
  get it from those candidates; the others by a bisection over the whole vocabulary, which runs
  only when some row needs it.
  """
  active = ((k > 0) & (k < x.shape[-1])) | (p < 1)  # [B]

  def cut(x):
    tau, exact = _thresholds_from_candidates(x, k, p, min(_CANDIDATES, x.shape[-1]))
    tau = lax.cond(jnp.all(exact), lambda: tau,
                   lambda: jnp.where(exact, tau, _thresholds_by_bisection(x, k, p)))
    return jnp.where(active[:, None] & (x < tau[:, None]), _NEG_INF, x)

  return lax.cond(jnp.any(active), cut, lambda x: x, x)


def apply_top_k(x: jax.Array, k: jax.Array) -> jax.Array:
  """Keeps tokens with fewer than k strictly larger logits; k <= 0 or k >= V keeps all."""
  return apply_top_k_top_p(x, k, jnp.ones(k.shape, jnp.float32))


def apply_top_p(x: jax.Array, p: jax.Array) -> jax.Array:
  """Keeps tokens whose strictly-more-probable mass is < p; p >= 1 keeps all."""
  return apply_top_k_top_p(x, jnp.zeros(p.shape, jnp.int32), p)


def apply_min_p(x: jax.Array, min_p: jax.Array) -> jax.Array:
  """Keeps tokens with p_i >= min_p * max_j p_j, i.e. exp(x_i - max) >= min_p."""
  def cut(x):
    e, _ = _unnormalized_probs(x)
    return jnp.where(e >= min_p[:, None], x, _NEG_INF)

  return lax.cond(jnp.any(min_p > 0), cut, lambda x: x, x)


# Steps 1-3: token sets, logit bias, penalties (they change the logits, not only the kept set).


def _valid_ids(ids: jax.Array, vocab: int) -> jax.Array:
  """ids with padding (-1) and out-of-range ids replaced by `vocab` (dropped by scatters)."""
  return jnp.where((ids >= 0) & (ids < vocab), ids, vocab)


def _saturate(x: jax.Array, y: jax.Array) -> jax.Array:
  """y where x is a number, clipped to the finite float32 range; -inf where x is -inf."""
  return jnp.where(x == _NEG_INF, _NEG_INF, jnp.clip(y, -_F32_MAX, _F32_MAX))


def apply_token_sets(x: jax.Array, banned: jax.Array, allowed: jax.Array) -> jax.Array:
  """Banned ids -> -inf; a row with allowed ids keeps only those. ids: int32[B, K], -1 pads."""
  vocab = x.shape[-1]
  banned, allowed = _valid_ids(banned, vocab), _valid_ids(allowed, vocab)

  def ban(x):
    rows = lax.broadcasted_iota(jnp.int32, banned.shape, 0)
    return x.at[rows, banned].set(_NEG_INF, mode="drop")

  def allow(x):
    rows = lax.broadcasted_iota(jnp.int32, allowed.shape, 0)
    keep = jnp.zeros(x.shape, bool).at[rows, allowed].set(True, mode="drop")
    restricted = jnp.any(allowed < vocab, axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(keep | ~restricted, x, _NEG_INF)

  x = lax.cond(jnp.any(banned < vocab), ban, lambda x: x, x)
  return lax.cond(jnp.any(allowed < vocab), allow, lambda x: x, x)


def apply_logit_bias(x: jax.Array, ids: jax.Array, biases: jax.Array) -> jax.Array:
  """Adds `biases[b, j]` to `x[b, ids[b, j]]` (duplicates add up). ids/biases: [B, K]."""
  ids = _valid_ids(ids, x.shape[-1])

  def add(x):
    rows = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    bias = jnp.zeros(x.shape, jnp.float32).at[rows, ids].add(biases, mode="drop")
    return _saturate(x, x + bias)

  return lax.cond(jnp.any((ids < x.shape[-1]) & (biases != 0)), add, lambda x: x, x)


def apply_penalties(x: jax.Array, counts: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array) -> jax.Array:
  """HF's repetition penalty, then OpenAI's frequency and presence penalties. counts: [B, V].

  For a token seen c > 0 times: x -> x / r if x > 0 else x * r (r = repetition), then
  x -> x - frequency * c - presence. Unseen tokens are unchanged. Negative counts count as 0.
  """
  active = (repetition != 1) | (presence != 0) | (frequency != 0)  # [B]

  def penalize(x):
    c = jnp.maximum(counts, 0)
    seen = c > 0
    r = repetition[:, None]
    y = jnp.where(seen, jnp.where(x < 0, x * r, x / r), x)
    y = y - jnp.where(seen, frequency[:, None] * c.astype(jnp.float32) + presence[:, None], 0.0)
    return _saturate(x, y)

  return lax.cond(jnp.any(active), penalize, lambda x: x, x)


# ---------------------------------------------------------------------------------------------
# Steps 8-10: truncations that need the renormalized distribution and its entropy.


def _distribution(x: jax.Array):
  """(p, log p, H) of softmax(x) per row: [B, V], [B, V], [B, 1]; p = 0 and H = 0 for empty rows."""
  e, m = _unnormalized_probs(x)
  z = jnp.sum(e, axis=-1, keepdims=True)
  ok = z > 0
  p = jnp.where(ok, e / jnp.where(ok, z, 1.0), 0.0)
  log_p = jnp.where(e > 0, x - m - jnp.log(jnp.where(ok, z, 1.0)), _NEG_INF)
  entropy = -jnp.sum(jnp.where(e > 0, p * log_p, 0.0), axis=-1, keepdims=True)
  return p, log_p, entropy


def apply_typical_p(x: jax.Array, typical_p: jax.Array) -> jax.Array:
  """Keeps tokens whose strictly-more-typical mass is < typical_p; typical_p >= 1 keeps all.

  Typicality is |-log p_i - H|. The kept set is an upper set of -|-log p_i - H|, so the same
  bisection as top-p finds its threshold (32 masked sums over the vocabulary).
  """
  active = typical_p < 1  # [B]

  def cut(x):
    p, log_p, entropy = _distribution(x)
    score = -jnp.abs(-log_p - entropy)  # higher is more typical
    keys = jnp.where(p > 0, _order_keys(jnp.where(p > 0, score, 0.0)), jnp.uint32(0))
    target = jnp.maximum(typical_p, _TINY) * jnp.sum(p, axis=-1)
    tau = _largest_threshold(keys, p, target)
    keep = (keys >= tau[:, None]) & (p > 0)
    return jnp.where(keep | ~active[:, None], x, _NEG_INF)

  return lax.cond(jnp.any(active), cut, lambda x: x, x)


def _cut_below(x: jax.Array, active: jax.Array, threshold) -> jax.Array:
  """Keeps p_i >= threshold(p, H) [B, 1] and the most probable token(s) of active rows."""
  def cut(x):
    p, _, entropy = _distribution(x)
    keep = (p >= threshold(entropy)) | (x == jnp.max(x, axis=-1, keepdims=True))
    return jnp.where(keep | ~active[:, None], x, _NEG_INF)

  return lax.cond(jnp.any(active), cut, lambda x: x, x)


def apply_epsilon_cutoff(x: jax.Array, epsilon: jax.Array) -> jax.Array:
  """Keeps p_i >= epsilon and the most probable token(s); epsilon <= 0 keeps all."""
  return _cut_below(x, epsilon > 0, lambda entropy: epsilon[:, None])


def apply_eta_cutoff(x: jax.Array, eta: jax.Array) -> jax.Array:
  """Keeps p_i >= min(eta, sqrt(eta) exp(-H)) and the most probable token(s); eta <= 0 keeps all."""
  def threshold(entropy):
    e = eta[:, None]
    return jnp.minimum(e, jnp.sqrt(e) * jnp.exp(-entropy))

  return _cut_below(x, eta > 0, threshold)


def process_f32(x: jax.Array, params: SamplingParams, counts: jax.Array | None = None):
  """The whole chain on prepared float32 logits with sanitized, broadcast params.

  Args:
    x: float32[B, V] from `prepare`.
    params: `SamplingParams` after `broadcast(B)` and `sanitized()`.
    counts: int32[B, V] token counts for the penalties, or None (no token seen yet: the
      penalties change nothing).
  """
  x = apply_token_sets(x, params.banned_token_ids, params.allowed_token_ids)
  x = apply_logit_bias(x, *params.logit_bias)
  if counts is not None:
    x = apply_penalties(x, counts, params.repetition_penalty, params.presence_penalty,
                        params.frequency_penalty)
  x = apply_temperature(x, params.temperature)
  x = apply_top_k_top_p(x, params.top_k, params.top_p)
  x = apply_min_p(x, params.min_p)
  x = apply_typical_p(x, params.typical_p)
  x = apply_epsilon_cutoff(x, params.epsilon_cutoff)
  return apply_eta_cutoff(x, params.eta_cutoff)


# ---------------------------------------------------------------------------------------------
# Public processors: validate in Python, then run jitted float32 code, cast back to the input dtype.


@jax.jit
def _process_logits(logits, params, counts):
  return process_f32(prepare(logits), params.sanitized(), counts).astype(logits.dtype)


def process_logits(logits: jax.Array, params: SamplingParams, *, counts=None) -> jax.Array:
  """Applies the whole chain of `params` to `[B, V]` logits (order: this module's docstring).

  Args:
    logits: `[B, V]` floating logits (any float dtype; the math runs in float32).
    params: a `SamplingParams`; each field a scalar or a `[B]` array. `min_new_tokens` must be 0
      here (it needs `decode`'s EOS ids and step).
    counts: `int[B, V]`, how often each row has seen each token (`jaxdecode.token_counts`);
      needed when a penalty is set.

  Returns:
    `[B, V]` logits of the input dtype: the processed distribution is their softmax; removed
    tokens are -inf. Rows with temperature 0 keep only their greedy token.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    >>> out = jaxdecode.process_logits(logits, jaxdecode.SamplingParams(top_p=0.8))
    >>> jnp.isfinite(out).tolist()  # 0.5 + 0.3 reaches 0.8: the third token is not needed
    [[True, True, False, False]]
    >>> seen = jaxdecode.token_counts(jnp.array([[0, 0]]), 4)  # token 0 seen twice
    >>> params = jaxdecode.SamplingParams(frequency_penalty=0.5, banned_token_ids=[3])
    >>> jaxdecode.process_logits(jnp.zeros((1, 4)), params, counts=seen).tolist()
    [[-1.0, 0.0, 0.0, -inf]]
  """
  params, counts = check_call(logits, params, counts, caller="process_logits")
  return _process_logits(logits, params, counts)


def _public(name: str, field: str, apply):
  @jax.jit
  def run(logits, value):
    p = SamplingParams().replace(**{field: value}).sanitized()
    return apply(prepare(logits), getattr(p, field)).astype(logits.dtype)

  def processor(logits: jax.Array, value) -> jax.Array:
    batch, _ = check_logits(logits)
    return run(logits, check_row_param(field, value, batch))

  processor.__name__ = processor.__qualname__ = name
  return processor


temperature = _public("temperature", "temperature", apply_temperature)
temperature.__doc__ = """Divides `[B, V]` logits by a temperature (scalar or `[B]`, >= 0).

  0 keeps only the greedy token (argmax, ties to the lowest index); values below 1 sharpen the
  distribution, above 1 flatten it, 1 returns the logits unchanged.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> jaxdecode.processors.temperature(jnp.array([[1.0, 3.0, 3.0]]), 0.0).tolist()
    [[-inf, 3.0, -inf]]
  """

top_k = _public("top_k", "top_k", apply_top_k)
top_k.__doc__ = """Keeps the tokens that have fewer than k strictly larger logits (0 disables).

  Ties at the boundary are all kept, so more than k tokens can survive.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> jaxdecode.processors.top_k(jnp.array([[1.0, 3.0, 2.0, 2.0]]), 2).tolist()
    [[-inf, 3.0, 2.0, 2.0]]
  """

top_p = _public("top_p", "top_p", apply_top_p)
top_p.__doc__ = """Keeps the smallest high-probability set whose mass reaches p (1 disables).

  Token i is kept iff the mass of the tokens strictly more probable than i is < p; ties at the
  boundary are kept and the most probable token always is.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
    >>> jnp.isfinite(jaxdecode.processors.top_p(logits, 0.6)).tolist()
    [[False, True, False]]
  """

min_p = _public("min_p", "min_p", apply_min_p)
min_p.__doc__ = """Keeps the tokens with probability >= min_p times the largest one (0 disables).

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
    >>> jnp.isfinite(jaxdecode.processors.min_p(logits, 0.4)).tolist()
    [[False, True, True]]
  """

typical_p = _public("typical_p", "typical_p", apply_typical_p)
typical_p.__doc__ = """Locally typical sampling: keeps the most typical tokens up to mass typical_p.

  Token i is kept iff the mass of the tokens strictly more typical than i is < typical_p, where
  typicality is the distance |-log p_i - H| of a token's information to the entropy H (1
  disables). The most typical token is always kept; the most probable one need not be.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))  # H = 1.03 nats; -log p = .69, 1.2, 1.61
    >>> jnp.isfinite(jaxdecode.processors.typical_p(logits, 0.25)).tolist()  # .3 is most typical
    [[False, True, False]]
  """

epsilon_cutoff = _public("epsilon_cutoff", "epsilon_cutoff", apply_epsilon_cutoff)
epsilon_cutoff.__doc__ = """Keeps the tokens with probability >= epsilon, and the most probable one.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.4, 0.35, 0.25]]))
    >>> jnp.isfinite(jaxdecode.processors.epsilon_cutoff(logits, 0.3)).tolist()
    [[True, True, False], [True, True, False]]
  """

eta_cutoff = _public("eta_cutoff", "eta_cutoff", apply_eta_cutoff)
eta_cutoff.__doc__ = """Keeps the tokens with probability >= min(eta, sqrt(eta) exp(-H)), and the top one.

  The cut adapts to the entropy H: a confident (low-entropy) step cuts at eta, an uncertain one
  cuts lower (0 disables).

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))  # sqrt(.25) * exp(-1.03) = 0.18
    >>> jnp.isfinite(jaxdecode.processors.eta_cutoff(logits, 0.25)).tolist()
    [[True, True, True]]
  """
