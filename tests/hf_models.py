"""Tiny random-weight models of transformers' Flax families (GPT-2, Llama, Gemma) and a tiny
byte-level BPE tokenizer, built here: nothing is downloaded. Shared by test_transformers_models
(hand-written step functions) and test_adapters (`jaxdecode.adapters`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import transformers  # the callers skip without it (pytest.importorskip)

FAMILIES = ("gpt2", "llama", "gemma")


def config(family, vocab, positions, eos, *, seed_layers=2):
  """A tiny config of `family` (2 layers, width 32) with `vocab` ids and `positions`."""
  common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos)
  if family == "gpt2":
    return transformers.GPT2Config(n_layer=seed_layers, n_embd=32, n_head=2,
                                   n_positions=positions, **common)
  cls = transformers.LlamaConfig if family == "llama" else transformers.GemmaConfig
  extra = {} if family == "llama" else dict(head_dim=8)
  return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=seed_layers,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
             **common, **extra)


def random_params(model, seed=0):
  """Weights of the model's own structure (`init_weights`, shapes only), drawn with NumPy:
  norms' scales near 1, biases near 0, matrices large enough that the logits are not flat."""
  shapes = jax.eval_shape(functools.partial(model.init_weights, jax.random.key(0), (1, 1)))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    noise = rng.standard_normal(leaf.shape).astype(np.float32)
    if leaf.ndim == 1:
      return (1.0 + 0.1 * noise) if "scale" in name or "weight" in name else 0.1 * noise
    return (0.4 if "embedding" in name else 0.2) * noise

  return jax.tree_util.tree_map_with_path(draw, shapes)


_CLASSES = {"gpt2": "FlaxGPT2LMHeadModel", "llama": "FlaxLlamaForCausalLM",
            "gemma": "FlaxGemmaForCausalLM"}


def model(family, vocab, positions, eos, *, dtype=jnp.float32, seed=0, layers=2):
  """(model, params): `family`'s Flax causal LM without an init pass, random weights."""
  cls = getattr(transformers, _CLASSES[family])
  with jax.numpy_rank_promotion("allow"):  # transformers' Flax code relies on it
    built = cls(config(family, vocab, positions, eos, seed_layers=layers), dtype=dtype,
                _do_init=False)
    params = random_params(built, seed)
  if dtype != jnp.float32:
    params = jax.tree.map(lambda p: p.astype(dtype), params)
  return built, params


TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog",
         '{"name": "ada", "ok": true, "n": 12}', "stop here. and go on", "true false null"]


def tokenizer(vocab=280, eos="<eos>"):
  """A byte-level BPE tokenizer trained on a few strings (256 bytes, merges, then `eos` as a
  special token unless None) as a transformers `PreTrainedTokenizerFast`."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab, special_tokens=[eos] if eos else [], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXTS * 3, trainer)
  kwargs = {"eos_token": eos} if eos else {}
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
