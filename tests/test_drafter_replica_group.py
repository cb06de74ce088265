"""Drafter replicas on several hosts (consumer/training/replica_group.py), as real processes on this machine.

Two "host leaders" meet at a TCPStore and average through gloo; one is SIGKILLed and
restarted; mismatched configs are refused; and two runs with their own rings,
supervisors, producers and drafters (two hosts) train one model.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest
from safetensors.torch import load_file

from support import PIPELINE_RUN, Run, build_target, curves, cyclic_rows, pipeline_config, wait_exit, wait_for

from dflash_ring.common.ring import Ring
from dflash_ring.common.lifecycle.rendezvous import serve_rendezvous

WORKER = Path(__file__).with_name("replica_group_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_secret(path: Path, content: bytes = b"0123456789abcdef0123456789abcdef") -> Path:
    """group.secret_file: mode 0600 from the start (why: the group's only credential)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    return path


@pytest.fixture
def store(tmp_path):
    """A rendezvous at 127.0.0.1 and the group secret at <tmp>/group.secret (what leader() passes)."""
    write_secret(tmp_path / "group.secret")
    address = f"tcp://127.0.0.1:{free_port()}"
    server = serve_rendezvous(address)
    yield address
    server.close()


def leader(run, store: str, host: str, *extra: str, secret: Path | None = None):
    return run.spawn(
        str(WORKER),
        host,
        "--rendezvous",
        store,
        "--out",
        str(run.tmp / "out"),
        "--secret",
        str(secret or run.tmp / "group.secret"),
        *extra,
    )


def step_of(run, host: str) -> int:
    path = run.tmp / "out" / f"{host}.step"
    return int(path.read_text().split()[0]) if path.exists() else 0


def common_rounds(run, a: str, b: str) -> list[str]:
    names = lambda h: {p.name for p in (run.tmp / "out" / h).glob("*.safetensors")}  # noqa: E731
    return sorted(names(a) & names(b))


def max_abs_diff(run, a: str, b: str, name: str) -> float:
    wa, wb = (load_file(run.tmp / "out" / h / name) for h in (a, b))
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def test_two_hosts_stay_in_sync(run, store):
    a, b = leader(run, store, "hostA", "--steps", "40"), leader(run, store, "hostB", "--steps", "40")
    for p in (a, b):
        assert wait_exit(p, 90) == 0, p.stderr.read()[-3000:]
    rounds = common_rounds(run, "hostA", "hostB")
    assert len(rounds) >= 10, rounds  # the formation average and one every 2 steps
    for name in rounds:
        assert max_abs_diff(run, "hostA", "hostB", name) < 1e-6, name
    log = a.stderr.read()
    assert "rank 0 of 2" in log or "rank 1 of 2" in log, log[-2000:]


def test_killed_host_rejoins_and_catches_up_while_the_other_trains(run, store):
    a = leader(run, store, "hostA", "--step-sleep", "0.05")
    b = leader(run, store, "hostB", "--step-sleep", "0.05")
    wait_for(lambda: len(common_rounds(run, "hostA", "hostB")) >= 3, timeout=60, what="two hosts averaging")
    b.send_signal(signal.SIGKILL)
    wait_exit(b)
    at_kill = step_of(run, "hostA")
    # The survivor notices (its collective fails at once), re-forms alone and keeps training.
    wait_for(lambda: step_of(run, "hostA") >= at_kill + 10, timeout=60, what="hostA training on alone")
    assert a.poll() is None
    before = set(common_rounds(run, "hostA", "hostB"))  # rounds from before the kill
    b_again = leader(run, store, "hostB", "--step-sleep", "0.05", "--steps", "20")
    assert wait_exit(b_again, 90) == 0, b_again.stderr.read()[-3000:]
    (run.tmp / "out" / "stop").touch()
    assert wait_exit(a, 60) == 0, a.stderr.read()[-3000:]
    log_b = b_again.stderr.read()
    assert "caught up with the live hosts' weights" in log_b, log_b[-3000:]
    new = [r for r in common_rounds(run, "hostA", "hostB") if r not in before]
    assert new, "no common round after the restart"
    for name in new:  # the first is the heal: hostB took hostA's weights; then they average
        assert max_abs_diff(run, "hostA", "hostB", name) < 1e-6, name
    assert step_of(run, "hostB") == 20 and step_of(run, "hostA") > at_kill + 10


def test_a_host_with_another_drafter_config_is_refused_by_field(run, store):
    a = leader(run, store, "hostA", "--steps", "200")
    wait_for(lambda: step_of(run, "hostA") > 0, timeout=60, what="hostA training")
    b = leader(run, store, "hostB", "--block-size", "8")
    assert wait_exit(b, 60) == 2
    err = b.stderr.read()
    assert "drafter.block_size = 8 here, 4 on hostA" in err, err[-2000:]
    (run.tmp / "out" / "stop").touch()
    assert wait_exit(a, 60) == 0


def host_config(run, target, data, port: int, serve: bool, secret: Path) -> None:
    """One host's run: the pipeline's, with one drafter, two epochs and a group of two hosts; metrics off."""
    pipeline_config(
        run,
        target,
        data,
        PIPELINE_RUN,
        {
            "data": {"epochs": 2},
            "group": {
                "rendezvous": f"tcp://127.0.0.1:{port}",
                "secret_file": str(secret),
                "serve": serve,
                "hosts": 2,
                "settle_s": 5.0,
                "timeout_s": 30.0,
                "host_name": run.name,
            },
            "metrics": {"enabled": False},
        },
        consumers=1,
    )


def test_two_hosts_with_their_own_rings_train_one_model(run):
    """Two runs (supervisor, producer, drafter each) on their own rings, as on two machines."""
    other = Run(run.tmp / "hostB", run.name + "b")
    other.tmp.mkdir()
    try:
        target = build_target(run.tmp / "target", "qwen3", layers=4)
        port = free_port()
        secret = write_secret(run.tmp / "group.secret")  # the same bytes on both "hosts"
        hosts = [(run, True, 0), (other, False, 1)]
        for r, serve, seed in hosts:
            host_config(r, target, cyclic_rows(r.tmp / "chat.jsonl", 96, seed=seed), port, serve, secret)
        drafters = []
        for r, _, _ in hosts:
            r.supervisor()
            r.role("target", 0)
            drafters.append(r.role("drafter", 0))
        for p in [*drafters, *(p for r, _, _ in hosts for p in r.procs if p not in drafters)]:
            assert wait_exit(p, 240) == 0, p.stderr.read()[-3000:]
        logs = [d.stderr.read() for d in drafters]
        for log in logs:
            assert "replica group generation" in log and "rank 1 of 2" in "\n".join(logs), log[-3000:]
            loss, acc = curves(log)
            assert len(loss) >= 20
            assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.05, (loss, acc)
        exported = []
        for r, _, _ in hosts:
            out = r.cli("export", str(r.tmp / "ckpt" / "drafter-0"), str(r.tmp / "exported"))
            assert "exported" in out.stdout
            exported.append(load_file(r.tmp / "exported" / "model.safetensors"))
        w0, w1 = exported
        diff = sum(float((w0[k] - w1[k]).norm() ** 2) for k in w0) ** 0.5
        norm = sum(float(w0[k].norm() ** 2) for k in w0) ** 0.5
        assert diff / norm < 0.05, diff / norm
        assert run.leftovers() == [] and other.leftovers() == []
    finally:
        for proc in other.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        Ring.unlink(other.name)
