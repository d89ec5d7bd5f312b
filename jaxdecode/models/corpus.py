"""Training corpora that need no download, split into training and held-out parts by document.

The default corpus is the running Python's own standard library: every `.py` file outside the
test folders (about 12 MB on CPython 3.11) plus the topics of `pydoc_data.topics` (0.4 MB). Each
file (or topic) is one document: its UTF-8 bytes followed by EOS. Whole documents are held out,
chosen by a hash of their name, so the held-out loss measures text the model never saw, not
chunks of files it trained on.

A user's own text: `build_corpus(FILE)` (one file: every 20th chunk of 4096 bytes is held out,
since one file cannot be split by document) or `build_corpus(DIR)` (every UTF-8 text file under
the folder is a document, split by name like the standard library).

Each `Corpus` records where it came from (`description`: the Python version, the number of
documents, a SHA-256 of the sorted document names and sizes), which training writes into the
checkpoint's metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig

import numpy as np

from jaxdecode import _files
from jaxdecode.models.tokenizer import ByteTokenizer

EOS = ByteTokenizer.EOS
HELD_OUT_EVERY = 20  # one document in 20 is held out (by a hash of its name)
SKIPPED_FOLDERS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token streams for training and evaluation.

  Attributes:
    train: int32 token stream of the training documents (each followed by EOS).
    held_out: int32 token stream of the held-out documents.
    parts: named held-out subsets to report separately (e.g. "stdlib", "pydoc topics").
    description: JSON-ready facts about the source (kept in checkpoint metadata).
  """
  train: np.ndarray
  held_out: np.ndarray
  parts: dict
  description: dict


def _is_held_out(name: str, every: int) -> bool:
  return int(hashlib.sha256(name.encode("utf-8")).hexdigest()[:8], 16) % every == 0


def _stream(documents: list[bytes]) -> np.ndarray:
  """Each document's bytes followed by EOS, as one int32 stream."""
  parts = []
  for doc in documents:
    parts.append(np.frombuffer(doc, np.uint8).astype(np.int32))
    parts.append(np.array([EOS], np.int32))
  return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def _digest(named: list[tuple[str, bytes]]) -> str:
  h = hashlib.sha256()
  for name, data in sorted(named):
    h.update(f"{name}\t{len(data)}\n".encode("utf-8"))
  return h.hexdigest()


def _split(named: list[tuple[str, bytes]], every: int):
  train = [d for n, d in named if not _is_held_out(n, every)]
  held = [d for n, d in named if _is_held_out(n, every)]
  if not held or not train:  # too few documents for a split by name: hold out the last one
    train, held = [d for _, d in named[:-1]], [named[-1][1]]
  return train, held


def stdlib_documents() -> list[tuple[str, bytes]]:
  """`(relative path, bytes)` of every UTF-8 `.py` file of the standard library outside its test
  folders (and outside site-packages), sorted by path."""
  root = sysconfig.get_paths()["stdlib"]
  named = []
  for folder, subfolders, files in os.walk(root):
    subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS)
    for name in sorted(files):
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      with open(path, "rb") as f:
        data = f.read()
      try:
        data.decode("utf-8")
      except UnicodeDecodeError:
        continue
      named.append((os.path.relpath(path, root).replace(os.sep, "/"), data))
  return sorted(named)


def pydoc_documents() -> list[tuple[str, bytes]]:
  """`(topic name, bytes)` of CPython's bundled `pydoc_data.topics`, sorted by name."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel  # a 0.4 MB module
  return [(f"pydoc:{name}", topics.topics[name].encode("utf-8"))
          for name in sorted(topics.topics)]


def stdlib_corpus(every: int = HELD_OUT_EVERY) -> Corpus:
  """The default corpus: the standard library's `.py` files plus the pydoc topics."""
  code, topics = stdlib_documents(), pydoc_documents()
  code_train, code_held = _split(code, every)
  topic_train, topic_held = _split(topics, every)
  named = code + topics
  return Corpus(
      train=_stream(code_train + topic_train), held_out=_stream(code_held + topic_held),
      parts={"stdlib": _stream(code_held), "pydoc topics": _stream(topic_held)},
      description={"source": "python stdlib + pydoc_data.topics",
                   "python": sys.version.split()[0], "documents": len(named),
                   "held_out_documents": len(code_held) + len(topic_held),
                   "sha256": _digest(named), "bytes": int(sum(len(d) for _, d in named))})


def pydoc_corpus(every: int = HELD_OUT_EVERY) -> Corpus:
  """The pydoc topics alone (the first embedded model's corpus), split by topic."""
  topics = pydoc_documents()
  train, held = _split(topics, every)
  return Corpus(train=_stream(train), held_out=_stream(held),
                parts={"pydoc topics": _stream(held)},
                description={"source": "pydoc_data.topics", "python": sys.version.split()[0],
                             "documents": len(topics), "held_out_documents": len(held),
                             "sha256": _digest(topics),
                             "bytes": int(sum(len(d) for _, d in topics))})


def split_stream(stream: np.ndarray, *, every: int = HELD_OUT_EVERY, chunk: int = 4096):
  """(train, held out) of one stream: every `every`-th chunk of `chunk` tokens is held out."""
  chunks = [stream[i:i + chunk] for i in range(0, len(stream), chunk)]
  val = [c for i, c in enumerate(chunks) if i % every == every - 1]
  train = [c for i, c in enumerate(chunks) if i % every != every - 1]
  if not val:  # a tiny corpus: hold out its tail
    cut = max(1, len(stream) // every)
    return stream[:-cut], stream[-cut:]
  return np.concatenate(train), np.concatenate(val)


def _utf8(data: bytes, what: str) -> None:
  try:
    data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{what} is not UTF-8 text ({e})") from None


def file_corpus(path: str) -> Corpus:
  """One UTF-8 text file, split by chunks (`split_stream`)."""
  data = _files.read_input(path, "corpus")
  _utf8(data, f"corpus {path!r}")
  stream = np.frombuffer(data, np.uint8).astype(np.int32)
  train, held = split_stream(stream)
  return Corpus(train=train, held_out=held, parts={"held out": held},
                description={"source": os.path.basename(path), "bytes": len(data),
                             "sha256": hashlib.sha256(data).hexdigest(), "documents": 1})


def directory_corpus(path: str, every: int = HELD_OUT_EVERY) -> Corpus:
  """Every UTF-8 text file under a folder is a document; whole files are held out."""
  named = []
  for folder, subfolders, files in os.walk(path):
    subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
    for name in sorted(files):
      if name.startswith("."):
        continue
      full = os.path.join(folder, name)
      data = _files.read_input(full, "corpus file")
      try:
        data.decode("utf-8")
      except UnicodeDecodeError:
        continue  # binary files are not text
      if data:
        named.append((os.path.relpath(full, path).replace(os.sep, "/"), data))
  if len(named) < 2:
    raise ValueError(f"corpus folder {path!r} holds {len(named)} UTF-8 text file(s); it needs "
                     f"at least 2 (one to train on, one to hold out), or give a single file")
  train, held = _split(named, every)
  return Corpus(train=_stream(train), held_out=_stream(held), parts={"held out": _stream(held)},
                description={"source": os.path.basename(os.path.abspath(path)),
                             "documents": len(named), "held_out_documents": len(held),
                             "sha256": _digest(named),
                             "bytes": int(sum(len(d) for _, d in named))})


def build_corpus(path: str | None = None) -> Corpus:
  """The corpus of `path`: None for the standard library, a file, or a folder of text files."""
  if path is None:
    return stdlib_corpus()
  if os.path.isdir(path):
    return directory_corpus(path)
  return file_corpus(path)
