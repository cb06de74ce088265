"""No run harms another, and no one else gets in: run names, ownership of IPC objects and lock directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ring.common.config.schema import default_runtime_root


def cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_ring", *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env
    )


def one_line_error(out: subprocess.CompletedProcess) -> str:
    """The CLI's contract for bad input: exit 2, exactly one line on stderr, no traceback."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    return lines[0]


@pytest.fixture
def runtime_root(tmp_path):
    """The lock-directory root a config without run_dir uses (as root /run/dflash-ring; created if missing)."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path / "xdg"))
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = env["XDG_RUNTIME_DIR"]
    root = default_runtime_root()
    made = not root.exists()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        yield root, env
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
        if made:
            try:
                root.rmdir()
            except OSError:
                pass


@pytest.mark.processes
@pytest.mark.parametrize(
    "how,name",
    [
        ("clean", "TRAVERSAL"),
        ("clean", ".."),
        ("status", "."),
        ("stop", "a/b"),
        ("status", ""),
        ("config", ".."),
        ("set", ".hidden"),
        ("config", "TRAVERSAL"),
    ],
)
def test_every_way_a_run_name_comes_in_is_validated(tmp_path, runtime_root, how, name):
    root, env = runtime_root
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.lock").write_text("not yours\n")
    if name == "TRAVERSAL":  # `clean ../../<dir>` once removed <dir>/*.lock
        name = os.path.relpath(victim, root)
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nname = "{name}"\n')
    args = {
        "clean": ["clean", name],
        "status": ["status", name],
        "stop": ["stop", name, "--timeout", "1"],
        "config": ["clean", "--config", str(config)],
        "set": ["status", "--set", f'run.name="{name}"'],
    }[how]
    out = cli(*args, cwd=tmp_path, env=env)
    line = one_line_error(out)
    assert "is not allowed" in line and "starting with a letter or digit" in line, line
    assert (victim / "precious.lock").exists()


def _shm(run_name: str) -> Path:
    return Path("/dev/shm") / f"dflash-ring.{run_name}"


def test_a_segment_or_semaphore_others_could_touch_is_refused(run):
    """Another user who creates the run's segment first (0666, or owned by them) never gets our workers."""
    from dflash_ring.common.config.load import load_config
    from dflash_ring.common.ownership import ForeignObjectError
    from dflash_ring.common.ring import Ring
    from dflash_ring.common.ring_spec import ring_spec

    run.write_config(1, 1)
    cfg = load_config(run.config)
    Ring.create(ring_spec(cfg)).close()
    segment, sem = _shm(run.name), Path(f"/dev/shm/sem.dflash-ring.{run.name}.ready")
    os.chmod(segment, 0o666)  # what `shm_open(..., 0666)` by someone else looks like
    with pytest.raises(ForeignObjectError, match=r"segment /dflash-ring\.\S+ has mode 0666, wider than 0600"):
        Ring.attach(ring_spec(cfg), timeout_s=0)
    line = one_line_error(run.cli("status", "--config", str(run.config), check=False))
    assert "mode 0666" in line and "not used" in line
    sup = run.supervisor()  # adopting it is refused the same way
    assert sup.wait(60) == 2 and "mode 0666" in sup.stderr.read()
    os.chmod(segment, 0o600)
    if os.geteuid() == 0:
        os.chown(segment, 65534, 65534)
        with pytest.raises(ForeignObjectError, match="belongs to uid 65534, not to this user"):
            Ring.attach(ring_spec(cfg), timeout_s=0)
        line = one_line_error(run.cli("clean", "--config", str(run.config), check=False))
        assert "belongs to uid 65534" in line and segment.exists()
        os.chown(segment, 0, 0)
    os.chmod(sem, 0o666)
    with pytest.raises(ForeignObjectError, match=r"semaphore /dflash-ring\.\S+\.ready has mode 0666"):
        Ring.attach(ring_spec(cfg), timeout_s=0)
    os.chmod(sem, 0o600)
    Ring.attach(ring_spec(cfg), timeout_s=0).close()  # ours and private again: accepted


def test_lock_directory_parents_are_made_private_and_foreign_ones_refused(run):
    """Missing parents are created 0700; a parent someone else owns or may write to is refused (/tmp fallback)."""
    from dflash_ring.common.lifecycle.liveness import ensure_lock_dir
    from dflash_ring.common.ownership import ForeignObjectError

    deep = run.tmp / "a" / "b" / "locks"
    ensure_lock_dir(deep)
    for d in (run.tmp / "a", run.tmp / "a" / "b", deep):
        assert d.stat().st_mode & 0o777 == 0o700, oct(d.stat().st_mode)
    shared = run.tmp / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # writable by all, not sticky: anyone could swap the lock directory
    with pytest.raises(ForeignObjectError, match="others may write to it and it is not sticky"):
        ensure_lock_dir(shared / "locks")
    os.chmod(shared, 0o1777)  # like /tmp: fine
    ensure_lock_dir(shared / "locks")
    if os.geteuid() == 0:
        squatted = run.tmp / "squatted"  # e.g. /tmp/dflash-ring-<uid> made first by another user
        squatted.mkdir(mode=0o700)
        os.chown(squatted, 65534, 65534)
        with pytest.raises(ForeignObjectError, match="belongs to uid 65534"):
            ensure_lock_dir(squatted / "run")
        run.lock_dir = squatted / "run"
        run.write_config(1, 1)
        sup = run.supervisor()  # a real supervisor refuses it in one line, before creating anything
        assert sup.wait(60) == 2
        err = sup.stderr.read().strip().splitlines()
        assert len(err) == 1 and "belongs to uid 65534" in err[0], err
        assert not _shm(run.name).exists()


def test_a_ring_in_use_is_never_stale_to_another_config(run):
    """Same run name, another run_dir: the second supervisor must not call the live ring stale nor remove it."""
    import json
    import signal

    from support import wait_exit, wait_for

    run.write_config(1, 1)
    sup = run.supervisor()
    consumer = run.worker("consumer", 0)
    wait_for(lambda: (run.lock_dir / "consumer-0.lock").exists(), what="the consumer to join")
    status = lambda cfg: json.loads(run.cli("status", "--config", str(cfg), "--json").stdout)
    created = status(run.config)["created_ns"]
    other = run.tmp / "other.toml"  # what `dflash-ring run` elsewhere, or a second operator, would use
    other.write_text(run.config.read_text().replace(str(run.lock_dir), str(run.tmp / "other-locks")))

    intruder = run.spawn(
        "-m", "dflash_ring", "supervisor", "--config", str(other), "--reclaim-stale", "--set", "metrics.enabled=false"
    )
    assert wait_exit(intruder) == 2
    err = intruder.stderr.read()
    assert "run.lock_dir: ring has" in err and "in use by" in err and "consumer-0.lock" in err, err
    line = one_line_error(run.cli("clean", "--config", str(other), check=False))
    assert "is live" in line and "consumer-0.lock" in line
    seen = status(other)  # status through the other config still finds the run's processes alive
    assert seen["created_ns"] == created and all(r["alive"] for r in seen["rows"] if r["role"] == "consumer")

    # A process that only maps the ring (attached, not joined: e.g. loading its model) keeps it in use too.
    holder = run.spawn(
        "-c",
        "import sys, time; from dflash_ring.common.ring import Ring; "
        f"r = Ring.open({run.name!r}); print('up', flush=True); time.sleep(600)",
        stdout=subprocess.PIPE,
    )
    assert holder.stdout.readline().strip() == "up"
    for p in (sup, consumer):
        p.send_signal(signal.SIGKILL)
        wait_exit(p)
    line = one_line_error(run.cli("clean", "--config", str(other), check=False))
    assert f"pid {holder.pid}" in line, line
    again = run.spawn(
        "-m", "dflash_ring", "supervisor", "--config", str(other), "--reclaim-stale", "--set", "metrics.enabled=false"
    )
    assert wait_exit(again) == 2 and f"pid {holder.pid}" in again.stderr.read()
    assert status(run.config)["created_ns"] == created
    holder.kill()
    wait_exit(holder)
    out = run.cli("clean", "--config", str(run.config))  # now it is dead: removed
    assert f"dflash-ring.{run.name}" in out.stdout and run.leftovers() == []
