"""Adapters of Flax NNX models (`jaxdecode.adapters.Adapter`): the embedded model
(`embedded`), and any NNX model with a cache in the shape of flax's `examples/gemma` (`nnx`).
The core's `jaxdecode.adapters` holds the protocol and the transformers adapter; this module
needs flax, so it lives with the models.

flax's examples/gemma cache holds per layer `{"k", "v": [B, S, heads, head_dim], "end_index":
int32[B]}`, but every row of a call is written at one shared slot, `end_index[0] % S`: the
shared write index of transformers' caches. `nnx` therefore reuses the core's bookkeeping
(`adapters.shared_index_functions`: per-row slot maps, rejected drafts forgotten, rows
compacted in order when a call would not fit), and gives the model the `[B, T, S]` attention
mask it asks for: query t of row b sees slot s iff that slot holds a position of row b at or
before the query's own."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx as flax_nnx

from jaxdecode import _checks
from jaxdecode import adapters
from jaxdecode.models import extras
from jaxdecode.models import transformer
from jaxdecode.models.checkpoint import load_default
from jaxdecode.models.tokenizer import ByteTokenizer

_STEP_FNS: dict = {}  # one jitted step function per model structure, so decode compiles once


def step_fn_for(graphdef):
  """The jitted step function of a model structure, built once (so decode compiles once). Like
  every `make_step_fn`, it declares `position_limit(state)`, so that `decode`, `beam_search`,
  `speculative_decode` and `stream` refuse a request that does not fit before running it."""
  if graphdef not in _STEP_FNS:
    _STEP_FNS[graphdef] = transformer.make_step_fn(graphdef)
  return _STEP_FNS[graphdef]


def embedded(model: transformer.Transformer, tokenizer=None) -> adapters.Adapter:
  """The `Adapter` of a `jaxdecode.models.Transformer` (the embedded model, a checkpoint of
  `jaxdecode train`, or any NNX model of that class): `prefill` / `make_step_fn` over its
  `KVCache`, batch-invariant by construction when its config says so.

  Args:
    model: a `Transformer`.
    tokenizer: its tokenizer (default `ByteTokenizer()`).

  Raises:
    ValueError: for another model type.
  """
  if not isinstance(model, transformer.Transformer):
    raise ValueError(f"model must be a jaxdecode.models.Transformer; got "
                     f"{type(model).__name__}")
  graphdef, weights = flax_nnx.split(model)
  tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
  return adapters.from_functions(
      "embedded Transformer", prefill=functools.partial(_prefill, graphdef, weights),
      step_fn=step_fn_for(graphdef), state_axes=transformer.DECODE_STATE_AXES,
      vocab_size=model.config.vocab_size, max_positions=model.config.max_len,
      eos_ids=(tokenizer.EOS,), pad_id=tokenizer.PAD, tokenizer=tokenizer,
      logits_fn=transformer.forward_fn(graphdef, weights),
      prompt_logprobs=functools.partial(_prefill_with_logprobs, graphdef, weights))


def _prefill(graphdef, weights, tokens, lengths, cache_length):
  logits, state = transformer.prefill(graphdef, weights, tokens, lengths,
                                      cache_length=cache_length)
  return logits, state, jnp.asarray(lengths, jnp.int32)


def _prefill_with_logprobs(graphdef, weights, tokens, lengths, cache_length):
  logits, state, logprobs = extras.prefill_with_logprobs(graphdef, weights, tokens, lengths,
                                                         cache_length=cache_length)
  return logits, state, jnp.asarray(lengths, jnp.int32), logprobs


# ---------------------------------------------------------------------------------------------
# Flax NNX models in the shape of flax's examples/gemma transformer.

_PROBE_BATCH, _PROBE_SLOTS = 2, 3  # distinct, so that a cache's batch and slot axes tell apart


def nnx(model, *, max_positions: int, eos_ids=None, pad_id=None, tokenizer=None,
        vocab_size=None, cache_dtype=None, batch_invariant: bool = False,
        padding: str = "right") -> adapters.Adapter:
  """An `Adapter` for a Flax NNX model in the shape of flax's `examples/gemma` transformer.

  The model is called as `model(last_tokens int32[B, T], positions int32[B, T], cache,
  attention_mask bool[B, T, S]) -> (logits [B, T, V], new_cache)`, its cache made by
  `model.init_cache(cache_size=S, batch_size=B, dtype=...)`: leaves `[B, S, ...]` and a write
  index (examples/gemma's `end_index`, rank 0 or 1) at which the model writes every row of a
  call, then moves on by T. The adapter runs a copy of the model in inference mode (`.eval()`).
  The mask is all a query may see: slots are not positions (rows share the write index and get
  compacted), so a layer that derives a window from slot indices (examples/gemma's
  `LOCAL_SLIDING`) is not supported.

  Args:
    model: the `flax.nnx.Module`. Its weights are carried in the state as data, so other
      weights of the same structure never recompile.
    max_positions: the longest sequence (prompt + new tokens) to run: the context the model
      was trained for (rotary positions have no table to read it from).
    eos_ids: the ids that end a row (default: the tokenizer's EOS); `()` for none (rows run to
      `max_new_tokens`).
    pad_id: the id after a row's end (default: the tokenizer's pad, else an EOS id, else 0).
    tokenizer: `models.ByteTokenizer()`, a transformers tokenizer, an `adapters.Tokenizer`, or
      None (token ids only; text calls then refuse).
    vocab_size: the ids the loops may emit (default: the logits' width); smaller when the
      embedding table is padded past the tokenizer's ids, which are then never drawn.
    cache_dtype: the cache's dtype (default: the weights' float dtype; float32 if mixed).
    batch_invariant: run the model under `jaxdecode.batch_invariant`, so that a row's tokens
      and log-probabilities are bitwise the same alone or in any batch.
    padding: "right" or "left": where a short prompt sits in the cache (`adapters.transformers`).

  Returns:
    An `Adapter` whose state is `{"cache", "slots", "params"}`, as `adapters.transformers`'.

  Raises:
    ValueError, before anything compiles: for a model that is not an NNX module, has no
      `init_cache` or cannot be called as above (one call is traced on a tiny probe, never
      compiled), a cache of another layout, a vocab_size past the logits' width, no EOS when
      `eos_ids` is not given, or ids outside the vocabulary.
  """
  if not isinstance(model, flax_nnx.Module) or not callable(getattr(model, "init_cache", None)):
    raise ValueError(f"model must be a flax.nnx.Module with init_cache(cache_size, batch_size, "
                     f"dtype), in the shape of flax's examples/gemma Transformer; got "
                     f"{type(model).__name__}")
  name = f"flax.nnx {type(model).__name__}"
  max_positions = _checks.integer("max_positions", max_positions, low=1)
  batch_invariant = _checks.boolean("batch_invariant", batch_invariant)
  padding = _checks.one_of("padding", padding, adapters.PADDINGS)
  graphdef, weights = _inference_split(model)
  cache_dtype = _cache_dtype(weights, cache_dtype)
  init_cache = functools.partial(_init_cache, graphdef, cache_dtype)
  width = _probe(graphdef, weights, init_cache)
  vocab = width if vocab_size is None else _checks.integer("vocab_size", vocab_size, low=1,
                                                           high=width)
  tokenizer = _text_tokenizer(tokenizer, vocab)
  eos_ids, pad_id = _special_ids(name, eos_ids, pad_id, tokenizer)
  fns = adapters.shared_index_functions(
      ("nnx", graphdef, vocab, max_positions, cache_dtype),
      functools.partial(_run, graphdef, vocab), init_cache, invariant=batch_invariant,
      vocab=vocab, max_positions=max_positions, padding=padding)
  return fns.adapter(name + adapters.adapter_options(batch_invariant, padding), weights,
                     vocab_size=vocab, max_positions=max_positions, eos_ids=eos_ids,
                     pad_id=pad_id, tokenizer=tokenizer)


def _run(graphdef, vocab, weights, cache, tokens, positions, slots):
  """One call of the model (`adapters.shared_index_functions`' `run`): query t of row b, at
  position `positions[b, t]`, sees the slots that hold row b's positions up to its own."""
  held = slots[:, None, :]  # [B, 1, S]
  attention_mask = (held >= 0) & (held <= positions[:, :, None])  # [B, T, S]
  with jax.numpy_rank_promotion("allow"):  # as the model's authors ran it, whatever the caller's
    logits, cache = flax_nnx.merge(graphdef, weights)(tokens, positions, cache, attention_mask)
  return logits[..., :vocab], cache


def _init_cache(graphdef, dtype, weights, batch: int, cache_length: int):
  return flax_nnx.merge(graphdef, weights).init_cache(cache_size=cache_length,
                                                      batch_size=batch, dtype=dtype)


def _inference_split(model):
  """(graphdef, state) of a copy of `model` in inference mode (dropout off); `model` itself is
  left as it is."""
  copy = flax_nnx.clone(model)
  copy.eval()
  return flax_nnx.split(copy)


def _cache_dtype(weights, given):
  """The dtype given (a float dtype), else the weights' float dtype (float32 if mixed)."""
  if given is None:
    floats = {jnp.dtype(x.dtype) for x in jax.tree.leaves(weights)
              if jnp.issubdtype(x.dtype, jnp.floating)}
    return floats.pop() if len(floats) == 1 else jnp.dtype(jnp.float32)
  try:
    dtype = jnp.dtype(given)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"cache_dtype must be a float dtype (jnp.bfloat16, jnp.float32, ...); "
                     f"got {given!r}")
  return dtype


def _probe(graphdef, weights, init_cache) -> int:
  """Traces (never compiles) `init_cache` and one call of the model on a tiny batch, checks
  what they give, and returns the logits' width."""
  batch, size = _PROBE_BATCH, _PROBE_SLOTS
  try:
    cache = jax.eval_shape(lambda w: init_cache(w, batch, size), weights)
  except Exception as error:  # the user's code: any error means the wrong shape of model
    raise ValueError(f"model.init_cache(cache_size={size}, batch_size={batch}, dtype=...) "
                     f"failed ({type(error).__name__}: {error}); the adapter needs flax's "
                     f"examples/gemma init_cache(cache_size, batch_size, dtype)") from error
  _check_cache_layout(cache, batch, size)

  def call(weights, cache):
    tokens = jnp.zeros((batch, 1), jnp.int32)
    mask = jnp.ones((batch, 1, size), bool)
    with jax.numpy_rank_promotion("allow"):
      return flax_nnx.merge(graphdef, weights)(tokens, tokens, cache, mask)

  expected = ("model must be called as model(last_tokens [B, T], positions [B, T], cache, "
              "attention_mask [B, T, S]) -> (logits [B, T, V], new_cache), like flax's "
              "examples/gemma Transformer")
  try:
    out = jax.eval_shape(call, weights, cache)
  except Exception as error:  # the user's code: any error means the wrong shape of model
    raise ValueError(f"{expected}; that call failed ({type(error).__name__}: "
                     f"{error})") from error
  logits = out[0] if isinstance(out, tuple) and len(out) == 2 else None
  if (getattr(logits, "ndim", 0) != 3 or logits.shape[:2] != (batch, 1)
      or jax.tree.structure(out[1]) != jax.tree.structure(cache)
      or jax.tree.leaves(out[1]) != jax.tree.leaves(cache)):
    got = jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}", out)
    raise ValueError(f"{expected}, the new cache of the same shapes and dtypes as the "
                     f"cache; on tokens [{batch}, 1] it gave {got}")
  return int(logits.shape[2])


def _check_cache_layout(cache, batch: int, size: int) -> None:
  """Every leaf `[batch, slots, ...]`, or an integer write index of shape () or [batch]."""
  leaves = jax.tree_util.tree_leaves_with_path(cache)
  for path, leaf in leaves:
    index = leaf.ndim <= 1 and jnp.issubdtype(leaf.dtype, jnp.integer) and (
        leaf.shape in ((), (batch,)))
    if not index and leaf.shape[:2] != (batch, size):
      raise ValueError(f"model.init_cache(cache_size={size}, batch_size={batch}) gave "
                       f"{jax.tree_util.keystr(path)} of shape {leaf.shape} ({leaf.dtype}); "
                       f"the adapter needs leaves [batch, cache slots, ...] and an integer "
                       f"write index of shape () or [batch] (examples/gemma's end_index)")
  if not any(leaf.ndim <= 1 for _, leaf in leaves):
    raise ValueError("model.init_cache(...) gave no write index (an integer leaf of shape () "
                     "or [batch], examples/gemma's end_index), which the adapter moves")


def _text_tokenizer(tokenizer, vocab: int):
  """The tokenizer as the text API uses it: transformers' wrapped in `adapters.Tokenizer`."""
  if tokenizer is None or isinstance(tokenizer, adapters.Tokenizer):
    return tokenizer
  if callable(getattr(tokenizer, "convert_ids_to_tokens", None)):
    if len(tokenizer) > vocab:
      raise ValueError(f"the tokenizer has {len(tokenizer)} ids but the model's vocabulary "
                       f"{vocab}: its tokens past {vocab - 1} have no logits; use the model's "
                       f"own tokenizer")
    return adapters.tokenizer(tokenizer, vocab_size=vocab)
  if not (callable(getattr(tokenizer, "encode", None))
          and callable(getattr(tokenizer, "decode", None))):
    raise ValueError(f"tokenizer must be models.ByteTokenizer(), a transformers tokenizer or "
                     f"an adapters.Tokenizer (encode / decode); got {type(tokenizer).__name__}")
  return tokenizer


def _special_ids(name, eos_ids, pad_id, tokenizer) -> tuple:
  """(eos_ids, pad_id): those given, else the tokenizer's; ValueError if no EOS anywhere."""
  if eos_ids is None:
    eos_ids = getattr(tokenizer, "eos_ids", None)
    if eos_ids is None and getattr(tokenizer, "EOS", None) is not None:
      eos_ids = (tokenizer.EOS,)
    if not eos_ids:
      raise ValueError(f"{name} has no EOS id (no tokenizer with one was given): give "
                       f"eos_ids=[...] (or eos_ids=() to run every row to max_new_tokens)")
  eos_ids = tuple([eos_ids] if isinstance(eos_ids, int) else eos_ids)
  if pad_id is None:
    pad_id = getattr(tokenizer, "PAD", None)
    pad_id = pad_id if pad_id is not None else (eos_ids[0] if eos_ids else 0)
  return eos_ids, pad_id


def resolve(model, tokenizer=None) -> adapters.Adapter:
  """`models.generate`'s `model=`: None (the embedded model), a `Transformer` or an `Adapter`.

  Raises:
    ValueError: for anything else, for a tokenizer given beside an `Adapter` (it has its own),
      and for an `Adapter` without a tokenizer (text needs one).
  """
  if model is None:
    model, default_tokenizer = load_default()
    return embedded(model, tokenizer or default_tokenizer)
  if isinstance(model, transformer.Transformer):
    return embedded(model, tokenizer)
  if isinstance(model, adapters.Adapter):
    if tokenizer is not None:
      raise ValueError(f"tokenizer= is for a Transformer; the adapter {model.name} has its own "
                       f"(give it to the adapter's constructor)")
    if model.tokenizer is None:
      raise ValueError(f"the adapter {model.name} has no tokenizer, which text prompts need; "
                       f"build it with one (adapters.transformers(model, params, tokenizer))")
    return model
  raise ValueError(f"model must be None (the embedded model), a jaxdecode.models.Transformer "
                   f"or a jaxdecode.adapters.Adapter (e.g. adapters.transformers(model, params, "
                   f"tokenizer), or models.adapters.nnx(model, max_positions=..., tokenizer=...) "
                   f"for another Flax NNX model); got {type(model).__name__}")
