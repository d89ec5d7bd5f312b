"""A toy language model with exact logits, for testing the decode loop.

Its state is one integer per row, a hash of the row's tokens and positions so far; the next-token
logits are a row of a fixed random table picked by that hash. Every logit is an exact table entry,
so the same history gives bit-identical logits in any batch, slot or sharding.
"""

import jax.numpy as jnp
import numpy as np

TABLE_ROWS = 997


def table(vocab, seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(TABLE_ROWS, vocab)) * 2, jnp.float32)


def _mix(h, token, position):
  return (h * 31 + token * 7 + position + 1) % TABLE_ROWS


def prefill(table, prompts):
  """(logits [B, V], state {'h': int32[B], 'calls': int32[]}, positions int32[B])."""
  hs = []
  for prompt in prompts:
    h = 0
    for position, token in enumerate(prompt):
      h = _mix(h, token, position)
    hs.append(h)
  h = jnp.asarray(hs, jnp.int32)
  state = {"h": h, "calls": jnp.zeros((), jnp.int32)}
  return table[h], state, jnp.asarray([len(p) for p in prompts], jnp.int32)


def make_step(table):
  def step(state, tokens, positions):
    h = _mix(state["h"], tokens, positions)
    return table[h], {"h": h, "calls": state["calls"] + 1}
  return step


# A cached variant: the state keeps the hash after every position (slot p: after the token at
# position p), like a KV cache, so a call can take K tokens per row and a row is rolled back by
# its position alone (stale slots beyond it are never read).


def prefill_cached(table, prompts, slots):
  """(logits [B, V], state {'h': int32[B, slots], 'calls': int32[]}, positions int32[B])."""
  h = np.zeros((len(prompts), slots), np.int32)
  for row, prompt in enumerate(prompts):
    value = 0
    for position, token in enumerate(prompt):
      value = _mix(value, token, position)
      h[row, position] = value
  lengths = np.array([len(p) for p in prompts])
  last = h[np.arange(len(prompts)), lengths - 1]
  state = {"h": jnp.asarray(h), "calls": jnp.zeros((), jnp.int32)}
  return table[jnp.asarray(last)], state, jnp.asarray(lengths, jnp.int32)


def make_cached_step(table):
  """step(state, tokens [B] or [B, K], positions [B]) -> (logits [B, V] or [B, K, V], state)."""
  def step(state, tokens, positions):
    single = tokens.ndim == 1
    tokens = tokens[:, None] if single else tokens
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    h = state["h"]
    value = h[rows, jnp.maximum(positions - 1, 0)] * (positions > 0)  # the hash before the call
    logits = []
    for j in range(tokens.shape[1]):
      value = _mix(value, tokens[:, j], positions + j)
      h = h.at[rows, positions + j].set(value, mode="drop")
      logits.append(table[value])
    logits = jnp.stack(logits, axis=1)
    return (logits[:, 0] if single else logits), {"h": h, "calls": state["calls"] + 1}
  return step


def bigram_table(vocab, seed=0, peak=6.0):
  """A bigram model's logits table [V, V]: each token prefers one successor (greedy text
  cycles, so prompt lookup predicts it) with some mass elsewhere."""
  rng = np.random.default_rng(seed)
  table = rng.normal(size=(vocab, vocab))
  table[np.arange(vocab), rng.permutation(vocab)] += peak
  return jnp.asarray(table, jnp.float32)


def prefill_bigram(table, prompts, slots):
  """(logits [B, V], state {'tokens': int32[B, slots]}, positions int32[B]) of a bigram model
  whose cache keeps the token at every position."""
  cache = np.zeros((len(prompts), slots), np.int32)
  for row, prompt in enumerate(prompts):
    cache[row, :len(prompt)] = prompt
  last = jnp.asarray([p[-1] for p in prompts])
  return table[last], {"tokens": jnp.asarray(cache)}, jnp.asarray([len(p) for p in prompts])


def make_bigram_step(table):
  """step(state, tokens [B] or [B, K], positions [B]): logits after each token = table[token]."""
  def step(state, tokens, positions):
    single = tokens.ndim == 1
    tokens = tokens[:, None] if single else tokens
    rows = jnp.arange(tokens.shape[0])[:, None]
    at = positions[:, None] + jnp.arange(tokens.shape[1])[None, :]
    cache = state["tokens"].at[rows, at].set(tokens, mode="drop")
    logits = table[tokens]
    return (logits[:, 0] if single else logits), {"tokens": cache}
  return step
