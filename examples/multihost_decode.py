"""Multi-host decoding on JAX's own distributed runtime: one batch split over several processes.

Run N processes on this machine (CPU devices, connected by JAX's CPU collectives, gloo):
  python examples/multihost_decode.py --processes 2 --seed 0 --max-new-tokens 32 \\
      "The for statement" "def f(x):" "import"
Process 0 prints the line that `jaxdecode generate --json --no-stream --seed 0
--max-new-tokens 32 PROMPT...` prints, with the same rows bit for bit (only "seconds", the
wall-clock time, differs). N is at most the number of prompts and at most 16. When a process
fails, the launcher names it and its exit status (or signal) on stderr, stops the others and
exits non-zero.

On a multi-host TPU slice, run the same command on every host (one process per host) with
`--cluster` in place of `--processes N`:
  gcloud compute tpus tpu-vm ssh NAME --worker=all --command="python multihost_decode.py \\
      --cluster --seed 0 --max-new-tokens 32 'The for statement' 'def f(x):'"
`jax.distributed.initialize()` without arguments then finds the coordinator and the other hosts
in the TPU environment, and the mesh spans every chip of the slice. Nothing else changes.

How: every process runs `decode_across_processes` with the same arguments. One mesh axis,
"data", spans the devices of all processes; each process prefills only its own block of rows,
`jax.make_array_from_process_local_data` joins the blocks into global arrays, and `decode` runs
on them as on one machine (the model step under `shard_map`: `make_step_fn(mesh=...)`). Row r
samples with `fold_in(key, r)`, and its logits do not depend on the other rows, so padding the
batch to a multiple of the device count changes no real row.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxdecode
from jaxdecode import models
from jaxdecode.tools import cli
from jaxdecode.tools._args import OneLineParser, positive_int, seed

PROG = "multihost_decode.py"
MAX_PROCESSES = 16  # --processes on one machine: each process holds the model (about 650 MB)


def decode_across_processes(model, tokenizer, prompts: list, params: jaxdecode.SamplingParams,
                            seed: int, max_new_tokens: int) -> models.Generation:
  """Decodes the prompts as one batch over the devices of all processes (every process calls
  this with the same arguments); returns all rows, on every process."""
  started = time.perf_counter()
  graphdef, weights = nnx.split(model)
  # The mesh lists the devices process by process, so process p holds the p-th block of rows.
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices), ("data",))
  rows, shared = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

  # Pad the batch to a multiple of the device count with copies of the last prompt (dropped at
  # the end). Every process pads all prompts to the same width, so that the shapes agree.
  ids = [tokenizer.encode(p) for p in prompts]
  ids += ids[-1:] * (-len(ids) % len(devices))
  tokens, lengths = jaxdecode.right_pad(ids, pad_id=tokenizer.PAD)
  block = len(ids) // jax.process_count()
  mine = slice(jax.process_index() * block, (jax.process_index() + 1) * block)
  logits, state = models.prefill(
      graphdef, weights, tokens[mine], lengths[mine],
      cache_length=min(tokens.shape[1] + max_new_tokens, model.config.max_len))

  # Each process's rows become its part of global arrays; the weights are replicated.
  def join(sharding, local):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                        local)
  state = state.replace(weights=join(shared, state.weights), cache=join(rows, state.cache),
                        blocks=join(shared, state.blocks))
  logits, positions = join(rows, logits), join(rows, lengths[mine])

  # Under jit, decode skips its checks of values on the host (a process cannot read the other
  # processes' rows; prefill has checked its own).
  step_fn = models.make_step_fn(graphdef, mesh=mesh)  # every device runs the model on its rows
  out = jax.jit(lambda state, logits, positions: jaxdecode.decode(
      step_fn, state, logits, key=jax.random.key(seed), params=params,
      max_new_tokens=max_new_tokens, positions=positions, eos_ids=[tokenizer.EOS],
      pad_id=tokenizer.PAD))(state, logits, positions)

  # Every process receives all rows (numpy arrays); the padding rows are dropped.
  gathered = multihost_utils.process_allgather(
      (out.tokens, out.logprobs, out.lengths, out.finished, out.dead_end), tiled=True)
  new_tokens, logprobs, lengths, finished, dead_end = (x[:len(prompts)] for x in gathered)
  texts = [tokenizer.decode(row[:k]) for row, k in zip(new_tokens, lengths)]
  return models.Generation(texts, new_tokens, logprobs, lengths, finished,
                           time.perf_counter() - started, dead_end)


def json_line(prompts: list, params: jaxdecode.SamplingParams, seed: int, max_new_tokens: int,
              out: models.Generation) -> str:
  """The line of `jaxdecode generate --json` (made by the command's own function)."""
  args = argparse.Namespace(prompts=prompts, n=1, seed=seed, greedy=False)
  # The settings that command reports (its defaults but for these two).
  settings = dict(seed=seed, max_new_tokens=max_new_tokens, penalize_prompt=False,
                  include_stop=False, n=1, length_penalty=1.0, num_draft_tokens=4,
                  top_logprobs=0, logprobs_mode="processed", prompt_logprobs=False)
  return cli._json_report(args, out, settings, settings=params)  # pylint: disable=protected-access


def parse(argv) -> argparse.Namespace:
  """The command line; a bad one exits with status 2 and one line on stderr."""
  parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
  parser.add_argument("prompts", nargs="+", metavar="PROMPT")
  where = parser.add_mutually_exclusive_group(required=True)
  where.add_argument("--processes", type=positive_int, metavar="N",
                     help=f"start N processes on this machine, at most one per prompt (each "
                          f"prefills its own block of rows) and at most {MAX_PROCESSES} (each is a "
                          f"JAX runtime with its own copy of the model, about 650 MB)")
  where.add_argument("--cluster", action="store_true",
                     help="be one process of a job started on every host of a TPU slice (or "
                          "another cluster that jax.distributed.initialize() detects)")
  parser.add_argument("--seed", type=seed, default=0)
  parser.add_argument("--max-new-tokens", type=positive_int, default=160)
  # Given by --processes N to the processes it starts.
  parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  for i, prompt in enumerate(args.prompts):
    if not prompt.strip():
      parser.error(f"prompt {i + 1} is empty; give some text to continue")
  if args.processes is not None and args.processes > MAX_PROCESSES:
    parser.error(f"argument --processes: at most {MAX_PROCESSES} processes on one machine, got "
                 f"{args.processes} (each holds a copy of the model; a larger job runs one "
                 f"process per host with --cluster)")
  if args.processes is not None and args.processes > len(args.prompts):
    parser.error(f"argument --processes: {args.processes} processes for {len(args.prompts)} "
                 f"prompt(s); give at most one process per prompt (a process without one would "
                 f"decode only padding)")
  return args


def describe(status: int) -> str:
  """How a process ended, from its `subprocess` status (minus the signal's number if killed)."""
  if status >= 0:
    return f"exited with status {status}"
  try:
    name = f" ({signal.Signals(-status).name})"
  except ValueError:
    name = ""
  return f"was killed by signal {-status}{name}"


REFUSED = 2  # a process's status when the job refused its input: process 0 has said why
GRACE_S = 30.0  # how long the others get to refuse it too (they make the same check, no waiting)


def start_processes(argv: list, n: int) -> int:
  """Runs this script as processes 0..n-1 of one job, with process 0 as the coordinator.

  Returns 0 when every process succeeds. When one fails, the others are stopped, a line on
  stderr names the process and how it ended, and the result is its exit status (128 + the
  signal's number when a signal killed it). Status 2 is the exception: every process refused
  the job (a prompt too long) and process 0 has printed why in one line; the others get time to
  end on their own, so that process 0's line is not cut off, and nothing is added to it.
  """
  with socket.socket() as s:  # a free port for the coordinator
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen([sys.executable, __file__, "--process-id", str(i),
                             "--coordinator", f"localhost:{port}", *argv],
                            stdout=None if i == 0 else subprocess.DEVNULL)
           for i in range(n)]
  failed = None  # the index of the first process seen failing
  try:
    while failed is None and None in (codes := [p.poll() for p in procs]):
      failed = next((i for i, code in enumerate(codes) if code), None)
      time.sleep(0.05)
    if failed is None:
      failed = next((i for i, p in enumerate(procs) if p.returncode), None)
    if failed is not None and procs[failed].returncode == REFUSED:
      deadline = time.monotonic() + GRACE_S
      while None in [p.poll() for p in procs] and time.monotonic() < deadline:
        time.sleep(0.05)
  finally:
    for p in procs:
      p.kill()
      p.wait()
  if failed is None:
    return 0
  status = procs[failed].returncode
  if status == REFUSED and procs[0].returncode == REFUSED:
    return REFUSED
  print(f"{PROG}: error: process {failed} of {n} {describe(status)}; the others were stopped",
        file=sys.stderr, flush=True)
  return status if status > 0 else 128 - status


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  if args.processes is not None and args.process_id is None:
    return start_processes(argv, args.processes)
  # Only the JSON line goes to stdout (gloo writes a note to it when it connects).
  stdout = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  if args.cluster:
    jax.distributed.initialize()
  else:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # jax 0.10's default
    jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                               process_id=args.process_id)
  model, tokenizer = models.load_default()
  longest = max(len(tokenizer.encode(p)) for p in args.prompts)
  if longest + args.max_new_tokens > model.config.max_len:  # the same on every process
    if jax.process_index() == 0:
      print(f"{PROG}: error: a prompt of {longest - 1} bytes plus --max-new-tokens "
            f"{args.max_new_tokens} does not fit the model's context of "
            f"{model.config.max_len} tokens", file=sys.stderr)
    return 2
  # `jaxdecode generate`'s defaults (made after initialize: SamplingParams holds jax arrays).
  params = jaxdecode.SamplingParams(temperature=0.8, top_p=0.95)
  out = decode_across_processes(model, tokenizer, args.prompts, params, args.seed,
                                args.max_new_tokens)
  if jax.process_index() == 0:
    print(json_line(args.prompts, params, args.seed, args.max_new_tokens, out), file=stdout,
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
