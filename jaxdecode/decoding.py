"""`decode`: the autoregressive loop that drives any JAX step function with jaxdecode's samplers.

Prompt helpers first: prompts of different lengths are *left-padded* into one `[B, T]` array so
that every row's last prompt token sits in the same column and the first new token of every row
is written to the same cache slot. Each row keeps its own positions (0 at its first real token)
and its own attention mask, so a row behaves exactly as if it were decoded alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdecode import processors
from jaxdecode import sampling
from jaxdecode.params import SamplingParams

DEFAULT_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def bucket_length(length: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
  """The smallest bucket >= `length` (so that new prompt lengths reuse compiled programs)."""
  for b in sorted(buckets):
    if b >= length:
      return int(b)
  raise ValueError(f"a prompt of {length} tokens is longer than the largest bucket "
                   f"{max(buckets)}; pass larger buckets or a shorter prompt")


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
  if len(prompts) == 0:
    raise ValueError("prompts must hold at least one prompt; got an empty list")
  lengths = [len(p) for p in prompts]
  if min(lengths) == 0:
    raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token")
  longest = max(lengths)
  if width is None:
    width = longest if buckets is None else bucket_length(longest, buckets)
  if width < longest:
    raise ValueError(f"width {width} is shorter than the longest prompt ({longest} tokens)")
  out = np.full((len(prompts), width), pad_id, np.int32)
  for row, p in enumerate(prompts):
    out[row, width - len(p):] = np.asarray(p, np.int32)
  return jnp.asarray(out), jnp.asarray(lengths, jnp.int32)


def prompt_mask(lengths: jax.Array, width: int) -> jax.Array:
  """`bool[B, T]`: True on the real (non-padding) tokens of left-padded prompts."""
  column = jnp.arange(width, dtype=jnp.int32)[None, :]
  return column >= (width - lengths)[:, None]


def prompt_positions(lengths: jax.Array, width: int) -> jax.Array:
  """`int32[B, T]`: each real token's position in its own prompt (0 first); padding gets 0.

  The first new token of row b then has position `lengths[b]`: pass `positions=lengths` to
  `decode`.
  """
  column = jnp.arange(width, dtype=jnp.int32)[None, :]
  return jnp.maximum(column - (width - lengths)[:, None], 0)


# ---------------------------------------------------------------------------------------------
# The loop.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeOutput:
  """What `decode` returns.

  Attributes:
    tokens: int32[B, N] new tokens; after a row's EOS, `pad_id`.
    logprobs: float32[B, N] log-probability of each token under its processed distribution
      (0 after EOS, so a row's sum is its sequence log-probability; 0 for temperature-0 rows).
    lengths: int32[B] new tokens up to and including the EOS (N for rows that did not stop).
    finished: bool[B] True where the row emitted an EOS id.
    state: the model state after the last `step_fn` call (it has seen every new token except
      the last, which is `tokens[:, -1]`; feed it to continue).
  """

  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  finished: jax.Array
  state: Any


def _step_keys(row_keys: jax.Array, t) -> jax.Array:
  """The keys of step t: `fold_in(row_key, t)` for every row. [B] -> [B]."""
  return jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)


def _check_step_output(out, state, batch: int, vocab: int) -> None:
  """Raises ValueError (at trace time) unless step_fn returned ([B, V] float logits, state)."""
  if not (isinstance(out, tuple) and len(out) == 2):
    raise ValueError(f"step_fn must return a pair (logits[B, V], state); got {type(out).__name__}")
  logits, new_state = out
  if jnp.shape(logits) != (batch, vocab) or not jnp.issubdtype(jnp.result_type(logits),
                                                                jnp.floating):
    raise ValueError(f"step_fn must return logits of shape ({batch}, {vocab}) and a floating "
                     f"dtype, like the prefill logits; got shape {jnp.shape(logits)} and dtype "
                     f"{jnp.result_type(logits)}")
  expected = jax.tree.structure(state)
  if jax.tree.structure(new_state) != expected:
    raise ValueError(f"step_fn must return a state with the same structure as its input; "
                     f"expected {expected}, got {jax.tree.structure(new_state)}")
  for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
    if (jnp.shape(old), jnp.result_type(old)) != (jnp.shape(new), jnp.result_type(new)):
      raise ValueError(f"step_fn must return state leaves of unchanged shape and dtype; a leaf "
                       f"went from {jnp.shape(old)} {jnp.result_type(old)} to "
                       f"{jnp.shape(new)} {jnp.result_type(new)}")


def _decode(step_fn, state, logits, key, params, positions, eos_ids, pad_id, counts, *,
            max_new_tokens: int, chunk_size: int):
  batch, vocab = logits.shape
  n = max_new_tokens
  row_keys = sampling.row_keys(key, batch)
  params = params.sanitized()
  _check_step_output(jax.eval_shape(step_fn, state, jnp.zeros(batch, jnp.int32), positions),
                     state, batch, vocab)
  is_eos = jnp.zeros(vocab, bool).at[eos_ids].set(True, mode="drop")  # [V]
  rows = jnp.arange(batch)

  def select(t, logits, done, counts):
    """Samples step t for every row; finished rows get pad_id and log-probability 0."""
    blocked = t < params.min_new_tokens  # [B]: EOS not allowed yet
    logits = lax.cond(jnp.any(blocked) & jnp.any(is_eos),
                      lambda x: jnp.where(blocked[:, None] & is_eos[None, :], -jnp.inf, x),
                      lambda x: x, logits)
    token, logprob = sampling.sample_rows(_step_keys(row_keys, t), logits, params, counts)
    token = jnp.where(done, pad_id, token)
    logprob = jnp.where(done, 0.0, logprob)
    counts = counts.at[rows, token].add((~done).astype(jnp.int32))
    return token, logprob, done | is_eos[token], counts

  # Step 0 samples from the prefill logits; every later step t first feeds token t-1 to the
  # model. So N tokens cost N - 1 model steps.
  token, logprob, done, counts = select(0, logits, jnp.zeros(batch, bool), counts)

  def step(carry, t):
    state, token, done, counts = carry
    logits, state = step_fn(state, token, positions + t - 1)
    token, logprob, new_done, counts = select(t, logits, done, counts)
    return (state, token, new_done, counts), (token, logprob, done)  # `done` before this step

  def run_steps(carry, ts):
    carry, (tokens, logprobs, was_done) = lax.scan(step, carry, ts)
    return carry, (tokens.T, logprobs.T, was_done.T)  # [B, len(ts)]

  # Steps 1..N-1 in chunks: a while loop over chunks stops as soon as every row has finished, and
  # a scan inside each chunk keeps the per-step loop overhead (and device syncs) low.
  chunk = max(1, min(chunk_size, n - 1)) if n > 1 else 1
  full_chunks, tail = divmod(n - 1, chunk)
  tokens = jnp.full((batch, n), pad_id, jnp.int32).at[:, 0].set(token)
  logprobs = jnp.zeros((batch, n), jnp.float32).at[:, 0].set(logprob)
  active_steps = jnp.ones((batch,), jnp.int32)  # steps each row took while not yet finished

  def chunk_body(loop):
    c, carry, tokens, logprobs, active_steps = loop
    first = 1 + c * chunk
    carry, (tk, lp, was_done) = run_steps(carry, first + jnp.arange(chunk, dtype=jnp.int32))
    tokens = lax.dynamic_update_slice(tokens, tk, (0, first))
    logprobs = lax.dynamic_update_slice(logprobs, lp, (0, first))
    return c + 1, carry, tokens, logprobs, active_steps + jnp.sum(~was_done, axis=1)

  def chunk_cond(loop):
    c, (_, _, done, _), *_ = loop
    return (c < full_chunks) & ~jnp.all(done)

  loop = (jnp.int32(0), (state, token, done, counts), tokens, logprobs, active_steps)
  _, carry, tokens, logprobs, active_steps = lax.while_loop(chunk_cond, chunk_body, loop)

  if tail:
    def run_tail(args):
      carry, tokens, logprobs, active_steps = args
      ts = jnp.arange(n - tail, n, dtype=jnp.int32)
      carry, (tk, lp, was_done) = run_steps(carry, ts)
      return (carry, tokens.at[:, n - tail:].set(tk), logprobs.at[:, n - tail:].set(lp),
              active_steps + jnp.sum(~was_done, axis=1))

    carry, tokens, logprobs, active_steps = lax.cond(
        jnp.all(carry[2]), lambda args: args, run_tail, (carry, tokens, logprobs, active_steps))

  state, _, done, _ = carry
  # A row's active steps include the one that emitted its EOS; the loop only stops early when
  # every row has finished, so unfinished rows took all N steps.
  return DecodeOutput(tokens, logprobs, active_steps, done, state)


_decode_jit = jax.jit(_decode, static_argnames=("step_fn", "max_new_tokens", "chunk_size"))


def decode(step_fn: Callable, state: Any, logits: jax.Array, *, key, params: SamplingParams,
           max_new_tokens: int, positions: jax.Array, eos_ids: Sequence[int] = (),
           pad_id: int = 0, counts=None, chunk_size: int = 16) -> DecodeOutput:
  """Generates up to `max_new_tokens` tokens per row with `lax.scan` over a model step function.

  Args:
    step_fn: a pure function `step_fn(state, tokens int32[B], positions int32[B]) ->
      (logits [B, V], state)`: one model step over a KV cache. It is a static argument: build it
      once and reuse it, or every call compiles again.
    state: the model state after the prefill (any pytree; e.g. weights and KV cache).
    logits: `[B, V]` next-token logits from the prefill.
    key: one key or one per row, as in `jaxdecode.sample`. Step t of a row samples with
      `fold_in(row_key, t)`.
    params: a `SamplingParams` (scalars or `[B]` arrays). Its penalties use each row's token
      counts, which `decode` carries; its `min_new_tokens` masks `eos_ids` at steps
      t < min_new_tokens.
    max_new_tokens: N, the number of tokens to generate (static).
    positions: `int32[B]`, the position of each row's first new token (its prompt length);
      the token sampled at step t is fed to `step_fn` with position `positions + t`.
    eos_ids: token ids that end a row; the row keeps the EOS and then only `pad_id`.
    pad_id: the id written after a row's EOS (and fed to `step_fn` for finished rows).
    counts: `int[B, V]` token counts to start the penalties from. None (the default) counts
      only the tokens this call generates, as OpenAI's and vLLM's presence and frequency
      penalties do. To count the prompt too, as HF's repetition_penalty does (its input_ids
      include the prompt), pass `jaxdecode.token_counts(prompt_tokens, V,
      mask=prompt_mask(lengths, T))`.
    chunk_size: steps per scanned chunk; the loop stops after the first chunk in which every
      row has finished.

  Returns:
    A `DecodeOutput`. Every traced input (state, logits, key, params, positions, eos_ids,
    pad_id, counts) can change without recompiling; shapes and `max_new_tokens` are static.
  """
  batch, vocab = processors.check_logits(logits)
  if not callable(step_fn):
    raise ValueError(f"step_fn must be callable; got {type(step_fn).__name__}")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) \
      or chunk_size < 1:
    raise ValueError(f"chunk_size must be an integer >= 1; got {chunk_size!r}")
  if not isinstance(params, SamplingParams):
    raise ValueError(f"params must be a jaxdecode.SamplingParams; got {type(params).__name__}")
  params = params.broadcast(batch, vocab)
  sampling.check_key(key, batch)
  # Token counts for the penalties, always carried (zeros by default) so that neither turning a
  # penalty on nor passing counts recompiles: an in-place update of B entries per step, read
  # only when a penalty is set.
  counts = (jnp.zeros((batch, vocab), jnp.int32) if counts is None else
            processors.check_counts(counts, batch, vocab))
  if jnp.shape(positions) != (batch,) or not jnp.issubdtype(jnp.result_type(positions),
                                                             jnp.integer):
    raise ValueError(f"positions must be an integer array of shape ({batch},), one per row of "
                     f"the logits; got shape {jnp.shape(positions)} and dtype "
                     f"{jnp.result_type(positions)}")
  eos = _check_ids("eos_ids", eos_ids, vocab, allow_many=True)
  pad = _check_ids("pad_id", pad_id, vocab, allow_many=False)
  return _decode_jit(step_fn, state, logits, key, params, jnp.asarray(positions, jnp.int32),
                     eos, pad, counts, max_new_tokens=int(max_new_tokens),
                     chunk_size=int(chunk_size))


def _check_ids(name: str, ids, vocab: int, *, allow_many: bool) -> jax.Array:
  """Validates token ids against the vocabulary; returns int32 (shape [E] or scalar)."""
  if isinstance(ids, jax.core.Tracer):
    return jnp.asarray(ids, jnp.int32)
  host = np.asarray(ids)
  if host.ndim not in ((0, 1) if allow_many else (0,)):
    raise ValueError(f"{name} must be {'a list of token ids' if allow_many else 'one token id'}; "
                     f"got {ids!r}")
  if host.size and not np.issubdtype(host.dtype, np.integer):
    raise ValueError(f"{name} must be integer token ids; got {ids!r}")
  bad = host[(host < 0) | (host >= vocab)] if host.size else host
  if bad.size:
    raise ValueError(f"{name} must be token ids in [0, {vocab}) (the vocabulary of the logits); "
                     f"got {bad.tolist()!r}")
  return jnp.asarray(host.reshape(-1) if allow_many else host, jnp.int32)
