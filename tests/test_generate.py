"""High-level generation, checkpoints, training pieces and the `jaxdecode` command."""

import io
import json
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
import reference
from jaxdecode.models import training
from jaxdecode.tools import cli
from jaxdecode.models import (ByteTokenizer, Transformer, TransformerConfig, forward, generate,
                              load_checkpoint, save_checkpoint)

TOK = ByteTokenizer()
CONFIG = TransformerConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A random tiny model and its checkpoint file."""
  model = Transformer(CONFIG, rngs=nnx.Rngs(0))
  path = str(tmp_path_factory.mktemp("ckpt") / "tiny.msgpack")
  save_checkpoint(path, CONFIG, nnx.split(model)[1], metadata={"note": "test"})
  return load_checkpoint(path)[0], path


def greedy_by_full_forward(model, prompt, n):
  """Independent reference: re-run the full forward over the whole sequence at every step."""
  graphdef, weights = nnx.split(model)
  ids = TOK.encode(prompt)
  new = []
  for _ in range(n):
    seq, length = jaxdecode.right_pad([ids + new], pad_id=TOK.PAD, width=32)  # one compile
    logits = forward(graphdef, weights, seq, length)
    token = int(np.argmax(np.asarray(logits[0, int(length[0]) - 1])))
    new.append(token)
    if token == TOK.EOS:
      break
  return new


@pytest.mark.slow
def test_greedy_generate_equals_a_full_forward_argmax_loop(tiny):
  model, _ = tiny
  prompts = ["def f(x):", "a"]
  out = generate(prompts, model=model, params=jaxdecode.SamplingParams(temperature=0.0),
                 max_new_tokens=10)
  for row, prompt in enumerate(prompts):
    expected = greedy_by_full_forward(model, prompt, 10)
    assert out.tokens[row, :out.lengths[row]].tolist() == expected
  np.testing.assert_array_equal(out.logprobs, 0.0)  # greedy: a point mass


@pytest.mark.slow
def test_beam_generate_equals_a_full_forward_beam_search(tiny):
  model, _ = tiny
  graphdef, weights = nnx.split(model)
  prompts, k, r, n = ["def f(x):", "a"], 3, 2, 8
  out = generate(prompts, model=model, max_new_tokens=n, beam_size=k, num_return=r,
                 length_penalty=0.6)
  assert out.scores.shape == (2, r) and [len(b) for b in out.beams] == [r, r]
  for row, prompt in enumerate(prompts):
    ids = TOK.encode(prompt)

    def next_logprobs(new, ids=ids):  # independent of the cache: the whole sequence each time
      seq, length = jaxdecode.right_pad([ids + list(new)], pad_id=TOK.PAD, width=32)
      return reference.log_softmax64(forward(graphdef, weights, seq, length)[0,
                                                                             int(length[0]) - 1])

    hyps, _, _ = reference.reference_beam_search(next_logprobs, beam_size=k, max_new_tokens=n,
                                                 eos_ids=(TOK.EOS,), length_penalty=0.6)
    for i, (score, toks) in enumerate(hyps[:r]):
      assert out.beams[row][i] == TOK.decode(list(toks))
      assert out.scores[row, i] == pytest.approx(score, rel=1e-5)
    assert out.texts[row] == out.beams[row][0]
    assert out.tokens[row, :out.lengths[row]].tolist() == list(hyps[0][1])


@pytest.mark.slow
@pytest.mark.parametrize("penalize_prompt", [False, True])
def test_greedy_generate_with_penalties_equals_a_penalized_full_forward_loop(tiny,
                                                                          penalize_prompt):
  model, _ = tiny
  graphdef, weights = nnx.split(model)
  prompt = "eeT"  # greedy without the prompt's counts emits "e" at step 4; with them it does not
  params = jaxdecode.SamplingParams(temperature=0.0, repetition_penalty=1.5,
                                    presence_penalty=0.5, frequency_penalty=0.2)
  out = generate([prompt], model=model, params=params, max_new_tokens=10,
                 penalize_prompt=penalize_prompt)
  ids = TOK.encode(prompt)
  new = []
  for _ in range(10):  # independent: full forward + the penalty formulas in numpy
    seq, length = jaxdecode.right_pad([ids + new], pad_id=TOK.PAD, width=32)
    x = np.asarray(forward(graphdef, weights, seq, length)[0, int(length[0]) - 1], np.float64)
    counts = np.bincount((ids if penalize_prompt else []) + new, minlength=x.size)
    seen = counts > 0
    x[seen] = np.where(x[seen] < 0, x[seen] * 1.5, x[seen] / 1.5) - 0.2 * counts[seen] - 0.5
    new.append(int(np.argmax(x)))
    if new[-1] == TOK.EOS:
      break
  assert out.tokens[0, :out.lengths[0]].tolist() == new
  assert (ord("e") in new[:5]) != penalize_prompt


@pytest.mark.slow
def test_same_seed_same_text_and_fields_are_consistent(tiny):
  model, _ = tiny
  params = jaxdecode.SamplingParams(temperature=1.0, top_p=0.95)
  a = generate(["The", "import os"], model=model, params=params, seed=3, max_new_tokens=12)
  b = generate(["The", "import os"], model=model, params=params, seed=3, max_new_tokens=12)
  c = generate(["The", "import os"], model=model, params=params, seed=4, max_new_tokens=12)
  assert a.texts == b.texts and a.texts != c.texts
  assert a.tokens.shape == (2, 12) and a.lengths.shape == (2,)
  valid = np.arange(12)[None] < a.lengths[:, None]
  assert np.isfinite(a.logprobs[valid]).all() and (a.logprobs[valid] <= 0).all()
  assert a.texts[0] == TOK.decode(a.tokens[0, :a.lengths[0]])


def test_generate_rejects_bad_prompts(tiny):
  model, _ = tiny
  with pytest.raises(ValueError, match="wrap it in a list"):
    generate("hello", model=model)
  with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty string"):
    generate(["a", ""], model=model)
  with pytest.raises(ValueError, match="does not fit the model's context of 64 tokens"):
    generate(["x" * 60], model=model, max_new_tokens=10)
  with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
    generate(["x"], model=model, max_new_tokens=0)


def test_checkpoint_round_trip_stores_float16_weights(tiny, tmp_path):
  model, path = tiny
  loaded, metadata = load_checkpoint(path)
  assert metadata == {"note": "test"} and loaded.config == CONFIG
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded))):
    np.testing.assert_array_equal(np.asarray(a, np.float16).astype(np.float32), b)
  bad = tmp_path / "bad.msgpack"
  bad.write_bytes(b"not a checkpoint")
  with pytest.raises(ValueError, match="is not a jaxdecode checkpoint"):
    load_checkpoint(str(bad))
  with pytest.raises(ValueError, match="does not exist"):
    load_checkpoint(str(tmp_path / "missing.msgpack"))


def test_checkpoints_have_only_string_map_keys_so_older_flax_can_read_them(tiny):
  import msgpack  # pylint: disable=import-outside-toplevel
  from jaxdecode.models import checkpoint  # pylint: disable=import-outside-toplevel
  _, path = tiny
  for file in (path, checkpoint.DEFAULT_PATH):
    with open(file, "rb") as f:  # strict_map_key=True (msgpack's default) refuses int keys
      blob = msgpack.unpackb(f.read(), raw=False, ext_hook=lambda code, data: code)
    assert "0" in blob["weights"]["blocks"], sorted(blob["weights"])


def test_eval_windows_cover_every_token_exactly_once():
  stream = np.arange(10, dtype=np.int32)
  inputs, targets = training.windows(stream, 4)
  assert targets.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1]]
  assert inputs[:, 0].tolist() == [TOK.BOS] * 3 and inputs[0, 1:].tolist() == [0, 1, 2]


def test_split_holds_out_every_twentieth_chunk():
  stream = np.arange(100_000, dtype=np.int32)
  train, val = training.split_stream(stream, every=20, chunk=1000)
  assert len(val) == 5000 and len(train) + len(val) == len(stream)
  assert np.intersect1d(train, val).size == 0


def test_evaluate_matches_a_hand_computed_uniform_model():
  # A model whose logits are all equal predicts every token with probability 1/V.
  model = Transformer(CONFIG, rngs=nnx.Rngs(1))
  graphdef, weights = nnx.split(model)
  zeroed = jax.tree.map(jnp.zeros_like, weights)
  nats = training.evaluate(graphdef, zeroed, np.arange(50, dtype=np.int32), 16, batch_size=2)
  assert nats == pytest.approx(math.log(CONFIG.vocab_size), rel=1e-6)


@pytest.mark.slow
def test_training_lowers_the_loss_on_a_repetitive_corpus(tmp_path):
  corpus = tmp_path / "c.txt"
  corpus.write_text("abcabcabd " * 400)
  out = tmp_path / "m.msgpack"
  small = TransformerConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=32)
  cfg = training.TrainConfig(steps=60, batch_size=8, seq_len=32, peak_lr=1e-2, warmup_steps=5,
                             eval_every=30)
  trained, summary = training.train(small, cfg, corpus=str(corpus), out=str(out),
                                    log=io.StringIO())
  first, best = summary["history"][0]["val_loss"], summary["val_loss"]
  assert best < 1.0 < math.log(259) and best <= first
  model, metadata = load_checkpoint(str(out))
  assert metadata["val_loss"] == best and model.config == small
  # The returned weights are the saved ones (which are float16 on disk).
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float16), b),
               nnx.split(trained)[1], nnx.split(model)[1])


@pytest.mark.slow
def test_training_that_never_reaches_a_finite_loss_raises_instead_of_saving(tmp_path,
                                                                             monkeypatch):
  corpus = tmp_path / "c.txt"
  corpus.write_text("abcabcabd " * 400)
  monkeypatch.setattr(training, "evaluate", lambda *args, **kwargs: float("nan"))
  small = TransformerConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=16)
  cfg = training.TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=0, eval_every=1)
  with pytest.raises(ValueError, match=r"training diverged: the validation loss was never "
                                       r"finite \(\[nan, nan\]\)"):
    training.train(small, cfg, corpus=str(corpus), out=str(tmp_path / "m.msgpack"),
                   log=io.StringIO())
  assert not (tmp_path / "m.msgpack").exists()


def run_cli(capsys, *argv):
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.slow
def test_cli_generate_is_reproducible_and_prints_a_summary(tiny, capsys):
  _, path = tiny
  args = ["generate", "Hello", "print(", "--model", path, "--max-new-tokens", "6", "--seed", "5",
          "--top-k", "20"]
  code, first, _ = run_cli(capsys, *args)
  assert code == 0
  code, second, _ = run_cli(capsys, *args)
  body = lambda s: [line for line in s.splitlines() if not line.startswith("--- temperature")]
  assert body(first) == body(second)
  assert "--- [1] 'Hello'" in first and "--- [2] 'print('" in first
  assert "temperature=0.8 top_k=20 top_p=0.95 min_p=0 seed=5 | 2 prompt(s)" in first
  code, greedy, _ = run_cli(capsys, "generate", "Hi", "--greedy", "--model", path,
                            "--max-new-tokens", "3")
  assert code == 0 and "--- greedy seed=0 | 1 prompt(s)" in greedy


@pytest.mark.slow
def test_cli_generate_passes_penalties_and_truncations_to_generate(tiny, capsys):
  model, path = tiny
  code, out, _ = run_cli(capsys, "generate", "eeT", "--model", path, "--greedy",
                         "--max-new-tokens", "10", "--repetition-penalty", "1.5",
                         "--presence-penalty", "0.5", "--frequency-penalty", "0.2",
                         "--penalize-prompt", "--typical-p", "0.9", "--min-new-tokens", "4")
  assert code == 0
  params = jaxdecode.SamplingParams(temperature=0.0, repetition_penalty=1.5, typical_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.2,
                                    min_new_tokens=4)
  expected = generate(["eeT"], model=model, params=params, max_new_tokens=10,
                      penalize_prompt=True).texts[0]
  assert out.splitlines()[1] == ("eeT" + expected).splitlines()[0]
  assert ("--- greedy typical_p=0.9 repetition_penalty=1.5 presence_penalty=0.5 "
          "frequency_penalty=0.2 min_new_tokens=4 penalize_prompt seed=0") in out


@pytest.mark.slow
def test_cli_beams_prints_the_best_beams_with_their_scores(tiny, capsys):
  model, path = tiny
  code, out, _ = run_cli(capsys, "generate", "Hi", "x =", "--model", path, "--beams", "3",
                         "--num-return", "2", "--max-new-tokens", "5", "--length-penalty", "0.5")
  assert code == 0
  expected = generate(["Hi", "x ="], model=model, max_new_tokens=5, beam_size=3, num_return=2,
                      length_penalty=0.5)
  lines = out.splitlines()
  for i, prompt in enumerate(["Hi", "x ="]):
    for r in range(2):
      header = f"--- [{i + 1}] {prompt!r} beam {r + 1}/2 score {expected.scores[i, r]:.4f}"
      assert header in lines
      text = "\n".join(lines[lines.index(header) + 1:])
      assert text.startswith(prompt + expected.beams[i][r])
  assert "--- beams=3 num_return=2 length_penalty=0.5 | 2 prompt(s)" in out
  code, out, _ = run_cli(capsys, "generate", "Hi", "--model", path, "--beams", "2",
                         "--max-new-tokens", "3")
  assert code == 0 and "--- [1] 'Hi' score " in out and "beam 1/" not in out


@pytest.mark.slow
def test_decoding_past_the_models_cache_stops_the_row_or_is_refused_up_front(tiny):
  # Issue 33: past the prefilled cache the model's logits are NaN, and decode used to emit NUL
  # tokens with NaN log-probabilities, counted in `lengths`. The model's step function declares
  # its cache (`position_limit`), so the request is refused before it runs; a step function that
  # declares nothing (here the same one, wrapped) gets its row stopped where the cache ends
  # (`dead_end`).
  from jaxdecode.models import make_step_fn, prefill
  model, _ = tiny
  graphdef, weights = nnx.split(model)
  tokens, lengths = jaxdecode.right_pad([TOK.encode("Hi"), TOK.encode("Hello")], pad_id=TOK.PAD,
                                        width=8)
  logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=8)
  slots = state.cache.k[0].shape[1]  # positions the cache holds (at least 8, at most max_len)
  n = slots - 1  # prompts of 3 and 6 tokens: the positions run out for both rows
  kw = dict(key=jax.random.key(0), params=jaxdecode.SamplingParams(temperature=0.0),
            max_new_tokens=n, positions=lengths, eos_ids=[TOK.EOS], pad_id=TOK.PAD)
  step_fn = make_step_fn(graphdef)
  out = jaxdecode.decode(lambda s, t, p: step_fn(s, t, p), state, logits, **kw)
  stopped = slots - np.asarray(lengths) + 1  # the token at position `slots` has no logits
  ran = ~np.asarray(out.finished)
  assert ran.any() and (out.dead_end == ran).all()
  assert (out.lengths[ran] == stopped[ran]).all() and not np.isnan(np.asarray(out.logprobs)).any()
  with pytest.raises(ValueError, match=rf"decode: max_new_tokens={n} does not fit the model "
                                       rf"state: row 1 starts at position 6, so it needs "
                                       rf"{6 + n - 1} positions, but the state holds {slots}"):
    jaxdecode.decode(step_fn, state, logits, **kw)


def test_cli_mistakes_are_one_line_naming_the_flag_before_anything_runs(tiny, capsys):
  _, path = tiny
  for argv, message in [
      (["generate", "Hi", "--model", path, "--beams", "999999999"],
       "--beams must be at most 8291442 for 1 row(s) and a vocabulary of 259 tokens"),
      (["generate", "Hi", "--model", path, "--min-new-tokens", "9", "--max-new-tokens", "8"],
       "--min-new-tokens 9 is more than --max-new-tokens 8: no row could end with EOS"),
      # The audit checks its steps against the context before printing its header.
      (["audit", "--model", path, "--mixes", "1", "--steps", "8"],
       "--steps 8 does not fit: the audit's prompts take up to")]:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and message in err, err
  with pytest.raises(ValueError, match=r"min_new_tokens \(5\) is more than max_new_tokens \(4\)"):
    generate(["Hi"], model=tiny[0], max_new_tokens=4,
             params=jaxdecode.SamplingParams(min_new_tokens=[5]))


@pytest.mark.slow
def test_generate_and_the_cli_show_only_the_beams_that_exist(tiny, capsys):
  # top_k=1 leaves each prompt one possible continuation: 3 beams asked, 1 exists; the empty
  # slots (score -inf, length 0) are neither texts nor printed beams (issue 33: the CLI used
  # to print them as beams scored -2e8), and --json stays valid JSON.
  model, path = tiny
  out = generate(["Hi"], model=model, max_new_tokens=4, beam_size=3, num_return=3,
                 params=jaxdecode.SamplingParams(top_k=1))
  assert out.beams == [out.texts] and len(out.texts[0]) > 0 and out.lengths[0] > 0
  assert out.scores.tolist() == [[0.0, -np.inf, -np.inf]]  # the argmax path, probability 1
  code, printed, _ = run_cli(capsys, "generate", "Hi", "--model", path, "--beams", "3",
                             "--num-return", "3", "--top-k", "1", "--max-new-tokens", "4")
  assert code == 0 and printed.count(" score ") == 1 and "beam 2/3" not in printed
  assert "--- [1] 'Hi': 1 possible beam(s) of 3" in printed
  code, printed, _ = run_cli(capsys, "generate", "Hi", "--model", path, "--beams", "3",
                             "--num-return", "3", "--top-k", "1", "--max-new-tokens", "4",
                             "--json")
  report = json.loads(printed)
  assert code == 0 and report["beams"] == [out.texts] and report["scores"] == [[0.0]]


@pytest.mark.slow
def test_cli_beams_print_the_prompt_logprobs_too(tiny, capsys):
  model, path = tiny
  code, out, _ = run_cli(capsys, "generate", "Hi", "--model", path, "--beams", "2",
                         "--max-new-tokens", "2", "--prompt-logprobs")
  expected = generate(["Hi"], model=model, max_new_tokens=2, beam_size=2, num_return=1,
                      prompt_logprobs=True).prompt_logprobs[0]
  assert code == 0
  assert f"    prompt log-probability {float(expected.sum()):.4f} over 2 tokens" in out


DRAFT_CONFIG = TransformerConfig(d_model=16, n_layers=1, n_heads=1, d_ff=32, max_len=64)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "small model"])
def test_generate_with_a_draft_returns_the_same_bits_as_without(tiny, draft):
  model, _ = tiny
  drafter = draft if draft == "ngram" else Transformer(DRAFT_CONFIG, rngs=nnx.Rngs(1))
  params = jaxdecode.SamplingParams(temperature=[0.0, 0.9, 1.3], top_k=[0, 12, 0],
                                    top_p=[1.0, 1.0, 0.9], repetition_penalty=1.2)
  # 42 + 20 new tokens nearly fill the context of 64: the verification's K + 1 slots past the
  # last kept token are capped at max_len.
  prompts = ["abcabcabc", "Hello", "x = x + " * 5 + "x"]
  plain = generate(prompts, model=model, params=params, seed=3, max_new_tokens=20)
  spec = generate(prompts, model=model, params=params, seed=3, max_new_tokens=20,
                  draft=drafter, num_draft_tokens=3)
  assert spec.texts == plain.texts
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.logprobs.view(np.uint32), plain.logprobs.view(np.uint32))
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  assert np.all((0 <= spec.accepted) & (spec.accepted <= spec.drafted))
  assert np.all(spec.drafted % 3 == 0) and 1 <= spec.calls <= 20
  assert plain.calls is None and plain.acceptance_rate is None
  assert 0.0 <= spec.acceptance_rate <= 1.0


@pytest.mark.slow
def test_a_model_drafting_for_itself_greedily_has_every_draft_accepted(tiny):
  """Greedy drafts from the target itself are the target's greedy tokens: every round accepts
  all K drafts and adds the bonus token, so N new tokens take ceil((N - 1) / (K + 1)) calls
  after the prefill's first token."""
  model, _ = tiny
  params = jaxdecode.SamplingParams(temperature=0.0)
  plain = generate(["Hello"], model=model, params=params, max_new_tokens=21)
  assert not plain.finished[0]  # no EOS: all 21 tokens are generated
  spec = generate(["Hello"], model=model, params=params, max_new_tokens=21, draft=model,
                  num_draft_tokens=4)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  assert spec.calls == math.ceil((21 - 1) / (4 + 1))
  assert spec.accepted[0] == 4 * spec.calls and spec.acceptance_rate == 1.0


def test_generate_rejects_bad_drafts(tiny):
  model, _ = tiny
  wide = Transformer(TransformerConfig(d_model=16, n_layers=1, n_heads=1, d_ff=32, max_len=64,
                                       vocab_size=300), rngs=nnx.Rngs(0))
  for kwargs, fragment in [
      (dict(draft="suffix"), "draft must be None, 'ngram' or a Transformer; got 'suffix'"),
      (dict(draft=3), "got int"),
      (dict(draft=wide), "draft model's vocabulary (300 tokens)"),
      (dict(draft="ngram", num_draft_tokens=0), "num_draft_tokens must be an integer in [1, 16]"),
      (dict(draft="ngram", num_draft_tokens=17), "num_draft_tokens must be"),
      (dict(draft="ngram", beam_size=2), "draft and beam_size exclude each other")]:
    with pytest.raises(ValueError, match=re.escape(fragment)):
      generate(["Hi"], model=model, max_new_tokens=4, **kwargs)
  # A draft model is named as such, not by the first 40 characters of its (multi-line) repr.
  small = Transformer(DRAFT_CONFIG, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError) as info:
    generate(["Hi"], model=model, max_new_tokens=4, draft=small, top_logprobs=2)
  assert str(info.value) == ("top_logprobs is not available with a draft model: speculative "
                             "decoding returns processed log-probabilities only")


@pytest.fixture
def no_prefill(monkeypatch):
  """Any prefill fails the test: a bad value must be refused before anything compiles."""
  def prefilled(*args, **kwargs):
    raise AssertionError("the prompts were prefilled before the bad value was refused")
  monkeypatch.setattr(sys.modules["jaxdecode.models.generate"], "prefill", prefilled)
  monkeypatch.setattr(sys.modules["jaxdecode.models.extras"], "prefill_with_logprobs",
                      prefilled)


SHORT_DRAFT_CONFIG = TransformerConfig(d_model=16, n_layers=1, n_heads=1, d_ff=32, max_len=8)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(beam_size=0), "beam_size must be an integer >= 1; got 0"),
    (dict(beam_size=2, num_return=3), "num_return must be at most beam_size = 2"),
    (dict(beam_size=2, length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(beam_size=2, prompt_logprobs=True, num_return=0), "num_return must be an integer"),
    (dict(params=jaxdecode.SamplingParams(banned_token_ids=[300])),
     "banned_token_ids has token id 300, outside the vocabulary of the logits [0, 259)"),
    (dict(params=jaxdecode.SamplingParams(temperature=[1.0, 0.5, 0.2])),
     "temperature has shape (3,) but the batch has 2 rows"),
    (dict(params=jaxdecode.SamplingParams(top_k=[1, 2, 3]), n=2),
     "top_k has shape (3,) but the batch has 2 rows"),
    (dict(draft="short"), "the draft model's context (8 tokens) is shorter than the prompts"),
    (dict(n=2**30), "n must be an integer in [1, 1073741823]; got 1073741824"),
    (dict(params=jaxdecode.SamplingParams(allowed_token_ids=[TOK.EOS], min_new_tokens=2)),
     "row 0 can select only EOS ids ([257]), which min_new_tokens=2 masks"),
])
def test_generate_refuses_bad_values_before_the_prefill(tiny, no_prefill, kwargs, fragment):
  model, _ = tiny
  if kwargs.get("draft") == "short":
    kwargs = dict(draft=Transformer(SHORT_DRAFT_CONFIG, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=re.escape(fragment)):
    generate(["Hi", "a longer prompt"], model=model, max_new_tokens=4, **kwargs)


@pytest.mark.slow
def test_cli_draft_prints_the_same_text_and_the_acceptance(tiny, capsys):
  _, path = tiny
  args = ["generate", "abcabc", "--model", path, "--max-new-tokens", "12", "--seed", "2"]
  code, plain, _ = run_cli(capsys, *args)
  assert code == 0
  code, spec, _ = run_cli(capsys, *args, "--draft", "ngram", "--num-draft-tokens", "3")
  assert code == 0
  assert plain.splitlines()[:-1] == spec.splitlines()[:-1]
  assert "draft=ngram K=3 (acceptance " in spec.splitlines()[-1]
  code, spec, _ = run_cli(capsys, *args, "--draft", path)  # a checkpoint as the draft
  assert code == 0 and plain.splitlines()[:-1] == spec.splitlines()[:-1]


@pytest.mark.parametrize("argv,fragment", [
    (["generate", ""], "prompt 1 is empty"),
    (["generate", "x", "--typical-p", "0"], "typical_p must be"),
    (["generate", "x", "--min-new-tokens", "-1"], "min_new_tokens must be an integer >= 0"),
    (["generate", "x", "--top-p", "1.5"], "top_p must be"),
    (["generate", "x", "--top-k", "2.5"], "expected an integer, got '2.5'"),
    (["generate", "x", "--max-new-tokens", "0"], "expected a positive integer, got '0'"),
    (["generate", "x" * 80], "does not fit the model's context of 64 tokens"),
    (["generate", "x", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["generate", "x", "--num-return", "2"], "add --beams K"),
    (["generate", "x", "--beams", "2", "--greedy"], "--greedy and --beams exclude each other"),
    (["generate", "x", "--beams", "2", "--num-return", "3"], "--num-return 3 is more than"),
    (["generate", "x", "--beams", "0"], "expected a positive integer, got '0'"),
    (["generate", "x", "--num-draft-tokens", "2"], "add --draft"),
    (["generate", "x", "--draft", "ngram", "--beams", "2"], "--draft and --beams exclude"),
    (["generate", "x", "--draft", "/no/such.msgpack"], "does not exist"),
    (["generate", "x", "--draft", "ngram", "--num-draft-tokens", "17"], "num_draft_tokens must"),
    (["generate", "x", "-n", "100000000000"], "n must be an integer in [1, 2147483647]"),
    (["eval", "/no/such/file"], "does not exist"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["generate", "x", "--regex", "(", "--max-new-tokens", "8"], "regex '(' cannot be compiled"),
    (["generate", "x", "--regex", "a", "--choice", "b"], "not allowed with argument"),
    (["generate", "x", "--json-schema", "/no/such.json"], "does not exist"),
    (["generate", "x", "--choice", "yes", "--choice", "no", "--stop", "e", "--max-new-tokens",
      "8"],
     "stop strings cannot be combined with a constraint"),
    (["generate", "x", "--regex", "ab", "--min-new-tokens", "5", "--max-new-tokens", "8"],
     "min_new_tokens=5 but every text of its constraint ends after at most 2 tokens"),
    (["generate", "x", "--regex", "a(?=b)", "--max-new-tokens", "8"], "uses a lookaround"),
])
def test_cli_user_mistakes_give_one_line_and_exit_2(tiny, capsys, argv, fragment):
  _, path = tiny
  if argv[0] in ("generate", "eval"):
    argv = argv + ["--model", path]
  code, _, err = run_cli(capsys, *argv)
  assert code == 2
  assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_eval_prints_nats_and_bits_per_byte(tiny, capsys, tmp_path):
  _, path = tiny
  text = tmp_path / "t.txt"
  text.write_text("hello world\n")
  code, out, _ = run_cli(capsys, "eval", str(text), "--model", path)
  words = out.split()
  nats, bits = float(words[0]), float(words[2].lstrip("("))
  assert code == 0 and words[1] == "nats/byte" and words[3] == "bits/byte)"
  assert bits == pytest.approx(nats / math.log(2), abs=2e-4)
  model, _ = tiny
  data = np.frombuffer(b"hello world\n", np.uint8).astype(np.int32)
  expected = training.evaluate(*nnx.split(model), data, CONFIG.max_len)
  assert nats == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
def test_embedded_models_load_and_meet_their_reported_held_out_loss():
  """The embedded main and draft models: trained on this Python's stdlib + pydoc topics with
  whole files held out; their recorded held-out losses are re-measured here on a slice."""
  import os  # pylint: disable=import-outside-toplevel
  from jaxdecode.models import checkpoint, corpus  # pylint: disable=import-outside-toplevel
  from jaxdecode.models import default_metadata, draft_metadata, load_default, load_draft
  model, tokenizer = load_default()
  draft = load_draft()
  assert model.config.max_len >= 512 and draft.config.vocab_size == model.config.vocab_size
  assert os.path.getsize(checkpoint.DEFAULT_PATH) <= 8 * 2**20
  assert os.path.getsize(checkpoint.DRAFT_PATH) <= 2**20
  held = corpus.stdlib_corpus().parts["stdlib"][:8192]
  for m, meta in ((model, default_metadata()), (draft, draft_metadata())):
    assert meta["corpus"]["source"] == "python stdlib + pydoc_data.topics" and meta["finished"]
    assert set(meta["held_out"]) == {"stdlib", "pydoc topics"}
    nats = training.evaluate(*nnx.split(m), held, m.config.max_len)
    assert abs(nats - meta["held_out"]["stdlib"]) < 0.25  # a slice of the same held-out files
  assert default_metadata()["held_out"]["stdlib"] <= 1.1
  assert default_metadata()["held_out"]["stdlib"] < draft_metadata()["held_out"]["stdlib"]
  assert tokenizer.decode(tokenizer.encode("for x in y:")) == "for x in y:"


def test_cli_bench_runs_the_suite_and_rejects_bad_flags(capsys):
  code, _, err = run_cli(capsys, "bench", "--quick", "--runs", "2")
  assert code == 2 and "runs" in err and "Traceback" not in err
  code, out, _ = run_cli(capsys, "bench", "--help")
  assert code == 0 and "--quick" in out and "jaxdecode bench" in out


@pytest.mark.slow
def test_cli_structured_output_matches_with_json_beams_and_a_draft(tiny, capsys, tmp_path):
  _, path = tiny
  schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
  (tmp_path / "s.json").write_text(json.dumps(schema))
  code, out, _ = run_cli(capsys, "generate", "a", "b", "--model", path, "--json-schema",
                         str(tmp_path / "s.json"), "--max-new-tokens", "40", "--json", "-n", "2")
  rows = json.loads(out)["rows"]
  assert code == 0 and len(rows) == 4
  for row in rows:  # a finished row parses and has the required key; others are cut short
    if row["finished"]:
      assert isinstance(json.loads(row["text"])["n"], int)
    else:
      assert len(row["tokens"]) == 40
  code, out, _ = run_cli(capsys, "generate", "a", "--model", path, "--choice", "yes",
                         "--choice", "no", "--beams", "2", "--num-return", "2", "--no-stream",
                         "--max-new-tokens", "8")
  assert code == 0 and sorted(re.findall(r"^a(yes|no)$", out, re.M)) == ["no", "yes"]
  code, out, _ = run_cli(capsys, "generate", "a", "--model", path, "--regex", "[0-9]{3}",
                         "--draft", "ngram", "--json", "--max-new-tokens", "8")
  text = json.loads(out)["rows"][0]["text"]
  assert code == 0 and re.fullmatch("[0-9]{3}", text)


@pytest.mark.slow
def test_generate_and_stream_take_a_prebuilt_constraint(tiny):
  model, _ = tiny
  vocab = TOK.vocabulary()
  options = ["yes", "no", "maybe"]
  c = jaxdecode.structured.stack([jaxdecode.structured.choice(options, vocab), None])
  out = generate(["a", "b"], model=model, constraint=c, max_new_tokens=8, seed=3)
  assert out.texts[0] in options and out.finished[0]
  streamed = ["", ""]
  for chunk in jaxdecode.models.stream(["a", "b"], model=model, constraint=c, max_new_tokens=8,
                                       seed=3, chunk_size=2):
    streamed = [s + t for s, t in zip(streamed, chunk.texts)]
  assert streamed == out.texts
  with pytest.raises(ValueError, match="not both"):
    generate(["a"], model=model, constraint=c, choices=options, max_new_tokens=8)
  with pytest.raises(ValueError, match="2 rows .* the batch has 3"):
    generate(["a", "b", "c"], model=model, constraint=c, max_new_tokens=8)


@pytest.mark.slow
def test_a_dead_end_is_reported_by_generate_and_the_command_with_status_3(tiny, capsys):
  """min_new_tokens=3 against a constraint with a 2-token text: a row that takes it can only
  stop at a dead end (its EOS is masked, nothing else is allowed). The first greedy call learns
  which of "b" / "c" the model prefers after "a"; the constraint then makes that one end the
  text, so the row dead-ends for sure: flagged in Generation, in --json and on stderr."""
  model, path = tiny
  first = generate(["x"], model=model, regex="a(b|c)", params=jaxdecode.SamplingParams(0.0),
                   max_new_tokens=4)
  short = first.texts[0][1]
  other = "c" if short == "b" else "b"
  pattern = f"a({short}|{other}defg)"
  out = generate(["x"], model=model, regex=pattern,
                 params=jaxdecode.SamplingParams(0.0, min_new_tokens=3), max_new_tokens=8)
  assert out.texts == ["a" + short] and out.dead_end.tolist() == [True]
  assert out.finished.tolist() == [False]
  code, text, err = run_cli(capsys, "generate", "x", "--model", path, "--regex", pattern,
                            "--greedy", "--min-new-tokens", "3", "--max-new-tokens", "8", "--json")
  row = json.loads(text)["rows"][0]
  assert code == 3 and row["dead_end"] is True and row["finished"] is False
  assert row["text"] == "a" + short
  assert "1 row(s) stopped at a dead end (prompt 1)" in err
  code, text, err = run_cli(capsys, "generate", "x", "--model", path, "--regex", pattern,
                            "--greedy", "--max-new-tokens", "8", "--json")
  assert code == 0 and json.loads(text)["rows"][0]["dead_end"] is False and not err


@pytest.mark.slow
def test_generate_stream_and_the_cli_give_the_history_rules_the_prompt(tiny, capsys):
  """no_repeat_ngram_size and bad_words see the prompt (transformers' reading): no new token
  completes a trigram of prompt + text, the bad word never appears; stream = generate; the
  command's flags build the same params."""
  model, path = tiny
  prompts = ["abcabcab", "zz"]
  params = jaxdecode.SamplingParams(temperature=0.0, no_repeat_ngram_size=3, bad_words=[[99, 100]],
                                    top_n_sigma=2.0, xtc_probability=1.0, xtc_threshold=0.2)
  out = generate(prompts, model=model, params=params, max_new_tokens=12)
  for b, prompt in enumerate(prompts):
    seq = TOK.encode(prompt) + out.tokens[b, :out.lengths[b]].tolist()
    grams = [tuple(seq[i:i + 3]) for i in range(len(seq) - 2)]
    start = len(TOK.encode(prompt)) - 2  # the first trigram that ends in a new token
    assert all(g not in grams[:i] for i, g in enumerate(grams) if i >= start), seq
    assert "cd" not in out.texts[b]
  # Sampled rows with the stateful rules (mirostat's mu, DRY's history): stream = generate.
  sampled = jaxdecode.SamplingParams(temperature=[0.9, 1.1], mirostat=[2, 0], mirostat_tau=3.0,
                                     dry_multiplier=0.8, dynatemp_range=[0.0, 0.5],
                                     no_repeat_ngram_size=3)
  whole = generate(prompts, model=model, params=sampled, max_new_tokens=12, seed=4)
  streamed = ["", ""]
  for chunk in jaxdecode.models.stream(prompts, model=model, params=sampled, max_new_tokens=12,
                                       seed=4, chunk_size=5):
    streamed = [s + t for s, t in zip(streamed, chunk.texts)]
  assert streamed == whole.texts
  code, printed, _ = run_cli(capsys, "generate", *prompts, "--model", path, "--greedy",
                             "--no-repeat-ngram-size", "3", "--bad-word", "cd", "--top-n-sigma",
                             "2", "--xtc-probability", "1", "--xtc-threshold", "0.2",
                             "--max-new-tokens", "12", "--json", "--top-p", "1")
  report = json.loads(printed)
  assert code == 0 and [r["text"] for r in report["rows"]] == out.texts
