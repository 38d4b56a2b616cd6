"""Load on the HTTP catalog service: 1 client, then N clients, doing lookups and publishes, bounded in time.

Usage (repository root, project venv):

    python bench/load_service.py [--clients 50] [--seconds 60] [--catalog sqlite|postgres]
        [--workers N] [--threads T] [--client-procs P] [--ceiling]

Starts `kvc serve` as a real process on 127.0.0.1 (a SQLite catalog in a temp
dir, or the embedded PostgreSQL) with `--workers N` and `--threads T` (default: the service's
own default), populates it, then runs 1 client and then `--clients` clients
against the same server and data with the same mix of operations, each for
the given time. Prints, for each phase, throughput, p50/p99 latency per
operation, errors and the CPU time per request of the server and of the load
generator, then the ratio of the two throughputs and the server's resident
memory at start and end. `--client-procs` spreads the clients over that many
processes (one Python process holds one GIL). `--ceiling` first runs the same
clients against a stub server that answers every call with a canned body: what
the load generator itself can drive on this machine.
The test suite runs a short version (tests/kvc/test_load.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.scratch import scratch_dir
from catalog import Catalog
from catalog.remote import RemoteCatalog
from catalog.wire import MatchModel
from tests.catalog_helpers import CS, FP, chain_records

TOKEN = "load-test-token"
SYSTEM = list(range(1000, 1000 + 8 * CS))  # a shared 8-chunk system prompt
_CLK = os.sysconf("SC_CLK_TCK")


@dataclass
class LoadResult:
    seconds: float
    clients: int
    ops: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # answers that were not the expected ones
    lost: list[str] = field(default_factory=list)  # acknowledged publishes not found afterwards
    published: list[list[int]] = field(default_factory=list)  # acknowledged publishes' prompts
    rss_start_kb: int = 0
    rss_end_kb: int = 0
    rss_samples: list[tuple[float, int]] = field(default_factory=list)  # (seconds in, kB)
    server_cpu_s: float = 0.0  # CPU time of the server's processes during the run
    client_cpu_s: float = 0.0  # CPU time of the load generator during the run
    db_cpu_s: float | None = None  # CPU time of the database server (PostgreSQL) during the run

    def merge(self, other: LoadResult) -> None:
        for op, lat in other.ops.items():
            self.ops.setdefault(op, []).extend(lat)
        self.errors += other.errors
        self.wrong += other.wrong
        self.published += other.published
        self.client_cpu_s += other.client_cpu_s

    @property
    def requests(self) -> int:
        return sum(len(lat) for lat in self.ops.values())

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seconds": round(self.seconds, 1),
            "clients": self.clients,
            "errors": len(self.errors),
            "wrong": len(self.wrong),
            "lost": len(self.lost),
            "rss_start_mb": round(self.rss_start_kb / 1024, 1),
            "rss_end_mb": round(self.rss_end_kb / 1024, 1),
            "rss_samples_mb": [(round(t), round(kb / 1024, 1)) for t, kb in self.rss_samples],
        }
        for op, lat in sorted(self.ops.items()):
            lat_sorted = sorted(lat)
            out[op] = {
                "count": len(lat),
                "p50_ms": round(statistics.median(lat_sorted) * 1e3, 2),
                "p99_ms": round(
                    lat_sorted[min(len(lat_sorted) - 1, int(len(lat_sorted) * 0.99))] * 1e3, 2
                ),
            }
        n = max(1, self.requests)
        out["requests_per_s"] = round(self.requests / self.seconds, 1)
        out["server_cpu_ms_per_request"] = round(self.server_cpu_s * 1e3 / n, 2)
        out["client_cpu_ms_per_request"] = round(self.client_cpu_s * 1e3 / n, 2)
        if self.db_cpu_s is not None:
            out["db_cpu_ms_per_request"] = round(self.db_cpu_s * 1e3 / n, 2)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the workers of `kvc serve --workers N`)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except OSError:
            pass
    return out


def _rss_kb(pid: int) -> int:
    """Resident memory of `pid` and its descendants."""
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its descendants."""
    total = 0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total / _CLK


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def populate(catalog_url: str) -> None:
    cat = Catalog.open(catalog_url, upgrade=True)
    try:
        cat.ensure_namespace("default", CS)
        for i in range(20):  # 20 conversations sharing the system prompt
            cat.record_chunks(chain_records("default", [*SYSTEM, *range(i * 50, i * 50 + 3 * CS)]))
    finally:
        cat.close()


@contextmanager
def kvc_serve(
    catalog_url: str, workdir: Path, *, workers: int | None = None, threads: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`kvc serve` in a process of its own: (its base URL, the process)."""
    tokens_file = workdir / "tokens.json"
    tokens_file.write_text(json.dumps({"default": hashlib.sha256(TOKEN.encode()).hexdigest()}))
    port = _free_port()
    args = ["--catalog", catalog_url, "--port", str(port), "--tokens-file", str(tokens_file)]
    if workers is not None:
        args += ["--workers", str(workers)]
    if threads is not None:
        args += ["--threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvc"), "serve", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, server)
        yield base, server
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
        if server.stderr:
            server.stderr.close()


def _wait_healthy(base: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            err = server.stderr.read().decode(errors="replace")[-2000:] if server.stderr else ""
            raise RuntimeError(f"kvc serve did not start: {err}")
        time.sleep(0.1)


def _clients(
    base: str,
    ids: range,
    *,
    stop_at: float,
    publish_ratio: float,
    check: bool,
    min_ops: dict[str, int] | None = None,
    max_overrun_s: float = 0.0,
) -> LoadResult:
    """Threads `ids` of the load in this process until `stop_at` (time.monotonic)."""
    result = LoadResult(seconds=0, clients=len(ids))
    lock = threading.Lock()

    def go_on() -> bool:
        now = time.monotonic()
        if now < stop_at:
            return True
        if not min_ops or now >= stop_at + max_overrun_s:
            return False
        with lock:
            return any(len(result.ops.get(op, ())) < n for op, n in min_ops.items())

    def client(n: int) -> None:
        rng = random.Random(n)
        with RemoteCatalog(base, TOKEN, timeout=60) as rc:
            while go_on():
                i = rng.randrange(20)
                start = 10_000 + n * 1000
                if rng.random() < publish_ratio:
                    op = "publish"
                    tail = range(start + rng.randrange(1000), start + 2000)
                    prompt = [*SYSTEM, *tail][: len(SYSTEM) + 2 * CS]
                    work = lambda p=prompt: rc.record_chunks(chain_records("default", p))  # noqa: E731
                else:
                    op = "lookup"
                    # A prefix of one of the 20 conversations: all of it is restorable.
                    prompt = [*SYSTEM, *range(i * 50, i * 50 + rng.randrange(1, 3 * CS))]
                    work = lambda p=prompt: rc.lookup("default", FP, [*p, 7])  # noqa: E731
                t0 = time.perf_counter()
                try:
                    answer = work()
                except Exception as exc:  # every error is counted and reported
                    with lock:
                        result.errors.append(f"{op}: {type(exc).__name__}: {exc}")
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    result.ops.setdefault(op, []).append(dt)
                    if op == "publish":
                        result.published.append(prompt)
                    elif check and getattr(answer, "matched_tokens", None) != len(prompt):
                        got = getattr(answer, "matched_tokens", answer)
                        result.wrong.append(f"lookup of {len(prompt)} tokens matched {got}")

    cpu0 = _own_cpu_s()
    threads = [threading.Thread(target=client, args=(n,)) for n in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.client_cpu_s = _own_cpu_s() - cpu0
    return result


def _client_proc(out: Any, base: str, ids: range, kwargs: dict[str, Any]) -> None:
    out.send(_clients(base, ids, **kwargs))
    out.close()


def drive(
    base: str,
    server_pid: int | None,
    *,
    clients: int,
    seconds: float,
    first_id: int = 0,
    client_procs: int = 1,
    publish_ratio: float = 0.1,
    check: bool = True,
    sample_every: float = 10.0,
    min_ops: dict[str, int] | None = None,
    max_overrun_s: float = 60.0,
    db_pid: int | None = None,
) -> LoadResult:
    """`clients` clients (ids from `first_id`) for `seconds`, in `client_procs` processes.

    With `min_ops` (operation -> count, one process only) the clients go on past that,
    for at most `max_overrun_s`, until every count is reached: on a slow machine a
    fixed time alone does not make a given number of requests."""
    procs = max(1, min(client_procs, clients))
    if min_ops and procs > 1:
        raise ValueError("min_ops needs the clients in one process")
    result = LoadResult(seconds=seconds, clients=clients)
    if server_pid is not None:
        result.rss_start_kb = _rss_kb(server_pid)
        cpu0 = _cpu_s(server_pid)
    db0 = _cpu_s(db_pid) if db_pid is not None else 0.0
    t0 = time.monotonic()
    stop_at = t0 + seconds
    kwargs: dict[str, Any] = {
        "stop_at": stop_at,
        "publish_ratio": publish_ratio,
        "check": check,
        "min_ops": min_ops,
        "max_overrun_s": max_overrun_s,
    }
    done = threading.Event()

    def sampler() -> None:  # the server's RSS over the run, to see whether it levels off
        while not done.wait(min(sample_every, max(0.01, stop_at - time.monotonic()))):
            if server_pid is not None:
                result.rss_samples.append((time.monotonic() - t0, _rss_kb(server_pid)))
            if time.monotonic() >= stop_at:
                return

    sampling = threading.Thread(target=sampler, daemon=True)
    sampling.start()
    ids = [range(first_id + k, first_id + clients, procs) for k in range(procs)]
    if procs == 1:
        result.merge(_clients(base, ids[0], **kwargs))
    else:
        ctx = multiprocessing.get_context("fork")
        running = []
        for part in ids:
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_client_proc, args=(send, base, part, kwargs))
            p.start()
            send.close()
            running.append((p, recv))
        for p, recv in running:
            result.merge(recv.recv())
            p.join()
    result.seconds = time.monotonic() - t0
    done.set()
    if server_pid is not None:
        result.server_cpu_s = _cpu_s(server_pid) - cpu0
        result.rss_end_kb = _rss_kb(server_pid)
    if db_pid is not None:
        result.db_cpu_s = _cpu_s(db_pid) - db0
    return result


def check_published(catalog_url: str, result: LoadResult) -> None:
    """Every publish the service acknowledged is in the catalog, whole."""
    cat = Catalog.open(catalog_url)
    try:
        for prompt in result.published:
            got = cat.lookup("default", FP, [*prompt, 7]).matched_tokens
            if got != len(prompt):
                result.lost.append(f"a publish of {len(prompt)} tokens: {got} found")
    finally:
        cat.close()


def run_load(
    catalog_url: str,
    *,
    clients: int,
    seconds: float,
    workdir: Path,
    sample_every: float = 10.0,
    publish_ratio: float = 0.1,
    min_ops: dict[str, int] | None = None,
    max_overrun_s: float = 60.0,
    workers: int | None = None,
) -> LoadResult:
    """Run `clients` for `seconds` against a fresh `kvc serve` over `catalog_url`."""
    populate(catalog_url)
    with kvc_serve(catalog_url, workdir, workers=workers) as (base, server):
        result = drive(
            base,
            server.pid,
            clients=clients,
            seconds=seconds,
            sample_every=sample_every,
            publish_ratio=publish_ratio,
            min_ops=min_ops,
            max_overrun_s=max_overrun_s,
        )
    check_published(catalog_url, result)
    return result


# -- the stub server: what the load generator can drive -----------------------------


def _stub_main(port: int, lookup_body: bytes) -> None:
    publish_body = json.dumps(
        {"recorded": 0, "already_present": 0, "replicas_added": 0, "conflicts": []}
    ).encode()

    def response(body: bytes) -> bytes:
        head = (
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    answers = {b"lookup": response(lookup_body), b"chunks": response(publish_body)}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                path = head.split(b" ", 2)[1]
                writer.write(answers[path.rsplit(b"/", 1)[1]])
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def run_ceiling(
    catalog_url: str, *, clients: int, seconds: float, client_procs: int, publish_ratio: float
) -> LoadResult:
    """The load generator against a stub that answers each call with a canned body at once."""
    cat = Catalog.open(catalog_url)
    try:
        # A real answer of the size the service gives (a whole conversation).
        match = cat.lookup("default", FP, [*SYSTEM, *range(0, 3 * CS), 7])
    finally:
        cat.close()
    port = _free_port()
    ctx = multiprocessing.get_context("fork")
    stub = ctx.Process(
        target=_stub_main, args=(port, MatchModel.of(match).model_dump_json().encode())
    )
    stub.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the stub server did not start") from None
                time.sleep(0.05)
        return drive(
            f"http://127.0.0.1:{port}",
            stub.pid,
            clients=clients,
            seconds=seconds,
            client_procs=client_procs,
            publish_ratio=publish_ratio,
            check=False,
        )
    finally:
        stub.terminate()
        stub.join(5)


# -- report ----------------------------------------------------------------------------------


def _print_phase(title: str, s: dict[str, Any]) -> None:
    print(f"\n{title}: {s['clients']} client(s) for {s['seconds']} s")
    print(f"  {'operation':<10} {'count':>8} {'p50 ms':>9} {'p99 ms':>9}")
    for op in ("lookup", "publish"):
        if op in s:
            o = s[op]
            print(f"  {op:<10} {o['count']:>8} {o['p50_ms']:>9.1f} {o['p99_ms']:>9.1f}")
    print(
        f"  throughput {s['requests_per_s']} requests/s, errors {s['errors']},"
        f" wrong answers {s['wrong']}, lost publishes {s['lost']}"
    )
    db = s.get("db_cpu_ms_per_request")
    print(
        f"  CPU per request: server {s['server_cpu_ms_per_request']} ms,"
        f" load generator {s['client_cpu_ms_per_request']} ms"
        + ("" if db is None else f", PostgreSQL {db} ms")
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60, help="per phase")
    ap.add_argument("--catalog", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--workers", type=int, default=None, help="kvc serve --workers")
    ap.add_argument("--threads", type=int, default=None, help="kvc serve --threads")
    ap.add_argument("--client-procs", type=int, default=1, help="processes for the N clients")
    ap.add_argument("--ceiling", action="store_true", help="also measure the generator's ceiling")
    ap.add_argument("--sample-every", type=float, default=10.0, help="RSS sample period (s)")
    ap.add_argument("--publish-ratio", type=float, default=0.1, help="share of publishes")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()
    with ExitStack() as stack:
        tmp = scratch_dir("kvc-load-")
        db_pid = None
        if args.catalog == "sqlite":
            url = f"sqlite:///{tmp / 'catalog.db'}"
        else:
            from tests.services import start_postgres

            pg = stack.enter_context(start_postgres())
            url, db_pid = pg.url, pg.proc.pid
        populate(url)
        ceiling = None
        if args.ceiling:
            ceiling = run_ceiling(
                url,
                clients=args.clients,
                seconds=args.seconds,
                client_procs=args.client_procs,
                publish_ratio=args.publish_ratio,
            )
        with kvc_serve(url, tmp, workers=args.workers, threads=args.threads) as (base, server):
            one = drive(
                base,
                server.pid,
                clients=1,
                seconds=args.seconds,
                publish_ratio=args.publish_ratio,
                sample_every=args.sample_every,
                db_pid=db_pid,
            )
            many = drive(
                base,
                server.pid,
                clients=args.clients,
                seconds=args.seconds,
                first_id=1,
                client_procs=args.client_procs,
                publish_ratio=args.publish_ratio,
                sample_every=args.sample_every,
                db_pid=db_pid,
            )
        for res in (one, many):
            check_published(url, res)
    s1, sn = one.summary(), many.summary()
    ratio = round(sn["requests_per_s"] / max(s1["requests_per_s"], 1e-9), 2)
    if args.json:
        doc = {"one": s1, "many": sn, "ratio": ratio}
        if ceiling is not None:
            doc["ceiling"] = ceiling.summary()
        print(json.dumps(doc, indent=2))
    else:
        workers = "default" if args.workers is None else args.workers
        threads = "default" if args.threads is None else args.threads
        print(
            f"\nkvc serve ({args.catalog}, --workers {workers}, --threads {threads}),"
            f" {os.cpu_count()} cores"
        )
        if ceiling is not None:
            _print_phase("load generator ceiling (stub server)", ceiling.summary())
        _print_phase("1 client", s1)
        _print_phase(f"{args.clients} clients in {args.client_procs} process(es)", sn)
        print(f"\nthroughput {args.clients} clients / 1 client: {ratio}")
        print(
            "server RSS (MB) at s: "
            + f"0: {s1['rss_start_mb']}, "
            + ", ".join(f"{t}: {mb}" for t, mb in s1["rss_samples_mb"])
            + "; then "
            + ", ".join(f"{t}: {mb}" for t, mb in sn["rss_samples_mb"])
        )
    bad = False
    for res in (one, many):
        for e in res.errors[:10]:
            print("error:", e, file=sys.stderr)
        for e in res.wrong[:10] + res.lost[:10]:
            print("wrong:", e, file=sys.stderr)
        bad = bad or bool(res.errors or res.wrong or res.lost)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
