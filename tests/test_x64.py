"""`jax_enable_x64` (a common global setting in scientific JAX code) changes nothing jaxdecode
returns: the main entry points run in a subprocess with x64 on and in one with it off, and every
token, log-probability (bit for bit), dtype and text is the same.

Without explicit dtypes, x64 turns bare `jnp.full`, `jnp.arange` and Python-scalar arithmetic into
float64/int64: before issue 33 every sampler failed under it ("cond branches must have equal
output types"), and a silently widened sum would change bits.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

import jaxdecode

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import jax
    jax.config.update("jax_enable_x64", {x64})
    import jax.numpy as jnp
    import numpy as np
    import jaxdecode
    from jaxdecode import SamplingParams, models
    import toy_model

    def bits(x):
      x = np.asarray(x)
      if x.dtype.kind == "f":
        return [str(x.dtype), np.asarray(x, np.float32).view(np.uint32).tolist()]
      return [str(x.dtype), x.tolist()]

    out = {{"x64": jnp.zeros(1).dtype == jnp.float64}}
    vocab = 13
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, vocab)) * 3, jnp.float32)
    counts = jnp.asarray(rng.integers(0, 3, (4, vocab)), jnp.int32)
    params = SamplingParams(
        temperature=np.array([0.0, 0.7, 1.3, 1.0], np.float32), top_k=[0, 5, 0, 3],
        top_p=np.array([1.0, 0.9, 0.8, 1.0], np.float32), min_p=[0.0, 0.0, 0.05, 0.0],
        typical_p=[1.0, 1.0, 1.0, 0.9], epsilon_cutoff=[0.0, 0.01, 0.0, 0.0],
        eta_cutoff=[0.0, 0.0, 0.02, 0.0], repetition_penalty=[1.0, 1.3, 1.0, 1.1],
        presence_penalty=[0.0, 0.2, 0.0, 0.0], frequency_penalty=[0.0, 0.0, 0.3, 0.0],
        logit_bias=[{{1: 2.0}}, None, {{3: -1.5}}, None], banned_token_ids=[[], [2], [], []],
        allowed_token_ids=[[], [], [], [0, 1, 4, 5, 6]])
    for name, key in (("typed", jax.random.key(7)), ("legacy", jax.random.PRNGKey(7))):
      tokens, logprobs = jaxdecode.sample_with_logprobs(key, logits, params, counts=counts)
      out["sample_" + name] = [bits(tokens), bits(logprobs)]
    out["greedy"] = bits(jaxdecode.greedy(logits))
    out["process_logits"] = bits(jaxdecode.process_logits(logits, params, counts=counts))
    out["process_bf16"] = bits(jaxdecode.process_logits(logits.astype(jnp.bfloat16), params,
                                                        counts=counts).astype(jnp.float32))

    table = toy_model.table(vocab)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2]]
    first, state, positions = toy_model.prefill(table, prompts)
    loop = dict(params=params.replace(min_new_tokens=np.array([0, 2, 0, 1], np.int32)),
                max_new_tokens=8, positions=positions, eos_ids=[4], pad_id=12)
    dec = jaxdecode.decode(toy_model.make_step(table), state, first, key=jax.random.key(3),
                           top_logprobs=3, **loop)
    out["decode"] = [bits(getattr(dec, f)) for f in ("tokens", "logprobs", "lengths", "finished",
                                                   "dead_end", "top_tokens", "top_logprobs")]
    beams = jaxdecode.beam_search(toy_model.make_step(table), state, first, beam_size=3,
                                  length_penalty=0.7, early_stopping="never", **loop)
    out["beam_search"] = [bits(getattr(beams, f)) for f in ("tokens", "scores", "lengths",
                                                          "finished", "logprobs", "dead_end")]
    first, state, positions = toy_model.prefill_cached(table, prompts, 32)
    drafter = jaxdecode.NgramDrafter(*jaxdecode.right_pad(prompts, width=8))
    spec = jaxdecode.speculative_decode(toy_model.make_cached_step(table), state, first,
                                        key=jax.random.key(3), drafter=drafter,
                                        num_draft_tokens=3, **dict(loop, positions=positions))
    out["speculative_decode"] = [bits(getattr(spec, f)) for f in (
        "tokens", "logprobs", "lengths", "finished", "accepted")]

    model, _ = models.load_default()
    gen = models.generate(["def f(x):", "The"], model=model, max_new_tokens=6, seed=1,
                          params=SamplingParams(temperature=0.8, top_p=0.9))
    out["generate"] = [gen.texts, bits(gen.tokens), bits(gen.logprobs), bits(gen.lengths)]
    gen = models.generate(["def f(x):"], model=model, max_new_tokens=4, beam_size=2)
    out["generate_beams"] = [gen.beams, bits(gen.scores)]
    print("RESULT " + json.dumps(out))
""")


def run(x64: bool) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("JAX_ENABLE_X64", None)
  script = SCRIPT.format(tests=os.path.dirname(__file__), x64=x64)
  return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def results(proc: subprocess.Popen) -> dict:
  stdout, stderr = proc.communicate(timeout=900)  # about 100 s on 2 busy cores
  assert proc.returncode == 0, stderr[-3000:]
  out = {}
  for line in stdout.splitlines():
    if line.startswith("RESULT "):
      out.update(json.loads(line[len("RESULT "):]))
  return out


def compare() -> list:
  with run(True) as proc_on, run(False) as proc_off:  # both at once
    try:
      on, off = results(proc_on), results(proc_off)
    finally:  # a failure or timeout leaves no process behind (nor its pipes open)
      for proc in (proc_on, proc_off):
        if proc.poll() is None:
          proc.kill()
  assert on.pop("x64") is True and off.pop("x64") is False  # the setting took effect
  assert on.keys() == off.keys()
  for name in off:
    assert on[name] == off[name], name
  assert "int64" not in json.dumps(on) and "float64" not in json.dumps(on)
  return sorted(on)


@pytest.mark.slow
def test_the_entry_points_and_generate_return_the_same_bits_and_texts_with_x64_on():
  """One pair of processes (x64 on, x64 off) runs the core entry points on toy models, then
  `generate` (sampled and with beams) through the embedded model: the models' numerics under x64
  are only checked where they run for real."""
  assert compare() == ["beam_search", "decode", "generate", "generate_beams",
                                      "greedy", "process_bf16", "process_logits",
                                      "sample_legacy", "sample_typed", "speculative_decode"]


def sixty_four_bit_arrays(jaxpr, found=None) -> list:
  """Every equation of a traced program (sub-programs included) with a 64-bit array output."""
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      aval = var.aval
      if (getattr(aval, "ndim", 0) >= 1 and not jnp.issubdtype(aval.dtype, jax.dtypes.prng_key)
          and aval.dtype.itemsize == 8):
        found.append(f"{eqn.primitive} {aval.str_short()}")
    for value in eqn.params.values():  # sub-programs: jit, cond branches, scan/while bodies
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sixty_four_bit_arrays(sub.jaxpr, found)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          sixty_four_bit_arrays(sub, found)
  return found


@pytest.mark.slow
def test_no_float64_or_int64_array_is_left_inside_the_loops_under_x64():
  # The structural side of the same promise, fast and in this process: traced with x64 on, the
  # sampler, decode, beam search and speculative decoding hold no 64-bit array (only weakly
  # typed scalar constants, which stay float32 in use). Tracing only: nothing compiles.
  # pylint: disable=protected-access
  from jaxdecode import beam, decoding, sampling, speculative  # pylint: disable=import-outside-toplevel
  import toy_model  # pylint: disable=import-outside-toplevel
  vocab, batch = 11, 2
  params = jaxdecode.SamplingParams(
      temperature=[0.5, 0.0], top_k=[0, 3], top_p=0.9, min_p=0.1, typical_p=0.9,
      epsilon_cutoff=0.01, eta_cutoff=0.01, repetition_penalty=1.2, presence_penalty=0.1,
      frequency_penalty=0.1, logit_bias={1: 2.0}, banned_token_ids=[3], min_new_tokens=1,
      top_n_sigma=1.0, xtc_probability=0.5, dynatemp_range=0.5, dry_multiplier=0.8,
      dry_sequence_breakers=[2], mirostat=[2, 0], no_repeat_ngram_size=2, bad_words=[[1, 5]])
  table = toy_model.table(vocab)
  with jax.enable_x64(True):
    assert jnp.zeros(1).dtype == jnp.float64  # the setting is on here
    p = params.broadcast(batch, vocab)
    logits, key = jnp.zeros((batch, vocab), jnp.float32), jax.random.key(0)
    counts, positions = jnp.zeros((batch, vocab), jnp.int32), jnp.ones(batch, jnp.int32)
    eos, pad = jnp.array([4], jnp.int32), jnp.int32(0)
    step, cached = toy_model.make_step(table), toy_model.make_cached_step(table)
    state = {"h": jnp.zeros(batch, jnp.int32), "calls": jnp.int32(0)}
    cached_state = {"h": jnp.zeros((batch, 16), jnp.int32), "calls": jnp.int32(0)}
    drafter = jaxdecode.NgramDrafter(jnp.zeros((batch, 3), jnp.int32), positions)
    programs = {
        "sample": lambda: sampling._sample(key, logits, p, counts),
        "sample_with_history": lambda: sampling._sample(key, logits, p, counts,
                                                        jnp.zeros((batch, 5), jnp.int32)),
        "decode": lambda: decoding._decode(step, state, logits, key, p, positions, eos, pad,
                                           counts, (), None, max_new_tokens=4, chunk_size=2,
                                           top_logprobs=2, logprobs_mode="raw"),
        "beam_search": lambda: beam._beam_search(
            step, state, logits, p, positions, eos, pad, counts, jnp.float32(0.7), (), None,
            axes=(None, 0), beam_size=2, num_return=2, max_new_tokens=4,
            early_stopping="never", chunk_size=2),
        "speculative_decode": lambda: speculative._speculative(
            cached, cached_state, logits, key, p, positions, eos, pad, counts, (), drafter, None,
            max_new_tokens=4, num_draft_tokens=2, chunk_size=2),
    }
    found = {name: sixty_four_bit_arrays(jax.make_jaxpr(fn)().jaxpr)
             for name, fn in programs.items()}
  assert found == {name: [] for name in programs}
