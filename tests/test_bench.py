# Copyright © 2026 turboquant_mlx contributors.

"""Helpers of the benchmarks in bench/ that their tables depend on."""

import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from turboquant_mlx import _ext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import bench_decode  # noqa: E402


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
    bench_decode.main([
        "--device", "cpu", "--layers", "2", "--hidden", "256", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "64", "--intermediate", "512", "--vocab", "512",
        "--contexts", "300", "--caches", "fp16,fp16:inplace,k4v4", "--steps", "3",
        "--warmup", "1", "--rounds", "1", "--chunk", "128",
    ])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 300")]
    names = list(dict.fromkeys(r.split("|")[2].strip() for r in rows))  # (printed twice)
    assert names == ["fp16", "fp16:inplace", "k4v4"]
    assert not any("error" in r or "non-finite" in r for r in rows), rows
