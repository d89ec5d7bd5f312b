"""The three layers: the core imports nothing above it, models never import the tools.

Read from the source (every `import` and `from ... import` of every module, at any depth), so a
lazy import that would hide an upward dependency is caught too.
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "jaxdecode")


def modules(folder):
  for name in sorted(os.listdir(folder)):
    if name.endswith(".py"):
      yield os.path.join(folder, name)


def parse(path):
  with open(path, encoding="utf-8") as f:
    return ast.parse(f.read())


def imported(path):
  """Every jaxdecode module named by an import in the file."""
  tree = parse(path)
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names |= {f"{node.module}.{a.name}" for a in node.names}
  return {n for n in names if n.startswith("jaxdecode")}


def layer(module_name):
  parts = module_name.split(".")
  return {"models": 1, "tools": 2}.get(parts[1], 0) if len(parts) > 1 else 0


@pytest.mark.parametrize("folder,level", [("", 0), ("models", 1), ("tools", 2)])
def test_no_module_imports_a_layer_above_its_own(folder, level):
  for path in modules(os.path.join(ROOT, folder)):
    if folder == "" and os.path.basename(path) == "bench.py":
      continue  # the `python -m jaxdecode.bench` entry point, which imports under __main__ only
    above = sorted(n for n in imported(path) if layer(n) > level)
    assert not above, f"{path} imports {above}"


def test_the_core_needs_no_flax_optax_or_matplotlib():
  for path in modules(ROOT):
    tree = parse(path)
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      for name in names:
        assert name.split(".")[0] not in ("flax", "optax", "matplotlib"), (path, name)


def test_the_bench_entry_point_imports_nothing_when_imported():
  tree = parse(os.path.join(ROOT, "bench.py"))
  top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
  assert not top_level


TOOLS_MAX_FUNCTION_LINES = 60  # issue 42: the tools in rooms their size


def test_no_function_in_the_tools_is_over_60_lines():
  """Every function of jaxdecode/tools (at any depth: the bench package, nested functions),
  counted from its `def` to its last line (its docstring included, its decorators not)."""
  folder = os.path.join(ROOT, "tools")
  long = []
  for dirpath, _, files in os.walk(folder):
    for name in sorted(files):
      if not name.endswith(".py"):
        continue
      path = os.path.join(dirpath, name)
      for node in ast.walk(parse(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
          lines = node.end_lineno - node.lineno + 1
          if lines > TOOLS_MAX_FUNCTION_LINES:
            long.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
  assert not long, long
