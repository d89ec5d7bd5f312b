"""SamplingParams: a pytree of traced per-row values with eager validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import SamplingParams


def test_defaults_are_the_disabled_values():
  p = SamplingParams()
  assert (float(p.temperature), int(p.top_k), float(p.top_p), float(p.min_p)) == (1.0, 0, 1.0, 0.0)
  assert p.top_k.dtype == jnp.int32 and p.temperature.dtype == jnp.float32


def test_is_a_pytree_of_thirty_leaves_that_round_trips():
  p = SamplingParams(temperature=[0.5, 1.0], top_k=3, top_p=0.9, min_p=0.1)
  leaves, treedef = jax.tree.flatten(p)
  # 24 number fields, logit_bias (ids, biases), banned and allowed ids, DRY's sequence
  # breakers, bad words.
  assert len(leaves) == 30
  q = jax.tree.unflatten(treedef, leaves)
  assert isinstance(q, SamplingParams)
  np.testing.assert_array_equal(q.temperature, [0.5, 1.0])


@pytest.mark.parametrize("field,value,fragment", [
    ("temperature", -0.1, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "got nan"),
    ("temperature", float("inf"), "got inf"),
    ("top_k", -1, "top_k must be an integer >= 0"),
    ("top_k", 2.5, "pass integers"),
    ("top_k", 3.0, "pass integers"),
    ("top_k", True, "boolean"),
    ("top_p", 0.0, "0 < top_p <= 1"),
    ("top_p", 1.5, "got 1.5"),
    ("top_p", float("nan"), "got nan"),
    ("min_p", -0.01, "0 <= min_p <= 1"),
    ("min_p", float("nan"), "got nan"),
    ("top_p", "high", "top_p must be"),
])
def test_bad_values_raise_value_error_naming_field_value_and_range(field, value, fragment):
  with pytest.raises(ValueError) as info:
    SamplingParams(**{field: value})
  message = str(info.value)
  assert field in message and fragment in message


def test_bad_entry_of_a_per_row_array_is_named_with_its_index():
  with pytest.raises(ValueError, match=r"top_p\[2\] = 1.5"):
    SamplingParams(top_p=[0.9, 1.0, 1.5])
  with pytest.raises(ValueError, match=r"scalar or a 1-D array"):
    SamplingParams(temperature=np.ones((2, 2)))


def test_replace_validates_and_rejects_unknown_fields():
  p = SamplingParams(top_p=0.9)
  assert float(p.replace(top_k=5).top_k) == 5
  with pytest.raises(ValueError, match="top_k"):
    p.replace(top_k=-3)
  with pytest.raises(ValueError, match="unknown SamplingParams field"):
    p.replace(topp=0.5)


def test_broadcast_checks_the_batch_size():
  p = SamplingParams(temperature=[0.1, 0.2, 0.3])
  assert p.broadcast(3).top_p.shape == (3,)
  with pytest.raises(ValueError, match=r"temperature has shape \(3,\) but the batch has 4 rows"):
    p.broadcast(4)


def test_traced_values_are_accepted_and_sanitized_under_jit():
  @jax.jit
  def build(t, k, p, m):
    return SamplingParams(t, k, p, m).sanitized()

  s = build(jnp.array([jnp.nan, -1.0, 0.5]), jnp.array([-4, 0, 7]),
            jnp.array([jnp.nan, -0.5, 2.0]), jnp.array([jnp.nan, -1.0, 3.0]))
  np.testing.assert_array_equal(s.temperature, [0.0, 0.0, 0.5])
  np.testing.assert_array_equal(s.top_k, [0, 0, 7])
  np.testing.assert_array_equal(s.top_p, [1.0, 0.0, 1.0])
  np.testing.assert_array_equal(s.min_p, [0.0, 0.0, 1.0])


def test_traced_float_top_k_is_rejected_at_trace_time():
  with pytest.raises(ValueError, match="top_k must be an integer"):
    jax.jit(lambda k: SamplingParams(top_k=k))(jnp.float32(3))


def test_params_work_as_vmap_in_axes_and_tree_map():
  p = SamplingParams(temperature=[0.5, 1.0])
  doubled = jax.tree.map(lambda v: v * 2, p)
  np.testing.assert_array_equal(doubled.temperature, [1.0, 2.0])
  axes = jax.tree.map(lambda v: 0 if v is p.temperature else None, p)
  out = jax.vmap(lambda q: q.temperature + q.top_p, in_axes=(axes,))(p)
  np.testing.assert_array_equal(out, [1.5, 2.0])
  assert jaxdecode.SamplingParams is SamplingParams


def test_equality_is_identity_not_an_ambiguous_array_comparison():
  p = SamplingParams(temperature=[0.5, 1.0])
  q = SamplingParams(temperature=[0.5, 1.0])
  assert p == p and p != q  # no "truth value of an array is ambiguous"
  assert p in [p] and len({p, q}) == 2


@pytest.mark.slow
def test_rows_selects_permutes_and_slices_per_row_fields_and_keeps_shared_ones():
  p = SamplingParams(temperature=[0.0, 0.5, 1.0], top_p=0.9,
                     banned_token_ids=[[1], [2, 3], []], allowed_token_ids=[7, 8],
                     logit_bias=[{1: 1.0}, None, {4: -2.0}])
  q = p.rows(np.array([2, 0]))
  assert q.temperature.tolist() == [1.0, 0.0]
  assert float(q.top_p) == pytest.approx(0.9) and q.top_p.shape == ()
  assert q.banned_token_ids.tolist() == [[-1] * 8, [1] + [-1] * 7]
  assert q.allowed_token_ids.tolist() == p.allowed_token_ids.tolist()  # shared: unchanged
  assert q.logit_bias[0][:, 0].tolist() == [4, 1] and q.logit_bias[1][:, 0].tolist() == [-2, 1]
  # A slice, and the same rows of the broadcast params.
  s = p.rows(slice(1, 3))
  b = p.broadcast(3)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.broadcast_to(x, y.shape), y),
               s.broadcast(2), b.rows(slice(1, 3)))
  # Sampling the selected rows equals sampling all rows and selecting.
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, 10)), jnp.float32)
  keys = jax.random.split(jax.random.key(0), 3)
  idx = np.array([2, 0, 1])
  np.testing.assert_array_equal(jaxdecode.sample(keys[idx], logits[idx], p.rows(idx)),
                                np.asarray(jaxdecode.sample(keys, logits, p))[idx])


def test_broadcast_params_can_be_sharded_over_a_mesh():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  p = SamplingParams(temperature=[0.5, 1.0], top_k=3, banned_token_ids=[4])
  placed = jax.device_put(p.broadcast(2), sharding)  # every leaf has the batch first
  assert isinstance(placed, SamplingParams) and placed.top_k.tolist() == [3, 3]
