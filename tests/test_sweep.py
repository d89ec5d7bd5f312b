"""The sampling sweep (quick grid, run once) and its command."""

import csv
import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdecode import SamplingParams
from jaxdecode.tools import cli, sweep
from jaxdecode.models import generate

pytestmark = pytest.mark.slow  # the whole module: it runs the real model end to end

EXPECTED_SETTINGS = ["greedy", "T=0.5", "T=0.7", "T=1", "T=1.3", "top-k 5", "top-k 20",
                     "top-k 100", "top-p 0.5", "top-p 0.8", "top-p 0.95", "min-p 0.05",
                     "min-p 0.1", "top-nσ 1", "top-nσ 1 T=1.3", "XTC 0.1/0.5",
                     "min-p 0.05 + XTC", "DRY 0.8", "min-p 0.05 + DRY", "mirostat τ=3",
                     "mirostat τ=5", "dynatemp 0.5"]
METRICS = ("eos_rate", "distinct_1", "distinct_2", "distinct_3", "distinct_4",
           f"repetition_{sweep.REPETITION_N}", "longest_repeat", "log_likelihood", "entropy")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  return sweep.run_sweep(tmp_path_factory.mktemp("sweep"), quick=True, seed=0)


def _index(name):
  return EXPECTED_SETTINGS.index(name)


def _csv_rows(path):
  with open(path, newline="", encoding="utf-8") as f:
    reader = csv.DictReader(f)
    return reader.fieldnames, list(reader)


def test_docstring_examples():
  out = doctest.testmod(sweep, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert out.attempted > 0 and out.failed == 0


def test_csv_has_one_row_per_setting_with_finite_metrics(result):
  header, rows = _csv_rows(result["csv"])
  assert tuple(header) == sweep.COLUMNS
  assert [r["setting"] for r in rows] == EXPECTED_SETTINGS
  n_prompts, steps = len(sweep.QUICK_PROMPTS), sweep.QUICK_MAX_NEW_TOKENS
  for row, setting in zip(rows, sweep.GRID):
    assert (float(row["temperature"]), int(row["top_k"]), float(row["top_p"]),
            float(row["min_p"])) == pytest.approx((setting.temperature, setting.top_k,
                                                   setting.top_p, setting.min_p))
    assert int(row["sequences"]) == n_prompts and 0 < int(row["tokens"]) <= n_prompts * steps
    values = {m: float(row[m]) for m in METRICS}
    assert all(math.isfinite(v) for v in values.values()), row
    for n in range(1, 5):
      assert 0 < values[f"distinct_{n}"] <= 1
    assert 0 <= values[f"repetition_{sweep.REPETITION_N}"] < 1
    assert values["log_likelihood"] < 0 and values["entropy"] >= 0
  # The CSV holds the returned rows, rounded to 4 decimals.
  for row, returned in zip(rows, result["rows"]):
    for m in METRICS:
      assert float(row[m]) == pytest.approx(returned[m], abs=5e-5)


def test_png_is_a_valid_image(result):
  with open(result["png"], "rb") as f:
    data = f.read()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
  width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
  assert width >= 1000 and height >= 500
  from matplotlib import image  # pylint: disable=import-outside-toplevel
  pixels = image.imread(result["png"])
  assert pixels.shape[:2] == (height, width) and pixels[..., :3].std() > 0.05  # not blank


def test_greedy_has_entropy_zero(result):
  g = _index("greedy")
  assert result["rows"][g]["entropy"] == 0.0
  np.testing.assert_array_equal(result["entropies"][g], 0.0)
  np.testing.assert_array_equal(result["logprobs"][g], 0.0)  # a point mass: log 1
  others = [row["entropy"] for row in result["rows"][1:]]
  assert min(others) > 0


def _sweep_rows(result):
  """The sweep's batch again: prompts, per-row params and keys, row r = (setting r // P, r % P)."""
  prompts = list(result["prompts"])
  return (prompts * len(sweep.GRID), sweep.grid_params(sweep.GRID, len(prompts)),
          jnp.tile(sweep.prompt_keys(result["seed"], len(prompts)), len(sweep.GRID)))


def test_greedy_rows_equal_a_separate_greedy_generate(result):
  # The same batch shape as the sweep's (so no new compile), every row greedy, other keys.
  prompts, _, keys = _sweep_rows(result)
  alone = generate(prompts, params=SamplingParams(temperature=0.0), key=keys[::-1],
                   max_new_tokens=result["max_new_tokens"])
  g, n_prompts = _index("greedy"), len(result["prompts"])
  for s in range(len(sweep.GRID)):
    np.testing.assert_array_equal(alone.tokens[s * n_prompts:(s + 1) * n_prompts],
                                  result["tokens"][g])
  assert alone.texts[:n_prompts] == result["texts"][g]


def test_each_row_depends_only_on_its_prompt_key_and_setting(result):
  """The sweep's rows in reverse order, in a separate call: every row comes out the same."""
  prompts, params, keys = _sweep_rows(result)
  reverse = jax.tree.map(lambda v: v[::-1], params.broadcast(len(prompts)))
  alone = generate(prompts[::-1], params=reverse, key=keys[::-1],
                   max_new_tokens=result["max_new_tokens"])
  tokens = alone.tokens[::-1].reshape(result["tokens"].shape)  # back to [S, P, N]
  # Since the keys were tile(prompt_keys), this also shows that prompt i had the same key under
  # every setting.
  np.testing.assert_array_equal(tokens, result["tokens"])


def test_higher_temperature_spreads_the_distribution_on_the_same_keys(result):
  rows = {row["setting"]: row for row in result["rows"]}
  assert rows["T=1.3"]["entropy"] > rows["T=0.5"]["entropy"]
  assert rows["T=1.3"]["log_likelihood"] < rows["T=0.5"]["log_likelihood"]


def test_top_k_5_entropy_is_at_most_ln_5_at_every_step(result):
  assert result["entropies"][_index("top-k 5")].max() <= math.log(5) + 1e-5
  assert result["entropies"][_index("top-p 0.5")].max() > 0


def test_teacher_forced_likelihood_equals_the_decodes_logprobs_at_temperature_1(result):
  """At T = 1 with no cut the processed distribution is the raw one; a cut only renormalizes
  the kept tokens upward, so the sampler's log-probability is never below the model's."""
  lengths = result["lengths"]
  valid = np.arange(result["max_new_tokens"])[None, None, :] < lengths[:, :, None]  # [S, P, N]
  t1 = _index("T=1")
  np.testing.assert_allclose(result["log_likelihoods"][t1][valid[t1]],
                             result["logprobs"][t1][valid[t1]], atol=2e-4)
  for name in ("top-k 5", "top-k 20", "top-k 100", "top-p 0.5", "top-p 0.8", "top-p 0.95",
               "min-p 0.05", "min-p 0.1"):
    s = _index(name)
    gap = result["logprobs"][s][valid[s]] - result["log_likelihoods"][s][valid[s]]
    assert gap.min() >= -2e-4, name


def test_run_sweep_rejects_bad_arguments_before_compiling(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  with pytest.raises(ValueError, match="exists and is a file, not a folder"):
    sweep.run_sweep(a_file, quick=True)
  with pytest.raises(ValueError, match=r"seed must be an integer in \[0, \d+\]; got -1"):
    sweep.run_sweep(tmp_path, quick=True, seed=-1)
  with pytest.raises(ValueError, match=r"prompts\[1\] must be a non-empty string"):
    sweep.run_sweep(tmp_path, prompts=["a", ""])
  with pytest.raises(ValueError, match="top_p must be"):
    sweep.run_sweep(tmp_path, grid=[sweep.Setting("bad", "top-p", top_p=1.5)])


def run_cli(capsys, *argv):
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


def test_cli_sweep_quick_writes_the_same_csv_for_the_same_seed(result, capsys, tmp_path):
  code, out, _ = run_cli(capsys, "sweep", "--quick", "--out", str(tmp_path))
  assert code == 0
  assert out.splitlines()[0].split() == list(sweep.COLUMNS)
  names = [line.split("  ")[0] for line in out.splitlines()[1:]]
  assert names[:len(EXPECTED_SETTINGS)] == EXPECTED_SETTINGS
  with open(result["csv"], encoding="utf-8") as a, open(tmp_path / "sweep.csv",
                                                        encoding="utf-8") as b:
    assert a.read() == b.read()
  assert (tmp_path / "sweep.png").stat().st_size > 0 and (tmp_path / "samples.txt").exists()


@pytest.mark.parametrize("argv,fragment", [
    (["sweep", "--quick", "--out", "{tmp}", "--frobnicate"],
     "unrecognized arguments: --frobnicate"),
    (["sweep", "--quick"], "the following arguments are required: --out"),
    (["sweep", "--out", "{tmp}", "--seed", "-1"], "expected an integer >= 0, got '-1'"),
    (["sweep", "--quick", "--out", "{tmp}/a_file"], "exists and is a file, not a folder"),
])
def test_cli_sweep_mistakes_give_one_line_and_exit_2(capsys, tmp_path, argv, fragment):
  (tmp_path / "a_file").write_text("x")
  argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
  code, _, err = run_cli(capsys, *argv)
  assert code == 2
  assert fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_module_command_help_and_bad_flag(capsys):
  assert sweep.main(["--help"]) == 0
  assert "--quick" in capsys.readouterr().out
  assert sweep.main(["--out"]) == 2
  err = capsys.readouterr().err
  assert "python -m jaxdecode.tools.sweep: error:" in err and len(err.strip().splitlines()) == 1


def test_entropy_replay_draws_the_decodes_log_probabilities_bit_for_bit(result):
  """The entropy column replays every step (DRY's history with the prompt, XTC's coin,
  mirostat's mu): along the sweep's tokens, the replay's log-probability of each drawn token is
  bitwise the decode's, so its entropies are those of the distributions the decode drew from."""
  from jaxdecode import loop, metrics, processors  # pylint: disable=import-outside-toplevel
  from jaxdecode.models import ByteTokenizer, load_default, teacher_forced_logits  # pylint: disable=import-outside-toplevel
  from jaxdecode.prompts import right_pad  # pylint: disable=import-outside-toplevel
  prompts, params, keys = _sweep_rows(result)
  tok = ByteTokenizer()
  prompt_tokens, prompt_lengths = right_pad([tok.encode(p) for p in prompts], pad_id=tok.PAD,
                                            buckets=None)
  tokens = result["tokens"].reshape(len(prompts), -1)
  lengths = result["lengths"].reshape(-1)
  logits = teacher_forced_logits(load_default()[0], prompt_tokens, prompt_lengths, tokens)
  real = np.arange(prompt_tokens.shape[1])[None, :] < np.asarray(prompt_lengths)[:, None]
  rows = len(prompts)
  h, logprobs = metrics._replay(  # pylint: disable=protected-access
      logits, params.broadcast(rows, logits.shape[-1]), jnp.asarray(lengths, jnp.int32),
      jnp.asarray(tokens, jnp.int32), jnp.zeros((rows, logits.shape[-1]), jnp.int32),
      loop.right_aligned_prompt(np.where(real, prompt_tokens, -1)),
      processors.row_keys(keys, rows))
  np.testing.assert_array_equal(np.asarray(logprobs), result["logprobs"].reshape(rows, -1))
  np.testing.assert_array_equal(np.asarray(h), result["entropies"].reshape(rows, -1))
  dry = _index("DRY 0.8")
  assert result["rows"][dry]["entropy"] != result["rows"][_index("T=1")]["entropy"]
