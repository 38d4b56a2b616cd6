"""`kvc demo`, the main job: runs on the embedded default, restores shared prefixes, checks exactness."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from catalog.catalog import Catalog

ROOT = Path(__file__).resolve().parents[2]


def _kvc(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "kvc"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    env["KVC_HOME"] = str(home)
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, wherever kvc is installed from
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=env)


def test_demo_json_on_a_fresh_home(tmp_path: Path) -> None:
    out = _kvc(
        "demo",
        "--json",
        "--sessions",
        "2",
        "--system-tokens",
        "300",
        "--new-tokens",
        "3",
        home=tmp_path / "h",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # stdout carries only the JSON document
    assert doc["exact"] is True
    first, *later = doc["sessions"]
    assert first["restored"] == 0 and first["recomputed"] == first["prompt_tokens"]
    assert all(s["restored"] >= 256 and s["exact"] for s in later)
    assert [s["session"] for s in doc["sessions"]] == ["chat-0", "chat-1", "chat-0-fork"]
    # Each session's ref, and the fork's source as the catalog recorded it.
    assert [(s["ref"], s["forked_from"]) for s in doc["sessions"]] == [
        ("demo/chat-0", None), ("demo/chat-1", None), ("demo/chat-0-fork", "demo/chat-0"),
    ]
    assert doc["stored_bytes"] < doc["per_session_file_bytes"]
    assert (tmp_path / "h" / "catalog.db").exists() and any((tmp_path / "h" / "blobs").rglob("*"))


def test_demo_again_restores_everything_and_prints_a_table(tmp_path: Path) -> None:
    args = ("--sessions", "1", "--system-tokens", "300", "--new-tokens", "2")
    assert _kvc("demo", *args, home=tmp_path / "h").returncode == 0
    out = _kvc("demo", *args, home=tmp_path / "h")
    assert out.returncode == 0, out.stderr
    assert "exact" in out.stdout and "NOT EXACT" not in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("chat-0 "))
    restored = int(row.split()[2])
    assert restored > 0  # the second run finds the first run's chunks
    assert (
        "demo/chat-0-fork was forked from demo/chat-0 "
        "(kvc show demo/chat-0-fork --namespace demo)"
    ) in out.stdout.splitlines()
    # The fork's ref remembers its source, and the second run moved no ref to where it was.
    with Catalog.open(f"sqlite:///{tmp_path / 'h' / 'catalog.db'}") as cat:
        assert cat.get_ref("demo", "demo/chat-0-fork").forked_from == "demo/chat-0"
        updates = cat.events(namespace="demo", kind="ref.update")
        assert updates and all(e.details["from"] != e.details["to"] for e in updates)
    refs = json.loads(_kvc("refs", "list", "--namespace", "demo", "--json", home=tmp_path / "h").stdout)
    listed = refs if isinstance(refs, list) else refs["refs"]
    assert {r["name"]: r["forked_from"] for r in listed}["demo/chat-0-fork"] == "demo/chat-0"
    # Sizes in the binary units every other command prints.
    storage = next(line for line in out.stdout.splitlines() if line.startswith("stored by kvc"))
    assert re.fullmatch(r"stored by kvc: [\d.]+ (B|KiB|MiB|GiB); one file per session would take [\d.]+ (B|KiB|MiB|GiB)", storage), storage


def test_demo_on_a_transformers_model_built_locally(tmp_path: Path) -> None:
    args = ("--json", "--sessions", "2", "--system-tokens", "300", "--new-tokens", "3")
    out = _kvc("demo", "--engine", "hf", *args, home=tmp_path / "h")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["engine"] == "transformers LlamaForCausalLM" and doc["exact"] is True
    first, *later = doc["sessions"]
    assert first["restored"] == 0
    assert all(s["restored"] >= 256 and s["exact"] for s in later)
    assert (tmp_path / "h" / "models" / "random-llama" / "config.json").exists()


def test_demo_on_a_given_checkpoint_directory(tmp_path: Path) -> None:
    from restore.engines.hf import save_random_model
    from tests.restore.engines.hf_worker import CONFIGS

    model = save_random_model(tmp_path / "qwen", "qwen2", **CONFIGS["qwen2"])
    out = _kvc(
        "demo",
        "--engine",
        "hf",
        "--model",
        str(model),
        "--sessions",
        "1",
        "--system-tokens",
        "100",
        "--new-tokens",
        "2",
        home=tmp_path / "h",
    )
    assert out.returncode == 0, out.stderr
    assert "kvc demo (transformers Qwen2ForCausalLM)" in out.stdout
    assert "NOT EXACT" not in out.stdout and "exact" in out.stdout


def test_demo_model_errors_are_one_line(tmp_path: Path) -> None:
    wrong = _kvc("demo", "--model", str(tmp_path), home=tmp_path / "h")
    assert wrong.returncode == 2 and "--model needs --engine hf" in wrong.stderr
    missing = _kvc("demo", "--engine", "hf", "--model", str(tmp_path / "nope"), home=tmp_path / "h")
    assert missing.returncode == 1, missing.stderr
    assert (
        missing.stderr.startswith("kvc: error: cannot load model")
        and "Traceback" not in missing.stderr
    )


def test_demo_hf_without_torch_says_what_to_install(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from kvc.cli import main\n"
        "sys.argv = ['kvc', 'demo', '--engine', 'hf']\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    env["KVC_HOME"] = str(tmp_path / "h")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 2
    assert out.stderr.startswith(
        "kvc: error: --engine hf needs torch and transformers: pip install 'kvc[hf]'"
    )


def test_each_session_is_reported_as_it_finishes(tmp_path: Path) -> None:
    """run_demo hands each row over before the next session starts; the command prints it
    then (header first, rows in order, the summary after); --json stdout is one document."""
    from chunkstore import open_store
    from kvc.demo import run_demo

    events: list[str] = []
    with Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", upgrade=True) as cat:
        cat.ensure_namespace("demo", 256)
        store = open_store(f"file://{tmp_path / 'blobs'}")
        run_demo(
            cat,
            [store],
            namespace="demo",
            chunk_size=256,
            page_size=16,
            system_tokens=300,
            sessions=2,
            new_tokens=2,
            progress=lambda name: events.append(f"start {name}"),
            on_row=lambda row: events.append(f"done {row.session}"),
        )
        store.close()
    assert events == [
        "start chat-0", "done chat-0", "start chat-1", "done chat-1",
        "start chat-0-fork", "done chat-0-fork",
    ]
    args = ("--sessions", "2", "--system-tokens", "300", "--new-tokens", "2")
    out = _kvc("demo", *args, home=tmp_path / "h").stdout.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("session "))
    rows = [line.split()[0] for line in out[header + 1 :] if line.startswith("chat-")]
    assert rows == ["chat-0", "chat-1", "chat-0-fork"]
    assert out.index(next(x for x in out if x.startswith("stored by kvc"))) > header + 3
    doc = json.loads(_kvc("demo", *args, "--json", home=tmp_path / "h").stdout)
    assert [s["session"] for s in doc["sessions"]] == rows


def _kvc_on_a_terminal(*args: str, home: Path) -> tuple[int, str, str]:
    """Run kvc with stderr on a pseudo-terminal (as in a shell) and stdout on a pipe:
    (exit code, stdout, what the terminal showed)."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    exe = Path(sys.executable).parent / "kvc"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    env.update(KVC_HOME=str(home), PYTHONPATH=str(ROOT))
    master, slave = pty.openpty()
    # A new terminal is 0 columns wide: tqdm would draw an empty bar.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    shown = bytearray()

    def drain() -> None:  # the terminal must be read while kvc writes, or kvc blocks
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every writer has closed the terminal
                return
            if not data:
                return
            shown.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with subprocess.Popen(
        [str(exe), *args], stdout=subprocess.PIPE, stderr=slave, env=env, text=True
    ) as proc:
        os.close(slave)
        stdout, _ = proc.communicate(timeout=300)
    reader.join(timeout=60)
    os.close(master)
    return proc.returncode, stdout, shown.decode(errors="replace")


def test_the_progress_line_is_on_the_terminals_stderr_and_stdout_stays_clean(
    tmp_path: Path,
) -> None:
    args = ("--sessions", "1", "--system-tokens", "300", "--new-tokens", "2")
    code, stdout, terminal = _kvc_on_a_terminal("demo", *args, home=tmp_path / "h")
    assert code == 0, terminal
    # The progress line went to the terminal: tqdm's bar, counting finished sessions.
    assert "kvc demo:" in terminal and "2/2" in terminal and "session" in terminal
    # stdout has the header, one row per session and the summary, and nothing of the bar.
    assert "\r" not in stdout and "kvc demo:" not in stdout
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("session "))
    assert [line.split()[0] for line in lines[header + 1 : header + 3]] == ["chat-0", "chat-0-fork"]
    # --json: stdout is the JSON document alone, and no bar is drawn at all.
    code, stdout, terminal = _kvc_on_a_terminal("demo", *args, "--json", home=tmp_path / "h")
    assert code == 0, terminal
    assert [s["session"] for s in json.loads(stdout)["sessions"]] == ["chat-0", "chat-0-fork"]
    assert "kvc demo:" not in terminal
