"""Table 1, kernels: `jaxdecode.greedy` and `jaxdecode.sample` (plain, top-k, top-p, min-p, a
chain, the controls and the samplers beyond transformers) over `jnp.argmax` on the same `[B, V]`
logits, with a sort-based exact top-p and transformers' Flax top-p warper as peers."""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode
from jaxdecode.params import SamplingParams
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench._common import BATCHES, RUNS, TOP_P, _medians, time_round_robin
from jaxdecode.tools.bench._table import Column, field, fixed

VOCABS = (32000, 128256, 256000)
SHAPES = ("wide", "lm")
QUICK_BATCHES = (8,)
QUICK_VOCABS = (32000, 128256)
PEER_MAX_ELEMENTS = 2_100_000  # B*V above which the sort-based peers are skipped by default
ZIPF_EXPONENT = 1.1 * 3  # "lm" logits: -ZIPF_EXPONENT * ln(rank)

# The jaxdecode samplers of a kernel row, in table order.
KERNEL_PARAMS = {
    "sample": dict(),
    "top_k": dict(top_k=50),
    "top_p": dict(top_p=TOP_P),
    "min_p": dict(min_p=0.05),
    "chain": dict(temperature=0.8, top_k=50, top_p=TOP_P, min_p=0.05),
}
# The controls (penalties, token sets, typical/epsilon/eta), timed in the same round robin (a
# second table). "penalties" gets token counts of CONTROL_SEEN random tokens per row; the token
# fields hold CONTROL_IDS ids per row.
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
# The rows.


def kernel_fns(logits: jax.Array, key: jax.Array,
               names: Sequence[str] = ("greedy", *KERNEL_PARAMS)) -> dict:
  """`jnp.argmax` under jit and the named kernels on `logits`, as zero-argument functions.

  Args:
    logits: `[B, V]`.
    key: the sampling key.
    names: "greedy" (`jaxdecode.greedy`) and names of `KERNEL_PARAMS` (`jaxdecode.sample`
      with those settings, built and validated once, outside the timing).

  Returns:
    name -> function, "argmax" first, then `names` in order.
  """
  argmax = jax.jit(lambda x: jnp.argmax(x, axis=-1))
  fns = {"argmax": lambda: argmax(logits)}
  for name in names:
    if name == "greedy":
      fns[name] = lambda: jaxdecode.greedy(logits)
    else:
      params = SamplingParams(**KERNEL_PARAMS[name])
      fns[name] = lambda params=params: jaxdecode.sample(key, logits, params)
  return fns


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
  fns = kernel_fns(logits, key)
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
# The report: the kernels, then the controls and the samplers beyond transformers (the same rows).


_KEY = (field("shape", 5, "shape", align="<"), field("B", 3, "batch"), field("V", 7, "vocab"))
_KERNEL_COLUMNS = (  # (header, ratio key) after `argmax ms`
    ("greedy", "greedy"), ("sample", "sample"), ("top-k", "top_k"), ("top-p", "top_p"),
    ("min-p", "min_p"), ("chain", "chain"))
_CONTROL_COLUMNS = (("penalties", "penalties"), ("bias+ban", "bias_ban"),
                    ("allowed", "allowed"), ("typical-p", "typical"), ("epsilon", "epsilon"),
                    ("eta", "eta"))
_SAMPLER_COLUMNS = (("top-nσ", "top_n_sigma"), ("xtc", "xtc"), ("dynatemp", "dynatemp"),
                    ("mirostat", "mirostat"), ("dry", "dry"), ("ngram", "ngram"),
                    ("bad-words", "bad_words"), ("all-new", "new_all"))


def _ratios(columns, width: int) -> list[Column]:
  return [field(header, width, "ratio", key, fmt=_table.ratio) for header, key in columns]


def _kernels(rows: Sequence[Mapping], settings: Mapping) -> list[str]:
  columns = [*_KEY, field("argmax ms", 9, "median_s", "argmax", fmt=fixed(3, 1e3)),
             *_ratios(_KERNEL_COLUMNS, 6), *_ratios((("sort-p", SORT_PEER),), 7),
             field("x-sort", 6, "speedup", "vs_sort", fmt=_table.ratio),
             *_ratios((("hf-p", HF_PEER),), 7),
             field("x-hf", 6, "speedup", "vs_transformers", fmt=_table.ratio)]
  legend = [
      "shapes: wide = N(0, 1) noise; lm = logit -3.3 ln(rank), ranks permuted per row. "
      "greedy = jaxdecode.greedy; sample = jaxdecode.sample at T=1; top-k 50, top-p 0.9, "
      "min-p 0.05; chain = T 0.8 + top-k 50 + top-p 0.9 + min-p 0.05; sort-p = sort-based exact "
      "top-p 0.9 (bench.sort_top_p_sample); hf-p = transformers FlaxTopPLogitsWarper(0.9) + "
      "jax.random.categorical."]
  skipped = [f"{row['shape']} B={row['batch']} V={row['vocab']}" for row in rows
             if "peers_skipped" in row]
  if skipped:
    legend.append(f"peers not timed where B*V > {settings['peer_max_elements']} (run with "
                  f"--all-peers): {'; '.join(skipped)}")
  return _table.table(
      ["Kernels: time / argmax time on the same float32 [B, V] logits (lower is faster); "
       "x-sort, x-hf = peer time / jaxdecode top-p time (higher: jaxdecode is faster)."],
      columns, rows, legend, wrap_title=True)


def format_tables(result: Mapping) -> list[str]:
  """The kernel, controls and samplers tables of `run_benchmarks`'s result, as lines."""
  rows = result["kernel"]
  if not rows:
    return []
  return _kernels(rows, result["settings"]) + _table.table(
      ["Controls: time / argmax time, timed in the same round robin as the kernels above."],
      [*_KEY, *_ratios(_CONTROL_COLUMNS, 9)], rows,
      f"penalties = repetition 1.2 + presence 0.5 + frequency 0.5 with counts of "
      f"{CONTROL_SEEN} seen tokens per row; bias+ban = logit_bias and banned_token_ids, "
      f"{CONTROL_IDS} ids each per row; allowed = allowed_token_ids, {CONTROL_ALLOWED} per "
      f"row; typical-p 0.9; epsilon 3e-4; eta 3e-4 (jaxdecode.sample at T=1).",
      wrap_title=True) + _table.table(
      ["Samplers beyond transformers: time / argmax time, the same round robin."],
      [*_KEY, *_ratios(_SAMPLER_COLUMNS, 9)], rows,
      f"top-nσ 1; xtc threshold 0.1, probability 0.5; dynatemp range 0.5; mirostat 2 (tau 5, "
      f"its first step); over a history of {CONTROL_HISTORY} random tokens per row: dry "
      f"multiplier 0.8 (base 1.75, allowed length 2), ngram = no_repeat_ngram_size 3, "
      f"bad-words = {CONTROL_IDS} sequences of 1-4 ids per row; all-new = those seven at "
      f"once (jaxdecode.sample at T=1).", wrap_title=True)
