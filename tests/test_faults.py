"""Nothing lost, nothing silently wrong: interrupted writes, bad paths, broken checkpoints, and
the sampler's edge cases that once returned a banned token or an empty row.

Each test names the defect it guards against.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax import serialization

import jaxdecode
from jaxdecode import SamplingParams, _files
from jaxdecode.models import Transformer, TransformerConfig, load_checkpoint, save_checkpoint
from jaxdecode.models import checkpoint as checkpoint_module
from jaxdecode.tools import cli, sweep

TINY = TransformerConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=32)
# /proc refuses new files even for root (tests and CI may run as root, where chmod means nothing).
UNWRITABLE_DIR = "/proc"


def run_cli(capsys, *argv):
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


def one_line_error(code, err, fragment):
  assert code == 2, err
  assert fragment in err, err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------
# Atomic writes.


def _tiny_checkpoint(path, seed=0, metadata=None):
  model = Transformer(TINY, rngs=nnx.Rngs(seed))
  save_checkpoint(str(path), TINY, nnx.split(model)[1], metadata=metadata or {"seed": seed})
  return model


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_killing_training_while_it_saves_leaves_the_old_checkpoint_byte_identical(tmp_path, how):
  out = tmp_path / "model.msgpack"
  _tiny_checkpoint(out)
  old = out.read_bytes()
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
  # A 25M-parameter model: serializing and writing its 50 MB takes long enough to be caught.
  argv = [sys.executable, "-m", "jaxdecode.tools.cli", "train", "--corpus", str(corpus),
          "--out", str(out), "--steps", "1", "--batch-size", "1", "--seq-len", "8",
          "--eval-every", "1", "--warmup-steps", "0", "--d-model", "1024", "--layers", "2",
          "--heads", "8", "--d-ff", "4096", "--max-len", "8"]
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  pattern = str(tmp_path / ".model.msgpack.*.tmp")
  deadline = time.monotonic() + 300
  caught = False
  while time.monotonic() < deadline and proc.poll() is None:
    if glob.glob(pattern):  # the save has begun: the temporary file exists
      proc.send_signal(getattr(signal, how))
      caught = True
      break
    time.sleep(0.0005)
  proc.communicate(timeout=120)
  assert caught, "the save was never observed in progress (the process ended first)"
  assert out.read_bytes() == old  # the previous checkpoint, whole
  load_checkpoint(str(out))
  if how == "SIGTERM":  # a clean stop removes its temporary file
    assert proc.returncode == 128 + signal.SIGTERM
    assert not glob.glob(pattern)


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
  target = tmp_path / "data.json"
  target.write_text("old")

  def broken_fsync(fd):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "fsync", broken_fsync)
  with pytest.raises(ValueError, match="could not be written .No space left on device.; the "
                                       "previous file, if any, is unchanged"):
    _files.atomic_write(target, b"new contents")
  assert target.read_text() == "old"
  assert os.listdir(tmp_path) == ["data.json"]


def test_written_files_get_the_permissions_open_would_give_or_keep_the_old_ones(tmp_path):
  umask = os.umask(0o022)
  try:
    fresh = tmp_path / "fresh.bin"
    _files.atomic_write(str(fresh), b"x")
    assert fresh.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    kept = tmp_path / "kept.bin"
    kept.write_bytes(b"old")
    kept.chmod(0o640)
    _files.atomic_write(str(kept), b"new")
    assert kept.read_bytes() == b"new" and kept.stat().st_mode & 0o777 == 0o640
  finally:
    os.umask(umask)


def test_an_interrupt_during_a_write_leaves_the_old_file(tmp_path, monkeypatch):
  target = tmp_path / "data.json"
  target.write_text("old")
  monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
  with pytest.raises(KeyboardInterrupt):
    _files.atomic_write(target, b"new")
  assert target.read_text() == "old" and os.listdir(tmp_path) == ["data.json"]


# ---------------------------------------------------------------------------------------------
# Output paths are checked before any long work.


@pytest.mark.parametrize("out,fragment", [
    ("{tmp}", "is a directory"),
    (f"{UNWRITABLE_DIR}/jaxdecode_test/model.msgpack", "cannot be created"),
    (f"{UNWRITABLE_DIR}/model.msgpack", "refuses new files"),
    ("{tmp}/a_file/model.msgpack", "is a file, not a folder"),
])
def test_train_rejects_a_bad_out_before_training(capsys, tmp_path, monkeypatch, out, fragment):
  (tmp_path / "a_file").write_text("x")
  started = []
  monkeypatch.setattr(cli.training, "as_corpus", lambda *a: started.append(1))
  code, _, err = run_cli(capsys, "train", "--out", out.replace("{tmp}", str(tmp_path)))
  one_line_error(code, err, fragment)
  assert not started  # nothing was trained, not even the corpus read


def test_sweep_rejects_an_unwritable_folder_before_generating(capsys, monkeypatch):
  monkeypatch.setattr(sweep, "generate", lambda *a, **k: pytest.fail("the sweep ran"))
  assert os.access(UNWRITABLE_DIR, os.W_OK) or os.geteuid() != 0  # what fooled the old check
  code, _, err = run_cli(capsys, "sweep", "--quick", "--out", UNWRITABLE_DIR)
  one_line_error(code, err, "refuses new files")


def test_bench_rejects_a_bad_out_before_timing(capsys, tmp_path):
  from jaxdecode.tools import bench
  code = bench.main(["--quick", "--out", str(tmp_path)], prog="jaxdecode bench")
  err = capsys.readouterr().err
  one_line_error(code, err, "is a directory")


# ---------------------------------------------------------------------------------------------
# Checkpoints are checked when loaded.


def _write_blob(path, **changes):
  """A checkpoint file like save_checkpoint's, with some of its parts replaced."""
  good = str(path) + ".good"
  _tiny_checkpoint(good)
  with open(good, "rb") as f:
    blob = serialization.msgpack_restore(f.read())
  os.remove(good)
  blob.update(changes)
  with open(path, "wb") as f:
    f.write(serialization.msgpack_serialize(blob))
  return blob


def test_checkpoint_without_weights_is_refused(tmp_path):
  path = tmp_path / "empty.msgpack"
  _write_blob(path, weights={})
  with pytest.raises(ValueError, match=r"empty.msgpack' does not match its config: missing "
                                       r"weights \['blocks/0/"):
    load_checkpoint(str(path))


def test_checkpoint_with_nan_weights_is_refused(tmp_path):
  path = tmp_path / "nan.msgpack"
  blob = _write_blob(path)
  blob["weights"]["final_norm"]["scale"] = np.full(16, np.nan, np.float16)
  path.write_bytes(serialization.msgpack_serialize(blob))
  with pytest.raises(ValueError, match="weight final_norm/scale has non-finite values"):
    load_checkpoint(str(path))


def test_checkpoint_whose_config_does_not_match_its_weights_is_refused(tmp_path):
  path = tmp_path / "wide.msgpack"
  config = json.loads(_write_blob(path)["config"])
  config["d_ff"] = 64
  _write_blob(path, config=json.dumps(config))
  with pytest.raises(ValueError, match=r"weight blocks/0/mlp_in/bias has shape \(32,\), but "
                                       r"the config needs \(64,\)"):
    load_checkpoint(str(path))


def test_checkpoint_with_another_vocabulary_is_refused_by_name(tmp_path):
  path = tmp_path / "vocab.msgpack"
  config = json.loads(_write_blob(path)["config"])
  config["vocab_size"] = 300
  _write_blob(path, config=json.dumps(config))
  with pytest.raises(ValueError, match="vocabulary of 300 tokens, but the byte tokenizer has 259"):
    load_checkpoint(str(path))


def test_checkpoint_of_an_unknown_format_and_non_checkpoints_are_refused(tmp_path):
  path = tmp_path / "future.msgpack"
  _write_blob(path, format="jaxdecode-checkpoint/99")
  with pytest.raises(ValueError, match="has checkpoint format 'jaxdecode-checkpoint/99'"):
    load_checkpoint(str(path))
  junk = tmp_path / "junk.msgpack"
  junk.write_bytes(b"\x00\x01not msgpack")
  with pytest.raises(ValueError, match="is not a jaxdecode checkpoint"):
    load_checkpoint(str(junk))
  with pytest.raises(ValueError, match="model checkpoint .* is a directory; give a file"):
    load_checkpoint(str(tmp_path))


def test_a_checkpoint_of_jaxdecode_0_1_without_format_tag_still_loads(tmp_path):
  path = tmp_path / "old.msgpack"
  blob = _write_blob(path)
  del blob["format"]
  path.write_bytes(serialization.msgpack_serialize(blob))
  model, metadata = load_checkpoint(str(path))
  assert model.config == TINY and metadata == {"seed": 0}


def test_save_refuses_non_finite_weights_and_writes_nothing(tmp_path):
  model = Transformer(TINY, rngs=nnx.Rngs(0))
  weights = jax.tree.map(lambda w: w * jnp.inf, nnx.split(model)[1])
  with pytest.raises(ValueError, match="is not finite; refusing to save"):
    save_checkpoint(str(tmp_path / "bad.msgpack"), TINY, weights)
  big = jax.tree.map(lambda w: w + 1e5, nnx.split(model)[1])  # finite, but not as float16
  with pytest.raises(ValueError, match="overflows float16"):
    save_checkpoint(str(tmp_path / "bad.msgpack"), TINY, big)
  assert not os.listdir(tmp_path)


def test_cli_reports_checkpoint_problems_in_one_line(capsys, tmp_path):
  path = tmp_path / "empty.msgpack"
  _write_blob(path, weights={})
  code, _, err = run_cli(capsys, "generate", "x", "--model", str(path))
  one_line_error(code, err, "does not match its config")
  code, _, err = run_cli(capsys, "generate", "x", "--model", str(tmp_path))
  one_line_error(code, err, "is a directory")
  code, _, err = run_cli(capsys, "train", "--corpus", str(tmp_path), "--out",
                         str(tmp_path / "m.msgpack"))
  one_line_error(code, err, "holds 0 UTF-8 text file(s)")  # a folder corpus with no text


# ---------------------------------------------------------------------------------------------
# The selection chain: never a banned token, never an empty row while something is allowed.


KEY = jax.random.key(0)


def test_a_banned_positive_inf_logit_is_removed_not_spread_over_the_row():
  logits = jnp.array([[jnp.inf, 1.0, 2.0]])
  for t in (1.0, 0.0):
    token, logprob = jaxdecode.sample_with_logprobs(KEY, logits,
                                                    SamplingParams(t, banned_token_ids=[0]))
    assert int(token[0]) in (1, 2) and np.isfinite(float(logprob[0]))
  greedy = jaxdecode.sample(KEY, logits, SamplingParams(0.0, banned_token_ids=[0]))
  assert greedy.tolist() == [2]
  # Not in the allowed set is the same as banned.
  token = jaxdecode.sample(KEY, logits, SamplingParams(0.0, allowed_token_ids=[1]))
  assert token.tolist() == [1]
  # A +inf that survives the token sets still takes the whole row.
  assert jaxdecode.sample(KEY, jnp.array([[1.0, jnp.inf, 2.0]]),
                          SamplingParams(banned_token_ids=[0])).tolist() == [1]


@pytest.mark.slow
def test_a_tiny_temperature_that_overflows_to_minus_inf_keeps_the_argmax():
  logits = jnp.array([[-200.0, -100.0]])
  token, logprob = jaxdecode.sample_with_logprobs(KEY, logits, SamplingParams(1e-37))
  assert token.tolist() == [1] and logprob.tolist() == [0.0]
  out = np.asarray(jaxdecode.process_logits(logits, SamplingParams(1e-37)))
  assert out[0, 1] == 0.0 and out[0, 0] == -np.inf  # the point mass it numerically is


_INF_MINUS_INF_ROW = """
import sys
sys.path.insert(0, %r)
import jax, jax.numpy as jnp, numpy as np, jaxdecode
params = jaxdecode.SamplingParams(
    temperature=0.0, top_p=1e-38, repetition_penalty=[1e-30, 1.0], frequency_penalty=[3e38, 0.0],
    logit_bias=[{0: -3e38, 2: 3e38}, {}], banned_token_ids=[[0], []])
counts = np.zeros((2, 5), np.int32)
counts[0, 2] = 3
logits = jnp.full((2, 5), jnp.inf)
tokens, logprobs = jaxdecode.sample_with_logprobs(jax.random.key(0), logits, params, counts=counts)
processed = jaxdecode.process_logits(logits, params, counts=counts)
print((np.asarray(tokens).tolist(), np.asarray(logprobs).tolist(),
       np.asarray(processed)[0].tolist()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("flags", ["", "--xla_backend_optimization_level=0"])
def test_an_infinite_penalty_on_a_saturated_logit_never_empties_the_row(flags):
  """Found by the hostile property test compiled at -O0: token 2's +3e38 bias divided by a 1e-30
  repetition penalty is +inf, less 3 * 3e38 of frequency penalty: inf - inf = NaN, which `clip`
  turned into -3.4e38 at XLA:CPU's defaults but kept as NaN at -O0, emptying a row whose tokens
  1, 3 and 4 are selectable (its +inf logits). The NaN is now the bottom of the range by
  construction; each code generation runs in a process of its own (XLA reads its flags once)."""
  env = dict(os.environ, XLA_FLAGS=flags)
  result = subprocess.run([sys.executable, "-c", _INF_MINUS_INF_ROW % os.path.dirname(
      os.path.dirname(os.path.abspath(__file__)))], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  tokens, logprobs, row = eval(result.stdout.strip().splitlines()[-1].replace("-inf", "None"))  # pylint: disable=eval-used
  assert tokens == [1, 0] and logprobs == [0.0, 0.0]  # rows of +inf ties: the lowest id
  assert row == [None, 0.0, None, None, None]  # token 1 alone: the point mass of top-p 1e-38


def test_saturated_bias_and_penalties_never_empty_a_row():
  logits = jnp.array([[-3e38, 3e38, 1.0]])
  params = SamplingParams(logit_bias={0: -3e38, 1: 3e38})
  out = np.asarray(jaxdecode.process_logits(logits, params))
  assert np.isfinite(out).any() and np.argmax(out) == 1
  counts = jnp.array([[5, 5, 5]])
  huge = SamplingParams(0.5, frequency_penalty=3e38, presence_penalty=3e38)
  token, logprob = jaxdecode.sample_with_logprobs(KEY, logits, huge, counts=counts)
  assert int(token[0]) in (0, 1, 2) and np.isfinite(float(logprob[0]))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.slow
def test_low_precision_outputs_saturate_instead_of_overflowing(dtype):
  logits = jnp.array([[10000.0, 9000.0, 1.0, -jnp.inf]], dtype)
  out = jaxdecode.process_logits(logits, SamplingParams(0.1))  # 100000 > float16's 65504
  assert out.dtype == dtype
  values = np.asarray(out, np.float32)
  assert not np.isposinf(values).any() and np.isneginf(values[0, 3])
  assert values[0, 0] > values[0, 1] > values[0, 2]  # the order of the top tokens is kept
  assert np.isfinite(np.asarray(jax.nn.softmax(values))).all()


@pytest.mark.slow
def test_traced_minus_one_eos_ids_never_make_the_last_token_an_eos():
  vocab = 5

  def step_fn(state, tokens, positions):  # always prefers the last token
    return jnp.zeros((tokens.shape[0], vocab)).at[:, vocab - 1].set(5.0), state

  @jax.jit
  def run(eos_ids, pad_id):
    return jaxdecode.decode(step_fn, {}, jnp.zeros((1, vocab)).at[:, vocab - 1].set(5.0),
                            key=KEY, params=SamplingParams(0.0), max_new_tokens=4,
                            positions=jnp.array([0]), eos_ids=eos_ids, pad_id=pad_id)

  out = run(jnp.array([-1, 2]), jnp.int32(0))
  assert out.tokens.tolist() == [[4, 4, 4, 4]] and not bool(out.finished[0])
  # A traced pad id out of range is replaced by 0 (after the EOS, that is what is written).
  out = run(jnp.array([4]), jnp.int32(99))
  assert out.tokens.tolist() == [[4, 0, 0, 0]]


@pytest.mark.parametrize("field,value,fragment", [
    ("repetition_penalty", 3.5e38, "cannot be represented in float32"),
    ("repetition_penalty", 1e-46, "cannot be represented in float32"),
    ("temperature", 1e-46, "cannot be represented in float32"),
    ("presence_penalty", -1e39, "cannot be represented in float32"),
    ("top_k", 2**40, "fits in int32"),
    ("min_new_tokens", 2**31, "fits in int32"),
])
def test_values_that_cannot_be_represented_are_errors(field, value, fragment):
  with pytest.raises(ValueError, match=fragment):
    SamplingParams(**{field: value})


def test_unrepresentable_ids_biases_and_counts_are_value_errors():
  with pytest.raises(ValueError, match=r"logit_bias keys must be token ids .integers in "
                                       r"\[0, 2\*\*31\)\); got 1099511627776"):
    SamplingParams(logit_bias={2**40: 1.0})
  with pytest.raises(ValueError, match="cannot be represented in float32"):
    SamplingParams(logit_bias={1: 1e39})
  with pytest.raises(ValueError, match=r"banned_token_ids must hold token ids"):
    SamplingParams(banned_token_ids=[2**40])
  with pytest.raises(ValueError, match=r"counts must be in \[0, 2147483647\]"):
    jaxdecode.process_logits(jnp.zeros((1, 3)), SamplingParams(presence_penalty=1.0),
                             counts=np.array([[2**33, 0, 0]]))


@pytest.mark.slow
def test_lists_are_accepted_or_refused_with_value_errors():
  assert jaxdecode.greedy([[0.0, 3.0, 1.0]]).tolist() == [1]
  assert jaxdecode.sample(KEY, [[0.0, 3.0, 1.0]], SamplingParams(0.0)).tolist() == [1]
  with pytest.raises(ValueError, match="logits must be a floating-point array"):
    jaxdecode.greedy([[0, 1]])
  with pytest.raises(ValueError, match="logits must be"):
    jaxdecode.greedy([[0.0, 1.0], [2.0]])  # ragged
  with pytest.raises(ValueError, match=r"positions must be an integer array of shape \(1,\)"):
    jaxdecode.decode(lambda s, t, p: (jnp.zeros((1, 2)), s), {}, jnp.zeros((1, 2)), key=KEY,
                     params=SamplingParams(), max_new_tokens=2, positions=[[0]])
  out = jaxdecode.decode(lambda s, t, p: (jnp.zeros((1, 2)), s), {}, jnp.zeros((1, 2)), key=KEY,
                         params=SamplingParams(0.0), max_new_tokens=2, positions=[0])
  assert out.tokens.tolist() == [[0, 0]]


# ---------------------------------------------------------------------------------------------
# The command: one line, exit 2, whatever went wrong.


def test_cli_huge_seed_is_one_line(capsys):
  code, _, err = run_cli(capsys, "generate", "x", "--seed", "99999999999999999999")
  one_line_error(code, err, "expected a seed in [0, 2**32)")


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_cli_seeds_that_would_share_a_key_are_refused(capsys, seed):
  # jax.random.key keeps 32 bits here: -1 would be 2**32 - 1's key, and 2**32 would be 0's.
  code, _, err = run_cli(capsys, "generate", "x", "--seed", seed)
  one_line_error(code, err, "expected a seed in [0, 2**32)")


def test_cli_invalid_utf8_prompt_is_one_clear_line(capsys):
  prompt = b"caf\xff".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
  code, _, err = run_cli(capsys, "generate", prompt, "--max-new-tokens", "2")
  one_line_error(code, err, "is not valid Unicode at character 3")


def test_cli_eval_of_a_directory_says_so(capsys, tmp_path):
  code, _, err = run_cli(capsys, "eval", str(tmp_path))
  one_line_error(code, err, "is a directory")


def test_cli_os_errors_are_one_line(capsys, tmp_path, monkeypatch):
  def denied(*args, **kwargs):
    raise PermissionError(13, "Permission denied")

  monkeypatch.setattr(checkpoint_module, "_read", denied)
  code, _, err = run_cli(capsys, "generate", "x", "--model", str(tmp_path / "m.msgpack"))
  one_line_error(code, err, "Permission denied")
