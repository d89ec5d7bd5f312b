"""Speculative decoding returns exactly decode's tokens and log-probabilities, for any drafts.

The models here give the same logits for K tokens in one call as for K single steps (exact table
lookups), which is what the equality needs; the embedded transformer's own multi-token step is
tested for that in tests/test_invariance.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import SamplingParams
import toy_model

VOCAB = 13
BIGRAM = toy_model.bigram_table(VOCAB, seed=1)
STEP = toy_model.make_bigram_step(BIGRAM)
HASHED = toy_model.table(VOCAB)
HASHED_STEP = toy_model.make_cached_step(HASHED)
SLOTS = 96
# Rows of different acceptance: a repetitive prompt, a short one, random ones.
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [2, 2, 2, 2], [7, 0, 7, 0, 7],
           [12, 11, 10]]
N = 40


def setup(prompts=PROMPTS, table=BIGRAM):
  logits, state, positions = toy_model.prefill_bigram(table, prompts, SLOTS)
  prompt_tokens, prompt_lengths = jaxdecode.right_pad(prompts, width=16)  # one width: one compile
  return logits, state, positions, jaxdecode.NgramDrafter(prompt_tokens, prompt_lengths)


def assert_same_as_decode(spec, ref):
  np.testing.assert_array_equal(spec.tokens, ref.tokens)
  np.testing.assert_array_equal(spec.logprobs, ref.logprobs)  # bits, not closeness
  np.testing.assert_array_equal(spec.lengths, ref.lengths)
  np.testing.assert_array_equal(spec.finished, ref.finished)


SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "top-p": SamplingParams(temperature=0.9, top_p=0.9),
    "mixed rows": SamplingParams(temperature=np.array([0.0, 0.7, 1.0, 0.0, 1.3, 0.5], np.float32),
                                 top_k=np.array([0, 3, 0, 5, 0, 2], np.int32),
                                 top_p=np.array([1.0, 0.9, 0.8, 1.0, 0.95, 1.0], np.float32)),
}
# Every rule at once, one per row (12 rows: the prompts twice), so one compiled program covers
# greedy, top-p, min-p, penalties, bans, bias, allowed ids and min_new_tokens.
EVERY_RULE = SamplingParams(
    temperature=np.array([0.0, 0.9, 1.2, 0.8, 0.7, 1.0] * 2, np.float32),
    top_p=np.array([1.0, 0.9, 1.0, 1.0, 1.0, 0.95] * 2, np.float32),
    min_p=np.array([0.0, 0.0, 0.1, 0.0, 0.0, 0.0] * 2, np.float32),
    repetition_penalty=np.array([1.0, 1.0, 1.0, 1.5, 1.0, 1.0] * 2, np.float32),
    presence_penalty=np.array([0.0, 0.0, 0.0, 0.3, 0.0, 0.0] * 2, np.float32),
    frequency_penalty=np.array([0.0, 0.0, 0.0, 0.2, 0.0, 0.5] * 2, np.float32),
    min_new_tokens=np.array([0, 0, 0, 0, 0, 12] * 2, np.int32),
    banned_token_ids=[[], [], [], [], [3, 8], []] * 2,
    allowed_token_ids=[[], [], [], [], [], []] * 1 + [[1, 2, 3, 4, 5, 9], [], [], [], [], []],
    logit_bias=[None, None, None, None, {5: 2.0, 9: -1.0}, None] * 2)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 8])
def test_speculative_equals_decode_bitwise_for_every_rule(k):
  logits, state, positions, drafter = setup(PROMPTS * 2)
  args = dict(key=jax.random.key(11), params=EVERY_RULE, max_new_tokens=N,
              positions=positions, eos_ids=[4, 6])
  ref = jaxdecode.decode(STEP, state, logits, **args)
  out = jaxdecode.speculative_decode(STEP, state, logits, drafter=drafter, num_draft_tokens=k,
                                     **args)
  assert_same_as_decode(out, ref)
  assert (np.asarray(out.accepted) <= np.asarray(out.drafted)).all()
  assert np.asarray(out.accepted).sum() > 0  # drafts were accepted (and then had to be right)
  assert np.asarray(out.finished).any()  # EOS inside accepted runs is handled too


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4, 5, 6, 7])
def test_speculative_equals_decode_bitwise_for_every_rule_more_draft_counts(k):
  test_speculative_equals_decode_bitwise_for_every_rule(k)


@pytest.mark.slow
def test_speculation_saves_calls_on_repetitive_text_and_counts_acceptance():
  logits, state, positions, drafter = setup()
  greedy = dict(key=jax.random.key(0), params=SamplingParams(temperature=0.0),
                max_new_tokens=N, positions=positions)
  out = jaxdecode.speculative_decode(STEP, state, logits, drafter=drafter, num_draft_tokens=4,
                                     **greedy)
  # Greedy bigram text cycles, so prompt lookup predicts it: far fewer calls than N - 1.
  assert int(out.calls) < (N - 1) // 2
  # Every call emits 1 + (drafts accepted in it) tokens per live row.
  emitted = np.asarray(out.lengths) - 1
  assert (emitted <= int(out.calls) + np.asarray(out.accepted)).all()
  assert float(out.acceptance_rate) > 0.5
  # Accepted drafts of each row are tokens it did not pay a call for.
  assert (np.asarray(out.lengths) - 1 - np.asarray(out.accepted) <= int(out.calls)).all()


@pytest.mark.slow
def test_any_drafts_give_the_same_output_garbage_included():
  class Garbage:  # a drafter that proposes random tokens: nothing is accepted by luck alone...
    def __init__(self, key):
      self.key = key

    def propose(self, context, k):
      key, sub = jax.random.split(self.key)
      return jax.random.randint(sub, (context.last.shape[0], k), 0, VOCAB), Garbage(key)

  jax.tree_util.register_pytree_node(Garbage, lambda g: ((g.key,), None),
                                     lambda _, c: Garbage(*c))
  logits, state, positions, _ = setup()
  args = dict(key=jax.random.key(2), params=SETTINGS["top-p"], max_new_tokens=N,
              positions=positions, eos_ids=[4])
  out = jaxdecode.speculative_decode(STEP, state, logits, drafter=Garbage(jax.random.key(7)),
                                     num_draft_tokens=5, **args)
  assert_same_as_decode(out, jaxdecode.decode(STEP, state, logits, **args))


@pytest.mark.slow
def test_a_row_alone_equals_the_row_in_a_batch():
  logits, state, positions, drafter = setup()
  keys = jax.random.split(jax.random.key(5), len(PROMPTS))
  params = SETTINGS["mixed rows"]
  batch = jaxdecode.speculative_decode(STEP, state, logits, key=keys, params=params,
                                       max_new_tokens=N, positions=positions, drafter=drafter,
                                       num_draft_tokens=4, eos_ids=[4])
  for row in (0, 3, 5):
    l1, s1, p1, d1 = setup([PROMPTS[row]])
    alone = jaxdecode.speculative_decode(STEP, s1, l1, key=keys[row:row + 1],
                                         params=params.rows(slice(row, row + 1)),
                                         max_new_tokens=N, positions=p1, drafter=d1,
                                         num_draft_tokens=4, eos_ids=[4])
    np.testing.assert_array_equal(alone.tokens[0], batch.tokens[row])
    np.testing.assert_array_equal(alone.logprobs[0], batch.logprobs[row])


@pytest.mark.slow
def test_the_model_drafter_keeps_its_cache_in_step_and_gives_decodes_tokens():
  logits, state, positions, _ = setup()
  # The draft model: the target's table plus noise, so it agrees most of the time.
  draft_table = BIGRAM + 0.5 * jax.random.normal(jax.random.key(3), BIGRAM.shape)
  _, draft_state, _ = toy_model.prefill_bigram(draft_table, PROMPTS, SLOTS)
  drafter = jaxdecode.ModelDrafter(state=draft_state, step_fn=toy_model.make_bigram_step(
      draft_table))
  for params in (SETTINGS["greedy"], SETTINGS["top-p"]):  # one compile: params are traced
    args = dict(key=jax.random.key(1), params=params, max_new_tokens=N, positions=positions,
                eos_ids=[4])
    out = jaxdecode.speculative_decode(STEP, state, logits, drafter=drafter,
                                       num_draft_tokens=3, **args)
    assert_same_as_decode(out, jaxdecode.decode(STEP, state, logits, **args))
  assert int(out.calls) < N - 1


@pytest.mark.slow
def test_a_model_with_history_rolls_back_by_position():
  """The hashed toy model's logits depend on the whole history: stale slots must not leak."""
  logits, state, positions = toy_model.prefill_cached(HASHED, PROMPTS, SLOTS)
  prompt_tokens, prompt_lengths = jaxdecode.right_pad(PROMPTS, buckets=None)
  args = dict(key=jax.random.key(4), params=SETTINGS["mixed rows"], max_new_tokens=N,
              positions=positions, eos_ids=[4])
  out = jaxdecode.speculative_decode(HASHED_STEP, state, logits,
                                     drafter=jaxdecode.NgramDrafter(prompt_tokens, prompt_lengths),
                                     num_draft_tokens=4, **args)
  assert_same_as_decode(out, jaxdecode.decode(HASHED_STEP, state, logits, **args))


@pytest.mark.slow
def test_a_dead_end_stops_a_row_as_decode_does_and_a_declared_cache_is_checked():
  # Rows meet NaN logits (a model past its cache) at different positions: speculative decoding
  # stops them at the same step as decode, bit for bit, without counting a draft there.
  logits, state, positions, drafter = setup()
  limits = jnp.asarray([12, 5, 99, 9, 99, 6], jnp.int32)

  def step(state, tokens, positions):
    out, state = STEP(state, tokens, positions)
    at = positions[:, None] + jnp.arange(tokens.shape[1])[None, :] if tokens.ndim == 2 else \
        positions
    return jnp.where((at >= (limits[:, None] if tokens.ndim == 2 else limits))[..., None],
                     jnp.nan, out), state

  kw = dict(key=jax.random.key(1), params=SETTINGS["mixed rows"], max_new_tokens=12,
            positions=positions)
  ref = jaxdecode.decode(step, state, logits, **kw)
  spec = jaxdecode.speculative_decode(step, state, logits, drafter=drafter, num_draft_tokens=3,
                                      **kw)
  assert_same_as_decode(spec, ref)
  np.testing.assert_array_equal(spec.dead_end, ref.dead_end)
  assert ref.dead_end.tolist() == [True, True, False, True, False, True]
  assert (spec.accepted <= spec.lengths).all()

  step.position_limit = lambda state: 18
  with pytest.raises(ValueError, match=r"speculative_decode: max_new_tokens=12 does not fit the "
                                       r"model state: row 0 starts at position 9, so it needs "
                                       r"20 positions, but the state holds 18"):
    jaxdecode.speculative_decode(step, state, logits, drafter=drafter, num_draft_tokens=3, **kw)


def test_ngram_lookup_continues_the_latest_match_periodically():
  prompts = [[5, 6, 7, 8, 5, 6], [1, 2, 3, 4], [9, 9, 9]]
  tokens, lengths = jaxdecode.right_pad(prompts, buckets=None)
  drafter = jaxdecode.NgramDrafter(tokens, lengths, max_ngram=3)
  context = jaxdecode.DraftContext(tokens=jnp.zeros((3, 4), jnp.int32),
                                   lengths=jnp.zeros(3, jnp.int32), last=tokens[:, 0],
                                   positions=lengths - 1, live=jnp.ones(3, bool))
  drafts, _ = drafter.propose(context, 6)
  # Row 0: suffix "5 6" seen at 0, followed by 7 8, then the cycle 5 6 7 8 repeats.
  # Row 1: no earlier match: the newest token repeated. Row 2: "9 9" at 0: 9s.
  assert drafts.tolist() == [[7, 8, 5, 6, 7, 8], [4, 4, 4, 4, 4, 4], [9, 9, 9, 9, 9, 9]]


@pytest.mark.slow
def test_new_values_do_not_recompile_and_bad_arguments_raise():
  traces = []

  def step(state, tokens, positions):
    traces.append(1)
    return STEP(state, tokens, positions)

  logits, state, positions, drafter = setup()
  for i in range(3):
    jaxdecode.speculative_decode(step, state, logits + i, key=jax.random.key(i),
                                 params=SamplingParams(temperature=0.5 * i, top_p=0.9),
                                 max_new_tokens=8, positions=positions, drafter=drafter,
                                 num_draft_tokens=2, eos_ids=[i])
    if i == 0:
      first = len(traces)
  assert len(traces) == first
  args = dict(key=jax.random.key(0), params=SamplingParams(), max_new_tokens=4,
              positions=positions)
  with pytest.raises(ValueError, match="num_draft_tokens must be an integer in"):
    jaxdecode.speculative_decode(STEP, state, logits, drafter=drafter, num_draft_tokens=0,
                                 **args)
  with pytest.raises(ValueError, match="drafter must have a propose"):
    jaxdecode.speculative_decode(STEP, state, logits, drafter="ngram", **args)
  with pytest.raises(ValueError, match=r"step_fn must return logits of shape \(6, 5, 13\)"):
    jaxdecode.speculative_decode(lambda s, t, p: (jnp.zeros((6, VOCAB)), s), state, logits,
                                 drafter=drafter, **args)
