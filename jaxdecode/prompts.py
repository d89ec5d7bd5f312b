"""Prompt helpers: token lists of different lengths padded into one `[B, T]` array.

`left_pad` puts every row's last prompt token in the same column, so the first new token of every
row goes to the same cache slot: the layout of most KV-cache models. Each row keeps its own
positions (0 at its first real token, `prompt_positions`) and its own attention mask
(`prompt_mask`), so a row can decode exactly as if it were alone. Widths come from a few buckets
so that new prompt lengths reuse compiled programs.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import _checks

DEFAULT_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  """The smallest bucket >= `length` (so that new prompt lengths reuse compiled programs)."""
  for b in sorted(buckets):
    if b >= length:
      return int(b)
  raise ValueError(f"a prompt of {length} tokens is longer than the largest bucket "
                   f"{max(buckets)}; pass larger buckets or a shorter prompt")


def _width(prompts, buckets, width) -> int:
  longest = max(len(p) for p in prompts)
  if width is None:
    return longest if buckets is None else bucket_length(longest, buckets)
  width = _checks.integer("width", width, low=1)
  if width < longest:
    raise ValueError(f"width {width} is shorter than the longest prompt ({longest} tokens)")
  return width


def left_pad(prompts: Sequence[Sequence[int]], *, pad_id: int = 0,
             buckets: Sequence[int] | None = DEFAULT_BUCKETS, width: int | None = None):
  """Left-pads token lists into one array.

  Args:
    prompts: B lists of token ids, each non-empty.
    pad_id: the id written into padding.
    buckets: allowed widths; the width is the smallest bucket that holds the longest prompt.
      None means exactly the longest prompt.
    width: an explicit width (overrides `buckets`).

  Returns:
    `(tokens int32[B, T], lengths int32[B])`, row b's prompt in `tokens[b, T - lengths[b]:]`.

  Examples:
    >>> tokens, lengths = left_pad([[5, 6, 7], [9]], pad_id=0, buckets=None)
    >>> tokens.tolist(), lengths.tolist()
    ([[5, 6, 7], [0, 0, 9]], [3, 1])
  """
  prompts = _checks.token_prompts(prompts)
  width = _width(prompts, buckets, width)
  out = np.full((len(prompts), width), pad_id, np.int32)
  for row, p in enumerate(prompts):
    out[row, width - len(p):] = p
  return jnp.asarray(out), jnp.asarray([len(p) for p in prompts], jnp.int32)


def right_pad(prompts: Sequence[Sequence[int]], *, pad_id: int = 0,
              buckets: Sequence[int] | None = DEFAULT_BUCKETS, width: int | None = None):
  """Right-pads token lists into one array: token p of every row sits in column p.

  The layout of a cache whose slot p holds position p (the embedded transformer's), so that the
  padding width never moves a row's tokens.

  Returns:
    `(tokens int32[B, T], lengths int32[B])`, row b's prompt in `tokens[b, :lengths[b]]`.

  Examples:
    >>> tokens, lengths = right_pad([[5, 6, 7], [9]], pad_id=0, buckets=None)
    >>> tokens.tolist(), lengths.tolist()
    ([[5, 6, 7], [9, 0, 0]], [3, 1])
  """
  prompts = _checks.token_prompts(prompts)
  width = _width(prompts, buckets, width)
  out = np.full((len(prompts), width), pad_id, np.int32)
  for row, p in enumerate(prompts):
    out[row, :len(p)] = p
  return jnp.asarray(out), jnp.asarray([len(p) for p in prompts], jnp.int32)


def prompt_mask(lengths: jax.Array, width: int) -> jax.Array:
  """`bool[B, T]`: True on the real (non-padding) tokens of left-padded prompts."""
  column = jnp.arange(width, dtype=jnp.int32)[None, :]
  return column >= (width - lengths)[:, None]


def prompt_positions(lengths: jax.Array, width: int) -> jax.Array:
  """`int32[B, T]`: each real token's position in its own left-padded prompt (0 first); padding
  gets 0.

  The first new token of row b then has position `lengths[b]`: pass `positions=lengths` to
  `decode`.
  """
  column = jnp.arange(width, dtype=jnp.int32)[None, :]
  return jnp.maximum(column - (width - lengths)[:, None], 0)
