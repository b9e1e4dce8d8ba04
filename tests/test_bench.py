# Copyright © 2026 turboquant_mlx contributors.

"""Helpers of the benchmarks in bench/ that their tables depend on."""

import math
import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from turboquant_mlx import _ext
from turboquant_mlx.cache import TurboQuantKVCache, make_prompt_cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import _long  # noqa: E402
import bench_batch  # noqa: E402
import bench_decode  # noqa: E402
import bench_prefill  # noqa: E402
import long_context  # noqa: E402


def _inplace_supported():
    return mx.default_device() == mx.cpu or _ext.gpu_backend() == "cuda"


def test_inplace_fp16_cache_equals_mlx_lm_cache_under_pipelining():
    # bench_decode's fp16:inplace baseline: the same contents as mlx-lm's KVCache, step
    # after step, while the previous steps' arrays are still referenced (as their
    # kernels hold them under pipelined decoding), and write_tokens never copies.
    if not _inplace_supported():
        pytest.skip("write_tokens has CPU and CUDA kernels")
    rng = np.random.default_rng(0)

    def tokens(n):
        k = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
        v = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
        return mx.array(k).astype(mx.float16), mx.array(v).astype(mx.float16)

    plain, inplace = KVCache(), bench_decode.InPlaceKVCache()
    held = []
    copies = _ext.buffer_copies()
    for n in [200] + [1] * 70:  # a prefill, then decode steps across a buffer growth
        k, v = tokens(n)
        a = plain.update_and_fetch(k, v)
        b = inplace.update_and_fetch(k, v)
        mx.async_eval(a, b)
        held.append(b)
        np.testing.assert_array_equal(np.array(a[0]), np.array(b[0]))
        np.testing.assert_array_equal(np.array(a[1]), np.array(b[1]))
    assert _ext.buffer_copies() == copies
    # Arrays of earlier steps still show their own tokens.
    np.testing.assert_array_equal(np.array(held[0][0]), np.array(plain.keys[..., :200, :]))


def test_bench_decode_runs_every_kind_of_cache(capsys):
    # A tiny model on the CPU: the fp16 baselines and a compressed cache, timed rows.
    if mx.default_device() != mx.cpu:
        pytest.skip("CPU smoke run")
    bench_decode.main(
        [
            "--device",
            "cpu",
            "--layers",
            "2",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "64",
            "--intermediate",
            "512",
            "--vocab",
            "512",
            "--contexts",
            "300",
            "--caches",
            "fp16,fp16:inplace,k4v4",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--chunk",
            "128",
        ]
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 300")]
    names = list(dict.fromkeys(r.split("|")[2].strip() for r in rows))  # (printed twice)
    assert names == ["fp16", "fp16:inplace", "k4v4"]
    assert not any("error" in r or "non-finite" in r for r in rows), rows


# -- bench_prefill.py and long_context.py (bench/_long.py) ----------------------------

TINY_LLAMA = [
    "--layers",
    "2",
    "--hidden",
    "256",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "64",
    "--intermediate",
    "512",
    "--vocab",
    "512",
]
TINY_QWEN = [
    "--qwen-layers",
    "4",
    "--qwen-hidden",
    "128",
    "--qwen-heads",
    "2",
    "--qwen-kv-heads",
    "1",
    "--qwen-head-dim",
    "64",
    "--qwen-vocab",
    "512",
    "--qwen-experts",
    "4",
    "--qwen-experts-per-tok",
    "2",
    "--qwen-moe-intermediate",
    "64",
    "--qwen-shared-intermediate",
    "64",
    "--qwen-linear-k-heads",
    "2",
    "--qwen-linear-v-heads",
    "4",
    "--qwen-linear-k-dim",
    "64",
    "--qwen-linear-v-dim",
    "64",
]
SMALL_RUN = ["--device", "cpu", "--block", "128", "--warmup-tokens", "130"]


def _table(path):
    """The rows of the markdown table in ``path`` as dicts by column name."""
    lines = [line for line in open(path).read().splitlines() if line.startswith("|")]
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(cols, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def _number(cell):
    value = float(cell)
    assert math.isfinite(value), cell
    return value


def _skip_unless_cpu():
    if mx.default_device() != mx.cpu:
        pytest.skip("CPU smoke run")


def test_bench_prefill_rows_for_every_cache(tmp_path):
    _skip_unless_cpu()
    out = tmp_path / "prefill.md"
    bench_prefill.main(SMALL_RUN + TINY_LLAMA + ["--contexts", "300", "--markdown-out", str(out)])
    rows = _table(out)
    assert [r["cache"] for r in rows] == bench_prefill.DEFAULT_CACHES.split(",")
    for r in rows:
        assert r["context"] == "300"
        for col in ("prompt tok/s", "TTFT s", "weights GiB", "KV GiB", "peak GiB", "temp GiB"):
            _number(r[col])
        assert _number(r["prompt tok/s"]) > 0
        if r["cache"] == "fp16":
            assert r["× fp16"] == r["goal margin GiB"] == r["goal met"] == "–"
        else:
            _number(r["× fp16"])
            _number(r["goal margin GiB"])
            assert r["goal met"] in ("yes", "no")


def test_bench_prefill_cache_time_and_baseline_from_jsonl(tmp_path):
    # A split run: fp16 first, then a compressed cache alone with fp16's row from the
    # JSON lines as its baseline; the timed methods are restored afterwards.
    _skip_unless_cpu()
    jsonl, out = tmp_path / "rows.jsonl", tmp_path / "prefill.md"
    methods = (KVCache.update_and_fetch, TurboQuantKVCache.update_and_fetch)
    common = SMALL_RUN + TINY_LLAMA + ["--contexts", "200", "--cache-time", "--jsonl", str(jsonl)]
    bench_prefill.main(common + ["--caches", "fp16"])
    bench_prefill.main(common + ["--caches", "tq4", "--markdown-out", str(out)])
    assert (KVCache.update_and_fetch, TurboQuantKVCache.update_and_fetch) == methods
    assert "_prefill_operands" not in KVCache.__dict__
    (row,) = _table(out)
    assert row["cache"] == "tq4"
    _number(row["× fp16"])
    assert row["goal met"] in ("yes", "no")
    assert 0 < _number(row["cache time"].rstrip("%")) <= 100
    records = _long.load_jsonl(str(jsonl))
    assert [r["cache"] for r in records] == ["fp16", "tq4"]
    assert all(0 < r["cache_fraction"] <= 1 for r in records)


def test_bench_prefill_runs_the_hybrid_model(tmp_path):
    _skip_unless_cpu()
    out = tmp_path / "prefill.md"
    bench_prefill.main(
        SMALL_RUN
        + TINY_QWEN
        + [
            "--model",
            "qwen35moe",
            "--contexts",
            "200",
            "--caches",
            "fp16,tq4",
            "--markdown-out",
            str(out),
        ]
    )
    rows = _table(out)
    assert [r["cache"] for r in rows] == ["fp16", "tq4"]
    assert all(_number(r["prompt tok/s"]) > 0 for r in rows)


def test_long_context_rows_for_both_models(tmp_path):
    _skip_unless_cpu()
    out = tmp_path / "long.md"
    long_context.main(
        SMALL_RUN
        + TINY_LLAMA
        + TINY_QWEN
        + [
            "--context",
            "200",
            "--decode-tokens",
            "4",
            "--verify-steps",
            "2",
            "--markdown-out",
            str(out),
        ]
    )
    rows = _table(out)
    assert [(r["model"], r["cache"]) for r in rows] == [
        (m, c) for m in ("llama8b", "qwen35moe") for c in ("fp16", "tq4", "k4v3")
    ]
    for r in rows:
        for col in (
            "prompt s",
            "prompt tok/s",
            "TTFT s",
            "decode tok/s",
            "verify ms/step",
            "verify tok/s",
            "KV GiB",
            "peak GiB",
        ):
            _number(r[col])
        assert _number(r["decode tok/s"]) > 0
        assert r["≤ 64 GiB"] == r["≤ 128 GiB"] == "yes"


def _tiny_args(extra=()):
    a = long_context.parse_args(SMALL_RUN + TINY_LLAMA + TINY_QWEN + list(extra))
    return a, _long.setup_device(a)


def test_qwen35moe_builder_is_hybrid_and_only_attention_layers_are_compressed():
    _skip_unless_cpu()
    a, dtype = _tiny_args(["--qwen-layers", "8"])
    model = _long.build_model("qwen35moe", a, dtype)
    linear = [layer.is_linear for layer in model.layers]
    assert linear == [True, True, True, False] * 2
    caches = make_prompt_cache(model, preset="tq4")
    assert [isinstance(c, TurboQuantKVCache) for c in caches] == [not x for x in linear]
    assert all(isinstance(c, ArraysCache) for c, x in zip(caches, linear) if x)
    # Quantized as mlx-lm quantizes the model: experts at 4 bits, gates at 8.
    mlp = model.layers[0].mlp
    assert mlp.switch_mlp.gate_proj.bits == 4 and mlp.switch_mlp.gate_proj.group_size == 64
    assert mlp.gate.bits == 8 and mlp.shared_expert_gate.bits == 8
    assert model.layers[0].linear_attn.A_log.dtype == mx.float32
    assert model.language_model.model.embed_tokens.bits == 4
    assert _long.vocab_size("qwen35moe", a) == 512


@pytest.mark.parametrize("name", ["fp16", "tq4"])
@pytest.mark.parametrize("model_name", ["llama8b", "qwen35moe"])
def test_verify_steps_add_one_token_to_the_trimmable_caches(model_name, name):
    _skip_unless_cpu()
    a, dtype = _tiny_args()
    model = _long.build_model(model_name, a, dtype)
    cache = _long.make_cache(model, name, 512)
    prompt = _long.random_tokens(100, _long.vocab_size(model_name, a), 0)
    rest = _long.feed_prompt(model, cache, prompt, a.block)
    y, _ = _long.next_token(model, cache, rest)
    _, (y, _) = long_context.decode(model, cache, y, 3)
    drafts = _long.random_tokens(3, 512, 1).astype(mx.uint32)
    long_context.verify(model, cache, y, 5, 4, drafts)
    offsets = {c.offset for c in cache if c.is_trimmable()}
    assert offsets == {100 + 3 + 5}


def test_a_row_that_runs_out_of_memory_does_not_fit(tmp_path, monkeypatch):
    # The out-of-memory error of one cache makes its row "does not fit"; the next still runs.
    _skip_unless_cpu()
    run_prompt = _long.run_prompt

    def failing(model, name, *args, **kwargs):
        if name == "tq4":
            raise RuntimeError("[cuda::malloc] out of memory")
        return run_prompt(model, name, *args, **kwargs)

    monkeypatch.setattr(_long, "run_prompt", failing)
    out = tmp_path / "long.md"
    long_context.main(
        SMALL_RUN
        + TINY_LLAMA
        + [
            "--models",
            "llama8b",
            "--caches",
            "tq4,k4v3",
            "--context",
            "200",
            "--decode-tokens",
            "2",
            "--verify-steps",
            "1",
            "--markdown-out",
            str(out),
        ]
    )
    failed, done = _table(out)
    assert failed["prompt s"].startswith("does not fit (RuntimeError")
    assert failed["≤ 64 GiB"] == failed["≤ 128 GiB"] == "no"
    assert done["cache"] == "k4v3" and _number(done["decode tok/s"]) > 0


def test_long_context_fill_skips_the_prompt(tmp_path):
    _skip_unless_cpu()
    out = tmp_path / "long.md"
    long_context.main(
        SMALL_RUN
        + TINY_LLAMA
        + TINY_QWEN
        + [
            "--caches",
            "fp16,tq4",
            "--context",
            "500",
            "--decode-tokens",
            "3",
            "--verify-steps",
            "2",
            "--fill",
            "--markdown-out",
            str(out),
        ]
    )
    rows = _table(out)
    assert [(r["model"], r["cache"]) for r in rows] == [
        (m, c) for m in ("llama8b", "qwen35moe") for c in ("fp16", "tq4")
    ]
    for r in rows:
        assert r["prompt s"] == r["prompt tok/s"] == r["TTFT s"] == "–"
        assert _number(r["decode tok/s"]) > 0 and _number(r["verify ms/step"]) > 0
        assert _number(r["KV GiB"]) >= 0


def test_fill_puts_the_context_in_every_attention_cache():
    _skip_unless_cpu()
    a, dtype = _tiny_args()
    model = _long.build_model("qwen35moe", a, dtype)
    cache = _long.make_cache(model, "tq4", 700)
    _long.fill_cache(model, cache, 600, _long.attention_shape("qwen35moe", a), dtype, chunk=256)
    assert [c.offset for c in cache if isinstance(c, TurboQuantKVCache)] == [600]
    assert all(
        c[0] is not None and c[1].dtype == mx.float32 for c in cache if isinstance(c, ArraysCache)
    )


# -- bench_batch.py -------------------------------------------------------------------


def _tables(path):
    """Every markdown table in ``path``: a list of row lists (dicts by column name)."""
    tables, lines = [], open(path).read().splitlines() + [""]
    block = []
    for line in lines:
        if line.startswith("|"):
            block.append(line)
        elif block:
            cols = [c.strip() for c in block[0].strip("|").split("|")]
            tables.append(
                [dict(zip(cols, (c.strip() for c in r.strip("|").split("|")))) for r in block[2:]]
            )
            block = []
    return tables


def test_bench_batch_rows_for_every_batch_and_cache(tmp_path):
    # A tiny model on the CPU: fp16 (BatchKVCache) and the compressed caches merged
    # into BatchTurboQuantKVCache, decoded at two batch sizes; then the budget table.
    _skip_unless_cpu()
    out, jsonl = tmp_path / "batch.md", tmp_path / "batch.jsonl"
    bench_batch.main(
        ["--device", "cpu"]
        + TINY_LLAMA
        + [
            "--contexts",
            "300",
            "--batches",
            "1,3",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--chunk",
            "128",
            "--budget-gib",
            "1",
            "--memory-unit",
            "MiB",
            "--markdown-out",
            str(out),
            "--jsonl",
            str(jsonl),
        ]
    )
    decode, fits = _tables(out)
    caches = bench_batch.DEFAULT_CACHES.split(",")
    assert [(r["batch"], r["cache"]) for r in decode] == [
        (b, c) for b in ("1", "3") for c in caches
    ]
    for r in decode:
        assert r["context"] == "300"
        assert _number(r["tok/s"]) > 0 and _number(r["KV MiB"]) > 0
        _number(r["peak MiB"])
        if r["cache"] == "fp16":
            assert r["× fp16"] == r["KV / fp16"] == "–"
        else:  # (the CPU's fp16 cache holds the model's float32)
            assert _number(r["× fp16"]) > 0 and 0 < _number(r["KV / fp16"]) < 1
    records = _long.load_jsonl(str(jsonl))
    kinds = {r["cache"]: r["batch_cache"] for r in records if r["bench"] == "batch"}
    assert kinds == {
        "fp16": "BatchKVCache",
        "tq4": "BatchTurboQuantKVCache",
        "k4v3": "BatchTurboQuantKVCache",
    }
    assert all(r["finite"] for r in records if r["bench"] == "batch")
    assert [r["cache"] for r in fits] == caches
    for r in fits:
        n = int(r["sequences in 1 GiB"])
        assert n > 0
        # The method: floor((budget - fixed) / (KV/seq + temp/seq)), to the cells' rounding.
        per_seq = (_number(r["KV MiB/seq"]) + _number(r["temp MiB/seq"])) * 2**20
        assert n == pytest.approx(
            (2**30 - _number(r["fixed MiB"]) * 2**20) / per_seq, rel=0.01, abs=1
        )
    assert all(_number(r["× fp16"]) > 1 for r in fits[1:])


def test_bench_batch_budget_fit():
    # fixed + B * per_seq through the smallest and largest batch.
    rows = {
        1: dict(batch=1, kv_bytes=100, temp_bytes=50),
        4: dict(batch=4, kv_bytes=400, temp_bytes=80),
        2: dict(batch=2, kv_bytes=999, temp_bytes=999),
    }  # (only the ends count)
    kv_seq, temp_seq, fixed, fit = bench_batch.fit_budget(rows, weights=1000, budget=3000)
    assert (kv_seq, temp_seq, fixed) == (100, 10, 1040)
    assert fit == (3000 - 1040) // 110
    # Temporaries that shrink with the batch count as fixed.
    rows[4]["temp_bytes"] = 20
    assert bench_batch.fit_budget(rows, 1000, 3000)[1:3] == (0.0, 1050)
