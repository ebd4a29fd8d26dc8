"""Warm spares: trainer processes that import torch and the trainer while torchrun's rendezvous forms a round.

Why (issue #30): after a pod is lost, the group trains again only once the c10d rendezvous has formed a new round
*and* every trainer of that round has started again: torchrun starts each trainer as a fresh interpreter, and that
interpreter spends its first seconds importing torch and the trainer (2 s alone on a 2-vCPU node; 4 s when every
trainer of the node and its neighbours starts at once: bench/RESULTS.md, the chaos bench's ``start-up:`` lines). The
rendezvous itself waits several seconds for the lost node's keep-alive to expire and for the last call, doing nothing
on the CPU. A spare does the imports in that wait.

How: when torchrun's agent begins a rendezvous (``SparePool.warm``, called by job/train/elastic/agent.py's handler), it starts
one spare per local trainer: ``python -u -m job.train.elastic.spare``, in a session of its own and with the agent's
environment, as torchrun starts a trainer. The spare imports what the trainer will import (``WARM_IMPORTS``) and then
waits for one hand-off on its stdin. When torchrun then starts a trainer (``SparePool.take``, called in place of its
``Popen``), the pool hands a spare the trainer's command line and environment; the spare sets them and runs the
trainer's module as ``__main__``, as ``python -u -m job`` would. torchrun watches, signals and reaps that process as it
would the one it started itself: it *is* the process it started (a child of the agent, leader of its own session).

A spare is used only where that is the same as a fresh start:
- the command is ``python -u -m MODULE ...`` (torchrun's ``-m``) with the interpreter the spare runs;
- the trainer's environment differs from the spare's only in what torchrun sets for each trainer (rank, world, store
  address, restart count: ``PER_TRAINER_KEYS``), none of which is read while importing. Anything else (a changed
  ``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES`` or ``LD_PRELOAD``, read when torch loads) starts a fresh process;
- torchrun sends the trainer's output where the agent's goes (no ``--redirects``/``--tee``: a spare's output is
  fixed when it starts).
Otherwise, and when a spare died before its hand-off, torchrun starts the trainer as always. What a spare cannot
be is a process that ran its interpreter's start-up hooks (``sitecustomize``) with the trainer's variables: it runs
them with the agent's environment and ``BIGGRAPH_WARM_SPARE=1``, which the hand-off removes. A spare that is never
handed a trainer reads the end of its stdin (the agent closed it, or died) and exits; ``BIGGRAPH_WARM_SPARES=0``
turns spares off.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional

logger = logging.getLogger("biggraph")

# what ``python -m job train`` imports before its first bucket (torch is most of the time); OPTIONAL_ ones where
# installed (a trainer imports s3fs for s3:// paths only)
WARM_IMPORTS = ("torch", "h5py", "job.cli", "job.train.elastic.launch", "job.train.trainer", "job.train.distributed.lock_server")
OPTIONAL_WARM_IMPORTS = ("s3fs",)
# torchrun sets these for each trainer (LocalElasticAgent._start_workers, start_processes); none is read at import
PER_TRAINER_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})
PER_TRAINER_PREFIXES = ("TORCHELASTIC_",)  # restart count, run id, error file, agent store, timers: read at run time
ENABLE_ENV = "BIGGRAPH_WARM_SPARES"
# set in a spare's environment until its hand-off: a start-up hook (sitecustomize) that acts only in trainers, which
# it tells by torchrun's per-trainer variables (LOCAL_RANK), runs in a spare before they exist and should act there too
SPARE_MARKER = "BIGGRAPH_WARM_SPARE"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def environment_mismatch(spare_env: Mapping[str, str], trainer_env: Mapping[str, str]) -> Optional[str]:
    """The first variable whose value differs between the spare's start and the trainer's (not one torchrun sets per
    trainer), or None when a spare may become this trainer."""
    for key in sorted(set(spare_env) | set(trainer_env)):
        if key in PER_TRAINER_KEYS or key.startswith(PER_TRAINER_PREFIXES):
            continue
        if spare_env.get(key) != trainer_env.get(key):
            return key
    return None


class SparePool:
    """The agent's spares: ``warm`` starts them, ``take`` hands one a trainer, ``close`` ends the unused ones. Used
    from the agent's one thread (its rendezvous and its starts of trainers), and at its exit.

    ``command`` is what torchrun runs for each trainer (its entrypoint and arguments, e.g. ``[python, -u, -m, job,
    train, config.yaml]``); ``count`` the trainers per node. A command that is not ``python -u -m MODULE ...`` gets
    no spares (``reason_off`` says why)."""

    def __init__(self, command: Sequence[str], count: int) -> None:
        self.command = [str(part) for part in command]
        self.count = max(0, int(count))
        self.reason_off = self._why_not(self.command)
        self._spares: list[tuple[subprocess.Popen, dict[str, str]]] = []
        self.handed_off = 0
        self.cold_starts = 0
        atexit.register(self.close)

    @staticmethod
    def _why_not(command: list[str]) -> Optional[str]:
        if not enabled():
            return f"{ENABLE_ENV}=0"
        if len(command) < 4 or command[1:3] != ["-u", "-m"]:
            return f"the trainer's command is not `python -u -m MODULE ...` ({' '.join(command[:4])})"
        return None

    def spare_command(self) -> list[str]:
        return [self.command[0], "-u", "-m", __name__]

    def warm(self) -> None:
        """Start spares until there are ``count`` alive (a rendezvous begins: they import while it forms)."""
        if self.reason_off:
            return
        self._spares = [(proc, env) for proc, env in self._spares if proc.poll() is None]
        while len(self._spares) < self.count:
            env = dict(os.environ)
            try:
                proc = subprocess.Popen(self.spare_command(), env={**env, SPARE_MARKER: "1"},
                                        stdin=subprocess.PIPE, start_new_session=True)
            except OSError as error:
                logger.warning("warm spares: could not start one (%s): trainers start cold", error)
                self.reason_off = str(error)
                return
            self._spares.append((proc, env))

    def take(self, args: Sequence[str], env: Mapping[str, str], redirected: bool = False
             ) -> Optional[subprocess.Popen]:
        """A spare turned into the trainer ``args`` (entrypoint first) with environment ``env``; None where a fresh
        process must start (no spare alive, another command, an environment that differs beyond the per-trainer
        variables, or torchrun ``redirected`` the trainer's output: a spare's is fixed when it starts). Where none
        fits, the other spares are ended too: the round's trainers are starting now, and a spare left waiting would
        hold its imports' memory through the whole round."""
        args = [str(part) for part in args]
        if not self.reason_off and not redirected and args[:4] == self.command[:4]:
            proc = self._take_one(args, env)
            if proc is not None:
                self.handed_off += 1
                return proc
        self.cold_starts += 1
        self.close()
        return None

    def _take_one(self, args: list[str], env: Mapping[str, str]) -> Optional[subprocess.Popen]:
        while self._spares:
            proc, spare_env = self._spares.pop(0)
            if proc.poll() is not None:
                logger.warning("warm spares: a spare exited (code %s) before it was needed: a trainer starts cold",
                               proc.returncode)
                continue
            mismatch = environment_mismatch(spare_env, env)
            if mismatch is not None:
                logger.warning("warm spares: the trainer's environment differs from the spare's in %s: it starts "
                               "cold", mismatch)
                self._end(proc)
                continue
            if self._hand_off(proc, args, env):
                return proc
        return None

    @staticmethod
    def _hand_off(proc: subprocess.Popen, args: list[str], env: Mapping[str, str]) -> bool:
        message = json.dumps({"module": args[3], "argv": args[4:], "env": dict(env)}).encode()
        assert proc.stdin is not None
        try:
            proc.stdin.write(message)
            proc.stdin.close()
        except OSError:  # it died between the poll and the write
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
            return False
        return True

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        """A spare not needed: closing its stdin makes it exit; kill it where it does not go at once."""
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()

    def close(self) -> None:
        spares, self._spares = self._spares, []
        for proc, _env in spares:
            self._end(proc)

    def alive(self) -> int:
        return len(self.pids())

    def pids(self) -> list[int]:
        """The spares alive, waiting for a trainer (their process ids)."""
        return [proc.pid for proc, _env in self._spares if proc.poll() is None]


def _read_hand_off() -> Optional[dict[str, Any]]:
    data = sys.stdin.buffer.read()
    if not data.strip():
        return None
    message = json.loads(data)
    if not isinstance(message, dict) or not isinstance(message.get("module"), str) \
            or not isinstance(message.get("argv"), list) or not isinstance(message.get("env"), dict):
        raise SystemExit(f"biggraph spare: a hand-off of the wrong shape: {sorted(message)!r}")
    return message


def main() -> None:
    """The spare: import, wait for the hand-off, become the trainer (or exit 0 on an empty stdin)."""
    import importlib
    import runpy
    import time

    started = time.monotonic()
    for module in WARM_IMPORTS:
        importlib.import_module(module)
    for module in OPTIONAL_WARM_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    imported = time.monotonic()
    message = _read_hand_off()
    if message is None:
        return
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in message["env"].items()})
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    from job.train import startup

    startup.handed_off(imports=imported - started, waited=time.monotonic() - imported)
    sys.argv = [message["module"], *[str(arg) for arg in message["argv"]]]
    runpy.run_module(message["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
