"""beam_search against independent references: brute-force enumeration, a plain-Python beam
search, and transformers' own beam search (when torch and transformers are installed).

Compiling a search takes seconds on CPU, so each test keeps one static configuration (beam
size, N, early_stopping, shapes) and varies the traced values (length penalty, params) inside it.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode import SamplingParams, beam
import toy_model

VOCAB = 13
TABLE = toy_model.table(VOCAB)
STEP = toy_model.make_step(TABLE)
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2], [7, 1, 7]]  # ragged: lengths 1 to 5


def history_hash(tokens):
  """The toy model's state after `tokens` (prompt + new tokens), recomputed from scratch."""
  h = 0
  for position, token in enumerate(tokens):
    h = (h * 31 + token * 7 + position + 1) % toy_model.TABLE_ROWS
  return h


def log_softmax64(x):
  x = np.asarray(x, np.float64)
  m = np.max(x)
  if m == -np.inf:
    return np.full(x.shape, -np.inf)
  return x - m - np.log(np.sum(np.exp(x - m)))


def toy_logprobs(table, prompt):
  """next_logprobs(new tokens) of the toy model for one prompt, in float64."""
  table = np.asarray(table)
  return lambda new: log_softmax64(table[history_hash(list(prompt) + list(new))])


def reference_beam_search(next_logprobs, *, beam_size, max_new_tokens, eos_ids=(),
                          length_penalty=1.0, early_stopping=True):
  """One row of transformers' beam search, in plain Python with float64 scores.

  Candidates: the best max(2, 1 + #eos) * K (score, beam, token) of the live beams' extensions.
  Of the K best, those ending (EOS, or the last step) become hypotheses scored
  sum / length ** length_penalty, unless the row is closed; the K best that go on are the next
  beams. The row closes once it has K hypotheses and either early_stopping is True or the best
  beam, bounded at the current length (at N for "never" with a positive penalty), cannot beat
  the worst hypothesis.

  Returns:
    (hypotheses [(score, tokens)] best first, the step at which the row closed).
  """
  k, n = beam_size, max_new_tokens
  beams = [((), 0.0)]
  hyps = []
  for t in range(n):
    cands = sorted(((score + lp, i, v) for i, (toks, score) in enumerate(beams)
                    for v, lp in enumerate(next_logprobs(toks)) if lp > -np.inf),
                   key=lambda c: (-c[0], c[1], c[2]))[:max(2, 1 + len(eos_ids)) * k]
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
    if t == n - 1:
      return hyps, t
    if len(hyps) == k:
      if early_stopping is True:
        return hyps, t
      bound = n if early_stopping == "never" and length_penalty > 0 else t + 1
      if not beams[0][1] / bound ** length_penalty > hyps[-1][0]:
        return hyps, t
  raise AssertionError("unreachable")


def run_toy(prompts, table=TABLE, step=STEP, **kwargs):
  logits, state, positions = toy_model.prefill(table, prompts)
  return jaxdecode.beam_search(step, state, logits, positions=positions, **kwargs)


def assert_matches(out, row, hyps, *, pad_id=0, eos_ids=(), rtol=2e-6):
  """Row `row` of a BeamOutput equals the reference hypotheses (tokens exactly)."""
  n = out.tokens.shape[-1]
  for r, (score, toks) in enumerate(hyps[:out.tokens.shape[1]]):
    expected = list(toks) + [pad_id] * (n - len(toks))
    assert out.tokens[row, r].tolist() == expected, (row, r)
    assert int(out.lengths[row, r]) == len(toks)
    assert bool(out.finished[row, r]) == (toks[-1] in eos_ids)
    np.testing.assert_allclose(float(out.scores[row, r]), score, rtol=rtol, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Brute force: with K >= V^(N-1) beams, beam search keeps every prefix, so it is exhaustive.


@pytest.mark.slow
def test_best_beams_are_the_exact_best_sequences_by_brute_force():
  vocab, n = 3, 3
  table = toy_model.table(vocab, seed=3)
  k = vocab ** (n - 1)
  prompt = [2, 1]
  logprobs = toy_logprobs(table, prompt)
  every = []
  for seq in itertools.product(range(vocab), repeat=n):
    total = sum(logprobs(seq[:i])[seq[i]] for i in range(n))
    every.append((total, seq))
  every.sort(key=lambda e: -e[0])
  for length_penalty in (1.0, 0.0, 2.5):
    out = run_toy([prompt], table, toy_model.make_step(table), beam_size=k, max_new_tokens=n,
                  length_penalty=length_penalty)
    assert out.tokens[0].tolist() == [list(seq) for _, seq in every[:k]]
    np.testing.assert_allclose(np.asarray(out.scores[0]),
                               [total / n ** length_penalty for total, _ in every[:k]],
                               rtol=1e-6)
    assert not np.asarray(out.finished).any() and (np.asarray(out.lengths) == n).all()


@pytest.mark.slow
def test_with_eos_and_never_the_hypotheses_are_the_exact_top_k_with_the_formula_scores():
  # Every hypothesis: a sequence ending with EOS (0) at any length <= N, or reaching N.
  vocab, n, eos = 4, 3, 0
  table = toy_model.table(vocab, seed=5)
  k = vocab ** (n - 1)
  prompts = [[3], [1, 2, 3]]
  step = toy_model.make_step(table)
  for length_penalty in (1.0, 0.5, 2.0, 0.0, -0.7):
    out = run_toy(prompts, table, step, beam_size=k, max_new_tokens=n, eos_ids=[eos],
                  early_stopping="never", length_penalty=length_penalty, pad_id=3)
    for row, prompt in enumerate(prompts):
      logprobs = toy_logprobs(table, prompt)
      every = []
      for length in range(1, n + 1):
        for seq in itertools.product(range(vocab), repeat=length):
          if eos in seq[:-1] or (length < n and seq[-1] != eos):
            continue
          total = sum(logprobs(seq[:i])[seq[i]] for i in range(length))
          every.append((total / length ** length_penalty, seq))  # the formula, by hand
      every.sort(key=lambda e: -e[0])
      assert len(every) > k
      assert_matches(out, row, every[:k], pad_id=3, eos_ids=(eos,))
    # Each score is the sum of the returned log-probs over length ** length_penalty.
    np.testing.assert_allclose(
        np.asarray(out.scores),
        np.asarray(out.logprobs).sum(-1) / np.asarray(out.lengths) ** length_penalty, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Against the plain-Python reference, on ragged prompts.


@pytest.mark.slow
@pytest.mark.parametrize("early_stopping,eos_ids", [(True, (4,)), (False, (4, 9)),
                                                    ("never", (4,))])
def test_matches_a_plain_python_beam_search_on_ragged_prompts(early_stopping, eos_ids):
  k, n = 3, 7
  for length_penalty in (1.0, 0.4, 2.0, -1.0):
    out = run_toy(PROMPTS, beam_size=k, max_new_tokens=n, eos_ids=list(eos_ids),
                  length_penalty=length_penalty, early_stopping=early_stopping, pad_id=12,
                  chunk_size=3)
    for row, prompt in enumerate(PROMPTS):
      hyps, _ = reference_beam_search(toy_logprobs(TABLE, prompt), beam_size=k,
                                      max_new_tokens=n, eos_ids=eos_ids,
                                      length_penalty=length_penalty,
                                      early_stopping=early_stopping)
      assert_matches(out, row, hyps, pad_id=12, eos_ids=eos_ids)
  assert np.asarray(out.finished).any() and not np.asarray(out.finished).all()


@pytest.mark.slow
def test_num_return_gives_the_best_r_and_the_loop_stops_after_the_chunk_where_all_rows_close():
  k, n, chunk, eos_ids = 3, 12, 2, (4, 9, 11)
  calls = []

  def counting_step(state, tokens, positions):  # counts the model calls on the host
    jax.debug.callback(lambda: calls.append(1))
    return STEP(state, tokens, positions)

  out = run_toy(PROMPTS, step=counting_step, beam_size=k, num_return=2, max_new_tokens=n,
                eos_ids=list(eos_ids), chunk_size=chunk)
  jax.effects_barrier()
  assert out.tokens.shape == (len(PROMPTS), 2, n) and out.scores.shape == (len(PROMPTS), 2)
  last = 0
  for row, prompt in enumerate(PROMPTS):
    hyps, closed = reference_beam_search(toy_logprobs(TABLE, prompt), beam_size=k,
                                         max_new_tokens=n, eos_ids=eos_ids)
    assert_matches(out, row, hyps[:2], eos_ids=eos_ids)
    last = max(last, closed)
  assert 1 < last < n - 2  # rows close early, at different steps
  # Step t >= 1 is one model call; whole chunks of `chunk` steps run until the one in which the
  # last row closed.
  assert len(calls) == chunk * math.ceil(last / chunk)


# ---------------------------------------------------------------------------------------------
# Against transformers' own beam search (PyTorch), on the same table model.


def hf_table_model(table):
  """The toy model as a transformers causal LM: the logits after a row's real tokens (its
  attention mask skips the left padding) are the table row of their hash, as in toy_model."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_outputs import CausalLMOutputWithPast

  class TableLM(transformers.PreTrainedModel, transformers.GenerationMixin):
    config_class = transformers.PretrainedConfig

    def __init__(self, config, table):
      super().__init__(config)
      self.table = torch.nn.Parameter(torch.tensor(np.asarray(table)), requires_grad=False)

    def forward(self, input_ids, attention_mask=None, **kwargs):
      hashes = [history_hash([t for t, m in zip(row, mask) if m])
                for row, mask in zip(input_ids.tolist(), attention_mask.tolist())]
      logits = torch.zeros(input_ids.shape + (self.table.shape[1],))
      logits[:, -1] = self.table[torch.tensor(hashes)]
      return CausalLMOutputWithPast(logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
      return {"input_ids": input_ids, "attention_mask": attention_mask}

  config = transformers.PretrainedConfig(vocab_size=table.shape[1])
  return TableLM(config, table), torch


@pytest.mark.slow
@pytest.mark.parametrize("beam_size,early_stopping,eos_ids", [
    (2, True, (4,)), (3, False, (4,)), (4, "never", (4, 9)), (3, "never", ())])
def test_matches_transformers_generate_num_beams(beam_size, early_stopping, eos_ids):
  model, torch = hf_table_model(TABLE)
  n, pad = 8, 12
  tokens, lengths = jaxdecode.left_pad(PROMPTS, pad_id=pad)
  width = tokens.shape[1]
  mask = np.asarray(jaxdecode.prompt_mask(lengths, width))
  for length_penalty in (1.0, 0.5, 2.0, -1.0):
    out = run_toy(PROMPTS, beam_size=beam_size, max_new_tokens=n, eos_ids=list(eos_ids),
                  length_penalty=length_penalty, early_stopping=early_stopping, pad_id=pad)
    hf = model.generate(torch.tensor(np.asarray(tokens)), attention_mask=torch.tensor(mask),
                        num_beams=beam_size, num_return_sequences=beam_size, max_new_tokens=n,
                        do_sample=False, length_penalty=length_penalty,
                        early_stopping=early_stopping, eos_token_id=list(eos_ids) or None,
                        pad_token_id=pad, use_cache=False, output_scores=True,
                        return_dict_in_generate=True)
    new = hf.sequences[:, width:].numpy().reshape(len(PROMPTS), beam_size, -1)
    hf_lengths = (hf.beam_indices.numpy() >= 0).sum(-1).reshape(len(PROMPTS), beam_size)
    hf_scores = hf.sequences_scores.numpy().reshape(len(PROMPTS), beam_size)
    np.testing.assert_array_equal(out.lengths, hf_lengths)
    for b in range(len(PROMPTS)):
      for r in range(beam_size):
        length = hf_lengths[b, r]
        assert out.tokens[b, r, :length].tolist() == new[b, r, :length].tolist(), (b, r)
        assert (np.asarray(out.tokens[b, r, length:]) == pad).all()
    np.testing.assert_allclose(out.scores, hf_scores, rtol=1e-6, atol=1e-7)
    ends_with_eos = np.isin(np.take_along_axis(np.asarray(out.tokens),
                                               np.asarray(out.lengths)[..., None] - 1, -1)[..., 0],
                            eos_ids)
    np.testing.assert_array_equal(out.finished, ends_with_eos)
