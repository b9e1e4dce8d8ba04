# Copyright © 2026 turboquant_mlx contributors.

"""Tiny random-weight mlx-lm models, an offline byte-level tokenizer, and an
independent reference cache for the integration tests.

The reference, :class:`DequantizedReferenceCache`, is a plain uncompressed cache:
it keeps every token (rounded to 16 bits, as the cache stores them) and, on each
call, hands mlx-lm's own attention the keys and values that a TurboQuant cache with
the same settings must be showing at that moment -- fp16 for sink and window
positions, and for the
rest the NumPy reference codec's reconstruction ``R^T (scale * c[code])`` of the
token (rotation in float64 from ``Rotation.matrix()``). It shares no code with
the cache or the ops besides the rotation's definition and the codebook.
"""

import importlib
import json
import os

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from turboquant_mlx import codebook, reference
from turboquant_mlx.cache import TurboQuantKVCache, layer_seed
from turboquant_mlx.rotation import Rotation

VOCAB = 260  # 256 byte tokens + specials, see make_tokenizer

CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=VOCAB, tie_word_embeddings=True,
    ),
    "llama_d128": dict(
        model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, rms_norm_eps=1e-5,
        vocab_size=VOCAB, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
        vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "qwen3_5": dict(
        model_type="qwen3_5", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32, full_attention_interval=2,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=VOCAB,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-6,
        rope_theta=10000.0, partial_rotary_factor=0.25, max_position_embeddings=4096,
        full_attention_interval=2,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=128, num_hidden_layers=4,
        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        vocab_size=VOCAB, sliding_window=16, sliding_window_pattern=2,
        query_pre_attn_scalar=64,
    ),
}


def build_model(name="llama", seed=0, **overrides):
    """A random-weight mlx-lm model (float32) from one of :data:`CONFIGS`."""
    config = dict(CONFIGS[name], **overrides)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger weights than the default init make attention distributions sharper, so
    # that errors in the cache show up in the logits.
    params = model.parameters()
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p * 2.0 if p.ndim == 2 else p, params))
    mx.eval(model.parameters())
    model.eval()
    return model


def make_tokenizer():
    """An offline byte-level tokenizer (256 byte tokens + <eos>), as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def save_model_dir(model, config_name, path, **overrides):
    """Writes an mlx-lm model directory (config, weights, tokenizer) for ``mlx_lm.load``."""
    from mlx.utils import tree_flatten

    os.makedirs(path, exist_ok=True)
    config = dict(CONFIGS[config_name], **overrides)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    mx.save_safetensors(
        os.path.join(path, "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    make_tokenizer().save_pretrained(path)


class DequantizedReferenceCache(_BaseCache):
    """Uncompressed cache showing attention what a TurboQuant cache must show (see doc)."""

    def __init__(self, key_bits, value_bits, seed, fp16_sink_tokens=0, fp16_recent_tokens=0):
        self.key_bits, self.value_bits = key_bits, value_bits
        self.seed = seed
        self.sinks, self.recent = fp16_sink_tokens, fp16_recent_tokens
        self.offset = 0
        self.k = self.v = self.k_hat = self.v_hat = None

    def _reconstruct(self, x, bits):
        D = x.shape[-1]
        R = Rotation(D, self.seed).matrix()
        c = codebook.lloyd_max_centroids(D, bits).astype(np.float32)
        y = reference.rotate(x, R).astype(np.float32)
        codes, scales = reference.quantize(y, c, bits)
        return reference.unrotate(reference.dequantize(codes, scales, c), R).astype(np.float32)

    def update_and_fetch(self, keys, values):
        # The cache stores (and quantizes) tokens rounded to its 16-bit window dtype.
        half = keys.dtype if keys.dtype in (mx.float16, mx.bfloat16) else mx.float16
        k = np.array(keys.astype(half).astype(mx.float32))
        v = np.array(values.astype(half).astype(mx.float32))
        kh, vh = self._reconstruct(k, self.key_bits), self._reconstruct(v, self.value_bits)
        cat = lambda a, b: b if a is None else np.concatenate([a, b], axis=2)
        self.k, self.v = cat(self.k, k), cat(self.v, v)
        self.k_hat, self.v_hat = cat(self.k_hat, kh), cat(self.v_hat, vh)
        self.offset += keys.shape[2]
        pos = np.arange(self.offset)
        exact = (pos < self.sinks) | (pos >= max(self.sinks, self.offset - self.recent))
        sel = exact[None, None, :, None]
        K = np.where(sel, self.k, self.k_hat)
        V = np.where(sel, self.v, self.v_hat)
        return mx.array(K).astype(keys.dtype), mx.array(V).astype(values.dtype)

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    @property
    def state(self):
        return []

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(n, self.offset)
        self.offset -= n
        for name in ("k", "v", "k_hat", "v_hat"):
            setattr(self, name, getattr(self, name)[:, :, : self.offset])
        return n

    def empty(self):
        return self.k is None

    @property
    def nbytes(self):
        return 0


def reference_caches(model, key_bits, value_bits, seed=0, fp16_sink_tokens=0,
                     fp16_recent_tokens=0, fp16_layers=()):
    """Reference caches for every layer of a plain (all full-attention) model."""
    return [
        KVCache() if i in fp16_layers else DequantizedReferenceCache(
            key_bits, value_bits, layer_seed(seed, i), fp16_sink_tokens, fp16_recent_tokens
        )
        for i in range(len(model.layers))
    ]


class ShadowCache(TurboQuantKVCache):
    """A TurboQuant cache that also runs the reference on the identical inputs.

    Every attention call inside a real model computes both the compressed result and
    mlx-lm's attention over the reference cache's keys and values for the same
    queries, and records the largest difference in ``diffs`` -- a per-layer, per-call
    check that is immune to the two paths drifting apart across layers.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reference = DequantizedReferenceCache(
            self.key_bits, self.value_bits, self.seed, self.fp16_sink_tokens,
            self.fp16_recent_tokens,
        )
        self.diffs = []

    def update_and_fetch(self, keys, values):
        self._ref_kv = self.reference.update_and_fetch(keys, values)
        return super().update_and_fetch(keys, values)

    def trim(self, n):
        self.reference.trim(n)
        return super().trim(n)

    def attention(self, queries, scale, mask=None, sinks=None):
        out = super().attention(queries, scale, mask, sinks)
        K, V = self._ref_kv
        want = mx.fast.scaled_dot_product_attention(
            queries, K, V, scale=scale, mask=mask, sinks=sinks
        )
        self.diffs.append((queries.shape[2], float(mx.abs(out - want).max())))
        return out


def shadow_caches(model, seed=0, fp16_layers=(), **cfg):
    return [
        KVCache() if i in fp16_layers else ShadowCache(seed=layer_seed(seed, i), **cfg)
        for i in range(len(model.layers))
    ]
