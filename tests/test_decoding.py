"""The decode loop: key policy, equivalence with a Python loop, stopping, reproducibility."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import SamplingParams, decoding, prompts
import conftest
import toy_model

VOCAB = 13
TABLE = toy_model.table(VOCAB)
STEP = toy_model.make_step(TABLE)
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2], [7, 1, 7], [3], [9, 9, 9, 9], [0, 12]]


def python_loop(step, state, logits, row_keys, params, n, positions, eos_ids=(), pad_id=0):
  """The reference: decode written as a plain Python loop over jaxdecode.sample_with_logprobs."""
  tokens, logprobs = [], []
  done = np.zeros(logits.shape[0], bool)
  lengths = np.zeros(logits.shape[0], np.int32)
  for t in range(n):
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
    token, logprob = jaxdecode.sample_with_logprobs(keys, logits, params)
    token = np.where(done, pad_id, np.asarray(token))
    logprobs.append(np.where(done, 0.0, np.asarray(logprob)))
    tokens.append(token)
    lengths += ~done
    done = done | np.isin(token, eos_ids)
    if t < n - 1:
      logits, state = step(state, jnp.asarray(token), positions + t)
  return np.stack(tokens, 1), np.stack(logprobs, 1), lengths, done, state


def mixed_params(batch, seed=0):
  rng = np.random.default_rng(seed)
  return SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0, 1.5], batch).astype(np.float32),
                        top_k=rng.choice([0, 3, 8], batch).astype(np.int32),
                        top_p=rng.choice([1.0, 0.9, 0.6], batch).astype(np.float32),
                        min_p=rng.choice([0.0, 0.05], batch).astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("n,chunk", [(1, 16), (7, 3), (12, 4), (20, 16)])
def test_decode_equals_a_python_loop_of_step_and_sample(n, chunk):
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  params = mixed_params(len(PROMPTS))
  key = jax.random.key(5)
  out = decoding.decode(STEP, state, logits, key=key, params=params, max_new_tokens=n,
                        positions=positions, eos_ids=[4, 11], pad_id=0, chunk_size=chunk)
  row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(len(PROMPTS)))
  tokens, logprobs, lengths, done, ref_state = python_loop(
      STEP, state, logits, row_keys, params, n, positions, eos_ids=[4, 11])
  np.testing.assert_array_equal(out.tokens, tokens)
  np.testing.assert_array_equal(out.logprobs, logprobs)  # bits: the same sums in any batch
  np.testing.assert_array_equal(out.lengths, lengths)
  np.testing.assert_array_equal(out.finished, done)
  if not done.all():  # an early stop skips steps the Python loop still takes
    np.testing.assert_array_equal(out.state["h"], ref_state["h"])


@pytest.mark.slow
def test_row_decodes_the_same_alone_and_in_a_batch_of_8_at_any_slot():
  prompt, row_params = [3, 1, 4, 1, 5], dict(temperature=1.2, top_k=9, top_p=0.95, min_p=0.01)
  key = jax.random.key(77)
  logits, state, positions = toy_model.prefill(TABLE, [prompt])
  alone = decoding.decode(STEP, state, logits, key=key[None], params=SamplingParams(**row_params),
                          max_new_tokens=24, positions=positions, eos_ids=[4])
  assert int(alone.lengths[0]) > 3  # a real continuation, not an immediate stop
  rng = np.random.default_rng(1)
  for slot in range(8):
    prompts = [list(rng.integers(0, VOCAB, rng.integers(1, 7))) for _ in range(8)]
    prompts[slot] = prompt
    logits, state, positions = toy_model.prefill(TABLE, prompts)
    params = mixed_params(8, seed=slot).broadcast(8)
    params = jax.tree.map(lambda v, x: v.at[slot].set(x[slot]), params,
                          SamplingParams(**row_params).broadcast(8))
    keys = jax.random.split(jax.random.key(slot), 8).at[slot].set(key)
    out = decoding.decode(STEP, state, logits, key=keys, params=params, max_new_tokens=24,
                          positions=positions, eos_ids=[4], chunk_size=5)
    np.testing.assert_array_equal(out.tokens[slot], alone.tokens[0])
    np.testing.assert_array_equal(out.logprobs[slot], alone.logprobs[0])
    assert int(out.lengths[slot]) == int(alone.lengths[0])


@pytest.mark.slow
def test_eos_is_kept_then_only_pad_and_lengths_count_through_eos():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  out = decoding.decode(STEP, state, logits, key=jax.random.key(0), params=SamplingParams(),
                        max_new_tokens=30, positions=positions, eos_ids=[4, 9], pad_id=12)
  tokens = np.asarray(out.tokens)
  assert out.finished.any()
  for row, length, finished in zip(tokens, np.asarray(out.lengths), np.asarray(out.finished)):
    if finished:
      assert row[length - 1] in (4, 9) and not np.isin(row[:length - 1], [4, 9]).any()
      assert (row[length:] == 12).all()
    else:
      assert length == 30 and not np.isin(row, [4, 9]).any()
  lp = np.asarray(out.logprobs)
  after = np.arange(30)[None, :] >= np.asarray(out.lengths)[:, None]
  assert (lp[after] == 0).all() and (lp[~after] < 0).all()


def limited_step(limits):
  """The toy model, with NaN logits from position limits[b] on (a model past its cache)."""
  def step(state, tokens, positions):
    logits, state = STEP(state, tokens, positions)
    return jnp.where((positions >= jnp.asarray(limits))[:, None], jnp.nan, logits), state
  return step


@pytest.mark.slow
@pytest.mark.parametrize("top_logprobs,logprobs_mode", [(0, "processed"), (2, "raw")])
def test_a_row_whose_step_has_nothing_selectable_stops_there_and_is_reported(top_logprobs,
                                                                             logprobs_mode):
  # Issue 33: past the cache the model's logits are NaN; a row used to go on with token 0 and a
  # NaN log-probability, counted in its length. Now it stops at that step: the same tokens as
  # without the limit before it, pad after, its length without the step, `dead_end` set. Row 2
  # has nothing selectable in its prefill logits: length 0.
  n, prompts = 9, PROMPTS[:5]
  limits = [6, 4, 99, 99, 7]  # row 0 (prompt of 3): tokens 1..3 from positions 3..5, then NaN
  logits, state, positions = toy_model.prefill(TABLE, prompts)
  logits = logits.at[2].set(-jnp.inf)
  kw = dict(key=jax.random.key(3), params=SamplingParams(temperature=0.8), max_new_tokens=n,
            positions=positions, pad_id=12, top_logprobs=top_logprobs,
            logprobs_mode=logprobs_mode)
  out = decoding.decode(limited_step(limits), state, logits, **kw)
  free = decoding.decode(STEP, state, logits, **kw)
  # Token t >= 1 comes from the logits at position p + t - 1: NaN once that reaches the limit.
  expected = [0 if b == 2 else min(n, limits[b] - len(p) + 1) for b, p in enumerate(prompts)]
  assert out.lengths.tolist() == expected == [4, 4, 0, 9, 5]
  assert out.dead_end.tolist() == [True, True, True, False, True] and not out.finished.any()
  for b, length in enumerate(expected):
    assert out.tokens[b, :length].tolist() == free.tokens[b, :length].tolist()
    assert (out.tokens[b, length:] == 12).all() and (out.logprobs[b, length:] == 0).all()
    np.testing.assert_array_equal(out.logprobs[b, :length], free.logprobs[b, :length])
    if top_logprobs:
      np.testing.assert_array_equal(out.top_tokens[b, :length], free.top_tokens[b, :length])
      assert (out.top_tokens[b, length:] == 12).all() and (out.top_logprobs[b, length:] == 0).all()
  assert not np.isnan(np.asarray(out.logprobs)).any()


def with_limit(step, limit):
  """`step` declaring that its state holds `limit` positions (what a fixed-size cache knows)."""
  def declared(state, tokens, positions):
    calls.append(1)
    return step(state, tokens, positions)
  calls = []
  declared.position_limit = lambda state: limit
  return declared, calls


@pytest.mark.slow
def test_a_step_fn_that_declares_its_cache_size_gets_a_request_past_it_refused_before_running():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS[:3])  # prompt lengths 3, 1, 5
  step, calls = with_limit(STEP, 10)
  message = (r"decode: max_new_tokens=7 does not fit the model state: row 2 starts at position "
             r"5, so it needs 11 positions, but the state holds 10 \(step_fn.position_limit"
             r"\(state\)\); prefill with a cache of at least 11 positions, or ask for at most 6 "
             r"new tokens")
  with pytest.raises(ValueError, match=message):
    decoding.decode(step, state, logits, key=jax.random.key(0), params=SamplingParams(),
                    max_new_tokens=7, positions=positions)
  with pytest.raises(ValueError, match=message.replace("decode", "beam_search")):
    jaxdecode.beam_search(step, state, logits, beam_size=2, max_new_tokens=7,
                          positions=positions)
  assert calls == []  # refused before anything ran
  out = decoding.decode(step, state, logits, key=jax.random.key(0), params=SamplingParams(),
                        max_new_tokens=6, positions=positions)  # exactly fits: 5 + 6 - 1 = 10
  assert out.lengths.tolist() == [6, 6, 6] and not out.dead_end.any()


@pytest.mark.slow
def test_no_eos_ids_means_every_row_runs_to_max_new_tokens():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  out = decoding.decode(STEP, state, logits, key=jax.random.key(0), params=SamplingParams(),
                        max_new_tokens=9, positions=positions)
  assert out.lengths.tolist() == [9] * len(PROMPTS) and not out.finished.any()
  assert int(out.state["calls"]) == 8  # N tokens cost N - 1 model steps


@pytest.mark.slow
def test_a_finished_batch_skips_the_remaining_chunks():
  steps_run = []  # one entry per loop step executed, counted by a user processor

  def count_steps(logits, context):
    jax.debug.callback(lambda: steps_run.append(1))
    return logits

  def run(**kwargs):
    steps_run.clear()
    out = decoding.decode(STEP, state, logits, key=jax.random.key(0), positions=positions,
                          logits_processors=[count_steps], **kwargs)
    jax.block_until_ready(out.tokens)
    jax.effects_barrier()
    return out, len(steps_run)

  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  eos = list(range(VOCAB))  # every token is an EOS: all rows finish at step 0
  out, steps = run(params=SamplingParams(), max_new_tokens=50, eos_ids=eos, chunk_size=8)
  assert out.lengths.tolist() == [1] * len(PROMPTS)
  assert int(out.state["calls"]) == 0  # no model call once every row has finished
  assert steps == 8  # the loop stopped after its first chunk (steps 0 to 7), not after 50
  # Greedy rows whose last EOS comes at step s: the model is called at steps 1 .. s, and the
  # loop stops after the chunk of 4 steps that holds step s.
  out, steps = run(params=SamplingParams(temperature=0.0), max_new_tokens=200, eos_ids=[4, 9, 2],
                   chunk_size=4)
  last = int(out.lengths.max())
  assert out.finished.all() and last < 100
  assert int(out.state["calls"]) == last - 1
  assert steps == 4 * -(-last // 4)


@pytest.mark.slow
def test_new_values_of_the_same_shapes_do_not_retrace():
  traces = []

  def step(state, tokens, positions):
    traces.append(1)
    return STEP(state, tokens, positions)

  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  rng = np.random.default_rng(0)
  for i in range(4):
    decoding.decode(step, state, logits + i, key=jax.random.key(i), params=mixed_params(8, i),
                    max_new_tokens=6, positions=positions + i, eos_ids=[i, i + 1],
                    pad_id=i, chunk_size=2)
    if i == 0:
      first = len(traces)
    logits = jnp.asarray(rng.normal(size=logits.shape), jnp.float32)
  assert len(traces) == first


@pytest.mark.slow
def test_vmap_over_keys_equals_one_by_one():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS[:3])
  keys = jax.random.split(jax.random.key(3), 4)
  params = mixed_params(3, 2)

  def run(key):
    return decoding.decode(STEP, state, logits, key=key, params=params, max_new_tokens=10,
                           positions=positions, eos_ids=[4], chunk_size=3)

  many = jax.vmap(run)(keys)
  for i, key in enumerate(keys):
    one = run(key)
    np.testing.assert_array_equal(many.tokens[i], one.tokens)
    np.testing.assert_array_equal(many.lengths[i], one.lengths)
    np.testing.assert_array_equal(many.logprobs[i], one.logprobs)


def test_prompt_helpers_left_pad_with_per_row_positions_and_masks():
  tokens, lengths = prompts.left_pad([[5, 6, 7], [9], [1, 2]], pad_id=0, buckets=(4, 8))
  assert tokens.tolist() == [[0, 5, 6, 7], [0, 0, 0, 9], [0, 0, 1, 2]]
  assert lengths.tolist() == [3, 1, 2]
  assert prompts.prompt_positions(lengths, 4).tolist() == [[0, 0, 1, 2], [0, 0, 0, 0],
                                                            [0, 0, 0, 1]]
  assert prompts.prompt_mask(lengths, 4).tolist() == [[False, True, True, True],
                                                       [False, False, False, True],
                                                       [False, False, True, True]]
  assert prompts.bucket_length(9, (8, 16)) == 16
  with pytest.raises(ValueError, match="longer than the largest bucket 16"):
    prompts.left_pad([[1] * 17], buckets=(8, 16))
  with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
    prompts.left_pad([[1], []])


@pytest.mark.parametrize("change,fragment", [
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer in \[1, 1073741824\]; got 0"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer in \[1, 1073741824\]; got 2.5"),
    (dict(positions=jnp.zeros(3, jnp.int32)), r"positions must be an integer array of shape \(8,\)"),
    (dict(positions=jnp.zeros(8)), "dtype float32"),
    (dict(params=SamplingParams(top_p=[0.5, 0.9])), r"top_p has shape \(2,\) but the batch has 8"),
    (dict(key=jax.random.split(jax.random.key(0), 3)), r"one per row \(shape \(8,\)\)"),
    (dict(eos_ids=[3, 13]), r"eos_ids must be token ids in \[0, 13\).*\[13\]"),
    (dict(eos_ids=[-1]), r"got \[-1\]"),
    (dict(pad_id=99), r"pad_id must be token ids in \[0, 13\)"),
    (dict(logits=jnp.zeros((8,))), "rank 2"),
])
def test_bad_arguments_raise_before_compiling(change, fragment):
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  kwargs = dict(logits=logits, key=jax.random.key(0), params=SamplingParams(), max_new_tokens=4,
                positions=positions)
  kwargs.update(change)
  with pytest.raises(ValueError, match=fragment):
    decoding.decode(STEP, state, **kwargs)


@pytest.mark.parametrize("bad_step,fragment", [
    (lambda s, t, p: (TABLE[s["h"]][:, :5], s), r"logits of shape \(8, 13\).*got shape \(8, 5\)"),
    (lambda s, t, p: (TABLE[s["h"]].astype(jnp.int32), s), "floating dtype"),
    (lambda s, t, p: (TABLE[s["h"]], {"h": s["h"]}), "same structure"),
    (lambda s, t, p: (TABLE[s["h"]], {"h": s["h"].astype(jnp.float32), "calls": s["calls"]}),
     "unchanged shape and dtype"),
    (lambda s, t, p: TABLE[s["h"]], "must return a pair"),
])
def test_a_step_fn_with_the_wrong_output_is_named(bad_step, fragment):
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  with pytest.raises(ValueError, match=fragment):
    decoding.decode(bad_step, state, logits, key=jax.random.key(0), params=SamplingParams(),
                    max_new_tokens=3, positions=positions)


SHARDED = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, {tests!r})
    import toy_model
    from jaxdecode import SamplingParams, decoding
    assert jax.device_count() == 8, jax.devices()
    table = toy_model.table(13)
    step = toy_model.make_step(table)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 13, rng.integers(1, 6))) for _ in range(16)]
    logits, state, positions = toy_model.prefill(table, prompts)
    params = SamplingParams(temperature=rng.uniform(0, 2, 16).astype(np.float32),
                            top_p=rng.uniform(0.5, 1, 16).astype(np.float32))
    keys = jax.random.split(jax.random.key(0), 16)
    kw = dict(params=params, max_new_tokens=12, eos_ids=[4], chunk_size=4)
    one = decoding.decode(step, state, logits, key=keys, positions=positions, **kw)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = NamedSharding(mesh, P("data"))
    shard = lambda x: jax.device_put(x, rows if jnp.ndim(x) else NamedSharding(mesh, P()))
    out = decoding.decode(step, jax.tree.map(shard, state), shard(logits), key=shard(keys),
                          positions=shard(positions), **kw)
    assert len(out.tokens.sharding.device_set) == 8, out.tokens.sharding
    np.testing.assert_array_equal(out.tokens, one.tokens)
    np.testing.assert_array_equal(out.lengths, one.lengths)
    np.testing.assert_array_equal(out.logprobs, one.logprobs)
    print("sharded ok")
""")


@pytest.mark.slow
def test_sharded_over_8_devices_equals_one_device():
  env = dict(os.environ, XLA_FLAGS=conftest.xla_flags("--xla_force_host_platform_device_count=8"),
             JAX_PLATFORMS="cpu")
  script = SHARDED.format(tests=os.path.dirname(__file__))
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "sharded ok" in result.stdout


# ---------------------------------------------------------------------------------------------
# User logit processors: applied before the built-in chain, traced, no recompile.


def ban_after_repeat(banned_table, logits, context):
  """A processor with an array argument: bans banned_table[last token] for the next step."""
  last = jnp.take_along_axis(context.tokens, jnp.maximum(context.step - 1, 0)[:, None], 1)[:, 0]
  ban = jnp.where(context.step > 0, banned_table[last], -1)  # [B]
  return jnp.where(jnp.arange(logits.shape[1])[None, :] == ban[:, None], -jnp.inf, logits)


@pytest.mark.slow
def test_logits_processors_run_before_the_chain_and_match_a_python_loop():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  table = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, VOCAB), jnp.int32)
  processor = jax.tree_util.Partial(ban_after_repeat, table)
  params = mixed_params(len(PROMPTS), 3)
  key = jax.random.key(9)
  n = 12
  out = decoding.decode(STEP, state, logits, key=key, params=params, max_new_tokens=n,
                        positions=positions, eos_ids=[4], chunk_size=5,
                        logits_processors=[processor])
  # Reference: a Python loop that bans by hand, then samples as decode does.
  row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(len(PROMPTS)))
  tokens = np.zeros((len(PROMPTS), n), np.int32)
  done = np.zeros(len(PROMPTS), bool)
  for t in range(n):
    x = np.asarray(logits).copy()
    if t > 0:
      x[np.arange(len(PROMPTS)), np.asarray(table)[tokens[:, t - 1]]] = -np.inf
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
    token = np.where(done, 0, np.asarray(jaxdecode.sample(keys, jnp.asarray(x), params)))
    tokens[:, t] = token
    done |= token == 4
    if t < n - 1:
      logits, state = STEP(state, jnp.asarray(token), positions + t)
  np.testing.assert_array_equal(out.tokens, tokens)
  # The ban held: no token follows the one its table entry bans.
  for row, length in zip(np.asarray(out.tokens), np.asarray(out.lengths)):
    for t in range(1, length):
      assert row[t] != int(table[row[t - 1]])


@pytest.mark.slow
def test_greedy_rows_take_the_argmax_after_the_processors():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  greedy = SamplingParams(temperature=0.0)
  plain = decoding.decode(STEP, state, logits, key=jax.random.key(0), params=greedy,
                          max_new_tokens=1, positions=positions)

  def no_argmax(logits, context):
    top = jnp.argmax(logits, 1)[:, None]  # [B, 1]
    return jnp.where(jnp.arange(logits.shape[1])[None, :] == top, -jnp.inf, logits)

  out = decoding.decode(STEP, state, logits, key=jax.random.key(0), params=greedy,
                        max_new_tokens=1, positions=positions, logits_processors=[no_argmax])
  second = np.argsort(-np.asarray(logits), axis=1, kind="stable")[:, 1]
  assert (np.asarray(plain.tokens[:, 0]) != np.asarray(out.tokens[:, 0])).all()
  np.testing.assert_array_equal(out.tokens[:, 0], second)


@pytest.mark.slow
def test_new_processor_arrays_do_not_recompile():
  traces = []

  def traced_ban(table, logits, context):
    traces.append(1)
    return ban_after_repeat(table, logits, context)

  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  outputs = []
  for seed in range(3):
    table = jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, VOCAB), jnp.int32)
    outputs.append(decoding.decode(
        STEP, state, logits, key=jax.random.key(0), params=SamplingParams(temperature=0.0),
        max_new_tokens=8, positions=positions,
        logits_processors=[jax.tree_util.Partial(traced_ban, table)]).tokens)
    if seed == 0:
      first = len(traces)
  assert len(traces) == first
  assert not np.array_equal(outputs[0], outputs[1])  # the new tables did take effect


def test_bad_logits_processors_raise_before_running():
  logits, state, positions = toy_model.prefill(TABLE, PROMPTS)
  args = dict(key=jax.random.key(0), params=SamplingParams(), max_new_tokens=3,
              positions=positions)
  with pytest.raises(ValueError, match="logits_processors must be a list of functions"):
    decoding.decode(STEP, state, logits, logits_processors=ban_after_repeat, **args)
  with pytest.raises(ValueError, match=r"logits_processors\[0\] must be a function"):
    decoding.decode(STEP, state, logits, logits_processors=[3], **args)
  with pytest.raises(ValueError, match=r"logits_processors\[0\] must return floating logits of "
                                       r"shape \(8, 13\)"):
    decoding.decode(STEP, state, logits, logits_processors=[lambda x, c: x[:, :3]], **args)
