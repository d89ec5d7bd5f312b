"""Batch-invariant numerics: a row's result depends on that row alone, bit for bit.

Each function has an `invariant` switch; `invariant=False` is the plain XLA formulation (a
negative control, and what the cost is measured against). Weights are arguments, never closed
over (XLA picks other kernels for constants).

Why plain ops are not invariant on XLA:CPU (measured with jax 0.10.2 on AVX2/FMA):

- `x @ w` with N rows: N = 1 runs Eigen's matrix-vector kernel; N >= 2 a YNNPACK kernel chosen
  by a cost model from (N, F, D). For this model's dense shapes N = 1 and every N >= 61 compute
  the *sequential FMA chain* `acc = fma(x[d], w[d, f], acc)`, d = 0..D-1 (checked against a
  float64 emulation); N = 2..60 split the sum differently. Odd output widths (259) add classes.
- A sum over a feature axis (`jnp.sum`, softmax's normalizer) changes its order with the number
  of rows. Elementwise ops (exp, tanh, rsqrt, cos, +, *) are invariant: XLA does not reassociate.

What each invariant function does instead:

- `linear`: always the sequential-FMA chain, through whichever kernel computes it for the static
  row count: the plain dot for 1 or >= 64 rows, one matrix-vector product per row (`lax.map`)
  for 2..24 rows, the rows padded to 64 for 25..63. Cost 0.85-1.3x a plain dot.
- `tied_logits` (x @ E.T): the transposed-weight dot, which has one class for every N >= 2 (259
  wide too), on every row fed twice (so never a single row, also per device when a batch is
  split).
- `rms_norm`: the mean square by a fixed tree of adds (`jaxdecode._reduce.tree_sum`).
- `attention`: fixed chunks of 64 cache slots in a `while_loop` that stops after the chunk
  holding the batch's furthest query; tree sums inside a chunk and an online softmax across
  chunks. A masked slot or chunk is an exact no-op (p = 0, values selected to 0, rescale exp(0) =
  1), so the cache length, the other rows' lengths and stale slots (even NaN) cannot change the
  bits, and the work follows the positions, not the cache length.

The bits depend on the CPU's instruction set and the XLA version: `jaxdecode.audit` (and
`jaxdecode audit` for the embedded model) checks the promise on your machine. On XLA:GPU the
kernel classes above do not hold (measured on an NVIDIA H200, jax 0.11.2: `linear` changes a
row's bits from 25 rows on, `tied_logits` from 8; `rms_norm` and `attention` hold), so the
audit fails there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode._reduce import tree_sum

CHUNK = 64  # cache slots per attention chunk; a cache holds a multiple of it (changing it changes bits)
_LARGE_ROWS = 64  # from here on YNNPACK's large-M kernel computes the sequential-FMA chain
_GEMV_ROWS = 24  # up to here one matrix-vector product per row is cheapest
_NEG = float(jnp.finfo(jnp.float32).min)


def _sequential_fma_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [N, D] @ w [D, F] in the sequential-FMA class, for every static N."""
  n = x.shape[0]
  if n == 1 or n >= _LARGE_ROWS:
    return x @ w
  if n <= _GEMV_ROWS:  # the loop body is a [1, D] @ [D, F] dot: Eigen's GEMV
    return lax.map(lambda row: row @ w, x[:, None, :])[:, 0]
  return (jnp.pad(x, ((0, _LARGE_ROWS - n), (0, 0))) @ w)[:n]


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
           invariant: bool) -> jax.Array:
  """`nnx.Linear`: x [..., D] @ w [D, F], then + b."""
  if invariant:
    lead = x.shape[:-1]
    y = _sequential_fma_matmul(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[1])
  else:
    y = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))
  return y if b is None else y + _lead(b, y.ndim)


def _lead(v: jax.Array, ndim: int) -> jax.Array:
  """A feature vector [F] shaped to broadcast against [..., F] (explicitly: rank promotion)."""
  return v.reshape((1,) * (ndim - 1) + v.shape)


def tied_logits(x: jax.Array, embedding: jax.Array, *, invariant: bool) -> jax.Array:
  """`nnx.Embed.attend`: x [..., D] @ embedding [V, D].T."""
  if not invariant:
    return jnp.dot(x, embedding.T)
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  n = x2.shape[0]
  pairs = jnp.broadcast_to(x2[:, None, :], (n, 2, x2.shape[1])).reshape(2 * n, x2.shape[1])
  y = lax.dot_general(pairs, embedding, (((1,), (1,)), ((), ())))
  return y.reshape(n, 2, -1)[:, 0].reshape(*lead, embedding.shape[0])


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6, *, invariant: bool) -> jax.Array:
  """`nnx.RMSNorm` (no mean subtraction): x * rsqrt(mean(x^2) + eps) * scale."""
  if invariant:
    mean_square = tree_sum(x * x, axis=-1, keepdims=True) / x.shape[-1]
  else:
    mean_square = jnp.mean(x * x, axis=-1, keepdims=True)
  return x * (lax.rsqrt(mean_square + eps) * _lead(scale, x.ndim))


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary embedding: rotates (x[i], x[i + Dh/2]) by `position * base^(-2i/Dh)`. Elementwise.

  Args:
    x: float32[B, T, H, Dh] queries or keys.
    positions: int32[B, T].
    base: the frequency base.
  """
  half = x.shape[-1] // 2
  freq = base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])  # [Dh/2]
  angle = positions.astype(jnp.float32)[:, :, None, None] * freq[None, None, None, :]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_pos: jax.Array, *,
              invariant: bool) -> jax.Array:
  """Causal attention of queries over a cache whose slot p holds position p.

  Query t of row b (at position `q_pos[b, t]`) attends to slots 0..q_pos[b, t]; slots beyond
  are never used, whatever they hold. Chunks of `CHUNK` slots are visited up to the one holding
  the furthest query of the batch, not up to the cache length.

  Args:
    q: float32[B, K, H, Dh] (RoPE applied, not scaled).
    k_cache, v_cache: float32[B, S, H, Dh], S a multiple of `CHUNK`.
    q_pos: int32[B, K].
    invariant: fixed-order tree sums (True) or plain einsum / sum (False) inside each chunk.

  Returns:
    float32[B, K, H, Dh].
  """
  batch, width, heads, dim = q.shape
  slots = k_cache.shape[1]
  scale = 1.0 / math.sqrt(dim)
  n_chunks = jnp.minimum((jnp.max(q_pos) + CHUNK) // CHUNK, slots // CHUNK)
  qh = jnp.transpose(q, (0, 2, 1, 3))  # [B, H, K, Dh]

  def body(carry):
    c, m, l, acc = carry
    start = c * CHUNK
    kc = lax.dynamic_slice_in_dim(k_cache, start, CHUNK, axis=1)  # [B, C, H, Dh]
    vc = lax.dynamic_slice_in_dim(v_cache, start, CHUNK, axis=1)
    slot = start + jnp.arange(CHUNK, dtype=jnp.int32)
    valid = slot[None, None, None, :] <= q_pos[:, None, :, None]  # [B, 1, K, C]
    if invariant:
      kt = jnp.transpose(kc, (0, 2, 3, 1))  # [B, H, Dh, C]
      s = tree_sum(qh[..., :, None] * kt[:, :, None, :, :], axis=3) * scale  # [B, H, K, C]
    else:
      s = jnp.einsum("bhkd,bchd->bhkc", qh, kc) * scale
    s = jnp.where(valid, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # a max is exact in any order
    alpha = jnp.exp(m - m_new)  # exactly 1 when this chunk adds nothing for the query
    p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)  # [B, H, K, C]
    vh = jnp.transpose(vc, (0, 2, 1, 3))  # [B, H, C, Dh]
    if invariant:
      l_new = l * alpha + tree_sum(p, axis=-1)
      pv = jnp.where(valid[..., None], p[..., None] * vh[:, :, None, :, :], 0.0)  # [B,H,K,C,Dh]
      acc_new = acc * alpha[..., None] + tree_sum(pv, axis=3)
    else:
      l_new = l * alpha + jnp.sum(p, axis=-1)
      row_end = jnp.max(q_pos, axis=1)  # [B]; slots beyond a row's last query are unused
      vh = jnp.where((slot[None, :] <= row_end[:, None])[:, None, :, None], vh, 0.0)
      acc_new = acc * alpha[..., None] + jnp.einsum("bhkc,bhcd->bhkd", p, vh)
    return c + 1, m_new, l_new, acc_new

  init = (jnp.int32(0), jnp.full((batch, heads, width), _NEG, jnp.float32),
          jnp.zeros((batch, heads, width), jnp.float32),
          jnp.zeros((batch, heads, width, dim), jnp.float32))
  _, _, l, acc = lax.while_loop(lambda carry: carry[0] < n_chunks, body, init)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return jnp.transpose(out, (0, 2, 1, 3))  # [B, K, H, Dh]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Plain causal softmax attention of a whole sequence (training: differentiable, no cache).

  q, k, v: float32[B, T, H, Dh] -> float32[B, T, H, Dh].
  """
  width = q.shape[1]
  scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
  causal = jnp.arange(width)[None, :] <= jnp.arange(width)[:, None]  # [T, S]
  scores = jnp.where(causal[None, None], scores, _NEG)
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
