"""Strict JAX for every test: implicit rank promotion raises, warnings are errors (pyproject);
no persistent compilation cache in test processes; compiled code dropped before a worker runs out
of memory mappings."""

import os

import jax
import hypothesis
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# Tests call the command's `main` in their own processes: keep XLA's persistent compilation cache
# off there even if the user's environment turns it on (writing some executables to it crashed a
# worker); subprocess tests that want it set their own JAXDECODE_CACHE_DIR.
os.environ["JAXDECODE_CACHE_DIR"] = ""

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
