"""A small Flax NNX transformer with a KV cache, and a byte tokenizer."""

from jaxdecode.models.tokenizer import ByteTokenizer
from jaxdecode.models.transformer import DecodeState
from jaxdecode.models.transformer import KVCache
from jaxdecode.models.transformer import Transformer
from jaxdecode.models.transformer import TransformerConfig
from jaxdecode.models.transformer import forward
from jaxdecode.models.transformer import init_cache
from jaxdecode.models.transformer import make_step_fn
from jaxdecode.models.transformer import prefill

__all__ = [
    "ByteTokenizer",
    "DecodeState",
    "KVCache",
    "Transformer",
    "TransformerConfig",
    "forward",
    "init_cache",
    "make_step_fn",
    "prefill",
]
