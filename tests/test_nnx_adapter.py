"""`jaxdecode.models.adapters.nnx`: a Flax NNX model in the shape of flax's `examples/gemma`
(tests/nnx_models.py, a tiny random-weight one written here) through every loop.

References, never the adapter's own cache: the model's full forward pass without a cache, on
the whole sequence (greedy, beams through tests/reference.py's beam search, step logits);
`decode` itself for speculative decoding (bitwise its output by construction); a prompt alone
for the needle test (bitwise, by `batch_invariant`'s construction).
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode.models import ByteTokenizer
from jaxdecode.models import adapters as model_adapters

import nnx_models
import reference
from adapter_checks import bits, check_needle, check_speculative

TOK = ByteTokenizer()
CONTEXT = 64
NEW = 6
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", '{"ok": true}', "x y z"]
PROMPTS = ["hello", "the quick brown", "x"]


@pytest.fixture(scope="module")
def model():
  return nnx_models.TinyGemma()


@pytest.fixture(scope="module")
def plain(model):
  return model_adapters.nnx(model, max_positions=CONTEXT, tokenizer=TOK)


@pytest.fixture(scope="module")
def invariant(model):
  return model_adapters.nnx(model, max_positions=CONTEXT, tokenizer=TOK, batch_invariant=True)


@pytest.fixture(scope="module")
def forward(model):
  """The model's full forward pass (no cache) on one sequence right-padded to 32 tokens (the
  causal mask hides the padding): `ids -> float64 logits [len(ids), V]`."""
  graphdef, weights = nnx.split(model)
  run = jax.jit(lambda w, t: nnx_models.full_forward(nnx.merge(graphdef, w), t))
  return lambda ids: np.asarray(run(weights, jnp.asarray(
      [list(ids) + [TOK.PAD] * (32 - len(ids))], jnp.int32))[0, :len(ids)], np.float64)


# ---------------------------------------------------------------------------------------------
# Fast: no decode loop compiled.


class _TwoArguments(nnx_models.TinyGemma):

  def __call__(self, tokens, cache):  # pylint: disable=arguments-differ
    return super().__call__(tokens, tokens, cache, None)


class _SlotsFirst(nnx_models.TinyGemma):

  def init_cache(self, cache_size, batch_size, dtype=jnp.float32):
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1) if x.ndim > 1 else x,
                        super().init_cache(cache_size, batch_size, dtype))


def test_bad_input_is_refused_with_the_argument_named_before_compiling(model, plain):
  with pytest.raises(ValueError, match="model must be a flax.nnx.Module with init_cache.*got str"):
    model_adapters.nnx("gemma", max_positions=CONTEXT, eos_ids=[1])
  with pytest.raises(ValueError, match=r"model must be called as model\(last_tokens \[B, T\], "
                                       r"positions \[B, T\], cache, attention_mask.*TypeError"):
    model_adapters.nnx(_TwoArguments(layers=1), max_positions=CONTEXT, tokenizer=TOK)
  with pytest.raises(ValueError, match=r"init_cache\(cache_size=3, batch_size=2\) gave "
                                       r"\['layer_0'\]\['k'\] of shape \(3, 2, 2, 16\)"):
    model_adapters.nnx(_SlotsFirst(layers=1), max_positions=CONTEXT, tokenizer=TOK)
  with pytest.raises(ValueError, match="max_positions"):
    model_adapters.nnx(model, max_positions=0, tokenizer=TOK)
  with pytest.raises(ValueError, match="cache_dtype must be a float dtype.*got 'int8'"):
    model_adapters.nnx(model, max_positions=CONTEXT, tokenizer=TOK, cache_dtype="int8")
  with pytest.raises(ValueError, match="vocab_size"):
    model_adapters.nnx(model, max_positions=CONTEXT, tokenizer=TOK, vocab_size=300)
  with pytest.raises(ValueError, match="no EOS id.*give eos_ids="):
    model_adapters.nnx(model, max_positions=CONTEXT)
  with pytest.raises(ValueError, match=r"padding must be one of \['right', 'left'\]; got 'up'"):
    model_adapters.nnx(model, max_positions=CONTEXT, tokenizer=TOK, padding="up")
  with pytest.raises(ValueError, match="tokenizer must be models.ByteTokenizer"):
    model_adapters.nnx(model, max_positions=CONTEXT, tokenizer="bytes", eos_ids=[1])
  with pytest.raises(ValueError, match=r"cache_length must hold the prompts .* 9 <= "
                                       r"cache_length=8 <= 64 is false"):
    plain.prefill(np.ones((2, 9), np.int32), np.array([9, 3]), 8)
  with pytest.raises(ValueError, match="does not fit the model's context of 64 tokens"):
    jaxdecode.models.generate(["hello " * 12], model=plain, max_new_tokens=4)
  with pytest.raises(ValueError, match=r"model must be None .*models.adapters.nnx.* got "
                                       r"TinyGemma"):
    jaxdecode.models.generate(["hi"], model=model)


@pytest.mark.slow
def test_steps_at_each_rows_own_position_give_the_full_forwards_logits(forward, plain):
  """Two rows of different lengths, then two-token calls (drafts) at each row's own position;
  the third after row 0 rejected its last draft, in a cache so small that the call compacts
  the rows' slots. Every call's logits are the full forward's on the row's sequence so far
  (the cache's bookkeeping, checked against no cache at all)."""
  rows = [TOK.encode("hello"), TOK.encode("hi")]
  tokens, lengths = jaxdecode.right_pad(rows, pad_id=TOK.PAD, buckets=None)
  logits, state, positions = plain.prefill(tokens, lengths, 11)
  calls = [np.array([[104, 105], [33, 34]]), np.array([[1, 2], [4, 5]]),
           np.array([[7, 8], [9, 10]])]
  back = [0, 0, 1]  # row 0 rejects the last draft of the call before the last one
  for ids, row in zip(rows, np.asarray(logits)):
    np.testing.assert_allclose(row, forward(ids)[-1], rtol=1e-5, atol=1e-5)
  for call, rejected in zip(calls, back):
    positions = positions - np.array([rejected, 0])
    rows[0] = rows[0][:len(rows[0]) - rejected]
    logits, state = plain.step_fn(state, call, positions)
    for b in range(2):
      rows[b] = rows[b] + call[b].tolist()
      np.testing.assert_allclose(np.asarray(logits[b]), forward(rows[b])[-call.shape[1]:],
                                 rtol=1e-5, atol=1e-5)
    positions = positions + call.shape[1]
  assert plain.step_fn.position_limit(state) == 11


# ---------------------------------------------------------------------------------------------
# Slow: each compiles decode loops.


@pytest.mark.slow
def test_greedy_generate_equals_a_greedy_loop_over_the_full_forward(forward, plain):
  out = jaxdecode.models.generate(PROMPTS, model=plain, max_new_tokens=NEW,
                                  params=jaxdecode.SamplingParams(temperature=0.0))
  for row, prompt in enumerate(PROMPTS):
    ids, new = TOK.encode(prompt), []
    while len(new) < NEW and TOK.EOS not in new:
      new.append(int(np.argmax(forward(ids + new)[-1])))
    assert out.tokens[row, :out.lengths[row]].tolist() == new, prompt
    assert out.texts[row] == TOK.decode([t for t in new if t != TOK.EOS])


@pytest.mark.slow
def test_needle_bitwise_alone_and_in_batches_of_2_and_7_and_score_gives_its_log_probs(model,
                                                                                    invariant):
  """The needle under batch_invariant, its batches left-padded (the prompt at later cache slots
  than alone); then `jaxdecode.score(adapter.logits_fn, ...)` of the right-padded adapter on
  the batch of 7 (one whole-sequence pass) gives decode's processed log-probs bitwise."""
  left = model_adapters.nnx(model, max_positions=CONTEXT, tokenizer=TOK, batch_invariant=True,
                            padding="left")
  tokens, lengths, params, out = check_needle(left, TEXTS, NEW)
  scores = jaxdecode.score(invariant.logits_fn, tokens, lengths, out.tokens, params=params,
                           eos_ids=invariant.eos_ids, pad_id=invariant.pad_id)
  live = np.arange(NEW)[None, :] < np.asarray(out.lengths)[:, None]
  np.testing.assert_array_equal(bits(np.where(live, scores.processed, 0)),
                                bits(np.where(live, out.logprobs, 0)))


@pytest.mark.slow
def test_speculative_with_the_model_minus_its_last_layer_gives_decodes_bits(model, invariant):
  """A draft of the same family (the model's own weights less its last block): decode's tokens
  and log-probs bitwise, with rows accepting different numbers of drafts, and n = 2."""
  draft = model_adapters.nnx(nnx_models.without_last_layer(model), max_positions=CONTEXT,
                             tokenizer=TOK, batch_invariant=True)
  check_speculative(invariant, draft, PROMPTS)


@pytest.mark.slow
def test_best_beams_equal_a_beam_search_over_the_full_forward(forward, plain):
  """`generate(beam_size=3)` (the cache's rows gathered by `state_axes` as beams reorder)
  against tests/reference.py's beam search, whose every step is a full forward pass."""
  k, n = 3, 4
  out = jaxdecode.models.generate(PROMPTS[:2], model=plain, max_new_tokens=n, beam_size=k,
                                  num_return=2, params=jaxdecode.SamplingParams())
  for row, prompt in enumerate(PROMPTS[:2]):
    ids = TOK.encode(prompt)
    hyps, _, _ = reference.reference_beam_search(
        lambda new, ids=ids: reference.log_softmax64(forward(ids + list(new))[-1]),
        beam_size=k, max_new_tokens=n, eos_ids=(TOK.EOS,))
    for i, (score, toks) in enumerate(hyps[:2]):
      assert out.beams[row][i] == TOK.decode(list(toks))
      assert out.scores[row, i] == pytest.approx(score, rel=1e-5)


@pytest.mark.slow
def test_bf16_weights_keep_a_bf16_cache_and_a_step_past_a_full_cache_gives_nan():
  model = nnx_models.TinyGemma(layers=1, dtype=jnp.bfloat16)
  adapter = model_adapters.nnx(model, max_positions=CONTEXT, tokenizer=TOK)
  tokens, lengths = jaxdecode.right_pad([TOK.encode("hi"), TOK.encode("a")], pad_id=TOK.PAD,
                                        buckets=None)
  width = tokens.shape[1]
  logits, state, positions = adapter.prefill(tokens, lengths, width + 2)
  kv_dtypes = {x.dtype for x in jax.tree.leaves(state["cache"]) if x.ndim > 1}
  assert kv_dtypes == {jnp.dtype(jnp.bfloat16)}
  assert logits.dtype == jnp.bfloat16 and adapter.step_fn.position_limit(state) == width + 2
  with pytest.raises(ValueError, match="max_new_tokens=4 does not fit the model state"):
    jaxdecode.decode(adapter.step_fn, state, logits, key=jax.random.key(0), max_new_tokens=4,
                     positions=positions, params=jaxdecode.SamplingParams())
  for _ in range(2):  # the two free slots
    logits, state = adapter.step_fn(state, jnp.zeros(2, jnp.int32), positions)
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    positions = positions + 1
  logits, _ = adapter.step_fn(state, jnp.zeros(2, jnp.int32), positions)
  assert np.isnan(np.asarray(logits, np.float32)).all()


@pytest.mark.slow
def test_json_schema_and_a_regex_through_the_byte_tokenizer(plain):
  """Structured output through the adapter (the tokenizer's `vocabulary()`): every row's text
  parses and matches its schema, or its regex, under sampling."""
  schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
  out = jaxdecode.models.generate(PROMPTS[:2], model=plain, max_new_tokens=16,
                                  json_schema=schema, n=2, seed=4,
                                  params=jaxdecode.SamplingParams(temperature=1.5))
  assert out.finished.all(), out.texts
  for text in out.texts:
    assert set(json.loads(text)) == {"ok"} and isinstance(json.loads(text)["ok"], bool)
  dates = jaxdecode.models.generate(PROMPTS, model=plain, max_new_tokens=12, seed=5,
                                    regex=r"20[0-9]{2}-[01][0-9]")
  assert dates.finished.all() and all(re.fullmatch(r"20[0-9]{2}-[01][0-9]", t)
                                      for t in dates.texts), dates.texts
