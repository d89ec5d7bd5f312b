"""Structured output: the embedded model writes a date, a JSON object and a label, on the device.

`jaxdecode.models.generate` takes `regex=`, `json_schema=` or `choices=`. The language is compiled
once into a token automaton (`jaxdecode.structured`, with outlines-core) and each row carries
its automaton state through the jitted loop: a token the automaton does not allow next is
masked before sampling, and EOS is allowed only where the text is a whole match. So the format
holds whatever the sampling settings; what the model still decides is the content, and the
embedded model is small: its JSON fields are often filler ("name": "name"), and a label can be
the wrong one. A constraint guarantees the form of the answer, not that it is right.

1. a date, with a regex;
2. a JSON object, with a JSON schema (checked with `json.loads`, and `jsonschema` if installed);
3. a label, from a list of choices;
4. one batch in which every prompt has its own constraint (or none).

Run: python examples/structured_output.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import re

from jaxdecode import SamplingParams
from jaxdecode.models import generate, load_default

DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "kind": {"enum": ["function", "class", "module"]},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 12},
                      "maxItems": 3},
        "returns_value": {"type": "boolean"},
    },
    "required": ["name", "kind", "arguments", "returns_value"],
}
LABELS = ["loops", "exceptions", "classes"]
YES_NO = "(yes|no)"
MAX_NEW_TOKENS = 128  # a row stops at EOS once its text is a whole match; this is only the cap


def schema_errors(value) -> list[str]:
  """What `jsonschema` finds wrong with `value` against SCHEMA ([] if valid or not installed)."""
  try:
    import jsonschema  # pylint: disable=import-outside-toplevel
  except ImportError:
    return []
  return [e.message for e in jsonschema.Draft202012Validator(SCHEMA).iter_errors(value)]


def main(quick: bool = False, seed: int = 0) -> dict:
  """Prints each part's outputs and checks them; returns what it checked.

  Args:
    quick: greedy only (by default also top-p 0.9 sampling: the constraint holds for any
      setting).
    seed: the sampling seed.

  Returns:
    `{"dates", "records", "labels", "mixed"}`: the texts of each part (per setting for the
    first three), `"finished"`: whether every constrained row ended with EOS on a whole match,
    and `"ok"`: whether every check passed.
  """
  model, tokenizer = load_default()
  settings = {"greedy": SamplingParams(temperature=0.0)}
  if not quick:
    settings["top-p 0.9"] = SamplingParams(top_p=0.9)
  ok, finished = True, True
  result = {"dates": {}, "records": {}, "labels": {}}

  def run(prompts, params, **constraint):
    nonlocal finished
    g = generate(prompts, model=model, tokenizer=tokenizer, params=params, seed=seed,
                 max_new_tokens=MAX_NEW_TOKENS, **constraint)
    finished &= bool(g.finished.all())
    return g.texts

  for name, params in settings.items():
    print(f"--- {name}")
    # 1. A date: the text must match the regex as a whole.
    dates = run(["Released on ", "The meeting is on "], params, regex=DATE)
    ok &= all(re.fullmatch(DATE, d) is not None for d in dates)
    print(f"dates:   {dates}")
    # 2. A JSON object that follows the schema: it parses, and validates.
    texts = run(["The built-in function len() ", "A class describes"], params,
                json_schema=SCHEMA)
    records = [json.loads(t) for t in texts]
    ok &= all(schema_errors(r) == [] for r in records)
    print("records: " + "\n         ".join(texts))
    # 3. A label: exactly one of the options.
    labels = run(["The for statement loops over a sequence. Topic: ",
                  "The try statement catches an error. Topic: "], params, choices=LABELS)
    ok &= all(label in LABELS for label in labels)
    print(f"labels:  {labels}")
    result["dates"][name], result["records"][name], result["labels"][name] = (dates, records,
                                                                              labels)

  # 4. One batch, a constraint per prompt: a date, yes/no, and free text (None).
  g = generate(["Released on ", "Is a tuple mutable? Answer: ", "The with statement"],
               model=model, tokenizer=tokenizer, params=settings["greedy"], seed=seed,
               max_new_tokens=MAX_NEW_TOKENS, regex=[DATE, YES_NO, None])
  mixed = g.texts
  ok &= re.fullmatch(DATE, mixed[0]) is not None and re.fullmatch(YES_NO, mixed[1]) is not None
  finished &= bool(g.finished[:2].all())
  print(f"--- one batch, a constraint per prompt\n{mixed[0]!r} | {mixed[1]!r} | "
        f"{mixed[2][:48]!r}...")
  print(f"every constrained row ended with EOS on a whole match: {finished}")
  print(f"every output matches its regex, parses and validates, or is one of the labels: {ok}")
  if not (ok and finished):
    raise SystemExit("a structured output broke its constraint")
  return dict(result, mixed=mixed, finished=finished, ok=ok)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="greedy only")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  main(quick=args.quick, seed=args.seed)
