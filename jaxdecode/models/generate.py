"""`generate`: text prompts in, continuations out, with the small transformer and `decode`."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode import _checks
from jaxdecode.beam import beam_search
from jaxdecode.decoding import decode
from jaxdecode.models.checkpoint import load_default
from jaxdecode.models.tokenizer import ByteTokenizer
from jaxdecode.models.transformer import DECODE_STATE_AXES, Transformer, make_step_fn, prefill
from jaxdecode.params import SamplingParams
from jaxdecode.processors import token_counts
from jaxdecode.prompts import bucket_length, right_pad
from jaxdecode.speculative import ModelDrafter, NgramDrafter, speculative_decode

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
    beams: with `beam_size`, the `num_return` best continuations of each prompt, best first
      (`texts` and the arrays above hold the best one); None otherwise.
    scores: with `beam_size`, float32[B, num_return] their beam scores; None otherwise.
    accepted, drafted: with `draft`, int32[B] drafts accepted and proposed per row; None
      otherwise.
    calls: with `draft`, the multi-token model calls made (one per round); None otherwise.
  """

  texts: list
  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finished: np.ndarray
  seconds: float
  beams: list | None = None
  scores: np.ndarray | None = None
  accepted: np.ndarray | None = None
  drafted: np.ndarray | None = None
  calls: int | None = None

  @property
  def tokens_per_second(self) -> float:
    return float(self.lengths.sum()) / max(self.seconds, 1e-9)

  @property
  def acceptance_rate(self) -> float | None:
    """With `draft`: the share of drafts accepted, over all rows (None without a draft)."""
    if self.drafted is None:
      return None
    return float(self.accepted.sum()) / max(float(self.drafted.sum()), 1.0)


def batch_prefill(model: Transformer, *, extra: int, pad_id: int = ByteTokenizer.PAD):
  """`prefill(prompts) -> (logits, state, positions)` for token lists, with room for `extra`
  more tokens per row: the `jaxdecode.audit` contract (right padding, bucketed widths)."""
  graphdef, weights = nnx.split(model)

  def run(prompts):
    tokens, lengths = right_pad(prompts, pad_id=pad_id)
    logits, state = prefill(graphdef, weights, tokens, lengths,
                            cache_length=tokens.shape[1] + extra)
    return logits, state, lengths

  return run


def _step_fn(graphdef):
  if graphdef not in _STEP_FNS:
    _STEP_FNS[graphdef] = make_step_fn(graphdef)
  return _STEP_FNS[graphdef]


def generate(prompts: Sequence[str], *, model: Transformer | None = None,
             params: SamplingParams | None = None, seed: int = 0, key=None,
             max_new_tokens: int = 128, tokenizer: ByteTokenizer | None = None,
             penalize_prompt: bool = False, beam_size: int | None = None,
             num_return: int | None = None, length_penalty: float = 1.0, draft=None,
             num_draft_tokens: int = 4) -> Generation:
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
    beam_size: None (the default) samples with `params` and `key`; K runs
      `jaxdecode.beam_search` with K beams per prompt instead (deterministic: no key; `params`
      apply to every beam, see `beam_search`).
    num_return: with `beam_size`, how many of the best beams to return per prompt (default K).
    length_penalty: with `beam_size`, the exponent of the length in the beam scores.
    draft: None (one model call per token), `"ngram"` (prompt lookup: drafts copied from
      earlier text of the row) or a small `Transformer` with the same vocabulary (e.g.
      `load_draft()`): speculative decoding with `jaxdecode.speculative_decode`. The output is
      bit for bit the output without a draft, for every `params` and key; only the number of
      model calls (and the time) changes. Not with `beam_size`.
    num_draft_tokens: with `draft`, the tokens drafted and verified per model call (1..16).

  Returns:
    A `Generation`. The same key, prompts and params give the same texts (with or without a
    draft).

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
  _check_draft(draft, num_draft_tokens, model, beam_size)

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
  tokens, lengths = right_pad(ids, pad_id=tokenizer.PAD, width=width)
  graphdef, weights = nnx.split(model)
  # A verification call writes K + 1 tokens; slots past the last one decode needs only ever
  # hold drafts that are thrown away (and positions past max_len give NaN logits, unused).
  # (up to max_len: past it only discarded drafts would land).
  room = max_new_tokens + (num_draft_tokens + 1 if draft is not None else 0)
  cache_length = min(width + room, context)
  logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=cache_length)
  key = jax.random.key(seed) if key is None else key
  counts = None
  if penalize_prompt:
    real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]  # right padding
    counts = token_counts(tokens, model.config.vocab_size, mask=real)
  if beam_size is not None:
    return _beam_generation(graphdef, state, logits, lengths, counts, started, tokenizer, params,
                            max_new_tokens, beam_size, num_return, length_penalty)
  stats = {}
  if draft is None:
    out = decode(_step_fn(graphdef), state, logits, key=key, params=params,
                 max_new_tokens=max_new_tokens, positions=lengths, eos_ids=[tokenizer.EOS],
                 pad_id=tokenizer.PAD, counts=counts)
  else:
    if isinstance(draft, str):
      drafter = NgramDrafter(tokens, lengths)
    else:
      if draft.config.max_len < width:
        raise ValueError(f"the draft model's context ({draft.config.max_len} tokens) is shorter "
                         f"than the prompts ({width} tokens, padded); use a draft with a longer "
                         f"max_len or draft='ngram'")
      draft_graphdef, draft_weights = nnx.split(draft)
      _, draft_state = prefill(draft_graphdef, draft_weights, tokens, lengths,
                               cache_length=min(cache_length, draft.config.max_len))
      drafter = ModelDrafter(draft_state, _step_fn(draft_graphdef))
    out = speculative_decode(_step_fn(graphdef), state, logits, key=key, params=params,
                             max_new_tokens=max_new_tokens, positions=lengths,
                             drafter=drafter, num_draft_tokens=num_draft_tokens,
                             eos_ids=[tokenizer.EOS], pad_id=tokenizer.PAD, counts=counts)
    stats = dict(accepted=np.asarray(out.accepted), drafted=np.asarray(out.drafted),
                 calls=int(out.calls))
  new_tokens = np.asarray(out.tokens)
  seconds = time.perf_counter() - started
  out_lengths = np.asarray(out.lengths)
  texts = [tokenizer.decode(row[:n]) for row, n in zip(new_tokens, out_lengths)]
  return Generation(texts, new_tokens, np.asarray(out.logprobs), out_lengths,
                    np.asarray(out.finished), seconds, **stats)


def _check_draft(draft, num_draft_tokens, model: Transformer, beam_size) -> None:
  if draft is None:
    return
  if isinstance(draft, str):
    if draft != "ngram":
      raise ValueError(f"draft must be None, 'ngram' or a Transformer; got {draft!r}")
  elif isinstance(draft, Transformer):
    if draft.config.vocab_size != model.config.vocab_size:
      raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not "
                       f"the model's ({model.config.vocab_size}); a draft must share the "
                       f"tokenizer")
  else:
    raise ValueError(f"draft must be None, 'ngram' or a Transformer; got "
                     f"{type(draft).__name__}")
  _checks.integer("num_draft_tokens", num_draft_tokens, low=1, high=16)
  if beam_size is not None:
    raise ValueError("draft and beam_size exclude each other: speculative decoding speeds up "
                     "sampling and greedy decoding, not beam search")


def _beam_generation(graphdef, state, logits, lengths, counts, started, tokenizer, params,
                     max_new_tokens, beam_size, num_return, length_penalty) -> Generation:
  """`generate` with beam search, from the prefill on: the best beam in the main fields, the
  `num_return` best in `beams` and `scores`."""
  out = beam_search(_step_fn(graphdef), state, logits, beam_size=beam_size,
                    num_return=num_return, max_new_tokens=max_new_tokens, positions=lengths,
                    eos_ids=[tokenizer.EOS], pad_id=tokenizer.PAD, length_penalty=length_penalty,
                    params=params, counts=counts, state_axes=DECODE_STATE_AXES)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)  # [B, R, N], [B, R]
  seconds = time.perf_counter() - started
  beams = [[tokenizer.decode(t[:n]) for t, n in zip(row, row_lengths)]
           for row, row_lengths in zip(tokens, lengths)]
  return Generation([row[0] for row in beams], tokens[:, 0], np.asarray(out.logprobs)[:, 0],
                    lengths[:, 0], np.asarray(out.finished)[:, 0], seconds, beams=beams,
                    scores=np.asarray(out.scores))
