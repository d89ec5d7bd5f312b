"""jaxdecode: exact, reproducible, jit-compiled decoding for JAX language models."""

from jaxdecode import metrics
from jaxdecode import processors
from jaxdecode.decoding import DecodeOutput
from jaxdecode.decoding import decode
from jaxdecode.decoding import left_pad
from jaxdecode.decoding import prompt_mask
from jaxdecode.decoding import prompt_positions
from jaxdecode.params import SamplingParams
from jaxdecode.processors import process_logits
from jaxdecode.processors import token_counts
from jaxdecode.sampling import greedy
from jaxdecode.sampling import sample
from jaxdecode.sampling import sample_with_logprobs
from jaxdecode.sampling import selectable

__version__ = "0.1.0"

__all__ = [
    "DecodeOutput",
    "SamplingParams",
    "decode",
    "greedy",
    "left_pad",
    "metrics",
    "process_logits",
    "processors",
    "prompt_mask",
    "prompt_positions",
    "sample",
    "sample_with_logprobs",
    "selectable",
    "token_counts",
]
