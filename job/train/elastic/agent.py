"""torchrun's agent, with a running node readmitted to a rendezvous that evicted it, and warm spares.

``python -m job.train.elastic.agent ARGS`` is ``torchrun ARGS`` (the container's launcher: docker/entrypoint.sh) with two
changes. The second: trainers start from warm spares, processes that imported torch and the trainer while the
rendezvous formed (job/train/elastic/spare.py). The first is a change to the c10d rendezvous handler, for this failure of
torch's dynamic rendezvous (issue #30):

Every node's agent writes a keep-alive heartbeat into the rendezvous store, and every sync of the rendezvous
state drops the nodes whose last heartbeat is older than ``keep_alive_interval * keep_alive_max_attempt`` (6 s
with the chart's settings). When the store itself stalls for longer than that (the pod that hosts it frozen, or
starved of CPU), no node can write its heartbeat, so the first sync after the stall drops *every* node: the
round's participants become empty, the state moves to a new round, and no agent ever sends a heartbeat again
(an agent only renews a heartbeat it still has). The workers keep training, unaware. A pod that then joins (a
replacement or a scale-up) becomes the first participant of the new round and waits there for ``min_nodes``;
the running agents only look for nodes on the *wait list*, which stays empty, so they never restart their
workers to admit it. It times out after ``join_timeout`` and its pod fails, while the group trains on without
it. Reproduced in the cluster in a box: tests/test_cluster_box.py
``test_a_pod_added_after_the_rendezvous_host_was_frozen_joins_the_group``.

The change: a running agent that is no longer a participant of the rendezvous while other nodes are forming
one counts them as waiting (``num_nodes_waiting``), which is the signal torchrun already acts on for a
scale-up: it stops its workers and joins the next round, without using up a restart. A node whose agent is
still a participant sees torch's answer unchanged.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, Optional

from job.train.elastic import spare
from job.train.elastic.spare import SparePool

logger = logging.getLogger("biggraph")


def _evicted_and_others_forming(handler: Any) -> int:
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


def readmitting(handler: Any) -> Any:
    """``handler`` (a ``DynamicRendezvousHandler``) with ``num_nodes_waiting`` also counting the nodes that form
    a round this node was evicted from (module docstring). Returns the same handler object."""
    original: Callable[[], int] = handler.num_nodes_waiting
    warned = False

    def num_nodes_waiting() -> int:
        nonlocal warned
        waiting = original()
        if waiting:
            return waiting
        forming = _evicted_and_others_forming(handler)
        if forming and not warned:
            warned = True
            logger.warning(
                "rendezvous: this node was dropped from the rendezvous (its keep-alive expired while the store stalled) and "
                "%d other node(s) are forming a round: restarting the workers to join it", forming)
        return forming

    handler.num_nodes_waiting = num_nodes_waiting
    return handler


def warming(handler: Any) -> Any:
    """``handler`` with ``next_rendezvous`` first starting the agent's warm spares, where it has a pool (the trainers'
    imports run while the round forms). Returns the same handler object."""
    original: Callable[[], Any] = handler.next_rendezvous

    def next_rendezvous() -> Any:
        if _pool is not None:
            _pool.warm()
        return original()

    handler.next_rendezvous = next_rendezvous
    return handler


def install() -> Optional[str]:
    """Make torch's ``c10d`` rendezvous backend return ``readmitting`` handlers; why not, when it cannot (a torch
    whose registry differs: torchrun then runs as it is)."""
    from torch.distributed.elastic.rendezvous import registry

    table = getattr(registry.handler_registry, "_registry", None)
    create = getattr(registry, "_create_c10d_handler", None)
    if not isinstance(table, dict) or create is None:
        return "torch's rendezvous registry has no c10d creator to wrap"

    def create_readmitting(params: Any) -> Any:
        return warming(readmitting(create(params)))

    table["c10d"] = create_readmitting
    return None


_pool: Optional[SparePool] = None  # the agent's spares, once torchrun's launcher has named the trainers' command


def install_spares() -> Optional[str]:
    """Start trainers from warm spares (job/train/elastic/spare.py): torchrun's launcher names the trainers' command and
    count (``launch_agent``: the pool is made there), and its ``Popen`` of a trainer takes a spare where one fits.
    Why not, where torch's launcher or process handler is not the one these hooks know (trainers then start cold)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    from torch.distributed.launcher import api as launcher

    handler_class = getattr(subprocess_handler, "SubprocessHandler", None)
    popen = getattr(handler_class, "_popen", None)
    launch_agent = getattr(launcher, "launch_agent", None)
    if handler_class is None or popen is None or launch_agent is None:
        return "torch's launcher or subprocess handler has no hook for them"
    if not spare.enabled():
        return f"{spare.ENABLE_ENV}=0"

    def launching(config: Any, entrypoint: Any, args: list[Any], *rest: Any, **kwargs: Any) -> Any:
        global _pool
        if isinstance(entrypoint, str):
            _pool = SparePool([entrypoint, *map(str, args)], int(getattr(config, "nproc_per_node", 1)))
        return launch_agent(config, entrypoint, args, *rest, **kwargs)

    def popen_or_spare(self: Any, args: tuple, env: dict[str, str]) -> Any:
        if _pool is not None:
            redirected = getattr(self, "_stdout", None) is not None or getattr(self, "_stderr", None) is not None
            proc = _pool.take(args, env, redirected=redirected)
            if proc is not None:
                return proc
        return popen(self, args, env)

    launcher.launch_agent = launching
    handler_class._popen = popen_or_spare
    return None


def main(argv: Optional[list[str]] = None) -> None:
    """``torchrun`` with ``install()`` and ``install_spares()`` first."""
    from torch.distributed.run import main as torchrun

    why_not = install()
    if why_not:
        logger.warning("rendezvous: running torchrun without the readmission of evicted nodes (%s)", why_not)
    why_not = install_spares()
    if why_not and spare.enabled():
        logger.warning("warm spares: trainers start cold (%s)", why_not)
    torchrun(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
