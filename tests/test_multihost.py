"""examples/multihost_decode.py: N processes joined by `jax.distributed` decode one batch and
print `jaxdecode generate --json`'s line, the same rows bit for bit."""

import os
import re
import runpy
import signal
import subprocess
import sys
import time

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
    (["--processes", "3", "x", "y"], "3 processes for 2 prompt(s); give at most one process per "
                                     "prompt"),
    (["--processes", "17", *"abcdefghijklmnopq"], "at most 16 processes on one machine, got 17"),
])
def test_a_bad_command_line_is_one_line_and_status_2(argv, message, capsys):
  main = runpy.run_path(EXAMPLE)["main"]
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2
  assert err.startswith("multihost_decode.py: error: ") and message in err
  assert len(err.splitlines()) == 1


@pytest.mark.slow
def test_a_prompt_past_the_context_is_reported_once_by_process_0():
  code, out, err = finish(start("--processes", "2", "--max-new-tokens", "20", "hi", "a" * 500),
                          timeout=120)
  assert code == 2 and out == ""
  assert err.splitlines() == ["multihost_decode.py: error: a prompt of 500 bytes plus "
                              "--max-new-tokens 20 does not fit the model's context of 512 tokens"]


def test_the_largest_process_count_is_accepted():
  args = runpy.run_path(EXAMPLE)["parse"](["--processes", "16", *"abcdefghijklmnop"])
  assert args.processes == 16 and len(args.prompts) == 16


def test_a_failed_process_is_named_with_its_status_and_the_others_are_stopped(capfd):
  """A real failure: 2 processes started for a job of 1 (the command line they get says so);
  process 1's `jax.distributed.initialize` refuses process_id=1 of 1 and exits with status 1."""
  start_processes = runpy.run_path(EXAMPLE)["start_processes"]
  code = start_processes(["--processes", "1", "--max-new-tokens", "200", "x"], 2)
  err = capfd.readouterr().err
  assert code == 1
  assert "process_id=1, num_processes=1" in err  # the process's own traceback
  assert err.splitlines()[-1] == ("multihost_decode.py: error: process 1 of 2 exited with status "
                                  "1; the others were stopped")


def _children(pid, count, timeout=60):
  """{process index: pid} of the `count` processes that launcher `pid` started."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
      with open(f"/proc/{pid}/task/{task}/children") as f:
        for child in f.read().split():
          with open(f"/proc/{child}/cmdline", "rb") as c:
            argv = c.read().split(b"\0")
          if b"--process-id" in argv:
            found[int(argv[argv.index(b"--process-id") + 1])] = int(child)
    if len(found) == count:
      return found
    time.sleep(0.02)
  raise AssertionError(f"the launcher started {found}, not {count} processes")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc (Linux)")
def test_a_killed_process_is_named_with_its_signal_and_the_others_are_stopped():
  launcher = start("--processes", "2", "--max-new-tokens", "200", "x", "y")
  try:
    children = _children(launcher.pid, 2)
    os.kill(children[1], signal.SIGKILL)  # as the kernel's out-of-memory killer would
  finally:
    code, out, err = finish(launcher, timeout=60)
  assert code == 128 + signal.SIGKILL and out == ""
  assert err.splitlines()[-1] == ("multihost_decode.py: error: process 1 of 2 was killed by "
                                  "signal 9 (SIGKILL); the others were stopped")
  with pytest.raises(ProcessLookupError):  # process 0 was stopped and reaped
    os.kill(children[0], 0)
