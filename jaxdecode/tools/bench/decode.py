"""Table 2, decode: `jaxdecode.decode` tokens/s with top-p over greedy on the embedded model and a
random-weights model with a 32000-token vocabulary; the first call over a later one; a decode whose
rows all stop at once over one without EOS."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

import jaxdecode
from jaxdecode.models import Transformer, TransformerConfig, make_step_fn
from jaxdecode.params import SamplingParams
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench._common import (RUNS, TOP_P, _default_model, _medians, _prompts,
                                           model_rows, prefilled, time_round_robin)
from jaxdecode.tools.bench._table import field, fixed


def random_model(vocab_size: int = 32000, *, d_model: int = 256, n_layers: int = 4,
                 n_heads: int = 4, d_ff: int = 1024, max_len: int = 256, seed: int = 0):
  """A random-weights `jaxdecode.models.Transformer` (the decode table's large-vocabulary model)."""
  config = TransformerConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                             n_heads=n_heads, d_ff=d_ff, max_len=max_len)
  return Transformer(config, rngs=nnx.Rngs(seed))


def decode_row(name: str, model, *, runs: int = RUNS, batch: int = 8, max_new_tokens: int = 64,
               seed: int = 0, early_stop: bool = True) -> dict:
  """Times `jaxdecode.decode` on one model: top-p versus greedy, first call, early stop.

  Three functions run round-robin, each one full `decode` call (prefill done once, outside):
  greedy and top-p 0.9 without EOS (every row runs all `max_new_tokens` steps), and greedy with
  `eos_ids` = the tokens greedy decoding emits in its first two steps, so that every row finishes
  at once. The first greedy call, made before any other, includes compilation.

  Args:
    name: the row's label.
    model: a `jaxdecode.models.Transformer`.
    runs: timed runs.
    batch: prompts per call.
    max_new_tokens: N.
    seed: seed of the prompts and of the sampling key.
    early_stop: time the EOS decode too (`jaxdecode doctor` leaves it out: one compile less).

  Returns:
    A dict with `model`, `vocab`, `batch`, `max_new_tokens`, `prompt_width`, `runs`,
    `first_call_s`, `median_s` (greedy, top_p, greedy_eos), `tokens_per_s` (greedy, top_p),
    `early_stop_max_length` (the longest row of the EOS decode) and `ratio`: `top_p_vs_greedy`
    (top-p tokens/s over greedy tokens/s), `first_vs_later` (first call time over the greedy
    median) and `early_stop_vs_full` (EOS decode time over greedy time); without `early_stop`,
    no `greedy_eos`, `early_stop_max_length` nor `early_stop_vs_full`.
  """
  run = _decoder(model, batch, max_new_tokens, seed)
  greedy, top_p = SamplingParams(temperature=0.0), SamplingParams(top_p=TOP_P)
  start = time.perf_counter()
  first = jax.block_until_ready(run(greedy))
  first_call = time.perf_counter() - start
  fns = {"greedy": lambda: run(greedy).tokens, "top_p": lambda: run(top_p).tokens}
  if early_stop:
    eos_ids = sorted(set(np.asarray(first.tokens[:, :2]).reshape(-1).tolist()))
    early = run(greedy, eos_ids)
    fns["greedy_eos"] = lambda: run(greedy, eos_ids).tokens
  medians = _medians(time_round_robin(fns, runs))
  new_tokens = batch * max_new_tokens
  row = {
      "model": name, "vocab": model.config.vocab_size, "batch": batch,
      "max_new_tokens": max_new_tokens, "prompt_width": run.width, "runs": runs,
      "first_call_s": first_call, "median_s": medians,
      "tokens_per_s": {"greedy": new_tokens / medians["greedy"],
                       "top_p": new_tokens / medians["top_p"]},
  }
  ratio = {"top_p_vs_greedy": medians["greedy"] / medians["top_p"],
           "first_vs_later": first_call / medians["greedy"]}
  if early_stop:
    row["early_stop_max_length"] = int(np.max(np.asarray(early.lengths)))
    ratio["early_stop_vs_full"] = medians["greedy_eos"] / medians["greedy"]
  return dict(row, ratio=ratio)


def _decoder(model, batch: int, max_new_tokens: int, seed: int):
  """`run(params, eos_ids=())`: one `decode` call of the row's prompts, prefilled once, with a new
  step function (its first call compiles); `run.width` the prompts' padded width."""
  ready = prefilled(model, _prompts(model.config.vocab_size, batch, seed), max_new_tokens)
  step_fn = make_step_fn(ready["graphdef"])
  key = jax.random.key(seed)

  def run(params, eos_ids=()):
    return jaxdecode.decode(step_fn, ready["state"], ready["logits"], key=key, params=params,
                            max_new_tokens=max_new_tokens, positions=ready["lengths"],
                            eos_ids=eos_ids)

  run.width = ready["width"]
  return run


def decode_table(models: Sequence[tuple[str, Callable[[], Any]]] | None = None, *,
                 runs: int = RUNS, batch: int = 8, max_new_tokens: int = 64,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
  """Decode rows (see `decode_row`) for several models.

  Args:
    models: (name, loader) pairs; `loader()` returns a `Transformer`. If it raises (e.g. the
      embedded weights do not exist yet) the row is `{"model": name, "skipped": reason}`.
      Default: the embedded model ("default") and `random_model()` ("random-32k").
    runs: timed runs per row.
    batch: prompts per call.
    max_new_tokens: N.
    progress: called with one line after each row.
  """
  if models is None:
    models = (("default", _default_model), ("random-32k", random_model))
  return model_rows(models, lambda name, model: decode_row(
      name, model, runs=runs, batch=batch, max_new_tokens=max_new_tokens),
                    what="decode", progress=progress)


# The first columns of the decode and beam tables: the model and its greedy decode.
MODEL_COLUMNS = (field("model", 11, "model", align="<"), field("V", 6, "vocab"),
                 field("greedy ms", 9, "median_s", "greedy", fmt=fixed(1, 1e3)))


def format_tables(result: Mapping) -> list[str]:
  """The decode table of `run_benchmarks`'s result, as lines."""
  if not result.get("decode"):
    return []
  s = result["settings"]
  return _table.table(
      [f"Decode: jaxdecode.decode, batch {s['decode_batch']}, {s['max_new_tokens']} new "
       f"tokens per row, no EOS unless stated"],
      [*MODEL_COLUMNS,
       field("greedy tok/s", 12, "tokens_per_s", "greedy", fmt=fixed(0)),
       field("top-p/greedy tok/s", 18, "ratio", "top_p_vs_greedy", fmt=_table.ratio),
       field("first/later", 11, "ratio", "first_vs_later", fmt=_table.ratio),
       field("EOS-stop/full", 13, "ratio", "early_stop_vs_full", fmt=_table.ratio)],
      result["decode"],
      "top-p/greedy: tokens/s with top-p 0.9 over tokens/s greedy; first/later: the first call "
      "(compiles) over a later one; EOS-stop/full: a greedy decode whose rows all emit EOS in "
      "the first step(s) over the same decode without EOS.", label=lambda row: row["model"])
