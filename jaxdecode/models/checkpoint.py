"""Checkpoints: one msgpack file with the model config, the weights (float16 on disk) and metadata.

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

from jaxdecode.models.transformer import Transformer, TransformerConfig

DEFAULT_PATH = os.path.join(os.path.dirname(__file__), "default.msgpack")


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


def save_checkpoint(path: str, config: TransformerConfig, weights, *, metadata=None) -> None:
  """Writes `config`, `weights` (an `nnx.State`, stored as float16) and JSON `metadata`."""
  pure = _keys_to_str(jax.tree.map(lambda a: np.asarray(a, np.float16),
                                   nnx.to_pure_dict(weights)))
  blob = {"config": json.dumps(dataclasses.asdict(config)),
          "metadata": json.dumps(metadata or {}), "weights": pure}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "wb") as f:
    f.write(serialization.msgpack_serialize(blob))


def load_checkpoint(path: str):
  """`(model, metadata)` from a file written by `save_checkpoint`; weights back in float32.

  Raises:
    ValueError: if the file does not exist or is not a jaxdecode checkpoint.
  """
  if not os.path.isfile(path):
    raise ValueError(f"model checkpoint {path!r} does not exist")
  with open(path, "rb") as f:
    try:
      blob = serialization.msgpack_restore(f.read())
      config = TransformerConfig(**json.loads(blob["config"]))
      metadata = json.loads(blob["metadata"])
      restored = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32),
                              _keys_from_str(blob["weights"]))
    except Exception as e:  # msgpack, JSON or layout errors all mean "not our file"
      raise ValueError(f"{path!r} is not a jaxdecode checkpoint ({type(e).__name__}: {e})") from e
  graphdef, weights = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  nnx.replace_by_pure_dict(weights, restored)
  return nnx.merge(graphdef, weights), metadata


@functools.lru_cache(maxsize=1)
def _load_default():
  return load_checkpoint(DEFAULT_PATH)


def load_default():
  """`(model, tokenizer)`: the embedded model trained on CPython's pydoc topics, and its tokenizer.

  The model's training figures (command, validation loss) are in `default_metadata()`.
  """
  from jaxdecode.models.tokenizer import ByteTokenizer  # pylint: disable=import-outside-toplevel
  return _load_default()[0], ByteTokenizer()


def default_metadata() -> dict:
  """How the embedded model was trained: settings, corpus, losses, duration."""
  return _load_default()[1]
