"""Structured decoding on the device: regexes, JSON schemas and choices as token automata.

A constraint is a deterministic automaton over the model's tokens: from each state, each token
either leads to one next state or is not allowed. It is held as device tables, and each row of
a decoding loop carries its automaton state as one int32, so the mask of a step is one gather
inside the jitted loop, with no host round trip (the libraries of the field compute each
step's mask on the host):

- `Vocabulary(tokens, eos_ids)`: the bytes of each token (`None` for a special token) and the
  end-of-sequence ids. `jaxdecode.models.ByteTokenizer().vocabulary()` is the embedded model's.
- `regex(pattern, vocab)`, `json_schema(schema, vocab)`, `choice(options, vocab)`: one
  constraint. The language is compiled to a token automaton by outlines-core (regex -> byte DFA
  -> token transitions; JSON schema -> regex), then renumbered and packed into tables here.
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

import dataclasses
import functools
import hashlib
import json
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
  """
  next_state: jax.Array
  token_class: jax.Array
  accepting: jax.Array
  initial: jax.Array
  automaton: jax.Array

  @property
  def rows(self) -> int:
    return self.initial.shape[0]

  def nbytes(self) -> int:
    """The device memory of the tables, in bytes."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self))


def _bucket(n: int, low: int = 8) -> int:
  return max(low, 1 << max(n - 1, 0).bit_length())


def _from_outlines(index, vocab: Vocabulary, what: str) -> Constraint:
  """Renumbers outlines-core's index and packs it into tables (dead states removed).

  Vectorized: a 32k vocabulary and a JSON schema of a few hundred states pack in seconds.
  """
  transitions = index.get_transitions()  # {state: {token: next}}
  initial = index.get_initial_state()
  finals = set(index.get_final_states())
  names = np.array(sorted(set(transitions) | finals | {initial} |
                          {n for t in transitions.values() for n in set(t.values())}), np.int64)
  number = lambda values: np.searchsorted(names, values)  # state name -> row
  states, vocab_size = len(names), len(vocab)
  ordinary = np.zeros(vocab_size + 1, bool)  # tokens a move may use (the last: out of range)
  ordinary[[i for i, t in enumerate(vocab.tokens) if t is not None]] = True
  ordinary[list(vocab.eos_ids)] = False
  dense = np.full((states, vocab_size), NOT_ALLOWED, np.int32)
  for name, moves in transitions.items():
    tokens = np.fromiter(moves.keys(), np.int64, len(moves))
    targets = number(np.fromiter(moves.values(), np.int64, len(moves)))
    keep = ordinary[np.minimum(tokens, vocab_size)]
    dense[number(name), tokens[keep]] = targets[keep]
  accepting = np.zeros(states, bool)
  accepting[number(np.array(sorted(finals), np.int64))] = True
  # An EOS id is allowed in an accepting state, and keeps the state (the row ends there).
  for e in vocab.eos_ids:
    dense[accepting, e] = np.flatnonzero(accepting)
  # Keep only states from which an accepting state can be reached (walking back from them): a
  # row never walks into a state where it could not finish.
  parents = [[] for _ in range(states)]
  for state in range(states):
    for target in np.unique(dense[state][dense[state] >= 0]).tolist():
      parents[target].append(state)
  alive = accepting.copy()
  todo = np.flatnonzero(accepting).tolist()
  while todo:
    for state in parents[todo.pop()]:
      if not alive[state]:
        alive[state] = True
        todo.append(state)
  if not alive[number(initial)]:
    raise ValueError(f"{what} matches no text that this vocabulary's tokens can spell (its "
                     f"language is empty)")
  dense[(dense >= 0) & ~alive[np.maximum(dense, 0)]] = NOT_ALLOWED
  columns, token_class = _token_classes(dense)
  s_pad, c_pad = _bucket(states), _bucket(columns.shape[0])
  next_state = np.full((s_pad, c_pad), NOT_ALLOWED, np.int32)
  next_state[:states, :columns.shape[0]] = columns.T
  accepting_pad = np.zeros(s_pad, bool)
  accepting_pad[:states] = accepting & alive
  return Constraint(next_state=jnp.asarray(next_state),
                    token_class=jnp.asarray(token_class[None, :], jnp.int32),
                    accepting=jnp.asarray(accepting_pad),
                    initial=jnp.asarray([int(number(initial))], jnp.int32),
                    automaton=jnp.zeros((1,), jnp.int32))


def _token_classes(dense: np.ndarray):
  """Tokens with equal columns of `dense` [S, V] share a class: `(columns [C, S], class [V])`,
  classes in the lexicographic order of their columns (as `np.unique(dense.T, axis=0)`).

  Columns are grouped by two random 64-bit hashes first (a [V, S] unique is slow for V = 32k),
  then checked; a collision falls back to the exact unique.
  """
  weights = np.random.default_rng(0).integers(1, 2**62, size=(dense.shape[0], 2), dtype=np.int64)
  with np.errstate(over="ignore"):
    hashes = (dense.T.astype(np.int64) + 1) @ weights  # [V, 2], wrapping
  _, first, inverse = np.unique(hashes, axis=0, return_index=True, return_inverse=True)
  inverse = inverse.reshape(-1)
  columns = dense.T[first]  # [C, S]
  if not np.array_equal(columns[inverse], dense.T):
    columns, inverse = np.unique(dense.T, axis=0, return_inverse=True)
    return columns, inverse.reshape(-1)
  order = np.lexsort(columns.T[::-1])
  rank = np.empty_like(order)
  rank[order] = np.arange(order.size)
  return columns[order], rank[inverse]


def _check_vocab(vocab) -> Vocabulary:
  if not isinstance(vocab, Vocabulary):
    raise ValueError(f"vocab must be a jaxdecode.structured.Vocabulary (e.g. "
                     f"models.ByteTokenizer().vocabulary()); got {type(vocab).__name__}")
  return vocab


@functools.lru_cache(maxsize=64)
def _compile_regex(pattern: str, vocab: Vocabulary, what: str) -> Constraint:
  from outlines_core import Index  # pylint: disable=import-outside-toplevel
  try:
    index = Index(pattern, vocab._outlines)  # pylint: disable=protected-access
  except (ValueError, RuntimeError, TypeError) as e:
    raise ValueError(f"{what} cannot be compiled: {str(e).splitlines()[0][:200]}") from None
  return _from_outlines(index, vocab, what)


def regex(pattern: str, vocab: Vocabulary) -> Constraint:
  """The generated text must match `pattern` as a whole (Rust `regex` syntax, like Python's
  `re` for the common cases: classes, groups, alternation, repetition, `{m,n}`).

  Known limits of the automaton outlines-core builds (0.2): an alternation is leftmost-first,
  so in `(x|xy)` the longer branch is never produced (put longer alternatives first; `choice`
  does); with a byte-level vocabulary, a multi-byte character cannot follow a text that is
  already a whole match (`é{1,2}` only gives "é"). A `\\d` is any Unicode digit: write `[0-9]`.
  Outputs always match; the language can be smaller than the pattern's.

  Examples:
    >>> from jaxdecode import structured
    >>> from jaxdecode.models import ByteTokenizer
    >>> c = structured.regex(r"[0-9]{4}-[0-9]{2}", ByteTokenizer().vocabulary())
    >>> c.rows, c.next_state.shape[0] >= 8
    (1, True)
  """
  if not isinstance(pattern, str) or not pattern:
    raise ValueError(f"pattern must be a non-empty regular expression string; got {pattern!r:.80}")
  return _compile_regex(pattern, _check_vocab(vocab), f"regex {pattern!r:.80}")


# JSON schema keywords outlines-core turns into the regex, and annotations that constrain
# nothing. Any other keyword is refused rather than silently ignored.
_SCHEMA_KEYWORDS = {
    "type", "properties", "required", "items", "prefixItems", "enum", "const", "anyOf", "oneOf",
    "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format",
    "minItems", "maxItems", "additionalProperties", "minProperties", "maxProperties",
    "title", "description", "$schema", "$id", "$comment", "examples", "default"}
_FORMATS = {"date", "date-time", "time", "uuid", "email", "uri"}


def _check_schema(node, path: str = "schema") -> None:
  if isinstance(node, bool):
    return
  if not isinstance(node, dict):
    raise ValueError(f"{path} must be a JSON object (a schema); got {node!r:.80}")
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
        _check_schema(sub, f"{path}.{key}.{name}")
    elif key in ("items", "additionalProperties") and not isinstance(value, bool):
      _check_schema(value, f"{path}.{key}")
    elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
      if not isinstance(value, list) or not value:
        raise ValueError(f"{path}.{key} must be a non-empty list of schemas; got {value!r:.80}")
      for i, sub in enumerate(value):
        _check_schema(sub, f"{path}.{key}[{i}]")


@functools.lru_cache(maxsize=64)
def _compile_schema(text: str, vocab: Vocabulary) -> Constraint:
  from outlines_core.json_schema import build_regex_from_schema  # pylint: disable=import-outside-toplevel
  try:
    pattern = build_regex_from_schema(text)
  except (ValueError, RuntimeError, TypeError) as e:
    raise ValueError(f"json_schema cannot be compiled: {str(e).splitlines()[0][:200]}") from None
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
  # Longest first: outlines-core's alternation is leftmost-first, so an option that extends an
  # earlier one ("yes", "yesterday") would otherwise never be produced.
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
                    automaton=jnp.asarray(pick, jnp.int32))


def _allowed_tables(constraint: Constraint) -> tuple[np.ndarray, np.ndarray]:
  """Host copies: bool[A, S, V] (token allowed from state, per automaton) and next int[A, S, V]."""
  table = np.asarray(constraint.next_state)
  classes = np.asarray(constraint.token_class)  # [A, V]
  moves = table[:, classes].transpose(1, 0, 2)  # [A, S, V]
  return moves >= 0, moves


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
  allowed, moves = _allowed_tables(constraint)
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
    ok, nxt = allowed[automaton[r]] & mask, moves[automaton[r]]
    seen, todo = {int(initial[r])}, [int(initial[r])]
    while todo:
      state = todo.pop()
      tokens = np.flatnonzero(ok[state])
      if not tokens.size:
        raise ValueError(f"row {r}: banned_token_ids/allowed_token_ids remove every token the "
                         f"constraint allows at some point of its text (automaton state "
                         f"{state}), so the row would have nothing to select; relax the token "
                         f"sets or the constraint")
      for target in set(nxt[state, tokens].tolist()) - seen:
        seen.add(target)
        todo.append(target)


# ---------------------------------------------------------------------------------------------
# Inside the loops (traced).


def check(constraint, batch: int, vocab: int, caller: str, params=None):
  """Validates `constraint=` of a loop (Python, before tracing); returns it broadcast to B rows
  (or None). With concrete `params`, token sets that leave a row nothing to select at a state it
  can reach are a ValueError (`check_token_sets`); traced ones make such a step a dead end."""
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
  if params is not None:
    check_token_sets(constraint, params, batch)
  if constraint.rows == 1 and batch != 1:
    constraint = dataclasses.replace(
        constraint, initial=jnp.broadcast_to(constraint.initial, (batch,)),
        automaton=jnp.broadcast_to(constraint.automaton, (batch,)))
  return constraint


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
