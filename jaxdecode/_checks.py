"""Argument checks, in one place: each raises `ValueError` naming the argument, its value and
what is allowed, before anything is traced or compiled.

Values that are only known under `jit` (tracers) cannot be checked; the functions here let them
through, and the code that uses them masks or sanitizes them by a documented rule.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Hashable
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_INT32 = np.iinfo(np.int32)
# Key data words per PRNG implementation (`jax.random.key_impl`), for naming a foreign legacy key.
_LEGACY_KEY_SIZES = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}


def is_traced(x) -> bool:
  """True for a value only known under a transformation (a tracer)."""
  return isinstance(x, jax.core.Tracer)


def dtype_of(x):
  """`jnp.result_type(x)`, read directly from a jax array (or tracer), whose dtype is already
  canonical: the checks run on every eager call, and `result_type` costs ~10 us."""
  return x.dtype if isinstance(x, jax.Array) else jnp.result_type(x)


# A seed becomes `jax.random.key(seed)`, whose key data holds 32 bits without jax's 64-bit mode:
# seeds 2**32 and 0 (or -1 and 2**32 - 1) would give the same key, so only [0, 2**32) is allowed.
MAX_SEED = 2**32 - 1


def integer(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
  """A Python int in [low, high] (either bound optional); booleans are refused.

  Examples:
    >>> integer("max_new_tokens", 5, low=1)
    5
    >>> integer("max_new_tokens", True, low=1)
    Traceback (most recent call last):
    ...
    ValueError: max_new_tokens must be an integer >= 1; got True
  """
  words = ("an integer" + (f" in [{low}, {high}]" if low is not None and high is not None else
                           f" >= {low}" if low is not None else
                           f" <= {high}" if high is not None else ""))
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{name} must be {words}; got {value!r}")
  value = int(value)
  if (low is not None and value < low) or (high is not None and value > high):
    raise ValueError(f"{name} must be {words}; got {value!r}")
  return value


MAX_NEW_TOKENS = 2**30  # positions + steps stay inside int32, with room for the prompt


def host_memory_bytes() -> int:
  """The memory of the default device: its `bytes_limit` where the backend reports one (GPU,
  TPU), else this machine's physical memory (CPU)."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  # a backend without memory_stats
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  try:
    import os  # pylint: disable=import-outside-toplevel
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):  # not a POSIX system: no foreseeable bound
    return 2**62


def max_new_tokens(value, rows: int, *, bytes_per_token: int = 8, caller: str = "decode") -> int:
  """`max_new_tokens` of a loop: an int in [1, 2**30] whose output buffers (`rows` rows of
  `bytes_per_token` bytes per token: tokens and log-probabilities) fit the device's memory.

  Refused before anything is allocated, with the estimate: a loop's outputs are [B, N] arrays
  created up front, so N = 10**8 would otherwise try to allocate them and fail (or swap) late.
  """
  value = integer("max_new_tokens", value, low=1, high=MAX_NEW_TOKENS)
  need = rows * value * bytes_per_token
  memory = host_memory_bytes()
  if need > memory // 2:
    raise ValueError(f"{caller}: max_new_tokens={value} needs output buffers of {rows} rows x "
                     f"{value} tokens x {bytes_per_token} bytes = {need / 2**30:.1f} GiB, more "
                     f"than half of the device's {memory / 2**30:.1f} GiB; ask for fewer tokens "
                     f"(or decode in several calls)")
  return value


def boolean(name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False; got {value!r}")
  return bool(value)


def real(name: str, value):
  """A finite real number as a Python float (a traced scalar is returned as it is).

  Examples:
    >>> real("length_penalty", 2)
    2.0
    >>> real("length_penalty", float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: length_penalty must be a finite number; got nan
  """
  if is_traced(value):
    if jnp.shape(value) != ():
      raise ValueError(f"{name} must be a scalar; got shape {jnp.shape(value)}")
    return value
  if isinstance(value, (jax.Array, np.ndarray, np.generic)) and jnp.shape(value) == () \
      and (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
    value = value.item()
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
      or not np.isfinite(float(value)):
    raise ValueError(f"{name} must be a finite number; got {value!r:.80}")
  return float(value)


def early_stopping(value):
  """True, False or "never" (transformers' `early_stopping` values); 0 and 1 are refused."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, str) and value == "never":
    return value
  raise ValueError(f"early_stopping must be True, False or \"never\"; got {value!r:.80}")


def instance(name: str, value, cls: type, what: str):
  """`value` if it is a `cls`; else ValueError ("{name} must be {what}; got {type}")."""
  if not isinstance(value, cls):
    raise ValueError(f"{name} must be {what}; got {type(value).__name__}")
  return value


def array(name: str, value, what: str):
  """`value` as an array (jax arrays and tracers unchanged, anything else through numpy).

  Lists of numbers become arrays; ragged lists, strings, objects and integers too large for any
  dtype raise ValueError ("{name} must be {what}") instead of numpy's TypeError/OverflowError.
  """
  if isinstance(value, (jax.Array, np.ndarray)) or is_traced(value):
    return value
  try:
    host = np.asarray(value)
  except (TypeError, ValueError, OverflowError) as e:
    raise ValueError(f"{name} must be {what}; got {value!r:.80} ({e})") from None
  if host.dtype == object or host.dtype.kind in "USV":
    raise ValueError(f"{name} must be {what}; got {value!r:.80}")
  return host


def token_rows(name: str, value, batch: int, what: str, caller: str = "") -> jax.Array:
  """Token rows: an integer array [B, T] with B = `batch`, as int32; ValueError otherwise.

  `what` says how the rows are laid out (e.g. "each row's prompt, padded with -1"); `caller`,
  when given, names the function the value went to.
  """
  value = array(name, value, "an integer array [B, T]")
  if jnp.ndim(value) != 2 or jnp.shape(value)[0] != batch or \
      not jnp.issubdtype(jnp.result_type(value), jnp.integer):
    raise ValueError(f"{caller + ': ' if caller else ''}{name} must be an integer array of "
                     f"{batch} rows ({what}); got shape {jnp.shape(value)} and dtype "
                     f"{jnp.result_type(value)}")
  return jnp.asarray(value, jnp.int32)


def logits(value, name: str = "logits") -> tuple[int, int]:
  """Checks a floating `[B, V]` array with V >= 1; returns (B, V)."""
  value = array(name, value, "a floating-point array [B, V]")
  shape = jnp.shape(value)
  if len(shape) != 2:
    hint = " For one row use logits[None]." if len(shape) == 1 else (
        " For extra leading axes use jax.vmap." if len(shape) > 2 else "")
    raise ValueError(f"{name} must have shape [B, V] (rank 2); got shape {shape}.{hint}")
  dtype = dtype_of(value)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating-point array (float32, bfloat16, float16, ...); "
                     f"got dtype {dtype}")
  if shape[1] < 1:
    raise ValueError(f"{name} must have a vocabulary of at least one token; got shape {shape}")
  if shape[0] < 1:
    raise ValueError(f"{name} must have at least one row (B >= 1); got shape {shape}")
  return shape


def row_integers(name: str, value, batch: int, what: str = "one per row") -> jax.Array:
  """An integer array `[batch]` (e.g. positions), as int32; concrete values must fit int32."""
  value = array(name, value, f"an integer array of shape ({batch},), {what}")
  shape, dtype = jnp.shape(value), jnp.result_type(value)
  if shape != (batch,) or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape ({batch},), {what}; got shape "
                     f"{shape} and dtype {dtype}")
  if not is_traced(value):
    host = np.asarray(value)
    if host.size and (host.min() < _INT32.min or host.max() > _INT32.max):
      raise ValueError(f"{name} must fit in int32; got {host.tolist()}")
  return jnp.asarray(value, jnp.int32)


def counts(value, batch: int, vocab: int) -> jax.Array:
  """Per-row token counts: an integer array `[B, V]` of values in [0, 2**31); as int32."""
  what = (f"an integer array of shape ({batch}, {vocab}) (how often each row has seen each "
          f"token; see jaxdecode.token_counts)")
  value = array("counts", value, what)
  shape, dtype = jnp.shape(value), jnp.result_type(value)
  if shape != (batch, vocab) or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"counts must be {what}; got shape {shape} and dtype {dtype}")
  if not is_traced(value):
    host = np.asarray(value)
    if host.size and (host.min() < 0 or host.max() > _INT32.max):
      raise ValueError(f"counts must be in [0, {_INT32.max}] (int32); got values from "
                       f"{host.min()} to {host.max()}")
  return jnp.asarray(value, jnp.int32)


def token_ids(name: str, ids, vocab: int, *, many: bool) -> jax.Array:
  """Token ids in [0, vocab): a list / 1-D array (`many`) or one id; returned as int32.

  Traced ids are returned unchecked: the code that uses them drops ids outside [0, vocab).
  """
  if is_traced(ids):
    return jnp.asarray(ids, jnp.int32)
  what = "a list of token ids" if many else "one token id"
  if isinstance(ids, (bool, np.bool_)):
    raise ValueError(f"{name} must be {what}; got {ids!r}")
  host = array(name, ids, what)
  host = np.asarray(host)
  if host.ndim not in ((0, 1) if many else (0,)):
    raise ValueError(f"{name} must be {what}; got {ids!r:.80}")
  if host.size and not np.issubdtype(host.dtype, np.integer):
    raise ValueError(f"{name} must be integer token ids; got {ids!r:.80}")
  bad = host[(host < 0) | (host >= vocab)] if host.size else host
  if bad.size:
    raise ValueError(f"{name} must be token ids in [0, {vocab}) (the vocabulary); got "
                     f"{bad.tolist()!r}")
  return jnp.asarray(host.reshape(-1) if many else host, jnp.int32)


def token_prompts(prompts, vocab: int | None = None) -> list[list[int]]:
  """A non-empty list of non-empty token-id lists (ids in [0, vocab) when vocab is given)."""
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)) \
      or len(prompts) == 0:
    raise ValueError(f"prompts must be a non-empty list of token-id lists; got {prompts!r:.80}")
  out = []
  for i, prompt in enumerate(prompts):
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (Sequence, np.ndarray)):
      raise ValueError(f"prompts[{i}] must be a list of token ids; got {prompt!r:.80}")
    if len(prompt) == 0:
      raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    ids = []
    for token in prompt:
      if isinstance(token, (bool, np.bool_)) or not isinstance(token, numbers.Integral) \
          or token < 0 or (vocab is not None and token >= vocab) or token > _INT32.max:
        bound = f"[0, {vocab})" if vocab is not None else "[0, 2**31)"
        raise ValueError(f"prompts[{i}] must hold token ids in {bound}; got {token!r}")
      ids.append(int(token))
    out.append(ids)
  return out


def text_prompts(prompts) -> tuple[str, ...]:
  """A non-empty list of non-empty strings."""
  if isinstance(prompts, str):
    raise ValueError("prompts must be a list of strings; got one string (wrap it in a list)")
  if not isinstance(prompts, (Sequence, np.ndarray)) or len(prompts) == 0:
    raise ValueError(f"prompts must be a non-empty list of strings; got {prompts!r:.80}")
  for i, prompt in enumerate(prompts):
    if not isinstance(prompt, str) or not prompt:
      raise ValueError(f"prompts[{i}] must be a non-empty string; got {prompt!r:.80}")
  return tuple(prompts)


@functools.lru_cache(maxsize=None)  # one entry per PRNG implementation name (a handful)
def _legacy_key_size(impl: str) -> int:
  """Words of uint32 data in a legacy key of the implementation `impl` (computed abstractly:
  no device work, and the answer cannot change, so it is computed once per name)."""
  data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
  return data.shape[-1]


def key(key, batch_size: int) -> None:
  """Raises ValueError unless `key` is one key or `batch_size` keys, typed or legacy uint32."""
  shape, dtype = jnp.shape(key), dtype_of(key)
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if shape not in ((), (batch_size,)):
      raise ValueError(f"key must be one typed key (shape ()) or one per row (shape "
                       f"({batch_size},)); got shape {shape}")
    return
  if dtype != jnp.uint32:
    raise ValueError(f"key must be a jax.random.key(...) or a legacy uint32 jax.random.PRNGKey; "
                     f"got dtype {dtype} with shape {shape}")
  impl = jax.config.jax_default_prng_impl
  key_size = _legacy_key_size(impl)
  if shape not in ((key_size,), (batch_size, key_size)):
    other = [name for name, size in _LEGACY_KEY_SIZES.items()
             if name != impl and shape[-1:] == (size,) and len(shape) in (1, 2)]
    hint = (f" (uint32 data of shape {shape} may come from PRNGKey(..., impl="
            f"{' or '.join(map(repr, other))}); raw key data does not say which implementation "
            f"made it, so pass a typed key: jax.random.wrap_key_data(key, impl=...))"
            if other else "")
    raise ValueError(f"key: a legacy uint32 key (jax.random.PRNGKey of the default "
                     f"implementation, {impl}) must have shape ({key_size},) for one key or "
                     f"({batch_size}, {key_size}) for one per row; got shape {shape}{hint}")


def beam_size_fits(beam_size: int, batch: int, vocab: int, name: str = "beam_size") -> None:
  """Raises ValueError unless a row's K * V continuations and the B * K beams can be indexed in
  int32 (the search's candidate and row indices)."""
  limit = min(_INT32.max // vocab, _INT32.max // batch)
  if beam_size > limit:
    raise ValueError(f"{name} must be at most {limit} for {batch} row(s) and a vocabulary of "
                     f"{vocab} tokens (the K * V candidates of a row and the B * K beams are "
                     f"indexed in int32); got {beam_size}")


def beam_options(beam_size, num_return, length_penalty) -> tuple[int, int, float]:
  """Beam search's `(beam_size >= 1, num_return in [1, beam_size] (None: beam_size), finite
  length_penalty)`."""
  beam_size = integer("beam_size", beam_size, low=1)
  num_return = integer("num_return", beam_size if num_return is None else num_return, low=1)
  if num_return > beam_size:
    raise ValueError(f"num_return must be at most beam_size = {beam_size} (the search keeps "
                     f"{beam_size} hypotheses per row); got {num_return}")
  return beam_size, num_return, real("length_penalty", length_penalty)


def one_of(name: str, value, allowed: Sequence[Any]):
  """`value` if it equals one of `allowed`; unhashable values (arrays) are refused, since an
  array compares elementwise and the value may become a static argument of a jitted call."""
  if not isinstance(value, Hashable) or value not in allowed:
    raise ValueError(f"{name} must be one of {list(allowed)}; got {value!r}")
  return value


LOGPROBS_MODES = ("processed", "raw")
MAX_TOP_LOGPROBS = 20


def top_logprobs(value, vocab: int | None = None) -> int:
  """0 (no lists; None too) or an integer in [1, 20], and at most `vocab` when given: how many
  most likely tokens to list."""
  if value is None:
    return 0
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or not (
      value == 0 or 1 <= value <= MAX_TOP_LOGPROBS):
    raise ValueError(f"top_logprobs must be an integer in [1, {MAX_TOP_LOGPROBS}] (0 or None: "
                     f"no lists); got {value!r}")
  if vocab is not None and value > vocab:
    raise ValueError(f"top_logprobs must be at most the vocabulary size, {vocab}; got {value!r}")
  return int(value)


def logprobs_mode(value) -> str:
  """"processed" or "raw"."""
  return one_of("logprobs_mode", value, LOGPROBS_MODES)


def stop_strings(value) -> tuple[str, ...]:
  """None, one string or a list of non-empty strings, as a tuple (empty: no stop strings)."""
  if value is None:
    return ()
  items = [value] if isinstance(value, str) else value
  if isinstance(items, (bytes, bytearray)) or not isinstance(items, (Sequence, np.ndarray)):
    raise ValueError(f"stop must be a string or a list of strings; got {value!r:.80}")
  for i, item in enumerate(items):
    if not isinstance(item, str) or not item:
      raise ValueError(f"stop[{i}] must be a non-empty string; got {item!r:.80} (an empty stop "
                       f"string would end every row at once)")
    try:
      item.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: decoded text never holds one
      raise ValueError(f"stop[{i}] is not valid Unicode at character {e.start} "
                       f"({item[e.start:e.end]!r}), so no text could match it; give UTF-8 "
                       f"text") from None
  return tuple(items)
