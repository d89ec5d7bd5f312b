"""`SamplingParams`: every sampling setting as one pytree of traced arrays.

Two kinds of field:

- *Number fields* (temperature, top_k, ..., min_new_tokens): a scalar (shared by all rows) or an
  array of shape `[B]` (one value per row).
- *Token fields* (logit_bias, banned_token_ids, allowed_token_ids): token ids padded with -1 into
  an int32 array `[K]` (the same ids for every row) or `[B, K]` (one row of ids per row);
  logit_bias pairs its ids with a float32 array of biases of the same shape. Lists and dicts are
  padded to a width K of 8, 16, 32, ... so that new ids reuse the compiled program unless the
  width grows.

The values are pytree *leaves*, not static metadata, so a jitted sampler called with new values
of the same shapes reuses its compiled program: changing a temperature, a penalty or a banned
token never recompiles.

Concrete values are validated when the object is built; a bad one raises `ValueError` naming the
field, the value and the allowed range. Token ids are checked against the vocabulary when the
params meet logits (`broadcast`). Values that are only known under `jit` (tracers) cannot be
checked there; the processors sanitize them instead, as documented in `sanitized()`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class _Field:
  name: str
  default: Any
  integer: bool
  allowed: str  # the allowed range, as shown in error messages
  ok: Callable[[np.ndarray], np.ndarray]  # elementwise: True where the value is allowed


_FIELDS = (
    _Field("temperature", 1.0, False, "a finite number >= 0 (0 means greedy)",
           lambda v: np.isfinite(v) & (v >= 0)),
    _Field("top_k", 0, True, "an integer >= 0 (0 disables top-k)",
           lambda v: v >= 0),
    _Field("top_p", 1.0, False, "a number with 0 < top_p <= 1 (1 disables top-p)",
           lambda v: (v > 0) & (v <= 1)),
    _Field("min_p", 0.0, False, "a number with 0 <= min_p <= 1 (0 disables min-p)",
           lambda v: (v >= 0) & (v <= 1)),
    _Field("repetition_penalty", 1.0, False,
           "a finite number > 0 (1 disables; > 1 discourages seen tokens)",
           lambda v: np.isfinite(v) & (v > 0)),
    _Field("presence_penalty", 0.0, False, "a finite number (0 disables; OpenAI allows -2..2)",
           np.isfinite),
    _Field("frequency_penalty", 0.0, False, "a finite number (0 disables; OpenAI allows -2..2)",
           np.isfinite),
    _Field("typical_p", 1.0, False, "a number with 0 < typical_p <= 1 (1 disables)",
           lambda v: (v > 0) & (v <= 1)),
    _Field("epsilon_cutoff", 0.0, False, "a number with 0 <= epsilon_cutoff < 1 (0 disables)",
           lambda v: (v >= 0) & (v < 1)),
    _Field("eta_cutoff", 0.0, False, "a number with 0 <= eta_cutoff < 1 (0 disables)",
           lambda v: (v >= 0) & (v < 1)),
    _Field("min_new_tokens", 0, True, "an integer >= 0 (0 disables)",
           lambda v: v >= 0),
    _Field("top_n_sigma", 0.0, False, "a finite number (<= 0 disables, as in llama.cpp)",
           np.isfinite),
    _Field("xtc_threshold", 0.1, False,
           "a number with 0 <= xtc_threshold <= 1 (> 0.5 disables XTC)",
           lambda v: (v >= 0) & (v <= 1)),
    _Field("xtc_probability", 0.0, False,
           "a number with 0 <= xtc_probability <= 1 (0 disables XTC)",
           lambda v: (v >= 0) & (v <= 1)),
    _Field("dynatemp_range", 0.0, False,
           "a finite number >= 0 (0 disables dynamic temperature)",
           lambda v: np.isfinite(v) & (v >= 0)),
    _Field("dynatemp_exponent", 1.0, False, "a finite number >= 0",
           lambda v: np.isfinite(v) & (v >= 0)),
    _Field("dry_multiplier", 0.0, False, "a finite number >= 0 (0 disables DRY)",
           lambda v: np.isfinite(v) & (v >= 0)),
    _Field("dry_base", 1.75, False, "a finite number >= 1",
           lambda v: np.isfinite(v) & (v >= 1)),
    _Field("dry_allowed_length", 2, True, "an integer >= 1", lambda v: v >= 1),
    _Field("dry_penalty_last_n", -1, True,
           "an integer >= -1 (-1: the whole history; 0 disables DRY)", lambda v: v >= -1),
    _Field("mirostat", 0, True, "0 (off) or 2 (mirostat 2; mirostat 1 is not provided)",
           lambda v: (v == 0) | (v == 2)),
    _Field("mirostat_tau", 5.0, False, "a finite number >= 0 (the target surprise, in bits)",
           lambda v: np.isfinite(v) & (v >= 0)),
    _Field("mirostat_eta", 0.1, False, "a finite number >= 0 (the learning rate)",
           lambda v: np.isfinite(v) & (v >= 0)),
    _Field("no_repeat_ngram_size", 0, True,
           "an integer >= 0 (0 disables)", lambda v: v >= 0),
)
_NUMBER_NAMES = tuple(f.name for f in _FIELDS)
_TOKEN_NAMES = ("logit_bias", "banned_token_ids", "allowed_token_ids", "dry_sequence_breakers",
                "bad_words")
_NAMES = _NUMBER_NAMES + _TOKEN_NAMES
_BY_NAME = {f.name: f for f in _FIELDS}
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
_MIN_WIDTH = 8  # the narrowest padded width of a token field


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _is_frozen_array(x) -> bool:
  """A concrete jax array: its values cannot change (unlike a NumPy array's)."""
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


# How many checked broadcasts `SamplingParams.broadcast` keeps per params object, one per
# (batch_size, vocab_size), the oldest dropped first.
BROADCAST_CACHE_SIZE = 4


def _convert(field: _Field, value) -> np.ndarray | jax.Array:
  """Converts one number field to an int32/float32 array of rank 0 or 1, validating it: a NumPy
  array for a concrete value (`_place` puts it on the device), a jax array for a traced one."""
  dtype = jnp.int32 if field.integer else jnp.float32
  if isinstance(value, bool) or (hasattr(value, "dtype") and value.dtype == bool):
    raise ValueError(f"{field.name} must be {field.allowed}; got a boolean: {value!r}")
  if not _is_concrete(value):
    if field.integer and not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(f"{field.name} must be {field.allowed}; got a traced array of dtype "
                       f"{value.dtype}")
    if jnp.ndim(value) > 1:
      raise ValueError(f"{field.name} must be a scalar or a 1-D array [B]; got shape "
                       f"{jnp.shape(value)}")
    return jnp.asarray(value, dtype)

  try:
    host = np.asarray(value)
  except Exception as e:  # e.g. a string or a ragged list
    raise ValueError(f"{field.name} must be {field.allowed}; got {value!r}") from e
  if host.ndim > 1:
    raise ValueError(f"{field.name} must be a scalar or a 1-D array [B]; got shape {host.shape}")
  if not (np.issubdtype(host.dtype, np.number)) or np.issubdtype(host.dtype, np.complexfloating):
    raise ValueError(f"{field.name} must be {field.allowed}; got {value!r} (dtype {host.dtype})")
  if field.integer and not np.issubdtype(host.dtype, np.integer):
    raise ValueError(f"{field.name} must be {field.allowed}; got {value!r} (dtype {host.dtype}); "
                     f"pass integers, e.g. {field.name}=5")
  if field.integer and np.any((host > np.iinfo(np.int32).max) | (host < np.iinfo(np.int32).min)):
    raise ValueError(f"{field.name} must be {field.allowed} that fits in int32; got {value!r}")
  bad = ~field.ok(host.astype(np.float64))
  if np.any(bad):
    if host.ndim == 0:
      raise ValueError(f"{field.name} must be {field.allowed}; got {host.item()!r}")
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"{field.name} must be {field.allowed}; got {field.name}[{i}] = "
                     f"{host[i].item()!r} (in {host.tolist()!r})")
  if not field.integer:
    _check_float32(field.name, host)
  return host.astype(np.int32 if field.integer else np.float32)


def _place(tree):
  """Every NumPy array of `tree` onto the default device, in one `jax.device_put` call (other
  leaves, jax arrays and tracers, unchanged). The values are those `jnp.asarray` gives (the host
  arrays already hold the final dtype), at a fraction of the cost of one call per leaf: this
  runs for every SamplingParams built. Staged like `jnp.asarray` under a trace."""
  leaves, treedef = jax.tree.flatten(tree)
  at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, np.ndarray)]
  for i, placed in zip(at, jax.device_put([leaves[i] for i in at])):
    leaves[i] = placed
  return jax.tree.unflatten(treedef, leaves)


def _check_float32(name: str, host: np.ndarray) -> None:
  """ValueError if a finite value has no float32 counterpart (it would become inf or 0)."""
  wide = host.astype(np.float64)
  with np.errstate(over="ignore", under="ignore"):
    narrow = wide.astype(np.float32)
  lost = (np.isfinite(wide) & ~np.isfinite(narrow)) | ((wide != 0) & (narrow == 0))
  if np.any(lost):
    v = wide[lost].reshape(-1)[0]
    raise ValueError(f"{name} = {v!r} cannot be represented in float32 (finite magnitudes from "
                     f"{float(np.finfo(np.float32).smallest_subnormal):.1e} to {_F32_MAX:.2e}, "
                     f"or 0)")


# ---------------------------------------------------------------------------------------------
# Token fields.

_IDS_FORMS = ("a list of token ids (the same for every row), a list of B such lists (one per "
              "row), or an int array [K] / [B, K] padded with -1")
_BIAS_FORMS = ("a dict {token_id: bias} (the same for every row), a list of B dicts (one per "
               "row; None for none), or a pair (ids, biases) of arrays [K] / [B, K] with ids "
               "padded with -1")


def _width(n: int) -> int:
  """The padded width for n ids: 8, 16, 32, ... (so new ids rarely change the shape)."""
  return max(_MIN_WIDTH, 1 << max(n - 1, 0).bit_length())


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _id_list(name: str, ids, row: int | None) -> list[int]:
  where = "" if row is None else f" (row {row})"
  out = []
  for i in ids:
    if not _is_int(i) or i < 0 or i > _INT32_MAX:
      raise ValueError(f"{name} must hold token ids (integers in [0, 2**31)); got {i!r}{where}")
    out.append(int(i))
  return out


def _is_sequence(x) -> bool:
  return isinstance(x, (list, tuple, set, frozenset, range, np.ndarray))


def _check_id_array(name: str, ids) -> jax.Array:
  """An int array [K] or [B, K] of ids padded with -1 (checked when concrete)."""
  if jnp.ndim(ids) not in (1, 2) or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
    raise ValueError(f"{name} must be {_IDS_FORMS}; got an array of shape {jnp.shape(ids)} and "
                     f"dtype {jnp.result_type(ids)}")
  if _is_concrete(ids):
    host = np.asarray(ids)
    if np.any(host < -1):
      raise ValueError(f"{name} must hold token ids >= 0 (and -1 for padding); got "
                       f"{int(host[host < -1][0])}")
    if np.any(host > np.iinfo(np.int32).max):
      raise ValueError(f"{name} must hold ids that fit in int32; got {int(host.max())}")
  return jnp.asarray(ids, jnp.int32)


def _convert_ids(name: str, value) -> np.ndarray | jax.Array:
  """banned_token_ids / allowed_token_ids -> int32 [K] or [B, K], padded with -1 (a NumPy array
  when built here from lists, for `_place`)."""
  if value is None:
    return np.full((_MIN_WIDTH,), -1, np.int32)
  if isinstance(value, (jax.Array, np.ndarray)):
    return _check_id_array(name, value)
  if not _is_sequence(value):
    raise ValueError(f"{name} must be {_IDS_FORMS}; got {value!r}")
  items = list(value)
  if all(_is_int(i) for i in items):
    ids = _id_list(name, items, None)
    out = np.full((_width(len(ids)),), -1, np.int32)
    out[:len(ids)] = ids
    return out
  if all(i is None or _is_sequence(i) for i in items):
    rows = [_id_list(name, [] if r is None else list(r), b) for b, r in enumerate(items)]
    out = np.full((len(rows), _width(max(len(r) for r in rows))), -1, np.int32)
    for b, r in enumerate(rows):
      out[b, :len(r)] = r
    return out
  raise ValueError(f"{name} must be {_IDS_FORMS}; got {value!r}")


def _bias_dict(d, row: int | None) -> tuple[list[int], list[float]]:
  where = "" if row is None else f" (row {row})"
  if d is None:
    return [], []
  if not isinstance(d, dict):
    raise ValueError(f"logit_bias must be {_BIAS_FORMS}; got {d!r}{where}")
  ids, biases = [], []
  for token, bias in d.items():
    if not _is_int(token) or token < 0 or token > _INT32_MAX:
      raise ValueError(f"logit_bias keys must be token ids (integers in [0, 2**31)); got "
                       f"{token!r}{where}")
    if isinstance(bias, (bool, np.bool_)) or not isinstance(bias, (int, float, np.number)) \
        or not np.isfinite(bias):
      raise ValueError(f"logit_bias values must be finite numbers (use banned_token_ids to ban a "
                       f"token); got {bias!r} for token {token}{where}")
    _check_float32(f"logit_bias[{token}]", np.asarray(bias))
    ids.append(int(token))
    biases.append(float(bias))
  return ids, biases


def _convert_bias(value) -> tuple[np.ndarray | jax.Array, np.ndarray | jax.Array]:
  """logit_bias -> (int32 ids, float32 biases), both [K] or [B, K]; ids padded with -1 (NumPy
  arrays when built here from dicts, for `_place`)."""
  if value is None or isinstance(value, dict) or (isinstance(value, (list, tuple))
                                                   and len(value) == 0):
    ids, biases = _bias_dict(value or None, None)
    out_ids = np.full((_width(len(ids)),), -1, np.int32)
    out_b = np.zeros(out_ids.shape, np.float32)
    out_ids[:len(ids)], out_b[:len(ids)] = ids, biases
    return out_ids, out_b
  if isinstance(value, (list, tuple)) and value and all(d is None or isinstance(d, dict)
                                                        for d in value):
    rows = [_bias_dict(d, b) for b, d in enumerate(value)]
    width = _width(max(len(ids) for ids, _ in rows))
    out_ids = np.full((len(rows), width), -1, np.int32)
    out_b = np.zeros(out_ids.shape, np.float32)
    for b, (ids, biases) in enumerate(rows):
      out_ids[b, :len(ids)], out_b[b, :len(ids)] = ids, biases
    return out_ids, out_b
  if isinstance(value, tuple) and len(value) == 2 and not isinstance(value[0], (dict, list)):
    ids = _check_id_array("logit_bias ids", value[0])
    biases = value[1]
    if jnp.shape(biases) != ids.shape or not jnp.issubdtype(jnp.result_type(biases),
                                                            jnp.floating):
      raise ValueError(f"logit_bias biases must be a float array of the ids' shape {ids.shape}; "
                       f"got shape {jnp.shape(biases)} and dtype {jnp.result_type(biases)}")
    if _is_concrete(biases):
      if not np.all(np.isfinite(np.asarray(biases))):
        raise ValueError("logit_bias values must be finite numbers (use banned_token_ids to ban "
                         "a token)")
      _check_float32("logit_bias", np.asarray(biases))
    return ids, jnp.asarray(biases, jnp.float32)
  raise ValueError(f"logit_bias must be {_BIAS_FORMS}; got {value!r}")


_WORDS_FORMS = ("a list of token-id sequences (the same for every row), a list of B such lists "
                "(one per row; None for none), or an int array [K, M] / [B, K, M] of sequences "
                "padded with -1 at their end")


def _word_list(words, row: int | None) -> list[list[int]]:
  where = "" if row is None else f" (row {row})"
  if not _is_sequence(words):
    raise ValueError(f"bad_words must be {_WORDS_FORMS}; got {words!r}{where}")
  out = []
  for word in words:
    if not _is_sequence(word) or len(word) == 0:
      raise ValueError(f"bad_words must hold non-empty sequences of token ids; got "
                       f"{word!r}{where}")
    out.append(_id_list("bad_words", list(word), row))
  return out


def _convert_words(value) -> np.ndarray | jax.Array:
  """bad_words -> int32 [K, M] or [B, K, M]: K sequences of at most M ids, each padded with -1
  at its end (a NumPy array when built here from lists, for `_place`)."""
  if value is None:
    return np.full((_MIN_WIDTH, _MIN_WIDTH), -1, np.int32)
  if isinstance(value, (jax.Array, np.ndarray)):
    if jnp.ndim(value) not in (2, 3) or not jnp.issubdtype(jnp.result_type(value), jnp.integer):
      raise ValueError(f"bad_words must be {_WORDS_FORMS}; got an array of shape "
                       f"{jnp.shape(value)} and dtype {jnp.result_type(value)}")
    if _is_concrete(value):
      host = np.asarray(value)
      if np.any(host < -1) or np.any(host > _INT32_MAX):
        raise ValueError("bad_words must hold token ids in [0, 2**31) (and -1 for padding); got "
                         f"{int(host[(host < -1) | (host > _INT32_MAX)][0])}")
      valid = host >= 0
      if np.any(valid[..., 1:] & ~valid[..., :-1]):
        raise ValueError("bad_words sequences must be padded with -1 at their end only; got a "
                         "token id after a -1")
    return jnp.asarray(value, jnp.int32)
  if not _is_sequence(value):
    raise ValueError(f"bad_words must be {_WORDS_FORMS}; got {value!r}")
  items = list(value)
  if all(_is_sequence(w) and len(w) > 0 and all(_is_int(i) for i in w) for w in items):
    rows, shared = [_word_list(items, None)], True
  elif all(r is None or _is_sequence(r) for r in items):
    rows, shared = [_word_list([] if r is None else list(r), b) for b, r in enumerate(items)], False
  else:
    raise ValueError(f"bad_words must be {_WORDS_FORMS}; got {value!r}")
  count = max([len(r) for r in rows] + [1])
  length = max([len(w) for r in rows for w in r] + [1])
  out = np.full((len(rows), _width(count), _width(length)), -1, np.int32)
  for b, r in enumerate(rows):
    for k, word in enumerate(r):
      out[b, k, :len(word)] = word
  return out[0] if shared else out


# ---------------------------------------------------------------------------------------------
# The field families: each checks and converts its concrete values (`check`, for the
# constructor) and maps traced values onto the allowed ranges (`sanitize`, for
# `SamplingParams.sanitized`). The rules `sanitized` documents are these.


def _numbers(values: dict, names: tuple[str, ...]) -> dict:
  """The number fields `names` of `values`, converted and validated by their `_Field`."""
  return {name: _convert(_BY_NAME[name], values[name]) for name in names}


def _disabled_if_nan(v, off, lo, hi):
  return jnp.where(jnp.isnan(v), off, jnp.clip(v, lo, hi))


def _finite(v):
  return _disabled_if_nan(v, 0.0, -_F32_MAX, _F32_MAX)


_TEMPERATURES = ("temperature", "dynatemp_range", "dynatemp_exponent")


def _check_temperatures(values: dict) -> dict:
  """temperature (a finite number >= 0, 0 greedy) and dynamic temperature's range and exponent
  (finite, >= 0)."""
  return _numbers(values, _TEMPERATURES)


def _sanitize_temperatures(p) -> dict:
  return dict(
      temperature=jnp.where(p.temperature > 0, p.temperature, 0.0),  # NaN > 0 is False
      dynatemp_range=_disabled_if_nan(p.dynatemp_range, 0.0, 0.0, _F32_MAX),
      dynatemp_exponent=_disabled_if_nan(p.dynatemp_exponent, 1.0, 0.0, _F32_MAX))


_TRUNCATIONS = ("top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                "top_n_sigma")


def _check_truncations(values: dict) -> dict:
  """The kept-set rules: top-k (an integer >= 0), top-p and typical-p (in (0, 1]), min-p (in
  [0, 1]), epsilon and eta (in [0, 1)), top-nσ (finite)."""
  return _numbers(values, _TRUNCATIONS)


def _sanitize_truncations(p) -> dict:
  return dict(
      top_k=jnp.maximum(p.top_k, 0),
      top_p=_disabled_if_nan(p.top_p, 1.0, 0.0, 1.0),
      min_p=_disabled_if_nan(p.min_p, 0.0, 0.0, 1.0),
      typical_p=_disabled_if_nan(p.typical_p, 1.0, 0.0, 1.0),
      epsilon_cutoff=_disabled_if_nan(p.epsilon_cutoff, 0.0, 0.0, 1.0),
      eta_cutoff=_disabled_if_nan(p.eta_cutoff, 0.0, 0.0, 1.0),
      top_n_sigma=_finite(p.top_n_sigma))


def _check_penalties(values: dict) -> dict:
  """The count penalties: repetition (finite, > 0), presence and frequency (finite)."""
  return _numbers(values, _PENALTIES)


def _sanitize_penalties(p) -> dict:
  rp = p.repetition_penalty
  return dict(repetition_penalty=jnp.where((rp > 0) & jnp.isfinite(rp), rp, 1.0),
              presence_penalty=_finite(p.presence_penalty),
              frequency_penalty=_finite(p.frequency_penalty))


def _check_lengths(values: dict) -> dict:
  """min_new_tokens: an integer >= 0."""
  return _numbers(values, ("min_new_tokens",))


def _sanitize_lengths(p) -> dict:
  return dict(min_new_tokens=jnp.maximum(p.min_new_tokens, 0))


_SAMPLERS = ("xtc_threshold", "xtc_probability", "dry_multiplier", "dry_base",
             "dry_allowed_length", "dry_penalty_last_n", "mirostat", "mirostat_tau",
             "mirostat_eta")


def _check_samplers(values: dict) -> dict:
  """The samplers beyond transformers: XTC (threshold and probability in [0, 1]), DRY (its
  numbers, and its sequence breakers as token ids) and mirostat (0 or 2; tau, eta >= 0)."""
  out = _numbers(values, _SAMPLERS)
  out["dry_sequence_breakers"] = _convert_ids("dry_sequence_breakers",
                                              values["dry_sequence_breakers"])
  return out


def _sanitize_samplers(p) -> dict:
  return dict(
      xtc_threshold=_disabled_if_nan(p.xtc_threshold, 1.0, 0.0, 1.0),
      xtc_probability=_disabled_if_nan(p.xtc_probability, 0.0, 0.0, 1.0),
      dry_multiplier=_disabled_if_nan(p.dry_multiplier, 0.0, 0.0, _F32_MAX),
      dry_base=_disabled_if_nan(p.dry_base, 1.0, 1.0, _F32_MAX),
      dry_allowed_length=jnp.maximum(p.dry_allowed_length, 1),
      dry_penalty_last_n=jnp.maximum(p.dry_penalty_last_n, -1),
      mirostat=jnp.where(p.mirostat == 2, p.mirostat, 0),
      mirostat_tau=_disabled_if_nan(p.mirostat_tau, 5.0, 0.0, _F32_MAX),
      mirostat_eta=_disabled_if_nan(p.mirostat_eta, 0.1, 0.0, _F32_MAX))


def _check_token_sets(values: dict) -> dict:
  """The bias and the bans: logit_bias ({id: bias} forms), banned and allowed token ids, bad
  words (token-id sequences) and the n-gram ban's size (an integer >= 0)."""
  out = {"logit_bias": _convert_bias(values["logit_bias"]),
         "banned_token_ids": _convert_ids("banned_token_ids", values["banned_token_ids"]),
         "allowed_token_ids": _convert_ids("allowed_token_ids", values["allowed_token_ids"]),
         "bad_words": _convert_words(values["bad_words"])}
  out.update(_numbers(values, ("no_repeat_ngram_size",)))
  return out


def _sanitize_token_sets(p) -> dict:
  ids, biases = p.logit_bias
  return dict(logit_bias=(ids, _finite(biases)),
              no_repeat_ngram_size=jnp.maximum(p.no_repeat_ngram_size, 0))


@dataclasses.dataclass(frozen=True)
class _Family:
  check: Callable[[dict], dict]  # the given values -> the family's fields, converted
  sanitize: Callable[[Any], dict]  # params -> the family's fields, sanitized


# In the order their values are checked (the first bad value raises).
_FAMILIES = (_Family(_check_temperatures, _sanitize_temperatures),
             _Family(_check_truncations, _sanitize_truncations),
             _Family(_check_penalties, _sanitize_penalties),
             _Family(_check_lengths, _sanitize_lengths),
             _Family(_check_samplers, _sanitize_samplers),
             _Family(_check_token_sets, _sanitize_token_sets))


# ---------------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, init=False, eq=False)  # `==` is identity: fields are arrays
class SamplingParams:
  """Per-row sampling settings (the processing order is that of `jaxdecode.process_logits`).

  Number fields are a scalar (shared by all rows) or a `[B]` array (one value per row). Token
  fields are given as lists/dicts (see each one) or as -1-padded int arrays `[K]` or `[B, K]`.

  Attributes:
    temperature: divides the logits; 0 means greedy (argmax, ties to the lowest index).
    top_k: keep the tokens that have fewer than `top_k` strictly larger logits; 0 disables.
    top_p: keep the tokens whose strictly-more-probable mass is < `top_p`; 1 disables.
    min_p: keep the tokens with probability >= `min_p` * the largest probability; 0 disables.
    repetition_penalty: HF's rule for tokens seen so far: a positive logit is divided by it, a
      negative one multiplied; 1 disables. Needs token counts (`decode` carries them).
    presence_penalty: subtracted once from the logit of every token seen so far (OpenAI/vLLM).
    frequency_penalty: subtracted from a token's logit once per time it was seen (OpenAI/vLLM).
    typical_p: keep the tokens whose strictly-more-typical mass is < `typical_p`, typicality
      being |-log p_i - H| (locally typical sampling); 1 disables.
    epsilon_cutoff: keep the tokens with p_i >= epsilon_cutoff, and the most probable; 0
      disables.
    eta_cutoff: keep the tokens with p_i >= min(eta, sqrt(eta) * exp(-H)), and the most
      probable; 0 disables.
    min_new_tokens: `decode` masks its EOS ids until a row has this many new tokens; 0 disables.
    top_n_sigma: top-nσ (llama.cpp): keep the tokens whose logit is >= max - n·σ, σ the
      standard deviation of the row's finite logits; <= 0 disables.
    xtc_threshold, xtc_probability: XTC (exclude top choices, llama.cpp): with probability
      `xtc_probability` per row and step, when at least two tokens have p >= `xtc_threshold`,
      remove all of them but the least probable. probability 0 (the default) or threshold
      > 0.5 disables.
    dynatemp_range, dynatemp_exponent: dynamic temperature (llama.cpp): a row's temperature
      becomes T_min + (T_max - T_min)·(H / log N)^exponent with T_min = max(0, T - range),
      T_max = T + range, H the entropy and N the selectable tokens of the row at that point of
      the chain; range 0 (the default) disables; temperature-0 rows stay greedy.
    dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n, dry_sequence_breakers:
      DRY ("don't repeat yourself", llama.cpp): a token that would extend a repeat of the row's
      last tokens of length n >= dry_allowed_length (within its last dry_penalty_last_n tokens;
      -1: all) has dry_multiplier · dry_base^(n - dry_allowed_length) subtracted from its logit,
      the exponent capped as llama.cpp caps it. A match stops at a sequence breaker (token
      ids, like banned_token_ids), and a breaker is never penalized. multiplier 0 (the
      default) disables. Needs the row's history (`decode` has it).
    mirostat, mirostat_tau, mirostat_eta: mirostat 2 (llama.cpp): with mirostat=2 a row keeps
      the tokens of surprise -log2 p <= mu (at least its most probable), mu a state the loops
      carry per row (initially 2·tau), updated after each token by mu -= eta·(s - tau), s the
      token's surprise under the kept set. Only the loops carry mu (`decode`, speculative
      decoding, `generate`, `stream`); beam search refuses it. 0 (the default) disables.
    no_repeat_ngram_size: ban every token that would complete an n-gram the row already holds
      (transformers); 0 disables. Needs the row's history (`decode` has it).
    bad_words: token-id sequences, each banned where the row's last tokens equal it without its
      last token (transformers' bad_words_ids, vLLM's bad_words): a list of sequences, or a
      list of B such lists. A one-token sequence is always banned.
    logit_bias: `(ids, biases)`: added to the logits of those tokens (a dict `{id: bias}` or a
      list of B dicts when building). Duplicate ids in the array form add up.
    banned_token_ids: tokens that are never selected (a list of ids, or a list of B lists).
    allowed_token_ids: when a row has any, only those tokens can be selected; a row without
      ids is unrestricted.

  Leaves have mixed shapes (scalars, `[B]`, token fields `[K]` or `[B, K]`), so call
  `broadcast(B)` before mapping over rows with `jax.tree.map` or sharding the params over a mesh:
  after it every leaf has the batch as its first axis. `rows(idx)` selects, reorders or slices
  rows directly (shared values stay shared).

  Examples:
    >>> import jaxdecode
    >>> p = jaxdecode.SamplingParams(temperature=0.7, top_p=0.9)
    >>> float(p.top_p)
    0.8999999761581421
    >>> jaxdecode.SamplingParams(banned_token_ids=[[3], [4, 5]]).banned_token_ids.shape
    (2, 8)
    >>> jaxdecode.SamplingParams(top_p=0.0)
    Traceback (most recent call last):
    ...
    ValueError: top_p must be a number with 0 < top_p <= 1 (1 disables top-p); got 0.0
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  repetition_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array
  typical_p: jax.Array
  epsilon_cutoff: jax.Array
  eta_cutoff: jax.Array
  min_new_tokens: jax.Array
  logit_bias: tuple  # (int32 ids, float32 biases), [K] or [B, K]
  banned_token_ids: jax.Array
  allowed_token_ids: jax.Array
  top_n_sigma: jax.Array
  xtc_threshold: jax.Array
  xtc_probability: jax.Array
  dynatemp_range: jax.Array
  dynatemp_exponent: jax.Array
  dry_multiplier: jax.Array
  dry_base: jax.Array
  dry_allowed_length: jax.Array
  dry_penalty_last_n: jax.Array
  mirostat: jax.Array
  mirostat_tau: jax.Array
  mirostat_eta: jax.Array
  no_repeat_ngram_size: jax.Array
  dry_sequence_breakers: jax.Array
  bad_words: jax.Array  # int32 [K, M] or [B, K, M], each sequence padded with -1 at its end

  def __init__(self, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, *,
               repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
               typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, min_new_tokens=0,
               logit_bias=None, banned_token_ids=None, allowed_token_ids=None,
               top_n_sigma=0.0, xtc_threshold=0.1, xtc_probability=0.0,
               dynatemp_range=0.0, dynatemp_exponent=1.0, dry_multiplier=0.0, dry_base=1.75,
               dry_allowed_length=2, dry_penalty_last_n=-1, dry_sequence_breakers=None,
               mirostat=0, mirostat_tau=5.0, mirostat_eta=0.1, no_repeat_ngram_size=0,
               bad_words=None):
    values = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                  frequency_penalty=frequency_penalty, typical_p=typical_p,
                  epsilon_cutoff=epsilon_cutoff, eta_cutoff=eta_cutoff,
                  min_new_tokens=min_new_tokens, top_n_sigma=top_n_sigma,
                  xtc_threshold=xtc_threshold, xtc_probability=xtc_probability,
                  dynatemp_range=dynatemp_range, dynatemp_exponent=dynatemp_exponent,
                  dry_multiplier=dry_multiplier, dry_base=dry_base,
                  dry_allowed_length=dry_allowed_length, dry_penalty_last_n=dry_penalty_last_n,
                  mirostat=mirostat, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                  no_repeat_ngram_size=no_repeat_ngram_size)
    values.update(logit_bias=logit_bias, banned_token_ids=banned_token_ids,
                  allowed_token_ids=allowed_token_ids,
                  dry_sequence_breakers=dry_sequence_breakers, bad_words=bad_words)
    converted = {}
    for family in _FAMILIES:  # each checks and converts its own fields
      converted.update(family.check(values))
    # Every check has passed: now the host arrays go to the device, all in one call.
    for name, value in _place(converted).items():
      object.__setattr__(self, name, value)
    host = [converted[n] for n in _NAMES]
    if all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(host)):
      # The values were all given here (no jax array): `_host` is what a transfer back gives.
      self.__dict__["_host"] = SamplingParams.tree_unflatten(None, _read_only(host))

  # Pytree protocol. Unflattening bypasses __init__: JAX rebuilds the object from tracers or
  # from placeholder leaves (e.g. vmap's in_axes), which must not be converted or validated.
  def tree_flatten(self):
    return tuple(getattr(self, n) for n in _NAMES), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    obj = object.__new__(cls)
    for name, child in zip(_NAMES, children):
      object.__setattr__(obj, name, child)
    return obj

  def _with(self, **changes) -> "SamplingParams":
    """A copy with fields replaced as they are (no conversion or validation)."""
    children = [changes.get(n, getattr(self, n)) for n in _NAMES]
    return SamplingParams.tree_unflatten(None, children)

  def replace(self, **changes) -> "SamplingParams":
    """Returns a copy with some fields changed (validated like the constructor)."""
    unknown = set(changes) - set(_NAMES)
    if unknown:
      raise ValueError(f"unknown SamplingParams field(s) {sorted(unknown)}; fields are {_NAMES}")
    values = {n: getattr(self, n) for n in _NAMES}
    values.update(changes)
    return SamplingParams(**values)

  def broadcast(self, batch_size: int, vocab_size: int | None = None) -> "SamplingParams":
    """Returns the params with every number field `[batch_size]`, every token field `[B, K]`.

    Args:
      batch_size: B, the rows of the logits.
      vocab_size: V; when given, concrete token ids are checked to lie in `[0, V)`, and no row
        may ban every token it allows (every token of `[0, V)` when it has no allowed ids).

    Raises:
      ValueError: if a per-row field's length is not `batch_size`, or a token id is out of range.

    When every leaf is a concrete jax array (always so for params built by the constructor:
    jax arrays cannot change), the checked, broadcast result is kept on this object for its last
    `BROADCAST_CACHE_SIZE` pairs `(batch_size, vocab_size)` and returned again: the checks
    depend on nothing else, so a repeated eager call skips them and the broadcast dispatch.
    Params holding NumPy arrays (mutable) or tracers are checked and broadcast on every call.
    """
    children = tuple(getattr(self, n) for n in _NAMES)
    cache_key = (batch_size, vocab_size)
    entry = self.__dict__.get("_broadcasts", {}).get(cache_key)
    if entry is not None:
      seen, out, out_leaves = entry
      # The same leaf objects as when it was checked (a field swapped with object.__setattr__
      # misses), and none of the result's buffers deleted or donated since.
      if all(a is b for a, b in zip(seen, children)) and \
          not any(leaf.is_deleted() for leaf in out_leaves):
        return out
    out = self._broadcast_checked(batch_size, vocab_size)
    out_leaves = jax.tree.leaves(out)
    if self._frozen and all(_is_frozen_array(leaf) for leaf in out_leaves):
      # Replaced whole (never edited in place), so a concurrent reader sees an old or a new dict.
      kept = [(k, e) for k, e in self.__dict__.get("_broadcasts", {}).items() if k != cache_key]
      kept = kept[max(0, len(kept) - BROADCAST_CACHE_SIZE + 1):]
      self.__dict__["_broadcasts"] = dict(kept + [(cache_key, (children, out, out_leaves))])
    return out

  def _broadcast_checked(self, batch_size: int, vocab_size: int | None) -> "SamplingParams":
    """`broadcast` without its cache: every check, then one jitted broadcast."""
    host = _check_batch(self, batch_size, vocab_size)
    # One jitted call instead of one dispatch per field.
    out = _broadcast_leaves(self, batch_size)
    if host is not None and self._frozen and _is_frozen_array(out.temperature):
      # The host copy of the result, from this one's without a transfer (the values of frozen
      # leaves cannot change between the two).
      out.__dict__["_host"] = _broadcast_host(host, batch_size)
    return out

  @functools.cached_property
  def _frozen(self) -> bool:
    """True when every leaf is a concrete jax array: values that cannot change, so what is
    derived from them (checks, broadcasts, host copies) can be kept on this object."""
    return all(_is_frozen_array(leaf) for leaf in jax.tree.leaves(self))

  @functools.cached_property
  def _host(self) -> "SamplingParams | None":
    """A numpy copy of every leaf (one transfer, cached on this object); None when traced."""
    if not all(_is_concrete(leaf) for leaf in jax.tree.leaves(self)):
      return None
    return jax.device_get(self)

  def sanitized(self) -> "SamplingParams":
    """Maps any value, valid or not, onto the allowed ranges; valid values are unchanged.

    Concrete values were already checked in the constructor, so this only matters for values
    traced under `jit`, which cannot raise. The rules (documented and tested):

    - temperature NaN or < 0 -> 0 (greedy); +inf stays +inf (uniform over the finite logits);
    - top_k < 0 -> 0 (disabled); min_new_tokens < 0 -> 0 (disabled);
    - top_p and typical_p: NaN -> 1 (disabled); <= 0 -> only the most probable (most typical)
      token(s); > 1 -> 1;
    - min_p NaN -> 0 (disabled); clipped to [0, 1];
    - epsilon_cutoff and eta_cutoff: NaN -> 0 (disabled); clipped to [0, 1] (epsilon 1 keeps
      only the most probable token(s); eta 1 cuts at exp(-H));
    - repetition_penalty: NaN, <= 0 or +inf -> 1 (disabled);
    - presence_penalty, frequency_penalty and logit biases: NaN -> 0; clipped to the finite
      float32 range (a bias of -inf acts as a very large negative one);
    - token ids outside `[0, V)` (-1 is padding) are ignored;
    - top_n_sigma: NaN -> 0 (disabled); clipped to the finite float32 range;
    - xtc_threshold: NaN -> 1 (disabled), clipped to [0, 1]; xtc_probability: NaN -> 0
      (disabled), clipped to [0, 1];
    - dynatemp_range: NaN or < 0 -> 0 (disabled), +inf -> the largest float32;
      dynatemp_exponent: NaN -> 1, clipped to [0, the largest float32];
    - dry_multiplier: NaN or < 0 -> 0 (disabled), clipped to the finite float32 range;
      dry_base: NaN or < 1 -> 1, +inf -> the largest float32; dry_allowed_length < 1 -> 1;
      dry_penalty_last_n < -1 -> -1;
    - mirostat other than 2 -> 0 (disabled); mirostat_tau and mirostat_eta: NaN -> their
      defaults (5, 0.1), clipped to [0, the largest float32];
    - no_repeat_ngram_size: < 0 -> 0 (disabled).
    """
    changes = {}
    for family in _FAMILIES:  # each maps its own fields
      changes.update(family.sanitize(self))
    return self._with(**changes)

  def rows(self, index) -> "SamplingParams":
    """The params of some rows: `index` is anything that indexes a `[B]` axis (an int array to
    gather or permute, a slice, a boolean mask). Per-row leaves are indexed; shared leaves
    (scalars, token fields of shape `[K]`) stay shared.

    Examples:
      >>> import jax.numpy as jnp, jaxdecode
      >>> p = jaxdecode.SamplingParams(temperature=jnp.array([0.0, 0.5, 1.0]), top_p=0.9)
      >>> q = p.rows(jnp.array([2, 0]))
      >>> q.temperature.tolist(), float(q.top_p) == float(p.top_p)
      ([1.0, 0.0], True)
    """
    def select(leaf, per_row_rank):
      return leaf[index] if leaf.ndim == per_row_rank else leaf
    ids, biases = self.logit_bias
    number = {n: select(getattr(self, n), 1) for n in _NUMBER_NAMES}
    return self._with(**number, logit_bias=(select(ids, 2), select(biases, 2)),
                      banned_token_ids=select(self.banned_token_ids, 2),
                      allowed_token_ids=select(self.allowed_token_ids, 2),
                      dry_sequence_breakers=select(self.dry_sequence_breakers, 2),
                      bad_words=select(self.bad_words, 3))

  def has_penalty(self) -> bool:
    """True if a concrete penalty is active on some row (the call then needs token counts)."""
    return (self._summary if self._frozen else self._summarize())[0]

  def largest_min_new_tokens(self) -> int:
    """The largest concrete `min_new_tokens` (0 when none is set or the values are traced)."""
    return (self._summary if self._frozen else self._summarize())[1]

  def reads_history(self) -> bool:
    """True if a concrete rule reads the row's earlier tokens (`no_repeat_ngram_size`, DRY, or
    a `bad_words` sequence of two tokens or more): the call then needs the row's history."""
    return (self._summary if self._frozen else self._summarize())[2]

  def uses_mirostat(self) -> bool:
    """True if a concrete row sets mirostat (its state mu lives in the loops)."""
    host = self._host
    return host is not None and bool(np.any(np.asarray(host.mirostat) != 0))

  def draws_xtc(self) -> bool:
    """True if a concrete row applies XTC by chance (0 < xtc_probability < 1 and
    xtc_threshold <= 0.5): the call then needs a key."""
    return (self._summary if self._frozen else self._summarize())[3]

  @functools.cached_property
  def _summary(self) -> tuple[bool, int, bool, bool]:
    """`_summarize()` kept on the object; only read when the leaves cannot change (`_frozen`)."""
    return self._summarize()

  def _summarize(self) -> tuple[bool, int, bool, bool]:
    """(has_penalty, largest_min_new_tokens, reads_history, draws_xtc) from the host copy of
    the leaves."""
    host = self._host
    if host is None:
      return False, 0, False, False
    words = np.asarray(host.bad_words)
    xtc = np.broadcast_arrays(host.xtc_probability, host.xtc_threshold)
    return (bool(np.any(host.repetition_penalty != 1) or np.any(host.presence_penalty != 0) or
                 np.any(host.frequency_penalty != 0)), int(np.max(host.min_new_tokens)),
            bool(np.any(host.no_repeat_ngram_size > 0) or np.any(words[..., 1] >= 0) or
                 np.any((np.asarray(host.dry_multiplier) != 0) &
                        (np.asarray(host.dry_penalty_last_n) != 0))),
            bool(np.any((xtc[0] > 0) & (xtc[0] < 1) & (xtc[1] <= 0.5))))


def _check_batch(params: "SamplingParams", batch_size: int,
                 vocab_size: int | None) -> "SamplingParams | None":
  """ValueError unless every field fits a batch of `batch_size` rows and, when `vocab_size` is
  given, every concrete token id is below it and no row bans every token it allows. Returns the
  params' host copy (None when traced)."""
  for name in _NUMBER_NAMES:
    shape = jnp.shape(getattr(params, name))
    if shape not in ((), (batch_size,)):
      raise ValueError(f"SamplingParams.{name} has shape {shape} but the batch has "
                       f"{batch_size} rows; expected a scalar or shape ({batch_size},)")
  token_fields = {"logit_bias": params.logit_bias[0],
                  "banned_token_ids": params.banned_token_ids,
                  "allowed_token_ids": params.allowed_token_ids,
                  "dry_sequence_breakers": params.dry_sequence_breakers}
  for name, ids in token_fields.items():
    if ids.ndim == 2 and ids.shape[0] != batch_size:
      raise ValueError(f"SamplingParams.{name} has one row of ids for each of {ids.shape[0]} "
                       f"rows (shape {ids.shape}) but the batch has {batch_size} rows")
  if params.bad_words.ndim == 3 and params.bad_words.shape[0] != batch_size:
    raise ValueError(f"SamplingParams.bad_words has sequences for each of "
                     f"{params.bad_words.shape[0]} rows (shape {params.bad_words.shape}) but the "
                     f"batch has {batch_size} rows")
  host = params._host  # pylint: disable=protected-access
  if vocab_size is not None and host is not None:
    for name in list(token_fields) + ["bad_words"]:
      ids = np.asarray(host.logit_bias[0] if name == "logit_bias" else getattr(host, name))
      if np.any(ids >= vocab_size):
        raise ValueError(f"SamplingParams.{name} has token id "
                         f"{int(ids[ids >= vocab_size][0])}, outside the vocabulary of the "
                         f"logits [0, {vocab_size})")
    _check_allowed_not_all_banned(host.banned_token_ids, host.allowed_token_ids, vocab_size)
  return host


def _broadcast_with(xp, params: SamplingParams, batch: int) -> SamplingParams:
  """Every number field [B], every token field [B, K], with `xp` (jnp on the device, np on a
  host copy: read-only views, no copy)."""
  def rows(v):  # a token field: [K] or [B, K] -> [B, K]
    return xp.broadcast_to(v, (batch, v.shape[-1]))
  number = {n: xp.broadcast_to(getattr(params, n), (batch,)) for n in _NUMBER_NAMES}
  ids, biases = params.logit_bias
  words = params.bad_words
  return params._with(**number, logit_bias=(rows(ids), rows(biases)),  # pylint: disable=protected-access
                      banned_token_ids=rows(params.banned_token_ids),
                      allowed_token_ids=rows(params.allowed_token_ids),
                      dry_sequence_breakers=rows(params.dry_sequence_breakers),
                      bad_words=xp.broadcast_to(words, (batch,) + words.shape[-2:]))


_broadcast_leaves = jax.jit(functools.partial(_broadcast_with, jnp), static_argnums=1)


def _read_only(tree):
  """The NumPy arrays of `tree`, each marked read-only (a host copy is never written)."""
  def freeze(leaf):
    leaf.flags.writeable = False
    return leaf
  return jax.tree.map(freeze, tree)


def _broadcast_host(host: SamplingParams, batch: int) -> SamplingParams:
  """`_broadcast_leaves` on the host copy, with NumPy."""
  return _broadcast_with(np, host, batch)


def _check_allowed_not_all_banned(banned: np.ndarray, allowed: np.ndarray, vocab: int) -> None:
  """Raises ValueError if a row bans every token it allows: the ids of its allowed_token_ids,
  or the whole vocabulary `[0, vocab)` when it has none (host arrays of ids in [-1, vocab))."""
  if not np.any(banned >= 0) or (banned.shape[-1] < vocab and not np.any(allowed >= 0)):
    return
  rows = max(banned.shape[0] if banned.ndim == 2 else 1, allowed.shape[0] if allowed.ndim == 2
             else 1)
  banned = np.broadcast_to(banned, (rows, banned.shape[-1]))
  allowed = np.broadcast_to(allowed, (rows, allowed.shape[-1]))
  for b in range(rows):
    ok = set(allowed[b][allowed[b] >= 0].tolist())
    if ok and ok <= set(banned[b].tolist()):
      raise ValueError(f"row {b} bans every token it allows ({sorted(ok)}): nothing could be "
                       f"selected; remove some from banned_token_ids or allow more")
    if not ok and np.unique(banned[b][banned[b] >= 0]).size == vocab:
      raise ValueError(f"row {b} bans every token of the vocabulary [0, {vocab}): nothing could "
                       f"be selected; remove some from banned_token_ids")


def check_eos_not_forced(params: SamplingParams, eos_ids, vocab: int) -> None:
  """Raises ValueError if a row with `min_new_tokens` > 0 can select nothing but EOS ids.

  The loops mask the EOS ids until a row has `min_new_tokens` new tokens; a row whose allowed
  tokens (the whole vocabulary without allowed_token_ids) less its banned ones are all EOS ids
  would have nothing to select then (the sampler would return token 0 with a NaN
  log-probability). Concrete values only: traced params or ids are not checked.

  Args:
    params: `SamplingParams` whose token ids were checked against the vocabulary.
    eos_ids: the loop's EOS ids.
    vocab: V.
  """
  host = params._host  # pylint: disable=protected-access
  if host is None or not _is_concrete(eos_ids) or not np.any(host.min_new_tokens > 0):
    return
  eos = np.asarray(eos_ids).reshape(-1)
  eos = set(eos[(eos >= 0) & (eos < vocab)].tolist())
  allowed, banned = np.asarray(host.allowed_token_ids), np.asarray(host.banned_token_ids)
  if not eos or (not np.any(allowed >= 0) and banned.shape[-1] + len(eos) < vocab):
    return  # every row has a token that is not an EOS id
  min_new = np.asarray(host.min_new_tokens)
  rows = max(allowed.shape[0] if allowed.ndim == 2 else 1,
             banned.shape[0] if banned.ndim == 2 else 1, min_new.size)
  allowed = np.broadcast_to(allowed, (rows, allowed.shape[-1]))
  banned = np.broadcast_to(banned, (rows, banned.shape[-1]))
  min_new = np.broadcast_to(min_new, (rows,))
  for b in np.flatnonzero(min_new > 0):
    left = set(allowed[b][allowed[b] >= 0].tolist()) or set(range(vocab))
    left -= set(banned[b].tolist())
    if left and left <= eos:
      raise ValueError(f"row {b} can select only EOS ids ({sorted(left)}), which "
                       f"min_new_tokens={min_new[b]} masks for its first {min_new[b]} tokens: "
                       f"nothing could be selected; allow other tokens or lower min_new_tokens")




def as_field(name: str, value) -> jax.Array:
  """Converts and validates one value as the SamplingParams field `name` (for the processors)."""
  return _place(_convert(_BY_NAME[name], value))
