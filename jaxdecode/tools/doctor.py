"""What holds on this machine (`jaxdecode doctor`): backend, the bitwise promise, costs, structure.

One command for "does this hold here?", on a laptop, a Colab TPU or GPU, or a test machine:

1. machine: `jax.default_backend()`, the devices (kind and count), the versions of python, jax,
   jaxlib, flax and jaxdecode, the CPU model and, on the CPU backend, its ISA flags (AVX-512...).
2. bitwise promise: the invariance audit of `jaxdecode audit` (`jaxdecode.invariance.audit`) on
   the embedded model, in its batch-invariant numerics and in plain XLA: a prompt decoded
   greedily alone and inside random batches, compared bit for bit.
3. sampler cost: `jaxdecode.sample` time over `jnp.argmax` time under `jit` on the same "lm"
   logits (the benchmark's protocol and code: `jaxdecode.tools.bench`), at [8, 128256]
   ([8, 32000] with --quick).
4. decode: tokens/s of `jaxdecode.decode` with top-p 0.9 over greedy on the embedded model
   (measured as `bench.decode_row` does).
5. structure, for this backend's lowering platform (cpu, cuda, rocm or tpu):
   `invariance.unordered_sums` of the batch-invariant decode step and of the sampling chain, and
   `invariance.host_round_trips` of `jaxdecode.sample` and of a decode of the embedded model.

The last line is a one-line verdict. `--quick` takes about a minute on 2 CPU cores; the full run
a few minutes on a GPU. The exit status is 0 when every section ran (whatever it found), 1 when
one failed (its error is printed in its place), 2 for a bad command line.
"""

# The benchmark's helpers (`bench._medians`, `_runs`, `_finite`) are this package's own: the
# doctor measures with the benchmark's code (`bench.kernel_fns`, `bench.decode_row`).
# pylint: disable=protected-access

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx

import jaxdecode
from jaxdecode import _files
from jaxdecode import invariance
from jaxdecode import models
from jaxdecode.params import SamplingParams
from jaxdecode.prompts import bucket_length
from jaxdecode.tools import bench
from jaxdecode.tools.bench import _table as bench_table
from jaxdecode.tools._args import OneLineParser, positive_int
from jaxdecode.tools._args import seed as seed_type

# Every default, by mode. The audit's prompts are cut from the pydoc topics (as `jaxdecode audit`
# does), `prompt_bytes` long: --quick keeps them in one padding bucket (16), so that only the
# batch size changes from mix to mix and fewer programs compile.
FULL = dict(mixes=12, steps=32, max_batch=8, prompt_bytes=(3, 60), logits=(8, 128256),
            decode=(8, 64), runs=bench.RUNS)
QUICK = dict(mixes=4, steps=16, max_batch=3, prompt_bytes=(8, 15), logits=(8, 32000),
             decode=(8, 16), runs=bench.QUICK_RUNS)
KERNELS = ("greedy", "sample", "top_p", "chain")  # timed against argmax (bench.KERNEL_PARAMS)
SHOWN = 3  # lines shown per structural finding
ISA_FLAGS = {  # what /proc/cpuinfo may list that XLA:CPU's kernels use
    "x86": ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"),
    "arm": ("asimd", "sve", "sve2", "bf16", "i8mm"),
}


# ---------------------------------------------------------------------------------------------
# The sections.


def lowering_platform(backend: str | None = None) -> str | None:
  """The `jax.export` platform of a backend: cpu, cuda, rocm or tpu (None: none known)."""
  backend = backend or jax.default_backend()
  if backend == "gpu":
    try:
      version = str(jax.devices()[0].client.platform_version).lower()
    except Exception:  # pylint: disable=broad-except  # an old or unusual runtime
      version = ""
    return "rocm" if "rocm" in version else "cuda"
  return backend if backend in ("cpu", "cuda", "rocm", "tpu") else None


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
  """`{"model": name, "arch": "x86" | "arm" | None, "isa": {flag: bool}}` from /proc/cpuinfo
  (the flags of `ISA_FLAGS` for the architecture; empty where the file cannot be read)."""
  model, flags, arch = None, set(), None
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      for line in f:  # the first processor's lines are enough
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "Model name") and model is None:
          model = value.strip() or None
        elif name == "flags" and not flags:
          flags, arch = set(value.split()), "x86"
        elif name == "Features" and not flags:
          flags, arch = set(value.split()), "arm"
  except OSError:
    pass
  isa = {flag: flag in flags for flag in ISA_FLAGS.get(arch, ())}
  model = model or platform.processor() or platform.machine() or "unknown"
  return {"model": model, "arch": arch, "isa": isa}


def machine() -> dict:
  """The backend, devices, versions, CPU and the lowering platform of this machine."""
  devices = jax.devices()
  backend = jax.default_backend()
  return {"backend": backend, "lowering_platform": lowering_platform(backend),
          "device_kinds": sorted({d.device_kind for d in devices}),
          "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
          "process_count": jax.process_count(), "devices": [repr(d) for d in devices[:8]],
          "os": platform.platform(), "cpu": cpu_info(), "cpu_count": os.cpu_count(),
          "usable_cpus": bench.usable_cpus(), "python": platform.python_version(),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
          "jaxdecode": jaxdecode.__version__}


def audit_prompts(count: int, seed: int, low: int = 3, high: int = 120) -> list:
  """`count` byte prompts of `low..high` bytes after BOS, cut from the pydoc topics; with the
  defaults, the prompts of `jaxdecode audit` (`cli.audit_prompts`)."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  text = " ".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
  rng = np.random.default_rng(seed)
  prompts = []
  for _ in range(count):
    n = int(rng.integers(low, high + 1))
    start = int(rng.integers(0, len(text) - n))
    prompts.append([models.ByteTokenizer.BOS] + list(text[start:start + n]))
  return prompts


def run_audit(load: Callable[[bool], Any], prompts: Sequence, *, mixes: int, steps: int,
              max_batch: int, seed: int = 0) -> dict:
  """`jaxdecode audit` in both numerics modes: per mode, mixes, divergent (logits differ in
  some bit), flipped (a greedy token changed) and the largest |logit difference|."""
  modes = []
  for invariant in (True, False):
    model = load(invariant)
    step_fn = models.make_step_fn(nnx.graphdef(model))
    report = invariance.audit(models.batch_prefill(model, extra=steps), step_fn, prompts,
                              steps=steps, mixes=mixes, max_batch=max_batch, seed=seed)
    worst = max(m.max_abs_diff for m in report.mixes)
    modes.append({"name": "batch-invariant" if invariant else "plain XLA", "mixes": mixes,
                  "divergent": report.divergent, "flipped": report.flipped,
                  "max_abs_diff": float(worst)})
  return {"steps": steps, "max_batch": max_batch, "prompts": len(prompts), "modes": modes}


def run_kernels(batch: int, vocab: int, *, runs: int, seed: int = 0) -> dict:
  """Sampler time over argmax time on the benchmark's "lm" logits [batch, vocab], timed by the
  benchmark's code (`bench.kernel_fns`, round robin after warm-up, medians), for `KERNELS` only."""
  logits = bench.make_logits("lm", batch, vocab, seed)
  fns = bench.kernel_fns(logits, jax.random.key(seed), KERNELS)
  medians = bench._medians(bench.time_round_robin(fns, runs))
  return {"shape": "lm", "batch": batch, "vocab": vocab, "runs": runs,
          "argmax_ms": medians["argmax"] * 1e3,
          "ratio": {name: medians[name] / medians["argmax"] for name in KERNELS}}


def run_decode(model, *, batch: int, max_new_tokens: int, runs: int, seed: int = 0) -> dict:
  """Tokens/s of `jaxdecode.decode` with top-p 0.9 over greedy on one model, and the first call
  (compilation) over a later one: `bench.decode_row` without its EOS-stop program (one
  compilation less), reporting `batch`, `max_new_tokens`, `runs`, `first_call_s`, `median_s`,
  `tokens_per_s` and `ratio`."""
  row = bench.decode_row("", model, runs=runs, batch=batch, max_new_tokens=max_new_tokens,
                         seed=seed, early_stop=False)
  return {key: row[key] for key in ("batch", "max_new_tokens", "runs", "first_call_s",
                                    "median_s", "tokens_per_s", "ratio")}


def _chain_params(batch: int) -> SamplingParams:
  """Every processor on, as in tests/test_structure.py (rows cycle through four settings)."""
  rows = [dict(temperature=0.0, banned=[3], bias={5: 1.0}),
          dict(temperature=1.0, top_p=0.9, typical_p=0.8, repetition_penalty=1.2,
               frequency_penalty=0.5),
          dict(temperature=0.7, top_k=40, top_p=0.5, min_p=0.1, epsilon_cutoff=1e-4,
               banned=[7, 8], bias={9: -2.0}),
          dict(temperature=1.3, top_k=5, eta_cutoff=1e-3)]
  rows = [rows[b % len(rows)] for b in range(batch)]
  field = lambda name, off, dtype: np.array([r.get(name, off) for r in rows], dtype)
  return SamplingParams(
      temperature=field("temperature", 1.0, np.float32), top_k=field("top_k", 0, np.int32),
      top_p=field("top_p", 1.0, np.float32), min_p=field("min_p", 0.0, np.float32),
      typical_p=field("typical_p", 1.0, np.float32),
      epsilon_cutoff=field("epsilon_cutoff", 0.0, np.float32),
      eta_cutoff=field("eta_cutoff", 0.0, np.float32),
      repetition_penalty=field("repetition_penalty", 1.0, np.float32),
      frequency_penalty=field("frequency_penalty", 0.0, np.float32),
      banned_token_ids=[r.get("banned", []) for r in rows],
      logit_bias=[r.get("bias", {}) for r in rows])


def run_structure(model, target: str, *, logits_shape: tuple[int, int],
                  decode_shape: tuple[int, int]) -> dict:
  """The structural checks, lowered for `target` (nothing is compiled or run).

  Returns:
    `{"platform", "checks": [{"name", "check", "found": [lines]}]}` for: unordered sums of the
    batch-invariant decode step and of the sampling chain; host round trips of
    `jaxdecode.sample` (temperature 0.8, top-k 50, top-p 0.9, min-p 0.05, traced) at
    `logits_shape` and of a decode (the same settings, EOS stop) of the model at `decode_shape`.
  """
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  if not model.config.batch_invariant:
    raise ValueError("the structural checks need the batch-invariant model")
  graphdef, weights = nnx.split(model)
  step_fn = models.make_step_fn(graphdef)
  batch, new_tokens = decode_shape
  width = bucket_length(12)  # the decode bench's prompts: 3..12 tokens
  cache_length = min(width + new_tokens, model.config.max_len)
  # The decode state's shapes, without running the prefill.
  _, state = jax.eval_shape(lambda t, n: models.prefill(graphdef, weights, t, n,
                                                        cache_length=cache_length),
                            i32(batch, width), i32(batch))
  vocab = model.config.vocab_size
  key = jax.random.key(0)
  chain = SamplingParams(**bench.KERNEL_PARAMS["chain"])
  tok = models.ByteTokenizer
  checks = []

  def check(name, kind, fn, *args):
    lister = invariance.unordered_sums if kind == "unordered sums" else \
        invariance.host_round_trips
    checks.append({"name": name, "check": kind,
                   "found": lister(fn, *args, platform=target)})

  check("invariant decode step", "unordered sums", step_fn, state, i32(batch), i32(batch))
  chain_batch, chain_vocab = 4, max(vocab, 16)
  all_on = _chain_params(chain_batch)
  check("sampling chain (every processor, draw, log-prob)", "unordered sums",
        lambda k, x, c: jaxdecode.sample_with_logprobs(
            k, jaxdecode.process_logits(x, all_on, counts=c),
            SamplingParams(temperature=all_on.temperature)),
        key, f32(chain_batch, chain_vocab), i32(chain_batch, chain_vocab))
  check(f"jaxdecode.sample [{logits_shape[0]}, {logits_shape[1]}]", "host round trips",
        lambda k, x, p: jaxdecode.sample(k, x, p), key, f32(*logits_shape), chain)
  check(f"decode of the model (B={batch}, {new_tokens} tokens, EOS stop)", "host round trips",
        lambda s, x, k, p, pos: jaxdecode.decode(
            step_fn, s, x, key=k, params=p, max_new_tokens=new_tokens, positions=pos,
            eos_ids=(tok.EOS,), pad_id=tok.PAD).tokens,
        state, f32(batch, vocab), key, chain, i32(batch))
  return {"platform": target, "checks": checks}


# ---------------------------------------------------------------------------------------------
# The report.


_ratio = bench_table.ratio


def _failed(section: Mapping) -> list:
  return [f"  failed: {section['error']}"]


def format_machine(m: Mapping) -> str:
  kinds = ", ".join(m["device_kinds"])
  processes = f" in {m['process_count']} processes" if m["process_count"] > 1 else ""
  lines = ["machine",
           f"  backend    {m['backend']} (lowering platform {m['lowering_platform'] or 'none'}); "
           f"{m['device_count']} device(s){processes}: {kinds}",
           f"  devices    {', '.join(m['devices'])}"
           + (" ..." if m["device_count"] > len(m["devices"]) else ""),
           f"  cpu        {m['cpu']['model']}, {m['cpu_count']} CPUs ({m['usable_cpus']} usable)"]
  if m["backend"] == "cpu":
    isa = m["cpu"]["isa"]
    lines.append("  isa        " + (", ".join(f"{k} {'yes' if v else 'no'}" for k, v in isa.items())
                                     or "unknown (no /proc/cpuinfo flags)"))
  lines.append(f"  versions   python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, "
               f"flax {m['flax']}, jaxdecode {m['jaxdecode']}")
  return "\n".join(lines)


def format_audit(a: Mapping) -> str:
  title = "bitwise promise (jaxdecode audit)"
  if "error" in a:
    return "\n".join([title] + _failed(a))
  modes = a["modes"]
  lines = [f"bitwise promise (jaxdecode audit): {modes[0]['mixes']} random mixes per mode "
           f"(batches of 2..{a['max_batch']}, random slots and partners), {a['steps']} greedy "
           f"steps, {a['seconds']:.0f} s",
           f"  {'numerics':<16} {'mixes':>5} {'logits differ':>13} {'tokens flip':>11} "
           f"{'max |diff|':>10}"]
  for m in modes:
    lines.append(f"  {m['name']:<16} {m['mixes']:>5} {m['divergent']:>13} {m['flipped']:>11} "
                 f"{m['max_abs_diff']:>10.3g}")
  inv = modes[0]
  lines.append("  the batch-invariant mode gives a prompt the same bits alone and in every mix: "
               "the promise holds here" if not inv["divergent"] else
               "  the batch-invariant mode diverged: its promise does not hold here; please "
               "report it with this output")
  return "\n".join(lines)


def format_kernels(k: Mapping) -> str:
  title = "sampler cost (time / argmax time under jit)"
  if "error" in k:
    return "\n".join([title] + _failed(k))
  r = k["ratio"]
  return "\n".join([
      f"{title}: lm logits [{k['batch']}, {k['vocab']}], {k['runs']} runs, medians, "
      f"{k['seconds']:.0f} s",
      f"  {'argmax ms':>9} {'greedy':>6} {'sample':>6} {'top-p':>6} {'chain':>6}",
      f"  {k['argmax_ms']:>9.3f} " + " ".join(f"{_ratio(r[n]):>6}" for n in KERNELS),
      "  sample = T 1; top-p 0.9; chain = T 0.8 + top-k 50 + top-p 0.9 + min-p 0.05 "
      "(lower is cheaper; 1.00 = argmax's cost)"])


def format_decode(d: Mapping) -> str:
  title = "decode (jaxdecode.decode)"
  if "error" in d:
    return "\n".join([title] + _failed(d))
  t, r = d["tokens_per_s"], d["ratio"]
  return "\n".join([
      f"decode (jaxdecode.decode, {d.get('model', 'embedded model')}): batch {d['batch']}, "
      f"{d['max_new_tokens']} new tokens, {d['runs']} runs, medians, {d['seconds']:.0f} s",
      f"  {'greedy tok/s':>12} {'top-p tok/s':>11} {'top-p/greedy':>12} {'first call s':>12}",
      f"  {t['greedy']:>12.0f} {t['top_p']:>11.0f} {_ratio(r['top_p_vs_greedy']):>12} "
      f"{d['first_call_s']:>12.1f}",
      "  top-p/greedy: tokens/s with top-p 0.9 over greedy (1.00 = sampling costs nothing); "
      "first call: compilation included"])


_PLATFORM_NOTES = {
    "cpu": "on XLA:CPU a branch that skips work pays: data-dependent branches are by design "
           "here; the cuda lowering is the one that must wait on the host for nothing",
    "tpu": "on TPU branches run on the device: data-dependent branches cost no host round trip",
    "cuda": "XLA:GPU reads each listed branch index or loop predicate back to the host "
            "(one early-exit loop per decode program is by design)",
    "rocm": "XLA:GPU reads each listed branch index or loop predicate back to the host "
            "(one early-exit loop per decode program is by design)",
}


def format_structure(s: Mapping) -> str:
  if "error" in s or "skipped" in s:
    title = "structure"
    return "\n".join([title] + (_failed(s) if "error" in s else [f"  skipped: {s['skipped']}"]))
  lines = [f"structure (lowered for {s['platform']}, nothing run), {s['seconds']:.0f} s"]
  for c in s["checks"]:
    lines.append(f"  {c['check']}, {c['name']}: {len(c['found'])}")
    lines += [f"      {line}" for line in c["found"][:SHOWN]]
    if len(c["found"]) > SHOWN:
      lines.append(f"      ... and {len(c['found']) - SHOWN} more")
  note = _PLATFORM_NOTES.get(s["platform"])
  if note:
    lines.append(f"  note: {note}")
  return "\n".join(lines)


SECTIONS = (("machine", format_machine), ("audit", format_audit), ("kernels", format_kernels),
            ("decode", format_decode), ("structure", format_structure))


def verdict(result: Mapping) -> str:
  """The one-line verdict: the promise, the costs, the structure."""
  parts = []
  a = result.get("audit")
  if a is None or "error" in a:
    parts.append("bitwise promise not checked (the audit failed)")
  else:
    inv, plain = a["modes"]
    if inv["divergent"]:
      parts.append(f"bitwise promise does NOT hold here ({inv['divergent']}/{inv['mixes']} mixes "
                   f"diverge, {inv['flipped']} flip a token; please report it)")
    else:
      parts.append(f"bitwise promise holds here (0/{inv['mixes']} mixes diverge; plain XLA "
                   f"{plain['divergent']}/{plain['mixes']})")
  k = result.get("kernels")
  if k is not None and "error" not in k:
    parts.append(f"sampler cost top-p {_ratio(k['ratio']['top_p'])}x, chain "
                 f"{_ratio(k['ratio']['chain'])}x argmax at [{k['batch']}, {k['vocab']}]")
  d = result.get("decode")
  if d is not None and "error" not in d:
    parts.append(f"decode tokens/s top-p/greedy {_ratio(d['ratio']['top_p_vs_greedy'])}")
  s = result.get("structure")
  if s is not None and "checks" in s:
    sums = sum(len(c["found"]) for c in s["checks"] if c["check"] == "unordered sums")
    trips = ", ".join(f"{c['name'].split(' ')[0].replace('jaxdecode.', '')} {len(c['found'])}"
                      for c in s["checks"] if c["check"] == "host round trips")
    parts.append(f"structure ({s['platform']}): {sums} unordered sums; host round trips: {trips}")
  elif s is not None and "skipped" in s:
    parts.append("structure not checked (no lowering platform for this backend)")
  failed = [name for name, section in result.items()
            if isinstance(section, Mapping) and "error" in section]
  if failed:
    parts.append(f"failed: {', '.join(failed)}")
  return "verdict: " + "; ".join(parts)


def format_report(result: Mapping) -> str:
  """The whole text report (what `jaxdecode doctor` prints), the verdict last."""
  lines = [f"$ {result['command']}"] if result.get("command") else []
  for name, render in SECTIONS:
    if name in result:
      lines += [render(result[name]), ""]
  return "\n".join(lines + [verdict(result)]) + "\n"


# ---------------------------------------------------------------------------------------------
# The run.


def settings_for(args: argparse.Namespace) -> dict:
  """The run's settings: the flags given, the rest from `QUICK` or `FULL`."""
  preset = QUICK if args.quick else FULL
  out = {name: getattr(args, name, None) for name in ("mixes", "steps", "max_batch", "runs",
                                                      "logits", "decode")}
  out = {k: preset[k] if v is None else v for k, v in out.items()}
  out.update(quick=args.quick, prompt_bytes=preset["prompt_bytes"], seed=args.seed,
             model=args.model)
  return out


def _section(result: dict, name: str, fn: Callable[[], dict], emit: Callable[[str], None],
             render: Callable[[Mapping], str]) -> None:
  """Runs one section into `result[name]` (its error, if it fails), timed, and emits it."""
  started = time.perf_counter()
  try:
    section = fn()
  except (KeyboardInterrupt, SystemExit):
    raise
  except Exception as e:  # pylint: disable=broad-except  # a doctor reports and goes on
    section = {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]}
  section["seconds"] = time.perf_counter() - started
  result[name] = section
  emit(render(section) + "\n")


def run(settings: Mapping, *, command: str = "", emit: Callable[[str], None] | None = None,
        load: Callable[[bool], Any] | None = None) -> dict:
  """Runs every section; returns the JSON-ready result (`format_report` renders it).

  Args:
    settings: from `settings_for` (mixes, steps, max_batch, runs, logits (B, V), decode (B, N),
      prompt_bytes, seed, model, quick).
    command: the command line, recorded.
    emit: called with each section's text as soon as it is done (None: quiet).
    load: `load(batch_invariant) -> Transformer` (default: the embedded model, or the checkpoint
      `settings["model"]`).

  Raises:
    ValueError: for settings that cannot run (checked before anything long starts).
  """
  emit = emit or (lambda text: None)
  path = settings.get("model")
  load = load or _loader(path)
  prompts, model = _checked(settings, load)
  decode_batch, new_tokens = settings["decode"]
  started = time.perf_counter()
  result = {"command": command, "settings": dict(settings)}
  if command:
    emit(f"$ {command}")
  _section(result, "machine", machine, emit, format_machine)
  _section(result, "audit", lambda: run_audit(
      load, prompts, mixes=settings["mixes"], steps=settings["steps"],
      max_batch=settings["max_batch"], seed=settings["seed"]), emit, format_audit)
  batch, vocab = settings["logits"]
  _section(result, "kernels", lambda: run_kernels(batch, vocab, runs=settings["runs"],
                                                  seed=settings["seed"]), emit, format_kernels)
  name = "embedded model" if path is None else os.path.basename(path)
  _section(result, "decode", lambda: dict(run_decode(
      model, batch=decode_batch, max_new_tokens=new_tokens, runs=settings["runs"],
      seed=settings["seed"]), model=name),
           emit, format_decode)
  target = result["machine"].get("lowering_platform") or lowering_platform()

  def structure():
    if target is None:
      return {"skipped": f"no lowering platform is known for the backend "
                         f"{jax.default_backend()!r} (cpu, cuda, rocm and tpu are)"}
    return run_structure(model, target, logits_shape=(batch, vocab),
                         decode_shape=(decode_batch, new_tokens))

  _section(result, "structure", structure, emit, format_structure)
  result["seconds"] = time.perf_counter() - started
  result["verdict"] = verdict(result)
  return result


def _loader(path: str | None) -> Callable[[bool], Any]:
  """`load(batch_invariant) -> Transformer`: the embedded model, or the checkpoint at `path`
  (checked to be readable now)."""
  if path is None:
    return lambda invariant: models.load_default(batch_invariant=invariant)[0]
  _files.read_input(path, "checkpoint")
  return lambda invariant: models.load_checkpoint(path, batch_invariant=invariant)[0]


def _checked(settings: Mapping, load: Callable[[bool], Any]) -> tuple[list, Any]:
  """`(the audit's prompts, the batch-invariant model)`, after checking that the settings fit
  the model (ValueError naming the flag otherwise)."""
  if settings["max_batch"] < 2:
    raise ValueError(f"--max-batch must be at least 2 (a needle and a partner); got "
                     f"{settings['max_batch']}")
  low, high = settings["prompt_bytes"]
  prompts = audit_prompts(max(8, settings["max_batch"]), settings["seed"], low, high)
  model = load(True)
  context = model.config.max_len
  width = bucket_length(max(len(p) for p in prompts))
  if width + settings["steps"] > context:
    hint = (f"use --steps {context - width} or fewer" if context > width else
            "use a model with a longer context")
    raise ValueError(f"--steps {settings['steps']} does not fit: the audit's prompts take up to "
                     f"{width} tokens (padded) of the model's context of {context}; {hint}")
  decode_batch, new_tokens = settings["decode"]
  decode_width = bucket_length(12)
  if decode_width + new_tokens > context:
    raise ValueError(f"--decode {decode_batch}x{new_tokens} does not fit: prompts of up to "
                     f"{decode_width} tokens (padded) and {new_tokens} new tokens exceed the "
                     f"model's context of {context}")
  return prompts, model


# ---------------------------------------------------------------------------------------------
# Command line.


def _shape(text: str, name: str = "BxN") -> tuple[int, int]:
  """`BxN` (e.g. 8x128256): two positive integers."""
  parts = text.lower().split("x")
  try:
    values = tuple(int(p) for p in parts)
  except ValueError:
    values = ()
  if len(values) != 2 or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected {name} with positive integers (e.g. 8x16), got "
                                     f"{text!r}")
  return values


def _logits(text: str) -> tuple[int, int]:
  batch, vocab = _shape(text, "BxV")
  if vocab < 2:
    raise argparse.ArgumentTypeError(f"the vocabulary needs at least 2 tokens, got {text!r}")
  return batch, vocab


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The command's flags (shared by `jaxdecode doctor` and `python -m jaxdecode.tools.doctor`)."""
  q, f = QUICK, FULL
  parser.add_argument("--quick", action="store_true",
                      help="smaller audit, shapes and runs: about a minute on 2 CPU cores")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON object (every section's figures and the verdict)")
  parser.add_argument("--model", default=None,
                      help="a checkpoint from `jaxdecode train` (default: the embedded model)")
  parser.add_argument("--mixes", type=positive_int, default=None,
                      help=f"audit: random batches per numerics mode (default {f['mixes']}; "
                           f"--quick {q['mixes']})")
  parser.add_argument("--steps", type=positive_int, default=None,
                      help=f"audit: greedy steps per run (default {f['steps']}; --quick "
                           f"{q['steps']})")
  parser.add_argument("--max-batch", type=positive_int, default=None,
                      help=f"audit: the largest batch of a mix, at least 2 (default "
                           f"{f['max_batch']}; --quick {q['max_batch']})")
  parser.add_argument("--runs", type=bench._runs, default=None,
                      help=f"timed runs per figure, at least {bench.MIN_RUNS} (default "
                           f"{f['runs']}; --quick {q['runs']})")
  parser.add_argument("--logits", type=_logits, default=None, metavar="BxV",
                      help=f"sampler cost: the logits' shape (default "
                           f"{'x'.join(map(str, f['logits']))}; --quick "
                           f"{'x'.join(map(str, q['logits']))})")
  parser.add_argument("--decode", type=_shape, default=None, metavar="BxN",
                      help=f"decode: batch and new tokens (default "
                           f"{'x'.join(map(str, f['decode']))}; --quick "
                           f"{'x'.join(map(str, q['decode']))})")
  parser.add_argument("--seed", type=seed_type, default=0, help="the audit's mixes and the logits")


def _flags(args: argparse.Namespace) -> list:
  """The flags of parsed arguments, as a command line would give them."""
  out = ["--quick"] if args.quick else []
  out += ["--json"] if args.json else []
  for name in ("model", "mixes", "steps", "max_batch", "runs", "logits", "decode"):
    value = getattr(args, name)
    if value is not None:
      text = "x".join(map(str, value)) if isinstance(value, tuple) else str(value)
      out += [f"--{name.replace('_', '-')}", text]
  return out + (["--seed", str(args.seed)] if args.seed else [])


def run_command(args: argparse.Namespace, *, prog: str = "jaxdecode doctor") -> int:
  """Runs the doctor for parsed flags: the report (or `--json`'s object), the verdict last.

  Returns:
    0 when every section ran, 1 when one failed (its error is in the report).
  """
  command = f"{prog} {shlex.join(_flags(args))}".strip()
  if args.json:
    def progress(text):
      first = text.strip().splitlines()[0] if text.strip() else ""
      print(f"[doctor] {first}", file=sys.stderr, flush=True)
    result = run(settings_for(args), command=command, emit=progress)
    print(json.dumps(bench._finite(result), allow_nan=False))
  else:
    result = run(settings_for(args), command=command,
                 emit=lambda text: print(text, flush=True))
    print(result["verdict"], flush=True)
  return 1 if any(isinstance(s, Mapping) and "error" in s for s in result.values()) else 0


def build_parser(prog: str = "jaxdecode doctor") -> argparse.ArgumentParser:
  parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
  add_arguments(parser)
  return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "jaxdecode doctor") -> int:
  """`jaxdecode doctor [flags]` from Python (e.g. `doctor.main(["--quick"])` in a notebook):
  prints the report, returns the exit status (2 with one error line for a bad command line)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    args = build_parser(prog).parse_args(argv)
  except SystemExit as e:  # --help (0) or a bad command line (2, already reported)
    return int(e.code or 0)
  try:
    return run_command(args, prog=prog)
  except (ValueError, OSError, OverflowError) as e:
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main(prog="python -m jaxdecode.tools.doctor"))
