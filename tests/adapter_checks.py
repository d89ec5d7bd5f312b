"""Bitwise checks of an adapter under `batch_invariant`, shared by tests/test_adapters.py and
tests/test_nnx_adapter.py: the needle (a prompt alone, then at a random slot of batches of other
sizes beside prompts of other lengths, with their own keys and sampling parameters) and
speculative decoding with a draft of the same family against decoding without one."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecode

NEEDLE = "the quick brown fox"


def bits(x):
  """The bits of a float array, for comparisons that NaN and -0.0 cannot fool."""
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def needle_run(adapter, prompts, keys, temperature, top_p, new):
  """`decode` through `adapter` on right-padded `prompts`: (tokens, lengths, params, output)."""
  ids = [adapter.tokenizer.encode(p) for p in prompts]
  tokens, lengths = jaxdecode.right_pad(ids, pad_id=adapter.pad_id, buckets=None)
  logits, state, positions = adapter.prefill(tokens, lengths, tokens.shape[1] + new)
  params = jaxdecode.SamplingParams(temperature=temperature, top_p=top_p)
  out = jaxdecode.decode(adapter.step_fn, state, logits, key=keys, max_new_tokens=new,
                         params=params, positions=positions, eos_ids=adapter.eos_ids,
                         pad_id=adapter.pad_id)
  return tokens, lengths, params, out


def check_needle(adapter, texts, new, sizes=(2, 7)):
  """The needle alone, then in batches of `sizes` (prompts cut from `texts`): tokens and
  log-probs bitwise. Returns the last batch's `needle_run`."""
  key = jax.random.key(39)
  alone = needle_run(adapter, [NEEDLE], key[None], np.float32([0.9]), np.float32([0.9]), new)[3]
  for size in sizes:
    rng = np.random.default_rng(size)
    slot = int(rng.integers(size))
    prompts = [texts[int(rng.integers(len(texts)))][:int(rng.integers(1, 30))] or "x"
               for _ in range(size)]
    keys = list(jax.random.split(jax.random.key(size), size))
    temperature, top_p = rng.uniform(0.6, 1.4, size), rng.uniform(0.7, 1.0, size)
    prompts[slot], keys[slot], temperature[slot], top_p[slot] = NEEDLE, key, 0.9, 0.9
    run = needle_run(adapter, prompts, jnp.stack(keys), temperature.astype(np.float32),
                     top_p.astype(np.float32), new)
    out = run[3]
    np.testing.assert_array_equal(out.tokens[slot], alone.tokens[0], err_msg=f"batch of {size}")
    np.testing.assert_array_equal(bits(out.logprobs[slot]), bits(alone.logprobs[0]),
                                  err_msg=f"batch of {size}")
  return run


def check_speculative(adapter, draft, prompts):
  """`generate(draft=draft)` gives `generate()`'s tokens, log-probs and texts bitwise (n = 2,
  top-p sampling), with rows accepting different numbers of drafts."""
  options = dict(model=adapter, max_new_tokens=12, n=2, seed=3,
                 params=jaxdecode.SamplingParams(temperature=0.7, top_p=0.9))
  plain = jaxdecode.models.generate(prompts, **options)
  fast = jaxdecode.models.generate(prompts, **options, draft=draft, num_draft_tokens=3)
  np.testing.assert_array_equal(fast.tokens, plain.tokens)
  np.testing.assert_array_equal(bits(fast.logprobs), bits(plain.logprobs))
  assert fast.texts == plain.texts
  assert 0 < fast.accepted.sum() < fast.drafted.sum()
  assert len(set(fast.accepted.tolist())) > 1
