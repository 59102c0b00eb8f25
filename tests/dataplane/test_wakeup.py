"""The main loops' wake-up (``dataplane.wakeup``) and how a data plane stops when its supervisor
is gone: real processes, real signals, bounded polls.

A handler that took a lock (``threading.Event.set``) deadlocked the main thread when a second
signal came while the first handler held the lock; a supervisor killed with SIGKILL sends its
children one SIGTERM per thread of its own, so its data plane could live on, serving, with no
supervisor (tests/test_fault_trials.py saw one such leftover).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from kvblend.dataplane import default_address
from kvblend.dataplane.settings import DataPlaneSettings
from tests.dataplane.conftest import create_store
from tests.harness import poll

DEADLINE_S = 60.0

#: a loop like the supervisor's: many waits, each woken by a signal or at once
LOOP = textwrap.dedent("""
    import signal, sys
    from kvblend.dataplane.wakeup import Wakeup
    wake = Wakeup().catch(stop=(signal.SIGTERM,), wake=(signal.SIGUSR1,))
    print("ready", flush=True)
    for _ in range(int(sys.argv[1])):
        wake.wait(0)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # the storm outlives the loop
    print("done", flush=True)
""")


def test_a_storm_of_signals_never_stops_the_loop() -> None:
    """SIGUSR1 sent as fast as one process can while the loop runs 300,000 waits that return at
    once unless woken: every wait returns. A handler that set a ``threading.Event`` instead failed
    here in each of four runs, within two seconds: nested handlers blocked on the lock their outer
    call held until the recursion limit ended the process."""
    proc = subprocess.Popen([sys.executable, "-c", LOOP, "300000"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        sent = 0

        def storm_until_done() -> bool:
            nonlocal sent
            for _ in range(200):
                if proc.poll() is not None:
                    return True
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    return True
                sent += 1
            return False
        poll(storm_until_done, DEADLINE_S, "the loop to finish under a storm of signals",
             every_s=0.0)
        assert proc.wait() == 0
        assert proc.stdout.read() == "done\n"
        assert sent > 1000  # it was a storm
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_stop_signal_is_recorded_and_wakes_the_wait() -> None:
    code = textwrap.dedent("""
        import signal
        from kvblend.dataplane.wakeup import Wakeup
        wake = Wakeup().catch()
        print("ready", flush=True)
        while wake.stop_signal is None:
            wake.wait(3600)
        print("stopped", wake.stop_signal)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_S) == 0
        assert proc.stdout.read() == f"stopped {int(signal.SIGTERM)}\n"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


#: a parent that starts the data plane without a death signal, says its pid, and waits
PARENT = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-m", "kvblend.dataplane"], stdout=subprocess.PIPE)
    line = child.stdout.readline()
    print(child.pid, line.decode().strip(), flush=True)
    child.wait()
""")


def test_a_data_plane_whose_parent_is_gone_stops_on_its_own(shm_prefix: str) -> None:
    """The parent SIGKILLed, and no PR_SET_PDEATHSIG to tell the data plane: it sees the parent
    change and stops, once its queued calls are done (its socket removed on the way)."""
    create_store(shm_prefix)
    config = DataPlaneSettings.build(shm_prefix=shm_prefix, backend="cpu", log_level="WARNING")
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, **config.to_env()})
    child = None
    try:
        assert parent.stdout is not None
        words = parent.stdout.readline().split()
        assert words[1:3] == ["dataplane", "ready"], words
        child = int(words[0])
        parent.kill()
        parent.wait()
        poll(lambda: not _alive(child), DEADLINE_S, "the data plane to stop without its parent")
        assert not os.path.exists(default_address(shm_prefix))  # it stopped, not died
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Alive and not a zombie (init reaps it once it exits)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
