"""Sharded decoding with JAX's own SPMD: the batch split over a device mesh, same tokens as one device.

Run on CPU with 8 simulated devices:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded_decode.py
On a GPU/TPU host it uses the real devices. `decode` needs no change: put the inputs on a
`NamedSharding` over a "data" mesh axis and jit propagates it through the loop.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxdecode

VOCAB, DIM = 64, 32


def make_model(seed=0):
  """A tiny recurrent language model: state = hidden vector per row (any pytree works)."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  weights = {"embed": jax.random.normal(k1, (VOCAB, DIM)) * 0.5,
             "mix": jax.random.normal(k2, (DIM, DIM)) / jnp.sqrt(DIM),
             "out": jax.random.normal(k3, (DIM, VOCAB)) * 2 / jnp.sqrt(DIM)}

  def step_fn(state, tokens, positions):  # state: (weights, hidden [B, D])
    w, h = state
    h = jnp.tanh(h @ w["mix"] + w["embed"][tokens] + 0.01 * positions[:, None])
    return h @ w["out"], (w, h)

  return weights, step_fn


def main(batch: int = 16, max_new_tokens: int = 32) -> None:
  weights, step_fn = make_model()
  prompts = [[int(t) for t in np.random.default_rng(r).integers(0, VOCAB, 1 + r % 5)]
             for r in range(batch)]
  # Prefill: run each prompt through the step function (a real model does this in one pass).
  tokens, lengths = jaxdecode.left_pad(prompts, buckets=None)
  positions = jaxdecode.prompt_positions(lengths, tokens.shape[1])
  mask = jaxdecode.prompt_mask(lengths, tokens.shape[1])
  state, logits = (weights, jnp.zeros((batch, DIM))), jnp.zeros((batch, VOCAB))
  for col in range(tokens.shape[1]):
    new_logits, new_state = step_fn(state, tokens[:, col], positions[:, col])
    keep = mask[:, col][:, None]
    state = (weights, jnp.where(keep, new_state[1], state[1]))  # padding leaves a row untouched
    logits = jnp.where(keep, new_logits, logits)

  params = jaxdecode.SamplingParams(temperature=0.8, top_p=0.9)
  keys = jax.random.split(jax.random.key(0), batch)  # one key per row: placement-independent
  kwargs = dict(key=keys, params=params, max_new_tokens=max_new_tokens, positions=lengths)
  single = jaxdecode.decode(step_fn, state, logits, **kwargs)

  mesh = Mesh(np.array(jax.devices()), ("data",))
  rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  sharded_state = (jax.device_put(weights, replicated), jax.device_put(state[1], rows))
  out = jaxdecode.decode(step_fn, sharded_state, jax.device_put(logits, rows),
                         key=jax.device_put(keys, rows), params=params,
                         max_new_tokens=max_new_tokens, positions=jax.device_put(lengths, rows))
  same = bool(np.array_equal(out.tokens, single.tokens))
  print(f"devices: {jax.device_count()} ({jax.devices()[0].platform}); batch {batch} sharded as "
        f"{out.tokens.sharding.spec}; tokens identical to one device: {same}")
  print("row 0:", out.tokens[0].tolist())
  if not same:
    raise SystemExit("sharded decoding differed from one device")


if __name__ == "__main__":
  main()
