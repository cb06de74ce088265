"""A stop during an interruptible phase (common/lifecycle/role_process.py) is not lost when its first raise is
swallowed."""

import sys
import contextlib
import os
import signal
import time

import pytest

from dflash_ring.common.config.schema import Config
from dflash_ring.common.layout import Role
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.common.lifecycle.role_process import RoleProcess, StopSignal
from dflash_ring.common.lifecycle.startup import Startup


@pytest.fixture
def proc():
    cfg = Config()
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGALRM)}
    with contextlib.ExitStack() as stack:
        p = RoleProcess(
            Role.PRODUCER,
            "",
            Startup("target 0"),
            stack,
            spec=ring_spec(cfg),
            metrics=cfg.metrics,
            run=cfg.run,
            journal_dir="",
        )
        signal.signal(signal.SIGTERM, p._on_signal)  # what `attach` installs once the ring is there
        yield p
    signal.setitimer(signal.ITIMER_REAL, 0)
    for s, handler in before.items():
        signal.signal(s, handler)


def test_a_stop_swallowed_where_it_landed_is_raised_again_until_the_phase_ends(proc):
    """The handler's StopSignal lands wherever the main thread is; in a weakref callback or a __del__ Python prints
    "Exception ignored" and goes on (seen once: a producer tokenized on after SIGTERM). Here the first raise is
    swallowed by the phase's own code, which never looks at `stop`: the raise comes again, naming the signal."""
    swallowed = 0
    with pytest.raises(StopSignal, match="SIGTERM"):
        with proc.interruptible():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises in here
            except StopSignal:
                swallowed += 1  # as a weakref callback would
            for _ in range(500):  # a phase that never checks `stop`: 5 s, ten times the repeat
                time.sleep(0.01)
            pytest.fail("the stop was lost: the phase ran to its end")
    assert swallowed == 1 and proc.stop.is_set()
    # Disarmed as the phase ended, not at the next alarm: by then Python may be finalizing, where SIGALRM's default
    # action would end a clean stop with exit -14 (seen under pytest-xdist in test_stop_phases.py).
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    time.sleep(0.7)  # nothing more is raised here


def test_a_signal_outside_an_interruptible_phase_only_sets_stop(proc):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    assert proc.stop.is_set() and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_stop_signal_python_swallows_in_a_del_is_no_traceback_but_other_errors_still_are(capsys, monkeypatch):
    """A SIGTERM during tokenizing raised StopSignal inside a weakref callback: Python printed "Exception ignored ...
    Traceback" on stderr (the alarm raised it again and the stop went through), which read as a crash
    (test_stop_phases failed on it in a clean-clone run). The hook RoleProcess installs drops exactly that."""
    from dflash_ring.common.lifecycle import role_process

    class Raises:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    monkeypatch.setattr(sys, "unraisablehook", role_process._quiet_stop)
    obj = Raises(role_process.StopSignal("SIGTERM"))
    del obj
    assert "Traceback" not in capsys.readouterr().err
    obj = Raises(ValueError("a real one"))
    del obj
    err = capsys.readouterr().err
    assert "Exception ignored" in err and "ValueError: a real one" in err
