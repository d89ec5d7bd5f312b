"""Straightforward sort-based references for the kept sets, in numpy float64.

They follow the definitions of jaxdecode.processors' docstring literally and share no code with jaxdecode. Where float32 and
float64 can disagree on a token (its quantity is within `TOL` of the cut), the token is reported
as ambiguous, and tests compare only the others.
"""

import math

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


# ---------------------------------------------------------------------------------------------
# Penalties and the entropy-based truncations, from their definitions (float64).

SCORE_TOL = 1e-4  # float32 typicality scores can reorder tokens whose scores are this close


def penalize(x32, counts, repetition=1.0, presence=0.0, frequency=0.0):
  """HF repetition penalty, then OpenAI frequency/presence penalties, in float32 like jaxdecode."""
  x = np.asarray(x32, np.float32).copy()
  counts = np.asarray(counts)
  seen = counts > 0
  r = np.float32(repetition)
  x[seen] = np.where(x[seen] < 0, x[seen] * r, x[seen] / r)
  x[seen] = x[seen] - (np.float32(frequency) * counts[seen].astype(np.float32)
                       + np.float32(presence))
  return x


def _entropy(probs):
  pos = probs > 0
  return -np.sum(probs[pos] * np.log(probs[pos]))


def typical_keep(x, mass):
  """(keep, ambiguous): keep i iff the mass of the tokens strictly more typical than i < mass.

  Token j is more typical than i iff |-log p_j - H| < |-log p_i - H|.
  """
  x = np.asarray(x, np.float64)
  if mass >= 1:
    return np.ones(x.size, bool), np.zeros(x.size, bool)
  probs = softmax64(x)
  pos = probs > 0
  score = np.full(x.size, np.inf)
  score[pos] = np.abs(-np.log(probs[pos]) - _entropy(probs))
  keep = np.zeros(x.size, bool)
  ambiguous = np.zeros(x.size, bool)
  for i in np.flatnonzero(pos):
    above = probs[score < score[i]].sum()
    keep[i] = above < mass
    # Robust unless a float32 perturbation of the scores (or of the mass) could flip it.
    lo = probs[score < score[i] - SCORE_TOL].sum()
    hi = probs[(score < score[i] + SCORE_TOL) & (x != x[i])].sum()
    ambiguous[i] = not (hi < mass - TOL or lo >= mass + TOL)
  return keep, ambiguous


def _cut_keep(x, threshold):
  probs = softmax64(x)
  keep = (probs >= threshold) | (probs == probs.max())
  ambiguous = (np.abs(probs - threshold) <= 1e-5 * threshold) & (probs != probs.max())
  return keep, ambiguous


def epsilon_keep(x, epsilon):
  """(keep, ambiguous): keep i iff p_i >= epsilon or p_i is the largest probability."""
  if epsilon <= 0:
    return np.ones(len(x), bool), np.zeros(len(x), bool)
  return _cut_keep(x, epsilon)


def eta_keep(x, eta):
  """(keep, ambiguous): keep i iff p_i >= min(eta, sqrt(eta) exp(-H)) or p_i is the largest."""
  if eta <= 0:
    return np.ones(len(x), bool), np.zeros(len(x), bool)
  return _cut_keep(x, min(eta, np.sqrt(eta) * np.exp(-_entropy(softmax64(x)))))


def process_row_full(x32, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                     epsilon=0.0, eta=0.0):
  """`process_row` followed by typical-p, epsilon and eta. Returns (logits, ambiguous)."""
  x, ambiguous = process_row(x32, temperature, top_k, top_p, min_p)
  for keep_fn, value in ((typical_keep, typical_p), (epsilon_keep, epsilon), (eta_keep, eta)):
    keep, amb = keep_fn(x, value)
    x, ambiguous = np.where(keep, x, -np.inf), ambiguous | amb
  return x, ambiguous


# ---------------------------------------------------------------------------------------------
# The peers' own algorithms, ported line by line to numpy (transformers' PyTorch warpers in
# generation/logits_process.py, with min_tokens_to_keep=1): sort-based, unlike jaxdecode.


def hf_repetition_penalty(scores, input_ids, penalty):
  """RepetitionPenaltyLogitsProcessor: gather the seen ids, rescale, scatter back."""
  scores = np.asarray(scores, np.float32).copy()
  for b, ids in enumerate(input_ids):
    score = scores[b, ids]
    scores[b, ids] = np.where(score < 0, score * np.float32(penalty), score / np.float32(penalty))
  return scores


def _log_softmax(scores):
  m = scores.max(axis=-1, keepdims=True)
  return scores - m - np.log(np.exp(scores - m).sum(axis=-1, keepdims=True))


def hf_typical_removed(scores, mass):
  """TypicalLogitsWarper: bool[B, V], True where the token is removed."""
  scores = np.asarray(scores, np.float64)
  normalized = _log_softmax(scores)
  p = np.exp(normalized)
  ent = -np.nansum(normalized * p, axis=-1, keepdims=True)
  shifted = np.abs(-normalized - ent)
  sorted_indices = np.argsort(shifted, axis=-1, kind="stable")
  sorted_scores = np.take_along_axis(shifted, sorted_indices, axis=-1)
  sorted_logits = np.take_along_axis(scores, sorted_indices, axis=-1)
  cumulative = np.cumsum(np.exp(_log_softmax(sorted_logits)), axis=-1)
  last_ind = np.minimum((cumulative < mass).sum(axis=1), scores.shape[-1] - 1)
  sorted_remove = sorted_scores > np.take_along_axis(sorted_scores, last_ind[:, None], axis=1)
  sorted_remove[:, :1] = False
  removed = np.zeros_like(sorted_remove)
  np.put_along_axis(removed, sorted_indices, sorted_remove, axis=1)
  return removed


def hf_epsilon_removed(scores, epsilon):
  """EpsilonLogitsWarper: p < epsilon, except the top token."""
  scores = np.asarray(scores, np.float64)
  probs = np.exp(_log_softmax(scores))
  return (probs < epsilon) & (scores < scores.max(axis=-1, keepdims=True))


def hf_eta_removed(scores, eta):
  """EtaLogitsWarper: p < min(eta, sqrt(eta) exp(-H)), except the top token."""
  scores = np.asarray(scores, np.float64)
  logp = _log_softmax(scores)
  probs = np.exp(logp)
  entropy = -np.sum(probs * logp, axis=-1, keepdims=True)
  threshold = np.minimum(eta, np.sqrt(eta) * np.exp(-entropy))
  return (probs < threshold) & (scores < scores.max(axis=-1, keepdims=True))


# Beam search.


def log_softmax64(x):
  x = np.asarray(x, np.float64)
  m = np.max(x)
  if m == -np.inf:
    return np.full(x.shape, -np.inf)
  return x - m - np.log(np.sum(np.exp(x - m)))


def reference_beam_search(next_logprobs, *, beam_size, max_new_tokens, eos_ids=(),
                          length_penalty=1.0, early_stopping=True):
  """One row of beam search, in plain Python with float64 scores: transformers' algorithm, except
  that an impossible candidate (log-probability -inf) is never a hypothesis nor a running beam.

  Candidates: the best max(2, 1 + #eos) * K possible (score, beam, token) extensions of the
  running beams. Of the K best, those ending (EOS, or the last step) become hypotheses scored
  sum / length ** length_penalty; the K best that go on (fewer if fewer are possible) are the next
  beams. The row closes once no beam is left, at the last step, or once it has K hypotheses and
  either early_stopping is True or the best beam, bounded at the current length (at N for
  "never" with a positive penalty), cannot beat the worst hypothesis.

  Returns:
    (hypotheses [(score, tokens)] best first (at most K), the step at which the row closed,
    whether a running beam met a distribution with nothing possible before it closed).
  """
  k, n = beam_size, max_new_tokens
  beams = [((), 0.0)]
  hyps = []
  dead_end = False
  for t in range(n):
    cands = []
    for i, (toks, score) in enumerate(beams):
      logprobs = next_logprobs(toks)
      dead_end |= bool(np.all(np.asarray(logprobs) == -np.inf))
      cands += [(score + lp, i, v) for v, lp in enumerate(logprobs) if score + lp > -np.inf]
    cands = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:max(2, 1 + len(eos_ids)) * k]
    next_beams = []
    for rank, (score, i, v) in enumerate(cands):
      toks = beams[i][0] + (v,)
      if v in eos_ids or t == n - 1:
        if rank < k:
          hyps.append((score / (t + 1) ** length_penalty, toks))
      elif len(next_beams) < k:
        next_beams.append((toks, score))
    hyps = sorted(hyps, key=lambda h: -h[0])[:k]
    beams = next_beams
    if t == n - 1 or not beams:
      return hyps, t, dead_end
    if len(hyps) == k:
      if early_stopping is True:
        return hyps, t, dead_end
      bound = n if early_stopping == "never" and length_penalty > 0 else t + 1
      if not beams[0][1] / bound ** length_penalty > hyps[-1][0]:
        return hyps, t, dead_end
  raise AssertionError("unreachable")


def every_sequence(next_logprobs, *, max_new_tokens, eos_ids=(), length_penalty=1.0):
  """Brute force: every possible sequence (each token of log-probability > -inf) that ends with
  an EOS id or reaches max_new_tokens, as (score, tokens) best first (ties: shorter, then lower
  ids first), with the most possible candidates any step has (all prefixes of that length
  extended by one token) and whether a possible unfinished prefix has nothing possible next.

  When K is at least both counts, beam search keeps every prefix, so its hypotheses are exactly
  these sequences, whatever early_stopping is.
  """
  done, widest, dead_end = [], 0, False
  prefixes = [((), 0.0)]
  for t in range(max_new_tokens):
    extended = []
    for toks, total in prefixes:
      logprobs = np.asarray(next_logprobs(toks), np.float64)
      dead_end |= bool(np.all(logprobs == -np.inf))
      extended += [(toks + (v,), total + lp) for v, lp in enumerate(logprobs) if lp > -np.inf]
    widest = max(widest, len(extended))
    prefixes = []
    for toks, total in extended:
      if toks[-1] in eos_ids or t == max_new_tokens - 1:
        done.append((total / len(toks) ** length_penalty, toks))
      else:
        prefixes.append((toks, total))
  return sorted(done, key=lambda h: (-h[0], len(h[1]), h[1])), widest, dead_end


# ---------------------------------------------------------------------------------------------
# The samplers of llama.cpp / transformers beyond the truncations above, from their published
# definitions, in plain Python over float64 (one row; inputs already free of NaN and +inf).


def top_n_sigma_keep(x, n):
  """(keep, ambiguous): llama.cpp's top-nσ. n <= 0 keeps all; otherwise keep i iff
  x_i >= max - n·σ, σ the population standard deviation of the finite logits."""
  x = [float(v) for v in x]
  finite = [v for v in x if v != -math.inf]
  if n <= 0 or not finite:
    return np.ones(len(x), bool), np.zeros(len(x), bool)
  # Scaled by the largest magnitude, so that 1e38 rows do not overflow in float64 either.
  scale = max(abs(v) for v in finite) or 1.0
  ys = [v / scale for v in finite]
  mean = sum(ys) / len(ys)
  sigma = math.sqrt(sum((y - mean) ** 2 for y in ys) / len(ys))
  cut = max(ys) - n * sigma
  keep = np.array([v != -math.inf and v / scale >= cut for v in x])
  ambiguous = np.array([v != -math.inf and abs(v / scale - cut) <= 1e-5 * (1 + abs(cut))
                        for v in x])
  return keep, ambiguous


def xtc_keep(x, threshold, applies=True):
  """(keep, ambiguous): llama.cpp's XTC when its coin says so (`applies`): if at least two
  tokens have p >= threshold, remove those above the least probable of them (all tokens tied at
  that least probability stay). threshold > 0.5 never removes anything."""
  probs = softmax64(x)
  size = len(probs)
  if not applies or threshold > 0.5:
    return np.ones(size, bool), np.zeros(size, bool)
  selectable = [i for i in range(size) if x[i] != -np.inf]
  above = [i for i in selectable if probs[i] >= threshold]
  ambiguous = np.array([x[i] != -np.inf and abs(probs[i] - threshold) <= 1e-5
                        for i in range(size)])
  if len(above) < 2:
    return np.ones(size, bool), ambiguous
  least = min(probs[i] for i in above)
  keep = np.array([not (i in above and probs[i] > least) for i in range(size)])
  return keep, ambiguous


def no_repeat_ngram_banned(tokens, n):
  """transformers' NoRepeatNGramLogitsProcessor on one row's tokens (a list): the set of ids
  that would complete an n-gram already in them."""
  if n <= 0 or len(tokens) + 1 < n:
    return set()
  grams = {}
  for i in range(len(tokens) - n + 1):
    gram = tuple(tokens[i:i + n])
    grams.setdefault(gram[:-1], set()).add(gram[-1])
  return grams.get(tuple(tokens[len(tokens) - n + 1:]) if n > 1 else (), set())


def bad_words_banned(tokens, words):
  """transformers' NoBadWordsLogitsProcessor on one row: the last id of each word whose other
  ids are the row's last tokens (a one-token word always)."""
  banned = set()
  for word in words:
    prefix = list(word[:-1])
    if not prefix or (len(prefix) <= len(tokens) and list(tokens[len(tokens) - len(prefix):])
                      == prefix):
      banned.add(word[-1])
  return banned


def dynatemp_logits(x, temperature, spread, exponent):
  """llama.cpp's dynamic temperature (llama_sampler_temp_ext) on one row, in float64: divide by
  T_min + (T_max - T_min)·(H / log N)^exponent, N the selectable tokens (one: unchanged)."""
  x = np.asarray(x, np.float64)
  selectable = [v for v in x if v != -np.inf]
  if spread <= 0 or temperature <= 0 or len(selectable) <= 1:
    return x if spread > 0 and temperature > 0 else x / temperature
  probs = softmax64(x)
  entropy = -sum(p * math.log(p) for p in probs if p > 0)
  low, high = max(0.0, temperature - spread), temperature + spread
  t = low + (high - low) * min(entropy / math.log(len(selectable)), 1.0) ** exponent
  if t == 0:  # greedy: a point mass on the first largest logit, its value kept
    out = np.full(x.size, -np.inf)
    out[first_argmax(x)] = x[first_argmax(x)]
    return out
  scaled = x / t
  if np.any(np.abs(scaled[np.isfinite(x)]) > np.finfo(np.float32).max):
    scaled = (x - x.max()) / t  # what float32 does instead of overflowing (processors docs)
  return np.where(scaled < -np.finfo(np.float32).max, -np.inf, scaled)  # float32: -inf there


def dry_penalties(tokens, vocab, multiplier, base, allowed_length, penalty_last_n, breakers):
  """llama.cpp's DRY (llama_sampler_dry_apply) on one row's tokens, with single-token breakers,
  written naively (no Z-algorithm): the penalty subtracted from each token's logit (float64)."""
  penalty = np.zeros(vocab)
  if multiplier == 0 or base < 1 or penalty_last_n == 0:
    return penalty
  last_n = len(tokens) if penalty_last_n == -1 else min(penalty_last_n, len(tokens))
  window = list(tokens[len(tokens) - last_n:])
  if last_n <= allowed_length:
    return penalty
  rat = lambda i: window[last_n - 1 - i]  # i-th token from the end
  rep_limit = last_n
  for i in range(last_n):
    if rat(i) in breakers:
      rep_limit = i
      break
  if rep_limit < allowed_length:
    return penalty
  longest = {}
  for k in range(1, last_n):  # the repeat of the last tokens that ends k tokens from the end
    n = 0
    while n + k < last_n and rat(n) == rat(n + k):
      n += 1
    n = min(n, rep_limit)
    if n >= allowed_length:
      token = rat(k - 1)  # the token after it
      longest[token] = max(longest.get(token, 0), n)
  max_exponent = int(np.float32(88.7228391) / np.log(np.float32(base))) if base > 1.000001 else 0
  for token, n in longest.items():
    if token in breakers or not 0 <= token < vocab:
      continue
    exponent = n - allowed_length
    if max_exponent > 0 and exponent > max_exponent:
      exponent = max_exponent
    penalty[token] = min(multiplier * float(base) ** exponent, float(np.finfo(np.float32).max))
  return penalty
