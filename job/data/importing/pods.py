"""One pod of a sharded import, and ``--pods N`` on one machine.

Every import runs ``run_pod``: a single-process ``biggraph import`` is pod 0 of 1, an Indexed Job's
pod is pod ``JOB_COMPLETION_INDEX`` of N, and ``biggraph import --pods N`` starts N local processes
that are exactly such pods. A pod does its share of each phase, skipping units already committed by an earlier run, then waits
for the other pods' units of that phase before the next:

1. read its run of shards, a group at a time (``shards.plan_groups``, ``mapper``),
2. build the dictionaries of partitions k with k mod N = its index (``dictionary``),
3. write buckets k with k mod N = its index (``assemble``); pod 0 then waits for every bucket and commits
   (``finish``).

A pod that dies costs only its uncommitted units: when it (or its replacement) runs again, it
finds the rest committed. Pods other than 0 exit after phase 3; pod 0 returns the summary.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import storage_adapters as storage
from job.config import ConfigSchema
from job.data.importing.assemble import (
    BucketJob,
    assemble_bucket,
    bucket_unit,
    bucket_units,
    dict_records_of,
    finish,
    relation_maps,
)
from job.data.importing.dictionary import build_dictionary, dict_unit, dict_units
from job.data.importing.mapper import group_unit, read_group
from job.data.importing.memory import settle_import_memory
from job.data.importing.options import ImportOptions, ImportSummary
from job.data.importing.plan import make_plan
from job.data.importing.shards import plan_groups, plan_shards
from job.data.importing.staging import (
    Staging,
    already_imported,
    default_staging_root,
    fingerprint,
    import_marker,
    input_versions,
    summary_of_marker,
)
from job.errors import InputFormatError, UserError

logger = logging.getLogger("biggraph")

CRASH_ENV = "BIGGRAPH_IMPORT_CRASH_AT"  # tests: "UNIT" -> SIGKILL this process after that unit's files, before its marker
RESTARTS = 3  # --pods N: a local pod killed by a signal is started again this many times (a Job's backoffLimitPerIndex)


@dataclass(frozen=True)
class PodRole:
    """Which pod this process is, of how many, and where the pods meet (None: the default staging root)."""

    index: int = 0
    count: int = 1
    staging_root: str | None = None
    skip_done: bool = True  # an import marker of this very request means there is nothing to do (a resubmit)


def _mine(units: list, role: PodRole) -> list:
    return units[role.index :: role.count]


def _crash_point(unit: str) -> None:
    if os.environ.get(CRASH_ENV) == unit:
        logger.warning("import: %s=%s: killing this pod before committing %s", CRASH_ENV, unit, unit)
        os.kill(os.getpid(), signal.SIGKILL)


class _CrashingStaging(Staging):
    """A Staging whose commit of the unit named by the test variable dies first (files written, marker not)."""

    def commit(self, unit: str, record: dict) -> None:
        _crash_point(unit)
        super().commit(unit, record)


class _PhaseClock:
    """Logs each phase's wall and CPU seconds in this pod, the CPU split into user and system time with the page
    faults (what bench/import_pods_bench.py models costs from: a pod's system time is mostly fresh memory mapped in)."""

    def __init__(self, pod: int) -> None:
        self.pod = pod
        self.wall, self.usage = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
        # what this process spent before phase 1, which every pod pays whatever its share
        logger.info("import: pod %d: start-up (interpreter, imports, config, plan): %.2f s CPU (%.2f user + %.2f sys, "
                    "%d page faults)", pod, self.usage.ru_utime + self.usage.ru_stime, self.usage.ru_utime,
                    self.usage.ru_stime, self.usage.ru_minflt)

    def lap(self, phase: str) -> None:
        wall, usage = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
        user, system = usage.ru_utime - self.usage.ru_utime, usage.ru_stime - self.usage.ru_stime
        logger.info("import: pod %d: %s took %.2f s wall, %.2f s CPU (%.2f user + %.2f sys, %d page faults)", self.pod,
                    phase, wall - self.wall, user + system, user, system, usage.ru_minflt - self.usage.ru_minflt)
        self.wall, self.usage = wall, usage


def _committed(staging: Staging) -> set[str]:
    return {name[: -len(".json")] for name in storage.listdir(staging.done_dir) if name.endswith(".json")}


def run_pod(config: ConfigSchema, files: list[str], options: ImportOptions, role: PodRole) -> ImportSummary | None:
    """This pod's share of the import (see the module docstring); pod 0 returns the summary, others None."""
    started = time.monotonic()
    # Memory from one heap that keeps what it frees, in 4 KiB pages: most of a pod's system time was the kernel
    # zeroing fresh huge pages, one working set per pod (issue #46; job.data.importing.memory).
    settle_import_memory()
    versions = input_versions(files)
    digest = fingerprint(config, files, versions, options)
    if role.skip_done and already_imported(config, digest):
        logger.info("import: %s already holds this import (%s): nothing to do", config.entity_path, import_marker(config))
        return summary_of_marker(config) if role.index == 0 else None
    # the groups of phase 1 depend on the pod count (the output does not): a staging directory per count
    base = role.staging_root or default_staging_root(config)
    root, failure = storage.join(base, f"{digest}-{role.count}"), storage.join(base, f"{digest}.failed.json")
    staging: Staging = _CrashingStaging(root, failure) if os.environ.get(CRASH_ENV) else Staging(root, failure)
    plan = make_plan(config)
    shards = plan_shards(files, [size for size, _ in versions], options)
    groups = plan_groups(shards, role.count, options.group_size)
    workdir = tempfile.mkdtemp(prefix="biggraph-import-", dir=options.tmp_dir)
    clock = _PhaseClock(role.index)
    try:
        # Phase 1: this pod's run of shards, a group at a time.
        done = _committed(staging)
        group_names = [group_unit(g.index) for g in groups]
        for group in groups:
            if group.pod == role.index and group_unit(group.index) not in done:
                try:
                    read_group(config, group, options, staging, workdir)
                except InputFormatError as err:
                    staging.fail(err, role.index)
                    raise
        clock.lap("phase 1 (shards)")
        staging.wait_for(group_names, "groups of shards")
        clock.lap("waiting for the other pods' shards")
        group_records = staging.read(group_names)
        # Phase 2: dictionaries.
        done = _committed(staging)
        units = dict_units(config, plan)
        for unit in _mine(units, role):
            if dict_unit(*unit) not in done:
                try:
                    build_dictionary(config, plan, unit, group_records, entity_min_count=options.entity_min_count,
                                     staging=staging)
                except UserError as err:  # two ids sharing a hash: the other pods must not wait for this unit
                    staging.fail(err, role.index)
                    raise
        clock.lap("phase 2 (dictionaries)")
        staging.wait_for([dict_unit(*u) for u in units], "partition dictionaries")
        clock.lap("waiting for the other pods' dictionaries")
        # Phase 3: buckets.
        relation_names, rel_maps = (None, None)
        if plan.dynamic:
            relation_names, rel_maps = relation_maps(group_records, options.relation_type_min_count)
        job = BucketJob(config, plan, groups, group_records, staging, rel_maps)
        done = _committed(staging)
        buckets = bucket_units(config, plan)
        for bucket in _mine(buckets, role):
            if bucket_unit(*bucket) not in done:
                assemble_bucket(job, bucket, workdir)
        clock.lap("phase 3 (buckets)")
        if role.index != 0:
            return None
        staging.wait_for([bucket_unit(*b) for b in buckets], "buckets")
        clock.lap("waiting for the other pods' buckets")
        summary = _summary_of(group_records)
        summary.relations = len(relation_names) if relation_names is not None else len(config.relations)
        finish(job, dict_records_of(staging, units), relation_names, digest, summary)
        clock.lap("commit")
        summary.seconds = time.monotonic() - started
        return summary
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _summary_of(group_records: list[dict]) -> ImportSummary:
    summary = ImportSummary()
    for record in group_records:
        summary.edges_read += record["edges_read"]
        summary.malformed_rows += record["malformed_rows"]
        summary.empty_id_rows += record["empty_id_rows"]
        summary.unknown_relation_rows += record["unknown_relation_rows"]
    return summary


def pod_index_from_env() -> int | None:
    """The pod index an Indexed Job gives its pods (None outside one)."""
    value = os.environ.get("JOB_COMPLETION_INDEX")
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"JOB_COMPLETION_INDEX={value!r} is not a pod index (expected an integer >= 0)") from None


def launch_local(argv: list[str], command: str, pods: int) -> int:
    """``biggraph import --pods N``: N local processes, each ``biggraph import ... --pod-index i`` (the pods' own
    code path). A pod killed by a signal is started again (as a Job replaces a lost pod); a pod that fails stops
    the others. The exit code is 0, or the first failing pod's."""
    at = argv.index(command) + 1
    procs: dict[int, subprocess.Popen] = {}
    restarts = dict.fromkeys(range(pods), 0)

    def start(index: int) -> None:
        child = [sys.executable, "-m", "job", *argv[:at], "--pod-index", str(index), *argv[at:]]
        env = dict(os.environ)
        if restarts[index]:
            env.pop(CRASH_ENV, None)
        procs[index] = subprocess.Popen(child, env=env)

    for index in range(pods):
        start(index)
    code = 0
    try:
        while procs:
            for index, proc in list(procs.items()):
                status = proc.poll()
                if status is None:
                    continue
                del procs[index]
                if status < 0 and restarts[index] < RESTARTS:
                    restarts[index] += 1
                    logger.warning("import: pod %d was killed (signal %d); starting it again", index, -status)
                    start(index)
                elif status != 0:
                    code = status if status > 0 else 1
                    raise _PodFailed
            time.sleep(0.2)
    except _PodFailed:
        pass
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait()
    return code


class _PodFailed(Exception):
    pass
