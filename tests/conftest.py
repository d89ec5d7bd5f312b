"""Strict JAX for every test: implicit rank promotion raises, warnings are errors (pyproject);
no persistent compilation cache in test processes."""

import os

import jax
import hypothesis

jax.config.update("jax_numpy_rank_promotion", "raise")

# Tests call the command's `main` in their own processes: keep XLA's persistent compilation cache
# off there even if the user's environment turns it on (writing some executables to it crashed a
# worker); subprocess tests that want it set their own JAXDECODE_CACHE_DIR.
os.environ["JAXDECODE_CACHE_DIR"] = ""

# jit compiles on first use, so wall-clock deadlines would only measure the compiler.
hypothesis.settings.register_profile("jaxdecode", deadline=None, max_examples=40,
                                     derandomize=True, print_blob=True)
hypothesis.settings.load_profile("jaxdecode")
