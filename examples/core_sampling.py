"""jaxdecode's core on a toy next-token distribution: what each rule keeps and what it samples.

Run: python examples/core_sampling.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "quickly", "purple"]
PROBS = np.array([0.30, 0.20, 0.14, 0.10, 0.08, 0.06, 0.05, 0.04, 0.02, 0.01])

SETTINGS = {
    "greedy (temperature 0)": jaxdecode.SamplingParams(temperature=0.0),
    "temperature 1.0": jaxdecode.SamplingParams(),
    "temperature 0.5": jaxdecode.SamplingParams(temperature=0.5),
    "temperature 1.5": jaxdecode.SamplingParams(temperature=1.5),
    "top-k 3": jaxdecode.SamplingParams(top_k=3),
    "top-p 0.6": jaxdecode.SamplingParams(top_p=0.6),
    "min-p 0.3": jaxdecode.SamplingParams(min_p=0.3),
}


def main(draws: int = 20_000) -> None:
  logits = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]  # [1, V]
  batch = jnp.broadcast_to(logits, (draws, len(WORDS)))  # the same row, many keys
  print(f"{'setting':<24}{'kept':>5}  sampled frequency of each kept word ({draws} draws)")
  for name, params in SETTINGS.items():
    kept = np.isfinite(np.asarray(jaxdecode.process_logits(logits, params)))[0]
    tokens = np.asarray(jaxdecode.sample(jax.random.key(0), batch, params))
    freq = np.bincount(tokens, minlength=len(WORDS)) / draws
    shown = "  ".join(f"{w}={f:.2f}" for w, f, k in zip(WORDS, freq, kept) if k)
    print(f"{name:<24}{kept.sum():>5}  {shown}")


if __name__ == "__main__":
  main()
