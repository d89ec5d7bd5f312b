"""Bring your own model: `jaxdecode.decode` driving a language model that is not jaxdecode's.

The model is a character trigram table built from a short text, written from scratch in plain
`jax.numpy`: its weights are a `[V, V, V]` table of log-probabilities, and its state carries a
per-row history buffer indexed by position, the counterpart of a transformer's KV cache. All that
`decode` needs from it is the step function contract

    step_fn(state, tokens int32[B], positions int32[B]) -> (logits float32[B, V], state)

with a state of unchanged structure and shapes, plus a prefill that gives the first logits.

The script decodes prompts of different lengths (left-padded with `jaxdecode.left_pad`, each row
with its own positions) under per-row `SamplingParams`, stops rows at EOS, and checks that
  1. greedy rows equal a plain Python argmax loop over the trigram counts (no JAX),
  2. the same rows in reversed slots, beside other neighbours and with more padding (same
     per-row keys and params), give the same tokens,
  3. the final state's history holds each row's prompt followed by its new tokens.

Run: python examples/bring_your_own_model.py [--max-new-tokens N] [--seed S]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode

TEXT = """\
the cat sat on the mat.
the dog sat on the log.
a cat ran to the dog.
the dog ran to the park and sat in the sun.
a bird sat on the dog and sang a song.
the cat saw the bird and the bird saw the cat.
at noon the cat ran home to the mat.
the sun set and the dog slept on the log.
a song is a thing a bird can sing.
the bird flew to the dog.
we all sat on the log.
"""

PROMPTS = ["the cat", "a", "the dog ran to", "", "a bird", "at noon"]
SETTINGS = [  # one per prompt: (label, temperature, top_k, top_p, min_p)
    ("greedy", 0.0, 0, 1.0, 0.0),
    ("greedy", 0.0, 0, 1.0, 0.0),
    ("T 0.8, top-k 5", 0.8, 5, 1.0, 0.0),
    ("greedy", 0.0, 0, 1.0, 0.0),
    ("T 1.0, top-p 0.9", 1.0, 0, 0.9, 0.0),
    ("T 0.7, min-p 0.2", 0.7, 0, 1.0, 0.2),
]


# ---------------------------------------------------------------------------------------------
# The vocabulary and the counts (plain Python).


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Characters of the text, then BOS, EOS and PAD."""
  chars: str

  @property
  def bos(self) -> int:
    return len(self.chars)

  @property
  def eos(self) -> int:
    return len(self.chars) + 1

  @property
  def pad(self) -> int:
    return len(self.chars) + 2

  @property
  def size(self) -> int:
    return len(self.chars) + 3

  def encode(self, text: str) -> list[int]:
    """BOS, then one id per character (every prompt starts at BOS, like every training line)."""
    return [self.bos] + [self.chars.index(c) for c in text]

  def decode(self, ids) -> str:
    return "".join(self.chars[i] for i in ids if i < len(self.chars))


def count_trigrams(text: str):
  """`(vocab, counts)`: counts[(a, b)][c] = how often c follows the pair (a, b) in the text.

  Each line is one sequence: two BOS of left context, its characters, then EOS.
  """
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  vocab = Vocab("".join(sorted(set("".join(lines)))))
  counts = collections.defaultdict(collections.Counter)
  for line in lines:
    ids = [vocab.bos] + vocab.encode(line) + [vocab.eos]
    for a, b, c in zip(ids, ids[1:], ids[2:]):
      counts[(a, b)][c] += 1
  return vocab, counts


# ---------------------------------------------------------------------------------------------
# The model in jax.numpy: weights, state, prefill, step.


def log_prob_table(vocab: Vocab, counts, alpha: float = 0.01) -> jax.Array:
  """float32[V, V, V]: log p(c | a, b), add-alpha smoothed over the characters and EOS.

  BOS and PAD are never predicted (-inf), so no sampler can ever emit them.
  """
  table = np.zeros((vocab.size, vocab.size, vocab.size), np.float64)
  for (a, b), following in counts.items():
    for c, n in following.items():
      table[a, b, c] = n
  predictable = np.zeros(vocab.size, bool)
  predictable[:vocab.eos + 1] = True
  predictable[vocab.bos] = False
  smoothed = np.where(predictable, table + alpha, 0.0)
  with np.errstate(divide="ignore"):
    return jnp.asarray(np.log(smoothed / smoothed.sum(-1, keepdims=True)), jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrigramState:
  """The model state `decode` carries from step to step (any pytree works).

  Attributes:
    log_probs: float32[V, V, V], the weights. Carried in the state, so the jitted loop receives
      them as data rather than baking them in as constants.
    history: int32[B, S], row b's token at logical position p in slot p: the model's cache.
    bos: int32[], the id that stands for "before the first token".
  """
  log_probs: jax.Array
  history: jax.Array
  bos: jax.Array


def step_fn(state: TrigramState, tokens: jax.Array, positions: jax.Array):
  """One decode step: writes `tokens[b]` at `positions[b]`, returns the next-token logits.

  Args:
    state: a `TrigramState` of B rows.
    tokens: int32[B], the token of each row at `positions`.
    positions: int32[B], its logical position (0 = the row's first prompt token).

  Returns:
    `(logits float32[B, V], state)`; the state has the same structure and shapes.
  """
  rows = jnp.arange(tokens.shape[0])
  history = state.history.at[rows, positions].set(tokens, mode="drop")  # past the end: dropped
  before = history[rows, jnp.maximum(positions - 1, 0)]  # [B]
  before = jnp.where(positions > 0, before, state.bos)
  logits = state.log_probs[before, tokens]  # [B, V]
  return logits, dataclasses.replace(state, history=history)


@functools.partial(jax.jit, static_argnames="cache_length")
def prefill(log_probs: jax.Array, tokens: jax.Array, lengths: jax.Array, bos: int, *,
            cache_length: int):
  """Reads left-padded prompts in one pass: fills the history, gives each row's next logits.

  Args:
    log_probs: float32[V, V, V] the weights.
    tokens: int32[B, T] left-padded prompts (`jaxdecode.left_pad`).
    lengths: int32[B] real tokens per row.
    bos: the BOS id.
    cache_length: S, history slots per row (static): at least T + max_new_tokens - 1.

  Returns:
    `(logits float32[B, V], TrigramState)`; row b's first new token has position `lengths[b]`.
  """
  batch, width = tokens.shape
  positions = jaxdecode.prompt_positions(lengths, width)  # [B, T]
  real = jaxdecode.prompt_mask(lengths, width)  # [B, T]
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, width))  # [B, T]
  slots = jnp.where(real, positions, cache_length)  # padding aims past the end: dropped
  history = jnp.zeros((batch, cache_length), jnp.int32).at[rows, slots].set(tokens, mode="drop")
  with_bos = jnp.pad(tokens, ((0, 0), (1, 0)), constant_values=bos)  # [B, T + 1]
  before = jnp.where(lengths >= 2, with_bos[:, -2], bos)  # [B]
  logits = log_probs[before, tokens[:, -1]]  # [B, V]
  return logits, TrigramState(log_probs, history, jnp.asarray(bos, jnp.int32))


def decode_rows(log_probs, vocab: Vocab, prompts, params, keys, max_new_tokens: int,
                cache_length: int, width: int | None = None):
  """Left-pads `prompts` (lists of ids) to `width` (default: the longest), prefills, decodes.

  A fixed `cache_length` keeps the state's shapes, and so decode's compiled program, the same
  whatever the prompt widths.
  """
  tokens, lengths = jaxdecode.left_pad(prompts, pad_id=vocab.pad, buckets=None, width=width)
  logits, state = prefill(log_probs, tokens, lengths, vocab.bos, cache_length=cache_length)
  return jaxdecode.decode(step_fn, state, logits, key=keys, params=params,
                          max_new_tokens=max_new_tokens, positions=lengths,
                          eos_ids=[vocab.eos], pad_id=vocab.pad)


# ---------------------------------------------------------------------------------------------
# The independent reference and the checks.


def python_greedy(vocab: Vocab, counts, prompt: list[int], max_new_tokens: int) -> list[int]:
  """Greedy decoding as a plain Python loop over the counts: no JAX, no table, no padding.

  Smoothing does not move an argmax, so the most frequent follower wins; ties go to the lowest
  id, and a pair never seen gives the lowest predictable id, as jaxdecode.greedy does.
  """
  predictable = [i for i in range(vocab.size) if i not in (vocab.bos, vocab.pad)]
  history, new = list(prompt), []
  for _ in range(max_new_tokens):
    before = history[-2] if len(history) >= 2 else vocab.bos
    following = counts.get((before, history[-1]), {})
    token = max(predictable, key=lambda c: (following.get(c, 0), -c))
    history.append(token)
    new.append(token)
    if token == vocab.eos:
      break
  return new


def row_params(settings) -> jaxdecode.SamplingParams:
  """One `SamplingParams` holding one value per row, from (label, T, top-k, top-p, min-p) rows."""
  _, temperature, top_k, top_p, min_p = zip(*settings)
  return jaxdecode.SamplingParams(temperature=np.array(temperature, np.float32),
                                  top_k=np.array(top_k, np.int32),
                                  top_p=np.array(top_p, np.float32),
                                  min_p=np.array(min_p, np.float32))


def main(max_new_tokens: int = 48, seed: int = 0) -> dict:
  """Decodes PROMPTS under SETTINGS, prints them and checks the three claims.

  Returns:
    A dict of the check results (each True when it holds) and the texts.
  """
  vocab, counts = count_trigrams(TEXT)
  log_probs = log_prob_table(vocab, counts)
  prompts = [vocab.encode(p) for p in PROMPTS]
  labels = [setting[0] for setting in SETTINGS]
  params = row_params(SETTINGS)
  keys = jax.random.split(jax.random.key(seed), len(prompts))  # one key per row
  extra_padding = 8  # for check 2
  cache_length = max(map(len, prompts)) + extra_padding + max_new_tokens
  out = decode_rows(log_probs, vocab, prompts, params, keys, max_new_tokens, cache_length)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  finished = np.asarray(out.finished)

  print(f"trigram model: vocabulary {vocab.size} ({len(vocab.chars)} characters + BOS, EOS, "
        f"PAD), {sum(len(c) for c in counts.values())} distinct trigrams; "
        f"{len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens")
  texts = []
  for row, prompt in enumerate(PROMPTS):
    text = vocab.decode(tokens[row, :lengths[row]])
    texts.append(text)
    end = "<eos>" if finished[row] else "..."
    print(f"  {labels[row]:<17} {prompt!r:>17} -> {text!r} {end}")

  # 1. Greedy rows against the plain Python loop.
  greedy_ok = True
  for row, setting in enumerate(SETTINGS):
    if setting[1] == 0.0:
      expected = python_greedy(vocab, counts, prompts[row], max_new_tokens)
      greedy_ok &= tokens[row, :lengths[row]].tolist() == expected
      greedy_ok &= bool(finished[row]) == (expected[-1] == vocab.eos)
  # After a row's EOS only PAD follows.
  pad_ok = all((tokens[row, lengths[row]:] == vocab.pad).all() for row in range(len(prompts)))
  print(f"greedy rows equal a plain Python argmax loop: {greedy_ok}; only PAD after EOS: "
        f"{pad_ok}")

  # 2. The rows in reversed slots, each with 8 more padding tokens, each with its own key and
  # params: a row's tokens depend only on its prompt, key and params.
  flip = lambda x: x[::-1]
  moved = decode_rows(log_probs, vocab, flip(prompts), row_params(flip(SETTINGS)), flip(keys),
                      max_new_tokens, cache_length,
                      width=max(map(len, prompts)) + extra_padding)
  moved_ok = np.array_equal(flip(np.asarray(moved.tokens)), tokens)
  print(f"the rows in reversed slots with {extra_padding} more padding tokens give the same "
        f"tokens: {moved_ok}")

  # 3. The history "cache" holds prompt + new tokens (all but the last, which was never fed).
  history = np.asarray(out.state.history)
  history_ok = all(
      history[row, :len(p) + lengths[row] - 1].tolist() == p + tokens[row, :lengths[row] - 1]
      .tolist() for row, p in enumerate(prompts))
  print(f"the final state's history holds each prompt and its new tokens: {history_ok}")

  checks = {"greedy_matches_python": bool(greedy_ok), "pad_after_eos": bool(pad_ok),
            "moved_rows_match": bool(moved_ok), "history_matches": bool(history_ok)}
  if not all(checks.values()):
    raise SystemExit(f"a check failed: {checks}")
  return {**checks, "texts": texts, "finished": finished.tolist()}


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--max-new-tokens", type=int, default=48)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  main(max_new_tokens=args.max_new_tokens, seed=args.seed)
