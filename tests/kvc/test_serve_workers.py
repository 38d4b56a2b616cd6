"""`kvc serve` with several worker processes: each answers with the same catalog, tokens,
limits and journal, the metrics count every process's requests, and it stops cleanly."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from catalog import Catalog
from catalog.remote import RemoteCatalog
from chunkstore import open_store
from maintenance.journal import read_journal
from tests.catalog_helpers import CS, FP, chain_records
from tests.services import free_port

TOKEN = "workers-token"
PROMPT = list(range(100, 100 + 3 * CS))


def workers_of(pid: int) -> list[int]:
    """The worker processes of a `kvc serve` (not multiprocessing's resource tracker)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                found.append(int(child))
    return found


def wait_for(what: str, check: Callable[[], bool], deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {deadline_s} s"
        time.sleep(0.05)


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def worker_config_of(pid: int) -> Path:
    """The config file a worker process was told to read (the only `KVC_SERVE_WORKER_*`
    variable `kvc serve` passes on)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    variables = dict(v.split(b"=", 1) for v in environ.split(b"\0") if b"=" in v)
    return Path(variables[b"KVC_SERVE_WORKER_CONFIG"].decode())


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], base: str, store_url: str) -> None:
        self.proc, self.base, self.store_url = proc, base, store_url

    def workers(self) -> list[int]:
        return workers_of(self.proc.pid)

    def remote(self) -> RemoteCatalog:
        # A fresh connection per client: it goes to whichever worker accepts it.
        return RemoteCatalog(self.base, TOKEN, timeout=30)


@contextlib.contextmanager
def serving(tmp_path: Path, url: str, extra_env: dict[str, str] | None = None) -> Iterator[Served]:
    """`kvc serve --workers 2` on the catalog at `url` (the schema is made here)."""
    with Catalog.open(url, upgrade=True) as cat:
        cat.ensure_namespace("default", CS)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"default": hashlib.sha256(TOKEN.encode()).hexdigest()}))
    store_url = (tmp_path / "blobs").as_uri()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    env |= {
        "KVC_SERVE_WORKERS": "2",
        "KVC_STORES": store_url,
        "KVC_MAX_PROMPT_TOKENS": str(4 * len(PROMPT)),
        "KVC_CONFIG": str(tmp_path / "absent.toml"),
        # Its metrics and worker-config directories go here: the group is killed below,
        # which leaves them (and the catalog URL in the config) behind.
        "TMPDIR": str(tmp_path),
    }
    env |= extra_env or {}
    serve = ["serve", "--catalog", url, "--tokens-file", str(tokens), "--port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvc.cli import main; main()", *serve, "--threads", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the workers go with it
    )
    s = Served(proc, f"http://127.0.0.1:{port}", store_url)
    try:
        wait_for("kvc serve answers", lambda: proc.poll() is None and healthy(s.base))
        wait_for("two workers", lambda: len(s.workers()) == 2)
        yield s
    finally:
        # Kill the whole group: killing the server alone would orphan its worker processes.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serving(tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}") as s:
        yield s


def test_the_catalog_password_is_in_no_worker_environment(
    tmp_path: Path, postgres_url: str
) -> None:
    """The catalog URL carries a password (PostgreSQL; the test server trusts any). No
    worker process's environment holds it, nor the service token `kvc serve` got in its own
    environment; the workers read their config from a file only this user can read, and
    the service works against that catalog."""
    import sqlalchemy as sa

    password = "pw-" + hashlib.sha256(tmp_path.name.encode()).hexdigest()[:20]
    url = sa.make_url(postgres_url).set(password=password).render_as_string(hide_password=False)
    with serving(tmp_path, url, {"KVC_SERVICE_TOKEN": "svc-" + password}) as s:
        workers = s.workers()
        assert len(workers) == 2
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert password.encode() not in environ
            config = worker_config_of(pid)
            assert (os.stat(config).st_mode & 0o777) == 0o600
            assert (os.stat(os.path.dirname(config)).st_mode & 0o777) == 0o700
        with s.remote() as rc:
            assert rc.record_chunks(chain_records("default", PROMPT)).recorded == 3
            assert rc.lookup("default", FP, [*PROMPT, 7]).matched_tokens == len(PROMPT)


def test_each_worker_sees_what_another_published_and_the_metrics_count_both(
    served: Served,
) -> None:
    first, second = served.workers()
    # Only `second` accepts connections while `first` is stopped, and the other way round.
    os.kill(first, signal.SIGSTOP)
    try:
        with served.remote() as rc:
            assert rc.record_chunks(chain_records("default", PROMPT)).recorded == 3
    finally:
        os.kill(first, signal.SIGCONT)
    os.kill(second, signal.SIGSTOP)
    try:
        with served.remote() as rc:
            assert rc.lookup("default", FP, [*PROMPT, 7]).matched_tokens == len(PROMPT)
        metrics = httpx.get(f"{served.base}/metrics", timeout=10).text
    finally:
        os.kill(second, signal.SIGCONT)
    # Answered by `first`: the publish that `second` counted is in its exposition.
    assert "kvc_publish_chunks_total 3.0" in metrics
    assert "kvc_lookups_total 1.0" in metrics
    assert "kvc_lookup_hits_total 1.0" in metrics


def test_every_worker_keeps_auth_limits_and_the_journal(served: Served) -> None:
    for worker in served.workers():
        others = [w for w in served.workers() if w != worker]
        for w in others:
            os.kill(w, signal.SIGSTOP)
        try:
            lookup = f"{served.base}/v1/namespaces/default/lookup"
            body = {"fingerprint": FP.hex, "tokens": [1, 2, 3]}
            assert httpx.post(lookup, json=body, timeout=10).status_code == 401
            wrong = {"Authorization": "Bearer not-the-token"}
            assert httpx.post(lookup, json=body, headers=wrong, timeout=10).status_code == 401
            too_long = {**body, "tokens": list(range(4 * len(PROMPT) + 1))}
            right = {"Authorization": f"Bearer {TOKEN}"}
            assert httpx.post(lookup, json=too_long, headers=right, timeout=10).status_code == 413
            with served.remote() as rc:
                rc.record_chunks(chain_records("default", PROMPT))
                head = chain_records("default", PROMPT)[-1].prefix_hash
                rc.create_ref("default", f"chat-{worker}", FP, head)
        finally:
            for w in others:
                os.kill(w, signal.SIGCONT)
    # Each worker journaled the ref it created to the configured store.
    store = open_store(served.store_url)
    try:
        refs = read_journal([store]).refs
    finally:
        store.close()
    assert {name for _, name in refs} == {f"chat-{w}" for w in served.workers()}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_stops_every_worker_and_removes_their_config(
    served: Served, sig: signal.Signals
) -> None:
    """Ctrl-C and what a service manager sends: every worker exits, and the file holding
    the catalog URL (with its password, on PostgreSQL) is not left behind."""
    workers = served.workers()
    config = worker_config_of(workers[0])
    assert config.is_file()
    served.proc.send_signal(sig)
    assert served.proc.wait(60) == 0
    for w in workers:
        wait_for(f"worker {w} exits", lambda w=w: not Path(f"/proc/{w}").exists(), 10)
    assert not config.parent.exists()
