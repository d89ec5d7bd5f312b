"""Train the small byte-level transformer on a text corpus with optax.

The default corpus is the running Python's standard library (`jaxdecode.models.corpus`: no
download, whole files held out); `--corpus FILE|DIR` takes your own text instead. Each document
is followed by an EOS token, so the model also learns to end.

Every training window starts with BOS, like a generation prompt does, and the loss is the mean
next-token cross-entropy in nats per byte (the target tokens are bytes, plus the EOS ids).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdecode import _checks
from jaxdecode import _files
from jaxdecode.models import corpus as corpus_module
from jaxdecode.models.checkpoint import save_checkpoint
from jaxdecode.models.tokenizer import ByteTokenizer
from jaxdecode.models.transformer import Transformer, TransformerConfig

TOKENIZER = ByteTokenizer()


# ---------------------------------------------------------------------------------------------
# Data.


def encode_documents(documents: list[str], *, eos_between: bool = True) -> np.ndarray:
  """One int32 token stream: each document's bytes, followed by EOS when `eos_between`."""
  parts = []
  for doc in documents:
    parts.append(np.frombuffer(doc.encode("utf-8"), np.uint8).astype(np.int32))
    if eos_between:
      parts.append(np.array([TOKENIZER.EOS], np.int32))
  return np.concatenate(parts) if parts else np.zeros(0, np.int32)


split_stream = corpus_module.split_stream


def as_corpus(corpus) -> corpus_module.Corpus:
  """A `Corpus` from None (the standard library), a path (a file or a folder of text files), a
  token stream (an int array, split by chunks), or a `Corpus`."""
  if isinstance(corpus, corpus_module.Corpus):
    return corpus
  if isinstance(corpus, np.ndarray):
    train, held = split_stream(corpus)
    return corpus_module.Corpus(train=train, held_out=held, parts={"held out": held},
                                description={"source": f"a token stream of {len(corpus)} "
                                                       f"tokens"})
  return corpus_module.build_corpus(corpus)


def windows(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping evaluation windows covering every token of `stream` exactly once.

  Returns (inputs, targets), int32[N, seq_len] each: inputs start with BOS; targets past the end
  of the stream are -1 (ignored).
  """
  n = max(1, math.ceil(len(stream) / seq_len))
  targets = np.full((n, seq_len), -1, np.int32)
  targets.reshape(-1)[:len(stream)] = stream
  inputs = np.concatenate([np.full((n, 1), TOKENIZER.BOS, np.int32), targets[:, :-1]], axis=1)
  inputs = np.where(inputs < 0, TOKENIZER.PAD, inputs)
  return inputs, targets


def random_batches(stream: np.ndarray, batch_size: int, seq_len: int,
                   seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Endless random windows: inputs [BOS, t0 .. t_{L-2}], targets [t0 .. t_{L-1}]."""
  if len(stream) < seq_len + 1:
    raise ValueError(f"the training text has {len(stream)} tokens; it needs at least "
                     f"{seq_len + 1} for windows of {seq_len}")
  rng = np.random.default_rng(seed)
  bos = np.full((batch_size, 1), TOKENIZER.BOS, np.int32)
  while True:
    starts = rng.integers(0, len(stream) - seq_len, batch_size)
    targets = np.stack([stream[s:s + seq_len] for s in starts])
    yield np.concatenate([bos, targets[:, :-1]], axis=1), targets


# ---------------------------------------------------------------------------------------------
# Loss, step, evaluation.


def loss_and_count(model: Transformer, inputs: jax.Array, targets: jax.Array):
  """(summed cross-entropy in nats, number of target tokens); targets < 0 are ignored."""
  logits = model(inputs)  # [B, T, V]
  valid = targets >= 0
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
  return -jnp.sum(jnp.where(valid, picked, 0.0)), jnp.sum(valid)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 3000
  batch_size: int = 32
  seq_len: int = 256
  peak_lr: float = 2e-3
  warmup_steps: int = 200
  weight_decay: float = 0.05
  clip_norm: float = 1.0
  eval_every: int = 250
  seed: int = 0
  eval_tokens: int = 65536  # held-out tokens of the periodic evaluations (the last uses all)

  def __post_init__(self):
    for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_tokens"):
      _checks.integer(name, getattr(self, name), low=1)
    _checks.integer("warmup_steps", self.warmup_steps, low=0)
    _checks.integer("seed", self.seed, low=0, high=_checks.MAX_SEED)
    for name in ("peak_lr", "weight_decay", "clip_norm"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
          math.isfinite(value) and value >= 0) or (name != "weight_decay" and value == 0):
        raise ValueError(f"{name} must be a finite number "
                         f"{'>= 0' if name == 'weight_decay' else '> 0'}; got {value!r}")


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW on a warmup + cosine schedule, after global-norm gradient clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.peak_lr, min(cfg.warmup_steps, max(cfg.steps - 1, 0)), max(cfg.steps, 1),
      end_value=cfg.peak_lr * 0.05)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                 mask=decay_mask))


def make_train_step(graphdef, optimizer):
  @jax.jit
  def train_step(weights, opt_state, inputs, targets):
    def loss_fn(w):
      total, count = loss_and_count(nnx.merge(graphdef, w), inputs, targets)
      return total / count

    loss, grads = jax.value_and_grad(loss_fn)(weights)
    updates, opt_state = optimizer.update(grads, opt_state, weights)
    return optax.apply_updates(weights, updates), opt_state, loss

  return train_step


@functools.partial(jax.jit, static_argnums=0)  # one program per model structure, not per call
def _batch_loss(graphdef, weights, inputs, targets):
  return loss_and_count(nnx.merge(graphdef, weights), inputs, targets)


def evaluate(graphdef, weights, stream: np.ndarray, seq_len: int, batch_size: int = 16) -> float:
  """Mean cross-entropy of the model on `stream`, in nats per token (byte)."""
  inputs, targets = windows(stream, seq_len)
  total, count = 0.0, 0
  for i in range(0, len(inputs), batch_size):
    x, y = inputs[i:i + batch_size], targets[i:i + batch_size]
    if len(x) < batch_size:  # pad the last batch to the same shape (no recompilation)
      pad = batch_size - len(x)
      x = np.concatenate([x, np.full((pad, seq_len), TOKENIZER.PAD, np.int32)])
      y = np.concatenate([y, np.full((pad, seq_len), -1, np.int32)])
    s, c = _batch_loss(graphdef, weights, jnp.asarray(x), jnp.asarray(y))
    total, count = total + float(s), count + int(c)
  return total / max(count, 1)


# ---------------------------------------------------------------------------------------------
# The loop.


def _progress(step: int, total: int, loss: float, started: float, stream=sys.stderr) -> None:
  width = 30
  done = int(width * step / total)
  rate = step / max(time.perf_counter() - started, 1e-9)
  eta = (total - step) / max(rate, 1e-9)
  stream.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.3f}  "
               f"{rate:.2f} steps/s  eta {eta / 60:.1f} min ")
  stream.flush()


def train(model_config: TransformerConfig, cfg: TrainConfig, *, corpus=None,
          out: str | None = None, log=sys.stderr):
  """Trains a new model on a corpus; returns `(model, summary)`.

  Every `eval_every` steps the held-out loss is measured on the first `eval_tokens` held-out
  tokens; the model returned (and saved) holds the weights of the evaluation with the lowest
  loss, not the last step's. With `out`, each evaluation that lowers the loss also saves them
  (atomically), so a long run can be stopped at any time and leaves its best model so far. At
  the end the best weights are scored on every held-out token, part by part
  (`summary["held_out"]`). The summary (losses, timings, settings, the corpus's description:
  JSON-ready) is the checkpoint metadata.

  Args:
    model_config: the model's sizes.
    cfg: the training settings.
    corpus: None (the standard library), a UTF-8 text file or a folder of them, a token stream
      (an int array), or a `jaxdecode.models.corpus.Corpus`.
    out: where to save a checkpoint (checked before training starts; written atomically).
    log: where progress goes.

  Raises:
    ValueError: for a bad corpus or `out` (before any training), or if the validation loss was
      never finite (the run diverged; nothing is saved).
  """
  if out is not None:
    _files.check_output_file(out, "checkpoint")
  data = as_corpus(corpus)
  if cfg.seq_len > model_config.max_len:
    raise ValueError(f"seq_len {cfg.seq_len} is longer than the model's max_len "
                     f"{model_config.max_len}")
  val_stream = data.held_out[:cfg.eval_tokens]
  model = Transformer(model_config, rngs=nnx.Rngs(cfg.seed))
  graphdef, weights = nnx.split(model)
  optimizer = make_optimizer(cfg)
  opt_state = optimizer.init(weights)
  step_fn = make_train_step(graphdef, optimizer)
  batches = random_batches(data.train, cfg.batch_size, cfg.seq_len, cfg.seed)
  history = []
  best, best_val = None, math.inf
  started = time.perf_counter()
  loss = float("nan")
  for step in range(1, cfg.steps + 1):
    inputs, targets = next(batches)
    weights, opt_state, loss = step_fn(weights, opt_state, jnp.asarray(inputs),
                                       jnp.asarray(targets))
    if step % 10 == 0 or step == cfg.steps:
      _progress(step, cfg.steps, float(loss), started, log)
    if step % cfg.eval_every == 0 or step == cfg.steps:
      val = evaluate(graphdef, weights, val_stream, cfg.seq_len)
      history.append({"step": step, "train_loss": float(loss), "val_loss": val,
                      "seconds": time.perf_counter() - started})
      log.write(f"\n  step {step}: train {float(loss):.4f}  validation {val:.4f} nats/byte\n")
      log.flush()
      if val <= best_val:  # keep the best weights, not the last (a NaN loss is never best)
        best, best_val = weights, val
        if out is not None and step < cfg.steps:
          save_checkpoint(out, model_config, best, metadata=dict(
              summary(data, cfg, history, best_val, {}, started), finished=False))
  if best is None:
    raise ValueError(f"training diverged: the validation loss was never finite "
                     f"({[h['val_loss'] for h in history]}); lower the learning rate and train "
                     f"again")
  held_out = {name: evaluate(graphdef, best, part, cfg.seq_len)
              for name, part in data.parts.items() if len(part)}
  log.write("  held out: " + ", ".join(f"{k} {v:.4f}" for k, v in held_out.items())
            + " nats/byte\n")
  result = dict(summary(data, cfg, history, best_val, held_out, started), finished=True)
  if out is not None:
    save_checkpoint(out, model_config, best, metadata=result)
  return nnx.merge(graphdef, best), result


def summary(data, cfg: TrainConfig, history: list, best_val: float, held_out: dict,
            started: float) -> dict:
  """The JSON-ready record of a run (the checkpoint's metadata)."""
  return {"train": dataclasses.asdict(cfg), "corpus": data.description,
          "python": sys.version.split()[0], "train_tokens": int(len(data.train)),
          "held_out_tokens": int(len(data.held_out)), "history": list(history),
          "val_loss": best_val, "held_out": held_out, "seconds": time.perf_counter() - started}
