"""Table 5, speculative decoding: `speculative_decode` over `decode` time (the same tokens) and the
acceptance rate, for the n-gram drafter and the embedded draft model, greedy and top-p."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import jaxdecode
from jaxdecode.models import prefill
from jaxdecode.params import SamplingParams
from jaxdecode.prompts import bucket_length
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench._common import (RUNS, TOP_P, _bench_step_fn, _default_draft,
                                           _default_model, _medians, time_round_robin)
from jaxdecode.tools.bench._table import field, fixed

_NAMES = ("x", "y", "width", "height", "name", "value", "size", "color", "speed", "label",
          "count", "parent")
_FRESH = ("The for statement", "A list comprehension", "Exceptions are raised",
          "The import system", "Class definitions", "Augmented assignment",
          "The with statement", "A coroutine function")


def spec_prompts(text: str, batch: int) -> list[str]:
  """The speculative table's prompts: "repetitive" (accessor methods that differ by a name, so
  earlier lines predict later ones) or "fresh" (the opening words of a docs paragraph)."""
  if text == "fresh":
    return [_FRESH[b % len(_FRESH)] for b in range(batch)]
  prompts = []
  for b in range(batch):
    names = [_NAMES[(b + i) % len(_NAMES)] for i in range(4)]
    body = "".join(f"    def get_{n}(self):\n        return self._{n}\n\n" for n in names[:3])
    prompts.append("class Point:\n" + body + f"    def get_{names[3]}(self):\n")
  return prompts


def spec_row(model, drafts: Mapping[str, Any], *, text: str, batch: int,
             ks: Sequence[int] = (2, 4, 8), runs: int = RUNS, max_new_tokens: int = 64,
             seed: int = 0) -> list[dict]:
  """Speculative over plain decode tokens/s on one prompt set, for each drafter, K and sampler.

  Everything runs round-robin on one prefill (room for N + max(K) + 1 tokens): plain `decode`
  greedy and top-p 0.9, and `speculative_decode` with each drafter ("ngram": prompt lookup; a
  model: its greedy tokens) and K, greedy and top-p. The outputs are the same tokens (tested
  elsewhere); only the time and the model calls differ.

  Returns:
    One dict per (drafter, sampler): `text`, `batch`, `drafter`, `sampler`, `plain_ms`, and per
    K: `speedup[K]` (plain time / speculative time), `acceptance[K]` (accepted / drafted) and
    `calls[K]` (multi-token model calls after the prefill; plain decode makes N - 1 steps).
  """
  setup = _spec_setup(model, drafts, text=text, batch=batch, ks=ks,
                      max_new_tokens=max_new_tokens, seed=seed)
  fns, stats = {}, {}
  for sampler, params in setup["samplers"].items():
    fns[f"plain/{sampler}"] = lambda params=params: setup["decode"](params).tokens
    for name, drafter in setup["drafters"].items():
      for k in ks:
        spec = lambda params=params, drafter=drafter, k=k: setup["spec"](params, drafter, k)
        out = spec()
        stats[(name, sampler, k)] = (
            float(jnp.sum(out.accepted)) / max(float(jnp.sum(out.drafted)), 1.0),
            int(out.calls))
        fns[f"{name}/{sampler}/{k}"] = lambda spec=spec: spec().tokens
  medians = _medians(time_round_robin(fns, runs))
  rows = []
  for name in setup["drafters"]:
    for sampler in setup["samplers"]:
      plain = medians[f"plain/{sampler}"]
      rows.append({
          "text": text, "batch": batch, "drafter": name, "sampler": sampler, "runs": runs,
          "max_new_tokens": max_new_tokens, "plain_ms": plain * 1e3,
          "speedup": {str(k): plain / medians[f"{name}/{sampler}/{k}"] for k in ks},
          "acceptance": {str(k): stats[(name, sampler, k)][0] for k in ks},
          "calls": {str(k): stats[(name, sampler, k)][1] for k in ks}})
  return rows


def _spec_setup(model, drafts: Mapping[str, Any], *, text: str, batch: int, ks: Sequence[int],
                max_new_tokens: int, seed: int) -> dict:
  """The prefill, drafters and calls of a `spec_row`: `{"samplers", "drafters", "decode":
  params -> DecodeOutput, "spec": (params, drafter, k) -> SpeculativeOutput}`."""
  from jaxdecode.models import ByteTokenizer  # pylint: disable=import-outside-toplevel
  tok = ByteTokenizer()
  ids = [tok.encode(p) for p in spec_prompts(text, batch)]
  longest = max(len(i) for i in ids)
  context = model.config.max_len
  if longest + max_new_tokens > context:
    raise ValueError(f"prompts of {longest} tokens + max_new_tokens {max_new_tokens} exceed the "
                     f"model's max_len {context}")
  width = bucket_length(longest)
  width = width if width + max_new_tokens <= context else longest
  # Verification may write up to K + 1 tokens past the last one kept: room for them, up to
  # max_len (past it, only discarded drafts would land; their logits are NaN).
  cache_length = min(width + max_new_tokens + max(ks) + 1, context)
  tokens, lengths = jaxdecode.right_pad(ids, pad_id=tok.PAD, width=width)
  graphdef, weights = nnx.split(model)
  logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=cache_length)
  step_fn = _bench_step_fn(graphdef)
  key = jax.random.key(seed)
  kwargs = dict(key=key, max_new_tokens=max_new_tokens, positions=lengths, eos_ids=[tok.EOS],
                pad_id=tok.PAD)
  return {
      "samplers": {"greedy": SamplingParams(temperature=0.0),
                   "top-p": SamplingParams(top_p=TOP_P)},
      "drafters": _drafters(drafts, tokens, lengths, cache_length),
      "decode": lambda params: jaxdecode.decode(step_fn, state, logits, params=params, **kwargs),
      "spec": lambda params, drafter, k: jaxdecode.speculative_decode(
          step_fn, state, logits, params=params, drafter=drafter, num_draft_tokens=k, **kwargs)}


def _drafters(drafts: Mapping[str, Any], tokens, lengths, cache_length: int) -> dict:
  """name -> drafter: "ngram" (prompt lookup) or a draft model (prefilled on the prompts)."""
  drafters = {}
  for name, draft in drafts.items():
    if draft == "ngram":
      drafters[name] = jaxdecode.NgramDrafter(tokens, lengths)
    else:
      d_graphdef, d_weights = nnx.split(draft)
      _, d_state = prefill(d_graphdef, d_weights, tokens, lengths,
                           cache_length=min(cache_length, draft.config.max_len))
      drafters[name] = jaxdecode.ModelDrafter(d_state, _bench_step_fn(d_graphdef))
  return drafters


def spec_table(*, batches: Sequence[int] = (1, 8), ks: Sequence[int] = (2, 4, 8),
               texts: Sequence[str] = ("repetitive", "fresh"), runs: int = RUNS,
               max_new_tokens: int = 64, model_loader: Callable[[], Any] | None = None,
               draft_loader: Callable[[], Any] | None = None,
               progress: Callable[[str], None] | None = None) -> list[dict]:
  """`spec_row` for each batch size and prompt set, with the n-gram drafter and the draft
  model (default `models.load_draft()`; left out, with a note row, if it cannot load)."""
  model = (model_loader or _default_model)()
  drafts = {"ngram": "ngram"}
  rows = []
  try:
    drafts["model"] = (draft_loader or _default_draft)()
  except Exception as e:  # pylint: disable=broad-except  # no draft model: n-gram rows only
    rows.append({"drafter": "model", "skipped": f"{type(e).__name__}: {e}"})
  for batch in batches:
    for text in texts:
      started = time.perf_counter()
      rows += spec_row(model, drafts, text=text, batch=batch, ks=ks, runs=runs,
                       max_new_tokens=max_new_tokens)
      if progress:
        progress(f"speculative B={batch} {text}: {time.perf_counter() - started:.0f} s")
  return rows


def format_tables(result: Mapping) -> list[str]:
  """The speculative table of `run_benchmarks`'s result, as lines."""
  if not result.get("speculative"):
    return []
  s = result["settings"]
  ks = s.get("spec_ks", [])
  per_k = []
  for k in ks:
    per_k += [field(f"K={k} x", 7, "speedup", str(k), fmt=_table.ratio),
              field("acc", 4, "acceptance", str(k), fmt=_table.percent)]
  return _table.table(
      [f"Speculative: speculative_decode vs decode (the same tokens), embedded model, "
       f"{s['max_new_tokens']} new tokens"],
      [field("text", 10, "text", align="<"), field("B", 2, "batch"),
       field("drafter", 7, "drafter", align="<"), field("sampler", 7, "sampler", align="<"),
       field("plain ms", 8, "plain_ms", fmt=fixed(1)), *per_k],
      result["speculative"],
      "K=k x: plain decode time / speculative time with k drafts per call (higher: "
      "speculation pays); acc: drafts accepted. repetitive: accessor methods differing by a "
      "name; fresh: the opening words of a docs paragraph. ngram: prompt lookup; model: the "
      "embedded draft model's greedy tokens.", label=lambda row: f"drafter {row['drafter']}")
