"""Speculative decoding whose output is bit for bit `decode`'s, only faster.

Each round, a drafter guesses up to K next tokens of every row; one multi-token model call
(`step_fn(state, tokens [B, K + 1], positions [B]) -> (logits [B, K + 1, V], state)`) gives the
logits after the row's newest token and after each draft. Then the tokens are drawn exactly as
`decode` draws them (coupled verification): at each of the K + 1 positions, `loop.draw` with the
row's step t (key `fold_in(row_key, t)`, the same processors, the penalty counts including the
drafts accepted so far, `min_new_tokens`). A draft is accepted while it equals the drawn token;
the first drawn token that differs, or the drawn token after K accepted drafts, ends the row's
round. So a row's tokens and log-probabilities are those of `decode` whenever the model gives the
same logits for K tokens in one call as in K single steps (the embedded transformer does, bit for
bit), whatever the drafter proposes; a good drafter only makes it faster. The acceptance rate is
the probability that the drawn token equals the draft.

The model is rolled back by position alone: a round that accepts a < K drafts leaves stale cache
entries beyond the row's new position, which the next call overwrites before anything reads
them. A cache must hold the `prompt + max_new_tokens - 1` positions whose logits the tokens are
drawn from (`decode`'s need; checked when the step function declares `position_limit`); the
last rounds also write drafts up to K positions past those, which the step function must drop
(the embedded model drops writes past its cache) or have room for: a step function that writes
a call whole or not at all declares `step_fn.whole_calls = True` (the adapters over a
shared-index cache do), and the check then asks for room for the drafts too.

Drafters (pure pytrees with `propose(context, num_draft_tokens) -> (drafts int32[B, K],
drafter)`; write your own):

- `NgramDrafter`: prompt lookup. The longest recent suffix n-gram of the row's own prompt +
  generated tokens that occurred earlier in that row, and the tokens that followed its latest
  earlier occurrence (continued periodically, so a loop is predicted whole).
- `ModelDrafter`: a small model's greedy tokens, its cache kept in step with the accepted tokens
  by position (it feeds its newest token and its K drafts each round).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode import _checks
from jaxdecode import _platform
from jaxdecode import loop
from jaxdecode import processors
from jaxdecode import structured
from jaxdecode.decoding import (DecodeOutput, check_fits, check_prompt_tokens, check_step_output,
                                make_spec)
from jaxdecode.params import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
  """What a drafter sees at the start of a round (B rows, at most N new tokens).

  Attributes:
    tokens: int32[B, N], each row's new tokens so far (pad_id after them).
    lengths: int32[B], how many.
    last: int32[B], each row's newest token (not yet fed to the model).
    positions: int32[B], the position of `last` (the first draft goes at `positions + 1`).
    live: bool[B], rows still generating.
  """
  tokens: jax.Array
  lengths: jax.Array
  last: jax.Array
  positions: jax.Array
  live: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpeculativeOutput(DecodeOutput):
  """`DecodeOutput` (tokens, logprobs, lengths and finished equal to `decode`'s) plus statistics.

  Attributes:
    accepted: int32[B], drafts accepted (each one a token that cost no model call of its own).
    drafted: int32[B], drafts proposed while the row was live (K per round).
    calls: int32[], multi-token model calls (rounds) made.

  `state` is the model state after the last call; unlike `decode`'s, it has seen drafts beyond
  the last accepted token (stale entries that a later call at the right position overwrites).
  """
  accepted: jax.Array
  drafted: jax.Array
  calls: jax.Array

  @property
  def acceptance_rate(self) -> jax.Array:
    """Accepted / drafted drafts over all rows (NaN if nothing was drafted)."""
    return jnp.sum(self.accepted) / jnp.sum(self.drafted)


# ---------------------------------------------------------------------------------------------
# Drafters.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  """Prompt lookup: continue the longest recent suffix n-gram seen earlier in the row.

  Attributes:
    prompts: int32[B, T], the prompts, right-padded (`jaxdecode.right_pad`).
    prompt_lengths: int32[B].
    min_ngram, max_ngram: the suffix lengths tried, longest first (static).
  """
  prompts: jax.Array
  prompt_lengths: jax.Array
  min_ngram: int = dataclasses.field(default=1, metadata=dict(static=True))
  max_ngram: int = dataclasses.field(default=3, metadata=dict(static=True))

  def propose(self, context: DraftContext, num_draft_tokens: int):
    history, length = _history(self.prompts, self.prompt_lengths, context)
    return jax.vmap(lambda h, n: _lookup(h, n, self.min_ngram, self.max_ngram,
                                         num_draft_tokens))(history, length), self


def _history(prompts, prompt_lengths, context: DraftContext):
  """Each row's prompt followed by its new tokens: (int32[B, T + N], lengths int32[B])."""
  width = prompts.shape[1]
  total = width + context.tokens.shape[1]
  i = jnp.arange(total, dtype=jnp.int32)[None, :]  # [1, T + N]
  from_prompt = i < prompt_lengths[:, None]
  new_index = jnp.clip(i - prompt_lengths[:, None], 0, context.tokens.shape[1] - 1)
  padded_prompts = jnp.pad(prompts, ((0, 0), (0, total - width)))
  history = jnp.where(from_prompt, padded_prompts,
                      jnp.take_along_axis(context.tokens, new_index, axis=1))
  return history, prompt_lengths + context.lengths


def _lookup(history, length, min_ngram: int, max_ngram: int, k: int):
  """One row: the K tokens after the latest earlier occurrence of its longest matching suffix.

  Drafts run periodically past the end of the history (a suffix matched q tokens back predicts
  the same q tokens again). With no match, the drafts repeat the newest token.
  """
  size = history.shape[0]
  i = jnp.arange(size, dtype=jnp.int32)
  best_start = jnp.int32(-1)  # the first token after the chosen match
  for n in range(min_ngram, max_ngram + 1):  # longer n-grams overwrite shorter ones
    suffix = lax.dynamic_slice_in_dim(jnp.pad(history, (n, 0)), length, n)  # history[L-n:L]
    windows = jnp.stack([jnp.roll(history, -j) for j in range(n)], axis=1)  # [size, n]
    # A window at i ends before the suffix starts, so a token follows it inside the history.
    match = jnp.all(windows == suffix[None, :], axis=1) & (i + n < length) & (length >= n + 1)
    latest = jnp.max(jnp.where(match, i, -1))
    best_start = jnp.where(latest >= 0, latest + n, best_start)
  period = jnp.maximum(length - best_start, 1)
  j = jnp.arange(k, dtype=jnp.int32)
  found = history[jnp.clip(best_start + j % period, 0, size - 1)]
  newest = history[jnp.clip(length - 1, 0, size - 1)]
  return jnp.where(best_start >= 0, found, newest).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A small model's greedy tokens as drafts.

  Attributes:
    step_fn: the draft model's step, `decode`'s contract `(state, tokens [B], positions [B]) ->
      (logits [B, V], state)` (static: build it once).
    state: the draft model's state after a prefill of the same prompts (its cache must hold
      `prompt + max_new_tokens + K + 1` positions).
  """
  state: Any
  step_fn: Callable = dataclasses.field(metadata=dict(static=True))

  def propose(self, context: DraftContext, num_draft_tokens: int):
    # Feed the newest token and each draft: K + 1 steps, so that the draft cache holds every
    # position up to the last draft (whatever the target accepts, the next round finds the
    # positions before its own newest token written).
    def body(carry, j):
      state, token = carry
      logits, state = self.step_fn(state, token, context.positions + j)
      nxt = processors.first_argmax(processors.remove_nan(logits))
      return (state, nxt), nxt

    (state, _), drafts = lax.scan(body, (self.state, context.last),
                                  jnp.arange(num_draft_tokens + 1, dtype=jnp.int32))
    return drafts[:num_draft_tokens].T, dataclasses.replace(self, state=state)


# ---------------------------------------------------------------------------------------------
# The loop.


def _speculative(step_fn, state, logits, key, params, positions, eos_ids, pad_id, counts,
                 logits_processors, drafter, constraint, prompt_tokens=None, *,
                 max_new_tokens: int, num_draft_tokens: int, chunk_size: int,
                 scores: bool = False):
  batch, vocab = logits.shape
  k = num_draft_tokens
  spec = make_spec(key, params, positions, eos_ids, pad_id, logits_processors, batch=batch,
                   vocab=vocab, constraint=constraint, prompt_tokens=prompt_tokens)
  check_step_output(jax.eval_shape(step_fn, state, jnp.zeros((batch, k + 1), jnp.int32),
                                   positions), state, (batch, k + 1, vocab))
  loop.check_processors(spec, batch, vocab, max_new_tokens)

  def call_model(operands):
    """Propose K drafts and score them: one (K + 1)-token model call."""
    s, drafter = operands
    at = positions + s.lengths - 1  # the position of each row's newest token
    context = DraftContext(tokens=s.tokens, lengths=s.lengths, last=s.last, positions=at,
                           live=s.live)
    drafts, drafter = drafter.propose(context, k)
    drafts = jnp.asarray(drafts, jnp.int32)
    tokens = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [B, K + 1]
    round_logits, model_state = step_fn(s.model_state, tokens, at)
    return round_logits.astype(jnp.float32), drafts, drafter, model_state

  def from_prefill(operands):
    """Round 0: the prefill's logits at position 0 and drafts that never match (-1), so that
    only token 0 is drawn; no model call."""
    s, drafter = operands
    round_logits = jnp.broadcast_to(prefill_logits[:, None], (batch, k + 1, vocab))
    return round_logits, jnp.full((batch, k), -1, jnp.int32), drafter, s.model_state

  def advance(carry, r, call=None):
    """Round r: propose, one (K + 1)-token model call, draw and accept. Round 0 draws token 0
    from the prefill's logits instead (on CPU and TPU in the same loop body, so the program
    holds the processor chain once; `call`: see `loop.run_from_prefill`); a round in which no
    row is live calls nothing on CPU and TPU, and is not counted in `calls` anywhere."""
    s, drafter, accepted, drafted, calls = carry
    calling = (r > 0) & jnp.any(s.live)
    round_logits, drafts, drafter, model_state = loop.call_or_skip(
        call, calling, call_model, from_prefill, (s, drafter))
    drafted = drafted + jnp.int32(k) * (s.live & calling)

    # Defined per round, not once: a loop body is traced once per formulation
    # (`jaxdecode._platform`), and jax caches a traced body by the function's identity.
    def verify(carry, j):
      s, in_run, accepted, logits, drafts = carry
      kinds = None
      if s.scores is None:
        token, logprob = loop.draw(spec, s, logits[:, j], s.lengths)
      else:  # decode(scores=True)'s step: the same draw, with every kind of the token
        token, logprob, _, kinds, _ = loop.draw_scored(spec, s, logits[:, j], s.lengths)
      recorded = in_run & s.live & ~jnp.isnan(logprob)  # NaN: nothing selectable, a dead end
      s = loop.record(spec, s, token, logprob, in_run, kinds=kinds)
      draft = drafts[:, jnp.minimum(j, k - 1)]
      match = (j < k) & (token == draft)
      return (s, in_run & match, accepted + (recorded & match), logits, drafts), None

    init = (s.replace(model_state=model_state), s.live, accepted, round_logits, drafts)
    (s, _, accepted, _, _), _ = lax.scan(verify, init, jnp.arange(k + 1, dtype=jnp.int32))
    return s, drafter, accepted, drafted, calls + calling

  # float32 is exact for every float dtype the chain takes: it begins by casting to float32.
  prefill_logits = logits.astype(jnp.float32)
  s = loop.init_state(spec, state, counts, max_new_tokens, scores=scores)
  zeros = jnp.zeros((batch,), jnp.int32)
  carry = (s, drafter, zeros, zeros, jnp.int32(0))
  s, _, accepted, drafted, calls = _platform.by_platform(
      lambda carry: loop.run_from_prefill(advance, carry, rounds=max_new_tokens,
                                          chunk=chunk_size, done=lambda c: loop.all_done(c[0])),
      carry)
  return SpeculativeOutput(s.tokens, s.logprobs, s.lengths, s.finished, s.model_state,
                           accepted, drafted, calls, dead_end=s.dead_end, scores=s.scores)


_speculative_jit = jax.jit(_speculative, static_argnames=(
    "step_fn", "max_new_tokens", "num_draft_tokens", "chunk_size", "scores"))


def speculative_decode(step_fn: Callable, state: Any, logits: jax.Array, *, key,
                       params: SamplingParams, max_new_tokens: int, positions: jax.Array,
                       drafter, num_draft_tokens: int = 4, eos_ids: Sequence[int] = (),
                       pad_id: int = 0, counts=None, chunk_size: int = 4,
                       logits_processors: Sequence[Callable] | None = None,
                       constraint=None, prompt_tokens=None,
                       scores: bool = False) -> SpeculativeOutput:
  """`decode`, with K drafted tokens verified per model call: the same tokens, fewer calls.

  Args:
    step_fn: the model's multi-token step `(state, tokens int32[B, K + 1], positions int32[B])
      -> (logits [B, K + 1, V], state)`: the logits after each of the K + 1 tokens, written at
      positions `positions[b] + j`; it must give bitwise the logits of K + 1 single steps (the
      embedded transformer's step does) for the output to equal `decode`'s. Static.
    state, logits, key, params, max_new_tokens, positions, eos_ids, pad_id, counts,
    logits_processors, constraint, prompt_tokens, scores: as in `decode` (drafts are verified under
      the constraint: a draft token the automaton does not allow is never accepted, so the
      output is the constrained `decode`'s).
    drafter: a pytree with `propose(context: DraftContext, num_draft_tokens) -> (drafts
      int32[B, K], drafter)`, e.g. `NgramDrafter` or `ModelDrafter`.
    num_draft_tokens: K (static), drafts per round.
    chunk_size: rounds per scanned chunk (the loop stops after the first chunk that leaves no
      live row).

  Returns:
    A `SpeculativeOutput`: `decode`'s fields for the same key (bit for bit given a model whose
    K-token calls equal K single steps), plus `accepted`, `drafted` and `calls`.
  """
  batch, vocab = _checks.logits(logits)
  if not callable(step_fn):
    raise ValueError(f"step_fn must be callable; got {type(step_fn).__name__}")
  max_new_tokens = _checks.max_new_tokens(max_new_tokens, batch, caller="speculative_decode")
  num_draft_tokens = _checks.integer("num_draft_tokens", num_draft_tokens, low=1, high=64)
  chunk_size = _checks.integer("chunk_size", chunk_size, low=1)
  if not callable(getattr(drafter, "propose", None)):
    raise ValueError(f"drafter must have a propose(context, num_draft_tokens) method (e.g. "
                     f"jaxdecode.NgramDrafter); got {type(drafter).__name__}")
  eos = _checks.token_ids("eos_ids", eos_ids, vocab, many=True)
  params, counts = processors.check_call(logits, params, counts, caller="speculative_decode",
                                         loop=True, eos_ids=eos)
  _checks.key(key, batch)
  counts = jnp.zeros((batch, vocab), jnp.int32) if counts is None else counts
  positions = _checks.row_integers("positions", positions, batch, "one per row of the logits")
  pad = _checks.token_ids("pad_id", pad_id, vocab, many=False)
  constraint = structured.check(constraint, batch, vocab, "speculative_decode", params,
                                eos_ids=eos_ids)
  check_fits(step_fn, state, positions, max_new_tokens, "speculative_decode",
             drafts=num_draft_tokens if getattr(step_fn, "whole_calls", False) else 0)
  prompt_tokens = check_prompt_tokens(prompt_tokens, batch, "speculative_decode")
  scores = _checks.boolean("scores", scores)
  return _speculative_jit(step_fn, state, jnp.asarray(logits), key, params, positions, eos, pad,
                          counts, loop.as_processors(logits_processors), drafter, constraint,
                          prompt_tokens,
                          max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
                          chunk_size=chunk_size, scores=scores)
