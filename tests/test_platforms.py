"""One program per backend, the same bits: `jaxdecode._platform`'s two formulations.

- Structure: lowered for `cuda` (no GPU needed), no program holds a data-dependent branch, and
  every loop has a constant trip count but one, the early exit between chunks of steps. The
  programs also lower for `tpu`, where the work-skipping branches stay.
- Equality: forcing each formulation on this CPU (`_platform.forced`), the sampling chain,
  `decode`, `beam_search`, `speculative_decode`, streaming and `generate` give bit for bit the
  same tokens and log-probabilities, on rows built to reach every branch.
- The walker `invariance.host_round_trips` itself, on programs with known answers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxdecode
from jaxdecode import SamplingParams, _platform, threshold
from jaxdecode.invariance import host_round_trips
from jaxdecode.models import (DECODE_STATE_AXES, Transformer, TransformerConfig, make_step_fn,
                              prefill)

TINY = TransformerConfig(d_model=32, n_layers=2, n_heads=2, d_ff=48, max_len=64)
POSITIONS = jnp.array([7, 3, 5])


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint32) if x.dtype == np.float32 else x


def _same(a, b):
  """Bitwise equality of two pytrees of arrays."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(_bits(x), _bits(y))


def _both(fn):
  """`fn()` traced and run with each formulation on this CPU."""
  out = {}
  for mode in _platform.MODES:
    with _platform.forced(mode):
      out[mode] = jax.device_get(fn())
  return out[_platform.BRANCHES], out[_platform.STRAIGHT]


@pytest.fixture(scope="module")
def tiny():
  model = Transformer(dataclasses.replace(TINY, batch_invariant=True), rngs=nnx.Rngs(0))
  graphdef, weights = nnx.split(model)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 250, (3, 7)), jnp.int32)
  logits, state = prefill(graphdef, weights, tokens, POSITIONS, cache_length=48)
  return model, graphdef, make_step_fn(graphdef), state, logits, tokens


def _params(batch):
  """Per-row values that reach every branch: greedy rows, top-k/top-p on and off, penalties."""
  return SamplingParams(
      temperature=jnp.array([0.0, 1.3, 0.7])[:batch], top_k=jnp.array([0, 5, 0])[:batch],
      top_p=jnp.array([1.0, 0.9, 0.6])[:batch], min_p=jnp.array([0.0, 0.0, 0.05])[:batch],
      typical_p=jnp.array([1.0, 0.95, 1.0])[:batch],
      repetition_penalty=jnp.array([1.0, 1.3, 1.0])[:batch], min_new_tokens=2,
      mirostat=jnp.array([0, 0, 2])[:batch], mirostat_tau=2.0, dry_multiplier=0.5,
      no_repeat_ngram_size=jnp.array([0, 3, 0])[:batch])


# ---------------------------------------------------------------------------------------------
# The walker.


def test_the_walker_tells_constant_trip_counts_and_data_branches_apart():
  assert host_round_trips(lambda x: lax.fori_loop(0, 10, lambda i, x: x * 2, x), 1.0) == []
  assert host_round_trips(lambda x: lax.scan(lambda c, i: (c + i, None), x,
                                             jnp.arange(5.0))[0], 1.0) == []
  found = host_round_trips(lambda x: lax.while_loop(lambda c: c < 10.0, lambda c: c * 2, x), 1.0)
  assert len(found) == 1 and found[0].startswith("while")
  found = host_round_trips(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x), 1.0)
  assert len(found) == 1 and found[0].startswith("case (2 branches)")
  # A fori_loop with a traced bound is a while on data.
  assert len(host_round_trips(lambda n: lax.fori_loop(0, n, lambda i, x: x + 1, 0), 3)) == 1
  # lax.platform_dependent leaves a case with a constant index: resolved at compile time.
  pd = lambda x: lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos)
  assert host_round_trips(pd, 1.0, platform="cuda") == []
  with pytest.raises(ValueError, match="platform"):
    host_round_trips(jnp.sin, 1.0, platform="metal")


# ---------------------------------------------------------------------------------------------
# Structure: no GPU step waits on the host.


def _programs(tiny):
  model, graphdef, step_fn, state, logits, tokens = tiny
  key = jax.random.key(0)
  params = _params(3)
  logits2 = jax.ShapeDtypeStruct((8, 300), jnp.float32)
  return {
      "sample": (lambda k, l: jaxdecode.sample(k, l, SamplingParams(top_p=0.9, top_k=40)),
                 (key, logits2)),
      "sample_with_logprobs": (lambda k, l: jaxdecode.sample_with_logprobs(
          k, l, SamplingParams(temperature=0.7, min_p=0.1)), (key, logits2)),
      "prefill": (lambda w, t: prefill(graphdef, w, t, POSITIONS, cache_length=48)[0],
                  (state.weights, tokens)),
      "step": (step_fn, (state, jnp.zeros(3, jnp.int32), POSITIONS)),
      "decode": (lambda s, l, k: jaxdecode.decode(
          step_fn, s, l, key=k, params=params, max_new_tokens=20, positions=POSITIONS,
          eos_ids=[0]).tokens, (state, logits, key)),
      "beam_search": (lambda s, l: jaxdecode.beam_search(
          step_fn, s, l, beam_size=2, max_new_tokens=20, positions=POSITIONS, eos_ids=[0],
          state_axes=DECODE_STATE_AXES).tokens, (state, logits)),
      "speculative_decode": (lambda s, l, k: jaxdecode.speculative_decode(
          step_fn, s, l, key=k, params=params, max_new_tokens=20, positions=POSITIONS,
          drafter=jaxdecode.NgramDrafter(tokens, POSITIONS), eos_ids=[0]).tokens,
          (state, logits, key)),
  }


PROGRAMS = ("sample", "sample_with_logprobs", "prefill", "step", "decode", "beam_search",
            "speculative_decode")
LOOPS = ("decode", "beam_search", "speculative_decode")


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.slow
def test_no_gpu_step_waits_on_the_host(tiny, name):
  fn, args = _programs(tiny)[name]
  found = host_round_trips(fn, *args, platform="cuda")
  assert not [f for f in found if f.startswith("case")], found
  whiles = [f for f in found if f.startswith("while")]
  # The loops may stop between chunks of steps (one while, read back once per chunk).
  assert len(whiles) == (1 if name in LOOPS else 0), found
  assert all("loop.py" in f for f in whiles), found


@pytest.mark.parametrize("name", PROGRAMS)
def test_the_programs_lower_for_tpu_with_their_branches(tiny, name):
  fn, args = _programs(tiny)[name]
  found = host_round_trips(fn, *args, platform="tpu")
  if name not in ("prefill", "step"):  # TPU decides branches on the device: they stay
    assert any(f.startswith("case") for f in found), found


# ---------------------------------------------------------------------------------------------
# Equality of the formulations.


def test_the_digit_search_finds_the_bisections_threshold():
  """15 pivots per pass give the 1-bit bisection's answer on ties, zeros, huge ranges."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(16, 300)).astype(np.float32) * rng.choice([0.01, 1, 50], (16, 1))
  x[0] = np.round(x[0])  # many ties
  x[1, :200] = -np.inf
  x[2] = 0.0
  x[3, 5] = 3e38
  x = jnp.asarray(x)
  keys = threshold.order_keys(x)
  e, _ = threshold.unnormalized_probs(x)
  total = jax.jit(lambda e: threshold._reduce.row_sum(e))(e)
  for weights, target in ((jnp.float32(1), jnp.asarray(rng.integers(0, 320, 16), jnp.float32)),
                          (e, total * jnp.asarray(rng.choice([0.1, 0.5, 0.9, 1.0, 1.5], 16),
                                                  jnp.float32))):
    bits = jax.jit(threshold.largest_threshold)(keys, weights, target)
    digits = jax.jit(threshold._largest_threshold_by_digits)(keys, weights, target)
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(digits))


def test_the_digit_search_finds_the_bisections_threshold_across_lane_chunks():
  """V = 2 * 4096 + 37: three lane chunks, the last one partial; thresholds land in each."""
  rng = np.random.default_rng(2)
  vocab = 2 * 4096 + 37
  x = rng.normal(size=(6, vocab)).astype(np.float32)
  x[0, :-30] = -np.inf  # everything selectable in the partial chunk
  x[1, 4096:] = -np.inf  # ... in the first chunk only
  x[2, 5000] = 40.0  # one token holds almost all the mass
  x[3] = np.round(x[3] * 2)  # ties across chunks
  x = jnp.asarray(x)
  keys = threshold.order_keys(x)
  e, _ = threshold.unnormalized_probs(x)
  total = jax.jit(lambda e: threshold._reduce.row_sum(e))(e)
  for weights, target in ((jnp.float32(1), jnp.asarray([3, 4000, 1, 8000, 4097, vocab],
                                                       jnp.float32)),
                          (e, total * jnp.asarray([0.5, 0.9, 0.99, 0.3, 1.0, 0.7], jnp.float32))):
    bits = jax.jit(threshold.largest_threshold)(keys, weights, target)
    digits = jax.jit(threshold._largest_threshold_by_digits)(keys, weights, target)
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(digits))


@pytest.mark.parametrize("vocab", [300, 2 * 4096 + 37])
def test_the_pivot_sums_are_row_sums_of_the_masked_rows(vocab):
  """`_pivot_sums`, lane chunk by lane chunk, against `row_sum` of each pivot's masked row."""
  rng = np.random.default_rng(3)
  keys = jnp.asarray(rng.integers(0, 1 << 32, (3, vocab), dtype=np.uint64).astype(np.uint32))
  keys = keys.at[0, ::7].set(0)  # removed tokens (typical-p gives them key 0)
  weights = rng.exponential(size=(3, vocab)).astype(np.float32)
  if vocab > 2 * 4096:
    # Row 1, lane 5: 2^40, 2^16, 2^16 in chunk order sum to 2^40 (each 2^16 is half an ulp and
    # rounds to even); 2^16 + 2^16 first would give 2^40 + 2^17.
    weights[1, 5::4096] = [2.0**40, 2.0**16, 2.0**16]
    keys = keys.at[1, 5::4096].set(0xFFFFFFFF)  # counted at every pivot
  weights = jnp.asarray(weights)
  pivots = jnp.asarray(np.stack([np.sort(rng.choice(np.asarray(k)[np.asarray(k) > 0], 15,
                                                     replace=False)) for k in keys]))  # >= 1
  masked_sum = jax.jit(lambda k, w, p: threshold._reduce.row_sum(
      jnp.where(k >= p[:, None], w, jnp.float32(0))))
  for w in (weights, jnp.float32(1)):
    got = jax.jit(threshold._pivot_sums)(keys, w, pivots)
    want = np.stack([np.asarray(masked_sum(keys, w, pivots[:, d])) for d in range(15)], axis=1)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    if w is weights:
      assert len(np.unique(want[0])) == len(np.unique(want[2])) == 15  # every pivot cuts elsewhere
      if vocab > 2 * 4096:
        np.testing.assert_array_equal(want[1], 2.0**40)


@pytest.mark.slow
def test_the_digit_searchs_scratch_stays_near_the_bisections():
  """Issue 37: the straight formulation materialized [B, 15, V] (4.6x the branch one's scratch
  here); it sums lane chunk by lane chunk now. top-p and typical-p both search."""
  x = jax.ShapeDtypeStruct((2, 100_000), jnp.float32)
  params = SamplingParams(top_p=0.9, typical_p=0.9)
  scratch = {}
  for mode in _platform.MODES:
    with _platform.forced(mode):
      compiled = jax.jit(lambda x: jaxdecode.process_logits(x, params)).lower(x).compile()
      scratch[mode] = compiled.memory_analysis().temp_size_in_bytes
  assert scratch[_platform.BRANCHES] > 2 * 100_000 * 4  # it holds at least two [B, V] arrays
  assert scratch[_platform.STRAIGHT] <= 1.5 * scratch[_platform.BRANCHES], scratch


@pytest.mark.slow
def test_the_sampling_chain_is_the_same_in_both_formulations():
  rng = np.random.default_rng(0)
  batch, vocab = 48, 300
  x = rng.normal(size=(batch, vocab)).astype(np.float32) * rng.choice([0.1, 1, 5, 30], (batch, 1))
  x[1] = -np.inf
  x[2, :5] = np.inf
  x[3, ::3] = np.nan
  x[4] = 0.0
  x[5, :100] = -0.0  # signed zeros survive where nothing acts on them
  x[6] = np.round(x[6])
  x[7] = 1e38
  pick = lambda *v: jnp.asarray(rng.choice(v, batch), jnp.float32)
  params = SamplingParams(
      temperature=pick(0, 0.5, 1, 1.5, 1e-30), top_k=jnp.asarray(
          rng.choice([0, 1, 5, 40, 70, 299], batch), jnp.int32),
      top_p=pick(1, 0.9, 0.5, 0.999), min_p=pick(0, 0.05), typical_p=pick(1, 0.9),
      epsilon_cutoff=pick(0, 1e-3), eta_cutoff=pick(0, 1e-3), repetition_penalty=pick(1, 1.3),
      presence_penalty=pick(0, 0.5), logit_bias={3: 2.0, 7: -100.0}, banned_token_ids=[11],
      top_n_sigma=pick(0, 1, 2.5), xtc_threshold=pick(0.01, 0.1, 0.6), xtc_probability=pick(0, 1),
      dynatemp_range=pick(0, 0.5, 2), dynatemp_exponent=pick(0, 1, 2),
      mirostat=jnp.asarray(rng.choice([0, 2], batch), jnp.int32), mirostat_tau=pick(0, 1, 3),
      dry_multiplier=pick(0, 0.8), dry_allowed_length=jnp.asarray(
          rng.choice([1, 2], batch), jnp.int32), dry_sequence_breakers=[3, 17],
      no_repeat_ngram_size=jnp.asarray(rng.choice([0, 1, 2, 3], batch), jnp.int32),
      bad_words=[[5, 6], [7, 8, 9], [10]])
  counts = jnp.asarray(rng.integers(0, 3, (batch, vocab)), jnp.int32)
  history = rng.integers(0, 20, (batch, 12)).astype(np.int32)
  history[:, :3] = -1
  keys = jax.random.split(jax.random.key(1), batch)
  plain = params.replace(repetition_penalty=1.0, presence_penalty=0.0,
                         xtc_probability=pick(0, 0.5, 1))

  def run():
    return (jaxdecode.process_logits(x, params, counts=counts, history=history),
            jaxdecode.sample_with_logprobs(keys, x, plain, history=history))

  branches, straight = _both(run)
  _same(branches, straight)


@pytest.mark.slow  # the fast loop keeps the sampling chain's equality
def test_decode_is_the_same_in_both_formulations(tiny):
  _, _, step_fn, state, logits, _ = tiny
  # 17 steps in chunks of 8: the tail chunk runs on CPU; a GPU peels step 0 and has none.
  run = lambda: jaxdecode.decode(step_fn, state, logits, key=jax.random.key(3), params=_params(3),
                                 max_new_tokens=17, positions=POSITIONS, eos_ids=[10, 32],
                                 chunk_size=8, top_logprobs=2)
  b, s = _both(run)  # the cache past a row's end may differ: not compared
  _same((b.tokens, b.logprobs, b.lengths, b.finished, b.dead_end, b.top_tokens, b.top_logprobs),
        (s.tokens, s.logprobs, s.lengths, s.finished, s.dead_end, s.top_tokens, s.top_logprobs))
  assert int(b.lengths.min()) >= 2  # min_new_tokens held


@pytest.mark.slow
def test_beam_search_is_the_same_in_both_formulations(tiny):
  _, _, step_fn, state, logits, _ = tiny
  run = lambda: jaxdecode.beam_search(step_fn, state, logits, beam_size=3, max_new_tokens=9,
                                      positions=POSITIONS, eos_ids=[10, 32], chunk_size=4,
                                      state_axes=DECODE_STATE_AXES,
                                      params=SamplingParams(top_k=jnp.array([0, 4, 30])))
  branches, straight = _both(run)
  _same((branches.tokens, branches.scores, branches.lengths, branches.logprobs),
        (straight.tokens, straight.scores, straight.lengths, straight.logprobs))


@pytest.mark.slow
def test_speculative_decoding_is_the_same_in_both_formulations(tiny):
  _, _, step_fn, state, logits, tokens = tiny
  run = lambda: jaxdecode.speculative_decode(
      step_fn, state, logits, key=jax.random.key(3), params=_params(3), max_new_tokens=13,
      positions=POSITIONS, drafter=jaxdecode.NgramDrafter(tokens, POSITIONS),
      num_draft_tokens=3, eos_ids=[10, 32], chunk_size=2)
  branches, straight = _both(run)
  _same((branches.tokens, branches.logprobs, branches.lengths, branches.accepted,
         branches.drafted, branches.calls),
        (straight.tokens, straight.logprobs, straight.lengths, straight.accepted,
         straight.drafted, straight.calls))


@pytest.mark.slow
def test_generate_and_streaming_are_the_same_in_both_formulations(tiny):
  model = tiny[0]
  prompts = ["ab", "The for statement", "x"]
  params = SamplingParams(temperature=jnp.array([0.0, 0.9, 1.2]), top_p=0.9)

  def run():
    outs = [jaxdecode.models.generate(prompts, model=model, params=params, max_new_tokens=12,
                                      seed=5)]
    texts = [""] * len(prompts)
    for chunk in jaxdecode.models.stream(prompts, model=model, params=params, max_new_tokens=12,
                                         seed=5, chunk_size=5):
      texts = [t + piece for t, piece in zip(texts, chunk.texts)]
    assert texts == outs[0].texts  # streaming gives generate's text in either formulation
    return [(g.tokens, g.logprobs, g.lengths) for g in outs] + [np.array(texts)]

  branches, straight = _both(run)
  _same(branches, straight)


@pytest.mark.slow
def test_a_decode_exports_for_gpu_and_tpu_at_once(tiny):
  """`jax.export` with both platforms: the program carries both formulations and picks one by
  the platform it is loaded on."""
  fn, args = _programs(tiny)["decode"]
  exported = jax.export.export(jax.jit(fn), platforms=["cuda", "tpu"])(*args)
  assert exported.platforms == ("cuda", "tpu")
