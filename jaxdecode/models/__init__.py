"""The embedded model: a small Flax NNX transformer with a KV cache, its byte tokenizer,
checkpoints, `generate` and `stream`, training, and the model-based metrics.

This layer builds on the core (`jaxdecode`) and never the other way round.
"""

from jaxdecode.models.checkpoint import default_metadata
from jaxdecode.models.checkpoint import draft_metadata
from jaxdecode.models.checkpoint import load_checkpoint
from jaxdecode.models.checkpoint import load_default
from jaxdecode.models.checkpoint import load_draft
from jaxdecode.models.checkpoint import save_checkpoint
from jaxdecode.models.generate import Generation
from jaxdecode.models.generate import batch_prefill
from jaxdecode.models.generate import generate
from jaxdecode.models.metrics import teacher_forced_logits
from jaxdecode.models.stream import StreamChunk
from jaxdecode.models.stream import stream
from jaxdecode.models.tokenizer import ByteTokenizer
from jaxdecode.models.transformer import DECODE_STATE_AXES
from jaxdecode.models.transformer import DecodeState
from jaxdecode.models.transformer import KVCache
from jaxdecode.models.transformer import Transformer
from jaxdecode.models.transformer import TransformerConfig
from jaxdecode.models.transformer import forward
from jaxdecode.models.transformer import forward_fn
from jaxdecode.models.transformer import init_cache
from jaxdecode.models.transformer import make_step_fn
from jaxdecode.models.transformer import prefill

__all__ = [
    "ByteTokenizer",
    "batch_prefill",
    "DECODE_STATE_AXES",
    "DecodeState",
    "Generation",
    "KVCache",
    "Transformer",
    "TransformerConfig",
    "default_metadata",
    "draft_metadata",
    "forward",
    "forward_fn",
    "generate",
    "init_cache",
    "load_checkpoint",
    "load_default",
    "load_draft",
    "make_step_fn",
    "prefill",
    "save_checkpoint",
    "stream",
    "StreamChunk",
    "teacher_forced_logits",
]
