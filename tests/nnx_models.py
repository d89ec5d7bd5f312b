"""A tiny Flax NNX language model in the shape of flax's `examples/gemma` transformer, written
here (nothing downloaded) for `jaxdecode.models.adapters.nnx`'s tests.

The shape that matters: `model(last_tokens [B, T], positions [B, T], cache, attention_mask
[B, T, S]) -> (logits [B, T, V], new_cache)`, and `model.init_cache(cache_size, batch_size,
dtype)` giving per layer `{"k", "v": [B, S, heads, head_dim], "end_index": int32[B]}`. As in
examples/gemma, every row of a call is written at one shared slot, `end_index[0] % S`, and
`end_index` moves on by T; with `cache=None` the call attends over its own T tokens only (the
full forward the tests use as their reference).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

MASKED = -2.3819763e38  # examples/gemma's K_MASK: a finite "minus infinity"


def rope(x, positions, base=10_000.0):
  """Rotary embedding of x [B, T, N, H] at positions [B, T] (examples/gemma's halves)."""
  half = x.shape[-1] // 2
  timescale = base ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
  angle = positions[..., None, None].astype(jnp.float32) / timescale[None, None, None, :]
  first, second = x[..., :half], x[..., half:]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return out.astype(x.dtype)


class RMSNorm(nnx.Module):

  def __init__(self, width, dtype):
    self.scale = nnx.Param(jnp.zeros((width,), dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    scale = 1.0 + self.scale[...].astype(jnp.float32)
    return (x32 * scale.reshape((1,) * (x.ndim - 1) + (-1,))).astype(x.dtype)


class Attention(nnx.Module):
  """Multi-head attention over a KV cache written at the shared index `end_index[0]`."""

  def __init__(self, width, heads, head_dim, dtype, rngs):
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype,
                                     rngs=rngs)
    self.heads, self.head_dim = heads, head_dim
    self.q, self.k, self.v = (linear(width, heads * head_dim) for _ in range(3))
    self.out = linear(heads * head_dim, width)

  def __call__(self, x, positions, cache, mask):
    batch, width, _ = x.shape
    split = lambda y: y.reshape(batch, width, self.heads, self.head_dim)
    q = rope(split(self.q(x)), positions) * self.head_dim ** -0.5
    k, v = rope(split(self.k(x)), positions), split(self.v(x))
    if cache is not None:  # the cache is left aligned; every row is written at row 0's index
      start = (0, cache["end_index"][0] % cache["k"].shape[1], 0, 0)
      k = lax.dynamic_update_slice(cache["k"], k, start)
      v = lax.dynamic_update_slice(cache["v"], v, start)
    logits = jnp.einsum("BTNH,BSNH->BTNS", q, k)
    logits = jnp.where(mask[:, :, None, :], logits, MASKED)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = self.out(jnp.einsum("BTNS,BSNH->BTNH", probs, v).reshape(batch, width, -1))
    if cache is None:
      return None, out
    return {"k": k, "v": v, "end_index": cache["end_index"] + width}, out


class Block(nnx.Module):

  def __init__(self, width, heads, head_dim, hidden, dtype, rngs):
    self.attention_norm, self.mlp_norm = RMSNorm(width, dtype), RMSNorm(width, dtype)
    self.attention = Attention(width, heads, head_dim, dtype, rngs)
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype,
                                     rngs=rngs)
    self.gate, self.up, self.down = linear(width, hidden), linear(width, hidden), linear(
        hidden, width)

  def __call__(self, x, positions, cache, mask):
    cache, attended = self.attention(self.attention_norm(x), positions, cache, mask)
    x = x + attended
    h = self.mlp_norm(x)
    return cache, x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))


class TinyGemma(nnx.Module):
  """Embedding (tied output), `layers` blocks, final norm: flax's examples/gemma in small."""

  def __init__(self, vocab=259, width=32, layers=2, heads=2, head_dim=16, hidden=64, *,
               dtype=jnp.float32, seed=0):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab, width, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.layers = nnx.List([Block(width, heads, head_dim, hidden, dtype, rngs)
                            for _ in range(layers)])
    self.final_norm = RMSNorm(width, dtype)
    self.heads, self.head_dim = heads, head_dim

  def __call__(self, last_tokens, positions, cache, attention_mask):
    x = self.embed(last_tokens) * jnp.sqrt(jnp.float32(self.embed.features)).astype(
        self.embed.dtype)
    new_cache = None if cache is None else {}
    for i, layer in enumerate(self.layers):
      name = f"layer_{i}"
      layer_cache, x = layer(x, positions, None if cache is None else cache[name],
                             attention_mask)
      if cache is not None:
        new_cache[name] = layer_cache
    return self.embed.attend(self.final_norm(x)), new_cache

  def init_cache(self, cache_size, batch_size, dtype=jnp.float32):
    shape = (batch_size, cache_size, self.heads, self.head_dim)
    return {f"layer_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                           "end_index": jnp.zeros((batch_size,), jnp.int32)}
            for i in range(len(self.layers))}


def without_last_layer(model):
  """A draft of the same family: `model`'s own weights, minus its last block."""
  draft = nnx.clone(model)
  draft.layers = nnx.List(list(draft.layers)[:-1])
  return draft


def full_forward(model, tokens):
  """The model on whole sequences, no cache (the reference): logits [B, T, V] under a causal
  mask."""
  tokens = jnp.asarray(tokens, jnp.int32)
  batch, width = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  causal = jnp.tril(jnp.ones((width, width), bool))
  return model(tokens, positions, None, jnp.broadcast_to(causal, (batch, width, width)))[0]
