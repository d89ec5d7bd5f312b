"""Selection rules: exact distributions, the key policy and reproducibility."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxdecode
import reference as ref

N_DRAWS = 100_000


def test_greedy_ties_go_to_lowest_index_and_nan_is_never_chosen():
  x = jnp.array([[1.0, 3.0, 3.0], [jnp.nan, -1.0, -2.0], [-jnp.inf, -jnp.inf, -jnp.inf],
                 [2.0, jnp.inf, jnp.inf]])
  assert jaxdecode.greedy(x).tolist() == [1, 1, 0, 1]
  assert jaxdecode.greedy(x).dtype == jnp.int32


def test_greedy_matches_numpy_argmax_on_random_logits():
  x = np.random.default_rng(0).normal(size=(16, 1000)).astype(np.float32)
  np.testing.assert_array_equal(jaxdecode.greedy(jnp.asarray(x)), np.argmax(x, axis=1))


@pytest.mark.parametrize("params", [
    dict(),
    dict(temperature=0.6),
    dict(temperature=1.7, top_k=4),
    dict(top_p=0.7),
    dict(top_k=6, top_p=0.85, min_p=0.05),
    dict(min_p=0.2, temperature=1.3),
], ids=repr)
def test_sampled_frequencies_match_filtered_distribution(params):
  """Chi-square over 100k draws against the reference's exact filtered distribution."""
  logits = np.array([2.0, 1.2, 1.2, 0.5, 0.0, -0.4, -1.0, -np.inf, -2.5, 0.9, -3.0, 1.5],
                    np.float32)
  p = jaxdecode.SamplingParams(**params)
  expected_logits, amb = ref.process_row(logits, float(p.temperature), int(p.top_k),
                                         float(p.top_p), float(p.min_p))
  assert not amb.any()
  expected = ref.softmax64(expected_logits)
  batch = jnp.broadcast_to(jnp.asarray(logits), (N_DRAWS, logits.size))
  tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(1234), batch, p)
  counts = np.bincount(np.asarray(tokens), minlength=logits.size)
  assert counts[expected == 0].sum() == 0, "a removed token was sampled"
  kept = expected > 0
  result = stats.chisquare(counts[kept], N_DRAWS * expected[kept])
  assert result.pvalue > 1e-3, (counts, N_DRAWS * expected)
  np.testing.assert_allclose(np.asarray(logprobs), np.log(expected[np.asarray(tokens)]),
                             atol=2e-6)


@pytest.mark.slow
def test_temperature_zero_rows_are_exactly_greedy_inside_a_sampling_batch():
  rng = np.random.default_rng(1)
  x = rng.integers(-3, 4, size=(64, 50)).astype(np.float32)  # many ties
  t = np.where(np.arange(64) % 2 == 0, 0.0, 1.0).astype(np.float32)
  params = jaxdecode.SamplingParams(temperature=t, top_k=np.arange(64) % 5, top_p=0.9)
  for seed in range(5):
    tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(seed), jnp.asarray(x), params)
    greedy = np.asarray(jaxdecode.greedy(jnp.asarray(x)))
    np.testing.assert_array_equal(np.asarray(tokens)[t == 0], greedy[t == 0])
    np.testing.assert_array_equal(np.asarray(logprobs)[t == 0], 0.0)
  # The sampling rows really sample: not all of them equal their greedy token.
  assert (np.asarray(tokens)[t == 1] != greedy[t == 1]).any()


@pytest.mark.slow
def test_tiny_temperature_equals_greedy_on_untied_logits_without_nan():
  rng = np.random.default_rng(2)
  x = rng.permuted(np.tile(np.arange(200, dtype=np.float32) * 1e-2, (32, 1)), axis=1)
  tokens, logprobs = jaxdecode.sample_with_logprobs(
      jax.random.key(0), jnp.asarray(x), jaxdecode.SamplingParams(temperature=1e-6))
  np.testing.assert_array_equal(tokens, np.argmax(x, axis=1))
  assert np.isfinite(np.asarray(logprobs)).all()


def per_row_keys(seed, n):
  return jax.random.split(jax.random.key(seed), n)


@pytest.mark.slow
def test_row_alone_equals_row_in_a_batch_of_16_at_any_slot():
  rng = np.random.default_rng(3)
  vocab = 300
  row = rng.normal(size=vocab).astype(np.float32) * 2
  row_params = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01)
  for draw in range(4):
    key = jax.random.fold_in(jax.random.key(7), draw)
    alone = jaxdecode.sample_with_logprobs(
        key[None], jnp.asarray(row[None]), jaxdecode.SamplingParams(**row_params))
    for slot in range(16):
      others = rng.normal(size=(16, vocab)).astype(np.float32)
      others[slot] = row
      keys = per_row_keys(100 * draw + slot, 16).at[slot].set(key)
      params = {name: rng.choice([0.0, 0.5, 1.0, 2.0], 16).astype(np.float32)
                for name in ("temperature",)}
      params["top_k"] = rng.integers(0, 20, 16).astype(np.int32)
      params["top_p"] = rng.uniform(0.1, 1.0, 16).astype(np.float32)
      params["min_p"] = rng.uniform(0.0, 0.3, 16).astype(np.float32)
      for name, value in row_params.items():
        params[name][slot] = value
      tokens, logprobs = jaxdecode.sample_with_logprobs(
          keys, jnp.asarray(others), jaxdecode.SamplingParams(**params))
      assert int(tokens[slot]) == int(alone[0][0])
      assert float(logprobs[slot]) == float(alone[1][0])  # bit for bit in any batch and slot


@pytest.mark.slow
def test_one_key_means_fold_in_of_the_row_index():
  x = jnp.asarray(np.random.default_rng(4).normal(size=(5, 100)), jnp.float32)
  key = jax.random.key(42)
  folded = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(5))
  np.testing.assert_array_equal(jaxdecode.sample(key, x), jaxdecode.sample(folded, x))


@pytest.mark.slow
def test_legacy_uint32_keys_equal_typed_keys():
  x = jnp.asarray(np.random.default_rng(5).normal(size=(6, 64)), jnp.float32)
  np.testing.assert_array_equal(jaxdecode.sample(jax.random.PRNGKey(3), x),
                                jaxdecode.sample(jax.random.key(3), x))
  typed = per_row_keys(9, 6)
  np.testing.assert_array_equal(jaxdecode.sample(jax.random.key_data(typed), x),
                                jaxdecode.sample(typed, x))


@pytest.mark.slow
def test_identical_rows_with_different_keys_draw_independently():
  probs = np.array([0.4, 0.3, 0.2, 0.1])
  pairs = 50_000
  x = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (2 * pairs, 4))
  tokens = np.asarray(jaxdecode.sample(per_row_keys(11, 2 * pairs), x)).reshape(pairs, 2)
  table = np.zeros((4, 4))
  np.add.at(table, (tokens[:, 0], tokens[:, 1]), 1)
  assert stats.chi2_contingency(table).pvalue > 1e-3  # independence of the two draws
  # Against the exact product distribution too.
  assert stats.chisquare(table.ravel(), pairs * np.outer(probs, probs).ravel()).pvalue > 1e-3


@pytest.mark.slow
def test_jit_equals_eager():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(4, 40)), jnp.float32)
  params = jaxdecode.SamplingParams(temperature=[0.0, 0.5, 1.0, 1.5], top_k=[0, 5, 10, 2],
                                    top_p=[1.0, 0.9, 0.5, 0.99], min_p=[0.0, 0.1, 0.0, 0.05])
  jitted = jax.jit(jaxdecode.sample_with_logprobs)(jax.random.key(0), x, params)
  with jax.disable_jit():
    eager = jaxdecode.sample_with_logprobs(jax.random.key(0), x, params)
  np.testing.assert_array_equal(jitted[0], eager[0])
  np.testing.assert_allclose(jitted[1], eager[1], rtol=1e-6)


@pytest.mark.slow
def test_vmap_over_samples_per_row_equals_the_flattened_batch():
  samples, batch, vocab = 3, 4, 50
  rng = np.random.default_rng(8)
  x = jnp.asarray(rng.normal(size=(batch, vocab)), jnp.float32)
  params = jaxdecode.SamplingParams(temperature=[0.5, 1.0, 1.0, 0.0], top_p=[0.9, 0.8, 1.0, 1.0])
  keys = per_row_keys(0, samples * batch).reshape(samples, batch)
  many = jax.vmap(jaxdecode.sample_with_logprobs, in_axes=(0, None, None))(keys, x, params)
  flat_params = jax.tree.map(lambda v: jnp.concatenate([v] * samples), params.broadcast(batch))
  flat = jaxdecode.sample_with_logprobs(keys.reshape(-1), jnp.tile(x, (samples, 1)), flat_params)
  np.testing.assert_array_equal(np.asarray(many[0]).ravel(), flat[0])
  np.testing.assert_allclose(np.asarray(many[1]).ravel(), flat[1], rtol=1e-6)


def test_new_params_keys_and_logits_do_not_retrace():
  traces = []

  @jax.jit
  def step(key, logits, params):
    traces.append(1)
    return jaxdecode.sample_with_logprobs(key, logits, params)

  rng = np.random.default_rng(9)
  for i in range(4):
    params = jaxdecode.SamplingParams(temperature=rng.uniform(0, 2, 3), top_k=rng.integers(0, 9, 3),
                                      top_p=rng.uniform(0.1, 1, 3), min_p=rng.uniform(0, 1, 3))
    step(jax.random.key(i), jnp.asarray(rng.normal(size=(3, 20)), jnp.float32), params)
  assert len(traces) == 1


@pytest.mark.slow
def test_same_key_same_tokens_different_keys_differ():
  x = jnp.zeros((8, 1000))
  a = jaxdecode.sample(jax.random.key(1), x)
  np.testing.assert_array_equal(a, jaxdecode.sample(jax.random.key(1), x))
  assert (np.asarray(a) != np.asarray(jaxdecode.sample(jax.random.key(2), x))).any()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_logits_sample_from_the_reference_distribution_of_their_values(dtype):
  x = jnp.asarray(np.random.default_rng(10).normal(size=(8, 77)), dtype)
  params = jaxdecode.SamplingParams(temperature=0.7, top_p=0.9)
  tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(0), x, params)
  assert logprobs.dtype == jnp.float32
  values = np.asarray(x, np.float32)  # exact: every bf16/f16 value is a float32
  for r in range(8):
    processed, amb = ref.process_row(values[r], 0.7, 0, 0.9, 0.0)
    assert np.isfinite(processed[tokens[r]]) and not amb[tokens[r]]
    finite = processed[np.isfinite(processed)]
    exact = processed[tokens[r]] - finite.max() - np.log(np.sum(np.exp(finite - finite.max())))
    np.testing.assert_allclose(float(logprobs[r]), exact, rtol=1e-5, atol=1e-6)


