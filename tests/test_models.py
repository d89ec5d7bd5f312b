"""The small transformer, its KV cache and the byte tokenizer.

The cache tests compare decoding through the cache with one full forward pass; the full forward
is itself compared with a plain NumPy re-implementation of the model.
"""

import dataclasses
import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdecode.prompts import right_pad
from jaxdecode.models import ByteTokenizer
from jaxdecode.models import DecodeState
from jaxdecode.models import KVCache
from jaxdecode.models import Transformer
from jaxdecode.models import TransformerConfig
from jaxdecode.models import forward
from jaxdecode.models import init_cache
from jaxdecode.models import make_step_fn
from jaxdecode.models import prefill
from jaxdecode.models import tokenizer as tokenizer_module
from jaxdecode.models import transformer as transformer_module

TINY = TransformerConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=64)
ATOL = 1e-5

# Most tests share these shapes so that each jitted program compiles once for the whole file.
LENGTHS = [3, 7, 1, 5]  # the prompts, right-padded to WIDTH
WIDTH = 8
NEW = 6  # continuation tokens fed one at a time
CACHE = WIDTH + NEW


def random_prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def model():
  return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def split(model):
  return nnx.split(model)


@pytest.fixture(scope="module")
def step_fn(split):
  return make_step_fn(split[0])


@pytest.fixture(scope="module")
def batch():
  """`(tokens int32[4, WIDTH], lengths int32[4], continuation int32[4, NEW])`."""
  tokens, lengths = right_pad(random_prompts(LENGTHS), width=WIDTH)
  continuation = jnp.asarray(np.random.default_rng(1).integers(0, 259, (4, NEW)), jnp.int32)
  return tokens, lengths, continuation


def sequences(batch):
  """Each prompt followed by its continuation, right-padded: `(tokens [4, T + N], lengths)`."""
  tokens, lengths, continuation = batch
  rows = [list(p) + continuation[r].tolist() for r, p in enumerate(random_prompts(LENGTHS))]
  return right_pad(rows, width=WIDTH + NEW)


def full_forward(graphdef, weights, batch):
  """Reference logits `[4, NEW + 1, V]` of every step, from the full pass over prompt +
  continuation: row b's step n is its column lengths[b] - 1 + n."""
  seq, seq_lengths = sequences(batch)
  logits = forward(graphdef, weights, seq, seq_lengths)
  at = batch[1][:, None] - 1 + jnp.arange(NEW + 1)[None, :]
  return jnp.take_along_axis(logits, at[:, :, None], axis=1)


# ---------------------------------------------------------------- the cache equals the full pass


@pytest.mark.slow
def test_cached_decoding_matches_full_forward_at_every_step_bit_for_bit(split, step_fn, batch):
  graphdef, weights = split
  tokens, lengths, continuation = batch
  full = full_forward(graphdef, weights, batch)  # [B, N + 1, V]
  logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=CACHE)
  np.testing.assert_array_equal(logits, full[:, 0])
  for n in range(NEW):
    logits, state = step_fn(state, continuation[:, n], lengths + n)
    np.testing.assert_array_equal(logits, full[:, n + 1], err_msg=f"step {n}")


@pytest.mark.slow
def test_a_k_token_step_equals_k_single_steps_bit_for_bit(split, step_fn, batch):
  graphdef, weights = split
  tokens, lengths, continuation = batch
  _, state = prefill(graphdef, weights, tokens, lengths, cache_length=CACHE)
  singles, s = [], state
  for n in range(NEW):
    logits, s = step_fn(s, continuation[:, n], lengths + n)
    singles.append(logits)
  many, _ = step_fn(state, continuation[:, :4], lengths)  # 4 tokens in one call
  np.testing.assert_array_equal(many, jnp.stack(singles[:4], axis=1))
  rest, _ = step_fn(_, continuation[:, 4:], lengths + 4)  # ... then the next 2 in one call
  np.testing.assert_array_equal(rest, jnp.stack(singles[4:], axis=1))


@pytest.mark.slow
def test_step_fn_inside_lax_scan_matches_full_forward(split, step_fn, batch):
  """The way `jaxdecode.decode` calls it: jitted, with the state as the scan carry."""
  graphdef, weights = split
  tokens, lengths, continuation = batch
  _, state = prefill(graphdef, weights, tokens, lengths, cache_length=CACHE)

  def body(carry, token):
    state, position = carry
    logits, state = step_fn(state, token, position)
    return (state, position + 1), logits

  _, logits = jax.jit(lambda s: jax.lax.scan(body, (s, lengths), continuation.T))(state)
  np.testing.assert_array_equal(jnp.swapaxes(logits, 0, 1),
                                full_forward(graphdef, weights, batch)[:, 1:])


@pytest.mark.slow
def test_a_row_is_rolled_back_by_its_position_alone(split, step_fn, batch):
  graphdef, weights = split
  tokens, lengths, continuation = batch
  _, state = prefill(graphdef, weights, tokens, lengths, cache_length=CACHE)
  reference, _ = step_fn(state, continuation[:, :3], lengths)
  # Write junk at the next positions, then step again from the old positions: same logits.
  junk = jnp.full((4, 3), 7, jnp.int32)
  _, dirty = step_fn(state, junk, lengths)
  again, _ = step_fn(dirty, continuation[:, :3], lengths)
  np.testing.assert_array_equal(again, reference)


def test_prefill_returns_weights_and_a_cache_with_room_for_the_requested_length(split, batch):
  graphdef, weights = split
  tokens, lengths, _ = batch
  _, state = prefill(graphdef, weights, tokens, lengths, cache_length=CACHE)
  assert isinstance(state, DecodeState) and isinstance(state.cache, KVCache)
  assert len(state.cache.k) == 2 == len(state.cache.v)
  assert state.cache.k[0].shape == (4, 64, 2, 16)  # rounded up to the 64-slot attention chunk
  assert jax.tree.structure(state.weights) == jax.tree.structure(weights)
  np.testing.assert_array_equal(state.cache.k[0][:, WIDTH:], 0)  # slots past the prompt: empty


@pytest.mark.slow
def test_positions_past_the_cache_or_max_len_give_nan_and_write_nothing(split, step_fn, batch):
  graphdef, weights = split
  tokens, lengths, _ = batch
  small = Transformer(dataclasses.replace(TINY, max_len=16), rngs=nnx.Rngs(0))
  graphdef16, weights16 = nnx.split(small)
  _, state = prefill(graphdef16, weights16, tokens, lengths, cache_length=CACHE)
  logits, new_state = make_step_fn(graphdef16)(state, jnp.array([5, 5, 5, 5], jnp.int32),
                                               jnp.array([8, 16, 2, 70], jnp.int32))
  # Position 16 is max_len (RoPE untrained there): NaN; 70 is past the 64 slots: NaN, unwritten.
  assert np.isfinite(logits[0::2]).all() and np.isnan(logits[1::2]).all()
  for old, new in zip(state.cache.k, new_state.cache.k):
    changed = np.any(np.asarray(new) != np.asarray(old), axis=(2, 3))  # [B, S]
    expected = np.zeros_like(changed)
    expected[0, 8] = expected[1, 16] = expected[2, 2] = True
    np.testing.assert_array_equal(changed, expected)


def test_init_cache_is_empty_and_rounded_up_to_the_attention_chunk():
  cache = init_cache(TINY, batch_size=3, length=65)
  assert [k.shape for k in cache.k] == [(3, 128, 2, 16)] * 2
  np.testing.assert_array_equal(cache.k[0], 0)


# ------------------------------------------------------------------------- the full forward pass


def numpy_reference(model, ids):
  """Logits `[T, V]` of one unpadded sequence, computed in float64 NumPy from the weights."""
  c = model.config
  embedding = np.asarray(model.embed.embedding[...], np.float64)
  x = embedding[np.asarray(ids)]  # [T, D]
  width, half = len(ids), c.head_dim // 2
  angle = np.arange(width)[:, None] * c.rope_base ** (-2.0 * np.arange(half) / c.head_dim)
  cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # [T, 1, Dh/2]

  def rope(a):  # [T, H, Dh]
    return np.concatenate([a[..., :half] * cos - a[..., half:] * sin,
                           a[..., half:] * cos + a[..., :half] * sin], axis=-1)

  def rms_norm(a, norm):
    return a / np.sqrt(np.mean(a**2, axis=-1, keepdims=True) + 1e-6) * np.asarray(norm.scale[...])

  def gelu(a):  # the tanh approximation, jax.nn.gelu's default
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))

  def linear(a, layer):
    out = a @ np.asarray(layer.kernel[...], np.float64)
    return out if layer.bias is None else out + np.asarray(layer.bias[...])

  future = np.triu(np.ones((width, width), bool), k=1)
  for block in model.blocks:
    qkv = linear(rms_norm(x, block.attention_norm), block.attention.qkv)
    q, k, v = np.split(qkv.reshape(width, 3, c.n_heads, c.head_dim), 3, axis=1)
    q, k, v = rope(q[:, 0]), rope(k[:, 0]), v[:, 0]
    scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(c.head_dim)
    scores[:, future] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    heads = np.einsum("hts,shd->thd", probs, v).reshape(width, c.d_model)
    x = x + linear(heads, block.attention.out)
    x = x + linear(gelu(linear(rms_norm(x, block.mlp_norm), block.mlp_in)), block.mlp_out)
  return rms_norm(x, model.final_norm) @ embedding.T


@pytest.mark.slow
def test_forward_matches_numpy_reference(model, split, batch):
  tokens, lengths, _ = batch
  logits = forward(*split, tokens, lengths)
  for row, prompt in enumerate(random_prompts(LENGTHS)):
    np.testing.assert_allclose(logits[row, :len(prompt)], numpy_reference(model, prompt),
                               atol=1e-4, rtol=0, err_msg=f"row {row}")


def test_training_pass_matches_the_inference_pass(model, split, batch):
  """`Transformer.__call__` (plain, no cache: training) against `forward` (the cache path)."""
  seq, seq_lengths = sequences(batch)
  train = jax.jit(lambda w, t: nnx.merge(split[0], w)(t))(split[1], seq)
  np.testing.assert_allclose(train, forward(*split, seq, seq_lengths), atol=ATOL, rtol=0)


def test_forward_is_causal(split, batch):
  tokens, lengths, _ = batch
  changed = tokens.at[1, 4].set((tokens[1, 4] + 1) % 256)  # row 1: 7 tokens
  before, after = forward(*split, tokens, lengths), forward(*split, changed, lengths)
  np.testing.assert_array_equal(before[1, :4], after[1, :4])
  assert (np.abs(before[1, 4:7] - after[1, 4:7]).max(axis=-1) > 1e-3).all()


def test_padding_values_do_not_change_real_logits(split, batch):
  tokens, lengths, _ = batch
  repadded = tokens.at[0, 3:].set(jnp.array([9, 99, 199, 256, 258], jnp.int32))  # row 0: 5 pads
  before, after = forward(*split, tokens, lengths), forward(*split, repadded, lengths)
  np.testing.assert_array_equal(before[0, :3], after[0, :3])
  np.testing.assert_array_equal(before[1:], after[1:])


def test_rope_makes_attention_scores_depend_only_on_relative_positions():
  from jaxdecode.models import numerics
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 6, 2, 16)), jnp.float32) for _ in range(2))
  positions = jnp.arange(6, dtype=jnp.int32)[None, :]

  def scores(shift):
    rq = numerics.rope(q, positions + shift, 10000.0)
    rk = numerics.rope(k, positions + shift, 10000.0)
    return jnp.einsum("bthd,bshd->bhts", rq, rk)

  np.testing.assert_allclose(scores(0), scores(11), atol=1e-4, rtol=0)
  # ...but positions do matter: the scores are not those of unrotated vectors.
  assert not np.allclose(scores(0), jnp.einsum("bthd,bshd->bhts", q, k), atol=1e-3)


# -------------------------------------------------------------------------- tracing and jitting


@pytest.mark.slow
def test_step_fn_traces_once_for_new_tokens_positions_and_weights(split, step_fn, batch):
  graphdef, weights = split
  tokens, lengths, continuation = batch
  _, state = prefill(graphdef, weights, tokens, lengths, cache_length=CACHE)
  traces = []

  def counted(state, tokens, positions):
    traces.append(None)
    return step_fn(state, tokens, positions)

  jitted = jax.jit(counted)
  jitted(state, jnp.array([1, 2, 3, 4], jnp.int32), lengths)
  jitted(state, jnp.array([200, 7, 0, 258], jnp.int32), lengths + 1)

  # New weights are data too: the same program, and results that follow the new weights.
  new_weights = jax.tree.map(lambda w: w * 1.5, weights)
  _, new_state = prefill(graphdef, new_weights, tokens, lengths, cache_length=CACHE)
  logits, _ = jitted(new_state, continuation[:, 0], lengths)
  assert len(traces) == 1
  np.testing.assert_array_equal(logits, full_forward(graphdef, new_weights, batch)[:, 1])
  # Without the blocks prefill made (as after `state.replace(weights=..., blocks=None)`), each
  # step makes them from the weights: the same bits.
  swapped = new_state.replace(blocks=None)
  np.testing.assert_array_equal(step_fn(swapped, continuation[:, 0], lengths)[0], logits)


def test_step_fn_rejects_mismatched_shapes(split, step_fn, batch):
  tokens, lengths, _ = batch
  _, state = prefill(*split, tokens, lengths, cache_length=CACHE)
  with pytest.raises(ValueError, match=r"shape \(4,\) or \(4, K\).*\(3,\) / \(4,\)"):
    step_fn(state, jnp.array([1, 2, 3], jnp.int32), lengths)


# ------------------------------------------------------------------------------- bad arguments


def test_prefill_rejects_a_cache_shorter_than_the_prompt_or_longer_than_max_len(split):
  tokens, lengths = right_pad(random_prompts([5]), buckets=None)
  with pytest.raises(ValueError, match=r"cache_length.*5 <= 4 <= 64"):
    prefill(*split, tokens, lengths, cache_length=4)
  with pytest.raises(ValueError, match=r"cache_length.*5 <= 65 <= 64"):
    prefill(*split, tokens, lengths, cache_length=65)


def test_prefill_and_forward_reject_bad_lengths_and_token_ids(split):
  tokens, lengths = right_pad(random_prompts([5, 2]), buckets=None)
  with pytest.raises(ValueError, match=r"lengths must be in \[1, T = 5\]; got \[5, 0\]"):
    prefill(*split, tokens, jnp.array([5, 0], jnp.int32), cache_length=8)
  with pytest.raises(ValueError, match=r"lengths must have shape \(2,\)"):
    forward(*split, tokens, jnp.array([5], jnp.int32))
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 259\); got: min 0 / max 300"):
    forward(*split, tokens.at[0, 0].set(300), lengths)
  with pytest.raises(ValueError, match=r"tokens must be an integer array \[B, T\]"):
    forward(*split, tokens[0], lengths)


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=30, n_heads=4), r"divisible by n_heads; got: 30 / 4"),
    (dict(d_model=12, n_heads=4), r"must be even for RoPE; got: 12 / 4 = 3"),
    (dict(n_layers=0), r"n_layers must be an integer >= 1; got 0"),
    (dict(vocab_size=2.5), r"vocab_size must be an integer >= 1; got 2.5"),
    (dict(max_len=True), r"max_len must be an integer >= 1; got True"),
    (dict(rope_base=float("nan")), r"rope_base must be a number > 1; got nan"),
])
def test_config_rejects_bad_sizes(kwargs, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig(**kwargs)


def test_default_config_is_valid_and_hashable():
  config = TransformerConfig()
  assert config.head_dim == 64 and config.vocab_size == ByteTokenizer.vocab_size
  assert hash(config) == hash(TransformerConfig())


# ---------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", [
    "", "hello, world", "你好，世界", "emoji 🎉🚀 and e\u0301", "line\nbreak\ttab\x00nul",
    "mixed 中文 ascii 😀",
])
def test_tokenizer_round_trips_utf8(text):
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert ids[0] == tok.BOS and ids[1:] == list(text.encode("utf-8"))
  assert tok.decode(ids) == text
  assert tok.decode(tok.encode(text, bos=False)) == text
  assert tok.decode_bytes(ids) == text.encode("utf-8")


def test_tokenizer_chinese_characters_are_three_bytes_each():
  assert ByteTokenizer().encode("中文", bos=False) == [0xE4, 0xB8, 0xAD, 0xE6, 0x96, 0x87]


def test_tokenizer_special_ids_and_decode_drops_them():
  tok = ByteTokenizer()
  assert (tok.BOS, tok.EOS, tok.PAD, tok.vocab_size) == (256, 257, 258, 259)
  assert tok.special_ids == (256, 257, 258)
  assert tok.decode([258, 258, 256, 104, 105, 257, 258]) == "hi"
  assert tok.decode(np.array([256, 104, 105], np.int32)) == "hi"
  assert tok.decode(jnp.array([104, 105, 257], jnp.int32)) == "hi"
  assert tok.decode([]) == ""


def test_tokenizer_decodes_a_cut_character_to_the_replacement_character():
  tok = ByteTokenizer()
  ids = tok.encode("ab中", bos=False)[:-1]  # the last character loses its final byte
  assert tok.decode(ids) == "ab\ufffd"


@pytest.mark.parametrize("text", [b"bytes", 5, None, ["a"]])
def test_tokenizer_encode_rejects_non_strings(text):
  with pytest.raises(ValueError, match=r"text must be a str; got " + type(text).__name__):
    ByteTokenizer().encode(text)


@pytest.mark.parametrize("ids, message", [
    ([104, 259], r"ids\[1\] = 259 is out of range; token ids must be in \[0, 259\)"),
    ([-1], r"ids\[0\] = -1 is out of range"),
    ([1.5], r"ids must be a 1-D sequence of ints in \[0, 259\); got shape \(1,\) of dtype float"),
    ([[1, 2]], r"got shape \(1, 2\)"),
    ("abc", r"ids must be a sequence of ints in \[0, 259\); got str"),
])
def test_tokenizer_decode_rejects_bad_ids(ids, message):
  with pytest.raises(ValueError, match=message):
    ByteTokenizer().decode(ids)


@pytest.mark.parametrize("module", [tokenizer_module, transformer_module],
                         ids=lambda m: m.__name__)
@pytest.mark.slow
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


def test_load_default_and_load_draft_hand_out_modules_of_their_own():
  """Training or assigning into the model you got changes nothing for the next caller: the
  weights are cached, never the module (nor the metadata dict)."""
  from jaxdecode import models
  for load in (lambda: models.load_default()[0], models.load_draft):
    mine = load()
    param = next(v for _, v in nnx.iter_graph(mine) if isinstance(v, nnx.Param))
    before = np.asarray(param[...]).copy()
    param[...] = param[...] * 0 + 7.0  # in place, as an optimizer update is
    fresh = next(v for _, v in nnx.iter_graph(load()) if isinstance(v, nnx.Param))
    np.testing.assert_array_equal(np.asarray(fresh[...]), before)
    assert float(np.asarray(param[...]).ravel()[0]) == 7.0
  meta = models.default_metadata()
  meta["tampered"] = True
  assert "tampered" not in models.default_metadata()
