"""Batch-invariant numerics: a row's result depends on that row alone, bit for bit.

Each function has an `invariant` switch; `invariant=False` is the plain XLA formulation (a
negative control, and what the cost is measured against). Weights are arguments, never closed
over (XLA picks other kernels for constants).

Why hand-written, when `jaxdecode.batch_invariant` rewrites any model: the plain step under that
transformation decodes at 0.81x (B = 1) and 0.69x (B = 8) of these functions' tokens/s on a
2-core AMD EPYC (greedy, 32 tokens), past the 10% the transformation may cost here; its chains
cannot use the tiled weights (`chain_blocks`) nor attention's early exit after the last chunk.

Why plain ops are not invariant: a product `x @ w`, a `jnp.sum` or a softmax's normalizer is one
op over many terms, and the backend chooses the order in which it adds them: XLA:CPU picks a
kernel (Eigen's matrix-vector product, a YNNPACK matrix kernel) from the row count, the sizes and
the CPU's instruction set; XLA:GPU picks tiles and split-K; TPU's default precision differs
between matrix-vector and matrix-matrix products. Measured: on an AVX2 machine a row's bits
changed between 2 and 61 rows, on an AVX-512 one at other row counts, on an H200 from 25 rows.

So the invariant functions never hand a sum to the backend. Every sum is written out in the
program as elementwise ops (multiply, add), which every backend computes one output element at
a time in the order the program writes (XLA never reassociates floating-point adds):

- `linear` (and `tied_logits`, x @ E.T): `chain_matmul`, multiply-add chains over the
  contraction in blocks of 32 terms, in an order fixed by the weight's shape. It reads the
  weight in a tiled copy (`chain_blocks`) that the model makes once per set of weights.
- `rms_norm`: the mean square by a fixed tree of adds (`jaxdecode._reduce.tree_sum`).
- `attention`: fixed chunks of 64 cache slots in a `while_loop` that stops after the chunk
  holding the batch's furthest query; tree sums inside a chunk and an online softmax across
  chunks. A masked slot or chunk is an exact no-op (p = 0, values selected to 0, rescale exp(0) =
  1), so the cache length, the other rows' lengths and stale slots (even NaN) cannot change the
  bits, and the work follows the positions, not the cache length.

A row's result is then a function of that row (and the weights) alone, for any number of rows,
on every backend, and `jaxdecode.invariance.unordered_sums` checks it from the program itself:
lowered for cpu, cuda or tpu, the invariant pass holds no dot, add-reduce or scatter-add over
floats (the plain pass holds 38). What is not promised: the same bits on two machines. The
compiler may fuse a multiply and an add into one FMA (XLA:CPU and NVPTX do where the hardware
has one), the same way for every element of one program, but not on every CPU or device alike.
`jaxdecode audit` checks the promise on a given machine.

The cost: every product is computed by XLA's elementwise code instead of a tuned matrix kernel.
On XLA:CPU that is a single-threaded loop; `jaxdecode bench` (numerics table) measures it
against `invariant=False`, the fast, documented alternative.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode import _platform
from jaxdecode._reduce import tree_sum

CHUNK = 64  # cache slots per attention chunk; a cache holds a multiple of it (changing it changes bits)
TERMS = 32  # contraction terms per block of `chain_matmul` (changing it changes bits)
LANES = 4  # multiply-add chains per block (changing it changes bits)
TILE = 32  # output columns per tile of `chain_matmul` (layout only: the bits do not depend on it)
_NEG = float(jnp.finfo(jnp.float32).min)


def chain_blocks(w: jax.Array) -> jax.Array:
  """w [D, F] -> the layout `chain_matmul` reads: [D/T, F/V, T, V], zero-padded.

  Block b, tile j holds w[bT:(b+1)T, jV:(j+1)V]. One block of T contraction rows is one slice
  of the leading axis, and a tile's T x V entries are contiguous, so the chain reads them in
  order whatever F is (reading T rows of a [D, 1024] weight column by column maps them all to
  one cache set). It is a copy of the weight: make it once per set of weights
  (`Transformer.chain_blocks`, which `prefill` keeps in the `DecodeState`), not once per step.
  """
  depth, width = w.shape
  blocks, tiles = -(-depth // TERMS), -(-width // TILE)
  w = jnp.pad(w, ((0, blocks * TERMS - depth), (0, tiles * TILE - width)))
  return jnp.transpose(w.reshape(blocks, TERMS, tiles, TILE), (0, 2, 1, 3))


@functools.partial(jax.jit, static_argnames=("width",))
def chain_matmul(x: jax.Array, blocks: jax.Array, width: int) -> jax.Array:
  """x [N, D] @ w [D, F] with the order of every sum written into the program.

  Output (n, f) is the sum over d of x[n, d] * w[d, f] in this order, and in no other: the
  contraction is cut into blocks of T = 32 terms, block 0 first; inside a block, term t goes to
  lane t mod 4, each lane a multiply-add chain in order of t, and the four lanes are added as
  (l0 + l1) + (l2 + l3); that block total is added to the running sum. Every step is an
  elementwise op on [F/V, N, V] arrays (V = 32 output columns per tile), which XLA computes
  one output element at a time in the expression's order on any backend: no kernel chooses an
  order, so output (n, f) depends on row n of x and on w alone, for every N. The lanes give the
  CPU independent chains to overlap; the block loop is a `fori_loop` with a constant trip count.

  Padding adds terms 0 * 0 (D up to a multiple of T) and columns that are cut off again; both
  depend on the weight's shape alone.

  It is jitted on its own so that it is traced once per shape: a model calls it for every
  projection of every layer, and tracing its 32 unrolled terms took 0.1 s a call. Inside another
  jit it is a call that XLA inlines, so the compiled program is the one the inline product
  gives (checked: the same instructions, the same bits).

  Args:
    x: [N, D].
    blocks: `chain_blocks(w)` of the weight w [D, F].
    width: F.
  """
  rows, depth = x.shape
  n_blocks, n_tiles = blocks.shape[:2]
  xb = jnp.pad(x, ((0, 0), (0, n_blocks * TERMS - depth))).reshape(rows, n_blocks, TERMS)
  xb = jnp.transpose(xb, (1, 0, 2))  # [nb, N, T]

  def block(b, total):
    # Each term slices its row of x and of the weight tile straight from the whole arrays:
    # one use per slice, so XLA fuses every slice into the one loop that computes the block
    # (slicing the block first made XLA copy it, which tripled a one-row product's time).
    lanes = [None] * LANES
    for t in range(TERMS):
      xt = lax.dynamic_slice(xb, (b, 0, t), (1, rows, 1))[0, :, 0]  # [N]
      wt = lax.dynamic_slice(blocks, (b, 0, t, 0), (1, n_tiles, 1, TILE))[0, :, 0]  # [nt, V]
      term = xt[None, :, None] * wt[:, None, :]  # [nt, N, V]
      lane = t % LANES
      lanes[lane] = term if lanes[lane] is None else lanes[lane] + term
    while len(lanes) > 1:  # a pairwise tree: (l0 + l1) + (l2 + l3) for 4 lanes
      lanes = [lanes[i] + lanes[i + 1] for i in range(0, len(lanes), 2)]
    return total + lanes[0]

  dtype = jnp.result_type(x, blocks)
  total = lax.fori_loop(0, n_blocks, block, jnp.zeros((n_tiles, rows, TILE), dtype))
  return jnp.transpose(total, (1, 0, 2)).reshape(rows, n_tiles * TILE)[:, :width]


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
           invariant: bool, blocks: jax.Array | None = None) -> jax.Array:
  """`nnx.Linear`: x [..., D] @ w [D, F], then + b.

  `blocks` (invariant only) is `chain_blocks(w)` made ahead; without it each call makes it.
  """
  if invariant:
    lead = x.shape[:-1]
    blocks = chain_blocks(w) if blocks is None else blocks
    y = chain_matmul(x.reshape(-1, x.shape[-1]), blocks, w.shape[1]).reshape(*lead, w.shape[1])
  else:
    y = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))
  return y if b is None else y + _lead(b, y.ndim)


def _lead(v: jax.Array, ndim: int) -> jax.Array:
  """A feature vector [F] shaped to broadcast against [..., F] (explicitly: rank promotion)."""
  return v.reshape((1,) * (ndim - 1) + v.shape)


def tied_logits(x: jax.Array, embedding: jax.Array, *, invariant: bool,
                blocks: jax.Array | None = None) -> jax.Array:
  """`nnx.Embed.attend`: x [..., D] @ embedding [V, D].T (`blocks`: `chain_blocks(embedding.T)`)."""
  if not invariant:
    return jnp.dot(x, embedding.T)
  return linear(x, embedding.T, invariant=True, blocks=blocks)


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
  are never used, whatever they hold. On CPU and TPU chunks of `CHUNK` slots are visited up to
  the one holding the furthest query of the batch; on a GPU every chunk is (a loop with a
  constant trip count: `jaxdecode._platform`), and a chunk past a query leaves it unchanged.

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
    # A query before this chunk keeps its carry exactly (x * 1 + 0 would turn -0.0 into +0.0),
    # so how many chunks the loop visits never changes a bit.
    used = (start <= q_pos)[:, None, :]  # [B, 1, K]
    return (c + 1, jnp.where(used, m_new, m), jnp.where(used, l_new, l),
            jnp.where(used[..., None], acc_new, acc))

  init = (jnp.int32(0), jnp.full((batch, heads, width), _NEG, jnp.float32),
          jnp.zeros((batch, heads, width), jnp.float32),
          jnp.zeros((batch, heads, width, dim), jnp.float32))

  def up_to_furthest_query(init):  # CPU, TPU: stop at the data's end
    return lax.while_loop(lambda carry: carry[0] < n_chunks, body, init)

  def every_chunk(init):  # GPU: a constant trip count, no predicate read back per chunk
    return lax.fori_loop(0, slots // CHUNK, lambda i, carry: body(carry), init)

  def visit(init):
    return (every_chunk if _platform.mode() == _platform.STRAIGHT else up_to_furthest_query)(init)

  _, _, l, acc = _platform.by_platform(visit, init)
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
