"""How Hogwild workers start: from a fork server that has imported torch once, without the caller's ``__main__``.

A spawned worker is a fresh interpreter that imports torch and the batch code before it can train (~1.2 s of CPU
each): two workers cost a second of wall time at the start of every run, sixteen on two vCPUs eleven seconds
(bench/RESULTS.md). A fork server (``multiprocessing``'s ``forkserver``) imports them once, in a process of its
own, and forks every worker from that clean state (no thread of the caller's running); started when a command knows it will train
on the CPU with several workers, its imports overlap the trainer's own. Forking the trainer itself is not an
option: it runs threads (torch, fsspec, the partition I/O), which a fork would copy mid-operation.

A forked worker inherits the server's environment, from when the server started; the trainer's is handed to
each worker with its arguments (``worker_environment``) and applied first thing, so that a variable set since
(``BIGGRAPH_NATIVE``, credentials) reaches the workers as it did with spawn. What a native library reads once,
when the server loads it (OpenMP's ``OMP_*``/``GOMP_*``/``KMP_*``, read as torch loads), is the server's: set those
before the run starts. ``BIGGRAPH_WORKER_START=spawn`` starts every worker as a fresh interpreter again.

A started child normally re-imports the parent's main module first - so that functions defined there can be
unpickled - which breaks the places users call the Python API from: a script without an ``if __name__ ==
"__main__"`` guard runs itself again in every worker (and multiprocessing refuses to start), ``python - <<EOF``
fails with ``FileNotFoundError: '<stdin>'``. Our workers need nothing from ``__main__`` (their target and
arguments live in ``job``), so while they start the parent shows multiprocessing an empty main module, exactly
as a notebook's kernel does.

Workers receive shared tensors over Unix sockets in multiprocessing's temporary directory (torch's file
descriptor passing; the fork server listens there too). A socket's path has ~107 bytes on Linux, so under a
``TMPDIR`` too long for one (some batch schedulers set deep per-job paths) that directory is moved to a short one
in ``/tmp`` (``short_socket_dir``). Where the server still cannot start, workers are spawned, with a warning.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import types
from collections.abc import Iterator
from multiprocessing import forkserver, process, resource_tracker, util
from multiprocessing.context import ForkServerContext, SpawnContext

logger = logging.getLogger("biggraph")

START_ENV = "BIGGRAPH_WORKER_START"
START_METHODS = ("forkserver", "spawn")
# what every worker needs before its first batch: imported once, by the server
PRELOAD = ["torch", "job.train.hogwild.pool"]

_lock = threading.Lock()
_server_failed: list[str] = []  # why the fork server could not start, once it could not: spawn from then on
SOCKET_PATH_MAX = 107  # a Unix socket path's bytes (sun_path: 108 on Linux, less the terminating NUL)
_SOCKET_NAME = len("/listener-") + 8  # multiprocessing's socket names (tempfile.mktemp's 8 random characters)


def start_method() -> str:
    """``forkserver`` where the platform has it, unless ``BIGGRAPH_WORKER_START`` says ``spawn``."""
    wanted = os.environ.get(START_ENV, "").strip().lower() or "forkserver"
    if wanted not in START_METHODS:
        logger.warning("%s=%s is not one of %s: using forkserver", START_ENV, wanted, ", ".join(START_METHODS))
        wanted = "forkserver"
    if wanted == "forkserver" and ("forkserver" not in multiprocessing.get_all_start_methods() or _server_failed):
        return "spawn"
    return wanted


def start_worker_server() -> None:
    """Start the fork server now, in the background (it imports ``PRELOAD`` meanwhile); nothing under spawn.

    Idempotent. Called where a run knows it will train on the CPU with several workers, as early as it can.
    """
    worker_context()  # or spawn from now on, with a warning


def worker_context() -> ForkServerContext | SpawnContext:
    """The multiprocessing context Hogwild workers start from (its fork server running, started with SIGTERM
    blocked: ``sigterm_blocked``)."""
    short_socket_dir()
    if start_method() == "forkserver":
        context = multiprocessing.get_context("forkserver")
        # multiprocessing's resource tracker first: starting it unblocks SIGTERM on its way out (its own
        # ``ensure_running``), which would undo the block below before the fork server starts
        resource_tracker.ensure_running()
        with sigterm_blocked():
            started = _ensure_server(context)
        if started:
            return context
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread meanwhile, so that a process started from it (the fork server, a spawned
    worker, and every worker the fork server forks, which inherits its mask) begins life with SIGTERM blocked: a
    Hogwild worker then ignores it before unblocking it (``pool._worker_main``), with no moment in between where
    torchrun's agent's SIGTERM, sent to the trainer's whole process group, could end it (issue 44: by construction,
    not by timing). The trainer loses nothing: a SIGTERM sent to it meanwhile is taken by another of its threads
    (Python then runs its handler in the main thread as always)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def short_socket_dir() -> str:
    """multiprocessing's temporary directory, moved to a short one in ``/tmp`` if a socket's path there would not
    fit (``SOCKET_PATH_MAX``); workers and the fork server started afterwards use it too. Idempotent."""
    with _lock:
        current = util.get_temp_dir()
        if len(os.fsencode(current)) + _SOCKET_NAME <= SOCKET_PATH_MAX:
            return current
        try:
            short = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
        except OSError as error:
            logger.warning("Hogwild workers: TMPDIR's path is too long for a Unix socket and /tmp is not writable "
                           "(%s): set TMPDIR to a short writable directory", error)
            return current
        # multiprocessing keeps it in the process's config (copied into every process started later); removed at exit
        process.current_process()._config["tempdir"] = short  # type: ignore[attr-defined]
        util.Finalize(None, shutil.rmtree, args=(short,), kwargs={"ignore_errors": True}, exitpriority=-100)
        logger.info("Hogwild workers: TMPDIR's path (%d bytes) is too long for a Unix socket; using %s for the "
                    "workers' sockets", len(os.fsencode(current)), short)
        return short


def raise_open_file_limit() -> None:
    """The soft limit on open files raised to the hard one: torch passes a shared tensor to another process as a
    file descriptor, held open in the sender until the receiver has taken it (a model of a few hundred relations
    would pass a soft limit of 1,024 with two workers)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError) as error:  # best effort: a failed send says what is missing
        logger.debug("could not raise the open file limit: %s", error)


def server_processes() -> int:
    """Processes besides the trainer and its workers that workers cost (the fork server: ~150 MiB, torch loaded)."""
    return 1 if start_method() == "forkserver" else 0


def worker_environment() -> dict[str, str]:
    """The trainer's environment, for a worker to apply (``apply_environment``) before it reads any of it."""
    return dict(os.environ)


def apply_environment(environment: dict[str, str]) -> None:
    """Make this worker's environment the trainer's (a forked worker starts with the server's)."""
    if dict(os.environ) != environment:
        os.environ.clear()
        os.environ.update(environment)


def _ensure_server(context: ForkServerContext) -> bool:
    """Start the fork server unless it runs; False (and spawn from then on) where it cannot start."""
    with _lock, _empty_main():  # the server is handed the main module's path too: it gets none
        # multiprocessing's own state, read defensively (private names): what the running server preloaded
        pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
        preloaded = list(getattr(forkserver._forkserver, "_preload_modules", []))
        if pid is not None:  # already running (ours, or a library user's): it keeps the modules it preloaded
            logger.debug("the fork server runs already (pid %s); preloaded: %s", pid, ", ".join(preloaded))
        # Read when the server starts. Added to the process-wide list, not replacing it: a caller may have set its
        # own. ('__main__' in it is harmless: the server is given no main module path, see above.)
        context.set_forkserver_preload(list(dict.fromkeys([*preloaded, *PRELOAD])))
        try:
            forkserver.ensure_running()
        except OSError as error:
            _server_failed.append(str(error))
            logger.warning("Hogwild workers: the fork server could not start (%s); spawning each worker instead "
                           "(slower to start)", error)
            return False
        return True


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Within the block, processes started with ``spawn`` or ``forkserver`` do not import the caller's ``__main__``."""
    with _lock, _empty_main():
        yield


@contextlib.contextmanager
def _empty_main() -> Iterator[None]:
    real = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if real is not None:
            sys.modules["__main__"] = real
