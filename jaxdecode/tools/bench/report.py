"""The whole run (`run_benchmarks`: every table into one JSON-ready dict) and its report
(`format_table`: the machine, then each table module's tables, then the notes)."""

from __future__ import annotations

import os
import platform
import textwrap
import time
from typing import Any, Callable, Mapping, Sequence

import flax
import jax
import jaxlib

import jaxdecode
# The table modules, as _-names: run_benchmarks' flags have their names.
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench import beam as _beam
from jaxdecode.tools.bench import decode as _decode
from jaxdecode.tools.bench import kernels as _kernels
from jaxdecode.tools.bench import numerics as _numerics
from jaxdecode.tools.bench import scoring as _scoring
from jaxdecode.tools.bench import speculative as _speculative
from jaxdecode.tools.bench import stream as _stream
from jaxdecode.tools.bench import structured as _structured
from jaxdecode.tools.bench._common import BATCHES, QUICK_RUNS, RUNS, TOP_P, WARMUP

# The table modules in report order; each has `format_tables(result) -> lines`.
TABLES = (_kernels, _decode, _beam, _numerics, _speculative, _stream, _structured, _scoring)


def usable_cpus() -> int | None:
  """The CPUs this process may run on (all of them where the OS does not say)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count()


def machine_info() -> dict:
  """Where the figures come from: OS, CPU, JAX devices and library versions."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
  devices = jax.devices()
  return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
          "usable_cpus": usable_cpus(), "backend": jax.default_backend(),
          "device_kind": devices[0].device_kind, "devices": [repr(d) for d in devices],
          "python": platform.python_version(), "jax": jax.__version__,
          "jaxlib": jaxlib.__version__, "flax": flax.__version__,
          "jaxdecode": jaxdecode.__version__,
          "transformers": _kernels._transformers_version()}  # pylint: disable=protected-access


def run_benchmarks(*, quick: bool = False, runs: int | None = None, decode: bool = True,
                   kernels: bool = True, beam: bool | None = None,
                   numerics: bool | None = None, spec: bool | None = None,
                   stream: bool | None = None, structured: bool | None = None,
                   scoring: bool | None = None, all_peers: bool = False,
                   batches: Sequence[int] | None = None, vocabs: Sequence[int] | None = None,
                   shapes: Sequence[str] = _kernels.SHAPES,
                   decode_models: Sequence[tuple[str, Callable[[], Any]]] | None = None,
                   beam_models: Sequence[tuple[str, Callable[[], Any]]] | None = None,
                   decode_batch: int = 8, max_new_tokens: int | None = None, command: str = "",
                   progress: Callable[[str], None] | None = None) -> dict:
  """Runs the tables; returns everything as one JSON-ready dict.

  Args:
    quick: the smaller grid (B=8, V in {32000, 128256}; 32 new tokens) and 10 runs by default.
    runs: timed runs per row (default 20, or 10 with `quick`).
    kernels, decode: include the kernel (and controls) table; the decode table.
    beam, numerics, spec, stream, structured, scoring: include the beam-search, numerics,
      speculative-decoding, streaming, structured-decoding and scoring tables (default, None:
      when the decode table is included).
    all_peers: time the sort-based peers at every size.
    batches, vocabs, shapes: the kernel table's B values, V values (default: by `quick`) and
      logit shapes.
    decode_models, beam_models: (name, loader) pairs for `decode_table` (default: its two
      models) and `beam_table` (default: the embedded model).
    decode_batch: prompts per decode (and beam search) call.
    max_new_tokens: tokens per decode and beam row (default 64, or 32 with `quick`).
    command: the command line, recorded in the result.
    progress: called with a line after each row.

  Returns:
    `{"command", "machine", "settings", "notes", "kernel", "decode", "beam", "numerics",
    "numerics_transformers", "speculative", "stream", "structured", "scoring"}`: the rows of
    each table (an empty list for a table left out), `settings["seconds"]` the total duration.
  """
  started = time.perf_counter()
  runs = runs or (QUICK_RUNS if quick else RUNS)
  on = lambda flag: decode if flag is None else flag  # pylint: disable=g-long-lambda
  run = dict(quick=quick, runs=runs, progress=progress,
             new_tokens=max_new_tokens or (32 if quick else 64))
  settings = _kernel_settings(quick, runs, batches, vocabs, shapes, all_peers)
  tables = {}
  for enabled, part, options in (
      (kernels, _kernel_part, {}), (decode, _decode_part, dict(models=decode_models)),
      (on(beam), _beam_part, dict(models=beam_models)), (on(numerics), _numerics_part, {}),
      (on(spec), _spec_part, {}), (on(stream), _stream_part, {}),
      (on(structured), _structured_part, {}), (on(scoring), _scoring_part, {})):
    tables.update(part(settings, run, decode_batch, **options) if enabled else
                  {key: [] for key in part.keys})
  settings["seconds"] = time.perf_counter() - started
  return {"command": command, "machine": machine_info(), "settings": settings,
          "notes": _notes(), **tables}


def _notes() -> list[str]:
  if _kernels.transformers_top_p_sampler() is None:
    return ["transformers (with its Flax generation code, transformers<5) is not installed: "
            "the transformers columns are skipped (pip install 'transformers<5')"]
  return []


def _kernel_settings(quick, runs, batches, vocabs, shapes, all_peers) -> dict:
  return {"quick": quick, "runs": runs, "warmup": WARMUP, "top_p": TOP_P,
          "kernel_params": _kernels.KERNEL_PARAMS, "control_params": _kernels.CONTROL_PARAMS,
          "batches": list(batches or (_kernels.QUICK_BATCHES if quick else BATCHES)),
          "vocabs": list(vocabs or (_kernels.QUICK_VOCABS if quick else _kernels.VOCABS)),
          "shapes": list(shapes),
          "peer_max_elements": None if all_peers else _kernels.PEER_MAX_ELEMENTS}


def _part(*keys: str):
  """Marks a table's runner with the result keys it fills (each `[]` when left out)."""
  def mark(fn):
    fn.keys = keys
    return fn
  return mark


@_part("kernel")
def _kernel_part(settings, run, batch):
  del batch
  return {"kernel": _kernels.kernel_table(
      batches=settings["batches"], vocabs=settings["vocabs"], shapes=settings["shapes"],
      runs=run["runs"], peer_max_elements=settings["peer_max_elements"],
      progress=run["progress"])}


@_part("decode")
def _decode_part(settings, run, batch, models):
  settings.update(decode_batch=batch, max_new_tokens=run["new_tokens"])
  return {"decode": _decode.decode_table(models, runs=run["runs"], batch=batch,
                                         max_new_tokens=run["new_tokens"],
                                         progress=run["progress"])}


@_part("beam")
def _beam_part(settings, run, batch, models):
  settings.update(decode_batch=batch, beam_size=_beam.BEAM_SIZE,
                  max_new_tokens=run["new_tokens"])
  return {"beam": _beam.beam_table(models, runs=run["runs"], batch=batch,
                                   max_new_tokens=run["new_tokens"], progress=run["progress"])}


@_part("numerics", "numerics_transformers")
def _numerics_part(settings, run, batch):
  del batch
  settings.update(numerics_batches=[1, 8] if run["quick"] else list(BATCHES),
                  max_new_tokens=run["new_tokens"])
  common = dict(runs=run["runs"], max_new_tokens=run["new_tokens"], progress=run["progress"])
  return {"numerics": _numerics.numerics_table(batches=settings["numerics_batches"], **common),
          "numerics_transformers": _numerics.transformers_numerics_table(
              batches=_numerics.HF_NUMERICS_BATCHES, **common)}


@_part("speculative")
def _spec_part(settings, run, batch):
  del batch
  settings.update(spec_batches=[1] if run["quick"] else [1, 8],
                  spec_ks=[4] if run["quick"] else [2, 4, 8], max_new_tokens=run["new_tokens"])
  return {"speculative": _speculative.spec_table(
      batches=settings["spec_batches"], ks=settings["spec_ks"], runs=run["runs"],
      max_new_tokens=run["new_tokens"], progress=run["progress"])}


@_part("stream")
def _stream_part(settings, run, batch):
  del batch
  settings.update(stream_batches=[1] if run["quick"] else [1, 8],
                  max_new_tokens=run["new_tokens"])
  return {"stream": _stream.stream_table(batches=settings["stream_batches"], runs=run["runs"],
                                         max_new_tokens=run["new_tokens"],
                                         progress=run["progress"])}


@_part("structured")
def _structured_part(settings, run, batch):
  del batch
  # The same sizes with --quick: the compile rows are timed once either way.
  settings.update(structured_batches=list(_structured.STRUCTURED_BATCHES),
                  structured_new_tokens=_structured.STRUCTURED_NEW_TOKENS,
                  structured_vocab=_structured.STRUCTURED_VOCAB)
  return {"structured": _structured.structured_table(
      batches=settings["structured_batches"], runs=run["runs"],
      max_new_tokens=_structured.STRUCTURED_NEW_TOKENS,
      vocab_size=_structured.STRUCTURED_VOCAB, progress=run["progress"])}


@_part("scoring")
def _scoring_part(settings, run, batch):
  del batch
  sizes = _scoring.QUICK if run["quick"] else _scoring.FULL
  runs = max(run["runs"], _scoring.SCORING_RUNS)
  settings.update(scoring_batches=list(sizes["batches"]),
                  scoring_new_tokens=sizes["max_new_tokens"], scoring_runs=runs)
  return {"scoring": _scoring.scoring_table(runs=runs, progress=run["progress"], **sizes)}


def format_table(result: Mapping) -> str:
  """The human-readable report of `run_benchmarks` (what `python -m jaxdecode.bench` prints)."""
  m = result["machine"]
  s = result["settings"]
  lines = [
      f"$ {result['command']}" if result.get("command") else "",
      f"machine: {m['platform']} | {m['cpu']} | {m['cpu_count']} CPUs ({m['usable_cpus']} usable)",
      f"jax {m['jax']} (jaxlib {m['jaxlib']}), flax {m['flax']}, transformers "
      f"{m['transformers'] or 'not installed'}, python {m['python']}, jaxdecode {m['jaxdecode']}",
      f"backend {m['backend']}, device kind {m['device_kind']}, "
      f"jax.devices() = [{', '.join(m['devices'])}]",
      f"{s['runs']} timed runs per row after {s['warmup']} warm-up calls, round-robin; medians; "
      f"total {s['seconds']:.0f} s",
      "",
  ]
  for module in TABLES:
    lines += module.format_tables(result)
  for note in result["notes"]:
    lines += textwrap.wrap(f"note: {note}", _table.WIDTH, subsequent_indent="  ")
  return "\n".join(lines).strip("\n") + "\n"
