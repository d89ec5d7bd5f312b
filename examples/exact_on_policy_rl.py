"""Exact on-policy RL: GRPO on the embedded draft model, the trainer's log-probs the sampler's.

Every step samples G completions per prompt with `models.generate(n=G, logprob_kinds=True)`
(the sampler), rewards each one with a program (the prompt plus the completion's first line
must parse as Python: `ast.parse`), takes group-relative advantages
A = (r - mean of the group) / (std of the group + eps), and updates the weights with the PPO
clipped objective, optax's Adam, over two minibatches. The trainer's log-probs come from
`jaxdecode.score` under `jax.value_and_grad`, with the sampler's `SamplingParams`: one forward
pass over prompt + completion (`models.forward_fn`), the `processed` kind, what the tokens were
drawn from (docs/decoding.md, section 13).

With the model's batch-invariant numerics (the default) the sampler's and the trainer's
log-probs are the same bits, although the trainer's batch is half the sampler's and its prompts
are padded to another width: on the first minibatch (the weights that sampled) max |Δ| and the
k3 KL estimate are exactly 0 and the PPO ratio is exactly 1, at every step; the example asserts
it. `--plain` is the usual setup instead: the same weights with XLA's plain kernels
(`load_draft(batch_invariant=False)`) for the sampler, and the model's training pass
(`Transformer.__call__`, whole sequences, plain ops) as the trainer's forward. Then they are not
0, and the ratio on policy is only close to 1 (the gap TIS/MIS corrections patch elsewhere).
(Plain kernels through the inference pass `models.forward` happen to match the sampler's bits
on XLA:CPU at these shapes; nothing promises it, on another backend or shape.)

Each step prints one line: the mean reward, the sampler-trainer diagnostics on the first
minibatch (`jaxdecode.logprob_diff`: max |Δ log-prob|, k3 KL, max |ratio - 1|), the loss, and
the mean ratio and clipped share on the second minibatch (after one update: off by design).

Run:
  python examples/exact_on_policy_rl.py                 # 40 steps, 8 prompts x 8 samples
  python examples/exact_on_policy_rl.py --plain         # the same with plain numerics
  python examples/exact_on_policy_rl.py --quick         # 2 tiny steps (the test)
  python examples/exact_on_policy_rl.py --out curve.png # also plot the reward (matplotlib)
"""

from __future__ import annotations

import ast
import io
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxdecode
from jaxdecode import _files
from jaxdecode import models
from jaxdecode.tools import _args

PROMPTS = ("x = ", "print(", "y = [", "return ", "z = (", "b = f(", "n = len(", "import ")
SAMPLING = jaxdecode.SamplingParams(temperature=1.0)  # the sampler's and the trainer's
CLIP = 0.2  # PPO's epsilon: the ratio is clipped to [0.8, 1.2]
EPS = 1e-6  # in the advantage's denominator (a group with one reward has advantage 0)
MINIBATCHES = 2  # per step, each a whole number of groups; the first is on policy
QUICK = dict(steps=2, group_size=4, prompts=2, max_new_tokens=8)


def reward(prompt: str, completion: str) -> float:
  """1.0 if the prompt and the completion's first line parse as Python, else 0.0."""
  try:
    ast.parse(prompt + completion.split("\n")[0])
  except (SyntaxError, ValueError):  # ValueError: a NUL byte
    return 0.0
  return 1.0


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
  """GRPO's baseline: each reward against its group's (prompt-major rows, G per prompt)."""
  groups = rewards.reshape(-1, group_size)
  centered = (groups - groups.mean(axis=1, keepdims=True)) / (groups.std(axis=1, keepdims=True)
                                                                + EPS)
  return centered.reshape(-1).astype(np.float32)


def make_train_step(graphdef, optimizer, eos: int, pad: int, *, plain: bool):
  """The jitted PPO step on one minibatch: `(weights, opt_state, batch) -> (weights, opt_state,
  loss, trainer log-probs [b, N], ratios [b, N])`, the log-probs and ratios at the weights
  before the update.

  The trainer's logits: `models.forward_fn` (the inference pass, the sampler's bits) or, with
  `plain`, the model's training pass (`Transformer.__call__`, whole sequences with plain ops),
  the forward an RL trainer usually has.
  """

  def training_pass(weights, tokens, lengths):
    del lengths  # right padding only follows a row's tokens: it changes none of their logits
    return nnx.merge(graphdef, weights)(tokens)

  def logits_fn(weights):
    if plain:
      return jax.tree_util.Partial(training_pass, weights)
    return models.forward_fn(graphdef, weights)

  def loss_fn(weights, batch):
    scores = jaxdecode.score(logits_fn(weights), batch["prompt_tokens"],
                             batch["prompt_lengths"], batch["tokens"], params=SAMPLING,
                             eos_ids=[eos], pad_id=pad)
    mask = batch["mask"]
    ratio = jnp.exp(jnp.where(mask, scores.processed - batch["old_logprobs"], 0.0))  # [b, N]
    advantage = batch["advantages"][:, None]
    objective = jnp.minimum(ratio * advantage,
                            jnp.clip(ratio, 1.0 - CLIP, 1.0 + CLIP) * advantage)
    tokens = jnp.maximum(jnp.sum(mask, axis=1), 1)  # GRPO: a mean per sequence, then per batch
    per_row = jnp.sum(jnp.where(mask, objective, 0.0), axis=1) / tokens
    return -jnp.mean(per_row), (scores.processed, ratio)

  @jax.jit
  def train_step(weights, opt_state, batch):
    (loss, (logprobs, ratio)), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights, batch)
    updates, opt_state = optimizer.update(grads, opt_state, weights)
    return optax.apply_updates(weights, updates), opt_state, loss, logprobs, ratio

  return train_step


def plot(curve: list, path: str, title: str) -> bool:
  """The mean reward per step as a PNG (atomically); False without matplotlib (optional)."""
  try:  # pylint: disable=import-outside-toplevel
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError:
    return False
  fig = Figure(figsize=(6, 3.2), dpi=90, layout="constrained")
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  ax.plot(np.arange(1, len(curve) + 1), curve, marker="o", markersize=3)
  ax.set_xlabel("GRPO step")
  ax.set_ylabel("mean reward (share that parses)")
  ax.set_ylim(0, 1.04)
  ax.grid(True, alpha=0.3)
  ax.set_title(title, fontsize=9)
  png = io.BytesIO()
  fig.savefig(png, format="png")
  _files.atomic_write(path, png.getvalue(), "reward plot")
  return True


def main(*, steps: int = 40, group_size: int = 8, prompts: int = 8, max_new_tokens: int = 16,
         seed: int = 0, plain: bool = False, quick: bool = False, out: str | None = None,
         learning_rate: float = 3e-4) -> dict:
  """Runs GRPO and returns `{"rewards": mean reward per step, "max_abs", "k3", "ratio_gap"
  (first minibatch, per step), "loss", "seconds", "png"}`.

  Args:
    steps, group_size, prompts, max_new_tokens: the run's size (`quick` overrides all four).
    seed: step t samples with key `fold_in(key(seed), t)`.
    plain: the usual setup: the sampler with XLA's plain kernels (`batch_invariant=False`),
      the trainer through the model's training pass.
    quick: QUICK's tiny sizes.
    out: a PNG path for the reward curve, or None.
    learning_rate: Adam's.
  """
  if quick:
    steps, group_size, prompts, max_new_tokens = (QUICK[k] for k in (
        "steps", "group_size", "prompts", "max_new_tokens"))
  if not 1 <= prompts <= len(PROMPTS) or prompts % MINIBATCHES:
    raise ValueError(f"--prompts must be {MINIBATCHES}, {2 * MINIBATCHES}, ... up to "
                     f"{len(PROMPTS)} (whole groups per minibatch); got {prompts}")
  if group_size < 2:
    raise ValueError(f"--group-size must be at least 2 (a group-relative baseline); got "
                     f"{group_size}")
  if out is not None:
    _files.check_output_file(out, "--out")  # before the run, not after it
  model = models.load_draft(batch_invariant=not plain)
  tok = models.ByteTokenizer()
  texts = PROMPTS[:prompts]
  room = model.config.max_len - max(len(tok.encode(p)) for p in texts)
  if max_new_tokens > room:
    raise ValueError(f"--max-new-tokens must be at most {room} (the draft model's context of "
                     f"{model.config.max_len} tokens less the longest prompt); got "
                     f"{max_new_tokens}")
  graphdef, weights = nnx.split(model)
  rows = prompts * group_size
  # The trainer's prompts, padded to their own width (not generate's bucket): another layout.
  prompt_tokens, prompt_lengths = jaxdecode.right_pad(
      [tok.encode(p) for p in texts for _ in range(group_size)], pad_id=tok.PAD, buckets=None)
  optimizer = optax.adam(learning_rate)
  opt_state = optimizer.init(weights)
  train_step = make_train_step(graphdef, optimizer, tok.EOS, tok.PAD, plain=plain)
  numerics = ("plain kernels (batch_invariant=False), the trainer's training pass" if plain else
              "batch-invariant, the trainer's inference pass")
  print(f"GRPO on the draft model ({numerics}): {prompts} prompts x {group_size} samples, "
        f"{max_new_tokens} new tokens, {steps} steps, Adam {learning_rate:g}, clip {CLIP}")
  print("reward: the prompt + the completion's first line parses as Python (ast.parse)")
  history = {"rewards": [], "max_abs": [], "k3": [], "ratio_gap": [], "loss": []}
  started = time.perf_counter()
  key = jax.random.key(seed)
  for step in range(1, steps + 1):
    model = nnx.merge(graphdef, weights)
    gen = models.generate(list(texts), model=model, params=SAMPLING, n=group_size,
                          key=jax.random.fold_in(key, step), max_new_tokens=max_new_tokens,
                          logprob_kinds=True)
    rewards = np.array([reward(texts[r // group_size], gen.texts[r]) for r in range(rows)],
                       np.float32)
    mask = np.arange(max_new_tokens)[None, :] < gen.lengths[:, None]
    rollout = dict(prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths,
                   tokens=jnp.asarray(gen.tokens), old_logprobs=jnp.asarray(gen.logprobs),
                   mask=jnp.asarray(mask),
                   advantages=jnp.asarray(group_advantages(rewards, group_size)))
    size = rows // MINIBATCHES
    for m in range(MINIBATCHES):
      batch = jax.tree.map(lambda a, m=m: a[m * size:(m + 1) * size], rollout)
      weights, opt_state, loss, logprobs, ratio = train_step(weights, opt_state, batch)
      if m == 0:  # on policy: the weights that sampled these tokens
        first = batch["mask"]
        gap = jaxdecode.logprob_diff(batch["old_logprobs"], logprobs, first)
        ratio_gap = float(jnp.max(jnp.where(first, jnp.abs(ratio - 1.0), 0.0)))
        # Exact by construction: the trainer's bits are the sampler's (checked even under -O).
        if not plain and not (float(gap.max_abs) == 0.0 and float(gap.k3) == 0.0 and
                              bool(jnp.all(jnp.where(first, ratio, 1.0) == 1.0))):
          raise SystemExit(f"step {step}: on policy the trainer's log-probs differ from the "
                           f"sampler's ({gap}) or a ratio is not 1")
        first_loss = float(loss)
      else:
        later = batch["mask"]
        mean_ratio = float(jnp.sum(jnp.where(later, ratio, 0.0)) / jnp.sum(later))
        clipped = float(jnp.sum(later & (jnp.abs(ratio - 1.0) > CLIP)) / jnp.sum(later))
    if not np.isfinite(first_loss):
      raise SystemExit(f"step {step}: the loss is not finite ({first_loss})")
    for name, value in (("rewards", float(rewards.mean())), ("max_abs", float(gap.max_abs)),
                        ("k3", float(gap.k3)), ("ratio_gap", ratio_gap), ("loss", first_loss)):
      history[name].append(value)
    print(f"step {step:3d}  reward {rewards.mean():.3f}  |Δ| max {float(gap.max_abs):.3g}  "
          f"k3 KL {float(gap.k3):.3g}  |ratio-1| max {ratio_gap:.3g}  loss {first_loss:+.2e}  "
          f"| minibatch 2: ratio {mean_ratio:.4f}, clipped {clipped:.1%}", flush=True)
    if step in (1, steps):
      samples = [texts[b] + gen.texts[b * group_size].split("\n")[0] for b in range(prompts)]
      print(f"  samples: {samples}"[:160])
  seconds = time.perf_counter() - started
  rewards = history["rewards"]
  if len(rewards) >= 10:
    head, tail = float(np.mean(rewards[:5])), float(np.mean(rewards[-5:]))
  else:
    head, tail = rewards[0], rewards[-1]
  print(f"mean reward: {head:.3f} (first steps) -> {tail:.3f} (last steps) in {seconds:.0f} s")
  if plain:
    print(f"plain numerics: on policy |Δ| max up to {max(history['max_abs']):.3g}, k3 KL up to "
          f"{max(history['k3']):.3g}, |ratio-1| up to {max(history['ratio_gap']):.3g}")
  else:
    print(f"batch-invariant numerics: |Δ| max, k3 KL and ratio - 1 exactly 0 at all {steps} "
          f"steps")
  png = None
  if out is not None:
    label = "plain numerics" if plain else "batch-invariant numerics"
    title = (f"GRPO on the draft model, {prompts} prompts x {group_size} samples, "
             f"{max_new_tokens} tokens, seed {seed}\n{label}: on-policy |Δ| max "
             f"{max(history['max_abs']):.3g}, k3 KL {max(history['k3']):.3g} (worst step)")
    if plot(rewards, out, title):
      png = out
      print(f"wrote {out}")
    else:
      print("matplotlib is not installed: no plot (pip install 'jaxdecode[plot]')")
  return dict(history, seconds=seconds, png=png)


def parse(argv=None):
  parser = _args.OneLineParser(prog="exact_on_policy_rl.py",
                               description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=_args.positive_int, default=40)
  parser.add_argument("--group-size", type=_args.positive_int, default=8,
                      help="samples per prompt (G, at least 2)")
  parser.add_argument("--prompts", type=_args.positive_int, default=8,
                      help=f"prompts per step: an even number up to {len(PROMPTS)}")
  parser.add_argument("--max-new-tokens", type=_args.positive_int, default=16)
  parser.add_argument("--seed", type=_args.seed, default=0)
  parser.add_argument("--plain", action="store_true",
                      help="the usual setup: XLA's plain kernels (batch_invariant=False) for "
                           "the sampler, the training pass for the trainer: the gap appears")
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK['steps']} steps of {QUICK['prompts']} prompts x "
                           f"{QUICK['group_size']} samples (the test)")
  parser.add_argument("--out", default=None, metavar="PNG",
                      help="write the reward curve there (needs matplotlib)")
  return parser, parser.parse_args(argv)


if __name__ == "__main__":
  cli, args = parse()
  try:
    main(steps=args.steps, group_size=args.group_size, prompts=args.prompts,
         max_new_tokens=args.max_new_tokens, seed=args.seed, plain=args.plain, quick=args.quick,
         out=args.out)
  except ValueError as e:
    cli.exit(2, f"{cli.prog}: error: {' '.join(str(e).split())}\n")
