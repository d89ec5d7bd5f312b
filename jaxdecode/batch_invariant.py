"""`batch_invariant(fn)`: a function transformation that fixes the order of every float sum.

XLA picks the order in which it adds the terms of a product, a `jnp.sum` or a cumulative sum
from the shapes it is given (and the CPU's instruction set, or the GPU's tiles), so a row of a
batched computation can get other bits in a batch of 3 than alone. `batch_invariant(fn)` traces
`fn` to a jaxpr and evaluates it with every order-choosing float reduction rewritten into a
construction built from elementwise ops, slices and selects only, whose order the program fixes
(XLA computes elementwise ops one output element at a time, in the order written, and never
reassociates float adds).

One construction serves every sum: the *in-order chain*. The terms of a sum are added one at a
time in index order, acc = acc + x[i], starting at +0.0, vectorized over every output element
at once. Exact zeros before a row's first term leave acc at +0.0 (+0.0 + -0.0 is +0.0), zeros
after its last term add nothing (acc + 0.0 == acc, and acc is never -0.0), so a row's result
does not depend on masked terms (exp(-inf) = 0, a zero weight) at either end of its axis: left
padding that shifts a row's cache slots leaves its bits alone. (A tree or lanes chosen by the
index modulo a width are not invariant to such a shift.) The chain is a `lax.scan` over the
reduction axis laid out first, each step one elementwise pass over the outputs.

- `reduce_sum` (and so `mean`, `var`, a softmax's or `logsumexp`'s normalizer, layer norms):
  the chain over the reduced axes, flattened in order.
- `dot_general` (every layout: batch dims, several contracting dims, `precision`,
  `preferred_element_type`): the chain of multiply-adds l[k] * r[k] over the contracting dims
  flattened in order, both operands read contraction-major so that a term is two contiguous
  slices, `UNROLL` terms per loop iteration in one pass over the output, the same loop at
  every shape (a second layout for large outputs, blocks of 32 terms over tiles of 32 columns
  as `jaxdecode.models.numerics.chain_matmul`, was up to 1.5x faster there but contracted
  other multiply-adds into FMAs than the one-pass loop: a row's bits changed where batching
  made its output large). Lanes chosen by the index modulo a width are not shift-invariant,
  and are not used. Operands narrower than float32 are multiplied and accumulated in float32;
  `precision` is moot (every product is an exactly rounded elementwise multiply). A weight the
  function transposes is copied on every call; `batch_invariant(fn, weights=i)` and `Weights`
  make those copies once, outside a loop.
- `reduce_prod`: the chain of multiplies from 1.0 (ones at either end are no-ops).
- `cumsum`, `cumprod`, `cumlogsumexp`: the chain, every prefix kept (from +0.0, 1.0, -inf).
- `reduce_window_sum` (and an add `reduce_window`): the window's offsets added in order.
- float `scatter-add`: one update at a time, in the order of the updates, in a `fori_loop`.
- `conv_general_dilated` (strides, padding, both dilations, feature groups): the kernel
  offsets' strided slices of the input as patches, then the product's chain over (input
  feature, kernel offset). It materializes the patches (im2col). `batch_group_count` > 1 is
  refused.
- `exp` (float32 and narrower): range reduction and a polynomial in basic arithmetic. XLA:CPU's
  own `exp` was measured to give other bits for the same input in arrays of some lengths (3,
  5-7, 11-15 elements: another code path), so a row's `exp` depended on the batch.
  `tanh`, `logistic`, `rsqrt`, `sqrt`, `erf`, `sin`, `cos`, `log1p`, `expm1`, `pow`, `exp2`
  and `div` showed no such dependence (lengths 1-39) and are kept.
- `log` (float32 and narrower): the exponent from its bits and a polynomial (`fixed_log`). A
  later measurement on a 2-core AMD EPYC found XLA:CPU's `log` length-dependent like its `exp`
  (at 3, 5-7, 11 and 13-15 elements).
- float `mul` (and `square`, `integer_pow`): `exact_product`, four exact partial products
  added in a fixed order. XLA contracts a multiply and an add into one FMA when both land in
  one fused kernel, and the fusion depends on the shapes: transformers' Flax Llama (`x * cos +
  rotate(x) * sin`, a norm's scale) gave a row other logits alone than in a batch of 5 through
  this alone. With exact products, contracting or not gives the same bits. (The chains' own
  `acc + l * r` is one loop body at every shape, and measured alike.)

Kept as they are: every elementwise and structural op on an explicit allow-list, exact
reductions (`reduce_max`/`min`, `argmax`, integer sums and products, logical reductions),
sorts. Everything else that may reorder float sums is refused at trace time with a
`BatchInvariantError` (a `NotImplementedError`, a `ValueError` too) naming the primitive and
the user's source line: FFT, linear algebra, convolutions with `batch_group_count` > 1,
`pure_callback` and other host callbacks returning floats, `pallas_call` / `ffi_call` / custom
calls, float collectives (`psum`), and any primitive not on the allow-list.

Control flow is rewritten inside: `jit` (inlined), `scan`, `while`, `cond`/`switch`,
`checkpoint`/`remat`, `shard_map` (float `psum` inside it is refused), `custom_jvp_call`/
`custom_vjp_call` (their primal body is evaluated rewritten; derivatives come from the plain
function, below).

What it promises: on one machine (and one JAX/XLA), a row's bits (a row being any slice along an
axis that no reduction runs over) do not depend on the other rows, and a reduction's result does
not depend on exact zeros added at either end of its axis (sums, products, cumulative sums from
the start) -- which is what left padding does to a row's cache slots. What it does not
promise: the same bits on two machines. XLA may fuse a multiply and an add into one FMA
(XLA:CPU and NVPTX do where the hardware has one); inside the chains it does so alike for
every element and batch size on one machine (the tests check it here), and a model's own
products are made exact (above) so that contraction cannot matter, but the chains' FMAs are
not on every CPU or GPU alike.

Derivatives: `batch_invariant(fn)` is a `jax.custom_jvp` whose primal output is the rewritten
function's and whose tangents are `jax.jvp` of the plain `fn`; so `jax.grad`, `value_and_grad`,
`jvp` and `vjp` work, the forward values are the rewritten ones, and the backward pass uses
plain XLA products (it is not batch-invariant).

What it costs (XLA:CPU, a 2-core AMD EPYC, quiet; invariant / plain time, the same process,
alternating, medians of 50): [8,256] @ [256,1024] 0.8x, [1,1024] @ [1024,1024] 1.1x,
[64,1024] @ [1024,1024] 2.0x (plain XLA uses a tuned, multithreaded kernel; the chain is
elementwise code, four terms per pass over the output; one term per pass, as before, was
2.0x, 2.2x and 4.5x under load); softmax over [8,4096] 1.6-2.1x, layer norm
[64,1024] 2.5x; a sum over [8,4096] 0.5x and a cumsum 0.2x (XLA:CPU's own row reductions are slow at these shapes).
Tracing runs `fn` once more (`make_jaxpr`) per call outside `jit`; compiling a chain is a loop.
A fully unrolled chain or lanes by index modulo a width were measured no faster, or not
shift-invariant; a pairwise tree aligned to each row's first nonzero term was shift-invariant
but 4-12x slower than the chain on XLA:CPU.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

UNROLL = 4  # terms of a chain per loop iteration (layout only: the bits do not depend on it)

__all__ = ["batch_invariant", "BatchInvariantError", "Weights"]


class BatchInvariantError(NotImplementedError, ValueError):
  """`batch_invariant` met a primitive it cannot make batch-invariant."""


# ---------------------------------------------------------------------------------------------
# Constructions: every one built from elementwise ops, slices, pads, selects and exact reductions.


def _is_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def _acc_dtype(dtype):
  """The accumulation dtype of a float sum: float32 for narrower floats."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return np.dtype(np.float32)
  return dtype


def _moved(x: jax.Array, axes) -> jax.Array:
  """x with `axes` moved to the front (in order) and flattened into one: [N, rest...]."""
  axes = tuple(a % x.ndim for a in axes)
  rest = tuple(a for a in range(x.ndim) if a not in axes)
  x = lax.transpose(x, axes + rest)
  n = math.prod(x.shape[:len(axes)])
  return x.reshape((n,) + x.shape[len(axes):])


def fixed_sum(x: jax.Array, axes) -> jax.Array:
  """The sum of x over `axes` (flattened in order): an in-order chain from +0.0."""
  out_dtype = x.dtype
  x = _moved(x, axes).astype(_acc_dtype(out_dtype))
  return _chain(x, lax.add, 0).astype(out_dtype)


def _varying_like(value: jax.Array, like: jax.Array) -> jax.Array:
  """`value` marked as varying over the manual mesh axes `like` varies over (in `shard_map`)."""
  aval = jax.typeof(like)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  have = getattr(getattr(jax.typeof(value), "manual_axis_type", None), "varying", None) or ()
  missing = tuple(sorted(set(vma or ()) - set(have)))
  return lax.pcast(value, missing, to="varying") if missing else value


def _chain(terms: jax.Array, op, init, prefixes: bool = False) -> jax.Array:
  """[N, R] -> [R]: acc = op(acc, terms[i]) for i = 0, 1, ..., N - 1, acc starting at `init`.

  A `lax.scan` over the leading axis (`UNROLL` steps per loop iteration: layout only, the order
  is the chain's). `prefixes`: return every acc ([N, R]: the inclusive scan) instead of the last.
  """
  acc = _varying_like(lax.full(terms.shape[1:], init, terms.dtype), terms)
  if prefixes:
    return lax.scan(lambda acc, x: (op(acc, x),) * 2, acc, terms, unroll=1)[1]
  return lax.scan(lambda acc, x: (op(acc, x), None), acc, terms,
                  unroll=max(1, min(UNROLL, terms.shape[0])))[0]


def fixed_prod(x: jax.Array, axes) -> jax.Array:
  """The product of x over `axes`, an in-order chain from 1.0."""
  out_dtype = x.dtype
  x = _moved(x, axes).astype(_acc_dtype(out_dtype))
  return _chain(x, lax.mul, 1).astype(out_dtype)


def _term_reader(x: jax.Array, contracting, batch, free, terms: int, acc_dtype):
  """`read(t) -> [nb, m]`: term t's slice of x (its contracting dims at t, unravelled in order).

  x is first laid out contraction-major (a transpose, skipped where x already is), so that a
  term is one contiguous slice. The slice is read, reshaped and cast inside the chain's loop:
  a reshape or cast of the whole operand before the loop would be copied every call (XLA
  copies a bitcast of a weight it passes into a loop). With `terms` past K, x is padded with
  zeros to `terms` first (a copy, made only then).
  """
  perm = tuple(contracting) + tuple(batch) + tuple(free)
  if perm != tuple(range(x.ndim)):
    x = lax.transpose(x, perm)
  shape = x.shape[:len(contracting)]
  if terms > math.prod(shape):
    x = x.reshape((math.prod(shape),) + x.shape[len(shape):])
    x = jnp.pad(x, [(0, terms - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    shape = (terms,)
  sizes = (1,) * len(shape) + x.shape[len(shape):]
  nb = math.prod(x.shape[len(shape):len(shape) + len(batch)])

  def read(t):
    starts = []
    for size in reversed(shape):
      starts.append(t % size)
      t = t // size
    starts = starts[::-1] + [0] * (x.ndim - len(shape))
    return lax.dynamic_slice(x, starts, sizes).reshape(nb, -1).astype(acc_dtype)

  return read


def chain_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers, out_dtype) -> jax.Array:
  """`lax.dot_general` as an in-order chain of multiply-adds over the contraction.

  Output element e is acc_K where acc_0 = +0.0 and acc_{k+1} = acc_k + l_e[k] * r_e[k], k
  running over the contracting dims flattened in order: an order fixed by the program. Both
  operands are read contraction-major, so term k is two contiguous slices; a loop runs
  `UNROLL` terms per iteration, each iteration one pass over the output (XLA fuses the terms'
  multiply-adds into one kernel that keeps the output in registers across them). When K is
  not a multiple of `UNROLL`, the operands are padded with zero terms (0 * 0 added to acc
  leaves it as it is; a select of zeros inside the loop kept XLA from contracting some of the
  multiply-adds into FMAs, measured). The same loop at every shape: XLA contracts its multiply-adds into
  FMAs alike for every element and batch size (measured), which a second layout for large
  outputs did not (see below).
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
  lf = tuple(d for d in range(lhs.ndim) if d not in lc + lb)
  rf = tuple(d for d in range(rhs.ndim) if d not in rc + rb)
  batch_shape = tuple(lhs.shape[d] for d in lb)
  lfree = tuple(lhs.shape[d] for d in lf)
  rfree = tuple(rhs.shape[d] for d in rf)
  k = math.prod(lhs.shape[d] for d in lc)
  nb, m, n = math.prod(batch_shape), math.prod(lfree), math.prod(rfree)
  acc_dtype = _acc_dtype(out_dtype)
  out_shape = batch_shape + lfree + rfree
  if k == 0 or nb * m * n == 0:
    return jnp.zeros(out_shape, out_dtype)
  terms = -(-k // UNROLL) * UNROLL  # K, or past it by zeros (0 * 0 added leaves acc as it is)
  read_left = _term_reader(lhs, lc, lb, lf, terms, acc_dtype)
  read_right = _term_reader(rhs, rc, rb, rf, terms, acc_dtype)
  zero = _varying_like(_varying_like(jnp.zeros((), acc_dtype), lhs), rhs)
  # Every term in one loop, at every shape. (Updating a large output once per block of 32
  # terms was faster there, but XLA contracted its multiply-adds into FMAs in other places
  # than this loop's, so a row got other bits where the batch made its output large: a
  # [1, 17, 32] @ [32, 97] row against the same row of [12, 17, 32] @ [32, 97]. Any switch of
  # layout on a size that batching or padding can change breaks the promise.)

  def iteration(i, acc):
    for u in range(UNROLL):
      t = i * UNROLL + u
      left, right = read_left(t), read_right(t)
      acc = acc + left[:, :, None] * right[:, None, :]
    return acc

  acc = lax.fori_loop(0, terms // UNROLL, iteration, jnp.broadcast_to(zero, (nb, m, n)))
  return acc.reshape(out_shape).astype(out_dtype)


def chain_conv(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
               dimension_numbers, feature_group_count, out_dtype) -> jax.Array:
  """`lax.conv_general_dilated` (batch_group_count 1) as patches and a `chain_dot`.

  Each kernel offset's strided slice of the padded, dilated input is one patch; output (n, o,
  s) is the in-order chain over (input feature, kernel offset) of patch * kernel, per feature
  group. It materializes the patches (input features x kernel size x output size).
  """
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  x = lax.transpose(lhs, tuple(lhs_spec))  # [N, C, spatial...]
  w = lax.transpose(rhs, tuple(rhs_spec))  # [O, I, kernel...]
  config = [(0, 0, 0)] * 2 + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation)]
  x = lax.pad(x, jnp.zeros((), x.dtype), config)
  kernel = w.shape[2:]
  out_spatial = [(size - (k - 1) * d - 1) // s + 1 for size, k, d, s in
                 zip(x.shape[2:], kernel, rhs_dilation, window_strides)]
  patches = []
  for offset in itertools.product(*[range(k) for k in kernel]):
    start = [0, 0] + [o * d for o, d in zip(offset, rhs_dilation)]
    limit = [x.shape[0], x.shape[1]] + [st + (n - 1) * s + 1 for st, n, s in
                                        zip(start[2:], out_spatial, window_strides)]
    patches.append(lax.slice(x, start, limit, (1, 1) + tuple(window_strides)))
  n = x.shape[0]
  groups = feature_group_count
  o, i = w.shape[:2]
  size, offsets = math.prod(out_spatial), len(patches)
  p = jnp.stack(patches, axis=2).reshape(n, groups, i, offsets, size)  # [N, G, I, K, S]
  p = jnp.transpose(p, (1, 0, 4, 2, 3))  # [G, N, S, I, K]
  k = w.reshape(groups, o // groups, i, offsets)  # [G, O/G, I, K]
  out = chain_dot(p, k, (((3, 4), (2, 3)), ((0,), (0,))), out_dtype)  # [G, N, S, O/G]
  out = jnp.transpose(out, (1, 0, 3, 2)).reshape((n, o) + tuple(out_spatial))  # [N, O, sp...]
  return lax.transpose(out, tuple(np.argsort(out_spec)))


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # few mantissa bits: k * _LN2_HI is exact for |k| < 2^15
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)


def fixed_exp(x: jax.Array) -> jax.Array:
  """exp(x) in basic float32 arithmetic: the same bits for an input wherever it sits.

  exp(x) = 2^k * p(r), k = round(x / ln 2), r = x - k ln 2 (in two parts), p a degree-7
  polynomial (Cephes' expf; within 2 ulp, tested); 2^k built from its bits, in two
  factors so that subnormal results are rounded once. x > 88.73 gives inf, x < -104 gives 0
  (so exp(-inf) = 0 exactly), NaN stays NaN.
  """
  dtype = x.dtype
  x = x.astype(jnp.float32)
  safe = jnp.clip(x, -104.0, 89.0)
  k = jnp.round(safe * _LOG2E)
  r = (safe - k * _LN2_HI) - k * _LN2_LO
  p = lax.full_like(r, _EXP_POLY[0])
  for c in _EXP_POLY[1:]:
    p = p * r + np.float32(c)
  p = p * (r * r) + r + np.float32(1.0)
  ki = k.astype(jnp.int32)
  k1 = ki // 2
  k2 = ki - k1

  def pow2(e):
    return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)

  y = (p * pow2(k1)) * pow2(k2)
  y = lax.select(x > 88.72283935546875, lax.full_like(y, np.inf), y)
  y = lax.select(x < -104.0, lax.full_like(y, 0.0), y)
  y = lax.select(x != x, x, y)
  return y.astype(dtype)


_SQRT_HALF = np.float32(0.70710678118654752440)
_LOG_POLY = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
             1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
             3.3333331174e-1)


def fixed_log(x: jax.Array) -> jax.Array:
  """log(x) in basic float32 arithmetic: the same bits for an input wherever it sits.

  x = m 2^e with m in [sqrt(1/2), sqrt(2)) read from its bits, log(x) = e ln 2 + log(m), log(m)
  a polynomial in f = m - 1 (Cephes' logf; within 1 ulp, tested). Zero and subnormals give -inf
  (XLA:CPU flushes subnormals: its own log does the same), negatives NaN, inf inf, NaN NaN.
  """
  dtype = x.dtype
  x = x.astype(jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.int32)
  e = ((bits >> 23) & 0xFF) - 126
  m = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F000000, jnp.float32)  # [0.5, 1)
  small = m < _SQRT_HALF
  e = lax.select(small, e - 1, e)
  f = lax.select(small, m + m, m) - np.float32(1.0)
  z = f * f
  p = lax.full_like(f, _LOG_POLY[0])
  for c in _LOG_POLY[1:]:
    p = p * f + np.float32(c)
  ef = e.astype(jnp.float32)
  y = p * f * z + ef * np.float32(-2.12194440e-4) - np.float32(0.5) * z
  y = (f + y) + ef * _LN2_HI
  y = lax.select(x < np.float32(np.finfo(np.float32).tiny), lax.full_like(y, -np.inf), y)
  y = lax.select(x < 0, lax.full_like(y, np.nan), y)
  y = lax.select(x == np.inf, x, y)
  y = lax.select(x != x, x, y)
  return y.astype(dtype)


_HIGH_BITS = np.uint32(0xFFFFF000)  # a float32's sign, exponent and 12 leading significand bits


def exact_product(a: jax.Array, b: jax.Array) -> jax.Array:
  """a * b (same shapes) whose bits do not depend on FMA contraction.

  XLA:CPU (and GPU compilers) contract a multiply and an add into one FMA when both land in one
  fused kernel, and which ops share a kernel depends on the shapes: a model's own `x * y + z`
  (rotary embeddings, a norm's scale and bias, GELU) got other bits alone than in a batch. Here
  each float32 factor is split into a high part of 12 significant bits and the exact rest, so
  each of the four partial products is exact, and an FMA over an exact product rounds as the
  add alone does; the partial products are added in a fixed order (the result is within
  2 ulp of a * b). Non-finite products take a * b. Narrower floats are multiplied in float32,
  where their product is exact, and rounded back; float64 and complex are kept.
  """
  dtype = jnp.result_type(a, b)
  if dtype in (jnp.bfloat16, jnp.float16):
    return (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(dtype)
  if dtype != jnp.float32:
    return a * b

  def split(x):
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & _HIGH_BITS,
                                  jnp.float32)
    return hi, x - hi

  (ah, al), (bh, bl) = split(a), split(b)
  product = ((ah * bh + ah * bl) + al * bh) + al * bl
  plain = a * b
  return lax.select(jnp.isfinite(plain) & jnp.isfinite(product), product, plain)


def _integer_power(x: jax.Array, y: int) -> jax.Array:
  """x ** y (an integer) by `exact_product`s: square-and-multiply over y's bits, high first."""
  if y == 0:
    return jnp.ones_like(x)
  out = x
  for bit in bin(abs(y))[3:]:
    out = exact_product(out, out)
    if bit == "1":
      out = exact_product(out, x)
  return out if y > 0 else 1 / out


def _logaddexp(a, b):
  """log(exp(a) + exp(b)) elementwise, with `fixed_exp`; -inf + -inf gives -inf."""
  hi = jnp.maximum(a, b)
  lo = jnp.minimum(a, b)
  safe_hi = lax.select(jnp.isfinite(hi), hi, lax.full_like(hi, 0))
  out = hi + jnp.log1p(fixed_exp(lo - safe_hi))
  out = lax.select(jnp.isneginf(hi) | jnp.isposinf(hi), hi, out)
  return lax.select(jnp.isnan(a) | jnp.isnan(b), a + b, out)


def fixed_cumulative(x: jax.Array, axis: int, reverse: bool, op, init) -> jax.Array:
  """A cumulative `op` along `axis`: the in-order chain from `init`, every prefix kept."""
  out_dtype = x.dtype
  axis = axis % x.ndim
  moved = _moved(x, (axis,)).astype(_acc_dtype(out_dtype))  # [N, rest...]
  if reverse:
    moved = lax.rev(moved, (0,))
  out = _chain(moved, op, init, prefixes=True)
  if reverse:
    out = lax.rev(out, (0,))
  order = list(range(1, x.ndim))
  order.insert(axis, 0)
  return lax.transpose(out, tuple(order)).astype(out_dtype)


def window_sum(x, init, window_dimensions, window_strides, padding, base_dilation,
               window_dilation):
  """`reduce_window` with add: the window's offsets added in order, starting from `init`.

  Padding and base dilation's holes add nothing (as XLA's: measured).
  """
  out_dtype = x.dtype
  x = x.astype(_acc_dtype(out_dtype))
  config = [(lo, hi, d - 1) for (lo, hi), d in zip(padding, base_dilation)]
  x = lax.pad(x, jnp.zeros((), x.dtype), config)
  out_shape = [(size - (w - 1) * wd - 1) // s + 1 for size, w, wd, s in
               zip(x.shape, window_dimensions, window_dilation, window_strides)]
  acc = lax.full(tuple(out_shape), init, x.dtype)
  for offset in itertools.product(*[range(w) for w in window_dimensions]):
    start = [o * wd for o, wd in zip(offset, window_dilation)]
    limit = [st + (o - 1) * s + 1 for st, o, s in zip(start, out_shape, window_strides)]
    acc = acc + lax.slice(x, start, limit, window_strides)
  return acc.astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# The interpreter.

# Primitives kept as they are: elementwise (each output element from its inputs' elements
# alone), structural (moves, slices, gathers, overwriting scatters: with duplicate indices,
# which write wins is XLA's choice, but no float is summed), exact reductions (max, min,
# logical), integer bits, sorts.
_ALLOWED = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e bitcast_convert_type
broadcast_in_dim cbrt ceil clamp clz complex concatenate conj convert_element_type copy copy_p
cos cosh digamma div dynamic_slice dynamic_update_slice eq erf erf_inv erfc exp2 expand_dims
expm1 floor ge gather gt igamma igamma_grad_a igammac imag integer_pow iota is_finite le lgamma
log log1p logistic lt max min mul ne neg nextafter not or polygamma population_count pow real
reduce_precision regularized_incomplete_beta rem reshape rev round rsqrt select_n shift_left
shift_right_arithmetic shift_right_logical sign sin sinh slice sqrt square squeeze sub tan tanh
transpose xor zeta pad split
argmax argmin reduce_max reduce_min reduce_and reduce_or reduce_xor cummax cummin
reduce_window_max reduce_window_min sort top_k scatter scatter-min scatter-max
random_bits random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32
rng_bit_generator rng_uniform stop_gradient optimization_barrier sharding_constraint
device_put mesh_cast reshard pvary axis_index pmax pmin all_gather ppermute all_to_all
debug_callback name pbroadcast pcast platform_index all_gather_invariant
""".split())

_LINALG = frozenset("""
cholesky eig eigh lu lu_pivots_to_permutation qr householder_product svd triangular_solve
schur hessenberg tridiagonal tridiagonal_solve custom_linear_solve linear_solve
""".split())


_STATE = threading.local()  # .outer: the equations whose bodies are being evaluated


def _outer() -> list:
  if not hasattr(_STATE, "outer"):
    _STATE.outer = []
  return _STATE.outer


def _hoisted() -> dict:
  """{id(weight leaf being evaluated): {permutation: its transposed copy}} (`Weights`)."""
  return getattr(_STATE, "hoisted", {})


def _where(eqn) -> str:
  """The user's source line of `eqn`, or of the innermost enclosing equation that has one.

  (jax.numpy wraps some ops in a `jit`, whose inner equations carry only JAX's own frames.)
  """
  try:
    from jax._src import source_info_util  # pylint: disable=import-outside-toplevel
    for candidate in [eqn] + _outer()[-2::-1]:
      where = source_info_util.summarize(candidate.source_info)
      if where:
        return where
  except Exception:  # pylint: disable=broad-except
    pass
  return "an unknown line"


def _refuse(eqn, why: str):
  raise BatchInvariantError(
      f"batch_invariant cannot rewrite `{eqn.primitive.name}` at {_where(eqn)}: {why}")


def _out_dtype(eqn, i=0):
  return eqn.outvars[i].aval.dtype


def _float_in(eqn) -> bool:
  return any(_is_float(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype"))


def _float_out(eqn) -> bool:
  return any(_is_float(v.aval.dtype) for v in eqn.outvars if hasattr(v.aval, "dtype"))


def _bind(eqn, invals):
  return eqn.primitive.bind(*invals, **eqn.params)


def _closed_fn(closed):
  """A Python function evaluating a ClosedJaxpr rewritten (flat args -> list of outputs)."""
  return lambda *args: _eval_jaxpr(closed.jaxpr, closed.consts, args)


def _open_fn(jaxpr):
  return lambda *args: _eval_jaxpr(jaxpr, (), args)


def _rewrite(eqn, invals):
  """The rewritten outputs of one equation (a list), or of a bound primitive as is."""
  name = eqn.primitive.name
  p = eqn.params
  if name == "reduce_sum":
    if not _is_float(invals[0].dtype):
      return _bind(eqn, invals)
    return [fixed_sum(invals[0], p["axes"])]
  if name == "reduce_prod":
    if not _is_float(invals[0].dtype):
      return _bind(eqn, invals)
    return [fixed_prod(invals[0], p["axes"])]
  if name == "dot_general":
    out_dtype = _out_dtype(eqn)
    if not _is_float(out_dtype):
      return _bind(eqn, invals)
    return [chain_dot(invals[0], invals[1], p["dimension_numbers"], out_dtype)]
  if name == "exp":
    x = invals[0]
    if x.dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
      return [fixed_exp(x)]
    if jnp.issubdtype(x.dtype, jnp.floating):  # float64: no measured dependence; kept
      return _bind(eqn, invals)
    _refuse(eqn, "complex exp is not rewritten")
  if name == "log" and invals[0].dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    return [fixed_log(invals[0])]  # other dtypes: kept (float64: not measured; complex)
  if name in ("cumsum", "cumprod", "cumlogsumexp"):
    if not _is_float(invals[0].dtype):
      return _bind(eqn, invals)
    op, init = {"cumsum": (lax.add, 0), "cumprod": (lax.mul, 1),
                "cumlogsumexp": (_logaddexp, -np.inf)}[name]
    return [fixed_cumulative(invals[0], p["axis"], p["reverse"], op, init)]
  if name == "reduce_window_sum":
    if not _is_float(invals[0].dtype):
      return _bind(eqn, invals)
    return [window_sum(invals[0], 0, p["window_dimensions"], p["window_strides"], p["padding"],
                       p["base_dilation"], p["window_dilation"])]
  if name == "reduce_window":
    if not _float_out(eqn):
      return _bind(eqn, invals)
    body = p["jaxpr"].jaxpr if hasattr(p["jaxpr"], "jaxpr") else p["jaxpr"]
    if (len(invals) != 2 or len(body.eqns) != 1 or body.eqns[0].primitive.name != "add"):
      _refuse(eqn, "a float reduce_window whose computation is not one add")
    return [window_sum(invals[0], invals[1], p["window_dimensions"], p["window_strides"],
                       p["padding"], p["base_dilation"], p["window_dilation"])]
  if name == "scatter-add":
    if not _is_float(invals[0].dtype):
      return _bind(eqn, invals)
    return [_scatter_add(eqn, *invals)]
  if name in ("scatter-mul", "select_and_scatter_add", "scatter_add"):
    if _float_out(eqn):
      _refuse(eqn, "a float scatter that combines updates in an order XLA picks")
    return _bind(eqn, invals)
  if name == "jit" or name in ("pjit", "closed_call", "core_call"):
    closed = p.get("jaxpr", p.get("call_jaxpr"))
    if hasattr(closed, "consts"):
      return _closed_fn(closed)(*invals)
    return _open_fn(closed)(*invals)
  if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
    closed = p.get("call_jaxpr", p.get("fun_jaxpr"))
    return _closed_fn(closed)(*invals)
  if name in ("remat2", "checkpoint", "remat"):
    fn = jax.checkpoint(_open_fn(p["jaxpr"]), prevent_cse=p["prevent_cse"], policy=p["policy"])
    return list(fn(*invals))
  if name == "scan":
    return _scan(eqn, invals)
  if name == "shard_map":
    fn = lambda *args: tuple(_open_fn(p["jaxpr"])(*args))
    return list(jax.shard_map(fn, mesh=p["mesh"], in_specs=p["in_specs"],
                              out_specs=p["out_specs"], check_vma=p["check_vma"],
                              axis_names=set(p["newly_manual_axes"]))(*invals))
  if name == "while":
    return _while(eqn, invals)
  if name == "cond":
    branches = [_closed_fn(b) for b in p["branches"]]
    return list(lax.switch(invals[0], branches, *invals[1:]))
  if name in ("psum", "psum2", "psum_invariant", "reduce_scatter", "psum_scatter"):
    if _float_in(eqn):
      _refuse(eqn, "a float sum across devices, in an order the runtime picks")
    return _bind(eqn, invals)
  if name in ("fft",):
    _refuse(eqn, "an FFT sums in an order its library picks")
  if name in ("pure_callback", "io_callback", "host_callback", "outside_call"):
    if _float_out(eqn):
      _refuse(eqn, "a host callback returning floats computes them out of sight")
    return _bind(eqn, invals)
  if name == "conv_general_dilated":
    if not _float_out(eqn):
      return _bind(eqn, invals)
    if p["batch_group_count"] != 1:
      _refuse(eqn, "a convolution with batch_group_count > 1 is not rewritten")
    return [chain_conv(invals[0], invals[1], p["window_strides"], p["padding"],
                       p["lhs_dilation"], p["rhs_dilation"], p["dimension_numbers"],
                       p["feature_group_count"], _out_dtype(eqn))]
  if name in ("mul", "square", "integer_pow") and _is_float(_out_dtype(eqn)):
    x = invals[0]
    if name == "mul":
      return [exact_product(x, invals[1])]
    return [_integer_power(x, 2 if name == "square" else p["y"])]
  if name == "transpose":  # of a weight `Weights` carries transposed: read the copy
    copy = _hoisted().get(id(invals[0]), {}).get(tuple(p["permutation"]))
    return [copy] if copy is not None else _bind(eqn, invals)
  if name in _LINALG:
    _refuse(eqn, "linear algebra kernels order their sums themselves")
  if name in ("pallas_call", "ffi_call", "custom_call", "tpu_custom_call", "mosaic_gpu_call",
              "triton_kernel_call"):
    _refuse(eqn, "a custom kernel orders its sums itself")
  if name in _ALLOWED:
    return _bind(eqn, invals)
  _refuse(eqn, "not known to be free of float sums (not on the allow-list)")


def _scatter_add(eqn, operand, indices, updates):
  """A float scatter-add, one update at a time in the order of the updates."""
  p = eqn.params
  dn = p["dimension_numbers"]
  if dn.operand_batching_dims:
    # Batching dims (vmap of a scatter) made explicit: each update's batch coordinates join its
    # index vector, and the operand's batching dims become inserted window dims.
    coords = [lax.broadcasted_iota(indices.dtype, indices.shape[:-1] + (1,), d)
              for d in dn.scatter_indices_batching_dims]
    indices = lax.concatenate([indices] + coords, indices.ndim - 1)
    dn = lax.ScatterDimensionNumbers(
        update_window_dims=dn.update_window_dims,
        inserted_window_dims=tuple(sorted(dn.inserted_window_dims + dn.operand_batching_dims)),
        scatter_dims_to_operand_dims=(tuple(dn.scatter_dims_to_operand_dims) +
                                      tuple(dn.operand_batching_dims)),
        operand_batching_dims=(), scatter_indices_batching_dims=())
  window = tuple(dn.update_window_dims)
  scatter_dims = tuple(d for d in range(updates.ndim) if d not in window)
  count = math.prod(updates.shape[d] for d in scatter_dims)
  if count == 0:
    return operand
  upd = lax.transpose(updates, scatter_dims + window)
  upd = upd.reshape((count,) + upd.shape[len(scatter_dims):])
  idx = indices.reshape((count, indices.shape[-1]))
  new_dn = lax.ScatterDimensionNumbers(
      update_window_dims=tuple(range(1, 1 + len(window))),
      inserted_window_dims=dn.inserted_window_dims,
      scatter_dims_to_operand_dims=dn.scatter_dims_to_operand_dims,
      operand_batching_dims=(), scatter_indices_batching_dims=())

  def step(i, acc):
    one_idx = lax.dynamic_slice_in_dim(idx, i, 1, axis=0)
    one_upd = lax.dynamic_slice_in_dim(upd, i, 1, axis=0)
    return lax.scatter_add(acc, one_idx, one_upd, new_dn, indices_are_sorted=True,
                           unique_indices=True, mode=p["mode"])

  return lax.fori_loop(0, count, step, operand)


def _scan(eqn, invals):
  p = eqn.params
  nc, ncarry = p["num_consts"], p["num_carry"]
  consts, carry, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
  body = _closed_fn(p["jaxpr"])

  def step(c, x):
    out = body(*consts, *c, *x)
    return list(out[:ncarry]), list(out[ncarry:])

  carry, ys = lax.scan(step, list(carry), list(xs), length=p["length"], reverse=p["reverse"],
                       unroll=p["unroll"])
  return list(carry) + list(ys)


def _while(eqn, invals):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
  cond, body = _closed_fn(p["cond_jaxpr"]), _closed_fn(p["body_jaxpr"])
  out = lax.while_loop(lambda c: cond(*cconsts, *c)[0], lambda c: list(body(*bconsts, *c)),
                       list(init))
  return list(out)


def _eval_jaxpr(jaxpr, consts, args) -> list:
  from jax._src import core  # pylint: disable=import-outside-toplevel
  env = {}

  def read(v):
    return v.val if isinstance(v, core.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    _outer().append(eqn)
    try:
      out = _rewrite(eqn, invals)
    finally:
      _outer().pop()
    if not isinstance(out, (list, tuple)):
      out = [out]
    for v, o in zip(eqn.outvars, out):
      if type(v).__name__ != "DropVar":
        if hasattr(o, "dtype") and o.dtype != v.aval.dtype:
          o = lax.convert_element_type(o, v.aval.dtype)
        env[v] = o
  return [read(v) for v in jaxpr.outvars]


# ---------------------------------------------------------------------------------------------
# Weights: transposes of weights made once, outside a loop.


class Weights(NamedTuple):
  """Weights with the transposed copies a `batch_invariant` function reads (`f.prepare`).

  A chain reads a product's operands contraction-major, so a weight the model transposes (a
  GPT-2 `Conv1D` kernel, a tied embedding as the output layer) is transposed into a copy on
  every call, which XLA cannot move out of a decoding loop that calls the model under a
  `cond`. `Weights` carries those copies, made once: `transposed[(leaf, permutation)]` is
  `lax.transpose(leaf'th leaf of weights, permutation)`. A pytree: carry it in a loop's state.
  """
  weights: Any
  transposed: dict


def _weight_transposes(jaxpr, leaves: dict) -> set:
  """{(leaf, permutation)}: the float transposes `jaxpr` applies to `leaves` ({var: leaf index}),
  looked for inside the `jit`s it calls (which the interpreter inlines), not inside loops."""
  from jax._src import core  # pylint: disable=import-outside-toplevel
  found = set()
  for eqn in jaxpr.eqns:
    invars = [v if isinstance(v, core.Var) else None for v in eqn.invars]
    if (eqn.primitive.name == "transpose" and invars[0] in leaves
        and _is_float(invars[0].aval.dtype)):
      found.add((leaves[invars[0]], tuple(eqn.params["permutation"])))
    elif eqn.primitive.name in ("jit", "pjit", "closed_call", "core_call"):
      inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      inner = getattr(inner, "jaxpr", inner)
      found |= _weight_transposes(inner, {iv: leaves[ov] for ov, iv in zip(invars, inner.invars)
                                          if ov in leaves})
  return found


# ---------------------------------------------------------------------------------------------
# The transformation.


def _flat_call(fn: Callable, args: tuple, kwargs: dict):
  """`(flat, plain)`: the leaves of `(args, kwargs)` as arrays, and `fn` as a function of them."""
  flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
  flat = [jnp.asarray(a) if not hasattr(a, "dtype") else a for a in flat]

  def plain(*flat_args):
    call_args, call_kwargs = jax.tree_util.tree_unflatten(in_tree, flat_args)
    return fn(*call_args, **call_kwargs)

  return flat, plain


def batch_invariant(fn: Callable, *, weights: int | None = None) -> Callable:
  """Makes `fn` batch-invariant: every float sum it does gets an order the program fixes.

  Like `jax.vmap`, it returns a function of the same arguments. When called, `fn` is traced
  (`jax.make_jaxpr`) on the arguments' shapes and dtypes, and the jaxpr evaluated with every
  order-choosing float reduction rewritten (see the module docstring for the constructions):
  products, sums and cumulative sums as in-order chains from +0.0, scatter-adds one update at a
  time, `exp` in basic arithmetic. Control flow (`jit`, `scan`, `while_loop`, `cond`/`switch`,
  `checkpoint`, `shard_map`, custom derivative rules) is rewritten inside. It composes with
  `jax.jit`, `jax.vmap` (either side) and derivatives (`grad`, `value_and_grad`, `jvp`,
  `vjp`): forward values are the rewritten function's, derivatives those of the plain `fn`
  (plain products).

  Promise: on one machine (and one JAX/XLA), a row's results do not depend on the other rows of
  the batch nor on the batch size, and a sum, product or cumulative sum does not depend on exact
  zeros added at either end of its reduction axis (left or right padding). Not promised: equal
  bits across machines (XLA may contract a chain's multiply and add into one FMA; it does so
  alike for every element and batch size of one machine, but not on every CPU or GPU alike;
  the function's own float multiplies are made exact so that contraction cannot matter), nor
  equal bits between `jit` and eager evaluation (eager runs each op alone: no FMA across ops).

  Cost: products run as elementwise code instead of a matrix kernel (measured on XLA:CPU:
  0.8x a plain product of [8,256] @ [256,1024], 2x at [64,1024] @ [1024,1024]); a softmax
  about 2x; see the module docstring.

  Refused (a `BatchInvariantError`, both `NotImplementedError` and `ValueError`, at trace time,
  naming the primitive and the source line): FFTs, linear algebra, convolutions with
  `batch_group_count` > 1 (which only gradients make), host
  callbacks returning floats (`pure_callback`, `io_callback`), custom kernels (`pallas_call`,
  `ffi_call`), float cross-device sums (`psum`, inside `shard_map`), and any primitive not on
  the allow-list of elementwise, structural and exact operations.

  Weights the same across calls (a decoding loop's): with `weights=i`, positional argument i
  holds them, and the returned function has `prepare(*args, **kwargs)`, which traces `fn` on a
  call's arguments and returns argument i as `Weights`: the weights and a transposed copy of
  each weight `fn` transposes. Given the `Weights` in place of the weights, a call reads the
  copies instead of transposing (the same bits): make them once, outside the loop (measured:
  transformers' Flax GPT-2, whose `Conv1D` kernels and tied output layer are transposed, spent
  about 2 ms of a 7 ms step copying them). It holds those weights twice.

  Args:
    fn: a function of arrays (pytrees in and out, positional or keyword arguments, all
      traced). Bind static arguments with `functools.partial` first.
    weights: the position of an argument holding weights that calls share, or None.

  Returns:
    The batch-invariant function, with `fn`'s signature.

  Example:
    >>> import numpy as np
    >>> from jaxdecode import batch_invariant
    >>> probs = jax.jit(batch_invariant(lambda x, w: jax.nn.softmax(x @ w, axis=-1)))
    >>> x = np.random.default_rng(0).standard_normal((7, 64)).astype(np.float32)
    >>> w = np.random.default_rng(1).standard_normal((64, 100)).astype(np.float32)
    >>> bool((probs(x, w)[3] == probs(x[3:4], w)[0]).all())  # row 3 alone: the same bits
    True
  """

  if weights is not None and (isinstance(weights, bool) or not isinstance(weights, int)
                              or weights < 0):
    raise ValueError(f"weights must be the position of an argument (an int >= 0) or None; "
                     f"got {weights!r}")

  def first_leaf(args) -> int:
    """The flat index of argument `weights`' first leaf among the leaves of `(args, kwargs)`."""
    return len(jax.tree_util.tree_leaves(args[:weights]))

  def unpacked(args):
    """(args with `Weights` replaced by its weights, {flat leaf index: {perm: copy}})."""
    if weights is None or len(args) <= weights or not isinstance(args[weights], Weights):
      return args, {}
    given = args[weights]
    args = args[:weights] + (given.weights,) + args[weights + 1:]
    offset = first_leaf(args)
    copies = {}
    for (leaf, perm), copy in given.transposed.items():
      copies.setdefault(offset + leaf, {})[tuple(perm)] = copy
    return args, copies

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    args, copies = unpacked(args)
    flat, plain = _flat_call(fn, args, kwargs)
    where = [(i, perm) for i in sorted(copies) for perm in sorted(copies[i])]
    extra = [copies[i][perm] for i, perm in where]
    closed, out_shape = jax.make_jaxpr(plain, return_shape=True)(*flat)
    out_tree = jax.tree_util.tree_structure(out_shape)

    def rewritten(*flat_args):
      flat_args, extra_args = flat_args[:len(flat)], flat_args[len(flat):]
      hoisted = {}
      for (i, perm), copy in zip(where, extra_args):
        hoisted.setdefault(id(flat_args[i]), {})[perm] = copy
      previous, _STATE.hoisted = _hoisted(), hoisted
      try:
        return _eval_jaxpr(closed.jaxpr, closed.consts, flat_args)
      finally:
        _STATE.hoisted = previous

    @jax.custom_jvp
    def run(*flat_args):
      return rewritten(*flat_args)

    @run.defjvp
    def _jvp(primals, tangents):
      # The copies' tangents are dropped: the plain `fn` differentiates through the weights.
      out = rewritten(*primals)
      _, tangents_out = jax.jvp(lambda *a: jax.tree_util.tree_leaves(plain(*a)),
                                list(primals[:len(flat)]), list(tangents[:len(flat)]))
      return out, tangents_out

    return jax.tree_util.tree_unflatten(out_tree, run(*flat, *extra))

  def prepare(*args, **kwargs) -> Weights:
    """Argument `weights` of a call with these arguments, as `Weights` (see `batch_invariant`)."""
    args, _ = unpacked(args)
    if len(args) <= weights:
      raise ValueError(f"prepare needs the arguments of a call: argument {weights} (the "
                       f"weights) is missing; got {len(args)} positional arguments")
    flat, plain = _flat_call(fn, args, kwargs)
    offset, leaves = first_leaf(args), jax.tree_util.tree_leaves(args[weights])
    closed = jax.make_jaxpr(plain)(*flat)
    found = _weight_transposes(closed.jaxpr, {v: i - offset for i, v in
                                              enumerate(closed.jaxpr.invars)
                                              if offset <= i < offset + len(leaves)})
    return Weights(args[weights], {(leaf, perm): lax.transpose(jnp.asarray(leaves[leaf]), perm)
                                   for leaf, perm in sorted(found)})

  if weights is not None:
    wrapped.prepare = prepare
  return wrapped


batch_invariant.Weights = Weights  # reachable as jaxdecode.batch_invariant.Weights (the function)
