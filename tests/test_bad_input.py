"""Bad input: clear errors before compiling, and defined results under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import SamplingParams

X = jnp.zeros((3, 10))


@pytest.mark.parametrize("logits,fragment", [
    (jnp.zeros(10), r"shape \[B, V\] \(rank 2\); got shape \(10,\). For one row use logits\[None\]"),
    (jnp.zeros((2, 3, 10)), "use jax.vmap"),
    (jnp.zeros((3, 10), jnp.int32), "floating-point"),
    (jnp.zeros((3, 0)), "at least one token"),
    (jnp.zeros((0, 10)), r"logits must have at least one row \(B >= 1\); got shape \(0, 10\)"),
])
def test_malformed_logits_raise(logits, fragment):
  for call in (lambda: jaxdecode.sample(jax.random.key(0), logits),
               lambda: jaxdecode.greedy(logits),
               lambda: jaxdecode.process_logits(logits, SamplingParams()),
               lambda: jaxdecode.processors.top_p(logits, 0.5)):
    with pytest.raises(ValueError, match=fragment):
      call()


def test_per_row_params_must_match_the_batch():
  with pytest.raises(ValueError, match=r"top_k has shape \(2,\) but the batch has 3 rows"):
    jaxdecode.sample(jax.random.key(0), X, SamplingParams(top_k=[1, 2]))
  with pytest.raises(ValueError, match=r"top_p has shape \(4,\) but logits have 3 rows"):
    jaxdecode.processors.top_p(X, jnp.full(4, 0.5))
  with pytest.raises(ValueError, match="top_p must be"):
    jaxdecode.processors.top_p(X, 0.0)
  with pytest.raises(ValueError, match="params must be a jaxdecode.SamplingParams"):
    jaxdecode.sample(jax.random.key(0), X, {"top_p": 0.5})


@pytest.mark.parametrize("key,fragment", [
    (jax.random.split(jax.random.key(0), 2), r"one per row \(shape \(3,\)\); got shape \(2,\)"),
    (jnp.zeros((3, 3), jnp.uint32), r"shape \(2,\) for one key or \(3, 2\)"),
    (jnp.zeros(2, jnp.int32), "dtype int32"),
    (jnp.zeros(2, jnp.float32), "dtype float32"),
])
def test_bad_keys_raise(key, fragment):
  with pytest.raises(ValueError, match=fragment):
    jaxdecode.sample(key, X)


def test_a_legacy_key_of_another_prng_implementation_is_named_with_the_fix():
  key = jax.random.PRNGKey(0, impl="rbg")  # uint32[4]: its data does not say which impl made it
  with pytest.raises(ValueError, match=r"key: a legacy uint32 key \(jax.random.PRNGKey of the "
                                       r"default implementation, threefry2x32\) must have shape "
                                       r"\(2,\).*got shape \(4,\).*impl='rbg' or 'unsafe_rbg'"
                                       r".*jax.random.wrap_key_data\(key, impl=...\)"):
    jaxdecode.sample(key, X)
  typed = jax.random.wrap_key_data(key, impl="rbg")  # the fix the message gives works
  assert jaxdecode.sample(typed, X).shape == (3,)


def test_the_loops_refuse_an_empty_batch_and_a_beam_count_past_int32_indices():
  step = lambda state, tokens, positions: (jnp.zeros((tokens.shape[0], 10)), state)
  empty, none = jnp.zeros((0, 10)), jnp.zeros(0, jnp.int32)
  for call in (
      lambda: jaxdecode.decode(step, {}, empty, key=jax.random.key(0), params=SamplingParams(),
                               max_new_tokens=2, positions=none),
      lambda: jaxdecode.beam_search(step, {}, empty, beam_size=2, max_new_tokens=2,
                                    positions=none),
      lambda: jaxdecode.speculative_decode(step, {}, empty, key=jax.random.key(0),
                                           params=SamplingParams(), max_new_tokens=2,
                                           positions=none, drafter=jaxdecode.NgramDrafter(
                                               jnp.zeros((0, 2), jnp.int32), none))):
    with pytest.raises(ValueError, match=r"logits must have at least one row"):
      call()
  with pytest.raises(ValueError, match=r"beam_size must be at most 214748364 for 1 row\(s\) and "
                                       r"a vocabulary of 10 tokens .*indexed in int32\); got "
                                       r"999999999"):
    jaxdecode.beam_search(step, {}, jnp.zeros((1, 10)), beam_size=999_999_999, max_new_tokens=2,
                          positions=jnp.zeros(1, jnp.int32))


def test_nan_logits_are_never_chosen_while_a_finite_one_exists():
  x = jnp.array([[jnp.nan, 0.0, jnp.nan, -1.0, jnp.nan]] * 2000)
  for params in (SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)):
    tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(0), x, params)
    assert set(np.unique(tokens).tolist()) <= {1, 3}
    assert np.isfinite(np.asarray(logprobs)).all()


@pytest.mark.slow
def test_positive_inf_logits_form_a_uniform_distribution():
  x = jnp.array([[1.0, jnp.inf, 5.0, jnp.inf]] * 4000)
  tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(0), x)
  counts = np.bincount(np.asarray(tokens), minlength=4)
  assert counts[0] == counts[2] == 0 and abs(counts[1] - 2000) < 200
  np.testing.assert_allclose(logprobs, np.log(0.5), rtol=1e-6)


@pytest.mark.slow
def test_rows_with_nothing_selectable_are_reported_not_hidden_and_do_not_disturb_others():
  x = jnp.array([[-jnp.inf] * 5, [jnp.nan] * 5, [0.0, 1.0, 2.0, 3.0, 4.0]])
  keys = jax.random.split(jax.random.key(3), 3)
  tokens, logprobs = jax.jit(jaxdecode.sample_with_logprobs)(keys, x, SamplingParams(top_p=0.9))
  assert tokens.tolist()[:2] == [0, 0]
  assert np.isnan(np.asarray(logprobs)[:2]).all()
  assert jaxdecode.selectable(x).tolist() == [False, False, True]
  alone = jaxdecode.sample_with_logprobs(keys[2:], x[2:], SamplingParams(top_p=0.9))
  assert int(tokens[2]) == int(alone[0][0])


@pytest.mark.slow
def test_invalid_params_under_jit_follow_the_documented_sanitization():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2000, 6)), jnp.float32)
  greedy = np.asarray(jaxdecode.greedy(x))

  @jax.jit
  def draw(t, k, p, m):
    return jaxdecode.sample(jax.random.key(1), x, SamplingParams(t, k, p, m))

  nan = jnp.float32(jnp.nan)
  # NaN or negative temperature -> greedy.
  np.testing.assert_array_equal(draw(nan, 0, 1.0, 0.0), greedy)
  np.testing.assert_array_equal(draw(jnp.float32(-2.0), 0, 1.0, 0.0), greedy)
  # top_p <= 0 -> only the most probable token; min_p > 1 -> clipped to 1 (the maximum only).
  np.testing.assert_array_equal(draw(1.0, 0, jnp.float32(-1.0), 0.0), greedy)
  np.testing.assert_array_equal(draw(1.0, 0, 1.0, jnp.float32(5.0)), greedy)
  # NaN top_p / min_p and negative top_k disable their filter: same draws as plain sampling.
  plain = draw(1.0, 0, 1.0, 0.0)
  np.testing.assert_array_equal(draw(1.0, 0, nan, nan), plain)
  np.testing.assert_array_equal(draw(1.0, jnp.int32(-5), 1.0, 0.0), plain)
  assert (np.asarray(plain) != greedy).any()
  # Tokens are always in range.
  for args in [(nan, jnp.int32(-5), nan, nan), (jnp.float32(jnp.inf), 0, 0.5, 0.0)]:
    tokens = np.asarray(draw(*args))
    assert ((tokens >= 0) & (tokens < 6)).all()
