"""Structured decoding (jaxdecode.structured): regexes, JSON schemas and choices as token automata.

Every check compares with something computed without the library's tables: Python's `re` for
whole matches, the `regex` package's partial matching for the prefixes of rows cut by
`max_new_tokens`, `jsonschema` for JSON, enumerations by `itertools` for finite languages, and
the masked softmax computed here by NumPy for the per-step law.

Most tests share one batch (a module fixture, so one compiled decode program): every pattern,
schema and choice of the lists below, each under greedy, top-p and temperature 1.5, in one
`structured.stack` with unconstrained rows, a dead-end row and the chi-square rows. The model is
tests/toy_model.py's cached hash model over the byte vocabulary (random logits, exact, with the
multi-token step that speculative decoding needs).
"""

import codecs
import functools
import itertools
import json
import random
import re
import time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import regex as partial_regex  # the `regex` package: partial matches, for prefixes
from scipy import stats

import jaxdecode
from jaxdecode import SamplingParams
from jaxdecode import structured
from jaxdecode.models import ByteTokenizer
import conftest
import toy_model

BOS, EOS, PAD = ByteTokenizer.BOS, ByteTokenizer.EOS, ByteTokenizer.PAD
VOCAB = ByteTokenizer().vocabulary()
V = len(VOCAB)  # 259
N = 64  # max_new_tokens of the shared batch
SLOTS = 16 + N + 8  # prompt width + new tokens + a draft round
TABLE = toy_model.table(V, seed=5)
STEP = toy_model.make_cached_step(TABLE)  # (state, tokens [B] or [B, K], positions) -> logits

REGEXES = [
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",  # a date
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",  # a number
    r"(cat|dog|bird)s?( and (cat|dog|bird)s?){0,3}",  # alternations
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})*",  # classes, unbounded repetition
    r"x{2,4}y{3}z{0,2}",  # repetition bounds
    r"(café|日本語|naïve) ?[αβγ]{1,3}",  # unicode literals and a class of 2-byte characters
    "line [0-9]+\n(line [0-9]+\n){1,3}end",  # newlines
    r"(ab){3,5}",
    r"#[0-9a-fA-F]{6}",
    r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)",
    r"[^a-z\n]{3,6}",  # a negated class: any character, multi-byte ones included
    r".{1,5}",
    r"(true|false|null)",
    r"([01][0-9]|2[0-3]):[0-5][0-9]",
    r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    r"q{70,}",  # its shortest match is longer than N: never finished
    r"[0-9]{2}:[0-9]{2}",  # table shape (8, 8), decoded alone below
]
SCHEMAS = [
    {"type": "object", "properties": {  # nested objects
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "name": {"type": "string", "maxLength": 6}},
                 "required": ["id", "name"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "v": {"const": 2}}, "required": ["color", "v"]},
    {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"type": "string", "maxLength": 3}]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
                                                       "y": {"type": "integer"}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"]},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                      "ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["d", "ok"]},
    {"type": "string", "maxLength": 8},
    {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
]
CHOICES = [
    ["yes", "no", "maybe"],
    ["ab"],  # one option: every token forced, then EOS
    ["positive", "negative", "neutral"],
    ["été", "hiver"],
    ["a", "ab", "abc"],  # prefixes of each other: EOS or more
    ["a.b", "(x)", "1+1", "a|b", "[c]", "^$", "back\\slash", "tab\tnl\n", "{1}", "#~&-"],
    ["yes", "no"],  # table shape (8, 8), decoded alone below
]
SETTINGS = {"greedy": (0.0, 1.0), "top-p": (1.0, 0.8), "temperature 1.5": (1.5, 1.0)}
PROMPTS = [list(b"ab ab ab"), list(b"12:34, 56")]
CHI_PATTERN = r"[0-4]z|é"  # the first step allows '0'..'4' and 0xC3 (é's first byte)
CHI_ALLOWED = [ord(c) for c in "01234"] + [0xC3]
CHI_ROWS = 2048  # per law
CHI_SETTINGS = {"chi temperature 1.5": (1.5, 1.0), "chi top-p 0.6": (1.5, 0.6)}
CHI_PROMPT = [7, 7, 7]


def constraint_of(kind, spec):
  return {"regex": structured.regex, "schema": structured.json_schema,
          "choice": structured.choice}[kind](spec, VOCAB)


# ---------------------------------------------------------------------------------------------
# Independent checks of a row's bytes.


def row_bytes(tokens, length):
  """(bytes of the row's tokens before any EOS, whether it ended with EOS); asserts that no
  special token other than a final EOS appears."""
  ids = [int(t) for t in np.asarray(tokens)[:int(length)]]
  ended = bool(ids) and ids[-1] == EOS
  body = ids[:-1] if ended else ids
  assert all(0 <= t < 256 for t in body), f"a special token inside the text: {ids}"
  return bytes(body), ended


def complete_prefix(data: bytes) -> str:
  """The text of `data` without a trailing incomplete UTF-8 character; AssertionError if the
  bytes are not a prefix of valid UTF-8."""
  try:
    return codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
  except UnicodeDecodeError as e:
    raise AssertionError(f"{data!r} is not a prefix of valid UTF-8: {e}") from None


def is_prefix_of_match(pattern: str, text: str) -> bool:
  """Whether `text` can be extended into a whole match of `pattern` (the `regex` package's
  partial matching, independent of outlines-core)."""
  return partial_regex.fullmatch(pattern, text, partial=True) is not None


def test_the_prefix_check_itself_tells_prefixes_from_non_prefixes():
  assert is_prefix_of_match(r"[0-9]{4}-[0-9]{2}", "123")
  assert is_prefix_of_match(r"[0-9]{4}-[0-9]{2}", "1234-5")
  assert not is_prefix_of_match(r"[0-9]{4}-[0-9]{2}", "12a")
  assert not is_prefix_of_match(r"[0-9]{4}-[0-9]{2}", "1234-567")
  assert is_prefix_of_match("line [0-9]+\n(line [0-9]+\n){1,3}end", "line 1\nline 22\ne")
  assert complete_prefix("日本".encode()[:4]) == "日"
  with pytest.raises(AssertionError):
    complete_prefix(b"\xff")


def schema_regex(schema) -> str:
  from outlines_core.json_schema import build_regex_from_schema
  return build_regex_from_schema(json.dumps(schema))


def check_row(kind, spec, tokens, length, finished, max_new_tokens):
  """Asserts what a constrained row must hold: a whole match if finished, else a prefix of one
  of exactly max_new_tokens tokens. Returns the row's text."""
  data, ended = row_bytes(tokens, length)
  assert ended == bool(finished)
  if finished:
    text = data.decode("utf-8")  # a whole match is valid UTF-8
    if kind == "regex":
      assert re.fullmatch(spec, text), (spec, text)
    elif kind == "schema":
      # Structure only: formats are checked by the test of `format` below.
      jsonschema.validate(json.loads(text), spec)
    else:
      assert text in spec, (spec, text)
    return text
  assert int(length) == max_new_tokens, (spec, data, int(length))
  text = complete_prefix(data)
  pattern = {"regex": lambda: spec, "schema": lambda: schema_regex(spec),
             "choice": lambda: "|".join(re.escape(o) for o in spec)}[kind]()
  assert is_prefix_of_match(pattern, text), (spec, data)
  return text


# ---------------------------------------------------------------------------------------------
# The shared batch.


def build_batch():
  """Rows, their constraint (one stack), params, keys and the prefill of the shared batch."""
  cases = ([("regex", p) for p in REGEXES] + [("schema", s) for s in SCHEMAS] +
           [("choice", c) for c in CHOICES])
  built = {i: constraint_of(kind, spec) for i, (kind, spec) in enumerate(cases)}
  rows = []  # (case index or None, setting, prompt index, banned ids)
  for i in range(len(cases)):
    for setting in SETTINGS:
      for p in range(len(PROMPTS)):
        rows.append(dict(case=i, setting=setting, prompt=p, banned=[]))
  for setting in SETTINGS:
    rows.append(dict(case=None, setting=setting, prompt=0, banned=[]))  # unconstrained
  ab = next(i for i, (kind, spec) in enumerate(cases) if spec == ["ab"])
  rows.append(dict(case=ab, setting="top-p", prompt=1, banned=[ord("b")], dead_end=True))
  chi = len(cases)
  cases.append(("regex", CHI_PATTERN))
  built[chi] = constraint_of("regex", CHI_PATTERN)
  first_chi = len(rows)
  rows += [dict(case=chi, setting=setting, prompt=None, banned=[], chi=True)
           for setting in CHI_SETTINGS for _ in range(CHI_ROWS)]
  constraint = structured.stack([None if r["case"] is None else built[r["case"]] for r in rows])
  settings = {**SETTINGS, **CHI_SETTINGS}
  temperature = np.array([settings[r["setting"]][0] for r in rows], np.float32)
  top_p = np.array([settings[r["setting"]][1] for r in rows], np.float32)
  params = SamplingParams(temperature=temperature, top_p=top_p,
                          banned_token_ids=[r["banned"] for r in rows])
  prompts = [CHI_PROMPT if r["prompt"] is None else PROMPTS[r["prompt"]] for r in rows]
  logits, state, positions = toy_model.prefill_cached(TABLE, prompts, SLOTS)
  keys = jax.random.split(jax.random.key(20240601), len(rows))
  return dict(cases=cases, built=built, rows=rows, constraint=constraint, params=params,
              prompts=prompts, logits=logits, state=state, positions=positions, keys=keys,
              first_chi=first_chi)


def run_decode(b, **kw):
  # Under jit the params are traced, so the dead-end row's bans follow the traced rule (a step
  # with nothing selectable ends the row); with concrete params decode refuses them up front
  # (test_concrete_bans_that_empty_a_constraint_are_refused_by_every_loop).
  # 4,292 rows x 64 steps: a program that runs long (conftest.RUNS_LONG).
  return jax.jit(lambda params: jaxdecode.decode(
      STEP, b["state"], b["logits"], key=b["keys"], params=params, max_new_tokens=N,
      positions=b["positions"], eos_ids=[EOS], pad_id=PAD, constraint=b["constraint"],
      **kw), compiler_options=conftest.RUNS_LONG)(b["params"])


@pytest.fixture(scope="module")
def batch():
  b = build_batch()
  out = run_decode(b)
  b["out"] = {f: np.asarray(getattr(out, f))
              for f in ("tokens", "logprobs", "lengths", "finished", "dead_end")}
  return b


def rows_of(b, kind=None, chi=False):
  for r, row in enumerate(b["rows"]):
    if row.get("chi", False) != chi or row.get("dead_end") or row["case"] is None:
      continue
    case_kind, spec = b["cases"][row["case"]]
    if kind is None or case_kind == kind:
      yield r, row, case_kind, spec


@pytest.mark.parametrize("kind", ["regex", "schema", "choice"])
@pytest.mark.slow
def test_outputs_match_their_constraint_whole_when_finished_and_as_a_prefix_when_cut(batch,
                                                                                     kind):
  out = batch["out"]
  finished_per_case = {}
  for r, row, kind_, spec in rows_of(batch, kind):
    text = check_row(kind_, spec, out["tokens"][r], out["lengths"][r], out["finished"][r], N)
    assert not out["dead_end"][r]
    finished_per_case.setdefault(row["case"], []).append((row["setting"], out["finished"][r],
                                                           text))
  # Not a vacuous check: most constraints have finished rows, and each setting finishes some.
  finished = [any(f for _, f, _ in v) for v in finished_per_case.values()]
  assert sum(finished) >= 0.75 * len(finished), finished_per_case
  for setting in SETTINGS:
    assert any(f for v in finished_per_case.values() for s, f, _ in v if s == setting)
  if kind == "choice":  # every choice row ends (the options are short)
    assert all(f for v in finished_per_case.values() for _, f, _ in v)


# `format: date`: outlines-core writes `\d` (any Unicode digit in Rust's syntax); the schema
# compiler turns it into [0-9], so dates are ASCII (the regex still admits 2023-02-31).
@pytest.mark.slow  # the shared batch: one large decode compile
def test_format_date_outputs_are_dates(batch):
  out = batch["out"]
  rows = [r for r, row, kind, spec in rows_of(batch, "schema")
          if "d" in spec.get("properties", {}) and out["finished"][r]]
  assert rows
  for r in rows:
    text, _ = row_bytes(out["tokens"][r], out["lengths"][r])
    value = json.loads(text.decode())
    jsonschema.validate(value, SCHEMAS[5], format_checker=jsonschema.FormatChecker())


def test_a_date_format_allows_only_ascii_digits():
  c = structured.json_schema({"type": "string", "format": "date"}, VOCAB)
  state = structured.advance(c, c.initial, jnp.asarray([ord('"')], jnp.int32))
  allowed = np.flatnonzero(np.asarray(structured.allowed(c, state))[0])
  assert set(allowed.tolist()) == set(b"0123456789"), bytes(allowed.tolist())


@pytest.mark.slow  # the shared batch: one large decode compile
def test_sampled_rows_differ_from_greedy_and_use_the_freedom_the_constraint_leaves(batch):
  """The settings matter: for free patterns, sampled texts are not all the greedy text."""
  out = batch["out"]
  texts = {}
  for r, row, kind, spec in rows_of(batch):
    data, _ = row_bytes(out["tokens"][r], out["lengths"][r])
    texts.setdefault((row["case"], row["prompt"]), {})[row["setting"]] = data
  differ = sum(len(set(t.values())) > 1 for t in texts.values())
  assert differ >= len(texts) // 2


@pytest.mark.slow  # the shared batch: one large decode compile
def test_a_language_longer_than_max_new_tokens_never_finishes_and_holds_a_prefix(batch):
  out = batch["out"]
  rows = [r for r, row, kind, spec in rows_of(batch, "regex") if spec == r"q{70,}"]
  assert rows
  for r in rows:
    assert not out["finished"][r] and out["lengths"][r] == N
    assert bytes(out["tokens"][r].tolist()) == b"q" * N


@pytest.mark.slow  # the shared batch: one large decode compile
def test_a_single_option_is_forced_token_by_token_then_eos(batch):
  out = batch["out"]
  rows = [r for r, row, kind, spec in rows_of(batch, "choice") if spec == ["ab"]]
  for r in rows:
    np.testing.assert_array_equal(out["tokens"][r][:4], [ord("a"), ord("b"), EOS, PAD])
    assert out["finished"][r] and out["lengths"][r] == 3
    # One allowed token: probability 1 under the masked, renormalized law.
    np.testing.assert_array_equal(out["logprobs"][r][:3], [0.0, 0.0, 0.0])


@pytest.mark.slow  # the shared batch: one large decode compile
def test_special_tokens_never_appear_and_eos_only_ends_rows(batch):
  out = batch["out"]
  for r, row in enumerate(batch["rows"]):
    if row["case"] is None:
      continue
    length = int(out["lengths"][r])
    body = out["tokens"][r][:length].tolist()
    assert length >= 1
    assert not set(body[:-1]) & {BOS, EOS, PAD}, body
    assert body[-1] not in (BOS, PAD)
    assert (body[-1] == EOS) == bool(out["finished"][r])
    np.testing.assert_array_equal(out["tokens"][r][length:], PAD)


@pytest.mark.slow  # the shared batch: one large decode compile
def test_unconstrained_rows_in_the_stack_are_free(batch):
  """A None row of a stack is not constrained: over N tokens of random logits its text uses
  bytes that no one pattern of the batch would allow together."""
  out = batch["out"]
  for r, row in enumerate(batch["rows"]):
    if row["case"] is None and row["setting"] != "greedy":
      tokens = out["tokens"][r][:out["lengths"][r]]
      assert len(set(tokens.tolist())) > 20


@pytest.mark.slow  # the shared batch: one large decode compile
def test_bans_that_remove_every_allowed_token_make_the_row_a_dead_end(batch):
  """choice(["ab"]) with 'b' banned: 'a' is forced, then nothing is selectable."""
  out = batch["out"]
  r = next(r for r, row in enumerate(batch["rows"]) if row.get("dead_end"))
  assert out["dead_end"][r] and not out["finished"][r]
  assert out["lengths"][r] == 1 and out["tokens"][r][0] == ord("a")
  np.testing.assert_array_equal(out["tokens"][r][1:], PAD)


# ---------------------------------------------------------------------------------------------
# The per-step law.


def masked_law(logits, allowed, temperature, top_p):
  """The expected first-step law, in float64: the softmax restricted to `allowed` and
  renormalized, then temperature, then top-p (DESIGN.md: token i is kept iff the mass of the
  tokens strictly more probable than i is < p), renormalized."""
  masked = np.full(logits.shape, -np.inf)
  masked[allowed] = logits[allowed] / temperature
  probs = np.exp(masked - masked.max())
  probs /= probs.sum()
  above = np.array([probs[probs > q].sum() for q in probs])
  probs = np.where(above < top_p, probs, 0.0)
  return probs / probs.sum()


@pytest.mark.slow  # the shared batch: one large decode compile
@pytest.mark.parametrize("group", range(len(CHI_SETTINGS)))
def test_the_first_step_law_is_the_masked_renormalized_softmax_chi_square(batch, group):
  """The constraint masks first: the law is the masked softmax, renormalized, then processed
  (temperature 1.5; then top-p 0.6 over the allowed tokens only, not over all 259)."""
  temperature, top_p = list(CHI_SETTINGS.values())[group]
  out = batch["out"]
  first = batch["first_chi"] + group * CHI_ROWS
  assert batch["rows"][first]["setting"] == list(CHI_SETTINGS)[group]
  draws = out["tokens"][first:first + CHI_ROWS, 0]
  counts = np.bincount(draws, minlength=V)
  # Every chi row has the same prompt, hence the same prefill logits (toy_model's table row).
  chi_logits = np.asarray(batch["logits"][first:first + CHI_ROWS])
  assert (chi_logits == chi_logits[:1]).all()
  expected = masked_law(chi_logits[0].astype(np.float64), CHI_ALLOWED, temperature, top_p)
  kept = np.flatnonzero(expected > 0)
  assert set(kept) <= set(CHI_ALLOWED)
  if top_p < 1:  # top-p over the allowed tokens keeps fewer than all of them, but not one
    assert 1 < kept.size < len(CHI_ALLOWED), expected[CHI_ALLOWED]
  assert counts[np.setdiff1d(np.arange(V), kept)].sum() == 0  # exactly zero, not just rare
  assert (expected[kept] * CHI_ROWS >= 5).all()  # chi-square's validity
  result = stats.chisquare(counts[kept], expected[kept] * CHI_ROWS)
  assert result.pvalue > 1e-3, (counts[kept], expected[kept] * CHI_ROWS)
  # The log-probabilities of the draws are those of the same law.
  logprobs = out["logprobs"][first:first + CHI_ROWS, 0]
  np.testing.assert_allclose(logprobs, np.log(expected[draws]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the shared batch: one large decode compile
def test_the_chi_rows_then_complete_their_match(batch):
  out = batch["out"]
  first = batch["first_chi"]
  for r in range(first, first + len(CHI_SETTINGS) * CHI_ROWS, 97):
    check_row("regex", CHI_PATTERN, out["tokens"][r], out["lengths"][r], out["finished"][r], N)
    assert out["finished"][r]


# ---------------------------------------------------------------------------------------------
# Rows alone.


ALONE = [  # rows of the shared batch decoded by themselves: (kind, spec, setting, prompt)
    ("regex", r"[0-9]{2}:[0-9]{2}", "top-p", 0),
    ("choice", ["yes", "no"], "temperature 1.5", 1),
    (None, None, "top-p", 0),  # an unconstrained row of the stack
    (None, None, "temperature 1.5", 0),
]


def decode_alone(prompt, key, constraint, setting):
  temperature, top_p = SETTINGS[setting]
  logits, state, positions = toy_model.prefill_cached(TABLE, [prompt], SLOTS)
  return jaxdecode.decode(STEP, state, logits, key=key,
                          params=SamplingParams(temperature=temperature, top_p=top_p),
                          max_new_tokens=N, positions=positions, eos_ids=[EOS], pad_id=PAD,
                          constraint=constraint)


def find_row(b, spec, setting, prompt):
  return next(r for r, row in enumerate(b["rows"])
              if (None if row["case"] is None else b["cases"][row["case"]][1]) == spec
              and row["setting"] == setting and row["prompt"] == prompt
              and not row.get("dead_end"))


@pytest.mark.parametrize("kind, spec, setting, prompt", ALONE)
@pytest.mark.slow
def test_each_row_of_the_stack_is_its_output_alone_bit_for_bit(batch, kind, spec, setting,
                                                               prompt):
  """Row r of the big stacked batch, with its key keys[r], equals the same prompt decoded by
  itself with its own constraint (not stacked) or none: tokens and log-probabilities bitwise.
  (The two constrained ones have the same table sizes: one program for both.)"""
  r = find_row(batch, spec, setting, prompt)
  alone = decode_alone(PROMPTS[prompt], batch["keys"][r:r + 1],
                       None if kind is None else constraint_of(kind, spec), setting)
  out = batch["out"]
  np.testing.assert_array_equal(np.asarray(alone.tokens)[0], out["tokens"][r])
  np.testing.assert_array_equal(np.asarray(alone.logprobs)[0], out["logprobs"][r])
  assert int(alone.lengths[0]) == out["lengths"][r]
  assert bool(alone.finished[0]) == out["finished"][r]
  if kind is not None:
    check_row(kind, spec, out["tokens"][r], out["lengths"][r], out["finished"][r], N)
    assert out["finished"][r]
  else:  # unconstrained: free text (random logits give many distinct bytes)
    assert len(set(out["tokens"][r].tolist())) > 20


@pytest.mark.slow  # the shared batch: one large decode compile
def test_a_new_regex_with_the_same_padded_shapes_does_not_recompile_decode(batch):
  first = constraint_of("regex", ALONE[0][1])
  key = batch["keys"][:1]
  decode_alone(PROMPTS[0], key, first, "temperature 1.5")  # compiled (or already)
  size = jaxdecode.decoding._decode_jit._cache_size()  # pylint: disable=protected-access
  pattern = r"[0-9]{2}-[0-9]{3}"  # another pattern, another automaton, the same table sizes
  other = structured.regex(pattern, VOCAB)
  assert other.next_state.shape == first.next_state.shape
  assert not np.array_equal(np.asarray(other.next_state), np.asarray(first.next_state))
  out = decode_alone(PROMPTS[0], key, other, "temperature 1.5")
  assert jaxdecode.decoding._decode_jit._cache_size() == size  # pylint: disable=protected-access
  check_row("regex", pattern, out.tokens[0], out.lengths[0], out.finished[0], N)
  assert bool(out.finished[0])


@pytest.mark.slow  # the shared batch: one large decode compile
def test_one_option_alone_gives_exactly_it_then_eos(batch):
  """choice(["ab"]) alone (the table sizes above: the same program), at temperature 1.5."""
  for i in range(3):
    out = decode_alone(PROMPTS[1], batch["keys"][i:i + 1], structured.choice(["ab"], VOCAB),
                       "temperature 1.5")
    np.testing.assert_array_equal(np.asarray(out.tokens)[0, :4],
                                  [ord("a"), ord("b"), EOS, PAD])
    assert bool(out.finished[0]) and int(out.lengths[0]) == 3


# ---------------------------------------------------------------------------------------------
# Speculative decoding and beam search.


@pytest.mark.slow  # the shared batch: one large decode compile
def test_speculative_decoding_with_the_stacked_constraint_equals_decode_bit_for_bit(batch):
  """speculative_decode (prompt-lookup drafts) over the batch's rows but the chi-square ones,
  with the same per-row keys, equals the rows of the shared decode bit for bit."""
  b = batch
  rows = list(range(b["first_chi"]))
  constraint = structured.stack([None if b["rows"][r]["case"] is None
                                 else b["built"][b["rows"][r]["case"]] for r in rows])
  params = SamplingParams(
      temperature=np.asarray(b["params"].temperature)[rows],
      top_p=np.asarray(b["params"].top_p)[rows],
      banned_token_ids=[b["rows"][r]["banned"] for r in rows])
  prompts = [b["prompts"][r] for r in rows]
  logits, state, positions = toy_model.prefill_cached(TABLE, prompts, SLOTS)
  drafter = jaxdecode.NgramDrafter(*jaxdecode.right_pad(prompts, width=16))
  spec = jax.jit(lambda params: jaxdecode.speculative_decode(  # traced params, as run_decode
      STEP, state, logits, key=b["keys"][np.asarray(rows)], params=params, max_new_tokens=N,
      positions=positions, eos_ids=[EOS], pad_id=PAD, constraint=constraint, drafter=drafter,
      num_draft_tokens=4), compiler_options=conftest.RUNS_LONG)(params)  # as run_decode's
  out = {k: v[rows] for k, v in b["out"].items()}
  np.testing.assert_array_equal(np.asarray(spec.tokens), out["tokens"])
  np.testing.assert_array_equal(np.asarray(spec.logprobs), out["logprobs"])
  np.testing.assert_array_equal(np.asarray(spec.lengths), out["lengths"])
  np.testing.assert_array_equal(np.asarray(spec.finished), out["finished"])
  np.testing.assert_array_equal(np.asarray(spec.dead_end), out["dead_end"])
  accepted = np.asarray(spec.accepted)
  assert accepted.sum() > 0  # drafts were accepted under the automata (and had to be right)
  assert (accepted <= np.asarray(spec.drafted)).all()


@pytest.mark.slow
def test_beam_search_with_constraints_returns_matching_texts():
  cases = [("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), ("choice", ["positive", "negative"]),
           ("schema", SCHEMAS[2]), ("regex", r"(ab){3,5}")]
  constraint = structured.stack([constraint_of(*c) for c in cases])
  prompts = [PROMPTS[i % 2] for i in range(len(cases))]
  logits, state, positions = toy_model.prefill_cached(TABLE, prompts, SLOTS)
  out = jaxdecode.beam_search(STEP, state, logits, beam_size=3, max_new_tokens=32,
                              positions=positions, eos_ids=[EOS], pad_id=PAD,
                              constraint=constraint)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  finished, scores = np.asarray(out.finished), np.asarray(out.scores)
  for b, (kind, spec) in enumerate(cases):
    assert finished[b, 0], (spec, tokens[b, 0])
    for k in range(tokens.shape[1]):
      if lengths[b, k] == 0:  # an empty slot
        assert scores[b, k] == -np.inf
        continue
      check_row(kind, spec, tokens[b, k], lengths[b, k], finished[b, k], 32)
  # choice: both options are possible hypotheses, and the 3rd slot finds nothing else
  b = 1
  texts = {row_bytes(tokens[b, k], lengths[b, k])[0] for k in range(3) if lengths[b, k]}
  assert texts == {b"positive", b"negative"}


# ---------------------------------------------------------------------------------------------
# The tables against enumerated languages (no decoding).


def language(constraint, limit=100_000):
  """Every byte string the (single) constraint accepts, by walking its tables (finite languages
  only); also asserts that every reachable state can still reach an accepting one."""
  table = np.asarray(constraint.next_state)
  classes = np.asarray(constraint.token_class)[0]
  accepting = np.asarray(constraint.accepting)
  start = int(np.asarray(constraint.initial)[0])
  found, todo = set(), [(start, b"")]
  while todo:
    state, text = todo.pop()
    assert len(found) < limit and len(text) < 64, "not a finite language"
    moves = table[state, classes]  # [V]
    allowed = np.flatnonzero(moves >= 0)
    assert allowed.size, f"state {state} after {text!r} allows nothing (a dead end)"
    if accepting[state]:
      found.add(text)
      assert moves[EOS] == state  # EOS allowed in accepting states, keeping the state
    else:
      assert moves[EOS] < 0  # and only there
    assert (moves[[BOS, PAD]] < 0).all()
    for t in allowed:
      if t < 256:
        todo.append((int(moves[t]), text + bytes([t])))
  return found


# Two limits of outlines-core's own token index that structured.py's construction lifts (it
# reads the byte DFA of `pattern` followed by an end byte, so no state of the pattern is a
# match state, and walks the tokens itself): alternations are no longer leftmost-first
# ("(x|xy)z?" gives all four words), and a multi-byte character may follow a whole match with
# the byte vocabulary ("é{1,2}" gives "éé").


@pytest.mark.parametrize("kind, spec, words", [
    ("regex", r"x{2,4}y{3}z{0,2}",
     {"x" * i + "yyy" + "z" * j for i in range(2, 5) for j in range(3)}),
    ("regex", r"([01][0-9]|2[0-3]):[0-5][0-9]",
     {f"{h:02d}:{m:02d}" for h in range(24) for m in range(60)}),
    ("regex", r"(café|日本語|naïve) ?[αβγ]{1,3}",
     {w + s + "".join(g) for w in ("café", "日本語", "naïve") for s in ("", " ")
      for n in (1, 2, 3) for g in itertools.product("αβγ", repeat=n)}),
    ("regex", r"(café|日本語|naïve) ?[αβγ]",
     {w + s + g for w in ("café", "日本語", "naïve") for s in ("", " ") for g in "αβγ"}),
    ("regex", r"(true|false|null)", {"true", "false", "null"}),
    ("choice", CHOICES[5], set(CHOICES[5])),
    ("choice", ["a", "ab", "abc"], {"a", "ab", "abc"}),  # choice orders them longest first
    ("choice", ["abc", "ab", "a"], {"a", "ab", "abc"}),  # the same options, longest first
    ("regex", r"(x|xy)z?", {"x", "xz", "xy", "xyz"}),
    ("regex", r"é{1,2}", {"é", "éé"}),
    ("schema", {"enum": ["x", 1, None, True]}, {'"x"', "1", "null", "true"}),
    ("schema", {"type": "array", "items": {"const": "k"}, "maxItems": 2},
     None),  # checked below by jsonschema instead of a list
])
def test_the_tables_accept_exactly_the_enumerated_language(kind, spec, words):
  found = language(constraint_of(kind, spec))
  if words is None:
    for text in found:
      jsonschema.validate(json.loads(text.decode()), spec)
    assert {json.dumps(json.loads(t.decode())) for t in found} == {"[]", '["k"]',
                                                                    '["k", "k"]'}
  else:
    assert found == {w.encode() for w in words}


def test_a_vocabulary_of_multi_byte_tokens_spells_the_language_with_them():
  """Tokens longer than a byte: '12' and '3' spell '123' and '3'; '1' alone is absent, so
  '13' cannot be spelled; the language of [0-9]{1,3} is what concatenations give."""
  vocab = structured.Vocabulary([b"12", b"3", b"4x", None], eos_ids=[3])
  c = structured.regex(r"[0-9]{1,3}", vocab)
  table = np.asarray(c.next_state)
  classes = np.asarray(c.token_class)[0]
  accepting = np.asarray(c.accepting)
  found, todo = set(), [(int(np.asarray(c.initial)[0]), b"")]
  while todo:
    state, text = todo.pop()
    if accepting[state]:
      found.add(text)
    for t in range(3):
      nxt = table[state, classes[t]]
      if nxt >= 0:
        todo.append((int(nxt), text + vocab.tokens[t]))
  assert found == {b"12", b"3", b"123", b"33", b"333", b"312"}


def test_allowed_and_advance_walk_a_choice_state_by_state():
  c = structured.choice(["abc", "ab", "a"], VOCAB)  # ["a", "ab", "abc"]
  state = c.initial
  expected = [({ord("a")}, ord("a")), ({ord("b"), EOS}, ord("b")), ({ord("c"), EOS}, ord("c")),
              ({EOS}, EOS)]
  for allowed_set, token in expected:
    allowed = np.asarray(structured.allowed(c, state))[0]
    assert set(np.flatnonzero(allowed).tolist()) == allowed_set
    state = structured.advance(c, state, jnp.asarray([token], jnp.int32))


# ---------------------------------------------------------------------------------------------
# Bad inputs: one clear ValueError each.


def test_invalid_regexes_are_value_errors():
  for pattern in ["(ab", "[a-", "a{3,1}", "*a"]:
    with pytest.raises(ValueError, match="regex"):
      structured.regex(pattern, VOCAB)
  with pytest.raises(ValueError, match="non-empty"):
    structured.regex("", VOCAB)


def test_an_empty_language_is_a_value_error():
  """A language the vocabulary cannot spell, or an empty one, is refused with one message."""
  empty = r"language is empty"
  vocab = structured.Vocabulary([b"a", b"b", None], eos_ids=[2])
  with pytest.raises(ValueError, match=r"regex 'c' matches no text.*language is empty"):
    structured.regex("c", vocab)  # no token has the byte
  nothing = r"[^\s\S]"  # no text at all
  with pytest.raises(ValueError, match=re.escape(f"regex {nothing!r} matches no text")):
    structured.regex(nothing, vocab)
  with pytest.raises(ValueError, match=r"choice \['c'\]"):
    structured.choice(["c"], vocab)
  with pytest.raises(ValueError, match=empty):
    structured.json_schema({"type": "integer"}, vocab)
  digits = structured.Vocabulary([b"12", b"34", None], eos_ids=[2])
  with pytest.raises(ValueError, match=empty):
    structured.regex("[0-9]{3}", digits)  # odd lengths cannot be spelled with 2-byte tokens
  c = structured.regex("[0-9]{4}", digits)  # but even ones can
  assert c.rows == 1
  pairs = structured.Vocabulary([b"ab", b"ba", None], eos_ids=[2])
  with pytest.raises(ValueError, match=empty):
    structured.regex("a(ba)*", pairs)  # "ab" + "ab" ... never ends with the lone "a"


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "integer", "minimum": 0}, "minimum"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties"),
    ({"type": "object", "properties": {"a": {"type": "number", "exclusiveMaximum": 3}}},
     "exclusiveMaximum"),
    ({"type": "array", "items": {"type": "string", "not": {"const": "x"}}}, "not"),
    ({"type": "number", "multipleOf": 2}, "multipleOf"),
])
def test_unsupported_schema_keywords_are_value_errors_naming_the_keyword(schema, keyword):
  with pytest.raises(ValueError, match=re.escape(repr(keyword))):
    structured.json_schema(schema, VOCAB)
  with pytest.raises(ValueError, match=re.escape(repr(keyword))):
    structured.json_schema(json.dumps(schema), VOCAB)  # the JSON string too


def test_bad_schemas_are_value_errors():
  with pytest.raises(ValueError, match="not valid JSON"):
    structured.json_schema("{not json", VOCAB)
  with pytest.raises(ValueError, match="schema"):
    structured.json_schema("[1, 2]", VOCAB)
  with pytest.raises(ValueError, match="format"):
    structured.json_schema({"type": "string", "format": "ipv4"}, VOCAB)


def test_bad_choices_are_value_errors():
  for options in [[], ["a", 1], ["a", ""], "ab", None, [None]]:
    with pytest.raises(ValueError, match="options"):
      structured.choice(options, VOCAB)


def test_bad_stacks_are_value_errors():
  c = structured.regex("[0-9]", VOCAB)
  with pytest.raises(ValueError, match="None"):
    structured.stack([None, None])
  with pytest.raises(ValueError):
    structured.stack([])
  small = structured.regex("[0-9]", structured.Vocabulary([b"1", b"2", None], eos_ids=[2]))
  with pytest.raises(ValueError, match="different vocabularies"):
    structured.stack([c, small])
  with pytest.raises(ValueError, match="one constraint"):
    structured.stack([structured.stack([c, c]), None])


def test_loops_refuse_a_constraint_of_another_vocabulary_or_row_count():
  c = structured.regex("[0-9]", VOCAB)
  logits, state, positions = toy_model.prefill_cached(TABLE, [PROMPTS[0]] * 3, SLOTS)
  args = dict(key=jax.random.key(0), params=SamplingParams(), max_new_tokens=4,
              positions=positions, eos_ids=[EOS], pad_id=PAD)
  small = structured.regex("[0-9]", structured.Vocabulary([b"1", b"2", None], eos_ids=[2]))
  with pytest.raises(ValueError, match="vocabulary of 3 tokens but the logits have 259"):
    jaxdecode.decode(STEP, state, logits, constraint=small, **args)
  with pytest.raises(ValueError, match="2 rows"):
    jaxdecode.decode(STEP, state, logits, constraint=structured.stack([c, None]), **args)
  drafter = jaxdecode.NgramDrafter(*jaxdecode.right_pad([PROMPTS[0]] * 3, width=16))
  with pytest.raises(ValueError, match="2 rows"):
    jaxdecode.speculative_decode(STEP, state, logits, constraint=structured.stack([c, None]),
                                 drafter=drafter, **args)
  with pytest.raises(ValueError, match="vocabulary of 3 tokens"):
    jaxdecode.beam_search(STEP, state, logits, beam_size=2, max_new_tokens=4,
                          positions=positions, constraint=small)
  with pytest.raises(ValueError, match="constraint"):
    jaxdecode.decode(STEP, state, logits, constraint=r"[0-9]", **args)


@pytest.fixture(scope="module")
def model():
  from jaxdecode import models
  return models.load_default()[0]


def test_generate_refuses_bad_constraint_arguments_before_running(model):
  from jaxdecode.models import generate
  with pytest.raises(ValueError, match="at most one of regex, json_schema and choices"):
    generate(["a"], model=model, regex="[0-9]", choices=["x"])
  with pytest.raises(ValueError, match="at most one"):
    generate(["a"], model=model, regex="[0-9]", json_schema={"type": "integer"})
  with pytest.raises(ValueError, match="one per prompt"):
    generate(["a", "b"], model=model, regex=["[0-9]", "[a-z]", None])
  with pytest.raises(ValueError, match="one per prompt"):
    generate(["a", "b"], model=model, choices=[["x"], ["y"], ["z"]])
  with pytest.raises(ValueError, match="regex"):
    generate(["a"], model=model, regex="(ab")
  with pytest.raises(ValueError, match="'minimum'"):
    generate(["a"], model=model, json_schema={"type": "integer", "minimum": 0})
  with pytest.raises(ValueError, match="remove every token"):
    generate(["a"], model=model, choices=["ab"],
             params=SamplingParams(banned_token_ids=[ord("b")]))
  with pytest.raises(ValueError, match="remove every token"):  # per row: only row 1's
    generate(["a", "b"], model=model, regex=["[0-9]x", "[0-9]y"],
             params=SamplingParams(banned_token_ids=[[], [ord("y")]]))
  with pytest.raises(ValueError, match="remove every token"):  # allowed ids outside the language
    generate(["a"], model=model, regex="[0-9]+",
             params=SamplingParams(allowed_token_ids=[ord("a"), ord("b")]))


# ---------------------------------------------------------------------------------------------
# Heavier runs (slow): a 32k BPE vocabulary, traced bans under jit, the embedded model.


def byte_level_decoder() -> dict:
  """ByteLevel's (GPT-2's) printable stand-in of each byte, inverted: char -> byte."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
               list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return {c: b for b, c in chars.items()}


def train_bpe(vocab_size=32000, seed=0):
  """A ByteLevel BPE tokenizer trained on a synthetic corpus (random words of random syllables,
  digits and JSON punctuation); returns (tokenizer, tokens as bytes with None for specials,
  eos id)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  rng = random.Random(seed)
  syllables = ([a + b for a in "bcdfghjklmnprstvwz" for b in "aeiouy"] +
               list("0123456789{}[]\":,. -_") + ["é", "ü", "日", "本"])
  words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
           for _ in range(60000)]
  corpus = [" ".join(rng.choices(words, k=12)) for _ in range(20000)]
  corpus += [json.dumps({"name": rng.choice(words), "age": rng.randint(0, 99),
                         "ok": rng.random() < 0.5}) for _ in range(2000)]
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<pad>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(corpus, trainer)
  decoder = byte_level_decoder()
  assert set(decoder) == set(pre_tokenizers.ByteLevel.alphabet())
  specials = {tokenizer.token_to_id("<eos>"), tokenizer.token_to_id("<pad>")}
  tokens = [None if i in specials else bytes(decoder[c] for c in tokenizer.id_to_token(i))
            for i in range(tokenizer.get_vocab_size())]
  # The bytes are right: encoding then concatenating the tokens' bytes gives the text back.
  text = '{"name": "bébé 日本", "tags": [1, 22]}'
  assert b"".join(tokens[i] for i in tokenizer.encode(text).ids) == text.encode()
  return tokenizer, tokens, tokenizer.token_to_id("<eos>")


BPE_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                   "ok": {"type": "boolean"},
                   "kind": {"enum": ["x", "y"]}},
    "required": ["name", "age", "ok"]}


@pytest.mark.slow
def test_random_logits_over_a_32k_bpe_vocabulary_give_valid_json(record_property):
  started = time.perf_counter()
  tokenizer, tokens, eos = train_bpe()
  trained = time.perf_counter() - started
  vocab_size = len(tokens)
  assert vocab_size == 32000  # reached from the synthetic corpus
  vocab = structured.Vocabulary(tokens, eos_ids=[eos])
  started = time.perf_counter()
  constraint = structured.json_schema(BPE_SCHEMA, vocab)
  compile_s = time.perf_counter() - started
  nbytes = constraint.nbytes()
  for name, value in (("bpe_vocab_size", vocab_size), ("bpe_train_s", round(trained, 2)),
                      ("schema_compile_s", round(compile_s, 2)), ("table_bytes", nbytes),
                      ("table_shape", tuple(constraint.next_state.shape))):
    record_property(name, value)
  print(f"\n32k BPE: vocab {vocab_size}, trained in {trained:.1f} s; schema compiled in "
        f"{compile_s:.2f} s; tables {nbytes} bytes, next_state {constraint.next_state.shape}")
  batch, n = 32, 160
  base = jax.random.key(99)

  def logits_at(rows, tokens_, positions):
    def one(r, t, p):
      k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, r), p), t)
      return jax.random.normal(k, (vocab_size,), jnp.float32) * 3.0
    return jax.vmap(one)(rows, tokens_, positions)

  def step(state, tokens_, positions):
    return logits_at(state["rows"], tokens_, positions), state

  rows = jnp.arange(batch, dtype=jnp.int32)
  positions = jnp.full((batch,), 1, jnp.int32)
  logits = logits_at(rows, jnp.zeros(batch, jnp.int32), jnp.zeros(batch, jnp.int32))
  params = SamplingParams(temperature=np.where(np.arange(batch) % 2, 1.5, 1.0),
                          top_p=np.where(np.arange(batch) % 2, 1.0, 0.9))
  decode = jax.jit(functools.partial(jaxdecode.decode, step, max_new_tokens=n, eos_ids=[eos],
                                     pad_id=tokenizer.token_to_id("<pad>")),
                   compiler_options=conftest.RUNS_LONG)  # 32 rows x 160 steps over 32k logits
  out = decode({"rows": rows}, logits, key=jax.random.split(base, batch), params=params,
               positions=positions, constraint=constraint)
  toks, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  finished = np.asarray(out.finished)
  pattern = schema_regex(BPE_SCHEMA)
  multi = 0
  for b in range(batch):
    ids = toks[b, :lengths[b]].tolist()
    assert (ids[-1] == eos) == finished[b]
    body = ids[:-1] if finished[b] else ids
    assert all(tokens[i] is not None for i in body)  # no special token inside
    multi += sum(len(tokens[i]) > 1 for i in body)
    data = b"".join(tokens[i] for i in body)
    if finished[b]:
      jsonschema.validate(json.loads(data.decode("utf-8")), BPE_SCHEMA)
    else:
      assert lengths[b] == n
      assert is_prefix_of_match(pattern, complete_prefix(data))
  assert finished.mean() >= 0.75, finished
  assert multi > 0  # the rows do use multi-byte tokens, not only single bytes


@pytest.mark.slow
def test_under_jit_traced_bans_that_remove_every_allowed_token_make_a_dead_end():
  c = structured.choice(["ab"], VOCAB)
  constraint = structured.stack([c, c, None])
  logits, state, positions = toy_model.prefill_cached(TABLE, [PROMPTS[0]] * 3, SLOTS)

  @jax.jit
  def run(banned):
    params = SamplingParams(temperature=1.0, banned_token_ids=banned)
    return jaxdecode.decode(STEP, state, logits, key=jax.random.key(3), params=params,
                            max_new_tokens=8, positions=positions, eos_ids=[EOS], pad_id=PAD,
                            constraint=constraint)

  out = run(jnp.asarray([[ord("b")], [-1], [ord("b")]], jnp.int32))
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  dead_end, finished = np.asarray(out.dead_end), np.asarray(out.finished)
  # Row 0: 'a' forced, then only 'b', which is banned: a dead end, its length stops at 1.
  assert dead_end[0] and not finished[0] and lengths[0] == 1 and tokens[0, 0] == ord("a")
  np.testing.assert_array_equal(tokens[0, 1:], PAD)
  # Row 1 (nothing banned): "ab" then EOS.
  np.testing.assert_array_equal(tokens[1, :3], [ord("a"), ord("b"), EOS])
  assert finished[1] and not dead_end[1]
  # Row 2 is unconstrained: the ban only removes 'b'.
  assert not dead_end[2] and lengths[2] >= 1 and ord("b") not in tokens[2, :lengths[2]].tolist()


@pytest.mark.slow
def test_generate_on_the_embedded_model_follows_per_prompt_constraints(model):
  """One batch (one compile): regexes, a JSON schema and a free row, greedy and sampled."""
  from jaxdecode.models import generate
  prompts = ["The date is ", "Is it raining? ", "Hello", "Temperature: ", "A user record: "]
  regexes = [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(yes|no)", None, r"-?[0-9]{1,2}\.[0-9] ?C"]
  schema = SCHEMAS[2]
  constraint = structured.stack([None if r is None else structured.regex(r, VOCAB)
                                 for r in regexes] + [structured.json_schema(schema, VOCAB)])
  params = SamplingParams(temperature=np.array([0.0, 1.0, 1.5, 1.5, 1.5], np.float32),
                          top_p=np.array([1.0, 0.9, 1.0, 1.0, 1.0], np.float32))
  out = generate(prompts, model=model, constraint=constraint, params=params, max_new_tokens=40,
                 seed=5)
  for b, pattern in enumerate(regexes):
    if pattern is None:
      continue
    assert out.finished[b], (pattern, out.texts[b])
    assert re.fullmatch(pattern, out.texts[b]), (pattern, out.texts[b])
  assert not re.fullmatch(regexes[0], out.texts[2])  # the unconstrained row is free text
  assert out.finished[4], out.texts[4]
  jsonschema.validate(json.loads(out.texts[4]), schema)


def test_concrete_bans_that_empty_a_constraint_are_refused_by_every_loop():
  """choice(["ab"]) with 'b' banned: after 'a' nothing is left; concrete values are an error in
  decode, beam_search and speculative_decode (generate's own check is tested above)."""
  c = structured.choice(["ab"], VOCAB)
  params = SamplingParams(banned_token_ids=[ord("b")])
  logits, state, positions = toy_model.prefill_cached(TABLE, [PROMPTS[0]], SLOTS)
  common = dict(max_new_tokens=4, positions=positions, eos_ids=[EOS], pad_id=PAD,
                constraint=c, params=params)
  calls = [lambda: jaxdecode.decode(STEP, state, logits, key=jax.random.key(0), **common),
           lambda: jaxdecode.beam_search(STEP, state, logits, beam_size=2, **common),
           lambda: jaxdecode.speculative_decode(
               STEP, state, logits, key=jax.random.key(0), **common,
               drafter=jaxdecode.NgramDrafter(*jaxdecode.right_pad([PROMPTS[0]], width=16)))]
  for call in calls:
    with pytest.raises(ValueError, match="nothing to select"):
      call()


# ---------------------------------------------------------------------------------------------
# A hostile user's inputs (issue 37): nothing silent, nothing unbounded.


@pytest.mark.slow
def test_every_loop_refuses_eos_ids_other_than_the_constraints():
  """eos_ids=[0] would end rows on an ordinary token of the text ("a" of "abc"), and eos_ids=[]
  would write the vocabulary's EOS as text: both are refused by every loop, naming both."""
  vocab = structured.Vocabulary([b"a", b"b", b"c", b"d", None], eos_ids=[4])
  c = structured.regex("[a-d]{3}", vocab)
  assert c.eos_ids == (4,)
  logits = jnp.zeros((2, 5))
  step = lambda state, tokens, positions: (jnp.zeros(tokens.shape + (5,)), state)
  common = dict(max_new_tokens=4, positions=jnp.array([1, 1]), constraint=c)
  for eos, named in (([0], r"eos_ids \[0\] disagree with the constraint's EOS ids \[4\]"),
                     ([], r"eos_ids \[\] disagree"), ([4, 0], r"eos_ids \[0, 4\] disagree")):
    with pytest.raises(ValueError, match="decode: " + named):
      jaxdecode.decode(step, {}, logits, key=jax.random.key(0), params=SamplingParams(),
                       eos_ids=eos, **common)
    with pytest.raises(ValueError, match="beam_search: " + named):
      jaxdecode.beam_search(step, {}, logits, beam_size=2, eos_ids=eos, **common)
    with pytest.raises(ValueError, match="speculative_decode: " + named):
      jaxdecode.speculative_decode(
          step, {}, logits, key=jax.random.key(0), params=SamplingParams(), eos_ids=eos,
          drafter=jaxdecode.NgramDrafter(*jaxdecode.right_pad([[0], [1]], width=4)), **common)
  out = jaxdecode.decode(step, {}, logits, key=jax.random.key(0), params=SamplingParams(),
                         eos_ids=[4], **common)
  text = np.asarray(out.tokens)
  assert np.all(text[:, :3] < 4) and np.all(text[:, 3] == 4) and np.all(np.asarray(out.finished))
  with pytest.raises(ValueError, match="different EOS ids"):
    structured.stack([c, structured.regex("a", structured.Vocabulary([b"a", b"b", b"c", b"d",
                                                                       None], eos_ids=[3]))])


def test_generate_and_stream_refuse_a_constraint_with_another_eos():
  other = structured.Vocabulary(list(VOCAB.tokens), eos_ids=[BOS])  # same size, another EOS
  from jaxdecode import models
  model = models.load_default()[0]
  for run in (models.generate, models.stream):
    with pytest.raises(ValueError, match=r"eos_ids \[%d\] disagree.*EOS ids \[%d\]" % (EOS, BOS)):
      run(["x"], model=model, constraint=structured.regex("ab", other), max_new_tokens=4)


def test_stop_strings_with_a_constraint_are_refused_before_anything_runs():
  """A stop string would end a constrained row inside a match ('mayb' of 'maybe', marked
  finished): generate and stream refuse the combination, whichever constraint is given."""
  from jaxdecode import models
  model = models.load_default()[0]
  for kind in (dict(choices=["yes", "no", "maybe"]), dict(regex="[a-z]+"),
               dict(json_schema={"type": "boolean"}), dict(regex=[None, "ab"]),
               dict(constraint=structured.choice(["yes"], VOCAB))):
    for run in (models.generate, models.stream):
      with pytest.raises(ValueError, match="stop strings cannot be combined with a constraint"):
        run(["x = ", "y = "], model=model, max_new_tokens=12, stop=["e", "o"], seed=1, **kind)


def test_min_new_tokens_past_every_text_of_the_constraint_is_refused_with_the_numbers():
  from jaxdecode import models
  model = models.load_default()[0]
  with pytest.raises(ValueError, match=r"min_new_tokens=5 but every text of its constraint ends "
                                       r"after at most 2 tokens"):
    models.generate(["x = "], model=model, regex="ab", params=SamplingParams(min_new_tokens=5))
  c = structured.choice(["ab", "abcdef"], VOCAB)
  assert structured.longest_texts(c).tolist() == [6]
  assert structured.longest_texts(structured.regex("a+", VOCAB)).tolist() == [-1]  # a loop
  assert structured.longest_texts(structured.stack([c, None])).tolist() == [6, -1]
  logits, state, positions = toy_model.prefill_cached(TABLE, [PROMPTS[0]] * 2, SLOTS)
  with pytest.raises(ValueError, match=r"decode: row 1: min_new_tokens=7 .* at most 6"):
    jaxdecode.decode(STEP, state, logits, key=jax.random.key(0), max_new_tokens=8,
                     params=SamplingParams(min_new_tokens=jnp.array([0, 7])), eos_ids=[EOS],
                     positions=positions, pad_id=PAD, constraint=structured.stack([c, c]))


def test_max_new_tokens_is_bounded_before_any_buffer_is_made():
  step = lambda state, tokens, positions: (jnp.zeros(tokens.shape + (5,)), state)
  args = dict(key=jax.random.key(0), params=SamplingParams(), positions=jnp.array([1, 1]))
  with pytest.raises(ValueError, match=r"max_new_tokens must be an integer in \[1, 1073741824\]; "
                                       r"got 2147483648"):
    jaxdecode.decode(step, {}, jnp.zeros((2, 5)), max_new_tokens=2**31, **args)
  rows = 2**16  # 65536 rows x 2**30 tokens x 8 bytes: past any machine's memory
  with pytest.raises(ValueError, match=r"max_new_tokens=1073741824 needs output buffers of 65536 "
                                       r"rows x 1073741824 tokens x 8 bytes"):
    jaxdecode.decode(step, {}, jnp.zeros((rows, 5)), max_new_tokens=2**30,
                     **dict(args, positions=jnp.ones(rows, jnp.int32)))
  with pytest.raises(ValueError, match=r"pass int32's largest position"):  # 2 GiB of buffers
    jaxdecode.decode(step, {}, jnp.zeros((1, 5)), max_new_tokens=2**28,
                     **dict(args, positions=jnp.array([2**31 - 2**27])))
  with pytest.raises(ValueError, match=r"beam_search: max_new_tokens=1073741824 needs output "
                                       r"buffers of 131072 rows"):
    jaxdecode.beam_search(step, {}, jnp.zeros((rows, 5)), beam_size=2, max_new_tokens=2**30,
                          positions=jnp.ones(rows, jnp.int32))


@pytest.mark.parametrize("pattern, fragment", [
    (r"(a)\1", r"backreference \('\\\\1'\)"),
    (r"(?P<n>a)\k<n>", "backreference"),
    (r"a(?=b)", r"lookaround \('\(\?=b'"),
    (r"(?<!a)b", "lookaround"),
    (r"a\bb", r"word boundary \\b"),
    (r"a^b", r"anchor '\^' inside the pattern"),
    (r"(a|b$)c", r"anchor '\$' inside the pattern"),
    (r"a\Ab", r"anchor \\A inside the pattern"),
    (r"[^\s\S]", r"language is empty"),
    (r"^$", r"only the empty text"),
    (r"(x{500}){500}", r"its repeats expand to about 250000 positions"),
    (r"(?:ab{1000}){1000}", r"its repeats expand to about 1001000 positions"),
])
def test_regexes_no_automaton_can_follow_are_named(pattern, fragment):
  with pytest.raises(ValueError, match=fragment):
    structured.regex(pattern, VOCAB)


def test_a_dfa_past_the_state_budget_is_refused_with_its_size(monkeypatch):
  """Python's parser cannot size `\\p{Greek}` (a syntax it lacks), so the DFA is built, in the
  worker, and its size checked before the token walk."""
  monkeypatch.setattr(structured, "MAX_STATES", 100)
  with pytest.raises(ValueError, match=r"its DFA has \d+ states, more than the budget of 100"):
    structured.regex(r"\p{Greek}{200}", VOCAB)


@pytest.mark.parametrize("pattern, same", [
    (r"^[0-9]{2}$", r"[0-9]{2}"), (r"\A(ab|c)\z", r"(ab|c)"), (r"^x\$", r"x[$]"),
    (r"[$^]{1,2}$", r"(\$|\^){1,2}"),
])
def test_leading_and_trailing_anchors_are_dropped(pattern, same):
  """A constraint always matches the whole text, so ^ / \\A and $ / \\z at the ends are
  redundant; escaped or in a class, they are characters."""
  assert language(structured.regex(pattern, VOCAB)) == language(structured.regex(same, VOCAB))


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "string", "maxLength": -1}, r"schema.maxLength must be an integer >= 0; got -1"),
    ({"type": "string", "maxLength": 2.5}, r"maxLength must be an integer >= 0"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, r"minLength \(5\) is more than"),
    ({"type": "array", "items": {"type": "null"}, "minItems": True}, r"minItems must be"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": "a"},
     r"required must be a list of property names"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]},
     r"required names \['b'\], which schema.properties does not define"),
    ({"enum": []}, r"enum must be a non-empty list"),
    ({"type": "string", "maxLength": 10**9}, r"maxLength is 1000000000: its automaton would have "
                                             r"about 10000000000 states"),
])
def test_schemas_with_impossible_or_unbounded_keywords_are_refused(schema, fragment):
  with pytest.raises(ValueError, match=fragment):
    structured.json_schema(schema, VOCAB)


def test_deep_schemas_name_the_depth_limit_and_nested_arrays_stay_bounded():
  deep = {"type": "null"}
  for _ in range(200):
    deep = {"type": "array", "items": deep}
  with pytest.raises(ValueError, match=r"nested 33 schemas deep, past structured decoding's "
                                       r"depth limit of 32"):
    structured.json_schema(deep, VOCAB)
  nested = {"type": "null"}  # outlines-core writes the items twice per level: 2^24 copies
  for _ in range(24):
    nested = {"type": "array", "items": nested}
  started = time.perf_counter()
  with pytest.raises(ValueError, match=r"json_schema: (its regex has \d+ characters, past the "
                                       r"budget|building its automaton)"):
    structured.json_schema(nested, VOCAB)
  assert time.perf_counter() - started < structured.DFA_SECONDS + 30


def _walk(c, text: bytes):
  """The state after `text` (byte tokens), or None where a byte is not allowed."""
  table, classes = np.asarray(c.next_state), np.asarray(c.token_class)[0]
  state = int(c.initial[0])
  for b in text:
    state = int(table[state, classes[b]])
    if state < 0:
      return None
  return state


@pytest.mark.parametrize("length", [300, pytest.param(1000, marks=pytest.mark.slow)])
def test_a_long_max_length_compiles_small_and_counts_characters(length):
  """outlines-core's own DFA of a bounded JSON string is exponential in maxLength (an escaped
  quote could start another match: 152 s and 4.2 GB at 20); built behind a unique first byte it
  is linear. Counted in characters: an escape and a 3-byte character are one each."""
  c = structured.json_schema({"type": "string", "maxLength": length}, VOCAB)
  assert c.next_state.shape[0] <= 32 * length  # about 11 states a character, padded
  accepting = np.asarray(c.accepting)
  for body in ("a" * length, '\\"' * length, "日" * length, "a\\n" * (length // 2)):
    state = _walk(c, ('"' + body + '"').encode())
    assert state is not None and accepting[state], body[:12]
  for body in ("a" * (length + 1), '\\"' * length + "b", "日" * (length + 1)):
    state = _walk(c, ('"' + body + '"').encode())
    assert state is None or not accepting[state], body[:12]


@pytest.mark.slow
def test_packing_a_wide_vocabulary_never_holds_a_dense_states_by_vocabulary_array():
  """`.{0,300}` over 32,000 tokens: the token automaton has thousands of states, so a dense
  int32 [S, V] alone would be over 600 MB (the packer took 3.6 GB before it walked the trie by
  blocks). The host memory traced while compiling stays under 200 MB + 10x the tables."""
  import tracemalloc
  rng = np.random.default_rng(0)
  tokens = {bytes([b]) for b in range(256)}
  while len(tokens) < 32000:
    tokens.add(bytes(rng.integers(32, 127, int(rng.integers(2, 9))).astype(np.uint8)))
  vocab = structured.Vocabulary(sorted(tokens) + [None], eos_ids=[32000])
  tracemalloc.start()
  try:
    c = structured.regex(".{0,300}", vocab)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert c.next_state.shape[0] >= 2048  # thousands of states: a dense table would not fit
  assert peak <= 200 * 2**20 + 10 * c.nbytes(), (peak / 2**20, c.nbytes() / 2**20)
  accepting, table = np.asarray(c.accepting), np.asarray(c.next_state)
  classes, ids = np.asarray(c.token_class)[0], {t: i for i, t in enumerate(sorted(tokens))}
  for text, ok in ((b"x" * 300, True), (b"x" * 301, False), ("é".encode() * 300, True),
                   (b"a\nb", False)):
    state = int(c.initial[0])
    for b in text:  # one single-byte token at a time
      state = int(table[state, classes[ids[bytes([b])]]]) if state >= 0 else state
    assert (state >= 0 and bool(accepting[state])) == ok, text[:8]
