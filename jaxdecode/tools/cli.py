"""The `jaxdecode` command: generate, eval, train, audit, bench, sweep, doctor.

A user's mistake (a bad flag, value, file or output path) gets a one-line error and exit status
2, never a traceback; `generate` exits with status 3 after printing its output when a row
stopped at a dead end (nothing selectable: its text is cut short, see `Generation.dead_end`); paths are checked before any long work starts. SIGTERM and Ctrl-C stop
the command cleanly: files being written are left as they were (see `jaxdecode._files`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from typing import Callable, NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxdecode import _checks
from jaxdecode import _files
from jaxdecode import adapters
from jaxdecode import models
from jaxdecode.invariance import audit as invariance_audit
from jaxdecode.models import training
from jaxdecode.params import SamplingParams
from jaxdecode.prompts import bucket_length
from jaxdecode.tools import bench
from jaxdecode.tools import doctor
from jaxdecode.tools import sweep
from jaxdecode.tools._args import OneLineParser, integer, number, positive_int, seed


# The SamplingParams fields set by flags of their own name, and the flags' defaults (the fields'
# defaults: a flag left at its default is not passed on).
_CONTROL = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_new_tokens": 0,
            "top_n_sigma": 0.0, "xtc_threshold": 0.1, "xtc_probability": 0.0,
            "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "dry_multiplier": 0.0,
            "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
            "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
            "no_repeat_ngram_size": 0}


def _add_sampling_flags(g: argparse.ArgumentParser) -> None:
  """`generate`'s sampling flags, in --help's order; a `_CONTROL` field's default is its own."""
  def control(name, kind, metavar=None, help=None, **extra):  # pylint: disable=redefined-builtin
    g.add_argument("--" + name.replace("_", "-"), type=kind, default=_CONTROL[name],
                   metavar=metavar, help=help, **extra)

  g.add_argument("--temperature", type=number, default=None,
                 help="default 0.8 (1, the model's own distribution, with --beams)")
  g.add_argument("--top-k", type=integer, default=0)
  g.add_argument("--top-p", type=number, default=None, help="default 0.95 (1 with --beams)")
  g.add_argument("--min-p", type=number, default=0.0)
  for name in ("typical_p", "epsilon_cutoff", "eta_cutoff"):
    control(name, number)
  control("top_n_sigma", number, "N", "keep the tokens whose logit is within N standard "
          "deviations of the largest (llama.cpp's top-nσ; <= 0 off)")
  control("xtc_threshold", number, "P", "XTC: the probability from which tokens count as top "
          "choices")
  control("xtc_probability", number, "P", "XTC: how often a step excludes its top choices but "
          "the least probable (0 off)")
  control("dynatemp_range", number, "R", "dynamic temperature: from T - R (confident steps) to "
          "T + R (uncertain ones), by the step's normalized entropy (0 off)")
  control("dynatemp_exponent", number, "E", "dynamic temperature: the power of the normalized "
          "entropy")
  control("dry_multiplier", number, "M", "DRY: the penalty of a token that extends a repeat of "
          "the text (0 off)")
  control("dry_base", number, "B", "DRY: the penalty grows as B ** (repeat length - allowed "
          "length)")
  control("dry_allowed_length", integer, "N", "DRY: repeats up to N tokens are not penalized")
  control("dry_penalty_last_n", integer, "N", "DRY: look at the last N tokens of prompt and text "
          "(-1: all)")
  g.add_argument("--dry-sequence-breaker", action="append", default=None, metavar="CHAR",
                 help="DRY: a one-token text that ends a repeat (repeatable; default: "
                      "llama.cpp's newline, ':', '\"' and '*')")
  control("mirostat", integer, "{0,2}", "2: mirostat 2, which steers each step's surprise "
          "toward --mirostat-tau", choices=(0, 2))
  control("mirostat_tau", number, "TAU", "mirostat: the target surprise, in bits")
  control("mirostat_eta", number, "ETA", "mirostat: the learning rate of its state")
  control("no_repeat_ngram_size", integer, "N", "never repeat an n-gram of the prompt and new "
          "text (transformers'; 0 off)")
  g.add_argument("--bad-word", action="append", default=None, metavar="TEXT",
                 help="never produce TEXT (its tokens as one banned sequence; repeatable)")
  control("repetition_penalty", number, help="HF's rule: > 1 discourages tokens already seen")
  control("presence_penalty", number)
  control("frequency_penalty", number)
  g.add_argument("--penalize-prompt", action="store_true",
                 help="count the prompt's tokens for the penalties (default: only new tokens)")
  control("min_new_tokens", integer, help="no end of text before this many new tokens")


def _add_generate(g: argparse.ArgumentParser) -> None:
  """`jaxdecode generate`'s arguments."""
  g.add_argument("prompts", nargs="+", help="one or more prompts (batched together)")
  _add_sampling_flags(g)
  g.add_argument("--seed", type=seed, default=0)
  g.add_argument("--max-new-tokens", type=positive_int, default=160)
  g.add_argument("--greedy", action="store_true", help="temperature 0 (overrides --temperature)")
  g.add_argument("--beams", type=positive_int, default=None, metavar="K",
                 help="beam search with K beams instead of sampling (transformers' num_beams; "
                      "deterministic, --seed unused)")
  g.add_argument("--num-return", type=positive_int, default=1, metavar="R",
                 help="with --beams: print the R best beams of each prompt, with their scores")
  g.add_argument("--length-penalty", type=number, default=1.0,
                 help="with --beams: beam score = sum of log-probs / length ** this")
  g.add_argument("--model", default=None,
                 help="a checkpoint from `jaxdecode train`, or a local transformers Flax "
                      "checkpoint directory (save_pretrained: config.json, weights, tokenizer) "
                      "(default: the embedded model)")
  g.add_argument("--draft", default=None, metavar="ngram|model|PATH",
                 help="speculative decoding (the same text, fewer model calls): drafts from "
                      "prompt lookup (ngram), the embedded draft model (model) or a checkpoint "
                      "(a transformers directory for a transformers --model)")
  g.add_argument("--num-draft-tokens", type=positive_int, default=4, metavar="K",
                 help="with --draft: tokens drafted and verified per model call (1..16)")
  g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                 help="end a row at the first occurrence of TEXT in its new text (repeatable)")
  g.add_argument("--include-stop", action="store_true",
                 help="with --stop: keep the stop string in the text")
  g.add_argument("-n", type=positive_int, default=1, metavar="N",
                 help="samples per prompt (sample i uses row key fold_in(row key, i))")
  g.add_argument("--top-logprobs", type=integer, default=0, metavar="K",
                 help="print a table per step: the K (1..20) most likely tokens and their "
                      "log-probabilities")
  g.add_argument("--logprobs-mode", choices=("processed", "raw"), default="processed",
                 help="log-probabilities of the distribution sampled from (processed) or of "
                      "the model (raw)")
  g.add_argument("--prompt-logprobs", action="store_true",
                 help="also score each prompt token under the model")
  shape = g.add_mutually_exclusive_group()
  shape.add_argument("--regex", default=None, metavar="PATTERN",
                     help="structured output: the new text must match PATTERN as a whole")
  shape.add_argument("--json-schema", default=None, metavar="FILE",
                     help="structured output: the new text must be JSON valid under the schema "
                          "in FILE")
  shape.add_argument("--choice", action="append", default=None, metavar="TEXT",
                     help="structured output: the new text must be one of the --choice TEXTs "
                          "(repeatable)")
  g.add_argument("--json", action="store_true",
                 help="print one JSON object (texts, tokens, log-probs, top lists, settings)")
  g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                 help="print text as it is generated (default: on a terminal, when nothing "
                      "needs the whole output: no --json, --beams, --draft, --top-logprobs)")


def build_parser() -> argparse.ArgumentParser:
  parser = OneLineParser(prog="jaxdecode", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

  _add_generate(sub.add_parser("generate", help="continue text prompts with the embedded model"))

  e = sub.add_parser("eval", help="the model's loss on a text file, in nats and bits per byte")
  e.add_argument("file")
  e.add_argument("--model", default=None)

  t = sub.add_parser("train", help="train the small transformer with optax")
  t.add_argument("--corpus", default=None,
                 help="a UTF-8 text file or a folder of them (default: this Python's standard "
                      "library and pydoc topics; whole files are held out)")
  t.add_argument("--out", default="jaxdecode_model.msgpack",
                 help="checkpoint path (checked before training; written atomically)")
  # The defaults are the embedded model's recipe (about 1 hour on 2 CPU cores); the draft model
  # adds --d-model 128 --layers 2 --heads 2 --d-ff 512.
  t.add_argument("--steps", type=positive_int, default=800)
  t.add_argument("--batch-size", type=positive_int, default=16)
  t.add_argument("--seq-len", type=positive_int, default=512)
  t.add_argument("--lr", type=number, default=2e-3)
  t.add_argument("--warmup-steps", type=integer, default=80)
  t.add_argument("--eval-every", type=positive_int, default=100)
  t.add_argument("--seed", type=seed, default=0)
  t.add_argument("--d-model", type=positive_int, default=256)
  t.add_argument("--layers", type=positive_int, default=4)
  t.add_argument("--heads", type=positive_int, default=4)
  t.add_argument("--d-ff", type=positive_int, default=1024)
  t.add_argument("--max-len", type=positive_int, default=512)
  a = sub.add_parser("audit", help="is a prompt's output the same alone and in any batch? "
                                   "(both numerics modes, bit for bit)")
  a.add_argument("--model", default=None,
                 help="a checkpoint, or a local transformers Flax checkpoint directory (audited "
                      "left-padded; default: the embedded model)")
  a.add_argument("--mixes", type=positive_int, default=20, help="random batches per mode")
  a.add_argument("--steps", type=positive_int, default=48, help="greedy steps per run")
  a.add_argument("--max-batch", type=positive_int, default=16,
                 help="the largest batch of a mix (at least 2)")
  a.add_argument("--seed", type=seed, default=0)
  a.add_argument("--verbose", action="store_true", help="one table line per mix")
  sub.add_parser("bench", help="the benchmark suite (see `jaxdecode bench --help`)")
  sweep.add_arguments(sub.add_parser(
      "sweep", help="degeneration metrics of 13 sampling settings: a CSV table and a plot",
      description=sweep.__doc__.splitlines()[0]))
  doctor.add_arguments(sub.add_parser(
      "doctor", help="what holds on this machine: backend, the bitwise promise, sampler and "
                     "decode costs, structure; a one-line verdict last",
      description=doctor.__doc__.splitlines()[0]))
  return parser


def _train(args) -> None:
  model_config = models.TransformerConfig(d_model=args.d_model, n_layers=args.layers,
                                          n_heads=args.heads, d_ff=args.d_ff,
                                          max_len=args.max_len)
  cfg = training.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             peak_lr=args.lr, warmup_steps=args.warmup_steps,
                             eval_every=args.eval_every, seed=args.seed)
  _, summary = training.train(model_config, cfg, corpus=args.corpus, out=args.out)
  print(f"best validation loss {summary['val_loss']:.4f} nats/byte after {cfg.steps} steps "
        f"({summary['seconds'] / 60:.1f} min); saved {args.out}")


def _load_model(path):
  if path is None:
    return models.load_default()[0]
  if _is_transformers_dir(path):
    return _transformers_model(path)
  return models.load_checkpoint(path)[0]


def _is_transformers_dir(path) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _transformers_model(path: str, **options):
  """A `jaxdecode.adapters` adapter of a local transformers Flax checkpoint directory (the
  model by `FlaxAutoModelForCausalLM`, its tokenizer by `AutoTokenizer`; nothing downloaded);
  `options`: `adapters.transformers`' (batch_invariant, padding)."""
  try:
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f"--model {path} is a transformers checkpoint directory, which needs "
                     f"transformers<5 installed (pip install 'transformers<5')") from None
  try:
    with jax.numpy_rank_promotion("allow"):  # transformers' Flax code relies on it
      model = transformers.FlaxAutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError, KeyError) as e:
    raise ValueError(f"--model {path}: not a transformers Flax causal LM with its tokenizer "
                     f"({' '.join(str(e).split())[:300]})") from None
  return adapters.transformers(model, model.params, tokenizer, **options)


def _vocab_size(model) -> int:
  return model.vocab_size if isinstance(model, adapters.Adapter) else model.config.vocab_size


def _bad_words(texts, tokenizer=None) -> list | None:
  """--bad-word TEXTs -> token sequences (the model's tokenizer's, default the embedded byte
  tokenizer's; no BOS)."""
  if not texts:
    return None
  for text in texts:
    if not text:
      raise ValueError("--bad-word needs some text; got an empty one")
  tokenizer = tokenizer or models.ByteTokenizer()
  return [tokenizer.encode(text, bos=False) for text in texts]


DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's default dry_sequence_breakers


def _breakers(texts, tokenizer=None) -> list[int]:
  """--dry-sequence-breaker texts (default llama.cpp's) -> token ids, one token each."""
  ids = []
  tokenizer = tokenizer or models.ByteTokenizer()
  for text in DRY_BREAKERS if texts is None else texts:
    tokens = tokenizer.encode(text, bos=False)
    if len(tokens) != 1:
      raise ValueError(f"--dry-sequence-breaker must be one token; {text!r} is {len(tokens)}")
    ids += tokens
  return ids


def _generate(args) -> None:
  _check_generate(args)
  beams = args.beams
  model = _load_model(args.model)
  tokenizer = model.tokenizer if isinstance(model, adapters.Adapter) else None
  params, temperature, top_p, control = _sampling(args, tokenizer)
  if args.draft is None and args.num_draft_tokens != 4:
    raise ValueError("--num-draft-tokens applies to speculative decoding: add --draft")
  if args.draft is not None and beams is not None:
    raise ValueError("--draft and --beams exclude each other: speculative decoding speeds up "
                     "sampling, not beam search")
  draft = args.draft
  if draft == "model":
    draft = models.load_draft()
  elif draft not in (None, "ngram"):
    draft = _load_model(draft)  # a missing or broken file: a clear ValueError
  if beams is not None:
    _checks.beam_size_fits(beams, len(args.prompts), _vocab_size(model), name="--beams")
  options = dict(model=model, params=params, seed=args.seed, max_new_tokens=args.max_new_tokens,
                 penalize_prompt=args.penalize_prompt, stop=args.stop,
                 include_stop=args.include_stop, n=args.n, regex=args.regex,
                 json_schema=_schema_file(args.json_schema), choices=args.choice)
  extra = dict(beam_size=beams, num_return=args.num_return if beams else None,
               length_penalty=args.length_penalty, draft=draft,
               num_draft_tokens=args.num_draft_tokens, top_logprobs=args.top_logprobs,
               logprobs_mode=args.logprobs_mode, prompt_logprobs=args.prompt_logprobs)
  streaming = args.stream
  if streaming is None:
    streaming = sys.stdout.isatty()
  streaming = streaming and not (args.json or beams or args.draft or args.top_logprobs or
                                 args.prompt_logprobs or args.logprobs_mode != "processed")
  if streaming:
    out = _print_stream(args.prompts, args.n, options)
  else:
    out = models.generate(args.prompts, **options, **extra)
  if args.json:
    print(_json_report(args, out, dict(options, **extra, params=None, model=None), settings=params))
    return _report_dead_ends(args, out)
  if not streaming:
    _print_rows(args, out)
  print(_settings_line(args, out, temperature, top_p, control))
  return _report_dead_ends(args, out)


def _check_generate(args) -> None:
  """ValueError naming the flag for `generate` flags that cannot go together."""
  for i, prompt in enumerate(args.prompts):
    if not prompt.strip():
      raise ValueError(f"prompt {i + 1} is empty; give some text to continue")
  beams = args.beams
  if beams is None and (args.num_return != 1 or args.length_penalty != 1.0):
    raise ValueError("--num-return and --length-penalty apply to beam search: add --beams K")
  if beams is not None and args.greedy:
    raise ValueError("--greedy and --beams exclude each other: beam search is already "
                     "deterministic (--greedy would make every beam a point mass)")
  if args.min_new_tokens > args.max_new_tokens:
    raise ValueError(f"--min-new-tokens {args.min_new_tokens} is more than --max-new-tokens "
                     f"{args.max_new_tokens}: no row could end with EOS; use at most "
                     f"{args.max_new_tokens}")
  if beams is not None and args.num_return > beams:
    raise ValueError(f"--num-return {args.num_return} is more than --beams {beams}: the search "
                     f"keeps {beams} beams per prompt")


def _sampling(args, tokenizer=None) -> tuple:
  """`(params, temperature, top_p, control)`: the `SamplingParams` of the flags, the temperature
  and top-p they resolve to, and the `_CONTROL` fields set away from their defaults. Texts
  (--bad-word, --dry-sequence-breaker) are encoded by `tokenizer` (default: the embedded
  model's byte tokenizer)."""
  beams = args.beams
  temperature = 0.0 if args.greedy else args.temperature
  if temperature is None:
    temperature = 1.0 if beams else 0.8
  top_p = args.top_p if args.top_p is not None else 1.0 if beams else 0.95
  control = {name: getattr(args, name) for name in _CONTROL if getattr(args, name) !=
             _CONTROL[name]}
  params = SamplingParams(temperature=temperature, top_k=args.top_k, top_p=top_p,
                          min_p=args.min_p, bad_words=_bad_words(args.bad_word, tokenizer),
                          dry_sequence_breakers=_breakers(args.dry_sequence_breaker, tokenizer),
                          **control)
  return params, temperature, top_p, control


def _print_rows(args, out) -> None:
  """Each prompt's continuations (samples, or beams with their scores) as text."""
  for i, prompt in enumerate(args.prompts):
    if args.beams is None:
      for j in range(args.n):
        row = i * args.n + j
        print(f"--- [{i + 1}] {prompt!r}" + (f" sample {j + 1}/{args.n}" if args.n > 1 else ""))
        print(prompt + out.texts[row])
        if args.top_logprobs:
          print(_top_table(out, row))
    else:
      for r, (beam_text, score) in enumerate(zip(out.beams[i], out.scores[i])):
        rank = f" beam {r + 1}/{args.num_return}" if args.num_return > 1 else ""
        print(f"--- [{i + 1}] {prompt!r}{rank} score {score:.4f}")
        print(prompt + beam_text)
      if len(out.beams[i]) < args.num_return:
        print(f"--- [{i + 1}] {prompt!r}: {len(out.beams[i])} possible beam(s) of "
              f"{args.num_return} (the settings leave fewer possible continuations)")
    if args.prompt_logprobs:
      lp = out.prompt_logprobs[i]
      print(f"    prompt log-probability {float(lp.sum()):.4f} over {lp.size} tokens")


def _settings_line(args, out, temperature, top_p, control) -> str:
  """The last line: the settings that differ from the defaults, and the speed."""
  beams = args.beams
  if beams is None:
    settings = ("greedy" if args.greedy else
                f"temperature={temperature:g} top_k={args.top_k} top_p={top_p:g} "
                f"min_p={args.min_p:g}")
  else:
    settings = f"beams={beams} num_return={args.num_return} length_penalty={args.length_penalty:g}"
    settings += "".join(f" {name}={value:g}" for name, value, off in (
        ("temperature", temperature, 1.0), ("top_k", args.top_k, 0), ("top_p", top_p, 1.0),
        ("min_p", args.min_p, 0.0)) if value != off)
  settings += "".join(f" {k}={v:g}" for k, v in control.items()) + (
      " penalize_prompt" if args.penalize_prompt else "")
  settings += f" bad_words={args.bad_word!r}" if args.bad_word else ""
  settings += (f" n={args.n}" if args.n > 1 else "") + (
      f" stop={args.stop!r}" if args.stop else "")
  if args.draft is not None:
    settings += (f" draft={args.draft} K={args.num_draft_tokens} (acceptance "
                 f"{out.acceptance_rate:.0%}, {out.calls} model calls)")
  return (f"--- {settings}{'' if beams else f' seed={args.seed}'} | {len(args.prompts)} "
          f"prompt(s), {int(out.lengths.sum())} new tokens in {out.seconds:.2f} s "
          f"({out.tokens_per_second:.0f} tokens/s, compilation included)")


DEAD_END = 3  # generate's exit status when a row stopped at a dead end


def _report_dead_ends(args, out) -> int:
  """A note on stderr and exit status 3 when a row (a prompt with --beams) stopped at a step
  with nothing selectable; 0 otherwise."""
  dead = np.flatnonzero(np.asarray(out.dead_end).reshape(-1))
  if not dead.size:
    return 0
  per = 1 if args.beams is not None else args.n
  names = ", ".join(f"prompt {r // per + 1}" + (f" sample {r % per + 1}" if per > 1 else "")
                    for r in dead.tolist()[:10]) + (" ..." if dead.size > 10 else "")
  print(f"jaxdecode generate: {dead.size} row(s) stopped at a dead end ({names}): a step left "
        f"nothing to select (e.g. a constraint that allows only EOS before --min-new-tokens); "
        f"their text is cut short and not finished", file=sys.stderr)
  return DEAD_END


def _print_stream(prompts, n: int, options: dict):
  """Prints the rows one after the other as `models.stream` produces them (later rows are
  buffered until the rows before them are done); returns a summary like a `Generation`."""
  started = time.perf_counter()
  rows = len(prompts) * n
  buffered, texts = [[] for _ in range(rows)], [""] * rows
  current, chunk = 0, None

  def header(row):
    b, j = divmod(row, n)
    print(f"--- [{b + 1}] {prompts[b]!r}" + (f" sample {j + 1}/{n}" if n > 1 else ""))
    sys.stdout.write(prompts[b])

  header(0)
  for chunk in models.stream(prompts, **options):
    for r, piece in enumerate(chunk.texts):
      buffered[r].append(piece)
      texts[r] += piece
    while current < rows:
      sys.stdout.write("".join(buffered[current]))
      buffered[current] = []
      if not chunk.done[current]:
        break
      sys.stdout.write("\n")
      current += 1
      if current < rows:
        header(current)
    sys.stdout.flush()
  return models.Generation(texts, None, None, chunk.lengths, chunk.finished,
                           time.perf_counter() - started, chunk.dead_end)


def _token_text(token: int) -> str:
  """A token for a table: the byte as a Python literal, or <BOS>/<EOS>/<PAD>."""
  tok = models.ByteTokenizer
  names = {tok.BOS: "<BOS>", tok.EOS: "<EOS>", tok.PAD: "<PAD>"}
  return names.get(token) or repr(bytes([token]))[2:-1] or "''"


def _top_table(out, row: int) -> str:
  """The readable table of `--top-logprobs`: one line per step of a row."""
  lines = [f"    {'step':>4}  {'token':<8} {'logprob':>8}   top {out.top_tokens.shape[-1]}"]
  for t in range(int(out.lengths[row])):
    tops = "  ".join(f"{_token_text(int(k))!s:<6}{float(v):8.3f}"
                     for k, v in zip(out.top_tokens[row, t], out.top_logprobs[row, t]))
    lines.append(f"    {t:>4}  {_token_text(int(out.tokens[row, t])):<8} "
                 f"{float(out.logprobs[row, t]):8.3f}   {tops}")
  return "\n".join(lines)


def _finite(values) -> list:
  """Floats for JSON: -inf (a removed token) and NaN become None."""
  return [float(v) if np.isfinite(v) else None for v in np.asarray(values).ravel()]


def _schema_file(path: str | None):
  """The JSON schema in `path` (a dict), or None; a missing or malformed file: ValueError."""
  if path is None:
    return None
  text = _files.read_input(path, "JSON schema file")
  try:
    return json.loads(text)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"--json-schema {path!r} is not valid JSON: {e}") from None


def _json_report(args, out, options: dict, settings: SamplingParams) -> str:
  """`--json`: one object with the settings and, per row, text, tokens, log-probs, lists."""
  rows = []
  for r, text in enumerate(out.texts):
    length = int(out.lengths[r])
    row = dict(prompt=r // args.n, sample=r % args.n, text=text,
               tokens=out.tokens[r, :length].tolist(), logprobs=_finite(out.logprobs[r, :length]),
               finished=bool(out.finished[r]), dead_end=bool(out.dead_end[r]))
    if out.top_tokens is not None:
      row["top"] = [dict(tokens=out.top_tokens[r, t].tolist(),
                         logprobs=_finite(out.top_logprobs[r, t])) for t in range(length)]
    rows.append(row)
  result = dict(prompts=list(args.prompts), rows=rows, seconds=out.seconds,
                settings=dict({k: v for k, v in options.items() if v is not None and
                               not hasattr(v, "config") and not isinstance(v, adapters.Adapter)},
                              seed=args.seed, greedy=args.greedy,
                              temperature=float(np.asarray(settings.temperature)),
                              top_k=int(np.asarray(settings.top_k)),
                              top_p=float(np.asarray(settings.top_p)),
                              min_p=float(np.asarray(settings.min_p))))
  if out.prompt_logprobs is not None:
    result["prompt_logprobs"] = [_finite(lp) for lp in out.prompt_logprobs]
  if out.beams is not None:
    # Only the beams that exist: a prompt with fewer possible continuations has fewer.
    result["beams"] = out.beams
    result["scores"] = [row[:len(b)].tolist() for row, b in zip(out.scores, out.beams)]
  return json.dumps(result, ensure_ascii=False, allow_nan=False)


def _eval(args) -> None:
  data = np.frombuffer(_files.read_input(args.file, "text file"), np.uint8).astype(np.int32)
  if data.size == 0:
    raise ValueError(f"{args.file!r} is empty; nothing to evaluate")
  model = models.load_checkpoint(args.model)[0] if args.model else models.load_default()[0]
  graphdef, weights = nnx.split(model)
  nats = training.evaluate(graphdef, weights, data, model.config.max_len)
  print(f"{nats:.4f} nats/byte ({nats / math.log(2):.4f} bits/byte) over {data.size} bytes")


def audit_prompts(count: int, seed: int) -> list:
  """Byte prompts of 3..120 bytes cut from the pydoc topics (the audit's needles/partners)."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel
  text = " ".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
  rng = np.random.default_rng(seed)
  prompts = []
  for _ in range(count):
    n = int(rng.integers(3, 121))
    start = int(rng.integers(0, len(text) - n))
    prompts.append([models.ByteTokenizer.BOS] + list(text[start:start + n]))
  return prompts


class _AuditSubject(NamedTuple):
  """The model `jaxdecode audit --model` names, in one numerics mode."""
  prefill: Callable  # `jaxdecode.audit`'s prefill of token lists
  step_fn: Callable
  context: int  # positions the model holds
  encode: Callable  # an audit prompt (BOS + bytes) -> the model's token ids
  padded: Callable  # the widest prompt's length -> the width its batch is padded to


def _audit_subject(path, invariant: bool, steps: int) -> _AuditSubject:
  """The embedded model or a `jaxdecode train` checkpoint (right-padded, bucketed widths), or a
  transformers checkpoint directory (its adapter, left-padded as transformers' own `generate`
  pads a batch, exact widths)."""
  if path is not None and _is_transformers_dir(path):
    adapter = _transformers_model(path, batch_invariant=invariant, padding="left")
    encode = lambda p: adapter.tokenizer.encode(bytes(p[1:]).decode("utf-8", "replace"))
    return _AuditSubject(adapter.batch_prefill(steps), adapter.step_fn, adapter.max_positions,
                         encode, lambda width: width)
  model = (models.load_default(batch_invariant=invariant) if path is None else
           models.load_checkpoint(path, batch_invariant=invariant))[0]
  return _AuditSubject(models.batch_prefill(model, extra=steps),
                       models.make_step_fn(nnx.graphdef(model)), model.config.max_len, list,
                       bucket_length)


def _audit(args) -> None:
  if args.max_batch < 2:
    raise ValueError(f"--max-batch must be at least 2 (a needle and a partner); got "
                     f"{args.max_batch}")
  if args.model is not None and not _is_transformers_dir(args.model):
    _files.read_input(args.model, "checkpoint")
  # Everything that can be refused is checked before the header, so that an error is one line.
  first = _audit_subject(args.model, True, args.steps)
  context = first.context
  prompts = [first.encode(p) for p in audit_prompts(max(8, args.max_batch), args.seed)]
  width = first.padded(max(len(p) for p in prompts))  # the widest batch, padded
  if width + args.steps > context:
    hint = (f"use --steps {context - width} or fewer" if context > width else
            "use a model with a longer context")
    raise ValueError(f"--steps {args.steps} does not fit: the audit's prompts take up to "
                     f"{width} tokens (padded) of the model's context of {context}; {hint}")
  print(f"jaxdecode audit: {args.mixes} random mixes per mode (batches of 2..{args.max_batch}, "
        f"random slots and partners), {args.steps} greedy steps, on {jax.default_backend()}")
  summary = []
  for invariant in (True, False):
    subject = first if invariant else _audit_subject(args.model, False, args.steps)
    report = invariance_audit(subject.prefill, subject.step_fn, prompts, steps=args.steps,
                              mixes=args.mixes, max_batch=args.max_batch, seed=args.seed)
    name = "batch-invariant" if invariant else "plain XLA"
    if args.verbose:
      print(report.format_table(f"--- {name}"))
    worst = max(m.max_abs_diff for m in report.mixes)
    summary.append((name, report.divergent, report.flipped, worst))
  print(f"{'numerics':<16} {'mixes':>5} {'logits differ':>13} {'tokens flip':>11} "
        f"{'max |diff|':>10}")
  for name, divergent, flipped, worst in summary:
    print(f"{name:<16} {args.mixes:>5} {divergent:>13} {flipped:>11} {worst:>10.3g}")
  if summary[0][1]:
    print("the batch-invariant mode diverged on this machine: its promise does not hold here; "
          "please report it with this table")


COMMANDS = {"generate": _generate, "eval": _eval, "train": _train, "audit": _audit,
            "sweep": sweep.run_command, "doctor": doctor.run_command}


def _enable_compilation_cache() -> None:
  """With `$JAXDECODE_CACHE_DIR` set, keeps compiled programs on disk there, so that a second
  `jaxdecode generate` skips most compiling.

  Off by default: with jax 0.10.2 on CPU, writing an executable to the persistent cache once
  crashed a test process (a segmentation fault inside `put_executable_and_time`), and a crash is
  worse than a slower start. That was before the tests bounded their memory mappings, the likely
  cause; the test suite now runs with a persistent cache of its own.
  """
  path = os.environ.get("JAXDECODE_CACHE_DIR", "")
  if not path:
    return
  try:
    _files.check_output_dir(path, "compilation cache folder")
  except ValueError:
    return  # an unwritable folder: run without the cache
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _raise_system_exit(signum, frame):
  del frame
  raise SystemExit(128 + signum)


def main(argv=None) -> int:
  """Runs the command; returns its exit status (2 for a user's mistake, in one line)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["bench"]:  # the suite parses its own flags (argparse cannot pass them through)
    return bench.main(argv[1:], prog="jaxdecode bench")
  try:
    args = build_parser().parse_args(argv)
  except SystemExit as e:  # --help (0) or a bad command line (2, already reported in one line)
    return int(e.code or 0)
  _enable_compilation_cache()
  # SIGTERM unwinds like Ctrl-C, so that half-written temporary files are removed.
  previous = signal.signal(signal.SIGTERM, _raise_system_exit)
  try:
    return COMMANDS[args.command](args) or 0
  except (ValueError, OSError, OverflowError) as e:
    message = str(e) or type(e).__name__
    print(f"jaxdecode {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"jaxdecode {args.command}: interrupted", file=sys.stderr)
    return 130
  finally:
    signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
  sys.exit(main())
