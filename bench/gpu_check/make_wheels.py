"""Make the folder of wheels the GPU check installs offline: kvc and its core dependencies,
plus the test runner, for CPython 3.12 on manylinux x86_64, under 64 MiB in all.

Usage (repository root, with network to PyPI):

    python bench/gpu_check/make_wheels.py [--out bench/gpu_check/wheels]

torch and transformers are not in it: the GPU machine has its own (torch 2.11,
transformers 5.17), and `run.py` installs into a virtual environment that sees
them (`--system-site-packages`). The folder gets `requirements.txt` (what
`run.py` installs) and `manifest.json` (commit, files and sizes). Copy the
repository checkout with the folder inside to the GPU machine, then run
`python bench/gpu_check/run.py` there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path(__file__).resolve().parent / "wheels"
LIMIT_BYTES = 64 << 20
PYTHON = "3.12"
ABI = "cp312"
# The GPU machine's torch 2.11 needs glibc 2.28, so every manylinux up to 2_28 runs there.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# From the test extra: what running the `cuda`-marked tests needs beyond kvc itself.
TEST_RUNNER = ("pytest", "hypothesis")
# Installed on the GPU machine already, and far over the size limit: never in the folder.
EXCLUDED = ("torch", "transformers", "triton", "vllm", "sglang")


class WheelFolderError(Exception):
    """The wheel folder is not what the GPU machine can install offline."""


def requirements(pyproject: Path) -> list[str]:
    """kvc's core dependencies and the test runner's, as requirement strings, from pyproject.toml."""
    project = tomllib.loads(pyproject.read_text())["project"]
    test = {
        canonicalize_name(Requirement(r).name): r for r in project["optional-dependencies"]["test"]
    }
    missing = [name for name in TEST_RUNNER if name not in test]
    if missing:
        raise WheelFolderError(f"pyproject.toml's test extra lists no {', '.join(missing)}")
    return [*project["dependencies"], *(test[name] for name in TEST_RUNNER)]


def download_command(out: Path, reqs: list[str]) -> list[str]:
    """`pip download` of `reqs` and everything they need, as binary wheels for CPython 3.12 on
    manylinux x86_64 (whatever the Python running it), `out` also searched for the kvc wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--dest", str(out), "--find-links", str(out)]
    cmd += ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp"]
    cmd += ["--abi", ABI, "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, *reqs]


def kvc_wheel_command(out: Path) -> list[str]:
    """Build kvc's own wheel from this checkout (no dependencies: those are downloaded)."""
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(ROOT)]


def wheel_runs_there(filename: str) -> bool:
    """Whether a wheel installs on CPython 3.12, manylinux x86_64."""
    _, _, _, tags = parse_wheel_filename(filename)
    return any(
        tag.interpreter in ("py3", "py312", ABI)
        and tag.abi in ("none", "abi3", ABI)
        and (tag.platform == "any" or tag.platform in PLATFORMS)
        for tag in tags
    )


def check_folder(out: Path) -> dict[str, int]:
    """Every file's size, once the folder holds only wheels the GPU machine can install, none of
    the excluded packages, kvc's among them, under the size limit; else `WheelFolderError`."""
    wheels = {p.name: p.stat().st_size for p in sorted(out.glob("*.whl"))}
    names = {canonicalize_name(parse_wheel_filename(w)[0]): w for w in wheels}
    if "kvc" not in names:
        raise WheelFolderError(f"no kvc wheel in {out}")
    excluded = sorted(names[n] for n in map(canonicalize_name, EXCLUDED) if n in names)
    if excluded:
        raise WheelFolderError(
            f"{', '.join(excluded)}: the GPU machine has its own torch and transformers; "
            "these must not be in the folder"
        )
    foreign = [w for w in wheels if not wheel_runs_there(w)]
    if foreign:
        raise WheelFolderError(
            f"wheels that do not install on CPython {PYTHON} manylinux x86_64: {', '.join(foreign)}"
        )
    total = sum(wheels.values())
    if total >= LIMIT_BYTES:
        biggest = sorted(wheels.items(), key=lambda kv: -kv[1])[:5]
        listed = ", ".join(f"{w} {size / 2**20:.1f} MiB" for w, size in biggest)
        raise WheelFolderError(
            f"the wheels take {total / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB limit "
            f"(biggest: {listed})"
        )
    return wheels


def kvc_requirement(wheels: dict[str, int]) -> str:
    """`kvc==<version>` of the kvc wheel in the folder."""
    for name in wheels:
        project, version, _, _ = parse_wheel_filename(name)
        if project == "kvc":
            return f"kvc=={version}"
    raise WheelFolderError("no kvc wheel in the folder")


def commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    reqs = requirements(ROOT / "pyproject.toml")
    subprocess.run(kvc_wheel_command(out), check=True)
    kvc = kvc_requirement({p.name: 0 for p in out.glob("*.whl")})
    subprocess.run(download_command(out, [kvc, *reqs]), check=True)
    try:
        wheels = check_folder(out)
    except WheelFolderError as exc:
        print(f"make_wheels: {exc}", file=sys.stderr)
        return 1
    runner = [r for r in reqs if canonicalize_name(Requirement(r).name) in TEST_RUNNER]
    (out / "requirements.txt").write_text("\n".join([kvc, *runner]) + "\n")
    total = sum(wheels.values())
    (out / "manifest.json").write_text(
        json.dumps(
            {"commit": commit(), "python": PYTHON, "total_bytes": total, "wheels": wheels},
            indent=1,
        )
        + "\n"
    )
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {out} (limit {LIMIT_BYTES >> 20} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
