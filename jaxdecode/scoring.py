"""The log-probability kinds of a token, named once, and their gradients.

Per generated token y of a step whose model logits are z (`[V]`), with T the row's temperature
and q the processed distribution (the one the token is drawn from: after the constraint, token
bans, bias, penalties, temperature and every truncation, renormalized):

- `raw`: `log_softmax(z)[y]`, the model's own log-probability;
- `tempered`: `log_softmax(z / T)[y]`, what a trainer that only knows the temperature recomputes
  (NaN where T = 0: dividing by 0 defines no distribution);
- `processed`: `log q[y]`, what the loops record by default (0 where T = 0: the greedy token is
  certain; -inf for a token the processors removed);
- `kept_logmass`: `log sum_{i kept} softmax(z / T)_i`, the log of the tempered mass of the tokens
  q keeps (its support). Where the chain only removes tokens (constraint, bans, top-k, top-p,
  min-p, typical-p, epsilon, eta, top-nσ, XTC, mirostat) and rescales by T, `processed = tempered -
  kept_logmass`; a bias, penalty, DRY or dynamic temperature also reweights the kept tokens, and
  then the identity does not hold. NaN where T = 0.

Every sum over the vocabulary is `jaxdecode._reduce`'s (an order fixed by V alone), and `processed`
is `sampling.log_softmax` of the processed logits, whose entry at a drawn token is bitwise the
log-probability `sampling.inverse_cdf` returned: so the kinds of a token depend on that row's
logits and state alone, in `decode` as in `jaxdecode.score`.

Gradients (`token_scores` is a `jax.custom_vjp` in the logits z): the chain's decisions (the kept
set, a greedy row's argmax, a dynamic temperature's value) are constants, and the continuous maps
are differentiated: `d raw / dz = onehot(y) - softmax(z)`; `d tempered / dz = (onehot(y) -
softmax(z / T)) / T`; `d processed / dz_i = s_i (onehot(y)_i - q_i)` for i kept (0 elsewhere),
s_i the change of token i's processed logit when every logit rises by one (a forward-mode pass
of the chain with a tangent of ones, in the backward pass only): for the chain's
elementwise maps that is dx_i / dz_i, i.e. 1 / T times the repetition penalty's factor (1 / r
or r) where it acts (bias, presence, frequency and DRY add constants); a dynamic temperature
depends on all logits but not on a uniform shift, so it is held at its value; a user processor
that mixes tokens contributes its row sums. `d kept_logmass / dz = (softmax_K(z / T) -
softmax(z / T)) / T`, K the kept set. Where a value is not finite (a removed token's -inf, NaN
at T = 0) its gradient is 0.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxdecode import _platform
from jaxdecode import _reduce
from jaxdecode import processors
from jaxdecode import sampling
from jaxdecode import threshold

KINDS = ("raw", "tempered", "processed", "kept_logmass")


class Scores(NamedTuple):
  """Log-probabilities of the same tokens, one array per kind (the module docstring defines them).

  Each field has the shape of the tokens it scores: `[B, N]` from `decode(scores=True)` and
  `jaxdecode.score`, with 0 where a row has no token (after its EOS, from a dead end on).

  Attributes:
    raw: `log_softmax(z)[y]`, the model's own log-probability.
    tempered: `log_softmax(z / T)[y]`; NaN where the temperature is 0.
    processed: under the distribution the token was drawn from (what `DecodeOutput.logprobs`
      holds by default); 0 for temperature-0 rows.
    kept_logmass: log of the tempered mass of the tokens the processed distribution keeps;
      NaN where the temperature is 0.
  """
  raw: jax.Array
  tempered: jax.Array
  processed: jax.Array
  kept_logmass: jax.Array


def _pick(logp: jax.Array, token: jax.Array) -> jax.Array:
  return jnp.take_along_axis(logp, token[:, None], axis=1)[:, 0]


def _probs(x: jax.Array) -> jax.Array:
  """softmax(x) [B, V] with `_reduce`'s sum; an all -inf row is all 0."""
  e, _ = threshold.unnormalized_probs(x)
  total = _reduce.row_sum(e, keepdims=True)
  return jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0)


def _tempered_logits(base: jax.Array, temperature: jax.Array) -> jax.Array:
  """base / T by the chain's own temperature step (its overflow rule included); T = 0 rows hold
  the greedy point mass there, which `token_scores` replaces by NaN."""
  return processors.apply_temperature(base, temperature)


def _values(logits, processed, token, temperature):
  base = processors.prepare(logits)
  raw = _pick(sampling.log_softmax(base), token)
  tempered_logits = _tempered_logits(base, temperature)
  tempered = _pick(sampling.log_softmax(tempered_logits), token)
  e, _ = threshold.unnormalized_probs(tempered_logits)
  total = _reduce.tree_sum(_reduce.lane_sums(e))  # [B], log_softmax's row sum
  kept = _reduce.tree_sum(_reduce.lane_sums(jnp.where(processed > -jnp.inf, e, 0.0)))
  kept_logmass = jnp.log(kept) - jnp.log(total)
  greedy = temperature == 0
  tempered = jnp.where(greedy, jnp.nan, tempered)
  kept_logmass = jnp.where(greedy, jnp.nan, kept_logmass)
  processed_lp = _pick(sampling.log_softmax(processed), token)
  return Scores(raw, tempered, processed_lp, kept_logmass)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def token_scores(chain: Callable | None, logits: jax.Array, processed: jax.Array,
                 token: jax.Array, temperature: jax.Array, chain_inputs: Any = None) -> Scores:
  """The four kinds of each row's `token` (`Scores` of float32[B]).

  Args:
    chain: `chain(chain_inputs, logits float32[B, V]) -> processed logits`, the processing
      that made `processed` (static: a module-level function, e.g. `loop.process_from`), or
      None. Only the gradient calls it: a forward-mode pass with a tangent of ones gives the
      slope s of `processed` (module docstring), so the program of an undifferentiated call
      holds nothing of it. None: `processed` gets no gradient (a loop that only draws).
    logits: [B, V] the model's logits of the step (any float dtype).
    processed: float32[B, V] the processed logits the token's distribution is (`loop.process`).
    token: int32[B].
    temperature: float32[B] each row's temperature (params.temperature, not a dynamic one).
    chain_inputs: the pytree `chain` reads besides the logits (not differentiated).
  """
  del chain, chain_inputs
  return _values(logits, processed, token, temperature)


def _fwd(chain, logits, processed, token, temperature, chain_inputs):
  del chain
  out = _values(logits, processed, token, temperature)
  return out, (logits, processed, token, temperature, chain_inputs, out)


def _slope(chain, chain_inputs, logits, processed):
  """float32[B, V]: each processed logit's change when every logit rises by one."""
  if chain is None:
    return jnp.zeros(processed.shape, jnp.float32)
  def slope(z):
    return jax.jvp(lambda z: chain(chain_inputs, z), (z,), (jnp.ones_like(z),))[1]

  # One formulation per platform, as the forward's (the backward is traced outside it).
  tangent = _platform.by_platform(slope, logits.astype(jnp.float32))
  return jnp.where(jnp.isfinite(tangent), tangent, 0.0)


def _bwd(chain, residuals, cotangent):
  logits, processed, token, temperature, chain_inputs, out = residuals
  vocab = logits.shape[-1]
  onehot = jax.nn.one_hot(token, vocab, dtype=jnp.float32)
  base = processors.prepare(logits)

  def weight(value, g):  # the cotangent where the value is finite, else 0
    return jnp.where(jnp.isfinite(value), g, 0.0)[:, None]

  grad = weight(out.raw, cotangent.raw) * (onehot - _probs(base))
  greedy = temperature == 0
  t = jnp.where(greedy, 1.0, temperature)[:, None]
  scaled = _tempered_logits(base, temperature)  # the forward's z / T (its overflow rule too)
  tempered = _probs(scaled)
  grad += weight(out.tempered, cotangent.tempered) * (onehot - tempered) / t
  kept = processed > -jnp.inf
  grad += weight(out.kept_logmass, cotangent.kept_logmass) * (
      _probs(jnp.where(kept, scaled, -jnp.inf)) - tempered) / t
  q = _probs(processed)
  slope = _slope(chain, chain_inputs, logits, processed)
  d_processed = jnp.where(kept, slope * (onehot - q), 0.0)
  grad += weight(out.processed, jnp.where(greedy, 0.0, cotangent.processed)) * d_processed
  grad = jnp.where(jnp.isfinite(grad), grad, 0.0).astype(logits.dtype)
  return grad, jnp.zeros_like(processed), None, jnp.zeros_like(temperature), None


token_scores.defvjp(_fwd, _bwd)


def empty(batch: int, steps: int) -> Scores:
  """Buffers `[B, N]` of zeros, one per kind (what a row without a token there reads)."""
  zeros = jnp.zeros((batch, steps), jnp.float32)
  return Scores(zeros, zeros, zeros, zeros)
