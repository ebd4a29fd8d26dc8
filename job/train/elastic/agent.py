"""The pods' launcher: torchrun with ``BiggraphAgent``, a subclass of torch's ``LocalElasticAgent``.

``python -m job.train.elastic.agent ARGS`` takes ``torchrun ARGS`` (the container's launcher: docker/entrypoint.sh) and
runs torch's own agent with three changes, each a method of the subclass (as DeepSpeed's ``DSElasticAgent`` does),
nothing in torch replaced process-wide but the one hook the warm spares need (below):

1. **The failure budget** (``_invoke_run``; job/train/elastic/budget.py): a worker group that failed because its
   round ended from outside after progress (a pod lost, replaced, added or deleted) restarts without spending
   ``--max-restarts``; a crash, or a round that ended before any work, spends it as torchrun always did.
2. **Readmission** (``_nodes_waiting``), for this failure of torch's dynamic rendezvous (issue #30): every node's
   agent writes a keep-alive heartbeat into the rendezvous store, and every sync of the rendezvous state drops the
   nodes whose last heartbeat is older than ``keep_alive_interval * keep_alive_max_attempt`` (6 s with the chart's
   settings). When the store itself stalls for longer (the pod that hosts it frozen, or starved of CPU), no node can
   write its heartbeat, so the first sync after the stall drops *every* node: the round's participants become
   empty, the state moves to a new round, and no agent ever sends a heartbeat again. A pod that then joins becomes
   the first participant of the new round and waits there for ``min_nodes``; the running agents only look for nodes
   on the *wait list*, which stays empty, so they never restart their workers to admit it (reproduced:
   tests/test_cluster_box.py ``test_a_pod_added_after_the_rendezvous_host_was_frozen_joins_the_group``). Here a
   running agent that is no longer a participant while other nodes form a round counts them as waiting, the signal
   torchrun acts on for a scale-up: it stops its workers and joins the next round, without spending a restart.
3. **Warm spares** (``_rendezvous``): trainers start from processes that imported torch and the trainer while the
   rendezvous formed (job/train/elastic/spare.py).
4. **A round whose roles never arrive** (``_rendezvous``, ``_assign_worker_ranks``): once a round has formed, every
   agent publishes its role in the round's store and waits for every other's (torch's ``_assign_worker_ranks``:
   ``multi_get``, up to the rendezvous' ``read_timeout``, 60 s). A node lost or frozen in between (a pod killed
   while the group re-forms) never publishes it, and torch's agent raises the store's timeout out of ``run``: the
   pod exits 1, which the chart's podFailurePolicy counts (the chaos bench's 100 events once ended the Job so, its
   index 0 failing four times in 30 minutes). Here the live agents join the next round instead (the lost node's
   keep-alive lapses meanwhile), up to ``ROLE_EXCHANGE_TRIES`` times in a row, without spending a restart.

Why the launch itself is ours (``launch``, torch's ``launch_agent`` reduced to what torchrun's command line uses):
torch's ``launch_agent`` constructs ``LocalElasticAgent`` by name, with no way to pass a subclass.

The one process-wide hook left: torch starts a worker through ``SubprocessHandler._popen``, created deep inside
``start_processes`` with no parameter an agent could set, so the spares replace that method (``install_spares``,
only in the launcher's own process: ``main``). Without it trainers start cold; nothing else changes.

Exit codes: torchrun's, and ``EXIT_RENDEZVOUS_LOST`` when the rendezvous is gone (its store's host pod lost),
which the chart's podFailurePolicy does not count for a pod that does not host the store (docker/entrypoint.sh).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from typing import Any, Optional

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from job.cli.quick_exit import QuickExit
from job.train.elastic import spare
from job.train.elastic.budget import EXIT_RENDEZVOUS_LOST, judge
from job.train.elastic.spare import SparePool

logger = logging.getLogger("biggraph")

# rounds in a row whose role exchange may time out before the agent gives up (each waits the rendezvous'
# read_timeout, 60 s by default): a node lost once a round formed costs one; more in a row means the store itself
# fails every read, and the agent ends as torch's would
ROLE_EXCHANGE_TRIES = 5


class RoleExchangeLost(RuntimeError):
    """The round formed, but not every node published its role in the round's store in time."""


def evicted_and_others_forming(handler: Any) -> int:
    """How many nodes form a round without this node, when this node is no longer a participant of the
    rendezvous (0 otherwise). Reads the state the handler synced last (its ``num_nodes_waiting`` syncs first)."""
    holder = getattr(handler, "_state_holder", None)
    node = getattr(handler, "_this_node", None)
    if holder is None or node is None:
        return 0
    state = holder.state
    if node in state.participants:
        return 0
    return len(state.participants) + len(state.wait_list)


def nodes_waiting(handler: Any) -> int:
    """torch's ``num_nodes_waiting`` of ``handler``, or, when it says none, the nodes forming a round this node was
    evicted from (module docstring, 2)."""
    waiting = int(handler.num_nodes_waiting())
    return waiting if waiting else evicted_and_others_forming(handler)


class BiggraphAgent(LocalElasticAgent):
    """torch's local agent with the failure budget, readmission and warm spares (module docstring)."""

    def __init__(self, *args: Any, pool: Optional[SparePool] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool = pool
        self._free_restarts = 0  # membership changes restarted without spending the budget (reported)
        self._warned_evicted = False

    def _rendezvous(self, worker_group: Any) -> None:
        """torch's rendezvous, with the trainers warmed meanwhile, and the next round joined when a node of this one
        never published its role (module docstring, 4)."""
        for attempt in range(1, ROLE_EXCHANGE_TRIES + 1):
            if self._pool is not None:
                self._pool.warm()  # the trainers' imports run while the round forms
            try:
                super()._rendezvous(worker_group)
                return
            except RoleExchangeLost as lost:
                if attempt == ROLE_EXCHANGE_TRIES:
                    raise
                logger.warning("rendezvous: %s (a node lost or frozen once the round formed); joining the next round "
                               "(%d of %d tries, no restart spent)", lost, attempt + 1, ROLE_EXCHANGE_TRIES)

    def _assign_worker_ranks(self, *args: Any, **kwargs: Any) -> Any:
        """torch's exchange of roles once a round formed; its store timeout said as ``RoleExchangeLost``."""
        from torch.distributed import DistStoreError

        try:
            return super()._assign_worker_ranks(*args, **kwargs)
        except DistStoreError as err:
            raise RoleExchangeLost(f"the round's roles did not all arrive ({str(err).split(',')[0]})") from err

    def _stop_workers(self, worker_group: Any) -> None:
        """torch's stop (SIGTERM, then SIGKILL after the shutdown timeout), but a worker that is stopped (SIGSTOP: a
        frozen rank whose peers have left the round) is killed at once: it cannot act on the SIGTERM, and waiting out
        the 30 s grace on it would hold the group's re-formation that long."""
        for worker in worker_group.workers:
            if isinstance(worker.id, int) and _process_stopped(worker.id):
                logger.warning("worker pid %d is stopped (frozen): killed at once, it cannot drain", worker.id)
                try:
                    os.kill(worker.id, signal.SIGKILL)
                except OSError:
                    pass
        super()._stop_workers(worker_group)

    def _nodes_waiting(self) -> int:
        handler = self._worker_group.spec.rdzv_handler
        waiting = int(handler.num_nodes_waiting())
        if waiting:
            return waiting
        forming = evicted_and_others_forming(handler)
        if forming and not self._warned_evicted:
            self._warned_evicted = True
            logger.warning(
                "rendezvous: this node was dropped from the rendezvous (its keep-alive expired while the store stalled) "
                "and %d other node(s) are forming a round: restarting the workers to join it", forming)
        return forming

    def _invoke_run(self, role: str = "default") -> RunResult:
        """torch's monitoring loop (``SimpleElasticAgent._invoke_run``) with the failure budget's verdict on a failed
        group and readmission's count of waiting nodes."""
        spec = self._worker_group.spec
        logger.info("[%s] starting workers for entrypoint: %s", spec.role, spec.get_entrypoint_name())
        self._initialize_workers(self._worker_group)
        while True:
            time.sleep(spec.monitor_interval)
            result = self._monitor_workers(self._worker_group)
            self._worker_group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                verdict = judge(failure.exitcode for failure in result.failures.values())
                if verdict.free:
                    self._free_restarts += 1
                    logger.warning("[%s] worker group ended: %s; restarting it without spending a restart (%d/%d "
                                   "left; %d membership change(s) so far)", spec.role, verdict.why,
                                   self._remaining_restarts, spec.max_restarts, self._free_restarts)
                    self._restart_workers(self._worker_group)
                elif self._remaining_restarts > 0:
                    self._remaining_restarts -= 1
                    logger.warning("[%s] worker group failed: %s; restarting it (%d/%d restarts left)", spec.role,
                                   verdict.why, self._remaining_restarts, spec.max_restarts)
                    self._restart_workers(self._worker_group)
                else:
                    logger.error("[%s] worker group failed: %s; no restarts left (--max-restarts=%d)", spec.role,
                                 verdict.why, spec.max_restarts)
                    self._stop_workers(self._worker_group)
                    self._worker_group.state = WorkerState.FAILED
                    return result
            elif result.state == WorkerState.HEALTHY:
                waiting = self._nodes_waiting()  # membership changes do not count as retries (torch's rule too)
                if waiting > 0:
                    logger.info("[%s] %d node(s) waiting to join: restarting the worker group", spec.role, waiting)
                    self._restart_workers(self._worker_group)
            else:
                raise RuntimeError(f"[{spec.role}] worker group in state {result.state.name}")


def _process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (state ``T`` in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def launch(config: Any, entrypoint: str, args: list[str]) -> None:
    """Run ``BiggraphAgent`` for torchrun's ``config`` (a ``LaunchConfig``) and the workers' command: torch's
    ``launch_agent`` but for the agent's class. Raises ``ChildFailedError`` when the group failed (torchrun's exit
    code 1) and torch's rendezvous errors when the rendezvous is gone."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    parameters = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr, **config.rdzv_configs)
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    if config.rdzv_backend == "static":  # --master-addr/--master-port without a rendezvous backend
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint.strip(), default_port=-1)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(parameters), max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, master_addr=master_addr, master_port=master_port,
        local_addr=config.local_addr, event_log_handler=config.event_log_handler)
    pool = SparePool([entrypoint, *map(str, args)], int(config.nproc_per_node)) if _spares_installed else None
    global _pool
    _pool = pool
    # torch 2.12 added LaunchConfig.shutdown_timeout (the agent's wait for its workers to stop); an image with an
    # older torch (a CUDA base image, say) has neither it nor the agent's keyword
    stop_wait = {"shutdown_timeout": config.shutdown_timeout} if hasattr(config, "shutdown_timeout") else {}
    agent = BiggraphAgent(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                          log_line_prefix_template=config.log_line_prefix_template, pool=pool, **stop_wait)
    close_rendezvous = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=spec.get_entrypoint_name(), failures=result.failures)
    except RendezvousError:
        close_rendezvous = False  # it is gone (or another node's): closing it would end the job for everyone
        raise
    except BaseException as err:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        close_rendezvous = not isinstance(err, SignalException)  # a stopped agent leaves it open for the others
        raise
    finally:
        if pool is not None:
            pool.close()
        if close_rendezvous:
            spec.rdzv_handler.shutdown()


_pool: Optional[SparePool] = None  # the running agent's spares (``launch``), read by the process hook
_spares_installed = False


def install_spares() -> Optional[str]:
    """Start trainers from warm spares (job/train/elastic/spare.py): torch's ``SubprocessHandler._popen`` of a trainer
    takes a spare where one fits (module docstring: torch offers no seam an agent could use for it). Why not, where
    torch's process handler is not the one this hook knows (trainers then start cold)."""
    global _spares_installed
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler_class = getattr(subprocess_handler, "SubprocessHandler", None)
    popen = getattr(handler_class, "_popen", None)
    if handler_class is None or popen is None:
        return "torch's subprocess handler has no hook for them"
    if not spare.enabled():
        return f"{spare.ENABLE_ENV}=0"

    def popen_or_spare(self: Any, args: tuple, env: dict[str, str]) -> Any:
        if _pool is not None:
            redirected = getattr(self, "_stdout", None) is not None or getattr(self, "_stderr", None) is not None
            proc = _pool.take(args, env, redirected=redirected)
            if proc is not None:
                return proc
        return popen(self, args, env)

    handler_class._popen = popen_or_spare
    _spares_installed = True
    return None


def launch_config(argv: list[str]) -> tuple[Any, str, list[str]]:
    """torchrun's command line as torchrun reads it (``torch.distributed.run``): (config, command, its arguments)."""
    from torch.distributed.run import config_from_args, parse_args, parse_min_max_nnodes

    args = parse_args(argv)
    unset = args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
    if args.standalone or (unset and parse_min_max_nnodes(args.nnodes)[1] == 1):  # torchrun's own rule
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, command, command_args = config_from_args(args)
    return config, str(command), list(command_args)


def main(argv: Optional[list[str]] = None) -> None:
    """``torchrun`` with ``BiggraphAgent``; exits ``EXIT_RENDEZVOUS_LOST`` when the rendezvous is gone."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    # an expected end below (the rendezvous gone, a signal) leaves with its code and skips the interpreter's teardown
    # of torch's abandoned threads, which aborted now and then ("terminate called without an active exception": 134
    # where 143 was meant; job/cli/quick_exit.py); every exit handler still runs first
    quick = QuickExit()
    quick.arm()
    why_not = install_spares()
    if why_not and spare.enabled():
        logger.warning("warm spares: trainers start cold (%s)", why_not)
    config, command, command_args = launch_config(sys.argv[1:] if argv is None else argv)
    try:
        record(launch)(config, command, command_args)
    except RendezvousError as err:
        logger.error("rendezvous: %s: %s (exit code %d)", type(err).__name__, err, EXIT_RENDEZVOUS_LOST)
        quick.allow(EXIT_RENDEZVOUS_LOST)
        sys.exit(EXIT_RENDEZVOUS_LOST)
    except SignalException as err:
        # the pod stopped from outside (deleted, scaled down, evicted): torchrun raises out of its monitor loop once
        # it has stopped the workers (each gave back what it held). An expected end, said in one line, with the
        # shell's code for the signal (budget.py reads 143 as a stop from outside), not a traceback in every
        # scaled-down pod's log
        code = 128 + int(err.sigval)
        logger.warning("agent: stopped by %s, workers stopped (exit code %d)", signal.Signals(err.sigval).name, code)
        quick.allow(code)
        sys.exit(code)


if __name__ == "__main__":
    main()
