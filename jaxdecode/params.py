"""`SamplingParams`: every numeric sampling setting as one pytree of traced arrays.

Each field is a scalar or an array of shape `[B]` (one value per row). The values are pytree
*leaves*, not static metadata, so a jitted sampler called with new values of the same shapes
reuses its compiled program: changing a temperature never recompiles.

Concrete values are validated when the object is built; a bad one raises `ValueError` naming the
field, the value and the allowed range. Values that are only known under `jit` (tracers) cannot be
checked there; the processors sanitize them instead, as documented in `sanitized()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


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
)
_NAMES = tuple(f.name for f in _FIELDS)


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _convert(field: _Field, value) -> jax.Array:
  """Converts one field to an int32/float32 array of rank 0 or 1, validating concrete values."""
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
                     f"pass integers, e.g. top_k=50")
  bad = ~field.ok(host.astype(np.float64))
  if np.any(bad):
    if host.ndim == 0:
      raise ValueError(f"{field.name} must be {field.allowed}; got {host.item()!r}")
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(f"{field.name} must be {field.allowed}; got {field.name}[{i}] = "
                     f"{host[i].item()!r} (in {host.tolist()!r})")
  if field.integer and np.any(host > np.iinfo(np.int32).max):
    raise ValueError(f"{field.name} must fit in int32; got {value!r}")
  return jnp.asarray(host, dtype)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, init=False)
class SamplingParams:
  """Per-row sampling settings, applied in the order temperature -> top-k -> top-p -> min-p.

  Every field is a scalar (shared by all rows) or a `[B]` array (one value per row).

  Attributes:
    temperature: divides the logits; 0 means greedy (argmax, ties to the lowest index).
    top_k: keep the tokens that have fewer than `top_k` strictly larger logits; 0 disables.
    top_p: keep the tokens whose strictly-more-probable mass is < `top_p`; 1 disables.
    min_p: keep the tokens with probability >= `min_p` * the largest probability; 0 disables.

  Examples:
    >>> import jaxdecode
    >>> p = jaxdecode.SamplingParams(temperature=0.7, top_p=0.9)
    >>> float(p.top_p)
    0.8999999761581421
    >>> jaxdecode.SamplingParams(top_p=0.0)
    Traceback (most recent call last):
    ...
    ValueError: top_p must be a number with 0 < top_p <= 1 (1 disables top-p); got 0.0
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array

  def __init__(self, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    values = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for field in _FIELDS:
      object.__setattr__(self, field.name, _convert(field, values[field.name]))

  # Pytree protocol. Unflattening bypasses __init__: JAX rebuilds the object from tracers or
  # from placeholder leaves (e.g. vmap's in_axes), which must not be converted or validated.
  def tree_flatten(self):
    return tuple(getattr(self, n) for n in _NAMES), None

  @classmethod
  def tree_unflatten(cls, aux, leaves):
    del aux
    obj = object.__new__(cls)
    for name, leaf in zip(_NAMES, leaves):
      object.__setattr__(obj, name, leaf)
    return obj

  def replace(self, **changes) -> "SamplingParams":
    """Returns a copy with some fields changed (validated like the constructor)."""
    unknown = set(changes) - set(_NAMES)
    if unknown:
      raise ValueError(f"unknown SamplingParams field(s) {sorted(unknown)}; fields are {_NAMES}")
    values = {n: getattr(self, n) for n in _NAMES}
    values.update(changes)
    return SamplingParams(**values)

  def broadcast(self, batch_size: int) -> "SamplingParams":
    """Returns the params with every field of shape `[batch_size]`.

    Raises:
      ValueError: if a per-row field's length is not `batch_size`.
    """
    leaves = []
    for name in _NAMES:
      value = getattr(self, name)
      shape = jnp.shape(value)
      if shape not in ((), (batch_size,)):
        raise ValueError(f"SamplingParams.{name} has shape {shape} but the batch has "
                         f"{batch_size} rows; expected a scalar or shape ({batch_size},)")
      leaves.append(jnp.broadcast_to(value, (batch_size,)))
    return SamplingParams.tree_unflatten(None, leaves)

  def sanitized(self) -> "SamplingParams":
    """Maps any value, valid or not, onto the allowed ranges; valid values are unchanged.

    Concrete values were already checked in the constructor, so this only matters for values
    traced under `jit`, which cannot raise. The rules (documented and tested):

    - temperature NaN or < 0 -> 0 (greedy); +inf stays +inf (uniform over the finite logits);
    - top_k < 0 -> 0 (disabled);
    - top_p NaN -> 1 (disabled); top_p <= 0 -> only the most probable token(s); > 1 -> 1;
    - min_p NaN -> 0 (disabled); clipped to [0, 1].
    """
    t = jnp.where(self.temperature > 0, self.temperature, 0.0)  # NaN > 0 is False
    k = jnp.maximum(self.top_k, 0)
    p = jnp.where(jnp.isnan(self.top_p), 1.0, jnp.clip(self.top_p, 0.0, 1.0))
    m = jnp.where(jnp.isnan(self.min_p), 0.0, jnp.clip(self.min_p, 0.0, 1.0))
    return SamplingParams.tree_unflatten(None, (t, k, p, m))


_BY_NAME = {f.name: f for f in _FIELDS}


def as_field(name: str, value) -> jax.Array:
  """Converts and validates one value as the SamplingParams field `name` (for the processors)."""
  return _convert(_BY_NAME[name], value)
