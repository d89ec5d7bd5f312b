"""colab/jaxdecode.ipynb runs top to bottom in quick mode and shows what its cells claim."""

import os
import re
import sys

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient

import jaxdecode
from jaxdecode.tools import sweep

pytestmark = pytest.mark.slow  # the whole module: it runs the real model end to end

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "colab", "jaxdecode.ipynb")
CELL_TIMEOUT_S = 300  # quick mode takes about 70 s in all on 2 CPU cores


def _read():
  with open(NOTEBOOK, encoding="utf-8") as f:
    return nbformat.read(f, as_version=4)


def test_notebook_is_stored_clean_and_valid():
  nb = _read()
  nbformat.validate(nb)
  assert nb.nbformat == 4
  assert nb.metadata.kernelspec.name == "python3"
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(not c.outputs and c.execution_count is None for c in code)
  # QUICK is read from the environment once, in the first code cell.
  assert "JAXDECODE_QUICK" in code[0].source
  assert all("JAXDECODE_QUICK" not in c.source for c in code[1:])


def _text(cell) -> str:
  """Everything a code cell printed (stdout and stderr)."""
  return "".join(o.text for o in cell.outputs if o.output_type == "stream")


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
  """The notebook executed in quick mode in an empty folder: `(cells by marker, folder)`.

  The kernel `python3` is pinned to this interpreter: a kernelspec written for sys.executable
  comes first on JUPYTER_PATH, so a user-level `python3` kernel of another Python cannot stand
  in for it.
  """
  work = tmp_path_factory.mktemp("notebook")
  kernels = tmp_path_factory.mktemp("jupyter")
  write_kernel_spec(str(kernels / "kernels" / "python3"))
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("JUPYTER_PATH", str(kernels))
    patch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    patch.setenv("JAXDECODE_QUICK", "1")
    patch.setenv("JAXDECODE_TRAIN", "1")  # quick mode must skip training all the same
    patch.delenv("JAXDECODE_REPO", raising=False)
    patch.setenv("JAX_NUMPY_RANK_PROMOTION", "raise")  # as strict as the other tests
    nb = _read()
    NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                   resources={"metadata": {"path": str(work)}}).execute()
  nbformat.write(nb, str(work / "executed.ipynb"))  # to look at when a check fails
  return nb, work


def _cell(nb, marker: str):
  """The one code cell whose source contains `marker`."""
  found = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
  assert len(found) == 1, f"{len(found)} code cells contain {marker!r}"
  return found[0]


def test_notebook_runs_without_errors(executed):
  """Over a minute (its module fixture executes the notebook: 129-165 s in the CI-way runs on
  2 cores): the cells claim things of the embedded model's own decoding (reproducible texts,
  speculative decoding giving plain decoding's tokens, structured outputs, an RL step with
  equal log-probs, the sweep, the bench and doctor tables), so each compiles the real programs
  a Colab user runs."""
  nb, _ = executed
  errors = [(o.ename, o.evalue) for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
  assert all(c.execution_count for c in nb.cells if c.cell_type == "code")


def test_install_cell_uses_this_environment(executed):
  nb, _ = executed
  out = _text(_cell(nb, "def pip_install"))
  assert "jaxdecode is already importable: nothing to install" in out
  assert "pip install" not in out
  assert f"jaxdecode {jaxdecode.__version__}: " in out
  # The kernel is this interpreter, so it saw the environment under test.
  assert f"python {sys.version.split()[0]}: {sys.executable}\n" in _text(_cell(nb, "jax.devices()"))


def test_settings_devices_model_and_training_cells(executed):
  nb, _ = executed
  assert "quick mode: True; training cell: off; 32 new tokens" in _text(_cell(nb, "QUICK ="))
  out = _text(_cell(nb, "jax.devices()"))
  assert "backend: cpu" in out and "jax.devices(): [CpuDevice(id=0)]" in out
  assert "running on the CPU" in out
  assert "embedded model: 4 layers, d_model 256" in _text(_cell(nb, "load_default()"))
  assert "training skipped" in _text(_cell(nb, "training.train("))


def test_settings_side_by_side(executed):
  nb, _ = executed
  out = _text(_cell(nb, "SETTINGS = {"))
  names = ["greedy", "temperature 0.8", "top-k 20", "top-p 0.9", "top-p 0.9 + repetition 1.3",
           "typical-p 0.9"]
  for prompt in ("The for statement", "A list comprehension", "def __init__(self"):
    block = out.split(repr(prompt) + "\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split(" | ")[0].strip() for line in block] == names
  assert re.search(r"seconds per setting: first [\d.]+ \(compiles\)", out)


def test_reproducibility_cell_printed_true(executed):
  nb, _ = executed
  out = _text(_cell(nb, "alone_equal"))
  assert "same key, same text: True" in out
  assert "row decoded alone equals the same row inside a batch: True" in out
  assert out.count("alone == in the batch: True") == 3
  assert re.search(r"another key changes [1-3] of 3 texts", out)


def test_speculative_cell_gives_the_same_tokens_with_both_drafters(executed):
  nb, _ = executed
  out = _text(_cell(nb, "num_draft_tokens=4"))
  for name in ("prompt lookup", "draft model"):
    assert re.search(rf"{name}: same tokens as plain decoding: True; \d+% of drafts accepted; "
                     rf"\d+ model calls for 32 tokens", out)


def test_structured_cell_matches_its_regex_schema_and_choices(executed):
  nb, _ = executed
  out = _text(_cell(nb, "json_schema=schema"))
  assert "matches: True" in out
  assert "is one of the options: True" in out
  assert re.search(r"json_schema: \{.*\} -> \{'name': .*'year': -?\d+\}|cut by max_new_tokens",
                   out)


def test_rl_cell_trains_with_the_samplers_log_probs_bit_for_bit(executed):
  nb, _ = executed
  lines = _text(_cell(nb, "grpo_loss(")).splitlines()
  assert len(lines) == 2, lines  # quick mode: two GRPO steps
  for step, line in enumerate(lines, start=1):
    assert re.fullmatch(rf"step {step}: reward [01]\.\d{{3}}, \|Δ\| max 0, k3 KL 0, every ratio "
                        rf"exactly 1: True", line), line


def test_sweep_cell_shows_the_plot_and_the_table(executed):
  nb, work = executed
  cell = _cell(nb, "run_sweep(")
  out_dir = work / "jaxdecode_out"
  png = out_dir / "sweep.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out_dir / "sweep.csv").is_file() and (out_dir / "samples.txt").is_file()
  shown = [o for o in cell.outputs if o.output_type == "display_data" and "image/png" in o.data]
  assert len(shown) == 1 and len(shown[0].data["image/png"]) > 1000
  out = _text(cell)
  table = out[out.index("setting "):].splitlines()
  assert table[0].split() == list(sweep.COLUMNS)
  assert [line.split("  ")[0].strip() for line in table[1:len(sweep.GRID) + 1]] == \
      [s.name for s in sweep.GRID]


def test_bench_cell_printed_the_tiny_tables(executed):
  nb, _ = executed
  out = _text(_cell(nb, "run_benchmarks("))
  assert "benchmark on cpu: tiny grid" in out
  assert "backend cpu, device kind cpu" in out
  assert "5 timed runs per row" in out
  assert re.search(r"^lm +2 +1000 +\d", out, re.M) and not re.search(r"^wide ", out, re.M)
  assert "Decode: jaxdecode.decode, batch 2, 8 new tokens per row" in out
  assert re.search(r"^default +259 ", out, re.M)


def test_doctor_cell_printed_its_table_and_the_verdict_last(executed):
  nb, _ = executed
  out = _text(_cell(nb, "doctor.main("))
  lines = out.rstrip("\n").splitlines()
  assert lines[0].startswith("$ jaxdecode doctor --quick --mixes 2 --steps 8 --max-batch 2")
  assert "  backend    cpu (lowering platform cpu); 1 device(s): cpu" in lines
  assert re.search(r"^  batch-invariant +2 +0 +0 +0$", out, re.M)
  assert re.search(r"^sampler cost .*: lm logits \[2, 1000\], 5 runs", out, re.M)
  assert re.search(r"^decode \(jaxdecode\.decode, embedded model\): batch 2, 8 new tokens", out,
                   re.M)
  assert "structure (lowered for cpu, nothing run)" in out and "failed" not in out
  assert lines[-1].startswith("verdict: bitwise promise holds here (0/2 mixes diverge; ")
