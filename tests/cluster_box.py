"""A cluster in a box: the chart's Indexed Job run as Kubernetes would run it, without Kubernetes.

``ClusterBox`` is a small supervisor that behaves as the Job controller and the kubelet do for the Job that
``helm template`` renders (charts/biggraph):

- **One pod per completion index**, each in its own network namespace (``ip netns``) with its own address on a
  bridge of its own (a veth pair per pod, ``eth0`` inside), and its own UTS namespace whose hostname is the pod's
  (``<job>-<index>``), as the pod's ``subdomain`` makes it.
- **The rendered container**: the command, arguments and environment of the Job's ``trainer`` container for that
  index (``JOB_COMPLETION_INDEX``; the fieldRef variables mapped: ``POD_NAME`` to ``<job>-<index>-<n>``,
  ``BIGGRAPH_RUN_ID`` (the Job's controller uid) to one fixed uid for the box's life), the entrypoint
  docker/entrypoint.sh from the checkout, the pod's volumes rewritten to local directories (``/etc/biggraph`` to
  the ConfigMap written out, ``/tmp`` to a fresh directory per pod: an emptyDir lives and dies with its pod).
- **DNS**: the headless Service's names (``<job>-<i>.<service>`` and the FQDN) resolve to the pods' addresses
  through ``/etc/netns/<ns>/hosts``, which ``ip netns exec`` bind-mounts over ``/etc/hosts``. Every index up to
  ``max_replicas`` is listed from the start (a pod's address is fixed by its index), as the cluster DNS lists
  each pod once it exists.
- **A pod is its network namespace's processes**: torchrun's workers run in sessions of their own, so a process
  group does not hold a pod; every process whose ``/proc/<pid>/ns/net`` is the pod's namespace does (what a
  container's cgroup holds on a node). ``kill`` SIGKILLs them all (a lost node, an OOM kill), ``freeze`` /
  ``thaw`` SIGSTOP / SIGCONT them all (a node that stalls: a VM paused, a long GC, a network partition that
  heals), ``terminate`` is the kubelet's deletion (SIGTERM to the container's first process, SIGKILL of what is
  left after the grace period).
- **The Job controller** (``podReplacementPolicy: Failed``, as the chart renders from 1.34): a pod that exits
  non-zero is replaced, once all of its processes are gone, by a fresh pod (a fresh agent, the same index, the
  same address, a fresh ``/tmp``); a pod that exits 0 completes its index, which is never run again.
  ``backoff_limit_per_index`` failures of one index fail the Job. ``scale(n)`` is what changing ``replicas``
  does to an elastic Indexed Job (``completions`` and ``parallelism`` changed together, Kubernetes >= 1.27):
  indexes ``n..`` are deleted (``terminate``), missing indexes below ``n`` are started.
- **Completion**: the Job completes when every index below ``completions`` has a pod that exited 0 (what an
  Indexed Job's ``Complete`` condition means); it fails when an index ran out of retries.

Every event (start, exit, kill, freeze, thaw, scale) is kept in ``events`` with its ``time.monotonic()`` time, so
that tests and benches can measure what an event costs. ``close`` always kills every process and removes every
namespace, link and hosts file the box made (tests call it from a fixture's finalizer).

The host is on the bridge too (``host_address``, the subnet's ``.1``), as a cluster's nodes reach services outside
it: a server the pods need (a fake S3 for the checkpoint) listens there, or on 0.0.0.0. ``subnet`` may be chosen before
the box is built (``free_subnet``), so that what is rendered into the pods (an endpoint URL) can name that address.
``secrets`` stands in for the Secrets that ``secretKeyRef`` entries of the container's env name (the chart's
``s3.existingSecret``).

Needs root and iproute2's ``ip`` (``available`` says why not, for a skip); Linux only.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
CLUSTER_DOMAIN = "svc.cluster.local"
NAMESPACE = "default"


def available() -> Optional[str]:
    """None when a box can be built here, else why not (for ``pytest.skip``)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (ip netns, veth pairs, bridges)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2 / util-linux)"
    return None


def free_subnet() -> str:
    """A /24 (its first three octets) for one box: per process and at random, so that boxes of concurrent sessions
    rarely meet (a clash fails ``ip addr add`` loudly, never silently)."""
    return f"10.{200 + os.getpid() % 50}.{int(uuid.uuid4().hex[:2], 16)}"


@dataclass
class Event:
    at: float  # time.monotonic()
    kind: str  # start, exit, kill, freeze, thaw, terminate, scale, replace
    index: int
    detail: str = ""


@dataclass
class Pod:
    index: int
    name: str  # the pod's name (POD_NAME): <job>-<index>-<incarnation>
    proc: subprocess.Popen
    log: Path
    started: float
    exit_code: Optional[int] = None
    frozen: bool = False
    deleting: bool = False  # terminated by scale-down: its exit is neither success nor failure
    disrupted: bool = False  # killed as a lost node is (``kill(disruption=True)``): the pod has DisruptionTarget


def _stopped_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return True


def _secret_data(secret: dict[str, Any]) -> dict[str, str]:
    """A rendered Secret's values; one that ``biggraph submit --dry-run`` printed redacted (job/k8s/jobs.py) gets a
    fresh random value, as the real submit creates it."""
    from job.k8s.jobs import REDACTED_NOTE

    if REDACTED_NOTE in (secret["metadata"].get("annotations") or {}):
        return {k: secrets.token_hex(24) for k in (secret.get("data") or {})}
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


@dataclass
class RenderedJob:
    """What the box needs of ``helm template``'s output."""

    name: str  # the Job's name
    service: str  # the headless Service's name
    command: list[str]
    env: list[dict[str, Any]]
    config_files: dict[str, str]  # the ConfigMap's data, mounted at /etc/biggraph
    replicas: int
    memory_limit: str  # the container's resources.limits.memory (what its resourceFieldRef env gives, in bytes)
    grace_period_s: float = 30.0  # the pod's terminationGracePeriodSeconds (the Kubernetes default when unset)
    # the podFailurePolicy's ``Ignore`` exit codes: a pod failing with one is replaced without counting
    ignored_exit_codes: frozenset[int] = frozenset()
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # the Secrets rendered with it (the group's)
    # the podFailurePolicy's ``Ignore`` rule on the DisruptionTarget condition: a pod of a lost node is not counted
    ignores_disruptions: bool = False

    @staticmethod
    def from_docs(docs: list[dict[str, Any]]) -> RenderedJob:
        def one(kind: str) -> dict[str, Any]:
            found = [d for d in docs if d["kind"] == kind
                     and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})]
            assert len(found) == 1, f"expected one {kind}, got {len(found)}"
            return found[0]

        job, service, config_map = one("Job"), one("Service"), one("ConfigMap")
        [container] = [c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
        return RenderedJob(job["metadata"]["name"], service["metadata"]["name"],
                           list(container["command"]) + list(container["args"]), list(container.get("env", [])),
                           dict(config_map["data"]), int(job["spec"]["completions"]),
                           str(container["resources"]["limits"]["memory"]),
                           float(job["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)),
                           frozenset(code for rule in (job["spec"].get("podFailurePolicy") or {}).get("rules", [])
                                     if rule["action"] == "Ignore" and "onExitCodes" in rule
                                     for code in rule["onExitCodes"]["values"]),
                           {d["metadata"]["name"]: _secret_data(d) for d in docs if d["kind"] == "Secret"},
                           any(rule["action"] == "Ignore" and any(c.get("type") == "DisruptionTarget"
                                                                  for c in rule.get("onPodConditions", []))
                               for rule in (job["spec"].get("podFailurePolicy") or {}).get("rules", [])))


@dataclass
class ClusterBox:
    """The Indexed Job of ``job`` run under ``root`` (logs, /tmp of every pod, the ConfigMap's files)."""

    job: RenderedJob
    root: Path
    max_replicas: int = 4
    job_uid: str = field(default_factory=lambda: f"box-{uuid.uuid4()}")
    backoff_limit_per_index: int = 3
    grace_period_s: Optional[float] = None  # the kubelet's SIGTERM -> SIGKILL (None: the rendered pod's)
    extra_env: dict[str, str] = field(default_factory=dict)
    initial: Optional[int] = None  # pods at the start (the Job patched to fewer than its rendered replicas)
    events: list[Event] = field(default_factory=list)
    subnet: str = field(default_factory=free_subnet)  # the pods' /24: pod i at .10+i, the host at .1
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # Secret name -> its data (secretKeyRef)

    def __post_init__(self) -> None:
        reason = available()
        if reason is not None:
            raise RuntimeError(reason)
        if self.grace_period_s is None:
            self.grace_period_s = self.job.grace_period_s
        self.tag = f"bgb{os.getpid() % 100000}{uuid.uuid4().hex[:3]}"  # <= 11 characters: link names fit in 15
        self.completions = self.initial or self.job.replicas
        self.pods: dict[int, Pod] = {}
        self.succeeded: set[int] = set()
        self.failures: dict[int, int] = {}
        self.failed_reason: Optional[str] = None
        self.incarnations: dict[int, int] = {}
        self.namespaces: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.etc = self.root / "etc-biggraph"
        self.etc.mkdir(parents=True, exist_ok=True)
        for key, text in self.job.config_files.items():
            (self.etc / key).write_text(text)
        (self.root / "logs").mkdir(exist_ok=True)

    # names and addresses -----------------------------------------------------------------------------
    def hostname(self, index: int) -> str:
        return f"{self.job.name}-{index}"

    def fqdn(self, index: int) -> str:
        return f"{self.hostname(index)}.{self.job.service}.{NAMESPACE}.{CLUSTER_DOMAIN}"

    def address(self, index: int) -> str:
        return f"{self.subnet}.{10 + index}"

    @property
    def host_address(self) -> str:
        """The host's address on the box's bridge: what a pod dials to reach a server running outside the box."""
        return f"{self.subnet}.1"

    def netns(self, index: int) -> str:
        return f"{self.tag}-{index}"

    def _run(self, *args: str) -> None:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")

    # the network --------------------------------------------------------------------------------------
    def _network(self) -> None:
        bridge = f"{self.tag}br"
        self.namespaces.append(bridge)  # removed in close (a link name, not a namespace: close tells them apart)
        self._run("ip", "link", "add", bridge, "type", "bridge")
        self._run("ip", "addr", "add", f"{self.host_address}/24", "dev", bridge)
        self._run("ip", "link", "set", bridge, "up")
        hosts = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        for index in range(self.max_replicas):
            # a pod's /etc/hosts line, and the headless Service's DNS records of every index
            hosts.append(f"{self.address(index)} {self.fqdn(index)} {self.hostname(index)}.{self.job.service} "
                         f"{self.hostname(index)}")
            # the reverse lookup torch's store server makes of every client (the v4-mapped address of a dual-stack
            # socket), answered here as a cluster's DNS answers a pod address's PTR: sent to this VM's resolver, which
            # drops about one query in 25-50 of a burst, it cost 5 s (10 s with its retry) at random points of a
            # group's start-up that a cluster does not have (``[c10d] The hostname of the client socket cannot be
            # retrieved. err=-3``; bench/RESULTS.md, "A group's start-up"). Under a name no pod looks up forward: the
            # Service names keep resolving to the IPv4 address alone
            hosts.append(f"::ffff:{self.address(index)} {self.hostname(index)}.reverse.{self.job.service}")
        for index in range(self.max_replicas):
            ns = self.netns(index)
            self._run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(hosts) + "\n")
            (etc / "hostname").write_text(self.hostname(index) + "\n")
            outside, inside = f"{self.tag}v{index}", f"{self.tag}i{index}"
            self._run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            self._run("ip", "link", "set", outside, "master", bridge, "up")
            self._run("ip", "link", "set", inside, "netns", ns)
            self._run("ip", "-n", ns, "link", "set", inside, "name", "eth0")
            self._run("ip", "-n", ns, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
            self._run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._run("ip", "-n", ns, "link", "set", "lo", "up")

    # a pod's processes ---------------------------------------------------------------------------------
    def members(self, index: int) -> list[int]:
        """Every process of the pod at ``index``: those in its network namespace."""
        try:
            inode = os.stat(f"/run/netns/{self.netns(index)}").st_ino
        except FileNotFoundError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    found.append(int(entry))
        return found

    def _signal_all(self, index: int, sig: int) -> int:
        """``sig`` to every process of the pod until no new one appears (a process may fork meanwhile)."""
        seen: set[int] = set()
        while True:
            fresh = [pid for pid in self.members(index) if pid not in seen]
            if not fresh:
                return len(seen)
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            seen.update(fresh)

    def _reap(self, index: int, timeout_s: float = 30.0) -> None:
        """SIGKILL whatever is left of the pod and wait until nothing is."""
        deadline = time.monotonic() + timeout_s
        while self.members(index):
            self._signal_all(index, signal.SIGKILL)
            self._signal_all(index, signal.SIGCONT)  # a stopped process dies of SIGKILL too; for good measure
            if time.monotonic() > deadline:
                raise RuntimeError(f"pod {index}: processes {self.members(index)} survive SIGKILL")
            time.sleep(0.05)

    def _env(self, index: int, pod_name: str, tmp: Path) -> dict[str, str]:
        env = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               "JOB_COMPLETION_INDEX": str(index), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        for item in self.job.env:
            if "value" in item:
                env[item["name"]] = self._local(str(item["value"]), tmp)
                continue
            path = (item.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath", "")
            if path == "metadata.name":
                env[item["name"]] = pod_name
            elif "controller-uid" in path:
                env[item["name"]] = self.job_uid  # the Job's uid: one for every pod, replaced and added ones too
            elif "secretKeyRef" in (item.get("valueFrom") or {}):
                ref = item["valueFrom"]["secretKeyRef"]
                secrets = {**self.job.secrets, **self.secrets}
                if ref["key"] not in secrets.get(ref["name"], {}):
                    if ref.get("optional"):
                        continue
                    raise ValueError(f"the box has no secret {ref['name']} with the key {ref['key']} (secrets=)")
                env[item["name"]] = secrets[ref["name"]][ref["key"]]
            elif (item.get("valueFrom") or {}).get("resourceFieldRef", {}).get("resource") == "limits.memory":
                from job.k8s.sizing import parse_quantity  # the API gives the container's limit in bytes

                env[item["name"]] = str(parse_quantity(self.job.memory_limit))
            else:
                raise ValueError(f"the box cannot map the env entry {item}")
        env.update(self.extra_env)
        return env

    def _local(self, value: str, tmp: Path) -> str:
        # the pod's volumes (the edge cache is an emptyDir of the pod, as /tmp: under the pod's directory)
        for mount, path in (("/etc/biggraph", self.etc), ("/tmp", tmp), ("/var/cache/biggraph/edges", tmp.parent / "edge-cache")):
            if value == mount or value.startswith(mount + "/"):
                return str(path) + value[len(mount):]
        return value

    def _start(self, index: int) -> None:
        """A fresh pod at ``index`` (the Job controller creating one)."""
        self._reap(index)  # podReplacementPolicy: Failed: never two pods of one index
        incarnation = self.incarnations.get(index, 0)
        self.incarnations[index] = incarnation + 1
        name = f"{self.hostname(index)}-{incarnation}"
        pod_dir = self.root / "pods" / name
        tmp = pod_dir / "tmp"
        tmp.mkdir(parents=True)
        command = [str(ENTRYPOINT) if c == "/usr/local/bin/biggraph-entrypoint" else self._local(c, tmp)
                   for c in self.job.command]
        ip, unshare = shutil.which("ip"), shutil.which("unshare")
        assert ip is not None and unshare is not None
        wrapped = [ip, "netns", "exec", self.netns(index), unshare, "--uts", "--", "/bin/sh", "-c",
                   'hostname "$1" && shift && exec "$@"', "pod", self.hostname(index), *command]
        log = self.root / "logs" / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(wrapped, env=self._env(index, name, tmp), cwd=pod_dir, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.pods[index] = Pod(index, name, proc, log, time.monotonic())
        self.event("start", index, name)

    def event(self, kind: str, index: int, detail: str = "") -> None:
        self.events.append(Event(time.monotonic(), kind, index, detail))

    # the controller -----------------------------------------------------------------------------------
    def start(self) -> ClusterBox:
        self._network()
        with self._lock:
            for index in range(self.completions):
                self._start(index)
        self._thread = threading.Thread(target=self._control, name="cluster-box", daemon=True)
        self._thread.start()
        return self

    def _control(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                self._step()

    def _step(self) -> None:
        for index, pod in list(self.pods.items()):
            if pod.exit_code is not None or pod.proc.poll() is None:
                continue
            pod.exit_code = pod.proc.returncode
            self.event("exit", index, f"{pod.name} code={pod.exit_code}")
            if pod.deleting or index >= self.completions:
                self._reap(index)
                del self.pods[index]
            elif pod.exit_code == 0:
                self._reap(index)  # a pod that succeeded leaves nothing behind either
                self.succeeded.add(index)
            else:
                ignored = pod.exit_code in self.job.ignored_exit_codes or (pod.disrupted
                                                                            and self.job.ignores_disruptions)
                if not ignored:  # the podFailurePolicy's Ignore rules
                    self.failures[index] = self.failures.get(index, 0) + 1
                if self.failures.get(index, 0) > self.backoff_limit_per_index:
                    self.failed_reason = f"index {index} failed {self.failures[index]} times (backoffLimitPerIndex)"
                    continue
                self._start(index)  # replaced once all of its processes are gone
                self.event("replace", index, self.pods[index].name)
        if self.failed_reason is None:
            for index in range(self.completions):
                if index not in self.pods and index not in self.succeeded:
                    self._start(index)

    def running(self) -> list[int]:
        """The indexes whose pod is running now (started, not exited; frozen ones included)."""
        with self._lock:
            return sorted(i for i, pod in self.pods.items() if pod.exit_code is None and pod.proc.poll() is None)

    def kill(self, index: int, *, disruption: bool = False) -> None:
        """SIGKILL every process of the pod at once (a lost node, an OOM kill); the controller replaces it.
        ``disruption``: the pod is marked as a lost node's is (the DisruptionTarget condition), which the rendered
        podFailurePolicy may ignore; an OOM kill is not."""
        with self._lock:
            self.pods[index].disrupted = disruption
            self.event("kill", index, self.pods[index].name)
            self._signal_all(index, signal.SIGKILL)

    def freeze(self, index: int) -> None:
        """SIGSTOP every process of the pod (it holds its sockets, answers nothing)."""
        with self._lock:
            self.pods[index].frozen = True
            self.event("freeze", index, self.pods[index].name)
            self._signal_all(index, signal.SIGSTOP)
            # SIGSTOP takes effect at the process's next scheduling point: a frozen pod is one whose processes are
            # all stopped, not merely signalled (a process running on another core showed ``R`` for a moment)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not all(_stopped_or_gone(pid) for pid in self.members(index)):
                time.sleep(0.005)

    def thaw(self, index: int) -> None:
        with self._lock:
            self.pods[index].frozen = False
            self.event("thaw", index, self.pods[index].name)
            self._signal_all(index, signal.SIGCONT)

    def terminate(self, index: int) -> None:
        """The kubelet deleting the pod: SIGTERM to the container's first process, SIGKILL after the grace."""
        with self._lock:
            pod = self.pods[index]
            pod.deleting = True
            self.event("terminate", index, pod.name)
            with contextlib.suppress(ProcessLookupError):
                pod.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + (self.grace_period_s or 0.0)
        while pod.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with self._lock:
            self._reap(index)

    def scale(self, replicas: int) -> None:
        """``replicas`` changed (completions = parallelism = ``replicas``): higher indexes deleted, new ones started."""
        assert 1 <= replicas <= self.max_replicas, f"the box has addresses for {self.max_replicas} pods"
        with self._lock:
            old, self.completions = self.completions, replicas
            self.event("scale", -1, f"{old}->{replicas}")
            doomed = [i for i in self.pods if i >= replicas]
            self.succeeded = {i for i in self.succeeded if i < replicas}
            for index in doomed:
                self.pods[index].deleting = True
        threads = [threading.Thread(target=self.terminate, args=(i,)) for i in doomed]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # new indexes are started by the controller's next step

    # the end ----------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        with self._lock:
            return self.failed_reason is None and all(i in self.succeeded for i in range(self.completions))

    def wait(self, timeout_s: float) -> None:
        """Until the Job completes; raises (with the pods' logs' tails) when it fails or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while not self.complete:
            if self.failed_reason is not None:
                raise AssertionError(f"the Job failed: {self.failed_reason}\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the Job did not complete in {timeout_s:.0f} s\n{self.tail()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")
                         for p in sorted((self.root / "logs").glob("*.log")))

    def tail(self, chars: int = 2500) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-chars:]
                         for p in sorted((self.root / "logs").glob("*.log")))

    def close(self) -> None:
        """Kill every pod, remove every namespace, link and hosts file; safe to call twice, and after a failure."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        errors = []
        for index in range(self.max_replicas):
            try:
                self._reap(index)
            except Exception as err:  # keep tearing down; report at the end
                errors.append(str(err))
        for pod in self.pods.values():
            with contextlib.suppress(Exception):
                pod.proc.wait(timeout=10)
        for name in reversed(self.namespaces):
            if name.endswith("br"):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", name], capture_output=True)  # its veth end goes with it
                shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        self.namespaces.clear()
        for index in range(self.max_replicas):  # a veth pair left outside by a set-up that failed half-way
            if Path(f"/sys/class/net/{self.tag}v{index}").exists():
                subprocess.run(["ip", "link", "del", f"{self.tag}v{index}"], capture_output=True)
        if errors:
            raise RuntimeError("; ".join(errors))
