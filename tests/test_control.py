"""Penalties, logit bias, token sets, min_new_tokens, typical-p, epsilon and eta.

Expected values are hand-computed (written out below) or come from tests/reference.py: the
float64 definitions and line-by-line numpy ports of transformers' sort-based warpers.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxdecode
from jaxdecode import SamplingParams, decoding, processors, prompts
import reference as ref
import toy_model

N_DRAWS = 100_000


def kept(x):
  return np.isfinite(np.asarray(x)).tolist()


# ---------------------------------------------------------------------------------------------
# Penalties.


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
  x = jnp.array([[2.0, -1.0, 0.5, 3.0, -jnp.inf]])
  counts = jnp.array([[1, 2, 0, 0, 4]])  # tokens 0, 1 and the -inf token 4 were seen
  out = jaxdecode.process_logits(x, SamplingParams(repetition_penalty=2.0), counts=counts)
  # 2 / 2 = 1; -1 * 2 = -2; unseen 0.5 and 3 unchanged; -inf stays -inf.
  assert np.asarray(out).tolist() == [[1.0, -2.0, 0.5, 3.0, -np.inf]]


def test_presence_and_frequency_penalties_subtract_once_and_per_count():
  x = jnp.array([[2.0, -1.0, 0.5, 3.0]])
  counts = jnp.array([[1, 2, 0, 3]])
  params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
  out = jaxdecode.process_logits(x, params, counts=counts)
  # token 0: 2/2 - 0.25*1 - 0.5 = 0.25; token 1: -1*2 - 0.25*2 - 0.5 = -3;
  # token 2: unseen, 0.5; token 3: 3/2 - 0.25*3 - 0.5 = 0.25.
  np.testing.assert_allclose(out, [[0.25, -3.0, 0.5, 0.25]], rtol=1e-6)
  # Negative penalties encourage seen tokens.
  out = jaxdecode.process_logits(x, SamplingParams(presence_penalty=-1.0), counts=counts)
  np.testing.assert_allclose(out, [[3.0, 0.0, 0.5, 4.0]])


def test_penalties_match_the_peers_formulas_on_random_rows():
  rng = np.random.default_rng(0)
  batch, vocab = 6, 40
  x = rng.normal(size=(batch, vocab)).astype(np.float32) * 3
  history = [rng.integers(0, vocab, size=rng.integers(0, 30)) for _ in range(batch)]
  counts = np.stack([np.bincount(h, minlength=vocab) for h in history])
  rep = rng.uniform(0.5, 2.0, batch).astype(np.float32)
  pres = rng.uniform(-1, 1, batch).astype(np.float32)
  freq = rng.uniform(-1, 1, batch).astype(np.float32)
  out = np.asarray(jaxdecode.process_logits(
      jnp.asarray(x), SamplingParams(repetition_penalty=rep, presence_penalty=pres,
                                     frequency_penalty=freq), counts=jnp.asarray(counts)))
  # HF's repetition penalty (gather the history's ids, rescale, scatter), then OpenAI's
  # mu[j] - c[j] * frequency - (c[j] > 0) * presence.
  for b in range(batch):
    hf = ref.hf_repetition_penalty(x[b:b + 1], [history[b]], float(rep[b]))[0]
    expected = hf - counts[b] * freq[b] - (counts[b] > 0) * pres[b]
    np.testing.assert_allclose(out[b], expected, rtol=1e-5, atol=1e-5)


def test_token_counts_counts_masked_tokens_and_skips_out_of_range_ids():
  tokens = jnp.array([[7, 7, 1, 2], [3, 3, 3, 9]])
  mask = jnp.array([[False, True, True, True], [True, True, True, True]])
  counts = jaxdecode.token_counts(tokens, 8, mask=mask)
  assert counts.tolist() == [[0, 1, 1, 0, 0, 0, 0, 1], [0, 0, 0, 3, 0, 0, 0, 0]]  # 9 >= V
  assert counts.dtype == jnp.int32


# ---------------------------------------------------------------------------------------------
# Bias and token sets.


@pytest.mark.slow
def test_logit_bias_per_row_dicts_and_duplicate_ids_in_the_array_form_add_up():
  x = jnp.zeros((2, 5))
  out = jaxdecode.process_logits(x, SamplingParams(logit_bias=[{1: 2.0, 3: -1.5}, None]))
  assert np.asarray(out).tolist() == [[0, 2.0, 0, -1.5, 0], [0] * 5]
  ids = jnp.array([4, 4, -1, 0])
  out = jaxdecode.process_logits(x, SamplingParams(logit_bias=(ids, jnp.array([1., 2., 9., 3.]))))
  assert np.asarray(out).tolist() == [[3.0, 0, 0, 0, 3.0]] * 2  # 1 + 2 on token 4; -1 pads
  # A huge bias saturates at the float32 range instead of overflowing to +inf.
  big = jaxdecode.process_logits(jnp.full((1, 2), 3e38), SamplingParams(logit_bias={0: 3e38}))
  assert np.isfinite(np.asarray(big)).all()


@pytest.mark.slow
def test_banned_and_allowed_token_sets_per_row():
  x = jnp.zeros((3, 6))
  params = SamplingParams(banned_token_ids=[[0], [], [2, 5]],
                          allowed_token_ids=[[1, 2, 3], [], [2, 3]])
  assert kept(jaxdecode.process_logits(x, params)) == [
      [False, True, True, True, False, False],  # allowed {1, 2, 3}, 0 banned anyway
      [True] * 6,  # no ids: unrestricted
      [False, False, False, True, False, False]]  # allowed {2, 3} minus banned 2
  tokens = jaxdecode.sample(jax.random.key(0), jnp.zeros((2000, 6)),
                            SamplingParams(allowed_token_ids=[4, 1]))
  assert set(np.unique(tokens).tolist()) == {1, 4}


def test_temperature_zero_takes_the_argmax_after_bans_bias_and_penalties():
  x = jnp.array([[5.0, 4.0, 3.0, 2.0]] * 4)
  params = SamplingParams(temperature=0.0,
                          banned_token_ids=[[0], [], [], []],
                          logit_bias=[None, {3: 10.0}, None, None],
                          repetition_penalty=[1.0, 1.0, 4.0, 1.0])
  counts = jnp.zeros((4, 4), jnp.int32).at[2, 0].set(1).at[2, 1].set(1)  # row 2 saw 0 and 1
  tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(0), x, params, counts=counts)
  # row 0: 0 banned -> 1; row 1: 2 + 10 -> 3; row 2: 5/4, 4/4 < 3 -> 2; row 3: plain argmax.
  assert tokens.tolist() == [1, 3, 2, 0]
  assert np.asarray(logprobs).tolist() == [0.0] * 4


# ---------------------------------------------------------------------------------------------
# typical-p, epsilon, eta: hand examples, the float64 definitions and HF's sort-based warpers.


def test_typical_p_keeps_the_most_typical_tokens_hand_example():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))
  # H = 1.0297 nats; |-log p - H| = 0.3365, 0.1743, 0.5798: order of typicality 1, 0, 2.
  # Mass strictly more typical: token 1: 0; token 0: 0.3; token 2: 0.8.
  assert kept(processors.typical_p(logits, 0.25)) == [[False, True, False]]
  assert kept(processors.typical_p(logits, 0.5)) == [[True, True, False]]
  assert kept(processors.typical_p(logits, 0.85)) == [[True, True, True]]
  assert kept(processors.typical_p(logits, 1.0)) == [[True, True, True]]


def test_epsilon_and_eta_cutoffs_hand_examples():
  peaked = [0.9, 0.07, 0.03]
  flat = [0.3, 0.25, 0.25, 0.2]
  assert kept(processors.epsilon_cutoff(jnp.log(jnp.array([peaked])), 0.05)) == \
      [[True, True, False]]
  assert kept(processors.epsilon_cutoff(jnp.log(jnp.array([peaked])), 0.95)) == \
      [[True, False, False]]  # the most probable token always stays
  # eta: threshold min(eta, sqrt(eta) exp(-H)).
  h_peaked = -sum(p * math.log(p) for p in peaked)  # 0.3861: exp(-H) = 0.680
  h_flat = -sum(p * math.log(p) for p in flat)  # 1.3763: exp(-H) = 0.2525
  assert min(0.05, math.sqrt(0.05) * math.exp(-h_peaked)) == 0.05  # cut at 0.05
  assert kept(processors.eta_cutoff(jnp.log(jnp.array([peaked])), 0.05)) == [[True, True, False]]
  assert 0.2 < math.sqrt(0.7) * math.exp(-h_flat) < 0.25  # 0.211: an uncertain step cuts lower
  assert kept(processors.eta_cutoff(jnp.log(jnp.array([flat])), 0.7)) == \
      [[True, True, True, False]]


@pytest.mark.parametrize("vocab", [2, 17, 300])
@pytest.mark.slow
def test_typical_epsilon_eta_match_the_float64_definitions(vocab):
  rng = np.random.default_rng(vocab)
  x = (rng.normal(size=(12, vocab)) * rng.uniform(0.5, 4, (12, 1))).astype(np.float32)
  x[rng.random(x.shape) < 0.1] = -np.inf
  x[:, 0] = 0.0
  x[3] = np.round(x[3])  # exact ties
  for typical, eps, eta in [(0.2, 0, 0), (0.9, 0, 0), (1.0, 0.01, 0), (1.0, 0, 0.004),
                            (0.95, 0.001, 0.0008), (0.5, 0.2, 0.3)]:
    params = SamplingParams(typical_p=typical, epsilon_cutoff=eps, eta_cutoff=eta)
    out = np.asarray(jaxdecode.process_logits(jnp.asarray(x), params))
    for row, out_row in zip(x, out):
      expected, amb = ref.process_row_full(row, typical_p=typical, epsilon=eps, eta=eta)
      np.testing.assert_array_equal(np.isfinite(out_row)[~amb], np.isfinite(expected)[~amb])
      assert np.isfinite(out_row).any()


def test_typical_epsilon_eta_agree_with_transformers_sort_based_warpers():
  rng = np.random.default_rng(7)
  x = (rng.normal(size=(32, 200)) * rng.uniform(0.5, 5, (32, 1))).astype(np.float32)
  for mass in (0.2, 0.6, 0.95):
    out = processors.typical_p(jnp.asarray(x), mass)
    np.testing.assert_array_equal(~np.isfinite(np.asarray(out)), ref.hf_typical_removed(x, mass))
  for eps in (3e-4, 1e-2):
    out = processors.epsilon_cutoff(jnp.asarray(x), eps)
    np.testing.assert_array_equal(~np.isfinite(np.asarray(out)), ref.hf_epsilon_removed(x, eps))
  for eta in (3e-4, 2e-2):
    out = processors.eta_cutoff(jnp.asarray(x), eta)
    np.testing.assert_array_equal(~np.isfinite(np.asarray(out)), ref.hf_eta_removed(x, eta))


def test_agrees_with_transformers_pytorch_processors_when_installed():
  torch = pytest.importorskip("torch")
  lp = pytest.importorskip("transformers.generation.logits_process")
  rng = np.random.default_rng(11)
  x = (rng.normal(size=(16, 120)) * 3).astype(np.float32)
  ids = rng.integers(0, 120, size=(16, 25))
  scores, input_ids = torch.tensor(x), torch.tensor(ids)
  counts = jnp.asarray(np.stack([np.bincount(r, minlength=120) for r in ids]))
  ours = jaxdecode.process_logits(jnp.asarray(x), SamplingParams(repetition_penalty=1.3),
                                  counts=counts)
  theirs = lp.RepetitionPenaltyLogitsProcessor(1.3)(input_ids, scores.clone())
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
  for field, warper in [("typical_p", lp.TypicalLogitsWarper(0.7)),
                        ("epsilon_cutoff", lp.EpsilonLogitsWarper(3e-3)),
                        ("eta_cutoff", lp.EtaLogitsWarper(3e-3))]:
    value = {"typical_p": 0.7}.get(field, 3e-3)
    ours = jaxdecode.process_logits(jnp.asarray(x), SamplingParams(**{field: value}))
    theirs = warper(input_ids, scores.clone())
    np.testing.assert_array_equal(np.isfinite(np.asarray(ours)),
                                  np.isfinite(theirs.numpy()), err_msg=field)


@pytest.mark.parametrize("settings", [
    dict(typical_p=0.8),
    dict(typical_p=0.5, temperature=1.4),
    dict(epsilon_cutoff=0.05),
    dict(eta_cutoff=0.02),
    dict(top_k=8, typical_p=0.9, epsilon_cutoff=0.01, eta_cutoff=0.01),
], ids=repr)
@pytest.mark.slow
def test_sampled_frequencies_match_the_new_truncations(settings):
  """Chi-square over 100k draws against the float64 reference's filtered distribution."""
  logits = np.array([2.0, 1.2, 1.2, 0.5, 0.0, -0.4, -1.0, -np.inf, -2.5, 0.9, -3.0, 1.5],
                    np.float32)
  p = SamplingParams(**settings)
  expected_logits, amb = ref.process_row_full(
      logits, float(p.temperature), int(p.top_k), float(p.top_p), float(p.min_p),
      float(p.typical_p), float(p.epsilon_cutoff), float(p.eta_cutoff))
  assert not amb.any()
  expected = ref.softmax64(expected_logits)
  assert 1 < (expected > 0).sum() < 11  # each setting really cuts, and keeps a choice
  batch = jnp.broadcast_to(jnp.asarray(logits), (N_DRAWS, logits.size))
  tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(99), batch, p)
  counts = np.bincount(np.asarray(tokens), minlength=logits.size)
  assert counts[expected == 0].sum() == 0, "a removed token was sampled"
  result = stats.chisquare(counts[expected > 0], N_DRAWS * expected[expected > 0])
  assert result.pvalue > 1e-3, (counts, N_DRAWS * expected)
  np.testing.assert_allclose(np.asarray(logprobs), np.log(expected[np.asarray(tokens)]),
                             atol=2e-6)


@pytest.mark.slow
def test_sampled_frequencies_match_with_penalties_bias_and_bans():
  logits = np.array([2.0, 1.2, 0.5, 0.0, -0.4, 1.5], np.float32)
  counts = np.array([2, 0, 1, 0, 0, 1])
  p = SamplingParams(repetition_penalty=1.5, presence_penalty=0.2, frequency_penalty=0.1,
                     logit_bias={3: 1.0}, banned_token_ids=[4])
  shifted = ref.penalize(logits, counts, 1.5, 0.2, 0.1)
  shifted[3] += 1.0
  shifted[4] = -np.inf
  expected = ref.softmax64(shifted)
  batch = jnp.broadcast_to(jnp.asarray(logits), (N_DRAWS, logits.size))
  tokens = jaxdecode.sample(jax.random.key(5), batch, p,
                            counts=jnp.broadcast_to(jnp.asarray(counts), batch.shape))
  observed = np.bincount(np.asarray(tokens), minlength=logits.size)
  assert observed[4] == 0
  keep = expected > 0
  assert stats.chisquare(observed[keep], N_DRAWS * expected[keep]).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------
# No retrace, sanitization under jit.


def random_control_params(rng, batch, vocab):
  ids = lambda n: [rng.choice(vocab, n, replace=False).tolist() for _ in range(batch)]
  return SamplingParams(
      temperature=rng.uniform(0, 2, batch), top_k=rng.integers(0, 9, batch),
      top_p=rng.uniform(0.1, 1, batch), min_p=rng.uniform(0, 0.2, batch),
      repetition_penalty=rng.uniform(0.5, 2, batch), presence_penalty=rng.uniform(-1, 1, batch),
      frequency_penalty=rng.uniform(-1, 1, batch), typical_p=rng.uniform(0.2, 1, batch),
      epsilon_cutoff=rng.uniform(0, 0.05, batch), eta_cutoff=rng.uniform(0, 0.05, batch),
      logit_bias=[dict(zip(r, rng.normal(size=3).tolist())) for r in ids(3)],
      banned_token_ids=ids(int(rng.integers(0, 5))), allowed_token_ids=ids(8))


@pytest.mark.slow
def test_new_values_of_every_field_do_not_retrace():
  traces = []

  @jax.jit
  def step(key, logits, params, counts):
    traces.append(1)
    return jaxdecode.sample_with_logprobs(key, logits, params, counts=counts)

  rng = np.random.default_rng(3)
  for i in range(4):
    params = random_control_params(rng, 3, 20)
    counts = jnp.asarray(rng.integers(0, 3, size=(3, 20)), jnp.int32)
    tokens, _ = step(jax.random.key(i), jnp.asarray(rng.normal(size=(3, 20)), jnp.float32),
                     params, counts)
    assert all(t in r for t, r in zip(tokens.tolist(), params.allowed_token_ids.tolist()))
  assert len(traces) == 1


@pytest.mark.slow
def test_invalid_new_params_under_jit_follow_the_documented_sanitization():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2000, 6)), jnp.float32)
  counts = jnp.zeros((2000, 6), jnp.int32).at[:, 0].set(1)
  plain = jaxdecode.sample(jax.random.key(1), x)
  greedy = np.asarray(jaxdecode.greedy(x))
  nan = jnp.float32(jnp.nan)

  @jax.jit
  def draw(**fields):
    return jaxdecode.sample(jax.random.key(1), x, SamplingParams(**fields), counts=counts)

  for disabled in (dict(repetition_penalty=nan), dict(repetition_penalty=jnp.float32(-2)),
                   dict(presence_penalty=nan), dict(frequency_penalty=nan),
                   dict(typical_p=nan), dict(epsilon_cutoff=nan), dict(eta_cutoff=nan),
                   dict(min_new_tokens=jnp.int32(-3)),
                   dict(banned_token_ids=jnp.array([-1, 6, 99])),
                   dict(logit_bias=(jnp.array([2, 7]), jnp.array([nan, 5.0])))):
    np.testing.assert_array_equal(draw(**disabled), plain, err_msg=repr(disabled))
  # epsilon > 1 keeps only the most probable token; eta > 1 acts as 1 (a cut at exp(-H)).
  np.testing.assert_array_equal(draw(epsilon_cutoff=jnp.float32(3.0)), greedy)
  np.testing.assert_array_equal(draw(eta_cutoff=jnp.float32(3.0)),
                                draw(eta_cutoff=jnp.float32(1.0)))
  # typical_p <= 0 keeps only each row's most typical token(s): |-log p - H| smallest.
  most_typical = [ref.typical_keep(row, 1e-9)[0] for row in np.asarray(x)]
  tokens = np.asarray(draw(typical_p=jnp.float32(-1.0)))
  assert all(keep[t] for keep, t in zip(most_typical, tokens))
  assert all(keep.sum() == 1 for keep in most_typical)  # these rows have no ties
  # An infinite presence penalty saturates: the seen token 0 is never drawn, nothing is NaN.
  tokens = np.asarray(draw(presence_penalty=jnp.float32(jnp.inf)))
  assert (tokens != 0).all() and ((tokens >= 0) & (tokens < 6)).all()


# ---------------------------------------------------------------------------------------------
# decode: counts carried through the loop, min_new_tokens.

VOCAB = 13
TABLE = toy_model.table(VOCAB)
STEP = toy_model.make_step(TABLE)
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2], [7, 1, 7], [3]]


def python_loop(logits, state, positions, row_keys, params, n, eos_ids, counts):
  """decode as a plain Python loop: counts and the EOS mask kept by hand in numpy."""
  counts = np.array(counts)
  min_new = np.asarray(params.broadcast(logits.shape[0]).min_new_tokens)
  tokens, logprobs = [], []
  done = np.zeros(logits.shape[0], bool)
  for t in range(n):
    x = np.array(logits)
    x[np.ix_(t < min_new, eos_ids)] = -np.inf
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
    token, logprob = jaxdecode.sample_with_logprobs(
        keys, jnp.asarray(x), params.replace(min_new_tokens=0), counts=jnp.asarray(counts))
    token = np.where(done, 0, np.asarray(token))
    counts[np.arange(len(token))[~done], token[~done]] += 1
    tokens.append(token)
    logprobs.append(np.where(done, 0.0, np.asarray(logprob)))
    done = done | np.isin(token, eos_ids)
    logits, state = STEP(state, jnp.asarray(token), positions + t)
  return np.stack(tokens, 1), np.stack(logprobs, 1)


@pytest.mark.slow
@pytest.mark.parametrize("count_prompt", [False, True])
def test_decode_with_penalties_equals_a_python_loop_that_counts_tokens(count_prompt):
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  batch = len(PROMPTS)
  params = SamplingParams(temperature=[0.0, 0.8, 1.0, 0.0, 1.2, 0.9],
                          repetition_penalty=[3.0, 1.3, 1.0, 1.0, 2.0, 1.0],
                          presence_penalty=[0.0, 0.5, 1.0, 0.0, 0.0, -0.5],
                          frequency_penalty=[0.0, 0.0, 0.3, 2.0, 0.5, 0.1],
                          min_new_tokens=[0, 5, 0, 3, 8, 0],
                          banned_token_ids=[[], [2], [], [], [0, 1], []])
  tokens, lengths = prompts.left_pad(PROMPTS, buckets=None)
  counts = (jaxdecode.token_counts(tokens, VOCAB, mask=prompts.prompt_mask(lengths, 5))
            if count_prompt else jnp.zeros((batch, VOCAB), jnp.int32))
  key = jax.random.key(21)
  eos = [4, 11]
  out = decoding.decode(STEP, state, logits, key=key, params=params, max_new_tokens=14,
                        positions=positions, eos_ids=eos, counts=counts if count_prompt else None,
                        chunk_size=4)
  row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(batch))
  ref_tokens, ref_logprobs = python_loop(logits, state, positions, row_keys, params, 14, eos,
                                         counts)
  np.testing.assert_array_equal(out.tokens, ref_tokens)
  np.testing.assert_allclose(out.logprobs, ref_logprobs, rtol=1e-5, atol=1e-6)
  # The penalties bite: greedy row 0 with repetition_penalty 3 does not repeat one token.
  assert len(set(np.asarray(out.tokens)[0].tolist())) > 1


@pytest.mark.slow
def test_min_new_tokens_masks_eos_until_that_many_tokens_exist():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  batch = len(PROMPTS)
  greedy = SamplingParams(temperature=0.0)
  first = decoding.decode(STEP, state, logits, key=jax.random.key(0), params=greedy,
                          max_new_tokens=1, positions=positions)
  eos = sorted(set(first.tokens[:, 0].tolist()))  # every row's greedy first token is an EOS
  stop_now = decoding.decode(STEP, state, logits, key=jax.random.key(0), params=greedy,
                             max_new_tokens=10, positions=positions, eos_ids=eos)
  assert stop_now.lengths.tolist() == [1] * batch
  min_new = [0, 1, 2, 3, 5, 9]
  out = decoding.decode(STEP, state, logits, key=jax.random.key(0),
                        params=greedy.replace(min_new_tokens=min_new), max_new_tokens=10,
                        positions=positions, eos_ids=eos)
  tokens = np.asarray(out.tokens)
  for row, m in enumerate(min_new):
    assert not np.isin(tokens[row, :m], eos).any()
    assert int(out.lengths[row]) >= max(m, 1) or not out.finished[row]
  assert int(out.lengths[0]) == 1  # min_new_tokens 0 changes nothing


@pytest.mark.slow
def test_min_new_tokens_with_nothing_but_eos_selectable_raises_in_every_loop():
  """A row that allows only EOS ids would have nothing to select while min_new_tokens masks
  them: the sampler would return token 0, which the row does not allow, with a NaN
  log-probability."""
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS[:2])
  eos = [4, 6]
  args = dict(max_new_tokens=3, positions=positions, eos_ids=eos)
  key = jax.random.key(0)
  only_eos = SamplingParams(allowed_token_ids=[[1, 4], [6, 4]], min_new_tokens=2)
  drafter = jaxdecode.NgramDrafter(*jaxdecode.right_pad(PROMPTS[:2], buckets=None))
  calls = {
      "decode": lambda p: decoding.decode(STEP, state, logits, params=p, key=key, **args),
      "speculative_decode": lambda p: jaxdecode.speculative_decode(
          STEP, state, logits, params=p, key=key, drafter=drafter, **args),
      "beam_search": lambda p: jaxdecode.beam_search(STEP, state, logits, params=p,
                                                     beam_size=2, **args)}
  for name, call in calls.items():
    with pytest.raises(ValueError, match=r"row 1 can select only EOS ids \(\[4, 6\]\), which "
                                         r"min_new_tokens=2 masks"):
      call(only_eos)
  # Banning every other token leaves only EOS ids too.
  banned = SamplingParams(banned_token_ids=[0, 1, 2, 3, 5, 7, 8, 9, 10, 11, 12],
                          min_new_tokens=[0, 1])
  with pytest.raises(ValueError, match=r"row 1 can select only EOS ids \(\[4, 6\]\)"):
    calls["decode"](banned)
  # Without min_new_tokens such a row is fine: it ends at once, with an EOS id.
  out = calls["decode"](SamplingParams(allowed_token_ids=[[1, 4], [6, 4]]))
  assert out.tokens[1, 0] in eos and out.lengths[1] == 1 and np.isfinite(out.logprobs[1, 0])


@pytest.mark.slow
def test_decode_does_not_retrace_when_control_values_change():
  traces = []

  def step(state, tokens, positions):
    traces.append(1)
    return STEP(state, tokens, positions)

  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  rng = np.random.default_rng(4)
  for i in range(3):
    params = random_control_params(rng, len(PROMPTS), VOCAB).replace(
        min_new_tokens=rng.integers(0, 4, len(PROMPTS)))
    counts = jnp.asarray(rng.integers(0, 2, size=(len(PROMPTS), VOCAB)), jnp.int32)
    decoding.decode(step, state, logits, key=jax.random.key(i), params=params,
                    max_new_tokens=5, positions=positions, eos_ids=[4],
                    counts=counts if i % 2 else None, chunk_size=2)  # None: zeros, same program
    if i == 0:
      first = len(traces)
  assert len(traces) == first


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("field,value,fragment", [
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("repetition_penalty", float("inf"), "got inf"),
    ("presence_penalty", float("nan"), "presence_penalty must be a finite number"),
    ("frequency_penalty", float("-inf"), "frequency_penalty must be a finite number"),
    ("typical_p", 0.0, "0 < typical_p <= 1"),
    ("typical_p", 1.5, "got 1.5"),
    ("epsilon_cutoff", 1.0, "0 <= epsilon_cutoff < 1"),
    ("eta_cutoff", -0.1, "0 <= eta_cutoff < 1"),
    ("min_new_tokens", -1, "min_new_tokens must be an integer >= 0"),
    ("min_new_tokens", 2.5, "pass integers"),
    ("banned_token_ids", [1, -2], "token ids (integers in [0, 2**31)); got -2"),
    ("banned_token_ids", [1, [2]], "banned_token_ids must be a list of token ids"),
    ("banned_token_ids", "abc", "banned_token_ids must be"),
    ("allowed_token_ids", [1.5], "got [1.5]"),
    ("allowed_token_ids", np.array([0.5]), "dtype float"),
    ("allowed_token_ids", np.array([[-3]]), "got -3"),
    ("logit_bias", {1: float("inf")}, "logit_bias values must be finite"),
    ("logit_bias", {-1: 1.0}, "logit_bias keys must be token ids"),
    ("logit_bias", {True: 1.0}, "logit_bias keys must be token ids"),
    ("logit_bias", [1, 2], "logit_bias must be a dict"),
    ("logit_bias", (np.array([1]), np.array([1.0, 2.0])), "float array of the ids' shape"),
])
def test_bad_new_fields_raise_value_error_naming_field_and_value(field, value, fragment):
  with pytest.raises(ValueError) as info:
    SamplingParams(**{field: value})
  assert fragment in str(info.value), str(info.value)


@pytest.mark.slow
def test_token_ids_are_checked_against_the_vocabulary_and_the_batch():
  x = jnp.zeros((2, 10))
  key = jax.random.key(0)
  with pytest.raises(ValueError, match=r"banned_token_ids has token id 10, outside the "
                                       r"vocabulary of the logits \[0, 10\)"):
    jaxdecode.sample(key, x, SamplingParams(banned_token_ids=[3, 10]))
  with pytest.raises(ValueError, match=r"logit_bias has token id 12"):
    jaxdecode.process_logits(x, SamplingParams(logit_bias={12: 1.0}))
  with pytest.raises(ValueError, match="for each of 3 rows .* but the batch has 2 rows"):
    jaxdecode.sample(key, x, SamplingParams(allowed_token_ids=[[1], [2], [3]]))
  with pytest.raises(ValueError, match=r"row 1 bans every token it allows \(\[2, 3\]\)"):
    jaxdecode.sample(key, x, SamplingParams(allowed_token_ids=[[1], [2, 3]],
                                            banned_token_ids=[3, 2]))
  # Without allowed ids a row allows the whole vocabulary: banning all of it leaves nothing
  # (the sampler would return token 0, a banned token, with a NaN log-probability).
  with pytest.raises(ValueError, match=r"row 1 bans every token of the vocabulary \[0, 10\)"):
    jaxdecode.sample(key, x, SamplingParams(banned_token_ids=[[1], list(range(10))]))
  with pytest.raises(ValueError, match=r"row 0 bans every token of the vocabulary"):
    jaxdecode.decode(lambda state, tokens, positions: (x, state), {}, x, key=key,
                     params=SamplingParams(banned_token_ids=list(range(9, -1, -1))),
                     max_new_tokens=2, positions=jnp.array([1, 1]))
  # One token left is enough, and the row then always draws it.
  tokens = jaxdecode.sample(key, x, SamplingParams(banned_token_ids=list(range(9))))
  assert tokens.tolist() == [9, 9]


def test_penalties_without_counts_and_min_new_tokens_outside_decode_raise():
  x = jnp.zeros((2, 10))
  with pytest.raises(ValueError, match="pass counts=\\[B, V\\] to sample"):
    jaxdecode.sample(jax.random.key(0), x, SamplingParams(repetition_penalty=1.2))
  with pytest.raises(ValueError, match="to process_logits"):
    jaxdecode.process_logits(x, SamplingParams(frequency_penalty=[0.0, 0.1]))
  with pytest.raises(ValueError, match="min_new_tokens=3 needs the EOS ids .* jaxdecode.decode"):
    jaxdecode.sample(jax.random.key(0), x, SamplingParams(min_new_tokens=3))
  for counts, fragment in [(jnp.zeros((2, 9), jnp.int32), r"got shape \(2, 9\)"),
                           (jnp.zeros((2, 10)), "dtype float32")]:
    with pytest.raises(ValueError, match=fragment):
      jaxdecode.sample(jax.random.key(0), x, counts=counts)
  with pytest.raises(ValueError, match="counts must be an integer array of shape"):
    logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
    decoding.decode(STEP, state, logits, key=jax.random.key(0), params=SamplingParams(),
                    max_new_tokens=2, positions=positions, counts=jnp.zeros((6, 3), jnp.int32))
