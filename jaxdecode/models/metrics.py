"""Model-based metrics for the embedded transformer: its raw logits at every generated step.

The metrics themselves (`jaxdecode.metrics`) take any model's logits; this computes them for a
`jaxdecode.models.Transformer` by teacher forcing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdecode.models.transformer import forward


def teacher_forced_logits(model, prompt_tokens, prompt_lengths, new_tokens) -> jax.Array:
  """The model's raw logits at every generated step, by one full pass (teacher forcing).

  Each row's sequence `prompt + new_tokens` goes through `forward` (the inference pass, so with
  the default numerics these are bitwise the logits the decode loop saw); `logits[b, t]` is the
  distribution the model gave `new_tokens[b, t]`. Tokens after a row's EOS (padding) only follow
  the row's real tokens, so by causality they change none of its valid logits.

  Args:
    model: a `jaxdecode.models.Transformer`.
    prompt_tokens: int32 `[B, T]` right-padded prompts (`jaxdecode.right_pad`).
    prompt_lengths: int32 `[B]` real prompt tokens per row (1..T).
    new_tokens: int32 `[B, N]` generated tokens (e.g. `Generation.tokens`); `T + N` must be at
      most the model's `max_len`.

  Returns:
    float32 `[B, N, V]`.
  """
  batch, width = jnp.shape(prompt_tokens)
  if jnp.ndim(new_tokens) != 2 or jnp.shape(new_tokens)[0] != batch:
    raise ValueError(f"new_tokens must have shape ({batch}, N), one row per prompt; got "
                     f"{jnp.shape(new_tokens)}")
  steps = jnp.shape(new_tokens)[1]
  graphdef, weights = nnx.split(model)
  lengths = jnp.asarray(prompt_lengths, jnp.int32)
  new_tokens = jnp.asarray(new_tokens, jnp.int32)
  # Row b: its prompt's real tokens, then its new tokens (right-padded to T + N).
  column = jnp.arange(width + steps, dtype=jnp.int32)[None, :]  # [1, T + N]
  prompt_part = jnp.pad(jnp.asarray(prompt_tokens, jnp.int32), ((0, 0), (0, steps)))
  new_part = jnp.take_along_axis(new_tokens, jnp.clip(column - lengths[:, None], 0, steps - 1),
                                 axis=1)
  sequence = jnp.where(column < lengths[:, None], prompt_part, new_part)
  logits = forward(graphdef, weights, sequence, lengths + steps)  # [B, T + N, V]
  at = lengths[:, None] - 1 + jnp.arange(steps, dtype=jnp.int32)[None, :]  # [B, N]
  return jnp.take_along_axis(logits, at[:, :, None], axis=1)
