"""A small decoder-only transformer (Flax NNX) and the functions that decode with it.

The model: token embedding, `n_layers` pre-norm blocks (RMSNorm -> causal multi-head attention
with RoPE -> residual; RMSNorm -> GELU MLP -> residual), a final RMSNorm and an output projection
tied to the embedding. Everything is float32.

One code path, `Transformer.run`, serves prefill (the whole prompt, or any chunk of it), the
one-token decode step and the K-token step of speculative decoding: it writes the keys and values
of K tokens per row into the KV cache and attends over the cache. With `batch_invariant=True`
(the default) every matmul, norm and attention sum goes through `jaxdecode.models.numerics`, so a
row's logits at a position depend on that row's tokens alone, bit for bit: not on the batch
size, the row's slot, the other rows, the padding, the cache length, how many positions one call
computes, or how many devices a data-parallel batch is split over. `batch_invariant=False` is the
plain XLA formulation (for the cost comparison and as a negative control); the same weights
serve both (held-out losses agree to ~1e-9).

Cache layout: slot p of a row holds position p (prompts are right-padded, `jaxdecode.right_pad`).
A call with tokens [B, K] at positions[b] writes slots positions[b] .. positions[b] + K - 1 and
nothing else, and reads no slot beyond a query's own position, so a row is rolled back by its
position alone (speculative decoding) and padding never shifts a row's keys. One array per layer:
slicing a layer out of a stacked array made XLA copy it every step.

The context: RoPE is used only within the trained range; a position at or past `max_len` (or past
the cache) gives NaN logits under jit, and `generate` refuses such a request before it starts.

Weights are data: `graphdef, weights = nnx.split(model)`; the structure is static and the weights
travel as a pytree argument of the jitted functions (and inside `DecodeState`), so new weights
never recompile and are never baked into a program as constants.

Training uses `Transformer.__call__`: the whole sequence at once with plain, differentiable ops.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jaxdecode.prompts import right_pad
  >>> config = TransformerConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_len=64)
  >>> graphdef, weights = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  >>> tokens, lengths = right_pad([[256, 104, 105], [256, 33]], buckets=None)
  >>> logits, state = prefill(graphdef, weights, tokens, lengths, cache_length=8)
  >>> step_fn = make_step_fn(graphdef)
  >>> logits, state = step_fn(state, jnp.array([10, 10], jnp.int32), lengths)
  >>> logits.shape
  (2, 259)
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdecode import _checks
from jaxdecode.models import numerics


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Sizes of the transformer. Static: a new config compiles new programs.

  Attributes:
    vocab_size: number of token ids (259 = `ByteTokenizer.vocab_size`).
    d_model: width of the residual stream.
    n_layers: number of transformer blocks.
    n_heads: attention heads; `d_model / n_heads` must be an even integer (RoPE rotates pairs).
    d_ff: hidden width of the MLP.
    max_len: the longest sequence (prompt + generated tokens) the model was trained for; RoPE
      positions past it are refused.
    rope_base: base of the RoPE frequencies (> 1).
    batch_invariant: the inference numerics: invariant (True) or plain XLA (False). A runtime
      choice, not stored in checkpoints: the same weights serve both.
  """
  vocab_size: int = 259
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  d_ff: int = 1024
  max_len: int = 512
  rope_base: float = 10000.0
  batch_invariant: bool = True

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_len"):
      _checks.integer(name, getattr(self, name), low=1)
    if not (isinstance(self.rope_base, numbers.Real) and self.rope_base > 1):  # NaN fails too
      raise ValueError(f"rope_base must be a number > 1; got {self.rope_base!r}")
    _checks.boolean("batch_invariant", self.batch_invariant)
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model must be divisible by n_heads; got: {self.d_model} / "
                       f"{self.n_heads}")
    if self.head_dim % 2:
      raise ValueError(f"the head dimension d_model / n_heads must be even for RoPE; got: "
                       f"{self.d_model} / {self.n_heads} = {self.head_dim}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def sizes(self) -> dict:
    """The fields that define the weights (what a checkpoint stores)."""
    out = dataclasses.asdict(self)
    del out["batch_invariant"]
    return out


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer; slot p of a row holds position p.

  Attributes:
    k: a tuple of L float32[B, S, H, Dh] arrays, the keys (after RoPE).
    v: a tuple of L float32[B, S, H, Dh] arrays, the values.
  """
  k: tuple
  v: tuple


@flax.struct.dataclass
class DecodeState:
  """What the step function carries from step to step.

  Attributes:
    weights: the model weights (`nnx.split(model)[1]`), carried so that a jitted decode loop
      receives them as traced data rather than as constants.
    cache: the `KVCache`.
    blocks: with batch-invariant numerics, `Transformer.chain_blocks()`: the weights of every
      product in the layout the invariant products read, made once by `prefill` rather than
      at every step (None: each step makes them; the bits are the same either way). They are
      derived from `weights`: a state given other weights needs `blocks=None` too
      (`state.replace(weights=new, blocks=None)`), or the steps keep the old products.
  """
  weights: nnx.State
  cache: KVCache
  blocks: dict | None = None


# Each DecodeState leaf's batch axis, for `jaxdecode.beam_search(..., state_axes=...)`: the
# weights and their blocks are shared, every cache array is [B, S, H, Dh].
DECODE_STATE_AXES = DecodeState(weights=None, cache=KVCache(k=0, v=0), blocks=None)


def cache_slots(length: int) -> int:
  """The slots a cache of `length` positions holds: rounded up to a multiple of the attention
  chunk (64)."""
  return -(-length // numerics.CHUNK) * numerics.CHUNK


def init_cache(config: TransformerConfig, batch_size: int, length: int) -> KVCache:
  """An all-zero cache with room for `length` positions per row.

  Returns:
    A `KVCache` of `n_layers` arrays `[B, S, H, Dh]`, S = `cache_slots(length)`.
  """
  shape = (batch_size, cache_slots(length), config.n_heads, config.head_dim)
  return KVCache(k=tuple(jnp.zeros(shape, jnp.float32) for _ in range(config.n_layers)),
                 v=tuple(jnp.zeros(shape, jnp.float32) for _ in range(config.n_layers)))


class Attention(nnx.Module):
  """Causal multi-head self-attention with RoPE (its weights; `Transformer` runs it)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.qkv = nnx.Linear(config.d_model, 3 * config.d_model, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(config.d_model, config.d_model, use_bias=False, rngs=rngs)


class Block(nnx.Module):
  """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)) (its weights)."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
    self.attention = Attention(config, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
    self.mlp_in = nnx.Linear(config.d_model, config.d_ff, rngs=rngs)
    self.mlp_out = nnx.Linear(config.d_ff, config.d_model, rngs=rngs)


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

  def chain_blocks(self) -> dict:
    """The weight of every product in the layout of the invariant products
    (`numerics.chain_blocks`): a copy of the weights, made once per set of weights.

    Returns:
      `{"layers": ({"qkv", "out", "mlp_in", "mlp_out"}, ...), "logits": ...}`.
    """
    layers = tuple({name: numerics.chain_blocks(kernel) for name, kernel in (
        ("qkv", b.attention.qkv.kernel[...]), ("out", b.attention.out.kernel[...]),
        ("mlp_in", b.mlp_in.kernel[...]), ("mlp_out", b.mlp_out.kernel[...]))}
                   for b in self.blocks)
    return {"layers": layers, "logits": numerics.chain_blocks(self.embed.embedding[...].T)}

  def _block(self, block: Block, x, attend, invariant: bool, blocks: dict | None = None):
    """One pre-norm block; `attend(q, k, v)` does the attention (cached or whole-sequence);
    `blocks`: the block's entry of `chain_blocks()` (invariant only; None makes them here)."""
    cfg = self.config
    batch, width, _ = x.shape
    pre = blocks or {}
    h = numerics.rms_norm(x, block.attention_norm.scale[...], block.attention_norm.epsilon,
                          invariant=invariant)
    qkv = numerics.linear(h, block.attention.qkv.kernel[...], invariant=invariant,
                          blocks=pre.get("qkv"))
    qkv = qkv.reshape(batch, width, 3, cfg.n_heads, cfg.head_dim)
    att = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])  # [B, T, H, Dh]
    x = x + numerics.linear(att.reshape(batch, width, cfg.d_model),
                            block.attention.out.kernel[...], invariant=invariant,
                            blocks=pre.get("out"))
    h = numerics.rms_norm(x, block.mlp_norm.scale[...], block.mlp_norm.epsilon,
                          invariant=invariant)
    h = numerics.linear(h, block.mlp_in.kernel[...], block.mlp_in.bias[...], invariant=invariant,
                        blocks=pre.get("mlp_in"))
    h = numerics.linear(jax.nn.gelu(h), block.mlp_out.kernel[...], block.mlp_out.bias[...],
                        invariant=invariant, blocks=pre.get("mlp_out"))
    return x + h

  def _logits(self, x, invariant: bool, blocks=None):
    x = numerics.rms_norm(x, self.final_norm.scale[...], self.final_norm.epsilon,
                          invariant=invariant)
    return numerics.tied_logits(x, self.embed.embedding[...], invariant=invariant, blocks=blocks)

  def run(self, tokens: jax.Array, positions: jax.Array, cache: KVCache,
          blocks: dict | None = None):
    """The one inference pass: K tokens per row through the KV cache.

    `tokens[b, t]` has position `positions[b] + t`; its key and value go to that slot (a slot
    past the cache is not written). Query t attends to the row's slots 0 .. positions[b] + t.

    Args:
      tokens: int32[B, K].
      positions: int32[B], the position of `tokens[:, 0]`.
      cache: a `KVCache`.
      blocks: `chain_blocks()` of these weights, made ahead (batch-invariant numerics only;
        None makes them in this call: the same bits, one copy of the weights more per call).

    Returns:
      `(logits float32[B, K, V], cache)`; logits at a position past the cache or at or past
      `max_len` are NaN, so that an overflow is visible rather than silently wrong.
    """
    cfg = self.config
    invariant = cfg.batch_invariant
    if invariant and blocks is None:
      blocks = self.chain_blocks()
    batch, width = tokens.shape
    slots = cache.k[0].shape[1]
    q_pos = positions.astype(jnp.int32)[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, width))
    new_k, new_v = list(cache.k), list(cache.v)
    x = jnp.take(self.embed.embedding[...], tokens, axis=0)  # [B, K, D]
    for layer, block in enumerate(self.blocks):
      def attend(q, k, v, layer=layer):
        q = numerics.rope(q, q_pos, cfg.rope_base)
        k = numerics.rope(k, q_pos, cfg.rope_base)
        new_k[layer] = new_k[layer].at[rows, q_pos].set(k, mode="drop")
        new_v[layer] = new_v[layer].at[rows, q_pos].set(v, mode="drop")
        return numerics.attention(q, new_k[layer], new_v[layer], q_pos, invariant=invariant)
      x = self._block(block, x, attend, invariant,
                      blocks["layers"][layer] if invariant else None)
    logits = self._logits(x, invariant, blocks["logits"] if invariant else None)
    inside = (q_pos < slots) & (q_pos < cfg.max_len)
    logits = jnp.where(inside[:, :, None], logits, jnp.nan)
    return logits, KVCache(k=tuple(new_k), v=tuple(new_v))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Training's pass: whole sequences, plain differentiable ops, no cache.

    Args:
      tokens: int32[B, T], each row a sequence from position 0 (right padding, if any, only
        follows the real tokens and so changes none of their logits).

    Returns:
      float32[B, T, V] next-token logits at every position.
    """
    cfg = self.config
    width = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)

    def attend(q, k, v):
      return numerics.causal_attention(numerics.rope(q, positions, cfg.rope_base),
                                       numerics.rope(k, positions, cfg.rope_base), v)

    x = jnp.take(self.embed.embedding[...], tokens, axis=0)
    for block in self.blocks:
      x = self._block(block, x, attend, invariant=False)
    return self._logits(x, invariant=False)


def _check_prompt(config: TransformerConfig, tokens, lengths, max_width: int, max_name: str):
  """Eager checks of a right-padded batch; values are checked only when they are concrete."""
  if jnp.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"tokens must be an integer array [B, T]; got shape {jnp.shape(tokens)} "
                     f"of dtype {jnp.result_type(tokens)}")
  batch, width = jnp.shape(tokens)
  if jnp.shape(lengths) != (batch,):
    raise ValueError(f"lengths must have shape ({batch},), one per row of tokens; got "
                     f"{jnp.shape(lengths)}")
  if width > max_width:
    raise ValueError(f"the prompt width T = {width} is longer than {max_name} = {max_width}")
  if not _checks.is_traced(tokens):
    values = np.asarray(tokens)
    if values.size and (values.min() < 0 or values.max() >= config.vocab_size):
      raise ValueError(f"token ids must be in [0, {config.vocab_size}); got: min {values.min()} "
                       f"/ max {values.max()}")
  if not _checks.is_traced(lengths):
    values = np.asarray(lengths)
    if values.min() < 1 or values.max() > width:
      raise ValueError(f"lengths must be in [1, T = {width}]; got {values.tolist()}")


def prefill(graphdef: nnx.GraphDef, weights: nnx.State, tokens: jax.Array, lengths: jax.Array,
            *, cache_length: int):
  """Runs right-padded prompts through the model into a new cache.

  Args:
    graphdef: the model structure (`nnx.split(model)[0]`); static.
    weights: the model weights (`nnx.split(model)[1]`); traced.
    tokens: int32[B, T] right-padded prompts (`jaxdecode.right_pad`).
    lengths: int32[B], the number of real tokens of each row (1..T).
    cache_length: positions the cache must hold (static), T <= cache_length <= `max_len`: the
      prompt plus every token to generate (a token past it gets NaN logits).

  Returns:
    `(logits float32[B, V], state)`: each row's next-token logits (after its last real token)
    and a `DecodeState`. The first new token of row b has position `lengths[b]`.
  """
  config = nnx.merge(graphdef, weights).config
  cache_length = _checks.integer("cache_length", cache_length, low=1)
  if not config.max_len >= cache_length >= jnp.shape(tokens)[-1]:
    raise ValueError(f"cache_length must be between the prompt width T and max_len; got: "
                     f"{jnp.shape(tokens)[-1]} <= {cache_length} <= {config.max_len} is false")
  _check_prompt(config, tokens, lengths, cache_length, "cache_length")
  logits, cache, blocks = _prefill(graphdef, weights, jnp.asarray(tokens, jnp.int32),
                                   jnp.asarray(lengths, jnp.int32), cache_length=cache_length)
  return logits, DecodeState(weights=weights, cache=cache, blocks=blocks)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_length"))
def _prefill(graphdef, weights, tokens, lengths, *, cache_length):
  """Jitted `prefill`; returns `(logits [B, V], KVCache, chain blocks or None)`."""
  model = nnx.merge(graphdef, weights)
  batch = tokens.shape[0]
  cache, start = _opaque((init_cache(model.config, batch, cache_length),
                          jnp.zeros((batch,), jnp.int32)))
  blocks = model.chain_blocks() if model.config.batch_invariant else None
  logits, cache = model.run(tokens, start, cache, blocks)
  return jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0], cache, blocks


def make_step_fn(graphdef: nnx.GraphDef, *, mesh: jax.sharding.Mesh | None = None,
                 axis: str = "data"):
  """The jitted model step for `jaxdecode.decode` (one token per row) and for
  `jaxdecode.speculative_decode` (K tokens per row): the same function, `Transformer.run`.

  Build it once per model structure: each call of `make_step_fn` makes a new jitted function.

  Args:
    graphdef: the model structure (`nnx.split(model)[0]`).
    mesh: for a batch split over devices, the `jax.sharding.Mesh`; the step then runs under
      `jax.shard_map`, so every device runs the single-device program on its own rows. Put the
      state's cache on the mesh split by rows and its weights and `blocks` replicated.
    axis: the mesh axis the batch is split over.

  Returns:
    `step_fn(state, tokens, positions) -> (logits, state)`, pure, declaring
    `step_fn.position_limit(state)` (the positions the cache holds): tokens int32[B] give logits
    float32[B, V]; tokens int32[B, K] give logits float32[B, K, V], bitwise those of K
    single steps. `tokens[b, t]` has position `positions[b] + t`; slots past the cache are not
    written and their logits are NaN.
  """

  def run(weights, blocks, cache, tokens, positions):
    return nnx.merge(graphdef, weights).run(tokens, positions, cache, blocks)

  if mesh is not None:
    rows, shared = jax.sharding.PartitionSpec(axis), jax.sharding.PartitionSpec()
    run = jax.shard_map(run, mesh=mesh, in_specs=(shared, shared, rows, rows, rows),
                        out_specs=(rows, rows), check_vma=False)

  def step_fn(state: DecodeState, tokens: jax.Array, positions: jax.Array):
    batch = state.cache.k[0].shape[0]
    single = jnp.ndim(tokens) == 1
    if jnp.shape(tokens)[:1] != (batch,) or jnp.ndim(tokens) not in (1, 2) \
        or jnp.shape(positions) != (batch,):
      raise ValueError(f"tokens must have shape ({batch},) or ({batch}, K) and positions shape "
                       f"({batch},), one per cache row; got {jnp.shape(tokens)} / "
                       f"{jnp.shape(positions)}")
    tokens = jnp.asarray(tokens, jnp.int32)
    logits, cache = run(state.weights, state.blocks, state.cache,
                        tokens[:, None] if single else tokens, jnp.asarray(positions, jnp.int32))
    return (logits[:, 0] if single else logits), state.replace(cache=cache)

  jitted = jax.jit(step_fn)
  # `decode`, `beam_search`, `speculative_decode` and `stream` refuse a request that does not
  # fit the cache before running it (past it the logits are NaN).
  jitted.position_limit = functools.partial(position_limit, graphdef)
  return jitted


def position_limit(graphdef: nnx.GraphDef, state: DecodeState) -> int:
  """The positions a `DecodeState` of the model `graphdef` holds: its cache's slots, at most the
  model's `max_len` (RoPE's trained range)."""
  slots = jax.tree.leaves(state.cache.k)[0].shape[1]  # each layer's cache is [B, S, H, Dh]
  return min(slots, nnx.merge(graphdef, state.weights).config.max_len)


def forward(graphdef: nnx.GraphDef, weights: nnx.State, tokens: jax.Array,
            lengths: jax.Array) -> jax.Array:
  """The inference pass over whole right-padded sequences (jitted): `Transformer.run` with a
  fresh cache, so its logits are bitwise those of prefill and of the decode steps.

  Args:
    graphdef: the model structure; static.
    weights: the model weights; traced.
    tokens: int32[B, T] right-padded sequences.
    lengths: int32[B] real tokens per row.

  Returns:
    float32[B, T, V]: `logits[b, t]` predicts the token after position t; columns at or after
    `lengths[b]` are meaningless.
  """
  config = nnx.merge(graphdef, weights).config
  _check_prompt(config, tokens, lengths, config.max_len, "max_len")
  return _differentiable_forward(graphdef, weights, jnp.asarray(tokens, jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_forward(graphdef, weights, tokens):
  """`_forward`, differentiable in the weights: its values are the inference pass's (bitwise,
  differentiated or not); its backward is the plain training pass's (`Transformer.__call__`,
  plain products and a softmax attention, at the same weights and tokens). The inference pass
  itself has no reverse-mode derivative on CPU and TPU (its attention stops at the data's end,
  a while loop) and would backpropagate through elementwise product chains; the plain pass
  computes the same function up to float32 rounding (`TransformerConfig.batch_invariant`)."""
  return _forward(graphdef, weights, tokens)


def _differentiable_forward_fwd(graphdef, weights, tokens):
  return _forward(graphdef, weights, tokens), (weights, tokens)


def _differentiable_forward_bwd(graphdef, residuals, cotangent):
  weights, tokens = residuals
  _, pullback = jax.vjp(lambda w: nnx.merge(graphdef, w)(tokens), weights)
  return pullback(cotangent)[0], None


_differentiable_forward.defvjp(_differentiable_forward_fwd, _differentiable_forward_bwd)


@functools.lru_cache(maxsize=64)
def _forward_of(graphdef: nnx.GraphDef):
  def logits_fn(weights, tokens, lengths):
    return forward(graphdef, weights, tokens, lengths)
  return logits_fn


def forward_fn(graphdef: nnx.GraphDef, weights: nnx.State) -> jax.tree_util.Partial:
  """`forward` with this model bound: `logits_fn(tokens, lengths) -> logits`, the function
  `jaxdecode.score` takes. A `jax.tree_util.Partial` whose leaves are the weights, so they are
  traced (new weights, or weights under `jax.grad`, never recompile); one function per
  `graphdef`, so the compiled programs are reused.

  Example:
    >>> import jax, jaxdecode
    >>> from flax import nnx
    >>> model = Transformer(TransformerConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64,
    ...                                       max_len=64), rngs=nnx.Rngs(0))
    >>> graphdef, weights = nnx.split(model)
    >>> def loss(weights):
    ...   scores = jaxdecode.score(forward_fn(graphdef, weights), [[256, 104]], [2], [[105, 33]])
    ...   return -scores.processed.sum()
    >>> value, grads = jax.value_and_grad(loss)(weights)
    >>> bool(value > 0)
    True
  """
  return jax.tree_util.Partial(_forward_of(graphdef), weights)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, weights, tokens):
  model = nnx.merge(graphdef, weights)
  batch, width = tokens.shape
  cache, start = _opaque((init_cache(model.config, batch, width),
                          jnp.zeros((batch,), jnp.int32)))
  logits, _ = model.run(tokens, start, cache)
  return logits


def _opaque(values):
  """Values the compiler cannot see through. A prefill's fresh cache and zero positions are
  compile-time constants; XLA then simplifies the masks and the attention into another program
  than the decode step's (which gets them as data), and the logits' bits differed."""
  return jax.lax.optimization_barrier(values)
