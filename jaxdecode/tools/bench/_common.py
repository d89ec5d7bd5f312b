"""What every table of the benchmark shares: the protocol's constants, round-robin timing, the
prompts and the prefill of a decode row, and the loop over a table's rows."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

import jaxdecode
from jaxdecode.models import load_default, make_step_fn, prefill
from jaxdecode.prompts import bucket_length

BATCHES = (1, 8, 64)
RUNS = 20  # the protocol's minimum for published figures
QUICK_RUNS = 10
MIN_RUNS = 5  # never fewer, even with --quick
WARMUP = 2  # calls of every function before timing (the first one compiles)
TOP_P = 0.9


# ---------------------------------------------------------------------------------------------
# Timing.


def time_round_robin(fns: Mapping[str, Callable[[], Any]], runs: int, *,
                     warmup: int = WARMUP) -> dict[str, list[float]]:
  """Times zero-argument functions round-robin, after `warmup` calls of each.

  Run i calls every function once, starting at function i mod n, and blocks on each result
  (`jax.block_until_ready`) before the clock stops.

  Args:
    fns: name -> function returning JAX arrays (or any pytree of them).
    runs: timed runs (>= 1).
    warmup: untimed calls of every function before the first run (the first one compiles).

  Returns:
    name -> the `runs` durations in seconds, in run order.
  """
  if runs < 1:
    raise ValueError(f"runs must be >= 1; got {runs!r}")
  names = list(fns)
  for _ in range(warmup):
    for name in names:
      jax.block_until_ready(fns[name]())
  times = {name: [] for name in names}
  for i in range(runs):
    for j in range(len(names)):
      name = names[(i + j) % len(names)]
      fn = fns[name]
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return times


def _first_call_s(fn: Callable[[], Any]) -> float:
  """Seconds of `fn()`'s first call, compilation included (it becomes a timed run after)."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _medians(times: Mapping[str, Sequence[float]]) -> dict[str, float]:
  return {name: float(statistics.median(t)) for name, t in times.items()}



# ---------------------------------------------------------------------------------------------
# The models, prompts and prefill of the decode rows.


def _default_model():
  return load_default()[0]


def _default_draft():
  from jaxdecode.models import load_draft  # pylint: disable=import-outside-toplevel
  return load_draft()


def _prompts(vocab: int, batch: int, seed: int = 0) -> list[list[int]]:
  """`batch` prompts of 3..12 random ids in [0, min(vocab, 256)): bytes for the default model."""
  rng = np.random.default_rng(seed)
  high = min(vocab, 256)
  return [rng.integers(0, high, size=int(rng.integers(3, 13))).tolist() for _ in range(batch)]


def check_fits(width: int, max_new_tokens: int, max_len: int) -> None:
  """ValueError when prompts padded to `width` and `max_new_tokens` exceed the context."""
  if width + max_new_tokens > max_len:
    raise ValueError(f"prompt width {width} + max_new_tokens {max_new_tokens} exceeds the "
                     f"model's max_len {max_len}")


def prefilled(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
              cache_length: int | None = None, pad_id: int = 0) -> dict:
  """The prompts right-padded to their length bucket and prefilled, checked to fit.

  Args:
    model: a `jaxdecode.models.Transformer`.
    prompts: token ids per row.
    max_new_tokens: N; the padded width + N must fit the model's `max_len`.
    cache_length: the cache's slots (default: the width + N).
    pad_id: the padding id.

  Returns:
    `{"graphdef", "weights", "tokens", "lengths", "width", "logits", "state"}` (the logits
    ready).
  """
  width = bucket_length(max(len(p) for p in prompts))
  check_fits(width, max_new_tokens, model.config.max_len)
  tokens, lengths = jaxdecode.right_pad(prompts, pad_id=pad_id, width=width)
  graphdef, weights = nnx.split(model)
  logits, state = prefill(graphdef, weights, tokens, lengths,
                          cache_length=cache_length or width + max_new_tokens)
  jax.block_until_ready(logits)
  return {"graphdef": graphdef, "weights": weights, "tokens": tokens, "lengths": lengths,
          "width": width, "logits": logits, "state": state}


_BENCH_STEP_FNS: dict = {}


def _bench_step_fn(graphdef):
  """One step function per model structure, kept: the rows that share it compile once."""
  if graphdef not in _BENCH_STEP_FNS:
    _BENCH_STEP_FNS[graphdef] = make_step_fn(graphdef)
  return _BENCH_STEP_FNS[graphdef]


# ---------------------------------------------------------------------------------------------
# A table's rows.


def table_rows(items: Sequence[tuple[Any, Callable[[], dict]]], *, label: Callable[[Any], str],
               skipped: Callable[[Any, str], dict], errors=(Exception,),
               progress: Callable[[str], None] | None = None) -> list[dict]:
  """Runs `make()` for each `(item, make)`; a row whose `make` raises one of `errors` becomes
  `skipped(item, "Type: message")`. `progress` gets `label(item)` and the seconds (or the
  reason) after each row."""
  rows = []
  for item, make in items:
    started = time.perf_counter()
    try:
      row = make()
    except errors as e:  # pylint: disable=broad-except  # a row that cannot run is reported
      row = skipped(item, f"{type(e).__name__}: {e}")
    rows.append(row)
    if progress:
      progress(f"{label(item)}: " + (f"skipped ({row['skipped']})" if "skipped" in row else
                                     f"{time.perf_counter() - started:.0f} s"))
  return rows


def model_rows(models: Sequence[tuple[str, Callable[[], Any]]],
               row: Callable[[str, Any], dict], *, what: str,
               progress: Callable[[str], None] | None = None) -> list[dict]:
  """`row(name, loader())` for each `(name, loader)`: a loader that raises gives the row
  `{"model": name, "skipped": "could not load the model: ..."}`, a row that raises ValueError
  (e.g. a context too short) `{"model": name, "skipped": ...}`."""
  def make(name, loader):
    try:
      model = loader()
    except Exception as e:  # pylint: disable=broad-except  # any failure to load skips the row
      return {"model": name, "skipped": f"could not load the model: {type(e).__name__}: {e}"}
    return row(name, model)

  return table_rows([(name, lambda name=name, loader=loader: make(name, loader))
                     for name, loader in models],
                    label=lambda name: f"{what} {name}",
                    skipped=lambda name, why: {"model": name, "skipped": why},
                    errors=(ValueError,), progress=progress)
