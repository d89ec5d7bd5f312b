"""The docstring examples are tests too."""

import doctest
import importlib

import pytest

import jaxdecode
from jaxdecode import (_checks, beam, decoding, params, processors, prompts, sampling, structured,
                       trainer)
from jaxdecode.models import extras, tokenizer, transformer

MODULES = [_checks, beam, decoding, extras, params, processors, prompts, sampling, structured,
           tokenizer, trainer, transformer,
           # The module, not the function `jaxdecode.batch_invariant` exported under its name.
           importlib.import_module("jaxdecode.batch_invariant")]


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


def test_public_functions_are_documented():
  for name in jaxdecode.__all__:
    assert getattr(jaxdecode, name).__doc__, name
