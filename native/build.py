"""cffi builders for the native core (layer 1): the CPU module, built in API mode.

`ffibuilder` compiles every native/cpu/*.c file into the extension
`ggtrain.native._cpu`, with the declarations of native/gt_core.h and native/ggtrain.h as
its cdef (build_cuda.py builds the CUDA library beside it when nvcc is there).
setup.py names it in `cffi_modules`; `python native/build.py` builds in place.
"""
import os
import pathlib
import re

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent


def cdef_text(*headers: str) -> str:
    """The headers' declarations without comments (cffi's parser needs no directives, and
    they have none): gt_core.h (what the backends share) and the backend's own API."""
    text = "\n".join((HERE / h).read_text() for h in headers)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _sources() -> list:
    # Relative paths keep the build reproducible and the paths short in messages.
    root = HERE.parent
    return sorted(os.path.relpath(p, root) for p in (HERE / "cpu").glob("*.c"))


def _headers() -> list:
    # The headers the sources include: build_ext rebuilds the extension only when a file it
    # depends on is newer than it, and without these a changed header (a constant, an inline
    # function) left every object as it was.
    root = HERE.parent
    return sorted(os.path.relpath(p, root) for p in [*HERE.glob("*.h"), *(HERE / "cpu").glob("*.h")])


# NOTE: GCC 12 at -O2 vectorizes only loops that need no scalar epilogue ("very cheap"
# cost model); the dynamic model vectorizes the plain elementwise loops too. No fast-math.
# -fno-math-errno: sqrtf may then be the (correctly rounded) vector instruction; with
# errno to set for negative inputs GCC kept every loop with a sqrtf scalar (AdamW's step
# ran at ~8 cycles an element). Nothing here reads errno, and no result changes.
_CFLAGS = ["-O2", "-fvect-cost-model=dynamic", "-fno-math-errno", "-std=c11", "-Wall", "-Wextra",
           "-fno-strict-aliasing", "-pthread"]
if os.environ.get("GGTRAIN_NATIVE_WERROR") == "1":
    _CFLAGS.append("-Werror")

ffibuilder = FFI()
ffibuilder.cdef(cdef_text("gt_core.h", "ggtrain.h"))
ffibuilder.set_source(
    "ggtrain.native._cpu",
    '#include <stdint.h>\n#include "native/gt_core.h"\n#include "native/ggtrain.h"\n',
    sources=_sources(),
    depends=_headers(),
    include_dirs=[str(HERE.parent)],
    extra_compile_args=_CFLAGS,
    extra_link_args=["-pthread", "-lm"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=False)
