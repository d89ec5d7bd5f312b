"""Logit processors: `[B, V]` logits in, `[B, V]` logits out; removed tokens become -inf.

`process_logits` applies them in this order (`process_f32`):

1. token sets: `banned_token_ids` -> -inf; a row with `allowed_token_ids` keeps only those;
   then the bans that read the row's history: `no_repeat_ngram_size`, `bad_words`;
2. the +inf rule: a row with +inf logits left is uniform over them (+inf -> 0, the rest -> -inf);
3. `logit_bias`: added to the logits of its tokens;
4. penalties, from each row's token counts: `repetition_penalty` (HF: a seen token's logit is
   divided by it if positive, multiplied if negative), then `frequency_penalty * count` and
   `presence_penalty * (count > 0)` are subtracted (OpenAI/vLLM); then DRY, from the row's
   history (llama.cpp's place: after its penalties, before top-nσ);
5. top-nσ (`top_n_sigma`), on the logits the penalties left, before the temperature (as in
   llama.cpp's chain): its kept set is the same at every temperature > 0;
6. temperature, or dynamic temperature (`dynatemp_range` > 0); 7. top-k; 8. top-p; 9. min-p;
10. typical-p; 11. epsilon; 12. eta;
13. XTC (`xtc_threshold`, `xtc_probability`), on the distribution every truncation left;
14. mirostat 2 (`mirostat=2`), last, with each row's state mu (the loops carry it).

Steps 1-4 change the logits that everything after them sees, greedy rows (temperature 0)
included: a temperature-0 row takes the argmax of the biased and penalized logits. Each
truncation (5, 7-13) acts on the distribution left by the steps before it, renormalized.

The definitions of the truncations, stated once here (order-free, so that none of them needs a
sort of the vocabulary; p is the row's distribution at that step, H = -sum_j p_j log p_j its
entropy in nats):

- top-k keeps token i iff fewer than k tokens have a strictly larger logit (boundary ties kept).
- top-p keeps token i iff the probability mass of the tokens strictly more probable than i is
  < p (the smallest nucleus reaching p, boundary ties kept, the most probable token always kept).
- min-p keeps token i iff p_i >= min_p * max_j p_j.
- typical-p keeps token i iff the mass of the tokens strictly more typical than i is < typical_p,
  where token j is more typical than i iff |-log p_j - H| < |-log p_i - H| (the most typical
  token is always kept; it need not be the most probable).
- epsilon keeps token i iff p_i >= epsilon_cutoff or p_i = max_j p_j.
- eta keeps token i iff p_i >= min(eta, sqrt(eta) * exp(-H)) or p_i = max_j p_j.
- top-nσ (Tang et al. 2024, "Top-nσ: Not All Logits Are You Need"; llama.cpp's
  `llama_sampler_top_n_sigma`) keeps token i iff x_i >= max_j x_j - n·σ, σ the population
  standard deviation of the row's finite logits (the -inf ones left out); n <= 0 keeps all, as
  in llama.cpp. The statistics are taken on the row scaled by a power of two, so that rows near
  the float32 range do not overflow.
- XTC ("exclude top choices", llama.cpp's `llama_sampler_xtc`, from text-generation-webui): with
  probability `xtc_probability` for that row and step, if at least two tokens have
  p_i >= `xtc_threshold`, every one of them whose p is larger than the least p among them is
  removed. Where several tie at that least probability, all of them stay: llama.cpp keeps the
  one its sort puts last, which an order-free rule cannot name. A threshold > 0.5 is a no-op
  (two tokens cannot both exceed it), as is probability 0. The coin is a uniform u of the
  row's token key (`fold_in(row_key, t)` in the loops) folded with `XTC_SALT`, and XTC acts
  iff u < probability: the token's own draw, from the key itself, is not disturbed. Without a
  key (`process_logits` without `key=`, beam search) only rows with probability 1 act.
- DRY ("don't repeat yourself", p-e-w's sampler in text-generation-webui; llama.cpp's
  `llama_sampler_dry_apply`, after koboldcpp): the row's window is its last W tokens (W =
  min(its tokens, `dry_penalty_last_n`), -1 for all; 0 disables); rep_limit is the number of
  tokens after the latest `dry_sequence_breakers` id in the window (W without one). For each
  position j of the window, n_j is the length of the longest run of tokens ending just before
  j that equals the window's last tokens (within the window), capped at rep_limit; a token v
  that is not a breaker gets n = max of n_j over the positions j holding v, and where n >=
  `dry_allowed_length` its logit loses `dry_multiplier` · `dry_base`^e, e = n -
  dry_allowed_length capped at int(88.7228391 / log(dry_base)) when dry_base > 1.000001, as in
  llama.cpp (the penalty is also clipped to the largest float32). Nothing changes where W <=
  dry_allowed_length or rep_limit < dry_allowed_length. Breakers here are single token ids
  (llama.cpp also takes multi-token strings).
- dynamic temperature (llama.cpp's `llama_sampler_temp_ext`, from "entropy-based dynamic
  temperature", Zhu et al. 2024 / kalomaze): a row with temperature T > 0 and
  `dynatemp_range` r > 0 is divided by T_min + (T_max - T_min)·(H / log N)^`dynatemp_exponent`
  instead of T, with T_min = max(0, T - r), T_max = T + r, H the entropy of its distribution at
  that point (after the penalties and top-nσ) and N its number of selectable tokens; a
  row with one selectable token is left as it is; T = 0 rows stay greedy; a dynamic
  temperature of 0 makes the row greedy.
- mirostat 2 (Basu et al. 2021, "Mirostat: A Neural Text Decoding Algorithm that Directly
  Controls Perplexity"; llama.cpp's `llama_sampler_mirostat_v2`): a row with `mirostat=2` and
  state mu keeps token i iff its surprise -log2 p_i <= mu, p the row's distribution at that
  point (the last step of the chain); when no token has, its most probable token(s) stay. After
  the token is drawn, mu <- mu - `mirostat_eta` · (s - `mirostat_tau`), s = -log2 of the
  token's probability under the renormalized kept set (llama.cpp's reading); mu starts at
  2·tau. The loops carry mu per row and update it when they record a token (so speculative
  decoding, which records only accepted tokens, carries decode's mu); `process_logits` and
  `sample` use the initial 2·tau. Mirostat 1 is not provided: its estimate of the Zipf exponent
  reads the 100 most probable tokens in order (a partial sort whose tie order llama.cpp leaves
  to std::sort) and its k then feeds a top-k, so an order-free exact statement was not done.
- `no_repeat_ngram_size` = n (transformers' NoRepeatNGramLogitsProcessor) bans token v iff
  the row's last n - 1 tokens followed by v form an n-gram that already occurs in the row's
  tokens (n = 1: every token the row holds). The row's tokens are its history: the prompt
  (when the loop is given `prompt_tokens`; padding never counts) and the new tokens.
- `bad_words` (transformers' bad_words_ids, vLLM's bad_words) bans the last token of each
  sequence whose other tokens are the row's last tokens; a one-token sequence is always
  banned, like `banned_token_ids`.

How the top-k, top-p and typical-p sets are found exactly without a sort is
`jaxdecode.threshold`'s subject. On CPU and TPU a step that no row uses is skipped (a
`lax.cond` on the batch); on GPU every step runs and changes only the rows that use it, with the
same bits (`jaxdecode._platform`: a GPU waits on the host for each branch).

Numerics: all math runs in float32 whatever the input dtype, and every sum over the vocabulary
is `jaxdecode._reduce.row_sum`, whose order of additions depends on V alone, so a row's result
is bitwise the same in any batch. Input hygiene:

- NaN logits become -inf (a NaN is never selected);
- token sets come first, so a banned +inf logit is simply removed; then a row with +inf logits
  left is uniform over them;
- a row whose logits are all -inf (or NaN) stays all -inf: it has nothing selectable;
- a bias or penalty never turns -inf into a number, and saturates at the float32 range instead
  of overflowing to +-inf; a temperature whose division overflows either way (x / t = +-inf for
  a finite x) divides `x - max` instead, so the row's most probable token stays finite: a row
  with a selectable token never comes back empty;
- outputs in float16/bfloat16 saturate to that dtype's range (a row whose maximum exceeds it is
  shifted by its maximum first, which keeps its distribution and the order of its top tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxdecode import _checks
from jaxdecode import _platform
from jaxdecode import _reduce
from jaxdecode import threshold
from jaxdecode.params import SamplingParams, as_field, check_eos_not_forced

_NEG_INF = threshold.NEG_INF
_F32_MAX = float(jnp.finfo(jnp.float32).max)


# ---------------------------------------------------------------------------------------------
# Validation (Python, before anything is traced or compiled).


def check_row_param(name: str, value, batch_size: int) -> jax.Array:
  """Validates one per-row parameter (scalar or [B]) and broadcasts it to `[batch_size]`."""
  value = as_field(name, value)
  if value.shape not in ((), (batch_size,)):
    raise ValueError(f"{name} has shape {value.shape} but logits have {batch_size} rows; "
                     f"expected a scalar or shape ({batch_size},)")
  return jnp.broadcast_to(value, (batch_size,))


def check_call(logits, params, counts, *, caller: str, loop: bool = False, eos_ids=None):
  """The checks shared by `process_logits`, the samplers and the loops, before anything compiles.

  Returns `(params broadcast to the batch, int32 counts or None)`. A loop (`loop=True`) carries
  its own counts, so a penalty without `counts` is fine there; it passes its checked `eos_ids`,
  and no row may then have nothing but EOS ids to select while `min_new_tokens` masks them.
  """
  batch, vocab = _checks.logits(logits)
  _checks.instance("params", params, SamplingParams, "a jaxdecode.SamplingParams")
  broadcast = params.broadcast(batch, vocab)
  if eos_ids is not None:
    check_eos_not_forced(params, eos_ids, vocab)
  if counts is not None:
    counts = _checks.counts(counts, batch, vocab)
  elif params.has_penalty() and not loop:
    raise ValueError(f"repetition_penalty, presence_penalty and frequency_penalty act on the "
                     f"tokens each row has seen: pass counts=[B, V] to {caller} (see "
                     f"jaxdecode.token_counts), or use jaxdecode.decode, which carries them")
  return broadcast, counts


def check_history(history, params: SamplingParams, batch: int, caller: str):
  """int32[B, H] history, or None; ValueError if a rule reads the history and none is given."""
  if history is None:
    if params.reads_history():
      raise ValueError(f"no_repeat_ngram_size, DRY and bad_words of two tokens or more act "
                       f"on the tokens each row has seen: pass history=[B, H] to {caller} (each "
                       f"row's tokens, oldest first, padded with -1 at the start), or use "
                       f"jaxdecode.decode, which carries them")
    return None
  return _checks.token_rows("history", history, batch, "each row's tokens, oldest first, "
                            "padded with -1 at the start")


def token_counts(tokens, vocab_size: int, mask=None) -> jax.Array:
  """How often each row holds each token id: `int32[B, V]` (the penalties' input).

  Args:
    tokens: `int[B, T]` token ids (e.g. left-padded prompts).
    vocab_size: V.
    mask: optional `bool[B, T]`, True on the tokens to count (e.g. `prompt_mask(lengths, T)`
      to skip padding). Ids outside `[0, V)` are not counted.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> jaxdecode.token_counts(jnp.array([[0, 2, 2], [1, 1, 3]]), 4).tolist()
    [[1, 0, 2, 0], [0, 2, 0, 1]]
  """
  tokens = _checks.array("tokens", tokens, "an integer array [B, T]")
  if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"tokens must be an integer array [B, T]; got shape {jnp.shape(tokens)} "
                     f"and dtype {jnp.result_type(tokens)}")
  vocab_size = _checks.integer("vocab_size", vocab_size, low=1)
  if mask is not None and jnp.shape(mask) != jnp.shape(tokens):
    raise ValueError(f"mask must have the shape of tokens {jnp.shape(tokens)}; got "
                     f"{jnp.shape(mask)}")
  return _token_counts(jnp.asarray(tokens, jnp.int32),
                       None if mask is None else jnp.asarray(mask, bool), vocab_size)


@functools.partial(jax.jit, static_argnums=2)
def _token_counts(tokens, mask, vocab):
  ones = jnp.ones(tokens.shape, jnp.int32) if mask is None else mask.astype(jnp.int32)
  rows = lax.broadcasted_iota(jnp.int32, tokens.shape, 0)
  return jnp.zeros((tokens.shape[0], vocab), jnp.int32).at[rows, valid_ids(tokens, vocab)].add(
      ones, mode="drop")


# ---------------------------------------------------------------------------------------------
# Float32 building blocks (traced; shapes in comments).


def remove_nan(logits: jax.Array) -> jax.Array:
  """float32 copy with NaN -> -inf. [B, V]."""
  x = logits.astype(jnp.float32)
  return jnp.where(jnp.isnan(x), _NEG_INF, x)


def apply_pos_inf_rule(x: jax.Array) -> jax.Array:
  """A row with +inf entries becomes uniform over them: +inf -> 0, the rest -> -inf."""
  def uniform_over_pos_inf(x):
    has_pos_inf = jnp.any(x == jnp.inf, axis=-1, keepdims=True)  # [B, 1]
    uniform = jnp.where(x == jnp.inf, jnp.float32(0), jnp.float32(_NEG_INF))
    return jnp.where(has_pos_inf, uniform, x)

  return _platform.skip_unless(jnp.any(x == jnp.inf), uniform_over_pos_inf, x)


def prepare(logits: jax.Array) -> jax.Array:
  """float32 copy with the input hygiene rules (NaN -> -inf, the +inf rule). [B, V]."""
  return apply_pos_inf_rule(remove_nan(logits))


def first_argmax(x: jax.Array) -> jax.Array:
  """Index of the row maximum, ties to the lowest index; NaN-free input. [B, V] -> int32[B].

  Two plain reductions (max, then min over the indices that reach it), which XLA runs faster
  than its variadic argmax. An all -inf row gives 0.
  """
  m = jnp.max(x, axis=-1, keepdims=True)
  iota = lax.broadcasted_iota(jnp.int32, x.shape, 1)
  return jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1).astype(jnp.int32)


def distribution(x: jax.Array):
  """(p, log p, H) of softmax(x) per row: [B, V], [B, V], [B, 1]; p = 0 and H = 0 for empty rows."""
  e, m = threshold.unnormalized_probs(x)
  z = _reduce.row_sum(e, keepdims=True)
  ok = z > 0
  p = jnp.where(ok, e / jnp.where(ok, z, 1.0), 0.0)
  log_p = jnp.where(e > 0, x - m - jnp.log(jnp.where(ok, z, 1.0)), _NEG_INF)
  entropy = -_reduce.row_sum(jnp.where(e > 0, p * log_p, 0.0), keepdims=True)
  return p, log_p, entropy


def valid_ids(ids: jax.Array, vocab: int) -> jax.Array:
  """ids with padding (-1) and any id outside `[0, V)` replaced by V, which scatters with
  `mode="drop"` ignore (a negative index would otherwise wrap around to V - 1)."""
  return jnp.where((ids >= 0) & (ids < vocab), ids, vocab)


def _saturate(x: jax.Array, y: jax.Array) -> jax.Array:
  """y where x is a number, clipped to the finite float32 range; -inf where x is -inf.

  A NaN y (inf - inf: a saturated logit divided by a tiny repetition penalty, less an infinite
  frequency penalty) is the bottom of the range: the penalty wins. It is set explicitly, not
  left to `clip`, whose max/min treat NaN as the code generation has them (measured: XLA:CPU at
  its defaults clipped it to -3.4e38, at -O0 it stayed NaN and emptied the row)."""
  y = jnp.where(jnp.isnan(y), -_F32_MAX, y)
  return jnp.where(x == _NEG_INF, _NEG_INF, jnp.clip(y, -_F32_MAX, _F32_MAX))


def apply_token_sets(x: jax.Array, banned: jax.Array, allowed: jax.Array) -> jax.Array:
  """Banned ids -> -inf; a row with allowed ids keeps only those. ids: int32[B, K], -1 pads."""
  vocab = x.shape[-1]
  banned, allowed = valid_ids(banned, vocab), valid_ids(allowed, vocab)

  def ban(x):
    rows = lax.broadcasted_iota(jnp.int32, banned.shape, 0)
    return x.at[rows, banned].set(_NEG_INF, mode="drop")

  def allow(x):
    rows = lax.broadcasted_iota(jnp.int32, allowed.shape, 0)
    keep = jnp.zeros(x.shape, bool).at[rows, allowed].set(True, mode="drop")
    restricted = jnp.any(allowed < vocab, axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(keep | ~restricted, x, _NEG_INF)

  x = _platform.skip_unless(jnp.any(banned < vocab), ban, x)
  return _platform.skip_unless(jnp.any(allowed < vocab), allow, x)


def apply_logit_bias(x: jax.Array, ids: jax.Array, biases: jax.Array) -> jax.Array:
  """Adds `biases[b, j]` to `x[b, ids[b, j]]` (duplicates add up). ids/biases: [B, K].

  Duplicates are added by a fixed tree over j (every entry j gets the total of its id), then
  written with a plain scatter: a scatter-add would leave their order to the backend (GPU
  atomics), and duplicates would then write equal values in any order.
  """
  ids = valid_ids(ids, x.shape[-1])

  def add(x):
    rows = lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    same = ids[:, :, None] == ids[:, None, :]  # [B, K, K]
    totals = _reduce.tree_sum(jnp.where(same, biases[:, None, :], 0.0), axis=-1)  # [B, K]
    bias = jnp.zeros(x.shape, jnp.float32).at[rows, ids].set(totals, mode="drop")
    # Only biased entries change: x + 0 would turn a -0.0 logit into +0.0, so a row's bits
    # would depend on whether another row of the batch has a bias.
    return jnp.where(bias != 0, _saturate(x, x + bias), x)

  return _platform.skip_unless(jnp.any((ids < x.shape[-1]) & (biases != 0)), add, x)


def apply_penalties(x: jax.Array, counts: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array) -> jax.Array:
  """HF's repetition penalty, then OpenAI's frequency and presence penalties. counts: [B, V].

  For a token seen c > 0 times: x -> x / r if x > 0 else x * r (r = repetition), then
  x -> x - frequency * c - presence. Unseen tokens are unchanged. Negative counts count as 0.
  """
  active = (repetition != 1) | (presence != 0) | (frequency != 0)  # [B]

  def penalize(x):
    c = jnp.maximum(counts, 0)
    seen = c > 0
    r = repetition[:, None]
    y = jnp.where(seen, jnp.where(x < 0, x * r, x / r), x)
    y = y - jnp.where(seen, frequency[:, None] * c.astype(jnp.float32) + presence[:, None], 0.0)
    return jnp.where(active[:, None], _saturate(x, y), x)

  return _platform.skip_unless(jnp.any(active), penalize, x)


def apply_temperature(x: jax.Array, t: jax.Array) -> jax.Array:
  """x / t per row; t == 0 rows become a point mass on their greedy token. float32 [B, V]."""
  greedy_rows = (t == 0)[:, None]
  t_safe = jnp.where(greedy_rows, 1.0, t[:, None])
  scaled = jnp.where(x == _NEG_INF, _NEG_INF, x / t_safe)

  # A tiny temperature can overflow x / t to +-inf; such rows use the equivalent (x - max) / t,
  # which is <= 0 everywhere and 0 at the maximum (same distribution, never an empty row).
  def fix_overflow(scaled):
    overflow = jnp.any(jnp.isinf(scaled) & (x > _NEG_INF), axis=-1, keepdims=True)

    def shift(scaled):
      m = jnp.max(x, axis=-1, keepdims=True)
      shifted = jnp.where(x == _NEG_INF, _NEG_INF, (x - m) / t_safe)
      return jnp.where(overflow, shifted, scaled)

    # Rows that do not overflow keep `scaled`: the max and the shift only where one does.
    return _platform.skip_unless(jnp.any(overflow), shift, scaled)

  scaled = _platform.skip_unless(jnp.any(t < 1), fix_overflow, scaled)

  def point_mass(scaled):
    iota = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    one_hot = jnp.where(iota == first_argmax(x)[:, None], x, _NEG_INF)
    return jnp.where(greedy_rows, one_hot, scaled)

  # The conditions skip whole passes over [B, V] when no row needs them (traced, no retrace).
  return _platform.skip_unless(jnp.any(greedy_rows), point_mass, scaled)


def apply_top_k_top_p(x: jax.Array, k: jax.Array, p: jax.Array) -> jax.Array:
  """top-k (k <= 0 or k >= V keeps all) then top-p (p >= 1 keeps all) on the top-k survivors.

  Both kept sets are upper sets of the row, so the pair is one threshold per row
  (`threshold.top_k_top_p_threshold`).
  """
  active = ((k > 0) & (k < x.shape[-1])) | (p < 1)  # [B]

  def cut(x):
    tau = threshold.top_k_top_p_threshold(x, k, p)
    return jnp.where(active[:, None] & (x < tau[:, None]), _NEG_INF, x)

  return _platform.skip_unless(jnp.any(active), cut, x)


def apply_min_p(x: jax.Array, min_p: jax.Array) -> jax.Array:
  """min-p: p_i >= min_p * max_j p_j, i.e. exp(x_i - max) >= min_p."""
  def cut(x):
    e, _ = threshold.unnormalized_probs(x)
    return jnp.where(e >= min_p[:, None], x, _NEG_INF)

  return _platform.skip_unless(jnp.any(min_p > 0), cut, x)


def apply_typical_p(x: jax.Array, typical_p: jax.Array) -> jax.Array:
  """typical-p, by bisection in the order of typicality (`threshold.typical_keep`)."""
  active = typical_p < 1  # [B]

  def cut(x):
    p, log_p, entropy = distribution(x)
    keep = threshold.typical_keep(p, log_p, entropy, typical_p)
    return jnp.where(keep | ~active[:, None], x, _NEG_INF)

  return _platform.skip_unless(jnp.any(active), cut, x)


def _cut_below(x: jax.Array, active: jax.Array, cutoff) -> jax.Array:
  """Keeps p_i >= cutoff(H) [B, 1] and the most probable token(s) of active rows."""
  def cut(x):
    p, _, entropy = distribution(x)
    keep = (p >= cutoff(entropy)) | (x == jnp.max(x, axis=-1, keepdims=True))
    return jnp.where(keep | ~active[:, None], x, _NEG_INF)

  return _platform.skip_unless(jnp.any(active), cut, x)


def apply_epsilon_cutoff(x: jax.Array, epsilon: jax.Array) -> jax.Array:
  """epsilon: p_i >= epsilon, and the most probable token(s); epsilon <= 0 keeps all."""
  return _cut_below(x, epsilon > 0, lambda entropy: epsilon[:, None])


def apply_eta_cutoff(x: jax.Array, eta: jax.Array) -> jax.Array:
  """eta: p_i >= min(eta, sqrt(eta) exp(-H)), and the most probable token(s)."""
  def cutoff(entropy):
    e = eta[:, None]
    return jnp.minimum(e, jnp.sqrt(e) * jnp.exp(-entropy))

  return _cut_below(x, eta > 0, cutoff)


def apply_top_n_sigma(x: jax.Array, n: jax.Array) -> jax.Array:
  """top-nσ: keeps x_i >= max - n·σ, σ the population standard deviation of the row's finite
  logits; n <= 0 keeps all.

  The statistics run on the row scaled by a power of two, 2^-e with max |x| = m·2^e (m in
  [0.5, 1); no scaling when max |x| < 1), so that rows near the float32 range do not overflow;
  a power of two changes no comparison. Sums are `_reduce.row_sum`s (batch-invariant).
  """
  active = n > 0  # [B]

  def cut(x):
    finite = x > _NEG_INF  # NaN and +inf are gone by now
    # An integer count: exact in any order, and as a float32 (V < 2^24) the same number as a
    # float sum of ones.
    count = jnp.sum(finite, axis=-1, keepdims=True, dtype=jnp.int32).astype(jnp.float32)
    largest = jnp.max(jnp.where(finite, jnp.abs(x), 0.0), axis=-1, keepdims=True)
    highest = jnp.max(x, axis=-1, keepdims=True)  # -inf for a row with nothing finite
    _, e = jnp.frexp(largest)
    e = jnp.maximum(e, 0)
    # Two factors >= 2^-64, each a normal float32: x * 2^-e exactly, without a subnormal scale.
    half = e // 2
    scale_a = lax.bitcast_convert_type((127 - half) << 23, jnp.float32)  # 2^-half
    scale_b = lax.bitcast_convert_type((127 - (e - half)) << 23, jnp.float32)
    y = jnp.where(finite, (x * scale_a) * scale_b, 0.0)
    safe_count = jnp.maximum(count, 1.0)
    mean = _reduce.row_sum(y, keepdims=True) / safe_count
    var = _reduce.row_sum(jnp.where(finite, jnp.square(y - mean), 0.0), keepdims=True) / safe_count
    # max_i of (x_i * a) * b is (max_i x_i * a) * b: a product by a positive number rounds
    # monotonically. So it comes from the pass that finds `largest`, not one over y.
    top = (highest * scale_a) * scale_b
    cutoff = top - n[:, None] * jnp.sqrt(var)
    return jnp.where(active[:, None] & finite & (y < cutoff), _NEG_INF, x)

  return _platform.skip_unless(jnp.any(active), cut, x)


def dynamic_temperature(x: jax.Array, t: jax.Array, spread: jax.Array,
                        exponent: jax.Array) -> jax.Array:
  """float32[B]: each row's temperature; where `spread` (dynatemp_range) > 0 and t > 0,
  T_min + (T_max - T_min)·(H / log N)^exponent (T_min = max(0, t - spread), T_max = t +
  spread, capped at the largest float32), H the entropy of softmax(x) and N its selectable
  tokens; H / log N is clipped to [0, 1] (float32 rounding can pass 1). A row with at most one
  selectable token gets 1: it is left as it is."""
  active = (spread > 0) & (t > 0)  # [B]

  def work():
    # H = log z - sum_i e_i (x_i - m) / z with e_i = exp(x_i - m), z = sum_i e_i: both sums in
    # the pass that computes e (two non-negative terms, no cancellation).
    e, m = threshold.unnormalized_probs(x)
    z = _reduce.row_sum(e)  # [B]
    weighted = _reduce.row_sum(jnp.where(e > 0, e * (x - m), 0.0))  # [B], <= 0
    safe_z = jnp.where(z > 0, z, 1.0)
    entropy = jnp.log(safe_z) - weighted / safe_z
    count = jnp.sum(x > _NEG_INF, axis=-1, dtype=jnp.int32)  # integers: exact
    log_n = jnp.log(jnp.maximum(count, 2).astype(jnp.float32))
    normalized = jnp.clip(entropy / log_n, 0.0, 1.0)
    low = jnp.maximum(t - spread, 0.0)
    high = jnp.minimum(t + spread, _F32_MAX)
    dynamic = low + (high - low) * jnp.power(normalized, exponent)
    return jnp.where(active, jnp.where(count > 1, dynamic, 1.0), t)

  return _platform.when(jnp.any(active), work, lambda: t)


XTC_SALT = 0x58544321  # XTC's draw: fold_in(the row's token key, XTC_SALT)


def xtc_uniforms(keys: jax.Array) -> jax.Array:
  """float32[B]: XTC's uniform of each row, from its token key folded with `XTC_SALT` (the
  token's own draw, from the key itself, is not disturbed)."""
  return jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, XTC_SALT), (),
                                               jnp.float32))(keys)


def _xtc_removed(x: jax.Array, e: jax.Array, cut_at: jax.Array, probability: jax.Array,
                 keys: jax.Array | None, enabled: jax.Array) -> jax.Array:
  """bool[B, V]: the tokens XTC removes, given e = exp(x - max) (`unnormalized_probs(x)`)."""
  coin = probability >= 1 if keys is None else xtc_uniforms(keys) < probability
  active = enabled & coin
  # p_i >= threshold as e_i >= threshold · z (z the sum of e): no division pass; the least
  # probable of them is the least e (p's order, ties included).
  z = _reduce.row_sum(e, keepdims=True)
  above = (e >= cut_at[:, None] * z) & (x > _NEG_INF)
  least = jnp.min(jnp.where(above, e, jnp.inf), axis=-1, keepdims=True)
  # A token above the cut and above the least of them means two or more are above it.
  return active[:, None] & above & (e > least)


def apply_xtc(x: jax.Array, cut_at: jax.Array, probability: jax.Array,
              keys: jax.Array | None) -> jax.Array:
  """XTC: where the row's uniform u < probability, if two or more tokens have p >= cut_at,
  removes those of them more probable than the least probable of them (ties at that least
  probability all stay). u is `xtc_uniforms(keys)`, drawn only when some row could act; keys
  None: only rows with probability >= 1 act."""
  enabled = (probability > 0) & (cut_at <= 0.5)  # [B]

  def cut(x):
    e, _ = threshold.unnormalized_probs(x)
    return jnp.where(_xtc_removed(x, e, cut_at, probability, keys, enabled), _NEG_INF, x)

  return _platform.skip_unless(jnp.any(enabled), cut, x)


LN2 = 0.6931471805599453


def _mirostat_keep(x: jax.Array, e: jax.Array, m: jax.Array, mirostat: jax.Array,
                   mu: jax.Array) -> jax.Array:
  """bool[B, V]: what mirostat 2 keeps, given (e, m) = unnormalized_probs(x); log p as in
  `distribution`."""
  z = _reduce.row_sum(e, keepdims=True)
  ok = z > 0
  log_p = jnp.where(e > 0, x - m - jnp.log(jnp.where(ok, z, 1.0)), _NEG_INF)
  keep = (-log_p / LN2 <= mu[:, None]) | (x == m)
  return keep | (mirostat != 2)[:, None]


def apply_mirostat(x: jax.Array, mirostat: jax.Array, mu: jax.Array) -> jax.Array:
  """mirostat 2's cut: rows with mirostat == 2 keep the tokens of surprise -log2 p <= mu and
  their most probable token(s) (which are kept whenever anything is)."""
  def cut(x):
    e, m = threshold.unnormalized_probs(x)
    return jnp.where(_mirostat_keep(x, e, m, mirostat, mu), x, _NEG_INF)

  return _platform.skip_unless(jnp.any(mirostat == 2), cut, x)


def mirostat_update(mu: jax.Array, logprob: jax.Array, params: SamplingParams) -> jax.Array:
  """mu - eta·(s - tau) for rows with mirostat == 2 (others unchanged); s = -logprob / ln 2,
  the drawn token's surprise in bits under the kept set."""
  s = -logprob / LN2
  return jnp.where(params.mirostat == 2, mu - params.mirostat_eta * (s - params.mirostat_tau),
                   mu)


def ngram_bans(history: jax.Array, size: jax.Array, runs: jax.Array | None = None) -> jax.Array:
  """bool[B, H]: True at the history entries that `no_repeat_ngram_size` bans: history[j] where
  the n - 1 tokens before it equal the row's last n - 1 tokens (n = size[b]; n = 1 bans every
  token of the history; n <= 0 nothing). history: int32[B, H], padded with negative ids at the
  start. The run lengths are `suffix_runs(history, 0)` (DRY's; `runs` if given): no bound on n.
  """
  run = history_runs(history) if runs is None else runs
  n = size[:, None]
  return (history >= 0) & (n >= 1) & (run >= n - 1)


def bad_word_bans(history: jax.Array, words: jax.Array) -> jax.Array:
  """int32[B, K]: the last id of each bad word whose other ids end the history; -1 otherwise.

  words: int32[B, K, M], each sequence padded with -1 at its end (an empty one bans nothing);
  history: int32[B, H] as in `ngram_bans` (H may be 0: then only one-token words are banned).
  """
  width = history.shape[1]
  length = jnp.sum(words >= 0, axis=-1, dtype=jnp.int32)  # [B, K]
  ok = length >= 1
  for q in range(words.shape[-1] - 1):  # the q-th id of the prefix against the history
    needed = q < length - 1
    at = width - (length - 1) + q  # [B, K]: where it must stand in the history
    if width:
      seen = jnp.take_along_axis(history, jnp.clip(at, 0, width - 1), axis=1)
      match = (at >= 0) & (seen == words[:, :, q])
    else:
      match = jnp.zeros(at.shape, bool)
    ok = ok & (~needed | match)
  last = jnp.take_along_axis(words, jnp.maximum(length - 1, 0)[:, :, None], axis=2)[:, :, 0]
  return jnp.where(ok, last, -1)


def suffix_runs(history: jax.Array, start: jax.Array) -> jax.Array:
  """int32[B, H]: run[j], how many consecutive i = 1, 2, ... have history[j - i] ==
  history[H - i] with j - i >= start[b] (the length of the repeat of the row's last tokens that
  ends just before position j; history padded with negative ids at the start).

  One shift per round, O(B·H) each. On CPU and TPU a while loop stops at the first round that
  extends no row's run (text repeats are short: a few rounds); on a GPU a loop of H rounds (a
  constant trip count, `jaxdecode._platform`). Both give the same array.
  """
  batch, width = history.shape
  if width == 0:
    return jnp.zeros(history.shape, jnp.int32)
  padded = jnp.concatenate([jnp.full(history.shape, -1, history.dtype), history], axis=1)
  column = lax.broadcasted_iota(jnp.int32, history.shape, 1)

  def body(i, alive, run):
    before = lax.dynamic_slice_in_dim(padded, width - i, width, axis=1)  # history[j - i]
    last = lax.dynamic_slice_in_dim(history, width - i, 1, axis=1)  # history[H - i], [B, 1]
    alive = alive & (before == last) & (last >= 0) & (column - i >= start[:, None])
    return alive, run + alive.astype(jnp.int32)

  init = (jnp.int32(1), jnp.ones(history.shape, bool), jnp.zeros(history.shape, jnp.int32))
  if _platform.mode() == _platform.STRAIGHT:
    # Python bounds: a constant trip count (int64 under x64, so the index is cast).
    _, run = lax.fori_loop(1, width + 1, lambda i, c: body(i.astype(jnp.int32), *c), init[1:])
    return run

  def cond(c):
    i, alive, _ = c
    return (i <= width) & jnp.any(alive)

  _, _, run = lax.while_loop(cond, lambda c: (c[0] + 1, *body(c[0], c[1], c[2])), init)
  return run


def history_runs(history: jax.Array) -> jax.Array:
  """`suffix_runs(history, 0)`: the runs of the whole history, which the n-gram bans read and
  DRY bounds by its window (`window_runs`), computed once per step for both."""
  return suffix_runs(history, jnp.zeros(history.shape[:1], jnp.int32))


def window_runs(runs: jax.Array, start: jax.Array) -> jax.Array:
  """`suffix_runs(history, start)` from `runs = suffix_runs(history, 0)` (start >= 0): a run
  ending before position j stops where j - i < start, so it is min(runs[j], max(j - start,
  0)), the same integers."""
  column = lax.broadcasted_iota(jnp.int32, runs.shape, 1)
  return jnp.minimum(runs, jnp.maximum(column - start[:, None], 0))


DRY_FLOAT_MAX_LOG = 88.7228391  # llama.cpp's bound of the exponent: log(FLT_MAX)


def dry_window(history: jax.Array, multiplier: jax.Array, base: jax.Array, allowed: jax.Array,
               last_n: jax.Array):
  """(int32[B] window W, bool[B] rows where DRY can act): W = min(tokens, last_n), all tokens
  where last_n < 0."""
  tokens = jnp.sum(history >= 0, axis=-1, dtype=jnp.int32)  # [B]
  window = jnp.where(last_n < 0, tokens, jnp.minimum(last_n, tokens))  # [B]
  return window, (multiplier != 0) & (base >= 1) & (last_n != 0) & (window > allowed)


def apply_dry(x: jax.Array, history: jax.Array | None, multiplier: jax.Array, base: jax.Array,
              allowed: jax.Array, last_n: jax.Array, breakers: jax.Array,
              runs: jax.Array | None = None) -> jax.Array:
  """DRY, llama.cpp's `llama_sampler_dry_apply` without its host loops (single-token breakers).

  Per row: the window is its last W = min(tokens, last_n) tokens (last_n -1: all; 0: off);
  rep_limit the number of tokens after its latest breaker in the window (W if none). Each
  position j of the window gets the length of the repeat of the window's last tokens that ends
  just before it (`suffix_runs`, bounded by the window), capped at rep_limit; token
  history[j] gets the largest such length n over its positions, and, where n >= allowed and it
  is not a breaker, its logit loses multiplier · base^e, e = n - allowed capped at
  int(88.7228391 / log(base)) when base > 1.000001 (the penalty clipped to the largest
  float32). Nothing happens where multiplier is 0, W <= allowed or rep_limit < allowed.
  `runs`: `history_runs(history)` if the caller has it (the chain shares it with the n-gram
  bans), else computed here.
  """
  batch, vocab = x.shape
  if history is None or history.shape[1] == 0:
    return x
  width = history.shape[1]
  breakers = valid_ids(breakers, vocab)  # [B, K]
  window, active = dry_window(history, multiplier, base, allowed, last_n)

  def penalize(x):
    column = lax.broadcasted_iota(jnp.int32, history.shape, 1)
    start = width - window  # [B]: the window's first column
    is_breaker = jnp.any((history[:, :, None] == breakers[:, None, :]) &
                         (breakers[:, None, :] < vocab), axis=-1)  # [B, H]
    after = jnp.where(is_breaker & (column >= start[:, None]), width - 1 - column, width)
    rep_limit = jnp.minimum(jnp.min(after, axis=-1), window)  # [B]
    whole = history_runs(history) if runs is None else runs
    run = jnp.minimum(window_runs(whole, start), rep_limit[:, None])  # [B, H]
    counted = run >= allowed[:, None]
    rows = lax.broadcasted_iota(jnp.int32, history.shape, 0)
    ids = valid_ids(jnp.where(counted, history, -1), vocab)  # [B, H]: V where not counted
    # Each counted position's token gets the longest of its runs (an integer scatter-max: its
    # order cannot matter); the penalty is then computed per position, not over [B, V].
    longest = jnp.zeros((batch, vocab), jnp.int32).at[rows, ids].max(run, mode="drop")
    n = jnp.take_along_axis(longest, jnp.minimum(ids, vocab - 1), axis=1)  # [B, H]
    not_breaker = ~jnp.any(ids[:, :, None] == breakers[:, None, :], axis=-1)
    hit = (active & (rep_limit >= allowed))[:, None] & counted & (ids < vocab) & not_breaker
    cap = jnp.where(base > 1.000001,
                    (jnp.float32(DRY_FLOAT_MAX_LOG) / jnp.log(base)).astype(jnp.int32), 0)
    exponent = n - allowed[:, None]
    exponent = jnp.where((cap[:, None] > 0) & (exponent > cap[:, None]), cap[:, None], exponent)
    penalty = jnp.minimum(multiplier[:, None] * jnp.power(base[:, None],
                                                          exponent.astype(jnp.float32)),
                          _F32_MAX)
    before = jnp.take_along_axis(x, jnp.minimum(ids, vocab - 1), axis=1)
    # Positions of one token all write the same value, so the order of the writes is moot.
    return x.at[rows, jnp.where(hit, ids, vocab)].set(_saturate(before, before - penalty),
                                                      mode="drop")

  return _platform.skip_unless(jnp.any(active), penalize, x)


def apply_history_bans(x: jax.Array, history: jax.Array | None, ngram: jax.Array,
                       words: jax.Array, runs: jax.Array | None = None) -> jax.Array:
  """`no_repeat_ngram_size` and `bad_words`: the tokens they ban become -inf (`runs`: see
  `ngram_bans`)."""
  vocab = x.shape[-1]
  batch = x.shape[0]
  if history is None:
    history = jnp.zeros((batch, 0), jnp.int32)
  rows = lax.broadcasted_iota(jnp.int32, (batch, 1), 0)

  def ban_ngrams(x):
    ids = jnp.where(ngram_bans(history, ngram, runs), history, vocab)
    return x.at[rows, valid_ids(ids, vocab)].set(_NEG_INF, mode="drop")

  def ban_words(x):
    ids = bad_word_bans(history, words)
    return x.at[rows, valid_ids(ids, vocab)].set(_NEG_INF, mode="drop")

  if history.shape[1]:
    x = _platform.skip_unless(jnp.any(ngram > 0), ban_ngrams, x)
  return _platform.skip_unless(jnp.any(words >= 0), ban_words, x)


def process_f32(logits: jax.Array, params: SamplingParams,
                counts: jax.Array | None = None, keys: jax.Array | None = None,
                history: jax.Array | None = None, mu: jax.Array | None = None) -> jax.Array:
  """The whole chain, in this module's order, on logits of any float dtype; float32 out.

  Args:
    logits: [B, V] floating logits.
    params: `SamplingParams` after `broadcast(B)` and `sanitized()`.
    counts: int32[B, V] token counts for the penalties, or None (no token seen yet: the
      penalties change nothing).
    keys: typed keys [B], the keys the rows' tokens are drawn with; XTC draws its uniform from
      `fold_in(keys[b], XTC_SALT)`. None: XTC acts on the rows whose probability is >= 1 only.
    history: int32[B, H], each row's tokens so far, oldest first, its newest at H - 1, padded
      with negative ids at the start (`no_repeat_ngram_size`, `bad_words`), or None (no token
      yet: the rules that read it ban only one-token bad words).
    mu: float32[B], each row's mirostat state (the loops carry it), or None: its initial
      value 2·mirostat_tau.
  """
  current = _platform.mode()
  if current is None:
    return _platform.by_platform(process_f32, logits, params, counts, keys, history, mu)
  return _chain(logits, params, counts, keys, history, mu, formulation=current)


@functools.partial(jax.jit, static_argnames=("formulation",))
def _chain(logits, params, counts, keys, history, mu, *, formulation: str):
  """`_process_f32` traced in one formulation, jitted so that a loop traces its chain once:
  a loop holds it up to three times (on a GPU the first round, the chunks and a last partial
  chunk draw apart), and loops of the same batch and vocabulary share it. Inside another jit it
  is a call that XLA inlines: the compiled program is the one the inline chain gives."""
  with _platform.tracing(formulation):
    return _process_f32(logits, params, counts, keys, history, mu)


def _process_f32(logits, params, counts, keys, history, mu):
  x, mu = _head(logits, params, counts, keys, history, mu)
  x = apply_xtc(x, params.xtc_threshold, params.xtc_probability, keys)
  return apply_mirostat(x, params.mirostat, mu)


def _head(logits, params, counts, keys, history, mu):
  """The chain up to eta (everything before XTC and mirostat): `(x, mu)`, mu the state to cut
  with (2·mirostat_tau where the caller has none)."""
  x = remove_nan(logits)
  x = apply_token_sets(x, params.banned_token_ids, params.allowed_token_ids)
  runs = None
  if history is not None and history.shape[1]:
    # One pass of run lengths for the n-gram bans and DRY (each bounds it as it needs).
    _, dry_active = dry_window(history, params.dry_multiplier, params.dry_base,
                               params.dry_allowed_length, params.dry_penalty_last_n)
    runs = _platform.when(jnp.any(params.no_repeat_ngram_size > 0) | jnp.any(dry_active),
                          lambda: history_runs(history),
                          lambda: jnp.zeros(history.shape, jnp.int32))
  x = apply_history_bans(x, history, params.no_repeat_ngram_size, params.bad_words, runs)
  x = apply_pos_inf_rule(x)
  x = apply_logit_bias(x, *params.logit_bias)
  if counts is not None:
    x = apply_penalties(x, counts, params.repetition_penalty, params.presence_penalty,
                        params.frequency_penalty)
  x = apply_dry(x, history, params.dry_multiplier, params.dry_base, params.dry_allowed_length,
                params.dry_penalty_last_n, params.dry_sequence_breakers, runs)
  x = apply_top_n_sigma(x, params.top_n_sigma)
  t = dynamic_temperature(x, params.temperature, params.dynatemp_range,
                          params.dynatemp_exponent)
  x = apply_temperature(x, t)
  x = apply_top_k_top_p(x, params.top_k, params.top_p)
  x = apply_min_p(x, params.min_p)
  x = apply_typical_p(x, params.typical_p)
  x = apply_epsilon_cutoff(x, params.epsilon_cutoff)
  x = apply_eta_cutoff(x, params.eta_cutoff)
  return x, 2.0 * params.mirostat_tau if mu is None else mu


def cast_saturating(x: jax.Array, dtype) -> jax.Array:
  """float32 [B, V] -> dtype, saturating at the dtype's range instead of overflowing to +-inf.

  A row whose maximum exceeds the range is shifted by its maximum first (same distribution, and
  its top tokens keep their order); -inf stays -inf.
  """
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32 or float(jnp.finfo(dtype).max) >= _F32_MAX:
    return x.astype(dtype)
  high = float(jnp.finfo(dtype).max)
  m = jnp.max(x, axis=-1, keepdims=True)
  x = jnp.where(m > high, x - m, x)
  return jnp.where(x == _NEG_INF, _NEG_INF, jnp.clip(x, -high, high)).astype(dtype)


# ---------------------------------------------------------------------------------------------
# Public processors: validate in Python, then run jitted float32 code, cast back to the input dtype.


@jax.jit
def _process_logits(logits, params, counts, key, history):
  keys = None if key is None else row_keys(key, logits.shape[0])
  return cast_saturating(process_f32(logits, params.sanitized(), counts, keys, history),
                         logits.dtype)


def row_keys(key, batch_size: int) -> jax.Array:
  """Typed keys `[batch_size]`, one per row, following the key policy (`jaxdecode.sampling`)."""
  if not jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)
  if key.shape == ():
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(batch_size,
                                                                      dtype=jnp.uint32))
  return key


def process_logits(logits: jax.Array, params: SamplingParams, *, counts=None, key=None,
                   history=None) -> jax.Array:
  """Applies the whole chain of `params` to `[B, V]` logits (order: this module's docstring).

  Args:
    logits: `[B, V]` floating logits (any float dtype; the math runs in float32).
    params: a `SamplingParams`; each field a scalar or a `[B]` array. `min_new_tokens` must be 0
      here (it needs `decode`'s EOS ids and step).
    counts: `int[B, V]`, how often each row has seen each token (`jaxdecode.token_counts`);
      needed when a penalty is set.
    key: one key or one per row (the key policy of `jaxdecode.sample`): XTC's draw comes from
      each row's key folded with `XTC_SALT`. Needed when a row has 0 < xtc_probability < 1;
      without it only rows with xtc_probability 1 apply XTC.
    history: `int[B, H]`, each row's tokens so far, oldest first, padded with -1 at the start;
      needed by `no_repeat_ngram_size`, DRY and `bad_words` of two tokens or more.

  Returns:
    `[B, V]` logits of the input dtype: the processed distribution is their softmax; removed
    tokens are -inf. Rows with temperature 0 keep only their greedy token.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    >>> out = jaxdecode.process_logits(logits, jaxdecode.SamplingParams(top_p=0.8))
    >>> jnp.isfinite(out).tolist()  # 0.5 + 0.3 reaches 0.8: the third token is not needed
    [[True, True, False, False]]
    >>> seen = jaxdecode.token_counts(jnp.array([[0, 0]]), 4)  # token 0 seen twice
    >>> params = jaxdecode.SamplingParams(frequency_penalty=0.5, banned_token_ids=[3])
    >>> jaxdecode.process_logits(jnp.zeros((1, 4)), params, counts=seen).tolist()
    [[-1.0, 0.0, 0.0, -inf]]
  """
  params, counts = check_call(logits, params, counts, caller="process_logits")
  no_min_new_tokens(params, "process_logits")
  batch = jnp.shape(logits)[0]
  history = check_history(history, params, batch, "process_logits")
  if key is None and params.draws_xtc():
    raise ValueError("xtc_probability between 0 and 1 draws whether XTC acts on a row: pass "
                     "key= to process_logits (one key, or one per row)")
  if key is not None:
    _checks.key(key, batch)
  return _process_logits(jnp.asarray(logits), params, counts, key, history)


def no_min_new_tokens(params: SamplingParams, caller: str) -> None:
  """ValueError if `min_new_tokens` is set: only the loops know the EOS ids and the step."""
  if params.largest_min_new_tokens():
    raise ValueError(f"min_new_tokens={params.largest_min_new_tokens()} needs the EOS ids and "
                     f"the step, which {caller} does not have; it applies in jaxdecode.decode")


@functools.partial(jax.jit, static_argnums=0)
def _run_one(apply, logits, value):
  return cast_saturating(apply(prepare(logits), value), logits.dtype)


def _one(apply, field: str, logits, value):
  """Validates `value` as the SamplingParams field `field` and applies one processor."""
  batch, _ = _checks.logits(logits)
  value = check_row_param(field, value, batch)
  # Traced values (inside a user's jit) are mapped onto the valid range like any params field.
  value = getattr(SamplingParams()._with(**{field: value}).sanitized(), field)  # pylint: disable=protected-access
  return _run_one(apply, jnp.asarray(logits), value)


def _top_k_alone(x, k):
  return apply_top_k_top_p(x, k, jnp.ones(k.shape, jnp.float32))


def _top_p_alone(x, p):
  return apply_top_k_top_p(x, jnp.zeros(p.shape, jnp.int32), p)


def temperature(logits: jax.Array, temperature: jax.Array | float) -> jax.Array:
  """Divides `[B, V]` logits by a temperature (scalar or `[B]`, >= 0).

  0 keeps only the greedy token (argmax, ties to the lowest index); values below 1 sharpen the
  distribution, above 1 flatten it, 1 returns the logits unchanged.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> jaxdecode.processors.temperature(jnp.array([[1.0, 3.0, 3.0]]), 0.0).tolist()
    [[-inf, 3.0, -inf]]
  """
  return _one(apply_temperature, "temperature", logits, temperature)


def top_k(logits: jax.Array, k: jax.Array | int) -> jax.Array:
  """top-k (defined in this module's docstring): k is a scalar or `[B]`; 0 disables.

  Ties at the boundary are all kept, so more than k tokens can survive.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> jaxdecode.processors.top_k(jnp.array([[1.0, 3.0, 2.0, 2.0]]), k=2).tolist()
    [[-inf, 3.0, 2.0, 2.0]]
  """
  return _one(_top_k_alone, "top_k", logits, k)


def top_p(logits: jax.Array, p: jax.Array | float) -> jax.Array:
  """top-p, the nucleus (defined in this module's docstring): p in (0, 1]; 1 disables.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
    >>> jnp.isfinite(jaxdecode.processors.top_p(logits, p=0.6)).tolist()
    [[False, True, False]]
  """
  return _one(_top_p_alone, "top_p", logits, p)


def min_p(logits: jax.Array, min_p: jax.Array | float) -> jax.Array:
  """min-p (defined in this module's docstring): min_p in [0, 1]; 0 disables.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
    >>> jnp.isfinite(jaxdecode.processors.min_p(logits, min_p=0.4)).tolist()
    [[False, True, True]]
  """
  return _one(apply_min_p, "min_p", logits, min_p)


def typical_p(logits: jax.Array, p: jax.Array | float) -> jax.Array:
  """Locally typical sampling (defined in this module's docstring): p in (0, 1]; 1 disables.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))  # H = 1.03 nats; -log p = .69, 1.2, 1.61
    >>> jnp.isfinite(jaxdecode.processors.typical_p(logits, p=0.25)).tolist()  # .3: most typical
    [[False, True, False]]
  """
  return _one(apply_typical_p, "typical_p", logits, p)


def epsilon_cutoff(logits: jax.Array, epsilon: jax.Array | float) -> jax.Array:
  """Epsilon sampling (defined in this module's docstring): epsilon in [0, 1); 0 disables.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.4, 0.35, 0.25]]))
    >>> jnp.isfinite(jaxdecode.processors.epsilon_cutoff(logits, epsilon=0.3)).tolist()
    [[True, True, False], [True, True, False]]
  """
  return _one(apply_epsilon_cutoff, "epsilon_cutoff", logits, epsilon)


def eta_cutoff(logits: jax.Array, eta: jax.Array | float) -> jax.Array:
  """Eta sampling (defined in this module's docstring): eta in [0, 1); 0 disables.

  The cut adapts to the entropy H: a confident (low-entropy) step cuts at eta, an uncertain one
  cuts lower.

  Examples:
    >>> import jax.numpy as jnp, jaxdecode
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]]))  # sqrt(.25) * exp(-1.03) = 0.18
    >>> jnp.isfinite(jaxdecode.processors.eta_cutoff(logits, eta=0.25)).tolist()
    [[True, True, True]]
  """
  return _one(apply_eta_cutoff, "eta_cutoff", logits, eta)
