"""DeathWatch and the drain board on real processes standing in for stubs and servers: a killed stub is
reported once, a normal exit never; a dead server's drain notice never counts."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from ipc import drain_notice, stubs
from ipc.stubs import DeathWatch, zombies


@pytest.fixture
def fake_stubs(monkeypatch):
    """Children of this test run as the 'llm' and 'preprocess' stubs of this process (the server). A pid
    put in ``children["exiting"]`` is an exit under way: out of ``stubs`` (no command line), no zombie yet."""
    children: dict = {"llm": [], "preprocess": [], "exiting": set()}

    def running(server_pid=None) -> dict[str, set[int]]:
        return {model: {c.pid for c in children[model] if c.returncode is None and not zombies([c.pid])} - children["exiting"]
                for model in ("llm", "preprocess")}

    monkeypatch.setattr(stubs, "stubs", running)
    yield children
    for child in children["llm"] + children["preprocess"]:
        child.kill()
        child.wait()


def start(children: dict, model: str) -> subprocess.Popen:
    child = subprocess.Popen(["sleep", "60"])
    children[model].append(child)
    return child


def test_a_killed_stub_is_reported_once_after_two_looks(fake_stubs):
    watch = DeathWatch(["llm"], os.getpid())
    victim = start(fake_stubs, "llm")
    assert watch.look() == set()
    os.kill(victim.pid, signal.SIGKILL)  # not reaped: a zombie, as Triton 2.51 leaves a killed stub
    time.sleep(0.2)
    assert zombies([victim.pid]) == {victim.pid}
    assert watch.look() == set()  # one look could be the instant before a normal exit is reaped
    assert watch.look() == {"llm"}
    assert watch.look() == set()  # once
    start(fake_stubs, "llm")  # the watchdog's reload
    assert watch.look() == set()


def test_a_stub_killed_before_the_first_periodic_look_is_reported(fake_stubs):
    """The watch sees the stubs alive when it is made: the OpenAI front end's first periodic look came a
    second after it said ready, and CI's fault test killed llm before it (a request then never answered)."""
    victim = start(fake_stubs, "llm")
    watch = DeathWatch(["llm"], os.getpid())
    os.kill(victim.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert [watch.look() for _ in range(3)] == [set(), {"llm"}, set()]


def test_a_stub_whose_exit_is_under_way_is_still_reported(fake_stubs):
    """A killed stub leaves ``stubs`` at once but turns zombie only once its memory is freed (a third of a
    second for 3 GiB): a look in between must not take it for a normal exit and forget it."""
    watch = DeathWatch(["llm"], os.getpid())
    victim = start(fake_stubs, "llm")
    assert watch.look() == set()
    fake_stubs["exiting"].add(victim.pid)
    assert [watch.look() for _ in range(2)] == [set(), set()]
    os.kill(victim.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert [watch.look() for _ in range(3)] == [set(), {"llm"}, set()]


def test_a_normal_exit_and_unwatched_models_are_not_deaths(fake_stubs):
    watch = DeathWatch(["llm"], os.getpid())
    leaving, other = start(fake_stubs, "llm"), start(fake_stubs, "preprocess")
    assert watch.look() == set()
    leaving.terminate()
    leaving.wait()  # reaped at once, as Triton reaps a stub it unloads
    os.kill(other.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert [watch.look() for _ in range(3)] == [set(), set(), set()]


def test_a_drain_notice_counts_only_while_its_own_server_runs(monkeypatch, tmp_path):
    """``launcher health`` fails, and preprocess and llm drain, while their server drains, and only then:
    a notice left by a server that died mid-drain counts neither while it is an unreaped zombie nor once
    its pid is another process's (a restarted container's tritonserver, which keeps /dev/shm)."""
    monkeypatch.setattr(drain_notice, "BOARD", tmp_path)
    server = subprocess.Popen(["sleep", "60"])
    try:
        assert not drain_notice.posted()
        drain_notice.begin(server.pid, 30)
        assert drain_notice.posted() and drain_notice.notice(server.pid).seconds == 30
        os.kill(server.pid, signal.SIGKILL)  # its launcher killed too: nobody clears the notice
        time.sleep(0.2)
        assert zombies([server.pid]) == {server.pid} and not drain_notice.posted() and drain_notice.notice(server.pid) is None
    finally:
        server.kill()
        server.wait()
    assert not drain_notice.posted()
    drain_notice.begin(os.getpid(), 30)
    assert drain_notice.posted()
    since = (tmp_path / f"drain-{os.getpid()}").read_text().split()[2]
    (tmp_path / f"drain-{os.getpid()}").write_text(f"0 30 {int(since) - 1}")  # an earlier process with this pid
    assert not drain_notice.posted() and drain_notice.notice(os.getpid()) is None
