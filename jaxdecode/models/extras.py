"""Host-side pieces of `generate` and `stream`: text decoded as tokens arrive (with stop
strings), n samples per prompt, and prompt log-probabilities.

Stop strings are matched on the host, on the decoded text, one token at a time: a row ends at
the first token whose text completes a stop string (the earliest end; among stop strings that
end at the same character, the one that starts first), wherever the chunks of a stream were
cut. `generate` and `stream` both go through `RowText`, so their texts agree.
"""

from __future__ import annotations

import codecs
import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode import processors
from jaxdecode import sampling
from jaxdecode.models import transformer


class RowText:
  """One row's text, decoded from its token ids as they arrive, with stop strings.

  Decoding matches `ByteTokenizer.decode` on the whole sequence: special ids (>= 256) are
  dropped, and invalid UTF-8 becomes U+FFFD (`errors="replace"`); a character whose bytes
  arrive in different calls is emitted once it is complete. With `pieces` (a tokenizer's bytes
  of each id, e.g. `jaxdecode.adapters.Tokenizer.pieces`), each id stands for its bytes and
  ids without bytes (None) are dropped.

  Attributes:
    text: the text so far; once a stop string matched, the final text (cut before the stop
      string, or after it with `include_stop`).
    tokens: the token ids consumed; once stopped, up to and including the token that
      completed the stop string.
    stopped: whether a stop string matched.

  Examples:
    >>> row = RowText(stop=("lo",))
    >>> row.feed([104, 101, 108]); row.release()  # "hel": "l" might start "lo"
    'he'
    >>> row.feed([108, 111, 33]); row.stopped, row.tokens, row.release()
    (True, 5, 'l')
  """

  def __init__(self, stop: Sequence[str] = (), include_stop: bool = False, pieces=None):
    self._pieces = pieces  # the bytes of each id (None or b"" for special ids); None: bytes ids
    self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    self._stop = tuple(stop)
    self._include_stop = include_stop
    self._hold = max((len(s) for s in self._stop), default=1) - 1
    self._released = 0
    self.text = ""
    self.tokens = 0
    self.stopped = False
    self.closed = False

  def feed(self, ids: Iterable[int]) -> None:
    """Consumes token ids in order; after a stop string matched, further ids are ignored."""
    if self.stopped or self.closed:
      return
    ids = [int(i) for i in ids]
    if not self._stop:  # no stop strings: no need to look at each token's text
      self.text += self._decoder.decode(b"".join(map(self._bytes, ids)))
      self.tokens += len(ids)
      return
    for i in ids:
      self.tokens += 1
      piece = self._bytes(i)
      if piece:
        self._append(self._decoder.decode(piece))
        if self.stopped:
          return

  def _bytes(self, i: int) -> bytes:
    if self._pieces is None:
      return bytes((i,)) if i < 256 else b""
    return (self._pieces[i] if 0 <= i < len(self._pieces) else None) or b""

  def close(self) -> None:
    """The row has ended: an incomplete last character becomes U+FFFD (as in `decode`)."""
    if not (self.stopped or self.closed):
      self._append(self._decoder.decode(b"", final=True))
    self.closed = True

  def release(self) -> str:
    """The text not released before that no later token can turn into part of a stop string
    (all of it once the row has stopped or closed)."""
    end = len(self.text)
    if not (self.stopped or self.closed):
      end = max(self._released, end - self._hold)
    piece, self._released = self.text[self._released:end], end
    return piece

  def _append(self, piece: str) -> None:
    """Adds decoded text and ends the row at the first stop string it completes."""
    if not piece:
      return
    old = len(self.text)
    self.text += piece
    best = None  # (end, start) of the earliest-ending match
    for s in self._stop:
      # No match ended inside the old text, so a new one starts after old - len(s).
      start = self.text.find(s, max(0, old - len(s) + 1))
      if start >= 0 and (best is None or (start + len(s), start) < best):
        best = (start + len(s), start)
    if best is not None:
      self.stopped = True
      self.text = self.text[:best[0] if self._include_stop else best[1]]


def cut_at_stops(tokens: np.ndarray, lengths: np.ndarray, stop: Sequence[str],
                 include_stop: bool, pieces=None):
  """The texts of a batch of new tokens, each row cut at its first stop string.

  Args:
    tokens: int[R, N] new tokens (pad_id after each row's length).
    lengths: int[R] new tokens per row.
    stop: the stop strings (may be empty).
    include_stop: whether a row's text keeps the stop string.
    pieces: the bytes of each token id (a tokenizer's `pieces`); None for byte ids.

  Returns:
    `(texts, lengths, stopped bool[R], keep bool[R, N])`: `keep` is False for the token
    columns after each row's (new) length.
  """
  texts, new_lengths, stopped = [], [], []
  for row, length in zip(tokens, lengths):
    text = RowText(stop, include_stop, pieces)
    text.feed(row[:length])
    text.close()
    texts.append(text.text)
    new_lengths.append(text.tokens if text.stopped else int(length))
    stopped.append(text.stopped)
  new_lengths = np.asarray(new_lengths, np.int32)
  keep = np.arange(tokens.shape[1])[None, :] < new_lengths[:, None]
  return texts, new_lengths, np.asarray(stopped), keep


def sample_keys(key, prompts: int, n: int) -> jax.Array:
  """Typed keys `[prompts * n]`: row b·n + i is `fold_in(row_key_b, i)`, where row_key_b is
  `fold_in(key, b)` for one key or `key[b]` for one key per prompt (the key policy)."""
  rows = sampling.row_keys(key, prompts)
  samples = jnp.arange(n, dtype=jnp.uint32)
  return jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(samples))(
      rows).reshape(-1)


def repeat_rows(tree, n: int):
  """Every array leaf of `tree` with each row (axis 0) repeated n times in place
  (`jnp.repeat`): prompt-major copies, e.g. of a prefilled cache."""
  return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), tree)


def prefill_with_logprobs(graphdef, weights, tokens, lengths, *, cache_length: int):
  """`transformer.prefill` that also returns each prompt token's log-probability.

  Returns:
    `(logits float32[B, V], DecodeState, logprobs float32[B, T - 1])`: `logprobs[b, j]` is the
    log-probability of token j + 1 given tokens 0..j under the model's own distribution (the
    log-softmax of its logits, with the samplers' batch-invariant sum); columns at or past
    `lengths[b] - 1` are meaningless.
  """
  logits, cache, blocks, logprobs = _prefill_with_logprobs(
      graphdef, weights, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32),
      cache_length=cache_length)
  return logits, transformer.DecodeState(weights=weights, cache=cache, blocks=blocks), logprobs


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_length"))
def _prefill_with_logprobs(graphdef, weights, tokens, lengths, *, cache_length):
  model = nnx.merge(graphdef, weights)
  batch, width = tokens.shape
  cache, start = transformer._opaque((  # pylint: disable=protected-access
      transformer.init_cache(model.config, batch, cache_length), jnp.zeros((batch,), jnp.int32)))
  blocks = model.chain_blocks() if model.config.batch_invariant else None
  logits, cache = model.run(tokens, start, cache, blocks)  # [B, T, V], as in prefill
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  vocab = logits.shape[-1]
  logp = sampling.log_softmax(processors.prepare(logits[:, :-1].reshape(-1, vocab)))
  logp = logp.reshape(batch, width - 1, vocab)
  return last, cache, blocks, jnp.take_along_axis(logp, tokens[:, 1:, None], axis=2)[..., 0]
