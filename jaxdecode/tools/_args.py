"""Command-line pieces shared by the `jaxdecode` command, the benchmark and the sweep.

A user's mistake on the command line is reported in one line with exit status 2, never a
traceback.
"""

from __future__ import annotations

import argparse

from jaxdecode import _checks


class OneLineParser(argparse.ArgumentParser):
  """argparse that reports a bad command line in one line (exit status 2)."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def integer(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _at_least(low: int, words: str):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      value = None
    if value is None or value < low:
      raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}")
    return value
  return parse


positive_int = _at_least(1, "a positive integer")
non_negative_int = _at_least(0, "an integer >= 0")


def number(text: str) -> float:
  try:
    return float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def seed(text: str) -> int:
  """A PRNG seed: an integer in [0, 2**32), where every seed gives its own key."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
  if not 0 <= value <= _checks.MAX_SEED:
    raise argparse.ArgumentTypeError(f"expected a seed in [0, 2**32), got {text}")
  return value
