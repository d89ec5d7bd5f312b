"""Eager calls: what a repeated call skips (the checked broadcast of a SamplingParams, kept on
the object) gives the jitted call's bits, never hides a bad value, and stays bounded.

Speed is measured (README, `jaxdecode bench`), not tested here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import params as params_module
from jaxdecode import sampling
from jaxdecode import SamplingParams

B, V = 3, 10
LOGITS = jnp.asarray(np.random.default_rng(0).normal(size=(B, V)), jnp.float32)
KEY = jax.random.key(7)


def bits(x):
  """The exact bits of an array (NaN payloads included), for bitwise comparisons."""
  x = np.asarray(x)
  return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize]) if x.dtype.kind == "f" else x


PARAMS = {
    "default": lambda: SamplingParams(),
    "top_p": lambda: SamplingParams(temperature=0.8, top_p=0.9),
    "per-row": lambda: SamplingParams(temperature=jnp.array([0.0, 0.7, 1.3]),
                                      top_k=np.array([0, 3, 5]), top_p=[1.0, 0.9, 0.8],
                                      min_p=0.05),
    "tokens": lambda: SamplingParams(banned_token_ids=[[1], [2, 3], []],
                                     allowed_token_ids=[0, 1, 2, 4, 5, 6],
                                     logit_bias=[{4: 2.0}, None, {0: -1.5}]),
}


@pytest.mark.parametrize("name", PARAMS)
@pytest.mark.slow
def test_a_repeated_eager_call_gives_the_jitted_calls_bits(name):
  params = PARAMS[name]()
  jitted = jax.jit(jaxdecode.sample_with_logprobs)(KEY, LOGITS, params)
  first = jaxdecode.sample_with_logprobs(KEY, LOGITS, params)
  assert params.broadcast(B, V) is params.broadcast(B, V)  # the check is kept from here on
  again = jaxdecode.sample_with_logprobs(KEY, LOGITS, params)
  for out in (first, again):
    np.testing.assert_array_equal(out[0], jitted[0])
    np.testing.assert_array_equal(bits(out[1]), bits(jitted[1]))
  np.testing.assert_array_equal(jaxdecode.sample(KEY, LOGITS, params), jitted[0])
  processed = jaxdecode.process_logits(LOGITS, params)
  np.testing.assert_array_equal(bits(jaxdecode.process_logits(LOGITS, params)), bits(processed))
  np.testing.assert_array_equal(bits(jax.jit(jaxdecode.process_logits)(LOGITS, params)),
                                bits(processed))


def test_no_params_reuses_one_default_and_gives_the_bits_of_an_explicit_default():
  assert sampling._default_params() is sampling._default_params()  # pylint: disable=protected-access
  expected = jax.jit(jaxdecode.sample_with_logprobs)(KEY, LOGITS, SamplingParams())
  for _ in range(2):
    tokens, logprobs = jaxdecode.sample_with_logprobs(KEY, LOGITS)
    np.testing.assert_array_equal(tokens, expected[0])
    np.testing.assert_array_equal(bits(logprobs), bits(expected[1]))


def test_the_host_copy_made_when_building_is_what_a_transfer_back_gives():
  p = PARAMS["tokens"]()
  assert "_host" in p.__dict__  # every value was given as a Python value: no transfer needed
  jax.tree.map(lambda h, d: np.testing.assert_array_equal(bits(h), bits(d)), p._host,  # pylint: disable=protected-access
               jax.device_get(p))
  b = p.broadcast(B, V)
  jax.tree.map(lambda h, d: np.testing.assert_array_equal(bits(h), bits(d)), b._host,  # pylint: disable=protected-access
               jax.device_get(b))


def test_a_bad_value_after_a_good_one_still_raises():
  params = SamplingParams(top_p=0.9, banned_token_ids=[7])
  jaxdecode.sample(KEY, LOGITS, params)
  # Other logits: the same params meet a vocabulary that does not hold their banned id.
  with pytest.raises(ValueError, match=r"banned_token_ids has token id 7, outside the vocabulary"):
    jaxdecode.sample(KEY, LOGITS[:, :5], params)
  with pytest.raises(ValueError, match=r"banned_token_ids has token id 7, outside"):
    jaxdecode.process_logits(LOGITS[:, :5], params)
  # A new params object with a bad value, built after a good one of the same shape.
  with pytest.raises(ValueError, match="top_p must be"):
    jaxdecode.sample(KEY, LOGITS, SamplingParams(top_p=1.5))
  per_row = SamplingParams(top_k=[1, 2, 3])
  jaxdecode.sample(KEY, LOGITS, per_row)
  with pytest.raises(ValueError, match=r"top_k has shape \(3,\) but the batch has 2 rows"):
    jaxdecode.sample(KEY, LOGITS[:2], per_row)
  # Bad keys, logits and counts with params (and without) whose checks are kept.
  for p in (params, None):
    with pytest.raises(ValueError, match=r"one per row \(shape \(3,\)\); got shape \(2,\)"):
      jaxdecode.sample(jax.random.split(KEY, 2), LOGITS, p)
    with pytest.raises(ValueError, match="dtype int32"):
      jaxdecode.sample(jnp.zeros(2, jnp.int32), LOGITS, p)
    with pytest.raises(ValueError, match=r"rank 2"):
      jaxdecode.sample(KEY, LOGITS[0], p)
    with pytest.raises(ValueError, match="floating-point"):
      jaxdecode.sample(KEY, LOGITS.astype(jnp.int32), p)
    with pytest.raises(ValueError, match=r"counts must be in \[0, "):
      jaxdecode.sample(KEY, LOGITS, p, counts=-jnp.ones((B, V), jnp.int32))
  with pytest.raises(ValueError, match="min_new_tokens=2 needs the EOS ids"):
    jaxdecode.sample(KEY, LOGITS, SamplingParams(min_new_tokens=2))


def test_params_of_numpy_arrays_are_checked_on_every_call_since_they_can_change():
  good = SamplingParams(banned_token_ids=[[1], [2], [3]], allowed_token_ids=[[], [], [3, 4]])
  params = jax.tree.map(np.array, good)  # writable NumPy leaves
  jaxdecode.sample(KEY, LOGITS, params)
  jaxdecode.sample(KEY, LOGITS, params)
  assert "_broadcasts" not in params.__dict__  # nothing kept for mutable leaves
  params.banned_token_ids[0, 1] = 12
  with pytest.raises(ValueError, match="banned_token_ids has token id 12, outside"):
    jaxdecode.sample(KEY, LOGITS, params)
  params.banned_token_ids[0, 1] = -1
  params.banned_token_ids[2, 1] = 4  # row 2 now bans both tokens it allows
  with pytest.raises(ValueError, match=r"row 2 bans every token it allows \(\[3, 4\]\)"):
    jaxdecode.sample(KEY, LOGITS, params)
  params.banned_token_ids[2, 1] = -1
  params.repetition_penalty[...] = 1.3  # a penalty needs counts
  with pytest.raises(ValueError, match="pass counts="):
    jaxdecode.sample(KEY, LOGITS, params)
  params.repetition_penalty[...] = 1.0
  params.min_new_tokens[...] = 3
  with pytest.raises(ValueError, match="min_new_tokens=3 needs the EOS ids"):
    jaxdecode.sample(KEY, LOGITS, params)


def test_the_kept_broadcasts_are_bounded_and_dropped_oldest_first():
  p = SamplingParams(top_p=0.9)
  size = params_module.BROADCAST_CACHE_SIZE
  for batch in range(1, 3 * size):
    assert p.broadcast(batch, V).top_p.shape == (batch,)
    assert len(p.__dict__["_broadcasts"]) <= size
  assert sorted(b for b, _ in p.__dict__["_broadcasts"]) == list(range(2 * size, 3 * size))
  kept = p.broadcast(3 * size - 1, V)
  assert p.broadcast(3 * size - 1, V) is kept and p.broadcast(1, V) is not p.broadcast(2, V)


def test_deleted_buffers_are_never_returned():
  p = SamplingParams(top_p=0.9)
  expected = jaxdecode.sample(KEY, LOGITS, p)
  kept = p.broadcast(B, V)
  kept.top_p.delete()  # e.g. donated to a jitted call
  fresh = p.broadcast(B, V)
  assert fresh is not kept and not fresh.top_p.is_deleted()
  np.testing.assert_array_equal(jaxdecode.sample(KEY, LOGITS, p), expected)


def test_traced_params_keep_working_and_are_never_kept():
  seen = []

  @jax.jit
  def draw(t, top_p):
    p = SamplingParams(temperature=t, top_p=top_p)  # tracers: not checkable, sanitized
    seen.append(p)
    return jaxdecode.sample(KEY, LOGITS, p)

  expected = jaxdecode.sample(KEY, LOGITS, SamplingParams(temperature=0.8, top_p=0.9))
  np.testing.assert_array_equal(draw(jnp.float32(0.8), jnp.float32(0.9)), expected)
  draw(jnp.float32(jnp.nan), jnp.float32(-1.0))  # bad traced values do not raise
  assert "_broadcasts" not in seen[0].__dict__


def test_concrete_params_closed_over_by_a_jit_give_the_same_bits_in_any_order():
  p = SamplingParams(temperature=jnp.array([0.5, 1.0, 1.5]), top_k=4)
  traced_first = jax.jit(lambda k, x: jaxdecode.sample(k, x, p))(KEY, LOGITS)  # miss under trace
  assert all(not isinstance(leaf, jax.core.Tracer)  # no tracer was kept
             for _, b, _ in p.__dict__.get("_broadcasts", {}).values() for leaf in jax.tree.leaves(b))
  eager = jaxdecode.sample(KEY, LOGITS, p)
  traced_after = jax.jit(lambda k, x: jaxdecode.sample(k, x, p))(KEY, LOGITS)  # hit under trace
  np.testing.assert_array_equal(eager, traced_first)
  np.testing.assert_array_equal(eager, traced_after)
