"""The docstring examples are tests too."""

import doctest

import pytest

import jaxdecode
from jaxdecode import params, processors, sampling


@pytest.mark.parametrize("module", [params, processors, sampling], ids=lambda m: m.__name__)
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0


def test_public_functions_are_documented():
  for name in jaxdecode.__all__:
    assert getattr(jaxdecode, name).__doc__, name
