"""`ByteTokenizer`: UTF-8 bytes as token ids, plus three special ids.

Ids 0..255 are the bytes of the UTF-8 encoding, so any text round-trips exactly and there is no
vocabulary file. A multi-byte character (Chinese, emoji) is several tokens; a generation cut in
the middle of one decodes to U+FFFD instead of raising.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class ByteTokenizer:
  """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, then BOS, EOS and PAD.

  Examples:
    >>> tok = ByteTokenizer()
    >>> tok.encode("hé")
    [256, 104, 195, 169]
    >>> tok.decode([256, 104, 195, 169, 257])
    'hé'
  """

  BOS = 256
  EOS = 257
  PAD = 258
  vocab_size = 259

  @property
  def special_ids(self) -> tuple[int, int, int]:
    """`(BOS, EOS, PAD)`."""
    return (self.BOS, self.EOS, self.PAD)

  def vocabulary(self):
    """The tokens as bytes for `jaxdecode.structured` (BOS, EOS and PAD are special; EOS ends)."""
    from jaxdecode import structured  # pylint: disable=import-outside-toplevel
    return structured.Vocabulary([bytes([i]) for i in range(256)] + [None] * 3, [self.EOS])

  def encode(self, text: str, *, bos: bool = True) -> list[int]:
    """Token ids of `text`: its UTF-8 bytes, after BOS if `bos`.

    Args:
      text: any Python string.
      bos: whether to start with the BOS id.

    Returns:
      A list of ints in [0, 256], BOS only at the start.
    """
    if not isinstance(text, str):
      raise ValueError(f"text must be a str; got {type(text).__name__} {text!r:.80}")
    try:
      ids = list(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates, e.g. non-UTF-8 bytes from a command line
      raise ValueError(f"text is not valid Unicode at character {e.start} "
                       f"({text[e.start:e.end]!r}): give UTF-8 text") from None
    return [self.BOS] + ids if bos else ids

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    """The bytes of `ids`, special ids dropped.

    Args:
      ids: token ids, each in [0, vocab_size) (a list, or a 1-D integer array).

    Returns:
      The byte string made of the ids below 256, in order.
    """
    ids = self._check_ids(ids)
    return bytes(i for i in ids if i < 256)

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids`: special ids dropped, invalid UTF-8 (a cut character) becomes U+FFFD.

    Args:
      ids: token ids, each in [0, vocab_size) (a list, or a 1-D integer array).

    Returns:
      The decoded string; never raises on byte content.
    """
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  def _check_ids(self, ids) -> list[int]:
    """`ids` as a list of Python ints; ValueError unless 1-D integers in [0, vocab_size)."""
    if isinstance(ids, (str, bytes)):
      raise ValueError(f"ids must be a sequence of ints in [0, {self.vocab_size}); "
                       f"got {type(ids).__name__} {ids!r:.80}")
    if not hasattr(ids, "__array__") and not isinstance(ids, (list, tuple)):
      ids = list(ids)  # a generator or other iterable
    array = np.asarray(ids)
    if array.size == 0:
      return []
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
      raise ValueError(f"ids must be a 1-D sequence of ints in [0, {self.vocab_size}); "
                       f"got shape {array.shape} of dtype {array.dtype}")
    bad = (array < 0) | (array >= self.vocab_size)
    if bad.any():
      index = int(np.argmax(bad))
      raise ValueError(f"ids[{index}] = {int(array[index])} is out of range; token ids must be "
                       f"in [0, {self.vocab_size})")
    return array.tolist()
