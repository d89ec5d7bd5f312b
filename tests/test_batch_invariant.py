"""`jaxdecode.batch_invariant`: a row's bits alone equal its bits in any batch, and padding.

Every program is checked twice: against a NumPy float64 reference (within float32 tolerance:
the rewrite computes the same function), and bit for bit between a row alone and the same row
inside batches of 2, 3, 7 and 33 rows (the other rows random, the row at a random slot).
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxdecode
from jaxdecode import batch_invariant
from jaxdecode.batch_invariant import BatchInvariantError
from jaxdecode.batch_invariant import exact_product
from jaxdecode.batch_invariant import fixed_exp
from jaxdecode.batch_invariant import fixed_log
from jaxdecode.invariance import unordered_sums

BATCHES = (2, 3, 7, 33)
D, F = 45, 70
SCATTER_INDEX = np.array([0, 3, 3, 5, 0, 3, 44, 1], np.int32)


def _bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _assert_bitwise(a, b, what=""):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape, what
  same = _bits(a) == _bits(b)
  assert same.all(), f"{what}: {np.sum(~same)} of {same.size} differ, max |diff| " \
      f"{np.nanmax(np.abs(a.astype(np.float64) - b)):.3g}"


def _assert_row_in_batch(fn, needle, alone, rng, *, batch, slot, args=(), scale=1.0):
  """`fn`'s outputs for the batch of one `needle` (`alone`) are bitwise those of row `slot` of a
  batch of `batch` random rows (standard normal times `scale`, drawn from `rng`) holding the
  needle there; `args` follow the batch. Outputs are pytrees, compared leaf by leaf."""
  x = rng.standard_normal((batch, *needle.shape[1:])).astype(np.float32) * scale
  x[slot] = needle[0]
  together, _ = jax.tree_util.tree_flatten_with_path(fn(x, *args))
  for (path, a), b in zip(together, jax.tree.leaves(alone)):
    _assert_bitwise(a[slot], b[0], f"{jax.tree_util.keystr(path)}, batch {batch}, slot {slot}")


def _weights(seed=0):
  rng = np.random.default_rng(seed)
  return dict(w=rng.standard_normal((D, F)).astype(np.float32) / 6,
              w3=rng.standard_normal((3, 15, 20)).astype(np.float32) / 4)


def _rows_program(x, w, w3):
  """[B, D] rows -> a dict of per-row results, one or more per rewritten primitive."""
  b = x.shape[0]
  xh = x.reshape(b, 3, 15)
  small = 1.0 + 0.01 * x
  return {
      "matmul": x @ w,
      "einsum_batch_dim": jnp.einsum("bhd,hdf->bhf", xh, w3),
      "einsum_two_contracting": jnp.einsum("bhd,hdf->bf", xh, w3),
      "bf16_preferred_f32": lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                            (((1,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32),
      "sum": jnp.sum(x, axis=-1),
      "var": jnp.var(x, axis=-1),
      "prod": jnp.prod(small, axis=-1),
      "logsumexp": jax.nn.logsumexp(x, axis=-1),
      "softmax": jax.nn.softmax(x, axis=-1),
      "cumsum": jnp.cumsum(x, axis=-1),
      "cumsum_reverse": lax.cumsum(x, axis=1, reverse=True),
      "cumlogsumexp": lax.cumlogsumexp(x, axis=1),
      "cumprod": lax.cumprod(small, axis=1),
      "window_sum": lax.reduce_window(x, 0.0, lax.add, (1, 3), (1, 2), ((0, 0), (1, 1))),
      "window_sum_init": lax.reduce_window(x, 1.5, lax.add, (1, 4), (1, 1), "VALID"),
      "scatter_add": x.at[:, SCATTER_INDEX].add(2.0 * x[:, :8]),
      "exp_of_3": jnp.exp(x[:, :3]),
  }


def _rows_reference(x, w, w3):
  """`_rows_program` in NumPy float64."""
  x, w, w3 = (np.asarray(a, np.float64) for a in (x, w, w3))
  b = x.shape[0]
  xh = x.reshape(b, 3, 15)
  small = 1.0 + 0.01 * x
  m = x.max(-1, keepdims=True)
  lse = np.log(np.exp(x - m).sum(-1)) + m[:, 0]
  padded = np.pad(x, ((0, 0), (1, 1)))
  scattered = x.copy()
  np.add.at(scattered, (slice(None), SCATTER_INDEX), 2.0 * x[:, :8])
  bf = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)
  return {
      "matmul": x @ w,
      "einsum_batch_dim": np.einsum("bhd,hdf->bhf", xh, w3),
      "einsum_two_contracting": np.einsum("bhd,hdf->bf", xh, w3),
      "bf16_preferred_f32": bf(x) @ bf(w),
      "sum": x.sum(-1),
      "var": x.var(-1),
      "prod": small.prod(-1),
      "logsumexp": lse,
      "softmax": np.exp(x - lse[:, None]),
      "cumsum": np.cumsum(x, -1),
      "cumsum_reverse": np.cumsum(x[:, ::-1], -1)[:, ::-1],
      "cumlogsumexp": np.logaddexp.accumulate(x, axis=1),
      "cumprod": np.cumprod(small, -1),
      "window_sum": np.stack([padded[:, i:i + 3].sum(-1) for i in range(0, D, 2)], -1),
      "window_sum_init": np.stack([1.5 + x[:, i:i + 4].sum(-1) for i in range(D - 3)], -1),
      "scatter_add": scattered,
      "exp_of_3": np.exp(x[:, :3]),
  }


GROUPS = {
    "products": ("matmul", "einsum_batch_dim", "einsum_two_contracting", "bf16_preferred_f32"),
    "sums": ("sum", "var", "prod", "logsumexp", "softmax", "exp_of_3"),
    "scans": ("cumsum", "cumsum_reverse", "cumlogsumexp", "cumprod", "window_sum",
              "window_sum_init", "scatter_add"),
}


@functools.lru_cache(maxsize=None)
def _group_program(group):
  """One jitted program per group: its compilations are shared by the batch sizes' tests."""
  names = GROUPS[group]
  return jax.jit(batch_invariant(lambda x, w, w3: {n: _rows_program(x, w, w3)[n] for n in names}))


@functools.lru_cache(maxsize=None)
def _needle(group):
  """The needle row and its results alone, checked against float64 and plain XLA once."""
  weights = _weights()
  needle = np.random.default_rng(1).standard_normal((1, D)).astype(np.float32)
  alone = _group_program(group)(needle, **weights)
  reference = _rows_reference(needle, **weights)
  names = GROUPS[group]
  plain = jax.jit(lambda x, w, w3: {n: _rows_program(x, w, w3)[n] for n in names})(
      needle, **weights)
  for name, value in alone.items():
    np.testing.assert_allclose(np.asarray(value, np.float64), reference[name], rtol=2e-5,
                               atol=2e-5, err_msg=name)
    np.testing.assert_allclose(value, plain[name], rtol=2e-5, atol=2e-5, err_msg=name)
  return needle, alone


def _check_rows(group, batch):
  needle, alone = _needle(group)
  rng = np.random.default_rng(batch)
  slot = int(rng.integers(batch))
  _assert_row_in_batch(lambda x: _group_program(group)(x, **_weights()), needle, alone, rng,
                       batch=batch, slot=slot, scale=3)


@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.slow
def test_a_row_alone_and_in_a_batch_of_3_bitwise_and_close_to_float64(group):
  """Alone: NumPy float64's result within float32 tolerance, and plain XLA's; in 3 rows: bits."""
  _check_rows(group, 3)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [2, 7, 33])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_a_row_alone_and_in_batches_of_2_7_33_bitwise(group, batch):
  _check_rows(group, batch)


def test_a_product_row_alone_and_in_a_large_output_bitwise():
  """A row of a small product ([1, 17, 32] @ [32, 97], 1,649 outputs) and the same row of a
  large one (12 rows, 19,788 outputs), and of [33, 70] @ [70, 600]. A second layout for large
  outputs (blocks of 32 terms) once gave 82 of that row's 1,649 outputs other bits here: XLA
  contracted other multiply-adds into FMAs in it. One loop at every shape gives the same bits."""
  rng = np.random.default_rng(14)
  product = jax.jit(batch_invariant(lambda x, w: x @ w))
  for x_shape, w_shape in (((12, 17, 32), (32, 97)), ((33, 70), (70, 600))):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    together = product(x, w)
    _assert_bitwise(together[0], product(x[:1], w)[0], f"{x_shape} row 0")
    _assert_bitwise(together[-1], product(x[-1:], w)[0], f"{x_shape} last row")
    np.testing.assert_allclose(together, np.asarray(x, np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_window_sums_with_padding_and_dilations_are_xlas():
  x = np.random.default_rng(15).standard_normal((3, 10)).astype(np.float32)
  for f in (lambda x: lax.reduce_window(x, 1.5, lax.add, (1, 3), (1, 2), ((0, 0), (2, 1))),
            lambda x: lax.reduce_window(x, 0.0, lax.add, (2, 3), (1, 2), ((1, 0), (2, 1)),
                                        base_dilation=(1, 2), window_dilation=(1, 2)),
            lambda x: lax.reduce_window(x, 1.5, lax.add, (2, 3), (1, 1), ((1, 0), (2, 1)),
                                        base_dilation=(2, 1))):
    np.testing.assert_allclose(jax.jit(batch_invariant(f))(x), f(x), rtol=1e-6, atol=1e-6)


def test_convolutions_as_patches_and_chains():
  """Strides, padding, both dilations, feature groups, NHWC and NCW: XLA's values, no
  convolution left, and an image's bits alone equal to its bits in a batch of 3."""
  rng = np.random.default_rng(16)
  cases = (
      (lambda x, w: lax.conv_general_dilated(
          x, w, (2, 1), ((1, 2), (0, 1)), lhs_dilation=(1, 2), rhs_dilation=(2, 1),
          dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2),
       rng.standard_normal((3, 9, 11, 4)), rng.standard_normal((3, 2, 2, 6))),
      (lambda x, w: lax.conv_general_dilated(x, w, (1,), "SAME"),
       rng.standard_normal((3, 5, 20)), rng.standard_normal((7, 5, 3))),
  )
  for f, x, w in cases:
    x, w = x.astype(np.float32), w.astype(np.float32)
    conv = jax.jit(batch_invariant(f))
    together = conv(x, w)
    np.testing.assert_allclose(together, f(x, w), rtol=1e-5, atol=1e-5)
    _assert_bitwise(together[1], conv(x[1:2], w)[0], "image 1")
    assert unordered_sums(batch_invariant(f), x, w) == []


def _padded_program(scores, x, v, w):
  """Reductions of one row over an axis whose ends may hold masked terms."""
  return {
      "sum": jnp.sum(x, axis=-1),
      "dot": x @ w,
      "logsumexp": jax.nn.logsumexp(scores, axis=-1),
      "attention": jax.nn.softmax(scores, axis=-1) @ v,
      "cumsum": jnp.cumsum(x, axis=-1),
  }


@pytest.mark.parametrize("lead,trail", [
    (3, 5), pytest.param(1, 0, marks=pytest.mark.slow), pytest.param(0, 1, marks=pytest.mark.slow),
    pytest.param(17, 2, marks=pytest.mark.slow)])
def test_masked_terms_at_either_end_change_no_bit(lead, trail):
  """Left padding shifts a row's cache slots: zero (exp(-inf)) terms before and after it."""
  rng = np.random.default_rng(3)
  n, rows = 11, 3
  scores = rng.standard_normal((rows, n)).astype(np.float32) * 4
  x = rng.standard_normal((rows, n)).astype(np.float32)
  v = rng.standard_normal((n, 6)).astype(np.float32)
  w = rng.standard_normal((n, 5)).astype(np.float32)
  program = jax.jit(batch_invariant(_padded_program))
  base = program(scores, x, v, w)
  pad = lambda a, value: np.pad(a, ((0, 0), (lead, trail)), constant_values=value)
  garbage = lambda a: np.concatenate([rng.standard_normal((lead, a.shape[1])), a,
                                      rng.standard_normal((trail, a.shape[1]))]).astype(np.float32)
  shifted = program(pad(scores, -np.inf), pad(x, 0.0), garbage(v), garbage(w))
  for name in ("sum", "dot", "logsumexp", "attention"):
    _assert_bitwise(shifted[name], base[name], name)
  _assert_bitwise(shifted["cumsum"][:, lead:lead + n], base["cumsum"], "cumsum")


def _same_bits_at_every_length(fn, values):
  """fn(values), after checking that each input gets the same bits in arrays of the lengths
  where XLA:CPU's own kernels were measured to take other code paths (and a few others)."""
  ref = np.asarray(fn(values))
  for n in (1, 2, 3, 5, 7, 11, 13, 15, 17):
    for start in range(0, len(values) - n, 37):
      _assert_bitwise(fn(values[start:start + n]), ref[start:start + n], f"length {n}")
  return ref


def test_exp_is_elementwise_everywhere_and_accurate():
  """`fixed_exp`: the same bits for an input in arrays of every length; within 2 ulp of exp."""
  values = np.concatenate([np.random.default_rng(4).standard_normal(64) * 5,
                           np.linspace(-103, 88.7, 200)]).astype(np.float32)
  exp = jax.jit(fixed_exp)
  ref = _same_bits_at_every_length(exp, values)
  exact = np.exp(values.astype(np.float64))
  normal = exact > np.finfo(np.float32).tiny
  ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
  assert np.max(np.abs(ref - exact)[normal] / ulp[normal]) <= 2.0
  # Subnormal results: XLA:CPU flushes them to zero (so does its own exp).
  assert np.max(np.abs(ref - exact)[~normal]) <= np.finfo(np.float32).tiny
  special = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 89.0, -110.0], np.float32)
  with np.errstate(over="ignore"):
    want = np.exp(special.astype(np.float64)).astype(np.float32)
  np.testing.assert_array_equal(exp(special), want)


def test_log_is_elementwise_everywhere_and_accurate():
  """`fixed_log`: the same bits for an input in arrays of every length (XLA:CPU's own `log`
  was measured to differ at 3, 5-7, 11 and 13-15 elements); within 1 ulp of log; and what
  `batch_invariant` makes of `jnp.log`."""
  rng = np.random.default_rng(19)
  values = np.concatenate([np.exp(rng.uniform(-80, 80, 300)),
                           rng.uniform(0.5, 2.0, 100)]).astype(np.float32)
  log = jax.jit(fixed_log)
  ref = _same_bits_at_every_length(log, values)
  exact = np.log(values.astype(np.float64))
  ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
  assert np.max(np.abs(ref - exact) / ulp) <= 1.0
  special = np.array([0.0, -0.0, -1.0, np.inf, np.nan, 1.0, np.finfo(np.float32).tiny],
                     np.float32)
  with np.errstate(divide="ignore", invalid="ignore"):
    np.testing.assert_array_equal(log(special), np.log(special))
  _assert_bitwise(jax.jit(batch_invariant(jnp.log))(values), ref, "batch_invariant(jnp.log)")


def test_a_product_followed_by_an_add_has_the_same_bits_fused_or_not():
  """XLA contracts `a * b + c` into one FMA when the multiply and the add share a fused kernel,
  and which ops share one depends on the shapes (a transformers Llama step's rotary embedding
  got other bits alone than in a batch of 5). `exact_product` (what a float `mul` becomes) has
  exact partial products, so fused (one program) and unfused (the product materialized by a
  program of its own, then added) give the same bits; and it is a * b within 2 ulp."""
  rng = np.random.default_rng(18)
  a, b = (rng.standard_normal(4096).astype(np.float32) for _ in range(2))
  c = -(a * b) + rng.standard_normal(4096).astype(np.float32) * 1e-3  # cancellation: FMA shows
  fused = jax.jit(lambda a, b, c: exact_product(a, b) + c)(a, b, c)
  product = jax.jit(exact_product)(a, b)
  _assert_bitwise(fused, jax.jit(lambda p, c: p + c)(product, c), "exact_product fused")
  exact = a.astype(np.float64) * b
  ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
  assert np.max(np.abs(np.asarray(product, np.float64) - exact) / ulp) <= 2.0
  special = np.array([np.inf, -np.inf, np.nan, 0.0, 3e38, 1e-30], np.float32)
  with np.errstate(over="ignore", invalid="ignore"):
    want = special * special[::-1]
  np.testing.assert_array_equal(jax.jit(exact_product)(special, special[::-1]), want)
  for dtype in (jnp.bfloat16, jnp.float16):
    x, y = (jnp.asarray(v[:64], dtype) for v in (a, b))
    _assert_bitwise(exact_product(x, y), (x.astype(np.float32) * y.astype(np.float32)).astype(
        dtype), str(dtype))
  # Powers go through it too: x ** 3 and x ** -2 within a few ulp.
  powers = jax.jit(batch_invariant(lambda x: (x ** 3, x ** -2, jnp.square(x))))(a[:64] + 2.0)
  x64 = a[:64].astype(np.float64) + 2.0
  for got, want in zip(powers, (x64 ** 3, x64 ** -2, x64 ** 2)):
    np.testing.assert_allclose(got, want, rtol=5e-7)


def test_nested_control_flow_scan_inside_jit_inside_cond():
  def f(x, w):
    @jax.jit
    def inner(x):
      def body(carry, row):
        carry = carry + jnp.sum(row * carry) * 1e-2 + row @ w
        return carry, jnp.mean(carry)
      return lax.scan(body, jnp.zeros(w.shape[1], x.dtype), x)

    def positive(x):
      carry, means = inner(x)
      return carry, means

    def negative(x):
      i, acc = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + x[c[0]] @ w),
                              (0, jnp.zeros(w.shape[1], x.dtype)))
      return acc, jnp.cumsum(x[:, 0])

    return lax.cond(jnp.sum(x) > 0, positive, negative, x)

  rng = np.random.default_rng(5)
  w = rng.standard_normal((9, 9)).astype(np.float32) / 3
  rows = jax.jit(jax.vmap(batch_invariant(f), in_axes=(0, None)))
  needle = rng.standard_normal((1, 4, 9)).astype(np.float32)
  for sign in (1, -1):
    needle = np.abs(needle) * sign
    alone = rows(needle, w)
    np.testing.assert_allclose(alone[0][0], jax.jit(f)(needle[0], w)[0], rtol=2e-5, atol=2e-5)
    _assert_row_in_batch(rows, needle, alone, rng, batch=7, slot=1, args=(w,))


def _loss(x, w):
  return jnp.sum(jax.nn.softmax(x @ w, axis=-1) * jnp.arange(F, dtype=jnp.float32)[None])


def _rewritten_loss():
  """`(batch_invariant(_loss), its jitted value, x, w)` for the differentiation tests."""
  w = _weights()["w"]
  x = np.random.default_rng(6).standard_normal((3, D)).astype(np.float32)
  f = batch_invariant(_loss)
  return f, jax.jit(f)(x, w), x, w


def test_grad_forward_values_are_the_rewritten_values():
  f, value, x, w = _rewritten_loss()
  value2, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)
  _assert_bitwise(value2, value, "value_and_grad's value")
  plain = jax.grad(_loss, argnums=(0, 1))(x, w)
  for g, p in zip(grads, plain):
    np.testing.assert_allclose(g, p, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_jvp_primal_is_the_rewritten_value():
  """jvp works too: the primal is the rewritten value, the tangent the plain function's."""
  f, value, x, w = _rewritten_loss()
  plain = jax.grad(_loss)(x, w)
  primal, tangent = jax.jit(lambda x, w, tx, tw: jax.jvp(f, (x, w), (tx, tw)))(
      x, w, np.ones_like(x), np.zeros_like(w))
  _assert_bitwise(primal, value, "jvp's primal")
  np.testing.assert_allclose(tangent, jnp.sum(plain), rtol=1e-4)


def test_vmap_either_side():
  w = _weights()["w"]
  row_fn = lambda row: jax.nn.softmax(row @ w) * jnp.sum(row)
  outside = jax.jit(jax.vmap(batch_invariant(row_fn)))
  inside = jax.jit(batch_invariant(jax.vmap(row_fn)))
  rng = np.random.default_rng(7)
  needle = rng.standard_normal((1, D)).astype(np.float32)
  for fn in (outside, inside):
    alone = fn(needle)
    np.testing.assert_allclose(alone, jax.vmap(row_fn)(needle), rtol=2e-5, atol=1e-6)
    _assert_row_in_batch(fn, needle, alone, rng, batch=33, slot=-1)


def test_scatter_add_of_a_vmapped_function():
  """`batch_invariant(vmap(f))` of a scatter-add (batching dims) with per-row indices."""
  row_fn = lambda row, index: row.at[index].add(2.0 * row[:4])
  fn = jax.jit(batch_invariant(jax.vmap(row_fn)))
  rng = np.random.default_rng(17)
  x = rng.standard_normal((7, 10)).astype(np.float32)
  index = rng.integers(0, 3, (7, 4)).astype(np.int32)  # duplicates
  together = fn(x, index)
  np.testing.assert_allclose(together, jax.vmap(row_fn)(x, index), rtol=1e-6, atol=1e-6)
  _assert_bitwise(together[5], fn(x[5:6], index[5:6])[0], "row 5")


def test_custom_vjp_and_checkpoint_inside():
  """Their primal bodies are rewritten; the gradient uses the custom rule (plain function)."""
  @jax.custom_vjp
  def scaled_sum(x):
    return jnp.sum(x, -1)

  scaled_sum.defvjp(lambda x: (scaled_sum(x), x.shape),
                    lambda shape, g: (3.0 * jnp.broadcast_to(g[:, None], shape),))

  def f(x, w):
    return scaled_sum(jax.checkpoint(lambda x: jnp.tanh(x @ w))(x))

  w = _weights()["w"]
  rng = np.random.default_rng(10)
  needle = rng.standard_normal((1, D)).astype(np.float32)
  fn = jax.jit(batch_invariant(f))
  _assert_row_in_batch(fn, needle, fn(needle, w), rng, batch=7, slot=4, args=(w,))
  np.testing.assert_allclose(fn(needle, w), f(needle, w), rtol=1e-5)
  grad = jax.grad(lambda x: jnp.sum(batch_invariant(f)(x, w)))(needle)
  np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(f(x, w)))(needle), rtol=1e-5)


def test_shard_map_inside_gives_the_bits_of_the_same_program_outside():
  mesh = jax.make_mesh((1,), ("d",))
  w = _weights()["w"]
  body = lambda x, w: (jax.nn.softmax(x @ w, -1), jnp.cumsum(x, -1))
  sharded = lambda x, w: jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()),
                                       out_specs=(P("d"), P("d")))(x, w)
  x = np.random.default_rng(11).standard_normal((4, D)).astype(np.float32)
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("d")))
  for a, b in zip(jax.jit(batch_invariant(sharded))(x, w), jax.jit(batch_invariant(body))(x, w)):
    _assert_bitwise(a, b, "shard_map")
  psum = lambda x: jax.shard_map(lambda x: lax.psum(x, "d"), mesh=mesh, in_specs=P("d"),
                                 out_specs=P())(x)
  with pytest.raises(BatchInvariantError, match="psum"):
    batch_invariant(psum)(x)


def test_pytrees_in_and_out_and_integers_pass():
  def f(tree):
    return {"s": jnp.sum(tree["a"], -1), "n": jnp.sum(tree["i"]),
            "pair": (tree["a"] @ tree["a"].T,)}

  tree = {"a": np.ones((2, 5), np.float32), "i": np.arange(4, dtype=np.int32)}
  out = batch_invariant(f)(tree)
  assert int(out["n"]) == 6 and out["n"].dtype == jnp.int32
  np.testing.assert_array_equal(out["s"], [5.0, 5.0])
  np.testing.assert_array_equal(out["pair"][0], np.full((2, 2), 5.0))


def _tied_model(w, x):
  """A model that transposes its weights, as GPT-2's `Conv1D` and a tied output layer do."""
  h = jnp.tanh(x @ w["proj"].T + w["bias"][None, :])
  return jax.nn.log_softmax(jax.jit(lambda h, e: h @ e.T)(h, w["embed"]), axis=-1)


def _tied_weights(seed=21):
  rng = np.random.default_rng(seed)
  return {"proj": rng.standard_normal((24, 40)).astype(np.float32) / 6,
          "bias": rng.standard_normal(24).astype(np.float32),
          "embed": rng.standard_normal((50, 24)).astype(np.float32) / 5}


def test_weights_carry_the_transposes_and_change_no_bit():
  """`weights=0`: `prepare` finds the two transposes the model makes of its weights (one inside
  a `jit`), and a call given the `Weights` reads their copies: no weight is transposed in its
  program, and every output bit, row and derivative is that of a call given the weights."""
  w, x = _tied_weights(), np.random.default_rng(22).standard_normal((6, 40)).astype(np.float32)
  model = batch_invariant(_tied_model, weights=0)
  prepared = model.prepare(w, x)
  assert sorted(prepared.transposed) == [(1, (1, 0)), (2, (1, 0))]  # leaves embed, proj
  _assert_bitwise(prepared.transposed[(2, (1, 0))], w["proj"].T)
  run = jax.jit(model)
  _assert_bitwise(run(prepared, x), run(w, x), "Weights vs weights")
  _assert_bitwise(run(prepared, x), jax.jit(batch_invariant(_tied_model))(w, x), "vs no option")
  _assert_bitwise(run(prepared, x[3:4])[0], run(prepared, x)[3], "row 3 alone")

  def transposed_shapes(*args):
    jaxpr = jax.make_jaxpr(model)(*args).jaxpr
    found = []
    def walk(jaxpr):
      for eqn in jaxpr.eqns:
        if eqn.primitive.name == "transpose":
          found.append(tuple(eqn.invars[0].aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
          walk(sub)
    walk(jaxpr)
    return found

  assert (24, 40) in transposed_shapes(w, x) and (50, 24) in transposed_shapes(w, x)
  assert not {(24, 40), (50, 24)} & set(transposed_shapes(prepared, x))
  loss = lambda weights: model(weights, x)[:, 7].sum()
  grads, plain = jax.grad(loss)(prepared).weights, jax.grad(
      lambda w: _tied_model(w, x)[:, 7].sum())(w)
  for name in w:
    np.testing.assert_allclose(grads[name], plain[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_weights_option_and_prepare_refuse_bad_input():
  with pytest.raises(ValueError, match="weights must be the position"):
    batch_invariant(_tied_model, weights=-1)
  with pytest.raises(ValueError, match="weights must be the position"):
    batch_invariant(_tied_model, weights=True)
  with pytest.raises(ValueError, match="argument 1 .* is missing"):
    batch_invariant(_tied_model, weights=1).prepare(_tied_weights())
  assert not hasattr(batch_invariant(_tied_model), "prepare")


def _refused(fn, *args, primitive):
  with pytest.raises(BatchInvariantError) as info:
    batch_invariant(fn)(*args)
  message = str(info.value)
  assert f"`{primitive}`" in message and "test_batch_invariant.py" in message, message
  assert isinstance(info.value, ValueError) and isinstance(info.value, NotImplementedError)


def test_refuses_what_it_cannot_rewrite_by_name_and_line():
  x = np.ones((2, 8), np.float32)
  _refused(lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x), x,
           primitive="pure_callback")
  _refused(lambda x: jnp.fft.rfft(x).real, x, primitive="fft")
  _refused(lambda x: lax.conv_general_dilated(x[:, None, None, :], jnp.ones((2, 1, 1, 3)),
                                              (1, 1), "VALID", batch_group_count=2), x,
           primitive="conv_general_dilated")
  _refused(lambda x: jnp.linalg.cholesky(x[:, :2] @ x[:, :2].T + jnp.eye(2)), x,
           primitive="cholesky")


def _block(x, p):
  """A transformer-like block in plain jnp: layer norm, causal attention, GELU MLP."""
  def norm(h, scale):
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    return (h - mean) * lax.rsqrt(var + 1e-5) * scale[None, None]

  b, t, d = x.shape
  h = norm(x, p["ln1"])
  q, k, v = (jnp.einsum("btd,dhe->bthe", h, p[n]) for n in ("wq", "wk", "wv"))
  scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(q.shape[-1])
  causal = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(causal[None, None], scores, -jnp.inf)
  attn = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, -1), v)
  x = x + jnp.einsum("bthe,hed->btd", attn, p["wo"])
  h = norm(x, p["ln2"])
  return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def _block_params(d=16, heads=2, seed=8):
  rng = np.random.default_rng(seed)
  r = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
  return {"ln1": np.ones(d, np.float32), "ln2": np.ones(d, np.float32), "wq": r(d, heads, 8),
          "wk": r(d, heads, 8), "wv": r(d, heads, 8), "wo": r(heads, 8, d), "w1": r(d, 32),
          "w2": r(32, d)}


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_no_unordered_sum_left_in_a_transformer_block(platform):
  p = _block_params()
  x = jax.ShapeDtypeStruct((2, 5, 16), jnp.float32)
  assert unordered_sums(_block, x, p, platform=platform)  # the plain block has them
  assert unordered_sums(batch_invariant(_block), x, p, platform=platform) == []


@pytest.mark.slow
def test_transformer_block_rows_bitwise():
  p = _block_params()
  block = jax.jit(batch_invariant(_block))
  rng = np.random.default_rng(9)
  needle = rng.standard_normal((1, 5, 16)).astype(np.float32)
  alone = block(needle, p)
  np.testing.assert_allclose(alone, _block(needle, p), rtol=1e-4, atol=1e-5)
  _assert_row_in_batch(block, needle, alone, rng, batch=7, slot=3, args=(p,))


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_the_embedded_models_plain_attention_made_invariant(platform):
  """`numerics.attention(invariant=False)` (a while_loop, `lax.platform_dependent`, einsums)."""
  from jaxdecode.models import numerics  # pylint: disable=import-outside-toplevel
  attention = functools.partial(numerics.attention, invariant=False)
  rng = np.random.default_rng(13)
  args = (rng.standard_normal((3, 1, 2, 8)).astype(np.float32),
          rng.standard_normal((3, 128, 2, 8)).astype(np.float32),
          rng.standard_normal((3, 128, 2, 8)).astype(np.float32),
          np.array([[5], [70], [100]], np.int32))
  assert unordered_sums(attention, *args, platform=platform)
  assert unordered_sums(batch_invariant(attention), *args, platform=platform) == []
  if platform == "cpu":
    np.testing.assert_allclose(jax.jit(batch_invariant(attention))(*args),
                               jax.jit(attention)(*args), rtol=1e-5, atol=1e-6)


def test_exported_from_the_package():
  assert jaxdecode.batch_invariant is batch_invariant
  assert "batch_invariant" in jaxdecode.__all__


# ---------------------------------------------------------------------------------------------
# The needle test on a model in the style of transformers' Flax GPT-2: one cache index shared by
# all rows, left padding (so a row's tokens sit at other cache slots in a batch than alone),
# an attention bias of finfo.min on masked slots, positions from the mask's cumulative sum.

VOCAB, WIDTH, HEADS, SLOTS = 50, 32, 2, 16


def _gpt2_like():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class Attention(nn.Module):
    @nn.compact
    def __call__(self, h, mask):
      b, t, d = h.shape
      q, k, v = jnp.split(nn.Dense(3 * d, name="c_attn")(h), 3, axis=-1)
      q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in (q, k, v))
      cached_key = self.variable("cache", "cached_key", jnp.zeros, (b, SLOTS) + k.shape[2:],
                                 k.dtype)
      cached_value = self.variable("cache", "cached_value", jnp.zeros,
                                   (b, SLOTS) + v.shape[2:], v.dtype)
      index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
      start = index.value
      k = lax.dynamic_update_slice(cached_key.value, k, (0, start, 0, 0))
      v = lax.dynamic_update_slice(cached_value.value, v, (0, start, 0, 0))
      cached_key.value, cached_value.value, index.value = k, v, start + t
      causal = jnp.arange(SLOTS)[None, :] <= (start + jnp.arange(t))[:, None]  # [t, S]
      allowed = causal[None, None] & (mask[:, None, None, :] > 0)  # [B, 1, t, S]
      bias = lax.select(allowed, jnp.zeros(allowed.shape, h.dtype),
                        jnp.full(allowed.shape, jnp.finfo(h.dtype).min, h.dtype))
      weights = nn.dot_product_attention_weights(q, k, bias=bias)
      out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
      return nn.Dense(d, name="c_proj")(out)

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
      x = x + Attention()(nn.LayerNorm()(x), mask)
      h = nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))
      return x + nn.Dense(WIDTH)(nn.gelu(h, approximate=True))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens, mask, positions):
      wte = nn.Embed(VOCAB, WIDTH, name="wte")
      x = wte(tokens) + nn.Embed(SLOTS, WIDTH, name="wpe")(positions)
      for _ in range(2):
        x = Block()(x, mask)
      return wte.attend(nn.LayerNorm()(x))

  return Model()


def _gpt2_runs(tokens_per_row, steps):
  """Left-pads the prompts, prefills, decodes `steps` greedy tokens per row (row 0's choice
  is fed to every row); returns the logits [B, 1 + steps, V], all under batch_invariant."""
  model = _gpt2_like()
  length = max(len(p) for p in tokens_per_row)
  tokens = np.zeros((len(tokens_per_row), length), np.int32)
  prompt_mask = np.zeros_like(tokens)
  for i, p in enumerate(tokens_per_row):
    tokens[i, length - len(p):] = p
    prompt_mask[i, length - len(p):] = 1
  params = model.init(jax.random.key(0), tokens[:1], np.ones((1, SLOTS), np.int32),
                      tokens[:1])["params"]
  mask = np.ones((len(tokens), SLOTS), np.int32)
  mask[:, :length] = prompt_mask
  positions = np.maximum(np.cumsum(prompt_mask, -1) - 1, 0).astype(np.int32)

  @jax.jit
  @batch_invariant
  def prefill(params, tokens, mask, positions):
    logits, variables = model.apply({"params": params}, tokens, mask, positions,
                                    mutable=["cache"])
    return logits[:, -1], variables["cache"]

  @jax.jit
  @batch_invariant
  def step(params, cache, token, mask, position):
    logits, variables = model.apply({"params": params, "cache": cache}, token[:, None], mask,
                                    position[:, None], mutable=["cache"])
    return logits[:, -1], variables["cache"]

  logits, cache = prefill(params, tokens, mask, positions)
  out = [logits]
  position = positions[:, -1]
  for _ in range(steps):
    token = jnp.full((len(tokens),), jnp.argmax(logits[0]), jnp.int32)
    position = position + 1
    logits, cache = step(params, cache, token, mask, position)
    out.append(logits)
  return np.stack([np.asarray(o) for o in out], axis=1)


@pytest.mark.slow
def test_no_unordered_sum_left_in_the_gpt2_like_models_step():
  """The model's decode step, lowered for cpu, cuda and tpu: every float sum has its order."""
  pytest.importorskip("flax")
  model = _gpt2_like()
  tokens, mask = np.ones((3, 1), np.int32), np.ones((3, SLOTS), np.int32)
  variables = model.init(jax.random.key(0), tokens, mask, tokens)

  def step(variables, tokens, mask, positions):
    return model.apply(variables, tokens, mask, positions, mutable=["cache"])

  for platform in ("cpu", "cuda", "tpu"):
    assert unordered_sums(step, variables, tokens, mask, tokens, platform=platform)
    assert unordered_sums(batch_invariant(step), variables, tokens, mask, tokens,
                          platform=platform) == []


@pytest.mark.slow
def test_needle_in_a_left_padded_batch_of_a_gpt2_like_flax_model():
  """A prompt alone and in a left-padded batch: bitwise the same logits, prefill and decode."""
  pytest.importorskip("flax")
  rng = np.random.default_rng(12)
  needle = list(rng.integers(1, VOCAB, 5))
  alone = _gpt2_runs([needle], steps=3)[0]
  for partners, slot in (([3, 7, 2], 0), ([7], 1)):
    prompts = [list(rng.integers(1, VOCAB, n)) for n in partners]
    prompts.insert(slot, needle)
    # Row 0's greedy token is fed to every row: put the needle there or compare step 0 only.
    together = _gpt2_runs(prompts, steps=3 if slot == 0 else 0)[slot]
    _assert_bitwise(together, alone[:len(together)], f"partners {partners}")
