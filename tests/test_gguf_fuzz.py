"""Fuzzing the GGUF reader with damaged copies of real and written files.

Every damaged copy must either read (and then every tensor and value must read
too) or raise FormatError: never another exception, a crash, a hang or a giant
allocation. Damage aimed at counts, lengths, offsets and alignment must always be
caught. Each file is bounded in time.
"""
import gc
import struct
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFValueType as VT

from ggtrain.errors import FormatError
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.gguf_writer import GGUFWriter
from ggtrain.formats.gguf_values import make_value
from tests import gguf_craft as craft
from tests.conftest import SHARED_DATA

SEED = 20240607
# Bound on reading one damaged file, relative to reading the undamaged one in the same
# run (a hang or a runaway loop is orders of magnitude slower; a loaded machine slows
# both alike), with a floor for the millisecond-sized files.
SLOWDOWN = 50
FLOOR_S = 0.5


def _written_file(path):
    """A file of ours with many value types, several tensor types and alignment 64."""
    rng = np.random.default_rng(0)
    with GGUFWriter(path, alignment=64) as w:
        w.add_kv("general.architecture", "llama")
        w.add_kv("a.u32", 7, VT.UINT32)
        w.add_kv("a.strs", ["x", "", "▁y", "zz"], VT.ARRAY, VT.STRING)
        w.add_kv("a.f32s", np.arange(6, dtype=np.float32))
        w.add_kv("a.bools", [True, False], VT.ARRAY, VT.BOOL)
        w.add_kv("a.nested", [make_value([1, 2], VT.ARRAY, VT.INT32), make_value([3], VT.ARRAY, VT.INT32)],
                 VT.ARRAY, VT.ARRAY)
        x = rng.standard_normal((4, 64)).astype(np.float32)
        for name, t in (("w.f32", T.F32), ("w.f16", T.F16), ("w.q8_0", T.Q8_0), ("w.q4_0", T.Q4_0),
                        ("w.bf16", T.BF16)):
            w.add_tensor_info(name, x.shape, t)
        w.add_tensor_info("w.i32", (5,), T.I32)
        for name in ("w.f32", "w.f16", "w.q8_0", "w.q4_0", "w.bf16"):
            w.write_tensor(name, x)
        w.write_tensor("w.i32", np.arange(5, dtype=np.int32))
    return path.read_bytes()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Our written file, plus two real files when ../shared is present."""
    files = {"written": _written_file(tmp_path_factory.mktemp("src") / "w.gguf")}
    shared = SHARED_DATA / "gguf"
    for name in ("stories260K-Q8_0.gguf", "ggml-vocab-llama-spm.gguf"):
        if (shared / name).is_file():
            files[name] = (shared / name).read_bytes()
    return files


def _read_everything(path):
    f = read_gguf(path)
    for v in f.kv.values():
        v.to_python()
    for name in f.tensors:
        f.read_tensor(name)
    return f


def _attempt(path, raw, must_fail, label, limit_s):
    path.write_bytes(raw)
    gc.disable()    # a collection of the whole test session's heap is not the reader's time
    t0 = time.perf_counter()
    try:
        _read_everything(path)
        ok = True
    except FormatError:
        ok = False
    except Exception as exc:  # noqa: BLE001 - the point of the test
        raise AssertionError(f"{label}: {type(exc).__name__}: {exc}") from exc
    finally:
        dt = time.perf_counter() - t0
        gc.enable()
    assert dt < limit_s, f"{label}: took {dt:.2f} s (limit {limit_s:.2f} s)"
    if must_fail:
        assert not ok, f"{label}: damaged file was accepted"
    return ok


def _put_u64(raw, at, v):
    b = bytearray(raw)
    b[at:at + 8] = struct.pack("<Q", v)
    return bytes(b)


def _put_u32(raw, at, v):
    b = bytearray(raw)
    b[at:at + 4] = struct.pack("<I", v)
    return bytes(b)


def _mutations(name, raw, rng):
    """(label, bytes, must_fail) for one source file."""
    pos = craft.field_positions(raw)
    end = pos["data_end"] if pos["tensor_offset"] else len(raw)
    out = []
    # truncations anywhere before the end of the last tensor (or of the file)
    for cut in sorted(set(rng.integers(0, end, 40).tolist()) | {0, 3, 23, 24, end - 1}):
        out.append((f"{name}: truncated to {cut}", raw[:cut], True))
    # flipped bytes in the metadata
    meta_end = min(pos["data_offset"], len(raw))
    for at in rng.integers(0, meta_end, 60).tolist():
        b = bytearray(raw)
        b[at] ^= 1 << int(rng.integers(0, 8))
        out.append((f"{name}: bit flip at {at}", bytes(b), False))
    for at in rng.integers(0, meta_end, 20).tolist():
        b = bytearray(raw)
        b[at] = int(rng.integers(0, 256))
        out.append((f"{name}: byte {at} replaced", bytes(b), False))
    # huge counts and lengths
    huge = [2**64 - 1, 2**63, 2**40, len(raw) * 3]
    for field in ("kv_count", "tensor_count", "string_len", "array_len", "dims"):
        places = pos[field]
        for at in rng.choice(places, min(len(places), 6), replace=False).tolist() if places else []:
            out.append((f"{name}: {field} at {at} huge", _put_u64(raw, at, huge[int(rng.integers(len(huge)))]), True))
    # unknown value / item / tensor types, too many dims
    for field, bad in (("value_type", [13, 255, 2**32 - 1]), ("item_type", [13, 99]),
                       ("ggml_type", [4, 5, 31, 1000]), ("n_dims", [5, 2**31])):
        places = pos[field]
        for at in rng.choice(places, min(len(places), 3), replace=False).tolist() if places else []:
            out.append((f"{name}: {field} at {at} = bad", _put_u32(raw, at, bad[int(rng.integers(len(bad)))]), True))
    # tensor offsets: past the end, misaligned, overlapping
    offs = pos["tensor_offset"]
    if offs:
        data_size = len(raw) - pos["data_offset"]
        for at in rng.choice(offs, min(len(offs), 5), replace=False).tolist():
            out.append((f"{name}: offset at {at} past end", _put_u64(raw, at, data_size + 4096), True))
            (cur,) = struct.unpack_from("<Q", raw, at)
            out.append((f"{name}: offset at {at} misaligned", _put_u64(raw, at, cur + 4), True))
        for _ in range(6):
            i, j = rng.choice(len(offs), 2, replace=False).tolist()
            (other,) = struct.unpack_from("<Q", raw, offs[j])
            out.append((f"{name}: tensor {i} moved onto tensor {j}", _put_u64(raw, offs[i], other), True))
    for at in pos["alignment_value"]:
        for bad in (0, 3, 48, 2**31 + 1):
            out.append((f"{name}: alignment {bad}", _put_u32(raw, at, bad), True))
    return out


def test_fuzz_damaged_files_raise_format_error(sources, tmp_path):
    # NOTE: earlier tests leave garbage (test_gguf.py's gguf-py readers of large vocabularies)
    # whose collection takes over a second; collected here, it cannot land in a timed read
    gc.collect()
    rng = np.random.default_rng(SEED)
    path = tmp_path / "fuzz.gguf"
    total = accepted = 0
    t0 = time.perf_counter()
    for name, raw in sources.items():
        path.write_bytes(raw)
        t1 = time.perf_counter()
        _read_everything(path)
        limit = max(FLOOR_S, SLOWDOWN * (time.perf_counter() - t1))
        for label, data, must_fail in _mutations(name, raw, rng):
            accepted += _attempt(path, data, must_fail, label, limit)
            total += 1
    print(f"{total} damaged files, {accepted} still valid, {time.perf_counter() - t0:.2f} s")
    assert total >= 150 * len(sources) // 2
