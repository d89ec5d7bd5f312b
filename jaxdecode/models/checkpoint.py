"""Checkpoints: one msgpack file with a format tag, the model config, the weights (float16 on
disk) and metadata.

Writing is atomic (`jaxdecode._files.atomic_write`): an interrupted save leaves the previous
file whole. Reading checks everything before a model is built: the format, the config, that
every weight the config needs is there with its shape and a float dtype and nothing else is,
that every value is finite, and that the vocabulary is the byte tokenizer's. Any failure is one
`ValueError` naming the file and what is wrong.

The embedded default model (`default.msgpack` beside this file) is such a file, written by
`jaxdecode train --out jaxdecode/models/default.msgpack`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import serialization

from jaxdecode import _checks
from jaxdecode import _files
from jaxdecode.models.tokenizer import ByteTokenizer
from jaxdecode.models.transformer import Transformer, TransformerConfig

DEFAULT_PATH = os.path.join(os.path.dirname(__file__), "default.msgpack")
DRAFT_PATH = os.path.join(os.path.dirname(__file__), "draft.msgpack")
FORMAT = "jaxdecode-checkpoint/1"


def _keys_to_str(tree):
  """Integer dict keys (the indices of `nnx.List` layers) as strings: msgpack readers before
  flax 0.12.8 refuse integer map keys."""
  if isinstance(tree, dict):
    return {str(k): _keys_to_str(v) for k, v in tree.items()}
  return tree


def _keys_from_str(tree):
  """The inverse of `_keys_to_str`: digit-string keys back to integers."""
  if isinstance(tree, dict):
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _keys_from_str(v)
            for k, v in tree.items()}
  return tree


def _path(keys) -> str:
  return "/".join(str(k) for k in keys)


def serialize(config: TransformerConfig, weights, *, metadata=None) -> bytes:
  """The bytes of a checkpoint: `config`, `weights` (an `nnx.State`, stored as float16), JSON
  `metadata`.

  Raises:
    ValueError: if a weight is not finite (or not finite as float16), or metadata is not JSON.
  """
  pure = jax.tree.map(np.asarray, nnx.to_pure_dict(weights))
  for keys, value in jax.tree_util.tree_flatten_with_path(pure)[0]:
    with np.errstate(over="ignore"):
      half = value.astype(np.float16)
    if not np.all(np.isfinite(half)):
      where = "is not finite" if not np.all(np.isfinite(value)) else "overflows float16"
      raise ValueError(f"weight {_path(k.key for k in keys)} {where}; refusing to save a broken "
                       f"model")
  try:
    meta = json.dumps(metadata or {})
  except (TypeError, ValueError) as e:
    raise ValueError(f"metadata must be JSON-serializable ({e})") from None
  blob = {"format": FORMAT, "config": json.dumps(config.sizes()), "metadata": meta,
          "weights": _keys_to_str(jax.tree.map(lambda a: a.astype(np.float16), pure))}
  return serialization.msgpack_serialize(blob)


def save_checkpoint(path: str, config: TransformerConfig, weights, *, metadata=None) -> None:
  """Writes a checkpoint atomically: an existing file at `path` survives any interruption.

  Raises:
    ValueError: if `path` cannot be written (a directory, an unwritable folder) or the weights
      are not finite; nothing is written then.
  """
  _files.atomic_write(path, serialize(config, weights, metadata=metadata), "checkpoint")


def _expected_weights(config: TransformerConfig) -> dict:
  """{path: shape} of every weight a model of `config` has (no weights are initialized)."""
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  pure = nnx.to_pure_dict(nnx.state(abstract))
  return {_path(k.key for k in keys): tuple(v.shape)
          for keys, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


def _read(path: str) -> dict:
  data = _files.read_input(path, "model checkpoint")
  try:
    blob = serialization.msgpack_restore(data)
  except Exception as e:  # pylint: disable=broad-except  # any msgpack error means "not ours"
    raise ValueError(f"{path!r} is not a jaxdecode checkpoint (not msgpack: "
                     f"{type(e).__name__})") from None
  if not isinstance(blob, dict) or not {"config", "weights"} <= set(blob):
    raise ValueError(f"{path!r} is not a jaxdecode checkpoint (no config and weights)")
  return blob


def load_checkpoint(path: str, *, batch_invariant: bool = True):
  """`(model, metadata)` from a file written by `save_checkpoint`; weights back in float32.

  Files of jaxdecode 0.1, which had no format tag, load too (same layout). `batch_invariant`
  picks the inference numerics (`TransformerConfig.batch_invariant`); the weights serve both.

  Raises:
    ValueError: naming the file and the problem, if it is missing, a directory, not a
      checkpoint, of another format version, or has a config that does not build, a missing,
      extra or misshapen weight, a non-finite weight, or a vocabulary other than the byte
      tokenizer's.
  """
  blob = _read(path)
  fmt = blob.get("format", FORMAT)
  if fmt != FORMAT:
    raise ValueError(f"{path!r} has checkpoint format {fmt!r}; this jaxdecode reads {FORMAT!r}")
  _checks.boolean("batch_invariant", batch_invariant)
  try:
    sizes = json.loads(blob["config"])
    sizes.pop("batch_invariant", None)
    config = TransformerConfig(**sizes, batch_invariant=batch_invariant)
    metadata = json.loads(blob.get("metadata", "{}"))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path!r} has an invalid config or metadata ({e})") from None
  if config.vocab_size != ByteTokenizer.vocab_size:
    raise ValueError(f"{path!r} has a vocabulary of {config.vocab_size} tokens, but the byte "
                     f"tokenizer has {ByteTokenizer.vocab_size}")
  weights = _keys_from_str(blob["weights"])
  if not isinstance(weights, dict):
    raise ValueError(f"{path!r} has no weight tree")
  found = {_path(k.key for k in keys): v
           for keys, v in jax.tree_util.tree_flatten_with_path(weights)[0]}
  expected = _expected_weights(config)
  missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
  if missing or extra:
    raise ValueError(f"{path!r} does not match its config: "
                     + "; ".join(x for x in (f"missing weights {missing[:5]}" if missing else "",
                                             f"unknown weights {extra[:5]}" if extra else "")
                                 if x))
  for name, shape in expected.items():
    value = found[name]
    if not isinstance(value, np.ndarray) or not np.issubdtype(value.dtype, np.floating):
      raise ValueError(f"{path!r}: weight {name} is not a float array (got "
                       f"{type(value).__name__})")
    if value.shape != shape:
      raise ValueError(f"{path!r}: weight {name} has shape {value.shape}, but the config needs "
                       f"{shape}")
    if not np.all(np.isfinite(value)):
      raise ValueError(f"{path!r}: weight {name} has non-finite values (NaN or inf)")
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), weights))
  return nnx.merge(graphdef, state), metadata


@functools.lru_cache(maxsize=4)
def _read_embedded(path: str, batch_invariant: bool):
  """An embedded checkpoint, read once: the module (only ever cloned, never handed out) and
  the metadata as JSON text."""
  model, metadata = load_checkpoint(path, batch_invariant=batch_invariant)
  return model, json.dumps(metadata)


def _load_embedded(path: str, batch_invariant: bool):
  """`(model, metadata)`: a module and a metadata dict of the caller's own on every call.

  The file is read once; the weights are cached, never the module: a caller who trains or
  assigns into the model it got changes nothing for the next caller (`generate()` without
  `model=`, the audit, another `load_default()`).
  """
  model, metadata = _read_embedded(path, batch_invariant)
  # nnx.clone: new modules and variables over the same immutable arrays (no copy of weights).
  return nnx.clone(model), json.loads(metadata)


def _load_default(batch_invariant: bool):
  return _load_embedded(DEFAULT_PATH, batch_invariant)


def load_default(batch_invariant: bool = True):
  """`(model, tokenizer)`: the embedded model and its byte tokenizer.

  Args:
    batch_invariant: the inference numerics: a row's logits the same bits alone or in any
      batch (True), or XLA's plain kernels (False, for comparison). The same weights.

  The model's training figures (command, validation loss) are in `default_metadata()`.
  """
  return _load_default(_checks.boolean("batch_invariant", batch_invariant))[0], ByteTokenizer()


def default_metadata() -> dict:
  """How the embedded model was trained: settings, corpus, losses, duration."""
  return _load_default(True)[1]


def load_draft(batch_invariant: bool = True):
  """The embedded draft model: a small transformer with the default model's byte tokenizer,
  trained the same way, for speculative decoding (`generate(..., draft=load_draft())`).

  Args:
    batch_invariant: its inference numerics, as in `load_default` (a draft's numerics never
      change the output of speculative decoding, only how many drafts are accepted).

  Its training figures are in `draft_metadata()`.
  """
  return _load_embedded(DRAFT_PATH, _checks.boolean("batch_invariant", batch_invariant))[0]


def draft_metadata() -> dict:
  """How the embedded draft model was trained."""
  return _load_embedded(DRAFT_PATH, True)[1]
