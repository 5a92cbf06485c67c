"""The one dtype table (native/cpu/dtype.c, read by ggtrain.native.dtypes) against gguf-py,
and its flags against what the native converters really do."""
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ggtrain.errors import DTypeError, ShapeError, UnsupportedOpError
from ggtrain.native import _check, ffi, lib
from ggtrain.native.dtypes import DTYPES, WEIGHT_TYPES, dtype, nbytes


def test_table_equals_gguf_block_sizes():
    ours = {d.id: (d.name, d.block, d.block_bytes) for d in DTYPES.values()}
    theirs = {int(t): (t.name.lower(), *GGML_QUANT_SIZES[t]) for t in GGML_QUANT_SIZES}
    assert ours == theirs


def test_lookup_by_name_id_and_enum():
    assert dtype("Q4_K") is dtype("q4_k") is dtype(T.Q4_K) is dtype(int(T.Q4_K))
    assert dtype("f32").itemsize == 4 and dtype("bf16").numpy == np.uint16
    assert dtype("f16").numpy == np.float16 and dtype("i32").numpy == np.int32
    with pytest.raises(DTypeError, match="unknown dtype 'q9_9'"):
        dtype("q9_9")
    with pytest.raises(DTypeError, match="unknown ggml type 99"):
        dtype(99)
    with pytest.raises(DTypeError, match="block type"):
        dtype("q8_0").itemsize


def test_nbytes():
    assert nbytes((3, 64), "q8_0") == 3 * 2 * 34
    assert nbytes((2, 256), "q4_k") == 2 * 144
    assert nbytes((5, 7), "f16") == 70
    assert nbytes((), "f32") == 4
    assert nbytes((0, 32), "q4_0") == 0
    with pytest.raises(ShapeError, match="multiple of 32"):
        nbytes((3, 33), "q4_0")


@pytest.mark.parametrize("name", list(DTYPES))
def test_flags_match_the_converters(name):
    """DEQUANTIZE/QUANTIZE are exactly the types gt_dequantize_row/gt_quantize_row take."""
    d = DTYPES[name]
    n = d.block * 2
    raw = np.zeros(nbytes((n,), d), np.uint8)
    f = np.zeros(n, np.float32)
    rc = lib.gt_dequantize_row(ffi.cast("float *", f.ctypes.data), ffi.cast("void *", raw.ctypes.data), d.id, n)
    if d.can_dequantize:
        _check(rc)
        assert not f.any()
    else:
        with pytest.raises(UnsupportedOpError, match=name):
            _check(rc)
    rc = lib.gt_quantize_row(ffi.cast("void *", raw.ctypes.data), ffi.cast("float *", f.ctypes.data), d.id, n)
    if d.can_quantize:
        _check(rc)
    else:
        with pytest.raises(UnsupportedOpError, match=name):
            _check(rc)


def test_weight_types_are_the_readable_ones():
    assert set(WEIGHT_TYPES) == {"f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
                                 "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4"}


def test_hyper_layout_comes_from_the_header():
    from ggtrain.core import ops
    assert (ops.HYPER_LR, ops.HYPER_MOMENTUM, ops.HYPER_COUNT) == (
        lib.GT_HYPER_LR, lib.GT_HYPER_MOMENTUM, lib.GT_HYPER_COUNT)
    assert len({ops.HYPER_LR, ops.HYPER_BETA1, ops.HYPER_BETA2, ops.HYPER_EPS, ops.HYPER_WD,
                ops.HYPER_BC1, ops.HYPER_BC2, ops.HYPER_MAX_NORM, ops.HYPER_MOMENTUM}) == 9
