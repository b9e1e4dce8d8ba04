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

With the levers (``center``, ``query_aware_keys``) the reference re-implements, in
float64 NumPy, their calibration rule (docs/ARCHITECTURE.md: every non-sink token held
unquantized until the first attention call that finds ``calibration_tokens`` of them,
query energies of the positions ``>= fp16_sink_tokens`` accumulated until then) and
reconstructs a quantized token as ``R^T(codec(R a (x - mu))) / a + mu``. Its queries
come through :meth:`DequantizedReferenceCache.attend`; inside a model, use
:func:`route_reference_attention` so that mlx-lm's attention reaches it.

A decode or verification block (at most ``DECODE_MAX_QUERIES`` queries) is answered as
single-token steps at its positions would be: query by query, each seeing the tokens
before ``p + 1 - fp16_recent_tokens`` quantized, with the calibration at the position
where the count of non-sink tokens reaches ``calibration_tokens``; a trim takes back the
trimmed positions' query energies and a calibration that used trimmed tokens.
"""

import contextlib
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
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
    "llama_d128": dict(
        model_type="llama",
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "qwen3_5": dict(
        model_type="qwen3_5",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        full_attention_interval=2,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        full_attention_interval=2,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB,
        sliding_window=16,
        sliding_window_pattern=2,
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


def reference_key_scale(q_energy, k_energy, pairing="half", rope_dims=0, limit=8.0):
    """NumPy (float64) key scale ``a`` from mean query / key channel energies ``(..., D)``."""

    def pair_mean(e):
        e = np.array(e, dtype=np.float64)
        out = e.copy()
        D = e.shape[-1]
        d = min(rope_dims or D, D)
        h = d // 2
        for i in range(h):
            j, k = (i, i + h) if pairing == "half" else (2 * i, 2 * i + 1)
            if pairing == "none":
                break
            out[..., j] = out[..., k] = 0.5 * (e[..., j] + e[..., k])
        return out

    sq, sk = pair_mean(q_energy), pair_mean(k_energy)
    sq = sq + 1e-3 * sq.mean(-1, keepdims=True) + 1e-30
    sk = sk + 1e-3 * sk.mean(-1, keepdims=True) + 1e-30
    r = np.sqrt(sq / sk)
    a2 = np.clip(r / r.mean(-1, keepdims=True), 1 / limit**2, limit**2)
    return np.sqrt(a2)


# TurboQuantKVCache.decode_max_queries: larger blocks are prefill blocks.
DECODE_MAX_QUERIES = 8


def row_mask(mask, L, i, pos, p):
    """The mask of row ``i`` (position ``p``) of an ``L``-query block, for attention of
    that row alone over keys at positions ``pos``."""
    if isinstance(mask, str):
        return mx.array(pos <= p)[None]
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == L:
        return mask[..., i : i + 1, :]
    return mask


class DequantizedReferenceCache(_BaseCache):
    """Uncompressed cache showing attention what a TurboQuant cache must show (see doc)."""

    def __init__(
        self,
        key_bits,
        value_bits,
        seed,
        fp16_sink_tokens=0,
        fp16_recent_tokens=0,
        center=False,
        query_aware_keys=False,
        rope_pairing="half",
        rope_dims=0,
        calibration_tokens=32,
    ):
        self.key_bits, self.value_bits = key_bits, value_bits
        self.seed = seed
        self.sinks, self.recent = fp16_sink_tokens, fp16_recent_tokens
        self.center, self.query_aware_keys = center, query_aware_keys
        self.rope_pairing, self.rope_dims = rope_pairing, rope_dims
        self.calibration_tokens = calibration_tokens
        self.calibrated = not (center or query_aware_keys)
        self.mu_k = self.mu_v = self.a = None  # float64, (B, H, 1, D)
        self.q_energy, self.q_count = None, 0
        # (first position, energy, count) of each block or single position of queries
        # observed, so that a trim takes back those at trimmed positions.
        self.q_seen = []
        self.calibrated_until = None  # the calibration used the tokens before this
        self.offset = 0
        self.k = self.v = None
        # First position of the last update when it was a prefill block (more than
        # DECODE_MAX_QUERIES tokens): that block's own queries see it unquantized.
        self.fresh_from = None

    def _reconstruct(self, x, bits, mu=None, a=None):
        # A head dim the kernels do not take is zero-padded to the next multiple of 32
        # and coded there (TurboQuantKVCache's docstring).
        D = x.shape[-1]
        Dp = -(-D // 32) * 32
        R = Rotation(Dp, self.seed).matrix()
        c = codebook.lloyd_max_centroids(Dp, bits).astype(np.float32)
        x = np.asarray(x, np.float64)
        if mu is not None:
            x = x - mu
        if a is not None:
            x = x * a
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (Dp - D,))], axis=-1)
        y = reference.rotate(x, R).astype(np.float32)
        codes, scales = reference.quantize(y, c, bits)
        out = reference.unrotate(reference.dequantize(codes, scales, c), R)[..., :D]
        if a is not None:
            out = out / a
        if mu is not None:
            out = out + mu
        return out.astype(np.float32)

    @property
    def k_hat(self):
        return self._reconstruct(self.k, self.key_bits, self.mu_k, self.a)

    @property
    def v_hat(self):
        return self._reconstruct(self.v, self.value_bits, self.mu_v)

    def _held(self):
        return max(0, self.offset - self.sinks)

    def calibrate(self, end=None):
        """Calibrates from the non-sink tokens before ``end`` (default: all held)."""
        end = self.offset if end is None else end
        if end > self.sinks:
            k = self.k[:, :, self.sinks : end].astype(np.float64)
            if self.center:
                self.mu_k = k.mean(axis=2, keepdims=True)
                self.mu_v = (
                    self.v[:, :, self.sinks : end].astype(np.float64).mean(axis=2, keepdims=True)
                )
                k = k - self.mu_k
            if self.query_aware_keys and self.q_count:
                self.a = reference_key_scale(
                    self.q_energy / self.q_count,
                    (k * k).mean(axis=2),
                    self.rope_pairing,
                    self.rope_dims,
                )[:, :, None, :]
        self.calibrated = True
        self.calibrated_until = end

    def observe(self, queries, first):
        """Adds the energies of queries at positions ``[first, first + L)`` (those at
        positions ``>= sinks``)."""
        if not self.query_aware_keys:
            return
        B, n_q, L, D = queries.shape
        H = self.k.shape[1]
        keep = np.arange(first, first + L) >= self.sinks
        q = np.array(queries.astype(mx.float32), dtype=np.float64)[:, :, keep]
        if q.shape[2]:
            e = (q.reshape(B, H, n_q // H, -1, D) ** 2).sum(axis=(2, 3))
            self.q_seen.append((first + int(np.argmax(keep)), e, (n_q // H) * q.shape[2]))
            self._sum_queries()

    def _sum_queries(self):
        self.q_energy = sum(e for _, e, _ in self.q_seen) if self.q_seen else None
        self.q_count = sum(c for _, _, c in self.q_seen)

    def update_and_fetch(self, keys, values):
        if not self.calibrated and self._held() >= self.calibration_tokens:
            self.calibrate()
        # The cache stores (and quantizes) tokens rounded to its 16-bit window dtype.
        half = keys.dtype if keys.dtype in (mx.float16, mx.bfloat16) else mx.float16
        k = np.array(keys.astype(half).astype(mx.float32))
        v = np.array(values.astype(half).astype(mx.float32))
        cat = lambda a, b: b if a is None else np.concatenate([a, b], axis=2)  # noqa: E731
        self.k, self.v = cat(self.k, k), cat(self.v, v)
        self.fresh_from = self.offset if keys.shape[2] > DECODE_MAX_QUERIES else None
        self.offset += keys.shape[2]
        self._dtype = keys.dtype
        return self.fetch()

    def fetch(self, exact_from=None):
        """Keys and values as the compressed cache must show them now (positions from
        ``exact_from`` on unquantized)."""
        pos = np.arange(self.offset)
        if self.calibrated:
            exact = (pos < self.sinks) | (pos >= max(self.sinks, self.offset - self.recent))
            if exact_from is not None:
                exact |= pos >= exact_from
        else:
            exact = np.ones(self.offset, dtype=bool)
        sel = exact[None, None, :, None]
        K = np.where(sel, self.k, self.k_hat) if not exact.all() else self.k
        V = np.where(sel, self.v, self.v_hat) if not exact.all() else self.v
        return mx.array(K).astype(self._dtype), mx.array(V).astype(self._dtype)

    def attend(self, queries, scale, mask=None, sinks=None):
        """What the compressed cache's ``attention`` must return for these queries.

        A decode or verification block (at most DECODE_MAX_QUERIES queries) runs as
        single-token steps at its positions would: its queries are observed one
        position at a time, a calibration falls at the position where the cache holds
        ``calibration_tokens`` non-sink tokens (from those tokens and the queries up to
        it), and the query at position p sees the non-sink tokens before
        ``p + 1 - recent`` quantized and the others exact (before calibration: all
        exact)."""
        B, n_q, L, D = queries.shape
        first = self.offset - L
        if L > DECODE_MAX_QUERIES:
            if not self.calibrated:
                self.observe(queries, first)
                if self._held() >= self.calibration_tokens:
                    self.calibrate()
            fresh = self.fresh_from
            if fresh is not None and queries.shape[2] != self.offset - fresh:
                fresh = None  # not the block's own queries
            K, V = self.fetch(fresh)
            return mx.fast.scaled_dot_product_attention(
                queries, K, V, scale=scale, mask=mask, sinks=sinks
            )
        uncalibrated_rows = 0
        if not self.calibrated:
            uncalibrated_rows = L
            at = first + L - 1
            if self._held() >= self.calibration_tokens:
                at = min(max(self.sinks + self.calibration_tokens - 1, first), first + L - 1)
                uncalibrated_rows = at - first
            for i in range(at - first + 1):
                self.observe(queries[:, :, i : i + 1], first + i)
            if uncalibrated_rows < L:
                self.calibrate(end=at + 1)
        pos = np.arange(self.offset)
        k_hat, v_hat = (self.k_hat, self.v_hat) if self.calibrated else (self.k, self.v)
        outs = []
        for i in range(L):
            p = first + i
            if i < uncalibrated_rows:
                exact = np.ones(self.offset, dtype=bool)
            else:
                exact = (pos < self.sinks) | (
                    pos >= max(self.sinks, p + 1 - self.recent) if self.recent else False
                )
            sel = exact[None, None, :, None]
            K = mx.array(np.where(sel, self.k, k_hat)).astype(self._dtype)
            V = mx.array(np.where(sel, self.v, v_hat)).astype(self._dtype)
            outs.append(
                mx.fast.scaled_dot_product_attention(
                    queries[:, :, i : i + 1],
                    K,
                    V,
                    scale=scale,
                    mask=row_mask(mask, L, i, pos, p),
                    sinks=sinks,
                )
            )
        return mx.concatenate(outs, axis=2)

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
        self.fresh_from = None
        for name in ("k", "v"):
            setattr(self, name, getattr(self, name)[:, :, : self.offset])
        # Queries observed at trimmed positions are taken back, and a calibration that
        # used trimmed tokens is undone.
        self.q_seen = [x for x in self.q_seen if x[0] < self.offset]
        self._sum_queries()
        if self.calibrated_until is not None and self.offset < self.calibrated_until:
            self.calibrated, self.calibrated_until = False, None
            self.mu_k = self.mu_v = self.a = None
        return n

    def empty(self):
        return self.k is None

    @property
    def nbytes(self):
        return 0


def reference_caches(
    model,
    key_bits,
    value_bits,
    seed=0,
    fp16_sink_tokens=0,
    fp16_recent_tokens=0,
    fp16_layers=(),
    **levers,
):
    """Reference caches for every layer of a plain (all full-attention) model.

    ``levers``: ``center``, ``query_aware_keys``, ``rope_pairing``, ``rope_dims``,
    ``calibration_tokens`` (then run the model inside :func:`route_reference_attention`).
    """
    return [
        KVCache()
        if i in fp16_layers
        else DequantizedReferenceCache(
            key_bits,
            value_bits,
            layer_seed(seed, i),
            fp16_sink_tokens,
            fp16_recent_tokens,
            **levers,
        )
        for i in range(len(model.layers))
    ]


def preset_kwargs(preset, **overrides):
    """The reference-cache arguments of a preset's layout and levers (``overrides`` win)."""
    from turboquant_mlx.cache import get_preset

    p = get_preset(preset)
    kw = dict(
        fp16_sink_tokens=p.fp16_sink_tokens,
        fp16_recent_tokens=p.fp16_recent_tokens,
        center=p.center,
        query_aware_keys=p.query_aware_keys,
    )
    kw.update(overrides)
    return kw


@contextlib.contextmanager
def route_reference_attention():
    """Within the block, mlx-lm's attention on a DequantizedReferenceCache calls its
    ``attend`` (which sees the queries, as the compressed cache's calibration does)."""
    from turboquant_mlx import attention as tq_attention

    tq_attention.install_hook()
    original = tq_attention._original

    def route(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, DequantizedReferenceCache):
            return cache.attend(queries, scale, mask, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    tq_attention._original = route
    try:
        yield
    finally:
        tq_attention._original = original


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
            self.key_bits,
            self.value_bits,
            self.seed,
            self.fp16_sink_tokens,
            self.fp16_recent_tokens,
            self.center,
            self.query_aware_keys,
            self.rope_pairing,
            self.rope_dims,
            self.calibration_tokens,
        )
        self.diffs = []

    def update_and_fetch(self, keys, values):
        self.reference.update_and_fetch(keys, values)
        return super().update_and_fetch(keys, values)

    def trim(self, n):
        self.reference.trim(n)
        return super().trim(n)

    def attention(self, queries, scale, mask=None, sinks=None):
        out = super().attention(queries, scale, mask, sinks)
        want = self.reference.attend(queries, scale, mask, sinks)
        self.diffs.append((queries.shape[2], float(mx.abs(out - want).max())))
        return out


def shadow_caches(model, seed=0, fp16_layers=(), **cfg):
    from turboquant_mlx.attention import install_hook

    install_hook()
    return [
        KVCache() if i in fp16_layers else ShadowCache(seed=layer_seed(seed, i), **cfg)
        for i in range(len(model.layers))
    ]
