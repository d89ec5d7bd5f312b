"""Table 8, scoring (issue 40): rollout tokens/s with log-probs of each kind over a rollout with the
default (processed) ones, and the cost of a training step (`jaxdecode.score` under
`jax.value_and_grad`), with the embedded model's batch-invariant numerics and with plain XLA.

Rollouts: `jaxdecode.decode` of the same prompts, top-p 0.9, no EOS, three ways: the default (the
processed log-prob of each token, which the draw computes anyway), `logprobs_mode="raw"` (the
model's own log-prob) and `scores=True` (every kind at once: raw, tempered, processed and
kept_logmass in a `jaxdecode.Scores`; tempered and kept_logmass have no cheaper way of their own).
Training step: `jax.jit(jax.value_and_grad(loss))`, the loss the mean processed log-prob of the
mode's own rollout tokens, scored by `jaxdecode.score` over `models.forward_fn(graphdef,
weights)`: one forward pass over prompt + new tokens and its gradient with respect to every
weight. Both modes (same weights) run in one round robin, so `train_vs_plain` is the invariant
step's time over the plain one's (the issue's goal: <= 1.5).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

import jaxdecode
from jaxdecode.models import forward_fn, load_default, make_step_fn
from jaxdecode.params import SamplingParams
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench._common import (TOP_P, _medians, _prompts, prefilled, table_rows,
                                           time_round_robin)
from jaxdecode.tools.bench._table import field, fixed

SCORING_RUNS = 20  # the table's timed runs, even with --quick (the protocol)
FULL = dict(batches=(1, 8), max_new_tokens=64)
QUICK = dict(batches=(8,), max_new_tokens=32)
KINDS = ("processed", "raw", "all_kinds")  # the rollouts, in column order
MODES = (("invariant", True), ("plain", False))


def _rollouts(model, batch: int, max_new_tokens: int, seed: int) -> dict:
  """One mode's prefill, its three rollout calls, its training step and its batch.

  Returns:
    `{"fns": name -> zero-argument function (the rollouts of `KINDS` and "train"), "width"}`.
  """
  ready = prefilled(model, _prompts(model.config.vocab_size, batch, seed), max_new_tokens)
  step_fn = make_step_fn(ready["graphdef"])
  params = SamplingParams(top_p=TOP_P)
  key = jax.random.key(seed)

  def decode(**kinds):
    return jaxdecode.decode(step_fn, ready["state"], ready["logits"], key=key, params=params,
                            max_new_tokens=max_new_tokens, positions=ready["lengths"], **kinds)

  rollout = decode(scores=True)  # the tokens the training step scores (any kind: the same)
  if not bool(jnp.all(jnp.isfinite(rollout.scores.processed))):
    raise AssertionError("a rollout token has a non-finite processed log-prob")
  graphdef = ready["graphdef"]

  def loss(weights, prompt_tokens, prompt_lengths, new_tokens):
    scores = jaxdecode.score(forward_fn(graphdef, weights), prompt_tokens, prompt_lengths,
                             new_tokens, params=params)
    return -jnp.mean(scores.processed)

  train = jax.jit(jax.value_and_grad(loss))
  args = (ready["weights"], ready["tokens"], ready["lengths"], rollout.tokens)
  return {"width": ready["width"], "fns": {
      "processed": lambda: decode().logprobs,
      "raw": lambda: decode(logprobs_mode="raw").logprobs,
      "all_kinds": lambda: decode(scores=True).scores,
      "train": lambda: train(*args)}}


def scoring_row(batch: int, *, runs: int = SCORING_RUNS, max_new_tokens: int = 64,
                loader: Callable[[bool], Any] | None = None, seed: int = 0) -> list[dict]:
  """The rollouts and training steps of both numerics modes at one batch size, one round robin.

  Args:
    batch: B, the rollout's rows and the training step's.
    runs: timed runs (the median is reported).
    max_new_tokens: N, the new tokens of a rollout (the training step scores them all).
    loader: `loader(batch_invariant) -> Transformer` (default: the embedded model).
    seed: seed of the prompts and of the sampling key.

  Returns:
    One dict per mode ("invariant", then "plain") with `mode`, `batch`, `max_new_tokens`,
    `prompt_width`, `runs`, `median_s` (processed, raw, all_kinds: the rollouts; train),
    `tokens_per_s` (the rollouts: B * N over the median; train: the B * N scored tokens) and
    `ratio`: `raw_vs_processed` and `all_kinds_vs_processed` (tokens/s over the default
    rollout's) and `train_vs_plain` (this mode's training step time over plain's; 1 for plain).
  """
  loader = loader or (lambda invariant: load_default(batch_invariant=invariant)[0])
  fns, widths = {}, {}
  for mode, invariant in MODES:
    setup = _rollouts(loader(invariant), batch, max_new_tokens, seed)
    widths[mode] = setup["width"]
    fns.update({f"{mode}/{name}": fn for name, fn in setup["fns"].items()})
  medians = _medians(time_round_robin(fns, runs))
  tokens = batch * max_new_tokens
  rows = []
  for mode, _ in MODES:
    m = {name: medians[f"{mode}/{name}"] for name in (*KINDS, "train")}
    rows.append({
        "mode": mode, "batch": batch, "max_new_tokens": max_new_tokens,
        "prompt_width": widths[mode], "runs": runs, "median_s": m,
        "tokens_per_s": {name: tokens / t for name, t in m.items()},
        "ratio": {"raw_vs_processed": m["processed"] / m["raw"],
                  "all_kinds_vs_processed": m["processed"] / m["all_kinds"],
                  "train_vs_plain": m["train"] / medians["plain/train"]}})
  return rows


def scoring_table(*, batches: Sequence[int] = FULL["batches"], runs: int = SCORING_RUNS,
                  max_new_tokens: int = FULL["max_new_tokens"],
                  loader: Callable[[bool], Any] | None = None,
                  progress: Callable[[str], None] | None = None) -> list[dict]:
  """`scoring_row` for each batch size, its two rows one after the other (a batch size that
  cannot run is one row `{"mode": "-", "batch", "skipped"}`).

  Raises:
    ValueError: `batches`, `runs` or `max_new_tokens` not positive integers (before anything
      compiles).
  """
  for name, values in (("batches", batches), ("runs", [runs]),
                       ("max_new_tokens", [max_new_tokens])):
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
      raise ValueError(f"{name} must be positive integers; got {values!r}")
  grouped = table_rows(
      [(batch, lambda batch=batch: {"rows": scoring_row(
          batch, runs=runs, max_new_tokens=max_new_tokens, loader=loader)})
       for batch in batches],
      label=lambda batch: f"scoring B={batch}",
      skipped=lambda batch, why: {"mode": "-", "batch": batch, "skipped": why},
      progress=progress)
  return [row for group in grouped for row in group.get("rows", [group])]


def format_tables(result: Mapping) -> list[str]:
  """The scoring table of `run_benchmarks`'s result, as lines."""
  if not result.get("scoring"):
    return []
  timed = [r for r in result["scoring"] if "skipped" not in r]
  new, runs = (timed[0]["max_new_tokens"], timed[0]["runs"]) if timed else ("-", "-")
  return _table.table(
      [f"Scoring: rollouts with log-probs of each kind (jaxdecode.decode, top-p 0.9, {new} new "
       f"tokens) and a training step (jaxdecode.score + jax.value_and_grad), embedded model, "
       f"batch-invariant vs plain XLA, {runs} runs"],
      [field("numerics", 9, "mode", align="<"), field("B", 3, "batch"),
       field("processed tok/s", 15, "tokens_per_s", "processed", fmt=fixed(0)),
       field("raw/proc.", 9, "ratio", "raw_vs_processed", fmt=_table.ratio),
       field("all-kinds/proc.", 15, "ratio", "all_kinds_vs_processed", fmt=_table.ratio),
       field("train ms", 9, "median_s", "train", fmt=fixed(1, 1e3)),
       field("train/plain", 11, "ratio", "train_vs_plain", fmt=_table.ratio)],
      result["scoring"],
      "processed tok/s: a rollout recording each token's processed log-prob (decode's "
      "default); raw/proc., all-kinds/proc.: tokens/s with logprobs_mode='raw', and with "
      "scores=True (raw, tempered, processed and kept_logmass at once), over that (1.00 = "
      "free); train ms: jax.value_and_grad of the mean processed log-prob from jaxdecode.score "
      "over models.forward_fn, B rows of prompt + new tokens; train/plain: the training step's "
      "time over plain XLA's (goal <= 1.5).", label=lambda row: f"B={row['batch']}",
      wrap_title=True)
