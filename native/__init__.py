"""Loader of the native core (layer 1): the cffi module, and `_check`.

`error_for(rc, message)` is the only place a gt_status becomes an exception (`_check` for the
CPU library, core/backend_cuda.py for the CUDA one).
"""
from ggtrain.errors import (
    DTypeError,
    GgtrainError,
    NativeError,
    OutOfMemoryError,
    ShapeError,
    UnsupportedOpError,
)

try:
    from ggtrain.native._cpu import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "ggtrain's native module is not built: run `pip install -e .` "
        "(or `python setup.py build_ext --inplace` after editing C)"
    ) from exc

# gt_status values (see gt_core.h)
GT_OK = 0
_ERRORS = {
    lib.GT_ERR_INVALID: lambda m, c: _ValueNativeError(m, c),
    lib.GT_ERR_SHAPE: lambda m, c: ShapeError(m),
    lib.GT_ERR_DTYPE: lambda m, c: DTypeError(m),
    lib.GT_ERR_NOMEM: lambda m, c: OutOfMemoryError(m),
    lib.GT_ERR_THREAD: lambda m, c: NativeError(m, c),
    lib.GT_ERR_UNSUPPORTED: lambda m, c: UnsupportedOpError(m),
}


class _ValueNativeError(NativeError, ValueError):
    """An invalid argument caught by the native core."""


def last_error() -> str:
    """The message of the last native failure on this thread."""
    return ffi.string(lib.gt_last_error()).decode("utf-8", "replace")


def error_for(rc: int, msg: str) -> Exception:
    """The exception of a gt_status with its message (any backend's)."""
    make = _ERRORS.get(rc)
    return make(msg, rc) if make else NativeError(msg, rc)


def _check(rc: int, what: str = "") -> None:
    """Raise the exception matching a gt_status of the CPU library (no-op for GT_OK)."""
    if rc == GT_OK:
        return
    msg = last_error() or f"native error {rc}"
    if what:
        msg = f"{what}: {msg}"
    raise error_for(rc, msg)


__all__ = ["ffi", "lib", "_check", "error_for", "last_error", "GgtrainError"]
