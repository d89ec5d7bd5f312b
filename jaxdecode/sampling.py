"""Selection rules: `[B, V]` logits (and a key) in, `int32[B]` tokens out.

Key policy (the reproducibility contract; docs/architecture.md):

- `key` is one key or one key per row (`[B]`); typed keys (`jax.random.key`) and legacy uint32
  keys (`jax.random.PRNGKey`, shape `[2]` or `[B, 2]`) are both accepted.
- With one key, row r uses `fold_in(key, r)`; with per-row keys, row r uses `keys[r]`.
- A row draws exactly one uniform number from its own key and nothing else, so its token depends
  only on its key, its logits and its params: not on the batch size, its slot or the other rows.

Sampling is an inverse-CDF draw over the processed distribution, done in two levels (lanes of
the vocabulary, then tokens inside the chosen lane) so that no full-vocabulary cumulative sum is
needed. It can only return a token of positive processed probability. Every sum over the
vocabulary has an order of additions fixed by V alone (`jaxdecode._reduce`), so a row's token
and log-probability are bitwise the same in any batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode import _checks
from jaxdecode import _reduce
from jaxdecode import processors
from jaxdecode import threshold
from jaxdecode.params import SamplingParams

row_keys = processors.row_keys  # typed keys [B], one per row, following the key policy


def _first_true(mask: jax.Array) -> jax.Array:
  """Index of the first True along the last axis (0 if none). [..., N] -> int32[...]."""
  return lax.argmax(mask, mask.ndim - 1, jnp.int32)


def inverse_cdf(x: jax.Array, u: jax.Array):
  """Draws one token per row from softmax(x), given one uniform in [0, 1) per row.

  The cumulative distribution runs over the tokens in a fixed order that suits a batch-invariant
  sum (`jaxdecode._reduce`): lane by lane, where lane l holds the tokens l, L + l, 2L + l, ...
  First the lane whose cumulative mass passes u * total, then the token inside that lane. Any
  fixed order gives every token its probability; this one needs only one pass over [B, V] (the
  lane sums) and sums whose bits do not depend on the batch.

  Args:
    x: float32[B, V] processed logits (-inf for removed tokens).
    u: float32[B] uniforms.

  Returns:
    (int32[B] tokens, float32[B] log-probabilities of those tokens under softmax(x)). Rows with
    nothing selectable give token 0 and log-probability NaN.
  """
  batch, vocab = x.shape
  lanes = _reduce.lanes_for(vocab)
  chunks = -(-vocab // lanes)
  e, m = threshold.unnormalized_probs(x)  # [B, V], [B, 1]
  lane_mass = _reduce.lane_sums(e)  # [B, L]
  lane_cdf = _reduce.row_cumsum(lane_mass)  # [B, L]
  total = _reduce.tree_sum(lane_mass)  # [B], the row sum
  target = u * total
  # The first lane whose cumulative mass passes the target; never an empty lane.
  passes = (lane_cdf > target[:, None]) & (lane_mass > 0)
  lane = jnp.where(jnp.any(passes, axis=-1), _first_true(passes),
                   lanes - 1 - _first_true((lane_mass > 0)[:, ::-1]))  # rounding: last non-empty
  # The lane's tokens, from the logits (exp recomputed for these `chunks` entries only).
  member_ids = lane[:, None] + lanes * jnp.arange(chunks, dtype=jnp.int32)[None, :]  # [B, M]
  in_vocab = member_ids < vocab
  members = jnp.take_along_axis(x, jnp.minimum(member_ids, vocab - 1), axis=1)
  members = jnp.where(in_vocab & (m > -jnp.inf), jnp.exp(members - m), 0.0)  # [B, M]
  before = jnp.take_along_axis(lane_cdf - lane_mass, lane[:, None], axis=1)[:, 0]  # [B]
  cdf = _reduce.row_cumsum(members)
  hit = (cdf > (target - before)[:, None]) & (members > 0)
  i = jnp.where(jnp.any(hit, axis=-1), _first_true(hit),
                chunks - 1 - _first_true((members > 0)[:, ::-1]))  # rounding: last positive
  ok = total > 0
  token = jnp.where(ok, i * lanes + lane, 0).astype(jnp.int32)

  x_token = jnp.take_along_axis(x, token[:, None], axis=1)[:, 0]
  logprob = jnp.where(ok, x_token - m[:, 0] - jnp.log(total), jnp.nan)
  return token, logprob


def log_softmax(x: jax.Array) -> jax.Array:
  """float32[B, V] log-probabilities of softmax(x), computed like `inverse_cdf`'s (the same
  batch-invariant sum), so a drawn token's entry is bitwise the log-probability `inverse_cdf`
  returns for it. -inf entries stay -inf; a row with nothing selectable is all NaN.

  Args:
    x: float32[B, V] logits without NaN (-inf for removed tokens).
  """
  e, m = threshold.unnormalized_probs(x)
  total = _reduce.tree_sum(_reduce.lane_sums(e))  # [B], inverse_cdf's row sum
  return jnp.where(total[:, None] > 0, x - m - jnp.log(total)[:, None], jnp.nan)


def draw(keys: jax.Array, processed: jax.Array):
  """One token per row from processed float32 logits `[B, V]`, one uniform per row from its key.

  Returns `(int32[B] tokens, float32[B] log-probabilities)` (see `inverse_cdf`).
  """
  u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)  # [B]
  return inverse_cdf(processed, u)


def sample_rows(keys: jax.Array, logits: jax.Array, params: SamplingParams,
                counts: jax.Array | None = None, history: jax.Array | None = None):
  """The traced core of sampling: typed keys [B], logits [B, V], sanitized broadcast params.

  `counts` (int32[B, V] or None) feeds the penalties, `history` (int32[B, H] or None) the
  n-gram and bad-word bans; XTC's draw comes from `fold_in(keys[b], XTC_SALT)`. Returns
  (int32[B] tokens, float32[B] logprobs).
  """
  return draw(keys, processors.process_f32(logits, params, counts, keys, history))


@jax.jit
def _sample(key, logits, params, counts, history=None):
  return sample_rows(row_keys(key, logits.shape[0]), logits, params.sanitized(), counts,
                     history)


_DEFAULT_PARAMS: list[SamplingParams] = []  # SamplingParams(), built once outside any trace


def _default_params() -> SamplingParams:
  """`SamplingParams()`: one object for every call that passes none, so that its checked
  broadcast is kept (`SamplingParams.broadcast`) instead of rebuilding it (~1 ms) per call.
  Built under a trace its leaves are tracers: that one is not kept."""
  if _DEFAULT_PARAMS:
    return _DEFAULT_PARAMS[0]
  params = SamplingParams()
  if params._frozen:  # pylint: disable=protected-access
    _DEFAULT_PARAMS[:] = [params]
  return params


def _as_array(x):
  """`jnp.asarray(x)`, skipped for a jax array (the checks already ran on it)."""
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def sample_with_logprobs(key, logits: jax.Array, params: SamplingParams | None = None, *,
                         counts=None, history=None):
  """Samples one token per row and returns it with its log-probability.

  Args:
    key: one key, or one key per row (`[B]` typed keys or `[B, 2]` legacy uint32 keys).
    logits: `[B, V]` floating logits.
    params: a `SamplingParams` (default: plain sampling at temperature 1). `min_new_tokens`
      must be 0 here: it needs `decode`'s EOS ids and step.
    counts: `int[B, V]`, how often each row has seen each token (`jaxdecode.token_counts`);
      needed when a penalty is set.
    history: `int[B, H]`, each row's tokens so far, oldest first, padded with -1 at the start;
      needed by `no_repeat_ngram_size`, DRY and `bad_words` of two tokens or more.

  Returns:
    `(tokens, logprobs)`: `int32[B]` and `float32[B]`, the log-probability of each chosen token
    under the processed distribution (0 for temperature-0 rows). A row with nothing selectable
    (all logits -inf or NaN, or every allowed token banned) gives token 0 and log-probability
    NaN.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.7, 0.2, 0.1], [0.1, 0.2, 0.7]]))
    >>> params = jaxdecode.SamplingParams(temperature=jnp.array([0.0, 1.0]), top_k=1)
    >>> tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(0), logits, params)
    >>> tokens.tolist(), logprobs.tolist()
    ([0, 2], [0.0, 0.0])
  """
  params = _default_params() if params is None else params
  params, counts = processors.check_call(logits, params, counts, caller="sample")
  processors.no_min_new_tokens(params, "sample")
  _checks.key(key, params.temperature.shape[0])
  history = processors.check_history(history, params, params.temperature.shape[0], "sample")
  return _sample(key, _as_array(logits), params, counts, history)


def sample(key, logits: jax.Array, params: SamplingParams | None = None, *,
           counts=None, history=None) -> jax.Array:
  """Samples one token per row from the processed distribution; see `sample_with_logprobs`.

  Rows with `temperature == 0` return exactly the argmax of the logits after the token sets,
  bias and penalties (`greedy(logits)` when none is set).

  Speed of eager calls: an eager call checks its arguments in Python, then runs one jitted
  program. The checks of a `SamplingParams` are kept on the object (`SamplingParams.broadcast`),
  so build the params once and reuse them: a repeated eager call then costs 10-45 us more than
  the jitted call (was 350-490 us; CPU, `[1, 1000]` float32 logits, ~180-330 us a call; at
  `[8, 128256]` the program dominates and both cost the same). Building a `SamplingParams` costs
  ~0.6 ms, so not per call. In a hot loop, jit the sampler with the params as an argument (they
  are traced data: new values never recompile)::

      fast = jax.jit(jaxdecode.sample)
      tokens = fast(key, logits, params)

  or, better, jit the whole step (model and sampling). Build the params outside the jitted
  function, where their values are checked: checks that need concrete values (a value's range,
  a token id against the vocabulary, a row banning every token) cannot run on traced params,
  whose invalid values are sanitized instead (`SamplingParams.sanitized`).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxdecode
    >>> logits = jnp.array([[0.0, 5.0, 1.0]])
    >>> jaxdecode.sample(jax.random.key(0), logits, jaxdecode.SamplingParams(temperature=0.0))
    Array([1], dtype=int32)
  """
  return sample_with_logprobs(key, logits, params, counts=counts, history=history)[0]


@jax.jit
def _greedy(logits):
  return processors.first_argmax(processors.prepare(logits))


def greedy(logits: jax.Array) -> jax.Array:
  """The most probable token of each row: `int32[B]`, ties to the lowest index.

  NaN logits are never chosen while another entry exists; a row of all -inf/NaN gives 0.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> jaxdecode.greedy(jnp.array([[1.0, 3.0, 3.0], [jnp.nan, 0.0, -1.0]]))
    Array([1, 1], dtype=int32)
  """
  _checks.logits(logits)
  return _greedy(_as_array(logits))


def selectable(logits: jax.Array) -> jax.Array:
  """`bool[B]`: True where a row has a token that can be selected (a non-NaN entry > -inf)."""
  _checks.logits(logits)
  return jnp.any(processors.remove_nan(jnp.asarray(logits)) > -jnp.inf, axis=-1)
