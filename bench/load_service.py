"""Load on the HTTP catalog service: concurrent clients doing lookups and publishes, bounded in time.

Usage (repository root, project venv):

    python bench/load_service.py [--clients 50] [--seconds 60] [--catalog sqlite|postgres]

Starts `kvc serve` as a real process on 127.0.0.1 (a SQLite catalog in a temp
dir, or the embedded PostgreSQL), populates it, then runs the clients for the
given time and stops by itself. Prints throughput, p50/p99 latency per
operation, errors, and the server's resident memory at start and end.
The test suite runs a short version (tests/test_load.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from catalog import Catalog
from kvc.remote import RemoteCatalog
from tests.catalog_helpers import CS, FP, chain_records

TOKEN = "load-test-token"
SYSTEM = list(range(1000, 1000 + 8 * CS))  # a shared 8-chunk system prompt


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
        total = 0
        for op, lat in sorted(self.ops.items()):
            lat_sorted = sorted(lat)
            total += len(lat)
            out[op] = {
                "count": len(lat),
                "p50_ms": round(statistics.median(lat_sorted) * 1e3, 2),
                "p99_ms": round(
                    lat_sorted[min(len(lat_sorted) - 1, int(len(lat_sorted) * 0.99))] * 1e3, 2
                ),
            }
        out["requests_per_s"] = round(total / self.seconds, 1)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


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
) -> LoadResult:
    """Run `clients` for `seconds`. With `min_ops` (operation -> count) the clients go on
    past that, for at most `max_overrun_s`, until every count is reached: on a slow machine
    a fixed time alone does not make a given number of requests."""
    cat = Catalog.open(catalog_url, upgrade=True)
    cat.ensure_namespace("default", CS)
    for i in range(20):  # 20 conversations sharing the system prompt
        cat.record_chunks(chain_records("default", [*SYSTEM, *range(i * 50, i * 50 + 3 * CS)]))
    cat.close()
    tokens_file = workdir / "tokens.json"
    tokens_file.write_text(json.dumps({"default": hashlib.sha256(TOKEN.encode()).hexdigest()}))
    port = _free_port()
    exe = Path(sys.executable).parent / "kvc"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    server = subprocess.Popen(
        [
            str(exe),
            "serve",
            "--catalog",
            catalog_url,
            "--port",
            str(port),
            "--tokens-file",
            str(tokens_file),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    result = LoadResult(seconds=seconds, clients=clients)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("kvc serve did not start")
            time.sleep(0.1)
        result.rss_start_kb = _rss_kb(server.pid)
        lock = threading.Lock()
        stop_at = time.monotonic() + seconds

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
            with RemoteCatalog(base, TOKEN, timeout=30) as rc:
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
                        elif getattr(answer, "matched_tokens", None) != len(prompt):
                            got = getattr(answer, "matched_tokens", answer)
                            result.wrong.append(f"lookup of {len(prompt)} tokens matched {got}")

        def sampler() -> None:  # the server's RSS over the run, to see whether it levels off
            while time.monotonic() < stop_at:
                time.sleep(min(sample_every, max(0.0, stop_at - time.monotonic())))
                with lock:
                    result.rss_samples.append((time.monotonic() - t0, _rss_kb(server.pid)))

        threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
        threads.append(threading.Thread(target=sampler))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + (max_overrun_s if min_ops else 0) + 120)
        result.seconds = time.monotonic() - t0
        result.rss_end_kb = _rss_kb(server.pid)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
        if server.stderr:
            server.stderr.close()
    # Every publish the service acknowledged is in the catalog, whole.
    cat = Catalog.open(catalog_url)
    try:
        for prompt in result.published:
            got = cat.lookup("default", FP, [*prompt, 7]).matched_tokens
            if got != len(prompt):
                result.lost.append(f"a publish of {len(prompt)} tokens: {got} found")
    finally:
        cat.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--catalog", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--sample-every", type=float, default=10.0, help="RSS sample period (s)")
    ap.add_argument("--publish-ratio", type=float, default=0.1, help="share of publishes")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="kvc-load-"))
        if args.catalog == "sqlite":
            url = f"sqlite:///{tmp / 'catalog.db'}"
        else:
            from tests.services import start_postgres

            url = stack.enter_context(start_postgres()).url
        res = run_load(
            url,
            clients=args.clients,
            seconds=args.seconds,
            workdir=tmp,
            sample_every=args.sample_every,
            publish_ratio=args.publish_ratio,
        )
    summary = res.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"\nkvc serve ({args.catalog}) under {args.clients} clients for {summary['seconds']} s"
        )
        print(f"{'operation':<10} {'count':>8} {'p50 ms':>9} {'p99 ms':>9}")
        for op in ("lookup", "publish"):
            if op in summary:
                o = summary[op]
                print(f"{op:<10} {o['count']:>8} {o['p50_ms']:>9.1f} {o['p99_ms']:>9.1f}")
        print(
            f"throughput {summary['requests_per_s']} requests/s, errors {summary['errors']},"
            f" wrong answers {summary['wrong']}, lost publishes {summary['lost']}"
        )
        print(
            "server RSS (MB) at s: "
            + f"0: {summary['rss_start_mb']}, "
            + ", ".join(f"{t}: {mb}" for t, mb in summary["rss_samples_mb"])
        )
    for e in res.errors[:10]:
        print("error:", e, file=sys.stderr)
    for e in res.wrong[:10] + res.lost[:10]:
        print("wrong:", e, file=sys.stderr)
    sys.exit(1 if res.errors or res.wrong or res.lost else 0)


if __name__ == "__main__":
    main()
