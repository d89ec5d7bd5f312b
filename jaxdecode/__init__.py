"""jaxdecode: exact, reproducible, jit-compiled decoding for JAX language models.

The core (this package's modules) is pure JAX and imports nothing above it; the embedded model
lives in `jaxdecode.models`, the command and its tools in `jaxdecode.tools`.
"""

from jaxdecode import adapters
from jaxdecode import metrics
from jaxdecode import processors
from jaxdecode import structured
from jaxdecode.batch_invariant import batch_invariant
from jaxdecode.beam import BeamOutput
from jaxdecode.beam import beam_search
from jaxdecode.decoding import DecodeOutput
from jaxdecode.decoding import decode
from jaxdecode.invariance import AuditReport
from jaxdecode.invariance import audit
from jaxdecode.loop import DecodeContext
from jaxdecode.params import SamplingParams
from jaxdecode.processors import process_logits
from jaxdecode.processors import token_counts
from jaxdecode.prompts import left_pad
from jaxdecode.prompts import prompt_mask
from jaxdecode.prompts import prompt_positions
from jaxdecode.prompts import right_pad
from jaxdecode.sampling import greedy
from jaxdecode.sampling import sample
from jaxdecode.sampling import sample_with_logprobs
from jaxdecode.sampling import selectable
from jaxdecode.scoring import Scores
from jaxdecode.speculative import DraftContext
from jaxdecode.speculative import ModelDrafter
from jaxdecode.speculative import NgramDrafter
from jaxdecode.speculative import SpeculativeOutput
from jaxdecode.speculative import speculative_decode
from jaxdecode.trainer import LogprobDiff
from jaxdecode.trainer import logprob_diff
from jaxdecode.trainer import score

__version__ = "0.2.0"

__all__ = [
    "adapters",
    "AuditReport",
    "audit",
    "batch_invariant",
    "BeamOutput",
    "DecodeContext",
    "DecodeOutput",
    "DraftContext",
    "ModelDrafter",
    "NgramDrafter",
    "SamplingParams",
    "beam_search",
    "decode",
    "greedy",
    "left_pad",
    "logprob_diff",
    "LogprobDiff",
    "metrics",
    "process_logits",
    "processors",
    "prompt_mask",
    "prompt_positions",
    "right_pad",
    "sample",
    "Scores",
    "score",
    "sample_with_logprobs",
    "selectable",
    "speculative_decode",
    "structured",
    "SpeculativeOutput",
    "token_counts",
]
