"""Strict JAX for every test: implicit rank promotion raises, warnings are errors (pyproject)."""

import jax
import hypothesis

jax.config.update("jax_numpy_rank_promotion", "raise")

# jit compiles on first use, so wall-clock deadlines would only measure the compiler.
hypothesis.settings.register_profile("jaxdecode", deadline=None, max_examples=40,
                                     derandomize=True, print_blob=True)
hypothesis.settings.load_profile("jaxdecode")
