"""Issue 14: streaming, stop strings, n samples, top log-probabilities, prompt log-probabilities."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode.models import (ByteTokenizer, Transformer, TransformerConfig, forward, generate,
                              stream)
from jaxdecode.models.extras import RowText

TOK = ByteTokenizer()
CONFIG = TransformerConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=64)
ASCII_AB = jaxdecode.SamplingParams(allowed_token_ids=[97, 98])  # texts over {a, b}, no EOS
# Bytes of "é" (C3 A9) and "€" (E2 82 AC) and "x": texts mix whole characters, characters cut
# by a chunk border, and invalid sequences (U+FFFD).
MULTIBYTE = jaxdecode.SamplingParams(allowed_token_ids=[0xC3, 0xA9, 0xE2, 0x82, 0xAC, 120])


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(0))


def stream_module():
  return sys.modules["jaxdecode.models.stream"]


def joined(chunks, rows):
  pieces = [[] for _ in range(rows)]
  last = None
  for chunk in chunks:
    for r, piece in enumerate(chunk.texts):
      pieces[r].append(piece)
    last = chunk
  return ["".join(p) for p in pieces], pieces, last


# ---------------------------------------------------------------------------------------------
# Bad values: ValueError naming the argument, before anything compiles.


@pytest.mark.parametrize("bad, match", [
    (dict(n=0), r"n must be an integer in \[1, 2147483647\]; got 0"),
    (dict(n=1.5), "n must be"),
    (dict(top_logprobs=21), r"top_logprobs must be an integer in \[1, 20\].*got 21"),
    (dict(top_logprobs=-1), "top_logprobs must be .* got -1"),
    (dict(top_logprobs=True), "top_logprobs must be"),
    (dict(stop=[""]), r"stop\[0\] must be a non-empty string"),
    (dict(stop=["ok", 3]), r"stop\[1\] must be a non-empty string"),
    (dict(stop=b"ok"), "stop must be a string or a list of strings; got b'ok'"),
    (dict(stop=["ok", "\udcff"]), r"stop\[1\] is not valid Unicode at character 0"),
    (dict(logprobs_mode="softmax"), "logprobs_mode must be one of \\['processed', 'raw'\\]"),
    # An array equal to "raw" is not "raw" (it would become an unhashable static argument).
    (dict(logprobs_mode=np.array("raw")), "logprobs_mode must be one of"),
    (dict(seed="1"), "seed must be an integer in"),
    (dict(seed=1.5), "seed must be an integer in"),
    (dict(seed=2**70), r"seed must be an integer in \[0, 4294967295\]"),
    (dict(seed=-1), r"seed must be an integer in \[0, 4294967295\]"),
    (dict(seed=2**32), r"seed must be an integer in \[0, 4294967295\]"),
    (dict(include_stop="yes"), "include_stop must be True or False"),
    (dict(prompt_logprobs=1), "prompt_logprobs must be True or False"),
    (dict(n=2, beam_size=2), "n > 1 does not apply to beam search"),
    (dict(top_logprobs=2, draft="ngram"), "top_logprobs is not available with draft"),
])
def test_bad_values_raise_before_compiling(model, bad, match):
  with pytest.raises(ValueError, match=match):
    generate(["hi"], model=model, max_new_tokens=2, **bad)
  if "beam_size" not in bad and "draft" not in bad and "top_logprobs" not in bad \
      and "logprobs_mode" not in bad and "prompt_logprobs" not in bad:
    with pytest.raises(ValueError, match=match):
      stream(["hi"], model=model, max_new_tokens=2, **bad)  # raised by the call, not iteration


def test_stream_refuses_what_it_does_not_stream(model):
  with pytest.raises(ValueError, match="stream does not support top_logprobs"):
    stream(["hi"], model=model, top_logprobs=2)
  with pytest.raises(ValueError, match="chunk_size must be an integer >= 1; got 0"):
    stream(["hi"], model=model, chunk_size=0)


@pytest.mark.parametrize("bad, match", [
    (dict(logprobs_mode="procesed"),
     r"logprobs_mode must be one of \['processed', 'raw'\]; got 'procesed'"),
    (dict(prompt_logprobs=1), "prompt_logprobs must be True or False; got 1"),
    (dict(top_logprobs=False), r"top_logprobs must be an integer in \[1, 20\].*got False"),
    (dict(top_logprobs=0.0), r"top_logprobs must be an integer in \[1, 20\].*got 0.0"),
    (dict(num_draft_tokens=0), r"num_draft_tokens must be an integer in \[1, 16\]; got 0"),
])
def test_stream_names_a_bad_value_before_refusing_what_it_does_not_stream(model, bad, match):
  # A typo is a bad value (as generate says), not an option that stream does not support.
  with pytest.raises(ValueError, match=match):
    stream(["hi"], model=model, max_new_tokens=2, **bad)
  with pytest.raises(ValueError, match=match):
    generate(["hi"], model=model, max_new_tokens=2, **bad)


def test_decode_checks_top_logprobs_and_mode():
  logits = jnp.zeros((1, 4))
  kw = dict(key=jax.random.key(0), params=jaxdecode.SamplingParams(), max_new_tokens=2,
            positions=jnp.array([1]))
  step_fn = lambda state, tokens, positions: (jnp.zeros((1, 4)), state)
  with pytest.raises(ValueError, match="top_logprobs must be .* got 21"):
    jaxdecode.decode(step_fn, {}, logits, top_logprobs=21, **kw)
  with pytest.raises(ValueError, match="logprobs_mode must be one of"):
    jaxdecode.decode(step_fn, {}, logits, logprobs_mode="logits", **kw)
  # The vocabulary has 4 tokens: no list of 5 (lax.top_k would fail while tracing).
  with pytest.raises(ValueError, match=r"top_logprobs must be at most the vocabulary size, 4; "
                                       r"got 5"):
    jaxdecode.decode(step_fn, {}, logits, top_logprobs=5, **kw)


# ---------------------------------------------------------------------------------------------
# The incremental text decoder and stop strings, by hand.


def test_row_text_equals_tokenizer_decode_however_the_bytes_are_split():
  rng = np.random.default_rng(0)
  texts = ["héllo €uro 😀!", "日本語", "a\u00e9\u20ac\U0001f600b"]
  for trial in range(300):
    if trial < 150:  # valid UTF-8, multi-byte characters split anywhere
      ids = TOK.encode(texts[trial % 3], bos=False)
    else:  # any bytes: invalid sequences, cut characters, special ids
      ids = rng.choice([0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 97,
                        TOK.BOS, TOK.EOS], size=int(rng.integers(0, 12))).tolist()
    cuts = sorted(rng.choice(len(ids) + 1, size=min(3, len(ids) + 1), replace=False).tolist())
    row, pieces, start = RowText(), [], 0
    for cut in cuts + [len(ids)]:
      row.feed(ids[start:cut])
      pieces.append(row.release())
      start = cut
    row.close()
    pieces.append(row.release())
    assert "".join(pieces) == TOK.decode(ids), ids
    assert row.tokens == len(ids) and not row.stopped


def test_row_text_stop_strings_by_hand():
  ids = TOK.encode("say hello, world", bos=False)
  row = RowText(stop=("lo,", "world"))
  row.feed(ids[:7])  # "say hel": the last 4 characters (len("world") - 1) are held back
  first = row.release()
  assert first == "say"
  row.feed(ids[7:])
  assert row.stopped and row.tokens == len("say hello,")
  assert first + row.release() == "say hel"
  # include_stop keeps it; the earliest-ending match wins, then the longest at that end.
  row = RowText(stop=("hello", "el"), include_stop=True)
  row.feed(ids)
  assert (row.text, row.tokens) == ("say hel", 7)
  row = RowText(stop=("c", "bc"))
  row.feed(TOK.encode("abcd", bos=False))
  assert (row.text, row.tokens) == ("a", 3)
  # A stop string that is a multi-byte character ends at its last byte.
  row = RowText(stop=("€",))
  row.feed(TOK.encode("5€ each", bos=False))
  assert (row.text, row.tokens) == ("5", 4)


# ---------------------------------------------------------------------------------------------
# Top log-probabilities in decode (a hand-made step function).


@pytest.mark.slow
def test_decode_top_lists_greedy_top1_raw_and_processed():
  vocab = 6
  table = jax.random.normal(jax.random.key(3), (vocab, vocab)) * 2.0

  def step_fn(state, tokens, positions):
    return table[tokens], state

  logits = table[jnp.array([1, 4])]
  kw = dict(key=jax.random.key(0), max_new_tokens=5, positions=jnp.array([3, 1]))
  greedy = jaxdecode.SamplingParams(temperature=0.0)
  plain = jaxdecode.decode(step_fn, {}, logits, params=greedy, **kw)
  assert plain.top_tokens is None and plain.top_logprobs is None  # off: nothing added
  out = jaxdecode.decode(step_fn, {}, logits, params=greedy, top_logprobs=4, **kw)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.top_tokens[..., 0], out.tokens)  # greedy token = top-1
  np.testing.assert_array_equal(out.top_logprobs[..., 0], 0.0)  # greedy: a point mass
  assert np.all(out.top_logprobs[..., 1:] == -np.inf)
  raw = jaxdecode.decode(step_fn, {}, logits, params=greedy, top_logprobs=vocab,
                         logprobs_mode="raw", **kw)
  tokens = np.asarray(raw.tokens)
  previous = np.concatenate([[[1], [4]], tokens[:, :-1]], axis=1)
  expected = np.asarray(jax.nn.log_softmax(table))[previous]  # [B, N, V], by hand
  order = np.argsort(-expected, axis=-1, kind="stable")
  np.testing.assert_array_equal(raw.top_tokens, order)
  np.testing.assert_allclose(raw.top_logprobs, np.take_along_axis(expected, order, -1),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(raw.logprobs, np.take_along_axis(expected, tokens[..., None],
                                                              -1)[..., 0], rtol=1e-6, atol=1e-6)
  # Processed with top_k=3: only 3 finite entries, and the drawn token's log-prob is its entry.
  top3 = jaxdecode.SamplingParams(temperature=1.0, top_k=3)
  out = jaxdecode.decode(step_fn, {}, logits, params=top3, top_logprobs=5, **kw)
  assert np.all(np.isfinite(out.top_logprobs).sum(-1) == 3)
  hit = out.top_tokens == np.asarray(out.tokens)[..., None]
  assert hit.sum(-1).tolist() == [[1] * 5] * 2
  np.testing.assert_array_equal(out.top_logprobs[hit], np.asarray(out.logprobs).ravel())
  # Sampled tokens do not depend on the lists or the mode.
  same = jaxdecode.decode(step_fn, {}, logits, params=top3, **kw)
  np.testing.assert_array_equal(out.tokens, same.tokens)
  np.testing.assert_array_equal(out.logprobs, same.logprobs)


# ---------------------------------------------------------------------------------------------
# Through the model.


@pytest.mark.slow
def test_sample_i_of_prompt_b_is_the_separate_request(model):
  prompts, n = ["ab", "xyz"], 3
  params = jaxdecode.SamplingParams(temperature=jnp.array([1.0, 0.7]), top_k=40)
  for key in (jax.random.key(7), jax.random.split(jax.random.key(8), 2)):
    out = generate(prompts, model=model, params=params, key=key, max_new_tokens=12, n=n,
                   top_logprobs=2)
    assert out.tokens.shape == (6, 12) and len(out.texts) == 6
    row_keys = [jax.random.fold_in(key, b) for b in range(2)] if key.shape == () else key
    for b, prompt in enumerate(prompts):
      for i in range(n):
        alone = generate([prompt], model=model, key=jax.random.fold_in(row_keys[b], i)[None],
                         params=jaxdecode.SamplingParams(float(params.temperature[b]), top_k=40),
                         max_new_tokens=12, top_logprobs=2)
        row = b * n + i
        np.testing.assert_array_equal(out.tokens[row], alone.tokens[0])
        np.testing.assert_array_equal(out.logprobs[row], alone.logprobs[0])
        np.testing.assert_array_equal(out.top_logprobs[row], alone.top_logprobs[0])
        assert out.texts[row] == alone.texts[0]
  assert len(set(out.texts[:n])) == n  # the samples of a prompt differ


@pytest.mark.slow
def test_generate_top_lists_greedy_and_raw_against_a_full_forward(model):
  graphdef, weights = nnx.split(model)
  out = generate(["def f"], model=model, params=jaxdecode.SamplingParams(temperature=0.0),
                 max_new_tokens=6, top_logprobs=5, logprobs_mode="raw")
  tokens = out.tokens[0, :out.lengths[0]].tolist()
  np.testing.assert_array_equal(out.top_tokens[0, :len(tokens), 0], tokens)  # greedy = top-1
  seq, length = jaxdecode.right_pad([TOK.encode("def f") + tokens], pad_id=TOK.PAD, width=16)
  logits = forward(graphdef, weights, seq, length)[0]
  prompt = len(TOK.encode("def f"))
  expected = np.asarray(jax.nn.log_softmax(logits[prompt - 1:prompt - 1 + len(tokens)]))
  order = np.argsort(-expected, axis=-1, kind="stable")[:, :5]
  np.testing.assert_array_equal(out.top_tokens[0, :len(tokens)], order)
  np.testing.assert_allclose(out.top_logprobs[0, :len(tokens)],
                             np.take_along_axis(expected, order, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_prompt_logprobs_of_prompt_plus_continuation_are_the_continuation_logprobs(model):
  out = generate(["ab"], model=model, params=ASCII_AB, seed=3, max_new_tokens=10,
                 logprobs_mode="raw")
  text = out.texts[0]
  assert len(text) == 10 and set(text) <= {"a", "b"}
  again = generate(["ab" + text], model=model, seed=3, max_new_tokens=1, prompt_logprobs=True)
  lp = again.prompt_logprobs[0]
  assert lp.shape == (12,)  # one per prompt byte (BOS has none)
  np.testing.assert_allclose(lp[2:], out.logprobs[0], rtol=0, atol=1e-6)
  # The prefill pass that also scores the prompt gives the same tokens.
  plain = generate(["ab" + text], model=model, seed=3, max_new_tokens=1)
  np.testing.assert_array_equal(again.tokens, plain.tokens)
  np.testing.assert_array_equal(again.logprobs, plain.logprobs)


@pytest.mark.slow
def test_stop_strings_across_chunk_borders_in_generate_and_stream(model):
  base = generate(["ab"], model=model, params=ASCII_AB, seed=5, max_new_tokens=16)
  text = base.texts[0]
  stop = text[3:5]  # tokens 3 and 4: a border of stream's chunks (token 0, then 1-3, 4-6...)
  at = text.find(stop)
  for include_stop in (False, True):
    out = generate(["ab"], model=model, params=ASCII_AB, seed=5, max_new_tokens=16, stop=[stop],
                   include_stop=include_stop)
    end = at + len(stop)
    assert out.texts[0] == text[:end if include_stop else at]
    assert out.finished[0] and out.lengths[0] == end
    np.testing.assert_array_equal(out.tokens[0, :end], base.tokens[0, :end])
    np.testing.assert_array_equal(out.tokens[0, end:], TOK.PAD)
    np.testing.assert_array_equal(out.logprobs[0, end:], 0.0)
    texts, pieces, last = joined(stream(["ab"], model=model, params=ASCII_AB, seed=5,
                                        max_new_tokens=16, stop=[stop],
                                        include_stop=include_stop, chunk_size=3), 1)
    assert texts == out.texts and last.finished[0] and last.done[0]
    assert last.lengths[0] == end
    assert all(stop not in p for p in pieces[0][:-1])  # never shown before it is resolved


@pytest.mark.slow
def test_stream_pieces_join_to_generate_with_split_multibyte_characters(model):
  kw = dict(model=model, params=MULTIBYTE, seed=11, max_new_tokens=24, n=2)
  out = generate(["é", "€"], **kw)
  texts, pieces, last = joined(stream(["é", "€"], chunk_size=2, **kw), 4)
  assert texts == out.texts
  np.testing.assert_array_equal(last.lengths, out.lengths)
  for r in range(4):  # the texts do have characters cut by a chunk border
    assert TOK.decode(out.tokens[r, :out.lengths[r]]) == out.texts[r]
  assert any("é" in t or "€" in t for t in out.texts)
  cut = 0
  for r in range(4):
    row = out.tokens[r]
    # a character starting in chunk k (tokens 1 + 2k, 2 + 2k) and ending in the next one
    starts = [t for t in range(1, 23) if row[t] in (0xC3, 0xE2) and t % 2 == 0]
    cut += sum(1 for t in starts if TOK.decode(row[t:t + (2 if row[t] == 0xC3 else 3)])
               in ("é", "€"))
  assert cut > 0


@pytest.mark.slow
def test_stream_compiles_one_chunk_program(model):
  chunk_fn = stream_module()._chunk  # pylint: disable=protected-access
  list(stream(["hello"], model=model, seed=0, max_new_tokens=20, chunk_size=4))
  compiled = chunk_fn._cache_size()  # pylint: disable=protected-access
  chunks = list(stream(["other", "x"], model=model, key=jax.random.key(3),
                       params=jaxdecode.SamplingParams(temperature=jnp.array([0.5, 1.0])),
                       max_new_tokens=20, chunk_size=4))
  assert len(chunks) > 3
  # New prompts (same width bucket), keys and params: no new program. The batch size is
  # static: [B] = 2 compiles once, like decode.
  list(stream(["again", "y"], model=model, seed=9, max_new_tokens=20, chunk_size=4))
  assert chunk_fn._cache_size() == compiled + 1  # pylint: disable=protected-access


# ---------------------------------------------------------------------------------------------
# The command.


@pytest.fixture(scope="module")
def tiny_path(model, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("ckpt") / "tiny.msgpack")
  jaxdecode.models.save_checkpoint(path, CONFIG, nnx.split(model)[1])
  return path


def run_cli(capsys, *argv):
  from jaxdecode.tools import cli  # pylint: disable=import-outside-toplevel
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.slow
def test_cli_streams_the_same_text_and_prints_json_and_tables(tiny_path, capsys):
  args = ["generate", "ab", "cd", "--model", tiny_path, "--max-new-tokens", "10", "-n", "2",
          "--stop", "e", "--stop", "zz", "--seed", "4"]
  code, streamed, _ = run_cli(capsys, *args, "--stream")
  assert code == 0
  code, whole, _ = run_cli(capsys, *args, "--no-stream")
  assert code == 0
  body = lambda s: s.split("\n--- temperature")[0]
  assert body(streamed) == body(whole) and "--- [2] 'cd' sample 2/2" in whole
  assert "n=2 stop=['e', 'zz'] seed=4" in whole
  code, text, _ = run_cli(capsys, *args, "--json", "--top-logprobs", "3")
  assert code == 0
  import json  # pylint: disable=import-outside-toplevel
  report = json.loads(text)
  out = generate(["ab", "cd"], model=jaxdecode.models.load_checkpoint(tiny_path)[0],
                 params=jaxdecode.SamplingParams(0.8, top_p=0.95), seed=4, max_new_tokens=10,
                 n=2, stop=["e", "zz"], top_logprobs=3)
  assert [r["text"] for r in report["rows"]] == out.texts
  assert [(r["prompt"], r["sample"]) for r in report["rows"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  assert report["rows"][3]["tokens"] == out.tokens[3, :out.lengths[3]].tolist()
  assert report["rows"][0]["top"][0]["tokens"] == out.top_tokens[0, 0].tolist()
  assert report["settings"]["stop"] == ["e", "zz"] and report["settings"]["n"] == 2
  code, table, _ = run_cli(capsys, "generate", "ab", "--model", tiny_path, "--greedy",
                           "--max-new-tokens", "2", "--top-logprobs", "2", "--logprobs-mode",
                           "raw")
  assert code == 0 and "step  token     logprob   top 2" in table


@pytest.mark.parametrize("flags, message", [
    (["-n", "0"], "argument -n: expected a positive integer"),
    (["--top-logprobs", "21"], "top_logprobs must be an integer in [1, 20]"),
    (["--stop", ""], "stop[0] must be a non-empty string"),
    # Not UTF-8 on the command line (Python keeps the byte as a lone surrogate): it could
    # never match, and --json could not print it.
    (["--stop", "\udcff", "--json"], "stop[0] is not valid Unicode at character 0"),
    (["--logprobs-mode", "x"], "invalid choice"),
])
def test_cli_bad_flags_are_one_line_errors(tiny_path, capsys, flags, message):
  code, _, err = run_cli(capsys, "generate", "ab", "--model", tiny_path, *flags)
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1
