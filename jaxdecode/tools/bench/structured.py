"""Table 7, structured decoding: `jaxdecode.decode` with `constraint=` over the same decode without
one, and the time, memory and size of compiling a constraint for a 32000-token BPE vocabulary."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable, Mapping, Sequence

import jax

import jaxdecode
from jaxdecode.params import SamplingParams
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench._common import (RUNS, TOP_P, _bench_step_fn, _default_model, _medians,
                                           prefilled, time_round_robin)
from jaxdecode.tools.bench._table import Column, field, fixed
from jaxdecode.tools.bench.speculative import spec_prompts

STRUCTURED_NEW_TOKENS = 32  # every structured row, quick or not
STRUCTURED_BATCHES = (1, 8)
STRUCTURED_VOCAB = 32000  # the compile rows' BPE vocabulary
# A realistic schema: an object of typed properties, an enum and an array. Its shortest match is
# longer than STRUCTURED_NEW_TOKENS bytes, so a constrained row never reaches an accepting state
# in the decode rows (every row runs every step, as the unconstrained one does).
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "email", "score", "active", "role", "tags"],
}
# A log line (shortest match 35 bytes).
STRUCTURED_REGEX = (r"[0-9]{4}-[01][0-9]-[0-3][0-9] [0-2][0-9]:[0-5][0-9]:[0-5][0-9] "
                    r"(INFO|WARNING|ERROR) [a-z_]+\.py:[0-9]+: [A-Z][a-z ]+\.")
BPE_EOS = "<|endoftext|>"


def byte_level_decoder() -> dict[str, int]:
  """The inverse of the byte-to-unicode table of ByteLevel BPE (GPT-2's `bytes_to_unicode`):
  each of the 256 characters a ByteLevel token is spelled with -> the byte it stands for.
  Printable bytes stand for themselves; the 68 others are shifted to U+0100 and up."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  chars, shifted = dict(zip(printable, printable)), 0
  for b in range(256):
    if b not in chars:
      chars[b] = 256 + shifted
      shifted += 1
  return {chr(c): b for b, c in chars.items()}


def bpe_vocabulary(vocab_size: int = STRUCTURED_VOCAB, texts: Sequence[str] | None = None):
  """A ByteLevel BPE vocabulary trained with the `tokenizers` package, as a
  `jaxdecode.structured.Vocabulary`.

  Args:
    vocab_size: the vocabulary's size (the 256 bytes, the merges and one special token).
    texts: the training text (default: the embedded model's corpus, the standard library's
      `.py` files and the pydoc topics; about 6 s on 2 cores for 32000 tokens).

  Returns:
    `(vocabulary, tokenizer)`: each token's bytes (its ByteLevel characters mapped back through
    `byte_level_decoder`), the special token `<|endoftext|>` as None and the EOS id; and the
    trained `tokenizers.Tokenizer`.

  Raises:
    ImportError: `tokenizers` is not installed.
  """
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, models as bpe_models, pre_tokenizers, trainers
  from jaxdecode import structured  # pylint: disable=import-outside-toplevel
  if texts is None:
    from jaxdecode.models import corpus  # pylint: disable=import-outside-toplevel
    texts = [doc.decode("utf-8") for _, doc in
             corpus.pydoc_documents() + corpus.stdlib_documents()]
  tokenizer = Tokenizer(bpe_models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  to_byte = byte_level_decoder()
  tokens = [None] * tokenizer.get_vocab_size()
  for text, i in tokenizer.get_vocab().items():
    tokens[i] = None if text == BPE_EOS else bytes(to_byte[ch] for ch in text)
  sample = 'def f(x):\n\treturn {"caf\u00e9": [1, 2.5]}  # \u00fc \u2192 \U0001f600\n'
  ids = tokenizer.encode(sample).ids
  if b"".join(tokens[i] for i in ids) != sample.encode("utf-8"):
    raise AssertionError("the BPE tokens' bytes do not spell the text they encode")
  return structured.Vocabulary(tokens, [tokenizer.token_to_id(BPE_EOS)]), tokenizer


def structured_decode_row(model, *, batch: int, runs: int = RUNS,
                          max_new_tokens: int = STRUCTURED_NEW_TOKENS,
                          schema: Mapping = STRUCTURED_SCHEMA, pattern: str = STRUCTURED_REGEX,
                          constraints: Sequence[str] = ("json", "regex"), seed: int = 0) -> dict:
  """Constrained over unconstrained `jaxdecode.decode` tokens/s on one prefill.

  Three functions run round-robin, each one full `decode` call with top-p 0.9 and no EOS (every
  row runs all `max_new_tokens` steps): without a constraint ("plain"), with the JSON schema's
  constraint and with the regex's, built for the model's byte vocabulary
  (`ByteTokenizer().vocabulary()`). Each of the three is its own compiled program.

  Args:
    model: a `jaxdecode.models.Transformer` over the byte vocabulary (259 tokens).
    batch: B (the prompts are `spec_prompts("fresh", B)`).
    runs: timed runs.
    max_new_tokens: N.
    schema, pattern: the JSON schema and the regex.
    constraints: which of "json" and "regex" to time against "plain".
    seed: seed of the sampling key.

  Returns:
    A dict with `batch`, `max_new_tokens`, `runs`, `vocab`, `median_s` (plain, json, regex),
    `tokens_per_s` (the same), `table_shape` (json, regex: the padded `[S, C]` of each
    constraint), `table_bytes` (json, regex) and `ratio`: `json_vs_plain` and `regex_vs_plain`
    (constrained tokens/s over unconstrained tokens/s; 1.00 = a constraint costs nothing).
  """
  from jaxdecode.models import ByteTokenizer  # pylint: disable=import-outside-toplevel
  tok = ByteTokenizer()
  constraints = _byte_constraints(tok.vocabulary(), schema, pattern, constraints)
  ready = prefilled(model, [tok.encode(p) for p in spec_prompts("fresh", batch)],
                    max_new_tokens, pad_id=tok.PAD)
  step_fn = _bench_step_fn(ready["graphdef"])
  key = jax.random.key(seed)
  params = SamplingParams(top_p=TOP_P)

  def run(constraint=None):
    # A constrained row may only end with its vocabulary's EOS (refused otherwise); both
    # languages are longer than the window, so no constrained row reaches it.
    return jaxdecode.decode(step_fn, ready["state"], ready["logits"], key=key, params=params,
                            max_new_tokens=max_new_tokens, positions=ready["lengths"],
                            pad_id=tok.PAD, eos_ids=[tok.EOS] if constraint is not None else (),
                            constraint=constraint).tokens

  medians = _medians(time_round_robin({
      "plain": run, **{name: (lambda c=c: run(c)) for name, c in constraints.items()}}, runs))
  new_tokens = batch * max_new_tokens
  return {
      "kind": "decode", "batch": batch, "max_new_tokens": max_new_tokens, "runs": runs,
      "vocab": model.config.vocab_size, "median_s": medians,
      "tokens_per_s": {name: new_tokens / t for name, t in medians.items()},
      "table_shape": {name: list(c.next_state.shape) for name, c in constraints.items()},
      "table_bytes": {name: c.nbytes() for name, c in constraints.items()},
      "ratio": {f"{name}_vs_plain": medians["plain"] / medians[name] for name in constraints},
  }


def _byte_constraints(vocabulary, schema: Mapping, pattern: str, names: Sequence[str]) -> dict:
  """name -> the constraint of "json" (`schema`) or "regex" (`pattern`) over `vocabulary`."""
  from jaxdecode import structured  # pylint: disable=import-outside-toplevel
  build = {"json": lambda: structured.json_schema(dict(schema), vocabulary),
           "regex": lambda: structured.regex(pattern, vocabulary)}
  return {name: build[name]() for name in names}


# The compile rows beyond the decode table's two constraints: the cases of issue 37 (a long
# wildcard, and a JSON string whose outlines-core automaton was exponential in maxLength).
STRUCTURED_EXTRA_COMPILES = {"any300": ".{0,300}", "maxlen1000": {"type": "string",
                                                                  "maxLength": 1000}}


def structured_compile_row(vocabulary, name: str, spec, *, vocab_seconds: float | None = None,
                           outlines_index: bool = True) -> dict:
  """The time and peak host memory to compile one constraint for `vocabulary` (from scratch:
  jaxdecode's cache of compiled constraints is cleared first) and the size of its tables.

  With `outlines_index`, also timed: outlines-core's own token `Index` of the same regex over the
  same tokens (what jaxdecode built its tables from before it walked the tokens itself).

  Args:
    vocabulary: a `jaxdecode.structured.Vocabulary` (e.g. from `bpe_vocabulary`).
    name: a name for the row; `spec` is a JSON schema when it is a dict, else a pattern.
    spec: the schema or the pattern.
    vocab_seconds: how long building `vocabulary` took (recorded as is).
    outlines_index: whether to time outlines-core's token index too (skip it where it blows
      up: a long maxLength).

  Returns:
    A dict with `kind` "compile", `constraint` (name), `vocab`, `compile_s`, `peak_mb` (the
    peak of the memory traced by `tracemalloc` during the compile: numpy's arrays included,
    outlines-core's worker process not), `index_s` (None without `outlines_index`), `vocab_s`,
    `regex_chars` (the regex's length), `table_shape` (the padded `[S, C]` of `next_state`) and
    `table_bytes` (`constraint.nbytes()`).
  """
  # pylint: disable=import-outside-toplevel
  import tracemalloc
  from outlines_core import Index, Vocabulary as OutlinesVocabulary
  from outlines_core.json_schema import build_regex_from_schema
  from jaxdecode import structured
  # pylint: enable=import-outside-toplevel
  is_schema = isinstance(spec, Mapping)
  pattern = build_regex_from_schema(json.dumps(spec)) if is_schema else spec
  for cached in (getattr(structured, "_compile_schema", None),
                 getattr(structured, "_compile_regex", None)):
    if hasattr(cached, "cache_clear"):
      cached.cache_clear()  # measure a compile, not a cache hit
  build = structured.json_schema if is_schema else structured.regex
  tracemalloc.start()
  try:
    start = time.perf_counter()
    constraint = jax.block_until_ready(build(spec, vocabulary))
    compile_s = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  index_s = None
  if outlines_index:
    groups: dict[bytes, list[int]] = {}
    for i, token in enumerate(vocabulary.tokens):
      if token is not None and i not in vocabulary.eos_ids:
        groups.setdefault(token, []).append(i)
    start = time.perf_counter()
    Index(pattern, OutlinesVocabulary(vocabulary.eos_ids[0], groups))
    index_s = time.perf_counter() - start
  return {"kind": "compile", "constraint": name, "vocab": len(vocabulary),
          "compile_s": compile_s, "peak_mb": peak / 2**20, "index_s": index_s,
          "vocab_s": vocab_seconds, "regex_chars": len(pattern),
          "table_shape": list(constraint.next_state.shape), "table_bytes": constraint.nbytes()}


def structured_table(*, batches: Sequence[int] = STRUCTURED_BATCHES, runs: int = RUNS,
                     max_new_tokens: int = STRUCTURED_NEW_TOKENS,
                     vocab_size: int | None = STRUCTURED_VOCAB,
                     model_loader: Callable[[], Any] | None = None,
                     vocab_texts: Sequence[str] | None = None,
                     constraints: Sequence[str] = ("json", "regex"),
                     extra_compiles: Sequence[str] = tuple(STRUCTURED_EXTRA_COMPILES),
                     progress: Callable[[str], None] | None = None) -> list[dict]:
  """`structured_decode_row` for each batch size on the embedded model (or `model_loader()`),
  then `structured_compile_row` for the JSON schema and the regex over a `vocab_size`-token
  ByteLevel BPE vocabulary (`bpe_vocabulary(vocab_size, vocab_texts)`; None: no compile rows).
  `constraints`: which of "json" and "regex" (both by default); `extra_compiles`: which of
  `STRUCTURED_EXTRA_COMPILES` to compile too. A part that cannot run is a row
  `{"kind", "skipped"}` (no model; `tokenizers` missing)."""
  rows = []
  try:
    model = (model_loader or _default_model)()
  except Exception as e:  # pylint: disable=broad-except  # no model: the compile rows only
    rows.append({"kind": "decode", "batch": "-", "skipped": f"{type(e).__name__}: {e}"})
    model = None
  for batch in batches if model is not None else ():
    started = time.perf_counter()
    rows.append(structured_decode_row(model, batch=batch, runs=runs,
                                      max_new_tokens=max_new_tokens, constraints=constraints))
    if progress:
      progress(f"structured decode B={batch}: {time.perf_counter() - started:.0f} s")
  if vocab_size is None:
    return rows
  started = time.perf_counter()
  try:
    vocabulary, _ = bpe_vocabulary(vocab_size, vocab_texts)
  except ImportError as e:
    rows.append({"kind": "compile", "constraint": "json, regex",
                 "skipped": f"the BPE vocabulary needs the tokenizers package (pip install "
                            f"tokenizers): {e}"})
    return rows
  vocab_s = time.perf_counter() - started
  specs = {"json": STRUCTURED_SCHEMA, "regex": STRUCTURED_REGEX}
  for name in [*constraints, *extra_compiles]:
    spec = specs.get(name, STRUCTURED_EXTRA_COMPILES.get(name))
    started = time.perf_counter()
    rows.append(structured_compile_row(vocabulary, name, spec, vocab_seconds=vocab_s,
                                       outlines_index=name in specs))
    if progress:
      progress(f"structured compile {name} V={len(vocabulary)}: "
               f"{time.perf_counter() - started:.0f} s")
  return rows



def _index_s(value: float | None) -> str:
  return "-" if value is None else f"{value:.2f}"


def _decode_table(rows: Sequence[Mapping], settings: Mapping) -> list[str]:
  new = settings.get("structured_new_tokens", STRUCTURED_NEW_TOKENS)
  return _table.table(
      [f"Structured: jaxdecode.decode with constraint= vs without, embedded model, top-p 0.9, "
       f"{new} new tokens, no EOS"],
      [field("B", 3, "batch"), field("plain ms", 8, "median_s", "plain", fmt=_table.ms),
       field("json ms", 8, "median_s", "json", fmt=_table.ms),
       field("regex ms", 8, "median_s", "regex", fmt=_table.ms),
       field("json/plain tok/s", 16, "ratio", "json_vs_plain", fmt=_table.ratio),
       field("regex/plain tok/s", 17, "ratio", "regex_vs_plain", fmt=_table.ratio),
       Column("json table", 10, lambda row: row["table_shape"].get("json", ["-"]), _table.shape)],
      rows,
      "json/plain, regex/plain: constrained tokens/s over unconstrained tokens/s on the same "
      "prefill (1.00 = the constraint is free; goal >= 0.95, floor 0.8). json: an object of "
      "7 typed properties (strings, integer, number, boolean, an enum, an array of strings); "
      "regex: a log line; both longer than the window, so every row runs every step. json "
      "table: the padded [states, token classes] of the byte vocabulary's constraint.",
      wrap_title=True)


def _compile_table(rows: Sequence[Mapping]) -> list[str]:
  vocab_s = rows[0].get("vocab_s")
  return _table.table(
      ["Structured compile: from scratch (cache cleared), for a ByteLevel BPE vocabulary "
       "trained with tokenizers on the embedded corpus"],
      [field("constraint", 10, "constraint", align="<"), field("V", 6, "vocab"),
       field("regex chars", 11, "regex_chars"), field("compile s", 9, "compile_s", fmt=fixed(2)),
       Column("peak MB", 7, lambda row: row.get("peak_mb", math.nan), fixed(0)),
       field("index s", 7, "index_s", fmt=_index_s),
       field("table", 11, "table_shape", fmt=_table.shape),
       field("table MB", 8, "table_bytes", fmt=fixed(2, 2**-20))],
      rows,
      "compile s: structured.json_schema / structured.regex (goal <= 5 s, floor 20 s); peak "
      "MB: the host memory traced during it (goal <= 200 MB + 10x the tables); index s: "
      "outlines-core's own token Index of the same regex, for comparison (what the tables "
      "were read from before; - where it blows up); any300: the regex .{0,300}; maxlen1000: a "
      "JSON string of maxLength 1000; table: next_state's padded [states, token classes]; "
      "table MB: constraint.nbytes() (goal <= 64 MB). The vocabulary took "
      + (f"{vocab_s:.1f} s to train." if vocab_s is not None else "- s to train."),
      wrap_title=True)


def format_tables(result: Mapping) -> list[str]:
  """The structured decode and compile tables of `run_benchmarks`'s result, as lines."""
  rows = result.get("structured") or []
  decode_rows = [row for row in rows if row.get("kind") == "decode"]
  compile_rows = [row for row in rows if row.get("kind") == "compile"]
  return ((_decode_table(decode_rows, result["settings"]) if decode_rows else []) +
          (_compile_table(compile_rows) if compile_rows else []))
