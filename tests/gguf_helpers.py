# Copyright © 2026 turboquant_mlx contributors.

"""A small GGUF writer, a tiny llama model to write with it, and a worker process
that loads GGUF files for the tests of the loader.

The writer is independent of the loader: it encodes what the GGUF specification
says (header, metadata key-value pairs, tensor infos, aligned data section) and
returns where each field landed, so that tests can damage one field at a time.

:class:`LoadWorker` runs ``load_gguf`` in a separate Python process that takes
file paths on stdin and answers one JSON line per file, so that a file which
crashes the process (a signal in native code) fails a test instead of taking the
test run down, while many files share one process start.
"""

import json
import os
import select
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

# Metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13)
)
_SCALAR_FORMATS = {
    UINT8: "B",
    INT8: "b",
    UINT16: "H",
    INT16: "h",
    UINT32: "I",
    INT32: "i",
    FLOAT32: "f",
    BOOL: "?",
    UINT64: "Q",
    INT64: "q",
    FLOAT64: "d",
}
# ggml tensor types: name -> (id, elements per block, bytes per block).
GGML_TYPES = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q6_K": (14, 256, 210),
    "BF16": (30, 1, 2),
    "IQ2_XXS": (16, 256, 66),
}


def _string(s):
    raw = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype, value, layout, field):
    """Encodes one metadata value; ``vtype`` is a type id or ``(ARRAY, element type)``."""
    if isinstance(vtype, tuple):
        _, etype = vtype
        head = struct.pack("<IQ", etype, len(value))
        layout[field + ":array_type"] = 0, 4
        layout[field + ":array_len"] = 4, 8
        body = b"".join(_value(etype, v, {}, "")[0] for v in value)
        return head + body, ARRAY
    if vtype == STRING:
        layout[field + ":len"] = 0, 8
        return _string(value), STRING
    return struct.pack("<" + _SCALAR_FORMATS[vtype], value), vtype


def gguf_bytes(metadata, tensors, version=3):
    """Encodes a GGUF file.

    Args:
        metadata: ``{key: (type, value)}`` in file order; an array's type is
            ``(ARRAY, element type)``. ``general.alignment`` (UINT32) sets the
            alignment of the data section (default 32).
        tensors: ``{name: (shape, type name, data bytes)}`` in file order, shape
            in row-major (MLX) order; data is laid out in the same order.

    Returns:
        ``(data, layout)``: the file's bytes and ``{field: (offset, size)}`` for
        the header counts (``tensor_count``, ``kv_count``), each metadata entry
        (``kv:KEY:keylen``, ``kv:KEY:type``, ``kv:KEY:value``, ``kv:KEY:value:len``
        for strings, ``kv:KEY:value:array_len`` for arrays) and each tensor info
        (``tensor:NAME:namelen``, ``:n_dims``, ``:dim0``..., ``:type``, ``:offset``),
        plus ``data_offset`` (offset, 0).
    """
    layout = {}
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata)))
    layout["version"] = 4, 4
    layout["tensor_count"] = 8, 8
    layout["kv_count"] = 16, 8
    alignment = 32
    for key, (vtype, value) in metadata.items():
        if key == "general.alignment" and vtype == UINT32:
            alignment = value
        layout[f"kv:{key}:keylen"] = len(out), 8
        out += _string(key)
        value_layout = {}
        encoded, type_id = _value(vtype, value, value_layout, "")
        layout[f"kv:{key}:type"] = len(out), 4
        out += struct.pack("<I", type_id)
        layout[f"kv:{key}:value"] = len(out), len(encoded)
        for name, (off, size) in value_layout.items():
            layout[f"kv:{key}:value{name}"] = len(out) + off, size
        out += encoded

    offsets, offset = [], 0
    for name, (shape, type_name, data) in tensors.items():
        offsets.append(offset)
        offset += len(data)
        offset += (-offset) % max(alignment, 1)
    for (name, (shape, type_name, data)), offset in zip(tensors.items(), offsets):
        layout[f"tensor:{name}:namelen"] = len(out), 8
        out += _string(name)
        layout[f"tensor:{name}:n_dims"] = len(out), 4
        out += struct.pack("<I", len(shape))
        for i, d in enumerate(reversed(shape)):
            layout[f"tensor:{name}:dim{i}"] = len(out), 8
            out += struct.pack("<Q", d)
        layout[f"tensor:{name}:type"] = len(out), 4
        out += struct.pack("<I", GGML_TYPES[type_name][0])
        layout[f"tensor:{name}:offset"] = len(out), 8
        out += struct.pack("<Q", offset)
    out += bytes((-len(out)) % max(alignment, 1))
    layout["data_offset"] = len(out), 0
    for (name, (shape, type_name, data)), offset in zip(tensors.items(), offsets):
        assert len(out) == layout["data_offset"][0] + offset
        out += data
        if name != list(tensors)[-1]:
            out += bytes((-len(out)) % max(alignment, 1))
    return bytes(out), layout


def write_gguf(path, metadata, tensors, version=3):
    data, layout = gguf_bytes(metadata, tensors, version)
    with open(path, "wb") as f:
        f.write(data)
    return layout


def tensor_data(shape, type_name, rng):
    """Plausible bytes of a tensor: small scales, random quants."""
    _, block, block_bytes = GGML_TYPES[type_name]
    n = int(np.prod(shape))
    if type_name == "F32":
        return rng.standard_normal(n).astype("<f4").tobytes()
    if type_name == "F16":
        return (0.1 * rng.standard_normal(n)).astype("<f2").tobytes()
    blocks = []
    half = lambda x: np.float16(x).astype("<f2").tobytes()  # noqa: E731
    for _ in range(n // block):
        q = rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes()
        if type_name in ("Q4_0", "Q8_0"):
            blocks.append(half(0.01) + q[2:])
        elif type_name == "Q4_1":
            blocks.append(half(0.01) + half(-0.05) + q[4:])
        elif type_name == "Q4_K":
            blocks.append(half(0.001) + half(0.001) + q[4:])
        elif type_name == "Q6_K":
            scales = rng.integers(-8, 8, 16, dtype=np.int8).tobytes()
            blocks.append(q[:192] + scales + half(0.001))
        else:
            blocks.append(q)
    return b"".join(blocks)


# Tokens of the tiny tokenizer: specials, the byte-level space, letters, digits,
# punctuation, and the results of its merges.
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
TINY_TOKENS = (
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ"]
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [str(d) for d in range(10)]
    + [".", ",", "!", "?"]
    + ["Ġt", "he", "Ġthe", "in"]
)
TINY = dict(hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=256, layers=2)


def tiny_llama(seed=0, tied=False, bias=False):
    """Metadata and tensors of a tiny valid llama GGUF (random weights).

    Types: Q8_0 embedding, F16 output, Q4_0 q/k, Q4_1 v/o, Q8_0 gate/up, Q4_K
    (layer 0) and Q6_K (layer 1) down projections, F32 norms and biases.
    """
    rng = np.random.default_rng(seed)
    c = TINY
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    metadata = {
        "general.architecture": (STRING, "llama"),
        "general.name": (STRING, "tiny"),
        "general.alignment": (UINT32, 32),
        "llama.block_count": (UINT32, c["layers"]),
        "llama.context_length": (UINT32, 256),
        "llama.embedding_length": (UINT32, c["hidden"]),
        "llama.feed_forward_length": (UINT32, c["ffn"]),
        "llama.attention.head_count": (UINT32, c["heads"]),
        "llama.attention.head_count_kv": (UINT32, c["kv_heads"]),
        "llama.rope.freq_base": (FLOAT32, 10000.0),
        "llama.attention.layer_norm_rms_epsilon": (FLOAT32, 1e-5),
        "llama.vocab_size": (UINT32, len(TINY_TOKENS)),
        "llama.rope.dimension_count": (UINT32, c["head_dim"]),
        "tokenizer.ggml.model": (STRING, "gpt2"),
        "tokenizer.ggml.pre": (STRING, "smollm"),
        "tokenizer.ggml.tokens": ((ARRAY, STRING), TINY_TOKENS),
        "tokenizer.ggml.token_type": ((ARRAY, INT32), [3, 3, 3] + [1] * (len(TINY_TOKENS) - 3)),
        "tokenizer.ggml.merges": ((ARRAY, STRING), TINY_MERGES),
        "tokenizer.ggml.bos_token_id": (UINT32, 1),
        "tokenizer.ggml.eos_token_id": (UINT32, 2),
        "tokenizer.ggml.add_bos_token": (BOOL, True),
        "tokenizer.chat_template": (STRING, template),
    }
    h, ffn, vocab = c["hidden"], c["ffn"], len(TINY_TOKENS)
    q, kv = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    specs = {"token_embd.weight": ((vocab, h), "Q8_0")}
    if not tied:
        specs["output.weight"] = ((vocab, h), "F16")
    specs["output_norm.weight"] = ((h,), "F32")
    for i in range(c["layers"]):
        specs.update(
            {
                f"blk.{i}.attn_norm.weight": ((h,), "F32"),
                f"blk.{i}.attn_q.weight": ((q, h), "Q4_0"),
                f"blk.{i}.attn_k.weight": ((kv, h), "Q4_0"),
                f"blk.{i}.attn_v.weight": ((kv, h), "Q4_1"),
                f"blk.{i}.attn_output.weight": ((h, q), "Q4_1"),
                f"blk.{i}.ffn_norm.weight": ((h,), "F32"),
                f"blk.{i}.ffn_gate.weight": ((ffn, h), "Q8_0"),
                f"blk.{i}.ffn_up.weight": ((ffn, h), "Q8_0"),
                f"blk.{i}.ffn_down.weight": ((h, ffn), "Q4_K" if i % 2 == 0 else "Q6_K"),
            }
        )
        if bias:
            specs.update(
                {
                    f"blk.{i}.attn_q.bias": ((q,), "F32"),
                    f"blk.{i}.attn_k.bias": ((kv,), "F32"),
                    f"blk.{i}.attn_v.bias": ((kv,), "F32"),
                    f"blk.{i}.attn_output.bias": ((h,), "F32"),
                }
            )
    tensors = {name: (shape, t, tensor_data(shape, t, rng)) for name, (shape, t) in specs.items()}
    return metadata, tensors


# --------------------------------------------------------------------------
# The worker process

_MARK = "@@load_gguf@@ "
_WORKER = r"""
import importlib.util, json, sys, time, traceback
spec = importlib.util.spec_from_file_location("_gguf_under_test", sys.argv[1])
gguf = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gguf)
import mlx.core as mx
import mlx_lm.models.llama  # noqa: F401  (import cost out of the timings)
import transformers  # noqa: F401
MARK = sys.argv[2]
print(MARK + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    tic = time.perf_counter()
    try:
        model, tok = gguf.load_gguf(request["path"], **request["kwargs"])
        if request["forward"]:
            mx.eval(model(mx.array([[1, 5, 7]])))
        outcome, message = "ok", ""
    except gguf.GGUFError as e:
        outcome, message = "GGUFError", str(e)
    except Exception as e:
        outcome, message = type(e).__name__, traceback.format_exc()
    print(MARK + json.dumps({"outcome": outcome, "message": message,
                             "seconds": time.perf_counter() - tic}), flush=True)
"""


class LoadWorker:
    """``load_gguf`` in a child process; a crash is reported as an outcome.

    ``run(path)`` returns ``{"outcome": "ok" | "GGUFError" | <exception name> |
    "crash" | "timeout", "message": ..., "seconds": ...}``; after a crash or a
    timeout the next call starts a fresh process.
    """

    def __init__(self, gguf_file, timeout=60.0):
        self.gguf_file, self.timeout = gguf_file, timeout
        self.proc = None
        self.stderr = None
        self.pending = b""

    def _start(self):
        env = dict(os.environ)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(self.gguf_file)))
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in sys.path if p])
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, self.gguf_file, _MARK],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
        )
        self.pending = b""
        if self._read_answer(120.0) is None:
            raise RuntimeError(f"the GGUF load worker did not start: {self._stop()}")

    def _stop(self):
        """Ends the process; returns its exit status and the end of its stderr."""
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # the unflushed request of a dead process
                pass
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-2000:]
        self.stderr.close()
        self.proc = None
        return f"exit status {rc}; stderr: {tail}"

    def _read_answer(self, timeout):
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" not in self.pending:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:  # the process is gone (or going)
                    try:
                        self.proc.wait(10)
                    except subprocess.TimeoutExpired:
                        pass
                    return None
                self.pending += chunk
            line, _, self.pending = self.pending.partition(b"\n")
            line = line.decode(errors="replace")
            if line.startswith(_MARK):  # anything else is the libraries' own output
                return json.loads(line[len(_MARK) :])

    def run(self, path, timeout=None, forward=False, **kwargs):
        """Loads ``path`` with ``load_gguf(path, **kwargs)`` (and runs the model on
        three tokens if ``forward``)."""
        if self.proc is None:
            self._start()
        request = {"path": os.fspath(path), "kwargs": kwargs, "forward": forward}
        tic = time.perf_counter()
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            answer = self._read_answer(self.timeout if timeout is None else timeout)
        except BrokenPipeError:
            answer = None
        if answer is None:
            outcome = "timeout" if self.proc.poll() is None else "crash"
            return {
                "outcome": outcome,
                "message": self._stop(),
                "seconds": time.perf_counter() - tic,
            }
        return answer

    def close(self):
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            self._stop()
