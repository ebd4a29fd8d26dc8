"""The ``biggraph`` command line: one subcommand per module, each registering its own arguments.

Keeping each command's arguments beside its implementation keeps this file thin; the
modules import their heavy dependencies (torch, h5py) only when the command runs, so
``biggraph config-help`` answers instantly.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import select
import sys
from collections.abc import Sequence

from job import __version__
from job.cli.common import add_config_arguments, overrides_of
from job.cli.logging_setup import configure_logging
from job.cli.quick_exit import QuickExit
from job.cli.quick_exit import allowed as quick_exit_allowed
from job.errors import UserError
from storage_adapters.errors import StorageError

__all__ = ["COMMAND_MODULES", "add_config_arguments", "build_parser", "entry", "main", "overrides_of"]

# Each module (of job.cli) registers one group of subcommands; this order is the order of ``biggraph --help``.
COMMAND_MODULES = ("train", "importing", "grow", "validate", "exporting", "legacy", "demo", "k8s", "archive", "report",
                   "native")
# Commands whose processes start by the dozen (an import's pods, issue #46): their parser is built from their own
# module alone, without importing every other command's (~0.1 s of CPU a process). The parse is the same.
OWN_MODULE = {"import": "importing"}

logger = logging.getLogger("biggraph")


def build_parser(modules: Sequence[str] = COMMAND_MODULES) -> argparse.ArgumentParser:
    """The parser of the commands that ``modules`` (of job.cli) register: all of them unless told."""
    parser = argparse.ArgumentParser(
        prog="biggraph",
        description="Train PyTorch-BigGraph-compatible graph embeddings on local files, S3 or Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"biggraph {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="log line format (json for log collectors)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in modules:
        importlib.import_module(f"job.cli.{name}").register(subparsers)
    return parser


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word not an option of ``biggraph`` itself), if any."""
    words = iter(argv)
    for word in words:
        if word == "--log-format":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def setup_logging(verbose: bool, log_format: str) -> None:
    configure_logging(logging.DEBUG if verbose else logging.INFO, log_format)


# What a command killed by SIGPIPE reports (128 + 13), as ``cat`` or ``git log`` do under ``| head``.
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Run one ``biggraph`` command; returns its exit code.

    A reader that goes away (``biggraph config-help | head``) ends the command quietly with
    ``EXIT_BROKEN_PIPE``, not a ``BrokenPipeError`` traceback. Not 0: the output was cut short,
    and a script that checks must be able to tell. 141 is the status shells already show for
    ``cat`` or ``git log`` under ``| head``, so ``set -o pipefail`` scripts see nothing new.
    ``own_process``: the process exists for this command alone (``entry``), so its start-up may be tuned for it
    (``_settle_startup``); a caller's process (a test, a script) is left as it is.
    """
    try:
        try:
            return _run(argv, own_process)
        finally:
            sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's exit
    except BrokenPipeError:
        if not _is_broken_pipe(_stdout_fd()):
            raise  # another pipe or socket broke: a real error, keep its traceback
        _discard_stdout()
        return EXIT_BROKEN_PIPE


def entry() -> None:
    """The process entry (the ``biggraph`` script, ``python -m job``): ``main``, then exit with its code. A command
    of ``QUICK_EXIT_COMMANDS`` that succeeded, or a trainer whose round ended, skips the interpreter's teardown
    (``job.cli.quick_exit``)."""
    quick = QuickExit()
    quick.arm()  # before the command runs: its own exit handlers run before this one
    code = main(own_process=True)
    if quick_exit_allowed(command_of(sys.argv[1:]), code):
        quick.allow(code)
    sys.exit(code)


def _settle_startup() -> None:
    """End a start-up run without the cycle collector (in a process of its own only, ``entry``: a caller's
    objects are not frozen). Importing a command's module (numpy, h5py, the importer) makes ~40k long-lived
    objects (modules, functions, classes), and the collector's passes over them while they are made free
    nothing: ~8 ms of CPU, which each pod of an import pays (issue #46). Frozen, they are left out of the later
    passes too, until the command ends (``_run`` unfreezes them then, so that their finalizers run at the
    interpreter's teardown as before); the collector runs as usual from here on."""
    gc.freeze()
    gc.enable()


def _stdout_fd() -> int | None:
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        return None


def _is_broken_pipe(fd: int | None) -> bool:
    """Whether ``fd`` is a pipe whose reader has gone (Linux flags that as POLLERR on the write end).

    Where poll cannot tell, any BrokenPipeError is taken to be stdout's.
    """
    if fd is None:
        return False
    if not hasattr(select, "poll") or sys.platform != "linux":
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of it cannot fail again."""
    fd = _stdout_fd()
    if fd is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)


def _run(argv: list[str] | None, own_process: bool = False) -> int:
    own = OWN_MODULE.get(command_of(sys.argv[1:] if argv is None else argv) or "")
    settle = own_process and own is not None and gc.isenabled()
    if settle:
        gc.disable()  # see _settle_startup
    try:
        try:
            parser = build_parser((own,) if own else COMMAND_MODULES)
            args = parser.parse_args(argv)
        finally:
            if settle:
                _settle_startup()
        return _call(args, argv)
    finally:
        if settle:
            gc.unfreeze()  # a frozen object's finalizer would not run at the interpreter's teardown (an error's exit)


def _call(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run the parsed command; a user's error is one line on stderr and its exit code."""
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a command may re-launch itself (one process per GPU)
    setup_logging(args.verbose, args.log_format)
    try:
        return int(args.func(args) or 0)
    except (UserError, StorageError) as err:
        print(f"biggraph {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"biggraph {args.command}: interrupted", file=sys.stderr)
        return 130
