"""Writing files without ever losing one: checks before long work, atomic replacement after.

Every file jaxdecode writes (checkpoints, the sweep's outputs, the benchmark's JSON) goes through
`atomic_write`: the bytes go to a temporary file in the target's folder, are flushed and fsynced,
and the temporary file is renamed over the target. A rename within one folder is atomic, so an
interruption at any moment (an exception, SIGTERM, SIGKILL, a full disk) leaves either the old
file or the new one, whole, never a truncated mix.

`check_output_file` and `check_output_dir` run before any long work (training, a sweep): they
find a bad path (a directory where a file should go, a file where a folder should go, a folder
that cannot be created or written) by creating and removing a temporary file there, which is
the only reliable test (`os.access` says yes to folders that then refuse writes).
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def _describe(e: OSError) -> str:
  return e.strerror or type(e).__name__


def _probe(folder: str, what: str, path: str) -> None:
  """Creates and removes a temporary file in `folder`; ValueError if that fails."""
  try:
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".jaxdecode-probe-", suffix=".tmp")
  except OSError as e:
    raise ValueError(f"{what} {path!r} cannot be written: the folder {folder!r} refuses new "
                     f"files ({_describe(e)})") from None
  os.close(fd)
  os.remove(probe)


def read_input(path, what: str) -> bytes:
  """The bytes of the file at `path`.

  Raises:
    ValueError: naming `what` and the path, if it is not a path, is a directory, does not exist
      or cannot be read.
  """
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise ValueError(f"{what} must be a file path; got {path!r}")
  path = os.fspath(path)
  if os.path.isdir(path):
    raise ValueError(f"{what} {path!r} is a directory; give a file")
  if not os.path.exists(path):
    raise ValueError(f"{what} {path!r} does not exist")
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError as e:
    raise ValueError(f"{what} {path!r} cannot be read ({_describe(e)})") from None


def check_output_file(path, what: str = "output file") -> str:
  """Checks that a file can be written at `path` (creating missing parent folders); returns it.

  Raises:
    ValueError: if `path` is empty, is a directory, or its folder cannot be created or written.
  """
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise ValueError(f"{what} must be a file path; got {path!r}")
  path = os.fspath(path)
  if os.path.isdir(path):
    raise ValueError(f"{what} {path!r} is a directory; give a file path inside it, e.g. "
                     f"{os.path.join(path, 'model.msgpack')!r}")
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise ValueError(f"{what} {path!r} cannot be written: {folder!r} is a file, not a folder")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise ValueError(f"{what} {path!r} cannot be written: the folder {folder!r} cannot be "
                     f"created ({_describe(e)})") from None
  _probe(folder, what, path)
  return path


def check_output_dir(path, what: str = "output folder") -> str:
  """Checks that files can be written in the folder `path` (creating it); returns it.

  Raises:
    ValueError: if `path` is empty, is a file, or cannot be created or written.
  """
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise ValueError(f"{what} must be a folder path; got {path!r}")
  path = os.fspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"{what} {path!r} exists and is a file, not a folder")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"{what} {path!r} cannot be created ({_describe(e)})") from None
  _probe(path, what, path)
  return path


def _file_mode(path: str) -> int:
  """The permission bits the new file gets: the old file's, or what `open(path, "w")` gives."""
  try:
    return os.stat(path).st_mode & 0o7777
  except OSError:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path, data: bytes, what: str = "output file") -> None:
  """Writes `data` to `path` so that the file is always either the old one or the new one.

  Raises:
    ValueError: if the file cannot be written (the old file, if any, is left as it was).
  """
  path = check_output_file(path, what)
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    os.fchmod(fd, _file_mode(path))  # mkstemp's 0600 would hide the file from other users
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException as e:  # KeyboardInterrupt and SystemExit (SIGTERM) included
    with contextlib.suppress(OSError):
      os.remove(tmp)
    if isinstance(e, OSError):
      raise ValueError(f"{what} {path!r} could not be written ({_describe(e)}); the previous "
                       f"file, if any, is unchanged") from None
    raise
  with contextlib.suppress(OSError):  # make the rename itself durable
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(dir_fd)
    finally:
      os.close(dir_fd)


def atomic_write_text(path, text: str, what: str = "output file") -> None:
  atomic_write(path, text.encode("utf-8"), what)
