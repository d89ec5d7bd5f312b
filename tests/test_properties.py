"""Hypothesis property tests: any valid input gives in-range tokens from the kept set."""

import pytest
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import jaxdecode
from jaxdecode import SamplingParams

GRID = [-np.inf, -3.0, -1.5, -0.5, 0.0, 0.5, 1.0, 2.5, 7.0]


@st.composite
def cases(draw):
  # Every shape is a compile of the chain, so the shapes are few (one row, where XLA specializes
  # size-1 dimensions; several rows; V of 1, 2 and past one lane of 8) and the values many.
  batch = draw(st.sampled_from([1, 3]))
  vocab = draw(st.sampled_from([1, 2, 17]))
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# Every kind of value a row can hold: +-inf, NaN, float32's extremes, subnormals, signed zeros.
EXTREME = [np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e30, -1e30, 1e-45, -1e-45, 0.0, -0.0, 1.0,
           -2.0, 5.5]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@st.composite
def hostile_cases(draw):
  """Rows of extreme values in any float dtype, and every params field set per row."""
  batch, vocab = 4, draw(st.sampled_from([5, 17]))
  dtype = draw(st.sampled_from(DTYPES))
  logits = np.array(draw(st.lists(st.sampled_from(EXTREME), min_size=batch * vocab,
                                  max_size=batch * vocab)), np.float32).reshape(batch, vocab)
  ids = st.lists(st.integers(0, vocab - 1), max_size=4)
  rows = []
  for _ in range(batch):
    allowed = draw(ids)
    banned = [i for i in draw(ids) if i not in allowed[:1]]  # a row may not ban all it allows
    rows.append(dict(
        temperature=draw(st.sampled_from([0.0, 1e-37, 1e-3, 0.7, 1.0, 1e3, 3e38])),
        top_k=draw(st.sampled_from([0, 1, 2, vocab - 1, vocab + 3])),
        top_p=draw(st.sampled_from([1e-38, 1e-6, 0.3, 0.9, 1.0])),
        min_p=draw(st.sampled_from([0.0, 0.1, 1.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1e-30, 1.5, 3e38])),
        presence_penalty=draw(st.sampled_from([0.0, -3e38, 2.0, 3e38])),
        frequency_penalty=draw(st.sampled_from([0.0, -1.0, 3e38])),
        typical_p=draw(st.sampled_from([1.0, 0.5, 1e-6, 1e-38])),
        epsilon_cutoff=draw(st.sampled_from([0.0, 0.05, 0.99])),
        eta_cutoff=draw(st.sampled_from([0.0, 0.05, 0.99])),
        logit_bias={i: draw(st.sampled_from([-3e38, -5.0, 5.0, 3e38])) for i in draw(ids)},
        banned=banned, allowed=allowed))
  column = lambda name, dt: np.array([r[name] for r in rows], dt)
  params = SamplingParams(
      temperature=column("temperature", np.float32), top_k=column("top_k", np.int32),
      top_p=column("top_p", np.float32), min_p=column("min_p", np.float32),
      repetition_penalty=column("repetition_penalty", np.float32),
      presence_penalty=column("presence_penalty", np.float32),
      frequency_penalty=column("frequency_penalty", np.float32),
      typical_p=column("typical_p", np.float32),
      epsilon_cutoff=column("epsilon_cutoff", np.float32),
      eta_cutoff=column("eta_cutoff", np.float32),
      logit_bias=[r["logit_bias"] for r in rows], banned_token_ids=[r["banned"] for r in rows],
      allowed_token_ids=[r["allowed"] for r in rows])
  counts = np.array(draw(st.lists(st.sampled_from([0, 0, 1, 3, 2**31 - 1]), min_size=batch * vocab,
                                  max_size=batch * vocab)), np.int32).reshape(batch, vocab)
  with np.errstate(over="ignore"):  # 3.4e38 is +inf in float16: one more extreme value
    logits = jnp.asarray(logits.astype(jnp.dtype(dtype)))
  return logits, params, rows, counts, draw(st.integers(0, 2**31 - 1))


@pytest.mark.slow
@given(hostile_cases())
def test_hostile_rows_never_yield_a_removed_token_nor_an_empty_row(case):
  logits, params, rows, counts, seed = case
  tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(seed), logits, params,
                                                    counts=counts)
  processed = np.asarray(jaxdecode.process_logits(logits, params, counts=counts), np.float32)
  tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
  x = np.asarray(logits, np.float32)
  vocab = x.shape[1]
  for b, row in enumerate(rows):
    allowed = np.zeros(vocab, bool)
    allowed[row["allowed"] or list(range(vocab))] = True
    allowed[row["banned"]] = False
    selectable = allowed & ~np.isnan(x[b]) & (x[b] > -np.inf)
    assert 0 <= tokens[b] < vocab
    if not selectable.any():
      assert np.isnan(logprobs[b])  # reported, not hidden
      continue
    assert selectable[tokens[b]], (b, row, x[b], tokens[b])  # allowed, not banned, not NaN
    assert np.isfinite(processed[b, tokens[b]])  # in process_logits' kept set
    assert np.isfinite(logprobs[b]) and logprobs[b] <= 1e-6
    assert not np.isnan(processed[b]).any() and not np.isposinf(processed[b]).any()
    if row["temperature"] == 0:  # greedy is the argmax of the processed logits
      assert tokens[b] == np.argmax(processed[b]) and logprobs[b] == 0.0
