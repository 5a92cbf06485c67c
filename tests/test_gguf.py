"""GGUF reading, writing and the native (de)quantizers, with gguf-py as the oracle.

Real files come from ../shared/data/gguf (skipped with a reason when absent):
llama.cpp's vocab-only files, stories260K in F32 and llama.cpp's Q8_0 / Q4_0
quantizations of it.
"""
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFValueType as VT, quants

from ggtrain.errors import ConfigError, FormatError, ShapeError, UnsupportedOpError
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.families import FAMILIES
from ggtrain.formats import model as layouts
from ggtrain.native import _check, ffi, lib
from ggtrain.formats.gguf import read_gguf, write_gguf
from ggtrain.formats.gguf_writer import GGUFWriter
from ggtrain.formats.gguf_values import StringArray, make_value
from ggtrain.formats.quants import DEQUANTIZABLE, dequantize, quantize, tensor_nbytes
from tests import gguf_craft as craft
from tests.conftest import SHARED_DATA

GGUF_DIR = SHARED_DATA / "gguf"
REAL_FILES = sorted(p.name for p in GGUF_DIR.glob("*.gguf")) if GGUF_DIR.is_dir() else []
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def gguf_dir(shared_data):
    d = shared_data / "gguf"
    if not d.is_dir():
        pytest.skip(f"{d} is absent")
    return d


_READERS = {}


def _oracle(path: Path) -> gguf.GGUFReader:
    """gguf-py's reader (slow: seconds for a vocabulary), once per file per session."""
    if path not in _READERS:
        _READERS[path] = gguf.GGUFReader(path)
    return _READERS[path]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
    return a.shape == b.shape and bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


# ---- native dequantize / quantize against gguf.quants ---------------------------

def _random_blocks(t, n_blocks, rng):
    """Random bytes, with the f16 scales of half the blocks made ordinary numbers (MXFP4's
    scale is one E8M0 byte: every byte is one)."""
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    if block > 1 and t != T.MXFP4:
        sane = rng.uniform(-2, 2, (n_blocks // 2, size // 2)).astype(np.float16).view(np.uint8)
        raw[: n_blocks // 2] = sane.reshape(n_blocks // 2, -1)[:, :size]
        # put ordinary scales where each format keeps them (the whole block is then finite)
        offs = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
                T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}[t]
        for o in offs:
            raw[: n_blocks // 2, o:o + 2] = np.float16(rng.uniform(0.001, 1)).reshape(1).view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("t", sorted(DEQUANTIZABLE - {T.F32}, key=int), ids=lambda t: t.name)
def test_dequantize_matches_gguf_py(t):
    rng = np.random.default_rng(int(t))
    block, _ = GGML_QUANT_SIZES[t]
    n_blocks = 512 if block > 1 else 8192
    raw = _random_blocks(t, n_blocks, rng)
    ours = dequantize(raw, t, (n_blocks, block) if block > 1 else (n_blocks,))
    with np.errstate(all="ignore"):
        ref = quants.dequantize(raw.reshape(1, -1), t).reshape(-1)
    assert _same_bits(ours, ref), f"{t.name}: differs from gguf.quants"


def _quant_inputs(rng):
    x = (rng.standard_normal((400, 64)) * rng.uniform(0, 10, (400, 1))).astype(np.float32)
    x[0] = 0                                                   # all-zero block
    x[1] = 1.5                                                 # constant block
    x[2, :32] = np.arange(-16, 16) / 2                         # exact halves: rounding ties
    x[2, 32:] = -np.arange(32) / 4
    x[3, :32] = 1e-30                                          # tiny scale (f16 underflow)
    x[3, 32:] = 7e4                                            # f16 overflow of the scale
    x[4, :32] = -3.0                                           # negative max (Q4_0 sign)
    x[4, 5] = 3.0                                              # first |max| wins in Q4_0
    return x


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_quantize_matches_gguf_py(t):
    x = _quant_inputs(np.random.default_rng(1))
    ours = quantize(x, t)
    with np.errstate(all="ignore"):
        ref = quants.quantize(x, t)
    assert ours.shape == ref.shape
    assert np.array_equal(ours, ref)
    back = dequantize(ours, t, x.shape)
    ok = np.isfinite(back).all(axis=1)
    if t == T.Q4_1:   # 16 levels between the row's min and max
        step = (x.max(axis=1, keepdims=True) - x.min(axis=1, keepdims=True)) / 15
    else:
        step = np.abs(x).max(axis=1, keepdims=True) / (127 if t == T.Q8_0 else 7)
    assert np.all((np.abs(back - x) <= step + 1e-6)[ok])


def test_quantize_f16_bf16_match_numpy_and_gguf_py():
    x = _quant_inputs(np.random.default_rng(2))
    with np.errstate(over="ignore"):
        assert np.array_equal(quantize(x, "F16").view(np.float16), x.astype(np.float16))
    assert np.array_equal(quantize(x, "BF16"), quants.quantize(x, T.BF16))


def test_quant_errors():
    with pytest.raises(ValueError):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (16,))
    with pytest.raises(ValueError):
        quantize(np.zeros(48, np.float32), T.Q8_0)
    x = np.zeros(48, np.float32)
    with pytest.raises(ShapeError, match="48 elements"):  # the native check behind them
        _check(lib.gt_quantize_row(ffi.NULL, ffi.cast("float *", x.ctypes.data), int(T.Q8_0), 48))
    with pytest.raises(ShapeError):
        _check(lib.gt_dequantize_row(ffi.cast("float *", x.ctypes.data), ffi.cast("void *", x.ctypes.data),
                                     int(T.Q4_K), 48))
    with pytest.raises(UnsupportedOpError):
        dequantize(np.zeros(66, np.uint8), T.IQ2_XXS, (256,))
    with pytest.raises(UnsupportedOpError):
        quantize(np.zeros(256, np.float32), T.IQ4_XS)


# ---- the real files --------------------------------------------------------------

def _types_of(v):
    return [v.type] + ([v.item_type] if v.item_type is not None else [])


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_file_matches_gguf_py(gguf_dir, name):
    path = gguf_dir / name
    ours = read_gguf(path)
    ref = _oracle(path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.version == ref.fields["GGUF.version"].contents()
    assert list(ours.kv) == list(fields)
    for key, field in fields.items():
        v = ours.kv[key]
        assert _types_of(v) == list(field.types), key
        assert v.to_python() == field.contents(), key
    assert ours.alignment == ref.alignment
    assert ours.data_offset == ref.data_offset
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for rt in ref.tensors:
        info = ours.tensors[rt.name]
        assert info.type == rt.tensor_type
        assert info.shape == tuple(reversed(rt.shape.tolist()))
        assert info.nbytes == rt.n_bytes
        assert ours.data_offset + info.offset == rt.data_offset
        assert ours.read_tensor(rt.name).tobytes() == np.asarray(rt.data).tobytes()


@pytest.mark.parametrize("name", REAL_FILES)
def test_real_file_metadata_is_fast(gguf_dir, name):
    read_gguf(gguf_dir / name)  # warm the page cache
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        read_gguf(gguf_dir / name)
        times.append(time.perf_counter() - t0)
    print(f"{name}: metadata in {min(times) * 1000:.1f} ms")
    assert min(times) < 0.2, f"{name}: {min(times):.3f} s (target < 0.2 s)"


def test_load_tensors_into_backend(gguf_dir, backend):
    path = gguf_dir / "stories260K-Q4_0.gguf"
    f = read_gguf(path)
    ref = {t.name: t for t in _oracle(path).tensors}
    wanted = ["token_embd.weight", "blk.0.ffn_down.weight", "output_norm.weight"]
    loaded = f.load_tensors(wanted, backend)
    assert list(loaded) == wanted
    for name, lt in loaded.items():
        assert lt.buffer.nbytes == lt.info.nbytes
        assert lt.buffer.bytes.tobytes() == np.asarray(ref[name].data).tobytes()
        assert lt.array().shape[:-1] == lt.info.shape[:-1]
    everything = f.load_tensors(None, backend)
    assert len(everything) == 48 and sum(t.buffer.nbytes for t in everything.values()) == f.tensor_bytes


@pytest.mark.parametrize("name", ["stories260K-Q8_0.gguf", "stories260K-Q4_0.gguf"])
def test_real_quantized_tensors_dequantize_like_gguf_py(gguf_dir, name):
    path = gguf_dir / name
    f = read_gguf(path)
    for rt in _oracle(path).tensors:
        ref = quants.dequantize(np.asarray(rt.data), rt.tensor_type)
        assert _same_bits(f.tensor_f32(rt.name), ref), rt.name


@pytest.mark.parametrize("name,t", [("stories260K-Q8_0.gguf", T.Q8_0), ("stories260K-Q4_0.gguf", T.Q4_0)])
def test_quantize_reproduces_llama_cpp(gguf_dir, name, t):
    """Our quantizer gives llama.cpp's bytes for every tensor it quantized to `t`."""
    f32, q = read_gguf(gguf_dir / "stories260K.gguf"), read_gguf(gguf_dir / name)
    n = 0
    for info in q.tensors.values():
        if info.type in (T.Q8_0, T.Q4_0):
            assert np.array_equal(quantize(f32.tensor_f32(info.name), info.type), q.read_tensor(info.name)), info.name
            n += 1
    assert n >= 30  # all matrices but the F16 fallbacks


@pytest.mark.parametrize("name", REAL_FILES)
def test_rewrite_is_byte_identical(gguf_dir, tmp_path, name):
    """Reading a llama.cpp file and writing it back reproduces it exactly."""
    f = read_gguf(gguf_dir / name)
    out = tmp_path / name
    with GGUFWriter(out, f.alignment) as w:
        for k, v in f.kv.items():
            if k != "general.alignment":
                w.add_kv(k, v)
        for t in f.tensors.values():
            w.add_tensor_info(t.name, t.shape, t.type)
        for t in f.tensors.values():
            w.write_tensor(t.name, f.read_tensor(t.name))
    assert out.read_bytes() == (gguf_dir / name).read_bytes()


# ---- round trips with gguf-py ----------------------------------------------------

def _sample_kv():
    rng = np.random.default_rng(3)
    return [
        ("general.architecture", "llama", None, None),
        ("test.u8", 255, VT.UINT8, None), ("test.i8", -128, VT.INT8, None),
        ("test.u16", 65535, VT.UINT16, None), ("test.i16", -32768, VT.INT16, None),
        ("test.u32", 2**32 - 1, VT.UINT32, None), ("test.i32", -2**31, VT.INT32, None),
        ("test.u64", 2**64 - 1, VT.UINT64, None), ("test.i64", -2**63, VT.INT64, None),
        ("test.f32", 1e-5, VT.FLOAT32, None), ("test.f64", 1e-300, VT.FLOAT64, None),
        ("test.bool", True, VT.BOOL, None), ("test.str", "héllo ▁wörld\n\0", VT.STRING, None),
        ("test.empty_str", "", VT.STRING, None),
        ("test.strs", ["a", "", "▁Lily", "<0x0A>", "日本"], VT.ARRAY, VT.STRING),
        ("test.f32s", rng.standard_normal(100).astype(np.float32), VT.ARRAY, VT.FLOAT32),
        ("test.i32s", np.arange(-5, 5, dtype=np.int32), VT.ARRAY, VT.INT32),
        ("test.u64s", [0, 2**64 - 1], VT.ARRAY, VT.UINT64),
        ("test.bools", [True, False, True], VT.ARRAY, VT.BOOL),
        ("test.empty_arr", [], VT.ARRAY, VT.INT32),
        ("test.empty_strs", [], VT.ARRAY, VT.STRING),
        ("test.nested", [[1, 2], [3]], VT.ARRAY, VT.ARRAY),
    ]


def _sample_tensors():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    return [
        ("a.f32", x, T.F32), ("a.f16", x, T.F16), ("a.bf16", x, T.BF16), ("a.q8_0", x, T.Q8_0),
        ("a.q4_0", x, T.Q4_0), ("a.i32", np.arange(7, dtype=np.int32), T.I32),
        ("a.3d", rng.standard_normal((2, 3, 5)).astype(np.float32), T.F32),
        ("a.q6_k_raw", _random_blocks(T.Q6_K, 2, rng).reshape(2, -1), T.Q6_K),
    ]


def _write_sample(path, alignment=32):
    with GGUFWriter(path, alignment) as w:
        for key, value, vt, it in _sample_kv():
            if vt == VT.ARRAY and it == VT.ARRAY:
                value = [make_value(v, VT.ARRAY, VT.INT32) for v in value]
            w.add_kv(key, value, vt, it)
        for name, data, t in _sample_tensors():
            shape = (2, 256) if t == T.Q6_K else data.shape
            w.add_tensor_info(name, shape, t)
        for name, data, t in _sample_tensors():
            w.write_tensor(name, data)


@pytest.mark.parametrize("alignment", [32, 64])
def test_our_file_reads_identically_in_gguf_py(tmp_path, alignment):
    path = tmp_path / "ours.gguf"
    _write_sample(path, alignment)
    ref = gguf.GGUFReader(path)
    ours = read_gguf(path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(ours.kv)
    for key, value, vt, it in _sample_kv():
        field = fields[key]
        v = ours.kv[key]
        assert field.types[0] == vt or (vt is None and field.types[0] == VT.STRING), key
        if vt == VT.ARRAY and it != VT.ARRAY and len(value):
            assert field.types == [VT.ARRAY, it], key
        expect = value.tolist() if isinstance(value, np.ndarray) else value
        if key == "test.f32":
            expect = float(np.float32(value))
        if key == "test.nested":
            assert v.to_python() == expect
            continue
        assert field.contents() == expect, key
        assert v.to_python() == expect, key
    assert ref.alignment == alignment == ours.alignment
    for rt, (name, data, t) in zip(ref.tensors, _sample_tensors()):
        assert rt.name == name and rt.tensor_type == t
        assert np.asarray(rt.data).tobytes() == ours.read_tensor(name).tobytes()
        if t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0):
            back = ours.tensor_f32(name)
            assert back.shape == data.shape
            assert _same_bits(back, quants.dequantize(quants.quantize(data, t), t))


def test_gguf_py_file_reads_identically_in_ours(tmp_path):
    path = tmp_path / "theirs.gguf"
    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_token_list(["<unk>", "a", "▁b"])
    w.add_token_types([2, 1, 1])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_int64("test.i64", -7)
    w.add_array("test.nested", [[1, 2], [3, 4, 5]])
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("x.f32", x)
    w.add_tensor("x.f16", x.astype(np.float16))
    w.add_tensor("x.q8_0", quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
    w.add_tensor("x.i8", np.arange(-3, 3, dtype=np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref = gguf.GGUFReader(path)
    ours = read_gguf(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert _types_of(ours.kv[key])[:2] == list(field.types)[:2], key
        if key != "test.nested":
            assert ours.kv[key].to_python() == field.contents(), key
    assert ours.value("test.nested") == [[1, 2], [3, 4, 5]]
    assert ours.kv["test.nested"].value[0].item_type == VT.INT32
    for rt in ref.tensors:
        assert ours.read_tensor(rt.name).tobytes() == np.asarray(rt.data).tobytes()
    assert _same_bits(ours.tensor_f32("x.f32"), x)
    assert _same_bits(ours.tensor_f32("x.q8_0"), quants.dequantize(quants.quantize(x, T.Q8_0), T.Q8_0))


def test_our_round_trip_keeps_exact_types(tmp_path):
    path = tmp_path / "rt.gguf"
    _write_sample(path)
    f = read_gguf(path)
    for key, value, vt, it in _sample_kv():
        v = f.kv[key]
        assert v.type == (VT.STRING if vt is None else vt)
        if vt == VT.ARRAY:
            assert v.item_type == it
            assert len(v.value) == len(value)
    assert f.value("test.empty_str") == ""
    assert f.value("test.empty_arr") == [] and f.value("test.empty_strs") == []
    assert isinstance(f.kv["test.strs"].value, StringArray)
    assert f.kv["test.f32s"].value.dtype == np.float32
    # a second pass through the writer reproduces the file byte for byte
    again = tmp_path / "again.gguf"
    with GGUFWriter(again) as w:
        for k, v in f.kv.items():
            w.add_kv(k, v)
        for t in f.tensors.values():
            w.add_tensor_info(t.name, t.shape, t.type)
        for t in f.tensors.values():
            w.write_tensor(t.name, f.read_tensor(t.name))
    assert again.read_bytes() == path.read_bytes()


def test_write_gguf_streams_callables(tmp_path):
    calls = []

    def make(i):
        def fn():
            calls.append(i)
            return np.full((4, 32), i, np.float32)
        return fn

    write_gguf(tmp_path / "s.gguf", {"general.architecture": "llama"},
               [(f"t{i}", make(i), "Q8_0", (4, 32)) for i in range(3)])
    assert calls == [0, 1, 2]
    f = read_gguf(tmp_path / "s.gguf")
    assert np.allclose([f.tensor_f32(f"t{i}")[0, 0] for i in range(3)], [0, 1, 2], rtol=1e-3)


# ---- writer: atomicity and misuse ------------------------------------------------

def test_writer_exception_leaves_nothing(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with GGUFWriter(path) as w:
            w.add_tensor_info("a", (32,), "F32")
            w.add_tensor_info("b", (32,), "F32")
            w.write_tensor("a", np.zeros(32, np.float32))
            raise RuntimeError("interrupted")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize("mistake", ["undeclared", "order", "size", "missing", "int_without_type", "long_name"])
def test_writer_misuse_is_an_error_and_leaves_nothing(tmp_path, mistake):
    path = tmp_path / "m.gguf"
    with pytest.raises((ValueError, TypeError)):
        with GGUFWriter(path) as w:
            w.add_tensor_info("a", (32,), "F32")
            w.add_tensor_info("b", (2, 32), "Q8_0")
            if mistake == "undeclared":
                w.write_tensor("a", np.zeros(32, np.float32))
                w.write_tensor("b", np.zeros((2, 32), np.float32))
                w.write_tensor("c", np.zeros(32, np.float32))
            elif mistake == "order":
                w.write_tensor("b", np.zeros((2, 32), np.float32))
            elif mistake == "size":
                w.write_tensor("a", np.zeros(31, np.float32))
            elif mistake == "missing":
                w.write_tensor("a", np.zeros(32, np.float32))
            elif mistake == "int_without_type":
                w.add_kv("x", 3)
            else:
                w.add_tensor_info("x" * 64, (32,), "F32")
    assert list(tmp_path.iterdir()) == []


_KILLED_WRITER = """
import sys, time
import numpy as np
from ggtrain.formats.gguf_writer import GGUFWriter
with GGUFWriter(sys.argv[1]) as w:
    for i in range(8):
        w.add_tensor_info(f"t{i}", (256, 1024), "F32")
    for i in range(8):
        w.write_tensor(f"t{i}", np.ones((256, 1024), np.float32))
        if i == 2:
            print("writing", flush=True)
            time.sleep(60)
"""


@pytest.mark.parametrize("existing", [False, True])
def test_killed_write_leaves_no_file_under_the_final_name(tmp_path, existing):
    path = tmp_path / "model.gguf"
    if existing:
        path.write_bytes(b"previous model")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE,
                            cwd=REPO, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    if existing:
        assert path.read_bytes() == b"previous model"
    else:
        assert not path.exists()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.gguf"]
    assert all(n.startswith(".model.gguf.") and n.endswith(".tmp") for n in leftovers)


# ---- damaged files: each check names what is wrong -----------------------------------

def _kv_base():
    return [craft.kv_str("general.architecture", "llama")]


BAD_FILES = {
    "empty": (b"", "not a GGUF file"),
    "short": (b"GGUF\x03\0\0", "truncated GGUF file"),
    "magic": (b"GGML" + bytes(40), "not a GGUF file"),
    "version1": (craft.build(version=1), "version 1 is obsolete"),
    "version9": (craft.build(version=9), "unknown GGUF version 9"),
    "big_endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    "huge_kv_count": (craft.build(_kv_base(), n_kv=2**62), "key/value count"),
    "huge_tensor_count": (craft.build(_kv_base(), n_tensors=2**40), "tensor count"),
    "kv_count_too_big": (craft.build(_kv_base(), n_kv=2), "truncated or damaged"),
    "key_len": (craft.build([struct.pack("<Q", 2**63) + b"abc" + bytes(20)]), "key of key/value pair 0"),
    "bad_utf8_key": (craft.build([craft.kv(b"\xff\xfe", 4, bytes(4))]), "not valid UTF-8"),
    "dup_key": (craft.build([craft.kv_u32("a", 1), craft.kv_u32("a", 2)]), "duplicate key 'a'"),
    "value_type": (craft.build([craft.kv("a", 13, bytes(8))]), "unknown value type 13"),
    "item_type": (craft.build([craft.kv("a", 9, struct.pack("<IQ", 99, 1))]), "unknown array item type 99"),
    "array_len": (craft.build([craft.kv("a", 9, struct.pack("<IQ", 6, 2**61) + bytes(16))]), "cannot fit"),
    "string_array_len": (craft.build([craft.kv("a", 9, struct.pack("<IQ", 8, 2**50) + craft.s("x"))]),
                         "cannot fit"),
    "string_in_array_len": (craft.build([craft.kv("a", 9, struct.pack("<IQ", 8, 2) + craft.s("x")
                                                  + struct.pack("<Q", 2**40) + b"yy")]), "string 1"),
    "string_array_utf8": (craft.build([craft.kv("a", 9, struct.pack("<IQ", 8, 1) + craft.s(b"\xc0\x80"))]),
                          "invalid UTF-8"),
    "string_value_len": (craft.build([craft.kv("a", 8, struct.pack("<Q", 99) + b"abc")]), "value of 'a'"),
    "nested_too_deep": (craft.build([craft.kv("a", 9, struct.pack("<IQ", 9, 1) * 6)]), "nested"),
    "alignment_zero": (craft.build([craft.kv_u32("general.alignment", 0)]), "not a power of two"),
    "alignment_three": (craft.build([craft.kv_u32("general.alignment", 3)]), "not a power of two"),
    "alignment_type": (craft.build([craft.kv("general.alignment", 10, struct.pack("<Q", 32))]),
                       "expected UINT32"),
    "n_dims": (craft.build(_kv_base(), [craft.tinfo("t", (1, 1, 1, 1, 1), 0, 0)], bytes(64)), "5 dimensions"),
    "ggml_type": (craft.build(_kv_base(), [craft.tinfo("t", (4,), 31, 0)], bytes(64)), "unknown ggml type 31"),
    "block_multiple": (craft.build(_kv_base(), [craft.tinfo("t", (48,), 8, 0)], bytes(64)),
                       "not a multiple of the Q8_0 block size"),
    "dup_tensor": (craft.build(_kv_base(), [craft.tinfo("t", (4,), 0, 0), craft.tinfo("t", (4,), 0, 32)],
                               bytes(64)), "duplicate tensor name 't'"),
    "past_end": (craft.build(_kv_base(), [craft.tinfo("t", (4,), 0, 64)], bytes(64)), "run past the end"),
    "huge_dims": (craft.build(_kv_base(), [craft.tinfo("t", (2**31, 2**31), 0, 0)], bytes(64)),
                  "run past the end"),
    "dim_2_63": (craft.build(_kv_base(), [craft.tinfo("t", (2**63,), 0, 0)], bytes(64)), "dimension of"),
    "misaligned": (craft.build(_kv_base(), [craft.tinfo("t", (4,), 0, 16)], bytes(64)),
                   "not a multiple of the alignment 32"),
    "overlap": (craft.build(_kv_base(), [craft.tinfo("a", (16,), 0, 0), craft.tinfo("b", (4,), 0, 32)],
                            bytes(96)), "overlap"),
    "truncated_data": (craft.f32_tensor_file(16)[:-40], "run past the end"),
    "truncated_infos": (craft.f32_tensor_file(16)[:90], "truncated or damaged"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_damaged_file_raises_format_error(tmp_path, case):
    raw, message = BAD_FILES[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(raw)
    with pytest.raises(FormatError) as info:
        read_gguf(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_good_crafted_file_reads(tmp_path):
    path = tmp_path / "ok.gguf"
    path.write_bytes(craft.f32_tensor_file(16, 3))
    f = read_gguf(path)
    assert [f.read_tensor(f"t{i}").tolist() for i in range(3)] == [list(range(16))] * 3


def test_file_shrunk_after_open(tmp_path):
    path = tmp_path / "s.gguf"
    path.write_bytes(craft.f32_tensor_file(16))
    f = read_gguf(path)
    os.truncate(path, f.data_offset + 8)
    with pytest.raises(FormatError, match="shrank|file ended"):
        f.read_tensor("t1")


def test_tensor_nbytes():
    assert tensor_nbytes((3, 64), "Q8_0") == 3 * 2 * 34
    assert tensor_nbytes((2, 256), T.Q4_K) == 2 * 144
    assert tensor_nbytes((), "F32") == 4
    with pytest.raises(ValueError):
        tensor_nbytes((3, 33), "Q4_0")


# ---- model layouts -------------------------------------------------------------------

def test_stories260k_layout(gguf_dir):
    for name in ("stories260K.gguf", "stories260K-Q8_0.gguf", "stories260K-Q4_0.gguf"):
        layout = layouts.validate_model(read_gguf(gguf_dir / name))
        c = layout.config
        assert (c.arch, c.vocab, c.dim, c.layers, c.heads, c.kv_heads, c.ff, c.ctx, c.n_rot, c.head_dim) == \
            ("llama", 512, 64, 5, 8, 4, 172, 2048, 8, 8)
        assert c.norm_eps == 1e-5 and c.rope_base == 10000.0 and c.rope_scale == 1.0 and not c.rope_freqs
        assert not layout.tied
        assert layout.shapes["blk.0.attn_k.weight"] == (32, 64)      # GQA: 4 kv heads of 8
        assert layout.shapes["blk.0.ffn_down.weight"] == (64, 172)
        assert c.n_params == 260032 + 512 * 64      # its own output matrix (not tied)


def _write_llama(path, cfg, drop=None, reshape=None, extra=None, arch=None, skip_key=None, add_kv=()):
    shapes = layouts.tensor_shapes(cfg)
    if drop:
        shapes.pop(drop)
    if reshape:
        shapes[reshape[0]] = reshape[1]
    if extra:
        shapes[extra] = (4,)
    kv = [k for k in layouts.config_to_kv(cfg, file_type=layouts.FILE_TYPES[T.F32]) if k[0] != skip_key]
    if arch:
        kv = [(k, arch if k == "general.architecture" else v, t) for k, v, t in kv]
    write_gguf(path, kv + list(add_kv), [(n, (lambda s=s: np.zeros(s, np.float32)), T.F32, s)
                                         for n, s in shapes.items()])


HP = dict(vocab=32, dim=16, layers=2, heads=4, kv_heads=2, ff=24, ctx=64)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_round_trip(tmp_path, tied):
    path = tmp_path / "l.gguf"
    cfg = ModelConfig(**HP, tied=tied)
    _write_llama(path, cfg)
    f = read_gguf(path)
    layout = layouts.validate_model(f)
    assert layout.config == cfg and layout.tied == tied
    # llama.cpp's key types
    for key in ("llama.block_count", "llama.context_length", "llama.embedding_length",
                "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
                "llama.rope.dimension_count", "llama.vocab_size", "general.file_type"):
        assert f.kv[key].type == VT.UINT32, key
    for key in ("llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"):
        assert f.kv[key].type == VT.FLOAT32, key
    assert "llama.attention.key_length" not in f.kv       # the head size is n_embd / n_head
    # gguf-py agrees on the ggml shapes (innermost first)
    ref = {t.name: t.shape.tolist() for t in gguf.GGUFReader(path).tensors}
    assert ref["blk.1.attn_k.weight"] == [16, 8] and ref["token_embd.weight"] == [16, 32]
    assert ref["blk.0.ffn_down.weight"] == [24, 16]


@pytest.mark.parametrize("arch,extra", [
    ("qwen2", dict()), ("qwen3", dict(head_dim=6)), ("llama", dict(rope_freqs=True, head_dim=10, rope_scale=4.0)),
])
def test_family_round_trip(tmp_path, arch, extra):
    """Each family's config survives its keys and tensors; gguf-py reads the head size and
    the family's tensors (biases, q/k norms, rope factors) with llama.cpp's names."""
    path = tmp_path / f"{arch}.gguf"
    cfg = ModelConfig(**HP, arch=arch, **extra)
    _write_llama(path, cfg)
    layout = layouts.validate_model(read_gguf(path))
    assert layout.config == cfg
    reader = gguf.GGUFReader(path)
    names = {t.name: t.shape.tolist() for t in reader.tensors}
    d = cfg.head_dim
    if arch == "qwen2":
        assert names["blk.1.attn_q.bias"] == [4 * d] and names["blk.0.attn_v.bias"] == [2 * d]
    if arch == "qwen3":
        assert names["blk.0.attn_q_norm.weight"] == [6] and names["blk.1.attn_k_norm.weight"] == [6]
        assert names["blk.0.attn_q.weight"] == [16, 24] and names["blk.0.attn_output.weight"] == [24, 16]
        assert reader.get_field("qwen3.attention.key_length").contents() == 6
        assert reader.get_field("qwen3.attention.value_length").contents() == 6
    if arch == "llama":
        assert names["rope_freqs.weight"] == [5]
        assert reader.get_field("llama.rope.scaling.type").contents() == "linear"


@pytest.mark.parametrize("damage,message", [
    (dict(drop="blk.1.ffn_up.weight"), "missing tensor 'blk.1.ffn_up.weight'"),
    (dict(reshape=("blk.0.attn_k.weight", (16, 16))), "'blk.0.attn_k.weight' has shape (16, 16), expected (8, 16)"),
    (dict(extra="blk.2.attn_q.weight"), "tensor 'blk.2.attn_q.weight' is not part of a llama model"),
    (dict(extra="blk.0.attn_q.bias"), "tensor 'blk.0.attn_q.bias' is not part of a llama model"),
    (dict(extra="blk.0.ffn_gate_exps.weight"), "a mixture-of-experts model"),
    (dict(arch="gpt2"), f"architecture 'gpt2' is not supported (ggtrain computes {', '.join(sorted(FAMILIES))})"),
    (dict(arch="falcon"), "architecture 'falcon' is not supported"),
    (dict(skip_key="llama.block_count"), "'llama.block_count' is missing"),
    (dict(add_kv=[("llama.rope.scaling.type", "yarn", VT.STRING)]),
     "llama.rope.scaling.type = 'yarn': a rope scaling ggtrain does not implement for llama (it applies none, linear)"),
    (dict(add_kv=[("llama.expert_count", 8, VT.UINT32)]), "llama.expert_count = 8: a mixture-of-experts model"),
    (dict(add_kv=[("llama.attention.sliding_window", 4096, VT.UINT32)]),
     "key 'llama.attention.sliding_window' is not applied by ggtrain's llama decoder"),
    (dict(add_kv=[("llama.attention.value_length", 8, VT.UINT32)]),
     "llama.attention.value_length 8 differs from the key head size 4"),
])
def test_llama_validation_errors(tmp_path, damage, message):
    path = tmp_path / "bad.gguf"
    _write_llama(path, ModelConfig(**HP), **damage)
    with pytest.raises(FormatError) as info:
        layouts.validate_model(read_gguf(path))
    assert message in str(info.value)


def test_qwen2_file_without_its_biases_is_refused(tmp_path):
    path = tmp_path / "q.gguf"
    _write_llama(path, ModelConfig(**HP, arch="qwen2"), drop="blk.1.attn_k.bias")
    with pytest.raises(FormatError, match="missing tensor 'blk.1.attn_k.bias'.*qwen2"):
        layouts.validate_model(read_gguf(path))


def test_llama_vocab_only_file(gguf_dir):
    with pytest.raises(FormatError, match="vocab-only"):
        layouts.validate_model(read_gguf(gguf_dir / "ggml-vocab-llama-spm.gguf"))


def test_llama_bad_hparams():
    with pytest.raises(ConfigError, match="multiple of kv_heads"):
        ModelConfig(vocab=8, dim=16, layers=1, heads=4, kv_heads=3, ff=8, ctx=8)
    with pytest.raises(ConfigError, match="architecture 'gpt2' is not supported"):
        ModelConfig(vocab=8, arch="gpt2")
