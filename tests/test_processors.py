"""Kept sets of every processor against the sort-based float64 reference (tests/reference.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import processors
import reference as ref


def tied_logits(rng, batch, vocab, neg_inf_share=0.15):
  """Logits on a coarse grid (many exact ties) with some -inf entries; never a whole -inf row."""
  x = rng.integers(-6, 7, size=(batch, vocab)).astype(np.float32) * 0.5
  x[rng.random((batch, vocab)) < neg_inf_share] = -np.inf
  x[np.arange(batch), rng.integers(0, vocab, batch)] = rng.normal(size=batch).astype(np.float32)
  return x


def assert_same_kept(out, expected, ambiguous=None):
  out = np.asarray(out, np.float64)
  ok = np.ones(out.shape, bool) if ambiguous is None else ~ambiguous
  np.testing.assert_array_equal(np.isfinite(out)[ok], np.isfinite(expected)[ok])


@pytest.mark.parametrize("vocab", [1, 2, 7, 50, 300])
def test_top_k_matches_sort_reference_with_ties_and_neg_inf(vocab):
  rng = np.random.default_rng(vocab)
  x = tied_logits(rng, 6, vocab)
  for k in [0, 1, 2, 3, 5, vocab - 1, vocab, vocab + 3]:
    ks = np.full(6, max(k, 0))
    out = processors.top_k(jnp.asarray(x), ks)
    expected = np.stack([np.where(ref.top_k_keep(r, kk), r, -np.inf) for r, kk in zip(x, ks)])
    assert_same_kept(out, expected)
    # Kept entries are unchanged, not rescaled.
    np.testing.assert_array_equal(np.asarray(out)[np.isfinite(expected)], x[np.isfinite(expected)])


def test_top_k_keeps_ties_at_boundary():
  x = jnp.array([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]])
  out = processors.top_k(x, 2)
  # 3.0 is the largest; the three 2.0s each have exactly one strictly larger logit: all kept.
  assert np.isfinite(np.asarray(out)).tolist() == [[False, True, True, True, True, False]]


def test_top_k_per_row_values():
  x = jnp.tile(jnp.arange(5.0)[None], (3, 1))
  out = processors.top_k(x, jnp.array([1, 3, 0]))
  assert np.isfinite(np.asarray(out)).sum(axis=1).tolist() == [1, 3, 5]


@pytest.mark.parametrize("vocab", [1, 3, 16, 257])
def test_top_p_matches_sort_reference_with_ties_and_neg_inf(vocab):
  rng = np.random.default_rng(100 + vocab)
  x = tied_logits(rng, 8, vocab)
  for p in [0.05, 0.3, 0.5, 0.77, 0.9, 0.99, 1.0]:
    out = processors.top_p(jnp.asarray(x), p)
    for row, out_row in zip(x, np.asarray(out)):
      keep, amb = ref.top_p_keep(row, p)
      assert_same_kept(out_row, np.where(keep, row, -np.inf), amb)


def test_top_p_keeps_ties_at_boundary():
  # probs 0.4, 0.2, 0.2, 0.2: for p = 0.5 the 0.2s each have mass 0.4 strictly above: all kept.
  x = jnp.log(jnp.array([[0.2, 0.4, 0.2, 0.2]]))
  assert np.isfinite(np.asarray(processors.top_p(x, 0.5))).all()
  # For p = 0.3 only the 0.4 token is needed.
  assert np.isfinite(np.asarray(processors.top_p(x, 0.3))).tolist() == [[False, True, False, False]]


def test_top_p_always_keeps_most_probable_token():
  x = jnp.log(jnp.array([[0.1, 0.5, 0.4], [0.3, 0.3, 0.4]]))
  out = np.isfinite(np.asarray(processors.top_p(x, 1e-9)))
  assert out.tolist() == [[False, True, False], [False, False, True]]


def test_top_p_one_keeps_everything_even_underflowing_tokens():
  x = jnp.array([[0.0, -200.0, -jnp.inf, -1e30]])
  out = np.asarray(processors.top_p(x, 1.0))
  np.testing.assert_array_equal(out, np.asarray(x))


@pytest.mark.parametrize("vocab", [1, 5, 64])
def test_min_p_matches_reference(vocab):
  rng = np.random.default_rng(200 + vocab)
  x = tied_logits(rng, 8, vocab)
  for m in [0.0, 0.01, 0.1, 0.37, 0.5, 1.0]:
    out = np.asarray(processors.min_p(jnp.asarray(x), m))
    for row, out_row in zip(x, out):
      keep, amb = ref.min_p_keep(row, m)
      assert_same_kept(out_row, np.where(keep, row, -np.inf), amb)


def test_min_p_one_keeps_only_the_maximum_ties():
  x = jnp.array([[1.0, 2.0, 2.0, 0.5]])
  assert np.isfinite(np.asarray(processors.min_p(x, 1.0))).tolist() == [[False, True, True, False]]


def test_temperature_scales_and_zero_is_a_point_mass_on_the_greedy_token():
  x = jnp.array([[1.0, 4.0, 4.0, -2.0], [2.0, -jnp.inf, 0.0, 1.0]])
  out = np.asarray(processors.temperature(x, jnp.array([0.0, 2.0])))
  np.testing.assert_array_equal(out[0], [-np.inf, 4.0, -np.inf, -np.inf])  # ties -> lowest index
  np.testing.assert_array_equal(out[1], [1.0, -np.inf, 0.0, 0.5])
  np.testing.assert_array_equal(np.asarray(processors.temperature(x, 1.0)), np.asarray(x))


def test_tiny_temperature_never_overflows():
  x = jnp.array([[3.0e5, 1.0, -3.0e5]])
  out = np.asarray(processors.temperature(x, 1e-36))
  assert not np.isnan(out).any() and not np.isposinf(out).any()
  assert np.isfinite(out[0, 0])  # the maximum stays selectable


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.slow
def test_process_logits_chain_matches_reference(seed):
  rng = np.random.default_rng(300 + seed)
  batch, vocab = 12, int(rng.choice([1, 6, 40, 130]))
  x = tied_logits(rng, batch, vocab)
  temperature = rng.choice([0.0, 0.5, 0.7, 1.0, 1.3, 2.0], batch).astype(np.float32)
  top_k = rng.choice([0, 1, 3, 10, vocab], batch).astype(np.int32)
  top_p = rng.choice([0.2, 0.6, 0.9, 0.95, 1.0], batch).astype(np.float32)
  min_p = rng.choice([0.0, 0.02, 0.1, 0.3], batch).astype(np.float32)
  params = jaxdecode.SamplingParams(temperature, top_k, top_p, min_p)
  out = np.asarray(jaxdecode.process_logits(jnp.asarray(x), params))
  for r in range(batch):
    expected, amb = ref.process_row(x[r], temperature[r], top_k[r], top_p[r], min_p[r])
    assert_same_kept(out[r], expected, amb)
    kept = np.isfinite(expected) & ~amb
    np.testing.assert_allclose(out[r][kept], expected[kept], rtol=1e-6)


def test_process_logits_order_is_temperature_top_k_top_p_min_p():
  # top-p after top-k renormalizes: with top_k=2 the two survivors (0.5, 0.3) have mass 5/8, 3/8;
  # top_p=0.6 then keeps only the first (its mass 0.625 reaches 0.6), while top-p on the full
  # distribution would keep two (0.5 < 0.6).
  x = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
  out = jaxdecode.process_logits(x, jaxdecode.SamplingParams(top_k=2, top_p=0.6))
  assert np.isfinite(np.asarray(out)).tolist() == [[True, False, False]]
  out = jaxdecode.process_logits(x, jaxdecode.SamplingParams(top_p=0.6))
  assert np.isfinite(np.asarray(out)).tolist() == [[True, True, False]]
  # Temperature before top-p: T = 0.25 sharpens (0.5, 0.3, 0.2) so the top token alone has
  # 0.5^4 / (0.5^4 + 0.3^4 + 0.2^4) = 0.869 >= 0.8 of the mass.
  out = jaxdecode.process_logits(x, jaxdecode.SamplingParams(temperature=0.25, top_p=0.8))
  assert np.isfinite(np.asarray(out)).tolist() == [[True, False, False]]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_processors_preserve_dtype_and_decide_in_float32(dtype):
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(4, 33)), dtype)
  params = jaxdecode.SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05)
  out = jaxdecode.process_logits(x, params)
  assert out.dtype == dtype and out.shape == x.shape
  # The kept sets are the float64 reference's on the low-precision values themselves.
  values = np.asarray(x, np.float32)  # exact: every bf16/f16 value is a float32
  for r in range(4):
    expected, amb = ref.process_row(values[r], 0.8, 10, 0.9, 0.05)
    assert_same_kept(np.asarray(out[r], np.float32), expected, amb)
    kept = np.isfinite(expected) & ~amb
    # Values are the float32 results rounded to the dtype (XLA:CPU's division is within an ulp).
    np.testing.assert_allclose(np.asarray(out[r], np.float32)[kept], expected[kept],
                               rtol=float(jnp.finfo(dtype).eps))
  for f, v in [(processors.top_k, 5), (processors.top_p, 0.5), (processors.min_p, 0.1),
               (processors.temperature, 0.5)]:
    assert f(x, v).dtype == dtype


def test_nan_and_inf_logits_hygiene():
  x = jnp.array([[jnp.nan, 1.0, 0.0], [jnp.inf, 1.0, jnp.inf], [jnp.nan, -jnp.inf, jnp.nan]])
  out = np.asarray(jaxdecode.process_logits(x, jaxdecode.SamplingParams()))
  np.testing.assert_array_equal(out[0], [-np.inf, 1.0, 0.0])  # NaN removed
  np.testing.assert_array_equal(out[1], [0.0, -np.inf, 0.0])  # uniform over the +inf entries
  np.testing.assert_array_equal(out[2], [-np.inf] * 3)  # nothing selectable, stays so
  assert jaxdecode.selectable(x).tolist() == [True, True, False]


def test_processed_values_are_traced_under_jit():
  traces = []

  @jax.jit
  def f(x, params):
    traces.append(1)
    return jaxdecode.process_logits(x, params)

  x = jnp.zeros((2, 10))
  for t, k, p, m in [(1.0, 0, 1.0, 0.0), (0.5, 3, 0.9, 0.1), (0.0, 9, 0.2, 1.0)]:
    f(x, jaxdecode.SamplingParams(t, k, p, m))
  f(x + 1, jaxdecode.SamplingParams(2.0, 1, 0.5, 0.5))
  assert len(traces) == 1


def test_ties_crossing_the_64_candidates_are_handled_exactly():
  # top-k = 3 keeps the top logit and all one hundred 4.0s (ties at the boundary), far more than
  # the 64 candidates of the fast path; top-p must then normalize over all of them.
  # With the 10.0 on top, top-p 0.83 needs the 4.0 tier only if it normalizes over all hundred
  # of them (mass 1 / (1 + 100 e^-6) < 0.83), not over the 63 inside the candidates.
  rng = np.random.default_rng(0)
  rows = [np.concatenate([[top], np.full(100, 4.0), np.linspace(-3, 3, 99)]).astype(np.float32)
          for top in (5.0, 10.0)]
  x = np.stack(rows + [rng.permutation(r) for r in rows])
  for k, p in [(3, 1.0), (3, 0.9), (3, 0.83), (3, 0.3), (0, 0.5), (60, 0.99), (200, 0.9)]:
    out = np.asarray(jaxdecode.process_logits(jnp.asarray(x), jaxdecode.SamplingParams(
        top_k=k, top_p=p)))
    for r in range(len(x)):
      expected, amb = ref.process_row(x[r], 1.0, k, p, 0.0)
      assert_same_kept(out[r], expected, amb)


@pytest.mark.slow
def test_fast_and_bisection_rows_mix_in_one_batch_like_the_reference():
  rng = np.random.default_rng(11)
  vocab = 1000
  flat = rng.normal(size=(6, vocab)).astype(np.float32) * 0.3  # nucleus of hundreds of tokens
  peaked = (rng.normal(size=(6, vocab)) * 4).astype(np.float32)  # nucleus of a few tokens
  x = np.concatenate([flat, peaked])
  k = np.array([0, 10, 100, 0, 63, 64] * 2, np.int32)
  p = np.array([0.9, 0.95, 0.5, 0.99, 1.0, 0.8] * 2, np.float32)
  out = np.asarray(jaxdecode.process_logits(jnp.asarray(x), jaxdecode.SamplingParams(
      top_k=k, top_p=p)))
  for r in range(len(x)):
    expected, amb = ref.process_row(x[r], 1.0, k[r], p[r], 0.0)
    assert_same_kept(out[r], expected, amb)
    alone = np.asarray(jaxdecode.process_logits(jnp.asarray(x[r:r + 1]), jaxdecode.SamplingParams(
        top_k=k[r], top_p=p[r])))
    np.testing.assert_array_equal(alone[0], out[r])
