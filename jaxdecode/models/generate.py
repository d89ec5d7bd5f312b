"""`generate`: text prompts in, continuations out, with the small transformer and `decode`."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from jaxdecode import _checks
from jaxdecode.decoding import decode
from jaxdecode.models.checkpoint import load_default
from jaxdecode.models.tokenizer import ByteTokenizer
from jaxdecode.models.transformer import Transformer, make_step_fn, prefill
from jaxdecode.params import SamplingParams
from jaxdecode.processors import token_counts
from jaxdecode.prompts import bucket_length, left_pad, prompt_mask

_STEP_FNS: dict = {}  # one jitted step function per model structure, so decode compiles once


@dataclasses.dataclass(frozen=True)
class Generation:
  """What `generate` returns.

  Attributes:
    texts: the continuation of each prompt (without the prompt and without EOS).
    tokens: int32[B, N] the new tokens (`PAD` after EOS).
    logprobs: float32[B, N] each token's log-probability under its processed distribution.
    lengths: int32[B] new tokens per row, including the EOS if any.
    finished: bool[B] whether the row ended with EOS.
    seconds: wall-clock time of the whole call (the first call includes compilation).
  """

  texts: list
  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finished: np.ndarray
  seconds: float

  @property
  def tokens_per_second(self) -> float:
    return float(self.lengths.sum()) / max(self.seconds, 1e-9)


def _step_fn(graphdef):
  if graphdef not in _STEP_FNS:
    _STEP_FNS[graphdef] = make_step_fn(graphdef)
  return _STEP_FNS[graphdef]


def generate(prompts: Sequence[str], *, model: Transformer | None = None,
             params: SamplingParams | None = None, seed: int = 0, key=None,
             max_new_tokens: int = 128, tokenizer: ByteTokenizer | None = None,
             penalize_prompt: bool = False) -> Generation:
  """Continues each text prompt; all prompts run as one batch.

  Args:
    prompts: non-empty strings.
    model: a `Transformer` (default: the embedded model, `load_default()`).
    params: `SamplingParams` (default: temperature 1); scalars or one value per prompt.
    seed: used when `key` is None: `key = jax.random.key(seed)`.
    key: one key (row r uses `fold_in(key, r)`) or one key per prompt.
    max_new_tokens: the most tokens to generate per prompt (EOS may stop a row earlier).
    tokenizer: the byte tokenizer (default `ByteTokenizer()`).
    penalize_prompt: whether the prompt's tokens count for the penalties of `params` (HF's
      repetition_penalty does count them); by default only generated tokens count (OpenAI's
      and vLLM's presence and frequency penalties).

  Returns:
    A `Generation`. The same key, prompts and params give the same texts.

  Raises:
    ValueError: for an empty prompt list or prompt, or a prompt that with `max_new_tokens`
      does not fit the model's context (`config.max_len`).
  """
  prompts = _checks.text_prompts(prompts)
  max_new_tokens = _checks.integer("max_new_tokens", max_new_tokens, low=1)
  if model is None:
    model, tokenizer = load_default()
  tokenizer = tokenizer or ByteTokenizer()
  params = SamplingParams() if params is None else params

  context = model.config.max_len
  ids = [tokenizer.encode(p) for p in prompts]
  longest = max(len(i) for i in ids)
  if longest + max_new_tokens > context:
    raise ValueError(f"a prompt of {longest - 1} bytes plus max_new_tokens={max_new_tokens} does "
                     f"not fit the model's context of {context} tokens; shorten the prompt or "
                     f"lower max_new_tokens")
  width = bucket_length(longest)  # a few widths, so new prompts rarely compile
  if width + max_new_tokens > context:
    width = longest
  started = time.perf_counter()
  tokens, lengths = left_pad(ids, pad_id=tokenizer.PAD, width=width)
  graphdef, weights = nnx.split(model)
  logits, state = prefill(graphdef, weights, tokens, lengths,
                          cache_length=width + max_new_tokens)
  key = jax.random.key(seed) if key is None else key
  counts = None
  if penalize_prompt:
    counts = token_counts(tokens, model.config.vocab_size,
                          mask=prompt_mask(lengths, tokens.shape[1]))
  out = decode(_step_fn(graphdef), state, logits, key=key, params=params,
               max_new_tokens=max_new_tokens, positions=lengths, eos_ids=[tokenizer.EOS],
               pad_id=tokenizer.PAD, counts=counts)
  new_tokens = np.asarray(out.tokens)
  seconds = time.perf_counter() - started
  out_lengths = np.asarray(out.lengths)
  texts = [tokenizer.decode(row[:n]) for row, n in zip(new_tokens, out_lengths)]
  return Generation(texts, new_tokens, np.asarray(out.logprobs), out_lengths,
                    np.asarray(out.finished), seconds)
