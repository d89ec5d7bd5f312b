"""`jaxdecode doctor`: every section and the verdict, on a tiny checkpoint with the smallest
settings (the real run takes a minute or more); its report from canned figures; its one-line
errors."""

import json
import re

import pytest
from flax import nnx

from jaxdecode.models import Transformer, TransformerConfig, save_checkpoint
from jaxdecode.tools import cli, doctor

# The smallest model that runs every section: one padding bucket of prompts (16) plus the
# audit's and the decode's few steps fit its context.
TINY = TransformerConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=64)
SMALLEST = ["--quick", "--mixes", "2", "--steps", "4", "--max-batch", "2", "--runs", "5",
            "--logits", "2x512", "--decode", "2x4"]
SECTION_TITLES = ("machine", "bitwise promise (jaxdecode audit): 2 random mixes per mode",
                  "sampler cost (time / argmax time under jit): lm logits [2, 512], 5 runs",
                  "decode (jaxdecode.decode, tiny.msgpack): batch 2, 4 new tokens, 5 runs",
                  "structure (lowered for cpu, nothing run)")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("doctor") / "tiny.msgpack")
  save_checkpoint(path, TINY, nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))[1])
  return path


def run_cli(capsys, *argv):
  code = cli.main(["doctor", *argv])
  out = capsys.readouterr()
  return code, out.out, out.err


@pytest.mark.slow
def test_the_doctor_prints_every_section_and_a_last_verdict_line(tiny_path, capsys):
  code, out, err = run_cli(capsys, *SMALLEST[:1], "--model", tiny_path, *SMALLEST[1:])
  assert code == 0, err
  lines = out.rstrip("\n").splitlines()
  assert lines[0] == f"$ jaxdecode doctor --quick --model {tiny_path} {' '.join(SMALLEST[1:])}"
  for title in SECTION_TITLES:
    assert any(line.startswith(title) for line in lines), title
  assert "  backend    cpu (lowering platform cpu); 1 device(s): cpu" in lines
  assert any(line.startswith("  isa        ") for line in lines)  # the CPU backend's flags
  invariant = next(line for line in lines if line.startswith("  batch-invariant "))
  assert invariant.split()[1:4] == ["2", "0", "0"]  # mixes, logits differ, tokens flip
  assert any(line.startswith("  plain XLA ") for line in lines)
  # What the structural checks find is tests/test_structure.py's business: here, that each
  # one reports a count.
  for name in ("unordered sums, invariant decode step",
               "unordered sums, sampling chain (every processor, draw, log-prob)",
               "host round trips, jaxdecode.sample [2, 512]",
               "host round trips, decode of the model (B=2, 4 tokens, EOS stop)"):
    assert re.search(rf"^  {re.escape(name)}: \d+$", out, re.M), name
  assert "failed" not in out
  verdict = lines[-1]
  assert verdict.startswith("verdict: bitwise promise holds here (0/2 mixes diverge; plain XLA ")
  assert "sampler cost top-p " in verdict and " argmax at [2, 512]" in verdict
  assert "decode tokens/s top-p/greedy " in verdict
  assert re.search(r"; structure \(cpu\): \d+ unordered sums; host round trips: sample \d+, "
                   r"decode \d+$", verdict)


def canned_result() -> dict:
  """A result as `doctor.run` returns it, with figures chosen by hand."""
  machine = dict(backend="gpu", lowering_platform="cuda", device_kinds=["NVIDIA H100"],
                 device_count=2, local_device_count=2, process_count=1,
                 devices=["CudaDevice(id=0)", "CudaDevice(id=1)"], os="Linux",
                 cpu=dict(model="Some CPU", arch="x86", isa={"avx512f": False}), cpu_count=16,
                 usable_cpus=16, python="3.11.7", jax="0.10.2", jaxlib="0.10.2", flax="0.12.8",
                 jaxdecode="0.2.0")
  audit = dict(steps=16, max_batch=3, prompts=8, seconds=12.0, modes=[
      dict(name="batch-invariant", mixes=4, divergent=0, flipped=0, max_abs_diff=0.0),
      dict(name="plain XLA", mixes=4, divergent=3, flipped=1, max_abs_diff=2.5e-6)])
  kernels = dict(shape="lm", batch=8, vocab=128256, runs=20, argmax_ms=0.25, seconds=3.0,
                 ratio=dict(greedy=1.0, sample=1.5, top_p=3.0 / 1.6, chain=12.34))
  decode = dict(batch=8, max_new_tokens=64, runs=20, first_call_s=9.5, seconds=20.0,
                tokens_per_s=dict(greedy=2000.0, top_p=1600.0),
                ratio=dict(top_p_vs_greedy=0.8, first_vs_later=30.0), model="embedded model")
  found = [f"case (2 branches) at processors.py:{n}" for n in range(5)]
  structure = dict(platform="cuda", seconds=2.0, checks=[
      dict(name="invariant decode step", check="unordered sums", found=[]),
      dict(name="sampling chain", check="unordered sums", found=["stablehlo.reduce adds"]),
      dict(name="jaxdecode.sample [8, 128256]", check="host round trips", found=found),
      dict(name="decode of the model", check="host round trips", found=["while at loop.py:1"])])
  return dict(command="jaxdecode doctor", machine=machine, audit=audit, kernels=kernels,
              decode=decode, structure=structure)


def test_the_report_of_canned_figures():
  result = canned_result()
  audit = result["audit"]
  text = doctor.format_report(result)
  lines = text.rstrip("\n").splitlines()
  assert lines[0] == "$ jaxdecode doctor"
  assert "  backend    gpu (lowering platform cuda); 2 device(s): NVIDIA H100" in lines
  assert not any(line.startswith("  isa") for line in lines)  # only on the CPU backend
  assert "  batch-invariant      4             0           0          0" in lines
  assert "  plain XLA            4             3           1    2.5e-06" in lines
  assert "      0.250   1.00   1.50   1.88   12.3" in lines  # 3 / 1.6 = 1.875; 12.34
  assert "          2000        1600         0.80          9.5" in lines
  assert "  host round trips, jaxdecode.sample [8, 128256]: 5" in lines
  assert lines[lines.index("  host round trips, jaxdecode.sample [8, 128256]: 5") + 3] == \
      "      case (2 branches) at processors.py:2"
  assert "      ... and 2 more" in lines
  assert lines[-1] == (
      "verdict: bitwise promise holds here (0/4 mixes diverge; plain XLA 3/4); sampler cost "
      "top-p 1.88x, chain 12.3x argmax at [8, 128256]; decode tokens/s top-p/greedy 0.80; "
      "structure (cuda): 1 unordered sums; host round trips: sample 5, decode 1")
  assert lines[-1] == doctor.verdict(result)
  # A divergent audit and a failed section say so in the verdict.
  audit["modes"][0].update(divergent=2, flipped=1)
  result["decode"] = dict(error="RuntimeError: out of memory", seconds=1.0)
  text = doctor.format_report(result)
  assert "the batch-invariant mode diverged: its promise does not hold here" in text
  assert "  failed: RuntimeError: out of memory" in text
  assert text.rstrip("\n").splitlines()[-1].startswith(
      "verdict: bitwise promise does NOT hold here (2/4 mixes diverge, 1 flip a token; please "
      "report it); sampler cost")
  assert text.rstrip("\n").endswith("; failed: decode")
  json.dumps(result, allow_nan=False)  # the result is JSON as it is


def test_cpu_flags_and_the_audit_prompts(tmp_path):
  x86 = tmp_path / "x86"
  x86.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse4_2 avx avx2 "
                 "avx512f\n\nprocessor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n")
  info = doctor.cpu_info(str(x86))
  assert info["model"] == "Test CPU 9000" and info["arch"] == "x86"
  assert info["isa"]["avx512f"] and info["isa"]["avx2"] and not info["isa"]["amx_tile"]
  arm = tmp_path / "arm"
  arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n")
  info = doctor.cpu_info(str(arm))
  assert info["arch"] == "arm" and info["isa"]["sve"] and not info["isa"]["sve2"]
  assert doctor.cpu_info(str(tmp_path / "missing"))["isa"] == {}
  # The full run's prompts are `jaxdecode audit`'s; --quick's sit in one padding bucket.
  assert doctor.audit_prompts(16, 3) == cli.audit_prompts(16, 3)
  assert {len(p) for p in doctor.audit_prompts(8, 0, *doctor.QUICK["prompt_bytes"])} <= \
      set(range(9, 17))
  assert doctor.lowering_platform("cpu") == "cpu" and doctor.lowering_platform("tpu") == "tpu"
  assert doctor.lowering_platform("METAL") is None


@pytest.mark.parametrize("argv, message", [
    (["--max-batch", "1"], "--max-batch must be at least 2"),
    (["--logits", "8"], "argument --logits: expected BxV with positive integers"),
    (["--logits", "8x1"], "the vocabulary needs at least 2 tokens"),
    (["--decode", "0x16"], "argument --decode: expected BxN"),
    (["--runs", "2"], "the protocol needs at least 5 runs"),
    (["--mixes", "0"], "argument --mixes: expected a positive integer"),
    (["--steps", "600"], "--steps 600 does not fit"),
    (["--decode", "8x600"], "--decode 8x600 does not fit"),
    (["--model", "/nonexistent/model.msgpack"], "/nonexistent/model.msgpack"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
  code, out, err = run_cli(capsys, "--quick", *argv)
  assert code == 2 and out == "", (out, err)
  assert message in err and err.startswith(("jaxdecode doctor: error: ", "jaxdecode: error: ")), err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_the_python_entry_point_reports_in_one_line_too(capsys):
  assert doctor.main(["--max-batch", "1"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("jaxdecode doctor: error: --max-batch must be at least 2")
  assert len(err.strip().splitlines()) == 1
  assert doctor.main(["--help"]) == 0
  assert "--quick" in capsys.readouterr().out


def test_text_and_json_output_and_the_exit_status(monkeypatch, capsys):
  """The command's plumbing on a canned run: sections as they come and the verdict last, or one
  JSON object; 1 when a section failed."""
  seen = {}

  def fake_run(settings, *, command, emit):
    seen.update(settings=settings, command=command)
    result = canned_result()
    for name, render in doctor.SECTIONS:
      emit(render(result[name]) + "\n")
    return dict(result, verdict=doctor.verdict(result))

  monkeypatch.setattr(doctor, "run", fake_run)
  code, out, err = run_cli(capsys, "--quick", "--runs", "7", "--logits", "4x1000")
  assert code == 0 and err == ""
  assert seen["command"] == "jaxdecode doctor --quick --runs 7 --logits 4x1000"
  assert seen["settings"] == dict(doctor.QUICK, runs=7, logits=(4, 1000), quick=True, seed=0,
                                  model=None)
  result = canned_result()
  assert out == "".join(render(result[name]) + "\n\n" for name, render in doctor.SECTIONS) + \
      doctor.verdict(result) + "\n"
  code, out, err = run_cli(capsys, "--json")
  assert code == 0 and len(out.splitlines()) == 1
  assert json.loads(out) == json.loads(json.dumps(dict(canned_result(),
                                                       verdict=doctor.verdict(canned_result()))))
  assert err.count("[doctor] ") == len(doctor.SECTIONS)  # progress: one line per section
  assert seen["settings"]["logits"] == doctor.FULL["logits"]

  def failing_run(settings, *, command, emit):
    result = dict(canned_result(), decode=dict(error="RuntimeError: boom", seconds=0.0))
    return dict(result, verdict=doctor.verdict(result))

  monkeypatch.setattr(doctor, "run", failing_run)
  code, out, _ = run_cli(capsys)
  assert code == 1 and out.rstrip("\n").splitlines()[-1].endswith("; failed: decode")
