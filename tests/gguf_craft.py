"""Hand-built GGUF bytes for the format tests, independent of our GGUF reader and writer.

`build` assembles a file from pieces so a test can write exactly the damage it
wants; `field_positions` walks a well-formed file and records where each count,
length, type and offset lies, so the fuzz test can aim its mutations.
"""
import struct

ALIGN = 32


def s(x) -> bytes:
    """A GGUF string: u64 length, then the bytes."""
    b = x.encode("utf-8") if isinstance(x, str) else bytes(x)
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def kv_u32(key, v) -> bytes:
    return kv(key, 4, struct.pack("<I", v))


def kv_str(key, v) -> bytes:
    return kv(key, 8, s(v))


def tinfo(name, ne, ggml_type: int, offset: int) -> bytes:
    return (s(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", ggml_type, offset))


def build(kvs=(), infos=(), data=b"", version=3, n_kv=None, n_tensors=None, align=ALIGN,
          magic=b"GGUF") -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    meta = head + b"".join(kvs) + b"".join(infos)
    if infos:
        meta += b"\0" * (-len(meta) % align)
    return meta + data


def f32_tensor_file(n=4, count=2) -> bytes:
    """`count` F32 tensors of n elements, one after the other (aligned)."""
    infos, data = [], b""
    for i in range(count):
        infos.append(tinfo(f"t{i}", (n,), 0, len(data)))
        data += struct.pack(f"<{n}f", *range(n)) + b"\0" * (-(4 * n) % ALIGN)
    return build([kv_str("general.architecture", "test")], infos, data)


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def field_positions(raw: bytes) -> dict:
    """Byte positions of the fields of a well-formed little-endian GGUF file:
    {"tensor_count": [8], "kv_count": [16], "string_len": [...], "value_type": [...],
    "array_len": [...], "item_type": [...], "n_dims": [...], "dims": [...],
    "ggml_type": [...], "tensor_offset": [...], "alignment_value": [...]},
    plus "data_offset" and "data_end" (end of the last tensor's bytes)."""
    pos = {k: [] for k in ("string_len", "value_type", "array_len", "item_type", "n_dims", "dims",
                           "ggml_type", "tensor_offset", "alignment_value")}
    pos["tensor_count"], pos["kv_count"] = [8], [16]
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)
    p = 24
    align = ALIGN

    def string(p):
        pos["string_len"].append(p)
        (n,) = struct.unpack_from("<Q", raw, p)
        return p + 8 + n

    def value(p, t):
        if t == 8:
            return string(p)
        if t == 9:
            pos["item_type"].append(p)
            it, n = struct.unpack_from("<IQ", raw, p)
            pos["array_len"].append(p + 4)
            p += 12
            if it in _SIZES:
                return p + n * _SIZES[it]
            for _ in range(n):
                p = value(p, it)
            return p
        return p + _SIZES[t]

    for _ in range(n_kv):
        kstart = p + 8
        p = string(p)
        key = raw[kstart:p].decode()
        pos["value_type"].append(p)
        (t,) = struct.unpack_from("<I", raw, p)
        p += 4
        if key == "general.alignment":
            pos["alignment_value"].append(p)
            (align,) = struct.unpack_from("<I", raw, p)
        p = value(p, t)
    ends = []
    sizes = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34), 30: (1, 2), 26: (1, 4), 24: (1, 1)}
    for _ in range(n_tensors):
        p = string(p)
        pos["n_dims"].append(p)
        (nd,) = struct.unpack_from("<I", raw, p)
        p += 4
        ne = struct.unpack_from(f"<{nd}Q", raw, p)
        pos["dims"].extend(p + 8 * i for i in range(nd))
        p += 8 * nd
        pos["ggml_type"].append(p)
        (t,) = struct.unpack_from("<I", raw, p)
        pos["tensor_offset"].append(p + 4)
        (off,) = struct.unpack_from("<Q", raw, p + 4)
        p += 12
        n = 1
        for d in ne:
            n *= d
        block, size = sizes[t]
        ends.append(off + n // block * size)
    pos["data_offset"] = -(-p // align) * align
    pos["data_end"] = pos["data_offset"] + max(ends, default=0)
    return pos
