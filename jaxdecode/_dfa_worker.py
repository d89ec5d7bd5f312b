"""Builds a regex's byte-level DFA (or a JSON schema's regex) with outlines-core, in a process
of its own.

Run by `jaxdecode.structured` as `python -c <this file's text>`, so that a pattern whose
automaton is too large for the budget is stopped (a time limit, and a memory limit where the
system has one) instead of taking the caller's process down. It imports outlines-core only.

Protocol: argv[1] is a JSON list `[sys.path, memory_limit_bytes, max_regex_chars]`; stdin is
the pattern (UTF-8), or `{` + a JSON schema. For a pattern, stdout gets `ok` + the initial
state and two native-endian int64 arrays, each preceded by its length: the final states and
the moves (src, byte, dst). For a schema: `ok` + its regex (UTF-8), or exit status 3 and a
message when the regex is longer than max_regex_chars. Any error: `er` + its message.
"""

import json
import struct
import sys


def main() -> int:
  path, memory, max_chars = json.loads(sys.argv[1])
  sys.path[:] = path
  if memory:
    try:
      import resource  # pylint: disable=import-outside-toplevel
      resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ImportError, ValueError, OSError):  # no such limit here: the time limit holds
      pass
  # pylint: disable=import-outside-toplevel
  from array import array
  from outlines_core import Index, Vocabulary
  from outlines_core.json_schema import build_regex_from_schema

  text = sys.stdin.buffer.read().decode("utf-8")
  out = sys.stdout.buffer
  try:
    if text.startswith("{"):
      regex = build_regex_from_schema(text)
    else:
      index = Index(text, Vocabulary(256, {bytes([b]): [b] for b in range(256)}))
  except Exception as e:  # pylint: disable=broad-except  # any failure is reported, in one line
    out.write(b"er" + str(e).encode("utf-8", "replace"))
    return 0
  if text.startswith("{"):
    if len(regex) > max_chars:
      out.write(f"its regex has {len(regex)} characters, past the budget of {max_chars}"
                .encode("utf-8"))
      return 3
    out.write(b"ok" + regex.encode("utf-8"))
    return 0
  finals = array("q", sorted(index.get_final_states()))
  moves = array("q")
  for src, row in index.get_transitions().items():
    for byte, dst in row.items():
      if byte < 256:  # 256: the EOS of this vocabulary
        moves.extend((src, byte, dst))
  out.write(b"ok" + struct.pack("<q", index.get_initial_state()))
  for part in (finals, moves):
    out.write(struct.pack("<q", len(part)) + part.tobytes())
  return 0


if __name__ == "__main__":
  sys.exit(main())
