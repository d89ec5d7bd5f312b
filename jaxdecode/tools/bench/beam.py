"""Table 3, beam search: `jaxdecode.beam_search` with K beams over greedy `decode` on the same
prompts, tokens/s of the returned sequences and of the model's work."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax

import jaxdecode
from jaxdecode.models import DECODE_STATE_AXES, make_step_fn
from jaxdecode.params import SamplingParams
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench._common import (RUNS, _default_model, _medians, _prompts, model_rows,
                                           prefilled, time_round_robin)
from jaxdecode.tools.bench._table import field, fixed
from jaxdecode.tools.bench.decode import MODEL_COLUMNS

BEAM_SIZE = 4  # the beam table's K


def beam_row(name: str, model, *, runs: int = RUNS, batch: int = 8, max_new_tokens: int = 64,
             beam_size: int = BEAM_SIZE, seed: int = 0) -> dict:
  """Times `jaxdecode.beam_search` with `beam_size` beams against greedy `decode` on one model.

  Both run round-robin on the same prefill (done once, outside), without EOS, so every row runs
  all `max_new_tokens` steps in both.

  Args:
    name: the row's label.
    model: a `jaxdecode.models.Transformer`.
    runs: timed runs.
    batch: prompts per call.
    max_new_tokens: N.
    beam_size: K.
    seed: seed of the prompts.

  Returns:
    A dict with `model`, `vocab`, `batch`, `beam_size`, `max_new_tokens`, `runs`, `median_s`
    (greedy, beam), `tokens_per_s` (greedy and beam: B * N returned tokens over the median) and
    `ratio`: `beam_vs_greedy` (beam tokens/s over greedy tokens/s) and
    `beam_model_tokens_vs_greedy` (the same with the B * K * N tokens the search feeds the model).
  """
  vocab = model.config.vocab_size
  ready = prefilled(model, _prompts(vocab, batch, seed), max_new_tokens)
  state, logits, lengths = ready["state"], ready["logits"], ready["lengths"]
  step_fn = make_step_fn(ready["graphdef"])
  greedy = SamplingParams(temperature=0.0)
  key = jax.random.key(seed)
  medians = _medians(time_round_robin({
      "greedy": lambda: jaxdecode.decode(step_fn, state, logits, key=key, params=greedy,
                                         max_new_tokens=max_new_tokens,
                                         positions=lengths).tokens,
      "beam": lambda: jaxdecode.beam_search(step_fn, state, logits, beam_size=beam_size,
                                            max_new_tokens=max_new_tokens, positions=lengths,
                                            state_axes=DECODE_STATE_AXES).tokens,
  }, runs))
  new_tokens = batch * max_new_tokens
  return {
      "model": name, "vocab": vocab, "batch": batch, "beam_size": beam_size,
      "max_new_tokens": max_new_tokens, "runs": runs, "median_s": medians,
      "tokens_per_s": {"greedy": new_tokens / medians["greedy"],
                       "beam": new_tokens / medians["beam"]},
      "ratio": {"beam_vs_greedy": medians["greedy"] / medians["beam"],
                "beam_model_tokens_vs_greedy": beam_size * medians["greedy"] / medians["beam"]},
  }


def beam_table(models: Sequence[tuple[str, Callable[[], Any]]] | None = None, *,
               runs: int = RUNS, batch: int = 8, max_new_tokens: int = 64,
               beam_size: int = BEAM_SIZE,
               progress: Callable[[str], None] | None = None) -> list[dict]:
  """Beam rows (see `beam_row`); models as in `decode_table` (default: the embedded model)."""
  if models is None:
    models = (("default", _default_model),)
  return model_rows(models, lambda name, model: beam_row(
      name, model, runs=runs, batch=batch, max_new_tokens=max_new_tokens, beam_size=beam_size),
                    what="beam", progress=progress)


def format_tables(result: Mapping) -> list[str]:
  """The beam table of `run_benchmarks`'s result, as lines."""
  if not result.get("beam"):
    return []
  s = result["settings"]
  return _table.table(
      [f"Beam search: jaxdecode.beam_search, K = {s['beam_size']} beams, vs greedy "
       f"decode; batch {s['decode_batch']}, {s['max_new_tokens']} new tokens, no EOS"],
      [*MODEL_COLUMNS,
       field("beam ms", 9, "median_s", "beam", fmt=fixed(1, 1e3)),
       field("beam tok/s", 10, "tokens_per_s", "beam", fmt=fixed(0)),
       field("beam/greedy tok/s", 17, "ratio", "beam_vs_greedy", fmt=_table.ratio),
       field("model tokens", 12, "ratio", "beam_model_tokens_vs_greedy", fmt=_table.ratio)],
      result["beam"],
      "beam/greedy tok/s: returned tokens per second (B * N each) of beam search over greedy; "
      "model tokens: the same with the B * K * N tokens beam search feeds the model (1.00 = "
      "each beam costs what a greedy row costs).", label=lambda row: row["model"])
