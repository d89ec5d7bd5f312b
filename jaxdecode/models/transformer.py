"""A small decoder-only transformer (Flax NNX) and the functions that decode with it.

The model: token embedding, `n_layers` pre-norm blocks (RMSNorm -> causal multi-head attention
with RoPE -> residual; RMSNorm -> GELU MLP -> residual), a final RMSNorm and an output projection
tied to the embedding. Everything is float32.

One code path, `Transformer.run_cached`, serves every use: a pass writes the keys and values of
its tokens into a KV cache and attends over the cache.

- Full forward (`Transformer.__call__`, `forward`): a fresh cache exactly as long as the input.
- `prefill`: a left-padded prompt `[B, T]` written into slots 0..T-1 of a longer cache.
- The step function of `make_step_fn`: one token per row, written after that row's tokens.

Cache layout. Prompts are left-padded (`jaxdecode.decoding.left_pad`), so row b's prompt fills
columns `T - lengths[b] .. T - 1` and its valid cache slots start at `start[b] = T - lengths[b]`.
The token at logical position p of row b (p = 0 at its first prompt token) lives in slot
`start[b] + p`, so every row's first new token (position `lengths[b]`) goes to slot T. A row
attends only to its own valid slots, and positions (RoPE) are per row, so a row gives the same
logits whatever the padding around it.

Weights are data. `graphdef, weights = nnx.split(model)`: the structure (`graphdef`) is static and
the weights travel as a pytree argument of the jitted functions and inside `DecodeState`, so new
weights (after training) never recompile and are never baked into a program as constants.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxdecode.prompts import left_pad
  >>> config = TransformerConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=64)
  >>> graphdef, weights = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  >>> tokens, lengths = left_pad([[256, 104, 105], [256, 33]], buckets=None)
  >>> logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=8)
  >>> step_fn = make_step_fn(graphdef)
  >>> logits, state = step_fn(state, jnp.array([10, 10], jnp.int32), lengths)
  >>> logits.shape
  (2, 259)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode import _checks
from jaxdecode.prompts import prompt_mask
from jaxdecode.prompts import prompt_positions


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes of the transformer. Static: a new config compiles new programs.

  Attributes:
    vocab_size: number of token ids (259 = `ByteTokenizer.vocab_size`).
    d_model: width of the residual stream.
    n_layers: number of transformer blocks.
    n_heads: attention heads; `d_model / n_heads` must be an even integer (RoPE rotates pairs).
    d_ff: hidden width of the MLP.
    max_len: the longest sequence (prompt + generated tokens) the model is used for; caches and
      full-forward inputs may not be longer.
    rope_base: base of the RoPE frequencies (> 1).
  """
  vocab_size: int = 259
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  d_ff: int = 1024
  max_len: int = 512
  rope_base: float = 10000.0

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len"):
      _checks.integer(name, getattr(self, name), low=1)
    if not (isinstance(self.rope_base, numbers.Real) and self.rope_base > 1):  # NaN fails too
      raise ValueError(f"rope_base must be a number > 1; got {self.rope_base!r}")
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model must be divisible by n_heads; got: {self.d_model} / "
                       f"{self.n_heads}")
    if self.head_dim % 2:
      raise ValueError(f"the head dimension d_model / n_heads must be even for RoPE; got: "
                       f"{self.d_model} / {self.n_heads} = {self.head_dim}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer, one row per sequence.

  Attributes:
    k: float32[L, B, S, H, Dh] keys (after RoPE).
    v: float32[L, B, S, H, Dh] values.
    start: int32[B], the first valid slot of each row (`T - lengths[b]` after `prefill`).
  """
  k: jax.Array
  v: jax.Array
  start: jax.Array


@flax.struct.dataclass
class DecodeState:
  """What the step function carries from step to step.

  Attributes:
    weights: the model weights (`nnx.split(model)[1]`), carried so that a jitted decode loop
      receives them as traced data rather than as constants.
    cache: the `KVCache`.
  """
  weights: nnx.State
  cache: KVCache


# Each DecodeState leaf's batch axis, for `jaxdecode.beam_search(..., state_axes=...)`: the weights
# are shared, the caches' k and v are [L, B, S, H, Dh], their start is [B].
DECODE_STATE_AXES = DecodeState(weights=None, cache=KVCache(k=1, v=1, start=0))


def init_cache(config: TransformerConfig, batch_size: int, length: int) -> KVCache:
  """An all-zero cache of `length` slots per row, every row starting at slot 0.

  Args:
    config: the model's config (sets L, H and Dh).
    batch_size: B.
    length: S, the number of slots per row.

  Returns:
    A `KVCache` with `k` and `v` of shape `[L, B, S, H, Dh]` and `start` of shape `[B]`.
  """
  shape = (config.n_layers, batch_size, length, config.n_heads, config.head_dim)
  return KVCache(k=jnp.zeros(shape, jnp.float32), v=jnp.zeros(shape, jnp.float32),
                 start=jnp.zeros((batch_size,), jnp.int32))


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding: rotates the pair (x[i], x[i + Dh/2]) by `position * base^(-2i/Dh)`.

  Args:
    x: float32[B, T, H, Dh] queries or keys.
    positions: int32[B, T] logical positions.
    base: the frequency base.

  Returns:
    float32[B, T, H, Dh].
  """
  half = x.shape[-1] // 2
  freq = base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])  # [Dh/2]
  angle = positions.astype(jnp.float32)[:, :, None, None] * freq[None, None, None, :]
  # angle: [B, T, 1, Dh/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def write_slots(buffer: jax.Array, new: jax.Array, first_slot: jax.Array) -> jax.Array:
  """Writes `new[b, t]` into slot `first_slot[b] + t` of row b; writes past the end are dropped.

  A select rather than `lax.dynamic_update_slice`, because dynamic_update_slice clamps a start
  index that runs past the end and would overwrite the last valid slots.

  Args:
    buffer: float32[B, S, H, Dh], one layer's keys or values.
    new: float32[B, T, H, Dh].
    first_slot: int32[B].

  Returns:
    float32[B, S, H, Dh]; slots that receive nothing are unchanged.
  """
  slots, width = buffer.shape[1], new.shape[1]
  source = jnp.arange(slots, dtype=jnp.int32)[None, :] - first_slot[:, None]  # [B, S]: t per slot
  written = (source >= 0) & (source < width)  # [B, S]
  index = jnp.clip(source, 0, width - 1)[:, :, None, None]  # [B, S, 1, 1]
  gathered = jnp.take_along_axis(new, index, axis=1)  # [B, S, H, Dh]
  return jnp.where(written[:, :, None, None], gathered, buffer)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
  """Multi-head attention of queries over keys/values, restricted to `allowed` pairs.

  Masked scores take float32's minimum rather than -inf: a query with no allowed key (a padding
  column) then averages the values uniformly, which is finite and harmless, instead of NaN.

  Args:
    q: float32[B, T, H, Dh].
    k: float32[B, S, H, Dh].
    v: float32[B, S, H, Dh].
    allowed: bool[B, T, S], whether query t may attend to slot s.

  Returns:
    float32[B, T, H, Dh].
  """
  scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])  # [B, H, T, S]
  scores = jnp.where(allowed[:, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)  # [B, H, T, S]
  return jnp.einsum("bhts,bshd->bthd", probs, v)


class Attention(nnx.Module):
  """Causal multi-head self-attention with RoPE over a KV cache."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.qkv = nnx.Linear(config.d_model, 3 * config.d_model, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(config.d_model, config.d_model, use_bias=False, rngs=rngs)

  def __call__(self, x, positions, k_cache, v_cache, first_slot, allowed):
    """Writes this pass's keys/values into the cache, then attends over the whole cache.

    Args:
      x: float32[B, T, D] (normalized) inputs.
      positions: int32[B, T] logical positions (for RoPE).
      k_cache: float32[B, S, H, Dh] this layer's keys.
      v_cache: float32[B, S, H, Dh] this layer's values.
      first_slot: int32[B], the slot of x[b, 0].
      allowed: bool[B, T, S].

    Returns:
      `(out float32[B, T, D], k_cache, v_cache)`.
    """
    batch, width, _ = x.shape
    heads, head_dim = self.config.n_heads, self.config.head_dim
    qkv = self.qkv(x).reshape(batch, width, 3, heads, head_dim)  # [B, T, 3, H, Dh]
    q = rope(qkv[:, :, 0], positions, self.config.rope_base)  # [B, T, H, Dh]
    k = rope(qkv[:, :, 1], positions, self.config.rope_base)  # [B, T, H, Dh]
    k_cache = write_slots(k_cache, k, first_slot)
    v_cache = write_slots(v_cache, qkv[:, :, 2], first_slot)
    out = attend(q, k_cache, v_cache, allowed)  # [B, T, H, Dh]
    return self.out(out.reshape(batch, width, heads * head_dim)), k_cache, v_cache


class Block(nnx.Module):
  """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
    self.attention = Attention(config, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
    self.mlp_in = nnx.Linear(config.d_model, config.d_ff, rngs=rngs)
    self.mlp_out = nnx.Linear(config.d_ff, config.d_model, rngs=rngs)

  def __call__(self, x, positions, k_cache, v_cache, first_slot, allowed):
    """Same arguments as `Attention.__call__`; returns `(x float32[B, T, D], k_cache, v_cache)`."""
    h, k_cache, v_cache = self.attention(self.attention_norm(x), positions, k_cache, v_cache,
                                         first_slot, allowed)
    x = x + h
    x = x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))
    return x, k_cache, v_cache


class Transformer(nnx.Module):
  """Decoder-only transformer; the output projection is the transposed token embedding.

  Args:
    config: the sizes.
    rngs: initialization randomness, e.g. `nnx.Rngs(0)`.
  """

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    # Std 1/sqrt(D): the tied output projection then gives logits of order 1 at initialization.
    self.embed = nnx.Embed(config.vocab_size, config.d_model,
                           embedding_init=nnx.initializers.normal(config.d_model ** -0.5),
                           rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
    self.final_norm = nnx.RMSNorm(config.d_model, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
    """Full forward pass (training, evaluation, reference for the cache).

    Query i of a row attends to key j iff `mask[j]` and `j <= i`. Logits at masked (padding)
    columns are finite but meaningless.

    Args:
      tokens: int32[B, T].
      positions: int32[B, T], each token's position in its own sequence (RoPE).
      mask: bool[B, T], True on real tokens.

    Returns:
      float32[B, T, V] next-token logits at every column.
    """
    batch, width = tokens.shape
    cache = init_cache(self.config, batch, width)
    logits, _ = self.run_cached(tokens, positions, cache, jnp.zeros((batch,), jnp.int32), mask)
    return logits

  def run_cached(self, tokens, positions, cache: KVCache, first_slot, key_valid):
    """The pass that every entry point shares.

    Writes the keys/values of `tokens[b, t]` into slot `first_slot[b] + t` and lets that token
    attend to every slot j with `key_valid[b, j]` and `j <= first_slot[b] + t`.

    Cache overflow: a token whose slot is >= S is not stored (no other slot is touched), and its
    logits are NaN so that the overflow is visible rather than silently wrong. Size caches as
    `prompt width + max_new_tokens`.

    Args:
      tokens: int32[B, T].
      positions: int32[B, T] logical positions (RoPE).
      cache: a `KVCache` of S slots per row.
      first_slot: int32[B], the slot of `tokens[b, 0]`.
      key_valid: bool[B, S], the slots a row may attend to at all.

    Returns:
      `(logits float32[B, T, V], cache)` with the new keys/values written; `start` unchanged.
    """
    slots, width = cache.k.shape[2], tokens.shape[1]
    query_slot = first_slot[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, T]
    slot = jnp.arange(slots, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    causal = slot <= query_slot[:, :, None]  # [B, T, S]
    allowed = key_valid[:, None, :] & causal  # [B, T, S]

    x = self.embed(tokens)  # [B, T, D]
    new_k, new_v = [], []
    for layer, block in enumerate(self.blocks):
      x, k, v = block(x, positions, cache.k[layer], cache.v[layer], first_slot, allowed)
      new_k.append(k)
      new_v.append(v)
    logits = self.embed.attend(self.final_norm(x))  # [B, T, V]
    logits = jnp.where((query_slot < slots)[:, :, None], logits, jnp.nan)
    return logits, cache.replace(k=jnp.stack(new_k), v=jnp.stack(new_v))


def _check_prompt(config: TransformerConfig, tokens, lengths, max_width: int, max_name: str):
  """Eager checks of a left-padded batch; values are checked only when they are concrete."""
  if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"tokens must be an integer array [B, T]; got shape {jnp.shape(tokens)} "
                     f"of dtype {jnp.result_type(tokens)}")
  batch, width = jnp.shape(tokens)
  if jnp.shape(lengths) != (batch,):
    raise ValueError(f"lengths must have shape ({batch},), one per row of tokens; got "
                     f"{jnp.shape(lengths)}")
  if width > max_width:
    raise ValueError(f"the prompt width T = {width} is longer than {max_name} = {max_width}")
  if not isinstance(tokens, jax.core.Tracer):
    values = np.asarray(tokens)
    if values.size and (values.min() < 0 or values.max() >= config.vocab_size):
      raise ValueError(f"token ids must be in [0, {config.vocab_size}); got: min {values.min()} "
                       f"/ max {values.max()}")
  if not isinstance(lengths, jax.core.Tracer):
    values = np.asarray(lengths)
    if values.min() < 1 or values.max() > width:
      raise ValueError(f"lengths must be in [1, T = {width}]; got {values.tolist()}")


def prefill(graphdef: nnx.GraphDef, weights: nnx.State, tokens: jax.Array, lengths: jax.Array,
            *, cache_length: int):
  """Runs left-padded prompts through the model, filling cache slots 0..T-1.

  Args:
    graphdef: the model structure (`nnx.split(model)[0]`); static.
    weights: the model weights (`nnx.split(model)[1]`); traced.
    tokens: int32[B, T] left-padded prompts (`jaxdecode.decoding.left_pad`).
    lengths: int32[B], the number of real tokens of each row (1..T).
    cache_length: S, slots per row (static), T <= S <= `config.max_len`; the prompt plus every
      generated token must fit (a token past the cache gets NaN logits).

  Returns:
    `(logits float32[B, V], state)`: each row's next-token logits (column T - 1) and a
    `DecodeState` whose cache has `start = T - lengths`. The first new token of row b has
    position `lengths[b]`.
  """
  config = nnx.merge(graphdef, weights).config
  if not config.max_len >= cache_length >= jnp.shape(tokens)[-1]:
    raise ValueError(f"cache_length must be between the prompt width T and max_len; got: "
                     f"{jnp.shape(tokens)[-1]} <= {cache_length} <= {config.max_len} is false")
  _check_prompt(config, tokens, lengths, cache_length, "cache_length")
  logits, cache = _prefill(graphdef, weights, tokens, lengths, cache_length=cache_length)
  return logits, DecodeState(weights=weights, cache=cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_length"))
def _prefill(graphdef, weights, tokens, lengths, *, cache_length):
  """Jitted `prefill`; returns `(logits [B, V], KVCache)`."""
  model = nnx.merge(graphdef, weights)
  batch, width = tokens.shape
  cache = init_cache(model.config, batch, cache_length).replace(start=width - lengths)
  key_valid = jnp.pad(prompt_mask(lengths, width), ((0, 0), (0, cache_length - width)))  # [B, S]
  logits, cache = model.run_cached(tokens, prompt_positions(lengths, width), cache,
                                   jnp.zeros((batch,), jnp.int32), key_valid)
  return logits[:, -1], cache


def make_step_fn(graphdef: nnx.GraphDef):
  """The jitted decode step for `jaxdecode.decode`: one new token per row through the cache.

  Build it once per model structure: each call of `make_step_fn` makes a new jitted function.

  Args:
    graphdef: the model structure (`nnx.split(model)[0]`).

  Returns:
    `step_fn(state, tokens int32[B], positions int32[B]) -> (logits float32[B, V], state)`, pure.
    Row b's token is written to slot `state.cache.start[b] + positions[b]` and attends to the
    row's slots `start[b] .. that slot`; RoPE uses `positions`. `positions` are logical: row b's
    first new token has position `lengths[b]`. A slot past the cache is not written and its
    row's logits are NaN (see `Transformer.run_cached`).
  """

  def step_fn(state: DecodeState, tokens: jax.Array, positions: jax.Array):
    batch = state.cache.start.shape[0]
    if tokens.shape != (batch,) or positions.shape != (batch,):
      raise ValueError(f"tokens and positions must have shape ({batch},), one per cache row; "
                       f"got {tokens.shape} / {positions.shape}")
    model = nnx.merge(graphdef, state.weights)
    cache = state.cache
    slots = cache.k.shape[2]
    key_valid = jnp.arange(slots, dtype=jnp.int32)[None, :] >= cache.start[:, None]  # [B, S]
    logits, cache = model.run_cached(tokens[:, None].astype(jnp.int32),
                                     positions[:, None].astype(jnp.int32), cache,
                                     cache.start + positions.astype(jnp.int32), key_valid)
    return logits[:, 0], DecodeState(weights=state.weights, cache=cache)

  return jax.jit(step_fn)


def forward(graphdef: nnx.GraphDef, weights: nnx.State, tokens: jax.Array,
            lengths: jax.Array) -> jax.Array:
  """Full forward pass over left-padded prompts (jitted).

  Args:
    graphdef: the model structure; static.
    weights: the model weights; traced.
    tokens: int32[B, T] left-padded sequences.
    lengths: int32[B] real tokens per row.

  Returns:
    float32[B, T, V]: `logits[b, t]` predicts the token after column t; padding columns are
    meaningless.
  """
  config = nnx.merge(graphdef, weights).config
  _check_prompt(config, tokens, lengths, config.max_len, "max_len")
  return _forward(graphdef, weights, tokens, lengths)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, weights, tokens, lengths):
  model = nnx.merge(graphdef, weights)
  width = tokens.shape[1]
  return model(tokens, prompt_positions(lengths, width), prompt_mask(lengths, width))
