"""examples/multihost_decode.py: N processes joined by `jax.distributed` decode one batch and
print `jaxdecode generate --json`'s line, the same rows bit for bit."""

import os
import re
import runpy
import signal
import subprocess
import sys

import pytest

from jaxdecode.tools import cli

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "multihost_decode.py")
PROMPTS = ["The for statement", "def f(x):", "import"]  # 3 rows over 2 processes: one padding row


def start(*args):
  # A session of its own: a timeout stops the launcher and the processes it started.
  return subprocess.Popen([sys.executable, EXAMPLE, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc, timeout=240):
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    raise
  return proc.returncode, out, err


def without_seconds(text):
  """The lines with the wall-clock time, the one field that differs between runs, zeroed."""
  return re.sub(r'"seconds": [0-9.eE+-]+', '"seconds": 0', text).splitlines()


@pytest.mark.slow
def test_two_processes_print_the_lines_of_jaxdecode_generate(capsys):
  flags = ["--seed", "3", "--max-new-tokens", "8"]
  proc = start("--processes", "2", *flags, *PROMPTS)  # runs while the command runs here
  try:
    assert cli.main(["generate", "--json", "--no-stream", *flags, *PROMPTS]) == 0
  finally:
    code, out, err = finish(proc)
  expected = capsys.readouterr().out
  assert code == 0, err[-3000:]
  assert len(expected.splitlines()) == 1
  assert without_seconds(out) == without_seconds(expected)


@pytest.mark.parametrize("argv, message", [
    (["--processes", "0", "x"], "argument --processes: expected a positive integer, got '0'"),
    (["--processes", "2"], "the following arguments are required: PROMPT"),
    (["x"], "one of the arguments --processes --cluster is required"),
    (["--processes", "2", "--cluster", "x"], "not allowed with argument --processes"),
    (["--processes", "2", "--seed", "-1", "x"], "expected a seed in [0, 2**32), got -1"),
    (["--processes", "2", "--max-new-tokens", "0", "x"], "expected a positive integer"),
    (["--processes", "2", "x", " "], "prompt 2 is empty"),
])
def test_a_bad_command_line_is_one_line_and_status_2(argv, message, capsys):
  main = runpy.run_path(EXAMPLE)["main"]
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2
  assert err.startswith("multihost_decode.py: error: ") and message in err
  assert len(err.splitlines()) == 1


def test_a_prompt_past_the_context_is_reported_once_by_process_0():
  code, out, err = finish(start("--processes", "2", "--max-new-tokens", "20", "hi", "a" * 500),
                          timeout=120)
  assert code == 2 and out == ""
  assert err.splitlines() == ["multihost_decode.py: error: a prompt of 500 bytes plus "
                              "--max-new-tokens 20 does not fit the model's context of 512 tokens"]
