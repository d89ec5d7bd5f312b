"""The README and the reference pages run: every ```python block of README.md, docs/api.md and
docs/reproducibility.md, in order, one namespace per file (the guide has tests/test_guide.py).

A page's claims live in asserts inside its snippets, so a change that makes one false fails here.
A failing block is reported at its line in the markdown file.
"""

import pathlib
import re
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/api.md", "docs/reproducibility.md"]
# A fence may be indented (a block inside a list item): the code is dedented by the fence's indent.
_BLOCK = re.compile(r"^( *)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str]]:
  """`(first line of the code, dedented code)` for every ```python block, in order."""
  return [(text.count("\n", 0, m.start(2)) + 1, textwrap.dedent(m.group(2)))
          for m in _BLOCK.finditer(text)]


def test_the_extractor_finds_indented_blocks_and_their_lines():
  text = "intro\n```python\nx = 1\n```\n- item\n\n  ```python\n  y = x + 1\n  ```\n"
  assert python_blocks(text) == [(3, "x = 1\n"), (8, "y = x + 1\n")]


@pytest.mark.slow  # the README's structured snippet runs the embedded model
@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_of_the_page_runs_in_order(page):
  path = ROOT / page
  text = path.read_text(encoding="utf-8")
  blocks = python_blocks(text)
  # Every fence opened as python is found (a typo such as "```Python" would skip a block).
  assert blocks and len(blocks) == len(re.findall(r"^ *```python", text, re.MULTILINE))
  namespace = {"__name__": "page"}
  for line, code in blocks:
    exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)  # pylint: disable=exec-used


def test_the_readme_is_a_tour_and_links_pages_that_exist():
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  assert len(text.splitlines()) <= 250, "the README is the tour: the reference goes in docs/"
  for target in ("docs/api.md", "docs/decoding.md", "docs/reproducibility.md", "docs/speed.md",
                 "docs/architecture.md", "docs/sweep/sweep.png"):
    assert f"]({target}" in text or f"({target})" in text, target
    assert (ROOT / target).is_file(), target
