"""Whether a trainer pod's memory limit, ``/dev/shm`` and ``/tmp`` hold what its config will use.

A CPU trainer allocates every partition it holds, its Adagrad sums and the unpartitioned tables in shared
memory (``/dev/shm``, a memory emptyDir in the chart), even with no Hogwild worker; with a checkpoint on an
object store it stages whole checkpoint files in ``/tmp``. The figures come from the trainer's own
arithmetic (:mod:`job.train.residency.budget`: ``choose_capacity``, ``shared_memory_bytes``, ``staging_bytes``) and
the entity counts; ``biggraph submit`` sizes the chart's volumes from them and refuses, as the pod's
preflight does, a pod that cannot hold them, naming the value to change and the figure it needs.

The chart's own defaults (``/dev/shm`` and ``/tmp`` from the config's ``memory_budget``, else the memory limit,
for a ``helm install`` without biggraph) are computed in one place only, its ``_helpers.tpl``; what this module
computes from the entity counts is passed to the chart as ``shm.sizeLimit``/``tmp.sizeLimit`` values.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from job.config import ConfigSchema
from job.errors import ConfigError, UserError
from job.formats import entities as entity_format
from job.session import storage_scoped
from job.train.residency.budget import PROCESS_FALLBACK_BYTES, choose_capacity, shared_memory_bytes, staging_bytes

TMP_BASE_BYTES = 512 * 2**20  # /tmp besides staged checkpoint files: native builds, sockets, HOME
SHM_HEADROOM_BYTES = 512 * 2**20  # /dev/shm besides the tables: the bucket's edges shared with workers, the model
# what the chart tells the pod about its volumes (the memory limit comes from the API: bytes)
MEMORY_LIMIT_ENV = "BIGGRAPH_MEMORY_LIMIT"
SHM_LIMIT_ENV = "BIGGRAPH_SHM_LIMIT"
TMP_LIMIT_ENV = "BIGGRAPH_TMP_LIMIT"
_QUANTITY = re.compile(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*")
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


@dataclass(frozen=True)
class Needs:
    """What a trainer of one config uses, in bytes (None: not known, e.g. the entity counts were not readable)."""

    memory_budget: Optional[int]
    shm: Optional[int]
    tmp: Optional[int]


@dataclass(frozen=True)
class PodSizes:
    """A trainer pod's memory limit and volume sizes, in bytes (None: no limit, or not known)."""

    memory_limit: Optional[int] = None
    shm: Optional[int] = None
    tmp: Optional[int] = None


def parse_quantity(text: Any) -> Optional[int]:
    """A Kubernetes quantity ('4Gi', '500M', 1073741824) in bytes, rounded up; None for none or an unparsable one."""
    if text is None or text == "":
        return None
    match = _QUANTITY.fullmatch(str(text))
    if not match or match.group(2) not in _SUFFIXES:
        return None
    return math.ceil(float(match.group(1)) * _SUFFIXES[match.group(2)])


def quantity(nbytes: int) -> str:
    """Bytes as the smallest whole Mi quantity holding them ('1536Mi'; whole Gi as '6Gi')."""
    mib = max(1, math.ceil(nbytes / 2**20))
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


@storage_scoped
def entity_counts(config: ConfigSchema) -> Optional[dict[str, list[int]]]:
    """The entity counts of every type (what the trainer reads at start), or None when entity_path cannot be read
    from here (a best effort: the pod checks again where the data is reachable)."""
    try:
        return {t: entity_format.read_entity_counts(config.entity_path, t, e.num_partitions)
                for t, e in config.entities.items()}
    except Exception:  # unreachable storage, missing files: sized by the budget alone
        return None


def group_sync_bytes(config: ConfigSchema, counts: dict[str, list[int]]) -> int:
    """What syncing the shared parameters costs the lock server's pod of a group (the most any pod of it pays):
    its vectors of the model's parameters, their Adagrad sums and the unpartitioned tables (job/train/distributed/lock_server.py).
    The model is built to count its parameters (relation operators: small); torch is imported here only, so that
    ``import job.cli`` stays light."""
    from job.model.scoring import Model
    from job.train.residency.budget import shared_values, sync_memory_bytes

    dynamic = 0
    if config.dynamic_relations:
        with contextlib.suppress(Exception):  # unreadable here: the pod checks again where the data is
            dynamic = entity_format.read_dynamic_rel_count(config.entity_path)
    parameters = sum(p.numel() for p in Model(config, dynamic).parameters())
    return sync_memory_bytes(shared_values(parameters, config, counts), serves=True)


def trainer_needs(config: ConfigSchema, counts: Optional[dict[str, list[int]]], group: bool = False) -> Needs:
    """What one trainer pod of ``config`` uses (the partitions it holds counted as a single-machine trainer holds
    them, an upper bound for distributed ones; in a ``group`` of pods, besides them, the vectors that sync the shared
    parameters, which the ``memory_budget`` holds too). ``choose_capacity``'s ConfigError (a budget that holds no
    bucket) is raised as it is."""
    budget = config.memory_budget_bytes
    if counts is None:
        return Needs(budget, None, None)
    logger = logging.getLogger("biggraph")
    level = logger.level
    logger.setLevel(logging.WARNING)  # choose_capacity says what a trainer will hold; here it is only asked
    try:
        capacity = choose_capacity(config, counts, distributed=False, processes=1,
                                   runtime_bytes=PROCESS_FALLBACK_BYTES,
                                   sync_bytes=group_sync_bytes(config, counts) if group else 0)
    finally:
        logger.setLevel(level)
    shm = shared_memory_bytes(config, counts, capacity) if config.device != "cuda" else 0
    return Needs(budget, shm, staging_bytes(config, counts) + TMP_BASE_BYTES)


def sized_volumes(needs: Needs) -> tuple[Optional[str], Optional[str]]:
    """The /dev/shm and /tmp sizes ``biggraph submit`` gives the chart when it knows what the trainer uses (None: it
    does not; the chart's defaults then): the tables plus headroom for what else is shared (the bucket's edges
    with Hogwild workers, the model), and the staged files."""
    if needs.shm is None or needs.tmp is None:
        return None, None
    return quantity(needs.shm + SHM_HEADROOM_BYTES), quantity(needs.tmp)


def job_trains_in_a_group(job: dict[str, Any]) -> bool:
    """Whether a rendered Job's trainers form a group (more than one pod, or more than one process per pod,
    torchrun's ``--nnodes`` / ``--nproc-per-node``): then each pays for syncing the shared parameters."""
    container = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    for arg in container.get("args") or []:
        flag, _, value = str(arg).partition("=")
        most = value.split(":")[-1]  # --nnodes=MIN:MAX
        if flag in ("--nnodes", "--nproc-per-node") and most.isdigit() and int(most) > 1:
            return True
    return int(job["spec"].get("completions") or 1) > 1


def job_sizes(job: dict[str, Any]) -> PodSizes:
    """The trainer container's memory limit and its /dev/shm and /tmp sizeLimits, from a rendered Job."""
    pod = job["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "trainer")
    volumes = {v["name"]: (v.get("emptyDir") or {}) for v in pod.get("volumes") or []}
    limits = (container.get("resources") or {}).get("limits") or {}
    return PodSizes(memory_limit=parse_quantity(limits.get("memory")),
                    shm=parse_quantity(volumes.get("dshm", {}).get("sizeLimit")),
                    tmp=parse_quantity(volumes.get("tmp", {}).get("sizeLimit")))


def pod_sizes_from_env(environ: Optional[dict[str, str]] = None) -> PodSizes:
    """This pod's sizes, as the chart passes them (none outside a pod: nothing to check)."""
    env = os.environ if environ is None else environ
    memory = parse_quantity(env.get(MEMORY_LIMIT_ENV))
    shm = parse_quantity(env.get(SHM_LIMIT_ENV))
    if shm is None and SHM_LIMIT_ENV in env:  # sizeLimit unset: the tmpfs itself says
        with contextlib.suppress(OSError):
            stat = os.statvfs("/dev/shm")
            shm = stat.f_blocks * stat.f_frsize
    return PodSizes(memory_limit=memory, shm=shm, tmp=parse_quantity(env.get(TMP_LIMIT_ENV)))


def check_fits(needs: Needs, sizes: PodSizes, where: str) -> None:
    """Refuse (``UserError``, one line) a pod that cannot hold what its trainer uses, naming the value to change."""
    budget = needs.memory_budget
    if budget is not None and sizes.memory_limit is not None and budget > sizes.memory_limit:
        raise UserError(f"{where}: resources.limits.memory {quantity(sizes.memory_limit)} is below the config's "
                        f"memory_budget {quantity(budget)}: raise resources.limits.memory to at least {quantity(budget)} "
                        "or lower memory_budget")
    if needs.shm:
        # shared memory pages count against the container's memory limit
        if budget is None and sizes.memory_limit is not None and needs.shm + PROCESS_FALLBACK_BYTES > sizes.memory_limit:
            required = needs.shm + PROCESS_FALLBACK_BYTES
            raise UserError(f"{where}: resources.limits.memory {quantity(sizes.memory_limit)} cannot hold the "
                            f"{quantity(needs.shm)} of tables the trainer keeps in /dev/shm next to its process: raise "
                            f"resources.limits.memory to at least {quantity(required)}, or set memory_budget")
        if sizes.shm is not None and needs.shm > sizes.shm:
            raise UserError(f"{where}: shm.sizeLimit {quantity(sizes.shm)} is below the {quantity(needs.shm)} the "
                            "trainer keeps in /dev/shm (partitions, their Adagrad sums, unpartitioned tables): set "
                            f"shm.sizeLimit to at least {quantity(needs.shm)}")
    if needs.tmp and sizes.tmp is not None and needs.tmp > sizes.tmp:
        raise UserError(f"{where}: tmp.sizeLimit {quantity(sizes.tmp)} is below the {quantity(needs.tmp)} the trainer "
                        f"stages in /tmp (checkpoint files read and uploaded): set tmp.sizeLimit to at least "
                        f"{quantity(needs.tmp)}")


def config_needs(config: ConfigSchema, where: str, counts: Optional[dict[str, list[int]]] = None,
                 group: bool = False) -> Needs:
    """``trainer_needs`` of ``config``, its entity counts read when not given; a budget that holds no bucket is a
    UserError naming memory_budget."""
    try:
        return trainer_needs(config, counts if counts is not None else entity_counts(config), group)
    except ConfigError as err:
        raise UserError(f"{where}: {err}") from None


def check_config_fits(config: ConfigSchema, sizes: PodSizes, where: str,
                      counts: Optional[dict[str, list[int]]] = None) -> Needs:
    """``check_fits`` for ``config``; the needs it checked."""
    needs = config_needs(config, where, counts)
    check_fits(needs, sizes, where)
    return needs
