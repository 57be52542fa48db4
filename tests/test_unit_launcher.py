"""The launcher's policies without a server: the restart backoff and limit (launcher/supervisor.py), how
repeated stop signals are taken (launcher/process.py), and the parent-death wrapper (launcher/child.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launcher import supervisor
from launcher.child import owned
from launcher.process import StopSignals
from launcher.supervisor import Restarts, ending


def test_restarts_back_off_doubling_to_a_cap_and_give_up_past_the_limit(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])
    policy = Restarts("tritonserver", limit=7, window=600)
    delays = []
    for _ in range(7):
        delays.append(policy.next_delay(-9))
        now[0] += 1  # it fails again a second after each restart
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(RuntimeError, match=r"tritonserver ended \(killed by SIGKILL\) after 7 restarts within 600 s"):
        policy.next_delay(-9)


def test_a_healthy_minute_resets_the_backoff_and_old_restarts_leave_the_window(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])
    policy = Restarts("openai_frontend", limit=2, window=100)
    assert [policy.next_delay(1), policy.next_delay(1)] == [1, 2]
    policy.ready_since = now[0]
    now[0] += supervisor.HEALTHY_SECONDS + 50  # up a healthy minute, and the first two restarts are past the window
    assert policy.next_delay(1) == 1


class FakeProcess:
    """A child process that ends when the test says."""

    next_pid = 100

    def __init__(self) -> None:
        self.pid, self.code = FakeProcess.next_pid, None
        FakeProcess.next_pid += 1

    def poll(self) -> int | None:
        return self.code


class FakeChild:
    def __init__(self) -> None:
        self.process, self.is_ready, self.starts = FakeProcess(), True, 0

    def start(self) -> "FakeChild":
        self.process, self.starts = FakeProcess(), self.starts + 1
        return self

    def ready(self) -> bool:
        return self.is_ready


def test_one_childs_backoff_or_start_up_never_hides_the_others_death(monkeypatch, tmp_path):
    """A front end started again while tritonserver is down is not ready until tritonserver is: the
    supervisor must still see tritonserver die meanwhile, and give up past the limit at once."""
    now, script = [0.0], {}
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])

    def sleep(seconds: float) -> None:
        now[0] += seconds
        for at in [t for t in script if t <= now[0]]:
            script.pop(at)()

    monkeypatch.setattr(supervisor.time, "sleep", sleep)
    monkeypatch.setenv("RESTART_LIMIT", "1")
    triton, frontend = FakeChild(), FakeChild()
    state, ended = supervisor.State(tmp_path / "state.json"), []

    def frontend_dies() -> None:
        frontend.process.code, frontend.is_ready = -9, False  # and, started again, never ready

    def triton_dies() -> None:
        triton.process.code = -9

    script.update({1.0: frontend_dies, 3.0: triton_dies, 10.0: triton_dies})
    with pytest.raises(RuntimeError, match=r"tritonserver ended \(killed by SIGKILL\) after 1 restarts"):
        supervisor.keep_serving({"tritonserver": triton, "openai_frontend": frontend}, state,
                                lambda: ended.append(now[0]), startup_timeout=1800)
    assert now[0] < 12  # not held up by the front end's start-up timeout (1800 s)
    assert frontend.starts == 1 and triton.starts == 1 and ended == [3.0]  # its stubs ended (the last: by stop)
    assert state.triton_pid == triton.process.pid and state.restarts == {"openai_frontend": 1, "tritonserver": 1}


def test_a_child_that_dies_before_it_is_ready_backs_off_doubling(monkeypatch, tmp_path):
    """A healthy minute resets the backoff only once the child served it: one that never gets ready (a
    model that fails to load) is started again after 1, 2, 4 s, not every second."""
    now, starts = [0.0], []
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(supervisor.time, "sleep", lambda seconds: now.__setitem__(0, now[0] + seconds))
    monkeypatch.setenv("RESTART_LIMIT", "3")
    child = FakeChild()
    now[0] = 1000.0  # long after it was first ready
    child.process.code, child.is_ready = 1, False

    def start() -> FakeChild:
        starts.append(now[0])
        child.process = FakeProcess()
        child.process.code = 1  # it exits at once, every time
        return child

    child.start = start
    with pytest.raises(RuntimeError, match="after 3 restarts"):
        supervisor.keep_serving({"tritonserver": child}, supervisor.State(tmp_path / "s.json"), lambda: None, 60)
    assert [round(b - a) for a, b in zip(starts, starts[1:])] == [2, 4]


def test_a_child_not_ready_within_the_start_up_timeout_is_ended_and_counted(monkeypatch, tmp_path):
    now, killed = [0.0], []
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(supervisor.time, "sleep", lambda seconds: now.__setitem__(0, now[0] + seconds))
    monkeypatch.setattr(supervisor.os, "killpg", lambda pid, number: killed.append(pid) or setattr(child.process, "code", -9))
    monkeypatch.setenv("RESTART_LIMIT", "1")
    child = FakeChild()
    child.process.code, child.is_ready = 1, False
    with pytest.raises(RuntimeError, match=r"openai_frontend ended \(killed by SIGKILL\) after 1 restarts"):
        supervisor.keep_serving({"openai_frontend": child}, supervisor.State(tmp_path / "s.json"), lambda: None,
                                startup_timeout=60)
    assert killed == [child.process.pid] and 60 < now[0] < 65


def test_restart_settings_are_checked(monkeypatch):
    monkeypatch.setenv("RESTART_LIMIT", "many")
    with pytest.raises(RuntimeError, match="RESTART_LIMIT must be a count"):
        supervisor.limits()
    monkeypatch.setenv("RESTART_LIMIT", "3")
    monkeypatch.setenv("RESTART_WINDOW", "60")
    assert supervisor.limits() == (3, 60.0)


def test_an_ending_is_said_in_words():
    assert ending(-9) == "killed by SIGKILL" and ending(1) == "exit code 1" and ending(-6) == "killed by SIGABRT"


def test_the_first_stop_signal_interrupts_and_the_next_ones_never_do():
    signals = StopSignals().install()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        os.kill(os.getpid(), signal.SIGINT)  # the second: logged only
        time.sleep(0.1)
        assert not signals.hurry.is_set()
        os.kill(os.getpid(), signal.SIGTERM)  # the third: the drain ends now
        time.sleep(0.1)
        assert signals.hurry.is_set() and signals.count == 3
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_a_child_gets_sigterm_when_its_parent_dies(tmp_path):
    """A parent that starts a child through ``owned`` and is then SIGKILLed: the child ends too."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from launcher.child import owned\n"
        f"child = subprocess.Popen(owned([sys.executable, '-c', 'import time; time.sleep(60)']), start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")], cwd=os.getcwd())
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    time.sleep(0.5)  # the wrapper has set the signal and become the sleeper
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)
    assert owned(["x"])[-2:] == [str(os.getpid()), "x"]


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
