"""Table 6, streaming: `models.stream` consumed to the end over `models.generate`."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from jaxdecode.params import SamplingParams
from jaxdecode.tools.bench import _table
from jaxdecode.tools.bench._common import (RUNS, TOP_P, _default_model, _medians, table_rows,
                                           time_round_robin)
from jaxdecode.tools.bench._table import field, fixed
from jaxdecode.tools.bench.speculative import spec_prompts


def stream_row(model, *, batch: int, runs: int = RUNS, max_new_tokens: int = 64,
               chunk_size: int = 16, seed: int = 0) -> dict:
  """`models.stream` (every chunk consumed) over `models.generate` time, same prompts and key.

  Both include the prefill and the host-side text decoding; top-p 0.9, no EOS stop forced (the
  rows run until EOS or `max_new_tokens`, the same in both since the tokens are the same).

  Returns:
    A dict with `batch`, `max_new_tokens`, `chunk_size`, `runs`, `median_s` (generate, stream),
    `chunks` (how many the stream yielded) and `ratio`: `stream_vs_generate` (time).
  """
  from jaxdecode.models import generate, stream  # pylint: disable=import-outside-toplevel
  prompts = spec_prompts("fresh", batch)
  params = SamplingParams(top_p=TOP_P)
  kwargs = dict(model=model, params=params, seed=seed, max_new_tokens=max_new_tokens)
  chunks = len(list(stream(prompts, chunk_size=chunk_size, **kwargs)))
  medians = _medians(time_round_robin({
      "generate": lambda: generate(prompts, **kwargs).tokens,
      "stream": lambda: [c.lengths for c in stream(prompts, chunk_size=chunk_size, **kwargs)],
  }, runs))
  return {"batch": batch, "max_new_tokens": max_new_tokens, "chunk_size": chunk_size,
          "runs": runs, "median_s": medians, "chunks": chunks,
          "ratio": {"stream_vs_generate": medians["stream"] / medians["generate"]}}


def stream_table(*, batches: Sequence[int] = (1, 8), runs: int = RUNS, max_new_tokens: int = 64,
                 model_loader: Callable[[], Any] | None = None,
                 progress: Callable[[str], None] | None = None) -> list[dict]:
  """`stream_row` for each batch size on the embedded model (or `model_loader()`)."""
  model = (model_loader or _default_model)()
  return table_rows(
      [(batch, lambda batch=batch: stream_row(model, batch=batch, runs=runs,
                                              max_new_tokens=max_new_tokens))
       for batch in batches],
      label=lambda batch: f"stream B={batch}", skipped=None, errors=(), progress=progress)


def format_tables(result: Mapping) -> list[str]:
  """The streaming table of `run_benchmarks`'s result, as lines."""
  if not result.get("stream"):
    return []
  return _table.table(
      [f"Streaming: models.stream (every chunk consumed) vs models.generate, embedded model, "
       f"top-p 0.9, {result['settings']['max_new_tokens']} new tokens"],
      [field("B", 3, "batch"), field("chunk", 5, "chunk_size"), field("chunks", 6, "chunks"),
       field("generate ms", 11, "median_s", "generate", fmt=fixed(1, 1e3)),
       field("stream ms", 9, "median_s", "stream", fmt=fixed(1, 1e3)),
       field("stream/generate", 15, "ratio", "stream_vs_generate", fmt=_table.ratio)],
      result["stream"],
      "stream/generate: time of a stream consumed to the end over generate's (1.00 = "
      "streaming is free); both include the prefill and the text decoding.")
