"""Adapters of Flax NNX models (`jaxdecode.adapters.Adapter`): the embedded model, and any NNX
model with a cache in the shape of flax's `examples/gemma` through the embedded model's
contract (`prefill` / `make_step_fn`). The core's `jaxdecode.adapters` holds the protocol and
the transformers adapter; this module needs flax, so it lives with the models."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

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
  graphdef, weights = nnx.split(model)
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
                   f"tokenizer)); got {type(model).__name__}")
