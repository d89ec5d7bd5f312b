"""The loop skeleton: the state and the named steps that every decoding loop is made of.

`decode`, speculative decoding and beam search share this bookkeeping rather than each writing
it again:

- `LoopSpec`: what stays fixed through a loop (row keys, params, EOS ids, pad id, positions,
  user logit processors), all traced data;
- `LoopState`: what changes (the model's state, each row's newest token, the new tokens and
  their log-probabilities so far, lengths, finished rows, penalty counts);
- `draw`: the token of step t of each row, exactly as `decode` draws it (user processors,
  `min_new_tokens`, the processor chain, key `fold_in(row_key, t)`), so that any loop that draws
  through it gives `decode`'s tokens;
- `record`: appends one token to the rows that are still live (EOS, pad, lengths, counts); a
  row whose step had nothing selectable stops there instead (a dead end);
- `run_chunks`: repeats a step in scanned chunks and stops after the first chunk that leaves no
  live row (or, for a loop with a stopping rule of its own, after the first that satisfies it).

Key policy: step t of a row (t = the tokens that row has generated before) samples with
`fold_in(row_key, t)`, whatever loop draws it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode import _platform
from jaxdecode import processors
from jaxdecode import sampling
from jaxdecode import scoring
from jaxdecode import structured
from jaxdecode.params import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeContext:
  """What a user logit processor sees besides the logits (shapes for B rows, N new tokens).

  Attributes:
    step: int32[B], the tokens each row has generated before this one (the t of its key).
    tokens: int32[B, N], the new tokens so far (pad_id from `step` on).
    counts: int32[B, V], how often each row has seen each token (the penalties' counts).
  """
  step: jax.Array
  tokens: jax.Array
  counts: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """The loop's fixed inputs (traced, so new values never recompile).

  Attributes:
    row_keys: typed keys [B], one per row (the key policy).
    params: `SamplingParams`, broadcast to B rows and sanitized.
    is_eos: bool[V], the EOS ids as a mask (ids outside [0, V) ignored).
    pad_id: int32[], written after a row's end and fed to the model for finished rows.
    positions: int32[B], the position of each row's first new token.
    logits_processors: a tuple of user processors `(logits [B, V], DecodeContext) -> logits`
      (pytrees: their array leaves are traced).
    constraint: a `jaxdecode.structured.Constraint` of B rows, or None.
    prompt: int32[B, T], each row's prompt right-aligned (its last token at T - 1, -1 before its
      first), for the rules that read a row's history (`no_repeat_ngram_size`, DRY,
      `bad_words`);
      None: the history is the new tokens alone.
  """
  row_keys: jax.Array
  params: SamplingParams
  is_eos: jax.Array
  pad_id: jax.Array
  positions: jax.Array
  logits_processors: tuple = ()
  constraint: Any = None
  prompt: Any = None


def right_aligned_prompt(prompt_tokens: jax.Array | None) -> jax.Array | None:
  """int32[B, T] prompts whose negative ids are padding (at either end, or anywhere) -> each
  row's tokens in order, right-aligned, -1 before them (a stable sort on validity; traced)."""
  if prompt_tokens is None:
    return None
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  valid = prompt_tokens >= 0
  order = jnp.argsort(valid.astype(jnp.int32), axis=1, stable=True)  # padding first, in order
  moved = jnp.take_along_axis(prompt_tokens, order, axis=1)
  return jnp.where(jnp.take_along_axis(valid, order, axis=1), moved, -1)


def history(spec: LoopSpec, state: "LoopState") -> jax.Array:
  """int32[B, T + N]: each row's prompt (`spec.prompt`; none: T = 0) and new tokens so far,
  oldest first, its newest token at T + N - 1, -1 before its first."""
  return history_of(spec.prompt, state.tokens, state.lengths)


def history_of(prompt: jax.Array | None, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """`history` from its parts: `prompt` int32[B, T] right-aligned (`right_aligned_prompt`) or
  None, the first `lengths[b]` of `tokens` int32[B, N] (what `jaxdecode.metrics` replays)."""
  batch, n = tokens.shape
  prompt = jnp.zeros((batch, 0), jnp.int32) if prompt is None else prompt
  column = jnp.arange(n, dtype=jnp.int32)[None, :]
  new = jnp.where(column < lengths[:, None], tokens, -1)
  full = jnp.concatenate([prompt, new], axis=1)  # [B, T + N], padding after the new tokens
  width = full.shape[1]
  source = jnp.arange(width, dtype=jnp.int32)[None, :] - (n - lengths)[:, None]
  return jnp.where(source >= 0, jnp.take_along_axis(full, jnp.maximum(source, 0), axis=1), -1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """What a loop carries from step to step (B rows, at most N new tokens each).

  Attributes:
    model_state: the step function's state (e.g. weights and KV cache).
    last: int32[B], each row's newest token, not yet fed to the model (pad_id once finished).
    tokens: int32[B, N], the new tokens so far; pad_id elsewhere.
    logprobs: float32[B, N], their log-probabilities (0 elsewhere).
    lengths: int32[B], new tokens so far, an EOS included.
    finished: bool[B], True once the row emitted an EOS id.
    counts: int32[B, V], token counts for the penalties.
    dead_end: bool[B], True once a step of the row had nothing selectable (its processed logits
      all -inf or NaN: a model past its cache, a processor that removes every token); the row
      stopped there, without a token for that step.
    automaton: int32[B], each row's state in `spec.constraint`'s automaton (0 without one).
    mirostat_mu: float32[B], each row's mirostat state mu (2·mirostat_tau at the start; it
      changes only in rows with mirostat == 2).
    scores: a `jaxdecode.scoring.Scores` of float32[B, N] buffers, every log-probability kind
      of each recorded token (0 elsewhere), or None: not asked for, nothing computed.
  """
  model_state: Any
  last: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  finished: jax.Array
  counts: jax.Array
  dead_end: jax.Array
  automaton: jax.Array
  mirostat_mu: jax.Array
  scores: Any = None

  def replace(self, **changes) -> "LoopState":
    return dataclasses.replace(self, **changes)

  @property
  def live(self) -> jax.Array:
    """bool[B]: rows that still generate (no EOS yet, no dead end, fewer than N tokens)."""
    return ~self.finished & ~self.dead_end & (self.lengths < self.tokens.shape[1])


def eos_mask(eos_ids: jax.Array, vocab: int) -> jax.Array:
  """bool[V]: True at the EOS ids; ids outside [0, V) (traced -1 padding, say) are ignored."""
  return jnp.zeros(vocab, bool).at[processors.valid_ids(eos_ids, vocab)].set(True, mode="drop")


def checked_pad_id(pad_id: jax.Array, vocab: int) -> jax.Array:
  """int32[]: a traced pad id outside [0, V) becomes 0 (concrete ones were checked)."""
  pad_id = jnp.asarray(pad_id, jnp.int32)
  return jnp.where((pad_id >= 0) & (pad_id < vocab), pad_id, 0)


def init_state(spec: LoopSpec, model_state, counts: jax.Array, max_new_tokens: int, *,
               scores: bool = False) -> LoopState:
  """The state before the first token: empty buffers (pad_id, 0), nothing finished; with
  `scores` (static) a buffer per log-probability kind (`jaxdecode.scoring`)."""
  batch = spec.positions.shape[0]
  return LoopState(model_state=model_state,
                   last=jnp.full((batch,), spec.pad_id, jnp.int32),
                   tokens=jnp.full((batch, max_new_tokens), spec.pad_id, jnp.int32),
                   logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32),
                   lengths=jnp.zeros((batch,), jnp.int32),
                   finished=jnp.zeros((batch,), bool), counts=counts,
                   dead_end=jnp.zeros((batch,), bool),
                   automaton=(jnp.zeros((batch,), jnp.int32) if spec.constraint is None
                              else spec.constraint.initial),
                   mirostat_mu=jnp.broadcast_to(2.0 * spec.params.mirostat_tau,
                                                (batch,)).astype(jnp.float32),
                   scores=scoring.empty(batch, max_new_tokens) if scores else None)


def process(spec: LoopSpec, state: LoopState, logits: jax.Array, step: jax.Array,
            keys: jax.Array | None = None) -> jax.Array:
  """The processed float32 logits `[B, V]` of step `step[b]` of each row.

  In order: the constraint's mask (tokens its automaton does not allow from the row's state
  become -inf), the user logit processors, then EOS ids masked where `step < min_new_tokens`,
  then the processor chain of `spec.params` with the state's counts and history (`history`).
  Every loop goes through this, so they all apply the same rules.

  Args:
    spec: the loop's fixed inputs.
    state: the current state (its tokens and counts feed the processors and penalties).
    logits: [B, V] the model's logits for this step.
    step: int32[B].
    keys: the keys the step's tokens are drawn with (XTC's draw folds them); None for a loop
      that draws nothing (beam search: XTC then acts only where its probability is 1).
  """
  return processors.process_f32(_chain_inputs(spec, state, logits, step), spec.params,
                                state.counts, keys, history(spec, state), state.mirostat_mu)


def _chain_inputs(spec: LoopSpec, state: LoopState, logits: jax.Array,
                  step: jax.Array) -> jax.Array:
  """The logits `process` hands the chain: the constraint's mask, the user processors, EOS
  masked before `min_new_tokens`."""
  if spec.constraint is not None:
    logits = jnp.where(structured.allowed(spec.constraint, state.automaton),
                       logits.astype(jnp.float32), -jnp.inf)
  if spec.logits_processors:
    context = DecodeContext(step=step, tokens=state.tokens, counts=state.counts)
    logits = logits.astype(jnp.float32)
    for processor in spec.logits_processors:
      logits = processor(logits, context)
  blocked = step < spec.params.min_new_tokens  # [B]: EOS not allowed yet
  logits = _platform.skip_unless(
      jnp.any(blocked) & jnp.any(spec.is_eos),
      lambda x: jnp.where(blocked[:, None] & spec.is_eos[None, :], -jnp.inf, x), logits)
  return logits


def draw(spec: LoopSpec, state: LoopState, logits: jax.Array, step: jax.Array):
  """Step `step[b]` of each row: `(tokens int32[B], logprobs float32[B])`, as `decode` draws it:
  `process`, then one inverse-CDF draw with key `fold_in(row_key, step)`. Rows that are not live
  get a token too; `record` ignores it.
  """
  return draw_processed(spec, state, logits, step)[:2]


def draw_processed(spec: LoopSpec, state: LoopState, logits: jax.Array, step: jax.Array):
  """`draw`, also returning the processed logits it drew from: `(tokens, logprobs, processed
  float32[B, V])` (for the log-probability lists of `decode(top_logprobs=...)`)."""
  keys = jax.vmap(jax.random.fold_in)(spec.row_keys, step)
  processed = process(spec, state, logits, step, keys)
  token, logprob = sampling.draw(keys, processed)
  return token, logprob, processed


def draw_scored(spec: LoopSpec, state: LoopState, logits: jax.Array, step: jax.Array,
                forced: jax.Array | None = None, *, slope: bool = False):
  """`draw_processed` with every log-probability kind of the token (`jaxdecode.scoring`).

  With `forced` (int32[B]) the row's token is `forced[b]` instead of a draw: the same
  processing (same key, counts, history, automaton and mirostat state), and its log-probability
  read from the processed distribution, so a token `decode` drew gets bitwise its logprob
  (`sampling.log_softmax` is `inverse_cdf`'s). `slope` (static): give the kinds a gradient
  for `processed` too (`scoring.token_scores` then differentiates the chain in the backward
  pass, and only there); False: none (nothing differentiates a draw).

  Returns:
    `(tokens int32[B], logprobs float32[B], processed float32[B, V], kinds Scores of [B],
    selectable bool[B])`; `logprobs` are the processed ones (NaN where nothing is selectable,
    with or without `forced`).
  """
  keys = jax.vmap(jax.random.fold_in)(spec.row_keys, step)
  processed = process(spec, state, lax.stop_gradient(logits), step, keys)
  if forced is None:
    token, logprob = sampling.draw(keys, processed)
    selectable = ~jnp.isnan(logprob)
  else:
    token = forced.astype(jnp.int32)
    selectable = jnp.any(processed > -jnp.inf, axis=-1)
  kinds = scoring.token_scores(process_from if slope else None, logits, processed, token,
                               spec.params.temperature,
                               (spec, state.replace(model_state=None), step, keys))
  if forced is not None:
    logprob = jnp.where(selectable, kinds.processed, jnp.nan)
  return token, logprob, processed, kinds, selectable


def process_from(inputs, logits: jax.Array) -> jax.Array:
  """`process` with its other arguments in one pytree `(spec, state, step, keys)`: the chain
  `scoring.token_scores` differentiates."""
  spec, state, step, keys = inputs
  return process(spec, state, logits, step, keys)


def record(spec: LoopSpec, state: LoopState, token: jax.Array, logprob: jax.Array,
           live: jax.Array | None = None, selectable: jax.Array | None = None,
           drawn_logprob: jax.Array | None = None,
           kinds: scoring.Scores | None = None) -> LoopState:
  """Appends `token[b]` (with `logprob[b]`) to every row b that is `live` (default: `state.live`).

  The token goes to column `lengths[b]` and becomes the row's `last`; the row's count of it grows
  by one; an EOS id finishes the row. A live row whose step had nothing `selectable` (default:
  where `logprob` is NaN, `draw`'s mark of such a row) records nothing and stops: its `dead_end`
  is set and its length does not count the step. Rows not recorded keep their buffers; a
  finished or dead-ended row's `last` is pad_id (what the model is fed for it from then on).
  A recorded row with mirostat updates its mu from `drawn_logprob` (default `logprob`), the
  token's log-probability under the distribution it was drawn from. `kinds` (a `Scores` of
  float32[B]) go to `state.scores` at the token's column, when the state carries them.
  """
  recorded = state.live if live is None else live & state.live
  selectable = ~jnp.isnan(logprob) if selectable is None else selectable
  dead_end = state.dead_end | (recorded & ~selectable)
  recorded = recorded & selectable
  rows = jnp.arange(token.shape[0], dtype=jnp.int32)
  column = jnp.where(recorded, state.lengths, state.tokens.shape[1])  # N: dropped
  finished = state.finished | (recorded & spec.is_eos[token])
  scores = state.scores
  if scores is not None and kinds is not None:
    scores = scoring.Scores(*(buffer.at[rows, column].set(value, mode="drop")
                              for buffer, value in zip(scores, kinds)))
  return state.replace(
      scores=scores,
      last=jnp.where(recorded, token, jnp.where(finished | dead_end, spec.pad_id, state.last)),
      tokens=state.tokens.at[rows, column].set(token, mode="drop"),
      logprobs=state.logprobs.at[rows, column].set(logprob, mode="drop"),
      lengths=state.lengths + recorded,
      finished=finished,
      counts=state.counts.at[rows, token].add(recorded.astype(jnp.int32)),
      dead_end=dead_end,
      automaton=state.automaton if spec.constraint is None else jnp.where(
          recorded, structured.advance(spec.constraint, state.automaton, token),
          state.automaton),
      mirostat_mu=jnp.where(recorded, processors.mirostat_update(
          state.mirostat_mu, logprob if drawn_logprob is None else drawn_logprob, spec.params),
                            state.mirostat_mu))


def all_done(state: LoopState) -> jax.Array:
  return ~jnp.any(state.live)


def run_chunks(advance: Callable[[Any, jax.Array], Any], state: Any, *, first: int, rounds: int,
               chunk: int, done: Callable[[Any], jax.Array] = all_done) -> Any:
  """`advance(state, i)` for i = first .. first + rounds - 1, stopping early once `done(state)`.

  The rounds run in `lax.scan` chunks of `chunk` inside a `lax.while_loop` over chunks, so the
  per-round loop overhead (and, on accelerators, the device-to-host check) is paid per chunk;
  the loop stops after the first chunk that leaves `done(state)` true. A last partial chunk runs
  under a `lax.cond` (always, on a GPU: `jaxdecode._platform`). `first`, `rounds` and `chunk`
  are static.

  `state` is a `LoopState` and `done` is `all_done` (no row is live) for `decode`; a loop with a
  state of its own (beam search carries its finished hypotheses beside the beams' `LoopState`)
  passes its own `done`, a bool[] of that state.
  """
  if rounds <= 0:
    return state
  chunk = max(1, min(chunk, rounds))
  full_chunks, tail = divmod(rounds, chunk)

  def scan(state, start, length):
    def body(state, i):
      return advance(state, i), None
    return lax.scan(body, state, start + jnp.arange(length, dtype=jnp.int32))[0]

  def chunk_body(loop):
    c, state = loop
    return c + 1, scan(state, first + c * chunk, chunk)

  def chunk_cond(loop):
    c, state = loop
    return (c < full_chunks) & ~done(state)

  _, state = lax.while_loop(chunk_cond, chunk_body, (jnp.int32(0), state))
  if tail:  # on a GPU (STRAIGHT) the tail runs anyway: its rounds record nothing once done
    state = _platform.skip_unless(~done(state), lambda s: scan(s, first + rounds - tail, tail),
                                  state)
  return state


def run_from_prefill(advance: Callable[[Any, jax.Array, bool | None], Any], state: Any, *,
                     rounds: int, chunk: int, done: Callable[[Any], jax.Array] = all_done) -> Any:
  """`run_chunks` for a loop whose round 0 draws from the prefill's logits, without a model call.

  `advance(state, t, call)` is round t. With `call=None` it calls the model when t > 0 (and,
  if it likes, when some row is live), through `_platform.when`: a `lax.cond` on CPU and TPU,
  so that one loop body serves every round and the program holds the processor chain once. On
  a GPU (STRAIGHT) round 0 is run first by itself with `call=False`, and rounds 1.. with
  `call=None` call the model always: no branch on data inside a round, and the program holds
  the chain twice. The tokens are the same.
  """
  if _platform.mode() == _platform.STRAIGHT:
    state = advance(state, jnp.int32(0), False)
    return run_chunks(lambda s, t: advance(s, t, None), state, first=1, rounds=rounds - 1,
                      chunk=chunk, done=done)
  return run_chunks(lambda s, t: advance(s, t, None), state, first=0, rounds=rounds, chunk=chunk,
                    done=done)


def call_or_skip(call: bool | None, pred: jax.Array, call_model: Callable, skip: Callable,
                 operand):
  """A round's model call: `call_model(operand)` or `skip(operand)` (see `run_from_prefill`).

  `call` True/False decides statically; None decides by `pred` on CPU and TPU (`lax.cond`) and
  calls always on a GPU, where `run_from_prefill` has already run round 0 without a call. When
  `pred` is false, calling must change nothing that the caller keeps but the model's state (a
  finished row is fed `pad_id`; its tokens are not recorded).
  """
  if call is False:
    return skip(operand)
  if call is True:
    return call_model(operand)
  return _platform.when(pred, lambda: call_model(operand), lambda: skip(operand))


def as_processors(logits_processors: Sequence[Callable] | None) -> tuple:
  """User logit processors as pytrees that jit can take as arguments.

  A processor that is a pytree with array leaves (`jax.tree_util.Partial(fn, arrays...)`, a flax
  struct, an equinox module) is kept, so its arrays are traced: new values never recompile. A
  plain function becomes `Partial(fn)` (static: the same function reuses the compiled program).
  """
  if logits_processors is None:
    return ()
  if callable(logits_processors) or not isinstance(logits_processors, (list, tuple)):
    raise ValueError(f"logits_processors must be a list of functions (logits, context) -> "
                     f"logits; got {logits_processors!r:.80}")
  out = []
  for i, p in enumerate(logits_processors):
    if not callable(p):
      raise ValueError(f"logits_processors[{i}] must be a function (logits [B, V], "
                       f"DecodeContext) -> logits [B, V]; got {p!r:.80}")
    leaves = jax.tree.leaves(p)
    out.append(jax.tree_util.Partial(p) if len(leaves) == 1 and leaves[0] is p else p)
  return tuple(out)


def check_processors(spec: LoopSpec, batch: int, vocab: int, max_new_tokens: int) -> None:
  """Raises ValueError (at trace time) unless each user processor returns float logits [B, V]."""
  context = DecodeContext(step=jnp.zeros(batch, jnp.int32),
                          tokens=jnp.zeros((batch, max_new_tokens), jnp.int32),
                          counts=jnp.zeros((batch, vocab), jnp.int32))
  logits = jax.ShapeDtypeStruct((batch, vocab), jnp.float32)
  for i, processor in enumerate(spec.logits_processors):
    out = jax.eval_shape(processor, logits, context)
    if getattr(out, "shape", None) != (batch, vocab) or not jnp.issubdtype(out.dtype,
                                                                            jnp.floating):
      raise ValueError(f"logits_processors[{i}] must return floating logits of shape "
                       f"({batch}, {vocab}); got {out!r:.120}")
