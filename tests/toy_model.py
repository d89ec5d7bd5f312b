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
