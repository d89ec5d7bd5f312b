"""`decode`: the autoregressive loop that drives any JAX step function with jaxdecode's samplers.

It is the loop skeleton of `jaxdecode.loop` with one model call per step: step 0 draws from the
prefill logits; step t >= 1 feeds each row's token t - 1 to `step_fn` and draws from the logits
it returns. So N new tokens cost N - 1 model calls (one loop body for all N steps).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdecode import _checks
from jaxdecode import _platform
from jaxdecode import loop
from jaxdecode import processors
from jaxdecode import sampling
from jaxdecode import structured
from jaxdecode.params import SamplingParams


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
    dead_end: bool[B] True where a step of the row had nothing selectable (its processed
      logits all -inf or NaN: e.g. a model past its cache, or your processor removed every
      token). The row stopped at that step: `lengths` does not count it, and `tokens` hold
      `pad_id` from there.
    state: the model state after the last `step_fn` call (it has seen every new token except
      the last, which is `tokens[:, -1]`; feed it to continue).
    top_tokens: with `top_logprobs=K`, int32[B, N, K]: at each step the K most likely tokens,
      best first (ties to the lower id), in `logprobs_mode`'s distribution; `pad_id` after a
      row's end. None otherwise.
    top_logprobs: with `top_logprobs=K`, float32[B, N, K], their log-probabilities (-inf for
      tokens the processors removed, 0 after a row's end); None otherwise.
    scores: with `scores=True`, a `jaxdecode.Scores` of float32[B, N]: each token's raw,
      tempered and processed log-probability and the log of the tempered mass its processed
      distribution kept (0 where `tokens` has no token; `jaxdecode.scoring` defines them);
      None otherwise.
  """

  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  finished: jax.Array
  state: Any
  # Keyword-only, so that subclasses (`SpeculativeOutput`) can add fields without defaults.
  dead_end: jax.Array = dataclasses.field(kw_only=True)
  top_tokens: Any = dataclasses.field(default=None, kw_only=True)
  top_logprobs: Any = dataclasses.field(default=None, kw_only=True)
  scores: Any = dataclasses.field(default=None, kw_only=True)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TopState:
  """The top-K lists so far, carried beside the `LoopState` (B rows, N steps, K entries).

  Attributes:
    tokens: int32[B, N, K], pad_id where nothing was recorded.
    logprobs: float32[B, N, K], 0 where nothing was recorded.
  """
  tokens: jax.Array
  logprobs: jax.Array


def check_step_output(out, state, shape: tuple) -> None:
  """Raises ValueError (at trace time) unless step_fn returned (float logits of `shape`, state)
  with the state's structure, shapes and dtypes unchanged."""
  if not (isinstance(out, tuple) and len(out) == 2):
    raise ValueError(f"step_fn must return a pair (logits, state); got {type(out).__name__}")
  logits, new_state = out
  if jnp.shape(logits) != shape or not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
    raise ValueError(f"step_fn must return logits of shape {shape} and a floating dtype, like "
                     f"the prefill logits; got shape {jnp.shape(logits)} and dtype "
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


def position_limit(step_fn, state) -> int | None:
  """How many positions `state` can hold (a call may feed positions 0 .. limit - 1), when the
  step function knows: `step_fn.position_limit(state)`, an attribute a step function over a
  cache of fixed length declares (the embedded model's does); None otherwise."""
  declared = getattr(step_fn, "position_limit", None)
  if declared is None:
    return None
  limit = declared(state)
  return None if limit is None else _checks.integer("step_fn.position_limit(state)", limit,
                                                    low=0)


def check_fits(step_fn, state, positions, max_new_tokens: int, caller: str,
               drafts: int = 0) -> None:
  """Raises ValueError, before anything runs, when the step function declares how many positions
  its state holds (`position_limit`) and some row would need more: N new tokens from position p
  feed the model positions p .. p + N - 2, so the state must hold p + N - 1 positions. (Past
  them a model has no valid logits; a row that meets logits with nothing selectable would stop
  there, a dead end.) With K `drafts` per call (speculative decoding) every row's calls feed
  its newest token and K drafts, up to position p + N - 1 + K, so the state must hold
  p + N + K. Traced positions are not checked."""
  if _checks.is_traced(positions):
    return
  past = drafts + 1 if drafts else 0  # positions fed past the last one decode needs
  need = np.asarray(positions, np.int64) + max_new_tokens - 1 + past
  if need.size and need.max() > np.iinfo(np.int32).max:
    raise ValueError(f"{caller}: positions up to {int(np.max(positions))} plus "
                     f"max_new_tokens={max_new_tokens} pass int32's largest position "
                     f"({np.iinfo(np.int32).max}); ask for fewer tokens")
  limit = position_limit(step_fn, state)
  if limit is None:
    return
  if need.size == 0 or need.max() <= limit:
    return
  row = int(np.argmax(need))
  start = int(np.asarray(positions)[row])
  with_drafts = f" with num_draft_tokens={drafts}" if drafts else ""
  most = limit - int(np.asarray(positions).max()) + 1 - past
  raise ValueError(f"{caller}: max_new_tokens={max_new_tokens}{with_drafts} does not fit the "
                   f"model state: row {row} starts at position {start}, so it needs "
                   f"{int(need[row])} positions, but the state holds {limit} "
                   f"(step_fn.position_limit(state)); prefill with a cache of at least "
                   f"{int(need.max())} positions, or ask for at most {max(most, 0)} new tokens")


def make_spec(key, params: SamplingParams, positions, eos_ids, pad_id, logits_processors,
              *, batch: int, vocab: int, constraint=None, prompt_tokens=None) -> loop.LoopSpec:
  """The `LoopSpec` of checked inputs, built under jit (sanitizes traced values by rule)."""
  return loop.LoopSpec(row_keys=sampling.row_keys(key, batch), params=params.sanitized(),
                       is_eos=loop.eos_mask(eos_ids, vocab),
                       pad_id=loop.checked_pad_id(pad_id, vocab), positions=positions,
                       logits_processors=logits_processors, constraint=constraint,
                       prompt=loop.right_aligned_prompt(prompt_tokens))


def check_prompt_tokens(prompt_tokens, batch: int, caller: str):
  """None, or the prompts as an int32 array [B, T] (negative ids are padding)."""
  if prompt_tokens is None:
    return None
  return _checks.token_rows("prompt_tokens", prompt_tokens, batch,
                            "each row's prompt, padded with -1", caller)


def score(logits, processed, token, logprob, *, top_logprobs: int, logprobs_mode: str):
  """The chosen tokens' log-probabilities in `logprobs_mode` and the top-K lists.

  Args:
    logits: [B, V] the model's logits of this step (what "raw" scores).
    processed: float32[B, V] the processed logits the tokens were drawn from ("processed").
    token, logprob: the drawn tokens and their processed log-probabilities (`loop.draw`).
    top_logprobs: K (static), 0 for no lists.
    logprobs_mode: "processed" or "raw" (static).

  Returns:
    `(logprob float32[B], top_ids int32[B, K], top_values float32[B, K])`, best first; the
    processed log-probability of a drawn token is bitwise its entry of the list.
  """
  base = processed if logprobs_mode == "processed" else processors.prepare(logits)
  logp = sampling.log_softmax(base)
  if logprobs_mode == "raw":
    logprob = jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]
  values, ids = lax.top_k(logp, top_logprobs)  # ties: the lower id first
  return logprob, ids.astype(jnp.int32), values


def _record_top(s: loop.LoopState, top: TopState, ids, values, selectable) -> TopState:
  """Writes each live row's list at its column `lengths[b]` (as `loop.record` does the token;
  not for a row whose step had nothing selectable)."""
  rows = jnp.arange(ids.shape[0], dtype=jnp.int32)
  column = jnp.where(s.live & selectable, s.lengths, s.tokens.shape[1])  # N: dropped
  return TopState(tokens=top.tokens.at[rows, column].set(ids, mode="drop"),
                  logprobs=top.logprobs.at[rows, column].set(values, mode="drop"))


def draw_and_record(spec: loop.LoopSpec, s: loop.LoopState, top: TopState | None, logits, step,
                    *, top_logprobs: int = 0, logprobs_mode: str = "processed", forced=None):
  """One step of `decode` after the model call: draw, score, record. Returns `(s, top)`.

  With the defaults (no lists, processed log-probabilities, no kinds, no forced tokens) this is
  `loop.draw` then `loop.record`, exactly; `top` is None then. `forced`: int32[B, N], the
  tokens to emit instead of drawing (column `step[b]` of row b).
  """
  kinds = None
  if top_logprobs == 0 and logprobs_mode == "processed" and s.scores is None and forced is None:
    token, logprob = loop.draw(spec, s, logits, step)
    return loop.record(spec, s, token, logprob), top
  if s.scores is None and forced is None:
    token, logprob, processed = loop.draw_processed(spec, s, logits, step)
    selectable = ~jnp.isnan(logprob)  # the processed log-probability marks a dead end
  else:
    column = jnp.minimum(step, forced.shape[1] - 1)[:, None] if forced is not None else None
    token, logprob, processed, kinds, selectable = loop.draw_scored(
        spec, s, logits, step,
        None if forced is None else jnp.take_along_axis(forced, column, axis=1)[:, 0])
  drawn = logprob  # mirostat's surprise is the processed one, whatever logprobs_mode reports
  if top_logprobs or logprobs_mode != "processed":
    logprob, ids, values = score(logits, processed, token, logprob, top_logprobs=top_logprobs,
                                 logprobs_mode=logprobs_mode)
    if top is not None:
      top = _record_top(s, top, ids, values, selectable)
  return loop.record(spec, s, token, logprob, selectable=selectable, drawn_logprob=drawn,
                     kinds=kinds), top


def start(spec: loop.LoopSpec, model_state, logits, counts, max_new_tokens: int, *,
          top_logprobs: int = 0, scores: bool = False):
  """The loop's carry before step 0: `(LoopState, TopState | None, float32 logits [B, V])`,
  the logits being the prefill's, which step 0 draws from (see `make_advance`)."""
  s = loop.init_state(spec, model_state, counts, max_new_tokens, scores=scores)
  top = None
  if top_logprobs:
    batch = logits.shape[0]
    top = TopState(tokens=jnp.full((batch, max_new_tokens, top_logprobs), spec.pad_id,
                                   jnp.int32),
                   logprobs=jnp.zeros((batch, max_new_tokens, top_logprobs), jnp.float32))
  # float32 is exact for every float dtype the chain takes: it begins by casting to float32.
  return s, top, logits.astype(jnp.float32)


def make_advance(step_fn, spec: loop.LoopSpec, *, top_logprobs: int = 0,
                 logprobs_mode: str = "processed", forced=None):
  """`advance((s, top, logits), t) -> (s, top, logits)`: step t of `decode` (shared by `decode`
  and `jaxdecode.models.stream`). For t >= 1 token t - 1 is fed to `step_fn` and its logits
  replace the carried ones; step 0 draws from the carried prefill logits. On CPU and TPU no
  model call either once every row has finished (the rest of a chunk then costs no model time).
  Then token t is drawn and recorded. `call`: see `loop.run_from_prefill`.

  On CPU and TPU one loop body serves every step, step 0 included, so the program holds the
  processor chain once: compiling it is most of a decode program's compile time.
  """

  def advance(carry, t, call=None):
    s, top, logits = carry

    def call_model(model_state):
      new_logits, model_state = step_fn(model_state, s.last, spec.positions + t - 1)
      return new_logits.astype(jnp.float32), model_state

    logits, model_state = loop.call_or_skip(call, (t > 0) & jnp.any(s.live), call_model,
                                            lambda m: (logits, m), s.model_state)
    s = s.replace(model_state=model_state)
    s, top = draw_and_record(spec, s, top, logits, jnp.full(s.last.shape, t, jnp.int32),
                             top_logprobs=top_logprobs, logprobs_mode=logprobs_mode,
                             forced=forced)
    return s, top, logits

  return advance


def output(carry) -> DecodeOutput:
  """The `DecodeOutput` of a loop carry `(LoopState, TopState | None, logits)`."""
  s, top, _ = carry
  return DecodeOutput(s.tokens, s.logprobs, s.lengths, s.finished, s.model_state,
                      dead_end=s.dead_end,
                      top_tokens=None if top is None else top.tokens,
                      top_logprobs=None if top is None else top.logprobs,
                      scores=s.scores)


def _decode(step_fn, state, logits, key, params, positions, eos_ids, pad_id, counts,
            logits_processors, constraint, prompt_tokens=None, forced=None, *,
            max_new_tokens: int, chunk_size: int, top_logprobs: int = 0,
            logprobs_mode: str = "processed", scores: bool = False):
  batch, vocab = logits.shape
  spec = make_spec(key, params, positions, eos_ids, pad_id, logits_processors, batch=batch,
                   vocab=vocab, constraint=constraint, prompt_tokens=prompt_tokens)
  check_step_output(jax.eval_shape(step_fn, state, jnp.zeros(batch, jnp.int32), positions),
                    state, (batch, vocab))
  loop.check_processors(spec, batch, vocab, max_new_tokens)
  carry = start(spec, state, logits, counts, max_new_tokens, top_logprobs=top_logprobs,
                scores=scores)
  advance = make_advance(step_fn, spec, top_logprobs=top_logprobs, logprobs_mode=logprobs_mode,
                         forced=forced)
  carry = _platform.by_platform(
      lambda carry: loop.run_from_prefill(advance, carry, rounds=max_new_tokens,
                                          chunk=chunk_size, done=lambda c: loop.all_done(c[0])),
      carry)
  return output(carry)


_decode_jit = jax.jit(_decode, static_argnames=("step_fn", "max_new_tokens", "chunk_size",
                                                "top_logprobs", "logprobs_mode", "scores"))


def decode(step_fn: Callable, state: Any, logits: jax.Array, *, key, params: SamplingParams,
           max_new_tokens: int, positions: jax.Array, eos_ids: Sequence[int] = (),
           pad_id: int = 0, counts=None, chunk_size: int = 16,
           logits_processors: Sequence[Callable] | None = None, top_logprobs: int = 0,
           logprobs_mode: str = "processed", constraint=None,
           prompt_tokens=None, scores: bool = False, forced_tokens=None) -> DecodeOutput:
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
    eos_ids: token ids that end a row; the row keeps the EOS and then only `pad_id`. Traced ids
      outside `[0, V)` (e.g. -1 padding) are ignored.
    pad_id: the id written after a row's EOS (and fed to `step_fn` for finished rows). A traced
      pad_id outside `[0, V)` is replaced by 0.
    counts: `int[B, V]` token counts to start the penalties from. None (the default) counts
      only the tokens this call generates, as OpenAI's and vLLM's presence and frequency
      penalties do. To count the prompt too, as HF's repetition_penalty does (its input_ids
      include the prompt), pass `jaxdecode.token_counts(prompt_tokens, V,
      mask=prompt_mask(lengths, T))`.
    chunk_size: steps per scanned chunk; the loop stops after the first chunk in which every
      row has finished.
    logits_processors: your own processors, applied in order to each step's logits before
      anything else (then `min_new_tokens`, then the chain of `params`): pure functions
      `(logits float32[B, V], context: jaxdecode.DecodeContext) -> logits [B, V]`, where the
      context holds each row's step, the new tokens so far and the token counts. Pass arrays
      they need as `jax.tree_util.Partial(fn, arrays...)`: the arrays are then traced, and new
      values never recompile (a plain function is static). Greedy rows take the argmax after
      them; NaN they return counts as -inf.
    top_logprobs: K in 1..20 and at most V (static) to also return, per step, the K most
      likely tokens and their log-probabilities (`DecodeOutput.top_tokens`, `.top_logprobs`);
      0 (the default) computes no lists and leaves the program as it was.
    logprobs_mode: which distribution `logprobs` and the lists score (static): "processed"
      (the default; the distribution the token was drawn from, after every processor and the
      temperature; removed tokens at -inf; 0 for greedy rows) or "raw" (the log-softmax of
      the logits `step_fn` returned, before any processing).
    constraint: a `jaxdecode.structured` constraint (`regex`, `json_schema`, `choice`, or
      `stack` for one per row): each row's new text must follow its automaton; the allowed
      tokens are masked first, before everything else, and an EOS id is allowed only where the
      text is a whole match. Its tables are traced (a new pattern of the same padded sizes does
      not recompile). None: unconstrained.
    prompt_tokens: `int[B, T]`, each row's prompt (negative ids are padding, at either end),
      for the rules that read a row's history (`no_repeat_ngram_size`, DRY, `bad_words`): they see
      the prompt and then the new tokens, as transformers does. None: the new tokens alone.
      Traced (new prompts of the same width do not recompile).
    scores: True (static) to also return every log-probability kind of each token
      (`DecodeOutput.scores`, a `jaxdecode.Scores`: raw, tempered, processed, kept_logmass;
      `jaxdecode.scoring` defines them). False (the default) computes none of them and leaves
      the program as it was. `jaxdecode.score` recomputes them from one forward pass, bitwise.
    forced_tokens: `int[B, N]` (N = max_new_tokens), tokens to emit instead of drawing them
      (forced decoding: replaying a rollout): step t of row b emits `forced_tokens[b, t]`, with
      the same processing as a draw (keys, counts, history, constraint, mirostat state), and its
      log-probabilities are those of that token, of each kind (with `scores=True`). A row still
      ends at an EOS id, at a step with nothing selectable (a dead end) or after N tokens; a
      forced token the processors removed gets processed log-probability -inf. Ids must be in
      [0, V) (pad after a row's end with `pad_id`). Traced. None: draw.

  Returns:
    A `DecodeOutput`. Every traced input (state, logits, key, params, positions, eos_ids,
    pad_id, counts, processor arrays) can change without recompiling; shapes and
    `max_new_tokens` are static.

  Examples:
    A step function that ignores its state and always prefers token (previous + 1) mod 5:

    >>> import jax, jax.numpy as jnp, jaxdecode
    >>> def step_fn(state, tokens, positions):
    ...   return jax.nn.one_hot((tokens + 1) % 5, 5) * 10.0, state
    >>> out = jaxdecode.decode(step_fn, {}, jnp.zeros((2, 5)).at[:, 3].set(10.0),
    ...                        key=jax.random.key(0), params=jaxdecode.SamplingParams(0.0),
    ...                        max_new_tokens=4, positions=jnp.array([3, 1]), eos_ids=[0])
    >>> out.tokens.tolist(), out.lengths.tolist(), out.finished.tolist()
    ([[3, 4, 0, 0], [3, 4, 0, 0]], [3, 3], [True, True])
  """
  batch, vocab = _checks.logits(logits)
  if not callable(step_fn):
    raise ValueError(f"step_fn must be callable; got {type(step_fn).__name__}")
  top_logprobs = _checks.top_logprobs(top_logprobs, vocab)
  # Per row and token: the token and its log-probability, and the top-K lists.
  max_new_tokens = _checks.max_new_tokens(max_new_tokens, batch, caller="decode",
                                          bytes_per_token=8 + 8 * top_logprobs)
  chunk_size = _checks.integer("chunk_size", chunk_size, low=1)
  logprobs_mode = _checks.logprobs_mode(logprobs_mode)
  eos = _checks.token_ids("eos_ids", eos_ids, vocab, many=True)
  params, counts = processors.check_call(logits, params, counts, caller="decode", loop=True,
                                         eos_ids=eos)
  _checks.key(key, batch)
  # Token counts for the penalties, always carried (zeros by default) so that neither turning a
  # penalty on nor passing counts recompiles: an in-place update of B entries per step, read
  # only when a penalty is set.
  counts = jnp.zeros((batch, vocab), jnp.int32) if counts is None else counts
  positions = _checks.row_integers("positions", positions, batch, "one per row of the logits")
  pad = _checks.token_ids("pad_id", pad_id, vocab, many=False)
  constraint = structured.check(constraint, batch, vocab, "decode", params, eos_ids=eos_ids)
  check_fits(step_fn, state, positions, max_new_tokens, "decode")
  prompt_tokens = check_prompt_tokens(prompt_tokens, batch, "decode")
  scores = _checks.boolean("scores", scores)
  forced_tokens = check_forced_tokens(forced_tokens, batch, max_new_tokens, vocab, "decode")
  return _decode_jit(step_fn, state, jnp.asarray(logits), key, params, positions, eos, pad, counts,
                     loop.as_processors(logits_processors), constraint, prompt_tokens,
                     forced_tokens, max_new_tokens=max_new_tokens,
                     chunk_size=chunk_size, top_logprobs=top_logprobs,
                     logprobs_mode=logprobs_mode, scores=scores)


def check_forced_tokens(tokens, batch: int, steps: int, vocab: int, caller: str,
                        name: str = "forced_tokens"):
  """None, or the tokens as an int32 array [B, N], every id in [0, V) (checked when concrete)."""
  if tokens is None:
    return None
  tokens = _checks.array(name, tokens, "an integer array [B, N]")
  if jnp.shape(tokens) != (batch, steps) or \
      not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"{caller}: {name} must be an integer array of shape ({batch}, {steps}) "
                     f"(one row per row of the batch, max_new_tokens columns); got shape "
                     f"{jnp.shape(tokens)} and dtype {jnp.result_type(tokens)}")
  if not _checks.is_traced(tokens):
    values = np.asarray(tokens)
    bad = (values < 0) | (values >= vocab)
    if bad.any():
      row, column = map(int, np.argwhere(bad)[0])
      raise ValueError(f"{caller}: {name} must hold token ids in [0, {vocab}) (pad a row's end "
                       f"with pad_id); got {int(values[row, column])} at [{row}, {column}]")
  return jnp.asarray(tokens, jnp.int32)
