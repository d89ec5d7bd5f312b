"""Hypothesis property tests: any valid input gives in-range tokens from the kept set."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import jaxdecode

GRID = [-np.inf, -3.0, -1.5, -0.5, 0.0, 0.5, 1.0, 2.5, 7.0]


@st.composite
def cases(draw):
  batch = draw(st.integers(1, 4))
  vocab = draw(st.sampled_from([1, 2, 3, 8, 17]))
  logits = np.array(draw(st.lists(st.sampled_from(GRID), min_size=batch * vocab,
                                  max_size=batch * vocab)), np.float32).reshape(batch, vocab)
  logits[:, draw(st.integers(0, vocab - 1))] = 0.25  # every row has something selectable
  rows = st.lists(st.tuples(st.sampled_from([0.0, 1e-6, 0.3, 1.0, 2.0, 50.0]),
                            st.integers(0, vocab + 1),
                            st.floats(1e-3, 1.0),
                            st.floats(0.0, 1.0)), min_size=batch, max_size=batch)
  t, k, p, m = (np.array(c) for c in zip(*draw(rows)))
  params = jaxdecode.SamplingParams(t.astype(np.float32), k.astype(np.int32),
                                    p.astype(np.float32), m.astype(np.float32))
  return logits, params, draw(st.integers(0, 2**31 - 1))


@given(cases())
def test_tokens_are_in_range_in_the_kept_set_with_finite_logprobs(case):
  logits, params, seed = case
  tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(seed), jnp.asarray(logits),
                                                    params)
  tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
  kept = np.isfinite(np.asarray(jaxdecode.process_logits(jnp.asarray(logits), params)))
  assert ((tokens >= 0) & (tokens < logits.shape[1])).all()
  assert kept[np.arange(len(tokens)), tokens].all()
  assert np.isfinite(logprobs).all() and (logprobs <= 1e-6).all()
  # The greedy token survives every filter.
  assert kept[np.arange(len(tokens)), np.asarray(jaxdecode.greedy(jnp.asarray(logits)))].all()


@given(cases())
def test_kept_set_is_an_upper_set_containing_the_greedy_token(case):
  """Every rule keeps all tokens at least as likely as a kept one (temperature 0 aside)."""
  logits, params, _ = case
  out = np.asarray(jaxdecode.process_logits(jnp.asarray(logits), params))
  greedy = np.asarray(jaxdecode.greedy(jnp.asarray(logits)))
  for row, kept, t, g in zip(logits, np.isfinite(out), np.asarray(params.temperature), greedy):
    assert kept[g]
    if t > 0 and (~kept & np.isfinite(row)).any():
      assert row[kept].min() > row[~kept & np.isfinite(row)].max()
