"""GGUF files (layer 5): the names most callers use, from the modules that hold them.

`read_gguf` and `GGUFFile` come from formats.gguf_reader (the bounds-checked reader),
`write_gguf` from formats.gguf_writer (the streaming atomic writer). The rest lives where it
is made: `GGUFWriter` in gguf_writer, typed values and tensor infos in gguf_values,
conversion between f32 and the ggml types in quants.
"""
from ggtrain.formats.gguf_reader import GGUFFile, read_gguf
from ggtrain.formats.gguf_writer import write_gguf

__all__ = ["GGUFFile", "read_gguf", "write_gguf"]
