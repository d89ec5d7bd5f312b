"""Constrained decoding with your own logit processor: a finite-state machine that only lets the
model write a number.

`jaxdecode.decode(..., logits_processors=[...])` applies your processors to each step's logits
before the built-in chain. A processor is a pure function `(logits [B, V], context) -> logits`;
the context holds each row's step and the tokens it has generated so far. Here the processor
runs a small finite-state machine over those tokens and removes (sets to -inf) every byte the
machine does not allow next, so the text is always a prefix of `[0-9]+(\\.[0-9]+)?` followed by
the end of text.

The machine's transition table is an array passed with `jax.tree_util.Partial`, so it is traced
data: a different table (another pattern) reuses the compiled loop. The script checks that
every output matches the pattern, and that a second table runs without compiling again.

Run:
  python examples/constrained_decoding.py
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxdecode
from jaxdecode.models import ByteTokenizer, load_default, make_step_fn, prefill

TOK = ByteTokenizer()
DIGITS = [ord(c) for c in "0123456789"]
DOT = ord(".")

# States of `[0-9]+(\.[0-9]+)?` then EOS: 0 start, 1 integer part, 2 after the dot, 3 fraction.
# table[state, token] = next state, or -1 where the token is not allowed.
NUMBER_TABLE = np.full((4, TOK.vocab_size), -1, np.int32)
NUMBER_TABLE[0, DIGITS] = 1
NUMBER_TABLE[1, DIGITS] = 1
NUMBER_TABLE[1, DOT] = 2
NUMBER_TABLE[1, TOK.EOS] = 1
NUMBER_TABLE[2, DIGITS] = 3
NUMBER_TABLE[3, DIGITS] = 3
NUMBER_TABLE[3, TOK.EOS] = 3
NUMBER_PATTERN = r"[0-9]+(\.[0-9]+)?"

# Another machine of the same shape: a lowercase word, then EOS (states 2 and 3 unused).
WORD_TABLE = np.full((4, TOK.vocab_size), -1, np.int32)
WORD_TABLE[0, [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"]] = 1
WORD_TABLE[1, [ord(c) for c in "abcdefghijklmnopqrstuvwxyz"]] = 1
WORD_TABLE[1, TOK.EOS] = 1
WORD_PATTERN = r"[a-z]+"


def fsm_state(table: jax.Array, tokens: jax.Array, step: jax.Array) -> jax.Array:
  """Each row's machine state after its first `step[b]` tokens. int32[B]."""
  def advance(state, column):
    token, t = column
    moved = table[state, token]
    return jnp.where(t < step, moved, state), None

  columns = (tokens.T, jnp.arange(tokens.shape[1])[:, None])  # scan over the N columns
  state, _ = jax.lax.scan(advance, jnp.zeros(tokens.shape[0], jnp.int32), columns)
  return state


TRACES = []  # one entry each time jax traces the processor (i.e. compiles a new loop)


def fsm_processor(table: jax.Array, logits: jax.Array,
                  context: jaxdecode.DecodeContext) -> jax.Array:
  """Removes every token the machine does not allow in each row's current state."""
  TRACES.append(1)
  allowed = table[fsm_state(table, context.tokens, context.step)] >= 0  # [B, V]
  return jnp.where(allowed, logits, -jnp.inf)


def constrained_generate(prompts, table, *, params, max_new_tokens=24, seed=0):
  """Decodes the embedded model with the machine `table` as a logit processor."""
  model, _ = load_default()
  graphdef, weights = nnx.split(model)
  tokens, lengths = jaxdecode.right_pad([TOK.encode(p) for p in prompts], pad_id=TOK.PAD)
  logits, state = prefill(graphdef, weights, tokens, lengths,
                          cache_length=tokens.shape[1] + max_new_tokens)
  processor = jax.tree_util.Partial(fsm_processor, jnp.asarray(table))  # table: traced data
  out = jaxdecode.decode(_step_fn(graphdef), state, logits, key=jax.random.key(seed),
                         params=params, max_new_tokens=max_new_tokens, positions=lengths,
                         eos_ids=[TOK.EOS], pad_id=TOK.PAD, logits_processors=[processor])
  return [TOK.decode(row[:n]) for row, n in zip(np.asarray(out.tokens), np.asarray(out.lengths))]


_STEP_FNS = {}


def _step_fn(graphdef):
  if graphdef not in _STEP_FNS:
    _STEP_FNS[graphdef] = make_step_fn(graphdef)
  return _STEP_FNS[graphdef]


def main(max_new_tokens: int = 24) -> dict:
  prompts = ["The answer is ", "pi = ", "There are ", "Version "]
  results = {}
  for name, params in {"greedy": jaxdecode.SamplingParams(temperature=0.0),
                       "sampled": jaxdecode.SamplingParams(temperature=1.0, top_p=0.95)}.items():
    texts = constrained_generate(prompts, NUMBER_TABLE, params=params,
                                 max_new_tokens=max_new_tokens)
    results[name] = texts
    for prompt, text in zip(prompts, texts):
      print(f"  {name:<8} {prompt!r} -> {text!r}")
  ok = all(re.fullmatch(NUMBER_PATTERN + "|[0-9]+\\.?", t) for ts in results.values() for t in ts)
  print(f"every output is a number (or a prefix of one, where max_new_tokens cut it): {ok}")

  # Another machine, the same shapes: traced data, so the loop is not compiled again.
  before = len(TRACES)
  words = constrained_generate(prompts, WORD_TABLE, params=jaxdecode.SamplingParams(0.0),
                               max_new_tokens=max_new_tokens)
  recompiled = len(TRACES) != before
  print(f"with the word machine: {words}; compiled again: {recompiled}")
  words_ok = all(re.fullmatch(WORD_PATTERN, w) for w in words)
  if not (ok and words_ok and not recompiled):
    raise SystemExit(f"constraint violated or recompiled: {results} {words} {recompiled}")
  return {"texts": results, "words": words, "recompiled": recompiled}


if __name__ == "__main__":
  main()
