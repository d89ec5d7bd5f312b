"""jaxdecode: exact, reproducible, jit-compiled decoding for JAX language models."""

from jaxdecode import processors
from jaxdecode.params import SamplingParams
from jaxdecode.processors import process_logits
from jaxdecode.sampling import greedy
from jaxdecode.sampling import sample
from jaxdecode.sampling import sample_with_logprobs
from jaxdecode.sampling import selectable

__version__ = "0.1.0"

__all__ = [
    "SamplingParams",
    "greedy",
    "process_logits",
    "processors",
    "sample",
    "sample_with_logprobs",
    "selectable",
]
