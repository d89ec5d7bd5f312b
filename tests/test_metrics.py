"""Degeneration metrics against values worked out by hand (and one brute-force reference)."""

import doctest
import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode import SamplingParams, metrics
from jaxdecode.models import (ByteTokenizer, Transformer, TransformerConfig, make_step_fn,
                              prefill, teacher_forced_logits)

NAN = float("nan")
LN2 = math.log(2)

# Row 0 is 1 2 3 1 2; row 1 is 1 2 4 (its two trailing zeros are padding, past its length).
TOKENS = np.array([[1, 2, 3, 1, 2], [1, 2, 4, 0, 0]])
LENGTHS = np.array([5, 3])


def assert_same(actual, expected):
  """Equal up to float rounding, with NaN equal to NaN."""
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.slow
def test_docstring_examples():
  result = doctest.testmod(metrics, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------------------------
# distinct-n


@pytest.mark.parametrize("n,over_set,per_row", [
    # unigrams 1 2 3 1 2 | 1 2 4: union {1, 2, 3, 4} over 8; rows 3/5 and 3/3
    (1, 4 / 8, [3 / 5, 1.0]),
    # bigrams 12 23 31 12 | 12 24: union {12, 23, 31, 24} over 6; rows 3/4 and 2/2
    (2, 4 / 6, [3 / 4, 1.0]),
    # trigrams 123 231 312 | 124: all distinct
    (3, 4 / 4, [1.0, 1.0]),
    # 4-grams 1231 2312 | none (row 1 is shorter than 4)
    (4, 2 / 2, [1.0, NAN]),
])
def test_distinct_n_over_the_set_and_per_sequence(n, over_set, per_row):
  assert_same(metrics.distinct_n(TOKENS, LENGTHS, n), over_set)
  assert_same(metrics.distinct_n(TOKENS, LENGTHS, n, per_sequence=True), per_row)


def test_distinct_n_counts_an_ngram_shared_by_two_rows_once_over_the_set():
  tokens = [[1, 2], [1, 2]]
  assert metrics.distinct_n(tokens, [2, 2], 2) == 0.5  # one distinct bigram, two occurrences
  assert_same(metrics.distinct_n(tokens, [2, 2], 2, per_sequence=True), [1.0, 1.0])


def test_distinct_n_ignores_tokens_after_the_length():
  # With the padding counted, row 1 would add the unigram 0 and the bigram 4 0.
  assert_same(metrics.distinct_n(TOKENS, LENGTHS, 1), 0.5)
  assert_same(metrics.distinct_n(TOKENS, [5, 5], 1), 5 / 10)  # {0, 1, 2, 3, 4} over 10


def test_all_identical_tokens():
  tokens, lengths = [[5, 5, 5, 5, 5, 5]], [6]
  for n, distinct in [(1, 1 / 6), (2, 1 / 5), (3, 1 / 4), (4, 1 / 3)]:
    assert_same(metrics.distinct_n(tokens, lengths, n), distinct)
    assert_same(metrics.repetition_rate(tokens, lengths, n), 1 - distinct)
  assert metrics.longest_repeated_span(tokens, lengths).tolist() == [5]  # 5 5 5 5 5 at 0 and 1
  assert metrics.longest_repeated_span(tokens, lengths, overlapping=False).tolist() == [3]


def test_sequence_shorter_than_n_has_no_ngrams():
  total, distinct = metrics.ngram_counts([[3, 4, 0]], [2], 3)
  assert total.tolist() == [0] and distinct.tolist() == [0]
  assert math.isnan(metrics.distinct_n([[3, 4, 0]], [2], 3))
  assert math.isnan(metrics.repetition_rate([[3, 4, 0]], [2], 3))
  # Beside a longer row, it adds nothing to the pooled counts.
  assert metrics.distinct_n([[3, 4, 0], [1, 1, 1]], [2, 3], 3) == 1.0


def test_empty_after_length_masking():
  tokens, lengths = [[7, 7, 7], [8, 8, 8]], [0, 0]
  for n in range(1, 5):
    assert math.isnan(metrics.distinct_n(tokens, lengths, n))
    assert_same(metrics.distinct_n(tokens, lengths, n, per_sequence=True), [NAN, NAN])
    assert math.isnan(metrics.repetition_rate(tokens, lengths, n))
  assert metrics.longest_repeated_span(tokens, lengths).tolist() == [0, 0]
  # A batch with no rows at all.
  assert math.isnan(metrics.distinct_n(np.zeros((0, 4), np.int32), np.zeros(0, np.int32), 2))


# ---------------------------------------------------------------------------------------------
# repetition


def test_repetition_rate_counts_ngrams_seen_earlier_in_the_same_row():
  # Unigrams: row 0 repeats 1 and 2 (2 of 5), row 1 nothing (0 of 3).
  assert_same(metrics.repetition_rate(TOKENS, LENGTHS, 1), 2 / 8)
  assert_same(metrics.repetition_rate(TOKENS, LENGTHS, 1, per_sequence=True), [2 / 5, 0.0])
  # Bigrams: row 0 repeats 12 (1 of 4), row 1 nothing (0 of 2).
  assert_same(metrics.repetition_rate(TOKENS, LENGTHS, 2), 1 / 6)
  assert_same(metrics.repetition_rate(TOKENS, LENGTHS, 2, per_sequence=True), [1 / 4, 0.0])
  # Overlapping occurrences count: in 7 7 7 7 8 the bigrams at 1 and 2 repeat the one at 0.
  assert_same(metrics.repetition_rate([[7, 7, 7, 7, 8]], [5], 2), 2 / 4)


def test_repetition_across_rows_is_not_repetition():
  assert metrics.repetition_rate([[1, 2], [1, 2]], [2, 2], 2) == 0.0


@pytest.mark.parametrize("row,length,overlapping,expected", [
    ([1, 2, 3, 1, 2], 5, True, 2),        # 1 2 at 0 and 3
    ([1, 2, 4, 0, 0], 3, True, 0),        # nothing repeats in 1 2 4
    ([7, 8, 9, 0, 7, 8, 9], 7, True, 3),  # 7 8 9 at 0 and 4
    ([1, 2, 1, 2, 1], 5, True, 3),        # 1 2 1 at 0 and 2 (they share the middle 1)
    ([1, 2, 1, 2, 1], 5, False, 2),       # disjoint: 1 2 at 0 and 2
    ([1, 2, 1, 2], 3, True, 1),           # the row is 1 2 1: only "1" repeats
    ([6], 1, True, 0),
])
def test_longest_repeated_span(row, length, overlapping, expected):
  got = metrics.longest_repeated_span([row], [length], overlapping=overlapping)
  assert got.tolist() == [expected]


def _brute_force_span(row, overlapping):
  """The longest substring found at two start positions, by checking every pair and length."""
  best = 0
  for i, j in itertools.combinations(range(len(row)), 2):
    for m in range(1, len(row) - j + 1):
      if row[i:i + m] == row[j:j + m] and (overlapping or i + m <= j):
        best = max(best, m)
  return best


def test_longest_repeated_span_matches_a_brute_force_search():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 3, size=(40, 12))
  lengths = rng.integers(0, 13, size=40)
  for overlapping in (True, False):
    got = metrics.longest_repeated_span(tokens, lengths, overlapping=overlapping)
    expected = [_brute_force_span(row[:n].tolist(), overlapping)
                for row, n in zip(tokens, lengths)]
    assert got.tolist() == expected


@pytest.mark.parametrize("call,fragment", [
    (lambda: metrics.distinct_n([1, 2, 3], [3], 1), "tokens must be an integer array [B, N]"),
    (lambda: metrics.distinct_n([[1.5, 2.0]], [2], 1), "tokens must be an integer array"),
    (lambda: metrics.distinct_n([[1, 2]], [2, 2], 1),
     "lengths must be an integer array of shape (1,)"),
    (lambda: metrics.distinct_n([[1, 2]], [3], 1), "lengths must be in [0, N = 2]; got [3]"),
    (lambda: metrics.distinct_n([[1, 2]], [-1], 1), "lengths must be in [0, N = 2]; got [-1]"),
    (lambda: metrics.distinct_n([[1, 2]], [2], 0), "n must be an integer >= 1; got 0"),
    (lambda: metrics.distinct_n([[1, 2]], [2], 2.0), "n must be an integer >= 1; got 2.0"),
    (lambda: metrics.repetition_rate([[1, 2]], [2], 1, per_sequence=1),
     "per_sequence must be True or False; got 1"),
    (lambda: metrics.longest_repeated_span([[1, 2]], [2], overlapping="no"),
     "overlapping must be True or False"),
])
def test_ngram_metrics_reject_bad_input(call, fragment):
  with pytest.raises(ValueError) as info:
    call()
  assert fragment in str(info.value)


# ---------------------------------------------------------------------------------------------
# log-likelihood under the raw model distribution


def _logits(probabilities):
  """Logits with the given softmax, shifted by a constant (the softmax must not care)."""
  return jnp.log(jnp.array(probabilities, jnp.float32)) + 7.0


# Row 0: token 0 at p = 0.5, then token 2 at p = 0.5. Row 1 (length 1): token 2 at p = 0.8; its
# second step is padding (token 1 at p = 0.001 would pull every mean down if it counted).
LL_LOGITS = _logits([[[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]],
                     [[0.1, 0.1, 0.8], [0.998, 0.001, 0.001]]])  # [2, 2, 3]
LL_TOKENS = jnp.array([[0, 2], [2, 1]])
LL_LENGTHS = jnp.array([2, 1])


def test_token_log_likelihoods_read_the_raw_distribution_and_mask_padding():
  got = metrics.token_log_likelihoods(LL_LOGITS, LL_TOKENS, LL_LENGTHS)
  assert got.dtype == jnp.float32 and got.shape == (2, 2)
  assert_same(got, [[math.log(0.5), math.log(0.5)], [math.log(0.8), 0.0]])


def test_mean_log_likelihood_over_the_set_and_per_sequence():
  # Over the set: (ln 0.5 + ln 0.5 + ln 0.8) / 3 valid tokens.
  assert_same(metrics.mean_log_likelihood(LL_LOGITS, LL_TOKENS, LL_LENGTHS),
              (2 * math.log(0.5) + math.log(0.8)) / 3)
  assert_same(metrics.mean_log_likelihood(LL_LOGITS, LL_TOKENS, LL_LENGTHS, per_sequence=True),
              [math.log(0.5), math.log(0.8)])
  assert math.isnan(metrics.mean_log_likelihood(LL_LOGITS, LL_TOKENS, jnp.array([0, 0])))


def test_log_likelihood_of_a_token_the_model_excludes_is_minus_inf():
  logits = jnp.array([[[0.0, -jnp.inf]]])
  assert metrics.mean_log_likelihood(logits, jnp.array([[1]]), jnp.array([1])) == -math.inf


@pytest.mark.parametrize("call,fragment", [
    (lambda: metrics.token_log_likelihoods(jnp.zeros((2, 3)), jnp.zeros((2, 3), jnp.int32),
                                           jnp.array([1, 1])),
     "logits must be a floating array [B, N, V]"),
    (lambda: metrics.token_log_likelihoods(LL_LOGITS, jnp.array([[0, 3], [0, 0]]), LL_LENGTHS),
     "tokens must be ids in [0, 3)"),
    (lambda: metrics.token_log_likelihoods(LL_LOGITS, jnp.array([[0, 1]]), LL_LENGTHS),
     "tokens must have shape (2, 2)"),
    (lambda: metrics.mean_log_likelihood(LL_LOGITS, LL_TOKENS, jnp.array([3, 1])),
     "lengths must be in [0, N = 2]; got [3, 1]"),
])
def test_model_metrics_reject_bad_input(call, fragment):
  with pytest.raises(ValueError) as info:
    call()
  assert fragment in str(info.value)


# ---------------------------------------------------------------------------------------------
# entropy of the processed distribution


# The entropy tests share the processed shape [2, 3] (B * N rows, V), so process_logits
# compiles once for them.
TWO_STEPS = _logits([[[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]])  # [1, 2, 3]
H_625_375 = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))  # two tokens at 5:3


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(), -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))),
    (SamplingParams(temperature=0.0), 0.0),           # greedy: a point mass
    (SamplingParams(top_k=1), 0.0),
    (SamplingParams(top_k=2), H_625_375),             # 0.5 and 0.3, renormalized to 5:3
    (SamplingParams(min_p=0.5), H_625_375),           # keeps p >= 0.25: 0.5 and 0.3
    (SamplingParams(top_p=0.5), 0.0),                 # 0.5 alone reaches 0.5
    (SamplingParams(top_p=0.8), H_625_375),           # 0.5 + 0.3 reaches 0.8
])
def test_entropy_is_that_of_the_processed_distribution(params, expected):
  got = metrics.step_entropies(TWO_STEPS, params, jnp.array([2]))
  assert_same(got, [[expected, expected]])


def test_entropy_with_temperature():
  logits = jnp.array([[[math.log(4.0), 0.0, -jnp.inf]] * 2])  # p = 0.8, 0.2, 0
  # Temperature 2 halves the logits: ln 2 and 0, so p = 2/3, 1/3: H = ln 3 - (2/3) ln 2.
  got = metrics.step_entropies(logits, SamplingParams(temperature=2.0), jnp.array([2]))
  assert_same(got, [[math.log(3) - 2 / 3 * LN2] * 2])


@pytest.mark.slow
def test_mean_entropy_per_row_params_minus_inf_and_masking():
  # Row 0 (T = 1): step 0 is 0.5 / 0.25 / 0.25 (H = 1.5 ln 2); step 1 is 0 / 0 / -inf, uniform
  # over two tokens (H = ln 2: the -inf entry contributes 0). Row 1 (T = 0, length 1): H = 0;
  # its masked second step would add ln 3 if it counted.
  logits = jnp.array([[[math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 0.0, -jnp.inf]],
                      [[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]])
  params = SamplingParams(temperature=jnp.array([1.0, 0.0]))
  lengths = jnp.array([2, 1])
  assert_same(metrics.step_entropies(logits, params, lengths), [[1.5 * LN2, LN2], [0.0, 0.0]])
  assert_same(metrics.mean_entropy(logits, params, lengths), (1.5 * LN2 + LN2 + 0.0) / 3)
  assert_same(metrics.mean_entropy(logits, params, lengths, per_sequence=True),
              [1.25 * LN2, 0.0])
  assert math.isnan(metrics.mean_entropy(logits, params, jnp.array([0, 0])))


@pytest.mark.slow
def test_entropy_with_a_penalty_uses_the_counts_of_the_earlier_steps():
  logits = jnp.zeros((1, 3, 2))  # uniform over two tokens at every step
  tokens = jnp.array([[0, 0, 1]])
  params = SamplingParams(frequency_penalty=math.log(3))  # logit - ln 3 per earlier occurrence
  # Step 0 has seen nothing: H = ln 2. Step 1 has seen token 0 once: p = 1/4, 3/4. Step 2 twice:
  # p = 1/10, 9/10.
  expected = [LN2, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)),
              -(0.1 * math.log(0.1) + 0.9 * math.log(0.9))]
  assert_same(metrics.step_entropies(logits, params, jnp.array([3]), tokens=tokens), [expected])
  # Counts to start from (e.g. the prompt's): token 1 seen once before step 0.
  start = jnp.array([[0, 1]])
  assert_same(metrics.step_entropies(logits, params, jnp.array([1]), tokens=tokens,
                                     counts=start)[0, 0],
              -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
  with pytest.raises(ValueError, match="pass tokens=.B, N., the generated tokens"):
    metrics.step_entropies(logits, params, jnp.array([3]))
  with pytest.raises(ValueError, match="min_new_tokens=2 is not supported by step_entropies"):
    metrics.step_entropies(logits, SamplingParams(min_new_tokens=2), jnp.array([3]))


def test_masked_mean():
  values = [[1.0, 3.0, 99.0], [5.0, 99.0, 99.0], [99.0, 99.0, 99.0]]
  assert metrics.masked_mean(values, [2, 1, 0]) == 3.0  # (1 + 3 + 5) / 3
  assert_same(metrics.masked_mean(values, [2, 1, 0], per_sequence=True), [2.0, 5.0, NAN])
  with pytest.raises(ValueError, match="values must be an array .B, N.; got shape .3,."):
    metrics.masked_mean([1.0, 2.0, 3.0], [1])


def test_entropy_of_a_step_with_nothing_selectable_is_nan():
  logits = jnp.full((1, 2, 3), -jnp.inf)
  got = metrics.step_entropies(logits, SamplingParams(), jnp.array([2]))
  assert math.isnan(float(got[0, 0])) and math.isnan(float(got[0, 1]))


def test_entropy_rejects_bad_params():
  with pytest.raises(ValueError, match="params must be a jaxdecode.SamplingParams"):
    metrics.step_entropies(TWO_STEPS, {"temperature": 1.0}, jnp.array([2]))
  with pytest.raises(ValueError, match="temperature has shape"):
    metrics.step_entropies(TWO_STEPS, SamplingParams(temperature=jnp.array([1.0, 0.5])),
                           jnp.array([2]))


# ---------------------------------------------------------------------------------------------
# teacher forcing through the model


@pytest.mark.slow
def test_teacher_forced_logits_are_the_logits_of_the_cached_decode_steps():
  """One forward pass over prompt + new tokens gives, at step t, the logits that the prefill
  (t = 0) and the KV-cache step function (t > 0) give when fed the same tokens one by one."""
  tok = ByteTokenizer()
  model = Transformer(TransformerConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=32),
                      rngs=nnx.Rngs(1))
  graphdef, weights = nnx.split(model)
  prompts, steps = ["def f(x):", "ab"], 6
  tokens, lengths = jaxdecode.right_pad([tok.encode(p) for p in prompts], pad_id=tok.PAD,
                                        buckets=None)
  new = jnp.array([[104, 105, 257, 258, 258, 258], [32, 120, 121, 122, 40, 41]])  # [2, 6]
  logits = teacher_forced_logits(model, tokens, lengths, new)
  assert logits.shape == (2, steps, tok.vocab_size)
  step_logits, state = prefill(graphdef, weights, tokens, lengths,
                               cache_length=tokens.shape[1] + steps)
  step_fn = make_step_fn(graphdef)
  for t in range(steps):
    np.testing.assert_array_equal(logits[:, t], step_logits)  # the same bits
    step_logits, state = step_fn(state, new[:, t], lengths + t)
  # Row 0 ends with EOS at step 2: its padding after that changes none of its valid logits.
  other = teacher_forced_logits(model, tokens, lengths, new.at[0, 3:].set(7))
  np.testing.assert_allclose(other[0, :3], logits[0, :3], atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="new_tokens must have shape .2, N."):
    teacher_forced_logits(model, tokens, lengths, new[:1])
