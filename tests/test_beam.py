"""beam_search against independent references: brute-force enumeration, a plain-Python beam
search, and transformers' own beam search (when torch and transformers are installed).

Compiling a search takes seconds on CPU, so each test keeps one static configuration (beam
size, N, early_stopping, shapes) and varies the traced values (length penalty, params) inside it.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode import SamplingParams, beam
import toy_model
from reference import every_sequence, log_softmax64, process_row, reference_beam_search

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


def toy_logprobs(table, prompt):
  """next_logprobs(new tokens) of the toy model for one prompt, in float64."""
  table = np.asarray(table)
  return lambda new: log_softmax64(table[history_hash(list(prompt) + list(new))])


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
      hyps, _, _ = reference_beam_search(toy_logprobs(TABLE, prompt), beam_size=k,
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
    hyps, closed, _ = reference_beam_search(toy_logprobs(TABLE, prompt), beam_size=k,
                                         max_new_tokens=n, eos_ids=eos_ids)
    assert_matches(out, row, hyps[:2], eos_ids=eos_ids)
    last = max(last, closed)
  assert 1 < last < n - 2  # rows close early, at different steps
  # Step t >= 1 is one model call; whole chunks of `chunk` steps (steps 0 .. chunk - 1, then the
  # next chunk) run until the one in which the last row closed.
  assert len(calls) == chunk * (last // chunk + 1) - 1


# ---------------------------------------------------------------------------------------------
# Impossible candidates (log-probability -inf) are never hypotheses nor running beams.


def _chain_step(table):
  """A state-free model: the logits after token x are `table[x]`."""
  table = jnp.asarray(table, jnp.float32)
  return lambda state, tokens, positions: (table[tokens], state)


def _log(p):
  with np.errstate(divide="ignore"):
    return np.log(np.asarray(p, np.float64)).astype(np.float32)


# From token 0: token 1 (p .6) or EOS 4 (p .4); then 1 -> 2 -> 1 -> ... for sure.
ISSUE_TABLE = _log([[0, .6, 0, 0, .4], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0],
                    [0, 0, 0, 0, 1]])


@pytest.mark.slow
@pytest.mark.parametrize("early_stopping", [True, False])
def test_an_eos_candidate_no_longer_ties_into_the_running_beams_and_hides_the_best_beam(
    early_stopping):
  # Issue 33's reproduction: -1e9 - log(.6) == -1e9 - log(.4) in float32, so the EOS candidate
  # used to become a running beam whose junk continuations filled the 3 slots, and
  # early_stopping=True stopped before 1 2 1 2 1 2 1 2 (score log(.6) / 8) ended.
  out = jaxdecode.beam_search(_chain_step(ISSUE_TABLE), {}, jnp.asarray(ISSUE_TABLE[[0]]),
                              beam_size=3, max_new_tokens=8, eos_ids=[4], pad_id=3,
                              positions=jnp.array([1]), early_stopping=early_stopping)
  assert out.tokens[0].tolist() == [[1, 2] * 4, [4] + [3] * 7, [3] * 8]
  np.testing.assert_allclose(out.scores[0, :2], [np.log(.6) / 8, np.log(.4)], rtol=1e-6)
  assert out.scores[0, 2] == -np.inf
  assert out.lengths[0].tolist() == [8, 1, 0] and out.finished[0].tolist() == [False, True, False]
  assert out.logprobs[0, 2].tolist() == [0.0] * 8 and not out.dead_end[0]


@pytest.mark.slow
def test_a_single_possible_path_gives_one_hypothesis_and_empty_slots_at_any_length_penalty():
  # Issue 33: K = 4 on a table with one possible path used to return four slots of length 6,
  # three of them copies scored -4.6e6 (length_penalty 3) or -0.0146 (12), above real beams.
  table = _log([[0, 1, 0, 0], [0, 0, .5, .5], [0, 0, 0, 1], [0, 1, 0, 0]])
  table[1] = [-np.inf, -np.inf, 0.0, -np.inf]  # after 1: 2 for sure; so 0 1 2 3 1 2 3 ...
  for length_penalty in (3.0, 12.0, -2.0, 0.0, -200.0):  # -200: 6 ** -200 underflows to 0
    out = jaxdecode.beam_search(_chain_step(table), {}, jnp.asarray(table[[0]]), beam_size=4,
                                max_new_tokens=6, positions=jnp.array([1]), pad_id=0,
                                length_penalty=length_penalty)
    assert out.tokens[0].tolist() == [[1, 2, 3, 1, 2, 3]] + [[0] * 6] * 3
    assert out.lengths[0].tolist() == [6, 0, 0, 0]
    assert out.scores[0, 0] == 0.0 and (out.scores[0, 1:] == -np.inf).all()
    assert not out.finished[0].any() and (out.logprobs[0] == 0).all()


def sparse_table(vocab, seed, *, keep=0.35):
  """A toy table where most logits are -inf or NaN (never selectable), and some rows have
  nothing selectable at all: (table for the model, the same with NaN as -inf for the reference)."""
  rng = np.random.default_rng(seed)
  table = rng.normal(size=(toy_model.TABLE_ROWS, vocab)).astype(np.float32) * 2
  dropped = rng.random(table.shape) > keep
  table[dropped] = np.where(rng.random(table.shape) < 0.2, np.nan, -np.inf)[dropped]
  table[rng.random(toy_model.TABLE_ROWS) < 0.04] = -np.inf  # dead ends
  return jnp.asarray(table), np.where(np.isnan(table), -np.inf, table)


@pytest.mark.slow
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_when_k_covers_every_possible_prefix_the_hypotheses_are_every_possible_sequence(
    early_stopping):
  # Brute force: with K at least the possible candidates of every step and the possible
  # sequences, beam search keeps every prefix, so it returns all sequences, best first, and
  # empty slots after them, whatever the length penalty's sign or the stopping rule.
  vocab, n, k, eos = 5, 4, 8, (0,)
  table, clean = sparse_table(vocab, seed=7)
  penalties = (-1.5, 0.0, 0.7, 3.0)
  by_count = {}  # the first prompt with 0, 1, ..., K possible sequences
  for prompt in itertools.chain(*(itertools.product(range(vocab), repeat=m) for m in (1, 2, 3))):
    found = [every_sequence(toy_logprobs(clean, prompt), max_new_tokens=n, eos_ids=eos,
                            length_penalty=lp) for lp in penalties]
    hyps, widest, _ = found[0]
    if widest <= k and len(hyps) <= k:
      by_count.setdefault(len(hyps), (list(prompt), found))
  assert sorted(by_count) == list(range(k + 1))
  prompts, expected = zip(*by_count.values())
  assert len({f[0][2] for f in expected}) == 2  # rows with dead ends and rows without
  step = toy_model.make_step(table)
  for i, length_penalty in enumerate(penalties):
    out = run_toy(list(prompts), table, step, beam_size=k, max_new_tokens=n, eos_ids=list(eos),
                  pad_id=4, length_penalty=length_penalty, early_stopping=early_stopping)
    for row, found in enumerate(expected):
      hyps, _, dead_end = found[i]
      assert_matches(out, row, hyps, pad_id=4, eos_ids=eos, rtol=1e-5)
      empty = slice(len(hyps), k)
      assert (out.scores[row, empty] == -np.inf).all() and (out.lengths[row, empty] == 0).all()
      assert (out.tokens[row, empty] == 4).all() and not out.finished[row, empty].any()
      assert bool(out.dead_end[row]) == dead_end, row


@pytest.mark.slow
def test_per_row_truncation_allowed_ids_and_temperature_0_match_the_reference():
  # K larger than the possible continuations of some rows (top-k 2, a tight top-p, min-p,
  # two allowed ids, temperature 0) and not of others; every length penalty sign.
  prompts = PROMPTS + [[3, 3]]
  k, n, eos = 4, 6, (4,)
  rows = dict(temperature=[1.0, 0.0, 0.8, 1.0, 1.2, 1.0], top_k=[2, 0, 0, 0, 0, 3],
              top_p=[1.0, 1.0, 0.3, 1.0, 1.0, 0.9], min_p=[0.0, 0.0, 0.0, 0.2, 0.0, 0.0])
  allowed = [[], [], [], [], [4, 7], []]
  params = SamplingParams(**{name: np.asarray(v) for name, v in rows.items()},
                          allowed_token_ids=allowed)
  for length_penalty in (1.0, -1.0, 0.0, 2.5):
    out = run_toy(prompts, beam_size=k, max_new_tokens=n, eos_ids=list(eos), pad_id=12,
                  params=params, length_penalty=length_penalty)
    for b, prompt in enumerate(prompts):
      def next_logprobs(new, b=b, prompt=prompt):
        x = np.asarray(TABLE[history_hash(prompt + list(new))], np.float32)
        if allowed[b]:
          x = np.where(np.isin(np.arange(VOCAB), allowed[b]), x, -np.inf).astype(np.float32)
        x, ambiguous = process_row(x, rows["temperature"][b], rows["top_k"][b], rows["top_p"][b],
                                   rows["min_p"][b])
        assert not ambiguous.any()
        return log_softmax64(x)

      hyps, _, dead_end = reference_beam_search(next_logprobs, beam_size=k, max_new_tokens=n,
                                                eos_ids=eos, length_penalty=length_penalty)
      assert_matches(out, b, hyps, pad_id=12, eos_ids=eos, rtol=1e-5)
      assert (out.scores[b, len(hyps):] == -np.inf).all() and not dead_end
    assert (out.lengths[1] == 0).sum() == k - 1  # temperature 0: one path, empty slots
    assert (out.lengths == 0).sum() > k - 1


@pytest.mark.slow  # the brute-force test above covers NaN and dead-end rows fast
def test_a_model_that_returns_nan_logits_ends_those_beams_and_reports_the_row():
  # Past its context a model returns NaN: beams there end without becoming hypotheses (instead
  # of NUL tokens scored NaN), and the row says so. Row 0 meets NaN at its first model call, so
  # only EOS candidates of step 0 can be hypotheses; row 1 never; row 2 at step 4.
  limits = [3, 9, 8]
  prompts = PROMPTS[:3]

  def step(state, tokens, positions):
    logits, inner = STEP({"h": state["h"], "calls": state["calls"]}, tokens, positions)
    return (jnp.where((positions >= state["limit"])[:, None], jnp.nan, logits),
            dict(inner, limit=state["limit"]))

  logits, state, positions = toy_model.prefill(TABLE, prompts)
  state = dict(state, limit=jnp.asarray(limits, jnp.int32))
  out = jaxdecode.beam_search(step, state, logits, positions=positions, beam_size=3,
                              max_new_tokens=6, eos_ids=[4, 9], pad_id=12)
  for b, prompt in enumerate(prompts):
    def next_logprobs(new, b=b, prompt=prompt):
      if new and len(prompt) + len(new) - 1 >= limits[b]:
        return np.full(VOCAB, -np.inf)
      return toy_logprobs(TABLE, prompt)(new)

    hyps, _, dead_end = reference_beam_search(next_logprobs, beam_size=3, max_new_tokens=6,
                                              eos_ids=(4, 9))
    assert_matches(out, b, hyps, pad_id=12, eos_ids=(4, 9))
    assert (out.scores[b, len(hyps):] == -np.inf).all()
    assert (out.lengths[b, len(hyps):] == 0).all()
    assert bool(out.dead_end[b]) == dead_end
  assert out.dead_end.tolist() == [True, False, True]
  assert (out.lengths[0] <= 1).all() and not np.isnan(np.asarray(out.scores)).any()


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


# ---------------------------------------------------------------------------------------------
# Rows are independent; any state layout.


def _needle(step, seed):
  """A row searched alone and at a random slot of batches with random partners (and partners'
  params): the fields that differ, [] if every one is bitwise the same."""
  prompt = [3, 1, 4, 1, 5]
  row_params = dict(temperature=0.9, repetition_penalty=1.2)
  kw = dict(beam_size=3, max_new_tokens=8, eos_ids=[4], early_stopping=False,
            length_penalty=0.8, chunk_size=3)
  alone = run_toy([prompt], step=step, params=SamplingParams(**row_params), **kw)
  rng = np.random.default_rng(seed)
  differ = []
  for _ in range(3):
    batch = 4
    prompts = [list(rng.integers(0, VOCAB, rng.integers(1, 7))) for _ in range(batch)]
    slot = int(rng.integers(batch))
    prompts[slot] = prompt
    temperature = rng.uniform(0.5, 1.5, batch).astype(np.float32)
    repetition = rng.uniform(1.0, 2.0, batch).astype(np.float32)
    temperature[slot], repetition[slot] = row_params["temperature"], row_params["repetition_penalty"]
    out = run_toy(prompts, step=step, params=SamplingParams(
        temperature=temperature, repetition_penalty=repetition), **kw)
    differ += [f for f in ("tokens", "scores", "lengths", "finished", "logprobs")
               if not np.array_equal(getattr(out, f)[slot], getattr(alone, f)[0])]
  return differ, alone


@pytest.mark.slow
def test_a_row_is_bitwise_the_same_alone_and_at_any_slot_of_a_batch():
  differ, alone = _needle(STEP, seed=0)
  assert differ == []
  assert np.asarray(alone.finished).any()  # the row does stop on an EOS


@pytest.mark.slow
def test_negative_control_the_needle_catches_a_model_that_mixes_rows():
  def leaky_step(state, tokens, positions):
    logits, state = STEP(state, tokens, positions)
    return logits + 0.5 * jnp.mean(logits, axis=0, keepdims=True), state

  differ, _ = _needle(leaky_step, seed=0)
  assert "tokens" in differ and "scores" in differ


def transposed_step(state, tokens, positions):
  """The toy model with its hashes at batch axis 1 of a [2, B'] leaf, and a shared leaf whose
  size happens to equal the prompt batch (it must reach the model unexpanded)."""
  if state["shared"].shape != (3,):
    raise AssertionError(f"a shared leaf was expanded: {state['shared'].shape}")
  logits, inner = STEP({"h": state["hT"][0], "calls": state["calls"]}, tokens, positions)
  hT = jnp.stack([inner["h"], inner["h"] + 1])
  return logits + 0 * state["shared"][0], dict(state, hT=hT, calls=inner["calls"])


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"hT": 1, "shared": None, "calls": 0}, {"hT": -1,
                                                                           "shared": None,
                                                                           "calls": None}])
def test_a_state_whose_batch_axis_is_not_first_gives_the_same_beams(axes):
  prompts = PROMPTS[:3]
  kw = dict(beam_size=3, max_new_tokens=6, eos_ids=[4], length_penalty=1.3)
  expected = run_toy(prompts, **kw)
  logits, state, positions = toy_model.prefill(TABLE, prompts)
  state = {"hT": jnp.stack([state["h"], state["h"] + 1]), "calls": state["calls"],
           "shared": jnp.arange(3.0)}
  out = jaxdecode.beam_search(transposed_step, state, logits, positions=positions,
                              state_axes=axes, **kw)
  for field in ("tokens", "scores", "lengths", "finished", "logprobs"):
    np.testing.assert_array_equal(getattr(out, field), getattr(expected, field))


@pytest.mark.slow
def test_embedded_transformer_kv_cache_matches_a_full_forward_reference():
  from jaxdecode import models
  config = models.TransformerConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                                    max_len=32)
  model = models.Transformer(config, rngs=nnx.Rngs(1))
  graphdef, weights = nnx.split(model)
  prompts, k, n, eos, width = [[5, 9, 2, 7], [11]], 3, 6, (3,), 16
  tokens, lengths = jaxdecode.right_pad(prompts, pad_id=0, width=8)
  logits, state = models.prefill(graphdef, weights, tokens, lengths, cache_length=8 + n)
  assert state.cache.k[0].shape[0] == len(prompts)  # per layer [B, S, H, Dh]
  out = jaxdecode.beam_search(models.make_step_fn(graphdef), state, logits, positions=lengths,
                              beam_size=k, max_new_tokens=n, eos_ids=list(eos),
                              early_stopping="never", length_penalty=0.7,
                              state_axes=models.DECODE_STATE_AXES)
  for row, prompt in enumerate(prompts):
    def next_logprobs(new, prompt=prompt):  # no cache: the whole sequence, every time
      seq, length = jaxdecode.right_pad([prompt + list(new)], pad_id=0, width=width)
      return log_softmax64(models.forward(graphdef, weights, seq, length)[0, int(length[0]) - 1])

    hyps, _, _ = reference_beam_search(next_logprobs, beam_size=k, max_new_tokens=n, eos_ids=eos,
                                    length_penalty=0.7, early_stopping="never")
    assert_matches(out, row, hyps, eos_ids=eos, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Processors per beam.


def ban_the_previous_token(logits, context):
  """A user processor: no beam repeats its newest token (reads each beam's own tokens)."""
  last = jnp.take_along_axis(context.tokens, jnp.maximum(context.step - 1, 0)[:, None], 1)[:, 0]
  ban = jnp.where(context.step > 0, last, -1)
  return jnp.where(jnp.arange(logits.shape[1])[None, :] == ban[:, None], -jnp.inf, logits)


@pytest.mark.slow
def test_penalties_bans_bias_min_new_tokens_temperature_and_top_k_apply_per_beam():
  prompts = PROMPTS[:3]
  eos, k, n = 4, 3, 7
  rows = dict(temperature=[1.0, 0.7, 1.3], repetition_penalty=[1.5, 1.0, 1.2],
              presence_penalty=[0.3, 0.0, 0.5], frequency_penalty=[0.2, 0.4, 0.0],
              min_new_tokens=[0, 3, 1], top_k=[0, 6, 0])
  params = SamplingParams(**{name: np.asarray(v) for name, v in rows.items()},
                          banned_token_ids=[[5], [], [7, 8]],
                          logit_bias=[{3: 0.5}, {}, {1: -0.4, 2: 1.0}])
  banned, bias = [[5], [], [7, 8]], [{3: 0.5}, {}, {1: -0.4, 2: 1.0}]
  padded, lengths = jaxdecode.left_pad(prompts)
  prompt_counts = jaxdecode.token_counts(padded, VOCAB,
                                         mask=jaxdecode.prompt_mask(lengths, padded.shape[1]))
  for count_prompt in (False, True):
    out = run_toy(prompts, beam_size=k, max_new_tokens=n, eos_ids=[eos], params=params,
                  counts=prompt_counts if count_prompt else None,
                  logits_processors=[ban_the_previous_token])
    for b, prompt in enumerate(prompts):
      def next_logprobs(new, b=b, prompt=prompt):
        x = np.asarray(TABLE[history_hash(prompt + list(new))], np.float64)
        if new:
          x[new[-1]] = -np.inf  # the user processor
        if len(new) < rows["min_new_tokens"][b]:
          x[eos] = -np.inf
        x[banned[b]] = -np.inf
        for token, value in bias[b].items():
          x[token] += value
        counts = np.bincount((prompt if count_prompt else []) + list(new), minlength=VOCAB)
        seen = counts > 0
        r = rows["repetition_penalty"][b]
        x[seen] = np.where(x[seen] < 0, x[seen] * r, x[seen] / r)
        x[seen] -= rows["frequency_penalty"][b] * counts[seen] + rows["presence_penalty"][b]
        x = x / rows["temperature"][b]
        if rows["top_k"][b]:
          x[x < np.sort(x)[::-1][rows["top_k"][b] - 1]] = -np.inf
        return log_softmax64(x)

      hyps, _, _ = reference_beam_search(next_logprobs, beam_size=k, max_new_tokens=n,
                                      eos_ids=(eos,))
      assert_matches(out, b, hyps, eos_ids=(eos,), rtol=1e-5)
      for toks in np.asarray(out.tokens[b]):
        assert eos not in toks[:rows["min_new_tokens"][b]]
        assert not set(toks.tolist()) & set(banned[b]) - {0}


@pytest.mark.slow
def test_new_values_of_the_traced_arguments_do_not_retrace():
  traces = []

  def step(state, tokens, positions):
    traces.append(1)
    return STEP(state, tokens, positions)

  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  outputs = []
  for i, length_penalty in enumerate((1.0, 0.3, -2.0)):
    outputs.append(jaxdecode.beam_search(
        step, state, logits + i, positions=positions + i, beam_size=2, max_new_tokens=5,
        eos_ids=[i, i + 4], pad_id=i, length_penalty=length_penalty,
        params=SamplingParams(temperature=0.5 + i, repetition_penalty=1 + i / 10,
                              banned_token_ids=[i + 1]),
        counts=jnp.full((len(PROMPTS), VOCAB), i, jnp.int32)))
    if i == 0:
      first = len(traces)
  assert len(traces) == first
  assert not np.array_equal(outputs[0].scores, outputs[1].scores)  # the new values took effect


# ---------------------------------------------------------------------------------------------
# Bad arguments: one clear ValueError each, before anything compiles.


@pytest.mark.parametrize("change,fragment", [
    (dict(beam_size=0), "beam_size must be an integer >= 1; got 0"),
    (dict(beam_size=2.0), "beam_size must be an integer >= 1; got 2.0"),
    (dict(num_return=4), "num_return must be at most beam_size = 3"),
    (dict(num_return=0), "num_return must be an integer >= 1; got 0"),
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer in \[1, 1073741824\]; got 0"),
    (dict(early_stopping="always"), "early_stopping must be True, False or \"never\"; got 'always'"),
    (dict(early_stopping=1), "early_stopping must be True, False or \"never\"; got 1"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number; got nan"),
    (dict(length_penalty="1"), "length_penalty must be a finite number; got '1'"),
    (dict(length_penalty=np.ones(2)), "length_penalty must be a finite number"),
    (dict(chunk_size=0), "chunk_size must be an integer >= 1; got 0"),
    (dict(state_axes={"h": 0}), "state_axes must be a pytree prefix of state.*calls"),
    (dict(state_axes=[0, 0]), "state_axes must be a pytree prefix of state"),
    (dict(state_axes={"h": 1, "calls": None}),
     r"state_axes gives state\['h'\] \(shape \(5,\)\) batch axis 1, which it does not have"),
    (dict(state_axes={"h": "0", "calls": None}), "state_axes must hold ints .* got '0'"),
    (dict(state_axes=True), "state_axes must hold ints .* got True"),
    (dict(state_axes={"h": 0.5, "calls": None}), "state_axes must hold ints .* got 0.5"),
    (dict(state={"h": jnp.zeros(5, jnp.int32), "w": jnp.zeros((7, 2))}),
     r"state\['w'\] \(shape \(7, 2\)\) batch axis 0, of size 7, but the logits have 5 rows"),
    (dict(positions=jnp.zeros(3, jnp.int32)), r"positions must be an integer array of shape \(5,\)"),
    (dict(eos_ids=[13]), r"eos_ids must be token ids in \[0, 13\)"),
    (dict(pad_id=-1), r"pad_id must be token ids in \[0, 13\)"),
    (dict(params=SamplingParams(top_p=[0.5, 0.9])), r"top_p has shape \(2,\) but the batch has 5"),
    (dict(params="greedy"), "params must be a jaxdecode.SamplingParams"),
    (dict(logits=jnp.zeros(13)), "rank 2"),
    (dict(step_fn=3), "step_fn must be callable"),
])
def test_bad_arguments_raise_a_clear_value_error(change, fragment):
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  kwargs = dict(step_fn=STEP, state=state, logits=logits, positions=positions, beam_size=3,
                max_new_tokens=4)
  kwargs.update(change)
  with pytest.raises(ValueError, match=fragment):
    jaxdecode.beam_search(kwargs.pop("step_fn"), kwargs.pop("state"), kwargs.pop("logits"),
                          **kwargs)


def test_a_step_fn_with_the_wrong_output_is_named_with_the_beam_rows():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  with pytest.raises(ValueError, match=r"logits of shape \(15, 13\).*got shape \(15, 5\)"):
    jaxdecode.beam_search(lambda s, t, p: (TABLE[s["h"]][:, :5], s), state, logits,
                          positions=positions, beam_size=3, max_new_tokens=3)


def test_leaf_axes_broadcasts_a_prefix_and_shares_0d_and_none_leaves():
  state = {"cache": {"k": jnp.zeros((2, 4, 3)), "start": jnp.zeros(4)}, "w": jnp.zeros((5, 4)),
           "step": jnp.zeros(()), "none": None}
  # Leaves in jax.tree.leaves order: cache.k, cache.start, step, w.
  assert beam.leaf_axes({"cache": {"k": 1, "start": 0}, "w": -1, "step": 0, "none": None},
                        state, 4) == (1, 0, None, 1)
  assert beam.leaf_axes({"cache": {"k": 1, "start": 0}, "w": None, "step": None, "none": None},
                        state, 4) == (1, 0, None, None)
  with pytest.raises(ValueError, match=r"state\['cache'\]\['k'\] \(shape \(2, 4, 3\)\) batch "
                                       r"axis 2, of size 3, but the logits have 4 rows"):
    beam.leaf_axes(-1, state, 4)
