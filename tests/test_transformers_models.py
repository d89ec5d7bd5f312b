"""Models no one here wrote: transformers' Flax GPT-2 and Llama, decoded by `jaxdecode.decode`.

Tiny random-weight configs built here (nothing is downloaded). Each model is driven by a step
function written below around the model's own cache (`init_cache`, `past_key_values`), with the
attention mask and position ids laid out as transformers' `FlaxGenerationMixin.generate` lays
them out for left-padded prompts (`prepare_inputs_for_generation`): the prompt's mask followed by
ones up to the cache length, position ids the mask's cumulative sum minus one (padding gets -1),
then one more per step. Every row writes its keys and values at the model's one shared
`cache_index`, so a prompt left-padded in a batch has its tokens at other cache slots than alone.

The promise checked (`jaxdecode.batch_invariant`, see jaxdecode/batch_invariant.py): a prompt's
sampled tokens and log-probs are bitwise the same alone and in batches of 5 and 12 beside
prompts of other lengths, with per-row keys and sampling parameters. It follows from the
construction (every float sum an in-order chain, `exp` in basic arithmetic), not from this
machine's kernels; the same test under plain numerics is a negative control, reported (not
asserted) when it does not fail here.
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import batch_invariant
from jaxdecode.invariance import _greedy_run
from jaxdecode.invariance import unordered_sums

transformers = pytest.importorskip("transformers")
import hf_models  # pylint: disable=wrong-import-position

VOCAB = 97
CACHE = 24  # cache slots of every run: one decode program per batch size and step function
NEW = 8  # new tokens per row
POSITIONS = 32  # the models' position tables; `generate` (prompt + NEW slots) also fits
NEEDLES = (1, CACHE - NEW + 1)  # prompt lengths: one token, and the longest that fits
PAD, EOS = 0, VOCAB - 1


@pytest.fixture(autouse=True)
def _numpy_rank_promotion():
  """transformers' Flax code relies on NumPy's rank promotion (a bias [F] added to [B, T, F]),
  which tests/conftest.py makes JAX refuse for jaxdecode's own code."""
  with jax.numpy_rank_promotion("allow"):
    yield


def _bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ---------------------------------------------------------------------------------------------
# The models: tiny configs, random weights drawn with NumPy (tests/hf_models.py).


def _model(family, dtype=jnp.float32):
  return hf_models.model(family, VOCAB, POSITIONS, EOS, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The step function around the model's cache, and a run: left-pad, prefill, decode.


def model_fns(model, params, closes_over_weights=False):
  """The prefill and the step function (decode's contract) around the model's own cache.

  prefill(weights, tokens [B, T], mask [B, CACHE], position_ids [B, T], cache) -> (logits
  [B, V], cache); step(state, tokens [B], positions [B]) -> (logits [B, V], state), the state
  {"cache", "mask"} and, unless the functions close over the weights, "params".
  """

  def prefill(weights, tokens, mask, position_ids, cache):
    weights = params if closes_over_weights else weights
    out = model(tokens, attention_mask=mask, position_ids=position_ids, params=weights,
                past_key_values=cache)
    return out.logits[:, -1], out.past_key_values

  def step(state, tokens, positions):
    weights = params if closes_over_weights else state["params"]
    out = model(tokens[:, None], attention_mask=state["mask"], position_ids=positions[:, None],
                params=weights, past_key_values=state["cache"])
    return out.logits[:, -1], {**state, "cache": out.past_key_values}

  return prefill, step


def empty_cache(model, batch):
  """`init_cache(batch, CACHE)`'s structure; its values are zeros (and a cache_index of 0),
  which eval_shape gives without running the forward pass that init_cache runs."""
  shapes = jax.eval_shape(functools.partial(model.init_cache, batch, CACHE))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@dataclasses.dataclass(frozen=True, eq=False)
class Decoder:
  """One model in one mode, its functions built once: `decode` and the greedy loop compile
  once per batch size, the prefill once per prompt shape."""
  family: str
  model: object
  params: object
  prefill: object  # jitted
  step: object  # decode's step_fn
  closes_over_weights: bool
  alone: dict = dataclasses.field(default_factory=dict)  # the needles' runs alone, by kind

  def start(self, prompts):
    """Left-pads the prompts and runs the prefill: (logits [B, V], state, lengths)."""
    tokens, lengths = jaxdecode.left_pad(prompts, pad_id=PAD, buckets=None)
    batch, width = tokens.shape
    mask = jaxdecode.prompt_mask(lengths, width).astype(jnp.int32)
    # As `prepare_inputs_for_generation`: the prompt's mask, then ones up to the cache's end
    # (causal masking hides the slots not yet written); position ids count real tokens.
    extended = jnp.ones((batch, CACHE), jnp.int32).at[:, :width].set(mask)
    position_ids = jnp.cumsum(mask, axis=-1) - 1
    logits, cache = self.prefill(self.params, tokens, extended, position_ids,
                                 empty_cache(self.model, batch))
    state = {"cache": cache, "mask": extended}
    if not self.closes_over_weights:
      state["params"] = self.params
    return logits, state, lengths

  def __call__(self, prompts, keys, sampling):
    """`jaxdecode.decode` of NEW tokens per row."""
    logits, state, lengths = self.start(prompts)
    return jaxdecode.decode(self.step, state, logits, key=keys, params=sampling,
                            max_new_tokens=NEW, positions=lengths, eos_ids=[EOS], pad_id=PAD)

  def greedy_logits(self, prompts):
    """The audit's greedy loop (`jaxdecode.invariance`; no sampling chain, so a small program
    to compile): greedy tokens [B, NEW] and the logits they came from [B, NEW, V]."""
    logits, state, lengths = self.start(prompts)
    tokens, all_logits = _greedy_run(self.step, state, logits, lengths, steps=NEW)
    return np.asarray(tokens), np.asarray(all_logits)


def make_decoder(family, *, invariant=True, dtype=jnp.float32, closes_over_weights=False):
  model, params = _model(family, dtype)
  prefill, step = model_fns(model, params, closes_over_weights)
  if invariant:
    prefill, step = batch_invariant(prefill), batch_invariant(step)
  return Decoder(family, model, params, jax.jit(prefill), step, closes_over_weights)


@pytest.fixture(scope="module")
def decoders():
  """`decoders(family, invariant=True, **options)`: one Decoder per configuration for the
  module, so that tests share its compiled programs."""
  made = {}

  def get(family, invariant=True, **options):
    key = (family, invariant, tuple(sorted(options.items())))
    if key not in made:
      made[key] = make_decoder(family, invariant=invariant, **options)
    return made[key]

  yield get
  made.clear()


# ---------------------------------------------------------------------------------------------
# The needle test: the needles alone, then together at random slots of a batch, beside partners
# of random lengths (so the needles' left padding differs), each row with its own key and
# sampling parameters.

NEEDLE_TEMPERATURE, NEEDLE_TOP_P = 0.9, 0.9


def _needle_prompts():
  rng = np.random.default_rng(38)
  return [[int(t) for t in rng.integers(1, EOS, n)] for n in NEEDLES]


def _needle_keys():
  return jax.random.split(jax.random.key(38), len(NEEDLES))


def _row_sampling(temperature, top_p):
  return jaxdecode.SamplingParams(temperature=np.asarray(temperature, np.float32),
                                  top_p=np.asarray(top_p, np.float32))


def _batch(batch, seed):
  """`batch` rows: the needles (at random slots), partners of random lengths (1 .. the longest
  needle), random keys and sampling parameters. Returns (prompts, keys, sampling, {slot:
  needle})."""
  rng = np.random.default_rng(seed)
  slots = rng.permutation(batch)[:len(NEEDLES)]
  prompts = [[int(t) for t in rng.integers(1, EOS, rng.integers(1, NEEDLES[-1] + 1))]
             for _ in range(batch)]
  keys = list(jax.random.split(jax.random.key(seed), batch))
  temperature, top_p = rng.uniform(0.6, 1.4, batch), rng.uniform(0.7, 1.0, batch)
  for needle, slot in enumerate(slots):
    prompts[slot], keys[slot] = _needle_prompts()[needle], _needle_keys()[needle]
    temperature[slot], top_p[slot] = NEEDLE_TEMPERATURE, NEEDLE_TOP_P
  placed = dict(zip(slots, range(len(NEEDLES))))
  return prompts, jnp.stack(keys), _row_sampling(temperature, top_p), placed


def _alone(dec, how):
  """Each needle run by itself (batch 1, no padding), once per decoder: `how` "sampled" (decode:
  tokens, log-probs) or "greedy" (the greedy loop: tokens, logits)."""
  if how not in dec.alone:
    out = []
    for prompt, key in zip(_needle_prompts(), _needle_keys()):
      if how == "sampled":
        r = dec([prompt], key[None], _row_sampling([NEEDLE_TEMPERATURE], [NEEDLE_TOP_P]))
        out.append((np.asarray(r.tokens[0]), np.asarray(r.logprobs[0])))
      else:
        tokens, logits = dec.greedy_logits([prompt])
        out.append((tokens[0], logits[0]))
    dec.alone[how] = out
  return dec.alone[how]


def needle_differences(dec, batch, how):
  """Per needle of a batch of `batch`: (needle length, slot, tokens that differ from the needle
  alone, floats (log-probs or logits) whose bits differ)."""
  alone = _alone(dec, how)
  prompts, keys, sampling, placed = _batch(batch, seed=batch)
  if how == "sampled":
    r = dec(prompts, keys, sampling)
    tokens, floats = np.asarray(r.tokens), np.asarray(r.logprobs)
  else:
    tokens, floats = dec.greedy_logits(prompts)
  out = []
  for slot, needle in sorted(placed.items()):
    ref_tokens, ref_floats = alone[needle]
    out.append((NEEDLES[needle], int(slot), int(np.sum(tokens[slot] != ref_tokens)),
                int(np.sum(_bits(floats[slot]) != _bits(ref_floats)))))
  return out


def check_needles(dec, batch, how):
  for length, slot, tokens, floats in needle_differences(dec, batch, how):
    assert (tokens, floats) == (0, 0), (
        f"the needle of length {length} at slot {slot} of {batch}: {tokens} tokens and {floats} "
        f"{'log-probs' if how == 'sampled' else 'logits'} differ from the needle alone")


@pytest.mark.slow  # about 28 s here (5 compilations); the fast loop keeps the lowering checks
def test_gpt2_greedy_logits_bitwise_alone_and_in_a_batch_of_5_under_batch_invariant(decoders):
  """Every step's logits (and so the greedy tokens) of a length-1 prompt and of the longest
  prompt that fits the cache, alone and in a left-padded batch of 5; weights an argument."""
  check_needles(decoders("gpt2"), 5, "greedy")


@pytest.mark.slow
def test_gpt2_sampled_tokens_and_logprobs_bitwise_alone_and_in_a_batch_of_12(decoders):
  """Through `decode`: temperature and top-p per row, a key per row."""
  check_needles(decoders("gpt2"), 12, "sampled")


@pytest.mark.slow
def test_llama_closing_over_its_weights_sampled_bitwise_alone_and_in_a_batch_of_5(decoders):
  """Through `decode`, the step function closing over the weights (constants of the program)."""
  check_needles(decoders("llama", closes_over_weights=True), 5, "sampled")


@pytest.mark.slow
def test_gpt2_bf16_weights_and_compute_greedy_logits_bitwise_alone_and_in_a_batch_of_5(
    decoders):
  """The model computing in bfloat16 (`dtype=`) with its weights cast by `jax.tree.map`: bf16
  products and sums are chains accumulating in float32, then rounded to bf16."""
  dec = decoders("gpt2", dtype=jnp.bfloat16)
  assert {p.dtype for p in jax.tree.leaves(dec.params)} == {jnp.dtype(jnp.bfloat16)}
  check_needles(dec, 5, "greedy")


def _generate_greedy(dec, prompts):
  """transformers' own greedy `generate` (its loop, cache of prompt + NEW slots, plain XLA)."""
  tokens, lengths = jaxdecode.left_pad(prompts, pad_id=PAD, buckets=None)
  mask = jaxdecode.prompt_mask(lengths, tokens.shape[1]).astype(jnp.int32)
  out = dec.model.generate(tokens, attention_mask=mask, params=dec.params, max_new_tokens=NEW,
                           do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
  return np.asarray(out.sequences[:, tokens.shape[1]:])


@pytest.mark.slow
@pytest.mark.parametrize("family,batch", [("gpt2", 12), ("llama", 5)])
def test_greedy_tokens_equal_the_models_own_generate(decoders, family, batch):
  """The step function is right: greedy decoding gives `model.generate(do_sample=False)`'s
  tokens, with plain numerics (the audit's greedy loop) and through `decode` at temperature 0
  under batch_invariant (the needle tests' compiled programs)."""
  prompts = _batch(batch, seed=batch)[0]
  invariant = decoders(family, closes_over_weights=family == "llama")
  expected = _generate_greedy(invariant, prompts)
  plain_tokens = decoders(family, invariant=False).greedy_logits(prompts)[0].copy()
  for row in plain_tokens:  # the greedy loop runs past EOS; generate pads after it
    if (row == EOS).any():
      row[np.argmax(row == EOS) + 1:] = PAD
  np.testing.assert_array_equal(plain_tokens, expected)
  greedy = jaxdecode.SamplingParams(temperature=np.zeros(batch, np.float32),
                                    top_p=np.ones(batch, np.float32))
  out = invariant(prompts, jax.random.split(jax.random.key(0), batch), greedy)
  np.testing.assert_array_equal(np.asarray(out.tokens), expected)


@pytest.mark.slow
@pytest.mark.filterwarnings("default:negative control")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_negative_control_plain_numerics_in_a_batch_of_5(decoders, family, capsys):
  """The fast needle test without batch_invariant. Plain XLA picks its kernels by shape, so a
  needle's logits usually differ in a batch; if they do not on this machine the test cannot
  show it and a warning says so (nothing is asserted: the promise is not plain XLA's)."""
  differences = needle_differences(decoders(family, invariant=False), 5, "greedy")
  differing = sum(floats for *_, floats in differences)
  with capsys.disabled():
    print(f"\nnegative control ({family}, plain XLA, batch of 5): "
          + "; ".join(f"length {n} at slot {s}: {f} of {NEW * VOCAB} logits and {t} greedy "
                      f"tokens differ" for n, s, t, f in differences))
  if not differing:
    warnings.warn(f"negative control did not fail: {family}'s needles under plain XLA gave "
                  f"the same bits alone and in a batch of 5 on this machine", UserWarning)


def _shapes(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.slow
def test_no_unordered_sum_left_in_the_step_and_prefill(family, platform):
  """Lowered for each platform (no such device needed): the plain programs leave float sums to
  the backend, the batch_invariant ones none."""
  model, params = _model(family)
  prefill, step = model_fns(model, params)
  batch, width = 3, 5
  cache = _shapes(jax.eval_shape(functools.partial(model.init_cache, batch, CACHE)))
  ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  weights = _shapes(params)
  cases = {"step": (step, ({"cache": cache, "mask": ints(batch, CACHE), "params": weights},
                           ints(batch), ints(batch))),
           "prefill": (prefill, (weights, ints(batch, width), ints(batch, CACHE),
                                 ints(batch, width), cache))}
  for name, (fn, args) in cases.items():
    assert unordered_sums(fn, *args, platform=platform), name
    left = unordered_sums(batch_invariant(fn), *args, platform=platform)
    assert left == [], f"{name}: {left}"
