"""`stream`: `generate`'s text as the decode loop produces it, chunk by chunk.

A host loop over one jitted chunk function (`chunk_size` steps of `decode`'s loop, a
`lax.scan`): every chunk reuses the same compiled program, and the next chunk is dispatched
before the host decodes the text of the last one, so the device is not left waiting.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdecode import _checks
from jaxdecode import decoding
from jaxdecode import loop
from jaxdecode import processors
from jaxdecode.models import extras
from jaxdecode.models.generate import prepare
from jaxdecode.models.tokenizer import ByteTokenizer
from jaxdecode.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class StreamChunk:
  """One chunk of `stream` (R rows: prompts · n, prompt-major).

  Attributes:
    texts: per row, the new text since the previous chunk ("" if none). Joining a row's pieces
      gives `generate`'s text for the same arguments.
    finished: bool[R], rows that ended with EOS or a stop string (`Generation.finished`).
    done: bool[R], rows that will produce no more text (finished, `max_new_tokens` reached, or
      a dead end: a step with nothing selectable, as `DecodeOutput.dead_end`).
    lengths: int32[R], new tokens per row so far (as `Generation.lengths` at the end).
    dead_end: bool[R], rows that stopped at a step with nothing selectable
      (`Generation.dead_end`).
  """

  texts: list
  finished: np.ndarray
  done: np.ndarray
  lengths: np.ndarray
  dead_end: np.ndarray


def stream(prompts: Sequence[str], *, model=None,
           params: SamplingParams | None = None, seed: int = 0, key=None,
           max_new_tokens: int = 128, tokenizer: ByteTokenizer | None = None,
           penalize_prompt: bool = False, beam_size: int | None = None,
           num_return: int | None = None, length_penalty: float = 1.0, draft=None,
           num_draft_tokens: int = 4, stop=None, include_stop: bool = False, n: int = 1,
           top_logprobs: int = 0, logprobs_mode: str = "processed",
           prompt_logprobs: bool = False, chunk_size: int = 16, regex=None, json_schema=None,
           choices=None, constraint=None, logprob_kinds: bool = False,
           forced_tokens=None) -> Iterator[StreamChunk]:
  """Continues each text prompt like `generate`, yielding the text as it is produced.

  The arguments are `generate`'s (same keys, same tokens, same texts), plus `chunk_size`.
  Everything is checked, and the prompts prefilled, when `stream` is called; the chunks come
  from iterating. The first chunk holds the first token of every row (drawn from the
  prefill), each later one `chunk_size` more steps. A row whose text might be the start of a
  stop string holds that text back until it is resolved, so a stop string that spans chunks
  is never shown. The loop ends as soon as every row is done (EOS, a stop string, or
  `max_new_tokens`), so stop strings also save model steps here.

  Not streamed: beam search (`beam_size`), speculative decoding (`draft`), `top_logprobs`,
  `logprobs_mode="raw"`, `prompt_logprobs`, `logprob_kinds` and `forced_tokens` (use
  `generate` for those).

  Args:
    chunk_size: decode steps per chunk (>= 1). Smaller chunks show text sooner and cost more
      host round trips.
    others: see `generate`.

  Returns:
    An iterator of `StreamChunk`.

  Raises:
    ValueError: as `generate`, and for the options that are not streamed.
  """
  chunk_size = _checks.integer("chunk_size", chunk_size, low=1)
  # A bad value is named as such (as `generate` does) before an option is refused.
  top_logprobs = _checks.top_logprobs(top_logprobs)
  logprobs_mode = _checks.logprobs_mode(logprobs_mode)
  prompt_logprobs = _checks.boolean("prompt_logprobs", prompt_logprobs)
  logprob_kinds = _checks.boolean("logprob_kinds", logprob_kinds)
  for name, on in (("beam_size", beam_size is not None), ("draft", draft is not None),
                   ("logprob_kinds", logprob_kinds), ("forced_tokens", forced_tokens is not None),
                   ("top_logprobs", top_logprobs > 0),
                   ("logprobs_mode='raw'", logprobs_mode == "raw"),
                   ("prompt_logprobs", prompt_logprobs)):
    if on:
      raise ValueError(f"stream does not support {name}; use generate for it")
  del num_return, length_penalty  # beam search only
  batch = prepare(
      prompts, model=model, params=params, seed=seed, key=key, max_new_tokens=max_new_tokens,
      tokenizer=tokenizer, penalize_prompt=penalize_prompt, beam_size=None, draft=None,
      num_draft_tokens=num_draft_tokens, stop=stop, include_stop=include_stop, n=n,
      top_logprobs=0, logprobs_mode="processed", prompt_logprobs=False, regex=regex,
      json_schema=json_schema, choices=choices, constraint=constraint)
  return _chunks(batch, max_new_tokens, chunk_size)


def _chunks(batch, max_new_tokens: int, chunk_size: int) -> Iterator[StreamChunk]:
  """The host loop: run a chunk, hand the previous chunk's text out meanwhile."""
  step_fn = batch.adapter.step_fn
  params, counts = processors.check_call(batch.logits, batch.params, batch.counts,
                                         caller="stream", loop=True)
  counts = jnp.zeros(batch.logits.shape, jnp.int32) if counts is None else counts
  decoding.check_fits(step_fn, batch.state, batch.positions, max_new_tokens, "stream")
  inputs = (batch.key, params, batch.positions,
            jnp.asarray(batch.adapter.eos_ids, jnp.int32).reshape(-1),
            jnp.asarray(batch.adapter.pad_id, jnp.int32), batch.constraint, batch.prompt_tokens)
  carry = _start(step_fn, batch.state, batch.logits, counts, *inputs,
                 max_new_tokens=max_new_tokens)
  rows = [extras.RowText(batch.stop, batch.include_stop, pieces=batch.pieces)
          for _ in range(batch.logits.shape[0])]
  seen = np.zeros(len(rows), np.int64)
  t = 1
  while True:
    following = None
    if t < max_new_tokens:  # dispatched now, runs while the host decodes `carry`
      following = _chunk(step_fn, carry, *inputs, jnp.int32(t), chunk_size=chunk_size)
    s = carry[0]
    tokens, lengths, finished, dead_end = jax.device_get((s.tokens, s.lengths, s.finished,
                                                          s.dead_end))
    chunk = _texts(rows, seen, tokens, lengths, finished, dead_end, max_new_tokens)
    yield chunk
    if chunk.done.all() or following is None:
      return
    carry, t = following, t + chunk_size


def _texts(rows, seen, tokens, lengths, finished, dead_end, max_new_tokens: int) -> StreamChunk:
  """Feeds each row's new tokens to its `RowText`; returns the chunk of released text."""
  pieces, stopped, done, out_lengths = [], [], [], []
  for r, row in enumerate(rows):
    row.feed(tokens[r, seen[r]:lengths[r]])
    seen[r] = lengths[r]
    over = row.stopped or finished[r] or dead_end[r] or lengths[r] >= max_new_tokens
    if over:
      row.close()
    pieces.append(row.release())
    stopped.append(row.stopped)
    done.append(over)
    out_lengths.append(row.tokens if row.stopped else lengths[r])
  return StreamChunk(pieces, np.asarray(finished) | np.asarray(stopped), np.asarray(done),
                     np.asarray(out_lengths, np.int32), np.asarray(dead_end, bool))


@functools.partial(jax.jit, static_argnames=("step_fn", "max_new_tokens"))
def _start(step_fn, state, logits, counts, key, params, positions, eos, pad, constraint,
           prompt_tokens, *, max_new_tokens: int):
  """`decode`'s step 0 (from the prefill's logits): the carry `(LoopState, float32 logits)`
  before the first chunk."""
  batch, vocab = logits.shape
  spec = decoding.make_spec(key, params, positions, eos, pad, (), batch=batch, vocab=vocab,
                            constraint=constraint, prompt_tokens=prompt_tokens)
  carry = decoding.start(spec, state, logits, counts, max_new_tokens)
  s, _, logits = decoding.make_advance(step_fn, spec)(carry, jnp.int32(0), call=False)
  return s, logits


@functools.partial(jax.jit, static_argnames=("step_fn", "chunk_size"))
def _chunk(step_fn, carry, key, params, positions, eos, pad, constraint, prompt_tokens, first,
           *, chunk_size: int):
  """Steps first .. first + chunk_size - 1 of `decode`'s loop (one program for every chunk:
  `first` is traced) on the carry `(LoopState, logits)`. Steps past a row's end record nothing,
  as in `decode`."""
  s, logits = carry
  batch, vocab = s.counts.shape
  spec = decoding.make_spec(key, params, positions, eos, pad, (), batch=batch, vocab=vocab,
                            constraint=constraint, prompt_tokens=prompt_tokens)
  advance = decoding.make_advance(step_fn, spec)

  def body(carry, t):
    return advance(carry, t), None

  (s, _, logits), _ = lax.scan(body, (s, None, logits),
                               first + jnp.arange(chunk_size, dtype=jnp.int32))
  return s, logits
