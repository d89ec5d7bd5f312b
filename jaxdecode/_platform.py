"""One program per backend: work-skipping branches on CPU and TPU, straight-line code on GPU.

A `lax.cond` whose predicate is data ("does any row use top-p?") skips whole passes over the
vocabulary when no row needs them. On XLA:CPU that is a win, and on a TPU the branch is decided
on the device. On XLA:GPU every such branch copies its predicate to the host and waits before
launching the branch, and so does every iteration of a `lax.while_loop`: a decoding step with
15 branches waits 15 times. So the library has two formulations of each such place, with the
same results bit for bit:

- `BRANCHES` (CPU, TPU): skip work that no row of the batch needs (`lax.cond`), and stop loops
  at the data's end (attention visits the cache up to the furthest query).
- `STRAIGHT` (GPU, and any other backend): no data-dependent branch inside a step; compute and
  select per row (`jnp.where`), loops with constant trip counts.

Each branch's "work" function leaves the rows that do not need it unchanged, bit for bit, so
running it on every row (STRAIGHT) gives what skipping it (BRANCHES) gives.

`by_platform(fn, *args)` traces `fn` once per formulation and lets `lax.platform_dependent` pick
one when the program is lowered: the program built for a GPU holds only the straight one.
Inside `fn`, `skip_unless` and `mode()` read the formulation being traced. Called outside any
`by_platform`, `skip_unless` makes its own per-platform choice.

`forced(mode)` (tests, benchmarks) traces every call with one formulation on any backend, so
that both can be run and compared on a CPU.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import jax
from jax import lax

BRANCHES = "branches"
STRAIGHT = "straight"
MODES = (BRANCHES, STRAIGHT)

_state = threading.local()


def mode() -> str | None:
  """The formulation being traced (`BRANCHES` or `STRAIGHT`), or None outside `by_platform`."""
  return getattr(_state, "mode", None) or getattr(_state, "forced", None)


@contextlib.contextmanager
def tracing(value: str):
  """Trace the body in formulation `value` (as `by_platform` does for each of its branches)."""
  previous = getattr(_state, "mode", None)
  _state.mode = value
  try:
    yield
  finally:
    _state.mode = previous


def by_platform(fn: Callable, *args):
  """`fn(*args)`, traced once per formulation; the lowering platform picks which one runs.

  CPU and TPU get `BRANCHES`, every other platform (CUDA, ROCm) `STRAIGHT`. Nested calls run
  `fn` in the formulation already being traced.
  """
  if mode() is not None:
    return fn(*args)

  def traced_as(value):
    def run(*a):
      with tracing(value):
        return fn(*a)
    return run

  branches = traced_as(BRANCHES)
  return lax.platform_dependent(*args, cpu=branches, tpu=branches, default=traced_as(STRAIGHT))


def skip_unless(pred: jax.Array, work: Callable, x):
  """`work(x)` when `pred` (a bool[] of the batch) holds, else `x`.

  `work` must return `x` unchanged, bit for bit, in every row that does not need it: then the
  straight formulation can run it always. BRANCHES skips it with a `lax.cond`.
  """
  current = mode()
  if current is None:
    return by_platform(lambda x: skip_unless(pred, work, x), x)
  if current == BRANCHES:
    return lax.cond(pred, work, lambda x: x, x)
  return work(x)


@contextlib.contextmanager
def forced(value: str):
  """Trace everything with formulation `value` on any backend (tests and benchmarks).

  jax caches traced programs by their arguments, not by this switch, so the caches are cleared
  on entry and on exit.
  """
  if value not in MODES:
    raise ValueError(f"mode must be one of {MODES}; got {value!r}")
  previous = getattr(_state, "forced", None)
  jax.clear_caches()
  _state.forced = value
  try:
    yield
  finally:
    _state.forced = previous
    jax.clear_caches()


def when(pred: jax.Array, work: Callable, otherwise: Callable):
  """`work()` when `pred` holds, else `otherwise()`; STRAIGHT always runs `work()`.

  The caller guarantees that wherever it uses the result, `work()` and `otherwise()` agree bit
  for bit when `pred` is false (typically: `work` is a per-row `jnp.where` whose inactive rows
  are what `otherwise` returns).
  """
  current = mode()
  if current is None:
    return by_platform(lambda: when(pred, work, otherwise))
  if current == BRANCHES:
    return lax.cond(pred, work, otherwise)
  return work()
