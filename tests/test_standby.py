"""Warm spares (``--standby``) against real ``kvblend serve`` processes: a SIGKILLed data plane or
API is replaced by its spare (the same pid that waited), a new serve after a SIGKILLed one adopts
the spares the killed one left and stops them cleanly, a spare of another configuration is told
no and exits, nobody of another uid can reach a spare's socket, and a name planted on a spare's
free path promotes nothing."""

from __future__ import annotations

import os
import signal
import stat

import pytest

from kvblend.shm.lock import pid_alive
from kvblend.shm.names import Names
from tests.faults import processes_of
from tests.harness import START_DEADLINE, Service, Services, listener_pid, poll, spare_pid

pytestmark = pytest.mark.slow

STANDBY = {"KVBLEND_STANDBY": "true"}


def spares(svc: Service) -> dict[str, int]:
    """Until both spares wait: their pids by child."""
    def both() -> dict[str, int] | None:
        pids = {c: spare_pid(svc.prefix, c) for c in ("dataplane", "api")}
        return pids if all(pids.values()) else None  # type: ignore[return-value]
    return poll(both, START_DEADLINE, "both warm spares waiting")


def test_a_killed_child_is_replaced_by_its_warm_spare(services: Services) -> None:
    svc = services.start(env=STANDBY)
    spare = spares(svc)
    old_dp = svc.dataplane_pid()
    assert old_dp is not None and old_dp != spare["dataplane"]
    os.kill(old_dp, signal.SIGKILL)
    assert svc.dataplane_after(old_dp)["pid"] == spare["dataplane"]
    old_api = listener_pid(svc.port)
    assert old_api is not None and old_api != spare["api"]
    os.kill(old_api, signal.SIGKILL)
    poll(lambda: svc.ready() and listener_pid(svc.port) == spare["api"], START_DEADLINE,
         "the API's spare serving")
    again = spares(svc)  # each promoted spare was followed by a new one
    assert set(again.values()).isdisjoint(spare.values())
    assert svc.stop() == 0
    poll(lambda: not processes_of(svc.prefix), START_DEADLINE, "every process, spares too, gone")
    assert not any(os.path.lexists(Names(svc.prefix).standby(c)) for c in ("dataplane", "api"))


def test_a_new_serve_adopts_the_spares_a_killed_one_left(services: Services) -> None:
    first = services.start(env=STANDBY)
    spare = spares(first)
    first.kill()  # SIGKILL: its children get SIGTERM, its spares stay
    second = services.start(port=first.port, env=STANDBY)
    assert second.dataplane_pid() == spare["dataplane"]
    poll(lambda: listener_pid(second.port) == spare["api"], START_DEADLINE,
         "the adopted API listening (the killed serve's API drains first)")
    assert second.ready()
    spares(second)
    assert second.stop() == 0  # adopted children are stopped like its own
    poll(lambda: not processes_of(second.prefix), START_DEADLINE, "every process gone")


def test_a_spare_of_another_configuration_is_told_no(services: Services) -> None:
    first = services.start(env=STANDBY)
    spare = spares(first)
    first.kill()
    second = services.start("--log-level", "error", port=first.port, env=STANDBY)
    poll(lambda: not any(pid_alive(p) for p in spare.values()), START_DEADLINE,
         "the other configuration's spares gone")
    assert second.dataplane_pid() not in spare.values()
    assert listener_pid(second.port) not in spare.values()


def test_a_spares_socket_is_this_uids_alone(services: Services) -> None:
    svc = services.start(env=STANDBY)
    spares(svc)
    for child in ("dataplane", "api"):
        st = os.lstat(Names(svc.prefix).standby(child))
        assert stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid()
        assert stat.S_IMODE(st.st_mode) == 0o600


def test_a_name_planted_on_a_free_spare_path_promotes_nothing(services: Services) -> None:
    svc = services.start(env=STANDBY)
    spare = spares(svc)
    names = Names(svc.prefix)
    old_api = listener_pid(svc.port)
    assert old_api is not None
    os.kill(old_api, signal.SIGKILL)
    poll(lambda: listener_pid(svc.port) == spare["api"], START_DEADLINE, "the API's spare serving")
    # its path is free until the next spare warms up: another user plants a symlink there, to
    # the data plane's spare; the supervisor followed it at the API's next exit and told that
    # spare no (another configuration), so it exited
    os.symlink(names.standby("dataplane"), names.standby("api"))
    try:
        os.kill(spare["api"], signal.SIGKILL)
        poll(lambda: listener_pid(svc.port) not in (None, spare["api"]), START_DEADLINE,
             "a new API serving")
        assert pid_alive(spare["dataplane"]) and spare_pid(svc.prefix, "dataplane") == \
            spare["dataplane"]
    finally:
        os.unlink(names.standby("api"))
