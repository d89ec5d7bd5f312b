"""`jaxdecode.adapters`: transformers' Flax GPT-2, Llama and Gemma (tiny random-weight configs,
tests/hf_models.py) and the embedded model through every loop, the text API and the command.

References, never this machine's kernels: transformers' own `generate` (greedy, beams) on the
same weights; `decode` itself for speculative decoding (bitwise its output by construction);
the prompts' own text for the tokenizer's bytes; a prompt alone for the needle tests (bitwise,
by `batch_invariant`'s construction); hand-built slot maps for the cache bookkeeping.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode
from jaxdecode import models  # noqa: F401  (jaxdecode.models)
from jaxdecode import adapters
from jaxdecode.adapters import _make_room, _position_limit  # pylint: disable=protected-access

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
import hf_models  # pylint: disable=wrong-import-position
# pylint: disable-next=wrong-import-position
from adapter_checks import bits as _bits, check_needle, check_speculative

POSITIONS = 64
NEW = 6


def _allowing_rank_promotion(fn):
  """transformers' own `generate` relies on NumPy's rank promotion, which tests/conftest.py
  makes JAX refuse; the adapters allow it around the model's own code themselves, so
  everything else here runs strict, as a strict user's code would."""

  def run(*args, **kwargs):
    with jax.numpy_rank_promotion("allow"):
      return fn(*args, **kwargs)

  return run


@pytest.fixture(scope="module")
def hf_tokenizer():
  return hf_models.tokenizer()


def _adapter(family, hf_tokenizer, *, invariant=False, dtype=jnp.float32, seed=0, extra=0,
             layers=2, padding="right"):
  """(adapter, model, params): a tiny model whose vocabulary is the tokenizer's (+ `extra`
  padded ids that the tokenizer has no token for)."""
  eos = hf_tokenizer.eos_token_id
  model, params = hf_models.model(family, len(hf_tokenizer) + extra, POSITIONS, eos,
                                  dtype=dtype, seed=seed, layers=layers)
  return (adapters.transformers(model, params, hf_tokenizer, batch_invariant=invariant,
                                padding=padding), model, params)


# ---------------------------------------------------------------------------------------------
# Fast: no decode loop compiled.


def test_tokenizer_pieces_are_the_bytes_of_each_token_and_make_a_vocabulary(hf_tokenizer):
  tok = adapters.tokenizer(hf_tokenizer)
  for text in hf_models.TEXTS + ["ünïcode ✓", "x"]:
    ids = hf_tokenizer.encode(text)
    assert b"".join(tok.pieces[i] for i in ids) == text.encode("utf-8")
    assert tok.decode(ids) == text
  eos = hf_tokenizer.eos_token_id
  assert tok.pieces[eos] is None and tok.eos_ids == (eos,)
  vocabulary = tok.vocabulary()
  assert len(vocabulary) == len(hf_tokenizer) and vocabulary.eos_ids == (eos,)
  padded = adapters.Tokenizer(hf_tokenizer, vocab_size=len(hf_tokenizer) + 5)
  assert padded.pieces[len(hf_tokenizer):] == [None] * 5


def test_bad_input_is_refused_with_the_argument_named_before_compiling(hf_tokenizer):
  model, params = hf_models.model("gpt2", len(hf_tokenizer), POSITIONS,
                                  hf_tokenizer.eos_token_id)
  with pytest.raises(ValueError, match="model must be a transformers FlaxPreTrainedModel.*"
                                       "got str"):
    adapters.transformers("gpt2", params)
  with pytest.raises(ValueError, match=r"_do_init=False\): give params="):
    adapters.transformers(model)
  small, small_params = hf_models.model("gpt2", len(hf_tokenizer) - 10, POSITIONS, 0)
  with pytest.raises(ValueError, match=f"tokenizer has {len(hf_tokenizer)} ids but .* "
                                       f"{len(hf_tokenizer) - 10}"):
    adapters.transformers(small, small_params, hf_tokenizer)
  no_eos = hf_models.tokenizer(eos=None)
  bare, bare_params = hf_models.model("gpt2", len(no_eos), POSITIONS, None)
  with pytest.raises(ValueError, match="no EOS id.*give eos_ids="):
    adapters.transformers(bare, bare_params, no_eos)
  for padding in ("middle", None, ["left"]):
    with pytest.raises(ValueError, match=r"padding must be one of \['right', 'left'\]; got"):
      adapters.transformers(model, params, hf_tokenizer, padding=padding)
  adapter = adapters.transformers(model, params, hf_tokenizer)
  with pytest.raises(ValueError, match=r"cache_length must hold the prompts .* 9 <= "
                                       r"cache_length=8 <= 64 is false"):
    adapter.prefill(np.ones((2, 9), np.int32), np.array([9, 3]), 8)
  with pytest.raises(ValueError, match="cache_length=80 <= 64 is false"):
    adapter.prefill(np.ones((2, 9), np.int32), np.array([9, 3]), 80)
  with pytest.raises(ValueError, match=f"prompt tokens must be ids in \\[0, {len(hf_tokenizer)}"):
    adapter.prefill(np.full((1, 3), len(hf_tokenizer)), np.array([3]), 8)
  with pytest.raises(ValueError, match="does not fit the model's context of 64 tokens"):
    jaxdecode.models.generate(["hello " * 40], model=adapter, max_new_tokens=4)
  other, other_params = hf_models.model("gpt2", len(hf_tokenizer) + 3, POSITIONS, 0)
  draft = adapters.transformers(other, other_params)
  with pytest.raises(ValueError, match=r"draft model's vocabulary \(283 tokens\) is not the "
                                       r"model's \(280\)"):
    jaxdecode.models.generate(["hi"], model=adapter, draft=draft)
  with pytest.raises(ValueError, match="model must be None .* got FlaxGPT2LMHeadModel"):
    jaxdecode.models.generate(["hi"], model=model)
  with pytest.raises(ValueError, match="has no tokenizer, which text prompts need"):
    jaxdecode.models.generate(["hi"], model=draft)
  no_eos_adapter = adapters.transformers(bare, bare_params, no_eos, eos_ids=())
  with pytest.raises(ValueError, match="structured output needs an EOS id"):
    jaxdecode.models.generate(["hi"], model=no_eos_adapter, regex="[ab]+",
                              max_new_tokens=4)


def test_cache_bookkeeping_forgets_rejected_drafts_rewinds_and_compacts_in_order():
  """Slot maps built by hand (the construction): row 0 holds positions 0..3 in slots 0..3,
  row 1 positions 0..1 in slots 0..1 and rejected drafts (2, 3) in slots 4..5."""
  slots = jnp.array([[0, 1, 2, 3, -1, -1, -1, -1],
                     [0, 1, -1, -1, 2, 3, -1, -1]], jnp.int32)
  k = jnp.arange(2 * 8, dtype=jnp.float32).reshape(2, 8, 1, 1)
  cache = {"layer": {"cached_key": k, "cache_index": jnp.int32(6)}}
  # Row 1 goes on at position 2: its drafts are forgotten, the write index moves back to 4.
  positions = jnp.array([4, 2], jnp.int32)
  kept, kept_slots = _make_room(cache, slots, positions, 1)
  np.testing.assert_array_equal(kept_slots[1], [0, 1, -1, -1, -1, -1, -1, -1])
  assert int(kept["layer"]["cache_index"]) == 4
  # Five tokens do not fit after slot 4 (4 + 5 > 8): rows move their held slots to the front.
  moved, moved_slots = _make_room(cache, slots, positions, 5)
  np.testing.assert_array_equal(moved_slots, [[0, 1, 2, 3, -1, -1, -1, -1],
                                              [0, 1, -1, -1, -1, -1, -1, -1]])
  np.testing.assert_array_equal(moved["layer"]["cached_key"][:, :2, 0, 0], [[0, 1], [8, 9]])
  assert int(moved["layer"]["cache_index"]) == 4
  # Three tokens fit at slot 4: nothing moves.
  same, _ = _make_room(cache, slots, positions, 3)
  np.testing.assert_array_equal(same["layer"]["cached_key"], k)
  # Row 0 (position 4) steps: index 4 fits one more token, nothing moves.
  one, _ = _make_room(cache, slots, jnp.array([4, 4], jnp.int32), 1)
  np.testing.assert_array_equal(one["layer"]["cached_key"], k)
  # The loops' check: each row can hold as many positions as there are slots, up to the context.
  assert _position_limit(64, {"slots": slots}) == 8
  assert _position_limit(5, {"slots": slots}) == 5


# ---------------------------------------------------------------------------------------------
# Slow: each compiles decode loops for a family.

PROMPTS = ["hello world", "the quick brown", "x", '{"name": "ada"']


@_allowing_rank_promotion
def _own_greedy(model, params, ids, eos, new=NEW, **options):
  """transformers' own greedy `generate`, one prompt at a time (no padding)."""
  out = model.generate(jnp.asarray([ids]), params=params, max_new_tokens=new, do_sample=False,
                       pad_token_id=eos, eos_token_id=eos, **options)
  return [int(t) for t in np.asarray(out.sequences[0, len(ids):])]


def _until_eos(tokens, eos):
  tokens = [int(t) for t in tokens]
  return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.slow
@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_greedy_generate_equals_the_familys_own_greedy_generate(family, hf_tokenizer):
  """`models.generate` at temperature 0 through the adapter (a batch laid out as the family's
  own `generate` lays it out: left-padded) gives the tokens of `model.generate(do_sample=False)`
  on each prompt alone, and on the same left-padded batch."""
  adapter, model, params = _adapter(family, hf_tokenizer, padding="left")
  eos = hf_tokenizer.eos_token_id
  out = jaxdecode.models.generate(PROMPTS, model=adapter, max_new_tokens=NEW,
                                  params=jaxdecode.SamplingParams(temperature=0.0))
  ids = [hf_tokenizer.encode(prompt) for prompt in PROMPTS]
  tokens, lengths = jaxdecode.left_pad(ids, pad_id=eos, buckets=None)
  mask = np.arange(tokens.shape[1])[None, :] >= tokens.shape[1] - np.asarray(lengths)[:, None]
  batch = _allowing_rank_promotion(model.generate)(
      tokens, attention_mask=jnp.asarray(mask, jnp.int32), params=params, max_new_tokens=NEW,
      do_sample=False, pad_token_id=eos, eos_token_id=eos).sequences
  for row, prompt in enumerate(PROMPTS):
    expected = _until_eos(_own_greedy(model, params, ids[row], eos), eos)
    assert out.tokens[row, :out.lengths[row]].tolist() == expected, prompt
    assert _until_eos(np.asarray(batch[row, tokens.shape[1]:]), eos) == expected, prompt
    assert out.texts[row] == hf_tokenizer.decode([t for t in expected if t != eos])


@pytest.mark.slow
@pytest.mark.parametrize("family, padding", [("gpt2", "right"), ("gpt2", "left"),
                                             ("llama", "left"), ("gemma", "left")])
def test_needle_bitwise_alone_and_in_batches_of_2_and_7_under_batch_invariant(
    family, padding, hf_tokenizer):
  """Left padding (transformers' own layout) puts the needle's prompt, in a batch, at later
  cache slots than alone; right padding puts a gap between its prompt and its new tokens."""
  check_needle(_adapter(family, hf_tokenizer, invariant=True, padding=padding)[0],
               hf_models.TEXTS, NEW)


@pytest.mark.slow
def test_left_padding_moves_a_prompt_to_later_slots_and_keeps_its_bits(hf_tokenizer):
  """The prefill of a left-padded batch: row b holds its positions 0..len-1 in the slots that
  end at the prompts' width (hand-built map), and under batch_invariant its last logits and its
  prompt's log-probabilities are bitwise those of the right-padded layout and of the row alone
  (exact zeros ahead of a row's terms leave its in-order sums as they are)."""
  ids = [hf_tokenizer.encode(p) for p in ["the quick brown", "x", "hello world"]]
  tokens, lengths = jaxdecode.right_pad(ids, pad_id=0, buckets=None)
  width = tokens.shape[1]
  runs = {}
  for padding in ("right", "left"):
    adapter = _adapter("llama", hf_tokenizer, invariant=True, padding=padding)[0]
    logits, state, positions, logprobs = adapter.prompt_logprobs(tokens, lengths, width + 2)
    np.testing.assert_array_equal(positions, lengths)
    runs[padding] = logits, logprobs, np.asarray(state["slots"])
  for row, n in enumerate(np.asarray(lengths)):
    held = list(range(n)) + [-1] * (width + 2 - n)
    assert runs["right"][2][row].tolist() == held
    assert runs["left"][2][row].tolist() == [-1] * (width - n) + held[:n + 2]
  live = np.arange(width - 1)[None, :] < (np.asarray(lengths) - 1)[:, None]
  np.testing.assert_array_equal(_bits(runs["left"][0]), _bits(runs["right"][0]))
  np.testing.assert_array_equal(_bits(np.where(live, runs["left"][1], 0)),
                                _bits(np.where(live, runs["right"][1], 0)))
  short, short_length = jaxdecode.right_pad(ids[1:2], pad_id=0, buckets=None)
  alone = adapter.prefill(short, short_length, short.shape[1] + 2)[0]
  np.testing.assert_array_equal(_bits(alone[0]), _bits(runs["left"][0][1]))


@pytest.mark.slow
def test_bf16_weights_needle_bitwise_under_batch_invariant(hf_tokenizer):
  adapter, _, params = _adapter("llama", hf_tokenizer, invariant=True, dtype=jnp.bfloat16)
  assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  check_needle(adapter, hf_models.TEXTS, NEW, sizes=(5,))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gemma"])
def test_best_beam_equals_the_familys_own_beam_search(family, hf_tokenizer):
  """`generate(beam_size=3)` vs transformers' Flax `generate(num_beams=3)`, prompt by prompt,
  length_penalty 1 (jaxdecode's beams follow transformers')."""
  adapter, model, params = _adapter(family, hf_tokenizer)
  eos = hf_tokenizer.eos_token_id
  out = jaxdecode.models.generate(PROMPTS[:3], model=adapter, max_new_tokens=4, beam_size=3,
                                  params=jaxdecode.SamplingParams())
  for row, prompt in enumerate(PROMPTS[:3]):
    expected = _until_eos(_own_greedy(model, params, hf_tokenizer.encode(prompt), eos, new=4,
                                      num_beams=3), eos)
    assert out.tokens[row, :out.lengths[row]].tolist() == expected, prompt


def _without_layer(tree, name):
  """`tree` without the subtree `name` of any dict that holds layers "0" and `name`."""
  if not isinstance(tree, dict):
    return tree
  return {k: _without_layer(v, name) for k, v in tree.items()
          if not (k == name and "0" in tree)}


@pytest.mark.slow
@pytest.mark.parametrize("family, padding", [("gpt2", "right"), ("llama", "left")])
def test_speculative_with_a_draft_of_the_same_family_gives_decodes_bits(family, padding,
                                                                         hf_tokenizer):
  """A one-layer draft of the same family (the model's first layer): the same tokens and log-probs as
  without a draft (bitwise, under batch_invariant, where K-token calls are K single steps),
  with rows accepting different numbers of drafts (the per-row slot map at work) and n = 2;
  the model's prompts right- or left-padded, the draft's right-padded."""
  adapter, _, params = _adapter(family, hf_tokenizer, invariant=True, padding=padding)
  small, _ = hf_models.model(family, len(hf_tokenizer), POSITIONS, hf_tokenizer.eos_token_id,
                             layers=1)
  # Layer skipping: the draft is the model without its last layer (its own weights otherwise).
  draft = adapters.transformers(small, _without_layer(params, "1"), hf_tokenizer,
                                batch_invariant=True)
  check_speculative(adapter, draft, PROMPTS)


@pytest.mark.slow
def test_json_schema_through_the_familys_tokenizer(hf_tokenizer):
  adapter = _adapter("gpt2", hf_tokenizer)[0]
  schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
  out = jaxdecode.models.generate(PROMPTS[:2], model=adapter, max_new_tokens=24, json_schema=schema,
                                  params=jaxdecode.SamplingParams(temperature=0.0))
  assert out.finished.all(), out.texts
  for text in out.texts:
    assert set(json.loads(text)) == {"ok"} and isinstance(json.loads(text)["ok"], bool)


@pytest.mark.slow
def test_padded_embeddings_are_never_drawn_and_greedy_matches_suppressed_own_generate(
    hf_tokenizer):
  """A model vocabulary 37 ids past the tokenizer's: the adapter's logits stop at the
  tokenizer's ids; transformers' generate with those ids suppressed gives the same tokens."""
  adapter, model, params = _adapter("llama", hf_tokenizer, extra=37)
  assert adapter.vocab_size == len(hf_tokenizer)
  eos = hf_tokenizer.eos_token_id
  out = jaxdecode.models.generate(PROMPTS, model=adapter, max_new_tokens=NEW, n=3, seed=1,
                                  params=jaxdecode.SamplingParams(temperature=3.0))
  assert out.tokens.max() < len(hf_tokenizer)
  greedy = jaxdecode.models.generate(PROMPTS[:2], model=adapter, max_new_tokens=NEW,
                                     params=jaxdecode.SamplingParams(temperature=0.0))
  padded = list(range(len(hf_tokenizer), len(hf_tokenizer) + 37))
  for row, prompt in enumerate(PROMPTS[:2]):
    expected = _until_eos(_own_greedy(model, params, hf_tokenizer.encode(prompt), eos,
                                      suppress_tokens=padded), eos)
    assert greedy.tokens[row, :greedy.lengths[row]].tolist() == expected


@pytest.mark.slow
def test_a_full_cache_is_refused_and_a_step_past_it_gives_nan_logits(hf_tokenizer):
  adapter = _adapter("gpt2", hf_tokenizer)[0]
  ids = [hf_tokenizer.encode(p) for p in PROMPTS[:2]]
  tokens, lengths = jaxdecode.right_pad(ids, pad_id=adapter.pad_id, buckets=None)
  width = tokens.shape[1]
  logits, state, positions = adapter.prefill(tokens, lengths, width + 2)
  assert adapter.step_fn.position_limit(state) == width + 2
  with pytest.raises(ValueError, match="max_new_tokens=4 does not fit the model state"):
    jaxdecode.decode(adapter.step_fn, state, logits, key=jax.random.key(0), max_new_tokens=4,
                     positions=positions, params=jaxdecode.SamplingParams())
  # Two new tokens fit, but not with a draft past the last one: the call is written whole.
  with pytest.raises(ValueError, match="max_new_tokens=2 with num_draft_tokens=1 does not fit "
                                       "the model state.* at most 1 new tokens"):
    jaxdecode.speculative_decode(adapter.step_fn, state, logits, key=jax.random.key(0),
                                 max_new_tokens=2, positions=positions, num_draft_tokens=1,
                                 drafter=jaxdecode.NgramDrafter(tokens, lengths),
                                 params=jaxdecode.SamplingParams())
  step = positions
  for _ in range(2):  # fills the two free slots
    logits, state = adapter.step_fn(state, jnp.zeros(2, jnp.int32), step)
    assert np.isfinite(np.asarray(logits)).all()
    step = step + 1
  logits, _ = adapter.step_fn(state, jnp.zeros(2, jnp.int32), step)
  assert np.isnan(np.asarray(logits)).all()


@pytest.mark.slow
def test_drafts_near_the_end_of_the_context_change_no_token(hf_tokenizer):
  """A verification call writes the newest token and K drafts of every row, finished ones too,
  and a shared-index cache writes a call whole. Near the end of a 24-position context,
  `generate(draft=...)` drafts fewer (1 of 3, then none) and returns the tokens and log-probs
  of decoding without a draft, bitwise (rows used to stop there as dead ends, cut short)."""
  model, params = hf_models.model("gpt2", len(hf_tokenizer), 24, hf_tokenizer.eos_token_id)
  adapter = adapters.transformers(model, params, hf_tokenizer, batch_invariant=True,
                                  eos_ids=())  # every row runs to max_new_tokens
  width = max(len(hf_tokenizer.encode(p)) for p in PROMPTS[:3])
  for new, drafts in ((24 - width - 1, 1), (24 - width, 0)):
    options = dict(model=adapter, max_new_tokens=new, seed=2,
                   params=jaxdecode.SamplingParams(temperature=0.8))
    plain = jaxdecode.models.generate(PROMPTS[:3], **options)
    fast = jaxdecode.models.generate(PROMPTS[:3], **options, draft="ngram", num_draft_tokens=3)
    np.testing.assert_array_equal(fast.tokens, plain.tokens)
    np.testing.assert_array_equal(_bits(fast.logprobs), _bits(plain.logprobs))
    assert fast.lengths.tolist() == [new] * 3 and not fast.dead_end.any()
    assert fast.drafted.max() <= drafts * fast.calls
    assert fast.calls == new - 1 if drafts == 0 else fast.drafted.min() > 0


@pytest.mark.slow
def test_stream_stop_strings_and_no_eos_through_an_adapter(hf_tokenizer):
  """`stream` joins to `generate`'s texts; a stop string cuts a row where its text has it; a
  tokenizer without EOS (eos_ids=()) runs every row to max_new_tokens."""
  adapter = _adapter("gpt2", hf_tokenizer)[0]
  options = dict(model=adapter, max_new_tokens=8, seed=5,
                 params=jaxdecode.SamplingParams(temperature=1.5))
  whole = jaxdecode.models.generate(PROMPTS, **options)
  pieces = ["" for _ in PROMPTS]
  for chunk in jaxdecode.models.stream(PROMPTS, **options, chunk_size=3):
    pieces = [a + b for a, b in zip(pieces, chunk.texts)]
  assert pieces == whole.texts
  stop = next(t[2:4] for t in whole.texts if len(t) > 4)
  cut = jaxdecode.models.generate(PROMPTS, **options, stop=stop)
  for text, full in zip(cut.texts, whole.texts):
    assert text == (full[:full.index(stop)] if stop in full else full)
  no_eos = hf_models.tokenizer(eos=None)
  model, params = hf_models.model("gpt2", len(no_eos), POSITIONS, None)
  bare = adapters.transformers(model, params, no_eos, eos_ids=())
  out = jaxdecode.models.generate(PROMPTS[:2], model=bare, max_new_tokens=5)
  assert out.lengths.tolist() == [5, 5] and not out.finished.any()


@pytest.mark.slow
def test_the_command_takes_a_local_transformers_checkpoint(hf_tokenizer, tmp_path, capsys):
  """`jaxdecode generate --model DIR` of a `save_pretrained` directory: the greedy text of
  `generate` through the same model loaded by FlaxAutoModelForCausalLM + AutoTokenizer."""
  from jaxdecode.tools import cli  # pylint: disable=import-outside-toplevel
  adapter, model, params = _adapter("gpt2", hf_tokenizer)
  model.save_pretrained(tmp_path, params=params)
  hf_tokenizer.save_pretrained(tmp_path)
  expected = jaxdecode.models.generate(["hello"], model=adapter, max_new_tokens=5,
                                       params=jaxdecode.SamplingParams(temperature=0.0))
  cli.main(["generate", "--model", str(tmp_path), "--greedy", "--max-new-tokens", "5",
            "--no-stream", "hello"])
  assert "hello" + expected.texts[0] in capsys.readouterr().out.splitlines()


@pytest.mark.slow
def test_the_audit_command_takes_a_local_transformers_checkpoint(hf_tokenizer, tmp_path,
                                                                  capsys):
  """`jaxdecode audit --model DIR`: the family's adapter, left-padded, in both numerics modes;
  the batch-invariant one diverges in no mix."""
  from jaxdecode.tools import cli  # pylint: disable=import-outside-toplevel
  model, params = hf_models.model("gpt2", len(hf_tokenizer), 256, hf_tokenizer.eos_token_id,
                                  layers=1)
  model.save_pretrained(tmp_path, params=params)
  hf_tokenizer.save_pretrained(tmp_path)
  code = cli.main(["audit", "--model", str(tmp_path), "--mixes", "2", "--steps", "3",
                   "--max-batch", "3"])
  out = capsys.readouterr().out
  assert code == 0, out
  lines = out.splitlines()
  assert next(line for line in lines if line.startswith("batch-invariant ")).split() == [
      "batch-invariant", "2", "0", "0", "0"]
  assert any(line.startswith("plain XLA ") for line in lines)
  code = cli.main(["audit", "--model", str(tmp_path), "--steps", "250"])
  err = capsys.readouterr().err
  assert code == 2 and "--steps 250 does not fit" in err and "context of 256" in err, err


@pytest.mark.slow
def test_score_with_the_adapters_logits_fn_gives_the_loops_log_probs(hf_tokenizer):
  """`jaxdecode.score(adapter.logits_fn, ...)` over prompt + sampled tokens (one forward pass,
  right-padded) gives the processed log-probabilities of `decode` over a left-padded batch
  (the family's own layout) bitwise, under batch_invariant (where the prefill's T-wide pass and
  the 1-token steps compute each row's sums alike, wherever its slots sit)."""
  adapter = _adapter("gpt2", hf_tokenizer, invariant=True, padding="left")[0]
  trainer = _adapter("gpt2", hf_tokenizer, invariant=True)[0]
  ids = [hf_tokenizer.encode(p) for p in PROMPTS[:3]]
  tokens, lengths = jaxdecode.right_pad(ids, pad_id=adapter.pad_id, buckets=None)
  params = jaxdecode.SamplingParams(temperature=0.8, top_p=0.9)
  logits, state, positions = adapter.prefill(tokens, lengths, tokens.shape[1] + NEW)
  out = jaxdecode.decode(adapter.step_fn, state, logits, key=jax.random.key(7), params=params,
                         max_new_tokens=NEW, positions=positions, eos_ids=adapter.eos_ids,
                         pad_id=adapter.pad_id)
  scores = jaxdecode.score(trainer.logits_fn, tokens, lengths, out.tokens, params=params,
                           eos_ids=adapter.eos_ids, pad_id=adapter.pad_id)
  live = np.arange(NEW)[None, :] < np.asarray(out.lengths)[:, None]
  np.testing.assert_array_equal(_bits(np.where(live, scores.processed, 0)),
                                _bits(np.where(live, out.logprobs, 0)))
