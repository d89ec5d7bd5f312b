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
  """The model's raw logits at every generated step, by one full forward pass (teacher forcing).

  The sequence `prompt + new_tokens` of every row goes through `forward`;
  `logits[b, t]` is the distribution the model gave the token `new_tokens[b, t]` (the column
  before it). Tokens after a row's EOS (padding) only follow the row's real tokens, so by
  causality they change none of its valid logits.

  Args:
    model: a `jaxdecode.models.Transformer`.
    prompt_tokens: int32 `[B, T]` left-padded prompts (`jaxdecode.left_pad`).
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
  sequence = jnp.concatenate([jnp.asarray(prompt_tokens, jnp.int32),
                              jnp.asarray(new_tokens, jnp.int32)], axis=1)  # [B, T + N]
  logits = forward(graphdef, weights, sequence, jnp.asarray(prompt_lengths, jnp.int32) + steps)
  return logits[:, width - 1:width - 1 + steps]  # [B, N, V]
