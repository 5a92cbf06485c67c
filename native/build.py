"""cffi builders for the native core (layer 1): the CPU module, built in API mode.

`ffibuilder` compiles every native/cpu/*.c file into the extension
`ggtrain.native._cpu`, with the declarations of native/ggtrain.h as its cdef.
setup.py names it in `cffi_modules`; `python native/build.py` builds in place.
"""
import os
import pathlib
import re

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent


def _cdef_text() -> str:
    """ggtrain.h without comments (cffi's parser needs no directives, and has none)."""
    text = (HERE / "ggtrain.h").read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return text


def _sources() -> list:
    # Relative paths keep the build reproducible and the paths short in messages.
    root = HERE.parent
    return sorted(os.path.relpath(p, root) for p in (HERE / "cpu").glob("*.c"))


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
ffibuilder.cdef(_cdef_text())
ffibuilder.set_source(
    "ggtrain.native._cpu",
    '#include "native/ggtrain.h"\n',
    sources=_sources(),
    include_dirs=[str(HERE.parent)],
    extra_compile_args=_CFLAGS,
    extra_link_args=["-pthread", "-lm"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=False)
