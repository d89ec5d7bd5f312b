"""Straightforward sort-based references for the kept sets, in numpy float64.

They follow DESIGN.md's definitions literally and share no code with jaxdecode. Where float32 and
float64 can disagree on a token (its quantity is within `TOL` of the cut), the token is reported
as ambiguous, and tests compare only the others.
"""

import numpy as np

TOL = 1e-5


def softmax64(x):
  x = np.asarray(x, np.float64)
  m = np.max(x)
  if m == -np.inf:
    return np.zeros_like(x)
  e = np.exp(x - m)
  return e / e.sum()


def top_k_keep(x, k):
  """Keep i iff fewer than k tokens have a strictly larger logit. x: 1-D."""
  x = np.asarray(x, np.float64)
  if k <= 0 or k >= x.size:
    return np.ones(x.size, bool)
  kth_largest = np.sort(x)[::-1][k - 1]
  return x >= kth_largest


def mass_strictly_above(probs):
  """For each token, the total probability of the tokens strictly more probable than it."""
  order = np.argsort(-probs, kind="stable")
  sorted_p = probs[order]
  exclusive = np.concatenate([[0.0], np.cumsum(sorted_p)[:-1]])
  first_of_tie = np.searchsorted(-sorted_p, -sorted_p, side="left")
  above = np.empty_like(probs)
  above[order] = exclusive[first_of_tie]
  return above


def top_p_keep(x, p):
  """(keep, ambiguous) for top-p on logits x. keep i iff mass strictly above i < p."""
  if p >= 1:
    return np.ones(len(x), bool), np.zeros(len(x), bool)
  above = mass_strictly_above(softmax64(x))
  return above < p, np.abs(above - p) < TOL


def min_p_keep(x, min_p):
  """(keep, ambiguous): keep i iff p_i >= min_p * max_j p_j."""
  if min_p <= 0:
    return np.ones(len(x), bool), np.zeros(len(x), bool)
  probs = softmax64(x)
  ratio = probs / probs.max() if probs.max() > 0 else probs
  return ratio >= min_p, np.abs(ratio - min_p) < TOL


def first_argmax(x):
  x = np.where(np.isnan(x), -np.inf, x)
  return int(np.flatnonzero(x == x.max())[0])


def process_row(x32, temperature, top_k, top_p, min_p):
  """The whole chain on one float32 row. Returns (processed float64 logits, ambiguous mask).

  Temperature is applied in float32, as jaxdecode does, so that both see the same ties.
  """
  x32 = np.asarray(x32, np.float32)
  ambiguous = np.zeros(x32.size, bool)
  if temperature == 0:
    out = np.full(x32.size, -np.inf)
    i = first_argmax(x32)
    out[i] = x32[i]
    return out, ambiguous
  with np.errstate(over="ignore"):
    x = (x32 / np.float32(temperature)).astype(np.float64)
  x = np.where(top_k_keep(x, top_k), x, -np.inf)
  keep, amb = top_p_keep(x, top_p)
  x, ambiguous = np.where(keep, x, -np.inf), ambiguous | amb
  keep, amb = min_p_keep(x, min_p)
  return np.where(keep, x, -np.inf), ambiguous | amb
