"""Train the small transformer on your own text, save it, reload it and generate from it.

Uses `jaxdecode.models.training.train` (held-out split, AdamW with warmup + cosine schedule and
clipping, held-out loss during training, the best weights kept), which returns the trained
model, then checks that the checkpoint it wrote and reloaded with
`jaxdecode.models.load_checkpoint` gives the same logits as that model. Checkpoints store
weights as float16, so the reload equals the trained model with its weights rounded to float16
exactly, and the float32 model up to that rounding (both are printed).

The default text is a few KB of the Python documentation (the compound-statement topics of
CPython's bundled `pydoc_data.topics`, no download); `--text FILE` takes any UTF-8 text file.
The model is byte-level, so any language works.

Run:
  python examples/train_on_your_text.py --quick          # tiny model, 60 steps: seconds on CPU
  python examples/train_on_your_text.py --text notes.txt # larger model, 400 steps: minutes
  jaxdecode generate --model train_on_your_text.msgpack "for x in"   # use the checkpoint
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxdecode
from jaxdecode.models import training
from jaxdecode.models import (ByteTokenizer, Transformer, TransformerConfig, forward, generate,
                              load_checkpoint, save_checkpoint)

DEFAULT_TOPICS = ("if", "while", "for", "try", "with", "function", "class", "lambda", "return",
                  "pass", "break", "continue")

QUICK = dict(model=TransformerConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, max_len=128),
             train=training.TrainConfig(steps=60, batch_size=8, seq_len=64, peak_lr=3e-3,
                                        warmup_steps=5, eval_every=20))
FULL = dict(model=TransformerConfig(d_model=128, n_layers=3, n_heads=4, d_ff=512, max_len=256),
            train=training.TrainConfig(steps=400, batch_size=16, seq_len=128, peak_lr=2e-3,
                                       warmup_steps=40, eval_every=100))


def default_text_stream() -> np.ndarray:
  """The token stream of DEFAULT_TOPICS from pydoc_data.topics, an EOS after each topic."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  return training.encode_documents([topics.topics[name] for name in DEFAULT_TOPICS])


def main(text: str | None = None, *, quick: bool = False, steps: int | None = None,
         out: str = "train_on_your_text.msgpack", prompt: str | None = None,
         max_new_tokens: int | None = None, seed: int = 0) -> dict:
  """Trains on `text` (a file path; None = the bundled docs), saves, reloads and generates.

  Args:
    text: a UTF-8 text file, or None for DEFAULT_TOPICS of pydoc_data.topics.
    quick: the tiny model and 60 steps (QUICK) instead of FULL.
    steps: overrides the number of training steps.
    out: where to write the checkpoint.
    prompt: the prompt to continue (default: the start of the text's first line).
    max_new_tokens: how much to generate (default 40 quick, 120 full).
    seed: model initialization, batch order and sampling.

  Returns:
    A dict: `val_loss_before`, `val_loss_after` (nats/byte on the held-out text), `history`
    (the training summary's: step, train and held-out loss), `reload_equals_float16` (bool),
    `reload_max_diff_float32`, `texts`.
  """
  setup = QUICK if quick else FULL
  model_config = setup["model"]
  cfg = dataclasses.replace(setup["train"], seed=seed)
  if steps:
    cfg = dataclasses.replace(cfg, steps=steps, eval_every=steps if quick else max(1, steps // 4))
  data = training.as_corpus(default_text_stream() if text is None else text)
  train_stream, val_stream = data.train, data.held_out
  print(f"text: {text or 'pydoc_data.topics ' + ', '.join(DEFAULT_TOPICS)}: "
        f"{len(train_stream)} training bytes, {len(val_stream)} held out")
  print(f"model: d_model {model_config.d_model}, {model_config.n_layers} layers, "
        f"{model_config.n_heads} heads, d_ff {model_config.d_ff}; {cfg.steps} steps of "
        f"{cfg.batch_size} x {cfg.seq_len} bytes")

  started = time.perf_counter()
  initial = Transformer(model_config, rngs=nnx.Rngs(cfg.seed))  # what train() starts from
  before = training.evaluate(*nnx.split(initial), val_stream, cfg.seq_len)
  print(f"held-out loss before training: {before:.3f} nats/byte (uniform over 259 ids: "
        f"{np.log(259):.3f})")
  # train() reports the held-out loss every eval_every steps and returns the model with the
  # best held-out loss.
  trained, summary = training.train(model_config, cfg, corpus=data, log=sys.stdout)
  graphdef, weights = nnx.split(trained)
  after = training.evaluate(graphdef, weights, val_stream, cfg.seq_len)
  print(f"\nheld-out loss after training:  {after:.3f} nats/byte "
        f"({after / np.log(2):.2f} bits/byte); {time.perf_counter() - started:.1f} s")

  save_checkpoint(out, model_config, weights,
                  metadata={"text": text or "pydoc_data.topics", "steps": cfg.steps,
                            "val_loss": after})
  reloaded, metadata = load_checkpoint(out)
  print(f"saved and reloaded {out} (metadata {metadata})")

  # The same logits: exactly for the float16-rounded weights the file holds, closely for float32.
  tokenizer = ByteTokenizer()
  held_out = [tokenizer.BOS] + val_stream[:cfg.seq_len - 1].tolist()  # as training saw it
  tokens, lengths = jaxdecode.right_pad([held_out], pad_id=tokenizer.PAD, buckets=None)
  rounded = jax.tree.map(lambda w: w.astype(jnp.float16).astype(jnp.float32), weights)
  reloaded_logits = forward(*nnx.split(reloaded), tokens, lengths)  # [1, T, V]
  exact = bool(jnp.array_equal(reloaded_logits, forward(graphdef, rounded, tokens, lengths)))
  diff = float(jnp.max(jnp.abs(reloaded_logits - forward(graphdef, weights, tokens, lengths))))
  print(f"reloaded logits equal the trained model's with float16-rounded weights: {exact}; "
        f"max |difference| from the float32 weights: {diff:.2g}")

  prompt = prompt or tokenizer.decode(train_stream[:200]).strip().split("\n")[0][:16] or "The"
  n = max_new_tokens or (40 if quick else 120)
  texts = {}
  for name, params in {"greedy": jaxdecode.SamplingParams(temperature=0.0),
                       "top-p 0.9": jaxdecode.SamplingParams(temperature=0.8, top_p=0.9)}.items():
    texts[name] = generate([prompt], model=reloaded, params=params, seed=seed,
                           max_new_tokens=n).texts[0]
    print(f"  {name:<9} {prompt!r} -> {texts[name]!r}")

  if not (after < before and exact):
    raise SystemExit(f"training did not lower the loss ({before:.3f} -> {after:.3f}) or the "
                     f"checkpoint did not reload exactly ({exact})")
  return {"val_loss_before": before, "val_loss_after": after, "history": summary["history"],
          "reload_equals_float16": exact, "reload_max_diff_float32": diff, "texts": texts}


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--text", default=None, help="a UTF-8 text file (default: a few KB of "
                                                   "the Python docs from pydoc_data.topics)")
  parser.add_argument("--quick", action="store_true", help="tiny model, 60 steps")
  parser.add_argument("--steps", type=int, default=None, help="training steps (overrides)")
  parser.add_argument("--out", default="train_on_your_text.msgpack", help="checkpoint path")
  parser.add_argument("--prompt", default=None, help="what to continue after training")
  parser.add_argument("--max-new-tokens", type=int, default=None)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  if args.text is not None and not os.path.isfile(args.text):
    parser.error(f"--text {args.text!r}: no such file")
  main(args.text, quick=args.quick, steps=args.steps, out=args.out, prompt=args.prompt,
       max_new_tokens=args.max_new_tokens, seed=args.seed)
