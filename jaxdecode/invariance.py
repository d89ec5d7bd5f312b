"""An invariance audit for any model: is a prompt's output the same alone and in a batch?

`audit(prefill, step_fn, prompts)` decodes each of some prompts greedily alone (the reference),
then inside random mixes (a random batch size, a random slot, random partner prompts of other
lengths), and compares the prompt's row bit for bit: the logits at every step until the tokens
part, the first step whose logits differ at all, and the greedy tokens that flip. The needle
test of vLLM's and SGLang's batch-invariant modes, for your model on your hardware: XLA picks
kernels by shape, differently on CPU, GPU and TPU, so a promise tested on one machine is checked
again on another by running this.

`jaxdecode audit` runs it on the embedded transformer in both modes (batch-invariant numerics
and plain XLA) and prints a table.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import _checks
from jaxdecode import processors


@dataclasses.dataclass(frozen=True)
class MixResult:
  """One mix: the needle at `slot` of a batch of `batch` prompts.

  Attributes:
    needle: index of the needle in the audited prompts.
    batch, slot: the batch size and the needle's row.
    partner_lengths: the other rows' prompt lengths.
    max_abs_diff: the largest |logit difference| at the steps before the tokens first part.
    first_logit_divergence: the first step whose logits differ in any bit (None: never).
    first_token_flip: the first step whose greedy token differs (None: never).
    tokens_flipped: how many of the steps' greedy tokens differ.
  """
  needle: int
  batch: int
  slot: int
  partner_lengths: tuple
  max_abs_diff: float
  first_logit_divergence: int | None
  first_token_flip: int | None
  tokens_flipped: int


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """What `audit` found, mix by mix."""
  steps: int
  mixes: list

  @property
  def divergent(self) -> int:
    """Mixes in which the needle's logits differ from its reference in any bit."""
    return sum(m.first_logit_divergence is not None for m in self.mixes)

  @property
  def flipped(self) -> int:
    """Mixes in which at least one greedy token changed."""
    return sum(m.first_token_flip is not None for m in self.mixes)

  def format_table(self, title: str = "") -> str:
    """A text table, one line per mix, and a summary line."""
    lines = [title] if title else []
    header = (f"{'needle':>6} {'B':>3} {'slot':>4} {'max |diff|':>11} {'1st diff':>8} "
              f"{'1st flip':>8} {'flips':>5}")
    lines += [header, "-" * len(header)]
    for m in self.mixes:
      lines.append(f"{m.needle:>6} {m.batch:>3} {m.slot:>4} {m.max_abs_diff:>11.3g} "
                   f"{_step(m.first_logit_divergence):>8} {_step(m.first_token_flip):>8} "
                   f"{m.tokens_flipped:>5}")
    lines.append(f"{self.divergent} of {len(self.mixes)} mixes diverge (logits differ in some "
                 f"bit); {self.flipped} flip a greedy token within {self.steps} steps")
    return "\n".join(lines) + "\n"


def _step(value) -> str:
  return "-" if value is None else str(value)


@functools.partial(jax.jit, static_argnames=("step_fn", "steps"))
def _greedy_run(step_fn, state, logits, positions, *, steps: int):
  """Greedy tokens [B, steps] and the logits they came from [B, steps, V] (step 0: prefill's)."""
  def body(carry, t):
    state, logits = carry
    token = processors.first_argmax(processors.remove_nan(logits))
    new_logits, state = step_fn(state, token, positions + t)
    return (state, new_logits), (token, logits)

  _, (tokens, all_logits) = jax.lax.scan(body, (state, logits),
                                         jnp.arange(steps, dtype=jnp.int32))
  return tokens.T, jnp.swapaxes(all_logits, 0, 1)


def _bits(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def audit(prefill: Callable, step_fn: Callable, prompts: Sequence[Sequence[int]], *,
          steps: int = 32, mixes: int = 20, max_batch: int = 16, seed: int = 0) -> AuditReport:
  """Decodes prompts alone and in random batches and compares them bit for bit.

  Args:
    prefill: `prefill(prompts: list of token lists) -> (logits [B, V], state, positions [B])`:
      your model's prefill of a batch (pad as your model wants); `positions` are the positions
      of each row's first new token.
    step_fn: `decode`'s step contract, `(state, tokens [B], positions [B]) -> (logits, state)`;
      the state must have room for `steps` more tokens per row. Static: build it once.
    prompts: at least two token lists; needles and partners are drawn from them.
    steps: greedy steps per run (the prefill's logits count as step 0).
    mixes: how many random mixes.
    max_batch: the largest batch of a mix (2..max_batch rows).
    seed: the mixes' randomness.

  Returns:
    An `AuditReport` (`.divergent`, `.flipped`, `.format_table()`).
  """
  prompts = _checks.token_prompts(prompts)
  if len(prompts) < 2:
    raise ValueError(f"prompts must hold at least 2 prompts (a needle and a partner); got "
                     f"{len(prompts)}")
  if not callable(prefill) or not callable(step_fn):
    raise ValueError("prefill and step_fn must be callable")
  steps = _checks.integer("steps", steps, low=1)
  mixes = _checks.integer("mixes", mixes, low=1)
  max_batch = _checks.integer("max_batch", max_batch, low=2)
  seed = _checks.integer("seed", seed)
  rng = np.random.default_rng(seed)

  def run(batch_prompts):
    logits, state, positions = prefill([list(p) for p in batch_prompts])
    tokens, all_logits = _greedy_run(step_fn, state, logits,
                                     jnp.asarray(positions, jnp.int32), steps=steps)
    return np.asarray(tokens), np.asarray(all_logits)

  references = {}
  results = []
  for _ in range(mixes):
    needle = int(rng.integers(len(prompts)))
    if needle not in references:
      tokens, logits = run([prompts[needle]])
      references[needle] = (tokens[0], logits[0])
    ref_tokens, ref_logits = references[needle]
    batch = int(rng.integers(2, max_batch + 1))
    slot = int(rng.integers(batch))
    others = [i for i in range(len(prompts)) if i != needle]
    partners = [prompts[int(i)] for i in rng.choice(others, batch - 1)]
    batch_prompts = partners[:slot] + [prompts[needle]] + partners[slot:]
    tokens, logits = run(batch_prompts)
    tokens, logits = tokens[slot], logits[slot]
    flips = np.flatnonzero(tokens != ref_tokens)
    first_flip = int(flips[0]) if flips.size else None
    # Logits are comparable while the tokens fed so far agree: steps 0 .. first flip.
    upto = steps if first_flip is None else first_flip + 1
    differs = np.any(_bits(logits[:upto]) != _bits(ref_logits[:upto]), axis=-1)
    diverged = np.flatnonzero(differs)
    with np.errstate(invalid="ignore"):
      diff = np.nanmax(np.abs(logits[:upto].astype(np.float64) - ref_logits[:upto]))
    results.append(MixResult(
        needle=needle, batch=batch, slot=slot, partner_lengths=tuple(len(p) for p in partners),
        max_abs_diff=float(diff), first_logit_divergence=int(diverged[0]) if diverged.size
        else None, first_token_flip=first_flip, tokens_flipped=int(flips.size)))
  return AuditReport(steps=steps, mixes=results)


# ---------------------------------------------------------------------------------------------
# The structural check: which sums of a program does the backend order?

_ADDS = ("stablehlo.add",)


def _operations(op):
  """Every operation nested in `op` (functions, loop bodies, branches), `op` first."""
  yield op
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        yield from _operations(inner.operation)


def _lowered_operations(fn: Callable, args, platform: str):
  """Every StableHLO operation of `jax.jit(fn)(*args)` lowered for `platform` (not compiled)."""
  if platform not in ("cpu", "cuda", "rocm", "tpu"):
    raise ValueError(f"platform must be 'cpu', 'cuda', 'rocm' or 'tpu'; got {platform!r}")
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  return _operations(lowered.compiler_ir("stablehlo").operation)


def _shape_and_float(value_type) -> tuple[tuple[int, ...], bool]:
  from jax.extend.mlir import ir  # pylint: disable=import-outside-toplevel
  ranked = ir.RankedTensorType(value_type)
  element = str(ranked.element_type)
  return tuple(ranked.shape), element.startswith(("f", "bf", "complex"))


def _int_list(text: str, key: str = "") -> list[int]:
  """The integers of `key = [1, 2]` in an attribute's text, or of `array<i64: 1, 2>` (no key)."""
  match = re.search(re.escape(key) + r" = \[([-\d, ]*)\]", text) if key else \
      re.search(r"array<i64(?::([-\d, ]*))?>", text)
  return [int(v) for v in (match.group(1) or "").replace(" ", "").split(",") if v] if match else []


def unordered_sums(fn: Callable, *args, platform: str = "cpu") -> list[str]:
  """The floating-point sums of `jax.jit(fn)(*args)` whose order the backend chooses.

  The program is lowered for `platform` ("cpu", "cuda", "tpu": no such device is needed) and
  its StableHLO is walked, loops, branches and called functions included. A sum's order is
  the backend's when it is one op over many terms: a `dot_general` contracting more than one
  term, an add-`reduce` or add-`reduce_window` over more than one element, a `convolution`, or a
  `scatter` that adds. Such an op's bits may change with the shape it is given, the kernel XLA
  picks, the CPU's instruction set, or the device. Elementwise ops (and so the chains and trees
  that `jaxdecode.models.numerics` and `jaxdecode._reduce` write with them) are not listed:
  each output element is computed by itself, in the order the program writes. Integer sums are
  exact in any order and are not listed either.

  Args:
    fn: the function; it is traced, lowered and walked, never compiled or run.
    *args: its arguments (arrays or `jax.ShapeDtypeStruct`s).
    platform: the lowering platform.

  Returns:
    One line per such op (its name, what it sums, and its source line), empty when the program
    fixes the order of every float sum.
  """
  found = []
  for op in _lowered_operations(fn, args, platform):
    name = op.name
    if name not in ("stablehlo.dot_general", "stablehlo.reduce", "stablehlo.reduce_window",
                    "stablehlo.convolution", "stablehlo.scatter"):
      continue
    shape, is_float = _shape_and_float(op.operands[0].type)
    if not is_float:
      continue
    body = [inner.operation.name for region in op.regions for block in region.blocks
            for inner in block.operations]
    what = None
    if name == "stablehlo.dot_general":
      dims = _int_list(str(op.attributes["dot_dimension_numbers"]), "lhs_contracting_dimensions")
      terms = int(np.prod([shape[d] for d in dims])) if dims else 1
      if terms > 1:
        what = f"contracts {terms} terms of {shape}"
    elif name == "stablehlo.reduce" and any(b in _ADDS for b in body):
      dims = _int_list(str(op.attributes["dimensions"]))
      terms = int(np.prod([shape[d] for d in dims])) if dims else 1
      if terms > 1:
        what = f"adds {terms} terms of {shape} (dimensions {dims})"
    elif name == "stablehlo.reduce_window" and any(b in _ADDS for b in body):
      window = _int_list(str(op.attributes["window_dimensions"]))
      if int(np.prod(window)) > 1:
        what = f"adds windows {window} of {shape}"
    elif name == "stablehlo.convolution":
      what = f"convolves {shape}"
    elif name == "stablehlo.scatter" and any(b in _ADDS for b in body):
      what = f"scatter-adds into {shape}"
    if what:
      found.append(f"{name} {what} at {_location(op.location)}")
  return found


def _location(location) -> str:
  """The innermost `file:line` of an MLIR location (the Python line that made the op)."""
  text = str(location)
  match = [(f.rsplit("/", 1)[-1], line) for f, line in re.findall(r'"([^"]+\.py)":(\d+)', text)]
  match = [m for m in match if m[0] != "_platform.py"] or match  # the caller, not the switch
  return f"{match[0][0]}:{match[0][1]}" if match else text[:80]


# ---------------------------------------------------------------------------------------------
# The control-flow check: where would a GPU step wait on the host?


def _defining_op(value):
  """The op that produced an MLIR value, or None for a block argument."""
  from jax.extend.mlir import ir  # pylint: disable=import-outside-toplevel
  owner = value.owner
  return owner.operation if isinstance(owner, ir.Operation) or hasattr(owner, "operation") \
      and not isinstance(owner, ir.Block) else None


def _is_constant(value) -> bool:
  op = _defining_op(value)
  return op is not None and op.name == "stablehlo.constant"


def _constant_trip_count(op) -> bool:
  """True when a `stablehlo.while` counts a carried integer from a constant up to a constant.

  The pattern `lax.fori_loop` with static bounds and `lax.scan` lower to: the condition region
  compares a block argument with a constant (and nothing else decides), the body returns that
  argument plus a constant, and the loop's initial value for it is a constant. XLA derives the
  trip count of such a loop at compile time, so on a GPU it runs without reading its predicate
  back to the host.
  """
  cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
  inner = [o.operation for o in cond.operations]
  compares = [o for o in inner if o.name == "stablehlo.compare"]
  if len(compares) != 1 or any(o.name not in ("stablehlo.constant", "stablehlo.compare",
                                              "stablehlo.return") for o in inner):
    return False
  counter = None
  for operand, other in ((compares[0].operands[0], compares[0].operands[1]),
                         (compares[0].operands[1], compares[0].operands[0])):
    if _defining_op(operand) is None and _is_constant(other):
      counter = operand
  if counter is None:
    return False
  index = next(i for i, arg in enumerate(cond.arguments) if arg == counter)
  if not _is_constant(op.operands[index]):
    return False
  returned = [o.operation for o in body.operations][-1]
  step = _defining_op(returned.operands[index])
  return (step is not None and step.name == "stablehlo.add" and
          any(a == body.arguments[index] for a in step.operands) and
          any(_is_constant(a) for a in step.operands))


def host_round_trips(fn: Callable, *args, platform: str = "cuda") -> list[str]:
  """The control flow of `jax.jit(fn)(*args)` whose decision is data: where a GPU would wait.

  The program is lowered for `platform` (no such device is needed) and its StableHLO walked,
  loops, branches and called functions included. Listed:

  - every `stablehlo.case` (a `lax.cond` or `lax.switch`) with more than one branch whose index
    is not a constant. XLA:GPU copies such a predicate to the host and waits for it before it
    launches a branch. A case with one branch, or a constant index (what
    `lax.platform_dependent` leaves after lowering for one platform), is resolved at compile
    time.
  - every `stablehlo.while` whose trip count is not a constant (`lax.while_loop` on data): XLA:GPU
    reads its predicate back after every iteration. `lax.fori_loop` with static bounds and
    `lax.scan` have constant trip counts.

  Args:
    fn: the function; traced and lowered, never compiled or run.
    *args: its arguments (arrays or `jax.ShapeDtypeStruct`s).
    platform: "cpu", "cuda", "rocm" or "tpu".

  Returns:
    One line per such op: "case" or "while", and its source line. Empty: no step waits.
  """
  found = []
  for op in _lowered_operations(fn, args, platform):
    if op.name == "stablehlo.case":
      if len(op.regions) > 1 and not _is_constant(op.operands[0]):
        found.append(f"case ({len(op.regions)} branches) at {_location(op.location)}")
    elif op.name == "stablehlo.while" and not _constant_trip_count(op):
      found.append(f"while (data-dependent trip count) at {_location(op.location)}")
  return found
