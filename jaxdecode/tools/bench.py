"""The benchmark suite: every figure is a ratio of two timings taken in the same process.

Run it as `python -m jaxdecode.bench [--quick] [--json] [--runs N] [--no-kernels] [--no-decode]
[--no-beam] [--no-numerics] [--no-spec] [--no-stream] [--[no-]structured] [--all-peers]` (or
`jaxdecode bench`).
The protocol (docs/architecture.md, "Benchmark protocol"):

- the functions of one table row are timed round-robin, run after run (each run starts at the
  next function, so no function always follows the same one), so that machine noise hits them
  all alike;
- each function is called at least twice before timing (the first call compiles);
- every call is followed by `jax.block_until_ready`; a figure is the median of >= 20 runs
  (`--quick` takes 10 runs by default, never fewer than 5, on a smaller grid);
- figures are ratios of such medians: sampler time / `jnp.argmax` time on the same `[B, V]`
  logits, decode tokens/s with top-p / greedy on the same model and prompts.

Tables:

1. Kernels. For each logit shape ("wide": standard Gaussian noise; "lm": a steep Zipf profile,
   logit = -3.3 ln(rank) with the ranks randomly permuted in every row), batch B and vocabulary V:
   `jaxdecode.greedy`, `jaxdecode.sample` (plain; top-k 50; top-p 0.9; min-p 0.05; the chain
   temperature 0.8 + top-k 50 + top-p 0.9 + min-p 0.05), a sort-based exact top-p reference
   (`sort_top_p_sample`) and, when `transformers` is installed, its Flax top-p warper, each as
   time / argmax time; plus the speedups of jaxdecode's top-p over the two sort-based ones.
   The controls (`CONTROL_PARAMS`: penalties with token counts, logit bias + banned tokens,
   allowed tokens, typical-p, epsilon, eta, top-nσ, XTC, dynamic temperature, mirostat 2, and
   over a history DRY, n-gram and bad-word bans, and those seven at once) are timed in the same round robin and printed as a second
   table.
2. Decode. `jaxdecode.decode` of 64 new tokens for a batch of 8 prompts (no EOS) with top-p 0.9
   versus greedy, for the embedded default model and a random-weights model with a 32000-token
   vocabulary; the first call (compilation included) versus a later one; and a decode whose rows
   all hit EOS at once versus the same decode without EOS.
3. Beam search. `jaxdecode.beam_search` with K = 4 beams versus greedy `decode` on the same 8
   prompts and 64 new tokens (no EOS, so both run every step), on the embedded model: tokens/s
   of the returned sequences (each search returns B * N tokens) and of the model's work (the
   search feeds B * K * N tokens through the model, greedy B * N).
4. Numerics. Greedy decode tokens/s of the embedded model with its batch-invariant numerics
   over the same weights with plain XLA kernels, at B = 1, 8 and 64; each mode's first call
   (compilation); one invariant step near the end of the context over one at position 32.
   Then the same ratio for a model no one here wrote, when `transformers<5` is installed (a
   line says why not otherwise): transformers' Flax GPT-2 (`HF_GPT2`: 4 layers, 256 wide,
   V = 8192, random weights), its prefill and step under `jaxdecode.batch_invariant` over
   plain XLA, both decoded by `jaxdecode.decode`, at B = 1 and 8.
5. Speculative decoding. `speculative_decode` over `decode` time (the same tokens) and the
   acceptance rate, for the n-gram drafter and the embedded draft model, greedy and top-p 0.9,
   B = 1 and 8, K = 2, 4, 8, on repetitive and on fresh prompts.
6. Streaming. `models.stream` consumed to the end over `models.generate`, B = 1 and 8.
7. Structured decoding. `jaxdecode.decode` with `constraint=` over the same decode without one
   (tokens/s), on the embedded model, top-p 0.9, 32 new tokens, B = 1 and 8, for a JSON schema
   and a regex (`STRUCTURED_SCHEMA`, `STRUCTURED_REGEX`); and the time to compile each of them
   from scratch for a 32000-token ByteLevel BPE vocabulary (trained with `tokenizers` on the
   embedded corpus, `bpe_vocabulary`), outlines-core's share of it, and the tables' size
   (`constraint.nbytes()`). Without `tokenizers` the compile rows are skipped.

Duration on 2 CPU cores (AMD EPYC), measured: the kernel and control tables about 8 minutes, the
model tables 24 (decode 1.6, beam 1, numerics 2.5, speculative 16, streaming 1, structured 2);
`--no-kernels` runs the model tables alone, `--no-kernels --no-decode --structured` the
structured table alone (about 2 minutes, with `--quick` too: its compile rows are timed once,
and half of it is compiling the decode loop). `--quick` (B = 8 kernels; numerics at B = 1, 8;
speculative at B = 1, K = 4; streaming at B = 1; 10 runs) takes roughly 10-12 minutes. Up to
twice that when the cores are shared. The sort-based peers are slow at large sizes, so by
default they are timed only where B*V <= `PEER_MAX_ELEMENTS` (B <= 8, and B = 64 with
V = 32000); `--all-peers` times them everywhere (about 20-30 more minutes).

From Python: `run_benchmarks(...)` returns every median and ratio as one dict (what `--json`
prints) and `format_table(result)` renders it (what the README pastes); `kernel_table`,
`decode_table`, `beam_table`, `numerics_table`, `spec_table`, `stream_table`,
`structured_table`, `bpe_vocabulary`, `time_round_robin` and the sort-based reference
`sort_top_p_sample` / `sort_top_p_mask` work on their own. `main(argv)` is the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import textwrap
import time
from typing import Any, Callable, Mapping, Sequence

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx

import jaxdecode
from jaxdecode import _files
from jaxdecode.models import (DECODE_STATE_AXES, Transformer, TransformerConfig, load_default,
                              make_step_fn, prefill)
from jaxdecode.params import SamplingParams
from jaxdecode.prompts import bucket_length
from jaxdecode.tools._args import OneLineParser

BATCHES = (1, 8, 64)
VOCABS = (32000, 128256, 256000)
SHAPES = ("wide", "lm")
QUICK_BATCHES = (8,)
QUICK_VOCABS = (32000, 128256)
RUNS = 20  # the protocol's minimum for published figures
QUICK_RUNS = 10
MIN_RUNS = 5  # never fewer, even with --quick
WARMUP = 2  # calls of every function before timing (the first one compiles)
PEER_MAX_ELEMENTS = 2_100_000  # B*V above which the sort-based peers are skipped by default
ZIPF_EXPONENT = 1.1 * 3  # "lm" logits: -ZIPF_EXPONENT * ln(rank)
TOP_P = 0.9
BEAM_SIZE = 4  # the beam table's K

# The jaxdecode samplers of a kernel row, in table order.
KERNEL_PARAMS = {
    "sample": dict(),
    "top_k": dict(top_k=50),
    "top_p": dict(top_p=TOP_P),
    "min_p": dict(min_p=0.05),
    "chain": dict(temperature=0.8, top_k=50, top_p=TOP_P, min_p=0.05),
}
# The controls (penalties, token sets, typical/epsilon/eta), timed in the same round robin (a second table). "penalties" gets token
# counts of CONTROL_SEEN random tokens per row; the token fields hold CONTROL_IDS ids per row.
CONTROL_IDS = 32
CONTROL_ALLOWED = 1000
CONTROL_SEEN = 64
CONTROL_PARAMS = {
    "penalties": dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
    "bias_ban": "logit_bias and banned_token_ids, CONTROL_IDS each",
    "allowed": "allowed_token_ids, CONTROL_ALLOWED per row",
    "typical": dict(typical_p=0.9),
    "epsilon": dict(epsilon_cutoff=3e-4),
    "eta": dict(eta_cutoff=3e-4),
    "top_n_sigma": dict(top_n_sigma=1.0),
    "xtc": dict(xtc_threshold=0.1, xtc_probability=0.5),
    "dynatemp": dict(dynatemp_range=0.5),
    "dry": dict(dry_multiplier=0.8),
    "mirostat": dict(mirostat=2, mirostat_tau=5.0),
    "ngram": dict(no_repeat_ngram_size=3),
    "bad_words": "bad_words, CONTROL_IDS sequences of 1 to 4 ids per row",
    "new_all": "top_n_sigma, xtc, dynatemp, dry, mirostat, ngram and bad_words at once",
}
CONTROL_HISTORY = 256  # tokens of history per row for the n-gram and bad-word bans
SORT_PEER = "sort_top_p"
HF_PEER = "transformers_top_p"


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
# Logits and the peers.


def make_logits(shape: str, batch: int, vocab: int, seed: int = 0) -> jax.Array:
  """Benchmark logits, float32[batch, vocab].

  Args:
    shape: "wide" (standard Gaussian noise: a flat distribution, top-p keeps most of the
      vocabulary) or "lm" (a steep Zipf profile like a trained LM's: the token of rank r has logit
      -3.3 ln(r), ranks randomly permuted in every row; top-p 0.9 keeps a handful of tokens).
    batch: B.
    vocab: V.
    seed: numpy seed; the same arguments give the same logits.
  """
  rng = np.random.default_rng(seed)
  if shape == "wide":
    return jnp.asarray(rng.standard_normal((batch, vocab), dtype=np.float32))
  if shape == "lm":
    profile = -ZIPF_EXPONENT * np.log(np.arange(1, vocab + 1, dtype=np.float64))  # [V], by rank
    ranks = rng.permuted(np.broadcast_to(np.arange(vocab), (batch, vocab)), axis=1)  # [B, V]
    return jnp.asarray(profile[ranks].astype(np.float32))
  raise ValueError(f"shape must be one of {SHAPES}; got {shape!r}")


def _sorted_top_p(logits: jax.Array, top_p):
  """The sort-based top-p cut in sorted order.

  Returns:
    `(order int32[B, V], sorted_x float32[B, V], keep bool[B, V])`: the descending sort
    permutation of each row, the sorted logits, and whether each sorted position is kept.
  """
  x = logits.astype(jnp.float32)
  batch, vocab = x.shape
  p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,))[:, None]  # [B, 1]
  order = jnp.argsort(-x, axis=-1, stable=True)  # [B, V], descending
  sorted_x = jnp.take_along_axis(x, order, axis=-1)  # [B, V]
  probs = jax.nn.softmax(sorted_x, axis=-1)
  exclusive = jnp.pad(jnp.cumsum(probs, axis=-1)[:, :-1], ((0, 0), (1, 0)))  # mass before j
  # Ties: every member of a group of equal logits gets the sum before the group's first member.
  iota = jax.lax.broadcasted_iota(jnp.int32, (batch, vocab), 1)
  new_group = jnp.pad(sorted_x[:, 1:] != sorted_x[:, :-1], ((0, 0), (1, 0)),
                      constant_values=True)  # [B, V]
  group_start = jax.lax.cummax(jnp.where(new_group, iota, 0), axis=1)  # [B, V]
  above = jnp.take_along_axis(exclusive, group_start, axis=-1)  # mass strictly more probable
  return order, sorted_x, (above < p) | (p >= 1)


@jax.jit
def sort_top_p_mask(logits: jax.Array, top_p) -> jax.Array:
  """The top-p kept set computed the textbook way, by sorting: `bool[B, V]`, True if kept.

  Sort each row descending, softmax, exclusive cumulative sum: a token is kept iff the mass
  before it is < p. Ties are resolved as jaxdecode.processors defines top-p (the mass of the tokens
  *strictly* more probable than i), so every member of a tie group gets the exclusive sum at the
  group's first position. float32.

  Args:
    logits: [B, V] floating logits (no NaN).
    top_p: a scalar or [B] array in (0, 1].
  """
  order, _, keep = _sorted_top_p(logits, top_p)
  inverse = jnp.argsort(order, axis=-1)  # [B, V]: the sorted position of each token
  return jnp.take_along_axis(keep, inverse, axis=-1)


@jax.jit
def sort_top_p_sample(key: jax.Array, logits: jax.Array, top_p) -> jax.Array:
  """A straightforward sort-based exact top-p sampler (the reference jaxdecode is timed against).

  Sorts each row descending, takes softmax and the exclusive cumulative sum, keeps the tokens
  whose exclusive sum is < p (ties as in `sort_top_p_mask`), draws with
  `jax.random.categorical` from the kept sorted logits and maps the draw back through the sort
  permutation.

  Args:
    key: one PRNG key (rows draw independently).
    logits: [B, V] floating logits (no NaN).
    top_p: a scalar or [B] array in (0, 1].

  Returns:
    int32[B] token ids.
  """
  order, sorted_x, keep = _sorted_top_p(logits, top_p)
  position = jax.random.categorical(key, jnp.where(keep, sorted_x, -jnp.inf), axis=-1)  # [B]
  return jnp.take_along_axis(order, position[:, None], axis=-1)[:, 0].astype(jnp.int32)


def transformers_top_p_sampler(top_p: float = TOP_P):
  """The `transformers` Flax top-p path as one jitted function, or None if not installed.

  Returns:
    `fn(key, logits[B, V]) -> int32[B]` that applies `FlaxTopPLogitsWarper(top_p)` and draws with
    `jax.random.categorical` (what `FlaxGenerationMixin` sampling does), or None when
    `transformers` (with its Flax generation code, `transformers<5`) cannot be imported.
  """
  try:
    # pylint: disable-next=import-outside-toplevel
    from transformers.generation.flax_logits_process import FlaxTopPLogitsWarper
  except Exception:  # pylint: disable=broad-except  # missing, or a version without Flax
    return None
  warper = FlaxTopPLogitsWarper(float(top_p))

  @jax.jit
  def sample(key, logits):
    return jax.random.categorical(key, warper(None, logits, 0), axis=-1).astype(jnp.int32)

  return sample


def _transformers_version() -> str | None:
  try:
    import transformers  # pylint: disable=import-outside-toplevel
  except Exception:  # pylint: disable=broad-except
    return None
  return transformers.__version__


# ---------------------------------------------------------------------------------------------
# Table 1: kernels.


def kernel_row(shape: str, batch: int, vocab: int, *, runs: int = RUNS, peers: bool = True,
               hf_sampler: Callable | None = None, seed: int = 0) -> dict:
  """Times one kernel row: argmax, greedy, the five samplers and (optionally) the peers.

  Args:
    shape: "wide" or "lm" (see `make_logits`).
    batch: B.
    vocab: V.
    runs: timed runs (the median is reported).
    peers: whether to time the sort-based reference (and `hf_sampler`, if given).
    hf_sampler: `transformers_top_p_sampler()`, or None to leave transformers out.
    seed: seed of the logits.

  Returns:
    A dict with `shape`, `batch`, `vocab`, `runs`, `median_s` (name -> seconds), `ratio`
    (name -> time / argmax time; exactly 1 for argmax) and `speedup` (`vs_sort` and
    `vs_transformers`: peer time / jaxdecode top-p time, where timed).
  """
  logits = make_logits(shape, batch, vocab, seed)
  key = jax.random.key(seed)
  argmax = jax.jit(lambda x: jnp.argmax(x, axis=-1))
  fns = {"argmax": lambda: argmax(logits), "greedy": lambda: jaxdecode.greedy(logits)}
  for name, settings in KERNEL_PARAMS.items():
    params = SamplingParams(**settings)  # built (and validated) once, outside the timing
    fns[name] = lambda params=params: jaxdecode.sample(key, logits, params)
  for name, (params, counts, history) in control_params(batch, vocab, seed).items():
    fns[name] = lambda params=params, counts=counts, history=history: jaxdecode.sample(
        key, logits, params, counts=counts, history=history)
  if peers:
    top_p = jnp.float32(TOP_P)
    fns[SORT_PEER] = lambda: sort_top_p_sample(key, logits, top_p)
    if hf_sampler is not None:
      fns[HF_PEER] = lambda: hf_sampler(key, logits)
  medians = _medians(time_round_robin(fns, runs))
  base = medians["argmax"]
  row = {"shape": shape, "batch": batch, "vocab": vocab, "runs": runs, "median_s": medians,
         "ratio": {name: t / base for name, t in medians.items()}, "speedup": {}}
  if SORT_PEER in medians:
    row["speedup"]["vs_sort"] = medians[SORT_PEER] / medians["top_p"]
  if HF_PEER in medians:
    row["speedup"]["vs_transformers"] = medians[HF_PEER] / medians["top_p"]
  return row


def control_params(batch: int, vocab: int, seed: int = 0) -> dict:
  """name -> (SamplingParams, counts or None, history or None) for the control columns (see
  CONTROL_PARAMS)."""
  rng = np.random.default_rng(seed)
  def ids(n):
    return [rng.choice(vocab, min(n, vocab), replace=False).tolist() for _ in range(batch)]

  seen = rng.integers(0, vocab, size=(batch, CONTROL_SEEN))
  counts = jaxdecode.token_counts(jnp.asarray(seen), vocab)
  history = jnp.asarray(rng.integers(0, vocab, size=(batch, CONTROL_HISTORY)), jnp.int32)
  words = [[rng.integers(0, vocab, rng.integers(1, 5)).tolist() for _ in range(CONTROL_IDS)]
           for _ in range(batch)]
  new = dict(CONTROL_PARAMS["top_n_sigma"], **CONTROL_PARAMS["xtc"], **CONTROL_PARAMS["ngram"],
             **CONTROL_PARAMS["dynatemp"], **CONTROL_PARAMS["dry"],
             **CONTROL_PARAMS["mirostat"])
  return {
      "penalties": (SamplingParams(**CONTROL_PARAMS["penalties"]), counts, None),
      "bias_ban": (SamplingParams(
          logit_bias=[dict(zip(r, rng.normal(size=CONTROL_IDS).tolist())) for r in
                      ids(CONTROL_IDS)], banned_token_ids=ids(CONTROL_IDS)), None, None),
      "allowed": (SamplingParams(allowed_token_ids=ids(CONTROL_ALLOWED)), None, None),
      "typical": (SamplingParams(**CONTROL_PARAMS["typical"]), None, None),
      "epsilon": (SamplingParams(**CONTROL_PARAMS["epsilon"]), None, None),
      "eta": (SamplingParams(**CONTROL_PARAMS["eta"]), None, None),
      "top_n_sigma": (SamplingParams(**CONTROL_PARAMS["top_n_sigma"]), None, None),
      "xtc": (SamplingParams(**CONTROL_PARAMS["xtc"]), None, None),
      "dynatemp": (SamplingParams(**CONTROL_PARAMS["dynatemp"]), None, None),
      "dry": (SamplingParams(**CONTROL_PARAMS["dry"]), None, history),
      "mirostat": (SamplingParams(**CONTROL_PARAMS["mirostat"]), None, None),
      "ngram": (SamplingParams(**CONTROL_PARAMS["ngram"]), None, history),
      "bad_words": (SamplingParams(bad_words=words), None, history),
      "new_all": (SamplingParams(**new, bad_words=words), None, history),
  }


def kernel_table(*, batches: Sequence[int] = BATCHES, vocabs: Sequence[int] = VOCABS,
                 shapes: Sequence[str] = SHAPES, runs: int = RUNS,
                 peer_max_elements: int | None = PEER_MAX_ELEMENTS, transformers: bool = True,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
  """All kernel rows (see `kernel_row`), shape by shape, then by B, then by V.

  Args:
    batches: the B values.
    vocabs: the V values.
    shapes: logit shapes, from `SHAPES`.
    runs: timed runs per row.
    peer_max_elements: time the sort-based peers only where B*V is at most this (None: always).
    transformers: include the `transformers` Flax peer when it is installed.
    progress: called with one line after each row (e.g. to print to stderr).

  Returns:
    The rows; a row whose peers were skipped has `peers_skipped` set to the reason.
  """
  hf = transformers_top_p_sampler() if transformers else None
  rows = []
  for shape in shapes:
    for batch in batches:
      for vocab in vocabs:
        started = time.perf_counter()
        peers = peer_max_elements is None or batch * vocab <= peer_max_elements
        row = kernel_row(shape, batch, vocab, runs=runs, peers=peers, hf_sampler=hf)
        if not peers:
          row["peers_skipped"] = f"B*V = {batch * vocab} > {peer_max_elements} (--all-peers)"
        rows.append(row)
        if progress:
          progress(f"kernel {shape} B={batch} V={vocab}: {time.perf_counter() - started:.0f} s")
  return rows


# ---------------------------------------------------------------------------------------------
# Table 2: decode.


def random_model(vocab_size: int = 32000, *, d_model: int = 256, n_layers: int = 4,
                 n_heads: int = 4, d_ff: int = 1024, max_len: int = 256, seed: int = 0):
  """A random-weights `jaxdecode.models.Transformer` (the decode table's large-vocabulary model)."""
  config = TransformerConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                             n_heads=n_heads, d_ff=d_ff, max_len=max_len)
  return Transformer(config, rngs=nnx.Rngs(seed))


def _default_model():
  return load_default()[0]


def _prompts(vocab: int, batch: int, seed: int = 0) -> list[list[int]]:
  """`batch` prompts of 3..12 random ids in [0, min(vocab, 256)): bytes for the default model."""
  rng = np.random.default_rng(seed)
  high = min(vocab, 256)
  return [rng.integers(0, high, size=int(rng.integers(3, 13))).tolist() for _ in range(batch)]


def decode_row(name: str, model, *, runs: int = RUNS, batch: int = 8, max_new_tokens: int = 64,
               seed: int = 0) -> dict:
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

  Returns:
    A dict with `model`, `vocab`, `batch`, `max_new_tokens`, `prompt_width`, `runs`,
    `first_call_s`, `median_s` (greedy, top_p, greedy_eos), `tokens_per_s` (greedy, top_p),
    `early_stop_max_length` (the longest row of the EOS decode) and `ratio`: `top_p_vs_greedy`
    (top-p tokens/s over greedy tokens/s), `first_vs_later` (first call time over the greedy
    median) and `early_stop_vs_full` (EOS decode time over greedy time).
  """
  vocab = model.config.vocab_size
  prompts = _prompts(vocab, batch, seed)
  width = bucket_length(max(len(p) for p in prompts))
  if width + max_new_tokens > model.config.max_len:
    raise ValueError(f"prompt width {width} + max_new_tokens {max_new_tokens} exceeds the "
                     f"model's max_len {model.config.max_len}")
  tokens, lengths = jaxdecode.right_pad(prompts, width=width)
  graphdef, weights = nnx.split(model)
  logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=width + max_new_tokens)
  jax.block_until_ready(logits)
  step_fn = make_step_fn(graphdef)  # a new function: the first decode call compiles
  key = jax.random.key(seed)
  greedy, top_p = SamplingParams(temperature=0.0), SamplingParams(top_p=TOP_P)

  def run(params, eos_ids=()):
    return jaxdecode.decode(step_fn, state, logits, key=key, params=params,
                            max_new_tokens=max_new_tokens, positions=lengths, eos_ids=eos_ids)

  start = time.perf_counter()
  first = jax.block_until_ready(run(greedy))
  first_call = time.perf_counter() - start
  eos_ids = sorted(set(np.asarray(first.tokens[:, :2]).reshape(-1).tolist()))
  early = run(greedy, eos_ids)
  medians = _medians(time_round_robin({
      "greedy": lambda: run(greedy).tokens,
      "top_p": lambda: run(top_p).tokens,
      "greedy_eos": lambda: run(greedy, eos_ids).tokens,
  }, runs))
  new_tokens = batch * max_new_tokens
  return {
      "model": name, "vocab": vocab, "batch": batch, "max_new_tokens": max_new_tokens,
      "prompt_width": width, "runs": runs, "first_call_s": first_call, "median_s": medians,
      "tokens_per_s": {"greedy": new_tokens / medians["greedy"],
                       "top_p": new_tokens / medians["top_p"]},
      "early_stop_max_length": int(np.max(np.asarray(early.lengths))),
      "ratio": {"top_p_vs_greedy": medians["greedy"] / medians["top_p"],
                "first_vs_later": first_call / medians["greedy"],
                "early_stop_vs_full": medians["greedy_eos"] / medians["greedy"]},
  }


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
  rows = []
  for name, loader in models:
    started = time.perf_counter()
    try:
      model = loader()
    except Exception as e:  # pylint: disable=broad-except  # any failure to load skips the row
      row = {"model": name, "skipped": f"could not load the model: {type(e).__name__}: {e}"}
    else:
      try:
        row = decode_row(name, model, runs=runs, batch=batch, max_new_tokens=max_new_tokens)
      except ValueError as e:  # e.g. a context too short for the prompts + N tokens
        row = {"model": name, "skipped": f"{type(e).__name__}: {e}"}
    rows.append(row)
    if progress:
      progress(f"decode {name}: " + (f"skipped ({row['skipped']})" if "skipped" in row else
                                     f"{time.perf_counter() - started:.0f} s"))
  return rows


# ---------------------------------------------------------------------------------------------
# Table 3: beam search.


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
  prompts = _prompts(vocab, batch, seed)
  width = bucket_length(max(len(p) for p in prompts))
  if width + max_new_tokens > model.config.max_len:
    raise ValueError(f"prompt width {width} + max_new_tokens {max_new_tokens} exceeds the "
                     f"model's max_len {model.config.max_len}")
  tokens, lengths = jaxdecode.right_pad(prompts, width=width)
  graphdef, weights = nnx.split(model)
  logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=width + max_new_tokens)
  step_fn = make_step_fn(graphdef)
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
  rows = []
  for name, loader in models:
    started = time.perf_counter()
    try:
      model = loader()
    except Exception as e:  # pylint: disable=broad-except  # any failure to load skips the row
      row = {"model": name, "skipped": f"could not load the model: {type(e).__name__}: {e}"}
    else:
      try:
        row = beam_row(name, model, runs=runs, batch=batch, max_new_tokens=max_new_tokens,
                       beam_size=beam_size)
      except ValueError as e:
        row = {"model": name, "skipped": f"{type(e).__name__}: {e}"}
    rows.append(row)
    if progress:
      progress(f"beam {name}: " + (f"skipped ({row['skipped']})" if "skipped" in row else
                                   f"{time.perf_counter() - started:.0f} s"))
  return rows


# ---------------------------------------------------------------------------------------------
# Table 4: batch-invariant numerics against plain XLA.


def numerics_row(batch: int, *, runs: int = RUNS, max_new_tokens: int = 64,
                 loader: Callable[[bool], Any] | None = None, seed: int = 0) -> dict:
  """Greedy decode tokens/s of the batch-invariant numerics over plain XLA, same weights.

  Both modes run round-robin on their own prefill of the same prompts. Also timed: each mode's
  first decode call (compilation included), and one invariant step at a late position (near
  `max_len`) over one at position 32: what a longer cache costs a step.

  Args:
    batch: B.
    runs: timed runs.
    max_new_tokens: N.
    loader: `loader(batch_invariant) -> Transformer` (default: the embedded model).
    seed: seed of the prompts.

  Returns:
    A dict with `batch`, `max_new_tokens`, `runs`, `median_s` (invariant, plain),
    `first_call_s` (invariant, plain), `step_ms` (early, late positions), `late_position`, and
    `ratio`: `invariant_vs_plain` (tokens/s) and `late_vs_early_step`.
  """
  loader = loader or (lambda invariant: load_default(batch_invariant=invariant)[0])
  greedy = SamplingParams(temperature=0.0)
  key = jax.random.key(seed)
  runs_by_mode, first_call, steps = {}, {}, {}
  late = None
  for mode, invariant in (("invariant", True), ("plain", False)):
    model = loader(invariant)
    prompts = _prompts(model.config.vocab_size, batch, seed)
    width = bucket_length(max(len(p) for p in prompts))
    if width + max_new_tokens > model.config.max_len:
      raise ValueError(f"prompt width {width} + max_new_tokens {max_new_tokens} exceeds the "
                       f"model's max_len {model.config.max_len}")
    tokens, lengths = jaxdecode.right_pad(prompts, width=width)
    graphdef, weights = nnx.split(model)
    cache = model.config.max_len
    logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=cache)
    step_fn = make_step_fn(graphdef)

    def run(step_fn=step_fn, state=state, logits=logits, lengths=lengths):
      return jaxdecode.decode(step_fn, state, logits, key=key, params=greedy,
                              max_new_tokens=max_new_tokens, positions=lengths).tokens

    first_call[mode] = _first_call_s(run)
    runs_by_mode[mode] = run
    if invariant:
      late = cache - 32
      ids = jnp.zeros((batch,), jnp.int32)
      for name, position in (("early", 32), ("late", late)):
        at = jnp.full((batch,), position, jnp.int32)
        steps[name] = (lambda at=at: step_fn(state, ids, at)[0])
  medians = _medians(time_round_robin({**runs_by_mode, **steps}, runs))
  return {
      "batch": batch, "max_new_tokens": max_new_tokens, "runs": runs,
      "median_s": {k: medians[k] for k in runs_by_mode}, "first_call_s": first_call,
      "step_ms": {k: medians[k] * 1e3 for k in steps}, "late_position": late,
      "ratio": {"invariant_vs_plain": medians["plain"] / medians["invariant"],
                "late_vs_early_step": medians["late"] / medians["early"]},
  }


def numerics_table(*, batches: Sequence[int] = BATCHES, runs: int = RUNS,
                   max_new_tokens: int = 64, loader: Callable[[bool], Any] | None = None,
                   progress: Callable[[str], None] | None = None) -> list[dict]:
  """`numerics_row` for each batch size (a row that cannot run is `{"batch", "skipped"}`)."""
  rows = []
  for batch in batches:
    started = time.perf_counter()
    try:
      row = numerics_row(batch, runs=runs, max_new_tokens=max_new_tokens, loader=loader)
    except Exception as e:  # pylint: disable=broad-except  # a missing model skips the row
      row = {"batch": batch, "skipped": f"{type(e).__name__}: {e}"}
    rows.append(row)
    if progress:
      progress(f"numerics B={batch}: " + (f"skipped ({row['skipped']})" if "skipped" in row
                                          else f"{time.perf_counter() - started:.0f} s"))
  return rows


# The same comparison on a model no one here wrote: transformers' Flax GPT-2 under
# `jaxdecode.batch_invariant` against the same model with plain XLA.

# Tiny but not trivial (about 5M parameters); random weights, nothing downloaded.
HF_GPT2 = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 256}
HF_NUMERICS_BATCHES = (1, 8)


def transformers_gpt2(config: Mapping | None = None, seed: int = 0):
  """`(model, params)`: transformers' `FlaxGPT2LMHeadModel` with random weights (`HF_GPT2`).

  Raises ImportError when transformers with its Flax models (`transformers<5`) is missing.
  """
  # pylint: disable-next=import-outside-toplevel
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  with jax.numpy_rank_promotion("allow"):  # transformers' code broadcasts by NumPy's rules
    model = FlaxGPT2LMHeadModel(GPT2Config(**(config or HF_GPT2)), _do_init=False)
    params = jax.jit(model.init_weights, static_argnums=1)(jax.random.key(seed), (1, 1))
  return model, params


def transformers_step_fns(model):
  """A transformers Flax causal LM as `(prefill, step_fn)` over its own cache, laid out as its
  `generate` lays out left-padded prompts (`prepare_inputs_for_generation`).

  `prefill(params, tokens [B, T], mask [B, S], cache)` (left-padded prompts; `mask` the
  prompts' mask followed by ones up to the cache's S slots; `cache` zeros of `init_cache(B, S)`)
  -> `(logits [B, V], state)`; `step_fn(state, tokens [B], positions [B])` is `decode`'s. The
  state holds the weights, the cache and the mask.
  """

  def prefill(params, tokens, mask, cache):
    position_ids = jnp.cumsum(mask[:, :tokens.shape[1]], -1) - 1  # padding gets -1, as generate
    out = model(tokens, attention_mask=mask, position_ids=position_ids, params=params,
                past_key_values=cache)
    return out.logits[:, -1], {"params": params, "cache": out.past_key_values, "mask": mask}

  def step_fn(state, tokens, positions):
    out = model(tokens[:, None], attention_mask=state["mask"], position_ids=positions[:, None],
                params=state["params"], past_key_values=state["cache"])
    return out.logits[:, -1], {**state, "cache": out.past_key_values}

  return prefill, step_fn


def transformers_numerics_row(batch: int, *, runs: int = RUNS, max_new_tokens: int = 64,
                              model=None, seed: int = 0) -> dict:
  """Greedy decode tokens/s of transformers' Flax GPT-2 under `jaxdecode.batch_invariant`
  (prefill and step) over the same model and weights with plain XLA, both through
  `jaxdecode.decode`, round-robin; and each mode's first decode call (compilation included).

  Args:
    batch: B.
    runs: timed runs.
    max_new_tokens: N.
    model: `(model, params)` (default: `transformers_gpt2()`).
    seed: seed of the prompts.

  Returns:
    A dict with `batch`, `max_new_tokens`, `runs`, `median_s` (invariant, plain),
    `first_call_s` (invariant, plain) and `ratio`: `invariant_vs_plain` (tokens/s).
  """
  model, params = model or transformers_gpt2()
  prompts = _prompts(model.config.vocab_size, batch, seed)
  tokens, lengths = jaxdecode.left_pad(prompts, buckets=None)
  cache_length = tokens.shape[1] + max_new_tokens
  mask = jnp.ones((batch, cache_length), jnp.int32).at[:, :tokens.shape[1]].set(
      jaxdecode.prompt_mask(lengths, tokens.shape[1]).astype(jnp.int32))
  greedy = SamplingParams(temperature=0.0)
  key = jax.random.key(seed)
  plain_fns = transformers_step_fns(model)
  runs_by_mode, first_call = {}, {}
  with jax.numpy_rank_promotion("allow"):
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
        lambda: model.init_cache(batch, cache_length)))  # init_cache's zeros, without its forward
    for mode, fns in (("invariant", tuple(map(jaxdecode.batch_invariant, plain_fns))),
                      ("plain", plain_fns)):
      prefill, step_fn = fns
      logits, state = jax.jit(prefill)(params, tokens, mask, cache)

      def run(step_fn=step_fn, state=state, logits=logits):
        with jax.numpy_rank_promotion("allow"):
          return jaxdecode.decode(step_fn, state, logits, key=key, params=greedy,
                                  max_new_tokens=max_new_tokens, positions=lengths).tokens

      first_call[mode] = _first_call_s(run)
      runs_by_mode[mode] = run
  medians = _medians(time_round_robin(runs_by_mode, runs))
  return {"batch": batch, "max_new_tokens": max_new_tokens, "runs": runs, "median_s": medians,
          "first_call_s": first_call,
          "ratio": {"invariant_vs_plain": medians["plain"] / medians["invariant"]}}


def transformers_numerics_table(*, batches: Sequence[int] = HF_NUMERICS_BATCHES,
                                runs: int = RUNS, max_new_tokens: int = 64, model=None,
                                progress: Callable[[str], None] | None = None) -> list[dict]:
  """`transformers_numerics_row` for each batch size; every row `{"batch", "skipped"}` when
  transformers' Flax GPT-2 cannot be imported (or a row cannot run)."""
  rows = []
  try:
    model = model or transformers_gpt2()
  except Exception as e:  # pylint: disable=broad-except  # transformers<5 is an optional extra
    why = (f"transformers with its Flax models (transformers<5) cannot be imported "
           f"({type(e).__name__}: {e}); pip install 'transformers<5'")
    return [{"batch": batch, "skipped": why} for batch in batches]
  for batch in batches:
    started = time.perf_counter()
    try:
      row = transformers_numerics_row(batch, runs=runs, max_new_tokens=max_new_tokens,
                                      model=model)
    except Exception as e:  # pylint: disable=broad-except
      row = {"batch": batch, "skipped": f"{type(e).__name__}: {e}"}
    rows.append(row)
    if progress:
      progress(f"numerics (transformers GPT-2) B={batch}: " + (
          f"skipped ({row['skipped']})" if "skipped" in row
          else f"{time.perf_counter() - started:.0f} s"))
  return rows


# ---------------------------------------------------------------------------------------------
# Table 5: speculative decoding.

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
  samplers = {"greedy": SamplingParams(temperature=0.0), "top-p": SamplingParams(top_p=TOP_P)}
  drafters = {}
  for name, draft in drafts.items():
    if draft == "ngram":
      drafters[name] = jaxdecode.NgramDrafter(tokens, lengths)
    else:
      d_graphdef, d_weights = nnx.split(draft)
      _, d_state = prefill(d_graphdef, d_weights, tokens, lengths,
                           cache_length=min(cache_length, draft.config.max_len))
      drafters[name] = jaxdecode.ModelDrafter(d_state, _bench_step_fn(d_graphdef))
  fns, stats = {}, {}
  for sampler, params in samplers.items():
    fns[f"plain/{sampler}"] = (lambda params=params: jaxdecode.decode(
        step_fn, state, logits, key=key, params=params, max_new_tokens=max_new_tokens,
        positions=lengths, eos_ids=[tok.EOS], pad_id=tok.PAD).tokens)
    for name, drafter in drafters.items():
      for k in ks:
        def spec(params=params, drafter=drafter, k=k):
          return jaxdecode.speculative_decode(
              step_fn, state, logits, key=key, params=params, max_new_tokens=max_new_tokens,
              positions=lengths, drafter=drafter, num_draft_tokens=k, eos_ids=[tok.EOS],
              pad_id=tok.PAD)
        out = spec()
        stats[(name, sampler, k)] = (
            float(jnp.sum(out.accepted)) / max(float(jnp.sum(out.drafted)), 1.0),
            int(out.calls))
        fns[f"{name}/{sampler}/{k}"] = lambda spec=spec: spec().tokens
  medians = _medians(time_round_robin(fns, runs))
  rows = []
  for name in drafters:
    for sampler in samplers:
      plain = medians[f"plain/{sampler}"]
      rows.append({
          "text": text, "batch": batch, "drafter": name, "sampler": sampler, "runs": runs,
          "max_new_tokens": max_new_tokens, "plain_ms": plain * 1e3,
          "speedup": {str(k): plain / medians[f"{name}/{sampler}/{k}"] for k in ks},
          "acceptance": {str(k): stats[(name, sampler, k)][0] for k in ks},
          "calls": {str(k): stats[(name, sampler, k)][1] for k in ks}})
  return rows


_BENCH_STEP_FNS: dict = {}


def _bench_step_fn(graphdef):
  if graphdef not in _BENCH_STEP_FNS:
    _BENCH_STEP_FNS[graphdef] = make_step_fn(graphdef)
  return _BENCH_STEP_FNS[graphdef]


def _default_draft():
  from jaxdecode.models import load_draft  # pylint: disable=import-outside-toplevel
  return load_draft()


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


# ---------------------------------------------------------------------------------------------
# Table 6: streaming.


def stream_row(model, *, batch: int, runs: int = RUNS, max_new_tokens: int = 64,
               chunk_size: int = 16, seed: int = 0) -> dict:
  """`models.stream` (every chunk consumed) over `models.generate` time, same prompts and key.

  Both include the prefill and the host-side text decoding; top-p 0.9, no EOS stop forced (the
  rows run until EOS or `max_new_tokens`, the same in both since the tokens are the same).

  Returns:
    A dict with `batch`, `max_new_tokens`, `chunk_size`, `runs`, `median_s` (generate, stream),
    `chunks` (how many the stream yielded) and `ratio`: `stream_vs_generate` (time).
  """
  from jaxdecode.models import generate, stream  # pylint: disable=import-outside-toplevel
  prompts = spec_prompts("fresh", batch)
  params = SamplingParams(top_p=TOP_P)
  kwargs = dict(model=model, params=params, seed=seed, max_new_tokens=max_new_tokens)
  chunks = len(list(stream(prompts, chunk_size=chunk_size, **kwargs)))
  medians = _medians(time_round_robin({
      "generate": lambda: generate(prompts, **kwargs).tokens,
      "stream": lambda: [c.lengths for c in stream(prompts, chunk_size=chunk_size, **kwargs)],
  }, runs))
  return {"batch": batch, "max_new_tokens": max_new_tokens, "chunk_size": chunk_size,
          "runs": runs, "median_s": medians, "chunks": chunks,
          "ratio": {"stream_vs_generate": medians["stream"] / medians["generate"]}}


def stream_table(*, batches: Sequence[int] = (1, 8), runs: int = RUNS, max_new_tokens: int = 64,
                 model_loader: Callable[[], Any] | None = None,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
  """`stream_row` for each batch size on the embedded model (or `model_loader()`)."""
  model = (model_loader or _default_model)()
  rows = []
  for batch in batches:
    started = time.perf_counter()
    rows.append(stream_row(model, batch=batch, runs=runs, max_new_tokens=max_new_tokens))
    if progress:
      progress(f"stream B={batch}: {time.perf_counter() - started:.0f} s")
  return rows


# ---------------------------------------------------------------------------------------------
# Table 7: structured decoding.

STRUCTURED_NEW_TOKENS = 32  # every structured row, quick or not
STRUCTURED_BATCHES = (1, 8)
STRUCTURED_VOCAB = 32000  # the compile rows' BPE vocabulary
# A realistic schema: an object of typed properties, an enum and an array. Its shortest match is
# longer than STRUCTURED_NEW_TOKENS bytes, so a constrained row never reaches an accepting state
# in the decode rows (every row runs every step, as the unconstrained one does).
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "score", "active", "role", "tags"],
}
# A log line (shortest match 35 bytes).
STRUCTURED_REGEX = (r"[0-9]{4}-[01][0-9]-[0-3][0-9] [0-2][0-9]:[0-5][0-9]:[0-5][0-9] "
                    r"(INFO|WARNING|ERROR) [a-z_]+\.py:[0-9]+: [A-Z][a-z ]+\.")
BPE_EOS = "<|endoftext|>"


def byte_level_decoder() -> dict[str, int]:
  """The inverse of the byte-to-unicode table of ByteLevel BPE (GPT-2's `bytes_to_unicode`):
  each of the 256 characters a ByteLevel token is spelled with -> the byte it stands for.
  Printable bytes stand for themselves; the 68 others are shifted to U+0100 and up."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  chars, shifted = dict(zip(printable, printable)), 0
  for b in range(256):
    if b not in chars:
      chars[b] = 256 + shifted
      shifted += 1
  return {chr(c): b for b, c in chars.items()}


def bpe_vocabulary(vocab_size: int = STRUCTURED_VOCAB, texts: Sequence[str] | None = None):
  """A ByteLevel BPE vocabulary trained with the `tokenizers` package, as a
  `jaxdecode.structured.Vocabulary`.

  Args:
    vocab_size: the vocabulary's size (the 256 bytes, the merges and one special token).
    texts: the training text (default: the embedded model's corpus, the standard library's
      `.py` files and the pydoc topics; about 6 s on 2 cores for 32000 tokens).

  Returns:
    `(vocabulary, tokenizer)`: each token's bytes (its ByteLevel characters mapped back through
    `byte_level_decoder`), the special token `<|endoftext|>` as None and the EOS id; and the
    trained `tokenizers.Tokenizer`.

  Raises:
    ImportError: `tokenizers` is not installed.
  """
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, models as bpe_models, pre_tokenizers, trainers
  from jaxdecode import structured  # pylint: disable=import-outside-toplevel
  if texts is None:
    from jaxdecode.models import corpus  # pylint: disable=import-outside-toplevel
    texts = [doc.decode("utf-8") for _, doc in
             corpus.pydoc_documents() + corpus.stdlib_documents()]
  tokenizer = Tokenizer(bpe_models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  to_byte = byte_level_decoder()
  tokens = [None] * tokenizer.get_vocab_size()
  for text, i in tokenizer.get_vocab().items():
    tokens[i] = None if text == BPE_EOS else bytes(to_byte[ch] for ch in text)
  sample = 'def f(x):\n\treturn {"caf\u00e9": [1, 2.5]}  # \u00fc \u2192 \U0001f600\n'
  ids = tokenizer.encode(sample).ids
  if b"".join(tokens[i] for i in ids) != sample.encode("utf-8"):
    raise AssertionError("the BPE tokens' bytes do not spell the text they encode")
  return structured.Vocabulary(tokens, [tokenizer.token_to_id(BPE_EOS)]), tokenizer


def structured_decode_row(model, *, batch: int, runs: int = RUNS,
                          max_new_tokens: int = STRUCTURED_NEW_TOKENS,
                          schema: Mapping = STRUCTURED_SCHEMA, pattern: str = STRUCTURED_REGEX,
                          constraints: Sequence[str] = ("json", "regex"), seed: int = 0) -> dict:
  """Constrained over unconstrained `jaxdecode.decode` tokens/s on one prefill.

  Three functions run round-robin, each one full `decode` call with top-p 0.9 and no EOS (every
  row runs all `max_new_tokens` steps): without a constraint ("plain"), with the JSON schema's
  constraint and with the regex's, built for the model's byte vocabulary
  (`ByteTokenizer().vocabulary()`). Each of the three is its own compiled program.

  Args:
    model: a `jaxdecode.models.Transformer` over the byte vocabulary (259 tokens).
    batch: B (the prompts are `spec_prompts("fresh", B)`).
    runs: timed runs.
    max_new_tokens: N.
    schema, pattern: the JSON schema and the regex.
    constraints: which of "json" and "regex" to time against "plain".
    seed: seed of the sampling key.

  Returns:
    A dict with `batch`, `max_new_tokens`, `runs`, `vocab`, `median_s` (plain, json, regex),
    `tokens_per_s` (the same), `table_shape` (json, regex: the padded `[S, C]` of each
    constraint), `table_bytes` (json, regex) and `ratio`: `json_vs_plain` and `regex_vs_plain`
    (constrained tokens/s over unconstrained tokens/s; 1.00 = a constraint costs nothing).
  """
  from jaxdecode import structured  # pylint: disable=import-outside-toplevel
  from jaxdecode.models import ByteTokenizer  # pylint: disable=import-outside-toplevel
  tok = ByteTokenizer()
  vocabulary = tok.vocabulary()
  build = {"json": lambda: structured.json_schema(dict(schema), vocabulary),
           "regex": lambda: structured.regex(pattern, vocabulary)}
  constraints = {name: build[name]() for name in constraints}
  ids = [tok.encode(p) for p in spec_prompts("fresh", batch)]
  width = bucket_length(max(len(i) for i in ids))
  if width + max_new_tokens > model.config.max_len:
    raise ValueError(f"prompt width {width} + max_new_tokens {max_new_tokens} exceeds the "
                     f"model's max_len {model.config.max_len}")
  tokens, lengths = jaxdecode.right_pad(ids, pad_id=tok.PAD, width=width)
  graphdef, weights = nnx.split(model)
  logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=width + max_new_tokens)
  step_fn = _bench_step_fn(graphdef)
  key = jax.random.key(seed)
  params = SamplingParams(top_p=TOP_P)

  def run(constraint=None):
    # A constrained row may only end with its vocabulary's EOS (refused otherwise); both
    # languages are longer than the window, so no constrained row reaches it.
    return jaxdecode.decode(step_fn, state, logits, key=key, params=params,
                            max_new_tokens=max_new_tokens, positions=lengths, pad_id=tok.PAD,
                            eos_ids=[tok.EOS] if constraint is not None else (),
                            constraint=constraint).tokens

  medians = _medians(time_round_robin({
      "plain": run, **{name: (lambda c=c: run(c)) for name, c in constraints.items()}}, runs))
  new_tokens = batch * max_new_tokens
  return {
      "kind": "decode", "batch": batch, "max_new_tokens": max_new_tokens, "runs": runs,
      "vocab": model.config.vocab_size, "median_s": medians,
      "tokens_per_s": {name: new_tokens / t for name, t in medians.items()},
      "table_shape": {name: list(c.next_state.shape) for name, c in constraints.items()},
      "table_bytes": {name: c.nbytes() for name, c in constraints.items()},
      "ratio": {f"{name}_vs_plain": medians["plain"] / medians[name] for name in constraints},
  }


# The compile rows beyond the decode table's two constraints: the cases of issue 37 (a long
# wildcard, and a JSON string whose outlines-core automaton was exponential in maxLength).
STRUCTURED_EXTRA_COMPILES = {"any300": ".{0,300}", "maxlen1000": {"type": "string",
                                                                  "maxLength": 1000}}


def structured_compile_row(vocabulary, name: str, spec, *, vocab_seconds: float | None = None,
                           outlines_index: bool = True) -> dict:
  """The time and peak host memory to compile one constraint for `vocabulary` (from scratch:
  jaxdecode's cache of compiled constraints is cleared first) and the size of its tables.

  With `outlines_index`, also timed: outlines-core's own token `Index` of the same regex over the
  same tokens (what jaxdecode built its tables from before it walked the tokens itself).

  Args:
    vocabulary: a `jaxdecode.structured.Vocabulary` (e.g. from `bpe_vocabulary`).
    name: a name for the row; `spec` is a JSON schema when it is a dict, else a pattern.
    spec: the schema or the pattern.
    vocab_seconds: how long building `vocabulary` took (recorded as is).
    outlines_index: whether to time outlines-core's token index too (skip it where it blows
      up: a long maxLength).

  Returns:
    A dict with `kind` "compile", `constraint` (name), `vocab`, `compile_s`, `peak_mb` (the
    peak of the memory traced by `tracemalloc` during the compile: numpy's arrays included,
    outlines-core's worker process not), `index_s` (None without `outlines_index`), `vocab_s`,
    `regex_chars` (the regex's length), `table_shape` (the padded `[S, C]` of `next_state`) and
    `table_bytes` (`constraint.nbytes()`).
  """
  # pylint: disable=import-outside-toplevel
  import tracemalloc
  from outlines_core import Index, Vocabulary as OutlinesVocabulary
  from outlines_core.json_schema import build_regex_from_schema
  from jaxdecode import structured
  # pylint: enable=import-outside-toplevel
  is_schema = isinstance(spec, Mapping)
  pattern = build_regex_from_schema(json.dumps(spec)) if is_schema else spec
  for cached in (getattr(structured, "_compile_schema", None),
                 getattr(structured, "_compile_regex", None)):
    if hasattr(cached, "cache_clear"):
      cached.cache_clear()  # measure a compile, not a cache hit
  build = structured.json_schema if is_schema else structured.regex
  tracemalloc.start()
  try:
    start = time.perf_counter()
    constraint = jax.block_until_ready(build(spec, vocabulary))
    compile_s = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  index_s = None
  if outlines_index:
    groups: dict[bytes, list[int]] = {}
    for i, token in enumerate(vocabulary.tokens):
      if token is not None and i not in vocabulary.eos_ids:
        groups.setdefault(token, []).append(i)
    start = time.perf_counter()
    Index(pattern, OutlinesVocabulary(vocabulary.eos_ids[0], groups))
    index_s = time.perf_counter() - start
  return {"kind": "compile", "constraint": name, "vocab": len(vocabulary),
          "compile_s": compile_s, "peak_mb": peak / 2**20, "index_s": index_s,
          "vocab_s": vocab_seconds, "regex_chars": len(pattern),
          "table_shape": list(constraint.next_state.shape), "table_bytes": constraint.nbytes()}


def structured_table(*, batches: Sequence[int] = STRUCTURED_BATCHES, runs: int = RUNS,
                     max_new_tokens: int = STRUCTURED_NEW_TOKENS,
                     vocab_size: int | None = STRUCTURED_VOCAB,
                     model_loader: Callable[[], Any] | None = None,
                     vocab_texts: Sequence[str] | None = None,
                     constraints: Sequence[str] = ("json", "regex"),
                     extra_compiles: Sequence[str] = tuple(STRUCTURED_EXTRA_COMPILES),
                     progress: Callable[[str], None] | None = None) -> list[dict]:
  """`structured_decode_row` for each batch size on the embedded model (or `model_loader()`),
  then `structured_compile_row` for the JSON schema and the regex over a `vocab_size`-token
  ByteLevel BPE vocabulary (`bpe_vocabulary(vocab_size, vocab_texts)`; None: no compile rows).
  `constraints`: which of "json" and "regex" (both by default); `extra_compiles`: which of
  `STRUCTURED_EXTRA_COMPILES` to compile too. A part that cannot run is a row
  `{"kind", "skipped"}` (no model; `tokenizers` missing)."""
  rows = []
  try:
    model = (model_loader or _default_model)()
  except Exception as e:  # pylint: disable=broad-except  # no model: the compile rows only
    rows.append({"kind": "decode", "batch": "-", "skipped": f"{type(e).__name__}: {e}"})
    model = None
  for batch in batches if model is not None else ():
    started = time.perf_counter()
    rows.append(structured_decode_row(model, batch=batch, runs=runs,
                                      max_new_tokens=max_new_tokens, constraints=constraints))
    if progress:
      progress(f"structured decode B={batch}: {time.perf_counter() - started:.0f} s")
  if vocab_size is None:
    return rows
  started = time.perf_counter()
  try:
    vocabulary, _ = bpe_vocabulary(vocab_size, vocab_texts)
  except ImportError as e:
    rows.append({"kind": "compile", "constraint": "json, regex",
                 "skipped": f"the BPE vocabulary needs the tokenizers package (pip install "
                            f"tokenizers): {e}"})
    return rows
  vocab_s = time.perf_counter() - started
  specs = {"json": STRUCTURED_SCHEMA, "regex": STRUCTURED_REGEX}
  for name in [*constraints, *extra_compiles]:
    spec = specs.get(name, STRUCTURED_EXTRA_COMPILES.get(name))
    started = time.perf_counter()
    rows.append(structured_compile_row(vocabulary, name, spec, vocab_seconds=vocab_s,
                                       outlines_index=name in specs))
    if progress:
      progress(f"structured compile {name} V={len(vocabulary)}: "
               f"{time.perf_counter() - started:.0f} s")
  return rows


# ---------------------------------------------------------------------------------------------
# The whole run, and its output.


def machine_info() -> dict:
  """Where the figures come from: OS, CPU, JAX devices and library versions."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
  devices = jax.devices()
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    usable = os.cpu_count()
  return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
          "usable_cpus": usable, "backend": jax.default_backend(),
          "device_kind": devices[0].device_kind, "devices": [repr(d) for d in devices],
          "python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "flax": flax.__version__,
          "jaxdecode": jaxdecode.__version__, "transformers": _transformers_version()}


def run_benchmarks(*, quick: bool = False, runs: int | None = None, decode: bool = True,
                   kernels: bool = True, beam: bool | None = None,
                   numerics: bool | None = None, spec: bool | None = None,
                   stream: bool | None = None, structured: bool | None = None,
                   all_peers: bool = False,
                   batches: Sequence[int] | None = None,
                   vocabs: Sequence[int] | None = None, shapes: Sequence[str] = SHAPES,
                   decode_models: Sequence[tuple[str, Callable[[], Any]]] | None = None,
                   beam_models: Sequence[tuple[str, Callable[[], Any]]] | None = None,
                   decode_batch: int = 8, max_new_tokens: int | None = None, command: str = "",
                   progress: Callable[[str], None] | None = None) -> dict:
  """Runs the kernel (and decode) tables; returns everything as one JSON-ready dict.

  Args:
    quick: the smaller grid (B=8, V in {32000, 128256}; 32 new tokens) and 10 runs by default.
    runs: timed runs per row (default 20, or 10 with `quick`).
    kernels: include the kernel (and controls) table.
    decode: include the decode table.
    beam: include the beam-search table (default: when the decode table is included).
    numerics: include the numerics table (default: likewise).
    spec: include the speculative-decoding table (default: likewise).
    stream: include the streaming table (default: likewise).
    structured: include the structured-decoding table (default: likewise).
    all_peers: time the sort-based peers at every size.
    batches: the kernel table's B values (default: by `quick`).
    vocabs: the kernel table's V values (default: by `quick`).
    shapes: the kernel table's logit shapes.
    decode_models: (name, loader) pairs for `decode_table` (default: its two models).
    beam_models: (name, loader) pairs for `beam_table` (default: the embedded model).
    decode_batch: prompts per decode (and beam search) call.
    max_new_tokens: tokens per decode and beam row (default 64, or 32 with `quick`).
    command: the command line, recorded in the result.
    progress: called with a line after each row.

  Returns:
    `{"command", "machine", "settings", "notes", "kernel", "decode", "beam", "numerics",
    "numerics_transformers", "speculative", "stream", "structured"}` (lists of the rows of
    `kernel_table`, `decode_table`, `beam_table`, `numerics_table`,
    `transformers_numerics_table`, `spec_table`, `stream_table` and `structured_table`),
    `settings["seconds"]` the total duration.
  """
  runs = runs or (QUICK_RUNS if quick else RUNS)
  started = time.perf_counter()
  notes = []
  if transformers_top_p_sampler() is None:
    notes.append("transformers (with its Flax generation code, transformers<5) is not installed: "
                 "the transformers columns are skipped (pip install 'transformers<5')")
  settings = {
      "quick": quick, "runs": runs, "warmup": WARMUP, "top_p": TOP_P,
      "kernel_params": KERNEL_PARAMS, "control_params": CONTROL_PARAMS,
      "batches": list(batches or (QUICK_BATCHES if quick else BATCHES)),
      "vocabs": list(vocabs or (QUICK_VOCABS if quick else VOCABS)), "shapes": list(shapes),
      "peer_max_elements": None if all_peers else PEER_MAX_ELEMENTS}
  kernel = []
  if kernels:
    kernel = kernel_table(batches=settings["batches"], vocabs=settings["vocabs"],
                          shapes=settings["shapes"], runs=runs,
                          peer_max_elements=settings["peer_max_elements"], progress=progress)
  decode_rows = []
  if decode:
    settings.update(decode_batch=decode_batch,
                    max_new_tokens=max_new_tokens or (32 if quick else 64))
    decode_rows = decode_table(decode_models, runs=runs, batch=decode_batch,
                               max_new_tokens=settings["max_new_tokens"], progress=progress)
  beam_rows = []
  if decode if beam is None else beam:
    settings.update(decode_batch=decode_batch, beam_size=BEAM_SIZE,
                    max_new_tokens=max_new_tokens or (32 if quick else 64))
    beam_rows = beam_table(beam_models, runs=runs, batch=decode_batch,
                           max_new_tokens=settings["max_new_tokens"], progress=progress)
  numerics_rows, numerics_hf_rows, spec_rows = [], [], []
  if decode if numerics is None else numerics:
    settings.update(numerics_batches=[1, 8] if quick else list(BATCHES),
                    max_new_tokens=max_new_tokens or (32 if quick else 64))
    numerics_rows = numerics_table(batches=settings["numerics_batches"], runs=runs,
                                   max_new_tokens=settings["max_new_tokens"], progress=progress)
    numerics_hf_rows = transformers_numerics_table(
        batches=HF_NUMERICS_BATCHES, runs=runs, max_new_tokens=settings["max_new_tokens"],
        progress=progress)
  if decode if spec is None else spec:
    settings.update(spec_batches=[1] if quick else [1, 8], spec_ks=[4] if quick else [2, 4, 8],
                    max_new_tokens=max_new_tokens or (32 if quick else 64))
    spec_rows = spec_table(batches=settings["spec_batches"], ks=settings["spec_ks"], runs=runs,
                           max_new_tokens=settings["max_new_tokens"], progress=progress)
  stream_rows = []
  if decode if stream is None else stream:
    settings.update(stream_batches=[1] if quick else [1, 8],
                    max_new_tokens=max_new_tokens or (32 if quick else 64))
    stream_rows = stream_table(batches=settings["stream_batches"], runs=runs,
                               max_new_tokens=settings["max_new_tokens"], progress=progress)
  structured_rows = []
  if decode if structured is None else structured:
    # The same sizes with --quick: the compile rows are timed once either way.
    settings.update(structured_batches=list(STRUCTURED_BATCHES),
                    structured_new_tokens=STRUCTURED_NEW_TOKENS,
                    structured_vocab=STRUCTURED_VOCAB)
    structured_rows = structured_table(batches=settings["structured_batches"], runs=runs,
                                       max_new_tokens=STRUCTURED_NEW_TOKENS,
                                       vocab_size=STRUCTURED_VOCAB, progress=progress)
  settings["seconds"] = time.perf_counter() - started
  return {"command": command, "machine": machine_info(), "settings": settings, "notes": notes,
          "kernel": kernel, "decode": decode_rows, "beam": beam_rows, "numerics": numerics_rows,
          "numerics_transformers": numerics_hf_rows, "speculative": spec_rows,
          "stream": stream_rows, "structured": structured_rows}


_WIDTH = 100  # the width of the legend lines


def _ms(seconds: float | None) -> str:
  """Seconds as milliseconds with 1 decimal; '-' when missing."""
  return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _fmt(value: float | None) -> str:
  """A ratio with 2 decimals below 10, 1 decimal from 10 on; '-' when missing."""
  if value is None:
    return "-"
  return f"{value:.2f}" if value < 10 else f"{value:.1f}"


_CONTROL_COLUMNS = (("penalties", "penalties"), ("bias+ban", "bias_ban"),
                    ("allowed", "allowed"), ("typical-p", "typical"), ("epsilon", "epsilon"),
                    ("eta", "eta"))
_SAMPLER_COLUMNS = (("top-nσ", "top_n_sigma"), ("xtc", "xtc"), ("dynatemp", "dynatemp"),
                    ("mirostat", "mirostat"), ("dry", "dry"), ("ngram", "ngram"),
                    ("bad-words", "bad_words"), ("all-new", "new_all"))
_KERNEL_COLUMNS = (  # (header, ratio key) after `argmax ms`
    ("greedy", "greedy"), ("sample", "sample"), ("top-k", "top_k"), ("top-p", "top_p"),
    ("min-p", "min_p"), ("chain", "chain"), ("sort-p", SORT_PEER), ("hf-p", HF_PEER))


def _section(title: list, header: str, rows: Sequence[Mapping], label: Callable,
             render: Callable, legend: str) -> list:
  """One table of the report: title, header, a line per row (`render(row, row["ratio"])`, or
  `label(row)` and the reason for a skipped row), and the legend."""
  lines = list(title) + [header, "-" * len(header)]
  for row in rows:
    if "skipped" in row:
      lines += textwrap.wrap(f"{label(row)} skipped: {row['skipped']}", _WIDTH,
                             subsequent_indent=" " * 4)
    else:
      lines.append(render(row, row.get("ratio")))
  return lines + textwrap.wrap(legend, _WIDTH) + [""]


def format_table(result: Mapping) -> str:
  """The human-readable report of `run_benchmarks` (what `python -m jaxdecode.bench` prints)."""
  m = result["machine"]
  s = result["settings"]
  lines = [
      f"$ {result['command']}" if result.get("command") else "",
      f"machine: {m['platform']} | {m['cpu']} | {m['cpu_count']} CPUs ({m['usable_cpus']} usable)",
      f"jax {m['jax']} (jaxlib {m['jaxlib']}), flax {m['flax']}, transformers "
      f"{m['transformers'] or 'not installed'}, python {m['python']}, jaxdecode {m['jaxdecode']}",
      f"backend {m['backend']}, device kind {m['device_kind']}, "
      f"jax.devices() = [{', '.join(m['devices'])}]",
      f"{s['runs']} timed runs per row after {s['warmup']} warm-up calls, round-robin; medians; "
      f"total {s['seconds']:.0f} s",
      "",
  ]
  kernel = result["kernel"]
  if kernel:
    lines += textwrap.wrap(
        "Kernels: time / argmax time on the same float32 [B, V] logits (lower is faster); x-sort, "
        "x-hf = peer time / jaxdecode top-p time (higher: jaxdecode is faster).", _WIDTH)
    header = (f"{'shape':<5} {'B':>3} {'V':>7} {'argmax ms':>9} "
              + " ".join(f"{h:>6}" for h, _ in _KERNEL_COLUMNS[:6])
              + f" {'sort-p':>7} {'x-sort':>6} {'hf-p':>7} {'x-hf':>6}")
    lines += [header, "-" * len(header)]
    for row in kernel:
      r, sp = row["ratio"], row["speedup"]
      lines.append(
          f"{row['shape']:<5} {row['batch']:>3} {row['vocab']:>7} "
          f"{row['median_s']['argmax'] * 1e3:>9.3f} "
          + " ".join(f"{_fmt(r.get(k)):>6}" for _, k in _KERNEL_COLUMNS[:6])
          + f" {_fmt(r.get(SORT_PEER)):>7} {_fmt(sp.get('vs_sort')):>6}"
          f" {_fmt(r.get(HF_PEER)):>7} {_fmt(sp.get('vs_transformers')):>6}")
    lines += textwrap.wrap(
        "shapes: wide = N(0, 1) noise; lm = logit -3.3 ln(rank), ranks permuted per row. "
        "greedy = jaxdecode.greedy; sample = jaxdecode.sample at T=1; top-k 50, top-p 0.9, "
        "min-p 0.05; chain = T 0.8 + top-k 50 + top-p 0.9 + min-p 0.05; sort-p = sort-based exact "
        "top-p 0.9 (bench.sort_top_p_sample); hf-p = transformers FlaxTopPLogitsWarper(0.9) + "
        "jax.random.categorical.", _WIDTH)
    skipped = [f"{row['shape']} B={row['batch']} V={row['vocab']}" for row in kernel
               if "peers_skipped" in row]
    if skipped:
      lines += textwrap.wrap(f"peers not timed where B*V > {s['peer_max_elements']} (run with "
                             f"--all-peers): {'; '.join(skipped)}", _WIDTH)
    lines.append("")
    lines += textwrap.wrap("Controls: time / argmax time, timed in the same round robin as the "
                           "kernels above.", _WIDTH)
    header = (f"{'shape':<5} {'B':>3} {'V':>7} "
              + " ".join(f"{h:>9}" for h, _ in _CONTROL_COLUMNS))
    lines += [header, "-" * len(header)]
    for row in kernel:
      lines.append(f"{row['shape']:<5} {row['batch']:>3} {row['vocab']:>7} "
                   + " ".join(f"{_fmt(row['ratio'].get(k)):>9}" for _, k in _CONTROL_COLUMNS))
    lines += textwrap.wrap(
        f"penalties = repetition 1.2 + presence 0.5 + frequency 0.5 with counts of "
        f"{CONTROL_SEEN} seen tokens per row; bias+ban = logit_bias and banned_token_ids, "
        f"{CONTROL_IDS} ids each per row; allowed = allowed_token_ids, {CONTROL_ALLOWED} per "
        f"row; typical-p 0.9; epsilon 3e-4; eta 3e-4 (jaxdecode.sample at T=1).", _WIDTH)
    lines.append("")
    lines += textwrap.wrap("Samplers beyond transformers: time / argmax time, the same round "
                           "robin.", _WIDTH)
    header = (f"{'shape':<5} {'B':>3} {'V':>7} "
              + " ".join(f"{h:>9}" for h, _ in _SAMPLER_COLUMNS))
    lines += [header, "-" * len(header)]
    for row in kernel:
      lines.append(f"{row['shape']:<5} {row['batch']:>3} {row['vocab']:>7} "
                   + " ".join(f"{_fmt(row['ratio'].get(k)):>9}" for _, k in _SAMPLER_COLUMNS))
    lines += textwrap.wrap(
        f"top-nσ 1; xtc threshold 0.1, probability 0.5; dynatemp range 0.5; mirostat 2 (tau 5, "
        f"its first step); over a history of {CONTROL_HISTORY} random tokens per row: dry "
        f"multiplier 0.8 (base 1.75, allowed length 2), ngram = no_repeat_ngram_size 3, "
        f"bad-words = {CONTROL_IDS} sequences of 1-4 ids per row; all-new = those seven at "
        f"once (jaxdecode.sample at T=1).", _WIDTH)
    lines.append("")
  if result.get("decode"):
    lines += _section(
        [f"Decode: jaxdecode.decode, batch {s['decode_batch']}, {s['max_new_tokens']} new "
         f"tokens per row, no EOS unless stated"],
        f"{'model':<11} {'V':>6} {'greedy ms':>9} {'greedy tok/s':>12} "
        f"{'top-p/greedy tok/s':>18} {'first/later':>11} {'EOS-stop/full':>13}",
        result["decode"], lambda row: row["model"],
        lambda row, r: (f"{row['model']:<11} {row['vocab']:>6} "
                        f"{row['median_s']['greedy'] * 1e3:>9.1f} "
                        f"{row['tokens_per_s']['greedy']:>12.0f} "
                        f"{_fmt(r['top_p_vs_greedy']):>18} {_fmt(r['first_vs_later']):>11} "
                        f"{_fmt(r['early_stop_vs_full']):>13}"),
        "top-p/greedy: tokens/s with top-p 0.9 over tokens/s greedy; first/later: the first call "
        "(compiles) over a later one; EOS-stop/full: a greedy decode whose rows all emit EOS in "
        "the first step(s) over the same decode without EOS.")
  if result.get("beam"):
    lines += _section(
        [f"Beam search: jaxdecode.beam_search, K = {s['beam_size']} beams, vs greedy "
         f"decode; batch {s['decode_batch']}, {s['max_new_tokens']} new tokens, no EOS"],
        f"{'model':<11} {'V':>6} {'greedy ms':>9} {'beam ms':>9} {'beam tok/s':>10} "
        f"{'beam/greedy tok/s':>17} {'model tokens':>12}",
        result["beam"], lambda row: row["model"],
        lambda row, r: (f"{row['model']:<11} {row['vocab']:>6} "
                        f"{row['median_s']['greedy'] * 1e3:>9.1f} "
                        f"{row['median_s']['beam'] * 1e3:>9.1f} "
                        f"{row['tokens_per_s']['beam']:>10.0f} {_fmt(r['beam_vs_greedy']):>17} "
                        f"{_fmt(r['beam_model_tokens_vs_greedy']):>12}"),
        "beam/greedy tok/s: returned tokens per second (B * N each) of beam search over greedy; "
        "model tokens: the same with the B * K * N tokens beam search feeds the model (1.00 = "
        "each beam costs what a greedy row costs).")
  if result.get("numerics"):
    late = next((r["late_position"] for r in result["numerics"] if "late_position" in r), None)
    lines += _section(
        [f"Numerics: greedy decode, {s['max_new_tokens']} new tokens, embedded model, "
         f"batch-invariant vs plain XLA (same weights)"],
        f"{'B':>3} {'inv ms':>8} {'plain ms':>8} {'inv/plain tok/s':>15} "
        f"{'compile inv s':>13} {'plain s':>7} {'late/early step':>15}",
        result["numerics"], lambda row: f"{row['batch']:>3}",
        lambda row, r: (f"{row['batch']:>3} {row['median_s']['invariant'] * 1e3:>8.1f} "
                        f"{row['median_s']['plain'] * 1e3:>8.1f} "
                        f"{_fmt(r['invariant_vs_plain']):>15} "
                        f"{row['first_call_s']['invariant']:>13.1f} "
                        f"{row['first_call_s']['plain']:>7.1f} "
                        f"{_fmt(r['late_vs_early_step']):>15}"),
        "inv/plain tok/s: the batch-invariant numerics' tokens/s over plain XLA's (1.00 = free); "
        "compile: the first decode call of each mode (compilation included); late/early step: "
        f"one invariant step at position {late} over one at position 32.")
  if result.get("numerics_transformers"):
    config = ", ".join(f"{k} {v}" for k, v in HF_GPT2.items())
    lines += _section(
        [f"Numerics: greedy decode, {s['max_new_tokens']} new tokens, transformers' Flax GPT-2, "
         f"batch_invariant vs plain XLA", f"({config}; random weights)"],
        f"{'B':>3} {'inv ms':>8} {'plain ms':>8} {'inv/plain tok/s':>15} "
        f"{'compile inv s':>13} {'plain s':>7}",
        result["numerics_transformers"], lambda row: f"{row['batch']:>3}",
        lambda row, r: (f"{row['batch']:>3} {row['median_s']['invariant'] * 1e3:>8.1f} "
                        f"{row['median_s']['plain'] * 1e3:>8.1f} "
                        f"{_fmt(r['invariant_vs_plain']):>15} "
                        f"{row['first_call_s']['invariant']:>13.1f} "
                        f"{row['first_call_s']['plain']:>7.1f}"),
        "inv/plain tok/s: tokens/s with the prefill and step under jaxdecode.batch_invariant "
        "over the same model's with plain XLA (1.00 = free); compile: each mode's first decode "
        "call.")
  if result.get("speculative"):
    ks = s.get("spec_ks", [])
    lines += _section(
        [f"Speculative: speculative_decode vs decode (the same tokens), embedded model, "
         f"{s['max_new_tokens']} new tokens"],
        f"{'text':<10} {'B':>2} {'drafter':<7} {'sampler':<7} {'plain ms':>8} "
        + " ".join(f"{'K=' + str(k) + ' x':>7} {'acc':>4}" for k in ks),
        result["speculative"], lambda row: f"drafter {row['drafter']}",
        lambda row, r: (f"{row['text']:<10} {row['batch']:>2} {row['drafter']:<7} "
                        f"{row['sampler']:<7} {row['plain_ms']:>8.1f} "
                        + " ".join(f"{_fmt(row['speedup'][str(k)]):>7} "
                                   f"{row['acceptance'][str(k)]:>4.0%}" for k in ks)),
        "K=k x: plain decode time / speculative time with k drafts per call (higher: "
        "speculation pays); acc: drafts accepted. repetitive: accessor methods differing by a "
        "name; fresh: the opening words of a docs paragraph. ngram: prompt lookup; model: the "
        "embedded draft model's greedy tokens.")
  if result.get("stream"):
    lines += _section(
        [f"Streaming: models.stream (every chunk consumed) vs models.generate, embedded model, "
         f"top-p 0.9, {s['max_new_tokens']} new tokens"],
        f"{'B':>3} {'chunk':>5} {'chunks':>6} {'generate ms':>11} {'stream ms':>9} "
        f"{'stream/generate':>15}",
        result["stream"], lambda row: f"{row['batch']:>3}",
        lambda row, r: (f"{row['batch']:>3} {row['chunk_size']:>5} {row['chunks']:>6} "
                        f"{row['median_s']['generate'] * 1e3:>11.1f} "
                        f"{row['median_s']['stream'] * 1e3:>9.1f} "
                        f"{_fmt(r['stream_vs_generate']):>15}"),
        "stream/generate: time of a stream consumed to the end over generate's (1.00 = "
        "streaming is free); both include the prefill and the text decoding.")
  structured_rows = result.get("structured") or []
  decode_rows = [row for row in structured_rows if row.get("kind") == "decode"]
  compile_rows = [row for row in structured_rows if row.get("kind") == "compile"]
  if decode_rows:
    new = s.get("structured_new_tokens", STRUCTURED_NEW_TOKENS)
    lines += _section(
        textwrap.wrap(f"Structured: jaxdecode.decode with constraint= vs without, embedded "
                      f"model, top-p 0.9, {new} new tokens, no EOS", _WIDTH),
        f"{'B':>3} {'plain ms':>8} {'json ms':>8} {'regex ms':>8} {'json/plain tok/s':>16} "
        f"{'regex/plain tok/s':>17} {'json table':>10}",
        decode_rows, lambda row: f"{row['batch']:>3}",
        lambda row, r: (f"{row['batch']:>3} {_ms(row['median_s'].get('plain')):>8} "
                        f"{_ms(row['median_s'].get('json')):>8} "
                        f"{_ms(row['median_s'].get('regex')):>8} "
                        f"{_fmt(r.get('json_vs_plain')):>16} {_fmt(r.get('regex_vs_plain')):>17} "
                        f"{'x'.join(map(str, row['table_shape'].get('json', ['-']))):>10}"),
        "json/plain, regex/plain: constrained tokens/s over unconstrained tokens/s on the same "
        "prefill (1.00 = the constraint is free; goal >= 0.95, floor 0.8). json: an object of "
        "7 typed properties (strings, integer, number, boolean, an enum, an array of strings); "
        "regex: a log line; both longer than the window, so every row runs every step. json "
        "table: the padded [states, token classes] of the byte vocabulary's constraint.")
  if compile_rows:
    lines += _section(
        textwrap.wrap("Structured compile: from scratch (cache cleared), for a ByteLevel BPE "
                      "vocabulary trained with tokenizers on the embedded corpus", _WIDTH),
        f"{'constraint':<10} {'V':>6} {'regex chars':>11} {'compile s':>9} {'peak MB':>7} "
        f"{'index s':>7} {'table':>11} {'table MB':>8}",
        compile_rows, lambda row: f"{row['constraint']:<10}",
        lambda row, r: (f"{row['constraint']:<10} {row['vocab']:>6} {row['regex_chars']:>11} "
                        f"{row['compile_s']:>9.2f} {row.get('peak_mb', math.nan):>7.0f} "
                        + (f"{row['index_s']:>7.2f} " if row.get("index_s") is not None
                           else f"{'-':>7} ")
                        + f"{'x'.join(map(str, row['table_shape'])):>11} "
                        f"{row['table_bytes'] / 2**20:>8.2f}"),
        "compile s: structured.json_schema / structured.regex (goal <= 5 s, floor 20 s); peak "
        "MB: the host memory traced during it (goal <= 200 MB + 10x the tables); index s: "
        "outlines-core's own token Index of the same regex, for comparison (what the tables "
        "were read from before; - where it blows up); any300: the regex .{0,300}; maxlen1000: a "
        "JSON string of maxLength 1000; table: next_state's padded [states, token classes]; "
        "table MB: constraint.nbytes() (goal <= 64 MB). The vocabulary took "
        + (f"{compile_rows[0]['vocab_s']:.1f} s to train."
           if compile_rows[0].get("vocab_s") is not None else "- s to train."))
  for note in result["notes"]:
    lines += textwrap.wrap(f"note: {note}", _WIDTH, subsequent_indent="  ")
  return "\n".join(lines).strip("\n") + "\n"


# ---------------------------------------------------------------------------------------------
# Command line.


def _runs(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
  if value < MIN_RUNS:
    raise argparse.ArgumentTypeError(f"the protocol needs at least {MIN_RUNS} runs; "
                                     f"got {value}")
  return value


def build_parser(prog: str = "python -m jaxdecode.bench") -> argparse.ArgumentParser:
  parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help=f"smaller grid (B=8, V in 32000/128256; 32 new tokens), {QUICK_RUNS} "
                           f"runs by default: roughly 10-12 minutes (the default run: about 32)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON object with every median (seconds) and ratio")
  parser.add_argument("--out", default=None, metavar="FILE",
                      help="also write that JSON object to FILE (checked before the run starts; "
                           "written atomically)")
  parser.add_argument("--runs", type=_runs, default=None, metavar="N",
                      help=f"timed runs per row (default {RUNS}; --quick: {QUICK_RUNS}, at "
                           f"least {MIN_RUNS})")
  parser.add_argument("--no-kernels", action="store_true",
                      help="skip the kernel and controls tables (the model tables only)")
  parser.add_argument("--no-decode", action="store_true", help="skip the decode table")
  parser.add_argument("--no-beam", action="store_true", help="skip the beam-search table")
  parser.add_argument("--no-numerics", action="store_true",
                      help="skip the batch-invariant numerics table")
  parser.add_argument("--no-spec", action="store_true",
                      help="skip the speculative-decoding table")
  parser.add_argument("--no-stream", action="store_true", help="skip the streaming table")
  parser.add_argument("--structured", action=argparse.BooleanOptionalAction, default=None,
                      help="include (or, with --no-structured, skip) the structured-decoding "
                           "table; by default it follows --decode like the other model tables "
                           "(on unless --no-decode), so --no-kernels --no-decode --structured "
                           "runs it alone (about 2 minutes, --quick too)")
  parser.add_argument("--all-peers", action="store_true",
                      help=f"time the sort-based peers also where B*V > {PEER_MAX_ELEMENTS} "
                           f"(20-30 minutes more)")
  return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m jaxdecode.bench") -> int:
  """Runs the benchmark and prints the table (or JSON); returns the exit status.

  Args:
    argv: the arguments (default `sys.argv[1:]`).
    prog: the command's name, for messages and the recorded command line.

  Returns:
    0 on success; 2 for a bad command line (reported in one line on stderr).
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = build_parser(prog)
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # --help (0) or a bad command line (2, already reported)
    return int(e.code or 0)
  if not args.quick and args.runs is not None and args.runs < RUNS:
    print(f"{prog}: error: published figures need --runs >= {RUNS}; add --quick for a smaller "
          f"run (see --help)", file=sys.stderr)
    return 2

  if args.out is not None:
    try:
      _files.check_output_file(args.out, "benchmark output")
    except ValueError as e:
      print(f"{prog}: error: {e}", file=sys.stderr)
      return 2

  def progress(line):
    print(f"[bench] {line}", file=sys.stderr, flush=True)

  result = run_benchmarks(quick=args.quick, runs=args.runs, kernels=not args.no_kernels,
                          decode=not args.no_decode,
                          beam=False if args.no_beam else None,
                          numerics=False if args.no_numerics else None,
                          spec=False if args.no_spec else None,
                          stream=False if args.no_stream else None,
                          structured=args.structured, all_peers=args.all_peers,
                          command=f"{prog} {shlex.join(argv)}".strip(), progress=progress)
  text = json.dumps(_finite(result), indent=1, sort_keys=False, allow_nan=False)
  if args.out is not None:
    _files.atomic_write_text(args.out, text + "\n", "benchmark output")
  if args.json:
    print(text)
  else:
    print(format_table(result), end="")
  return 0


def _finite(tree):
  """JSON-safe copy: non-finite floats become None."""
  if isinstance(tree, Mapping):
    return {k: _finite(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_finite(v) for v in tree]
  if isinstance(tree, float) and not math.isfinite(tree):
    return None
  return tree


if __name__ == "__main__":
  sys.exit(main())
