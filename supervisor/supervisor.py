"""The supervisor: creates (or adopts) the ring, owns the done-counter and the shutdown broadcast.

Stop protocol, the place where bugs hide: a drafter never stops on its own
view of an empty ring, because a slow producer may still be coming. Only the
supervisor decides, and only when every producer has reported its shard done
(or, on a drain, has stopped) AND no slot is WRITING, READY or READING. Then
it sets the shutdown flag and wakes every waiter.
"""

from __future__ import annotations

import logging
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from dflash_ring.common.lifecycle import sd_notify
from dflash_ring.common.config.schema import Config
from dflash_ring.common.layout import STOP_DRAIN, STOP_NOW, Counter, RingHeaderError, Role, RowStatus
from dflash_ring.common.lifecycle.ledger import Ledger
from dflash_ring.common.lifecycle.ledger_events import SupervisorStart
from dflash_ring.common.lifecycle.liveness import LockFile, ensure_lock_dir, live_lock_files, lock_path
from dflash_ring.common.metrics import SUPERVISOR, RingCollector, serve
from dflash_ring.common.ring import ConfigMismatchError, HalfCreatedRingError, Ring
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.common.lifecycle.rendezvous import serve_rendezvous
from dflash_ring.common.lifecycle.startup import Startup
from dflash_ring.common.lifecycle.trained_journal import remove_all
from dflash_ring.common.ring_users import ring_users
from dflash_ring.supervisor.cleanup import remove_run, users_of
from dflash_ring.supervisor.reaper import reap
from dflash_ring.supervisor.fence import fence
from dflash_ring.supervisor.silence import SilenceWatch
from dflash_ring.supervisor.owed import owed
from dflash_ring.supervisor.unfinished import save_unfinished, seal_journals

log = logging.getLogger(__name__)

# The run ended and was torn down after a silent straggler was fenced (SIGKILLed, what it held handed to the replay
# lists): a clean end, not a failure, yet one an operator should hear of (the log's error lines say which process).
# Its own code, so scripts can tell it from 0 and from 1; the supervisor unit lists it in SuccessExitStatus=, so
# systemd's Restart=on-failure does not restart a run that ended. A straggler that survives SIGKILL is still 1.
EXIT_FENCED = 3


class SupervisorError(RuntimeError):
    pass


class StaleRunError(SupervisorError):
    pass


class Supervisor:
    def __init__(self, cfg: Config, startup: Startup, reclaim_stale: bool = False):
        self.cfg = cfg
        self.reclaim_stale = reclaim_stale
        self.startup = startup
        self.lock_dir = cfg.run.lock_dir()
        self.ring: Ring | None = None
        self._lock: LockFile | None = None
        self._signals = 0
        self._rendezvous = None  # group.serve: the cross-host drafter group's store, for as long as this runs
        self._metrics: RingCollector | None = None
        self._stopping_sent = False
        self._owed_logged = 0.0
        self._silence = SilenceWatch(cfg.supervisor.silent_after_s)
        self._short_done: set[int] = set()  # producer rows named DONE short of their end (producers_done)

    # ---- start ---------------------------------------------------------------

    def start(self) -> Ring:
        """Create the ring, or adopt a live one; refuse a stale one unless told to reclaim it."""
        ensure_lock_dir(self.lock_dir)
        me = lock_path(self.lock_dir, Role.SUPERVISOR, 0)
        self._lock = LockFile.try_acquire(me)
        if self._lock is None:
            pid = me.read_text().strip() if me.exists() else "?"
            raise SupervisorError(f"a supervisor for run {self.cfg.run.name!r} is already running (pid {pid})")
        self._lock.write_pid()
        if self._metrics is None:  # before the ring exists: a taken port must not leave a ring behind
            self._metrics = RingCollector(self.lock_dir)
            registry = serve(self.cfg.metrics, self.cfg.run.name, SUPERVISOR)
            registry.register(self._metrics)
            self.startup.export(registry)
        if self.cfg.group.serve and self._rendezvous is None:  # before the ring too: bound to its address only
            self._rendezvous = serve_rendezvous(self.cfg.group.rendezvous)
            log.info(
                "serving the drafter replica group's rendezvous at %s (that address only; members sign with "
                "group.secret_file)",
                self.cfg.group.rendezvous,
            )
        run = self.cfg.run.name
        if Ring.exists(run):
            self.ring = self._adopt_or_reclaim(run)
        else:
            Ring.unlink(run)  # semaphores left by a crash during create or teardown
            self.ring = Ring.create(ring_spec(self.cfg))
            log.info(
                "created ring %s: %d slots x %.1f MiB, %d producer(s), %d consumer(s)",
                self.ring.name,
                self.cfg.ring.slots,
                self.cfg.ring.slot_bytes / 2**20,
                self.cfg.topology.producers,
                self.cfg.topology.consumers,
            )
        t = self.cfg.topology
        if self.cfg.ring.slots < 2 * t.consumers + t.producers:
            log.warning(
                "ring.slots = %d: each drafter holds up to 2 slots until it has trained them (one training, "
                "one prefetched), so %d drafter(s) leave the %d producer(s) little room to run ahead; "
                "set ring.slots to at least %d",
                self.cfg.ring.slots,
                t.consumers,
                t.producers,
                2 * t.consumers + 2 * t.producers,
            )
        self.ring.take_row(0, Role.SUPERVISOR, 0)
        ledger = Ledger.open(self.cfg.run.ledger_dir, Role.SUPERVISOR, 0)
        if ledger is not None:  # which ring: created or adopted
            ledger.write(
                SupervisorStart(self.ring.identity.created_ns, self.ring.counter(Counter.SUPERVISOR_ADOPTIONS))
            )
        self.startup.finish("ring", ledger)  # lock, metrics port, ring created or adopted, row taken
        if ledger is not None:
            ledger.close()
        self._metrics.attach(self.ring)
        return self.ring

    def _adopt_or_reclaim(self, run: str) -> Ring:
        """Adopt the run's ring if anything uses it (whoever's config that is), else refuse or reclaim it."""
        half_created: HalfCreatedRingError | None = None
        try:
            ring = Ring.open(run)
        except RingHeaderError as e:
            live = users_of(run, self.lock_dir, ignore={self._lock.path})
            if live or not self.reclaim_stale:
                raise SupervisorError(f"{e}" + (f" (live: {', '.join(live)})" if live else "")) from None
            ring, half_created = None, e if isinstance(e, HalfCreatedRingError) else None
        if ring is not None:
            dirs = [d for d in (ring.lock_dir, self.lock_dir) if d is not None]
            live = ring_users(run, dirs, ignore={self._lock.path})
            try:
                ring.check(ring_spec(self.cfg))
            except ConfigMismatchError as e:
                ring.close()
                if live:  # e.g. another config's run_dir: never ours to adopt or remove
                    raise ConfigMismatchError(f"{e} The ring is in use by {', '.join(live)}") from None
                if not self.reclaim_stale:
                    raise
                ring = None
        if ring is not None and live:
            ring.increment(Counter.SUPERVISOR_ADOPTIONS)
            log.warning("adopted live ring %s (live: %s)", ring.name, ", ".join(live))
            return ring
        if not self.reclaim_stale:
            assert ring is not None
            st = ring.status()
            ring.close()
            created = datetime.fromtimestamp(st.created_ns / 1e9, timezone.utc).isoformat(timespec="seconds")
            raise StaleRunError(
                f"run {run!r} has a stale ring {ring.name} (created {created}, items produced "
                f"{st.counters['produced']}, consumed {st.counters['consumed']}, {st.depth} still ready) "
                f"whose processes are all dead. Remove it with `dflash-ring clean {run}`, "
                f"or start the supervisor with --reclaim-stale to discard it"
            )
        if ring is not None:
            save_unfinished(
                ring, self.cfg.target.state_dir, self.cfg.train.checkpoint_dir
            )  # what it held is produced again, not lost
            ring.close()
        elif half_created is not None:
            log.warning("%s; it never held an item, so nothing is lost with it", half_created)
        else:
            log.error("the stale ring's header is unreadable: the items it held cannot be produced again")
        removed = Ring.unlink(run)
        log.warning("reclaimed stale run %r: removed %s", run, ", ".join(removed))
        return Ring.create(ring_spec(self.cfg))

    # ---- main loop ---------------------------------------------------------------

    def run(self) -> int:
        """Supervise until shutdown and every process has left; return the exit code."""
        ring = self.ring if self.ring is not None else self.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        producers = self.cfg.topology.producers
        shutdown_at: float | None = None
        sd_notify.ready(f"ring {ring.name} up")
        try:
            while True:
                ring.heartbeat(0)
                sd_notify.watchdog()
                reap(ring, self.lock_dir, self.cfg.train.checkpoint_dir)
                self._silence.observe(ring.rows())
                self._apply_stop_requests(ring)
                done = self.producers_done(ring)
                ring.set_flag(Counter.PRODUCERS_DONE, done)
                if not ring.shutting_down and self._may_shut_down(ring, done, producers):
                    ring.set_flag(Counter.SHUTDOWN)
                    log.info(
                        "shutdown: %d/%d producers done, ring empty, %d items produced, %d consumed",
                        done,
                        producers,
                        ring.counter(Counter.PRODUCED),
                        ring.counter(Counter.CONSUMED),
                    )
                if ring.shutting_down or ring.draining:
                    self._notify_stopping()
                if ring.shutting_down:
                    ring.broadcast()
                    shutdown_at = shutdown_at or time.monotonic()
                    others = self._live_others()
                    if not others:
                        self._teardown(ring)
                        return 0
                    # A live process that still heartbeats is finishing its item or its checkpoint:
                    # wait for it. Give up only on one silent for exit_timeout_s, or on a third signal.
                    timeout = self.cfg.supervisor.exit_timeout_s
                    if (
                        time.monotonic() - shutdown_at > timeout
                        and not self._others_progressing(ring, timeout)
                        or self._signals > 2
                    ):
                        log.error(
                            "still alive %.0fs after shutdown and silent: %s; stopping them with SIGKILL before "
                            "what they hold is handed to the replay lists",
                            time.monotonic() - shutdown_at,
                            ", ".join(others),
                        )
                        if survivors := fence(self.lock_dir, others):
                            log.error(
                                "%s survived SIGKILL: leaving the ring in place (nothing handed over twice); "
                                "once they are gone, `dflash-ring clean %s` or a restart hands it over",
                                ", ".join(survivors),
                                self.cfg.run.name,
                            )
                            self.close()
                            return 1
                        self._teardown(ring)
                        return EXIT_FENCED
                time.sleep(self.cfg.supervisor.reap_interval_s)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def producers_done(self, ring: Ring) -> int:
        """Producer rows DONE whose cursor is at the end of the plan (ProcessTable.mark_done: every finished shard's
        is). A DONE row short of it was not written by a producer that finished (a stray write into the table): it is
        not counted, and is named once, so the run does not end while that shard still owes batches."""
        rows = ring.rows()
        done = 0
        for row in np.flatnonzero((rows["role"] == Role.PRODUCER) & (rows["status"] == RowStatus.DONE)):
            cursor = ring.committed_cursor(int(row))
            if cursor is not None and cursor[0] >= self.cfg.data.epochs:
                done += 1
            elif int(row) not in self._short_done:
                self._short_done.add(int(row))
                log.error(
                    "producer %d's row says DONE but its cursor is %s, short of its plan's end (epoch %d): not "
                    "counted as done; the run waits for that shard",
                    int(rows[row]["index"]),
                    "absent" if cursor is None else f"epoch {cursor[0]} position {cursor[1]}",
                    self.cfg.data.epochs,
                )
        return done

    def _may_shut_down(self, ring: Ring, done: int, producers: int) -> bool:
        if ring.draining and not self._live_others():
            # Every process left during a drain (`systemctl stop` of the whole run): nobody will train what
            # the ring holds now, so end here; the teardown hands it back to the producers' replay lists.
            return True
        counts = ring.slot_counts()
        if counts["writing"] or counts["ready"] or counts["reading"]:
            return False
        if done == producers:
            return self._nothing_owed(ring)
        if not ring.draining:
            return False
        rows = ring.rows()
        return not ((rows["role"] == Role.PRODUCER) & (rows["status"] == RowStatus.RUNNING)).any()

    def _nothing_owed(self, ring: Ring) -> bool:
        """No batch a dead drafter lost is still to be produced again (supervisor/owed.py); logged when it waits."""
        still = owed(self.cfg.target.state_dir, self.cfg.run.name, self.cfg.train.checkpoint_dir, ring)
        if still and time.monotonic() - self._owed_logged > 10:
            self._owed_logged = time.monotonic()
            log.info(
                "every shard done, but dead drafters' lost batches are still being produced again: %s",
                ", ".join(f"producer {i}: {n}" for i, n in sorted(still.items())),
            )
        return not still

    @staticmethod
    def _others_progressing(ring: Ring, within_s: float) -> bool:
        """Whether a running producer or drafter heartbeated within the last within_s seconds."""
        rows = ring.rows()
        running = rows[1:][rows[1:]["status"] == RowStatus.RUNNING]
        return bool(((time.time_ns() - running["heartbeat_ns"].astype("i8")) < within_s * 1e9).any())

    def _apply_stop_requests(self, ring: Ring) -> None:
        request = max(
            ring.counter(Counter.STOP_REQUEST),
            STOP_DRAIN if self._signals == 1 else 0,
            STOP_NOW if self._signals > 1 else 0,
        )
        if request >= STOP_DRAIN and not ring.draining:
            log.info("drain requested: producers take no new work; shutdown follows once the ring is empty")
            ring.set_flag(Counter.DRAIN)
            ring.broadcast()
        if request >= STOP_NOW and not ring.shutting_down:
            ring.set_flag(Counter.SHUTDOWN)  # from now on no item is claimed: what is ready stays untrained
            log.warning(
                "immediate stop requested: drafters finish the items they hold and exit; items still "
                "ready go back to the producers' replay lists when the run ends"
            )

    def _notify_stopping(self) -> None:
        """Once, when the run starts to drain or shut down: systemd then shows it as deactivating."""
        if not self._stopping_sent:
            sd_notify.stopping()
            self._stopping_sent = True

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals += 1  # first: drain; second: stop now

    def _live_others(self) -> list[str]:
        return [p.name for p in live_lock_files(self.lock_dir) if self._lock is None or p != self._lock.path]

    def _teardown(self, ring: Ring) -> None:
        seal_journals(ring, self.cfg.train.checkpoint_dir)  # every process has left: a drafter dead since owes too
        held, damaged = ring.unfinished_items()
        still = owed(self.cfg.target.state_dir, self.cfg.run.name, self.cfg.train.checkpoint_dir, ring)
        complete = self.producers_done(ring) == self.cfg.topology.producers and not held and not damaged and not still
        if still and not held and self.producers_done(ring) == self.cfg.topology.producers:
            log.error(
                "a drafter died after the run's last batch was trained: %d batch(es) it trained after its "
                "checkpoint are in the producers' replay lists; start the run again to train them",
                sum(still.values()),
            )
        if not complete:  # stopped before the end: the resume points, with what the ring still holds
            save_unfinished(ring, self.cfg.target.state_dir, self.cfg.train.checkpoint_dir)
        if self._metrics is not None:
            self._metrics.detach()
        ring.close()
        self.ring = None
        removed = remove_run(self.cfg.run.name, self.lock_dir, keep=self._lock.path if self._lock else None)
        if self._lock is not None:
            self._lock.release(unlink=True)
            self._lock = None
        try:
            self.lock_dir.rmdir()
        except OSError:
            pass
        if complete:  # every shard done: the producers' resume points are void (a drained run keeps them)
            state = Path(self.cfg.target.state_dir).expanduser() / self.cfg.run.name
            for cursor in sorted(state.glob("producer-*.json")):
                cursor.unlink(missing_ok=True)
                removed.append(str(cursor))
            removed += remove_all(self.cfg.train.checkpoint_dir)  # every batch is in a saved state: journals void
        log.info("run %r finished; removed %s", self.cfg.run.name, ", ".join(removed) or "nothing")

    def close(self) -> None:
        """Leave without tearing down (e.g. after an error): a restarted supervisor adopts the ring."""
        if self._metrics is not None:
            self._metrics.detach()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
