"""Helpers of the tests that ask real llama.cpp (llama-cpp-python, the interop extra) and run
the `ggtrain` command."""
import contextlib
import io
import itertools
import subprocess
import sys
import traceback

import numpy as np


def run_cli(*args):
    """`python -m ggtrain ARGS` in a subprocess (stdout and stderr captured as text)."""
    return subprocess.run([sys.executable, "-m", "ggtrain", *map(str, args)], capture_output=True, text=True)


def run_here(*args):
    """`ggtrain ARGS` as run_cli gives it (returncode, stdout, stderr), run by the console entry
    point (ggtrain.cli.main.main: its parsing, error mapping and exit codes) in this process:
    no interpreter start and imports per call (seconds each). For tests of what a command
    computes; a test of the process itself (signals, stray output of the C side) uses run_cli.
    An exception main() lets through (a bug) is its traceback on stderr and status 1, as the
    interpreter ends a process with it."""
    from ggtrain.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                err.write(f"{exc.code}\n")
        except Exception:       # noqa: BLE001 (a bug's traceback, as the process would show it)
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["ggtrain", *map(str, args)], code, out.getvalue(), err.getvalue())


def open_llm(llama, model, lora=None, scale=1.0, n_ctx=256, logits_all=True):
    """A quiet 2-thread llama.cpp context on `model` (with an adapter at `scale`), F32 KV cache (so
    its logits can be compared with ours): logits of every position, or with logits_all=False of
    the last one only (last_logits), as generation runs: its graphs then give the last block's
    FFN and the head that one row, which picks their kernels' orders."""
    kw = dict(lora_path=str(lora), lora_scale=scale) if lora else {}
    return llama.Llama(model_path=str(model), n_ctx=n_ctx, n_threads=2, n_threads_batch=2, seed=0,
                       logits_all=logits_all, verbose=False, type_k=llama.GGML_TYPE_F32, type_v=llama.GGML_TYPE_F32,
                       flash_attn=False, **kw)


def last_logits(llm, ids) -> np.ndarray:
    """The logits after the last of ids (n_vocab,), from a context opened with logits_all=False."""
    llm.reset()
    llm.eval(list(ids))
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()


def greedy(llm, ids, n):
    """llama.cpp's greedy continuation of ids: n token ids."""
    llm.reset()
    return [int(t) for t in itertools.islice(llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                                           repeat_penalty=1.0), n)]


def their_nll(llama, model, text: str, window: int) -> float:
    """llama.cpp's mean NLL of text (with BOS) in non-overlapping windows of `window` tokens
    (each from an empty cache, as `ggtrain eval` scores them), F32 KV cache."""
    llm = open_llm(llama, model, n_ctx=window)
    ids = llm.tokenize(text.encode(), add_bos=True)
    total = 0.0
    for s in range(0, len(ids) - 1, window):
        w = ids[s:s + window + 1]
        llm.reset()
        llm.eval(w[:-1])
        logits = np.array(llm.scores[:len(w) - 1], np.float64)
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        total -= logp[np.arange(len(w) - 1), w[1:]].sum()
    return total / (len(ids) - 1)


def their_half_window_nll(llama, model, text: str, n_ctx: int) -> tuple:
    """(mean NLL, tokens scored) as llama-perplexity scores text (its default, no stride): chunks
    of n_ctx tokens of the text tokenized with BOS, the last partial chunk dropped, each chunk's
    first token replaced by BOS (where the vocabulary adds one), the whole chunk decoded from an empty cache, and the tokens after
    position n_ctx / 2 scored; F32 KV cache."""
    llm = open_llm(llama, model, n_ctx=n_ctx)
    ids = llm.tokenize(text.encode(), add_bos=True)
    adds_bos = len(llm.tokenize(b"a", add_bos=True)) > len(llm.tokenize(b"a", add_bos=False))
    first, total, count = n_ctx // 2, 0.0, 0
    for s in range(0, len(ids) - n_ctx + 1, n_ctx):
        chunk = ([llm.token_bos()] if adds_bos else ids[s:s + 1]) + ids[s + 1:s + n_ctx]
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[first:n_ctx - 1], np.float64)
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        total -= logp[np.arange(len(logits)), chunk[first + 1:]].sum()
        count += len(logits)
    return total / count, count


def random_lora_pairs(rng, weights: dict, layers: int, targets=("attn_q", "attn_v", "ffn_up", "ffn_down"),
                      rank: int = 16, std: float = 0.3) -> dict:
    """{weight name: (A (rank, n_in), B (n_out, rank))} f32, normal with `std`, for the targets of
    every block: an adapter whose effect is large enough to see."""
    pairs = {}
    for i in range(layers):
        for t in targets:
            w = f"blk.{i}.{t}.weight"
            n_out, n_in = weights[w].shape
            pairs[w] = (rng.normal(0, std, (rank, n_in)).astype(np.float32),
                        rng.normal(0, std, (n_out, rank)).astype(np.float32))
    return pairs


def ggml_quantize(llama, x: np.ndarray, type_id: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """The bytes llama-cpp-python's own libggml-base writes for f32 rows x (rows, n) as ggml type
    type_id (ggml_quantize_chunk, what llama_model_quantize calls), with the importance of each
    of the n columns (imatrix, f32) or without one."""
    import ctypes
    import os

    from ggtrain.native.dtypes import nbytes
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama.__file__), "lib", "libggml-base.so"))
    f = lib.ggml_quantize_chunk
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p]
    f.restype = ctypes.c_size_t
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros(nbytes(x.shape, type_id), np.uint8)
    im = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    assert f(type_id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
             None if im is None else im.ctypes.data) == out.size
    return out


def imatrix_with_llama_cpp(llama, model, text: str, ctx: int, chunks: int, kv_f32: bool) -> tuple:
    """llama-imatrix's sums computed by llama-cpp-python's own library (the build whose numbers
    --numerics llama follows): its collector as tools/imatrix/imatrix.cpp writes it, an eval
    callback (cb_eval) that takes the f32 input of every MUL_MAT of a blk.* weight with at least
    16 rows and adds x[j] * x[j] row after row into f32 sums, counting the rows, and of every
    MUL_MAT_ID (the stacked experts) adds each routed row into its expert's sums (n_expert, n)
    slot after slot, token after token within a slot, counting each expert's rows; the text
    tokenized by llama.cpp (BOS where the vocabulary asks, no special tokens), `chunks` chunks of
    ctx tokens each starting with BOS where it asks, each decoded from an empty memory with every
    position's logits asked for, without flash attention, the KV cache F32 (kv_f32) or F16.
    Returns ({weight name: (n,) or (n_expert, n) f32 sums}, {weight name: rows counted, or
    (n_expert,) per expert})."""
    import ctypes
    import os

    base = ctypes.CDLL(os.path.join(os.path.dirname(llama.__file__), "lib", "libggml-base.so"))
    base.ggml_op_name.restype = ctypes.c_char_p
    base.ggml_op_name.argtypes = [ctypes.c_int]

    class Tensor(ctypes.Structure):     # struct ggml_tensor of ggml.h
        pass
    Tensor._fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                       ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                       ("flags", ctypes.c_int32), ("src", ctypes.POINTER(Tensor) * 10),
                       ("view_src", ctypes.POINTER(Tensor)), ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p),
                       ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]
    sums, counts = {}, {}

    def weight_name(t) -> str:      # "CPU#blk.0.attn_q.weight#0" -> "blk.0.attn_q.weight"
        name = t.name.decode()
        return name.split("#")[1] if "#" in name else name

    def rows_of(x, i1, i2, i3=0):
        at = x.data + i1 * x.nb[1] + i2 * x.nb[2] + i3 * x.nb[3]
        return np.ctypeslib.as_array((ctypes.c_float * x.ne[0]).from_address(at))

    def collect_experts(t, ask):
        w, x, ids = t.src[0].contents, t.src[1].contents, t.src[2].contents
        if ask:
            return True
        name, n_as = weight_name(w), w.ne[2]
        assert x.type == 0 and ids.ne[1] == x.ne[2], name
        acc = sums.setdefault(name, np.zeros((n_as, x.ne[0]), np.float32))
        n = counts.setdefault(name, np.zeros(n_as, np.int64))
        for slot in range(ids.ne[0]):
            for token in range(ids.ne[1]):
                ex = ctypes.c_int32.from_address(ids.data + token * ids.nb[1] + slot * ids.nb[0]).value
                row = rows_of(x, slot % x.ne[1], token)
                acc[ex] += row * row
                n[ex] += 1
        return True

    @llama.ggml_backend_sched_eval_callback
    def collect(ptr, ask, _):
        t = ctypes.cast(ptr, ctypes.POINTER(Tensor)).contents
        if base.ggml_op_name(t.op) == b"MUL_MAT_ID":
            return collect_experts(t, ask)
        if base.ggml_op_name(t.op) != b"MUL_MAT":
            return not ask
        w, x = t.src[0].contents, t.src[1].contents
        name = weight_name(w)
        if ask:
            return x.ne[1] >= 16 and x.type == 0 and name.startswith("blk.")
        acc = sums.setdefault(name, np.zeros(x.ne[0], np.float32))
        for i3 in range(x.ne[3]):
            for i2 in range(x.ne[2]):
                for r in range(x.ne[1]):
                    row = rows_of(x, r, i2, i3)
                    acc += row * row
        counts[name] = counts.get(name, 0) + x.ne[1] * x.ne[2] * x.ne[3]
        return True

    mp = llama.llama_model_default_params()
    m = llama.llama_model_load_from_file(str(model).encode(), mp)
    cp = llama.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = max(256, ctx), ctx, ctx, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = cp.type_v = llama.GGML_TYPE_F32 if kv_f32 else llama.GGML_TYPE_F16
    cp.cb_eval = collect
    c = llama.llama_init_from_model(m, cp)
    vocab = llama.llama_model_get_vocab(m)
    data = text.encode()
    ids = (llama.llama_token * (len(data) + 8))()
    n = llama.llama_tokenize(vocab, data, len(data), ids, len(ids), True, False)
    assert 0 <= n and n >= chunks * ctx, n
    batch = llama.llama_batch_init(ctx, 0, 1)
    try:
        for i in range(chunks):
            llama.llama_memory_clear(llama.llama_get_memory(c), True)
            batch.n_tokens = ctx
            for k in range(ctx):
                bos = k == 0 and llama.llama_vocab_get_add_bos(vocab)
                batch.token[k] = llama.llama_vocab_bos(vocab) if bos else ids[i * ctx + k]
                batch.pos[k], batch.n_seq_id[k], batch.logits[k] = k, 1, True
                batch.seq_id[k][0] = 0
            assert llama.llama_decode(c, batch) == 0
    finally:
        llama.llama_batch_free(batch)
        llama.llama_free(c)
        llama.llama_model_free(m)
    return sums, counts


def quantize_with_llama_cpp(llama, src, dst, file_type: int, requantize: bool = False, imatrix: dict | None = None,
                            expect: int = 0) -> None:
    """llama.cpp's llama_model_quantize of the model src into dst as file_type (an LLAMA_FTYPE),
    default parameters, 2 threads; with imatrix {tensor name: f32 importance} as its importance
    matrix (params.imatrix: an array of {name, data, size} ended by a null name, as
    llama-quantize passes it). expect: its status (1: it refused)."""
    import ctypes

    params = llama.llama_model_quantize_default_params()
    params.ftype = int(file_type)
    params.nthread = 2
    params.allow_requantize = requantize
    keep = []
    if imatrix is not None:
        entries = (llama.llama_model_imatrix_data * (len(imatrix) + 1))()
        for e, (name, v) in zip(entries, imatrix.items()):
            v = np.ascontiguousarray(v, np.float32)
            keep.append(v)
            e.name = name.encode()
            e.data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            e.size = v.size
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama.llama_model_imatrix_data))
        keep.append(entries)
    assert llama.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == expect


# small random models whose rules and fallbacks cover llama.cpp's mixtures: rows of whole Q*_K
# blocks, the output untied, 8 layers (Q4_K_M's more-bits layers 0, 3, 6 and 7), GQA 4 (Q2_K's
# attn_v Q4_K); and SmolLM2's widths (576: the fallbacks, ffn_down's 1536: K-quants), tied, F16
SMALL_MODELS = {"k256-f32": (dict(dim=256, layers=8, heads=8, kv_heads=2, ff=256, ctx=64), "f32"),
                "w576-tied-f16": (dict(dim=576, layers=2, heads=9, kv_heads=3, ff=1536, ctx=64, tied=True), "f16")}


def write_small_models(folder) -> dict:
    """{name: path} of SMALL_MODELS written into folder (byte tokenizer, random weights, seed 1)."""
    from ggtrain.core.models.config import ModelConfig, init_params
    from ggtrain.formats.model_file import save_model
    from ggtrain.formats.tokenizer import load_tokenizer

    tok = load_tokenizer("byte", "First Citizen: Before we proceed any further, hear me speak.")
    models = {}
    for name, (shape, t) in SMALL_MODELS.items():
        config = dict(vocab=tok.n_vocab, **shape)
        models[name] = folder / f"{name}.gguf"
        save_model(models[name], config, init_params(ModelConfig(**config), seed=1, std=0.02), tok, out_type=t)
    return models


def same_model_files(ours, theirs) -> None:
    """The same tensors (names, types, bytes, in any order) and general.file_type."""
    from ggtrain.formats.gguf import read_gguf
    a, b = read_gguf(ours), read_gguf(theirs)
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, info in b.tensors.items():
        assert a.tensors[name].type == info.type, (name, a.tensors[name].type.name, info.type.name)
        assert np.array_equal(a.read_tensor(name).view(np.uint8), b.read_tensor(name).view(np.uint8)), name
    assert a.value("general.file_type") == b.value("general.file_type")
