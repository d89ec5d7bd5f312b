"""Bring your model: a model family turned into what every decoding loop takes.

An `Adapter` holds, for one model and its weights: a prefill over right-padded prompts, the
multi-token step function of `decode` / `beam_search` / `speculative_decode` / `stream` (with
`position_limit`), the state's batch axes for beams, the vocabulary size, EOS and pad ids, a
tokenizer (text <-> ids, and the token bytes that `jaxdecode.structured` needs) and a
`logits_fn` for `jaxdecode.score`. `models.generate`, `models.stream` and the command take one.

Constructors here (the core imports no flax; the embedded model's and other Flax NNX models'
adapters are in `jaxdecode.models.adapters`):

- `transformers(model, params, tokenizer)`: a transformers `FlaxPreTrainedModel` with
  `init_cache` (GPT-2, Llama, Gemma, ...);
- `from_functions(...)`: any family, from a prefill and a step function written by hand
  (docs/step_functions.md);
- `shared_index_functions(...)`: the prefill and step of any model whose cache writes every
  row at one shared index, from one call of the model (`transformers` and
  `models.adapters.nnx` are built on it).

transformers' Flax models (and flax's examples/gemma) write every row of a call at one shared
index (`cache_index`), and mask slots with an attention mask. The loops need per-row positions:
speculative decoding accepts a different number of drafts per row, and a row's next call starts
at its own position. So the state keeps, per row, the position each cache slot holds (`slots`,
-1 for none), and each call (1) forgets the slots holding positions at or past the row's new
ones (rejected drafts), (2) moves the shared write index back to just after the last slot any
row still holds, (3) when the call's tokens would not fit, compacts each row's held slots to the
front (in order, so attention sees the same keys in the same order), then (4) writes the call's
tokens with their own position ids and a mask of the held slots. A prefill lays a batch's
prompts out right-padded (row b's positions in slots 0..len-1) or, with `padding="left"`, as
transformers' own `generate` does (every prompt ends at the same slot). Under
`batch_invariant`, where every sum is an in-order chain, masked slots are exact zeros wherever
they sit, so a row's bits do not depend on where the padding or the other rows put its slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdecode import _checks
from jaxdecode import _platform
from jaxdecode import processors
from jaxdecode import sampling
from jaxdecode import structured
from jaxdecode.prompts import right_pad
from jaxdecode.batch_invariant import batch_invariant as _batch_invariant


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
  """One model (structure and weights) as the decoding loops take it.

  Attributes:
    name: the family and model, for messages ("transformers FlaxGPT2LMHeadModel").
    prefill: `prefill(tokens int32[B, T], lengths int32[B], cache_length) -> (logits [B, V],
      state, positions int32[B])`: right-padded prompts (`jaxdecode.right_pad`) into a state
      with room for `cache_length` positions; `positions[b]` is the position of row b's first
      new token.
    step_fn: the loops' step, `(state, tokens int32[B] or [B, K], positions int32[B]) ->
      (logits [B, V] or [B, K, V], state)`, jitted, declaring `step_fn.position_limit(state)`.
    state_axes: each state leaf's batch axis (`beam_search(state_axes=)`), None for shared
      leaves such as weights.
    vocab_size: V, the ids the loops may emit (the tokenizer's size when the model's embedding
      table is padded past it: padded ids are never in the logits).
    eos_ids: the ids that end a row (may be empty: rows then run to `max_new_tokens`).
    pad_id: the id written after a row's end.
    max_positions: the model's context (its position table or trained range).
    tokenizer: a `Tokenizer` (or the embedded `ByteTokenizer`), or None.
    logits_fn: `logits_fn(tokens int32[B, T], lengths int32[B]) -> [B, T, V]`, the model over
      right-padded whole sequences, for `jaxdecode.score`.
    prompt_logprobs: `prefill` that also returns float32[B, T - 1], each prompt token's
      log-probability given the ones before it (`generate(prompt_logprobs=True)`), or None.
  """

  name: str
  prefill: Callable
  step_fn: Callable
  state_axes: Any
  vocab_size: int
  eos_ids: tuple
  pad_id: int
  max_positions: int
  tokenizer: Any = None
  logits_fn: Callable | None = None
  prompt_logprobs: Callable | None = None

  def vocabulary(self) -> structured.Vocabulary:
    """The tokenizer's `structured.Vocabulary` (ValueError without a tokenizer or an EOS)."""
    if self.tokenizer is None or not hasattr(self.tokenizer, "vocabulary"):
      raise ValueError(f"structured output needs the tokens' bytes: give {self.name} a "
                       f"tokenizer (adapters.transformers(model, params, tokenizer))")
    if not self.eos_ids:
      raise ValueError(f"structured output needs an EOS id to end a match; {self.name} has "
                       f"none: give eos_ids=[...] to the adapter")
    return self.tokenizer.vocabulary()

  def batch_prefill(self, extra: int) -> Callable:
    """`prefill(prompts) -> (logits, state, positions)` for token lists, with room for `extra`
    more tokens per row: the contract of `jaxdecode.audit` (right padding, exact widths)."""
    extra = _checks.integer("extra", extra, low=1)

    def run(prompts):
      tokens, lengths = right_pad(prompts, pad_id=self.pad_id, buckets=None)
      return self.prefill(tokens, lengths, tokens.shape[1] + extra)

    return run

  def repeat_rows(self, state, n: int):
    """`state` with every row repeated n times in place (prompt-major), shared leaves kept."""
    full = jax.tree.broadcast(self.state_axes, state, is_leaf=lambda x: x is None)
    return jax.tree.map(
        lambda a, x: x if a is None or jnp.ndim(x) == 0 else jnp.repeat(x, n, axis=a),
        full, state, is_leaf=lambda x: x is None)


def from_functions(name: str, *, prefill: Callable, step_fn: Callable, state_axes,
                   vocab_size: int, max_positions: int, eos_ids: Sequence[int] = (),
                   pad_id: int = 0, tokenizer=None, logits_fn=None,
                   prompt_logprobs=None) -> Adapter:
  """An `Adapter` of hand-written functions (the contracts of `Adapter`'s attributes).

  Raises:
    ValueError: for a vocab_size or max_positions below 1, or ids outside [0, vocab_size).
  """
  vocab_size = _checks.integer("vocab_size", vocab_size, low=1)
  max_positions = _checks.integer("max_positions", max_positions, low=1)
  eos_ids = tuple(_checks.integer("eos_ids[i]", int(e) if isinstance(e, np.integer) else e,
                                  low=0, high=vocab_size - 1) for e in eos_ids)
  pad_id = _checks.integer("pad_id", pad_id, low=0, high=vocab_size - 1)
  if not callable(prefill) or not callable(step_fn):
    raise ValueError(f"prefill and step_fn must be callables; got {type(prefill).__name__} / "
                     f"{type(step_fn).__name__}")
  return Adapter(name, prefill, step_fn, state_axes, vocab_size, eos_ids, pad_id, max_positions,
                 tokenizer, logits_fn, prompt_logprobs)


# ---------------------------------------------------------------------------------------------
# Tokenizers: transformers' (fast) tokenizers as encode / decode / token bytes.


def _byte_decoder() -> dict:
  """GPT-2's byte-level alphabet inverted: the printable character standing for each byte."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = list(printable), 0
  for b in range(256):
    if b not in printable:
      printable.append(b)
      chars.append(256 + extra)
      extra += 1
  return {chr(c): b for b, c in zip(printable, chars)}


def _token_pieces(hf, size: int) -> list:
  """The bytes of each id below `size` (None for special and unknown ids), from the tokenizer's
  own token strings: byte-level BPE (GPT-2, Llama 3) maps each character back to its byte;
  SentencePiece-style vocabularies (Llama 2, Gemma) read "▁" as a space and <0xHH> as a byte."""
  special = set(hf.all_special_ids) | set(getattr(hf, "added_tokens_decoder", {}) or {})
  strings = hf.convert_ids_to_tokens(list(range(min(size, len(hf)))))
  byte_level = _is_byte_level(hf)
  inverse = _byte_decoder()
  pieces = []
  for i, s in enumerate(strings):
    if i in special or s is None:
      pieces.append(None)
    elif byte_level:
      pieces.append(bytes(inverse[c] for c in s) if all(c in inverse for c in s) else None)
    elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
      pieces.append(bytes([int(s[3:5], 16)]))
    else:
      pieces.append(s.replace("\u2581", " ").encode("utf-8") or None)
  return pieces + [None] * (size - len(pieces))


def _is_byte_level(hf) -> bool:
  backend = getattr(hf, "backend_tokenizer", None)
  decoder = getattr(backend, "decoder", None)
  return type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)


class Tokenizer:
  """A transformers tokenizer as jaxdecode's text API uses it.

  Text is decoded from each token's bytes (`pieces`), so `decode`, stop strings and streamed
  text agree token by token, and `vocabulary()` gives `jaxdecode.structured` the same bytes.

  Args:
    hf: a transformers tokenizer (`PreTrainedTokenizerFast`, e.g. `AutoTokenizer`'s).
    vocab_size: the ids to describe (default `len(hf)`); ids past the tokenizer's are special.
    eos_ids: override the tokenizer's EOS (default: `hf.eos_token_id`, none if it has none).
  """

  def __init__(self, hf, vocab_size: int | None = None, eos_ids=None):
    if not callable(getattr(hf, "convert_ids_to_tokens", None)) or not callable(
        getattr(hf, "encode", None)):
      raise ValueError(f"tokenizer must be a transformers tokenizer (encode, "
                       f"convert_ids_to_tokens); got {type(hf).__name__}")
    self.hf = hf
    self.vocab_size = len(hf) if vocab_size is None else vocab_size
    self.pieces = _token_pieces(hf, self.vocab_size)
    if eos_ids is None:
      eos_ids = () if hf.eos_token_id is None else (hf.eos_token_id,)
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.EOS = self.eos_ids[0] if self.eos_ids else None  # pylint: disable=invalid-name
    pad = hf.pad_token_id if hf.pad_token_id is not None else self.EOS
    self.PAD = 0 if pad is None else int(pad)  # pylint: disable=invalid-name

  def __len__(self) -> int:
    return self.vocab_size

  def encode(self, text: str, *, bos: bool = True) -> list:
    """Token ids of `text`, with the special tokens the tokenizer adds (e.g. BOS) if `bos`."""
    return [int(i) for i in self.hf.encode(text, add_special_tokens=bos)]

  def decode_bytes(self, ids) -> bytes:
    return b"".join(self.pieces[int(i)] or b"" for i in ids)

  def decode(self, ids) -> str:
    """The text of `ids`: their bytes as UTF-8 (special ids dropped, bad bytes U+FFFD)."""
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  def vocabulary(self) -> structured.Vocabulary:
    if not self.eos_ids:
      raise ValueError("the tokenizer has no EOS token (eos_token_id is None), which "
                       "structured output needs to end a match; give eos_ids=[...]")
    return _vocabulary(tuple(self.pieces), self.eos_ids)


@functools.lru_cache(maxsize=8)
def _vocabulary(pieces: tuple, eos_ids: tuple) -> structured.Vocabulary:
  return structured.Vocabulary(list(pieces), eos_ids)


def tokenizer(hf, vocab_size: int | None = None, eos_ids=None) -> Tokenizer:
  """`Tokenizer(hf, vocab_size, eos_ids)`; a `Tokenizer` is returned as it is."""
  return hf if isinstance(hf, Tokenizer) else Tokenizer(hf, vocab_size, eos_ids)


# ---------------------------------------------------------------------------------------------
# transformers' Flax causal LMs.

_FUNCTIONS: dict = {}  # one set of jitted functions per model program (shared_index_functions)
PADDINGS = ("right", "left")  # where a short prompt sits in a shared-index cache


def transformers(model, params=None, tokenizer=None, *, eos_ids=None, pad_id=None,
                 batch_invariant: bool = False, padding: str = "right") -> Adapter:
  """An `Adapter` for a transformers Flax causal LM (`FlaxPreTrainedModel` with `init_cache`).

  Args:
    model: e.g. `FlaxAutoModelForCausalLM.from_pretrained(path)`, `FlaxGPT2LMHeadModel`,
      `FlaxLlamaForCausalLM`, `FlaxGemmaForCausalLM`.
    params: its weights (default `model.params`), carried as data: new ones never recompile.
    tokenizer: a transformers tokenizer (or a `Tokenizer`), or None (token ids only). When the
      model's embedding table is padded past the tokenizer's ids, the logits stop at the
      tokenizer's size: padded ids are never drawn.
    eos_ids: the ids that end a row (default: the tokenizer's EOS, else the config's
      `eos_token_id`); `()` for none (rows run to `max_new_tokens`).
    pad_id: the id after a row's end (default: the tokenizer's pad, else an EOS id, else 0).
    batch_invariant: run the model's prefill and step under `jaxdecode.batch_invariant`, so a
      row's tokens and log-probabilities are bitwise the same alone or in any batch.
    padding: where a prompt shorter than the batch's longest sits in the cache: "right" (slot p
      holds position p; the gap lies between the prompt and the new tokens) or "left" (every
      prompt ends at the same slot, as transformers' own `generate` pads a batch). The
      adapter's functions take right-padded prompts either way.

  Returns:
    An `Adapter`. Its state is `{"cache", "slots", "params"}` (see this module's docstring;
    under `batch_invariant`, "params" is a `jaxdecode.batch_invariant.Weights`).

  Raises:
    ValueError: for a model without `init_cache`, missing weights, a tokenizer with more ids
      than the model's vocabulary, no EOS anywhere when `eos_ids` is not given, or ids outside
      the vocabulary.
  """
  if not (callable(getattr(model, "init_cache", None)) and hasattr(model, "config")
          and hasattr(model, "module")):
    raise ValueError(f"model must be a transformers FlaxPreTrainedModel with init_cache (a "
                     f"Flax causal LM such as FlaxGPT2LMHeadModel or FlaxLlamaForCausalLM); "
                     f"got {type(model).__name__}")
  name = f"transformers {type(model).__name__}"
  if params is None:
    try:
      params = model.params
    except ValueError:
      raise ValueError(f"{name} was built without weights (_do_init=False): give params=")
  batch_invariant = _checks.boolean("batch_invariant", batch_invariant)
  padding = _checks.one_of("padding", padding, PADDINGS)
  model_vocab = int(model.config.vocab_size)
  vocab = model_vocab
  if tokenizer is not None:
    hf = tokenizer.hf if isinstance(tokenizer, Tokenizer) else tokenizer
    tokenizer = Tokenizer(hf, eos_ids=eos_ids if eos_ids is not None else (
        tokenizer.eos_ids if isinstance(tokenizer, Tokenizer) else None))
    if len(tokenizer.hf) > model_vocab:
      raise ValueError(f"the tokenizer has {len(tokenizer.hf)} ids but {name}'s vocabulary "
                       f"{model_vocab}: its tokens past {model_vocab - 1} have no logits; use "
                       f"the model's own tokenizer")
    vocab = len(tokenizer.hf)
    tokenizer = Tokenizer(tokenizer.hf, vocab, tokenizer.eos_ids)
  eos_ids = _eos_ids(name, eos_ids, tokenizer, model.config)
  if pad_id is None:
    pad_id = tokenizer.PAD if tokenizer is not None else (
        model.config.pad_token_id if model.config.pad_token_id is not None
        else eos_ids[0] if eos_ids else 0)
  max_positions = (getattr(model.config, "n_positions", None)
                   or getattr(model.config, "max_position_embeddings", None))
  fns = _hf_functions(model, vocab, batch_invariant, int(max_positions), padding)
  return fns.adapter(name + adapter_options(batch_invariant, padding), params,
                     vocab_size=vocab, max_positions=max_positions, eos_ids=eos_ids,
                     pad_id=pad_id, tokenizer=tokenizer)


def adapter_options(invariant: bool, padding: str) -> str:
  """The options an adapter's name shows: " (batch_invariant, left padding)"."""
  shown = (["batch_invariant"] if invariant else []) + (
      [f"{padding} padding"] if padding != "right" else [])
  return f" ({', '.join(shown)})" if shown else ""


def _eos_ids(name, eos_ids, tokenizer, config) -> tuple:
  """The EOS ids given, else the tokenizer's, else the config's; ValueError if none."""
  if eos_ids is not None:
    return tuple([eos_ids] if isinstance(eos_ids, int) else eos_ids)
  if tokenizer is not None and tokenizer.eos_ids:
    return tokenizer.eos_ids
  found = getattr(config, "eos_token_id", None)
  if found is None:
    raise ValueError(f"{name} has no EOS id: the tokenizer's eos_token_id and the config's are "
                     f"None; give eos_ids=[...] (or eos_ids=() to run every row to "
                     f"max_new_tokens)")
  return tuple([found] if isinstance(found, int) else found)


@dataclasses.dataclass(frozen=True, eq=False)
class SharedIndexFunctions:
  """The jitted functions of one model over a shared-index cache (`shared_index_functions`)."""
  prefill: Callable  # (params, tokens, lengths, cache_length) -> (logits, state, positions)
  step: Callable  # jitted, with position_limit
  logits: Callable  # (params, tokens, lengths) -> logits [B, T, V]
  prompt_logprobs: Callable  # prefill's, and the prompt tokens' log-probabilities

  def adapter(self, name: str, params, **fields) -> Adapter:
    """The `Adapter` of these functions over the weights `params` (carried in the state as
    data, so new weights never recompile); `fields`: `from_functions`' vocab_size,
    max_positions, eos_ids, pad_id and tokenizer."""
    return from_functions(
        name, prefill=functools.partial(self.prefill, params), step_fn=self.step,
        state_axes={"cache": 0, "slots": 0, "params": None},
        logits_fn=jax.tree_util.Partial(self.logits, params),
        prompt_logprobs=functools.partial(self.prompt_logprobs, params), **fields)


def _hf_functions(model, vocab: int, invariant: bool, max_positions: int,
                  padding: str) -> SharedIndexFunctions:
  """The jitted prefill, step and logits of a transformers model, built once per model."""

  def run(params, cache, tokens, positions, slots):
    # transformers' Flax code relies on NumPy rank promotion (a bias [F] added to [B, T, F]).
    # Its attention mask is [B, S] over the slots; it adds the causal part itself.
    with jax.numpy_rank_promotion("allow"):
      out = model(tokens, attention_mask=(slots >= 0).astype(jnp.int32), position_ids=positions,
                  params=params, past_key_values=cache)
    return out.logits[..., :vocab], out.past_key_values

  def init_cache(params, batch, cache_length):
    del params  # transformers' caches depend on the config alone
    with jax.numpy_rank_promotion("allow"):  # it runs the model once (shapes only)
      return model.init_cache(batch, cache_length)

  return shared_index_functions((model, vocab), run, init_cache, invariant=invariant,
                                vocab=vocab, max_positions=max_positions, padding=padding)


def shared_index_functions(key, run: Callable, init_cache: Callable, *, invariant: bool,
                           vocab: int, max_positions: int,
                           padding: str = "right") -> SharedIndexFunctions:
  """The prefill, step, logits and prompt log-probabilities of a model whose KV cache writes
  every row of a call at one shared index (this module's docstring), built once per `key`.

  Args:
    key: what identifies the model's program (structure, vocabulary), hashable; `invariant`
      and `padding` are added to it here.
    run: `run(params, cache, tokens int32[B, T], positions int32[B, T], slots int32[B, S]) ->
      (logits [B, T, V], cache)`: the model writes the call's tokens at the cache's shared
      index; `slots[b, s]` is the position slot s holds for row b after the write (-1: none),
      from which `run` builds the model's attention mask.
    init_cache: `init_cache(params, batch, cache_length) -> cache`, evaluated for its shapes
      only (the cache starts as zeros): leaves `[B, S, ...]` and the write index, of rank 0 or
      1 (transformers' `cache_index`, flax's examples/gemma `end_index [B]`).
    invariant, vocab, max_positions: run `run` under `jaxdecode.batch_invariant`; V, the
      logits' width; the model's context.
    padding: "right" (row b's prompt in slots 0..len-1) or "left" (in slots T-len..T-1 of a
      T-wide prefill, as transformers' `generate` lays out a batch). The functions take and
      return right-padded prompts and logits either way.
  """
  left = _checks.one_of("padding", padding, PADDINGS) == "left"
  key = (key, invariant, padding)  # the options are part of the program
  if key in _FUNCTIONS:
    return _FUNCTIONS[key]
  # Under batch_invariant the state carries the weights as `Weights`: the copies of the weights
  # the model transposes are made once per prefill, not on every step (see `batch_invariant`).
  run = _batch_invariant(run, weights=0) if invariant else run

  def forward(params, tokens, lengths, cache_length):
    batch, width = tokens.shape
    shapes = jax.eval_shape(functools.partial(init_cache, params, batch, cache_length))
    cache = lax.optimization_barrier(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    columns = jnp.arange(width, dtype=jnp.int32)[None, :]
    shift = (width - lengths)[:, None] if left else jnp.zeros_like(lengths)[:, None]
    positions = columns - shift  # [B, T]: the position of each column's token (< 0: padding)
    if left:  # column c of row b holds its token c - shift (padding columns: its first token)
      tokens = jnp.take_along_axis(tokens, jnp.maximum(positions, 0), axis=1)
    slots = jnp.arange(cache_length, dtype=jnp.int32)[None, :] - shift
    slots = jnp.where((slots >= 0) & (slots < lengths[:, None]), slots, -1)  # [B, S]
    positions = jnp.maximum(positions, 0)
    if invariant:
      params = run.prepare(params, cache, tokens, positions, slots)
    logits, cache = run(params, cache, tokens, positions, slots)
    if left:  # back to the right-padded layout: token p's logits in column p
      logits = jnp.take_along_axis(logits, jnp.minimum(columns + shift, width - 1)[..., None],
                                   axis=1)
    return logits, {"cache": cache, "slots": slots, "params": params}

  @functools.partial(jax.jit, static_argnames="cache_length")
  def prefill_jit(params, tokens, lengths, cache_length):
    logits, state = forward(params, tokens, lengths, cache_length)
    return _last(logits, lengths), state

  def prefill(params, tokens, lengths, cache_length):
    tokens, lengths = _checked_prompts(tokens, lengths, cache_length, max_positions, vocab)
    logits, state = prefill_jit(params, tokens, lengths, cache_length)
    return logits, state, lengths

  @functools.partial(jax.jit, static_argnames="cache_length")
  def scored_jit(params, tokens, lengths, cache_length):
    logits, state = forward(params, tokens, lengths, cache_length)
    return _last(logits, lengths), state, token_logprobs(logits, tokens)

  def prompt_logprobs(params, tokens, lengths, cache_length):
    tokens, lengths = _checked_prompts(tokens, lengths, cache_length, max_positions, vocab)
    logits, state, logprobs = scored_jit(params, tokens, lengths, cache_length)
    return logits, state, lengths, logprobs

  @jax.jit
  def logits(params, tokens, lengths):
    tokens = jnp.asarray(tokens, jnp.int32)
    return forward(params, tokens, jnp.asarray(lengths, jnp.int32), tokens.shape[1])[0]

  step = jax.jit(functools.partial(_shared_index_step, run))
  step.position_limit = functools.partial(_position_limit, max_positions)
  step.whole_calls = True  # a call that does not fit is not written: see `_shared_index_step`
  fns = _FUNCTIONS[key] = SharedIndexFunctions(prefill, step, logits, prompt_logprobs)
  return fns


def _last(logits, lengths):
  """Each row's logits after its last prompt token: `[B, T, V]` -> `[B, V]`."""
  return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]


def token_logprobs(logits, tokens):
  """Each token's log-probability under the logits before it (the samplers' batch-invariant
  log-softmax): `logits [B, T, V]`, `tokens int32[B, T]` -> float32[B, T - 1]."""
  batch, width, vocab = logits.shape
  logp = sampling.log_softmax(processors.prepare(logits[:, :-1].reshape(-1, vocab)))
  logp = logp.reshape(batch, width - 1, vocab)
  return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=2)[..., 0]


def _checked_prompts(tokens, lengths, cache_length, max_positions, vocab):
  """int32 tokens [B, T] and lengths [B], checked against the cache and the vocabulary."""
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  if tokens.ndim != 2 or lengths.shape != tokens.shape[:1] or not tokens.size:
    raise ValueError(f"tokens must be int[B, T] (right-padded prompts) and lengths int[B]; got "
                     f"shapes {tokens.shape} / {lengths.shape}")
  cache_length = _checks.integer("cache_length", cache_length, low=1)
  if not tokens.shape[1] <= cache_length <= max_positions:
    raise ValueError(f"cache_length must hold the prompts and fit the model's positions: "
                     f"{tokens.shape[1]} <= cache_length={cache_length} <= {max_positions} is "
                     f"false; shorten the prompts or ask for fewer new tokens")
  if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
    raise ValueError(f"lengths must be in [1, {tokens.shape[1]}] (the prompts' width); got "
                     f"{lengths.min()}..{lengths.max()}")
  real = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  if ((tokens < 0) | (tokens >= vocab))[real].any():
    raise ValueError(f"prompt tokens must be ids in [0, {vocab}); got {tokens[real].min()}.."
                     f"{tokens[real].max()}")
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)


def _shared_index_step(run, state, tokens, positions):
  """The loops' step over a shared-index cache: `(state, tokens [B] or [B, K], positions [B])
  -> (logits, state)`; row b's tokens get positions `positions[b] + k`."""
  single = jnp.ndim(tokens) == 1
  tokens = jnp.asarray(tokens, jnp.int32)
  tokens = tokens[:, None] if single else tokens
  positions = jnp.asarray(positions, jnp.int32)
  width = tokens.shape[1]
  cache, slots = _make_room(state["cache"], state["slots"], positions, width)
  index = _cache_index(cache)
  fits = index + width <= slots.shape[1]
  new_positions = positions[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
  slots = lax.dynamic_update_slice(slots, new_positions, (jnp.int32(0), index))
  logits, cache = run(state["params"], cache, tokens, new_positions, slots)
  # A call that does not fit the cache would overwrite held slots: its logits are NaN, so the
  # loops stop there (`position_limit` and `whole_calls` let them refuse such a request
  # beforehand; one row's drafts past its last position are enough to make a call not fit).
  logits = jnp.where(fits, logits, jnp.nan)
  return (logits[:, 0] if single else logits), {**state, "cache": cache, "slots": slots}


def _is_index(leaf) -> bool:
  """A cache's write index: a leaf of rank 0 (transformers' `cache_index`) or 1 (flax's
  examples/gemma `end_index [B]`, which every row reads at row 0: one shared index too)."""
  return jnp.ndim(leaf) <= 1


def _cache_index(cache) -> jax.Array:
  return jnp.max(next(x for x in jax.tree.leaves(cache) if _is_index(x))).astype(jnp.int32)


def _with_index(cache, index):
  return jax.tree.map(
      lambda x: jnp.full(jnp.shape(x), index, x.dtype) if _is_index(x) else x, cache)


def _make_room(cache, slots, positions, width: int):
  """Forgets slots at or past each row's position (rejected drafts), moves the shared write
  index to just after the last slot a row holds, and, for a call that would not fit there,
  moves each row's held slots to the front, in order. Returns (cache, slots)."""
  slots = jnp.where(slots >= positions[:, None], -1, slots)
  size = slots.shape[1]
  last = jnp.max(jnp.where(jnp.any(slots >= 0, axis=0),
                           jnp.arange(1, size + 1, dtype=jnp.int32), 0))
  cache = _with_index(cache, last)
  # Needed only where rows moved apart (speculative rounds, a draft model's steps): decode and
  # beams from a prefill never get here on CPU and TPU; on GPU the gather runs as identity.
  needed = last + width > size

  def compact(x):
    cache, slots = x
    held = slots >= 0
    order = jnp.argsort(~held, axis=1, stable=True)  # held slots first, in slot order
    order = jnp.where(needed, order, jnp.arange(size, dtype=order.dtype)[None, :])
    gather = lambda a: jnp.take_along_axis(
        a, order.reshape(order.shape + (1,) * (a.ndim - 2)), axis=1)
    cache = jax.tree.map(lambda a: a if _is_index(a) else gather(a), cache)
    count = jnp.max(jnp.sum(held, axis=1, dtype=jnp.int32))
    return _with_index(cache, jnp.where(needed, count, last)), gather(slots)

  return _platform.skip_unless(needed, compact, (cache, slots))


def _position_limit(max_positions: int, state) -> int:
  """The positions the state holds for the loops' check (`decoding.check_fits`): every row can
  hold as many positions as the cache has slots (a call that would not fit at the shared write
  index first moves each row's slots to the front), and at most the model's context."""
  return min(max_positions, int(jnp.shape(state["slots"])[1]))
