"""Training corpora: whole documents held out, EOS after each, a description that pins them."""

import io
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdecode.models import ByteTokenizer, TransformerConfig, corpus, training

EOS = ByteTokenizer.EOS


def documents_of(stream):
  """The documents of an EOS-separated stream, as bytes."""
  cuts = np.flatnonzero(stream == EOS)
  starts = np.concatenate([[0], cuts[:-1] + 1])
  return [bytes(stream[a:b].astype(np.uint8)) for a, b in zip(starts, cuts)]


def make_folder(tmp_path, n=60):
  folder = tmp_path / "texts"
  (folder / "sub").mkdir(parents=True)
  for i in range(n):
    (folder / ("sub" if i % 2 else ".") / f"doc{i}.txt").write_text(f"document {i}\n" * (i + 1))
  (folder / "image.bin").write_bytes(b"\xff\xfe\x00binary")  # not UTF-8: skipped
  return folder


def test_a_folder_corpus_holds_out_whole_files_chosen_by_name(tmp_path):
  folder = make_folder(tmp_path)
  data = corpus.build_corpus(str(folder))
  train, held = documents_of(data.train), documents_of(data.held_out)
  files = {p.read_bytes() for p in folder.rglob("*.txt")}
  assert set(train) | set(held) == files and not set(train) & set(held)
  assert 0 < len(held) < len(files) / 5  # about one in 20
  assert data.description["documents"] == 60 and data.description["held_out_documents"] == len(held)
  # The same folder gives the same split and digest; a changed file changes the digest.
  again = corpus.build_corpus(str(folder))
  np.testing.assert_array_equal(again.held_out, data.held_out)
  (folder / "doc0.txt").write_text("changed")
  assert corpus.build_corpus(str(folder)).description["sha256"] != data.description["sha256"]


def test_a_folder_needs_two_text_files_and_a_file_corpus_splits_by_chunks(tmp_path):
  (tmp_path / "one.txt").write_text("just one")
  with pytest.raises(ValueError, match="holds 1 UTF-8 text file"):
    corpus.build_corpus(str(tmp_path))
  text = tmp_path / "big.txt"
  text.write_text("abc" * 50_000)
  data = corpus.build_corpus(str(text))
  assert len(data.train) + len(data.held_out) == 150_000 and data.description["documents"] == 1
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"\xff\xfe")
  with pytest.raises(ValueError, match="is not UTF-8 text"):
    corpus.build_corpus(str(bad))


def test_the_standard_library_corpus_skips_tests_and_site_packages_and_holds_out_whole_files():
  named = corpus.stdlib_documents()
  names = [n for n, _ in named]
  assert not any(part in corpus.SKIPPED_FOLDERS for n in names for part in n.split("/")[:-1])
  assert all(n.endswith(".py") for n in names) and len(named) > 300
  data = corpus.stdlib_corpus()
  held = documents_of(data.parts["stdlib"])
  files = dict((d, n) for n, d in named)
  assert held and all(d in files for d in held)  # each held-out document is a whole file
  assert not set(held) & set(documents_of(data.train))
  assert data.description["python"] == sys.version.split()[0]
  assert len(data.parts["pydoc topics"]) > 0 and data.description["bytes"] > 5_000_000


@pytest.mark.slow
def test_training_is_reproducible_for_the_same_seed_and_corpus(tmp_path):
  folder = make_folder(tmp_path)
  config = TransformerConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=32)
  cfg = training.TrainConfig(steps=6, batch_size=2, seq_len=16, warmup_steps=1, eval_every=3)
  runs = [training.train(config, cfg, corpus=str(folder), log=io.StringIO()) for _ in range(2)]
  (a, sa), (b, sb) = runs
  jax.tree.map(np.testing.assert_array_equal, nnx.split(a)[1], nnx.split(b)[1])
  assert sa["history"] == [{**h, "seconds": sa["history"][i]["seconds"]}
                           for i, h in enumerate(sb["history"])]
  assert sa["corpus"]["sha256"] == sb["corpus"]["sha256"]
  assert set(sa["held_out"]) == {"held out"}


@pytest.mark.slow
def test_a_run_stopped_midway_leaves_its_best_checkpoint_so_far(tmp_path, monkeypatch):
  folder = make_folder(tmp_path)
  config = TransformerConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=32)
  cfg = training.TrainConfig(steps=8, batch_size=2, seq_len=16, warmup_steps=1, eval_every=2)
  out = tmp_path / "run.msgpack"
  real_evaluate = training.evaluate
  losses = iter([3.0, 2.0])

  def evaluate_then_stop(*args, **kwargs):
    real_evaluate(*args, **kwargs)
    try:
      return next(losses)
    except StopIteration:
      raise KeyboardInterrupt from None  # Ctrl-C during the third evaluation

  monkeypatch.setattr(training, "evaluate", evaluate_then_stop)
  with pytest.raises(KeyboardInterrupt):
    training.train(config, cfg, corpus=str(folder), out=str(out), log=io.StringIO())
  from jaxdecode.models import load_checkpoint
  _, metadata = load_checkpoint(str(out))
  assert metadata["finished"] is False and metadata["val_loss"] == 2.0
  assert [h["step"] for h in metadata["history"]] == [2, 4]
