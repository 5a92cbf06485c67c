"""Data parallelism over MPI (layer 4): which process this is, the sums processes share, and
the slice of each global batch that is this process's.

`mpiexec -n N ggtrain ...` starts N copies of the same command. Each draws the same global
batch (batch x N rows), trains on its own rows (`World.shard`), and before the optimizer step
one all-reduce sums the N gradients, in place, in the flat gradient buffer. Started without a
launcher, `world()` is one process and mpi4py is never imported: the launchers announce
themselves in the environment (MPICH's and Intel MPI's Hydra: PMI_RANK/PMI_SIZE; Open MPI:
OMPI_COMM_WORLD_RANK/SIZE; MVAPICH: MV2_COMM_WORLD_*), and a plain run pays nothing.

Failures: a process that raises prints one line naming its rank and aborts the run (the CLI
does that); one that is killed (OOM killer, kill -9) cannot say anything, so under Hydra
(MPICH's mpiexec) each rank trains in a child of the process the launcher started, and that
parent reports the child's death in one line before the launcher ends the others
(`supervise`); a collective that does not finish within GGTRAIN_DP_TIMEOUT seconds (default
300: a peer is stuck, or its machine unreachable) stops every process with one line naming
this rank.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from ggtrain.errors import ConfigError

# (rank variable, size variable) of the launchers we know, first match wins
LAUNCHER_VARS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"))
DEFAULT_TIMEOUT_S = 300.0
SUPERVISOR_VAR = "GGTRAIN_DP_SUPERVISOR"    # set in the child: its parent's pid
_PR_SET_PDEATHSIG = 1                       # linux/prctl.h


def launched() -> tuple:
    """(rank, size) the launcher announced in the environment; (0, 1) without one."""
    for rank_var, size_var in LAUNCHER_VARS:
        if size_var in os.environ:
            try:
                return int(os.environ.get(rank_var, "0")), int(os.environ[size_var])
            except ValueError:
                raise ConfigError(f"{rank_var}={os.environ.get(rank_var)!r}, {size_var}="
                                  f"{os.environ[size_var]!r}: not process numbers") from None
    return 0, 1


class World:
    """The processes of one data-parallel run: this one's `rank` among `size`.

    One process (size 1) has no communicator and every method is the identity.
    """

    def __init__(self, rank: int = 0, size: int = 1, comm=None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rank, self.size, self.comm = rank, size, comm
        self.timeout_s = timeout_s
        self._busy = None              # (what, since) of the collective under way
        self._lock = threading.Lock()
        if comm is not None:
            threading.Thread(target=self._watch, name="ggtrain-dp-watchdog", daemon=True).start()

    @property
    def lead(self) -> bool:
        """Whether this process writes (logs, checkpoints, models, progress): rank 0."""
        return self.rank == 0

    # ---- collectives -------------------------------------------------------------

    def allreduce(self, backend, buffer, count: int) -> None:
        """Sum the first `count` f32 elements of a backend buffer over every process, in place.

        This is the gradient all-reduce, the one place a backend's memory meets the network:
        the backend decides how its memory gets there (Backend.allreduce: the CPU's buffers
        are host memory that MPI reads and writes directly; CUDA's go through NCCL, bootstrapped
        over MPI; a backend without a device collective stages through the host).
        """
        if self.comm is None:
            return
        backend.allreduce(buffer, count, self)

    def reduce_host(self, array: np.ndarray) -> None:
        """Sum a host f32 array over every process, in place (MPI)."""
        from mpi4py import MPI
        with self._collective("the gradient all-reduce"):
            self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)

    def broadcast(self, obj):
        """Rank 0's `obj` (small, picklable), on every process."""
        if self.comm is None:
            return obj
        with self._collective("a broadcast from rank 0"):
            return self.comm.bcast(obj, root=0)

    def sum(self, values) -> np.ndarray:
        """Element-wise sum over the processes of a small float64 vector (losses, counts, votes)."""
        values = np.array(values, dtype=np.float64).reshape(-1)
        if self.comm is None:
            return values
        from mpi4py import MPI
        with self._collective("a sum of losses"):
            self.comm.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)
        return values

    def gather(self, obj) -> list:
        """Every process's `obj` (small, picklable), in rank order, on every process."""
        if self.comm is None:
            return [obj]
        with self._collective("an exchange of process names"):
            return self.comm.allgather(obj)

    def abort(self, code: int = 1) -> None:
        """End every process of the run now (after this one printed why)."""
        sys.stderr.flush()
        if self.comm is not None:
            # NOTE: the launcher forwards this process's stderr through a proxy that the abort
            # kills; a moment's wait lets the line just printed reach the user
            time.sleep(0.3)
            self.comm.Abort(code)
        os._exit(code)

    # ---- the data this process trains on ----------------------------------------

    def shard(self, batch):
        """This process's rows of a global batch: an array (rows, ...) or a dict of them.

        Rows rank*r .. (rank+1)*r - 1 with r = rows / size, so that the processes together
        train on exactly the batch one process would. Raises ConfigError when the rows do
        not divide evenly.
        """
        if self.size == 1:
            return batch
        if isinstance(batch, dict):
            return {k: self.shard(v) for k, v in batch.items()}
        rows = len(batch)
        if rows % self.size:
            raise ConfigError(f"a batch of {rows} rows cannot be split over {self.size} processes")
        r = rows // self.size
        return batch[self.rank * r:(self.rank + 1) * r]

    # ---- the hang guard ------------------------------------------------------------

    @contextlib.contextmanager
    def _collective(self, what: str):
        """Marks a collective under way for the watchdog."""
        with self._lock:
            self._busy = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._busy = None

    def _watch(self) -> None:
        """Daemon thread: a collective under way for longer than timeout_s ends the run."""
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            with self._lock:
                busy = self._busy
            if busy is not None and time.monotonic() - busy[1] > self.timeout_s:
                print(f"error: rank {self.rank}: {busy[0]} waited more than {self.timeout_s:g} s "
                      f"for the other processes (one is stuck or unreachable; GGTRAIN_DP_TIMEOUT "
                      f"sets the limit); stopping every process", file=sys.stderr, flush=True)
                self.abort(1)


class Shard:
    """A batch source drawing global batches from `source` (batch x size rows each) and
    giving this process its rows; `epoch` is the source's (global) progress."""

    def __init__(self, source, world: World):
        self.source, self.world = source, world

    @property
    def epoch(self) -> float:
        return self.source.epoch

    def next(self):
        return self.world.shard(self.source.next())


def supervise(argv: list) -> None:
    """Under Hydra with several processes, run this command again in a child process and wait
    for it; when the child dies of a signal, print one line naming the rank. Returns at once in
    that child, without a launcher, elsewhere than Linux, and under other launchers (Open MPI's
    mpirun names a dead rank itself). argv: the command's arguments (without the program name).

    The parent exits as the child did when that is 0 or 130 (every process stopped on Ctrl-C);
    otherwise it ends itself by SIGTERM: Hydra ends the other processes only when one dies of
    a signal, and a rank that failed before MPI started (e.g. a usage error) would otherwise
    leave them waiting for it forever.
    """
    rank, size = launched()
    parent = os.environ.get(SUPERVISOR_VAR)
    if parent is not None:      # the child: die with the parent, whatever kills it
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != int(parent):    # it died before prctl
            os._exit(1)
        return
    if size <= 1 or "PMI_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    fds = tuple(int(os.environ[v]) for v in ("PMI_FD",) if os.environ.get(v, "").isdigit())
    # the same program (the console script, or ggtrain/__main__.py), so usage lines name it alike
    program = [sys.argv[0]] if os.path.isfile(sys.argv[0]) else ["-m", "ggtrain"]
    child = subprocess.Popen([sys.executable, *program, *argv], pass_fds=fds,
                             env={**os.environ, SUPERVISOR_VAR: str(os.getpid())})
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:   # pragma: no cover - wait is restarted by Python (PEP 475)
            continue
    if code in (0, 130):
        os._exit(code)
    if code < 0:
        name = signal.Signals(-code).name
        print(f"error: rank {rank} (pid {child.pid}) was killed by {name}; stopping every process",
              file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _timeout() -> float:
    text = os.environ.get("GGTRAIN_DP_TIMEOUT", "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"GGTRAIN_DP_TIMEOUT={text!r}: expected a number of seconds > 0")
    return value


@functools.lru_cache(maxsize=None)
def world() -> World:
    """This process's World: from MPI when a launcher started several processes, else one.

    mpi4py is imported (and MPI initialised) only in the first case. Raises ConfigError when
    a launcher started several processes but mpi4py is not installed, or disagrees with it.
    """
    rank, size = launched()
    if size <= 1:
        return World()
    timeout_s = _timeout()
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ConfigError(f"started as rank {rank} of {size} processes, but mpi4py cannot be "
                          f"imported ({exc}); install the dp extra: pip install 'ggtrain[dp]'") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != size or comm.Get_rank() != rank:
        raise ConfigError(f"the launcher says rank {rank} of {size}, MPI says rank {comm.Get_rank()} "
                          f"of {comm.Get_size()} (is mpi4py built for another MPI than the mpiexec "
                          f"that started this?)")
    return World(rank, size, comm, timeout_s)


def started() -> World | None:
    """The World if `world()` has set one up (MPI initialised, several processes), else None:
    what an error handler asks before deciding to abort the whole run."""
    if world.cache_info().currsize == 0:
        return None
    w = world()
    return w if w.comm is not None else None
