# Copyright © 2026 turboquant_mlx contributors.

"""Batched generation on compressed caches (turboquant_mlx.batch).

The reference for a batch is each prompt generated alone, with mlx-lm's own
``generate_step`` and a single cache of the same preset: mlx-lm's ``BatchGenerator``
(and ``batch_generate``) on merged caches must give every row the same greedy tokens
and logits within float tolerance. Greedy tokens are compared up to the first step
where the single run's top two logits are closer than the tolerance (a near tie that
float rounding may decide either way); the logits are compared up to there too.
The batch's attention is checked against float64 attention over each row's
dequantized tokens, and merge / extract / filter / extend against the single caches.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step

from turboquant_mlx.batch import BatchTurboQuantKVCache
from turboquant_mlx.cache import TurboQuantKVCache, make_prompt_cache

from lm_helpers import build_model, make_tokenizer

LOGIT_ATOL = 2e-2  # batch vs alone: float rounding (and the rare code it flips)
# (Observed: up to ~1e-2 on the tiny random models, whose logits span ~20.)


def _alone(model, prompt, preset, n, prefill_step_size=2048):
    cache = make_prompt_cache(model, preset=preset)
    toks, logps = [], []
    for (t, lp), _ in zip(
        generate_step(
            mx.array(prompt),
            model,
            prompt_cache=cache,
            max_tokens=n,
            prefill_step_size=prefill_step_size,
        ),
        range(n),
    ):
        toks.append(int(t))
        logps.append(np.array(lp))
    return toks, logps


def _batched(model, prompts, preset, n, **kwargs):
    gen = BatchGenerator(model, stop_tokens=None, **kwargs)
    uids = gen.insert(
        prompts,
        [n] * len(prompts),
        caches=[make_prompt_cache(model, preset=preset) for _ in prompts],
    )
    return _generated(gen, uids)


def _generated(gen, uids):
    """Every row's tokens and logprobs until ``gen`` is done, in ``uids`` order."""
    toks = {u: [] for u in uids}
    logps = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            toks[r.uid].append(r.token)
            logps[r.uid].append(np.array(r.logprobs))
    gen.close()
    return [toks[u] for u in uids], [logps[u] for u in uids]


def _assert_rows_match(
    model, prompts, preset, n, batch_toks, batch_logps, prefill_step_size=2048, atol=LOGIT_ATOL
):
    """Each row against its prompt alone: logits within ``atol``, the same greedy
    tokens until a step where the alone run's top two logits are closer than twice
    the logits' difference there (a near tie the rounding decides; the row stops)."""
    compared = 0
    for i, p in enumerate(prompts):
        toks, logps = _alone(model, p, preset, n, prefill_step_size)
        assert len(batch_toks[i]) == n
        for s in range(n):
            msg = f"row {i} (length {len(p)}) step {s}"
            np.testing.assert_allclose(batch_logps[i][s], logps[s], atol=atol, rtol=0, err_msg=msg)
            if batch_toks[i][s] != toks[s]:
                top2 = np.sort(logps[s])[-2:]
                diff = np.abs(batch_logps[i][s] - logps[s]).max()
                assert top2[1] - top2[0] <= 2 * diff, msg
                break
            compared += 1
    assert compared >= n * len(prompts) // 2  # (no row stopped early but by rare ties)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n).tolist() for n in lengths]


# Lengths around the calibration (4 sinks + 32 tokens), the window (32 / 128) and 1.
@pytest.mark.parametrize(
    "name,preset,lengths,n,kwargs",
    [
        ("llama", "tq4", (5, 40, 70, 1), 45, {}),
        ("llama", "k4v3", (6, 150, 39), 30, {}),
        ("llama", "tq4", (5, 40, 70, 9, 2), 40, dict(prefill_batch_size=2)),  # joins mid-decode
        ("llama", "tq4", (60, 23), 20, dict(prefill_step_size=16)),  # prompts in chunks
        ("qwen3", "tq4", (7, 33, 80), 40, {}),
        ("qwen3_5", "tq4", (7, 34, 80), 40, {}),  # hybrid: ArraysCache layers batch as theirs
        ("qwen3_5", "k4v3", (12, 140), 20, {}),
        ("llama", "tq4-nowindow", (5, 40, 70), 40, {}),
        # No window, no levers: short prompts are read quantized, as single steps read them.
        ("llama", "tq4-plain", (5, 40, 70, 2), 20, {}),
        ("qwen3_5", "tq4-sink", (7, 33, 80), 12, {}),
    ],
)
def test_batch_generator_matches_alone(name, preset, lengths, n, kwargs):
    model = build_model(name)
    prompts = _prompts(lengths)
    toks, logps = _batched(model, prompts, preset, n, **kwargs)
    _assert_rows_match(
        model, prompts, preset, n, toks, logps, kwargs.get("prefill_step_size", 2048)
    )


def test_batch_generate_tokens_and_returned_caches():
    model = build_model("llama")
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tok = TokenizerWrapper(make_tokenizer())
    prompts = _prompts((5, 44, 70), seed=1)
    n = 12
    caches = [make_prompt_cache(model, preset="tq4") for _ in prompts]
    out = batch_generate(
        model,
        tok,
        prompts,
        prompt_caches=caches,
        max_tokens=n,
        return_token_ids=True,
        return_prompt_caches=True,
    )
    for i, p in enumerate(prompts):
        toks, _ = _alone(model, p, "tq4", n)
        got = out.token_ids[i]
        assert got == toks[: len(got)]
        # The returned caches are single caches holding the row's tokens.
        layer = out.caches[i][0]
        assert isinstance(layer, TurboQuantKVCache)
        assert layer.size() == len(p) + len(got) - 1 or layer.size() == len(p) + len(got)


def test_smollm2_batch_matches_alone():
    gguf = pytest.importorskip("turboquant_mlx.gguf")
    try:
        path = gguf.default_smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    model, tok = gguf.load_gguf(path)
    texts = ["The capital of France is", "Write a haiku about the sea. " * 6]
    prompts = [tok.encode(t) for t in texts]  # 5 and 49 tokens: one calibrates at once
    toks, logps = _batched(model, prompts, "tq4", 6)
    # The model computes in float32 but the caches store its keys in float16: where
    # the batch's float32 rounding differs, a key can round to the next float16 and
    # then to another code (observed up to 0.045 on logits spanning ~20).
    _assert_rows_match(model, prompts, "tq4", 6, toks, logps, atol=0.1)


# -- the batch cache against the single caches and float64 attention -------------------


def _filled_single(preset_kwargs, length, seed, H=2, D=64, queries=True):
    """A single cache holding ``length`` random tokens, fed as a prompt block and
    decode steps (so that it calibrates as generation would)."""
    c = TurboQuantKVCache(**preset_kwargs)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 1, H, length, D)).astype(np.float32)
    first = max(1, length - 3)
    c.update_and_fetch(mx.array(x[0, :, :, :first]), mx.array(x[1, :, :, :first]))
    if queries:
        c.attention(
            mx.array(rng.standard_normal((1, 2 * H, first, D)), mx.float32),
            0.125,
            "causal" if first > 1 else None,
        )
    for t in range(first, length):
        c.update_and_fetch(mx.array(x[0, :, :, t : t + 1]), mx.array(x[1, :, :, t : t + 1]))
        if queries:
            c.attention(mx.array(rng.standard_normal((1, 2 * H, 1, D)), mx.float32), 0.125)
    return c


TQ4 = dict(key_bits=4, value_bits=4, fp16_sink_tokens=4, fp16_recent_tokens=32, center=True)
K4V3 = dict(key_bits=4, value_bits=3, fp16_sink_tokens=4, fp16_recent_tokens=128, center=True)
PLAIN = dict(key_bits=3, value_bits=3)


def _f64_attention(q, k, v, scale):
    """float64 attention of one row's queries ``(Hq, L, D)`` over ``(H, N, D)``."""
    Hq, H = q.shape[0], k.shape[0]
    k = np.repeat(k, Hq // H, axis=0)
    v = np.repeat(v, Hq // H, axis=0)
    s = np.einsum("hld,hnd->hln", q, k) * scale
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hln,hnd->hld", p, v)


def _single_kv(c):
    k, v = c.dequantized_keys_values(mx.float32)
    return np.array(k, np.float64)[0], np.array(v, np.float64)[0]


@pytest.mark.parametrize("cfg", [TQ4, K4V3, PLAIN], ids=["tq4", "k4v3", "k3v3-plain"])
def test_merge_attention_matches_float64_rows(cfg):
    lengths = (3, 41, 90, 170)
    singles = [_filled_single(cfg, n, seed=i) for i, n in enumerate(lengths)]
    refs = [_single_kv(c) for c in singles]
    batch = TurboQuantKVCache.merge(singles)
    assert isinstance(batch, BatchTurboQuantKVCache)
    assert batch.left_padding.tolist() == [max(lengths) - n for n in lengths]
    assert batch.offset.tolist() == list(lengths)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((len(lengths), 4, 1, 64)).astype(np.float32)
    out = np.array(batch.attention(mx.array(q), 0.125, None))
    for b, (k, v) in enumerate(refs):
        want = _f64_attention(q[b].astype(np.float64), k, v, 0.125)
        np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=1e-4)
        # And the single cache's own attention.
        one = np.array(singles[b].attention(mx.array(q[b : b + 1]), 0.125, None))
        np.testing.assert_allclose(out[b], one[0], atol=2e-5, rtol=1e-4)


def test_prompt_block_scores_go_in_chunks_within_the_budget():
    # A prompt block over the rows' history materializes its scores; within
    # prefill_budget_bytes they go in query chunks, with the same output as one chunk.
    lengths = (41, 170, 300)
    singles = [_filled_single(TQ4, n, seed=20 + i) for i, n in enumerate(lengths)]
    rng = np.random.default_rng(9)
    L = 24
    k = mx.array(rng.standard_normal((3, 2, L, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((3, 2, L, 64)).astype(np.float32))
    q = mx.array(rng.standard_normal((3, 4, L, 64)).astype(np.float32))
    outs = []
    for budget in (1 << 30, 3 * 4 * 3 * 4 * 400 * 5):  # one chunk; chunks of ~5 queries
        batch = TurboQuantKVCache.merge(copy.deepcopy(singles))
        batch.prefill_budget_bytes = budget
        batch.update_and_fetch(k, v)
        outs.append(np.array(batch.attention(q, 0.125, "causal")))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-6, rtol=1e-5)


def test_dense_attention_in_query_chunks_matches_float64():
    from turboquant_mlx.attention import dense_attention

    rng = np.random.default_rng(4)
    B, Hq, H, L, N, D = 2, 4, 2, 13, 50, 32
    q = rng.standard_normal((B, Hq, L, D))
    k = rng.standard_normal((B, H, N, D))
    v = rng.standard_normal((B, H, N, D))
    keep = rng.random((B, 1, L, N)) < 0.8
    keep[..., 0] = True
    for mask in (keep, keep[:, :, :1]):  # per query, and the same for every query
        out, lse = dense_attention(
            mx.array(q, mx.float32),
            mx.array(k, mx.float32),
            mx.array(v, mx.float32),
            0.2,
            mx.array(mask),
            max_score_bytes=B * Hq * N * 4 * 3 * 4,
        )  # 4 queries
        m = np.broadcast_to(mask, (B, Hq, L, N))
        s = np.einsum("bhld,bhnd->bhln", q, np.repeat(k, 2, axis=1)) * 0.2
        s = np.where(m, s, -np.inf)
        want_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
        p = np.exp(s - want_lse[..., None])
        want = np.einsum("bhln,bhnd->bhld", p, np.repeat(v, 2, axis=1))
        np.testing.assert_allclose(np.array(out), want, atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(np.array(lse), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("held,block", [(5, 6), (1, 8), (3, 4)])
def test_short_block_over_fewer_compressed_columns_than_queries(held, block):
    # A verification-sized block longer than the compressed history (a prompt-cache
    # entry continued in a batch): the op needs kv_len >= queries, so the batch reads
    # those columns decoded, and agrees with the single cache.
    rng = np.random.default_rng(held * 10 + block)
    single = TurboQuantKVCache(**PLAIN)
    k, v = (mx.array(rng.standard_normal((1, 2, held, 64)).astype(np.float32)) for _ in "kv")
    single.update_and_fetch(k, v)
    batch = TurboQuantKVCache.merge([copy.deepcopy(single)])
    k, v = (mx.array(rng.standard_normal((1, 2, block, 64)).astype(np.float32)) for _ in "kv")
    q = mx.array(rng.standard_normal((1, 4, block, 64)).astype(np.float32))
    batch.update_and_fetch(k, v)
    single.update_and_fetch(k, v)
    out = np.array(batch.attention(q, 0.125, "causal"))
    want = np.array(single.attention(q, 0.125, "causal"))
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cfg", [TQ4, PLAIN], ids=["tq4", "k3v3-plain"])
def test_merge_extract_round_trip_and_decode(cfg):
    lengths = (2, 37, 75)
    singles = [_filled_single(cfg, n, seed=10 + i) for i, n in enumerate(lengths)]
    batch = TurboQuantKVCache.merge(copy.deepcopy(singles))
    for b, c in enumerate(singles):
        e = batch.extract(b)
        assert e.size() == c.size() and e.calibrated == c.calibrated
        for x, y in zip(_single_kv(e), _single_kv(c)):
            np.testing.assert_array_equal(x, y)
    # Decode steps on the batch and on the singles see the same tokens.
    rng = np.random.default_rng(3)
    for step in range(40):
        k = rng.standard_normal((3, 2, 1, 64)).astype(np.float32)
        v = rng.standard_normal((3, 2, 1, 64)).astype(np.float32)
        q = rng.standard_normal((3, 4, 1, 64)).astype(np.float32)
        batch.update_and_fetch(mx.array(k), mx.array(v))
        out = np.array(batch.attention(mx.array(q), 0.125, None))
        for b, c in enumerate(singles):
            c.update_and_fetch(mx.array(k[b : b + 1]), mx.array(v[b : b + 1]))
            one = np.array(c.attention(mx.array(q[b : b + 1]), 0.125, None))
            np.testing.assert_allclose(
                out[b], one[0], atol=2e-5, rtol=1e-4, err_msg=f"row {b} step {step}"
            )
    for b, c in enumerate(singles):
        e = batch.extract(b)
        assert e.size() == c.size() and e.calibrated == c.calibrated
        for x, y in zip(_single_kv(e), _single_kv(c)):
            np.testing.assert_array_equal(x, y)


def test_filter_and_extend_keep_rows():
    cfg = TQ4
    singles = [_filled_single(cfg, n, seed=20 + i) for i, n in enumerate((50, 8, 120, 36))]
    refs = [_single_kv(c) for c in singles]
    a = TurboQuantKVCache.merge(singles[:2])
    b = TurboQuantKVCache.merge(singles[2:])
    a.extend(b)
    assert a.offset.tolist() == [50, 8, 120, 36]
    for i, ref in enumerate(refs):
        for x, y in zip(_single_kv(a.extract(i)), ref):
            np.testing.assert_array_equal(x, y)
    a.filter([3, 0])
    assert a.offset.tolist() == [36, 50]
    assert a.size() == 50  # the columns only row 2 needed are gone
    for i, j in enumerate((3, 0)):
        for x, y in zip(_single_kv(a.extract(i)), refs[j]):
            np.testing.assert_array_equal(x, y)
    # Extending with an empty batch adds rows with nothing in them.
    a.extend(TurboQuantKVCache.merge([TurboQuantKVCache(**cfg)]))
    assert a.offset.tolist() == [36, 50, 0]
    assert a.extract(2).empty()


def test_trim_is_exact_within_rollback():
    singles = [_filled_single(TQ4, n, seed=30 + i) for i, n in enumerate((60, 90))]
    batch = TurboQuantKVCache.merge(copy.deepcopy(singles))
    rng = np.random.default_rng(5)
    before = [_single_kv(batch.extract(b)) for b in range(2)]
    for _ in range(5):
        batch.update_and_fetch(
            mx.array(rng.standard_normal((2, 2, 1, 64)), mx.float32),
            mx.array(rng.standard_normal((2, 2, 1, 64)), mx.float32),
        )
        batch.attention(mx.array(rng.standard_normal((2, 4, 1, 64)), mx.float32), 0.125)
    assert batch.trim(5) == 5
    for b in range(2):
        for x, y in zip(_single_kv(batch.extract(b)), before[b]):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("cut", [20, 60])
def test_merge_takes_caches_trimmed_beyond_rollback(cut):
    # A prompt-cache entry trimmed back to a shared prefix by more than its rollback
    # window holds compressed tokens where the window should be; the single cache reads
    # them as stored, and so does the batch (decoded into the row's fp16 columns, so
    # only their fp16 rounding differs). Then both decode alike.
    singles = [_filled_single(TQ4, 90, seed=20), _filled_single(TQ4, 170, seed=21)]
    assert singles[1].trim(cut) == cut
    batch = TurboQuantKVCache.merge(copy.deepcopy(singles))
    rng = np.random.default_rng(5)
    for step in range(12):
        q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
        out = np.array(batch.attention(mx.array(q), 0.125, None))
        for b, c in enumerate(singles):
            one = np.array(c.attention(mx.array(q[b : b + 1]), 0.125, None))
            np.testing.assert_allclose(
                out[b], one[0], atol=3e-3, rtol=1e-2, err_msg=f"row {b} step {step}"
            )
        k = rng.standard_normal((2, 2, 1, 64)).astype(np.float32)
        v = rng.standard_normal((2, 2, 1, 64)).astype(np.float32)
        batch.update_and_fetch(mx.array(k), mx.array(v))
        for b, c in enumerate(singles):
            c.update_and_fetch(mx.array(k[b : b + 1]), mx.array(v[b : b + 1]))


def test_merge_refusals():
    with pytest.raises(ValueError, match="query_aware_keys"):
        TurboQuantKVCache.merge([TurboQuantKVCache(3, 3, center=True, query_aware_keys=True)])
    with pytest.raises(ValueError, match="different settings"):
        TurboQuantKVCache.merge([TurboQuantKVCache(4, 4), TurboQuantKVCache(4, 3)])
    c = TurboQuantKVCache(4, 4)
    c.update_and_fetch(mx.zeros((1, 2, 3, 96)), mx.zeros((1, 2, 3, 96)))
    with pytest.raises(ValueError, match="head dim 96"):
        TurboQuantKVCache.merge([c])


def test_deepcopy_twins_decode_apart():
    """A deep copy (mlx-lm's split of a prompt batch) shares the buffers: the two
    batches then decode different tokens, each as its rows' single caches would."""
    singles = [_filled_single(TQ4, n, seed=40 + i) for i, n in enumerate((45, 80))]
    refs = [copy.deepcopy(singles), copy.deepcopy(singles)]
    batch = TurboQuantKVCache.merge(singles)
    mx.eval(batch.state)
    twins = [batch, copy.deepcopy(batch)]
    rng = np.random.default_rng(9)
    for _ in range(40):  # (tokens leave the window: both append compressed tokens)
        for cache, ref in zip(twins, refs):
            k = rng.standard_normal((2, 2, 1, 64)).astype(np.float32)
            v = rng.standard_normal((2, 2, 1, 64)).astype(np.float32)
            q = mx.array(rng.standard_normal((2, 4, 1, 64)), mx.float32)
            cache.update_and_fetch(mx.array(k), mx.array(v))
            cache.attention(q, 0.125)
            for b, c in enumerate(ref):
                c.update_and_fetch(mx.array(k[b : b + 1]), mx.array(v[b : b + 1]))
                c.attention(q[b : b + 1], 0.125)
        mx.eval(twins[0].state, twins[1].state)  # (interleaved writes, if shared)
    for cache, ref in zip(twins, refs):
        for b in range(2):
            for x, y in zip(_single_kv(cache.extract(b)), _single_kv(ref[b])):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("preset", ["tq4", "k4v3"])
def test_batch_continues_caches_with_history(preset):
    """Prompt caches that already hold a prefix (a prompt cache's reuse) merge with
    their compressed tokens and continue as each would alone."""
    model = build_model("llama")
    prefixes = _prompts((50, 7, 150), seed=3)
    suffixes = _prompts((12, 30, 10), seed=4)
    n = 12
    filled = []
    for p in prefixes:
        cache = make_prompt_cache(model, preset=preset)
        model(mx.array(p)[None], cache=cache)
        filled.append(cache)
    gen = BatchGenerator(model, stop_tokens=None)
    uids = gen.insert(suffixes, [n] * 3, caches=copy.deepcopy(filled))
    toks, logps = _generated(gen, uids)
    for i in range(len(uids)):
        cache = copy.deepcopy(filled[i])
        alone = [
            (int(t), np.array(lp))
            for (t, lp), _ in zip(
                generate_step(mx.array(suffixes[i]), model, prompt_cache=cache, max_tokens=n),
                range(n),
            )
        ]
        for s, (t, lp) in enumerate(alone):
            msg = f"row {i} step {s}"
            np.testing.assert_allclose(logps[i][s], lp, atol=LOGIT_ATOL, rtol=0, err_msg=msg)
            if toks[i][s] != t:
                top2 = np.sort(lp)[-2:]
                assert top2[1] - top2[0] <= 2 * np.abs(logps[i][s] - lp).max(), msg
                break


def test_left_padding_prepare_matches_singles():
    """A batch prepared with left padding (mlx-lm's other way of batching prompts)
    ignores the padded columns, whatever they hold."""
    cfg = TQ4
    lengths = (50, 20)
    rng = np.random.default_rng(11)
    L = max(lengths)
    k = rng.standard_normal((2, 2, L, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, L, 64)).astype(np.float32)
    k[1, :, : L - lengths[1]] = np.nan  # padding: never read, never quantized
    batch = TurboQuantKVCache.merge([TurboQuantKVCache(**cfg) for _ in lengths])
    batch.prepare(left_padding=[L - n for n in lengths])
    batch.update_and_fetch(mx.array(k), mx.array(v))
    q = rng.standard_normal((2, 4, L, 64)).astype(np.float32)
    out = np.array(batch.attention(mx.array(q), 0.125, "causal"))
    assert batch.offset.tolist() == list(lengths)
    for b, n in enumerate(lengths):
        c = TurboQuantKVCache(**cfg)
        c.update_and_fetch(mx.array(k[b : b + 1, :, L - n :]), mx.array(v[b : b + 1, :, L - n :]))
        one = np.array(c.attention(mx.array(q[b : b + 1, :, L - n :]), 0.125, "causal"))
        np.testing.assert_allclose(out[b, :, L - n :], one[0], atol=2e-5, rtol=1e-4)
    # Decode steps after it, against the same singles continued.
    for b, n in enumerate(lengths):
        for x, y in zip(_single_kv(batch.extract(b)), _single_kv(_single_like(cfg, k, v, b, n))):
            np.testing.assert_array_equal(x, y)


def _single_like(cfg, k, v, b, n):
    c = TurboQuantKVCache(**cfg)
    L = k.shape[2]
    c.update_and_fetch(mx.array(k[b : b + 1, :, L - n :]), mx.array(v[b : b + 1, :, L - n :]))
    c.attention(mx.zeros((1, 4, n, 64)), 0.125, "causal")
    return c


def test_update_refuses_non_finite_tokens():
    batch = TurboQuantKVCache.merge(
        [_filled_single(TQ4, n, seed=50 + i) for i, n in enumerate((40, 12))]
    )
    before = [_single_kv(batch.extract(b)) for b in range(2)]
    k = np.zeros((2, 2, 1, 64), np.float32)
    k[1, 0, 0, 3] = np.inf
    with pytest.raises(ValueError, match="not finite"):
        batch.update_and_fetch(mx.array(k), mx.zeros((2, 2, 1, 64)))
    assert batch.offset.tolist() == [40, 12]
    for b in range(2):
        for x, y in zip(_single_kv(batch.extract(b)), before[b]):
            np.testing.assert_array_equal(x, y)
