"""Quickstart: the embedded model continues a few prompts under five decoding settings.

`jaxdecode.models.generate` batches the prompts, runs the embedded byte-level transformer
(`jaxdecode.models.load_default()`, trained on CPython's pydoc topics) and decodes with
`jaxdecode.decode`. Every setting uses the same seed, and the whole table is generated twice: the
same seed gives the same text. Another seed changes the sampled texts but never greedy's.
Sampling values are traced data, so the five settings share one compiled program (only the first
call compiles).

Run: python examples/quickstart.py [--max-new-tokens N] [--seed S] [PROMPT ...]
"""

from __future__ import annotations

import argparse

import jaxdecode
from jaxdecode.models import generate, load_default

PROMPTS = ["The for statement", "A list comprehension", "def f(x):"]

SETTINGS = {
    "greedy": jaxdecode.SamplingParams(temperature=0.0),
    "temperature 0.7": jaxdecode.SamplingParams(temperature=0.7),
    "top-k 20": jaxdecode.SamplingParams(top_k=20),
    "top-p 0.9": jaxdecode.SamplingParams(top_p=0.9),
    "min-p 0.1": jaxdecode.SamplingParams(min_p=0.1),
}


def show(text: str) -> str:
  """One line per continuation: newlines and tabs made visible."""
  return text.replace("\n", "\\n").replace("\t", "\\t")


def run_table(model, tokenizer, prompts, seed: int, max_new_tokens: int):
  """`({setting: [continuation per prompt]}, {setting: seconds})` for every setting."""
  texts, seconds = {}, {}
  for name, params in SETTINGS.items():
    out = generate(prompts, model=model, tokenizer=tokenizer, params=params, seed=seed,
                   max_new_tokens=max_new_tokens)
    texts[name], seconds[name] = out.texts, out.seconds
  return texts, seconds


def main(prompts=PROMPTS, max_new_tokens: int = 64, seed: int = 0) -> dict:
  """Prints every prompt's continuation under every setting, then the reproducibility check.

  Returns:
    `{"texts": {setting: [continuation per prompt]}, "same": bool, "greedy_same_other_seed":
    bool, "changed_other_seed": int}`: whether a second run with the same seed gave exactly the
    same texts, whether greedy ignored a different seed, and how many sampled texts it changed.
  """
  model, tokenizer = load_default()
  texts, seconds = run_table(model, tokenizer, prompts, seed, max_new_tokens)
  again, _ = run_table(model, tokenizer, prompts, seed, max_new_tokens)

  width = max(len(name) for name in SETTINGS)
  print(f"embedded model: {model.config.n_layers} layers, d_model {model.config.d_model}, "
        f"byte vocabulary {model.config.vocab_size}; seed {seed}, {max_new_tokens} new tokens "
        f"at most")
  for i, prompt in enumerate(prompts):
    print(f"\n{prompt!r}")
    for name in SETTINGS:
      print(f"  {name:<{width}} | {show(texts[name][i])}")
  first, *rest = seconds.values()
  print(f"\nseconds per setting: first {first:.2f} (compiles), later "
        f"{min(rest, default=first):.2f}-{max(rest, default=first):.2f} (same program: sampling "
        f"values are traced data)")
  same = texts == again
  print(f"same seed, second run: identical text for every setting and prompt: {same}")
  other, _ = run_table(model, tokenizer, prompts, seed + 1, max_new_tokens)
  greedy_same = other["greedy"] == texts["greedy"]
  changed = sum(a != b for name in SETTINGS if name != "greedy"
                for a, b in zip(texts[name], other[name]))
  print(f"seed {seed + 1}: greedy text unchanged: {greedy_same}; sampled texts that changed: "
        f"{changed} of {(len(SETTINGS) - 1) * len(prompts)}")
  if not (same and greedy_same):
    raise SystemExit("the same seed gave different text, or greedy depended on the seed")
  return {"texts": texts, "same": same, "greedy_same_other_seed": greedy_same,
          "changed_other_seed": changed}


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("prompts", nargs="*", default=PROMPTS, help="text prompts to continue")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  main(prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed)
