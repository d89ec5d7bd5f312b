"""The benchmark suite: every figure is a ratio of two timings taken in the same process.

Run it as `python -m jaxdecode.bench [--quick] [--json] [--runs N] [--no-kernels] [--no-decode]
[--no-beam] [--no-numerics] [--no-spec] [--no-stream] [--[no-]structured] [--[no-]scoring]
[--all-peers]` (or `jaxdecode bench`).
The protocol (docs/architecture.md, "Benchmark protocol"):

- the functions of one table row are timed round-robin, run after run (each run starts at the
  next function, so no function always follows the same one), so that machine noise hits them
  all alike;
- each function is called at least twice before timing (the first call compiles);
- every call is followed by `jax.block_until_ready`; a figure is the median of >= 20 runs
  (`--quick` takes 10 runs by default, never fewer than 5, on a smaller grid);
- figures are ratios of such medians: sampler time / `jnp.argmax` time on the same `[B, V]`
  logits, decode tokens/s with top-p / greedy on the same model and prompts.

Tables:

1. Kernels. For each logit shape ("wide": standard Gaussian noise; "lm": a steep Zipf profile,
   logit = -3.3 ln(rank) with the ranks randomly permuted in every row), batch B and vocabulary V:
   `jaxdecode.greedy`, `jaxdecode.sample` (plain; top-k 50; top-p 0.9; min-p 0.05; the chain
   temperature 0.8 + top-k 50 + top-p 0.9 + min-p 0.05), a sort-based exact top-p reference
   (`sort_top_p_sample`) and, when `transformers` is installed, its Flax top-p warper, each as
   time / argmax time; plus the speedups of jaxdecode's top-p over the two sort-based ones.
   The controls (`CONTROL_PARAMS`: penalties with token counts, logit bias + banned tokens,
   allowed tokens, typical-p, epsilon, eta, top-nσ, XTC, dynamic temperature, mirostat 2, and
   over a history DRY, n-gram and bad-word bans, and those seven at once) are timed in the same
   round robin and printed as a second table.
2. Decode. `jaxdecode.decode` of 64 new tokens for a batch of 8 prompts (no EOS) with top-p 0.9
   versus greedy, for the embedded default model and a random-weights model with a 32000-token
   vocabulary; the first call (compilation included) versus a later one; and a decode whose rows
   all hit EOS at once versus the same decode without EOS.
3. Beam search. `jaxdecode.beam_search` with K = 4 beams versus greedy `decode` on the same 8
   prompts and 64 new tokens (no EOS, so both run every step), on the embedded model: tokens/s
   of the returned sequences (each search returns B * N tokens) and of the model's work (the
   search feeds B * K * N tokens through the model, greedy B * N).
4. Numerics. Greedy decode tokens/s of the embedded model with its batch-invariant numerics
   over the same weights with plain XLA kernels, at B = 1, 8 and 64; each mode's first call
   (compilation); one invariant step near the end of the context over one at position 32.
   Then the same ratio for a model no one here wrote, when `transformers<5` is installed (a
   line says why not otherwise): transformers' Flax GPT-2 (`HF_GPT2`: 4 layers, 256 wide,
   V = 8192, random weights), its prefill and step under `jaxdecode.batch_invariant` over
   plain XLA, both decoded by `jaxdecode.decode`, at B = 1 and 8.
5. Speculative decoding. `speculative_decode` over `decode` time (the same tokens) and the
   acceptance rate, for the n-gram drafter and the embedded draft model, greedy and top-p 0.9,
   B = 1 and 8, K = 2, 4, 8, on repetitive and on fresh prompts.
6. Streaming. `models.stream` consumed to the end over `models.generate`, B = 1 and 8.
7. Structured decoding. `jaxdecode.decode` with `constraint=` over the same decode without one
   (tokens/s), on the embedded model, top-p 0.9, 32 new tokens, B = 1 and 8, for a JSON schema
   and a regex (`STRUCTURED_SCHEMA`, `STRUCTURED_REGEX`); and the time to compile each of them
   from scratch for a 32000-token ByteLevel BPE vocabulary (trained with `tokenizers` on the
   embedded corpus, `bpe_vocabulary`), outlines-core's share of it, and the tables' size
   (`constraint.nbytes()`). Without `tokenizers` the compile rows are skipped.
8. Scoring (`scoring`). Rollout tokens/s with log-probs of each kind over the default rollout
   (processed), and the training step (`jaxdecode.score` + `jax.value_and_grad` over
   `models.forward_fn`), batch-invariant numerics over plain XLA, B = 1 and 8 (--quick: 8), at
   least `scoring.SCORING_RUNS` runs.

Duration on 2 CPU cores (AMD EPYC), measured: the kernel and control tables about 8 minutes, the
model tables 24 (decode 1.6, beam 1, numerics 2.5, speculative 16, streaming 1, structured 2)
and the scoring table 15 (6.5 with `--quick`; both measured with the 2 cores shared, load 9-10);
`--no-kernels` runs the model tables alone, `--no-kernels --no-decode --structured` the
structured table alone (about 2 minutes, with `--quick` too: its compile rows are timed once,
and half of it is compiling the decode loop). `--quick` (B = 8 kernels; numerics at B = 1, 8;
speculative at B = 1, K = 4; streaming at B = 1; 10 runs) takes roughly 10-12 minutes, and
the scoring table's 6.5 more (`--no-scoring` leaves it out). Up to
twice that when the cores are shared. The sort-based peers are slow at large sizes, so by
default they are timed only where B*V <= `PEER_MAX_ELEMENTS` (B <= 8, and B = 64 with
V = 32000); `--all-peers` times them everywhere (about 20-30 more minutes).

From Python: `run_benchmarks(...)` returns every median and ratio as one dict (what `--json`
prints) and `format_table(result)` renders it (what the README pastes); `kernel_table`,
`decode_table`, `beam_table`, `numerics_table`, `spec_table`, `stream_table`,
`structured_table`, `scoring_table`, `bpe_vocabulary`, `time_round_robin` and the sort-based
reference `sort_top_p_sample` / `sort_top_p_mask` work on their own. `main(argv)` is the
command line.

The package: one module per table (`kernels`, `decode`, `beam`, `numerics`, `speculative`,
`stream`, `structured`, `scoring`; each times its rows and writes its tables with
`format_tables(result)`), `_common` (the protocol's constants, round-robin timing, the shared
prefill), `_table` (the one table writer: a title, column specs, rows, a legend), `report` (the
whole run and the report) and `command` (the command line; `__main__` runs it). Everything
public is importable from here, and from `jaxdecode.bench`.
"""


# pylint: disable=g-importing-member,useless-import-alias
from jaxdecode.models import Transformer, TransformerConfig
from jaxdecode.tools.bench._common import BATCHES, MIN_RUNS, QUICK_RUNS, RUNS, TOP_P, WARMUP
from jaxdecode.tools.bench._common import _first_call_s, _medians, _prompts, time_round_robin
from jaxdecode.tools.bench._table import WIDTH as _WIDTH, ms as _ms, ratio as _fmt
from jaxdecode.tools.bench.beam import BEAM_SIZE, beam_row, beam_table
from jaxdecode.tools.bench.command import _finite, _runs, build_parser, main
from jaxdecode.tools.bench.decode import decode_row, decode_table, random_model
from jaxdecode.tools.bench.kernels import (CONTROL_ALLOWED, CONTROL_HISTORY, CONTROL_IDS,
                                           CONTROL_PARAMS, CONTROL_SEEN, HF_PEER, KERNEL_PARAMS,
                                           PEER_MAX_ELEMENTS, QUICK_BATCHES, QUICK_VOCABS,
                                           SHAPES, SORT_PEER, VOCABS, ZIPF_EXPONENT,
                                           control_params, kernel_fns, kernel_row, kernel_table,
                                           make_logits, sort_top_p_mask, sort_top_p_sample,
                                           transformers_top_p_sampler)
from jaxdecode.tools.bench.numerics import (HF_GPT2, HF_NUMERICS_BATCHES, numerics_row,
                                            numerics_table, transformers_gpt2,
                                            transformers_numerics_row,
                                            transformers_numerics_table, transformers_step_fns,
                                            transformers_training_step)
from jaxdecode.tools.bench.report import format_table, machine_info, run_benchmarks, usable_cpus
from jaxdecode.tools.bench.scoring import SCORING_RUNS, scoring_row, scoring_table
from jaxdecode.tools.bench.speculative import spec_prompts, spec_row, spec_table
from jaxdecode.tools.bench.stream import stream_row, stream_table
from jaxdecode.tools.bench.structured import (BPE_EOS, STRUCTURED_BATCHES,
                                              STRUCTURED_EXTRA_COMPILES, STRUCTURED_NEW_TOKENS,
                                              STRUCTURED_REGEX, STRUCTURED_SCHEMA,
                                              STRUCTURED_VOCAB, bpe_vocabulary,
                                              byte_level_decoder, structured_compile_row,
                                              structured_decode_row, structured_table)
