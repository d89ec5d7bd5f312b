"""The command line of the benchmark: `python -m jaxdecode.bench` and `jaxdecode bench`."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from typing import Mapping, Sequence

from jaxdecode import _files
from jaxdecode.tools._args import OneLineParser
from jaxdecode.tools.bench import report
from jaxdecode.tools.bench._common import MIN_RUNS, QUICK_RUNS, RUNS
from jaxdecode.tools.bench.kernels import PEER_MAX_ELEMENTS

DESCRIPTION = ("The benchmark suite: every figure is a ratio of two timings taken in the same "
               "process.")


def _runs(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
  if value < MIN_RUNS:
    raise argparse.ArgumentTypeError(f"the protocol needs at least {MIN_RUNS} runs; "
                                     f"got {value}")
  return value


def build_parser(prog: str = "python -m jaxdecode.bench") -> argparse.ArgumentParser:
  parser = OneLineParser(prog=prog, description=DESCRIPTION)
  parser.add_argument("--quick", action="store_true",
                      help=f"smaller grid (B=8, V in 32000/128256; 32 new tokens), {QUICK_RUNS} "
                           f"runs by default: roughly 10-12 minutes and the scoring table's "
                           f"6.5 (the default run: about 32 and 15)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON object with every median (seconds) and ratio")
  parser.add_argument("--out", default=None, metavar="FILE",
                      help="also write that JSON object to FILE (checked before the run starts; "
                           "written atomically)")
  parser.add_argument("--runs", type=_runs, default=None, metavar="N",
                      help=f"timed runs per row (default {RUNS}; --quick: {QUICK_RUNS}, at "
                           f"least {MIN_RUNS})")
  parser.add_argument("--no-kernels", action="store_true",
                      help="skip the kernel and controls tables (the model tables only)")
  parser.add_argument("--no-decode", action="store_true", help="skip the decode table")
  parser.add_argument("--no-beam", action="store_true", help="skip the beam-search table")
  parser.add_argument("--no-numerics", action="store_true",
                      help="skip the batch-invariant numerics table")
  parser.add_argument("--no-spec", action="store_true",
                      help="skip the speculative-decoding table")
  parser.add_argument("--no-stream", action="store_true", help="skip the streaming table")
  parser.add_argument("--structured", action=argparse.BooleanOptionalAction, default=None,
                      help="include (or, with --no-structured, skip) the structured-decoding "
                           "table; by default it follows --decode like the other model tables "
                           "(on unless --no-decode), so --no-kernels --no-decode --structured "
                           "runs it alone (about 2 minutes, --quick too)")
  parser.add_argument("--scoring", action=argparse.BooleanOptionalAction, default=None,
                      help="include (or, with --no-scoring, skip) the scoring table (rollouts "
                           "with log-probs, the training step); by default it follows --decode, "
                           "so --no-kernels --no-decode --scoring runs it alone")
  parser.add_argument("--all-peers", action="store_true",
                      help=f"time the sort-based peers also where B*V > {PEER_MAX_ELEMENTS} "
                           f"(20-30 minutes more)")
  return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m jaxdecode.bench") -> int:
  """Runs the benchmark and prints the table (or JSON); returns the exit status.

  Args:
    argv: the arguments (default `sys.argv[1:]`).
    prog: the command's name, for messages and the recorded command line.

  Returns:
    0 on success; 2 for a bad command line (reported in one line on stderr).
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    args = build_parser(prog).parse_args(argv)
  except SystemExit as e:  # --help (0) or a bad command line (2, already reported)
    return int(e.code or 0)
  error = _check(args)
  if error:
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2

  def progress(line):
    print(f"[bench] {line}", file=sys.stderr, flush=True)

  flag = lambda off: False if off else None  # pylint: disable=g-long-lambda
  result = report.run_benchmarks(
      quick=args.quick, runs=args.runs, kernels=not args.no_kernels, decode=not args.no_decode,
      beam=flag(args.no_beam), numerics=flag(args.no_numerics), spec=flag(args.no_spec),
      stream=flag(args.no_stream), structured=args.structured, scoring=args.scoring,
      all_peers=args.all_peers, command=f"{prog} {shlex.join(argv)}".strip(), progress=progress)
  text = json.dumps(_finite(result), indent=1, sort_keys=False, allow_nan=False)
  if args.out is not None:
    _files.atomic_write_text(args.out, text + "\n", "benchmark output")
  print(text if args.json else report.format_table(result), end="\n" if args.json else "")
  return 0


def _check(args: argparse.Namespace) -> str | None:
  """What is wrong with parsed arguments before anything runs (None: nothing)."""
  if not args.quick and args.runs is not None and args.runs < RUNS:
    return (f"published figures need --runs >= {RUNS}; add --quick for a smaller run (see "
            f"--help)")
  if args.out is not None:
    try:
      _files.check_output_file(args.out, "benchmark output")
    except ValueError as e:
      return str(e)
  return None


def _finite(tree):
  """JSON-safe copy: non-finite floats become None."""
  if isinstance(tree, Mapping):
    return {k: _finite(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_finite(v) for v in tree]
  if isinstance(tree, float) and not math.isfinite(tree):
    return None
  return tree
