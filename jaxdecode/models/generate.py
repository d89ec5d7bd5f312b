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
from jaxdecode import adapters
from jaxdecode import structured
from jaxdecode.beam import beam_search
from jaxdecode.decoding import check_forced_tokens, decode
from jaxdecode.models import adapters as model_adapters
from jaxdecode.models import extras
from jaxdecode.models.adapters import step_fn_for  # noqa: F401  (re-exported: its old home)
from jaxdecode.models.tokenizer import ByteTokenizer
from jaxdecode.models.transformer import Transformer, prefill
from jaxdecode.params import SamplingParams, check_eos_not_forced
from jaxdecode.processors import token_counts
from jaxdecode.prompts import bucket_length, right_pad
from jaxdecode.speculative import ModelDrafter, NgramDrafter, speculative_decode


@dataclasses.dataclass(frozen=True)
class Generation:
  """What `generate` returns.

  B is the number of rows: prompts · n, prompt-major (row b·n + i is sample i of prompt b).

  Attributes:
    texts: the continuation of each row (without the prompt, EOS and, unless `include_stop`,
      the stop string).
    tokens: int32[B, N] the new tokens (`PAD` after EOS or after a stop string's last token).
    logprobs: float32[B, N] each token's log-probability in `logprobs_mode` (by default under
      its processed distribution); 0 after the row's end.
    lengths: int32[B] new tokens per row, including the EOS or the stop string's tokens.
    finished: bool[B] whether the row ended with EOS or a stop string.
    dead_end: bool[B] whether the row stopped at a step with nothing selectable
      (`DecodeOutput.dead_end`; with `beam_size`, `BeamOutput.dead_end`). `generate` refuses the
      requests it can foresee that of (a prompt past the context, params that leave nothing).
    seconds: wall-clock time of the whole call (the first call includes compilation).
    beams: with `beam_size`, the `num_return` best continuations of each prompt, best first
      (`texts` and the arrays above hold the best one), fewer where the prompt has fewer
      possible continuations (bans, truncation, temperature 0); None otherwise.
    scores: with `beam_size`, float32[B, num_return] their beam scores (-inf after the last of
      a prompt's `beams`); None otherwise.
    accepted, drafted: with `draft`, int32[B] drafts accepted and proposed per row; None
      otherwise.
    calls: with `draft`, the multi-token model calls made (one per round); None otherwise.
    top_tokens: with `top_logprobs=K`, int32[B, N, K] the K most likely tokens of each step,
      best first (PAD after the row's end); None otherwise.
    top_logprobs: with `top_logprobs=K`, float32[B, N, K] their log-probabilities in
      `logprobs_mode` (-inf for removed tokens in "processed"); None otherwise.
    prompt_logprobs: with `prompt_logprobs=True`, one float32 array per prompt (not per
      sample): the log-probability of each prompt byte given the text before it (BOS has
      none), under the model's own distribution; None otherwise.
    logprob_kinds: with `logprob_kinds=True`, a `jaxdecode.Scores` of float32[B, N] numpy
      arrays: each token's raw, tempered and processed log-probability and the log of the
      tempered mass its processed distribution kept (`jaxdecode.scoring`; 0 after the row's
      end, a stop string's included); None otherwise. `jaxdecode.score` recomputes them from
      one forward pass, bitwise.
  """

  texts: list
  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finished: np.ndarray
  seconds: float
  dead_end: np.ndarray
  beams: list | None = None
  scores: np.ndarray | None = None
  accepted: np.ndarray | None = None
  drafted: np.ndarray | None = None
  calls: int | None = None
  top_tokens: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None
  prompt_logprobs: list | None = None
  logprob_kinds: object = None

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


def generate(prompts: Sequence[str], *, model=None,
             params: SamplingParams | None = None, seed: int = 0, key=None,
             max_new_tokens: int = 128, tokenizer: ByteTokenizer | None = None,
             penalize_prompt: bool = False, beam_size: int | None = None,
             num_return: int | None = None, length_penalty: float = 1.0, draft=None,
             num_draft_tokens: int = 4, stop=None, include_stop: bool = False, n: int = 1,
             top_logprobs: int = 0, logprobs_mode: str = "processed",
             prompt_logprobs: bool = False, regex=None, json_schema=None,
             choices=None, constraint=None, logprob_kinds: bool = False,
             forced_tokens=None) -> Generation:
  """Continues each text prompt; all prompts run as one batch.

  Args:
    prompts: non-empty strings.
    model: a `Transformer` (default: the embedded model, `load_default()`) or a
      `jaxdecode.adapters.Adapter` with a tokenizer (e.g. `adapters.transformers(model,
      params, tokenizer)`): every option below works through an adapter.
    params: `SamplingParams` (default: temperature 1); scalars or one value per prompt.
    seed: used when `key` is None: `key = jax.random.key(seed)`, an integer in [0, 2**32).
    key: one key (row r uses `fold_in(key, r)`) or one key per prompt.
    max_new_tokens: the most tokens to generate per prompt (EOS may stop a row earlier).
    tokenizer: with a `Transformer`, its tokenizer (default `ByteTokenizer()`); an adapter
      has its own.
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
      `load_draft()`), or an `Adapter` of the same vocabulary (a smaller model of the same
      family): speculative decoding with `jaxdecode.speculative_decode`. The output is
      bit for bit the output without a draft, for every `params` and key; only the number of
      model calls (and the time) changes. Not with `beam_size`.
    num_draft_tokens: with `draft`, the tokens drafted and verified per model call (1..16);
      with an adapter whose calls are written whole (`step_fn.whole_calls`: transformers' and
      NNX models), fewer where the context leaves no room for them past `max_new_tokens`
      (none: one call per token), which changes no token.
    stop: a string or a list of non-empty strings: a row ends at the first occurrence of any
      of them in its new text (the earliest-ending one), its later tokens become PAD and it
      counts as finished. The cut is made on the decoded text after the loop: the model still
      computes the row's tokens up to EOS or `max_new_tokens` (`stream` stops early instead,
      once every row has ended). Not with a constraint (a constrained row ends only where
      its text is a whole match: write the end into the pattern).
    include_stop: whether the text keeps the stop string (by default it ends before it; the
      stop string's tokens are kept in `tokens` either way).
    n: samples per prompt (>= 1). Rows are prompt-major; with n > 1, sample i of prompt b is
      drawn with row key `fold_in(row_key_b, i)` (row_key_b = `fold_in(key, b)`, or `key[b]`
      for one key per prompt), so it equals a separate call with that key. Each prompt is
      prefilled once and its cache copied. Not with `beam_size`.
    top_logprobs: K in 1..20 for the K most likely tokens of each step and their
      log-probabilities (`top_tokens`, `top_logprobs`); 0 for none. Not with `beam_size` or
      `draft`.
    logprobs_mode: "processed" (the distribution each token was drawn from) or "raw" (the
      model's own log-softmax); applies to `logprobs` and the top lists. "raw" not with
      `beam_size` or `draft`.
    prompt_logprobs: whether to return each prompt token's log-probability under the model
      (`Generation.prompt_logprobs`), computed in the prefill pass.
    regex, json_schema, choices: structured output (at most one of them; see
      `jaxdecode.structured`): a regular expression the new text must match as a whole, a JSON
      schema (a dict or a JSON string) it must validate against, or a list of strings it must
      be one of. Give one for every prompt, or a list with one per prompt (`None`: that prompt
      is unconstrained; for `choices`, a list of option lists). A row that ends with EOS is a
      whole match (`finished`); one stopped by `max_new_tokens` holds a prefix of one, and
      one stopped at a dead end (`dead_end`, e.g. a `min_new_tokens` longer than the text it
      took) holds a whole match that is not `finished`. Not with `stop`. A `min_new_tokens`
      longer than every text of the constraint is refused.
    constraint: instead of those three, a `jaxdecode.structured` constraint built yourself
      (one for every row, or `structured.stack` of one per row: prompts · n).
    logprob_kinds: whether to return every log-probability kind of each token
      (`Generation.logprob_kinds`: raw, tempered, processed, kept_logmass), for an RL trainer
      that scores the same tokens with `jaxdecode.score`. Not with `beam_size`.
    forced_tokens: `int[B, max_new_tokens]` (B = prompts · n rows), tokens to emit instead of
      sampling them (`decode(forced_tokens=...)`: replaying a rollout, e.g. another sampler's,
      to get its log-probabilities of each kind here); a row still ends at EOS. Not with
      `beam_size` or `draft`.

  Returns:
    A `Generation`. The same key, prompts and params give the same texts (with or without a
    draft).

  Raises:
    ValueError: for an empty prompt list or prompt, a prompt that with `max_new_tokens` does
      not fit the model's context (`config.max_len`), n < 1 (or more rows than int32 holds),
      top_logprobs outside 1..20, an empty stop string, an unknown logprobs_mode, params that
      leave a row nothing to select, or options that exclude each other; all before the
      prompts are prefilled.
  """
  if beam_size is not None:
    _checks.beam_options(beam_size, num_return, length_penalty)
  logprob_kinds = _checks.boolean("logprob_kinds", logprob_kinds)
  if beam_size is not None and logprob_kinds:
    raise ValueError(f"logprob_kinds does not apply to beam search (beam_size={beam_size}): a "
                     f"beam is chosen by its joint score, not sampled, so it has no sampling "
                     f"log-probability of each kind")
  if forced_tokens is not None and (beam_size is not None or draft is not None):
    raise ValueError("forced_tokens replays tokens through decode: not with beam_size or draft "
                     "(give the tokens alone: the replay needs no draft, and a beam is not "
                     "sampled)")
  if forced_tokens is not None:  # its shape and ids, before the prompts are prefilled
    rows = len(_checks.text_prompts(prompts)) * _checks.integer("n", n, low=1)
    vocab = (ByteTokenizer.vocab_size if model is None else
             model_adapters.resolve(model, tokenizer).vocab_size)
    forced_tokens = check_forced_tokens(forced_tokens, rows, _checks.integer(
        "max_new_tokens", max_new_tokens, low=1), vocab, "generate")
  batch = prepare(prompts, model=model, params=params, seed=seed, key=key,
                  max_new_tokens=max_new_tokens, tokenizer=tokenizer,
                  penalize_prompt=penalize_prompt, beam_size=beam_size, draft=draft,
                  num_draft_tokens=num_draft_tokens, stop=stop, include_stop=include_stop, n=n,
                  top_logprobs=top_logprobs, logprobs_mode=logprobs_mode,
                  prompt_logprobs=prompt_logprobs, regex=regex, json_schema=json_schema,
                  choices=choices, constraint=constraint)
  tokenizer = batch.tokenizer
  if beam_size is not None:
    return _beam_generation(batch.adapter, batch.state, batch.logits, batch.positions,
                            batch.counts, batch.started, tokenizer, batch.params, max_new_tokens,
                            beam_size, num_return, length_penalty,
                            prompt_logprobs=batch.prompt_logprobs, constraint=batch.constraint,
                            prompt_tokens=batch.prompt_tokens)
  stats = {}
  options = dict(key=batch.key, params=batch.params, max_new_tokens=max_new_tokens,
                 positions=batch.positions, eos_ids=batch.adapter.eos_ids,
                 pad_id=batch.adapter.pad_id,
                 counts=batch.counts, constraint=batch.constraint,
                 prompt_tokens=batch.prompt_tokens)
  # A verification call writes K + 1 positions for every row, finished rows too. The embedded
  # model drops what lands past its cache; a step that writes a call whole or not at all (an
  # adapter over a shared-index cache: `whole_calls`) gets, near the model's context, only as
  # many drafts as its cache holds past each row's last token (the tokens are the same with
  # fewer drafts, or none).
  drafts = 0 if draft is None else num_draft_tokens
  if drafts and getattr(batch.adapter.step_fn, "whole_calls", False):
    drafts = min(drafts, batch.cache_length - batch.width - max_new_tokens)
  if drafts < 1:
    out = decode(batch.adapter.step_fn, batch.state, batch.logits, **options,
                 top_logprobs=batch.top_logprobs, logprobs_mode=batch.logprobs_mode,
                 scores=logprob_kinds, forced_tokens=forced_tokens)
    if draft is not None:  # one call per token after the prefill's
      rows = len(batch.ids) * batch.n
      stats = dict(accepted=np.zeros(rows, np.int32), drafted=np.zeros(rows, np.int32),
                   calls=max(int(np.max(out.lengths)) - 1, 0))
  else:
    out = speculative_decode(batch.adapter.step_fn, batch.state, batch.logits, **options,
                             drafter=_drafter(draft, batch), num_draft_tokens=drafts,
                             scores=logprob_kinds)
    stats = dict(accepted=np.asarray(out.accepted), drafted=np.asarray(out.drafted),
                 calls=int(out.calls))
  new_tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
  out_lengths, finished = np.asarray(out.lengths), np.asarray(out.finished)
  tops = (None, None) if out.top_tokens is None else (np.asarray(out.top_tokens),
                                                      np.asarray(out.top_logprobs))
  kinds = None if out.scores is None else type(out.scores)(*map(np.asarray, out.scores))
  if batch.stop:
    texts, out_lengths, stopped, keep = extras.cut_at_stops(
        new_tokens, out_lengths, batch.stop, batch.include_stop, pieces=batch.pieces)
    new_tokens = np.where(keep, new_tokens, batch.adapter.pad_id)
    logprobs = np.where(keep, logprobs, 0.0).astype(np.float32)
    finished = finished | stopped
    if tops[0] is not None:
      tops = (np.where(keep[..., None], tops[0], batch.adapter.pad_id),
              np.where(keep[..., None], tops[1], 0.0).astype(np.float32))
    if kinds is not None:
      kinds = type(kinds)(*(np.where(keep, k, 0.0).astype(np.float32) for k in kinds))
  else:
    texts = [tokenizer.decode(row[:k]) for row, k in zip(new_tokens, out_lengths)]
  seconds = time.perf_counter() - batch.started
  return Generation(texts, new_tokens, logprobs, out_lengths, finished, seconds,
                    np.asarray(out.dead_end), **stats,
                    top_tokens=tops[0], top_logprobs=tops[1],
                    prompt_logprobs=batch.prompt_logprobs, logprob_kinds=kinds)


@dataclasses.dataclass
class Prepared:
  """A checked request after the prefill: what `generate` and `stream` decode from.

  Rows are prompts · n, prompt-major; `state`, `logits`, `lengths` and `counts` are per row
  (each prompt's prefill copied n times), `key` holds one typed key per row when n > 1.
  """
  tokenizer: object
  adapter: adapters.Adapter
  ids: list
  tokens: jax.Array
  lengths: jax.Array
  width: int
  room: int  # cache slots past the prompts' width (min(width + room, context) in all)
  cache_length: int
  logits: jax.Array
  state: object
  key: jax.Array
  params: SamplingParams
  counts: jax.Array | None
  started: float
  n: int
  stop: tuple
  include_stop: bool
  top_logprobs: int
  logprobs_mode: str
  prompt_logprobs: list | None
  constraint: object = None
  positions: jax.Array | None = None  # each row's first new position (the adapter's prefill)

  @property
  def pieces(self):
    """The bytes of each token id for stop strings (None: the byte tokenizer's ids)."""
    return getattr(self.tokenizer, "pieces", None)

  @property
  def prompt_tokens(self) -> jax.Array:
    """int32[B, T]: each row's prompt, -1 after its end (the loops' `prompt_tokens`, so that
    the rules that read a row's history see the prompt, as transformers and llama.cpp do)."""
    return prompt_ids(self.tokens, self.lengths)


@jax.jit
def prompt_ids(tokens, lengths):
  """Right-padded prompts `[B, T]` with `lengths` -> the same with -1 on the padding."""
  real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
  return jnp.where(real, tokens, -1).astype(jnp.int32)


def prepare(prompts, *, model, params, seed, key, max_new_tokens, tokenizer, penalize_prompt,
            beam_size, draft, num_draft_tokens, stop, include_stop, n, top_logprobs,
            logprobs_mode, prompt_logprobs, regex=None, json_schema=None,
            choices=None, constraint=None) -> Prepared:
  """Checks `generate`'s arguments (all of them, before anything compiles), prefills each
  prompt once and copies its rows n times. Returns a `Prepared`."""
  prompts = _checks.text_prompts(prompts)
  max_new_tokens = _checks.integer("max_new_tokens", max_new_tokens, low=1)
  # Rows (prompts · n) are indexed in int32.
  n = _checks.integer("n", n, low=1, high=np.iinfo(np.int32).max // len(prompts))
  stop = _checks.stop_strings(stop)
  include_stop = _checks.boolean("include_stop", include_stop)
  top_logprobs = _checks.top_logprobs(top_logprobs)
  logprobs_mode = _checks.logprobs_mode(logprobs_mode)
  prompt_logprobs = _checks.boolean("prompt_logprobs", prompt_logprobs)
  _check_excluded(beam_size, draft, n, stop, top_logprobs, logprobs_mode)
  adapter = model_adapters.resolve(model, tokenizer)
  tokenizer, vocab, eos_ids = adapter.tokenizer, adapter.vocab_size, list(adapter.eos_ids)
  params = SamplingParams() if params is None else params
  _checks.instance("params", params, SamplingParams, "a jaxdecode.SamplingParams")
  draft = _check_draft(draft, num_draft_tokens, adapter, beam_size)
  if key is None:
    key = jax.random.key(_checks.integer("seed", seed, low=0, high=_checks.MAX_SEED))
  _checks.key(key, len(prompts))

  context = adapter.max_positions
  ids = [tokenizer.encode(p) for p in prompts]
  longest = max(len(i) for i in ids)
  if longest + max_new_tokens > context:
    size = (f"{longest - 1} bytes" if isinstance(tokenizer, ByteTokenizer)
            else f"{longest} tokens")
    raise ValueError(f"a prompt of {size} plus max_new_tokens={max_new_tokens} does "
                     f"not fit the model's context of {context} tokens; shorten the prompt or "
                     f"lower max_new_tokens")
  width = bucket_length(longest)  # a few widths, so new prompts rarely compile
  if width + max_new_tokens > context:
    width = longest
  if isinstance(draft, adapters.Adapter) and draft.max_positions < width:
    raise ValueError(f"the draft model's context ({draft.max_positions} tokens) is shorter "
                     f"than the prompts ({width} tokens, padded); use a draft with a "
                     f"longer max_len or draft='ngram'")
  # Per-row values and token ids against the prompts and the vocabulary, before the prefill.
  params.broadcast(len(prompts), vocab)
  check_eos_not_forced(params, eos_ids, vocab)
  _check_min_new_tokens(params, max_new_tokens)
  if beam_size is not None:
    _checks.beam_size_fits(beam_size, len(prompts), vocab)
  if constraint is not None:
    if any(v is not None for v in (regex, json_schema, choices)):
      raise ValueError("give constraint= or one of regex, json_schema and choices, not both")
    structured.check(constraint, len(prompts) * n, vocab, "generate")
  else:
    constraint = _constraint(regex, json_schema, choices, len(prompts), n, adapter)
  if constraint is not None:
    if stop:
      raise ValueError(_STOP_WITH_CONSTRAINT)
    if not eos_ids:
      raise ValueError(f"a constraint needs an EOS id to end a match; {adapter.name} has none: "
                       f"give the adapter eos_ids=[...]")
    structured.check_eos(constraint, eos_ids, "generate")
    structured.check_token_sets(constraint, params, len(prompts), n)
    structured.check_min_new_tokens(constraint, params, len(prompts), n)
  started = time.perf_counter()
  tokens, lengths = right_pad(ids, pad_id=adapter.pad_id, width=width)
  # A verification call writes K + 1 tokens; slots past the last one decode needs only ever
  # hold drafts that are thrown away: room for them up to max_len (past it, only discarded
  # drafts would land, with NaN logits).
  room = max_new_tokens + (num_draft_tokens + 1 if draft is not None else 0)
  cache_length = min(width + room, context)
  prompt_lp = None
  if prompt_logprobs:
    if adapter.prompt_logprobs is None:
      raise ValueError(f"prompt_logprobs is not available with {adapter.name} (its adapter has "
                       f"no prompt_logprobs function)")
    logits, state, positions, lp = adapter.prompt_logprobs(tokens, lengths, cache_length)
    lp = np.asarray(lp)
    prompt_lp = [lp[b, :len(i) - 1] for b, i in enumerate(ids)]
  else:
    logits, state, positions = adapter.prefill(tokens, lengths, cache_length)
  counts = None
  if penalize_prompt:
    real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]  # right padding
    counts = token_counts(tokens, vocab, mask=real)
  if n > 1:
    params = params.rows(np.repeat(np.arange(len(prompts)), n))
    key = extras.sample_keys(key, len(prompts), n)
    state = adapter.repeat_rows(state, n)
    logits, tokens, lengths, counts, positions = extras.repeat_rows(
        (logits, tokens, lengths, counts, positions), n)
  return Prepared(tokenizer, adapter, ids, tokens, lengths, width, room, cache_length, logits,
                  state, key, params, counts, started, n, stop, include_stop, top_logprobs,
                  logprobs_mode, prompt_lp, constraint, positions)


_STOP_WITH_CONSTRAINT = (
    "stop strings cannot be combined with a constraint (regex, json_schema, choices or "
    "constraint=): a constrained row ends only where its text is a whole match (with EOS), and "
    "a stop string would end it inside one; write where the text ends into the pattern instead "
    "(e.g. regex='[^.]*\\.' ends at the first period)")


def _constraint(regex, json_schema, choices, prompts: int, n: int,
                adapter: adapters.Adapter):
  """The `jaxdecode.structured` constraint of generate's `regex=`, `json_schema=` or `choices=`
  (one for all rows, or one per row: prompts · n, prompt-major), or None."""
  given = [(name, value) for name, value in (("regex", regex), ("json_schema", json_schema),
                                              ("choices", choices)) if value is not None]
  if not given:
    return None
  if len(given) > 1:
    raise ValueError(f"give at most one of regex, json_schema and choices; got "
                     f"{', '.join(name for name, _ in given)}")
  name, value = given[0]
  if not hasattr(adapter.tokenizer, "vocabulary"):
    raise ValueError(f"{name} needs a tokenizer with vocabulary() (jaxdecode.structured); got "
                     f"{type(adapter.tokenizer).__name__}")
  vocabulary = adapter.vocabulary()
  if len(vocabulary) != adapter.vocab_size:
    raise ValueError(f"the tokenizer's vocabulary has {len(vocabulary)} tokens but the model "
                     f"{adapter.vocab_size}")
  build = {"regex": structured.regex, "json_schema": structured.json_schema,
           "choices": structured.choice}[name]
  one = {"regex": lambda v: isinstance(v, str), "json_schema": lambda v: isinstance(v, (str, dict)),
         "choices": lambda v: isinstance(v, (list, tuple)) and all(isinstance(o, str) for o in v)
         and len(v) > 0}[name]
  if one(value):
    return build(value, vocabulary)
  if not isinstance(value, (list, tuple)) or len(value) != prompts:
    raise ValueError(f"{name} must be one {'option list' if name == 'choices' else name} for "
                     f"every prompt, or a list with one per prompt ({prompts}; None for an "
                     f"unconstrained prompt); got {value!r:.80}")
  per_prompt = [None if v is None else build(v, vocabulary) for v in value]
  if all(c is None for c in per_prompt):
    return None
  return structured.stack([c for c in per_prompt for _ in range(n)])


def _check_min_new_tokens(params: SamplingParams, max_new_tokens: int) -> None:
  """ValueError for a min_new_tokens above max_new_tokens (EOS could never end such a row: ask
  for exactly max_new_tokens tokens with min_new_tokens = max_new_tokens)."""
  if _checks.is_traced(params.min_new_tokens):
    return
  most = int(np.max(np.asarray(params.min_new_tokens)))
  if most > max_new_tokens:
    raise ValueError(f"min_new_tokens ({most}) is more than max_new_tokens ({max_new_tokens}): "
                     f"no row could end with EOS; use min_new_tokens <= max_new_tokens "
                     f"(equal: exactly max_new_tokens tokens)")


def _drafter(draft, batch: Prepared):
  """The drafter of `speculative_decode` for `draft` ("ngram" or an adapter), over the rows."""
  if isinstance(draft, str):
    return NgramDrafter(batch.tokens, batch.lengths)
  if isinstance(draft, Transformer):
    draft = model_adapters.embedded(draft, batch.tokenizer)
  tokens, lengths = right_pad(batch.ids, pad_id=batch.adapter.pad_id, width=batch.width)
  _, draft_state, _ = draft.prefill(tokens, lengths,
                                    min(batch.width + batch.room, draft.max_positions))
  if batch.n > 1:
    draft_state = draft.repeat_rows(draft_state, batch.n)
  return ModelDrafter(draft_state, draft.step_fn)


def _check_excluded(beam_size, draft, n, stop, top_logprobs, logprobs_mode) -> None:
  """ValueError for options that do not go together."""
  if beam_size is not None:
    for name, on in (("n > 1", n > 1), ("stop", bool(stop)), ("top_logprobs", top_logprobs > 0),
                     ("logprobs_mode='raw'", logprobs_mode == "raw")):
      if on:
        raise ValueError(f"{name} does not apply to beam search (beam_size={beam_size}): beam "
                         f"search returns num_return best beams, scored by processed "
                         f"log-probabilities")
  if draft is not None:
    what = f"draft={draft!r:.40}" if isinstance(draft, str) else "a draft model"
    for name, on in (("top_logprobs", top_logprobs > 0),
                     ("logprobs_mode='raw'", logprobs_mode == "raw")):
      if on:
        raise ValueError(f"{name} is not available with {what}: speculative decoding returns "
                         f"processed log-probabilities only")


def _check_draft(draft, num_draft_tokens, adapter: adapters.Adapter, beam_size):
  """ValueError for a bad draft or num_draft_tokens (checked with or without a draft); returns
  the draft as "ngram", an `Adapter` (a `Transformer` is adapted with the model's tokenizer) or
  None."""
  _checks.integer("num_draft_tokens", num_draft_tokens, low=1, high=16)
  if draft is None:
    return None
  if isinstance(draft, str):
    if draft != "ngram":
      raise ValueError(f"draft must be None, 'ngram' or a Transformer; got {draft!r}")
  elif isinstance(draft, (Transformer, adapters.Adapter)):
    if isinstance(draft, Transformer):
      draft = model_adapters.embedded(draft, adapter.tokenizer)
    if draft.vocab_size != adapter.vocab_size:
      raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not "
                       f"the model's ({adapter.vocab_size}); a draft must share the "
                       f"tokenizer")
    theirs, ours = (getattr(t, "pieces", None) for t in (draft.tokenizer, adapter.tokenizer))
    if theirs is not None and ours is not None and list(theirs) != list(ours):
      raise ValueError(f"the draft {draft.name}'s tokenizer maps ids to other tokens than the "
                       f"model's; a draft must share the tokenizer")
  else:
    raise ValueError(f"draft must be None, 'ngram', a Transformer or an Adapter; got "
                     f"{type(draft).__name__}")
  if beam_size is not None:
    raise ValueError("draft and beam_size exclude each other: speculative decoding speeds up "
                     "sampling and greedy decoding, not beam search")
  return draft


def _beam_generation(adapter, state, logits, lengths, counts, started, tokenizer, params,
                     max_new_tokens, beam_size, num_return, length_penalty,
                     prompt_logprobs=None, constraint=None, prompt_tokens=None) -> Generation:
  """`generate` with beam search, from the prefill on: the best beam in the main fields, the
  `num_return` best in `beams` and `scores`."""
  out = beam_search(adapter.step_fn, state, logits, beam_size=beam_size,
                    num_return=num_return, max_new_tokens=max_new_tokens, positions=lengths,
                    eos_ids=list(adapter.eos_ids), pad_id=adapter.pad_id,
                    length_penalty=length_penalty, params=params, counts=counts,
                    state_axes=adapter.state_axes,
                    constraint=constraint, prompt_tokens=prompt_tokens)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)  # [B, R, N], [B, R]
  seconds = time.perf_counter() - started
  # A slot that no hypothesis reached (length 0, score -inf: the prompt has fewer possible
  # continuations than num_return) is not a beam.
  beams = [[tokenizer.decode(t[:n]) for t, n in zip(row, row_lengths) if n > 0]
           for row, row_lengths in zip(tokens, lengths)]
  return Generation([row[0] if row else "" for row in beams], tokens[:, 0],
                    np.asarray(out.logprobs)[:, 0],
                    lengths[:, 0], np.asarray(out.finished)[:, 0], seconds,
                    np.asarray(out.dead_end), beams=beams,
                    scores=np.asarray(out.scores), prompt_logprobs=prompt_logprobs)
