"""The trainer's side of on-policy RL: `score` (teacher-forced log-probabilities, bitwise the
sampler's) and `logprob_diff` (how far two sets of log-probabilities are apart).

`score` computes the model's logits for whole sequences with one forward pass, then replays the
decode loop over them with every token forced: the same `loop.process` (constraint, bans, bias,
penalty counts and history rebuilt from the tokens, temperature, truncations, XTC's coin from
the same key, mirostat's state), the same `loop.record` (EOS, dead ends, padding) and the same
kinds (`jaxdecode.scoring`). Only the logits come from elsewhere: one pass over
`prompt + new tokens` instead of a prefill and one cached step per token. With a model whose
logits are batch-invariant and whose K-token calls equal K single steps (the embedded model's
default numerics: `models.forward` is `Transformer.run`, the function of the prefill and of the
steps), those are the same bits, so the scores are bitwise what `decode` returned.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdecode import _checks
from jaxdecode import _platform
from jaxdecode import decoding
from jaxdecode import loop
from jaxdecode import processors
from jaxdecode import structured
from jaxdecode.params import SamplingParams, check_eos_not_forced
from jaxdecode.scoring import Scores

_SCORE_KEY_SEED = 0  # the key `score` uses when none is given (only XTC's coin reads keys)


def _as_fn(logits_fn):
  """A pytree `jit` can take: a `Partial` (or any pytree callable with array leaves) keeps its
  arrays traced (new weights never recompile); a plain function becomes `Partial(fn)`."""
  leaves = jax.tree.leaves(logits_fn)
  if len(leaves) == 1 and leaves[0] is logits_fn:
    return jax.tree_util.Partial(logits_fn)
  return logits_fn


def sequences(prompt_tokens, prompt_lengths, new_tokens):
  """Right-padded `prompt + new tokens` rows: `(tokens int32[B, T + N], lengths int32[B])`, as
  `models.teacher_forced_logits` lays them out (row b: its `prompt_lengths[b]` real prompt
  tokens, then its N new tokens, then the prompt's padding)."""
  batch, width = prompt_tokens.shape
  steps = new_tokens.shape[1]
  column = jnp.arange(width + steps, dtype=jnp.int32)[None, :]
  prompt_part = jnp.pad(prompt_tokens, ((0, 0), (0, steps)))
  new_part = jnp.take_along_axis(new_tokens, jnp.clip(column - prompt_lengths[:, None], 0,
                                                      steps - 1), axis=1)
  inside = column < prompt_lengths[:, None] + steps
  tokens = jnp.where(column < prompt_lengths[:, None], prompt_part,
                     jnp.where(inside, new_part, prompt_part))
  return tokens, prompt_lengths + steps


def _step_logits(logits_fn, prompt_tokens, prompt_lengths, new_tokens):
  """float[B, N, V]: row b's logits for new token t, from one call of `logits_fn`."""
  tokens, lengths = sequences(prompt_tokens, prompt_lengths, new_tokens)
  logits = logits_fn(tokens, lengths)  # [B, T + N, V]
  at = prompt_lengths[:, None] - 1 + jnp.arange(new_tokens.shape[1], dtype=jnp.int32)[None, :]
  return jnp.take_along_axis(logits, at[:, :, None], axis=1)


def _score(logits_fn, prompt_tokens, prompt_lengths, new_tokens, params, constraint, eos, pad,
           key, counts, logits_processors):
  batch, steps = new_tokens.shape
  logits = _step_logits(logits_fn, prompt_tokens, prompt_lengths, new_tokens)
  vocab = logits.shape[-1]
  column = jnp.arange(prompt_tokens.shape[1], dtype=jnp.int32)[None, :]
  history = jnp.where(column < prompt_lengths[:, None], prompt_tokens, -1)
  spec = decoding.make_spec(key, params, prompt_lengths, eos, pad, logits_processors,
                            batch=batch, vocab=vocab, constraint=constraint,
                            prompt_tokens=history)
  loop.check_processors(spec, batch, vocab, steps)
  counts = jnp.zeros((batch, vocab), jnp.int32) if counts is None else counts
  state = loop.init_state(spec, None, counts, steps, scores=True)

  def body(s, t):
    step = jnp.full((batch,), t, jnp.int32)
    token, logprob, _, kinds, selectable = loop.draw_scored(
        spec, s, logits[:, t].astype(jnp.float32), step, new_tokens[:, t], slope=True)
    return loop.record(spec, s, token, logprob, selectable=selectable,
                       drawn_logprob=lax.stop_gradient(logprob), kinds=kinds), None

  # A plain scan of N steps (no early exit: a while loop has no reverse-mode derivative); a
  # row past its end records nothing, as in `decode`. One formulation per platform, as in
  # `decode` (`jaxdecode._platform`): on a GPU the chain holds no data-dependent branch.
  state = _platform.by_platform(
      lambda s: lax.scan(body, s, jnp.arange(steps, dtype=jnp.int32))[0], state)
  return state.scores


_score_jit = jax.jit(_score)


def score(logits_fn: Callable, prompt_tokens, prompt_lengths, new_tokens, *,
          params: SamplingParams | None = None, constraint=None, eos_ids: Sequence[int] = (),
          pad_id: int = 0, key=None, counts=None,
          logits_processors: Sequence[Callable] | None = None) -> Scores:
  """Teacher-forced log-probabilities of generated tokens, of every kind, from one forward pass.

  The trainer's side of on-policy RL: given the tokens a sampler (`decode`,
  `speculative_decode`, `models.generate`) produced, it returns the log-probabilities the
  sampler recorded for them, bitwise, when the model's logits are batch-invariant and its
  whole-sequence pass equals its cached steps (the embedded model's default numerics): for any
  batch on either side, a different batch size for sampler and trainer, prompts of different
  lengths, every `SamplingParams` rule, and a structured constraint. It is differentiable
  (`jax.grad` through `logits_fn`; `jaxdecode.scoring` states the derivative).

  It replays `decode` with each token forced (`decode(forced_tokens=...)`'s step): penalty
  counts and the history rules rebuilt from the tokens, the constraint's automaton advanced by
  them, XTC's coin drawn from `key`, mirostat's state carried. A row ends as in `decode`: at its
  first EOS id (the EOS is scored; later columns read 0), at a step with nothing selectable (a
  dead end: that column and later ones read 0), or after N tokens.

  Args:
    logits_fn: `logits_fn(tokens int32[B, T + N], lengths int32[B]) -> float[B, T + N, V]`:
      next-token logits at every position of right-padded rows (`logits[b, i]` predicts token
      i + 1). The embedded model's is `models.forward_fn(graphdef, weights)` (a
      `jax.tree_util.Partial` whose weights are traced: new weights never recompile). A plain
      function is a static argument: build it once and reuse it.
    prompt_tokens: `int[B, T]` right-padded prompts (`jaxdecode.right_pad`), as the sampler
      prefilled them.
    prompt_lengths: `int[B]`, real prompt tokens per row (1..T); row b's first new token has
      position `prompt_lengths[b]` (decode's `positions`).
    new_tokens: `int[B, N]` the generated tokens (`DecodeOutput.tokens`): ids in [0, V),
      `pad_id` after a row's end.
    params: the sampler's `SamplingParams` (default: temperature 1, nothing else).
    constraint: the sampler's `jaxdecode.structured` constraint, or None.
    eos_ids: the sampler's EOS ids.
    pad_id: the sampler's pad id.
    key: the sampler's key (one, or one per row). Only XTC's coin reads it: needed when a row
      has 0 < xtc_probability < 1; otherwise any key gives the same scores.
    counts: `int[B, V]`, the token counts the sampler started its penalties from (decode's
      `counts`; `models.generate(penalize_prompt=True)` counts the prompt). None: zeros.
    logits_processors: the sampler's own logit processors (decode's `logits_processors`),
      applied at each step exactly as there. For the gradient, a processor is differentiated
      along a uniform shift of the logits (`jaxdecode.scoring`): exact for elementwise ones.

  Returns:
    A `jaxdecode.Scores` of float32[B, N] (raw, tempered, processed, kept_logmass; defined in
    `jaxdecode.scoring`), aligned with `new_tokens`, 0 where a row has no token.

  Raises:
    ValueError: bad shapes, ids or params, before anything compiles; `new_tokens` must be 2-d
      (beam search's `[B, R, N]` is refused: a beam's score is not a sampling log-probability).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxdecode
    >>> table = jnp.log(jnp.array([[.1, .6, .3], [.5, .3, .2], [.2, .2, .6]]))
    >>> def logits_fn(tokens, lengths):  # a bigram model: the logits depend on the last token
    ...   return table[tokens]
    >>> out = jaxdecode.score(logits_fn, jnp.array([[0]]), jnp.array([1]), jnp.array([[1, 0]]),
    ...                       params=jaxdecode.SamplingParams(top_k=2))
    >>> [[round(float(p), 3) for p in jnp.exp(kind[0])] for kind in (out.raw, out.processed)]
    [[0.6, 0.5], [0.667, 0.625]]
  """
  if not callable(logits_fn):
    raise ValueError(f"logits_fn must be a function (tokens [B, T + N], lengths [B]) -> logits "
                     f"[B, T + N, V]; got {type(logits_fn).__name__}")
  prompt_tokens = _int_array("prompt_tokens", prompt_tokens, 2, "[B, T]")
  batch, width = prompt_tokens.shape
  new_tokens = _checks.array("new_tokens", new_tokens, "an integer array [B, N]")
  if jnp.ndim(new_tokens) == 3:
    raise ValueError(f"score: new_tokens has shape {jnp.shape(new_tokens)}, beam search's "
                     f"[B, R, N]: a beam's tokens were chosen by their joint score, not sampled, "
                     f"so no sampling log-probability exists to match; score a beam as its own "
                     f"batch row ([B * R, N]) to get its log-probabilities under params")
  new_tokens = _int_array("new_tokens", new_tokens, 2, "[B, N]")
  if new_tokens.shape[0] != batch or new_tokens.shape[1] < 1:
    raise ValueError(f"score: new_tokens must have shape ({batch}, N) with N >= 1, one row per "
                     f"prompt; got {new_tokens.shape}")
  prompt_lengths = _checks.row_integers("prompt_lengths", prompt_lengths, batch,
                                        "one per row of prompt_tokens")
  if not _checks.is_traced(prompt_lengths):
    values = np.asarray(prompt_lengths)
    if values.min() < 1 or values.max() > width:
      raise ValueError(f"score: prompt_lengths must be in [1, T = {width}]; got "
                       f"{values.tolist()}")
  fn = _as_fn(logits_fn)
  steps = new_tokens.shape[1]
  out = jax.eval_shape(fn, jax.ShapeDtypeStruct((batch, width + steps), jnp.int32),
                       jax.ShapeDtypeStruct((batch,), jnp.int32))
  shape = getattr(out, "shape", None)
  if shape is None or len(shape) != 3 or shape[:2] != (batch, width + steps) or \
      not jnp.issubdtype(out.dtype, jnp.floating):
    raise ValueError(f"score: logits_fn must return floating logits of shape ({batch}, "
                     f"{width + steps}, V) for tokens of shape ({batch}, {width + steps}); got "
                     f"{out!r:.120}")
  vocab = shape[2]
  for name, array in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens)):
    if not _checks.is_traced(array):
      values = np.asarray(array)
      bad = (values < 0) | (values >= vocab)
      if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"score: {name} must hold token ids in [0, {vocab}) (pad with pad_id);"
                         f" got {int(values[at])} at {list(at)}")
  params = SamplingParams() if params is None else params
  _checks.instance("params", params, SamplingParams, "a jaxdecode.SamplingParams")
  eos = _checks.token_ids("eos_ids", eos_ids, vocab, many=True)
  params = params.broadcast(batch, vocab)
  check_eos_not_forced(params, eos, vocab)
  if counts is not None:
    counts = _checks.counts(counts, batch, vocab)
  pad = _checks.token_ids("pad_id", pad_id, vocab, many=False)
  constraint = structured.check(constraint, batch, vocab, "score", params, eos_ids=eos_ids)
  if key is None:
    if params.draws_xtc():
      raise ValueError("score: xtc_probability between 0 and 1 draws whether XTC acts on a row "
                       "from the sampler's key: pass the sampler's key= (one, or one per row)")
    key = jax.random.key(_SCORE_KEY_SEED)
  _checks.key(key, batch)
  return _score_jit(fn, prompt_tokens, prompt_lengths, new_tokens, params, constraint, eos, pad,
                    key, counts, loop.as_processors(logits_processors))


def _int_array(name: str, value, ndim: int, shape: str) -> jax.Array:
  value = _checks.array(name, value, f"an integer array {shape}")
  if jnp.ndim(value) != ndim or not jnp.issubdtype(jnp.result_type(value), jnp.integer):
    raise ValueError(f"score: {name} must be an integer array {shape}; got shape "
                     f"{jnp.shape(value)} and dtype {jnp.result_type(value)}")
  return jnp.asarray(value, jnp.int32)


class LogprobDiff(NamedTuple):
  """How far two log-probability arrays of the same tokens are apart (`logprob_diff`).

  With p the first policy (the sampler, whose tokens these are) and q the second (the trainer),
  and Δ = b - a = log q(y) - log p(y) per masked token:

  Attributes:
    mean_abs: float32[], mean |Δ| over the masked tokens.
    max_abs: float32[], max |Δ| (0 with no token).
    k1: float32[], mean of -Δ: the k1 estimate of KL(p ‖ q) (unbiased, can be negative).
    k3: float32[], mean of exp(Δ) - 1 - Δ: the k3 estimate of KL(p ‖ q) (unbiased, >= 0).
    sequence_ratio: float32[B], exp(sum of Δ over each row's masked tokens): the row's
      sequence-level importance ratio q(y) / p(y) (1 for a row without tokens).
  """
  mean_abs: jax.Array
  max_abs: jax.Array
  k1: jax.Array
  k3: jax.Array
  sequence_ratio: jax.Array


@jax.jit
def _logprob_diff(a, b, mask):
  delta = jnp.where(mask & (a != b), b - a, 0.0)  # equal (-inf and -inf too): 0
  count = jnp.sum(mask, dtype=jnp.float32)
  denominator = jnp.maximum(count, 1.0)
  absolute = jnp.abs(delta)
  return LogprobDiff(mean_abs=jnp.sum(absolute) / denominator,
                     max_abs=jnp.max(absolute, initial=0.0),
                     k1=jnp.sum(-delta) / denominator,
                     k3=jnp.sum(jnp.where(mask, jnp.expm1(delta) - delta, 0.0)) / denominator,
                     sequence_ratio=jnp.exp(jnp.sum(delta.reshape(delta.shape[0], -1), axis=1)))


def logprob_diff(a, b, mask=None) -> LogprobDiff:
  """Diagnostics of two log-probability arrays of the same tokens: sampler (a) against trainer (b).

  Args:
    a: float[B, N] log p(y), e.g. `DecodeOutput.logprobs` (the sampler's, the behaviour policy).
    b: float[B, N] log q(y) of the same tokens, e.g. `score(...).processed` (the trainer's).
    mask: bool[B, N], the tokens to compare (e.g. `column < DecodeOutput.lengths[:, None]`).
      None: every entry. Entries outside the mask are never read (they may be NaN or -inf).

  Returns:
    A `LogprobDiff`: mean and max |Δ|, the k1 and k3 estimates of KL(p ‖ q) (Schulman's
    "Approximating KL divergence") and each row's sequence ratio exp(Σ Δ), Δ = b - a. On policy,
    with `score` against `decode` under batch-invariant numerics, every one is exactly 0 (and
    the ratios exactly 1).

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> a = jnp.log(jnp.array([[0.5, 0.25]]))
    >>> d = jaxdecode.logprob_diff(a, a + jnp.array([[0.1, 0.3]]))
    >>> [round(float(x), 4) for x in (d.mean_abs, d.max_abs, d.k1, d.sequence_ratio[0])]
    [0.2, 0.3, -0.2, 1.4918]
  """
  a = _checks.array("a", a, "a float array [B, N]")
  b = _checks.array("b", b, "a float array [B, N]")
  if jnp.ndim(a) < 1 or jnp.shape(a) != jnp.shape(b):
    raise ValueError(f"logprob_diff: a and b must be arrays of the same shape [B, N]; got "
                     f"{jnp.shape(a)} / {jnp.shape(b)}")
  if mask is None:
    mask = jnp.ones(jnp.shape(a), bool)
  elif jnp.shape(mask) != jnp.shape(a) or jnp.result_type(mask) != jnp.bool_:
    raise ValueError(f"logprob_diff: mask must be a bool array of shape {jnp.shape(a)}; got "
                     f"shape {jnp.shape(mask)} and dtype {jnp.result_type(mask)}")
  return _logprob_diff(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                       jnp.asarray(mask))
