"""A just-in-time build never waits on a build that died: torch's lock file left by a killed build is removed,
and live builds of one extension still take turns."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from lookahead_kernels.build_lock import exclusive_build

pytest.importorskip("fcntl")

NAME = "lookahead_lock_test"


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path / NAME


def test_the_lock_file_a_killed_build_left_is_removed(build_dir, capsys):
    # As a build killed inside torch's load leaves it: its process gone, its OS lock released with it.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import pathlib, sys, time\n"
         "from lookahead_kernels.build_lock import exclusive_build\n"
         f"with exclusive_build({NAME!r}):\n"
         f"    pathlib.Path(sys.argv[1], 'lock').touch()\n"
         "    print('holding', flush=True)\n"
         "    time.sleep(600)\n",
         str(build_dir)],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert holder.stdout.readline().strip() == "holding"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (build_dir / "lock").exists()
    with exclusive_build(NAME):
        assert not (build_dir / "lock").exists()
    assert "interrupted" in capsys.readouterr().err


def test_live_builds_of_one_extension_take_turns(build_dir):
    entered = threading.Event()

    def second():
        with exclusive_build(NAME):
            entered.set()

    with exclusive_build(NAME):
        (build_dir / "lock").touch()  # torch's own lock, held by this live build
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        assert not entered.is_set() and (build_dir / "lock").exists()
        (build_dir / "lock").unlink()  # torch releases its lock before the load returns
    thread.join(timeout=10)
    assert entered.is_set()


def test_each_checkout_builds_into_a_directory_of_its_own(tmp_path):
    """Two source trees never share a build directory (torch rebuilt a library whose build file named the other
    tree's sources, silently); one tree always gets the same one, and the name stays a C identifier."""
    from lookahead_kernels import cpu_ops, pool_ext
    from lookahead_kernels.build_lock import extension_name

    a = extension_name("lookahead_cpu_ops", tmp_path / "a" / "csrc")
    b = extension_name("lookahead_cpu_ops", tmp_path / "b" / "csrc")
    assert a != b and a == extension_name("lookahead_cpu_ops", tmp_path / "a" / "csrc")
    assert a.startswith("lookahead_cpu_ops_") and a.isidentifier()
    assert cpu_ops._NAME == extension_name("lookahead_cpu_ops", cpu_ops._CSRC)
    assert pool_ext._CPU_NAME == extension_name("lookahead_pool_cpu", pool_ext._CSRC) != cpu_ops._NAME
