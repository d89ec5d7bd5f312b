"""The benchmark's plumbing on tiny sizes, and the exactness of its sort-based reference.

No timing assertions here: speed is shown by `jaxdecode bench`, never asserted by a test.
"""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdecode
from jaxdecode import SamplingParams
from jaxdecode.tools import bench
import reference

SAMPLERS = ("argmax", "greedy", "sample", "top_k", "top_p", "min_p", "chain",
            *bench.CONTROL_PARAMS)
HAS_TRANSFORMERS = bench.transformers_top_p_sampler() is not None


def _positive_finite(x):
  return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def kernel_result():
  return bench.run_benchmarks(batches=(2,), vocabs=(1000,), runs=5, decode=False,
                              command="test")


@pytest.mark.slow
def test_kernel_rows_have_every_median_and_ratio(kernel_result):
  rows = kernel_result["kernel"]
  assert [(r["shape"], r["batch"], r["vocab"]) for r in rows] == [("wide", 2, 1000),
                                                                   ("lm", 2, 1000)]
  expected = set(SAMPLERS) | {bench.SORT_PEER} | ({bench.HF_PEER} if HAS_TRANSFORMERS else set())
  for row in rows:
    assert row["runs"] == 5
    assert set(row["median_s"]) == expected == set(row["ratio"])
    assert row["ratio"]["argmax"] == 1.0
    for value in [*row["median_s"].values(), *row["ratio"].values(), *row["speedup"].values()]:
      assert _positive_finite(value)
    assert set(row["speedup"]) == {"vs_sort"} | ({"vs_transformers"} if HAS_TRANSFORMERS else set())
    assert row["speedup"]["vs_sort"] == row["median_s"][bench.SORT_PEER] / row["median_s"]["top_p"]


@pytest.mark.slow
def test_result_is_valid_json_and_formats_as_a_table(kernel_result):
  text = json.dumps(bench._finite(kernel_result), allow_nan=False)
  back = json.loads(text)
  assert set(back) == {"command", "machine", "settings", "notes", "kernel", "decode", "beam",
                       "numerics", "numerics_transformers", "speculative", "stream",
                       "structured", "scoring"}
  assert back["decode"] == back["beam"] == back["structured"] == back["scoring"] == []  # decode=False: no model tables
  assert back["settings"]["runs"] == 5 and back["settings"]["seconds"] > 0
  for field in ("platform", "cpu_count", "device_kind", "devices", "jax"):
    assert back["machine"][field]
  table = bench.format_table(kernel_result)
  assert "$ test" in table and "argmax ms" in table
  assert sum(line.startswith(("wide ", "lm ")) for line in table.splitlines()) == 6  # 3 tables
  assert "penalties  bias+ban" in table and "top-nσ       xtc" in table
  assert max(len(line) for line in table.splitlines()) <= 100


def test_time_round_robin_alternates_after_warmup():
  calls = []
  fns = {name: (lambda name=name: calls.append(name) or jnp.zeros(())) for name in "abc"}
  times = bench.time_round_robin(fns, 3, warmup=2)
  assert calls[:6] == list("abcabc")  # warm-up: every function twice
  assert calls[6:] == list("abc") + list("bca") + list("cab")  # each run starts one further
  assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}


@pytest.mark.slow
def test_peers_are_skipped_above_the_size_limit_and_without_transformers(monkeypatch):
  monkeypatch.setattr(bench.kernels, "transformers_top_p_sampler", lambda top_p=0.9: None)
  result = bench.run_benchmarks(batches=(2,), vocabs=(1000,), shapes=("wide",), runs=5,
                                decode=False)
  (row,) = result["kernel"]
  assert bench.SORT_PEER in row["median_s"] and bench.HF_PEER not in row["median_s"]
  assert any("transformers" in note for note in result["notes"])
  (row,) = bench.kernel_table(batches=(2,), vocabs=(1000,), shapes=("wide",), runs=5,
                              peer_max_elements=1999)
  assert row["peers_skipped"] and row["speedup"] == {}
  assert bench.SORT_PEER not in row["median_s"] and bench.HF_PEER not in row["median_s"]


def test_logit_shapes():
  wide = np.asarray(bench.make_logits("wide", 3, 500))
  lm = np.asarray(bench.make_logits("lm", 3, 500))
  assert wide.dtype == lm.dtype == np.float32 and wide.shape == lm.shape == (3, 500)
  np.testing.assert_array_equal(wide, np.asarray(bench.make_logits("wide", 3, 500)))
  profile = -3.3 * np.log(np.arange(1, 501))
  for row in lm:  # every row is the Zipf profile, permuted; rows differ
    np.testing.assert_allclose(np.sort(row)[::-1], profile, rtol=1e-6)
  assert not np.array_equal(lm[0], lm[1])
  with pytest.raises(ValueError, match="shape"):
    bench.make_logits("flat", 1, 10)


def _examples():
  rng = np.random.default_rng(1)
  yield "gaussian", rng.normal(size=(6, 40)).astype(np.float32) * 3
  yield "lm", np.asarray(bench.make_logits("lm", 4, 64, seed=3))
  # Ties at the boundary: top-p 0.5 must keep all three tied tokens (the definition in jaxdecode.processors).
  yield "ties", np.log(np.array([[0.4, 0.2, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]], np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99, 1.0])
def test_sort_reference_keeps_exactly_the_top_p_set(top_p):
  for name, x in _examples():
    mask = np.asarray(bench.sort_top_p_mask(jnp.asarray(x), top_p))
    ours = np.isfinite(np.asarray(jaxdecode.process_logits(jnp.asarray(x),
                                                           SamplingParams(top_p=top_p))))
    for r in range(x.shape[0]):
      keep, ambiguous = reference.top_p_keep(x[r], top_p)  # float64, the definition literally
      sure = ~ambiguous
      np.testing.assert_array_equal(mask[r][sure], keep[sure], err_msg=f"{name} row {r}")
      np.testing.assert_array_equal(mask[r][sure], ours[r][sure], err_msg=f"{name} row {r}")
  ties = np.asarray(bench.sort_top_p_mask(jnp.log(jnp.array([[0.4, 0.2, 0.2, 0.2]])), 0.5))
  assert ties.tolist() == [[True, True, True, True]]


def test_sort_reference_takes_per_row_top_p():
  x = jnp.asarray(next(_examples())[1])
  p = jnp.array([0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
  per_row = np.asarray(bench.sort_top_p_mask(x, p))
  for r in range(x.shape[0]):
    np.testing.assert_array_equal(per_row[r], np.asarray(bench.sort_top_p_mask(x, p[r]))[r])


@pytest.mark.slow
def test_sort_reference_samples_from_the_renormalized_nucleus():
  x = jnp.asarray(np.log(np.array([[0.35, 0.05, 0.25, 0.2, 0.1, 0.05],
                                   [0.05, 0.05, 0.1, 0.1, 0.3, 0.4]], np.float32)))
  kept = np.isfinite(np.asarray(jaxdecode.process_logits(x, SamplingParams(top_p=0.7))))
  n = 4000
  keys = jax.random.split(jax.random.key(0), n)
  tokens = np.asarray(jax.vmap(bench.sort_top_p_sample, in_axes=(0, None, None))(keys, x, 0.7))
  assert tokens.shape == (n, 2) and tokens.dtype == np.int32
  for r in range(2):
    assert kept[r][tokens[:, r]].all()  # only tokens of the nucleus
    probs = np.where(kept[r], np.exp(np.asarray(x[r], np.float64)), 0)
    probs /= probs.sum()
    counts = np.bincount(tokens[:, r], minlength=6)
    sigma = np.sqrt(n * probs * (1 - probs)) + 1e-9
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma + 1e-9), (r, counts, n * probs)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers (Flax) is an optional extra")
def test_transformers_peer_draws_from_the_nucleus():
  x = jnp.asarray(next(_examples())[1])
  kept = np.isfinite(np.asarray(jaxdecode.process_logits(x, SamplingParams(top_p=0.9))))
  hf = bench.transformers_top_p_sampler(0.9)
  for seed in range(5):
    tokens = np.asarray(hf(jax.random.key(seed), x))
    assert kept[np.arange(x.shape[0]), tokens].all()


@pytest.mark.slow
def test_decode_table_on_a_tiny_model():
  def tiny():
    return bench.random_model(300, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=64)

  def missing():
    raise ValueError("model checkpoint 'default.msgpack' does not exist")

  rows = bench.decode_table([("missing", missing), ("tiny", tiny)], runs=5, batch=4,
                            max_new_tokens=8)
  assert rows[0]["model"] == "missing" and "does not exist" in rows[0]["skipped"]
  row = rows[1]
  assert row["model"] == "tiny" and row["vocab"] == 300 and row["batch"] == 4
  assert row["max_new_tokens"] == 8 and row["runs"] == 5
  assert set(row["median_s"]) == {"greedy", "top_p", "greedy_eos"}
  assert set(row["tokens_per_s"]) == {"greedy", "top_p"}
  assert set(row["ratio"]) == {"top_p_vs_greedy", "first_vs_later", "early_stop_vs_full"}
  for value in [row["first_call_s"], *row["median_s"].values(), *row["tokens_per_s"].values(),
                *row["ratio"].values()]:
    assert _positive_finite(value)
  assert row["early_stop_max_length"] <= 2  # every row stopped at once
  result = {"command": "", "machine": bench.machine_info(), "notes": [], "kernel": [],
            "decode": rows, "settings": {"runs": 5, "warmup": 2, "seconds": 1.0,
                                         "decode_batch": 4, "max_new_tokens": 8}}
  table = bench.format_table(result)
  assert "tiny" in table and "missing" in table and "skipped" in table
  json.dumps(bench._finite(result), allow_nan=False)


@pytest.mark.parametrize("argv", [["--runs", "3"], ["--quick", "--runs", "4"],
                                  ["--runs", "ten"], ["--runs", "10"], ["--bogus"],
                                  ["--quick", "extra"]])
def test_bad_command_lines_exit_2_in_one_line(argv, capsys, monkeypatch):
  monkeypatch.setattr(bench.report, "run_benchmarks",
                      lambda **kw: pytest.fail("must not run"))
  assert bench.main(argv) == 2
  out, err = capsys.readouterr()
  assert out == "" and len(err.strip().splitlines()) == 1 and "error" in err


def test_help_exits_0(capsys):
  assert bench.main(["--help"]) == 0
  assert "--quick" in capsys.readouterr().out


@pytest.mark.slow
def test_main_prints_json_or_a_table(kernel_result, capsys, monkeypatch):
  seen = {}

  def fake_run(**kwargs):
    seen.update(kwargs)
    return dict(kernel_result, command=kwargs["command"])

  monkeypatch.setattr(bench.report, "run_benchmarks", fake_run)
  assert bench.main(["--quick", "--json", "--no-decode", "--runs", "5"]) == 0
  back = json.loads(capsys.readouterr().out)
  assert back["command"] == "python -m jaxdecode.bench --quick --json --no-decode --runs 5"
  assert seen["quick"] and seen["runs"] == 5 and not seen["decode"] and not seen["all_peers"]
  assert seen["beam"] is seen["numerics"] is seen["spec"] is seen["stream"] is None
  assert seen["structured"] is seen["scoring"] is None  # follow --decode, as the model tables do
  ratios = [v for row in back["kernel"] for v in row["ratio"].values()]
  assert ratios and all(_positive_finite(v) for v in ratios)
  assert bench.main(["--quick", "--all-peers"], prog="jaxdecode bench") == 0
  out = capsys.readouterr().out
  assert out.startswith("$ jaxdecode bench --quick --all-peers\n") and "argmax ms" in out
  assert seen["all_peers"] and seen["decode"] and seen["runs"] is None
  assert bench.main(["--quick", "--no-beam"]) == 0
  capsys.readouterr()
  assert seen["beam"] is False and seen["decode"]
  assert bench.main(["--quick", "--no-kernels", "--no-numerics", "--no-spec"]) == 0
  capsys.readouterr()
  assert not seen["kernels"] and seen["numerics"] is False and seen["spec"] is False
  assert seen["stream"] is None
  assert bench.main(["--quick", "--no-stream", "--no-scoring"]) == 0
  capsys.readouterr()
  assert seen["stream"] is False and seen["scoring"] is False
  assert bench.main(["--no-kernels", "--no-decode", "--structured"]) == 0
  capsys.readouterr()
  assert seen["structured"] is True and not seen["decode"]
  assert bench.main(["--no-structured"]) == 0
  capsys.readouterr()
  assert seen["structured"] is False and seen["decode"]


def test_decode_table_skips_a_model_whose_context_is_too_short():
  def short():
    return bench.random_model(300, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=20)

  (row,) = bench.decode_table([("short", short)], runs=5, batch=2, max_new_tokens=8)
  assert row["model"] == "short" and "max_len" in row["skipped"]


@pytest.mark.slow
def test_beam_table_on_a_tiny_model():
  def tiny():
    return bench.random_model(300, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=64)

  def short():
    return bench.random_model(300, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=12)

  rows = bench.beam_table([("tiny", tiny), ("short", short)], runs=5, batch=2,
                          max_new_tokens=6, beam_size=3)
  row = rows[0]
  assert (row["model"], row["vocab"], row["batch"], row["beam_size"], row["max_new_tokens"],
          row["runs"]) == ("tiny", 300, 2, 3, 6, 5)
  assert set(row["median_s"]) == set(row["tokens_per_s"]) == {"greedy", "beam"}
  for value in [*row["median_s"].values(), *row["tokens_per_s"].values(),
                *row["ratio"].values()]:
    assert _positive_finite(value)
  r = row["ratio"]
  assert r["beam_vs_greedy"] == row["median_s"]["greedy"] / row["median_s"]["beam"]
  assert r["beam_model_tokens_vs_greedy"] == pytest.approx(3 * r["beam_vs_greedy"])
  assert rows[1]["model"] == "short" and "max_len" in rows[1]["skipped"]
  result = {"command": "", "machine": bench.machine_info(), "notes": [], "kernel": [],
            "decode": [], "beam": rows,
            "settings": {"runs": 5, "warmup": 2, "seconds": 1.0, "decode_batch": 2,
                         "max_new_tokens": 6, "beam_size": 3}}
  table = bench.format_table(result)
  assert "Beam search: jaxdecode.beam_search, K = 3 beams, vs greedy decode; batch 2" in table
  assert max(len(line) for line in table.splitlines()) <= 100
  assert any(line.startswith("tiny ") for line in table.splitlines()) and "skipped" in table
  json.dumps(bench._finite(result), allow_nan=False)


def _tiny_model(invariant, *, max_len):
  """A loader of the numerics and scoring tables: a 1-layer model in the asked numerics."""
  config = bench.TransformerConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                                   max_len=max_len, batch_invariant=invariant)
  return bench.Transformer(config, rngs=nnx.Rngs(0))


def _missing_model(invariant):
  raise ValueError("model checkpoint 'default.msgpack' does not exist")


@pytest.mark.slow
def test_numerics_table_on_a_tiny_model():
  tiny = functools.partial(_tiny_model, max_len=128)
  (row,) = bench.numerics_table(batches=(2,), runs=5, max_new_tokens=8, loader=tiny)
  assert row["batch"] == 2 and row["late_position"] == 128 - 32
  assert set(row["median_s"]) == set(row["first_call_s"]) == {"invariant", "plain"}
  assert set(row["step_ms"]) == {"early", "late"}
  for value in [*row["median_s"].values(), *row["first_call_s"].values(),
                *row["step_ms"].values(), *row["ratio"].values()]:
    assert _positive_finite(value)
  (skipped,) = bench.numerics_table(batches=(1,), runs=5, max_new_tokens=8, loader=_missing_model)
  assert "does not exist" in skipped["skipped"]
  result = {"command": "", "machine": bench.machine_info(), "notes": [], "kernel": [],
            "decode": [], "numerics": [row, skipped],
            "settings": {"runs": 5, "warmup": 2, "seconds": 1.0, "max_new_tokens": 8}}
  table = bench.format_table(result)
  assert "Numerics:" in table and "position 96 over one at position 32" in table
  assert "skipped: ValueError" in table


@pytest.mark.slow
def test_transformers_numerics_table_on_a_tiny_gpt2_or_a_line_saying_why_not(monkeypatch):
  def unavailable(*args, **kwargs):
    raise ImportError("cannot import name 'FlaxGPT2LMHeadModel'")

  with monkeypatch.context() as m:
    m.setattr(bench.numerics, "transformers_gpt2", unavailable)
    skipped = bench.transformers_numerics_table(batches=(1, 8), runs=5)
  assert [row["batch"] for row in skipped] == [1, 8]
  assert all("transformers<5" in row["skipped"] for row in skipped)
  rows = skipped
  if HAS_TRANSFORMERS:
    tiny = bench.transformers_gpt2({"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 50,
                                    "n_positions": 64})
    (row,) = bench.transformers_numerics_table(batches=(2,), runs=5, max_new_tokens=4,
                                               model=tiny)
    assert row["batch"] == 2 and set(row["median_s"]) == set(row["first_call_s"]) == set(
        row["train_s"]) == {"invariant", "plain"}
    assert set(row["ratio"]) == {"invariant_vs_plain", "train_invariant_vs_plain"}
    for value in [*row["median_s"].values(), *row["first_call_s"].values(),
                  *row["train_s"].values(), *row["ratio"].values()]:
      assert _positive_finite(value)
    rows = [row] + skipped
  result = {"command": "", "machine": bench.machine_info(), "notes": [], "kernel": [],
            "decode": [], "numerics_transformers": rows,
            "settings": {"runs": 5, "warmup": 2, "seconds": 1.0, "max_new_tokens": 4}}
  table = bench.format_table(result)
  assert "transformers' Flax GPT-2" in table and "skipped: transformers with its Flax" in table
  assert ("train inv/plain" in table) == HAS_TRANSFORMERS
  assert max(len(line) for line in table.splitlines()) <= 100


@pytest.mark.slow
def test_spec_table_on_a_tiny_model_counts_acceptance_and_calls():
  def tiny():
    return bench.random_model(259, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=256)

  def no_draft():
    raise ValueError("draft checkpoint 'draft.msgpack' does not exist")

  rows = bench.spec_table(batches=(1,), ks=(2,), texts=("repetitive",), runs=5,
                          max_new_tokens=8, model_loader=tiny, draft_loader=tiny)
  assert [(r["drafter"], r["sampler"]) for r in rows] == [
      ("ngram", "greedy"), ("ngram", "top-p"), ("model", "greedy"), ("model", "top-p")]
  for row in rows:
    assert 0.0 <= row["acceptance"]["2"] <= 1.0 and _positive_finite(row["speedup"]["2"])
    # 8 tokens: the prefill's first, then rounds of 1 to 3 tokens each.
    assert math.ceil(7 / 3) <= row["calls"]["2"] <= 7
  skipped = bench.spec_table(batches=(1,), ks=(2,), texts=("fresh",), runs=5, max_new_tokens=8,
                             model_loader=tiny, draft_loader=no_draft)
  assert "does not exist" in skipped[0]["skipped"] and len(skipped) == 3
  result = {"command": "", "machine": bench.machine_info(), "notes": [], "kernel": [],
            "decode": [], "speculative": rows + skipped,
            "settings": {"runs": 5, "warmup": 2, "seconds": 1.0, "max_new_tokens": 8,
                         "spec_ks": [2]}}
  table = bench.format_table(result)
  assert "Speculative:" in table and "drafter model skipped" in table
  assert "repetitive  1 ngram   greedy" in table


def test_spec_prompts_repeat_a_pattern_or_open_a_paragraph():
  (rep,) = bench.spec_prompts("repetitive", 1)
  assert rep.count("def get_") == 4 and rep.endswith("    def get_height(self):\n")
  fresh = bench.spec_prompts("fresh", 9)
  assert fresh[0] == fresh[8] == "The for statement" and len(set(fresh)) == 8


@pytest.mark.slow
def test_stream_table_on_a_tiny_model():
  def tiny():
    return bench.random_model(259, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=128)

  (row,) = bench.stream_table(batches=(2,), runs=5, max_new_tokens=20, model_loader=tiny)
  assert row["batch"] == 2 and row["chunk_size"] == 16 and row["runs"] == 5
  assert 1 <= row["chunks"] <= 3  # 20 tokens: the first, then chunks of up to 16 steps
  assert _positive_finite(row["ratio"]["stream_vs_generate"])
  result = {"command": "", "machine": bench.machine_info(), "notes": [], "kernel": [],
            "stream": [row], "settings": {"runs": 5, "warmup": 2, "seconds": 1.0,
                                          "max_new_tokens": 20}}
  assert "Streaming: models.stream" in bench.format_table(result)


def test_byte_level_decoder_is_a_bijection_onto_the_bytes():
  table = bench.byte_level_decoder()
  assert len(table) == 256 and sorted(table.values()) == list(range(256))
  assert table["A"] == ord("A") and table["\u0120"] == ord(" ")  # GPT-2's "Ġ" is a space


@pytest.mark.slow
def test_structured_table_on_a_tiny_model_and_a_small_bpe_vocabulary():
  def tiny():
    return bench.random_model(259, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=128)

  texts = [doc for doc in bench.spec_prompts("fresh", 8)] * 20 + ['{"a": [1, 2.5, "x@y.z"]}']
  # One constraint keeps it to two decode programs (each constraint compiles its own).
  rows = bench.structured_table(batches=(2,), runs=5, max_new_tokens=4, vocab_size=400,
                                model_loader=tiny, vocab_texts=texts, constraints=("json",),
                                extra_compiles=("maxlen1000",))
  decode, compiled, extra = rows
  assert (decode["kind"], decode["batch"], decode["max_new_tokens"]) == ("decode", 2, 4)
  assert set(decode["median_s"]) == {"plain", "json"} and set(decode["ratio"]) == {"json_vs_plain"}
  for value in [*decode["median_s"].values(), *decode["ratio"].values()]:
    assert _positive_finite(value)
  assert (compiled["kind"], compiled["constraint"]) == ("compile", "json")
  assert 256 < compiled["vocab"] <= 400 and compiled["table_bytes"] > 0
  assert _positive_finite(compiled["compile_s"]) and _positive_finite(compiled["index_s"])
  assert _positive_finite(compiled["peak_mb"]) and extra["index_s"] is None
  assert extra["constraint"] == "maxlen1000" and extra["table_shape"][0] >= 1000
  result = {"command": "", "machine": bench.machine_info(), "notes": [], "kernel": [],
            "structured": rows, "settings": {"runs": 5, "warmup": 2, "seconds": 1.0,
                                             "structured_new_tokens": 4}}
  table = bench.format_table(result)
  assert "Structured: jaxdecode.decode with constraint=" in table and "Structured compile" in table
  assert max(len(line) for line in table.splitlines()) <= 100
  json.dumps(bench._finite(result), allow_nan=False)


@pytest.mark.slow
def test_scoring_table_on_a_tiny_model():
  """About 2 minutes on 2 cores: a row compiles 8 programs (3 rollouts and a training step, in
  each numerics mode), whatever the sizes."""
  tiny = functools.partial(_tiny_model, max_len=64)
  rows = bench.scoring_table(batches=(2,), runs=2, max_new_tokens=4, loader=tiny)
  assert [row["mode"] for row in rows] == ["invariant", "plain"]
  for row in rows:
    assert (row["batch"], row["max_new_tokens"], row["runs"]) == (2, 4, 2)
    assert set(row["median_s"]) == {"processed", "raw", "all_kinds", "train"}
    assert set(row["tokens_per_s"]) == set(row["median_s"])
    assert set(row["ratio"]) == {"raw_vs_processed", "all_kinds_vs_processed", "train_vs_plain"}
    for value in [*row["median_s"].values(), *row["tokens_per_s"].values(),
                  *row["ratio"].values()]:
      assert _positive_finite(value)
    assert row["tokens_per_s"]["raw"] == 2 * 4 / row["median_s"]["raw"]
  invariant, plain = rows
  assert plain["ratio"]["train_vs_plain"] == 1.0
  assert invariant["ratio"]["train_vs_plain"] == (invariant["median_s"]["train"] /
                                                  plain["median_s"]["train"])
  (skipped,) = bench.scoring_table(batches=(1,), runs=2, max_new_tokens=4, loader=_missing_model)
  assert skipped["batch"] == 1 and "does not exist" in skipped["skipped"]
  result = {"command": "", "machine": bench.machine_info(), "notes": [], "kernel": [],
            "scoring": rows + [skipped], "settings": {"runs": 2, "warmup": 2, "seconds": 1.0}}
  table = bench.format_table(result)
  assert "Scoring: rollouts with log-probs" in table and "B=1 skipped: ValueError" in table
  assert sum(line.startswith(("invariant ", "plain ")) for line in table.splitlines()) == 2
  assert max(len(line) for line in table.splitlines()) <= 100
  json.dumps(bench._finite(result), allow_nan=False)


@pytest.mark.parametrize("kwargs", [dict(batches=(0,)), dict(batches=()), dict(runs=0),
                                    dict(max_new_tokens=1.5)])
def test_scoring_table_refuses_bad_sizes_before_compiling(kwargs):
  def loader(invariant):
    pytest.fail("must not load a model")

  name = next(iter(kwargs))
  with pytest.raises(ValueError, match=name):
    bench.scoring_table(loader=loader, **kwargs)


@pytest.mark.parametrize("argv, named", [(["--rounds", "0"], "--rounds"),
                                         (["--batches", "1,0"], "--batches"),
                                         (["--new", "-1"], "--new"),
                                         (["--families", "bert"], "--families")])
def test_families_bench_refuses_bad_arguments_before_building_a_model(argv, named, capsys):
  from jaxdecode.tools.bench import families  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as stop:
    families.main(argv)
  assert stop.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.slow
def test_families_bench_row_on_a_tiny_gpt2():
  """The three samplers on one tiny model: tokens/s from the medians, ratios to the family's
  own `generate`, and the markdown row."""
  pytest.importorskip("transformers")
  from jaxdecode.tools.bench import families  # pylint: disable=import-outside-toplevel
  row = families.family_rows("gpt2", 2, new=3, prompt=4, rounds=2, vocab=300, width=32,
                             layers=1, positions=16)
  assert (row["family"], row["batch"], row["new"], row["rounds"]) == ("gpt2", 2, 3, 2)
  for name in ("jaxdecode", "jaxdecode batch_invariant", "transformers generate"):
    assert _positive_finite(row[name])
  assert row["plain / own"] == row["jaxdecode"] / row["transformers generate"]
  assert row["invariant / own"] == row["jaxdecode batch_invariant"] / row["transformers generate"]
  header, rule, line = families.format_rows([row]).splitlines()
  assert header.count("|") == rule.count("|") == line.count("|") == 8
  assert line.startswith("| gpt2 | 2 | ") and line.endswith(f"| {row['invariant / own']:.2f} |")
