"""Bit for bit through the model: a row's output depends on its own prompt, key and params only.

The needle test (vLLM's and SGLang's, here through jaxdecode's own transformer): a prompt decoded
alone, then at a random slot of batches of random size with random partner prompts of other
lengths, greedy and sampled rows with per-row keys; tokens and log-probabilities compared bit
for bit. Then prefill chunking, 8 devices, the plain numerics as a negative control (so the test
can fail), and the audit on a model built to be non-invariant.
"""

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode import SamplingParams
from jaxdecode.models import (Transformer, TransformerConfig, batch_prefill, load_default,
                              make_step_fn, prefill)
from jaxdecode.prompts import right_pad
import conftest
import toy_model

SMALL = TransformerConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, max_len=128)
N = 64  # new tokens per row
WIDTH = 64  # the batch's prompt width; a prompt alone gets its own (smaller) width


def corpus_prompts(count, seed, low=3, high=40):
  """Byte prompts cut from the pydoc topics, of random lengths."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  text = " ".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    n = int(rng.integers(low, high))
    start = int(rng.integers(0, len(text) - n))
    out.append([256] + list(text[start:start + n]))
  return out


@pytest.fixture(scope="module")
def small():
  model = Transformer(SMALL, rngs=nnx.Rngs(3))
  graphdef, weights = nnx.split(model)
  return graphdef, weights, make_step_fn(graphdef)


def run(graphdef, weights, step_fn, prompts, keys, params, width=None):
  """Right-pad, prefill, decode N tokens: (tokens, logprobs)."""
  tokens, lengths = right_pad(prompts, pad_id=258, width=width)
  logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=tokens.shape[1] + N)
  out = jaxdecode.decode(step_fn, state, logits, key=keys, params=params, max_new_tokens=N,
                         positions=lengths, eos_ids=[257], pad_id=258)
  return np.asarray(out.tokens), np.asarray(out.logprobs)


def row_params(rng, batch):
  """Per-row settings: greedy, top-p and min-p rows mixed."""
  kind = rng.integers(0, 3, batch)
  return SamplingParams(temperature=np.where(kind == 0, 0.0, 0.9).astype(np.float32),
                        top_p=np.where(kind == 1, 0.9, 1.0).astype(np.float32),
                        min_p=np.where(kind == 2, 0.05, 0.0).astype(np.float32))


def needle_mixes(graphdef, weights, step_fn, batches, seed):
  """Yields (alone, in the batch) (tokens, logprobs), one random mix per batch size."""
  rng = np.random.default_rng(seed)
  pool = corpus_prompts(40, seed)
  all_keys = jax.random.split(jax.random.key(seed), 64)
  for m, batch in enumerate(batches):
    slot = int(rng.integers(batch))
    needle = int(rng.integers(len(pool)))
    prompts = [pool[int(i)] for i in rng.integers(0, len(pool), batch)]
    prompts[slot] = pool[needle]
    keys = all_keys[rng.permutation(64)[:batch]]
    params = row_params(rng, batch)
    together = run(graphdef, weights, step_fn, prompts, keys, params, width=WIDTH)
    alone = run(graphdef, weights, step_fn, [pool[needle]], keys[slot:slot + 1],
                params.rows(slice(slot, slot + 1)))  # its own padding width
    yield m, alone, (together[0][slot:slot + 1], together[1][slot:slot + 1])


# Batch sizes that take different kernels: 1 (XLA specializes size-1 dimensions), 2, odd ones,
# and one past 32. Each size is a decode to compile, so the volume of random mixes (the last
# round ran 200 here: 8 minutes) belongs to `jaxdecode audit --mixes N`, which draws random mixes
# of a user's own model on their machine; the suite keeps the sizes that take other kernels.
NEEDLE_BATCHES = [1, 2, 3, 8, 33]


@pytest.mark.slow
def test_needle_alone_equals_the_needle_in_random_batches_bit_for_bit(small):
  count = 0
  for m, alone, together in needle_mixes(*small, batches=NEEDLE_BATCHES, seed=0):
    chex.assert_trees_all_equal(alone, together, custom_message=f"mix {m}")
    count += 1
  assert count == len(NEEDLE_BATCHES)


@pytest.mark.slow
def test_the_plain_numerics_differ_in_some_mix_so_the_needle_test_can_fail():
  """Negative control: the same needle test with `batch_invariant=False` must see a difference
  (it stops at the first mix that shows one: each further mix is a decode to compile)."""
  plain = Transformer(dataclasses.replace(SMALL, batch_invariant=False), rngs=nnx.Rngs(3))
  graphdef, weights = nnx.split(plain)
  step_fn = make_step_fn(graphdef)
  mixes = needle_mixes(graphdef, weights, step_fn, batches=NEEDLE_BATCHES, seed=0)
  assert any(not all(np.array_equal(a, b) for a, b in zip(alone, together))
             for _, alone, together in mixes)


@pytest.mark.slow  # the fast loop keeps test_models' K = 4 and 2 against single steps
def test_k_token_calls_equal_single_steps_bit_for_bit_for_k_up_to_32(small):
  """Speculative verification's call: K tokens per row at once, K = 2 .. 32, against one token
  per call, for rows at different positions."""
  graphdef, weights, step_fn = small
  prompts = corpus_prompts(3, seed=11, low=5, high=30)
  tokens, lengths = right_pad(prompts, pad_id=258, width=32)
  _, state = prefill(graphdef, weights, tokens, lengths, cache_length=64)
  feed = jnp.asarray(np.random.default_rng(2).integers(0, 256, (3, 32)), jnp.int32)
  singles, s = [], state
  for t in range(32):
    logits, s = step_fn(s, feed[:, t], lengths + t)
    singles.append(logits)
  singles = jnp.stack(singles, axis=1)  # [B, 32, V]
  for k in (2, 3, 7, 16, 32):
    many, _ = step_fn(state, feed[:, :k], lengths)
    np.testing.assert_array_equal(many, singles[:, :k], err_msg=f"K = {k}")


@pytest.mark.slow
def test_prefill_whole_in_chunks_and_token_by_token_give_the_same_bits(small):
  graphdef, weights, step_fn = small
  prompts = corpus_prompts(5, seed=7, low=20, high=40)
  tokens, lengths = right_pad(prompts, pad_id=258, width=48)
  whole, _ = prefill(graphdef, weights, tokens, lengths, cache_length=64)
  shortest = int(lengths.min())
  for chunk in (7, 3, 1):
    # The first `chunk` tokens by prefill, the rest `chunk` at a time through the step.
    logits, state = prefill(graphdef, weights, tokens[:, :chunk], jnp.full(5, chunk),
                            cache_length=64)
    seen = {chunk - 1: logits}
    for start in range(chunk, shortest, chunk):
      width = min(chunk, shortest - start)
      step_logits, state = step_fn(state, tokens[:, start:start + width],
                                   jnp.full(5, start, jnp.int32))
      for j in range(width):
        seen[start + j] = step_logits[:, j]
    # Every row's logits after its position shortest - 1 equal the whole prefill's there.
    full = jaxdecode.models.forward(graphdef, weights, tokens, lengths)
    np.testing.assert_array_equal(seen[shortest - 1], full[:, shortest - 1])
  np.testing.assert_array_equal(
      whole, jnp.take_along_axis(full, (lengths - 1)[:, None, None], axis=1)[:, 0])


@pytest.mark.slow
def test_the_embedded_model_prefills_alike_in_one_call_or_token_by_token():
  model, tok = load_default()
  graphdef, weights = nnx.split(model)
  step_fn = make_step_fn(graphdef)
  ids = tok.encode("The for statement is used to iterate over the elements")
  tokens, lengths = right_pad([ids], buckets=None)
  whole, _ = prefill(graphdef, weights, tokens, lengths, cache_length=64)
  logits, state = prefill(graphdef, weights, tokens[:, :1], jnp.array([1]), cache_length=64)
  for p in range(1, len(ids)):
    logits, state = step_fn(state, tokens[:, p], jnp.array([p], jnp.int32))
  np.testing.assert_array_equal(logits, whole)


@pytest.mark.slow
def test_eight_devices_give_the_bits_of_one(tmp_path):
  script = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, %r)
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxdecode
    from jaxdecode.models import Transformer, make_step_fn, prefill
    from jaxdecode.prompts import right_pad
    import test_invariance as t
    assert jax.device_count() == 8
    graphdef, weights = nnx.split(Transformer(t.SMALL, rngs=nnx.Rngs(3)))
    prompts = t.corpus_prompts(16, seed=5)
    tokens, lengths = right_pad(prompts, pad_id=258, width=64)
    logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=64 + t.N)
    keys = jax.random.split(jax.random.key(0), 16)
    params = jaxdecode.SamplingParams(temperature=0.8, top_p=0.9)
    kw = dict(params=params, max_new_tokens=t.N, eos_ids=[257], pad_id=258)
    one = jaxdecode.decode(make_step_fn(graphdef), state, logits, key=keys, positions=lengths,
                           **kw)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows, shared = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    sharded_state = state.replace(weights=jax.device_put(state.weights, shared),
                                  blocks=jax.device_put(state.blocks, shared),
                                  cache=jax.device_put(state.cache, rows))
    out = jaxdecode.decode(make_step_fn(graphdef, mesh=mesh), sharded_state,
                           jax.device_put(logits, rows), key=jax.device_put(keys, rows),
                           positions=jax.device_put(lengths, rows), **kw)
    assert len(out.tokens.sharding.device_set) == 8
    np.testing.assert_array_equal(out.tokens, one.tokens)
    np.testing.assert_array_equal(out.logprobs, one.logprobs)
    print("8 devices equal")
  """) % os.path.dirname(__file__)
  env = dict(os.environ, XLA_FLAGS=conftest.xla_flags("--xla_force_host_platform_device_count=8"))
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "8 devices equal" in result.stdout


def _cpu_has(flag: str) -> bool:
  """Whether this (Linux, x86) CPU lists `flag` in /proc/cpuinfo; True where it cannot tell."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return any(line.startswith("flags") and flag in line.split() for line in f)
  except OSError:
    return True


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["AVX2", "SSE4_2"])
def test_the_bits_stay_batch_invariant_when_xla_may_use_only_an_older_instruction_set(isa):
  """Another CPU, as far as XLA's own code goes: `--xla_cpu_max_isa` limits the instructions XLA
  generates, which is where the invariant numerics run. AVX2 is the developers' CPUs' set;
  SSE4_2 has no FMA, so every product is rounded on its own and the bits change, yet a row
  alone and in batches of 3 and 8, and 5 tokens in one call against 5 calls, stay equal."""
  if isa == "AVX2" and not _cpu_has("avx512f"):
    pytest.skip("this CPU's own set is AVX2 at most: the rest of the suite runs that code")
  script = textwrap.dedent("""
    import sys
    sys.path.insert(0, %r)
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from jaxdecode.models import Transformer, make_step_fn, prefill
    from jaxdecode.prompts import right_pad
    import test_invariance as t
    graphdef, weights = nnx.split(Transformer(t.SMALL, rngs=nnx.Rngs(3)))
    step_fn = make_step_fn(graphdef)
    pool = t.corpus_prompts(8, seed=9)
    feed = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 5)), jnp.int32)

    def steps(rows, width):
      tokens, lengths = right_pad([pool[r] for r in rows], pad_id=258, width=width)
      logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=64)
      out, s = [logits], state
      for i in range(5):
        logits, s = step_fn(s, feed[np.array(rows), i], lengths + i)
        out.append(logits)
      many, _ = step_fn(state, feed[np.array(rows)], lengths)
      np.testing.assert_array_equal(many, jnp.stack(out[1:], axis=1))  # K = 5 vs 5 calls
      return np.stack(out, axis=1)

    alone = steps([2], None)[0]
    for rows in ([0, 1, 2], [7, 6, 5, 4, 3, 2, 1, 0]):
      np.testing.assert_array_equal(steps(rows, 48)[rows.index(2)], alone)
    print("invariant under", %r)
  """) % (os.path.dirname(__file__), isa)
  env = dict(os.environ, XLA_FLAGS=f"--xla_cpu_max_isa={isa}", JAX_COMPILATION_CACHE_DIR="")
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"invariant under {isa}" in result.stdout


@pytest.mark.slow
def test_the_constructions_tests_pass_under_xlas_default_code_generation():
  """The suite compiles with XLA:CPU's older element-wise emitters, LLVM at -O0 and no FMA
  instructions (tests/conftest.py), which changes where XLA's own kernels round differently
  (e.g. `exp` at some array lengths takes another code path only in vectorized code) and which
  multiply-adds are fused. The tests of the invariant numerics and of `batch_invariant`, and
  the embedded model's decode step against its full forward pass (two programs that must fuse
  their multiply-adds alike), therefore run once more, in runs of their own compiled with
  XLA's defaults, where those kernels are the ones users get."""
  fast = conftest._FAST_COMPILE
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in fast)
  env = dict(os.environ, XLA_FLAGS=flags, JAXDECODE_TEST_XLA_FLAGS="default")
  here = os.path.dirname(__file__)
  runs = [["-m", "not slow", *(os.path.join(here, name)
                               for name in ("test_numerics.py", "test_batch_invariant.py"))],
          [os.path.join(here, "test_models.py") + "::" + name for name in (
              "test_cached_decoding_matches_full_forward_at_every_step_bit_for_bit",
              "test_a_k_token_step_equals_k_single_steps_bit_for_bit")]]
  for tests in runs:
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p",
                             "no:cacheprovider", "-o", "addopts=", "-q", *tests],
                            env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", result.stdout) and "failed" not in result.stdout


# ---------------------------------------------------------------------------------------------
# The audit.


@pytest.mark.slow
def test_the_audit_finds_nothing_on_an_invariant_model_and_reports_the_mixes(small):
  graphdef, weights, step_fn = small
  model = nnx.merge(graphdef, weights)
  report = jaxdecode.audit(batch_prefill(model, extra=16), step_fn, corpus_prompts(8, 3),
                           steps=16, mixes=5, max_batch=6)
  assert len(report.mixes) == 5 and report.divergent == 0 and report.flipped == 0
  assert all(m.max_abs_diff == 0 and 2 <= m.batch <= 6 for m in report.mixes)
  assert "0 of 5 mixes diverge" in report.format_table()


def test_the_audit_catches_a_model_whose_logits_depend_on_the_batch():
  vocab = 13
  table = toy_model.table(vocab)
  step = toy_model.make_step(table)

  def leaky_step(state, tokens, positions):  # adds a term that depends on the other rows
    logits, state = step(state, tokens, positions)
    return logits + 0.3 * jnp.mean(logits, axis=0, keepdims=True), state

  def leaky_prefill(prompts):
    logits, state, positions = toy_model.prefill(table, prompts)
    return logits + 0.3 * jnp.mean(logits, axis=0, keepdims=True), state, positions

  prompts = [[1, 2, 3], [4], [5, 6, 7, 8], [2, 2], [9, 0, 1]]
  report = jaxdecode.audit(leaky_prefill, leaky_step, prompts, steps=12, mixes=6, max_batch=4)
  assert report.divergent == 6  # every mix: step 0 already differs
  assert all(m.first_logit_divergence == 0 and m.max_abs_diff > 0 for m in report.mixes)
  assert report.flipped > 0 and sum(m.tokens_flipped for m in report.mixes) > 0
  honest = jaxdecode.audit(lambda p: toy_model.prefill(table, p), step, prompts, steps=12,
                           mixes=6, max_batch=4)
  assert honest.divergent == 0


def test_the_audit_rejects_bad_arguments():
  with pytest.raises(ValueError, match="at least 2 prompts"):
    jaxdecode.audit(lambda p: None, lambda s, t, p: None, [[1, 2]])
  with pytest.raises(ValueError, match="max_batch must be an integer >= 2"):
    jaxdecode.audit(lambda p: None, lambda s, t, p: None, [[1], [2]], max_batch=1)


@pytest.mark.slow
def test_the_audit_command_runs_both_modes_on_a_checkpoint(tmp_path, capsys):
  from jaxdecode.models import save_checkpoint  # pylint: disable=import-outside-toplevel
  from jaxdecode.tools import cli  # pylint: disable=import-outside-toplevel
  tiny = TransformerConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=192)
  path = str(tmp_path / "tiny.msgpack")
  save_checkpoint(path, tiny, nnx.split(Transformer(tiny, rngs=nnx.Rngs(0)))[1])
  code = cli.main(["audit", "--model", path, "--mixes", "2", "--steps", "4", "--max-batch",
                   "3", "--verbose"])
  out = capsys.readouterr().out
  assert code == 0
  lines = out.splitlines()
  invariant = next(line for line in lines if line.startswith("batch-invariant "))
  assert invariant.split() == ["batch-invariant", "2", "0", "0", "0"]
  assert any(line.startswith("plain XLA ") for line in lines)
  assert "--- batch-invariant" in out and "0 of 2 mixes diverge" in out
  code = cli.main(["audit", "--model", path, "--max-batch", "1"])
  err = capsys.readouterr().err
  assert code == 2 and "--max-batch must be at least 2" in err and len(err.splitlines()) == 1


def test_the_audit_command_names_the_steps_that_do_not_fit_and_a_negative_seed(tmp_path,
                                                                               capsys):
  from jaxdecode.models import save_checkpoint  # pylint: disable=import-outside-toplevel
  from jaxdecode.tools import cli  # pylint: disable=import-outside-toplevel
  tiny = TransformerConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=192)
  path = str(tmp_path / "tiny.msgpack")
  save_checkpoint(path, tiny, nnx.split(Transformer(tiny, rngs=nnx.Rngs(0)))[1])
  # The audit's prompts are cut from the pydoc topics, 4..121 tokens, padded to a bucket.
  widest = max(len(p) for p in cli.audit_prompts(16, 0))
  width = min(b for b in (8, 16, 32, 64, 128) if b >= widest)
  for argv, message in [
      (["--steps", "100"], f"--steps 100 does not fit: the audit's prompts take up to {width} "
                           f"tokens (padded) of the model's context of 192; use --steps "
                           f"{192 - width} or fewer"),
      (["--seed", "-1"], "argument --seed: expected a seed in [0, 2**32), got -1")]:
    code = cli.main(["audit", "--model", path, "--mixes", "1", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
