"""Strict JAX for every test: implicit rank promotion raises, warnings are errors (pyproject);
XLA:CPU compiling faster (older element-wise emitters, LLVM at -O0, no FMA instructions); one
XLA compilation cache per test run, shared by its workers; compiled code dropped before a worker
runs out of memory mappings."""

import os
import platform
import shutil
import subprocess
import sys
import tempfile

import jax
import hypothesis
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# Tests call the command's `main` in their own processes: the command's own cache (opt-in by
# JAXDECODE_CACHE_DIR) stays off there even if the user's environment turns it on; subprocess
# tests that want it set their own JAXDECODE_CACHE_DIR.
os.environ["JAXDECODE_CACHE_DIR"] = ""

# Most of the suite's time is XLA compiling, and different tests (in both workers, and the
# processes they start) compile many identical programs. A run therefore shares one persistent
# compilation cache, in a folder of its own that starts empty (a user's cache is never read or
# written) and is removed at the end; every program is cached. An identical program is the same
# executable, so no test sees other bits. JAXDECODE_TEST_XLA_CACHE=off compiles everything.
_CACHE_ENV = "JAXDECODE_TEST_XLA_CACHE"


def _use_cache(path: str) -> None:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = path  # for the processes tests start
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# XLA compiling is most of the suite's time: 70% of the fast loop's CPU time (433 of 616 s,
# measured per test). The suite therefore has XLA:CPU compile faster than it does by default:
# with its older element-wise emitters, LLVM at -O0, and (x86) no instruction past AVX. Measured
# the whole suite, 2 workers: 1,774 s with the emitters and -O1, 1,295 s with these flags; the
# emitters alone took test_decoding's fast tests from 75 to 56 s of CPU.
# Why AVX: at -O0 XLA:CPU still writes fused multiply-adds where its own math functions use them
# (vfmadd in the `exp` and `log` kernels of a -O0 program's object code), but it
# contracts no plain multiply and add (`jit(a * b + c)` with a = b = 1 + 2**-12,
# c = -(1 + 2**-11): 0 at -O0, 2**-24 at -O1, -O2 and the defaults, which contract). So two
# programs that compute the same arithmetic in different kernels (a decode step and the full
# forward; the CPU and GPU formulations of a decode) then differ in last bits: measured, 7 tests
# fail at -O0 on an AVX2 machine. AVX has no FMA instruction at all, so under it every multiply
# and add rounds twice in every program alike, and the whole suite passes.
# Every bitwise assertion compares programs compiled with the same flags (or, for RUNS_LONG
# below, at another LLVM level under the same cap, which changes no arithmetic: with no FMA
# instruction to contract into and no fast-math, LLVM keeps every IEEE operation and its
# order at every level). XLA's default code generation stays under test all the same:
# tests/test_invariance.py runs the construction's tests and the step-against-forward tests
# again under it, and its tests of older instruction sets start processes with XLA's
# defaults (capped at AVX2, SSE4.2). Processes started with 8 host devices compile as the run
# does (`xla_flags`).
# JAXDECODE_TEST_XLA_FLAGS=default compiles with XLA's defaults throughout.
_FLAGS_ENV = "JAXDECODE_TEST_XLA_FLAGS"
_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_O1 = (_EMITTERS, "--xla_backend_optimization_level=1")
_O0_NO_FMA = (_EMITTERS, "--xla_backend_optimization_level=0", "--xla_cpu_max_isa=AVX")
# The first set this XLA takes (elsewhere than x86 there is no AVX cap, so FMA everywhere: -O1).
_CANDIDATES = (_O0_NO_FMA, _O1) if platform.machine().lower() in ("x86_64", "amd64") else (_O1,)
_FAST_COMPILE = tuple(dict.fromkeys(f for c in _CANDIDATES for f in c))  # what a run may add


# The few programs that run long rather than compile long (thousands of rows, or a 32k
# vocabulary, for many steps) are compiled with LLVM's optimizations all the same, through
# `jax.jit(..., compiler_options=RUNS_LONG)`: the AVX cap stays (no FMA), so they round as the
# rest of the suite does. Measured on 2 cores, the structured batch (4,292 rows x 64 steps):
# at -O0 compiled in 5 s and ran in 32-38 s, at -O2 compiled in 8 s and ran in 4-6 s, the
# same tokens (another test's run beside it).
RUNS_LONG = {"xla_backend_optimization_level": 2}


def _fast_compile_flags() -> str:
  """XLA_FLAGS with the first of `_CANDIDATES` that this XLA takes added, or unchanged where it
  takes none (an unknown flag aborts the process that starts a backend, so a child process
  tries each first)."""
  for candidate in _CANDIDATES:
    flags = xla_flags(*candidate)
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0)"],
                           env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
                           capture_output=True, timeout=120, check=False)
    if probe.returncode == 0:
      return flags
  return os.environ.get("XLA_FLAGS", "")


def xla_flags(*extra: str) -> str:
  """This run's XLA_FLAGS with `extra` added, for a process a test starts (e.g. with 8 host
  devices): it compiles as the run does; tests about code generation set their own."""
  return " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()


def pytest_configure(config):
  """The controller sets the run's compiler flags and makes its cache folder before the workers
  start (they inherit both; no backend has started in any process yet)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if (not hasattr(config, "workerinput") and os.environ.get(_FLAGS_ENV) != "default"
      and _EMITTERS not in flags):  # (a run started by a test inherits the flags)
    os.environ["XLA_FLAGS"] = _fast_compile_flags()
  setting = os.environ.get(_CACHE_ENV, "")
  if setting == "off":
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    jax.config.update("jax_compilation_cache_dir", None)
    return
  if not hasattr(config, "workerinput"):  # the controller, or a run without workers
    setting = tempfile.mkdtemp(prefix="jaxdecode-test-xla-cache-")
    os.environ[_CACHE_ENV] = setting
    config.add_cleanup(lambda: shutil.rmtree(setting, ignore_errors=True))
  _use_cache(setting)

# jit compiles on first use, so wall-clock deadlines would only measure the compiler.
hypothesis.settings.register_profile("jaxdecode", deadline=None, max_examples=40,
                                     derandomize=True, print_blob=True)
hypothesis.settings.load_profile("jaxdecode")


# Every executable XLA:CPU compiles keeps about three memory mappings until it is freed, and one
# test worker compiles some 20,000 programs (hypothesis draws new shapes), so a worker used to reach
# Linux's limit of 65,530 mappings (vm.max_map_count) near the end of the suite; the next mmap
# inside LLVM then failed and the worker died with a segmentation fault in `backend_compile`.
# Dropping jax's caches when a worker holds half that many keeps it far from the limit; tests
# only pay for recompiling what they use next.
_MAPS = "/proc/self/maps"
_MAX_MAPS = 30_000


def _mappings() -> int:
  with open(_MAPS, "rb") as f:
    return f.read().count(b"\n")


@pytest.fixture(autouse=True)
def _bounded_mappings():
  yield
  if os.path.exists(_MAPS) and _mappings() > _MAX_MAPS:
    jax.clear_caches()
