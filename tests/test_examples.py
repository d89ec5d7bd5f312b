"""Every example runs (in a quick mode) and checks what it claims."""

import os
import runpy
import subprocess
import sys

import pytest

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
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, os.path.join(EXAMPLES, "sharded_decode.py")],
                          env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"devices: {devices} (cpu)" in result.stdout
  assert "tokens identical to one device: True" in result.stdout
