"""Bench against each family's own sampler: tokens/s of jaxdecode (plain and under
`batch_invariant`) and of transformers' own Flax `generate`, on the same model, batch and
settings (top-p 0.9, temperature 1, no top-k, no EOS: every row makes `new` tokens).

Random-weight models of the real architectures (nothing is downloaded), a few millions of
parameters; every program is compiled before timing; the three samplers run alternately, round
after round, and each figure is the median of the rounds (`block_until_ready` on the tokens).
`gemma`'s own `Sampler` is not benched: jaxdecode has no adapter for the `gemma` library
(its 3.3 release installs here, with tensorflow among 124 more packages, but neither its models
nor its sampler import; see the README's "Bring your model"); Gemma's architecture is benched
through transformers' `FlaxGemmaForCausalLM`.

Run: `python -m jaxdecode.tools.bench.families [--rounds R] [--new N] [--families gpt2,llama]`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import adapters
from jaxdecode.decoding import decode
from jaxdecode.params import SamplingParams

FAMILIES = ("gpt2", "llama", "gemma")
_CLASSES = {"gpt2": ("GPT2Config", "FlaxGPT2LMHeadModel"),
            "llama": ("LlamaConfig", "FlaxLlamaForCausalLM"),
            "gemma": ("GemmaConfig", "FlaxGemmaForCausalLM")}


def family_model(family: str, *, vocab: int = 4096, width: int = 256, layers: int = 4,
                 positions: int = 512, seed: int = 0):
  """(model, params): a random-weight transformers Flax model of `family` (no init pass)."""
  import transformers  # pylint: disable=import-outside-toplevel
  config_name, class_name = _CLASSES[family]
  if family == "gpt2":
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab,
                                     n_positions=positions)
  else:
    config = getattr(transformers, config_name)(
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=width // 4, vocab_size=vocab,
        max_position_embeddings=positions)
  with jax.numpy_rank_promotion("allow"):  # transformers' Flax code relies on it
    model = getattr(transformers, class_name)(config, _do_init=False)
    shapes = jax.eval_shape(functools.partial(model.init_weights, jax.random.key(0), (1, 1)))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if leaf.ndim == 1:
      name = jax.tree_util.keystr(path)
      return (1.0 + 0.1 * noise) if "scale" in name or "weight" in name else 0.1 * noise
    return noise / np.sqrt(leaf.shape[0])

  return model, jax.tree_util.tree_map_with_path(draw, shapes)


def _jaxdecode_run(adapter, tokens, lengths, new: int):
  """A function of a key that prefills and decodes `new` tokens per row (top-p 0.9)."""
  params = SamplingParams(temperature=1.0, top_p=0.9)

  def run(key):
    logits, state, positions = adapter.prefill(tokens, lengths, tokens.shape[1] + new)
    return decode(adapter.step_fn, state, logits, key=key, params=params,
                  max_new_tokens=new, positions=positions, eos_ids=(), pad_id=0).tokens

  return run


def _own_run(model, params, tokens, new: int):
  """transformers' own Flax `generate` (jitted whole, as its docs advise), top-p 0.9."""

  @jax.jit
  def generate(params, tokens, key):
    with jax.numpy_rank_promotion("allow"):
      return model.generate(tokens, params=params, prng_key=key, max_new_tokens=new,
                            do_sample=True, top_p=0.9, top_k=0, temperature=1.0,
                            pad_token_id=0, eos_token_id=None).sequences

  return lambda key: generate(params, tokens, key)


def family_rows(family: str, batch: int, *, new: int = 64, prompt: int = 16,
                rounds: int = 5, **model_options) -> dict:
  """One row: tokens/s of each sampler on `family` at `batch` rows, medians of `rounds`;
  `model_options`: `family_model`'s sizes (vocab, width, layers)."""
  model, params = family_model(family, **model_options)
  rng = np.random.default_rng(batch)
  tokens = jnp.asarray(rng.integers(1, model.config.vocab_size, (batch, prompt)), jnp.int32)
  lengths = jnp.full((batch,), prompt, jnp.int32)
  runs = {
      "jaxdecode": _jaxdecode_run(adapters.transformers(model, params, eos_ids=()),
                                  tokens, lengths, new),
      "jaxdecode batch_invariant": _jaxdecode_run(
          adapters.transformers(model, params, eos_ids=(), batch_invariant=True),
          tokens, lengths, new),
      "transformers generate": _own_run(model, params, tokens, new),
  }
  seconds = {name: [] for name in runs}
  for r in range(rounds + 1):  # round 0 compiles
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run(jax.random.key(r)))
      if r:
        seconds[name].append(time.perf_counter() - start)
  row = dict(family=family, batch=batch, new=new, prompt=prompt, rounds=rounds)
  for name, times in seconds.items():
    row[name] = batch * new / statistics.median(times)
  own = row["transformers generate"]
  row["plain / own"] = row["jaxdecode"] / own
  row["invariant / own"] = row["jaxdecode batch_invariant"] / own
  return row


def format_rows(rows: list) -> str:
  """A markdown table of `family_rows` rows (tokens/s and the ratios to the family's own)."""
  head = ("| family | B | jaxdecode tok/s | batch_invariant tok/s | own generate tok/s | "
          "plain / own | invariant / own |")
  lines = [head, "|" + "---|" * 7]
  for r in rows:
    lines.append(f"| {r['family']} | {r['batch']} | {r['jaxdecode']:.0f} | "
                 f"{r['jaxdecode batch_invariant']:.0f} | {r['transformers generate']:.0f} | "
                 f"{r['plain / own']:.2f} | {r['invariant / own']:.2f} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxdecode.tools.bench.families")
  parser.add_argument("--families", default=",".join(FAMILIES))
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  families = [f for f in args.families.split(",") if f]
  for family in families:
    if family not in FAMILIES:
      parser.error(f"--families: {family!r} is not one of {', '.join(FAMILIES)}")
  batches = [b.strip() for b in args.batches.split(",") if b.strip()]
  if not batches or not all(b.isdigit() and int(b) >= 1 for b in batches):
    parser.error(f"--batches must be integers >= 1 separated by commas; got {args.batches!r}")
  for name in ("new", "rounds"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
  rows = []
  for family in families:
    for batch in map(int, batches):
      rows.append(family_rows(family, batch, new=args.new, rounds=args.rounds))
      print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}\n" + format_rows(rows))


if __name__ == "__main__":
  main()
