"""The cross-host rendezvous against someone who can reach its port (issue 14 item 10), with real processes.

The store listens on its configured address only; members sign every value with the
group secret, so a client without it can neither take a rank, nor squat the config
fingerprint, nor hand gloo an address; and one member's NaN never reaches the others.
"""

from __future__ import annotations

import json
import math
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
from safetensors.torch import load_file
from torch.distributed import TCPStore

from support import wait_exit, wait_for
from test_drafter_replica_group import common_rounds, free_port, leader, max_abs_diff, store, write_secret  # noqa: F401

from dflash_ring.common.config.schema import Config, ConfigError
from dflash_ring.common.lifecycle.rendezvous import parse_rendezvous, serve_rendezvous


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def other_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (a store bound to 127.0.0.1 must not answer there)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return sorted({i[4][0] for i in infos if not i[4][0].startswith("127.")})


def test_the_rendezvous_listens_on_its_configured_address_only():
    port = free_port()
    server = serve_rendezvous(f"tcp://127.0.0.1:{port}")
    try:
        assert not refused("127.0.0.1", port)
        assert refused("127.0.0.2", port), "a store bound to 127.0.0.1 answered on 127.0.0.2"
        for addr in other_addresses():
            assert refused(addr, port), f"a store bound to 127.0.0.1 answered on {addr}"
    finally:
        server.close()
    port = free_port()
    server = serve_rendezvous(f"tcp://127.0.0.2:{port}")
    try:
        assert not refused("127.0.0.2", port) and refused("127.0.0.1", port)
    finally:
        server.close()


def test_the_group_secret_is_required_and_must_be_private(tmp_path):
    def check(**group) -> str:
        cfg = Config()
        cfg.group.rendezvous = "tcp://127.0.0.1:29999"
        for k, v in group.items():
            setattr(cfg.group, k, v)
        with pytest.raises(ConfigError) as e:
            cfg.validate()
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "group.secret_file is not set" in check()
    assert "cannot open" in check(secret_file=str(tmp_path / "absent"))
    wide = write_secret(tmp_path / "wide")
    os.chmod(wide, 0o640)
    assert "chmod 600" in check(secret_file=str(wide))
    short = write_secret(tmp_path / "short", b"tiny")
    assert "at least 16" in check(secret_file=str(short))
    good = write_secret(tmp_path / "good")
    (tmp_path / "link").symlink_to(good)
    assert "cannot open" in check(secret_file=str(tmp_path / "link"))  # a link could be swapped under us
    os.mkfifo(tmp_path / "fifo", 0o600)  # its open waited for a writer forever (check-config hung)
    assert "is not a regular file" in check(secret_file=str(tmp_path / "fifo"))
    assert "is not a regular file" in check(secret_file=str(tmp_path))
    cfg = Config()
    cfg.group.rendezvous, cfg.group.secret_file = "tcp://127.0.0.1:29999", str(good)
    cfg.validate()


def squat(address: str) -> None:
    """What a client without the secret can write: every key the group uses, before any host arrives."""
    host, port = parse_rendezvous(address)
    s = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    s.set("fingerprint", json.dumps({"drafter.block_size": 99}))  # would refuse every real host if trusted
    s.set("fingerprint_host", "evil")
    s.add("g0/count", 1)  # takes rank 0 of generation 0 without a signed host record
    s.set("g0/host0", "evil")
    for g in range(4):
        s.set(f"g{g}/size", "3")
        for r in range(3):
            s.set(f"g{g}/host{r}", "evil")
            s.set(f"g{g}/hb{r}", "99")
            s.set(f"g{g}/pg/0/{r}", b"\x00" * 64)  # gloo's peer-address keys


def member_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "replica group generation" in ln]


def test_a_squatter_without_the_secret_neither_blocks_nor_joins_the_group(run, store):
    squat(store)
    a, b = leader(run, store, "hostA", "--steps", "40"), leader(run, store, "hostB", "--steps", "40")
    logs = {}
    for name, p in (("hostA", a), ("hostB", b)):
        assert wait_exit(p, 120) == 0, p.stderr.read()[-3000:]
        logs[name] = p.stderr.read()
    for log in logs.values():
        assert "differs from the group's" not in log
        lines = member_lines(log)
        assert lines and all("of 2 (hostA, hostB)" in ln or "of 2 (hostB, hostA)" in ln for ln in lines), lines
        assert "evil" not in "\n".join(lines)
    rounds = common_rounds(run, "hostA", "hostB")
    assert len(rounds) >= 10, rounds
    for name in rounds:
        assert max_abs_diff(run, "hostA", "hostB", name) < 1e-6, name


def test_a_client_with_another_secret_cannot_join_or_change_the_group(run, store):
    a = leader(run, store, "hostA", "--step-sleep", "0.05")
    b = leader(run, store, "hostB", "--step-sleep", "0.05")
    wait_for(lambda: len(common_rounds(run, "hostA", "hostB")) >= 3, timeout=60, what="two hosts averaging")
    other = write_secret(run.tmp / "other.secret", b"another secret, not the group's!")
    c = leader(run, store, "hostC", "--step-sleep", "0.05", "--steps", "100", secret=other)
    assert wait_exit(c, 120) == 0, c.stderr.read()[-3000:]
    log_c = c.stderr.read()
    assert member_lines(log_c) == [] and not list((run.tmp / "out" / "hostC").glob("*")), log_c[-3000:]
    assert "group.secret_file differs between hosts" in log_c
    after_c = len(common_rounds(run, "hostA", "hostB"))
    wait_for(
        lambda: len(common_rounds(run, "hostA", "hostB")) >= after_c + 3,
        timeout=90,
        what="hostA and hostB averaging again",
    )
    (run.tmp / "out" / "stop").touch()
    for p in (a, b):
        assert wait_exit(p, 60) == 0, p.stderr.read()[-3000:]
        assert "hostC" not in "\n".join(member_lines(p.stderr.read()))
    for name in common_rounds(run, "hostA", "hostB"):
        assert max_abs_diff(run, "hostA", "hostB", name) < 1e-6, name


def finite(run, host: str, name: str) -> bool:
    return all(bool(t.isfinite().all()) for t in load_file(run.tmp / "out" / host / name).values())


def test_nan_from_one_member_never_reaches_the_others(run, store):
    a = leader(run, store, "hostA", "--steps", "30")
    b = leader(run, store, "hostB", "--steps", "30", "--nan-at", "10")
    logs = {}
    for name, p in (("hostA", a), ("hostB", b)):
        assert wait_exit(p, 90) == 0, p.stderr.read()[-3000:]
        logs[name] = p.stderr.read()
    assert "injected NaN at step 10" in logs["hostB"]
    assert "hostB (rank" in logs["hostA"] and "non-finite parameters: left out of this average" in logs["hostA"]
    assert "this host: taking the others' mean" in logs["hostB"], logs["hostB"][-3000:]
    rounds = common_rounds(run, "hostA", "hostB")
    assert len(rounds) >= 10, rounds
    for name in rounds:  # the NaN round included: hostB took hostA's weights, and both stay finite
        assert finite(run, "hostA", name) and finite(run, "hostB", name), name
        assert max_abs_diff(run, "hostA", "hostB", name) < 1e-6, name
    for host in ("hostA", "hostB"):
        assert math.isfinite(float((run.tmp / "out" / f"{host}.step").read_text().split()[1]))
