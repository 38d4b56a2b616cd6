"""The GPU check: on a machine with a CUDA GPU and no network, install kvc from the wheel folder,
run every `cuda`-marked test, then the restore-into-GPU bench; within 8 minutes.

Usage (repository checkout copied to the GPU machine with the folder `make_wheels.py` made):

    python bench/gpu_check/run.py [--wheels bench/gpu_check/wheels] [--work DIR]

`python` is the GPU machine's Python 3.12 with its own torch and transformers.
Steps: check that torch sees a CUDA device (else exit 3, nothing installed); make a
virtual environment that sees the machine's packages (`--system-site-packages`) and
`pip install --no-index --find-links` the folder into it; copy `tests/`, the bench
scripts and `pyproject.toml` into the work directory (so the tests import the
installed kvc, not the checkout) and run `pytest -m cuda` on the test files that
carry the marker; run `bench/bench_hf_cuda.py`. Everything is printed and kept in
the work directory (`report.json`, `bench.json`, `junit.xml`).

Exit codes: 0 all passed, 3 no CUDA device, 4 the install failed, 5 a test failed
or none ran, 6 the bench failed or found a restore that was not exact, 7 out of time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WHEELS = Path(__file__).resolve().parent / "wheels"
BUDGET_S = 8 * 60
BENCH_ARGS = ("--tokens", "1024,4096,16384", "--dtypes", "bfloat16,float32", "--reps", "5")
# What the bench needs from the checkout: the bench itself and the two scripts it imports from.
BENCH_FILES = ("bench_hf_cuda.py", "bench_hf.py", "bench_restore.py")
# A test or module marked `cuda`: the decorator, or a module's `pytestmark`.
CUDA_MARKER = re.compile(
    r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bpytest\.mark\.cuda\b)", re.M
)

EXIT_OK = 0
EXIT_NO_GPU = 3
EXIT_INSTALL = 4
EXIT_TESTS = 5
EXIT_BENCH = 6
EXIT_TIME = 7

GPU_PROBE = (
    "import json, platform, torch\n"
    "ok = torch.cuda.is_available()\n"
    "print(json.dumps({'cuda': ok, 'torch': torch.__version__, 'cuda_build': torch.version.cuda,\n"
    "    'device': torch.cuda.get_device_name(0) if ok else None,\n"
    "    'python': platform.python_version()}))\n"
)


class OutOfTime(Exception):
    """The check's time budget ran out during a step."""


def probe_gpu(python: str) -> dict[str, object]:
    """What `python`'s torch says about CUDA (`torch` None when it cannot import torch)."""
    out = subprocess.run([python, "-c", GPU_PROBE], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return {"cuda": False, "torch": None, "error": out.stderr.strip().splitlines()[-1:]}
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def venv_command(python: str, venv: Path) -> list[str]:
    return [python, "-m", "venv", "--system-site-packages", str(venv)]


def install_command(venv_python: Path, wheels: Path) -> list[str]:
    """pip, offline, from the folder only: what its requirements.txt names, and their needs."""
    return [
        str(venv_python),
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        str(wheels),
        "--requirement",
        str(wheels / "requirements.txt"),
    ]


def cuda_test_files(tests: Path) -> list[Path]:
    """The test modules that carry the `cuda` marker, relative to the directory above `tests`."""
    return sorted(
        p.relative_to(tests.parent)
        for p in tests.rglob("test_*.py")
        if CUDA_MARKER.search(p.read_text(encoding="utf-8"))
    )


def pytest_command(python: Path, files: Sequence[Path], junit: Path) -> list[str]:
    return [
        str(python),
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        "-rs",
        f"--junitxml={junit}",
        *map(str, files),
    ]


def bench_command(python: Path, src: Path, out: Path) -> list[str]:
    return [
        str(python),
        str(src / "bench" / "bench_hf_cuda.py"),
        *BENCH_ARGS,
        "--json-out",
        str(out),
    ]


def copy_sources(src: Path) -> None:
    """The tests, the bench scripts and the pytest settings, without kvc's own packages."""
    shutil.copytree(ROOT / "tests", src / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "bench").mkdir()
    for name in BENCH_FILES:
        shutil.copy2(ROOT / "bench" / name, src / "bench" / name)
    shutil.copy2(ROOT / "pyproject.toml", src / "pyproject.toml")


def junit_counts(junit: Path) -> dict[str, int]:
    """tests, failures, errors and skipped, summed over the report's test suites."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {
        key: sum(int(s.get(key, 0)) for s in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }


def step(cmd: list[str], deadline: float, cwd: Path, env: dict[str, str] | None = None) -> int:
    """Run one step in the foreground, its output straight to ours, until the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise OutOfTime(" ".join(cmd[:4]))
    print(f"\n$ {' '.join(cmd)}", flush=True)
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, timeout=left).returncode
    except subprocess.TimeoutExpired as exc:
        raise OutOfTime(" ".join(cmd[:4])) from exc


def run(python: str, wheels: Path, work: Path, budget_s: float) -> tuple[int, dict[str, object]]:
    deadline = time.monotonic() + budget_s
    report: dict[str, object] = {"python": python, "wheels": str(wheels), "work": str(work)}
    gpu = probe_gpu(python)
    report["gpu"] = gpu
    if not gpu["cuda"]:
        why = (
            f"torch cannot be imported by {python} ({gpu.get('error')})"
            if gpu["torch"] is None
            else f"torch {gpu['torch']} (built for CUDA {gpu['cuda_build']}) sees no CUDA device"
        )
        print(f"gpu_check: no CUDA GPU: {why}. Nothing was installed or run.", file=sys.stderr)
        return EXIT_NO_GPU, report
    print(f"gpu_check: {gpu['device']}, torch {gpu['torch']}, CUDA {gpu['cuda_build']}")
    manifest = wheels / "manifest.json"
    if not (manifest.is_file() and (wheels / "requirements.txt").is_file()):
        print(f"gpu_check: {wheels} is not a wheel folder: run make_wheels.py", file=sys.stderr)
        return EXIT_INSTALL, report
    made_for = json.loads(manifest.read_text())["python"]
    if not str(gpu["python"]).startswith(f"{made_for}."):
        print(
            f"gpu_check: {python} is Python {gpu['python']}; the wheels are for CPython "
            f"{made_for}: pass --python with a {made_for} that has torch",
            file=sys.stderr,
        )
        return EXIT_INSTALL, report
    try:
        venv = work / "venv"
        venv_python = venv / "bin" / "python"
        if step(venv_command(python, venv), deadline, work) != 0:
            return EXIT_INSTALL, report
        if step(install_command(venv_python, wheels), deadline, work) != 0:
            print("gpu_check: the offline install failed (above)", file=sys.stderr)
            return EXIT_INSTALL, report
        src = work / "src"
        copy_sources(src)
        files = cuda_test_files(src / "tests")
        report["test_files"] = [str(f) for f in files]
        junit = work / "junit.xml"
        # Nothing of the checkout on the path: the tests import the kvc that was installed.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        tests_rc = step(pytest_command(venv_python, files, junit), deadline, src, env)
        counts = junit_counts(junit) if junit.is_file() else {}
        report["tests"] = {"exit": tests_rc, **counts}
        ran = counts.get("tests", 0) - counts.get("skipped", 0)
        if tests_rc != 0 or ran == 0:
            print(f"gpu_check: cuda tests: exit {tests_rc}, {counts}", file=sys.stderr)
            return EXIT_TESTS, report
        bench_json = work / "bench.json"
        bench_rc = step(bench_command(venv_python, src, bench_json), deadline, src, env)
        report["bench"] = {
            "exit": bench_rc,
            "rows": json.loads(bench_json.read_text()) if bench_json.is_file() else None,
        }
        if bench_rc != 0:
            return EXIT_BENCH, report
    except OutOfTime as exc:
        print(f"gpu_check: out of time ({budget_s:.0f} s) during: {exc}", file=sys.stderr)
        return EXIT_TIME, report
    return EXIT_OK, report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS)
    ap.add_argument("--work", type=Path, help="a new directory for the venv and reports")
    ap.add_argument(
        "--python", default=sys.executable, help="the Python with torch (default: this)"
    )
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
    args = ap.parse_args(argv)
    work: Path = args.work or Path(tempfile.mkdtemp(prefix="kvc-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    code, report = run(args.python, args.wheels.resolve(), work.resolve(), args.budget)
    report["exit"] = code
    report["seconds"] = round(time.monotonic() - t0, 1)
    (work / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu_check: exit {code} after {report['seconds']} s; report in {work / 'report.json'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
