"""Structured decoding on the device: regexes, JSON schemas and choices as token automata.

A constraint is a deterministic automaton over the model's tokens: from each state, each token
either leads to one next state or is not allowed. It is held as device tables, and each row of
a decoding loop carries its automaton state as one int32, so the mask of a step is one gather
inside the jitted loop, with no host round trip (the libraries of the field compute each
step's mask on the host):

- `Vocabulary(tokens, eos_ids)`: the bytes of each token (`None` for a special token) and the
  end-of-sequence ids. `jaxdecode.models.ByteTokenizer().vocabulary()` is the embedded model's.
- `regex(pattern, vocab)`, `json_schema(schema, vocab)`, `choice(options, vocab)`: one
  constraint. outlines-core turns a JSON schema into a regex and a regex into a byte-level DFA
  (in a separate process, under a time and memory budget); the token automaton is built here
  from the DFA by walking the vocabulary's trie, without any dense [states, V] array.
- `stack([c0, c1, None, ...])`: one constraint per row; `None` leaves a row unconstrained.

Semantics (`decode`, `beam_search`, `speculative_decode` and `stream` take `constraint=`):

- the constraint covers the generated tokens only, not the prompt;
- each step the row's allowed tokens come first, before token sets, bias, penalties,
  temperature and truncation: sampling draws from the model's distribution restricted to the
  allowed tokens and renormalized, then processed as usual;
- a special token (`None`) is never allowed; an EOS id only in an accepting state (where it
  is the only choice if nothing else is allowed). A row ended by `max_new_tokens` before it is
  accepted holds a prefix of a match;
- a step whose processing leaves nothing allowed (bans that remove every allowed token, say)
  is a dead end, as anywhere in the library: the row stops there, flagged `dead_end`.

Tables: `next_state[S, C]` (the state after a token of class c, -1 where not allowed) and
`token_class[A, V]` (each automaton's class of each token: tokens whose columns are identical in
every state share a class, so a 32k vocabulary costs [S, C] with C far below V). Sizes are padded
to powers of two, so a new pattern of a similar size reuses the compiled program. Compiled
constraints are cached per (kind, pattern, vocabulary).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

NOT_ALLOWED = -1


class Vocabulary:
  """A model's tokens as bytes, for building constraints.

  Args:
    tokens: `tokens[i]` is token i's bytes (a `str` is taken as UTF-8), or `None` for a special
      token (never allowed by a constraint, except an EOS id in an accepting state).
    eos_ids: the ids that end a sequence (at least one; each must be a special token or a token
      of the list).
  """

  def __init__(self, tokens: Sequence[bytes | str | None], eos_ids: Sequence[int]):
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") or not len(tokens):
      raise ValueError(f"tokens must be a non-empty list of bytes (or None for a special token); "
                       f"got {tokens!r:.80}")
    out = []
    for i, token in enumerate(tokens):
      if isinstance(token, str):
        token = token.encode("utf-8")
      if token is not None and (not isinstance(token, bytes) or not token):
        raise ValueError(f"tokens[{i}] must be non-empty bytes, a str or None; got {token!r:.80}")
      out.append(token)
    eos = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
    if not eos or any(not isinstance(e, (int, np.integer)) or isinstance(e, bool)
                      or not 0 <= e < len(out) for e in eos):
      raise ValueError(f"eos_ids must be one or more token ids in [0, {len(out)}); got "
                       f"{eos_ids!r:.80}")
    self.tokens = tuple(out)
    self.eos_ids = tuple(sorted({int(e) for e in eos}))
    digest = hashlib.sha256(repr((self.tokens, self.eos_ids)).encode()).hexdigest()
    self._key = digest

  def __len__(self) -> int:
    return len(self.tokens)

  def __eq__(self, other) -> bool:
    return isinstance(other, Vocabulary) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)

  def __repr__(self) -> str:
    return f"Vocabulary({len(self.tokens)} tokens, eos_ids={list(self.eos_ids)})"

  @functools.cached_property
  def _outlines(self):
    """outlines-core's vocabulary: every ordinary token, grouped by its bytes."""
    from outlines_core import Vocabulary as OutlinesVocabulary  # pylint: disable=import-outside-toplevel
    groups: dict[bytes, list[int]] = {}
    for i, token in enumerate(self.tokens):
      if token is not None and i not in self.eos_ids:
        groups.setdefault(token, []).append(i)
    return OutlinesVocabulary(self.eos_ids[0], groups)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Constraint:
  """Token automata as device tables (a pytree: new tables of the same sizes never recompile).

  Attributes:
    next_state: int32[S, C], the state after a token of class c from state s; -1: not allowed.
    token_class: int32[A, V], each automaton's class of each token.
    accepting: bool[S], where the text so far is a whole match (the vocabulary's EOS ids are
      allowed there, and keep the state).
    initial: int32[R], each row's first state (R = 1: every row).
    automaton: int32[R], each row's row of `token_class`.
    eos_ids: the vocabulary's EOS ids (static): the only ids that may end a constrained row,
      so every loop refuses `eos_ids=` that are not exactly these.
  """
  next_state: jax.Array
  token_class: jax.Array
  accepting: jax.Array
  initial: jax.Array
  automaton: jax.Array
  eos_ids: tuple = dataclasses.field(default=(), metadata=dict(static=True))

  @property
  def rows(self) -> int:
    return self.initial.shape[0]

  def nbytes(self) -> int:
    """The device memory of the tables, in bytes."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self))


def _bucket(n: int, low: int = 8) -> int:
  return max(low, 1 << max(n - 1, 0).bit_length())


# The budget of one compile. The byte-level DFA is built by outlines-core in a process of its
# own, stopped past DFA_SECONDS (and DFA_MEMORY bytes of address space where the system can
# limit it); a DFA of more than MAX_STATES states, or a token walk of more than MAX_WORK state x
# prefix steps, is refused before the walk starts, with the numbers.
DFA_SECONDS = 60.0
DFA_MEMORY = 4 * 2**30
MAX_STATES = 200_000
MAX_WORK = 3 * 10**9
MAX_REGEX_CHARS = 10**6  # a JSON schema's regex (nested arrays double it per level)
# The worker compiles _MARK (?:pattern) _END: see `_byte_dfa`.
_MARK, _END = "\n", "\uffff"  # U+FFFF: a noncharacter, bytes EF BF BF
_WORKER = None


def _run_workers(patterns: Sequence[str], what: str) -> tuple[int, bytes]:
  """`(i, reply)`: the first reply of workers (`jaxdecode/_dfa_worker.py`) started together,
  one per pattern (they describe one DFA: the first to finish wins, the others are stopped)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  global _WORKER  # pylint: disable=global-statement
  if _WORKER is None:
    from importlib import resources  # pylint: disable=import-outside-toplevel
    _WORKER = resources.files("jaxdecode").joinpath("_dfa_worker.py").read_text("utf-8")
  argv = [sys.executable, "-c", _WORKER, json.dumps([sys.path, DFA_MEMORY, MAX_REGEX_CHARS])]
  with tempfile.TemporaryDirectory(prefix="jaxdecode-dfa-") as folder:
    running, failed = [], []
    try:
      for i, pattern in enumerate(patterns):  # files, not pipes: a large reply never blocks
        with open(f"{folder}/{i}.in", "wb") as f:
          f.write(pattern.encode("utf-8"))
        with open(f"{folder}/{i}.in", "rb") as stdin, open(f"{folder}/{i}.out", "wb") as out:
          running.append((i, subprocess.Popen(argv, stdin=stdin, stdout=out,
                                              stderr=subprocess.DEVNULL)))
      deadline = time.monotonic() + DFA_SECONDS
      while running and time.monotonic() < deadline:
        for i, proc in list(running):
          if proc.poll() is None:
            continue
          running.remove((i, proc))
          with open(f"{folder}/{i}.out", "rb") as f:
            reply = f.read()
          if proc.returncode == 0 and reply[:2] in (b"ok", b"er"):
            return i, reply
          if proc.returncode == 3:  # a budget the worker checks itself
            raise ValueError(f"{what}: {reply.decode('utf-8', 'replace')}")
          failed.append(proc.returncode)
        time.sleep(0.005)
    finally:
      for _, proc in running:
        proc.kill()
        proc.wait()
  if failed and not running:
    raise ValueError(f"{what}: building its automaton failed (exit status {failed[0]}), most "
                     f"likely past the memory budget of {DFA_MEMORY / 2**30:g} GiB "
                     f"(structured.DFA_MEMORY): its DFA is too large")
  raise ValueError(f"{what}: building its automaton took more than {DFA_SECONDS:g} s (the "
                   f"budget, structured.DFA_SECONDS), so it was stopped; its DFA is too large "
                   f"(bounded repeats such as {{0,5000}}, or nested ones, multiply states)")


def _byte_dfa(pattern: str, what: str):
  """`(initial, accepting bool[S], delta int32[S, 256])`: the DFA of `pattern` over bytes
  (UTF-8), anchored at both ends; -1 where a byte is not allowed.

  outlines-core builds it over the 256 single bytes, for `(?:pattern) _END` and, in a second
  process at the same time, for `_MARK (?:pattern) _END`; the first to finish is read:
  - `_END` (U+FFFF, a noncharacter): outlines-core drops moves out of a state where the text
    is a whole match (a lone lead byte of a multi-byte character, so a byte-level vocabulary
    could not spell "é" there, or the longer branch of `(x|xy)`). With `_END` after the
    pattern, a state of the pattern is a match only after a U+FFFF in the text; it accepts
    where `_END` leads to a match.
  - `_MARK` (a newline): outlines-core also builds the unanchored DFA, which can be
    exponentially larger: for `"(a|\\"){0,20}"` every quote inside the string could start
    another match, each with its own count (4 GB at 20). Behind a first byte that the text
    does not hold, no second match can start (`.` never matches a newline, a JSON string never
    holds one), and the anchored DFA is `_MARK`'s successor: a maxLength of 1000 compiles in
    0.3 s. A pattern whose text holds newlines (`[\\s\\S]{0,100}`) blows up this way instead,
    and the form without `_MARK` finishes first.
  """
  which, reply = _run_workers([_MARK + "(?:" + pattern + ")" + _END,
                               "(?:" + pattern + ")" + _END], what)
  if reply[:2] == b"er":
    message = reply[2:].decode("utf-8", "replace")
    if "incompatible with the regex" in message:  # no text can be spelled
      raise ValueError(f"{what} matches no text that this vocabulary's tokens can spell (its "
                       f"language is empty)")
    raise ValueError(f"{what} cannot be compiled: {message.splitlines()[0][:200]}")
  start = int(np.frombuffer(reply, np.int64, 1, 2)[0])
  offset, parts = 10, []
  for _ in range(2):
    count = int(np.frombuffer(reply, np.int64, 1, offset)[0])
    parts.append(np.frombuffer(reply, np.int64, count, offset + 8))
    offset += 8 + 8 * count
  finals, moves = parts[0], parts[1].reshape(-1, 3)
  names = np.unique(np.concatenate([[start], finals, moves[:, 0], moves[:, 2]]))
  if names.size > MAX_STATES:
    raise ValueError(f"{what}: its DFA has {names.size} states, more than the budget of "
                     f"{MAX_STATES} (structured.MAX_STATES)")
  number = lambda values: np.searchsorted(names, values)  # state name -> row
  delta = np.full((names.size, 256), NOT_ALLOWED, np.int32)
  delta[number(moves[:, 0]), moves[:, 1]] = number(moves[:, 2])
  final = np.zeros(names.size, bool)
  final[number(finals)] = True
  after = np.arange(names.size)
  for byte in _END.encode("utf-8"):  # where _END leads from each state
    after = np.where(after >= 0, delta[np.maximum(after, 0), byte], NOT_ALLOWED)
  accepting = (after >= 0) & final[np.maximum(after, 0)]
  # The states that only spell _END reach no accepting state: the token automaton drops them.
  initial = int(delta[number(start), ord(_MARK)]) if which == 0 else int(number(start))
  if initial < 0:
    raise ValueError(f"{what} matches no text that this vocabulary's tokens can spell (its "
                     f"language is empty)")
  return initial, accepting, delta


class _Trie:
  """The vocabulary's ordinary tokens as a trie of byte prefixes, level by level: level d holds
  the distinct prefixes of length d (each a parent prefix and a byte), and `leaf[d]` the
  tokens of length d with their prefix."""

  def __init__(self, tokens: Sequence[bytes], ids: np.ndarray):
    lengths = np.fromiter((len(t) for t in tokens), np.int64, len(tokens))
    width = int(lengths.max()) if len(tokens) else 0
    data = np.zeros((len(tokens), width), np.uint8)
    flat = np.frombuffer(b"".join(tokens), np.uint8)
    rows = np.repeat(np.arange(len(tokens)), lengths)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    data[rows, cols] = flat
    self.levels, self.leaves = [], []
    node = np.zeros(len(tokens), np.int64)
    for d in range(width):
      active = np.flatnonzero(lengths > d)
      keys, inverse = np.unique(node[active] * 256 + data[active, d], return_inverse=True)
      node[active] = inverse.reshape(-1)
      self.levels.append((keys // 256, (keys % 256).astype(np.int64)))
      ends = active[lengths[active] == d + 1]
      self.leaves.append((ids[ends], node[ends]))
    self.size = sum(parents.size for parents, _ in self.levels)

  def walk(self, delta: np.ndarray, byte_class: np.ndarray, states: np.ndarray,
           out: np.ndarray) -> None:
    """`out[:, token]` = the state after each token from each of `states` (`delta` [S + 1, K]
    over byte classes `byte_class[256]`; its last row, the sink, where a byte is not allowed).
    """
    current = states[:, None]
    for (parents, codes), (ids, nodes) in zip(self.levels, self.leaves):
      current = delta[current[:, parents], byte_class[codes][None, :]]
      out[:, ids] = current[:, nodes]


def _token_automaton(initial: int, accepting: np.ndarray, delta: np.ndarray,
                     vocab: Vocabulary, what: str) -> Constraint:
  """The token automaton of a byte DFA, packed into tables, without any dense [S, V] array.

  1. Walk every token from every state along the vocabulary's trie, a block of states at a
     time, and hash each token's column (its next state from every state): tokens with equal
     columns get equal hashes (two random 64-bit linear hashes: a collision of two different
     columns has probability below 2^-80).
  2. One token per hash is walked again from all states: the table [S, C] of classes.
  3. States that a row cannot reach, or from which no accepting state can be reached, are
     removed, and classes whose columns became equal are merged: the tables of a canonical
     automaton, whatever the DFA's numbering.
  """
  states = delta.shape[0]
  sink = np.vstack([np.where(delta >= 0, delta, states), np.full((1, 256), states)])
  # Bytes with equal columns share a class: a table of a few columns stays in cache.
  columns, byte_class = np.unique(sink.T, axis=0, return_inverse=True)
  sink, byte_class = np.ascontiguousarray(columns.T, np.int32), byte_class.reshape(-1)
  ordinary = np.array([t is not None and i not in vocab.eos_ids
                       for i, t in enumerate(vocab.tokens)])
  ids = np.flatnonzero(ordinary)
  trie = _Trie([vocab.tokens[i] for i in ids], ids)
  if states * trie.size > MAX_WORK:
    raise ValueError(f"{what}: its DFA has {states} states and the vocabulary {trie.size} token "
                     f"prefixes: a walk of {states * trie.size:.2g} steps, more than the budget of "
                     f"{MAX_WORK:.2g} (structured.MAX_WORK)")
  weights = np.random.default_rng(0).integers(1, 2**63, size=(2, states + 1), dtype=np.uint64)
  block = max(1, min(states, (1 << 22) // max(len(vocab), 1)))  # ~16 MB of int32 per block

  def hash_block(s0: int) -> np.ndarray:
    """[2, V]: sum over the block's states of weight[state] * (next + 1), wrapping."""
    rows = np.arange(s0, min(states, s0 + block))
    out = np.full((rows.size, len(vocab)), states, np.int32)  # specials and EOS: no move
    trie.walk(sink, byte_class, rows, out)
    out = out.astype(np.uint64) + np.uint64(1)
    return np.stack([weights[h, rows] @ out for h in range(2)])

  # numpy's gathers release the GIL: blocks run on every core, and wrapping sums commute.
  workers = min(4, os.cpu_count() or 1, -(-states // block))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    hashes = functools.reduce(np.add, pool.map(hash_block, range(0, states, block)))
  special = ~ordinary
  eos = np.zeros(len(vocab), bool)
  eos[list(vocab.eos_ids)] = True
  hashes[:, special] = 0  # one class for the special tokens (never allowed) ...
  hashes[0, eos] = 1  # ... and one for EOS (allowed in accepting states)
  hashes[1, eos] = 0
  _, first, cls = np.unique(hashes.T, axis=0, return_index=True, return_inverse=True)
  cls = cls.reshape(-1)
  table = np.full((states, first.size), states, np.int32)  # [S, C], `states`: not allowed
  walked = first[ordinary[first]]
  out = np.empty((states, walked.size), np.int32)
  _Trie([vocab.tokens[i] for i in walked], np.arange(walked.size)).walk(
      sink, byte_class, np.arange(states), out)
  table[:, cls[walked]] = out
  table[accepting, cls[list(vocab.eos_ids)][0]] = np.flatnonzero(accepting)
  table = np.where(table < states, table, NOT_ALLOWED)
  # Keep the states a row reaches from the initial state and that can still reach acceptance.
  reach = _closure(table, np.array([initial]), forward=True, states=states)
  alive = _closure(table, np.flatnonzero(accepting), forward=False, states=states)
  keep = reach & alive
  if not keep[initial]:
    raise ValueError(f"{what} matches no text that this vocabulary's tokens can spell (its "
                     f"language is empty)")
  new = np.cumsum(keep) - 1  # old state -> new state
  table = table[keep]
  table = np.where((table >= 0) & keep[np.maximum(table, 0)], new[np.maximum(table, 0)],
                   NOT_ALLOWED)
  columns, merged = np.unique(table.T, axis=0, return_inverse=True)  # [C', S'], lexicographic
  token_class = merged.reshape(-1)[cls]
  count = int(keep.sum())
  s_pad, c_pad = _bucket(count), _bucket(columns.shape[0])
  next_state = np.full((s_pad, c_pad), NOT_ALLOWED, np.int32)
  next_state[:count, :columns.shape[0]] = columns.T
  accepting_pad = np.zeros(s_pad, bool)
  accepting_pad[:count] = accepting[keep]
  return Constraint(next_state=jnp.asarray(next_state),
                    token_class=jnp.asarray(token_class[None, :], jnp.int32),
                    accepting=jnp.asarray(accepting_pad),
                    initial=jnp.asarray([int(new[initial])], jnp.int32),
                    automaton=jnp.zeros((1,), jnp.int32), eos_ids=vocab.eos_ids)


def _closure(table: np.ndarray, seeds: np.ndarray, *, forward: bool, states: int) -> np.ndarray:
  """bool[S]: the states reachable from `seeds` along `table`'s moves (forward), or from which
  a seed is reachable (backward)."""
  src = np.repeat(np.arange(states), table.shape[1])
  dst = table.reshape(-1)
  ok = dst >= 0
  src, dst = (src[ok], dst[ok]) if forward else (dst[ok], src[ok])
  order = np.argsort(src, kind="stable")
  src, dst = src[order], dst[order]
  starts = np.searchsorted(src, np.arange(states + 1))
  seen = np.zeros(states, bool)
  seen[seeds] = True
  frontier = np.asarray(seeds, np.int64)
  while frontier.size:
    spans = [dst[starts[s]:starts[s + 1]] for s in frontier.tolist()]
    nxt = np.unique(np.concatenate(spans)) if spans else frontier[:0]
    frontier = nxt[~seen[nxt]]
    seen[frontier] = True
  return seen


def _check_vocab(vocab) -> Vocabulary:
  if not isinstance(vocab, Vocabulary):
    raise ValueError(f"vocab must be a jaxdecode.structured.Vocabulary (e.g. "
                     f"models.ByteTokenizer().vocabulary()); got {type(vocab).__name__}")
  return vocab


@functools.lru_cache(maxsize=64)
def _compile_regex(pattern: str, vocab: Vocabulary, what: str) -> Constraint:
  initial, accepting, delta = _byte_dfa(pattern, what)
  return _token_automaton(initial, accepting, delta, vocab, what)


def regex(pattern: str, vocab: Vocabulary) -> Constraint:
  """The generated text must match `pattern` as a whole (Rust `regex` syntax, like Python's
  `re` for the common cases: classes, groups, alternation, repetition, `{m,n}`).

  The pattern always matches the whole text: a leading `^` / `\\A` and a trailing `$` / `\\z`
  are dropped; anchors and word boundaries elsewhere, backreferences and lookarounds are a
  ValueError (no token automaton can follow them). A `\\d` is any Unicode digit: write
  `[0-9]`. One known gap: after the noncharacter U+FFFF in the text, outlines-core's DFA may
  allow less than the pattern does (outputs still match). The compile has a budget (`DFA_SECONDS`,
  `DFA_MEMORY`, `MAX_STATES`, `MAX_WORK`): past it, a ValueError with the numbers.

  Examples:
    >>> from jaxdecode import structured
    >>> from jaxdecode.models import ByteTokenizer
    >>> c = structured.regex(r"[0-9]{4}-[0-9]{2}", ByteTokenizer().vocabulary())
    >>> c.rows, c.next_state.shape[0] >= 8
    (1, True)
  """
  if not isinstance(pattern, str) or not pattern:
    raise ValueError(f"pattern must be a non-empty regular expression string; got {pattern!r:.80}")
  what = f"regex {pattern!r:.80}"
  return _compile_regex(_whole_match(pattern, what), _check_vocab(vocab), what)


def _whole_match(pattern: str, what: str) -> str:
  """`pattern` without a leading `^` / `\\A` or a trailing `$` / `\\z` (a constraint always
  matches the whole text, so they say nothing); a ValueError naming what no token automaton
  can do: an anchor or word boundary elsewhere, a backreference, a lookaround. Then a ValueError
  when its bounded repeats foreseeably expand past the budget (`_estimate_positions`)."""
  body = pattern
  if body.startswith("^"):
    body = body[1:]
  elif body.startswith("\\A"):
    body = body[2:]
  i, in_class, end = 0, 0, len(body)
  while i < end:
    ch = body[i]
    if ch == "\\" and i + 1 < end:
      nxt = body[i + 1]
      if not in_class:
        if nxt in "123456789" or body.startswith("k<", i + 1):
          raise ValueError(f"{what} uses a backreference ({body[i:i + 3]!r}): it is not a "
                           f"regular language, so no token automaton can follow it")
        if nxt in "AzbB<>" or (nxt == "z" and i + 2 < end):
          if nxt == "z" and i + 2 == end:
            body = body[:i]
            break
          if nxt in "bB<>":
            raise ValueError(f"{what} uses the word boundary \\{nxt}, which structured "
                             f"decoding does not support: spell the characters around it")
          raise ValueError(f"{what} uses the anchor \\{nxt} inside the pattern, which "
                           f"structured decoding does not support: a constraint always matches "
                           f"the whole text (a leading ^ or \\A and a trailing $ or \\z are "
                           f"dropped as redundant)")
      i += 2
      continue
    if ch == "[":
      in_class += 1
      i += 1
      if body.startswith("^", i):
        i += 1
      if body.startswith("]", i):  # a literal ] first in a class
        i += 1
      continue
    if ch == "]" and in_class:
      in_class -= 1
    elif not in_class:
      if body.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
        raise ValueError(f"{what} uses a lookaround ({body[i:i + 4]!r}...), which structured "
                         f"decoding does not support (no token automaton can express it): "
                         f"write the condition into the pattern itself")
      if ch == "$" and i == end - 1:
        body = body[:i]
        break
      if ch in "^$":
        raise ValueError(f"{what} uses the anchor {ch!r} inside the pattern, which structured "
                         f"decoding does not support: a constraint always matches the whole "
                         f"text (a leading ^ and a trailing $ are dropped as redundant)")
    i += 1
  if not body:
    raise ValueError(f"{what} matches only the empty text: nothing to generate")
  positions = _estimate_positions(body)
  if positions is not None and positions > MAX_STATES:
    raise ValueError(f"{what}: its repeats expand to about {positions} positions, so its "
                     f"automaton would have more states than the budget of {MAX_STATES} "
                     f"(structured.MAX_STATES); lower the repeat counts")
  return body


def _estimate_positions(pattern: str) -> int | None:
  """The number of character positions of `pattern` with every bounded repeat expanded (a
  lower bound on its DFA's states), from Python's own regex parser; None where Python's syntax
  differs from the pattern's (the build's time and memory budget still holds)."""
  try:
    import re._parser as parser  # pylint: disable=import-outside-toplevel
  except ImportError:  # Python 3.10
    import sre_parse as parser  # pylint: disable=import-outside-toplevel,deprecated-module
  try:
    tree = parser.parse(pattern)
  except Exception:  # pylint: disable=broad-except  # a syntax Python does not share
    return None

  def size(items) -> int:
    total = 0
    for op, arg in items:
      name = str(op)
      if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        low, high, sub = arg
        high = low if high == parser.MAXREPEAT else high
        total += max(high, 1) * size(sub)
      elif name == "SUBPATTERN":
        total += size(arg[-1])
      elif name == "BRANCH":
        total += sum(size(branch) for branch in arg[1])
      elif name in ("AT", "GROUPREF"):
        continue
      else:
        total += 1
    return total

  return size(tree)


# JSON schema keywords outlines-core turns into the regex, and annotations that constrain
# nothing. Any other keyword is refused rather than silently ignored.
_SCHEMA_KEYWORDS = {
    "type", "properties", "required", "items", "prefixItems", "enum", "const", "anyOf", "oneOf",
    "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format",
    "minItems", "maxItems", "additionalProperties", "minProperties", "maxProperties",
    "title", "description", "$schema", "$id", "$comment", "examples", "default"}
_FORMATS = {"date", "date-time", "time", "uuid", "email", "uri"}


MAX_SCHEMA_DEPTH = 32  # nested schemas (outlines-core's JSON parser stops near 64)
MAX_STRING_LENGTH = 5000  # a string's minLength/maxLength: ~10 DFA states per character
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _check_schema(node, path: str = "schema", depth: int = 0) -> None:
  if isinstance(node, bool):
    return
  if not isinstance(node, dict):
    raise ValueError(f"{path} must be a JSON object (a schema); got {node!r:.80}")
  if depth > MAX_SCHEMA_DEPTH:
    raise ValueError(f"{path} is nested {depth} schemas deep, past structured decoding's depth "
                     f"limit of {MAX_SCHEMA_DEPTH} (structured.MAX_SCHEMA_DEPTH)")
  for key in _COUNTS:
    value = node.get(key)
    if key in node and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
      raise ValueError(f"{path}.{key} must be an integer >= 0; got {value!r:.80}")
  for low, high in (("minLength", "maxLength"), ("minItems", "maxItems"),
                    ("minProperties", "maxProperties")):
    if low in node and high in node and node[low] > node[high]:
      raise ValueError(f"{path}.{low} ({node[low]}) is more than {path}.{high} ({node[high]})")
  for key in ("minLength", "maxLength"):
    if node.get(key, 0) > MAX_STRING_LENGTH:
      raise ValueError(f"{path}.{key} is {node[key]}: its automaton would have about "
                       f"{10 * node[key]} states (about 10 per character, for multi-byte "
                       f"characters and escapes), past the budget of {MAX_STRING_LENGTH} "
                       f"characters (structured.MAX_STRING_LENGTH)")
  if "required" in node:
    required = node["required"]
    if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
      raise ValueError(f"{path}.required must be a list of property names; got "
                       f"{required!r:.80}")
    missing = [r for r in required if r not in node.get("properties", {})]
    if missing:
      raise ValueError(f"{path}.required names {missing!r:.80}, which {path}.properties does "
                       f"not define (the output could never hold them)")
  if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
    raise ValueError(f"{path}.enum must be a non-empty list; got {node['enum']!r:.80}")
  for key, value in node.items():
    if key not in _SCHEMA_KEYWORDS:
      raise ValueError(f"{path} uses the JSON schema keyword {key!r}, which structured decoding "
                       f"does not support (supported: {', '.join(sorted(_SCHEMA_KEYWORDS))})")
    if key == "format" and value not in _FORMATS:
      raise ValueError(f"{path} has format {value!r}; supported formats: {sorted(_FORMATS)}")
    if key == "pattern" and ("minLength" in node or "maxLength" in node):
      raise ValueError(f"{path} sets both pattern and minLength/maxLength, which outlines-core "
                       f"cannot combine (it would drop the pattern); use one of them")
    if key in ("properties", "$defs", "definitions"):
      if not isinstance(value, dict):
        raise ValueError(f"{path}.{key} must be an object; got {value!r:.80}")
      for name, sub in value.items():
        _check_schema(sub, f"{path}.{key}.{name}", depth + 1)
    elif key in ("items", "additionalProperties") and not isinstance(value, bool):
      _check_schema(value, f"{path}.{key}", depth + 1)
    elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
      if not isinstance(value, list) or not value:
        raise ValueError(f"{path}.{key} must be a non-empty list of schemas; got {value!r:.80}")
      for i, sub in enumerate(value):
        _check_schema(sub, f"{path}.{key}[{i}]", depth + 1)


@functools.lru_cache(maxsize=64)
def _compile_schema(text: str, vocab: Vocabulary) -> Constraint:
  # In a process of its own too: outlines-core writes an array's items twice, so nested arrays
  # double the regex per level (32 levels: a 2^32-character string).
  _, reply = _run_workers([text], "json_schema")
  if reply[:2] == b"er":
    message = reply[2:].decode("utf-8", "replace").splitlines()[0][:200]
    raise ValueError(f"json_schema cannot be compiled: {message}")
  pattern = reply[2:].decode("utf-8")
  # outlines-core writes formats such as date with `\d`, which is any Unicode digit in this
  # regex syntax ("7\u0668\u0665\u0665-11-30" is not a date): JSON formats mean ASCII digits.
  pattern = re.sub(r"(?<!\\)((?:\\\\)*)\\d", r"\1[0-9]", pattern)
  return _compile_regex(pattern, vocab, "json_schema")


def json_schema(schema, vocab: Vocabulary) -> Constraint:
  """The generated text must be JSON that validates against `schema` (a dict or a JSON string).

  Supported: objects (properties, required), arrays (items, minItems/maxItems), strings
  (minLength/maxLength or pattern; formats date, date-time, time, uuid, email, uri), numbers,
  integers, booleans, null, enum, const, anyOf/oneOf/allOf, $ref/$defs. Numeric bounds,
  uniqueItems, patternProperties and every other keyword are a ValueError naming it.
  Whitespace between tokens is limited to what outlines-core allows (at most one space).
  """
  if isinstance(schema, str):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as e:
      raise ValueError(f"json_schema is not valid JSON: {e}") from None
  if not isinstance(schema, dict):
    raise ValueError(f"json_schema must be a JSON schema object (a dict or a JSON string); got "
                     f"{schema!r:.80}")
  _check_schema(schema)
  return _compile_schema(json.dumps(schema), _check_vocab(vocab))  # keeps the key order


def _escape(text: str) -> str:
  """A regex matching `text` literally (Rust `regex` syntax)."""
  return "".join("\\" + ch if ch in "\\.+*?()|[]{}^$#&-~" else ch for ch in text)


def choice(options: Sequence[str], vocab: Vocabulary) -> Constraint:
  """The generated text must be exactly one of `options` (non-empty strings)."""
  if isinstance(options, (str, bytes)) or not hasattr(options, "__iter__"):
    raise ValueError(f"options must be a list of strings; got {options!r:.80}")
  options = list(options)
  if not options or any(not isinstance(o, str) or not o for o in options):
    raise ValueError(f"options must be a non-empty list of non-empty strings; got "
                     f"{options!r:.120}")
  # One order (longest first) for a set of options, so that the cache finds it again.
  ordered = sorted(dict.fromkeys(options), key=lambda o: -len(o.encode()))
  return _compile_regex("(" + "|".join(_escape(o) for o in ordered) + ")", _check_vocab(vocab),
                        f"choice {options!r:.80}")


def _pass_through(vocab_size: int) -> Constraint:
  """One accepting state that allows every token: an unconstrained row."""
  return Constraint(next_state=jnp.zeros((1, 1), jnp.int32),
                    token_class=jnp.zeros((1, vocab_size), jnp.int32),
                    accepting=jnp.ones((1,), bool), initial=jnp.zeros((1,), jnp.int32),
                    automaton=jnp.zeros((1,), jnp.int32))


def stack(constraints: Sequence[Constraint | None]) -> Constraint:
  """One constraint per row: row r follows `constraints[r]`; `None` leaves a row unconstrained.

  The automata share one table: their states are numbered one after another, each keeps its
  own token classes (a row of `token_class`).
  """
  if isinstance(constraints, Constraint) or not isinstance(constraints, (list, tuple)) \
      or not constraints:
    raise ValueError(f"stack takes a non-empty list of constraints or None; got "
                     f"{constraints!r:.80}")
  real = [c for c in constraints if c is not None]
  for i, c in enumerate(constraints):
    if c is not None and (not isinstance(c, Constraint) or c.rows != 1):
      raise ValueError(f"constraints[{i}] must be one constraint (from regex, json_schema or "
                       f"choice) or None; got {type(c).__name__}")
  if not real:
    raise ValueError("stack needs at least one constraint (every entry is None)")
  vocab_size = real[0].token_class.shape[1]
  if any(c.token_class.shape[1] != vocab_size for c in real):
    raise ValueError(f"the constraints are built for different vocabularies (sizes "
                     f"{sorted({c.token_class.shape[1] for c in real})})")
  if len({c.eos_ids for c in real}) > 1:
    raise ValueError(f"the constraints are built for vocabularies with different EOS ids "
                     f"({sorted({c.eos_ids for c in real})}); stack needs one vocabulary")
  parts = list(dict.fromkeys(id(c) for c in real))  # each distinct automaton once
  by_id = {id(c): c for c in real}
  automata = [by_id[i] for i in parts] + [_pass_through(vocab_size)]
  offsets = np.cumsum([0] + [a.next_state.shape[0] for a in automata])
  width = max(a.next_state.shape[1] for a in automata)
  table = np.full((_bucket(int(offsets[-1])), _bucket(width)), NOT_ALLOWED, np.int32)
  accepting = np.zeros(table.shape[0], bool)
  for a, start in zip(automata, offsets):
    t = np.asarray(a.next_state)
    table[start:start + t.shape[0], :t.shape[1]] = np.where(t >= 0, t + start, NOT_ALLOWED)
    accepting[start:start + t.shape[0]] = np.asarray(a.accepting)
  which = {i: n for n, i in enumerate(parts)}
  pick = [which[id(c)] if c is not None else len(parts) for c in constraints]
  initial = [int(offsets[p]) + int(automata[p].initial[0]) for p in pick]
  return Constraint(next_state=jnp.asarray(table),
                    token_class=jnp.concatenate([a.token_class for a in automata]),
                    accepting=jnp.asarray(accepting), initial=jnp.asarray(initial, jnp.int32),
                    automaton=jnp.asarray(pick, jnp.int32), eos_ids=real[0].eos_ids)


def check_token_sets(constraint: Constraint, params, prompts: int, n: int = 1) -> None:
  """ValueError when concrete `banned_token_ids` / `allowed_token_ids` leave a row of the
  constraint nothing to select at some state it can reach (`generate`'s check; in the loops,
  traced sets make such a step a dead end instead).

  Args:
    constraint: one constraint or `prompts * n` stacked rows.
    params: the `SamplingParams` of `prompts` rows (each row's sets apply to its n samples).
    prompts, n: the rows are prompts · n, prompt-major.
  """
  fields = [getattr(params, f) for f in ("banned_token_ids", "allowed_token_ids")]
  if any(isinstance(f, jax.core.Tracer) for f in fields):
    return
  if not any(np.any(np.asarray(f) >= 0) for f in fields):
    return  # no token sets: every state keeps what the constraint allows
  vocab = constraint.token_class.shape[1]
  banned, allowed_ids = (np.asarray(f).reshape((-1, np.shape(f)[-1])) if np.ndim(f) else
                         np.zeros((1, 0), np.int32) for f in fields)
  table = np.asarray(constraint.next_state)  # [S, C]: class-level, never [S, V]
  classes = np.asarray(constraint.token_class)  # [A, V]
  rows = prompts * n
  initial = np.broadcast_to(np.asarray(constraint.initial), (rows,))
  automaton = np.broadcast_to(np.asarray(constraint.automaton), (rows,))
  for r in range(rows):
    b = r // n
    mask = np.ones(vocab, bool)
    ban = banned[b % banned.shape[0]]
    mask[ban[(ban >= 0) & (ban < vocab)]] = False
    keep = allowed_ids[b % allowed_ids.shape[0]]
    keep = keep[(keep >= 0) & (keep < vocab)]
    if keep.size:
      only = np.zeros(vocab, bool)
      only[keep] = True
      mask &= only
    # A class stays usable when one of its tokens survives the sets.
    usable = np.zeros(table.shape[1], bool)
    usable[np.unique(classes[automaton[r]][mask])] = True
    moves = np.where(usable[None, :], table, NOT_ALLOWED)
    seen, todo = {int(initial[r])}, [int(initial[r])]
    while todo:
      state = todo.pop()
      targets = moves[state][moves[state] >= 0]
      if not targets.size:
        raise ValueError(f"row {r}: banned_token_ids/allowed_token_ids remove every token the "
                         f"constraint allows at some point of its text (automaton state "
                         f"{state}), so the row would have nothing to select; relax the token "
                         f"sets or the constraint")
      for target in set(targets.tolist()) - seen:
        seen.add(target)
        todo.append(target)


# ---------------------------------------------------------------------------------------------
# Inside the loops (traced).


def check(constraint, batch: int, vocab: int, caller: str, params=None, eos_ids=None):
  """Validates `constraint=` of a loop (Python, before tracing); returns it broadcast to B rows
  (or None).

  With concrete `params`, token sets that leave a row nothing to select at a state it can reach
  are a ValueError (`check_token_sets`; traced ones make such a step a dead end), and so is a
  `min_new_tokens` that no text of the constraint can reach (`check_min_new_tokens`). With
  `eos_ids` (the loop's), anything but the constraint's own EOS ids is a ValueError
  (`check_eos`).
  """
  if constraint is None:
    return None
  if not isinstance(constraint, Constraint):
    raise ValueError(f"{caller}: constraint must be a jaxdecode.structured constraint (regex, "
                     f"json_schema, choice or stack) or None; got {type(constraint).__name__}")
  if constraint.token_class.shape[1] != vocab:
    raise ValueError(f"{caller}: the constraint is built for a vocabulary of "
                     f"{constraint.token_class.shape[1]} tokens but the logits have {vocab}")
  if constraint.rows not in (1, batch):
    raise ValueError(f"{caller}: the constraint has {constraint.rows} rows (from stack) but the "
                     f"batch has {batch}; stack one entry per row")
  if eos_ids is not None:
    check_eos(constraint, eos_ids, caller)
  if params is not None:
    check_token_sets(constraint, params, batch)
    check_min_new_tokens(constraint, params, batch, caller=caller)
  if constraint.rows == 1 and batch != 1:
    constraint = dataclasses.replace(
        constraint, initial=jnp.broadcast_to(constraint.initial, (batch,)),
        automaton=jnp.broadcast_to(constraint.automaton, (batch,)))
  return constraint


def check_eos(constraint: Constraint, eos_ids, caller: str) -> None:
  """ValueError unless the loop's `eos_ids` are exactly the constraint's EOS ids.

  The automaton allows an EOS id only where the text is a whole match. Another id as the
  loop's EOS would end rows in the middle of a match (an ordinary token of the text), and
  without the vocabulary's EOS among them the EOS would be written as text.
  """
  if isinstance(eos_ids, jax.core.Tracer):
    raise ValueError(f"{caller}: with a constraint, eos_ids must be concrete (they are checked "
                     f"against the constraint's EOS ids {list(constraint.eos_ids)})")
  given = sorted({int(e) for e in np.asarray(eos_ids).reshape(-1).tolist()})
  if given != list(constraint.eos_ids):
    raise ValueError(f"{caller}: eos_ids {given} disagree with the constraint's EOS ids "
                     f"{list(constraint.eos_ids)} (its Vocabulary's): a constrained row may "
                     f"only end where its text is a whole match, with the vocabulary's EOS; "
                     f"pass eos_ids={list(constraint.eos_ids)}")


def longest_texts(constraint: Constraint) -> np.ndarray:
  """The most tokens other than EOS that each row can take before its automaton allows only
  EOS: int64[R], or -1 where it is unbounded (a loop is reachable). Host arithmetic on the
  tables: one walk over each automaton's states."""
  table = np.asarray(constraint.next_state)
  classes = np.asarray(constraint.token_class)  # [A, V]
  text = np.ones(classes.shape[1], bool)
  text[list(constraint.eos_ids)] = False
  out, memo = [], {}
  for start, a in zip(np.asarray(constraint.initial).tolist(),
                      np.asarray(constraint.automaton).tolist()):
    if (start, a) not in memo:
      usable = np.zeros(table.shape[1], bool)  # classes with a token other than EOS
      usable[np.unique(classes[a][text])] = True
      memo[start, a] = _longest_path(np.where(usable[None, :], table, NOT_ALLOWED), start)
    out.append(memo[start, a])
  return np.asarray(out, np.int64)


def _longest_path(table: np.ndarray, start: int) -> int:
  """Edges s -> table[s, c] (c with table[s, c] >= 0): the longest path from `start`, or -1
  when a cycle is reachable from it."""
  successors = {}
  todo, seen = [start], {start}
  while todo:  # the states reachable from start
    state = todo.pop()
    nxt = np.unique(table[state][table[state] >= 0]).tolist()
    successors[state] = nxt
    for t in nxt:
      if t not in seen:
        seen.add(t)
        todo.append(t)
  indegree = dict.fromkeys(successors, 0)
  for nxt in successors.values():
    for t in nxt:
      indegree[t] += 1
  order = [s for s, d in indegree.items() if d == 0]  # Kahn: a topological order
  for state in order:
    for t in successors[state]:
      indegree[t] -= 1
      if indegree[t] == 0:
        order.append(t)
  if len(order) < len(successors):
    return -1
  longest = dict.fromkeys(successors, 0)
  for state in reversed(order):
    longest[state] = max((1 + longest[t] for t in successors[state]), default=0)
  return longest[start]


def check_min_new_tokens(constraint: Constraint, params, prompts: int, n: int = 1, *,
                         caller: str = "generate") -> None:
  """ValueError when a concrete `min_new_tokens` is more than every text of a row's constraint
  can hold: such a row could only stop at a dead end (its EOS is masked where the automaton
  allows nothing else). A row whose constraint has some longer texts and some shorter ones is
  not refused: it ends at a dead end (flagged) only if it takes a short one.

  Args:
    constraint: one constraint or `prompts * n` stacked rows.
    params: the `SamplingParams` of `prompts` rows (each row's value applies to its n samples).
  """
  least = params.min_new_tokens
  if isinstance(least, jax.core.Tracer):
    return
  least = np.broadcast_to(np.asarray(least).reshape(-1), (prompts,))
  if not np.any(least > 0):
    return
  longest = np.broadcast_to(longest_texts(constraint), (prompts * n,))
  for r in range(prompts * n):
    need = int(least[r // n])
    if 0 <= longest[r] < need:
      raise ValueError(f"{caller}: row {r}: min_new_tokens={need} but every text of its "
                       f"constraint ends after at most {int(longest[r])} tokens (then only EOS "
                       f"is allowed), so the row could only stop at a dead end; lower "
                       f"min_new_tokens to at most {int(longest[r])}")


def allowed(constraint: Constraint, state: jax.Array) -> jax.Array:
  """bool[B, V]: the tokens each row may take from its automaton state (int32[B]). An EOS id
  is a token that accepting states allow and that keeps the state."""
  classes = constraint.token_class[constraint.automaton]  # [B, V]
  return jnp.take_along_axis(constraint.next_state[state], classes, axis=1) >= 0


def advance(constraint: Constraint, state: jax.Array, token: jax.Array) -> jax.Array:
  """int32[B]: each row's state after `token` (a token not allowed keeps it)."""
  cls = jnp.take_along_axis(constraint.token_class[constraint.automaton], token[:, None],
                            axis=1)[:, 0]
  nxt = constraint.next_state[state, cls]
  return jnp.where(nxt >= 0, nxt, state)
