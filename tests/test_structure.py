"""The promise checked from the program: lowered for cpu, cuda and tpu (no device needed), the
batch-invariant passes leave no float sum to the backend.

`jaxdecode.invariance.unordered_sums` walks a program's StableHLO and lists every float dot,
add-reduce, add-reduce_window, convolution and scatter-add over more than one term: the ops whose
order (and so whose bits) a backend chooses per shape. The invariant model's step (1 and K
tokens), its prefill (16 tokens: a multi-token program in the fast loop) and the sampling chain
must hold none on any platform; the plain model is the negative control, and small programs
with hand-known answers test the walker itself.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode import SamplingParams
from jaxdecode import _reduce
from jaxdecode.invariance import unordered_sums
from jaxdecode.models import Transformer, TransformerConfig, make_step_fn, prefill

PLATFORMS = ("cpu", "cuda", "tpu")
# Widths that take several chain blocks (80 = 2.5 blocks of 32), an odd vocabulary and 2 heads.
TINY = TransformerConfig(d_model=80, n_layers=2, n_heads=2, d_ff=96, max_len=128)
F32 = jnp.float32


def _step_and_state(invariant):
  model = Transformer(dataclasses.replace(TINY, batch_invariant=invariant), rngs=nnx.Rngs(0))
  graphdef, weights = nnx.split(model)
  tokens = jnp.ones((3, 8), jnp.int32)
  _, state = prefill(graphdef, weights, tokens, jnp.array([8, 5, 2]), cache_length=64)
  return graphdef, weights, make_step_fn(graphdef), state


@pytest.fixture(scope="module")
def invariant():
  return _step_and_state(True)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("width", [1, 5, 32])
@pytest.mark.slow
def test_the_invariant_step_leaves_no_sum_to_the_backend(invariant, platform, width):
  _, _, step_fn, state = invariant
  tokens = jnp.zeros((3,) if width == 1 else (3, width), jnp.int32)
  assert unordered_sums(step_fn, state, tokens, jnp.array([8, 5, 2]), platform=platform) == []


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_invariant_prefill_leaves_no_sum_to_the_backend(invariant, platform):
  graphdef, weights, _, _ = invariant
  fn = lambda w, t, n: prefill(graphdef, w, t, n, cache_length=64)[0]
  args = (weights, jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
  assert unordered_sums(fn, *args, platform=platform) == []


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_sampling_chain_leaves_no_sum_to_the_backend(platform):
  """Every processor on (bans, bias with duplicate ids, penalties, temperature, top-k, top-p,
  min-p, typical, epsilon, eta), then the draw and its log-probability."""
  batch, vocab = 4, 300
  params = SamplingParams(
      temperature=jnp.array([0.0, 1.0, 0.7, 1.3]), top_k=jnp.array([0, 0, 40, 5]),
      top_p=jnp.array([1.0, 0.9, 0.5, 1.0]), min_p=jnp.array([0.0, 0.0, 0.1, 0.0]),
      typical_p=jnp.array([1.0, 0.8, 1.0, 1.0]), epsilon_cutoff=jnp.array([0.0, 0.0, 1e-4, 0.0]),
      eta_cutoff=jnp.array([0.0, 0.0, 0.0, 1e-3]), banned_token_ids=[[3], [], [7, 8], []],
      logit_bias=[{5: 1.0}, {}, {9: -2.0}, {}], repetition_penalty=jnp.array([1.0, 1.2, 1.0, 1.0]),
      frequency_penalty=jnp.array([0.0, 0.5, 0.0, 0.0]))
  counts = jax.ShapeDtypeStruct((batch, vocab), jnp.int32)
  fn = lambda key, logits, counts: jaxdecode.sample_with_logprobs(
      key, jaxdecode.process_logits(logits, params, counts=counts),
      SamplingParams(temperature=params.temperature))
  assert unordered_sums(fn, jax.random.key(0), jax.ShapeDtypeStruct((batch, vocab), F32), counts,
                        platform=platform) == []


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.slow),
                                      pytest.param("tpu", marks=pytest.mark.slow)])
def test_the_trainer_s_score_leaves_no_sum_to_the_backend(invariant, platform):
  """`jaxdecode.score` over the invariant forward (every kind, a truncation, a penalty): its
  forward program orders every sum itself, as decode's does, so its bits are decode's on
  every backend (its backward, the plain training pass, is not promised bitwise)."""
  graphdef, weights, _, _ = invariant
  params = SamplingParams(temperature=jnp.array([0.0, 0.7, 1.2]), top_p=0.9,
                          frequency_penalty=jnp.array([0.0, 0.5, 0.0]))
  fn = lambda w, t, n, new: jaxdecode.score(jaxdecode.models.forward_fn(graphdef, w), t, n, new,
                                            params=params, eos_ids=[257], pad_id=258)
  args = (weights, jax.ShapeDtypeStruct((3, 8), jnp.int32), jax.ShapeDtypeStruct((3,), jnp.int32),
          jax.ShapeDtypeStruct((3, 4), jnp.int32))
  assert unordered_sums(fn, *args, platform=platform) == []


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.slow),
                                      pytest.param("tpu", marks=pytest.mark.slow)])
def test_negative_control_the_plain_step_leaves_its_products_and_sums_to_the_backend(platform):
  _, _, step_fn, state = _step_and_state(False)
  found = unordered_sums(step_fn, state, jnp.zeros((3,), jnp.int32), jnp.array([8, 5, 2]),
                         platform=platform)
  # Per layer: qkv, out, mlp in, mlp out, q.k and p.v products, two norms, the softmax sum;
  # then the final norm and the logits.
  assert sum("dot_general" in line for line in found) == 2 * 6 + 1
  assert sum("stablehlo.reduce adds" in line for line in found) == 2 * 3 + 1


def test_the_walker_lists_what_the_backend_orders_and_nothing_else():
  x, w = jax.ShapeDtypeStruct((4, 8), F32), jax.ShapeDtypeStruct((8, 3), F32)
  assert len(unordered_sums(lambda x, w: x @ w, x, w)) == 1
  assert "contracts 8 terms" in unordered_sums(lambda x, w: x @ w, x, w)[0]
  assert len(unordered_sums(lambda x: jnp.sum(x, axis=1), x)) == 1
  assert len(unordered_sums(lambda x: jnp.cumsum(x, axis=1), x)) == 1
  assert len(unordered_sums(lambda x: jnp.zeros(9).at[jnp.array([1, 1])].add(x[0, :2]), x)) == 1
  # Products of one term, integer sums, maxima, argmax, sorts and the fixed trees: none.
  assert unordered_sums(lambda x: x[:, :1] @ x[:1, :], x) == []
  assert unordered_sums(lambda x: jnp.sum(x.astype(jnp.int32), axis=1), x) == []
  assert unordered_sums(lambda x: (jnp.max(x, 1), jnp.argmax(x, 1), jnp.sort(x, 1)), x) == []
  assert unordered_sums(lambda x: (_reduce.row_sum(x), _reduce.row_cumsum(x)), x) == []
  assert unordered_sums(lambda x: jnp.sum(x[:, :1], axis=1), x) == []  # one term
  # Inside loops and branches too.
  looped = lambda x, w: jax.lax.fori_loop(0, 3, lambda i, a: a + jnp.sum(x @ w), 0.0)
  assert len(unordered_sums(looped, x, w)) == 2


def test_the_walker_rejects_an_unknown_platform():
  with pytest.raises(ValueError, match="platform must be"):
    unordered_sums(jnp.sum, jax.ShapeDtypeStruct((3,), F32), platform="gpu")


def test_the_invariant_chain_matmul_is_the_float64_product_to_float32_accuracy():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 1000)).astype(np.float32)
  w = (rng.standard_normal((1000, 259)) / 30).astype(np.float32)
  from jaxdecode.models import numerics  # pylint: disable=import-outside-toplevel
  got = np.asarray(numerics.linear(jnp.asarray(x), jnp.asarray(w), invariant=True), np.float64)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  bound = 1000 * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w))
  assert np.all(np.abs(got - exact) <= bound)
