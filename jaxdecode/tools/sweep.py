"""The sampling sweep: degeneration metrics for a grid of settings, as a CSV and a plot.

Run it as `jaxdecode sweep [--quick] --out DIR` (or `python -m jaxdecode.tools.sweep`). It continues a
few English / Python-doc prompts with the embedded model (`jaxdecode.models.load_default()`) under
every setting of `GRID`:

  greedy; temperature 0.5, 0.7, 1.0, 1.3; top-k 5, 20, 100; top-p 0.5, 0.8, 0.95; min-p 0.05, 0.1;
  top-nσ 1 (at T = 1 and 1.3); XTC threshold 0.1, probability 0.5 (alone and after min-p 0.05);
  DRY multiplier 0.8 (base 1.75, allowed length 2, llama.cpp's breakers; alone and after min-p
  0.05); mirostat 2 with τ = 3 and 5 (η = 0.1); dynamic temperature 1 ± 0.5

(all at temperature 1 unless named), and measures each setting with `jaxdecode.metrics`:
distinct-1..4 and the repetition of its sequences, the mean per-token log-likelihood of the text
under the raw model, and the mean entropy of the processed distribution it sampled from (for
DRY, XTC and mirostat, `metrics.step_entropies` replays each step with the row's history, key
and mu, so it is the distribution the decode drew from).

One decode does it all: the batch holds every (setting, prompt) pair, with the setting's values
as per-row `SamplingParams` (traced data, so one compiled program serves the whole grid). Prompt
i gets the same key under every setting (`fold_in(key(seed), i)`), so the settings differ only
by their parameters, never by their random numbers; and since a row depends only on its key,
prompt and params, each row is exactly what `generate([prompt], params=setting, key=that key)`
gives alone. The raw model logits at every generated step come from one teacher-forced forward
pass over prompt + generated text (`jaxdecode.models.teacher_forced_logits`).

Outputs in the `out` folder:

- `sweep.csv`: one row per setting, one column per metric (`COLUMNS`);
- `sweep.png`: diversity (distinct-3) against model log-likelihood, and repetition against
  log-likelihood, each point labelled by its setting;
- `samples.txt`: every setting's continuation of every prompt, to read.

Duration on 2 shared CPU cores: the default grid (8 prompts x 22 settings = 176 rows of 160 new
tokens) about 3 minutes (measured 168 s on a loaded machine, 74 s of it the decode); `--quick` (3
prompts x 24 new tokens) about a minute, mostly compiling.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import os
import sys
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdecode import _checks
from jaxdecode import _files
from jaxdecode import metrics
from jaxdecode.models import ByteTokenizer, generate, load_default, teacher_forced_logits
from jaxdecode.params import SamplingParams
from jaxdecode.prompts import right_pad
from jaxdecode.tools._args import OneLineParser, non_negative_int


@dataclasses.dataclass(frozen=True)
class Setting:
  """One point of the grid: a name, its family (for the plot's colours) and its values.

  `others` holds any other `SamplingParams` fields as (name, value) pairs, e.g.
  `(("dry_multiplier", 0.8),)`; fields a setting does not name keep their defaults.
  """
  name: str
  family: str
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  others: tuple = ()


GRID = (
    Setting("greedy", "greedy", temperature=0.0),
    *(Setting(f"T={t:g}", "temperature", temperature=t) for t in (0.5, 0.7, 1.0, 1.3)),
    *(Setting(f"top-k {k}", "top-k", top_k=k) for k in (5, 20, 100)),
    *(Setting(f"top-p {p:g}", "top-p", top_p=p) for p in (0.5, 0.8, 0.95)),
    *(Setting(f"min-p {m:g}", "min-p", min_p=m) for m in (0.05, 0.1)),
    # The samplers beyond transformers (llama.cpp's names and defaults), at temperature 1.
    Setting("top-nσ 1", "top-nσ", others=(("top_n_sigma", 1.0),)),
    Setting("top-nσ 1 T=1.3", "top-nσ", temperature=1.3, others=(("top_n_sigma", 1.0),)),
    Setting("XTC 0.1/0.5", "XTC", others=(("xtc_threshold", 0.1), ("xtc_probability", 0.5))),
    Setting("min-p 0.05 + XTC", "XTC", min_p=0.05,
            others=(("xtc_threshold", 0.1), ("xtc_probability", 0.5))),
    Setting("DRY 0.8", "DRY", others=(("dry_multiplier", 0.8),)),
    Setting("min-p 0.05 + DRY", "DRY", min_p=0.05, others=(("dry_multiplier", 0.8),)),
    *(Setting(f"mirostat τ={tau:g}", "mirostat", others=(("mirostat", 2), ("mirostat_tau", tau)))
      for tau in (3.0, 5.0)),
    Setting("dynatemp 0.5", "dynatemp", others=(("dynatemp_range", 0.5),)),
)
# DRY's sequence breakers, llama.cpp's defaults ("\n", ":", '"', "*"), as the byte tokenizer's ids.
DRY_BREAKERS = ("\n", ":", "\"", "*")

PROMPTS = (
    "The for statement",
    "A list comprehension",
    "def __init__(self",
    "The with statement is used to",
    "Exceptions can be raised",
    "A dictionary maps",
    "for i in range(10):",
    "The import system",
)
MAX_NEW_TOKENS = 160
QUICK_PROMPTS = PROMPTS[:3]
QUICK_MAX_NEW_TOKENS = 24

REPETITION_N = 8  # bytes: an 8-gram is a word or two, so a repeated one is a repeated phrase

COLUMNS = (
    "setting", "temperature", "top_k", "top_p", "min_p", "others",
    "sequences", "tokens", "eos_rate",
    "distinct_1", "distinct_2", "distinct_3", "distinct_4",
    f"repetition_{REPETITION_N}", "longest_repeat",
    "log_likelihood", "entropy",
)
COLUMN_NOTES = {
    "others": "the setting's other SamplingParams fields, name=value separated by spaces",
    "sequences": "sequences generated (one per prompt)",
    "tokens": "new tokens in all, each row up to and including its EOS",
    "eos_rate": "share of the sequences that ended with EOS",
    "distinct_n": "distinct n-grams / n-grams, pooled over the setting's sequences",
    f"repetition_{REPETITION_N}": f"share of {REPETITION_N}-grams already seen earlier in the "
                                  f"same sequence, pooled",
    "longest_repeat": "longest token span occurring twice in a sequence (overlaps allowed), "
                      "mean over the sequences",
    "log_likelihood": "mean per-token log-likelihood (nats) under the raw model",
    "entropy": "mean entropy (nats) of the processed distribution per step",
}

_FAMILY_COLOURS = {"greedy": "black", "temperature": "tab:red", "top-k": "tab:blue",
                   "top-p": "tab:green", "min-p": "tab:purple", "top-nσ": "tab:pink",
                   "XTC": "tab:brown", "DRY": "tab:orange", "mirostat": "tab:olive",
                   "dynatemp": "tab:cyan"}


def grid_params(grid: Sequence[Setting], prompts_per_setting: int) -> SamplingParams:
  """Per-row `SamplingParams` for the batch `[setting 0 x prompts, setting 1 x prompts, ...]`.

  Every field a setting names in `others` gets a column (its default in the other settings);
  with DRY in the grid, every row gets llama.cpp's sequence breakers (`DRY_BREAKERS`), which
  change nothing where DRY is off.

  Args:
    grid: the settings.
    prompts_per_setting: P, the rows of each setting.

  Returns:
    `SamplingParams` whose fields have shape `[len(grid) * P]`.

  Examples:
    >>> p = grid_params(GRID[:2], 2)
    >>> p.temperature.tolist(), p.top_k.tolist()
    ([0.0, 0.0, 0.5, 0.5], [0, 0, 0, 0])
  """
  defaults = SamplingParams()

  def column(values, dtype):
    return np.repeat(np.array(values, dtype), prompts_per_setting)

  fields = {f: column([getattr(s, f) for s in grid], t) for f, t in
            (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
             ("min_p", np.float32))}
  for name in dict.fromkeys(name for s in grid for name, _ in s.others):
    default = np.asarray(getattr(defaults, name))
    fields[name] = column([dict(s.others).get(name, default.item()) for s in grid],
                          default.dtype)
  if "dry_multiplier" in fields:
    breakers = [ByteTokenizer().encode(c, bos=False)[0] for c in DRY_BREAKERS]
    fields["dry_sequence_breakers"] = [breakers] * (len(grid) * prompts_per_setting)
  return SamplingParams(**fields)


def prompt_keys(seed: int, count: int) -> jax.Array:
  """The key of prompt i, the same under every setting: `fold_in(key(seed), i)`. `[count]`."""
  base = jax.random.key(seed)
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(count, dtype=jnp.uint32))


def setting_metrics(tokens: np.ndarray, lengths: np.ndarray, log_likelihoods: np.ndarray,
                    entropies: np.ndarray, finished: np.ndarray) -> dict:
  """The metric columns of one setting from its rows.

  Args:
    tokens: int `[P, N]` the setting's generated tokens.
    lengths: int `[P]` new tokens per row (including EOS).
    log_likelihoods: `[P, N]` `metrics.token_log_likelihoods` of the rows.
    entropies: `[P, N]` `metrics.step_entropies` of the rows.
    finished: bool `[P]` whether each row ended with EOS.

  Returns:
    A dict with the metric columns of `COLUMNS` (everything after `min_p`).
  """
  row = {"sequences": int(len(lengths)), "tokens": int(np.sum(lengths)),
         "eos_rate": float(np.mean(finished))}
  for n in range(1, metrics.MAX_N + 1):
    row[f"distinct_{n}"] = metrics.distinct_n(tokens, lengths, n)
  row[f"repetition_{REPETITION_N}"] = metrics.repetition_rate(tokens, lengths, REPETITION_N)
  row["longest_repeat"] = float(np.mean(metrics.longest_repeated_span(tokens, lengths)))
  row["log_likelihood"] = metrics.masked_mean(log_likelihoods, lengths)
  row["entropy"] = metrics.masked_mean(entropies, lengths)
  return row


def run_sweep(out_dir, *, quick: bool = False, seed: int = 0, prompts: Sequence[str] | None = None,
              max_new_tokens: int | None = None, grid: Sequence[Setting] = GRID, model=None,
              progress: Callable[[str], None] | None = None) -> dict:
  """Generates with every setting of `grid`, measures each, writes the CSV, PNG and samples.

  Args:
    out_dir: the folder for `sweep.csv`, `sweep.png` and `samples.txt` (created if missing).
    quick: fewer prompts and tokens (`QUICK_PROMPTS`, `QUICK_MAX_NEW_TOKENS`), for tests.
    seed: prompt i uses the key `fold_in(jax.random.key(seed), i)` under every setting.
    prompts: the prompts (default `PROMPTS`, or `QUICK_PROMPTS` with `quick`).
    max_new_tokens: new tokens per row (default `MAX_NEW_TOKENS`, or `QUICK_MAX_NEW_TOKENS`).
    grid: the settings (default `GRID`).
    model: a `jaxdecode.models.Transformer` (default: the embedded model).
    progress: called with a line of text at each stage (e.g. `print`).

  Returns:
    A dict with `rows` (one dict per setting, keyed by `COLUMNS`), `csv`, `png` and `samples`
    (the paths written), `grid`, `prompts`, `max_new_tokens`, `seed`, `seconds` (wall time),
    `texts` (`texts[s][i]`: setting s, prompt i) and per-row arrays of shape `[S, P, ...]`:
    `tokens`, `lengths`, `finished`, `logprobs` (under the processed distribution, from the
    decode), `log_likelihoods` (under the raw model) and `entropies`.

  Raises:
    ValueError: for a bad folder, prompt, seed or `max_new_tokens`, before anything compiles.
  """
  started = time.perf_counter()
  say = progress or (lambda line: None)
  seed = _checks.integer("seed", seed, low=0, high=_checks.MAX_SEED)
  prompts = _checks.text_prompts((QUICK_PROMPTS if quick else PROMPTS) if prompts is None
                                 else prompts)
  if max_new_tokens is None:
    max_new_tokens = QUICK_MAX_NEW_TOKENS if quick else MAX_NEW_TOKENS
  grid = _checked_grid(grid)
  params = grid_params(grid, len(prompts))  # validates every value
  out_dir = _files.check_output_dir(out_dir, "sweep output folder")
  if model is None:
    model, _ = load_default()
  tok = ByteTokenizer()
  n_settings, n_prompts = len(grid), len(prompts)

  say(f"generating {n_settings} settings x {n_prompts} prompts = {n_settings * n_prompts} rows "
      f"of up to {max_new_tokens} tokens, in one decode")
  keys = jnp.tile(prompt_keys(seed, n_prompts), n_settings)  # [S * P]: the same key per prompt
  gen = generate(list(prompts) * n_settings, model=model, params=params, key=keys,
                 max_new_tokens=max_new_tokens, tokenizer=tok)
  say(f"generated {int(gen.lengths.sum())} tokens in {gen.seconds:.1f} s; scoring them under "
      f"the model (teacher forcing)")
  arrays = _scored(model, gen, [tok.encode(p) for p in prompts] * n_settings, params, keys,
                   pad_id=tok.PAD, shape=(n_settings, n_prompts))
  rows = [_row(setting, {k: v[s] for k, v in arrays.items()}) for s, setting in enumerate(grid)]
  texts = [gen.texts[s * n_prompts:(s + 1) * n_prompts] for s in range(n_settings)]

  paths = _write_outputs(out_dir, rows, grid, prompts, texts, title=(
      f"{n_prompts} prompts x {max_new_tokens} new tokens, seed {seed}, the same keys for every "
      f"setting"), say=say)
  seconds = time.perf_counter() - started
  say(f"wrote {', '.join(p for p in paths if p)} ({seconds:.0f} s in all)")
  return {"rows": rows, "csv": paths[0], "png": paths[1], "samples": paths[2], "grid": grid,
          "prompts": prompts, "max_new_tokens": int(max_new_tokens), "seed": int(seed),
          "seconds": seconds, "texts": texts, **arrays}


def _row(setting: Setting, arrays: Mapping) -> dict:
  """One setting's row of the table: its values, then its metrics (`setting_metrics`)."""
  row = {"setting": setting.name, "temperature": setting.temperature, "top_k": setting.top_k,
         "top_p": setting.top_p, "min_p": setting.min_p,
         "others": " ".join(f"{k}={v:g}" for k, v in setting.others)}
  row.update(setting_metrics(arrays["tokens"], arrays["lengths"], arrays["log_likelihoods"],
                             arrays["entropies"], arrays["finished"]))
  return row


def _checked_grid(grid: Sequence[Setting]) -> tuple[Setting, ...]:
  """The grid as a tuple, checked: a non-empty list of `Setting` with distinct names."""
  grid = tuple(grid)
  if not grid or not all(isinstance(s, Setting) for s in grid):
    raise ValueError(f"grid must be a non-empty list of Setting; got {grid!r:.80}")
  names = [s.name for s in grid]
  if len(set(names)) != len(names):
    raise ValueError(f"grid settings need distinct names; got {names}")
  return grid


def _scored(model, gen, prompt_ids, params, keys, *, pad_id: int, shape: tuple[int, int]) -> dict:
  """The rows of `gen` scored under the model (teacher forcing): `tokens`, `lengths`,
  `finished`, `logprobs`, `log_likelihoods` and `entropies`, each `[S, P, ...]` (`shape`)."""
  prompt_tokens, prompt_lengths = right_pad(prompt_ids, pad_id=pad_id, buckets=None)
  logits = teacher_forced_logits(model, prompt_tokens, prompt_lengths, gen.tokens)
  log_likelihoods = np.asarray(metrics.token_log_likelihoods(logits, gen.tokens, gen.lengths))
  # The prompts as generate gave them to decode (-1 padding): the history DRY reads.
  real = np.arange(prompt_tokens.shape[1])[None, :] < np.asarray(prompt_lengths)[:, None]
  entropies = np.asarray(metrics.step_entropies(
      logits, params, gen.lengths, tokens=gen.tokens, key=keys,
      prompt_tokens=np.where(real, prompt_tokens, -1)))
  del logits

  def per_setting(x):  # [S * P, ...] -> [S, P, ...]
    return np.asarray(x).reshape(*shape, *np.shape(x)[1:])

  return {"tokens": per_setting(gen.tokens), "lengths": per_setting(gen.lengths),
          "finished": per_setting(gen.finished), "logprobs": per_setting(gen.logprobs),
          "log_likelihoods": per_setting(log_likelihoods), "entropies": per_setting(entropies)}


def _write_outputs(out_dir: str, rows, grid, prompts, texts, *, title: str, say) -> tuple:
  """Writes sweep.csv, sweep.png (when matplotlib is installed) and samples.txt into `out_dir`;
  returns their paths (None for a plot not drawn)."""
  csv_path = os.path.join(out_dir, "sweep.csv")
  write_csv(rows, csv_path)
  png_path = os.path.join(out_dir, "sweep.png")
  if not plot(rows, grid, png_path, title=title):
    say("matplotlib is not installed: no sweep.png (pip install 'jaxdecode[plot]')")
    png_path = None
  samples_path = os.path.join(out_dir, "samples.txt")
  write_samples(grid, prompts, texts, samples_path)
  return csv_path, png_path, samples_path


def _format(column: str, value) -> str:
  """Settings as given (`0.95`), metrics with 4 decimals; no other field: `-`."""
  if column in ("temperature", "top_p", "min_p"):
    return f"{value:g}"
  if column == "others":
    return value or "-"
  if isinstance(value, float):
    return f"{value:.4f}" if math.isfinite(value) else str(value)
  return str(value)


def write_csv(rows: Sequence[dict], path: str) -> None:
  """One line per setting, the columns of `COLUMNS`; floats with 4 decimals (written
  atomically)."""
  text = io.StringIO(newline="")
  writer = csv.writer(text)
  writer.writerow(COLUMNS)
  for row in rows:
    writer.writerow([_format(c, row[c]) for c in COLUMNS])
  _files.atomic_write_text(path, text.getvalue(), "sweep table")


def write_samples(grid: Sequence[Setting], prompts: Sequence[str], texts, path: str) -> None:
  """Every setting's continuation of every prompt, as plain text (written atomically)."""
  parts = []
  for setting, row in zip(grid, texts):
    parts.append(f"=== {setting.name}\n")
    for prompt, text in zip(prompts, row):
      parts.append(f"--- {prompt!r}\n{prompt}{text}\n")
    parts.append("\n")
  _files.atomic_write_text(path, "".join(parts), "sweep samples")


def format_table(rows: Sequence[dict]) -> str:
  """The rows as an aligned text table (what the command prints)."""
  cells = [list(COLUMNS)] + [[_format(c, row[c]) for c in COLUMNS] for row in rows]
  widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
  lines = [" ".join(cell.rjust(w) if i else cell.ljust(w)
                    for i, (cell, w) in enumerate(zip(line, widths))) for line in cells]
  return "\n".join(lines) + "\n"


def _colour(family: str) -> str:
  return _FAMILY_COLOURS.get(family, "tab:gray")


# Where a label may go, tried in order: (dx, dy) in points from its dot, horizontal alignment.
_LABEL_SPOTS = ((6, 4, "left"), (6, -12, "left"), (-6, 4, "right"), (-6, -12, "right"),
                (0, 9, "center"), (0, -18, "center"), (10, 14, "left"), (-10, 14, "right"),
                (10, -22, "left"), (-10, -22, "right"))


def _label_points(fig, ax, x, y, names, colours) -> None:
  """Labels each dot at the first spot that overlaps no dot and no label placed before it."""
  renderer = fig.canvas.get_renderer()
  centres = ax.transData.transform(np.stack([x, y], axis=1))  # [S, 2] in pixels
  radius = 6.0
  taken = [(cx - radius, cy - radius, cx + radius, cy + radius) for cx, cy in centres]
  frame = ax.get_window_extent(renderer)

  def free(box):
    if box.x0 < frame.x0 or box.x1 > frame.x1 or box.y0 < frame.y0 or box.y1 > frame.y1:
      return False
    return all(box.x1 <= a or box.x0 >= c or box.y1 <= b or box.y0 >= d for a, b, c, d in taken)

  for i, name in enumerate(names):
    for k, (dx, dy, ha) in enumerate(_LABEL_SPOTS):
      label = ax.annotate(name, (x[i], y[i]), xytext=(dx, dy), textcoords="offset points",
                          ha=ha, fontsize=9, color=colours[i])
      label.set_in_layout(False)
      box = label.get_window_extent(renderer)
      if free(box) or k == len(_LABEL_SPOTS) - 1:
        taken.append((box.x0, box.y0, box.x1, box.y1))
        break
      label.remove()


def plot(rows: Sequence[dict], grid: Sequence[Setting], path: str, *, title: str = "") -> bool:
  """Writes the PNG: distinct-3 and repetition against log-likelihood, one labelled dot each.

  Drawn with matplotlib's Agg canvas directly (no pyplot, so no global backend or figure state).
  matplotlib is an optional extra (`pip install 'jaxdecode[plot]'`): without it nothing is
  written and this returns False.
  """
  try:  # optional: the only matplotlib use in the project
    # pylint: disable=import-outside-toplevel
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError:
    return False

  x = np.array([row["log_likelihood"] for row in rows])
  panels = [("distinct_3", "diversity: distinct-3 (distinct / all 3-grams)",
             "more stable = more conservative; more diverse = more risk"),
            (f"repetition_{REPETITION_N}",
             f"repetition: share of {REPETITION_N}-grams seen earlier in the same sequence",
             "degeneration: the likeliest text repeats itself most")]
  fig = Figure(figsize=(14, 6), dpi=110, layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, 2)
  for ax, (column, ylabel, subtitle) in zip(axes, panels):
    y = np.array([row[column] for row in rows])
    for family in dict.fromkeys(s.family for s in grid):  # in order of appearance
      members = [i for i, s in enumerate(grid) if s.family == family]
      ax.scatter(x[members], y[members], s=55, color=_colour(family), label=family, zorder=3)
    ax.set_xlabel("model log-likelihood of the text (nats per token; right = more predictable)")
    ax.set_ylabel(ylabel)
    ax.set_title(subtitle, fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.margins(0.12)
  axes[0].legend(loc="upper right", fontsize=9)
  fig.suptitle(f"jaxdecode sweep: {len(grid)} sampling settings" + (f"; {title}" if title else ""),
               fontsize=12)
  fig.canvas.draw()  # settles the layout, so that label positions can be measured
  for ax, (column, _, _) in zip(axes, panels):
    _label_points(fig, ax, x, np.array([row[column] for row in rows]), [s.name for s in grid],
                  [_colour(s.family) for s in grid])
  png = io.BytesIO()
  fig.savefig(png, format="png")
  _files.atomic_write(path, png.getvalue(), "sweep plot")
  return True


# ---------------------------------------------------------------------------------------------
# The command.


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The command's flags (shared by `jaxdecode sweep` and `python -m jaxdecode.tools.sweep`)."""
  parser.add_argument("--out", required=True, metavar="DIR",
                      help="folder for sweep.csv, sweep.png and samples.txt (created if missing)")
  parser.add_argument("--quick", action="store_true",
                      help=f"{len(QUICK_PROMPTS)} prompts x {QUICK_MAX_NEW_TOKENS} tokens instead "
                           f"of {len(PROMPTS)} x {MAX_NEW_TOKENS} (well under a minute)")
  parser.add_argument("--seed", type=non_negative_int, default=0, help="prompt i uses fold_in(key(seed), i)")


def run_command(args: argparse.Namespace) -> int:
  """Runs the sweep for parsed flags and prints the table; progress goes to stderr."""
  result = run_sweep(args.out, quick=args.quick, seed=args.seed,
                     progress=lambda line: print(f"[sweep] {line}", file=sys.stderr, flush=True))
  print(format_table(result["rows"]), end="")
  written = [p for p in (result["csv"], result["png"], result["samples"]) if p]
  print(f"wrote {', '.join(written)} in {result['seconds']:.0f} s")
  return 0


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m jaxdecode.tools.sweep") -> int:
  """The command line; returns the exit status (2 with one error line for a user mistake)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
  add_arguments(parser)
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # --help (0) or a bad command line (2, already reported)
    return int(e.code or 0)
  try:
    return run_command(args)
  except (ValueError, OSError, OverflowError) as e:
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
