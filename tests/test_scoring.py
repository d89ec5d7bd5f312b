"""Exact on-policy scoring: `jaxdecode.score` gives bitwise the log-probabilities the loops
recorded, of every kind (`jaxdecode.scoring`), and `logprob_diff` measures the gap.

Why the bits must match (the construction, not this machine's kernels): `score` replays the
loop's own step (`loop.draw_scored`: `loop.process`, then `sampling.log_softmax`, whose entry at
a drawn token is `inverse_cdf`'s log-probability by the same expression and fixed-order sums) on
the same logits. The toy model's logits are exact table entries (the same history gives the same
entry, alone or batched, step by step or over a whole sequence), so every bit of difference here
would be the loop's or the processors'; the embedded transformer's whole-sequence pass equals its
cached steps by `Transformer.run`'s construction (tests/test_invariance.py, tests/test_metrics.py).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import SamplingParams
from jaxdecode import scoring
from jaxdecode import structured
import toy_model

V = 23
TABLE = toy_model.table(V, seed=3)
STEP = toy_model.make_cached_step(TABLE)
SLOTS = 32
N = 10
EOS = 0
# Token 0 is the EOS (a special token); token i >= 1 spells the letter chr(ord('a') + i - 1).
VOCAB = structured.Vocabulary([None] + [bytes([ord("a") + i - 1]) for i in range(1, V)],
                              eos_ids=[EOS])


def sequence_logits(tokens, lengths):
  """The toy model over whole right-padded rows: logits[b, i] = TABLE[hash of tokens[b, :i+1]],
  the entry its prefill (i = length - 1) and cached steps give (`toy_model._mix`)."""
  del lengths
  h = jnp.zeros(tokens.shape[:1], jnp.int32)
  out = []
  for position in range(tokens.shape[1]):
    h = toy_model._mix(h, tokens[:, position], position)  # pylint: disable=protected-access
    out.append(TABLE[h])
  return jnp.stack(out, axis=1)


# Seven rows: every rule of SamplingParams on some row, a user logit processor, a constraint, a
# greedy row, a row that runs into a dead end, and an n = 2 group (rows 5 and 6: one prompt, keys
# fold_in(k, i)).
PROMPTS = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13], [1, 2, 3, 4], [9, 9, 9], [9, 9, 9]]
CONSTRAINTS = [structured.regex("[a-d]{1,3}", VOCAB), None, None, None, None, None, None]
PARAMS = SamplingParams(
    temperature=np.array([0.9, 0.0, 1.1, 0.7, 1.0, 1.2, 1.2], np.float32),
    top_k=np.array([3, 0, 0, 0, 0, 8, 8], np.int32),
    top_p=np.array([0.95, 1.0, 1.0, 1.0, 1.0, 0.9, 0.9], np.float32),
    min_p=np.array([0.0, 0.0, 0.05, 0.0, 0.0, 0.02, 0.02], np.float32),
    repetition_penalty=np.array([1.3, 1.2, 1.0, 1.0, 1.0, 1.1, 1.1], np.float32),
    presence_penalty=np.array([0.2, 0.0, 0.0, 0.0, 0.0, 0.1, 0.1], np.float32),
    frequency_penalty=np.array([0.1, 0.0, 0.0, 0.0, 0.0, 0.2, 0.2], np.float32),
    typical_p=np.array([1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0], np.float32),
    epsilon_cutoff=np.array([0.0, 0.0, 0.01, 0.0, 0.0, 0.0, 0.0], np.float32),
    eta_cutoff=np.array([0.0, 0.0, 0.01, 0.0, 0.0, 0.0, 0.0], np.float32),
    min_new_tokens=np.array([0, 3, 0, 0, 0, 2, 2], np.int32),
    no_repeat_ngram_size=np.array([0, 2, 0, 0, 1, 0, 0], np.int32),
    top_n_sigma=np.array([0.0, 0.0, 0.0, 1.5, 0.0, 0.0, 0.0], np.float32),
    dynatemp_range=np.array([0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0], np.float32),
    xtc_threshold=np.array([0.1, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05], np.float32),
    xtc_probability=np.array([0.0, 0.0, 0.5, 0.0, 0.0, 0.5, 0.5], np.float32),
    dry_multiplier=np.array([0.0, 0.0, 0.8, 0.0, 0.0, 0.0, 0.0], np.float32),
    mirostat=np.array([0, 0, 0, 2, 0, 0, 0], np.int32),
    mirostat_tau=np.array([5.0, 5.0, 5.0, 3.0, 5.0, 5.0, 5.0], np.float32),
    banned_token_ids=[[7], [], [], [], [], [4], [4]],
    # Row 4 may only use three tokens, none twice counting its prompt (no_repeat_ngram_size=1),
    # and no EOS: its third step has nothing selectable, a dead end.
    allowed_token_ids=[[], [], [], [], [2, 5, 9], [], []],
    logit_bias=[{3: 1.5}, None, {11: -2.0}, None, None, {6: 0.5}, {6: 0.5}],
    bad_words=[None, None, [[8, 9]], None, None, None, None])


def _user_processor(logits, context, bonus):
  """A user logit processor reading its context: a per-row bonus for token 5, and a penalty
  for the tokens the row has drawn."""
  return logits.at[:, 5].add(bonus) - 0.05 * context.counts.astype(jnp.float32)


BONUS = jnp.array([0.5, 0.0, 1.0, -1.0, 0.0, 2.0, 2.0], jnp.float32)


def processors_of(rows):
  return [jax.tree_util.Partial(_user_processor, bonus=BONUS[np.asarray(rows)])]


def keys_of(seed=11):
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(seed), r))(jnp.arange(5))
  group = jax.vmap(lambda i: jax.random.fold_in(keys[4], i))(jnp.arange(1, 3))  # n = 2
  return jnp.concatenate([keys, group])


def toy_prefill(rows):
  logits, state, positions = toy_model.prefill_cached(TABLE, [PROMPTS[r] for r in rows], SLOTS)
  return logits, state, positions


@pytest.fixture(scope="module")
def sampled():
  """The sampler's side: decode(scores=True) of the seven rows."""
  rows = np.arange(len(PROMPTS))
  logits, state, positions = toy_prefill(rows)
  prompt_tokens, prompt_lengths = jaxdecode.right_pad(PROMPTS, width=6)
  out = jaxdecode.decode(STEP, state, logits, key=keys_of(), params=PARAMS, max_new_tokens=N,
                         positions=positions, eos_ids=[EOS], constraint=structured.stack(
                             CONSTRAINTS), prompt_tokens=jnp.where(
                                 jnp.arange(6)[None] < prompt_lengths[:, None], prompt_tokens,
                                 -1), scores=True, logits_processors=processors_of(rows))
  return dict(out=out, prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths)


def score_rows(sampled, rows, new_tokens=None):
  """The trainer's side for `rows` of the sampled batch (any order, repeats allowed)."""
  rows = np.asarray(rows)
  out = sampled["out"]
  return jaxdecode.score(sequence_logits, sampled["prompt_tokens"][rows],
                         sampled["prompt_lengths"][rows],
                         out.tokens[rows] if new_tokens is None else new_tokens,
                         params=PARAMS.rows(rows), eos_ids=[EOS],
                         constraint=structured.stack([CONSTRAINTS[r] for r in rows]),
                         key=keys_of()[rows], logits_processors=processors_of(rows))


def assert_same_bits(got, want):
  for kind, g, w in zip(jaxdecode.Scores._fields, got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=kind)


def log_softmax64(x):
  x = np.asarray(x, np.float64)
  m = x.max()
  return x - m - math.log(np.exp(x - m).sum())


# ---------------------------------------------------------------------------------------------
# The sampler's kinds


@pytest.mark.slow
def test_decode_kinds_are_the_recorded_logprobs_and_the_model_s_own(sampled):
  """processed is bitwise DecodeOutput.logprobs; raw and tempered equal an independent float64
  log-softmax of the table entry the step saw; rows end as asked (EOS, dead end)."""
  out = sampled["out"]
  scores = out.scores
  np.testing.assert_array_equal(scores.processed, out.logprobs)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  assert out.finished[0] and lengths[0] < N  # the constrained row ends on EOS
  # allowed {2, 5, 9}, none twice, and its prompt holds 2: two tokens, then nothing selectable
  assert out.dead_end[4] and lengths[4] == 2
  temperature = np.asarray(PARAMS.temperature)
  for b, prompt in enumerate(PROMPTS):
    h = 0
    for position, token in enumerate(prompt):
      h = toy_model._mix(h, token, position)  # pylint: disable=protected-access
    for t in range(N):
      if t >= lengths[b]:  # no token here: every kind reads 0
        assert all(float(k[b, t]) == 0.0 for k in scores)
        continue
      z = np.asarray(TABLE[h], np.float64)
      y = tokens[b, t]
      np.testing.assert_allclose(scores.raw[b, t], log_softmax64(z)[y], rtol=0, atol=2e-6)
      if temperature[b] == 0:
        assert np.isnan(scores.tempered[b, t]) and np.isnan(scores.kept_logmass[b, t])
        assert float(scores.processed[b, t]) == 0.0
      else:
        np.testing.assert_allclose(scores.tempered[b, t], log_softmax64(z / temperature[b])[y],
                                   rtol=0, atol=2e-6)
        assert scores.kept_logmass[b, t] <= 0
      h = toy_model._mix(h, y, len(prompt) + t)  # pylint: disable=protected-access


@pytest.mark.slow
def test_processed_is_tempered_minus_kept_mass_where_the_chain_only_removes_tokens(sampled):
  """Row 4 (temperature 1, allowed ids, n-gram bans: removals only): processed = tempered -
  kept_logmass to float32 rounding; row 0 has a bias and penalties, which reweight: it need not."""
  s = sampled["out"].scores
  n = int(sampled["out"].lengths[4])
  np.testing.assert_allclose(s.processed[4, :n], (s.tempered - s.kept_logmass)[4, :n],
                             rtol=0, atol=1e-5)
  assert np.all(np.asarray(s.kept_logmass[4, :n]) < 0)


# ---------------------------------------------------------------------------------------------
# The trainer's side: bitwise, in any batch


@pytest.mark.slow
def test_score_is_bitwise_decode_in_another_batch_of_another_size(sampled):
  """Nine rows in another order, repeats included (the sampler had seven): each row's four kinds
  are the bits decode recorded for it, EOS-ended, dead-ended, greedy, constrained, XTC and
  mirostat rows included."""
  rows = np.array([6, 3, 0, 0, 5, 2, 4, 1, 3])
  got = score_rows(sampled, rows)
  want = jax.tree.map(lambda x: x[rows], sampled["out"].scores)
  assert_same_bits(got, want)
  # on policy, the diagnostics are exactly 0 and the sequence ratios exactly 1
  mask = jnp.arange(N)[None, :] < sampled["out"].lengths[rows][:, None]
  diff = jaxdecode.logprob_diff(want.processed, got.processed, mask)
  assert float(diff.max_abs) == 0.0 and float(diff.k1) == 0.0 and float(diff.k3) == 0.0
  np.testing.assert_array_equal(diff.sequence_ratio, np.ones(len(rows), np.float32))
  # Negative control: the trainer forgetting row 0's repetition penalty keeps its raw bits and
  # changes its processed log-probs (so the equality above is not vacuous). New values of the
  # same shapes reuse the compiled program.
  compiled = jaxdecode.trainer._score_jit._cache_size()  # pylint: disable=protected-access
  params = PARAMS.rows(rows)
  forgot = jaxdecode.score(sequence_logits, sampled["prompt_tokens"][rows],
                           sampled["prompt_lengths"][rows], sampled["out"].tokens[rows],
                           params=params.replace(repetition_penalty=jnp.ones(len(rows))),
                           eos_ids=[EOS], key=keys_of()[rows],
                           logits_processors=processors_of(rows),
                           constraint=structured.stack([CONSTRAINTS[r] for r in rows]))
  np.testing.assert_array_equal(forgot.raw, got.raw)
  assert float(jaxdecode.logprob_diff(want.processed, forgot.processed, mask).max_abs) > 0
  assert jaxdecode.trainer._score_jit._cache_size() == compiled  # pylint: disable=protected-access


@pytest.mark.slow
def test_forced_decoding_replays_a_rollout_with_its_log_probs(sampled):
  """decode(forced_tokens=the rollout) emits it and returns its kinds, bitwise; a forced token
  the processors removed (a banned id) gets processed -inf, its raw log-prob stays finite."""
  out = sampled["out"]
  logits, state, positions = toy_prefill(np.arange(len(PROMPTS)))
  prompt = jnp.where(jnp.arange(6)[None] < sampled["prompt_lengths"][:, None],
                     sampled["prompt_tokens"], -1)
  options = dict(key=keys_of(), params=PARAMS, max_new_tokens=N, positions=positions,
                 eos_ids=[EOS], constraint=structured.stack(CONSTRAINTS), prompt_tokens=prompt,
                 scores=True, logits_processors=processors_of(np.arange(len(PROMPTS))))
  replay = jaxdecode.decode(STEP, state, logits, forced_tokens=out.tokens, **options)
  for name in ("tokens", "logprobs", "lengths", "finished", "dead_end"):
    np.testing.assert_array_equal(getattr(replay, name), getattr(out, name), err_msg=name)
  assert_same_bits(replay.scores, out.scores)
  forced = out.tokens.at[5, 1].set(4)  # row 5 bans token 4
  other = jaxdecode.decode(STEP, state, logits, forced_tokens=forced, **options)
  assert other.scores.processed[5, 1] == -np.inf and np.isfinite(other.scores.raw[5, 1])
  assert int(other.tokens[5, 1]) == 4


@pytest.mark.slow
def test_speculative_rollouts_score_as_decode_does(sampled):
  """speculative_decode(scores=True) records decode's kinds for the same key, so score equals
  them too (the n-gram drafter proposes from the prompts)."""
  rows = np.arange(len(PROMPTS))
  logits, state, positions = toy_prefill(rows)
  prompt = jnp.where(jnp.arange(6)[None] < sampled["prompt_lengths"][:, None],
                     sampled["prompt_tokens"], -1)
  spec = jaxdecode.speculative_decode(
      STEP, state, logits, key=keys_of(), params=PARAMS, max_new_tokens=N, positions=positions,
      eos_ids=[EOS], constraint=structured.stack(CONSTRAINTS), prompt_tokens=prompt,
      logits_processors=processors_of(rows),
      drafter=jaxdecode.NgramDrafter(sampled["prompt_tokens"], sampled["prompt_lengths"]),
      num_draft_tokens=3, scores=True)
  np.testing.assert_array_equal(spec.tokens, sampled["out"].tokens)
  assert_same_bits(spec.scores, sampled["out"].scores)


# ---------------------------------------------------------------------------------------------
# Hand-computed kinds and gradients (no processor chain compiled: small programs)


def test_token_kinds_against_hand_computed_values():
  """One row p = (.5, .3, .15, .05), T = 0.5, top-k 2 kept {0, 1}, token 1: raw log .3;
  tempered log(.09 / .345); processed log(.09 / .34); kept log(.34 / .345)."""
  p = np.array([0.5, 0.3, 0.15, 0.05])
  z = jnp.log(jnp.asarray([p, p], jnp.float32))
  processed = jnp.where(jnp.arange(4)[None] < 2, z / 0.5, -jnp.inf)
  processed = processed.at[1].set(jnp.array([-jnp.inf, 0.0, -jnp.inf, -jnp.inf]))  # greedy
  got = jax.jit(lambda *a: scoring.token_scores(None, *a))(z, processed, jnp.array([1, 1]),
                                                          jnp.array([0.5, 0.0]))
  q = p ** 2
  np.testing.assert_allclose(got.raw, [math.log(0.3)] * 2, rtol=1e-6)
  np.testing.assert_allclose(got.tempered[0], math.log(q[1] / q.sum()), rtol=1e-6)
  np.testing.assert_allclose(got.processed[0], math.log(q[1] / q[:2].sum()), rtol=1e-6)
  np.testing.assert_allclose(got.kept_logmass[0], math.log(q[:2].sum() / q.sum()), rtol=1e-6)
  assert np.isnan(got.tempered[1]) and np.isnan(got.kept_logmass[1])  # T = 0: undefined
  assert float(got.processed[1]) == 0.0  # the greedy token is certain


def _penalized_top2(inputs, z):
  """A stand-in chain: top-2 kept, the first token's logit divided by a repetition penalty,
  then the temperature (inputs: kept bool[V], scale float32[V], T)."""
  kept, scale, t = inputs
  return jnp.where(kept[None], z * scale[None] / t, -jnp.inf)


def test_kinds_gradients_equal_the_derivatives_of_their_formulas():
  """Each kind's gradient in the logits against jax.grad of its closed form on the kept set
  (T = 0.5, top-k 2, a repetition penalty 1.25 on token 0: slope 1 / (T · 1.25) there, which
  the backward finds by differentiating the chain along a uniform shift)."""
  z = jnp.array([[1.0, 0.4, -0.3, 0.2]], jnp.float32)
  t, r = 0.5, 1.25
  scale = jnp.array([1 / r, 1.0, 1.0, 1.0])
  kept = jnp.array([True, True, False, False])

  def closed(z):
    raw = jax.nn.log_softmax(z[0])[1]
    tempered = jax.nn.log_softmax(z[0] / t)[1]
    processed = jax.nn.log_softmax(jnp.where(kept, z[0] * scale / t, -jnp.inf))[1]
    kept_mass = jax.nn.logsumexp(jnp.where(kept, z[0] / t, -jnp.inf)) - jax.nn.logsumexp(
        z[0] / t)
    return raw, tempered, processed, kept_mass

  inputs = (kept, scale, jnp.float32(t))
  processed_logits = _penalized_top2(inputs, z)

  def kinds(z, temperature):
    return jnp.stack(scoring.token_scores(_penalized_top2, z, processed_logits, jnp.array([1]),
                                          temperature, inputs))[:, 0]

  got = jax.jit(jax.jacrev(kinds))(z, jnp.array([t]))  # [4 kinds, 1, V]
  want = jax.jit(jax.jacrev(lambda z: jnp.stack(closed(z))))(z)
  for i, kind in enumerate(jaxdecode.Scores._fields):
    np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-6, err_msg=kind)
  greedy = jax.jit(jax.jacrev(kinds))(z, jnp.array([0.0]))[1]
  np.testing.assert_array_equal(greedy, np.zeros((1, 4), np.float32))  # NaN value: 0 gradient


# ---------------------------------------------------------------------------------------------
# Diagnostics


def test_logprob_diff_against_hand_computed_values():
  """Δ = b - a on the mask: (0.1, -0.2) in row 0, (0.3) in row 1; a masked-out NaN is never
  read. mean|Δ| = 0.2, max 0.3, k1 = -mean Δ = -0.0667, k3 = mean(e^Δ - 1 - Δ)."""
  a = jnp.array([[-1.0, -2.0, jnp.nan], [-0.5, -jnp.inf, -3.0]])
  b = jnp.array([[-0.9, -2.2, 0.0], [-0.2, -jnp.inf, -1.0]])
  mask = jnp.array([[True, True, False], [True, True, False]])
  d = jaxdecode.logprob_diff(a, b, mask)
  deltas = np.array([0.1, -0.2, 0.3])
  np.testing.assert_allclose(d.mean_abs, 0.6 / 4, rtol=1e-6)  # four masked tokens (one -inf pair)
  np.testing.assert_allclose(d.max_abs, 0.3, rtol=1e-6)
  np.testing.assert_allclose(d.k1, -deltas.sum() / 4, rtol=1e-5)
  np.testing.assert_allclose(d.k3, np.sum(np.expm1(deltas) - deltas) / 4, rtol=1e-5)
  np.testing.assert_allclose(d.sequence_ratio, [math.exp(-0.1), math.exp(0.3)], rtol=1e-6)
  with pytest.raises(ValueError, match="a and b must be arrays of the same shape"):
    jaxdecode.logprob_diff(a, b[:1])
  with pytest.raises(ValueError, match="mask must be a bool array of shape"):
    jaxdecode.logprob_diff(a, b, mask.astype(jnp.int32))


# ---------------------------------------------------------------------------------------------
# Bad input: a clear ValueError before anything compiles


def _fn(tokens, lengths):
  del lengths
  return jnp.zeros(tokens.shape + (5,), jnp.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: jaxdecode.score("f", [[1]], [1], [[1]]), "logits_fn must be a function"),
    (lambda: jaxdecode.score(_fn, [[1]], [1], [[[1, 2]]]), "beam search's .B, R, N."),
    (lambda: jaxdecode.score(_fn, [[1]], [1], [[1], [2]]), r"new_tokens must have shape \(1, N\)"),
    (lambda: jaxdecode.score(_fn, [[1, 2]], [3], [[1]]), r"prompt_lengths must be in \[1, T = 2\]"),
    (lambda: jaxdecode.score(_fn, [[1]], [1], [[7]]),
     r"new_tokens must hold token ids in \[0, 5\)"),
    (lambda: jaxdecode.score(lambda t, n: t, [[1]], [1], [[1]]), "must return floating logits"),
    (lambda: jaxdecode.score(_fn, [[1]], [1], [[1]], eos_ids=[9]), "eos_ids"),
    (lambda: jaxdecode.score(_fn, [[1]], [1], [[1]],
                             params=SamplingParams(xtc_probability=0.5)), "pass the sampler's key"),
    (lambda: jaxdecode.score(_fn, [[1]], [1], [[1]], params={"temperature": 1.0}),
     "params must be a jaxdecode.SamplingParams"),
])
def test_score_refuses_bad_input_by_name(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_decode_refuses_bad_forced_tokens_by_name():
  def step(state, tokens, positions):
    return jnp.zeros((1, 5)), state
  options = dict(key=jax.random.key(0), params=SamplingParams(), max_new_tokens=3,
                 positions=jnp.array([1]))
  with pytest.raises(ValueError, match=r"forced_tokens must be an integer array of shape \(1, 3\)"):
    jaxdecode.decode(step, {}, jnp.zeros((1, 5)), forced_tokens=[[1, 2]], **options)
  with pytest.raises(ValueError,
                     match=r"forced_tokens must hold token ids in \[0, 5\) .* got -1 at \[0, 1\]"):
    jaxdecode.decode(step, {}, jnp.zeros((1, 5)), forced_tokens=[[1, -1, 2]], **options)
  with pytest.raises(ValueError, match="scores must be"):
    jaxdecode.decode(step, {}, jnp.zeros((1, 5)), scores="yes", **options)


# ---------------------------------------------------------------------------------------------
# The embedded transformer: its whole-sequence pass is its cached steps, so score is decode


@pytest.fixture(scope="module")
def transformer_rollout():
  """The sampler: models.generate(logprob_kinds=True) on a tiny transformer, two prompts of
  different lengths, n = 2 samples each (row keys fold_in(k, i)), per-prompt params."""
  from flax import nnx
  from jaxdecode import models
  model = models.Transformer(models.TransformerConfig(d_model=32, n_layers=1, n_heads=2,
                                                      d_ff=64, max_len=64), rngs=nnx.Rngs(4))
  graphdef, weights = nnx.split(model)
  tok = models.ByteTokenizer()
  prompts = ["def f(x):", "ab"]
  params = SamplingParams(temperature=np.array([0.8, 0.6], np.float32), top_k=40,
                          frequency_penalty=np.array([0.0, 0.3], np.float32))
  gen = models.generate(prompts, model=model, params=params, n=2, max_new_tokens=6, seed=2,
                        logprob_kinds=True)
  tokens, lengths = jaxdecode.right_pad([tok.encode(p) for p in prompts for _ in range(2)],
                                        pad_id=tok.PAD, buckets=None)  # not generate's width
  return dict(graphdef=graphdef, weights=weights, tokens=tokens, lengths=lengths, gen=gen,
              params=params.rows(np.repeat(np.arange(2), 2)), tok=tok, model=model)


@pytest.mark.slow
def test_score_of_the_embedded_model_is_generate_bitwise_in_another_batch(transformer_rollout):
  """Rows 3 and 0 alone (the sampler had four, in another order, and padded its prompts to
  another width): models.forward over prompt + tokens gives the kinds generate recorded, bit
  for bit; the two samples of a prompt differ; beams are refused."""
  from jaxdecode import models
  r = transformer_rollout
  gen, tok = r["gen"], r["tok"]
  assert gen.texts[0] != gen.texts[1] or gen.texts[2] != gen.texts[3]
  np.testing.assert_array_equal(gen.logprob_kinds.processed, gen.logprobs)
  rows = np.array([3, 0])
  got = jaxdecode.score(models.forward_fn(r["graphdef"], r["weights"]), r["tokens"][rows],
                        r["lengths"][rows], gen.tokens[rows], params=r["params"].rows(rows),
                        eos_ids=[tok.EOS], pad_id=tok.PAD)
  assert_same_bits(got, jax.tree.map(lambda x: x[rows], gen.logprob_kinds))
  with pytest.raises(ValueError, match="logprob_kinds does not apply to beam search"):
    models.generate(["ab"], model=r["model"], beam_size=2, logprob_kinds=True)


@pytest.mark.slow
def test_score_under_value_and_grad_keeps_the_bits_and_gives_the_plain_gradient(
    transformer_rollout):
  """Under jax.value_and_grad the scores are still the sampler's bits; the gradient of the
  processed log-probs is finite and matches jax.grad of a plain float32 reference (the training
  pass's logits, the frequency penalty, the temperature and the same top-k set) within float32
  error."""
  from jaxdecode import models
  from flax import nnx
  r = transformer_rollout
  gen, params, lengths, tok = r["gen"], r["params"], r["lengths"], r["tok"]
  new = jnp.asarray(gen.tokens)
  mask = jnp.arange(new.shape[1])[None, :] < jnp.asarray(gen.lengths)[:, None]

  def loss(weights):
    s = jaxdecode.score(models.forward_fn(r["graphdef"], weights), r["tokens"], lengths, new,
                        params=params, eos_ids=[tok.EOS], pad_id=tok.PAD)
    return jnp.sum(s.processed), s

  (_, got), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(r["weights"])
  assert_same_bits(got, gen.logprob_kinds)

  def reference(weights):  # plain ops only: the training pass, a log-softmax, the top-k set
    sequence, _ = jaxdecode.trainer.sequences(r["tokens"], lengths, new)
    z = nnx.merge(r["graphdef"], weights)(sequence)
    at = lengths[:, None] - 1 + jnp.arange(new.shape[1])[None, :]
    z = jnp.take_along_axis(z, at[:, :, None], axis=1)  # [B, N, V]
    seen = jax.nn.one_hot(new, z.shape[-1])
    counts = jnp.cumsum(seen, axis=1) - seen  # each token's count before step t
    z = z - params.frequency_penalty[:, None, None] * counts
    kth = jnp.sort(jax.lax.stop_gradient(z), axis=-1)[..., -40][..., None]
    x = jnp.where(z >= kth, z / params.temperature[:, None, None], -jnp.inf)
    lp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), new[..., None], axis=-1)
    return jnp.sum(jnp.where(mask, lp[..., 0], 0.0))

  want = jax.jit(jax.grad(reference))(r["weights"])
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * max(1.0, float(np.abs(w).max())))


@pytest.mark.slow
def test_generate_replays_forced_tokens_with_their_kinds(transformer_rollout):
  """generate(forced_tokens=a rollout) under another seed emits that rollout, with its texts
  and, bit for bit, its log-probabilities of each kind (no rule here reads the key)."""
  from jaxdecode import models
  r = transformer_rollout
  gen = r["gen"]
  replay = models.generate(["def f(x):", "ab"], model=r["model"], params=r["params"].rows(
      np.array([0, 2])), n=2, max_new_tokens=6, seed=9, logprob_kinds=True,
                           forced_tokens=gen.tokens)
  assert replay.texts == gen.texts
  np.testing.assert_array_equal(replay.tokens, gen.tokens)
  assert_same_bits(replay.logprob_kinds, gen.logprob_kinds)
  with pytest.raises(ValueError, match=r"generate: forced_tokens must be an integer array of "
                                       r"shape \(4, 6\)"):
    models.generate(["def f(x):", "ab"], model=r["model"], n=2, max_new_tokens=6,
                    forced_tokens=gen.tokens[:2])


def test_stream_refuses_the_kinds_and_forced_tokens_by_name():
  from jaxdecode import models
  for name, value in (("logprob_kinds", True), ("forced_tokens", [[1]])):
    with pytest.raises(ValueError, match=f"stream does not support {name}; use generate"):
      models.stream(["a"], **{name: value})
