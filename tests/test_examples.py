"""Every example runs (in a quick mode) and checks what it claims."""

import importlib.util
import re
import os
import runpy
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import conftest
from jaxdecode.models import training
from jaxdecode.models import load_checkpoint

pytestmark = pytest.mark.slow  # the whole module: it runs the real model end to end

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def load(name):
  return runpy.run_path(os.path.join(EXAMPLES, name))


def test_core_sampling_example(capsys):
  load("core_sampling.py")["main"](draws=2000)
  out = capsys.readouterr().out
  assert "greedy (temperature 0)      1  the=1.00" in out
  assert "top-k 3                     3" in out


@pytest.mark.parametrize("devices", [1, 8])
def test_sharded_decode_example_matches_one_device(devices):
  env = dict(os.environ, XLA_FLAGS=conftest.xla_flags(
                 f"--xla_force_host_platform_device_count={devices}"),
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "sharded_decode.py")],
                          env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"devices: {devices} (cpu)" in result.stdout
  assert "tokens identical to one device: True" in result.stdout


@pytest.fixture(scope="module")
def byom():
  """bring_your_own_model.py as one module for its tests, so they share decode's compiled loop."""
  name = "example_bring_your_own_model"
  spec = importlib.util.spec_from_file_location(name,
                                                os.path.join(EXAMPLES, "bring_your_own_model.py"))
  module = importlib.util.module_from_spec(spec)
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(sys.modules, name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module


def test_quickstart_same_seed_gives_the_same_text(capsys):
  prompts = ["The for statement", "def f(x):"]
  result = load("quickstart.py")["main"](prompts=prompts, max_new_tokens=12)
  out = capsys.readouterr().out
  texts = result["texts"]
  assert list(texts) == ["greedy", "temperature 0.7", "top-k 20", "top-p 0.9", "min-p 0.1"]
  assert all(len(row) == len(prompts) and all(isinstance(t, str) for t in row)
             for row in texts.values())
  assert result["same"] and "identical text for every setting and prompt: True" in out
  # Another seed never moves greedy and moves at least one of the 8 sampled texts.
  assert result["greedy_same_other_seed"]
  assert result["changed_other_seed"] >= 1
  for name, row in texts.items():  # printed side by side, one line per setting
    assert f"{name:<15} | {row[0]}".replace("\n", "\\n") in out


def test_bring_your_own_model_greedy_equals_a_python_argmax_loop(byom, capsys):
  result = byom.main(max_new_tokens=32)
  out = capsys.readouterr().out
  assert result["greedy_matches_python"] and result["pad_after_eos"]
  assert result["moved_rows_match"] and result["history_matches"]
  assert "greedy rows equal a plain Python argmax loop: True" in out
  # The greedy rows of this text all reach "... the dog." and stop at EOS.
  greedy_rows = [0, 1, 3]
  assert [result["texts"][r] for r in greedy_rows] == [" on the dog.", " bird sat on the dog.",
                                                       "the dog."]
  assert all(result["finished"][r] for r in greedy_rows)


def test_bring_your_own_model_checks_catch_a_model_unlike_its_counts(byom, monkeypatch):
  counted_table = byom.log_prob_table

  def noisy_table(vocab, counts):  # same shapes (no new compile), other argmaxes
    table = counted_table(vocab, counts)
    return table + jax.random.normal(jax.random.key(1), table.shape)

  monkeypatch.setattr(byom, "log_prob_table", noisy_table)
  with pytest.raises(SystemExit, match="'greedy_matches_python': False"):
    byom.main(max_new_tokens=32)


def test_train_on_your_text_lowers_the_loss_and_reloads_exactly(tmp_path):
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  text = tmp_path / "mine.txt"  # the user's own file: 23 KB about sequence types
  text.write_text(topics.topics["typesseq"], encoding="utf-8")
  text, out = str(text), str(tmp_path / "mine.msgpack")
  result = load("train_on_your_text.py")["main"](text, quick=True, out=out)
  assert result["val_loss_after"] < result["val_loss_before"] - 1.0
  history = result["history"]  # the held-out loss every 20 steps, from training.train
  assert [h["step"] for h in history] == [20, 40, 60]
  assert history[-1]["val_loss"] < history[0]["val_loss"]
  assert result["val_loss_after"] == pytest.approx(min(h["val_loss"] for h in history),
                                                   abs=1e-5)
  assert result["reload_equals_float16"]
  assert 0 < result["reload_max_diff_float32"] < 0.05  # float16 rounding, nothing more
  assert all(isinstance(t, str) and t for t in result["texts"].values())
  # Independently: the file's model scores the held-out text as the trained model did.
  model, metadata = load_checkpoint(out)
  val = training.as_corpus(text).held_out
  loss = training.evaluate(*nnx.split(model), val, 64)
  assert metadata["steps"] == 60
  assert abs(loss - metadata["val_loss"]) < 0.01


def test_constrained_decoding_writes_only_numbers_and_reuses_the_compiled_loop(capsys):
  result = load("constrained_decoding.py")["main"](max_new_tokens=16)
  out = capsys.readouterr().out
  assert not result["recompiled"]
  for texts in result["texts"].values():
    for text in texts:
      assert re.fullmatch(r"[0-9]+(\.[0-9]*)?", text), text
  assert all(re.fullmatch(r"[a-z]+", w) for w in result["words"])
  assert "every output is a number" in out and "compiled again: False" in out


def test_structured_output_matches_parses_validates_and_picks_a_label(capsys):
  """About a minute on 2 cores: the example decodes the embedded model under a regex, a JSON
  schema, a choice and a mixed batch, each a structured decode of its own to compile."""
  import json  # pylint: disable=import-outside-toplevel
  import jsonschema  # pylint: disable=import-outside-toplevel  # a test dependency
  example = load("structured_output.py")
  result = example["main"](quick=True)
  out = capsys.readouterr().out
  assert result["ok"] and result["finished"]
  assert all(re.fullmatch(example["DATE"], d) for d in result["dates"]["greedy"])
  for record in result["records"]["greedy"]:
    jsonschema.validate(record, example["SCHEMA"])
    json.dumps(record)
  assert all(label in example["LABELS"] for label in result["labels"]["greedy"])
  date, answer, free = result["mixed"]  # one batch, a constraint per prompt (None: free text)
  assert re.fullmatch(example["DATE"], date) and answer in ("yes", "no") and free
  assert "matches its regex, parses and validates, or is one of the labels: True" in out


def test_exact_on_policy_rl_trainer_log_probs_are_the_samplers_at_every_step(capsys):
  """GRPO's quick mode: on the first minibatch of every step the trainer's log-probs
  (jaxdecode.score under value_and_grad) are the sampler's bits (|Δ| max and k3 KL exactly 0,
  every ratio exactly 1; the example asserts it too), the loss is finite, and each step prints
  its line."""
  example = load("exact_on_policy_rl.py")
  result = example["main"](quick=True)
  out = capsys.readouterr().out
  steps = example["QUICK"]["steps"]
  assert result["max_abs"] == [0.0] * steps and result["k3"] == [0.0] * steps
  assert result["ratio_gap"] == [0.0] * steps
  assert all(np.isfinite(result["loss"])) and len(result["rewards"]) == steps
  assert all(0.0 <= r <= 1.0 for r in result["rewards"])
  for step in range(1, steps + 1):
    assert re.search(rf"^step +{step}  reward [01]\.\d{{3}}  \|Δ\| max 0  k3 KL 0  "
                     rf"\|ratio-1\| max 0  loss [+-]\d", out, re.M), out
  assert f"exactly 0 at all {steps} steps" in out
  assert result["png"] is None  # no --out, no plot
  # The reward is a program's verdict: the prompt plus the completion's first line parses.
  assert example["reward"]("x = ", "1 + 2\nnot python (") == 1.0
  assert example["reward"]("print(", "x") == 0.0
  advantages = example["group_advantages"](np.array([1, 0, 0, 0, 1, 1, 1, 1], np.float32), 4)
  np.testing.assert_allclose(advantages, [np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3),
                                          -1 / np.sqrt(3), 0, 0, 0, 0], rtol=1e-5)


def test_exact_on_policy_rl_plain_numerics_show_the_gap(capsys):
  """The negative control: plain kernels for the sampler and the training pass for the trainer
  (--plain) give log-probs that differ (|Δ| > 0, ratio != 1 on policy), so the zeros above
  come from the construction, not from a check that cannot fail."""
  result = load("exact_on_policy_rl.py")["main"](quick=True, plain=True)
  out = capsys.readouterr().out
  assert all(gap > 0 for gap in result["max_abs"]) and all(g > 0 for g in result["ratio_gap"])
  assert all(np.isfinite(result["loss"]))
  assert "plain numerics: on policy |Δ| max up to" in out


def test_exact_on_policy_rl_plot_is_optional(tmp_path, monkeypatch):
  """The reward curve is a PNG written whole, with matplotlib; without it, no file and False
  (main then says so)."""
  example = load("exact_on_policy_rl.py")
  path = tmp_path / "curve.png"
  if importlib.util.find_spec("matplotlib") is not None:
    assert example["plot"]([0.1, 0.5, 0.9], str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path.unlink()
  monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # not installed
  assert not example["plot"]([0.1, 0.5, 0.9], str(path), "title") and not path.exists()


@pytest.mark.parametrize("flags, message", [
    (["--prompts", "3"], "--prompts must be 2, 4, ... up to 8"),
    (["--group-size", "1"], "--group-size must be at least 2"),
    (["--steps", "0"], "argument --steps: expected a positive integer, got '0'")])
def test_exact_on_policy_rl_refuses_bad_flags_in_one_line(flags, message):
  result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "exact_on_policy_rl.py"),
                           *flags], capture_output=True, text=True, timeout=120)
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
