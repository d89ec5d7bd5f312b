"""The invariant layers, one at a time: a row's bits do not depend on how many rows come with it.

The model-level tests (test_invariance, test_models) show the promise end to end; these pin it to
the layer that would break it, for row counts that select different XLA:CPU kernels for a plain
dot (1, 2, small, 24/25, 64/65, a prime, a long prefill), the model's widths and odd ones.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode.models import numerics

ROWS = (1, 2, 3, 24, 25, 64, 65, 97, 300)
# D, F: the model's width first; every row count of every shape is a compile, so the fast loop
# keeps that one and the suite (slow) the odd ones.
SHAPES = ((256, 768),) + tuple(pytest.param(d, f, marks=pytest.mark.slow)
                               for d, f in ((1024, 256), (37, 259), (16, 5), (3, 1)))


def _data(rows, depth, width, seed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((rows, depth)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((depth, width)) / np.sqrt(depth), jnp.float32)
  return x, w


@pytest.mark.parametrize("depth,width", SHAPES)
@pytest.mark.slow
def test_a_row_of_linear_has_the_same_bits_for_every_row_count(depth, width):
  x, w = _data(max(ROWS), depth, width, seed=depth)
  f = jax.jit(lambda x, w: numerics.linear(x, w, invariant=True))
  for r in (0, 1, 70):
    alone = np.asarray(f(x[r:r + 1], w))[0]
    for n in ROWS:
      if n > r:
        np.testing.assert_array_equal(np.asarray(f(x[:n], w))[r], alone, err_msg=f"row {r} of {n}")
  np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(x, np.float64) @ np.asarray(w, np.float64),
                             rtol=1e-5, atol=1e-5)


def test_linear_keeps_leading_axes_and_adds_the_bias():
  x, w = _data(6, 8, 5, seed=1)
  b = jnp.arange(5, dtype=jnp.float32)
  y = numerics.linear(x.reshape(2, 3, 8), w, b, invariant=True)
  assert y.shape == (2, 3, 5)
  np.testing.assert_allclose(y.reshape(6, 5), np.asarray(x) @ np.asarray(w) + np.asarray(b), rtol=1e-5, atol=1e-5)
  assert numerics.linear(x[:0], w, invariant=True).shape == (0, 5)


def test_tied_logits_rows_do_not_depend_on_the_row_count():
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((max(ROWS), 256)), jnp.float32)
  embedding = jnp.asarray(rng.standard_normal((259, 256)) * 0.05, jnp.float32)
  f = jax.jit(lambda x, e: numerics.tied_logits(x, e, invariant=True))
  alone = np.asarray(f(x[5:6], embedding))[0]
  for n in ROWS[3:]:
    np.testing.assert_array_equal(np.asarray(f(x[:n], embedding))[5], alone, err_msg=f"{n} rows")
  np.testing.assert_allclose(alone, np.asarray(x[5]) @ np.asarray(embedding).T, rtol=1e-5, atol=1e-5)


def test_the_plain_dot_is_not_invariant_so_these_tests_can_fail():
  """On XLA:CPU a plain [N, 1024] @ [1024, 256] changes row 0's bits for some N (measured on AVX2
  and AVX-512 machines); if a future XLA made it invariant, this says the tests lost their teeth."""
  x, w = _data(max(ROWS), 1024, 256, seed=0)
  f = jax.jit(lambda x, w: numerics.linear(x, w, invariant=False))
  alone = np.asarray(f(x[:1], w))[0]
  assert any(not np.array_equal(np.asarray(f(x[:n], w))[0], alone) for n in ROWS[1:])
