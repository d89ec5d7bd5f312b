"""top-nσ, XTC, dynamic temperature, DRY, mirostat 2, no_repeat_ngram_size and bad_words:
exact against the plain-Python references of tests/reference.py on hostile rows, and composed
with every loop (decode, speculative, beam search, constraints) with rows bitwise the same
alone and batched."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxdecode
from jaxdecode import SamplingParams, metrics, processors, sampling
import reference as ref
import toy_model

INF, NAN = np.inf, np.nan


def hygiene(row):
  """The chain's input rules, by hand: NaN -> -inf; a row with +inf is uniform over them."""
  row = np.where(np.isnan(row), -INF, np.asarray(row, np.float64))
  if np.any(row == INF):
    row = np.where(row == INF, 0.0, -INF)
  return row


def kept(out):
  return np.isfinite(np.asarray(out, np.float64))


# Hostile rows of V = 6: ties, -inf, NaN, +inf, float32's extremes, a flat row, nothing left.
HOSTILE = np.array([
    [1.0, 2.0, 3.0, 4.0, 4.0, -INF],
    [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
    [1e38, -1e38, 3e38, 0.0, -3.4e38, 3.4e38],
    [NAN, 2.0, NAN, -1.0, 2.0, 0.0],
    [INF, 1.0, INF, -INF, 0.0, 5.0],
    [-INF, -INF, -INF, -INF, -INF, -INF],
    [-1.5, 0.0, 1.5, -1.5, 0.0, 1.5],
    [3.0, -INF, -INF, -INF, -INF, -INF],
], np.float32)


with np.errstate(divide="ignore"):
  XTC_ROWS = np.log(np.array([
      [0.3, 0.3, 0.2, 0.2, 0.0, 0.0],     # two tie at the least probability above 0.19: both stay
      [0.5, 0.2, 0.1, 0.1, 0.05, 0.05],
      [0.6, 0.3, 0.1, 0.0, 0.0, 0.0],
      [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],     # one token: nothing to exclude
      [0.25, 0.25, 0.25, 0.25, 0.0, 0.0],  # all tied: all stay
      [0.4, 0.3, 0.2, 0.1, 0.0, 0.0],
  ], np.float64)).astype(np.float32)
ROWS = np.concatenate([HOSTILE, XTC_ROWS])  # [14, 6]: every processor test uses this shape
NO_HISTORY = np.full((len(ROWS), 16), -1, np.int32)


def chain(x, params, history=NO_HISTORY):
  """process_logits with a history and a key always (one compiled program for these tests)."""
  return np.asarray(jaxdecode.process_logits(jnp.asarray(x), params, history=history,
                                             key=jax.random.key(0)))


@pytest.mark.slow
def test_top_n_sigma_matches_llama_cpp_on_hostile_rows_every_row_its_own_n():
  rng = np.random.default_rng(0)
  for n_values in ([1.0] * 14, [0.0, -1.0, 0.5, 1.0, 2.0, 1e30, 0.3, 1.0, 0.1, 0.2, 0.4, 0.8,
                                1.2, 0.6], rng.choice([0.0, 0.2, 0.7, 1.0, 1.6, 3.0], 14)):
    n = np.asarray(n_values, np.float32)
    out = chain(ROWS, SamplingParams(top_n_sigma=n))
    for r, row in enumerate(ROWS):
      clean = hygiene(row)
      keep, amb = ref.top_n_sigma_keep(clean, float(n[r]))
      keep = keep & np.isfinite(clean)
      np.testing.assert_array_equal(kept(out[r])[~amb], keep[~amb], err_msg=f"row {r}")
      np.testing.assert_array_equal(out[r][keep], clean[keep])  # kept logits are unchanged


@pytest.mark.slow
def test_a_vocabulary_of_one_token():
  """top-nσ and XTC keep it; a repeat bans it (n-grams), and so does a bad word."""
  x = jnp.array([[2.0], [2.0], [2.0]])
  params = SamplingParams(top_n_sigma=3.0, xtc_probability=1.0, xtc_threshold=0.0,
                          no_repeat_ngram_size=np.array([2, 0, 0], np.int32),
                          bad_words=[None, None, [[0, 0]]])
  out = jaxdecode.process_logits(x, params, history=np.array([[0, 0], [0, 0], [-1, 0]]))
  assert np.asarray(out).tolist() == [[-np.inf], [2.0], [-np.inf]]


def test_top_n_sigma_kept_set_does_not_change_with_temperature():
  rng = np.random.default_rng(1)
  x = rng.normal(size=ROWS.shape).astype(np.float32) * 3
  n = np.array([0.5, 1.0, 1.5, 2.0, 0.0, 0.8, 0.3] * 2, np.float32)
  masks = [kept(chain(x, SamplingParams(temperature=t, top_n_sigma=n))) for t in (0.3, 1.0, 2.5)]
  np.testing.assert_array_equal(masks[0], masks[1])
  np.testing.assert_array_equal(masks[2], masks[1])
  assert 14 < masks[1].sum() < 14 * 6 - 14  # it cut something, and not everything



def test_xtc_with_probability_one_matches_llama_cpp_and_keeps_ties_at_the_least_probable():
  hostile = np.concatenate([XTC_ROWS, HOSTILE])
  rows = len(hostile)
  assert hostile.shape == ROWS.shape
  # Thresholds away from every row's probabilities: a float32 p on the other side of the cut
  # than its float64 value would change the least probable token above it, and so the row.
  for thresholds in ([0.19] * rows, [0.19, 0.09, 0.25, 0.0, 0.24, 0.15] + [0.1] * 8,
                     [0.51, 0.6, 1.0, 0.7, 0.9, 0.55] + [0.8] * 8):  # > 0.5: a no-op
    thr = np.asarray(thresholds, np.float32)
    out = chain(hostile, SamplingParams(xtc_threshold=thr, xtc_probability=1.0))
    for r, row in enumerate(hostile):
      clean = hygiene(row)
      keep, amb = ref.xtc_keep(clean, float(thr[r]))
      assert not amb.any(), (r, thr[r])
      keep = keep & np.isfinite(clean)
      np.testing.assert_array_equal(kept(out[r])[~amb], keep[~amb], err_msg=f"row {r}")
      np.testing.assert_array_equal(out[r][keep], clean[keep])
    if thresholds[0] == 0.19:
      assert kept(out[0]).tolist() == [False, False, True, True, False, False]
  # Probability 0 is off, whatever the threshold.
  off = chain(ROWS, SamplingParams(xtc_threshold=0.0))
  np.testing.assert_array_equal(off, chain(ROWS, SamplingParams()))


def test_dynamic_temperature_matches_llama_cpp_on_hostile_rows():
  rng = np.random.default_rng(5)
  temperature = rng.choice([0.3, 0.8, 1.0, 1.5], 14).astype(np.float32)
  spread = rng.choice([0.2, 0.5, 1.0, 2.0], 14).astype(np.float32)
  exponent = rng.choice([0.0, 0.5, 1.0, 2.0], 14).astype(np.float32)
  out = chain(ROWS, SamplingParams(temperature=temperature, dynatemp_range=spread,
                                   dynatemp_exponent=exponent))
  for r, row in enumerate(ROWS):
    clean = hygiene(row)
    expected = ref.dynatemp_logits(clean, float(temperature[r]), float(spread[r]),
                                   float(exponent[r]))
    np.testing.assert_array_equal(kept(out[r]), np.isfinite(expected), err_msg=f"row {r}")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(out[r][finite], expected[finite], rtol=2e-5, err_msg=f"row {r}")
  # Range 0 is plain temperature, bit for bit; a spread that reaches 0 at zero entropy makes a
  # one-hot row greedy; a temperature-0 row stays greedy.
  np.testing.assert_array_equal(
      chain(ROWS, SamplingParams(temperature=temperature, dynatemp_range=0.0)),
      chain(ROWS, SamplingParams(temperature=temperature)))
  greedy = chain(ROWS, SamplingParams(temperature=0.0, dynatemp_range=1.0))
  np.testing.assert_array_equal(greedy, chain(ROWS, SamplingParams(temperature=0.0)))


N_DRAWS = 20_000


@pytest.mark.slow
def test_xtc_coin_comes_from_the_row_key_folded_with_its_own_constant():
  """Rows whose coin (uniform of fold_in(row key, XTC_SALT)) is >= p draw exactly the token of
  the same key without XTC; the others draw from the XTC-kept set; frequencies are the mixture."""
  row = XTC_ROWS[5]  # 0.4, 0.3, 0.2, 0.1: threshold 0.15 keeps 0.2 and 0.1
  logits = jnp.broadcast_to(jnp.asarray(row), (N_DRAWS, row.size))
  keys = jax.random.split(jax.random.key(3), N_DRAWS)
  with_xtc = SamplingParams(xtc_threshold=0.15, xtc_probability=0.4)
  tokens = np.asarray(jaxdecode.sample(keys, logits, with_xtc))
  plain = np.asarray(jaxdecode.sample(keys, logits, SamplingParams()))
  coin = np.asarray(jax.vmap(lambda k: jax.random.uniform(
      jax.random.fold_in(k, processors.XTC_SALT)))(keys))
  acted = coin < 0.4
  np.testing.assert_array_equal(tokens[~acted], plain[~acted])
  assert set(tokens[acted].tolist()) <= {2, 3}
  full = ref.softmax64(row)
  cut = ref.softmax64(np.where(ref.xtc_keep(row.astype(np.float64), 0.15)[0], row, -INF))
  expected = 0.6 * full + 0.4 * cut
  counts = np.bincount(tokens, minlength=row.size)
  assert counts[expected == 0].sum() == 0
  assert stats.chisquare(counts[expected > 0], N_DRAWS * expected[expected > 0]).pvalue > 1e-3
  assert abs(acted.mean() - 0.4) < 0.02


@pytest.mark.slow
def test_sampled_frequencies_match_the_reference_with_bans_top_n_sigma_and_dynatemp():
  row = np.array([2.0, 1.2, 1.2, 0.5, 0.0, -0.4, -1.0, -INF, -2.5, 0.9, -3.0, 1.5], np.float32)
  seen = [0, 9, 4, 9, 0, 9]
  history = np.array([[-1] + seen], np.int32)
  params = SamplingParams(top_n_sigma=1.2, dynatemp_range=0.6, dynatemp_exponent=1.5,
                          no_repeat_ngram_size=3, bad_words=[[9, 1], [11]], dry_multiplier=0.7,
                          dry_allowed_length=1)
  x = row.astype(np.float64)
  banned = ref.no_repeat_ngram_banned(seen, 3) | ref.bad_words_banned(seen, [[9, 1], [11]])
  assert banned == {4, 1, 11}  # 0 9 -> 4 (3-gram), 9 -> 1, 11
  x[sorted(banned)] = -INF
  penalty = ref.dry_penalties(seen, 12, 0.7, 1.75, 1, -1, set())
  assert penalty[0] > 0  # 9 0 9 ... 9 repeated: 0 follows 9
  x = x - penalty
  x = np.where(ref.top_n_sigma_keep(x, 1.2)[0], x, -INF)
  expected = ref.softmax64(ref.dynatemp_logits(x, 1.0, 0.6, 1.5))
  assert 2 < (expected > 0).sum() < 8
  logits = jnp.broadcast_to(jnp.asarray(row), (N_DRAWS, row.size))
  tokens, logprobs = jaxdecode.sample_with_logprobs(
      jax.random.key(12), logits, params, history=np.broadcast_to(history, (N_DRAWS, 7)))
  counts = np.bincount(np.asarray(tokens), minlength=row.size)
  assert counts[expected == 0].sum() == 0
  assert stats.chisquare(counts[expected > 0], N_DRAWS * expected[expected > 0]).pvalue > 1e-3
  np.testing.assert_allclose(np.asarray(logprobs), np.log(expected[np.asarray(tokens)]),
                             atol=2e-5)


def left_padded(histories, width):
  out = np.full((len(histories), width), -1, np.int32)
  for b, h in enumerate(histories):
    if h:
      out[b, width - len(h):] = h
  return out


def test_no_repeat_ngram_and_bad_words_match_transformers_on_hostile_histories():
  rng = np.random.default_rng(2)
  vocab = 6
  histories = [list(rng.integers(0, vocab, rng.integers(0, 14))) for _ in range(10)]
  histories += [[3] * 12, [], [5], [1, 2, 1, 2, 1]]  # one repeated token, empty, one token
  sizes = np.array([rng.integers(0, 6) for _ in histories], np.int32)
  sizes[-4:] = [2, 1, 3, 2]
  sizes[0] = 40  # longer than the history: nothing
  words = [[[1, 2], [2, 3, 4], [5]], [], [[3, 3, 3]], [[0]]] * 3 + [[[2, 1]], [[1, 2, 1, 2, 3]]]
  words = words[:len(histories)]
  x = np.zeros(ROWS.shape, np.float32)
  history = left_padded(histories, 16)
  for params, banned in [
      (SamplingParams(no_repeat_ngram_size=sizes),
       [ref.no_repeat_ngram_banned(h, int(n)) for h, n in zip(histories, sizes)]),
      (SamplingParams(bad_words=words),
       [ref.bad_words_banned(h, w) for h, w in zip(histories, words)])]:
    out = kept(chain(x, params, history))
    for b, ids in enumerate(banned):
      assert set(np.flatnonzero(~out[b]).tolist()) == ids, (b, histories[b])
  assert ref.no_repeat_ngram_banned([3] * 12, 2) == {3}  # the reference is not vacuous
  with pytest.raises(ValueError, match="pass history="):
    jaxdecode.process_logits(x, SamplingParams(no_repeat_ngram_size=2))
  for bad in (history[:1], history[:, :, None], history.astype(np.float32)):
    with pytest.raises(ValueError, match=rf"history must be an integer array of {len(x)} rows"):
      jaxdecode.process_logits(x, SamplingParams(no_repeat_ngram_size=2), history=bad)
  with pytest.raises(ValueError, match="history must be an integer array"):
    jaxdecode.process_logits(x, SamplingParams(no_repeat_ngram_size=2), history="tokens")


def test_dry_matches_llama_cpp_on_hostile_histories():
  rng = np.random.default_rng(6)
  vocab = ROWS.shape[1]
  histories = [list(rng.integers(0, 3, rng.integers(0, 16))) for _ in range(8)]
  histories += [[2] * 16, [0, 1, 2, 2, 1, 2, 3, 0, 1, 2], [1, 2, 1, 2, 1, 2, 1], [4],
                [1, 2, 5, 1, 2, 5, 1, 2], [3, 3, 3, 4, 3, 3, 3]]  # a repeated token; llama.cpp's
  multiplier = rng.choice([0.0, 0.8, 1.0, 3e38], 14).astype(np.float32)  # example; breakers
  multiplier[8:] = [2.0, 1.0, 0.5, 1.0, 1.5, 1.0]
  base = rng.choice([1.0, 1.5, 1.75, 1e30], 14).astype(np.float32)
  base[8:] = [1.75, 2.0, 1.0, 1.75, 3.0, 1e20]
  allowed = rng.choice([1, 2, 3], 14).astype(np.int32)
  allowed[8:] = [2, 1, 1, 1, 2, 1]
  last_n = rng.choice([-1, 0, 3, 6, 50], 14).astype(np.int32)
  last_n[8:] = [-1, -1, 5, -1, -1, 4]
  breakers = [[3], [], [5, 0], [], [], [1], [], []] + [[], [3], [], [], [5], [4]]
  x = ROWS.copy()
  out = chain(x, SamplingParams(dry_multiplier=multiplier, dry_base=base,
                                dry_allowed_length=allowed, dry_penalty_last_n=last_n,
                                dry_sequence_breakers=breakers), left_padded(histories, 16))
  f32_max = float(np.finfo(np.float32).max)
  for b, tokens in enumerate(histories):
    penalty = ref.dry_penalties(tokens, vocab, float(multiplier[b]), float(base[b]),
                                int(allowed[b]), int(last_n[b]), set(breakers[b]))
    clean = hygiene(x[b])
    expected = np.where(clean == -INF, -INF, np.clip(clean - penalty, -f32_max, f32_max))
    np.testing.assert_array_equal(kept(out[b]), np.isfinite(expected), err_msg=f"row {b}")
    finite = np.isfinite(expected)
    np.testing.assert_allclose(out[b][finite], expected[finite], rtol=1e-5, atol=1e-6,
                               err_msg=f"row {b}: {tokens}")
  # The rows that must be penalized are (the test is not vacuous): the repeated token, and
  # llama.cpp's own example (c by 2^2, b by 2^0, y by 2^1 with allowed length 1 and base 2).
  assert ref.dry_penalties([2] * 16, 6, 2.0, 1.75, 2, -1, set())[2] > 0
  assert ref.dry_penalties(histories[9], 6, 1.0, 2.0, 1, -1, set()).tolist() == [0, 1, 4, 2, 0, 0]
  np.testing.assert_array_equal(out[9] - hygiene(x[9]), [0, -1, -4, 0, 0, 0])  # y: breaker


@pytest.mark.parametrize("field,value,fragment", [
    ("top_n_sigma", float("nan"), "top_n_sigma must be a finite number"),
    ("top_n_sigma", float("inf"), "got inf"),
    ("xtc_threshold", 1.5, "0 <= xtc_threshold <= 1"),
    ("xtc_probability", -0.1, "0 <= xtc_probability <= 1"),
    ("xtc_probability", float("nan"), "got nan"),
    ("no_repeat_ngram_size", -1, "no_repeat_ngram_size must be an integer >= 0"),
    ("dynatemp_range", -0.5, "dynatemp_range must be a finite number >= 0"),
    ("dynatemp_exponent", float("inf"), "got inf"),
    ("dry_allowed_length", 0, "dry_allowed_length must be an integer >= 1"),
    ("dry_base", 0.5, "dry_base must be a finite number >= 1"),
    ("dry_multiplier", -1.0, "dry_multiplier must be a finite number >= 0"),
    ("dry_penalty_last_n", -2, "an integer >= -1"),
    ("dry_sequence_breakers", [-3], "token ids"),
    ("mirostat", 1, "mirostat must be 0 (off) or 2"),
    ("mirostat_tau", -1.0, "mirostat_tau must be a finite number >= 0"),
    ("mirostat_eta", float("nan"), "got nan"),
    ("no_repeat_ngram_size", 2.0, "pass integers"),
    ("bad_words", [[1, -2]], "token ids"),
    ("bad_words", [[1, 2], []], "non-empty"),
    ("bad_words", np.array([[-1, 3]]), "padded with -1 at their end"),
])
def test_new_fields_refuse_bad_values_naming_field_value_and_range(field, value, fragment):
  with pytest.raises(ValueError, match="bad_words|" + field) as info:
    SamplingParams(**{field: value})
  assert field in str(info.value) and fragment in str(info.value)


def test_new_field_values_are_traced_and_their_defaults_change_nothing():
  rng = np.random.default_rng(4)
  x = rng.normal(size=ROWS.shape).astype(np.float32)
  history = left_padded([[1, 2, 1], [4], [2, 2, 2, 2]] * 4 + [[], [5]], 16)
  chain(x, SamplingParams(bad_words=[None] * 14), history)
  compiled = processors._process_logits._cache_size()  # pylint: disable=protected-access
  outs = [chain(x, SamplingParams(top_n_sigma=n, xtc_threshold=t, xtc_probability=p,
                                  no_repeat_ngram_size=g, bad_words=w), history)
          for n, t, p, g, w in [(0.0, 0.1, 0.0, 0, [None] * 14),
                                (1.0, 0.05, 1.0, 2, [[[1, 2]]] + [None] * 13),
                                (2.5, 0.3, 0.5, 1, [[[4, 5]], None, [[2, 2, 5]]] + [None] * 11)]]
  assert processors._process_logits._cache_size() == compiled  # pylint: disable=protected-access
  assert not np.array_equal(kept(outs[1]), kept(outs[0]))
  np.testing.assert_array_equal(outs[0], chain(x, SamplingParams()))


# ---------------------------------------------------------------------------------------------
# Through the loops.

VOCAB = 11
BIGRAM = toy_model.bigram_table(VOCAB, seed=3)
STEP = toy_model.make_bigram_step(BIGRAM)
PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 6, 7, 8, 9, 10], [2, 2, 2, 2], [7, 0, 7, 0, 7], [9, 3]]
N = 9  # row 3 bans every token it has seen: at most 10 new ones before nothing is left
# One row per rule (and all of them at once), every row different.
LOOP_PARAMS = SamplingParams(
    temperature=np.array([0.0, 0.9, 1.0, 0.0, 0.8, 1.2], np.float32),
    top_n_sigma=np.array([0.0, 1.0, 0.0, 0.0, 0.0, 1.5], np.float32),
    xtc_threshold=np.array([0.1, 0.1, 0.05, 0.1, 0.1, 0.08], np.float32),
    xtc_probability=np.array([0.0, 0.0, 0.6, 0.0, 0.0, 0.5], np.float32),
    dynatemp_range=np.array([0.0, 0.5, 0.0, 0.0, 0.3, 0.0], np.float32),
    dynatemp_exponent=np.array([1.0, 2.0, 1.0, 1.0, 0.5, 1.0], np.float32),
    dry_multiplier=np.array([0.0, 0.8, 1.5, 0.0, 0.0, 0.5], np.float32),
    dry_allowed_length=np.array([2, 2, 1, 2, 2, 3], np.int32),
    dry_penalty_last_n=np.array([-1, 6, -1, -1, -1, 10], np.int32),
    dry_sequence_breakers=[[], [3], [], [], [], [0, 9]],
    mirostat=np.array([0, 2, 0, 0, 2, 0], np.int32),
    mirostat_tau=np.array([5.0, 1.5, 5.0, 5.0, 0.8, 5.0], np.float32),
    mirostat_eta=np.array([0.1, 0.5, 0.1, 0.1, 1.0, 0.1], np.float32),
    no_repeat_ngram_size=np.array([2, 0, 0, 1, 3, 2], np.int32),
    bad_words=[[[1, 2, 3]], None, None, [[2, 5]], [[0, 7, 0]], [[3, 3], [10]]])


def repeats(seq, start, n):
  """The positions j >= start whose n-gram seq[j - n + 1 : j + 1] occurs earlier in seq."""
  grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
  return [i + n - 1 for i, g in enumerate(grams) if i + n - 1 >= start and g in grams[:i]]


def prompt_array():
  """Rows padded with -1 at the start, at the end, or both (any is allowed)."""
  out = np.full((len(PROMPTS), 8), -1, np.int32)
  for b, p in enumerate(PROMPTS):
    start = (0, 8 - len(p), 1)[b % 3]
    out[b, start:start + len(p)] = p
  return out


@jax.jit
def one_step(keys, logits, params, history, mu):
  """One step of sampling with a mirostat state: the chain, one draw, mu's update."""
  params = params.sanitized()
  processed = processors.process_f32(logits, params, None, keys, history, mu)
  token, logprob = sampling.draw(keys, processed)
  return token, logprob, processors.mirostat_update(mu, logprob, params)


def python_loop(params, key, prompts):
  """decode written as a Python loop of single steps (`one_step`) with the row keys
  fold_in(fold_in(key, row), t), the history prompt + new tokens and mu carried by hand."""
  logits, state, positions = toy_model.prefill_bigram(BIGRAM, prompts, 32)
  rows = len(prompts)
  params = params.broadcast(rows, VOCAB)
  row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(rows))
  tokens, logprobs = [], []
  mu = 2.0 * params.mirostat_tau
  for t in range(N):
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
    history = left_padded([list(p) + [int(v) for v in col] for p, col in
                           zip(prompts, np.array(tokens, np.int32).reshape(t, rows).T)], 32)
    token, logprob, mu = one_step(keys, logits, params, history, mu)
    tokens.append(np.asarray(token))
    logprobs.append(np.asarray(logprob))
    logits, state = STEP(state, token, positions + t)
  return np.stack(tokens, 1), np.stack(logprobs, 1)


def run_decode(params, key, rows=slice(None)):
  prompts = PROMPTS[rows]
  logits, state, positions = toy_model.prefill_bigram(BIGRAM, prompts, 32)
  return jaxdecode.decode(STEP, state, logits, key=key, params=params, max_new_tokens=N,
                          positions=positions, prompt_tokens=prompt_array()[rows])


@pytest.mark.slow
def test_decode_with_the_new_rules_equals_a_python_loop_and_rows_alone():
  key = jax.random.key(7)
  out = run_decode(LOOP_PARAMS, key)
  tokens, logprobs = python_loop(LOOP_PARAMS, key, PROMPTS)
  np.testing.assert_array_equal(out.tokens, tokens)
  np.testing.assert_array_equal(out.logprobs, logprobs)
  assert not np.asarray(out.dead_end).any()
  # The rules held: no new token completes a bigram already in rows 0 and 5 (prompt included),
  # nor a token already in row 3.
  for b, n in ((0, 2), (5, 2), (3, 1)):
    seq = PROMPTS[b] + np.asarray(out.tokens[b]).tolist()
    assert repeats(seq, len(PROMPTS[b]), n) == [], seq
  assert repeats(PROMPTS[0] + [3], 5, 2) == [5]  # the check itself can fail
  # A row alone: bitwise its tokens and log-probs in the batch (its key: fold_in(key, row)).
  for b in range(len(PROMPTS)):
    alone = jaxdecode.decode(
        STEP, *_prefill_one(b), key=jax.random.fold_in(key, b)[None],
        params=LOOP_PARAMS.rows(np.array([b])), max_new_tokens=N,
        positions=jnp.array([len(PROMPTS[b])]), prompt_tokens=prompt_array()[b:b + 1])
    np.testing.assert_array_equal(alone.tokens[0], out.tokens[b])
    np.testing.assert_array_equal(alone.logprobs[0], out.logprobs[b])


def _prefill_one(b):
  logits, state, _ = toy_model.prefill_bigram(BIGRAM, [PROMPTS[b]], 32)
  return state, logits


@pytest.mark.slow
def test_speculative_equals_decode_bitwise_with_the_new_rules():
  key = jax.random.key(8)
  ref_out = run_decode(LOOP_PARAMS, key)
  logits, state, positions = toy_model.prefill_bigram(BIGRAM, PROMPTS, 32)
  prompt_tokens, prompt_lengths = jaxdecode.right_pad(PROMPTS, width=8)
  out = jaxdecode.speculative_decode(
      STEP, state, logits, key=key, params=LOOP_PARAMS, max_new_tokens=N, positions=positions,
      drafter=jaxdecode.NgramDrafter(prompt_tokens, prompt_lengths), num_draft_tokens=3,
      prompt_tokens=prompt_array())
  np.testing.assert_array_equal(out.tokens, ref_out.tokens)
  np.testing.assert_array_equal(out.logprobs, ref_out.logprobs)
  assert np.asarray(out.accepted).sum() > 0


@pytest.mark.slow
def test_beam_search_bans_repeated_ngrams_and_bad_words_and_refuses_an_xtc_coin():
  logits, state, positions = toy_model.prefill_bigram(BIGRAM, PROMPTS[:3], 32)
  params = SamplingParams(no_repeat_ngram_size=2, bad_words=[[1, 2, 3], [4, 4]],
                          top_n_sigma=2.0, dynatemp_range=0.5, xtc_probability=1.0,
                          dry_multiplier=0.8)
  out = jaxdecode.beam_search(STEP, state, logits, beam_size=3, max_new_tokens=8,
                              positions=positions, params=params,
                              prompt_tokens=prompt_array()[:3])
  for b in range(3):
    for r in range(3):
      start = len(PROMPTS[b])
      seq = PROMPTS[b] + np.asarray(out.tokens[b, r, :out.lengths[b, r]]).tolist()
      assert repeats(seq, start, 2) == [], seq
      assert all(seq[i - 1:i + 1] != [4, 4] and seq[i - 2:i + 1] != [1, 2, 3]
                 for i in range(start, len(seq))), seq
  with pytest.raises(ValueError, match="beam_search draws nothing"):
    jaxdecode.beam_search(STEP, state, logits, beam_size=2, max_new_tokens=4,
                          positions=positions, params=SamplingParams(xtc_probability=0.5))
  with pytest.raises(ValueError, match="beam_search does not carry mirostat"):
    jaxdecode.beam_search(STEP, state, logits, beam_size=2, max_new_tokens=4,
                          positions=positions, params=SamplingParams(mirostat=2))


def mirostat_reference(prompts, tokens, logprobs, tau, eta):
  """llama.cpp's mirostat 2 over the bigram model, in float64, along the tokens decode drew: at
  each step the kept set for mu (the drawn token must be in it), the drawn token's probability
  under the renormalized kept set (decode's log-probability must match it), then mu's update.
  Returns how many steps had a token near the cut (not checked)."""
  table = np.asarray(BIGRAM, np.float64)
  unsure = 0
  for b, prompt in enumerate(prompts):
    mu = 2.0 * tau[b]
    last = prompt[-1]
    for t in range(tokens.shape[1]):
      probs = ref.softmax64(table[last])
      surprise = -np.log2(probs)
      keep = (surprise <= mu) | (probs == probs.max())
      kept = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
      token = int(tokens[b, t])
      if np.min(np.abs(surprise - mu)) < 1e-4:
        unsure += 1
      else:
        assert keep[token], (b, t, token, mu)
        np.testing.assert_allclose(logprobs[b, t], np.log(kept[token]), atol=2e-5)
      mu = mu - eta[b] * (-np.log2(kept[token]) - tau[b])
      last = token
  return unsure


@pytest.mark.slow
def test_mirostat_2_in_decode_follows_llama_cpp_and_keeps_mu_per_row():
  """Per row tau and eta, tau = 0 (only the most probable token, mu stays 0) and eta = 0 (mu
  stays 2 tau); logprobs_mode="raw" reports other log-probabilities but draws the same tokens
  (mu learns from the processed ones); every row alone gives its batch bits."""
  tau = np.array([3.0, 0.0, 1.0, 2.0, 0.5, 4.0], np.float32)
  eta = np.array([0.1, 0.3, 0.0, 1.0, 0.5, 0.2], np.float32)
  params = SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=eta)
  key = jax.random.key(21)
  out = run_decode(params, key)
  tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
  assert mirostat_reference(PROMPTS, tokens, logprobs, tau, eta) <= 2
  table = np.asarray(BIGRAM)
  assert all(tokens[1, t] == np.argmax(table[([PROMPTS[1][-1]] + list(tokens[1]))[t]])
             for t in range(N))  # tau = 0: greedy
  assert (logprobs[1] == 0).all() and (logprobs[0] < 0).any()
  logits, state, positions = toy_model.prefill_bigram(BIGRAM, PROMPTS, 32)
  raw = jaxdecode.decode(STEP, state, logits, key=key, params=params, max_new_tokens=N,
                         positions=positions, prompt_tokens=prompt_array(), logprobs_mode="raw")
  np.testing.assert_array_equal(raw.tokens, out.tokens)
  assert not np.array_equal(raw.logprobs, out.logprobs)
  for b in (0, 4):
    alone = jaxdecode.decode(
        STEP, *_prefill_one(b), key=jax.random.fold_in(key, b)[None], params=params.rows(
            np.array([b])), max_new_tokens=N, positions=jnp.array([len(PROMPTS[b])]),
        prompt_tokens=prompt_array()[b:b + 1])
    np.testing.assert_array_equal(alone.tokens[0], out.tokens[b])
    np.testing.assert_array_equal(alone.logprobs[0], out.logprobs[b])


@pytest.mark.slow
def test_mirostat_first_step_frequencies_match_the_kept_distribution():
  """sample() has no state: it cuts at the initial mu = 2 tau."""
  row = np.asarray(BIGRAM)[3]
  probs = ref.softmax64(row)
  tau = float(np.sort(-np.log2(probs))[3]) / 2 + 0.05  # keeps the 4 most probable
  keep = -np.log2(probs) <= 2 * tau
  assert keep.sum() == 4
  expected = np.where(keep, probs, 0.0) / probs[keep].sum()
  logits = jnp.broadcast_to(jnp.asarray(row), (N_DRAWS, row.size))
  tokens = np.asarray(jaxdecode.sample(jax.random.key(5), logits,
                                       SamplingParams(mirostat=2, mirostat_tau=tau)))
  counts = np.bincount(tokens, minlength=row.size)
  assert counts[~keep].sum() == 0
  assert stats.chisquare(counts[keep], N_DRAWS * expected[keep]).pvalue > 1e-3


@pytest.mark.slow
def test_the_new_rules_compose_with_a_constraint_in_decode_and_speculative_decoding():
  """Under a regex every finished row is a whole match (the rules only remove or reweigh the
  tokens the automaton allows), and speculative decoding still equals decode bit for bit."""
  letters = [bytes([c]) for c in b"abcdefghij"]
  vocab = jaxdecode.structured.Vocabulary(letters + [None], eos_ids=[10])  # V = 11, EOS 10
  constraint = jaxdecode.structured.regex(r"(ab|c|de)+", vocab)
  key = jax.random.key(4)
  logits, state, positions = toy_model.prefill_bigram(BIGRAM, PROMPTS, 32)
  args = dict(key=key, params=LOOP_PARAMS, max_new_tokens=N, positions=positions,
              prompt_tokens=prompt_array(), constraint=constraint, eos_ids=[10])
  out = jaxdecode.decode(STEP, state, logits, **args)
  prompt_tokens, prompt_lengths = jaxdecode.right_pad(PROMPTS, width=8)
  spec = jaxdecode.speculative_decode(
      STEP, state, logits, drafter=jaxdecode.NgramDrafter(prompt_tokens, prompt_lengths),
      num_draft_tokens=3, **args)
  np.testing.assert_array_equal(spec.tokens, out.tokens)
  np.testing.assert_array_equal(spec.logprobs, out.logprobs)
  finished = np.asarray(out.finished)
  assert finished.any()
  for b in np.flatnonzero(finished):
    text = bytes(letters[t][0] for t in np.asarray(out.tokens[b, :out.lengths[b] - 1]))
    assert re.fullmatch(rb"(ab|c|de)+", text), text


def test_every_loop_names_prompt_tokens_of_the_wrong_shape_or_dtype():
  logits, state, positions = toy_model.prefill_bigram(BIGRAM, PROMPTS[:3], 32)
  loops = {
      "decode": lambda p: jaxdecode.decode(STEP, state, logits, key=jax.random.key(0),
                                           params=SamplingParams(), max_new_tokens=4,
                                           positions=positions, prompt_tokens=p),
      "beam_search": lambda p: jaxdecode.beam_search(STEP, state, logits, beam_size=2,
                                                     max_new_tokens=4, positions=positions,
                                                     prompt_tokens=p),
      "speculative_decode": lambda p: jaxdecode.speculative_decode(
          STEP, state, logits, key=jax.random.key(0), params=SamplingParams(), max_new_tokens=4,
          positions=positions, drafter=jaxdecode.NgramDrafter(*jaxdecode.right_pad(PROMPTS[:3], width=8)),
          prompt_tokens=p)}
  for name, run in loops.items():
    for bad in (prompt_array(), prompt_array()[:3, :, None], prompt_array()[:3] * 0.5):
      with pytest.raises(ValueError, match=rf"{name}: prompt_tokens must be an integer array of "
                                           r"3 rows \(each row's prompt, padded with -1\)"):
        run(bad)


# ---------------------------------------------------------------------------------------------
# The entropy metric replays the loop: history, XTC's coin and mirostat's mu.

REPLAY_V, REPLAY_N = 8, 7
REPLAY_PROMPTS = [[1, 2, 3, 1, 2], [4, 4], [5, 2, 5, 2]]
REPLAY_PARAMS = SamplingParams(
    dry_multiplier=np.array([0.8, 0.0, 1.5], np.float32),
    dry_allowed_length=np.array([2, 2, 1], np.int32),
    no_repeat_ngram_size=np.array([3, 0, 0], np.int32),
    xtc_threshold=np.array([0.1, 0.1, 0.12], np.float32),
    xtc_probability=np.array([0.5, 0.0, 1.0], np.float32),
    mirostat=np.array([2, 2, 0], np.int32),
    mirostat_tau=np.array([2.0, 2.5, 5.0], np.float32),
    mirostat_eta=np.array([0.3, 0.5, 0.1], np.float32),
    bad_words=[None, None, [[2, 5]]])


@functools.partial(jax.jit, static_argnums=(1, 2))
def xtc_coins(key, batch, steps):
  """[B, N]: the uniform of fold_in(fold_in(fold_in(key, b), t), XTC_SALT), the key policy."""
  def coin(b, t):
    row_key = jax.random.fold_in(jax.random.fold_in(key, b), t)
    return jax.random.uniform(jax.random.fold_in(row_key, processors.XTC_SALT))
  return jax.vmap(lambda b: jax.vmap(lambda t: coin(b, t))(jnp.arange(steps)))(jnp.arange(batch))


def replay_reference(logits, params, prompts, key, rng, *, frozen_mu=False, prompt=True):
  """decode's steps in float64 from the published definitions (tests/reference.py), drawing
  each token from the kept distribution with `rng`: (tokens [B, N], entropies [B, N], the
  smallest distance of a kept-set decision to its cut). XTC's coin is the uniform of
  fold_in(fold_in(fold_in(key, row), t), XTC_SALT), the key policy written out."""
  host = jax.tree.map(np.asarray, params.broadcast(len(prompts), REPLAY_V))
  batch, steps, vocab = logits.shape
  coins = np.asarray(xtc_coins(key, batch, steps))
  tokens = np.zeros((batch, steps), np.int32)
  entropies = np.zeros((batch, steps))
  margin = np.inf
  for b in range(batch):
    mu = 2.0 * float(host.mirostat_tau[b])
    seen = list(prompts[b]) if prompt else []
    for t in range(steps):
      x = np.asarray(logits[b, t], np.float64)
      banned = ref.no_repeat_ngram_banned(seen, int(host.no_repeat_ngram_size[b]))
      banned |= ref.bad_words_banned(seen, [[int(v) for v in w if v >= 0]
                                            for w in host.bad_words[b] if w[0] >= 0])
      x[sorted(banned)] = -INF
      x = x - ref.dry_penalties(seen, vocab, float(host.dry_multiplier[b]),
                                float(host.dry_base[b]), int(host.dry_allowed_length[b]),
                                int(host.dry_penalty_last_n[b]), [])
      keep, _ = ref.xtc_keep(x, float(host.xtc_threshold[b]),
                             coins[b, t] < host.xtc_probability[b])
      probs = ref.softmax64(x)
      if float(host.xtc_probability[b]) > 0:
        margin = min(margin, np.min(np.abs(probs[x > -INF] - host.xtc_threshold[b])))
      x = np.where(keep, x, -INF)
      probs = ref.softmax64(x)
      if host.mirostat[b] == 2:
        with np.errstate(divide="ignore"):
          surprise = -np.log2(probs)
        margin = min(margin, np.min(np.abs(surprise[probs > 0] - mu)))
        probs = np.where((surprise <= mu) | (probs == probs.max()), probs, 0.0)
        probs = probs / probs.sum()
      entropies[b, t] = -sum(p * np.log(p) for p in probs if p > 0)
      token = int(rng.choice(vocab, p=probs))
      tokens[b, t] = token
      if host.mirostat[b] == 2 and not frozen_mu:
        mu -= float(host.mirostat_eta[b]) * (-np.log2(probs[token]) - float(host.mirostat_tau[b]))
      seen.append(token)
  return tokens, entropies, margin


@pytest.mark.slow  # compiling the replayed chain takes most of its 6-15 s
def test_step_entropies_replay_history_xtc_coin_and_mirostat_mu_against_a_reference():
  logits = np.random.default_rng(11).normal(size=(3, REPLAY_N, REPLAY_V)).astype(np.float32)
  key = jax.random.key(5)
  tokens, expected, margin = replay_reference(logits, REPLAY_PARAMS, REPLAY_PROMPTS, key,
                                              np.random.default_rng(12))
  assert margin > 1e-5  # no decision of this draw sits on a float32 rounding boundary
  prompt_tokens = np.full((3, 6), -1, np.int32)
  for b, p in enumerate(REPLAY_PROMPTS):
    prompt_tokens[b, 6 - len(p):] = p  # left-padded: decode takes padding at either end
  lengths = np.array([REPLAY_N, REPLAY_N, 4])
  got = metrics.step_entropies(jnp.asarray(logits), REPLAY_PARAMS, lengths, tokens=tokens,
                               prompt_tokens=prompt_tokens, key=key)
  want = np.where(np.arange(REPLAY_N) < lengths[:, None], expected, 0.0)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5)
  # Negative controls: the reference without mu's updates, or without the prompt, differs from
  # the one checked along the same tokens, so a metric that dropped either would fail above.
  for variant in (dict(frozen_mu=True), dict(prompt=False)):
    other_tokens, other, _ = replay_reference(logits, REPLAY_PARAMS, REPLAY_PROMPTS, key,
                                              np.random.default_rng(12), **variant)
    first = np.argmax(np.any(other_tokens != tokens, axis=0)) if np.any(
        other_tokens != tokens) else REPLAY_N
    assert np.max(np.abs(other[:, :first] - expected[:, :first])) > 1e-3, variant
  with pytest.raises(ValueError, match="pass tokens="):
    metrics.step_entropies(jnp.asarray(logits), REPLAY_PARAMS, lengths)
  with pytest.raises(ValueError, match="pass key="):
    metrics.step_entropies(jnp.asarray(logits), REPLAY_PARAMS, lengths, tokens=tokens)


@pytest.mark.slow
def test_step_entropies_replay_is_decode_bit_for_bit():
  """The replay's log-probability of each drawn token is bitwise decode's, every rule on (so
  its history, XTC coins and mu are decode's); step_entropies returns the replay's entropies
  (0 for the greedy rows)."""
  key = jax.random.key(9)
  out = run_decode(LOOP_PARAMS, key)
  tokens = np.asarray(out.tokens)
  previous = np.concatenate([[[p[-1]] for p in PROMPTS], tokens[:, :-1]], axis=1)
  logits = jnp.asarray(BIGRAM)[previous]  # [B, N, V]: the bigram model's logits at each step
  params = LOOP_PARAMS.broadcast(len(PROMPTS), VOCAB)
  start = jnp.zeros((len(PROMPTS), VOCAB), jnp.int32)
  row_keys = processors.row_keys(key, len(PROMPTS))
  prompt = jaxdecode.loop.right_aligned_prompt(prompt_array())
  h, logprobs = metrics._replay(logits, params, out.lengths, jnp.asarray(tokens), start, prompt,
                                row_keys)  # pylint: disable=protected-access
  np.testing.assert_array_equal(logprobs, out.logprobs)
  assert (np.asarray(out.lengths) == N).all()
  got = metrics.step_entropies(logits, LOOP_PARAMS, out.lengths, tokens=tokens,
                               prompt_tokens=prompt_array(), key=key)
  np.testing.assert_array_equal(got, h)
  assert np.all(np.asarray(h)[0] == 0) and np.all(np.asarray(h)[1:] >= 0)
  assert np.any(np.asarray(h) > 0.1)


# ---------------------------------------------------------------------------------------------
# Restructured computations give the bits of the plain ones.


def _old_top_n_sigma(x, n):
  """apply_top_n_sigma as first written (float count, max over the scaled row): the bits the
  restructured one must keep."""
  from jaxdecode import _reduce  # pylint: disable=import-outside-toplevel
  finite = x > -jnp.inf
  count = _reduce.row_sum(finite.astype(jnp.float32), keepdims=True)
  largest = jnp.max(jnp.where(finite, jnp.abs(x), 0.0), axis=-1, keepdims=True)
  _, e = jnp.frexp(largest)
  e = jnp.maximum(e, 0)
  half = e // 2
  scale_a = jax.lax.bitcast_convert_type((127 - half) << 23, jnp.float32)
  scale_b = jax.lax.bitcast_convert_type((127 - (e - half)) << 23, jnp.float32)
  y = jnp.where(finite, (x * scale_a) * scale_b, 0.0)
  safe_count = jnp.maximum(count, 1.0)
  mean = _reduce.row_sum(y, keepdims=True) / safe_count
  var = _reduce.row_sum(jnp.where(finite, jnp.square(y - mean), 0.0), keepdims=True) / safe_count
  top = jnp.max(jnp.where(finite, y, -jnp.inf), axis=-1, keepdims=True)
  cutoff = top - n[:, None] * jnp.sqrt(var)
  return jnp.where((n > 0)[:, None] & finite & (y < cutoff), -jnp.inf, x)


def _old_temperature(x, t):
  """apply_temperature as first written (the shift computed whenever a row has t < 1)."""
  greedy_rows = (t == 0)[:, None]
  t_safe = jnp.where(greedy_rows, 1.0, t[:, None])
  scaled = jnp.where(x == -jnp.inf, -jnp.inf, x / t_safe)
  overflow = jnp.any(jnp.isinf(scaled) & (x > -jnp.inf), axis=-1, keepdims=True)
  m = jnp.max(x, axis=-1, keepdims=True)
  shifted = jnp.where(x == -jnp.inf, -jnp.inf, (x - m) / t_safe)
  scaled = jnp.where(overflow, shifted, scaled)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  one_hot = jnp.where(iota == processors.first_argmax(x)[:, None], x, -jnp.inf)
  return jnp.where(greedy_rows, one_hot, scaled)


@pytest.mark.parametrize("mode", ["branches", "straight"])
@pytest.mark.slow
def test_restructured_top_n_sigma_temperature_and_runs_keep_their_bits(mode):
  from jaxdecode import _platform  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(31)
  rows = np.concatenate([hygiene_rows(), rng.normal(size=(6, 6)).astype(np.float32) * 1e3,
                         rng.standard_cauchy(size=(4, 6)).astype(np.float32)])
  x = jnp.asarray(rows)
  n = jnp.asarray(rng.choice([0.0, 0.5, 1.0, 2.0], len(rows)), jnp.float32)
  t = jnp.asarray(rng.choice([0.0, 1e-38, 0.3, 1.0, 2.0], len(rows)), jnp.float32)
  history = np.tile([0, 1, 2, 0, 1, 1], (5, 4)) ^ (rng.random((5, 24)) < 0.1)  # repeats
  history[1, :5] = -1  # padding at the start
  history = jnp.asarray(history, jnp.int32)
  start = jnp.asarray([0, 3, 10, 23, 24], jnp.int32)
  with _platform.forced(mode):
    sigma = jax.jit(processors.apply_top_n_sigma)(x, n)
    temp = jax.jit(processors.apply_temperature)(x, t)
    runs = jax.jit(lambda h, s: processors.window_runs(processors.history_runs(h), s))(
        history, start)
    direct = jax.jit(processors.suffix_runs)(history, start)
  np.testing.assert_array_equal(sigma, jax.jit(_old_top_n_sigma)(x, n))
  np.testing.assert_array_equal(temp, jax.jit(_old_temperature)(x, t))
  np.testing.assert_array_equal(runs, direct)
  assert np.any(np.isinf(np.asarray(sigma)) & np.isfinite(rows))  # top-nσ cut something
  assert np.asarray(direct).max() >= 3  # some runs, and bounded ones, were compared


def hygiene_rows():
  return np.stack([hygiene(r) for r in ROWS]).astype(np.float32)
