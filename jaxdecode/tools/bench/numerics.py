"""Table 4, numerics: greedy decode tokens/s with batch-invariant numerics over plain XLA, on the
embedded model (its own invariant numerics) and on transformers' Flax GPT-2 under
`jaxdecode.batch_invariant`."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

import jaxdecode
from jaxdecode.models import load_default, make_step_fn
from jaxdecode.params import SamplingParams
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench._common import (BATCHES, RUNS, _first_call_s, _medians, _prompts,
                                           prefilled, table_rows, time_round_robin)
from jaxdecode.tools.bench._table import field, fixed


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
    cache = model.config.max_len
    ready = prefilled(model, _prompts(model.config.vocab_size, batch, seed), max_new_tokens,
                      cache_length=cache)
    state, logits, lengths = ready["state"], ready["logits"], ready["lengths"]
    step_fn = make_step_fn(ready["graphdef"])

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
  return table_rows(
      [(batch, lambda batch=batch: numerics_row(batch, runs=runs, max_new_tokens=max_new_tokens,
                                                loader=loader)) for batch in batches],
      label=lambda batch: f"numerics B={batch}",
      skipped=lambda batch, why: {"batch": batch, "skipped": why}, progress=progress)


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


def transformers_step_fns(model, invariant: bool = False):
  """A transformers Flax causal LM as `(prefill, step_fn)` over its own cache, laid out as its
  `generate` lays out left-padded prompts (`prepare_inputs_for_generation`).

  `prefill(params, tokens [B, T], mask [B, S], cache)` (left-padded prompts; `mask` the
  prompts' mask followed by ones up to the cache's S slots; `cache` zeros of `init_cache(B, S)`)
  -> `(logits [B, V], state)`; `step_fn(state, tokens [B], positions [B])` is `decode`'s. The
  state holds the weights, the cache and the mask. `invariant`: the model runs under
  `jaxdecode.batch_invariant(..., weights=0)`, and the state holds its `Weights` (the
  transposes of GPT-2's kernels and tied output layer made once, by the prefill).
  """

  def call(params, tokens, mask, positions, cache):
    out = model(tokens, attention_mask=mask, position_ids=positions, params=params,
                past_key_values=cache)
    return out.logits[:, -1], out.past_key_values

  forward = jaxdecode.batch_invariant(call, weights=0) if invariant else call

  def prefill(params, tokens, mask, cache):
    position_ids = jnp.cumsum(mask[:, :tokens.shape[1]], -1) - 1  # padding gets -1, as generate
    if invariant:
      params = forward.prepare(params, tokens, mask, position_ids, cache)
    logits, cache = forward(params, tokens, mask, position_ids, cache)
    return logits, {"params": params, "cache": cache, "mask": mask}

  def step_fn(state, tokens, positions):
    logits, cache = forward(state["params"], tokens[:, None], state["mask"], positions[:, None],
                            state["cache"])
    return logits, {**state, "cache": cache}

  return prefill, step_fn


TRAIN_WIDTH = 64  # tokens per row of the training-step rows


def transformers_training_step(model, params, tokens, invariant: bool) -> Callable[[], Any]:
  """A zero-argument run of `jax.jit(jax.value_and_grad(loss))`, the loss the mean next-token
  negative log-likelihood of `tokens` [B, T] under the model's forward pass over them: under
  `jaxdecode.batch_invariant(..., weights=0)` (its `Weights` prepared once) or plain. The
  invariant forward gives the values; the derivatives are the plain forward's (plain products)."""

  def call(weights, tokens):
    with jax.numpy_rank_promotion("allow"):  # transformers' code broadcasts by NumPy's rules
      return model(tokens, params=weights).logits

  forward = jaxdecode.batch_invariant(call, weights=0) if invariant else call
  weights = forward.prepare(params, tokens) if invariant else params

  def loss(weights):
    logp = jax.nn.log_softmax(forward(weights, tokens)[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

  step = jax.jit(jax.value_and_grad(loss))
  return lambda: step(weights)


def transformers_numerics_row(batch: int, *, runs: int = RUNS, max_new_tokens: int = 64,
                              model=None, seed: int = 0) -> dict:
  """Greedy decode tokens/s of transformers' Flax GPT-2 under `jaxdecode.batch_invariant`
  (`transformers_step_fns`) over the same model and weights with plain XLA, both through
  `jaxdecode.decode`, round-robin; and each mode's first decode call (compilation included).

  Args:
    batch: B.
    runs: timed runs.
    max_new_tokens: N.
    model: `(model, params)` (default: `transformers_gpt2()`).
    seed: seed of the prompts.

  Returns:
    A dict with `batch`, `max_new_tokens`, `runs`, `median_s` (invariant, plain),
    `first_call_s` (invariant, plain), `train_s` (`transformers_training_step`'s medians over
    B x TRAIN_WIDTH tokens) and `ratio`: `invariant_vs_plain` (tokens/s),
    `train_invariant_vs_plain` (time).
  """
  model, params = model or transformers_gpt2()
  prompts = _prompts(model.config.vocab_size, batch, seed)
  tokens, lengths = jaxdecode.left_pad(prompts, buckets=None)
  cache_length = tokens.shape[1] + max_new_tokens
  mask = jnp.ones((batch, cache_length), jnp.int32).at[:, :tokens.shape[1]].set(
      jaxdecode.prompt_mask(lengths, tokens.shape[1]).astype(jnp.int32))
  greedy = SamplingParams(temperature=0.0)
  key = jax.random.key(seed)
  runs_by_mode, first_call = {}, {}
  with jax.numpy_rank_promotion("allow"):
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
        lambda: model.init_cache(batch, cache_length)))  # init_cache's zeros, without its forward
    for mode in ("invariant", "plain"):
      prefill, step_fn = transformers_step_fns(model, invariant=mode == "invariant")
      logits, state = jax.jit(prefill)(params, tokens, mask, cache)

      def run(step_fn=step_fn, state=state, logits=logits):
        with jax.numpy_rank_promotion("allow"):
          return jaxdecode.decode(step_fn, state, logits, key=key, params=greedy,
                                  max_new_tokens=max_new_tokens, positions=lengths).tokens

      first_call[mode] = _first_call_s(run)
      runs_by_mode[mode] = run
  medians = _medians(time_round_robin(runs_by_mode, runs))
  text = jax.random.randint(jax.random.key(seed), (batch, TRAIN_WIDTH), 0,
                            model.config.vocab_size, jnp.int32)
  steps = {mode: transformers_training_step(model, params, text, mode == "invariant")
           for mode in ("invariant", "plain")}
  train = _medians(time_round_robin(steps, runs))
  return {"batch": batch, "max_new_tokens": max_new_tokens, "runs": runs, "median_s": medians,
          "first_call_s": first_call, "train_s": train,
          "ratio": {"invariant_vs_plain": medians["plain"] / medians["invariant"],
                    "train_invariant_vs_plain": train["invariant"] / train["plain"]}}


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
  return table_rows(
      [(batch, lambda batch=batch: transformers_numerics_row(
          batch, runs=runs, max_new_tokens=max_new_tokens, model=model)) for batch in batches],
      label=lambda batch: f"numerics (transformers GPT-2) B={batch}",
      skipped=lambda batch, why: {"batch": batch, "skipped": why}, progress=progress)


_INV_PLAIN = (field("B", 3, "batch"),
              field("inv ms", 8, "median_s", "invariant", fmt=fixed(1, 1e3)),
              field("plain ms", 8, "median_s", "plain", fmt=fixed(1, 1e3)),
              field("inv/plain tok/s", 15, "ratio", "invariant_vs_plain", fmt=_table.ratio),
              field("compile inv s", 13, "first_call_s", "invariant", fmt=fixed(1)),
              field("plain s", 7, "first_call_s", "plain", fmt=fixed(1)))


def format_tables(result: Mapping) -> list[str]:
  """The numerics tables (embedded model, transformers' GPT-2) of `run_benchmarks`'s result."""
  s, lines = result["settings"], []
  if result.get("numerics"):
    late = next((r["late_position"] for r in result["numerics"] if "late_position" in r), None)
    lines += _table.table(
        [f"Numerics: greedy decode, {s['max_new_tokens']} new tokens, embedded model, "
         f"batch-invariant vs plain XLA (same weights)"],
        [*_INV_PLAIN, field("late/early step", 15, "ratio", "late_vs_early_step",
                            fmt=_table.ratio)],
        result["numerics"],
        "inv/plain tok/s: the batch-invariant numerics' tokens/s over plain XLA's (1.00 = "
        "free); compile: the first decode call of each mode (compilation included); late/early "
        f"step: one invariant step at position {late} over one at position 32.")
  if result.get("numerics_transformers"):
    config = ", ".join(f"{k} {v}" for k, v in HF_GPT2.items())
    lines += _table.table(
        [f"Numerics: greedy decode, {s['max_new_tokens']} new tokens, transformers' Flax "
         f"GPT-2, batch_invariant vs plain XLA", f"({config}; random weights)"],
        [*_INV_PLAIN, field("train inv/plain", 15, "ratio", "train_invariant_vs_plain",
                            fmt=_table.ratio)],
        result["numerics_transformers"],
        "inv/plain tok/s: tokens/s with the prefill and step under jaxdecode.batch_invariant "
        "over the same model's with plain XLA (1.00 = free); compile: each mode's first decode "
        f"call; train inv/plain: a training step (value_and_grad of the next-token loss over "
        f"B x {TRAIN_WIDTH} tokens) under batch_invariant over plain's time (goal <= 1.5).")
  return lines
