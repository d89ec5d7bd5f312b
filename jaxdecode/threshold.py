"""The exact kept-set search: per-row thresholds for top-k, top-p and typical-p without a sort.

The definitions are those of `jaxdecode.processors` (its module docstring states each one once).
What they share: each kept set is an *upper set* of the row in some order (top-k and top-p in
the order of the logits, typical-p in the order of typicality), so it is "every token whose
order key is >= one threshold", and the threshold is the largest key whose upper set reaches a
target amount (k tokens, or a probability mass).

Two ways to find it, both exact:

- Candidates (`thresholds_from_candidates`): a row whose top-k/top-p set provably lies inside its
  64 largest logits gets the threshold from those 64 values (`lax.top_k`) and their cumulative
  mass. Peaked rows, and any k <= 63, take this path.
- Bisection (`largest_threshold`): over the 32 bits of the float32 order, most significant bit
  first: 32 masked reductions over `[B, V]`. Any row, any k or p; typical-p always uses it.

Which way a row goes depends only on that row, and every sum is `_reduce.row_sum` (an order of
additions fixed by V alone), so a row's result never depends on the batch, bit for bit. No
data-dependent shapes; everything is jittable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode import _platform
from jaxdecode import _reduce

NEG_INF = float("-inf")
TINY = float(jnp.finfo(jnp.float32).tiny)
CANDIDATES = 64  # per-row candidates for the fast path (lax.top_k)


def order_keys(x: jax.Array) -> jax.Array:
  """uint32 keys with the same order as the float32 values (-0.0 and +0.0 tie). [B, V]."""
  x = jnp.where(x == 0, 0.0, x)  # -0.0 -> +0.0, so that equal floats get equal keys
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def value_of_key(key: jax.Array) -> jax.Array:
  """Inverse of `order_keys`: the float32 value with that order key."""
  positive = (key >> 31) == 1
  bits = jnp.where(positive, key ^ jnp.uint32(0x80000000), ~key)
  return lax.bitcast_convert_type(bits, jnp.float32)


def largest_threshold(keys: jax.Array, weights, target: jax.Array) -> jax.Array:
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
  if _platform.mode() == _platform.STRAIGHT:
    return _largest_threshold_by_digits(keys, weights, target)

  def body(i, t):
    candidate = t | (jnp.uint32(1) << jnp.asarray(31 - i, jnp.uint32))  # [B]
    reached = _reduce.row_sum(jnp.where(keys >= candidate[:, None], weights, jnp.float32(0)))
    return jnp.where(reached >= target, candidate, t)

  return lax.fori_loop(0, 32, body, jnp.zeros(keys.shape[:1], jnp.uint32))


DIGIT_BITS = 4  # the GPU search: 8 passes of 15 pivots each


def _largest_threshold_by_digits(keys: jax.Array, weights, target: jax.Array) -> jax.Array:
  """`largest_threshold` with 15 pivots per pass over [B, V]: 8 passes instead of 32.

  The same answer bit for bit: `reached(t) = row_sum(weights[keys >= t])` is the same function of
  t (the same fixed order of additions), and it never grows with t (the weights are >= 0 and
  rounding is monotone), so "the largest t with reached(t) >= target" has one answer, whichever
  way it is searched. Each pass fixes 4 bits: the largest digit d (0..15) whose pivot
  `t | d << shift` still reaches the target. A pass reads the row once for all 15 pivots, which
  suits a GPU (bound by memory and launches, not by compares); `_pivot_sums` keeps its scratch
  to [B, 15, L] lanes, not [B, 15, V].
  """
  batch = keys.shape[0]
  digits = jnp.arange(1, 1 << DIGIT_BITS, dtype=jnp.uint32)  # [D]

  def body(i, t):
    shift = jnp.asarray(32 - DIGIT_BITS * (i + 1), jnp.uint32)
    pivots = t[:, None] | (digits[None, :] << shift)  # [B, D], every pivot >= 1
    reached = _pivot_sums(keys, weights, pivots)  # [B, D]
    best = jnp.max(jnp.where(reached >= target[:, None], digits, jnp.uint32(0)), axis=1)
    return t | (best << shift)

  return lax.fori_loop(0, 32 // DIGIT_BITS, body, jnp.zeros((batch,), jnp.uint32))


def _pivot_sums(keys: jax.Array, weights, pivots: jax.Array) -> jax.Array:
  """[B, D]: `row_sum(where(keys >= pivots[:, d, None], weights, 0))` for every d, bit for bit.

  `_reduce.row_sum`'s order of additions, written lane chunk by lane chunk: chunk c of every
  pivot's masked row, [B, D, L], is formed from keys[:, cL:(c+1)L] and added to the running lane
  sums, chunk 0 first, then the lanes go through the same pairwise tree. So the [B, D, V] masked
  rows never exist as one array (at [33, 200000] they were 396 MB of scratch); the chain fuses
  into one pass over the row. Past V the chunk is +0.0, as row_sum's padding is (and as a key
  there would give: every pivot is >= 1 > any padding key).
  """
  vocab = keys.shape[1]
  lanes = _reduce.lanes_for(vocab)
  scalar = jnp.ndim(weights) == 0

  def chunk(start):
    stop = min(start + lanes, vocab)
    k = keys[:, None, start:stop]
    w = weights if scalar else weights[:, None, start:stop]
    masked = jnp.where(k >= pivots[:, :, None], w, jnp.float32(0))
    return jnp.pad(masked, ((0, 0), (0, 0), (0, start + lanes - stop)))

  acc = chunk(0)
  for start in range(lanes, vocab, lanes):
    acc = acc + chunk(start)
  return _reduce.tree_sum(acc, axis=2)


def unnormalized_probs(x: jax.Array):
  """exp(x - max) per row (0 for rows with nothing selectable), and the row max. [B, V]."""
  m = jnp.max(x, axis=-1, keepdims=True)
  e = jnp.where(m > NEG_INF, jnp.exp(x - m), 0.0)
  return e, m


def thresholds_by_bisection(x: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
  """top-k then top-p thresholds of every row by bisection over all V tokens (any k, any p).

  Args:
    x: float32[B, V] logits (-inf for removed tokens; no NaN, no +inf).
    k: int32[B] top-k (<= 0 or >= V: off).
    p: float32[B] top-p (>= 1: off).

  Returns:
    float32[B]: keep the tokens with `x >= threshold` (-inf keeps everything).
  """
  vocab = x.shape[-1]
  keys = order_keys(x)
  k_active = (k > 0) & (k < vocab)
  no_cut = jnp.full(k.shape, NEG_INF, jnp.float32)
  tau_k = _platform.when(  # each bisection only when some row needs it (CPU, TPU)
      jnp.any(k_active),
      lambda: jnp.where(k_active, value_of_key(largest_threshold(keys, jnp.float32(1), k)),
                        NEG_INF),
      lambda: no_cut)
  e, _ = unnormalized_probs(x)
  e = jnp.where(x >= tau_k[:, None], e, 0.0)  # the distribution after top-k
  target = jnp.maximum(p, TINY) * _reduce.row_sum(e)
  tau_p = _platform.when(jnp.any(p < 1),
                   lambda: jnp.where(p < 1, value_of_key(largest_threshold(keys, e, target)),
                                     NEG_INF),
                   lambda: no_cut)
  return jnp.maximum(tau_k, tau_p)


def thresholds_from_candidates(x: jax.Array, k: jax.Array, p: jax.Array, candidates: int):
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
  e = jnp.where(m > NEG_INF, jnp.exp(values - m), 0.0)  # [B, K]
  k_active = (k > 0) & (k < vocab)
  tau_k = jnp.where(k_active, jnp.take_along_axis(values, jnp.clip(k, 1, candidates)[:, None] - 1,
                                                  axis=1)[:, 0], NEG_INF)
  e = jnp.where(values >= tau_k[:, None], e, 0.0)  # after top-k
  # Z: the candidates' mass when top-k cut inside them, else the whole row's (a full pass over
  # the vocabulary, skipped when every row has top-k).
  z_row = _platform.when(jnp.any(~k_active), lambda: _reduce.row_sum(unnormalized_probs(x)[0]),
                   lambda: jnp.zeros(k.shape, jnp.float32))
  z = jnp.where(k_active, _reduce.row_sum(e), z_row)
  target = jnp.maximum(p, TINY) * z
  # Mass strictly above each candidate: the exclusive cumulative mass at its value's first slot.
  iota = lax.broadcasted_iota(jnp.int32, values.shape, 1)
  new_value = jnp.concatenate([jnp.ones_like(values[:, :1], bool),
                               values[:, 1:] != values[:, :-1]], axis=1)
  first_slot = lax.cummax(jnp.where(new_value, iota, 0), axis=1)
  above = jnp.take_along_axis(_reduce.row_cumsum(e) - e, first_slot, axis=1)
  kept = (values >= tau_k[:, None]) & ((above < target[:, None]) | (p >= 1)[:, None])
  tau = jnp.min(jnp.where(kept, values, jnp.inf), axis=-1)
  tau = jnp.where(k_active | (p < 1), tau, NEG_INF)
  # Exact when the kept set, and the top-k set that normalizes top-p, end above the last
  # candidate: then no token outside the candidates (not even a tie) belongs to either.
  inside = (tau > values[:, -1]) & (~k_active | (tau_k > values[:, -1]))
  exact = (candidates == vocab) | inside | (m[:, 0] == NEG_INF)
  return tau, exact


def top_k_top_p_threshold(x: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
  """The per-row threshold of top-k followed by top-p: candidates where exact, else bisection.

  Args/returns as `thresholds_by_bisection`; the bisection runs only when some row needs it.
  """
  tau, exact = thresholds_from_candidates(x, k, p, min(CANDIDATES, x.shape[-1]))
  return _platform.when(~jnp.all(exact),
                        lambda: jnp.where(exact, tau, thresholds_by_bisection(x, k, p)),
                        lambda: tau)


def typical_keep(p: jax.Array, log_p: jax.Array, entropy: jax.Array,
                 typical_p: jax.Array) -> jax.Array:
  """bool[B, V]: the typical-p kept set of each row, by bisection in the order of typicality.

  Args:
    p: float32[B, V] probabilities (0 for removed tokens).
    log_p: float32[B, V] their logarithms (-inf for removed tokens).
    entropy: float32[B, 1].
    typical_p: float32[B] (>= 1: keep every token of positive probability).
  """
  score = -jnp.abs(-log_p - entropy)  # higher is more typical
  keys = jnp.where(p > 0, order_keys(jnp.where(p > 0, score, 0.0)), jnp.uint32(0))
  # Every kept p is a normal float (XLA flushes subnormals), so a target of at least TINY keeps
  # the most typical token; typical_p * sum(p) alone can flush to 0 and keep nothing.
  target = jnp.maximum(typical_p * _reduce.row_sum(p), TINY)
  tau = largest_threshold(keys, p, target)
  return (keys >= tau[:, None]) & (p > 0)
