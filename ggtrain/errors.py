"""Exception classes of ggtrain (layer 0).

Each class derives from GgtrainError and from the builtin it refines, so callers
can catch either the project base or the builtin (STYLE §7).
"""


class GgtrainError(Exception):
    """Base of every error ggtrain raises on purpose."""


class ShapeError(GgtrainError, ValueError):
    """Shapes that do not fit together."""


class DTypeError(GgtrainError, TypeError):
    """A dtype an op or kernel does not take."""


class UnsupportedOpError(GgtrainError, NotImplementedError):
    """An op a backend (or a build) cannot run."""


class NativeError(GgtrainError, RuntimeError):
    """A failure reported by the native core; `.code` is the gt_status value."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(message)
        self.code = code


class DeviceError(NativeError):
    """A failure of an accelerator device or its runtime."""


class OutOfMemoryError(GgtrainError, MemoryError):
    """An allocation that could not be served."""


class FormatError(GgtrainError, ValueError):
    """A file that is not what it claims to be (GGUF, IDX, checkpoint)."""


class ConfigError(GgtrainError, ValueError):
    """A bad option value or combination of options."""


class WriteError(GgtrainError, OSError):
    """A file that could not be written (a full disk, a folder that is not writable); the
    file's previous content, if any, is intact (writes go through a temporary)."""


class NumericError(GgtrainError, ArithmeticError):
    """Training diverged: a loss or gradient became NaN or infinite."""
