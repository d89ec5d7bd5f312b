"""docs/decoding.md runs: every ```python block of the guide, in order, in one namespace.

The guide backs its claims with asserts inside its snippets, so a change in jaxdecode that makes
a claim false fails here instead of leaving the guide silently wrong. A failing block is reported
with its line in the markdown file (the code is compiled with that file name and line offset).
"""

import pathlib
import re

import pytest

pytestmark = pytest.mark.slow  # the whole module: it runs the real model end to end

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "decoding.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str]]:
  """`(first line of the code, code)` for every ```python block, in order (lines count from 1)."""
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def test_the_extractor_finds_blocks_and_their_lines():
  text = "intro\n```python\nx = 1\n```\n\n```text\nnot code\n```\n```python\ny = x + 1\n```\n"
  assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = x + 1\n")]


def test_every_python_block_of_the_guide_runs_in_order():
  """Over a minute (85-108 s in the CI-way runs on 2 cores): the guide's printed figures (kept
  sets, acceptance rates, the forced constraint's log-probs) are the embedded model's, so its
  blocks run that model; the speculative-decoding block alone runs six generates over three drafting setups (none, prompt
  lookup, the draft model), each a loop of its own to compile."""
  text = GUIDE.read_text(encoding="utf-8")
  blocks = python_blocks(text)
  assert len(blocks) >= 10, f"expected the guide's snippets in {GUIDE}; found {len(blocks)}"
  # Every fence opened as python must be found (a typo such as "```Python" would skip a block).
  assert len(blocks) == len(re.findall(r"^```python", text, re.MULTILINE))
  namespace = {"__name__": "decoding_guide"}
  for line, code in blocks:
    # Blank lines in front make tracebacks point at the block's line in the markdown file.
    exec(compile("\n" * (line - 1) + code, str(GUIDE), "exec"), namespace)  # pylint: disable=exec-used
