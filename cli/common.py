"""Pieces the training and inference commands share (layer 6): backend choice, the
processes of a data-parallel run, the --log JSON-lines writer, and Ctrl-C handling that
lets a run stop cleanly."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import sys
import time
from typing import Callable

import typer
from tqdm import tqdm

from ggtrain.core import distributed
from ggtrain.core.backend import Backend
from ggtrain.core.backend_cpu import CpuBackend, default_threads
from ggtrain.core.backend_cuda import CudaBackend, unavailable_reason
from ggtrain.core.models.inference import llama_numerics_available
from ggtrain.core.numerics import LLAMA
from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.corpus import TokenFile, corpus_tokens, default_cache_dir
from ggtrain.formats.imatrix import read_imatrix
from ggtrain.formats.sample_cache import SampleSet, cached_samples, sample_records, samples_key
from ggtrain.formats.tokenizer import Tokenizer
from ggtrain.native.dtypes import dtype


# --backend's values: what each runs on, the precision of the GPU's matrix products (the CUDA
# library's names, gtc_set_math) and the words --help gives it
BACKENDS = {
    "cpu": (None, "the CPU's threads"),
    "cuda": ("f32", "one GPU, exact f32"),
    "cuda-tf32": ("tf32", "the GPU's f32 matrix products on TF32 tensor cores: about 2x faster, about 1e-3 "
                          "relative error"),
    "cuda-bf16": ("bf16", "the GPU's matrix products on bf16 tensor cores, their operands rounded to bf16 "
                          "(f32 sums; everything else f32, a fine-tune's fused loss head too): about 1e-2 "
                          "relative error, and today no faster than cuda-tf32"),
}


class _Lines:
    """A progress report for a stderr that is not a terminal (a log file, a pipe): a plain line
    at most every `every` seconds and at the end, not a bar redrawn with carriage returns (a
    thousand updates made some 200 KB of them). Takes what tqdm's bars are given here."""

    def __init__(self, total=None, initial: int = 0, desc: str = "", unit: str = "it", every: float = 30.0, **_):
        self.total, self.n, self.desc, self.unit, self.every = total, initial, desc, unit, every
        self.postfix, self.t0 = "", time.perf_counter()
        self.last = self.t0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self._line()

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def write(self, line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def _line(self) -> None:
        of = f"/{self.total}" if self.total else ""
        rest = f" ({self.postfix})" if self.postfix else ""
        self.write(f"{self.desc + ': ' if self.desc else ''}{self.n}{of} {self.unit}, "
                   f"{time.perf_counter() - self.t0:.0f} s{rest}")

    def close(self) -> None:
        if self.n and time.perf_counter() - self.t0 >= self.every:
            self._line()


def progress_bar(quiet: bool = False, **kw):
    """A progress bar on stderr (tqdm's, where stderr is a terminal; plain lines now and then
    where it is not), or None with quiet. kw: tqdm's (total, initial, unit, desc, ...)."""
    if quiet:
        return None
    if not sys.stderr.isatty():
        return _Lines(**kw)
    return tqdm(file=sys.stderr, **kw)


def make_backend(backend: str = "cpu", threads: int | None = None) -> Backend:
    """The backend --backend names, with --threads; ConfigError naming the bad value, and for
    cuda saying why it cannot run here."""
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend}: expected {', '.join(list(BACKENDS)[:-1])} or {list(BACKENDS)[-1]}")
    math = BACKENDS[backend][0]
    if math is not None:
        why = unavailable_reason()
        if why:
            raise ConfigError(f"--backend {backend}: not available: {why}")
        return CudaBackend(math=math)
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    return CpuBackend(threads or default_threads())


def numerics_for(numerics: str, be: Backend, old: str | None = None) -> str:
    """--numerics for backend be: llama where it has llama.cpp's kernels, else a ConfigError;
    a replaced flag (old) is said in a warning."""
    if old is not None:
        typer.echo(f"warning: {old} is replaced by --numerics {numerics}", err=True)
    if numerics == LLAMA and not llama_numerics_available(be):
        raise ConfigError(f"--numerics {LLAMA}: the {be.name} backend computes exact f32 only (llama.cpp's CPU "
                          f"numbers are the CPU backend's)")
    return numerics


def start_world() -> distributed.World:
    """The processes of this run (one without mpiexec). With several, rank 0 says which
    process is which (a launcher that reports a dead process names it by pid and host)."""
    world = distributed.world()
    if world.size > 1:
        names = world.gather(f"{os.getpid()}@{socket.gethostname()}")
        if world.lead:
            typer.echo(f"data parallel over {world.size} processes (rank: pid@host): "
                       + ", ".join(f"{r}: {n}" for r, n in enumerate(names)), err=True)
    return world


@contextlib.contextmanager
def file_errors(prefix: str, kind: str = "file"):
    """Turn the OSErrors of opening and reading a path into one-line ConfigErrors that start
    with `prefix` (e.g. "--file t.txt"); kind names what the path should be."""
    try:
        yield
    except FileNotFoundError:
        raise ConfigError(f"{prefix}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{prefix}: is a directory, not a {kind}") from None
    except OSError as exc:
        raise ConfigError(f"{prefix}: cannot read: {exc.strerror or exc}") from None


@contextlib.contextmanager
def option_named(option: str):
    """A FormatError about a file an option names, said with the option first ("--model
    README.md: not a GGUF file ...") where the message starts with the file alone."""
    try:
        yield
    except FormatError as exc:
        raise FormatError(f"{option} {exc}") from None


def imatrix_option(path: str | None, out_type: str | None):
    """The importance matrix --imatrix names (formats.imatrix.Imatrix), or None; ConfigError
    without --out-type, and for a file that cannot be read, one line naming it."""
    if path is None:
        return None
    if out_type is None:
        raise ConfigError(f"--imatrix {path}: an importance matrix weights quantization; give --out-type too")
    with file_errors(f"--imatrix {path}", "importance matrix file"), option_named("--imatrix"):
        return read_imatrix(path)


def imatrix_words(imatrix, stored: dict, types: dict) -> str:
    """"; weighted by FILE (k of n quantized matrices)" for a model written with an importance
    matrix: stored {name: type it came in}, types {name: type written}."""
    if imatrix is None:
        return ""
    changed = [n for n, t in types.items() if t != stored.get(n) and dtype(t).is_block]
    k = sum(n in imatrix.values for n in changed)
    return f"; importance matrix {imatrix.path} ({k} of {len(changed)} quantized matrices have an entry)"


def token_cache_dir(token_cache: str | None) -> str | None:
    """The folder the --token-cache option names: None for "none", the default when not given.
    A default that cannot be written (a read-only home) is said in a warning and not used:
    the run tokenizes without keeping the tokens; a folder the user named is used or fails."""
    if token_cache == "none":
        return None
    if token_cache is not None:
        return token_cache
    folder = default_cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
        writable = os.access(folder, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        typer.echo(f"warning: the token cache {folder} cannot be written; tokenizing without keeping the "
                   f"tokens (--token-cache DIR or GGTRAIN_TOKEN_CACHE names another folder)", err=True)
        return None
    return folder


def read_records(path: pathlib.Path, tok: Tokenizer, template_of: Callable, template_key: str,
                 train_on_inputs: bool, token_cache: str | None, quiet: bool, world: distributed.World,
                 check: Callable[[str, str], None]) -> SampleSet:
    """The samples of a record --data file (or folder of shards), from the token cache when
    made before, else made by worker processes (a progress bar) and kept there. check(kind, layout) runs before any
    sample is made (an error there costs no sampling); template_of(kind, conversational)
    gives the chat template the records need, or None."""
    cache = token_cache_dir(token_cache)
    with file_errors(f"--data {path}"):
        key = samples_key(path, tok, template_key, train_on_inputs)
    found = cached_samples(cache, key, path)
    if found is not None:
        check(found.kind, found.layout)
        return found
    bar = None

    def progress(done: int, total: int, unit: str) -> None:
        nonlocal bar
        if quiet or not world.lead:
            return
        if bar is None:
            bar = progress_bar(total=total, unit=unit, unit_scale=unit == "B", desc=f"sampling {path.name}",
                           leave=False, mininterval=0.5)
        bar.update(done - bar.n)

    try:
        return sample_records(path, tok, template_of, train_on_inputs, cache, key, progress=progress,
                              workers=1 if world.size > 1 else None, check=check)
    except OSError as e:
        raise ConfigError(f"--token-cache {cache}: cannot write the samples of --data {path}: "
                          f"{e.strerror or e}") from None
    finally:
        if bar is not None:
            bar.close()


def read_corpus(path: pathlib.Path, tok: Tokenizer, add_bos: bool, token_cache: str | None,
                quiet: bool, world: distributed.World) -> TokenFile:
    """The ids of a plain-text --data file (formats/corpus.py), with a progress bar (bytes,
    tokens/s, time left) while it is tokenized; token_cache: the --token-cache option (a
    folder, "none", or None for the default). Under mpiexec each process tokenizes alone
    (one worker each) or maps the cached file."""
    cache = token_cache_dir(token_cache)
    bar = None

    def progress(done: int, total: int, tokens: int) -> None:
        nonlocal bar
        if quiet or not world.lead:
            return
        if bar is None:
            bar = progress_bar(total=total, unit="B", unit_scale=True, desc=f"tokenizing {path.name}",
                           leave=False, mininterval=0.5)
        bar.update(done - bar.n)
        bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)

    try:
        found = corpus_tokens(path, tok, add_bos=add_bos, cache_dir=cache, progress=progress,
                              workers=1 if world.size > 1 else None)
    except ConfigError as e:
        raise ConfigError(f"--data {e}") from None
    except OSError as e:
        if e.filename is not None and os.path.abspath(e.filename) == os.path.abspath(path):
            with file_errors(f"--data {path}"):
                raise
        where = f"--token-cache {cache}" if cache is not None else "the temporary folder"
        raise ConfigError(f"{where}: cannot write the tokens of --data {path}: {e.strerror or e}") from None
    finally:
        if bar is not None:
            bar.close()
    return found


class JsonLog:
    """--log RUN.jsonl: one JSON object per line, flushed as written (no file: no-op); append:
    add to the file (a resumed run's log) instead of starting it anew."""

    def __init__(self, path: pathlib.Path | None, append: bool = False):
        self.file = open(path, "a" if append else "w", encoding="utf-8") if path else None

    def write(self, obj: dict) -> None:
        if self.file:
            self.file.write(json.dumps(obj) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


@contextlib.contextmanager
def stop_on_ctrl_c(run):
    """While active, Ctrl-C calls run.request_stop() (the run ends after its current update) instead
    of raising; yields a dict whose "interrupted" entry says whether it happened."""
    state = {"interrupted": False}

    def handler(signum, frame):
        state["interrupted"] = True
        run.request_stop()

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, old)
