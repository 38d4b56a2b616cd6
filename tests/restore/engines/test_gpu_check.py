"""The GPU check (bench/gpu_check/, bench/bench_hf_cuda.py), everything of it that runs without a GPU:
the wheel folder's selection and size check, run.py's command lines and its exit without a GPU, the
collection of the `cuda`-marked tests from a copy, and the bench on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
NO_GPU = not torch.cuda.is_available()


def script(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_wheels = script("bench/gpu_check/make_wheels.py")
gpu_run = script("bench/gpu_check/run.py")


def env_without_checkout() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# -- make_wheels.py ------------------------------------------------------------------------------


def test_the_folder_takes_kvc_s_core_dependencies_and_the_test_runner_never_torch() -> None:
    reqs = make_wheels.requirements(ROOT / "pyproject.toml")
    names = {Requirement(r).name for r in reqs}
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {Requirement(r).name for r in core} | {"pytest", "hypothesis"} == names
    assert not names & {"torch", "transformers", "vllm", "sglang"}
    cmd = make_wheels.download_command(Path("/w"), ["kvc==0.1.0", *reqs])
    joined = " ".join(cmd)
    assert cmd[1:4] == ["-m", "pip", "download"]
    for flag in (
        "--only-binary=:all:",
        "--python-version 3.12",
        "--implementation cp",
        "--abi cp312",
        "--platform manylinux_2_28_x86_64",
        "--find-links /w",
        "--dest /w",
    ):
        assert flag in joined, flag
    assert cmd[-len(reqs) - 1 :] == ["kvc==0.1.0", *reqs]
    assert make_wheels.kvc_wheel_command(Path("/w"))[-4:] == [
        "--no-deps",
        "--wheel-dir",
        "/w",
        str(ROOT),
    ]


def wheel(folder: Path, name: str, size: int = 1000) -> None:
    with open(folder / name, "wb") as f:
        f.truncate(size)  # sparse: the size counts, the disk holds nothing


GOOD = [
    "kvc-0.1.0-py3-none-any.whl",
    "numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    "zstandard-0.25.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "six-1.17.0-py2.py3-none-any.whl",
]


def test_the_folder_check_accepts_wheels_for_312_manylinux_under_the_limit(tmp_path: Path) -> None:
    for name in GOOD:
        wheel(tmp_path, name, 5 << 20)
    sizes = make_wheels.check_folder(tmp_path)
    assert sizes == dict.fromkeys(sorted(GOOD), 5 << 20)
    assert make_wheels.kvc_requirement(sizes) == "kvc==0.1.0"


@pytest.mark.parametrize(
    ("extra", "size", "message"),
    [
        ("torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", 1000, "torch-2.11.0.*own torch"),
        ("transformers-5.17.0-py3-none-any.whl", 1000, "transformers-5.17.0"),
        (
            "numpy-2.5.5-cp311-cp311-manylinux_2_28_x86_64.whl",
            1000,
            "do not install.*numpy-2.5.5-cp311",
        ),
        (
            "blake3-1.0.11-cp312-cp312-macosx_11_0_arm64.whl",
            1000,
            "do not install.*macosx_11_0_arm64",
        ),
        ("botocore-1.44.18-py3-none-any.whl", 50 << 20, r"70\.0 MiB, over the 64 MiB.*botocore"),
    ],
)
def test_the_folder_check_refuses_by_name(
    tmp_path: Path, extra: str, size: int, message: str
) -> None:
    for name in GOOD:
        wheel(tmp_path, name, 5 << 20)
    wheel(tmp_path, extra, size)
    with pytest.raises(make_wheels.WheelFolderError, match=message):
        make_wheels.check_folder(tmp_path)


def test_a_folder_without_kvc_is_refused(tmp_path: Path) -> None:
    wheel(tmp_path, GOOD[1])
    with pytest.raises(make_wheels.WheelFolderError, match="no kvc wheel"):
        make_wheels.check_folder(tmp_path)


# -- run.py --------------------------------------------------------------------------------------


def test_run_installs_offline_into_a_venv_that_sees_the_machine_s_torch() -> None:
    venv = gpu_run.venv_command("/usr/bin/python3.12", Path("/w/venv"))
    assert venv == ["/usr/bin/python3.12", "-m", "venv", "--system-site-packages", "/w/venv"]
    install = gpu_run.install_command(Path("/w/venv/bin/python"), Path("/wheels"))
    assert install[:4] == ["/w/venv/bin/python", "-m", "pip", "install"]
    assert "--no-index" in install
    assert install[install.index("--find-links") + 1] == "/wheels"
    assert install[install.index("--requirement") + 1] == "/wheels/requirements.txt"
    tests = gpu_run.pytest_command(Path("py"), [Path("tests/a.py")], Path("/w/junit.xml"))
    assert tests[1:5] == ["-m", "pytest", "-m", "cuda"]
    assert "--junitxml=/w/junit.xml" in tests and tests[-1] == "tests/a.py"
    bench = gpu_run.bench_command(Path("py"), Path("/w/src"), Path("/w/bench.json"))
    assert bench[1] == "/w/src/bench/bench_hf_cuda.py"
    assert bench[-2:] == ["--json-out", "/w/bench.json"] and "--tokens" in bench


def test_the_cuda_marked_test_files_are_found_and_only_those() -> None:
    files = gpu_run.cuda_test_files(ROOT / "tests")
    assert Path("tests/restore/engines/test_hf.py") in files
    assert Path("tests/restore/engines/test_gpu_check.py") not in files
    every = {
        p.relative_to(ROOT)
        for p in (ROOT / "tests").rglob("test_*.py")
        if any(line.strip() == "@pytest.mark.cuda" for line in p.read_text().splitlines())
    }
    assert every == set(files)


@pytest.mark.skipif(not NO_GPU, reason="checks the exit where there is no GPU")
def test_without_a_gpu_run_says_so_exits_3_and_installs_nothing(tmp_path: Path) -> None:
    work = tmp_path / "work"
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu_check/run.py"), "--work", str(work)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == gpu_run.EXIT_NO_GPU == 3, out.stderr
    assert "no CUDA GPU" in out.stderr and "sees no CUDA device" in out.stderr
    assert f"torch {torch.__version__}" in out.stderr
    assert sorted(p.name for p in work.iterdir()) == ["report.json"]
    report = json.loads((work / "report.json").read_text())
    assert report["exit"] == 3 and report["gpu"]["cuda"] is False


def test_a_python_without_torch_exits_3_naming_it(tmp_path: Path) -> None:
    # A Python that sees no site-packages: torch cannot be imported there.
    python = tmp_path / "python-without-site"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    work = tmp_path / "work"
    code, report = gpu_run.run(str(python), tmp_path / "wheels", work, 120)
    assert code == 3 and report["gpu"]["torch"] is None
    assert not work.exists()


def test_a_python_other_than_the_wheels_one_or_no_wheel_folder_exits_4_before_installing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = {
        "cuda": True,
        "torch": "2.11.0",
        "cuda_build": "12.8",
        "device": "GPU",
        "python": "3.11.7",
    }
    monkeypatch.setattr(gpu_run, "probe_gpu", lambda python: gpu)
    wheels, work = tmp_path / "wheels", tmp_path / "work"
    work.mkdir()
    assert gpu_run.run("python3", wheels, work, 60)[0] == gpu_run.EXIT_INSTALL == 4  # no folder
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("kvc==0.1.0\n")
    (wheels / "manifest.json").write_text(json.dumps({"python": "3.12"}))
    assert gpu_run.run("python3", wheels, work, 60)[0] == 4  # a Python 3.11
    assert list(work.iterdir()) == []  # nothing made, nothing installed


@pytest.mark.slow
def test_the_copied_tests_collect_and_report_the_cuda_tests(tmp_path: Path) -> None:
    """run.py's test step as it runs there, on a copy of tests/ that imports the installed kvc:
    here every cuda test is collected and skipped, and the JUnit counts say so."""
    src = tmp_path / "src"
    gpu_run.copy_sources(src)
    assert (src / "bench/bench_hf_cuda.py").is_file() and (src / "pyproject.toml").is_file()
    files = gpu_run.cuda_test_files(src / "tests")
    junit = tmp_path / "junit.xml"
    out = subprocess.run(
        gpu_run.pytest_command(Path(sys.executable), files, junit),
        cwd=src,
        env=env_without_checkout(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    counts = gpu_run.junit_counts(junit)
    assert counts["tests"] >= 2 and counts["failures"] == counts["errors"] == 0
    if NO_GPU:
        assert counts["skipped"] == counts["tests"]


# -- bench_hf_cuda.py ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_bench_runs_on_the_cpu_and_finds_the_restore_exact(tmp_path: Path) -> None:
    rows_file = tmp_path / "rows.json"
    args = ["--device", "cpu", "--model", "demo", "--tokens", "40,300", "--dtypes", "bfloat16"]
    args += ["--reps", "1", "--json-out", str(rows_file)]
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/bench_hf_cuda.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    assert [(r["tokens"], r["dtype"], r["device"]) for r in rows] == [
        (40, "bfloat16", "cpu"),
        (300, "bfloat16", "cpu"),
    ]
    for r in rows:
        assert r["exact"] and r["on_device"]
        assert r["kv_mb"] == pytest.approx((r["tokens"] - 1) * 4 * 2 * 2 * 64 * 2 / 1e6)
        assert r["restore_gbs"] > 0 and r["floor_gbs"] > 0 and r["ratio_to_floor"] > 0
    assert "restore ms" in out.stdout and "floor GB/s" in out.stdout


@pytest.mark.skipif(not NO_GPU, reason="checks the exit where there is no GPU")
def test_the_bench_without_a_gpu_exits_3_and_measures_nothing() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/bench_hf_cuda.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 3
    assert "no CUDA device" in out.stderr and "nothing measured" in out.stderr
