"""`beam_search`: transformers' beam search over any JAX step function, on the loop skeleton.

The search keeps K running beams per row, as K rows of one `loop.LoopState` (row b * K + k is
beam k of prompt row b), and beside them the K best finished hypotheses of each row. Step t:

1. the processed logits of every beam (`loop.process`: user processors, `min_new_tokens`, the
   processor chain with the beam's own token counts), then their log-softmax;
2. candidates: the top C = max(2, 1 + len(eos_ids)) * K of (beam score + log-probability) over
   the row's K * V continuations (ties to the lower beam, then the lower token id); a candidate
   is *possible* iff that float32 sum is > -inf;
3. the next running beams: the K best possible candidates that do not end the sequence (an EOS
   id, or step N - 1); the model state, tokens and counts of their parents are gathered along
   each state leaf's batch axis (`state_axes`). With fewer than K, the other slots are empty
   (score -inf) and stay so;
4. finalization: each possible candidate among the K best that ends the sequence is scored
   `sum of log-probs / (t + 1) ** length_penalty` (t + 1 new tokens, the EOS included, the prompt
   never) and kept if it is among the row's K best hypotheses so far;
5. the row is done once it cannot change any more: once no running beam is left; with
   `early_stopping=True` once it holds K hypotheses; otherwise once it holds K and the best
   running beam cannot beat the worst of them by transformers' estimate (see `beam_search`).
   The loop stops after the first chunk of steps in which every row is done
   (`loop.run_chunks`).

This is the algorithm of transformers 4.x `generate(num_beams=K)` (its vectorized PyTorch
`_beam_search`), except that an impossible candidate (log-probability -inf) is never a
hypothesis nor a running beam. transformers keeps such candidates apart by adding -1e9 to
scores, which float32 cannot keep apart (`-1e9 - 0.51 == -1e9 - 0.92`): when a row has fewer
than K possible continuations, its placeholder beams tie their way into the running beams and
their continuations fill the hypothesis slots with junk. Wherever every step of a row has at
least 2K possible candidates (C of them when there are more EOS ids), the two give the same
beams and scores; `beam_search`'s docstring lists the other differences.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode import _checks
from jaxdecode import _platform
from jaxdecode import decoding
from jaxdecode import loop
from jaxdecode import processors
from jaxdecode import sampling
from jaxdecode import structured
from jaxdecode import threshold
from jaxdecode.params import SamplingParams

EARLY_STOPPING = (True, False, "never")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BeamOutput:
  """What `beam_search` returns: R sequences per prompt row, best first.

  Attributes:
    tokens: int32[B, R, N] the new tokens of each hypothesis; `pad_id` after its end.
    scores: float32[B, R] `sum(logprobs) / lengths ** length_penalty`, descending in each row.
      A slot with no hypothesis (only when the row has fewer than R possible sequences: tight
      truncation, bans, allowed ids, temperature 0 or -inf logits) has score -inf and length 0,
      and comes after every hypothesis. (A hypothesis scores -inf too where lengths **
      length_penalty underflows to 0, e.g. length_penalty=-200; its length tells it apart.)
    lengths: int32[B, R] new tokens, an EOS included; 0 in an empty slot.
    finished: bool[B, R] True where the hypothesis ends with an EOS id (False where it reached
      `max_new_tokens`).
    logprobs: float32[B, R, N] each token's log-probability under its beam's processed
      distribution (log-softmax of the processed logits); 0 after the end.
    dead_end: bool[B] True where a running beam of the row met processed logits with nothing
      selectable (every entry -inf or NaN: e.g. a model past its cache, or a processor that
      removes every token) while the row was searching; that beam ended there, as a `decode`
      row does, without becoming a hypothesis.
  """
  tokens: jax.Array
  scores: jax.Array
  lengths: jax.Array
  finished: jax.Array
  logprobs: jax.Array
  dead_end: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BeamState:
  """What the search carries from step to step (B rows, K beams, N new tokens at most).

  Attributes:
    beams: the running beams as a `LoopState` of B * K rows (row b * K + k: beam k of row b).
    beam_scores: float32[B, K] each running beam's sum of log-probs, best first (transformers'
      `running_beam_scores`); -inf in an empty slot.
    final_tokens: int32[B, K, N] the finished hypotheses (`pad_id` after their end).
    final_logprobs: float32[B, K, N] their per-token log-probabilities.
    final_lengths: int32[B, K] their lengths (0 in an empty slot).
    final_eos: bool[B, K] whether each ends with an EOS id.
    final_scores: float32[B, K] their scores, best first (-inf in an empty slot).
    final_filled: bool[B, K] whether a slot holds a hypothesis (transformers' `is_sent_finished`).
    improvable: bool[B] transformers' `is_early_stop_heuristic_unsatisfied`: the row has a
      running beam, and it may still beat the worst hypothesis.
    done: bool[B] the row's hypotheses can no longer change.
    dead_end: bool[B] a running beam met logits with nothing selectable (`BeamOutput`).
  """
  beams: loop.LoopState
  beam_scores: jax.Array
  final_tokens: jax.Array
  final_logprobs: jax.Array
  final_lengths: jax.Array
  final_eos: jax.Array
  final_scores: jax.Array
  final_filled: jax.Array
  improvable: jax.Array
  done: jax.Array
  dead_end: jax.Array

  def replace(self, **changes) -> "BeamState":
    return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# The state's batch axes.


def leaf_axes(state_axes, state, batch: int) -> tuple:
  """One batch axis per leaf of `state` (in `jax.tree.leaves` order): a nonnegative int or None.

  `state_axes` is a pytree prefix of `state` (like `jax.vmap`'s `in_axes`) whose leaves are ints
  (negative ones count from the end) or None (a shared leaf). 0-d leaves are always shared.
  Raises ValueError, naming the leaf, for a structure that is not a prefix, an axis that is not
  an int or None, an axis out of range, or an axis whose size is not `batch`.
  """
  def bad_axis(a):
    return a is not None and (isinstance(a, bool) or not isinstance(a, int))

  prefix_leaves = jax.tree.leaves(state_axes, is_leaf=lambda x: x is None)
  for a in prefix_leaves:
    if bad_axis(a):
      raise ValueError(f"state_axes must hold ints (a leaf's batch axis) or None (a shared "
                       f"leaf); got {a!r:.80} in {state_axes!r:.200}")
  try:
    full = jax.tree.broadcast(state_axes, state, is_leaf=lambda x: x is None)
  except ValueError as e:
    raise ValueError(f"state_axes must be a pytree prefix of state, like jax.vmap's in_axes "
                     f"(an int for every leaf, None for shared leaves, or a tree of those "
                     f"matching state's structure); got {state_axes!r:.200}. The structures "
                     f"differ: {' '.join(str(e).split())[:400]}") from None
  paths, treedef = jax.tree_util.tree_flatten_with_path(state)
  axes = treedef.flatten_up_to(full)
  out = []
  for (path, leaf), axis in zip(paths, axes):
    shape = jnp.shape(leaf)
    name = f"state{jax.tree_util.keystr(path)}"
    if axis is None or not shape:
      out.append(None)
      continue
    if not -len(shape) <= axis < len(shape):
      raise ValueError(f"state_axes gives {name} (shape {shape}) batch axis {axis}, which it "
                       f"does not have; use an axis in [{-len(shape)}, {len(shape)}) or None "
                       f"for a shared leaf")
    axis %= len(shape)
    if shape[axis] != batch:
      raise ValueError(f"state_axes gives {name} (shape {shape}) batch axis {axis}, of size "
                       f"{shape[axis]}, but the logits have {batch} rows; give the axis of "
                       f"size {batch}, or None for a shared leaf such as weights")
    out.append(axis)
  return tuple(out)


def _map_batched(fn, tree, axes: tuple):
  """`fn(leaf, axis)` on every leaf with a batch axis; shared leaves unchanged."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten([leaf if axis is None else fn(leaf, axis)
                            for leaf, axis in zip(leaves, axes)])


def expand_beams(tree, axes: tuple, beam_size: int):
  """Every batched leaf with each row repeated `beam_size` times (row b -> rows b*K .. b*K+K-1)."""
  return _map_batched(lambda x, a: jnp.repeat(x, beam_size, axis=a), tree, axes)


def take_beams(tree, rows: jax.Array, axes: tuple):
  """Every batched leaf's rows `rows` (int32[B * K]) along its batch axis."""
  return _map_batched(lambda x, a: jnp.take(x, rows, axis=a), tree, axes)


# ---------------------------------------------------------------------------------------------
# One step.


def log_softmax(x: jax.Array) -> jax.Array:
  """float32 log-softmax per row; a row with nothing selectable (all -inf) stays all -inf."""
  empty = jnp.max(x, axis=-1, keepdims=True) == -jnp.inf
  return jnp.where(empty, -jnp.inf, jax.nn.log_softmax(jnp.where(empty, 0.0, x), axis=-1))


def _along(x: jax.Array, index: jax.Array) -> jax.Array:
  """x[b, index[b, j], ...]: gathers along axis 1."""
  index = index.reshape(index.shape + (1,) * (x.ndim - index.ndim))
  return jnp.take_along_axis(x, index, axis=1)


def rank_keys(score: jax.Array, valid: jax.Array) -> jax.Array:
  """int32 keys in the order of (valid, score): every valid entry above every invalid one, valid
  entries in the order of their float32 scores (a NaN score as -inf; -0.0 and +0.0 tie).

  So a hypothesis whose score the length penalty drove to -inf (or 0/0) still outranks an empty
  slot, and `lax.top_k` over the keys orders valid entries exactly as over their scores.
  """
  score = jnp.where(jnp.isnan(score), -jnp.inf, score)
  keys = jnp.where(valid, threshold.order_keys(score), jnp.uint32(0))  # a valid key is > 0
  return lax.bitcast_convert_type(keys ^ jnp.uint32(0x80000000), jnp.int32)


def beam_step(spec: loop.LoopSpec, s: BeamState, logits: jax.Array, t: jax.Array, *,
              axes: tuple, candidates: int, length_penalty: jax.Array, early_stopping,
              max_new_tokens: int) -> BeamState:
  """Step t of the search: candidates from `logits` [B * K, V], new running beams, finalization.

  A candidate is possible iff its log-probability (the float32 sum beam score + token
  log-probability) is > -inf; an impossible one never becomes a hypothesis or a running beam.
  A running slot without a possible candidate left is empty (score -inf), and so are all its
  continuations.

  Args:
    spec: the loop's fixed inputs, B * K rows.
    s: the state before step t (the running beams hold t tokens each).
    logits: the model's logits for token t of every running beam.
    t: int32[] the step.
    axes: the model state's batch axes (`leaf_axes`).
    candidates: C, the candidates per row (`candidate_count`; static).
    length_penalty: float32[].
    early_stopping: True, False or "never" (static).
    max_new_tokens: N (static).
  """
  batch, beams = s.beam_scores.shape
  vocab = logits.shape[-1]
  n = max_new_tokens
  step = jnp.full((batch * beams,), t, jnp.int32)
  logp = log_softmax(loop.process(spec, s.beams, logits, step))  # [B*K, V]
  # A live beam (a running beam of a row still searching) whose processed logits have nothing
  # selectable ends there, as a `decode` row does; the row reports it.
  live = (s.beam_scores > -jnp.inf) & ~s.done[:, None]  # [B, K]
  stuck = live & (jnp.max(logp, axis=-1).reshape(batch, beams) == -jnp.inf)
  total = (logp.reshape(batch, beams, vocab) + s.beam_scores[:, :, None]).reshape(batch, -1)
  cand_scores, cand_index = lax.top_k(total, candidates)  # [B, C], best first
  possible = cand_scores > -jnp.inf  # [B, C]
  parent, token = cand_index // vocab, cand_index % vocab  # [B, C]
  cand_logp = jnp.take_along_axis(logp.reshape(batch, -1), cand_index, axis=1)  # [B, C]
  ends = spec.is_eos[token] | (t == n - 1)  # [B, C]: the candidate ends its sequence

  # The next running beams: the K best possible candidates that go on; -inf marks empty slots.
  beam_scores, pick = lax.top_k(jnp.where(possible & ~ends, cand_scores, -jnp.inf), beams)
  rows = (jnp.arange(batch, dtype=jnp.int32)[:, None] * beams
          + _along(parent, pick)).reshape(-1)  # [B*K]: each new beam's parent row
  state = s.beams
  parents = state.replace(model_state=take_beams(state.model_state, rows, axes),
                          **{f: getattr(state, f)[rows] for f in
                             ("tokens", "logprobs", "lengths", "finished", "counts",
                              "automaton", "mirostat_mu")})
  # Running beams never finish: an EOS id only ends the candidates that are finalized.
  keep_going = dataclasses.replace(spec, is_eos=jnp.zeros_like(spec.is_eos))
  new_beams = loop.record(keep_going, parents, _along(token, pick).reshape(-1),
                          _along(cand_logp, pick).reshape(-1))

  # Finalization: the possible candidates among the K best that end the sequence, while the row
  # still takes hypotheses (transformers' rules: not once full with early_stopping=True, not
  # once the best running beam could not beat the worst hypothesis).
  open_row = s.improvable[:, None]  # [B, 1]
  if early_stopping is True:
    open_row = open_row & ~jnp.all(s.final_filled, axis=1, keepdims=True)
  just_ended = ends[:, :beams] & possible[:, :beams] & open_row  # [B, K]
  length = t + 1
  # A sum of 0 (every token certain) scores 0 at any length, also where length ** length_penalty
  # underflows to 0 or overflows (0 / 0 would be NaN).
  total_top = cand_scores[:, :beams]
  score = jnp.where(total_top == 0, jnp.float32(0),
                    total_top / jnp.power(length.astype(jnp.float32), length_penalty))
  top_parent = parent[:, :beams]  # [B, K]
  columns = jnp.arange(n, dtype=jnp.int32)[None, None, :] == t  # [1, 1, N]
  tokens = jnp.where(columns, token[:, :beams, None],
                     _along(state.tokens.reshape(batch, beams, n), top_parent))
  logprobs = jnp.where(columns, cand_logp[:, :beams, None],
                       _along(state.logprobs.reshape(batch, beams, n), top_parent))
  # The previous hypotheses come first, so a tie keeps the older one.
  _, keep = lax.top_k(rank_keys(jnp.concatenate([s.final_scores, score], axis=1),
                                jnp.concatenate([s.final_filled, just_ended], axis=1)), beams)

  def merge(old, new):
    # A done row keeps its hypotheses as they are, so it ends the same alone or in a batch.
    merged = _along(jnp.concatenate([old, new], axis=1), keep)
    return jnp.where(s.done.reshape((batch,) + (1,) * (old.ndim - 1)), old, merged)

  final_filled = merge(s.final_filled, just_ended)
  # An empty slot holds nothing: pad tokens, log-probabilities 0, length 0, score -inf.
  final_tokens = jnp.where(final_filled[:, :, None], merge(s.final_tokens, tokens), spec.pad_id)
  final_logprobs = jnp.where(final_filled[:, :, None], merge(s.final_logprobs, logprobs), 0.0)
  final_scores = jnp.where(final_filled, merge(s.final_scores, score), -jnp.inf)
  final_lengths = jnp.where(final_filled,
                            merge(s.final_lengths, jnp.full((batch, beams), length, jnp.int32)), 0)
  final_eos = final_filled & merge(s.final_eos, spec.is_eos[token[:, :beams]])

  # Can the row still change? It needs a running beam, and, once it holds K hypotheses, one
  # whose score could beat the worst of them by transformers' estimate (at the running beams'
  # new length t + 1; "never" with a positive length penalty bounds by N).
  if early_stopping == "never":
    hypothetical = jnp.where(length_penalty > 0, jnp.int32(n), length)
  else:
    hypothetical = length
  best = beam_scores[:, 0] / jnp.power(hypothetical.astype(jnp.float32), length_penalty)
  filled = jnp.all(final_filled, axis=1)
  worst = jnp.min(final_scores, axis=1)
  improvable = s.improvable & (beam_scores[:, 0] > -jnp.inf) & (~filled | (best > worst))
  done = ~improvable | (t >= n - 1)
  if early_stopping is True:
    done = done | filled
  return BeamState(beams=new_beams, beam_scores=beam_scores, final_tokens=final_tokens,
                   final_logprobs=final_logprobs, final_lengths=final_lengths,
                   final_eos=final_eos, final_scores=final_scores, final_filled=final_filled,
                   improvable=improvable, done=s.done | done,
                   dead_end=s.dead_end | jnp.any(stuck, axis=1))


def candidate_count(beam_size: int, n_eos: int, vocab: int) -> int:
  """C = max(2, 1 + len(eos_ids)) * K (transformers' count: K candidates can always go on, even
  if every beam's EOS ids rank first), at most K * V."""
  return min(max(2, 1 + n_eos) * beam_size, beam_size * vocab)


# ---------------------------------------------------------------------------------------------
# The search.


def init_state(spec: loop.LoopSpec, model_state, counts: jax.Array, *, batch: int,
               beam_size: int, max_new_tokens: int) -> BeamState:
  """Before step 0: K copies of each row, beam 0 at score 0 and beams 1..K-1 empty (-inf, so
  that step 0 takes its candidates from beam 0 alone), no hypothesis, every row improvable."""
  k, n = beam_size, max_new_tokens
  scores = jnp.zeros((batch, k), jnp.float32).at[:, 1:].set(-jnp.inf)
  return BeamState(
      beams=loop.init_state(spec, model_state, counts, n), beam_scores=scores,
      final_tokens=jnp.full((batch, k, n), spec.pad_id, jnp.int32),
      final_logprobs=jnp.zeros((batch, k, n), jnp.float32),
      final_lengths=jnp.zeros((batch, k), jnp.int32), final_eos=jnp.zeros((batch, k), bool),
      final_scores=jnp.full((batch, k), -jnp.inf, jnp.float32),
      final_filled=jnp.zeros((batch, k), bool), improvable=jnp.ones((batch,), bool),
      done=jnp.zeros((batch,), bool), dead_end=jnp.zeros((batch,), bool))


def _without_mirostat(params: SamplingParams) -> SamplingParams:
  """Traced mirostat values act as 0 in beam search (concrete ones are refused)."""
  return params._with(mirostat=jnp.zeros_like(params.mirostat))  # pylint: disable=protected-access


def _beam_search(step_fn, state, logits, params, positions, eos_ids, pad_id, counts,
                 length_penalty, logits_processors, constraint, prompt_tokens=None, *,
                 axes: tuple, beam_size: int,
                 num_return: int, max_new_tokens: int, early_stopping, chunk_size: int):
  batch, vocab = logits.shape
  k, n = beam_size, max_new_tokens
  rows = batch * k
  beam_row = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), k)  # [B*K]: each beam's prompt row
  spec = loop.LoopSpec(
      row_keys=sampling.row_keys(jax.random.key(0), rows),  # unused: the search draws nothing
      params=_without_mirostat(params.rows(beam_row).sanitized()),
      is_eos=loop.eos_mask(eos_ids, vocab),
      pad_id=loop.checked_pad_id(pad_id, vocab), positions=positions[beam_row],
      logits_processors=logits_processors,
      constraint=None if constraint is None else dataclasses.replace(
          constraint, initial=constraint.initial[beam_row],
          automaton=constraint.automaton[beam_row]),
      prompt=None if prompt_tokens is None else loop.right_aligned_prompt(
          prompt_tokens)[beam_row])
  model_state = expand_beams(state, axes, k)
  decoding.check_step_output(jax.eval_shape(step_fn, model_state, jnp.zeros(rows, jnp.int32),
                                            spec.positions), model_state, (rows, vocab))
  loop.check_processors(spec, rows, vocab, n)
  length_penalty = jnp.asarray(length_penalty, jnp.float32)
  step = dict(axes=axes, candidates=candidate_count(k, eos_ids.shape[0], vocab),
              length_penalty=length_penalty, early_stopping=early_stopping, max_new_tokens=n)

  def advance(carry, t, call=None):
    """Step t: for t >= 1 feed each beam's token t - 1 (its logits replace the carried ones;
    step 0 searches the carried prefill logits), then search step t. On CPU and TPU one loop
    body serves every step, so the program holds the processor chain once (`call`: see
    `loop.run_from_prefill`). Reordering the state at step 0 changes nothing (a row's K beams
    hold the same prefill state)."""
    s, logits = carry

    def call_model(model_state):
      out, model_state = step_fn(model_state, s.beams.last, spec.positions + t - 1)
      return out.astype(jnp.float32), model_state

    logits, model_state = loop.call_or_skip(call, t > 0, call_model, lambda m: (logits, m),
                                            s.beams.model_state)
    s = s.replace(beams=s.beams.replace(model_state=model_state))
    return beam_step(spec, s, logits, t, **step), logits

  s = init_state(spec, model_state, counts[beam_row], batch=batch, beam_size=k,
                 max_new_tokens=n)
  # float32 is exact for every float dtype the chain takes: it begins by casting to float32.
  s, _ = _platform.by_platform(
      lambda carry: loop.run_from_prefill(advance, carry, rounds=n, chunk=chunk_size,
                                          done=lambda c: jnp.all(c[0].done)),
      (s, logits[beam_row].astype(jnp.float32)))
  r = num_return
  return BeamOutput(tokens=s.final_tokens[:, :r], scores=s.final_scores[:, :r],
                    lengths=s.final_lengths[:, :r], finished=s.final_eos[:, :r],
                    logprobs=s.final_logprobs[:, :r], dead_end=s.dead_end)


_beam_search_jit = jax.jit(_beam_search, static_argnames=(
    "step_fn", "axes", "beam_size", "num_return", "max_new_tokens", "early_stopping",
    "chunk_size"))


def beam_search(step_fn: Callable, state: Any, logits: jax.Array, *, beam_size: int,
                max_new_tokens: int, positions: jax.Array, eos_ids: Sequence[int] = (),
                pad_id: int = 0, length_penalty: float = 1.0, early_stopping=True,
                params: SamplingParams | None = None, state_axes: Any = 0,
                num_return: int | None = None, counts=None, chunk_size: int = 16,
                logits_processors: Sequence[Callable] | None = None,
                constraint=None, prompt_tokens=None) -> BeamOutput:
  """Beam search over a model step function: the `num_return` best of `beam_size` beams per row.

  The semantics are those of transformers 4.x `generate(num_beams=K)` (PyTorch): each step takes
  the top max(2, 1 + len(eos_ids)) * K candidates of (beam score + log-softmax of the processed
  logits) over the row's K * V continuations; each of the top K candidates that ends in an EOS id
  is finalized with score `sum of log-probs / new_tokens ** length_penalty` (new tokens counted
  with the EOS, never the prompt); the K best candidates that do not end go on as the next beams.
  At `max_new_tokens`, the top K candidates are finalized the same way. A row keeps its K best
  hypotheses and returns the best `num_return`.

  One exception to transformers' algorithm: a candidate whose log-probability is -inf (a token
  the processors removed, a -inf logit, a beam that does not exist) is never a hypothesis and
  never a running beam. A row with fewer than K possible continuations runs fewer beams; a row
  is done once no running beam is left; early stopping counts the hypotheses that exist. A slot
  no hypothesis reached has score -inf, length 0 and `pad_id` tokens, after every hypothesis.

  Args:
    step_fn: `step_fn(state, tokens int32[B'], positions int32[B']) -> (logits [B', V], state)`,
      the `decode` contract; it is called with B' = B * K rows (beam k of row b is row b*K + k).
      Static: build it once.
    state: the model state after a prefill of B rows (any pytree).
    logits: `[B, V]` next-token logits from that prefill.
    beam_size: K >= 1 beams per row (static).
    max_new_tokens: N >= 1, the most new tokens (static).
    positions: `int32[B]`, the position of each row's first new token (its prompt length), as
      in `decode`; rows may have prompts of different lengths.
    eos_ids: ids that end a hypothesis. Traced ids outside [0, V) are ignored (they still count
      in the candidate number, which is static).
    pad_id: written after a hypothesis' end.
    length_penalty: the exponent of the length in the score (traced: a new value does not
      recompile). > 0 favours longer hypotheses, < 0 shorter ones; 0 ranks by log-probability.
    early_stopping: when a row stops (static), as in transformers, and in any case once no
      running beam is left: True: once it holds K hypotheses. False: once it holds K and the best running beam's score at its current
      length cannot beat the worst of them (a heuristic: with length_penalty > 0 a longer beam
      might still have). "never": the same test with the bound at `max_new_tokens` when
      length_penalty > 0 (exact: beam search then stops only when no beam can improve).
    params: `SamplingParams` (default: none), applied to every beam as `decode` applies them to
      a row, with the beam's own token counts: bans, allowed ids, logit bias, penalties,
      `min_new_tokens` (EOS masked while a beam has fewer new tokens), temperature (the
      log-softmax of logits / T) and the truncations (removed tokens get log-probability -inf:
      the search never picks them). Temperature 0 makes each beam a point mass on its argmax.
      Per-row values apply to all beams of their row. Traced: new values do not recompile.
      The search draws nothing, so XTC applies only where `xtc_probability` is 1 (a value
      between 0 and 1 is refused; traced ones act as 0) and mirostat is refused (its state
      is updated by drawn tokens; traced values act as 0); `no_repeat_ngram_size`, DRY and
      `bad_words` read each beam's own history.
    state_axes: each state leaf's batch axis, as a pytree prefix of `state` like `jax.vmap`'s
      `in_axes`: an int for all leaves (default 0), or a tree with ints and None (a shared leaf,
      e.g. weights). 0-d leaves are always shared. The embedded transformer's state is
      `DecodeState(weights=None, cache=KVCache(k=1, v=1, start=0))`: its caches are
      `[L, B, S, H, Dh]`. Batched leaves are repeated K times and reordered every step.
    num_return: R, the sequences returned per row, 1 <= R <= K (default K; static).
    counts: `int[B, V]` token counts to start every beam's penalties from (default: none, only
      new tokens count), as in `decode`.
    chunk_size: steps per scanned chunk; the loop stops after the first chunk in which every row
      is done.
    logits_processors: your own processors, as in `decode`; they see B * K rows (the beams), with
      each beam's tokens and counts in the context.
    constraint: a `jaxdecode.structured` constraint, as in `decode` (one per prompt row with
      `stack`); each beam carries its automaton state, gathered from its parent, so every
      hypothesis that ends with EOS is a whole match.
    prompt_tokens: `int[B, T]`, each row's prompt (negative ids are padding), for
      `no_repeat_ngram_size` and `bad_words`, as in `decode`.

  Returns:
    A `BeamOutput` of `[B, R, ...]` arrays, best first.

  Differences from transformers, on purpose:

  - transformers applies its logits processors to the log-softmax of the raw logits and does not
    renormalize; jaxdecode takes the log-softmax of the processed logits (a ban or top-k
    renormalizes what is left; temperature divides the logits). With no processor active the
    two are the same computation, and give the same beams and scores (up to float rounding).
  - `params` per row apply to every beam of that row; the penalties count each beam's own new
    tokens (plus `counts`): transformers counts the prompt too (pass `counts` to do that).
  - Impossible candidates (above). transformers adds -1e9 to the scores of candidates it rules
    out, and in float32 `-1e9 - 0.51 == -1e9 - 0.92`: where a row has fewer possible
    continuations than its beams need, a placeholder or an EOS candidate ties its way into the
    running beams, their continuations fill the K hypothesis slots with junk scored about -1e9
    (and with `early_stopping=True` stop the row before its real best beam ends), and empty
    slots come back as beams. Where every step of a row has at least C = max(2, 1 +
    len(eos_ids)) * K possible candidates, nothing is ruled out that way and the two give the
    same beams and scores.
  - Rows are independent: a row stops, and its result is fixed, as soon as its own stopping rule
    holds, so a row gives bitwise the same beams alone or in any batch (given batch-invariant
    logits). transformers decides by the rules of the whole batch, which changes nothing a
    finished row returns.
  - Ties between equal scores go to the lower beam, then the lower token id (`lax.top_k`);
    `torch.topk` does not promise an order.

  Examples:
    A model that ignores its state: after token x it prefers x + 1, and EOS (0) after 3.

    >>> import jax, jax.numpy as jnp, jaxdecode
    >>> table = jnp.log(jnp.array([[.1, .6, .3, 0., 0.], [.1, 0., .5, .4, 0.],
    ...                            [.2, 0., 0., .5, .3], [.9, 0., 0., 0., .1],
    ...                            [.5, .5, 0., 0., 0.]]))
    >>> def step_fn(state, tokens, positions):
    ...   return table[tokens], state
    >>> out = jaxdecode.beam_search(step_fn, {}, table[jnp.array([0])], beam_size=2,
    ...                             max_new_tokens=4, positions=jnp.array([1]), eos_ids=[0])
    >>> out.tokens.tolist(), out.lengths.tolist(), out.finished.tolist()
    ([[[1, 2, 3, 0], [1, 3, 0, 0]]], [[4, 3]], [[True, True]])
    >>> out.scores.tolist()  # log(.6 * .5 * .5 * .9) / 4, log(.6 * .4 * .9) / 3
    [[-0.50062..., -0.51082...]]
  """
  batch, vocab = _checks.logits(logits)
  if not callable(step_fn):
    raise ValueError(f"step_fn must be callable; got {type(step_fn).__name__}")
  beam_size, num_return, length_penalty = _checks.beam_options(beam_size, num_return,
                                                               length_penalty)
  _checks.beam_size_fits(beam_size, batch, vocab)
  max_new_tokens = _checks.max_new_tokens(max_new_tokens, batch * beam_size, caller="beam_search")
  chunk_size = _checks.integer("chunk_size", chunk_size, low=1)
  early_stopping = _checks.early_stopping(early_stopping)
  params = SamplingParams() if params is None else params
  eos = _checks.token_ids("eos_ids", eos_ids, vocab, many=True)
  params, counts = processors.check_call(logits, params, counts, caller="beam_search",
                                         loop=True, eos_ids=eos)
  if params.uses_mirostat():
    raise ValueError("beam_search does not carry mirostat's state (it draws no token whose "
                     "surprise would update it): use mirostat=0, or sample with "
                     "jaxdecode.decode")
  if params.draws_xtc():
    raise ValueError("beam_search draws nothing, so XTC cannot apply by chance: use "
                     "xtc_probability 0 or 1 (1 applies it at every step), or sample with "
                     "jaxdecode.decode")
  counts = jnp.zeros((batch, vocab), jnp.int32) if counts is None else counts
  positions = _checks.row_integers("positions", positions, batch, "one per row of the logits")
  pad = _checks.token_ids("pad_id", pad_id, vocab, many=False)
  axes = leaf_axes(state_axes, state, batch)
  decoding.check_fits(step_fn, state, positions, max_new_tokens, "beam_search")
  constraint = structured.check(constraint, batch, vocab, "beam_search", params,
                                eos_ids=eos_ids)
  return _beam_search_jit(step_fn, state, jnp.asarray(logits), params, positions, eos, pad,
                          counts, length_penalty, loop.as_processors(logits_processors),
                          constraint,
                          decoding.check_prompt_tokens(prompt_tokens, batch, "beam_search"),
                          axes=axes, beam_size=beam_size, num_return=num_return,
                          max_new_tokens=max_new_tokens, early_stopping=early_stopping,
                          chunk_size=chunk_size)
