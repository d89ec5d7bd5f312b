"""Degeneration metrics: diversity, repetition, model log-likelihood and entropy of generations.

Every metric reads a batch of generated sequences as `tokens [B, N]` with per-row `lengths [B]`:
row b is `tokens[b, :lengths[b]]` and anything after it (padding after EOS) is ignored. An n-gram
is n consecutive tokens of one row; n-grams never span two rows.

Each aggregate comes in two forms:

- over the set (the default, `per_sequence=False`): one float; counts are pooled over all rows
  first, then divided (so long rows weigh more than short ones);
- per sequence (`per_sequence=True`): a `[B]` array, one value per row.

A ratio with nothing to count (a row shorter than n, a set with no tokens) is NaN, never 0: it
is undefined, not perfect or terrible.

The n-gram metrics (`distinct_n`, `repetition_rate`, `longest_repeated_span`) are numpy. The
likelihood and entropy ones (`token_log_likelihoods`, `mean_log_likelihood`, `step_entropies`,
`mean_entropy`) take JAX arrays: any model's raw logits at every generated step (for the
embedded transformer, `jaxdecode.models.teacher_forced_logits` computes them).

Example:
  >>> import numpy as np
  >>> tokens = np.array([[1, 2, 1, 2, 0], [3, 3, 3, 9, 9]])  # [B, N]
  >>> lengths = np.array([4, 3])                            # row 1 is [3, 3, 3]
  >>> distinct_n(tokens, lengths, 2)  # bigrams 12 21 12 | 33 33: 3 distinct of 5
  0.6
  >>> longest_repeated_span(tokens, lengths).tolist()  # "1 2" twice; "3 3" at 0 and 1
  [2, 2]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax import lax

from jaxdecode import _checks
from jaxdecode import loop
from jaxdecode import processors
from jaxdecode import sampling
from jaxdecode.params import SamplingParams

MAX_N = 4  # distinct-n is usually reported for n = 1..MAX_N


# ---------------------------------------------------------------------------------------------
# Validation (Python, before anything compiles).


def _check_tokens(tokens, lengths) -> tuple[np.ndarray, np.ndarray]:
  """`(tokens int64[B, N], lengths int64[B])` on the host; ValueError for bad shapes or values."""
  host = np.asarray(tokens)
  if host.ndim != 2 or not (np.issubdtype(host.dtype, np.integer) or host.size == 0):
    raise ValueError(f"tokens must be an integer array [B, N]; got shape {host.shape} of dtype "
                     f"{host.dtype}")
  batch, width = host.shape
  lens = np.asarray(lengths)
  if lens.shape != (batch,) or not (np.issubdtype(lens.dtype, np.integer) or lens.size == 0):
    raise ValueError(f"lengths must be an integer array of shape ({batch},), one per row of "
                     f"tokens; got shape {lens.shape} of dtype {lens.dtype}")
  if lens.size and (lens.min() < 0 or lens.max() > width):
    raise ValueError(f"lengths must be in [0, N = {width}]; got {lens.tolist()}")
  return host.astype(np.int64), lens.astype(np.int64)


def _check_logits(logits, tokens, lengths):
  """Checks float `[B, N, V]` logits against `[B, N]` tokens in [0, V) and `[B]` lengths."""
  shape = jnp.shape(logits)
  if len(shape) != 3 or not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
    raise ValueError(f"logits must be a floating array [B, N, V] (the model's logits at each "
                     f"generated step); got shape {shape} of dtype {jnp.result_type(logits)}")
  if shape[2] < 1:
    raise ValueError(f"logits must have a vocabulary of at least one token; got shape {shape}")
  if tokens is not None:
    if jnp.shape(tokens) != shape[:2]:
      raise ValueError(f"tokens must have shape {shape[:2]}, the [B, N] of the logits; got "
                       f"{jnp.shape(tokens)}")
    host, _ = _check_tokens(tokens, np.full(shape[0], shape[1]))
    if host.size and (host.min() < 0 or host.max() >= shape[2]):
      raise ValueError(f"tokens must be ids in [0, {shape[2]}) (the vocabulary of the logits); "
                       f"got: min {host.min()} / max {host.max()}")
  _, lens = _check_tokens(np.zeros(shape[:2], np.int32), lengths)
  return jnp.asarray(lens, jnp.int32)


def _ratio(numerator, denominator):
  """numerator / denominator elementwise, NaN where the denominator is 0."""
  numerator = np.asarray(numerator, np.float64)
  denominator = np.asarray(denominator, np.float64)
  safe = np.where(denominator > 0, denominator, 1.0)
  return np.where(denominator > 0, numerator / safe, np.nan)


def _aggregate(numerator, denominator, per_sequence: bool):
  """Per row `[B]`, or pooled over the set (sum / sum) as a Python float."""
  if per_sequence:
    return _ratio(numerator, denominator)
  return float(_ratio(np.sum(numerator), np.sum(denominator)))


def masked_mean(values, lengths, *, per_sequence: bool = False):
  """The mean of per-step values `[B, N]` over each row's first `lengths[b]` steps.

  How `mean_log_likelihood` and `mean_entropy` aggregate `token_log_likelihoods` and
  `step_entropies`; use it to aggregate a subset of rows without recomputing them.

  Args:
    values: `[B, N]` numbers (steps at or after a row's length are ignored, whatever they hold).
    lengths: integer `[B]`, each in [0, N].
    per_sequence: one mean per row instead of one over every valid step of the set.

  Returns:
    A float (NaN when there is no valid step), or a float64 `[B]` array (NaN for empty rows).

  Examples:
    >>> masked_mean([[1.0, 3.0, 99.0], [5.0, 99.0, 99.0]], [2, 1])  # (1 + 3 + 5) / 3
    3.0
    >>> masked_mean([[1.0, 3.0, 99.0], [5.0, 99.0, 99.0]], [2, 1], per_sequence=True).tolist()
    [2.0, 5.0]
  """
  _checks.boolean("per_sequence", per_sequence)
  values = np.asarray(values, np.float64)
  if values.ndim != 2:
    raise ValueError(f"values must be an array [B, N]; got shape {values.shape}")
  _, lengths = _check_tokens(np.zeros(values.shape, np.int32), lengths)
  valid = np.arange(values.shape[1])[None, :] < lengths[:, None]
  return _aggregate(np.where(valid, values, 0.0).sum(axis=1), lengths, per_sequence)


# ---------------------------------------------------------------------------------------------
# n-gram metrics (numpy).


def _ngrams(row: np.ndarray, n: int) -> np.ndarray:
  """The n-grams of one row as `[max(len - n + 1, 0), n]`."""
  if len(row) < n:
    return np.zeros((0, n), row.dtype)
  return np.lib.stride_tricks.sliding_window_view(row, n)


def ngram_counts(tokens, lengths, n: int) -> tuple[np.ndarray, np.ndarray]:
  """Per row: how many n-grams it has and how many of them are distinct.

  Args:
    tokens: integer `[B, N]`.
    lengths: integer `[B]`, each in [0, N]; row b is `tokens[b, :lengths[b]]`.
    n: the n-gram size (>= 1).

  Returns:
    `(total int64[B], distinct int64[B])` with `total[b] = max(lengths[b] - n + 1, 0)`.

  Examples:
    >>> total, distinct = ngram_counts([[5, 5, 5, 5]], [4], 2)
    >>> total.tolist(), distinct.tolist()
    ([3], [1])
  """
  tokens, lengths = _check_tokens(tokens, lengths)
  n = _checks.integer("n", n, low=1)
  total = np.zeros(len(lengths), np.int64)
  distinct = np.zeros(len(lengths), np.int64)
  for b, (row, length) in enumerate(zip(tokens, lengths)):
    grams = _ngrams(row[:length], n)
    total[b] = len(grams)
    distinct[b] = len(np.unique(grams, axis=0)) if len(grams) else 0
  return total, distinct


def distinct_n(tokens, lengths, n: int, *, per_sequence: bool = False):
  """distinct-n: the number of distinct n-grams divided by the number of n-grams.

  Over the set (default), an n-gram that occurs in several rows counts once in the numerator
  and every occurrence counts in the denominator: `|union of the rows' n-gram sets| / sum of
  the rows' n-gram counts`. Per sequence, each row is its own set.

  Args:
    tokens: integer `[B, N]`.
    lengths: integer `[B]`, each in [0, N]; tokens after a row's length are ignored.
    n: the n-gram size (>= 1).
    per_sequence: one value per row instead of one for the whole set.

  Returns:
    A float in (0, 1] (NaN if there is no n-gram at all), or a float64 `[B]` array with NaN for
    rows shorter than n.

  Examples:
    >>> distinct_n([[1, 2, 3], [1, 2, 4]], [3, 3], 2)  # 12 23 | 12 24: 3 distinct of 4
    0.75
    >>> distinct_n([[1, 2, 3], [1, 2, 4]], [3, 3], 2, per_sequence=True).tolist()
    [1.0, 1.0]
  """
  tokens, lengths = _check_tokens(tokens, lengths)
  n = _checks.integer("n", n, low=1)
  _checks.boolean("per_sequence", per_sequence)
  total, distinct = ngram_counts(tokens, lengths, n)
  if per_sequence:
    return _ratio(distinct, total)
  grams = [_ngrams(row[:length], n) for row, length in zip(tokens, lengths)]
  pooled = np.concatenate(grams, axis=0) if grams else np.zeros((0, n), np.int64)
  union = len(np.unique(pooled, axis=0)) if len(pooled) else 0
  return float(_ratio(union, total.sum()))


def repetition_rate(tokens, lengths, n: int, *, per_sequence: bool = False):
  """The share of n-grams that already occurred earlier in the same sequence.

  The n-gram starting at position i of a row is *repeated* if the same n-gram starts at some
  position j < i of that row (overlapping occurrences count: in `a a a`, the bigram at 1
  repeats the one at 0). Repeats across rows do not count. Per row this is
  `1 - distinct_n(..., per_sequence=True)`; over the set it pools the rows' counts:
  `sum(repeated) / sum(n-grams)`.

  Args:
    tokens: integer `[B, N]`.
    lengths: integer `[B]`, each in [0, N]; tokens after a row's length are ignored.
    n: the n-gram size (>= 1).
    per_sequence: one value per row instead of one for the whole set.

  Returns:
    A float in [0, 1) (NaN if there is no n-gram at all), or a float64 `[B]` array with NaN for
    rows shorter than n.

  Examples:
    >>> repetition_rate([[7, 7, 7, 7, 8]], [5], 2)  # 77 77 77 78: two repeats of 4 bigrams
    0.5
  """
  _checks.boolean("per_sequence", per_sequence)
  total, distinct = ngram_counts(tokens, lengths, n)
  return _aggregate(total - distinct, total, per_sequence)


def _longest_run(matches: np.ndarray) -> int:
  """The longest run of consecutive True values in a 1-D bool array."""
  if not matches.any():
    return 0
  padded = np.concatenate([[False], matches, [False]])
  edges = np.flatnonzero(padded[1:] != padded[:-1])  # starts and ends of the runs, alternating
  return int((edges[1::2] - edges[::2]).max())


def longest_repeated_span(tokens, lengths, *, overlapping: bool = True) -> np.ndarray:
  """Per row, the length of the longest token substring that occurs at least twice in it.

  Two occurrences are two different start positions. With `overlapping=True` (default) they
  may overlap: `a a a a` has `a a a` at 0 and at 1, so its span is 3. With
  `overlapping=False` the two occurrences must be disjoint: `a a a a` gives 2 (`a a` at 0 and
  2). A row with no repeated token (or empty) gives 0.

  For each offset d, a repeat at positions i and i + d is a run of `row[k] == row[k + d]`, so
  the answer is the longest such run over all d (capped at d when overlaps are not allowed):
  O(L^2) work per row of length L.

  Args:
    tokens: integer `[B, N]`.
    lengths: integer `[B]`, each in [0, N]; tokens after a row's length are ignored.
    overlapping: whether the two occurrences may overlap.

  Returns:
    int64 `[B]`, each in [0, lengths[b] - 1].

  Examples:
    >>> longest_repeated_span([[4, 4, 4, 4], [1, 2, 3, 0]], [4, 3]).tolist()
    [3, 0]
    >>> longest_repeated_span([[4, 4, 4, 4]], [4], overlapping=False).tolist()
    [2]
  """
  tokens, lengths = _check_tokens(tokens, lengths)
  _checks.boolean("overlapping", overlapping)
  out = np.zeros(len(lengths), np.int64)
  for b, (row, length) in enumerate(zip(tokens, lengths)):
    row = row[:length]
    best = 0
    for d in range(1, length):
      if length - d <= best:  # a run at offset d is at most length - d long
        break
      run = _longest_run(row[:-d] == row[d:])
      best = max(best, run if overlapping else min(run, d))
    out[b] = best
  return out


# ---------------------------------------------------------------------------------------------
# Model-based metrics (JAX): the model's raw logits at every generated step.


def _valid(lengths: jax.Array, steps: int) -> jax.Array:
  """bool[B, N]: True at t < lengths[b]."""
  return jnp.arange(steps, dtype=jnp.int32)[None, :] < lengths[:, None]


@jax.jit
def _token_log_likelihoods(logits, tokens, lengths):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, N, V]
  picked = jnp.take_along_axis(logp, tokens[:, :, None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.where(_valid(lengths, tokens.shape[1]), picked, 0.0)  # [B, N]


def token_log_likelihoods(logits, tokens, lengths) -> jax.Array:
  """Each generated token's log-probability under the raw model distribution (teacher forcing).

  `log softmax(logits[b, t])[tokens[b, t]]` in float32, whatever settings generated the
  tokens: this asks how likely the model itself finds the text, not how likely the sampler was
  to pick it.

  Args:
    logits: floating `[B, N, V]`, the model's raw logits at each generated step
      (`teacher_forced_logits`).
    tokens: integer `[B, N]` generated tokens, ids in [0, V).
    lengths: integer `[B]`, each in [0, N]; steps at or after a row's length give 0.

  Returns:
    float32 `[B, N]`, <= 0 at valid steps (-inf for a token the model gives no mass).

  Examples:
    >>> import jax.numpy as jnp, numpy as np
    >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))  # [1, 2, 3]
    >>> ll = token_log_likelihoods(logits, jnp.array([[1, 2]]), jnp.array([1]))  # step 1 masked
    >>> np.asarray(ll, np.float64).round(4).tolist()  # ln 0.25
    [[-1.3863, 0.0]]
  """
  lengths = _check_logits(logits, tokens, lengths)
  return _token_log_likelihoods(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32), lengths)


def mean_log_likelihood(logits, tokens, lengths, *, per_sequence: bool = False):
  """The mean per-token log-likelihood (nats) of the generated tokens under the raw model.

  Over the set: the sum of every valid token's log-likelihood divided by the number of valid
  tokens. Per sequence: each row's mean over its own tokens. Higher (closer to 0) means text the
  model finds more predictable.

  Args:
    logits: floating `[B, N, V]`, the model's raw logits at each generated step.
    tokens: integer `[B, N]` generated tokens.
    lengths: integer `[B]`, each in [0, N].
    per_sequence: one value per row instead of one for the whole set.

  Returns:
    A float (NaN when no row has a token), or a float64 `[B]` array (NaN for empty rows).

  Examples:
    >>> import jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([[[0.5, 0.5], [0.25, 0.75]]]))  # (ln 0.5 + ln 0.75) / 2
    >>> round(mean_log_likelihood(logits, jnp.array([[0, 1]]), jnp.array([2])), 4)
    -0.4904
  """
  _checks.boolean("per_sequence", per_sequence)
  return masked_mean(token_log_likelihoods(logits, tokens, lengths), lengths,
                     per_sequence=per_sequence)


def _entropy_of(processed: jax.Array) -> jax.Array:
  """float32[R]: the entropy of softmax(processed) per row, NaN where nothing is selectable."""
  x = processors.remove_nan(processed)  # [R, V]
  _, _, h = processors.distribution(x)
  return jnp.where(jnp.any(x > -jnp.inf, axis=-1), jnp.maximum(h[:, 0], 0.0), jnp.nan)


@functools.partial(jax.jit, static_argnames=("steps",))
def _entropies(processed, lengths, *, steps: int):
  h = _entropy_of(processed).reshape(lengths.shape[0], steps)  # [B, N]
  return jnp.where(_valid(lengths, steps), h, 0.0)


@functools.partial(jax.jit, static_argnames=("vocab",))
def _step_counts(tokens, counts, *, vocab: int):
  """The counts each step saw: `counts + counts of tokens[:, :t]`. int32[B, N, V]."""
  seen = jax.nn.one_hot(tokens, vocab, dtype=jnp.int32)  # [B, N, V]
  return counts[:, None, :] + jnp.cumsum(seen, axis=1) - seen


@jax.jit
def _replay(logits, params, lengths, tokens, counts, prompt, row_keys):
  """`decode`'s steps replayed along its tokens: `(entropies float32[B, N], logprobs
  float32[B, N])`, the processed distribution's entropy at each step and the drawn token's
  log-probability under it (what `decode` returns), 0 from a row's length on.

  One `lax.scan` over the steps carries what the loop carries (`jaxdecode.loop`): the penalty
  counts, each row's mirostat mu (2·tau at first, updated from each token's processed
  log-probability) and, through `loop.history_of`, the history prompt + tokens so far; step t
  of a row uses the key `fold_in(row_key, t)` (XTC's coin), or none where `row_keys` is None.
  """
  batch, steps, _ = logits.shape
  params = params.sanitized()
  rows = jnp.arange(batch, dtype=jnp.int32)

  def step(carry, t):
    counts, mu = carry
    done = jnp.minimum(t, lengths)  # [B]: the tokens row b had generated before step t
    keys = None if row_keys is None else jax.vmap(jax.random.fold_in)(row_keys, done)
    x = lax.dynamic_index_in_dim(logits, t, axis=1, keepdims=False)  # [B, V]
    processed = processors.process_f32(x, params, counts, keys,
                                       loop.history_of(prompt, tokens, done), mu)
    token = lax.dynamic_index_in_dim(tokens, t, axis=1, keepdims=False)  # [B]
    logprob = jnp.take_along_axis(sampling.log_softmax(processed), token[:, None], axis=1)[:, 0]
    recorded = t < lengths
    mu = jnp.where(recorded, processors.mirostat_update(mu, logprob, params), mu)
    counts = counts.at[rows, token].add(recorded.astype(jnp.int32))
    return (counts, mu), (_entropy_of(processed), jnp.where(recorded, logprob, 0.0))

  mu = jnp.broadcast_to(2.0 * params.mirostat_tau, (batch,)).astype(jnp.float32)
  _, (h, logprobs) = lax.scan(step, (counts, mu), jnp.arange(steps, dtype=jnp.int32))
  valid = _valid(lengths, steps)
  return jnp.where(valid, h.T, 0.0), logprobs.T


def _needs_replay(params: SamplingParams) -> bool:
  """True if a step's distribution depends on more than its logits and counts: the history
  (n-gram and bad-word bans, DRY), mirostat's mu, or XTC (its coin, or only where probability
  is 1)."""
  host = jax.tree.map(np.asarray, params)
  xtc = (host.xtc_probability > 0) & (host.xtc_threshold <= 0.5)
  return params.reads_history() or params.uses_mirostat() or bool(np.any(xtc))


def step_entropies(logits, params: SamplingParams, lengths, *, tokens=None, counts=None,
                   prompt_tokens=None, key=None) -> jax.Array:
  """Entropy (nats) of the *processed* distribution at every generated step.

  The distribution the sampler drew from: `softmax(jaxdecode.process_logits(logits[:, t],
  params))`. Removed tokens (-inf) contribute 0; temperature-0 rows are a point mass, entropy 0.
  With a penalty, step t is processed with the token counts `decode` had there: `counts` plus
  the counts of `tokens[:, :t]`. With a rule that reads more than the step's logits (DRY,
  `no_repeat_ngram_size`, `bad_words`, mirostat, XTC), the steps are replayed as `decode` ran
  them, along `tokens`: the history `prompt_tokens` + `tokens[:, :t]`, mirostat's mu updated
  from each token's processed log-probability, and XTC's coin from `fold_in(row_key, t)`; so
  each value is exactly the entropy of the distribution `decode` drew step t from (given the
  same logits, prompt tokens and key).

  Args:
    logits: floating `[B, N, V]`, the model's raw logits at each generated step.
    params: the `SamplingParams` that generated the rows (each row's values apply to all of its
      steps); `min_new_tokens` must be 0 (it needs the EOS ids and the step).
    lengths: integer `[B]`, each in [0, N]; steps at or after a row's length give 0.
    tokens: integer `[B, N]`, the generated tokens; needed when `params` has a penalty or one
      of the rules above.
    counts: integer `[B, V]`, the counts `decode` started from (default: none, as in `decode`).
    prompt_tokens: integer `[B, T]`, each row's prompt padded with -1 (`decode`'s argument of
      that name; `models.generate` passes it): the start of the history of DRY, the n-gram and
      the bad-word bans. None: the history is the new tokens alone.
    key: the key `decode` was given (one key, or one per row): needed where XTC acts by chance
      (0 < xtc_probability < 1).

  Returns:
    float32 `[B, N]`, each in [0, ln V]. A step whose logits have nothing selectable (all -inf
    or NaN) gives NaN.

  Examples:
    >>> import jax.numpy as jnp, numpy as np, jaxdecode
    >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]], [[0.5, 0.25, 0.25]]]))  # [2, 1, 3]
    >>> params = jaxdecode.SamplingParams(temperature=jnp.array([0.0, 1.0]))
    >>> h = step_entropies(logits, params, jnp.array([1, 1]))
    >>> np.asarray(h, np.float64).round(4).tolist()  # greedy: 0; T = 1: 1.5 ln 2
    [[0.0], [1.0397]]
    >>> logits = jnp.log(jnp.array([[[0.5, 0.25, 0.25]] * 2]))  # [1, 2, 3]
    >>> bigrams = jaxdecode.SamplingParams(no_repeat_ngram_size=2)  # prompt 1 0, then token 1
    >>> h = step_entropies(logits, bigrams, jnp.array([2]), tokens=jnp.array([[1, 2]]),
    ...                    prompt_tokens=jnp.array([[1, 0]]))
    >>> np.asarray(h, np.float64).round(4).tolist()  # step 1 bans 0 (1 0 was seen): ln 2
    [[1.0397, 0.6931]]
  """
  lengths = _check_logits(logits, tokens, lengths)
  _checks.instance("params", params, SamplingParams, "a jaxdecode.SamplingParams")
  batch, steps, vocab = jnp.shape(logits)
  params = params.broadcast(batch, vocab)
  mnt = np.asarray(params.min_new_tokens)
  if mnt.max(initial=0) > 0:
    raise ValueError(f"min_new_tokens={int(mnt.max())} is not supported by step_entropies (it "
                     f"masks EOS at early steps, which needs the EOS ids); pass "
                     f"params.replace(min_new_tokens=0)")
  start = None
  if counts is not None:
    start = _checks.counts(counts, batch, vocab)
  if _needs_replay(params):
    if tokens is None:
      raise ValueError("params has a rule that reads the tokens each row has drawn (DRY, "
                       "no_repeat_ngram_size, bad_words, mirostat or XTC): pass tokens=[B, N], "
                       "the generated tokens")
    if key is None and params.draws_xtc():
      raise ValueError("xtc_probability between 0 and 1 draws whether XTC acts at each step: "
                       "pass key=, the key decode was given")
    row_keys = None
    if key is not None:
      _checks.key(key, batch)
      row_keys = processors.row_keys(key, batch)
    prompt = None
    if prompt_tokens is not None:
      prompt_tokens = _checks.array("prompt_tokens", prompt_tokens, "an integer array [B, T]")
      if jnp.ndim(prompt_tokens) != 2 or jnp.shape(prompt_tokens)[0] != batch or \
          not jnp.issubdtype(jnp.result_type(prompt_tokens), jnp.integer):
        raise ValueError(f"prompt_tokens must be an integer array [B, T] with B = {batch} "
                         f"(each row's prompt, padded with -1); got shape "
                         f"{jnp.shape(prompt_tokens)} and dtype "
                         f"{jnp.result_type(prompt_tokens)}")
      prompt = loop.right_aligned_prompt(prompt_tokens)
    if start is None:
      start = jnp.zeros((batch, vocab), jnp.int32)
    return _replay(jnp.asarray(logits), params, lengths, jnp.asarray(tokens, jnp.int32), start,
                   prompt, row_keys)[0]
  step_counts = None
  if params.has_penalty():
    if tokens is None:
      raise ValueError("params has a penalty, which depends on the tokens each row has seen: "
                       "pass tokens=[B, N], the generated tokens")
    if start is None:
      start = jnp.zeros((batch, vocab), jnp.int32)
    step_counts = _step_counts(jnp.asarray(tokens, jnp.int32), start, vocab=vocab)
    step_counts = step_counts.reshape(batch * steps, vocab)
  # Row b's params for each of its N steps: [B, ...] -> [B * N, ...], the rows of
  # logits.reshape(B * N, V).
  flat_params = jax.tree.map(lambda v: jnp.repeat(v, steps, axis=0), params)
  processed = processors.process_logits(jnp.reshape(logits, (batch * steps, vocab)), flat_params,
                                        counts=step_counts)
  return _entropies(processed, lengths, steps=steps)


def mean_entropy(logits, params: SamplingParams, lengths, *, tokens=None, counts=None,
                 prompt_tokens=None, key=None, per_sequence: bool = False):
  """The mean entropy (nats) of the processed distribution per generated step.

  Over the set: the sum of `step_entropies` over every valid step divided by the number of
  valid steps. Per sequence: each row's mean over its own steps.

  Args:
    logits: floating `[B, N, V]`, the model's raw logits at each generated step.
    params: the `SamplingParams` that generated the rows.
    lengths: integer `[B]`, each in [0, N].
    tokens: integer `[B, N]` generated tokens (needed with a penalty; see `step_entropies`).
    counts: integer `[B, V]` the token counts `decode` started from (penalties only).
    prompt_tokens: integer `[B, T]` the prompts (the history rules; see `step_entropies`).
    key: the key `decode` was given (XTC by chance; see `step_entropies`).
    per_sequence: one value per row instead of one for the whole set.

  Returns:
    A float (NaN when no row has a step), or a float64 `[B]` array (NaN for empty rows).

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[[0.45, 0.45, 0.1]] * 2]))  # [1, 2, 3]
    >>> params = jaxdecode.SamplingParams(top_k=2)  # keeps the two 0.45s: uniform over 2
    >>> round(mean_entropy(logits, params, jnp.array([2])), 4)  # ln 2
    0.6931
  """
  _checks.boolean("per_sequence", per_sequence)
  return masked_mean(step_entropies(logits, params, lengths, tokens=tokens, counts=counts,
                                    prompt_tokens=prompt_tokens, key=key),
                     lengths, per_sequence=per_sequence)
