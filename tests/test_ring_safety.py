"""Bad input gets a clear error and loses nothing: stale runs, mismatched configs, damaged bytes."""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct

import hypothesis.strategies as st
import msgpack
import posix_ipc
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from support import wait_exit, wait_for
from dflash_ring.common.config.load import load_config
from dflash_ring.common.config.schema import ConfigError
from dflash_ring.common.layout import HEADER_BYTES, RingHeaderError, read_identity
from dflash_ring.common.ring import ConfigMismatchError, Ring, segment_name
from dflash_ring.common.ring_spec import ring_spec
from dflash_ring.common.slot_format import SlotFormatError, SlotHeader, SlotLayout, decode_header, encode_header


def cfg_for(run, **overrides):
    return load_config(run.config, [f"{k}={v}" for k, v in overrides.items()])


def test_stale_segment_is_refused_with_the_fix_then_cleaned(run):
    run.write_config(1, 1)
    sup = run.supervisor()
    consumer = run.worker("consumer", 0)
    wait_for(lambda: (run.lock_dir / "consumer-0.lock").exists(), what="the consumer to join")
    # `clean` refuses a live run.
    out = run.cli("clean", "--config", str(run.config), check=False)
    assert out.returncode == 2 and "is live" in out.stderr and "dflash-ring stop" in out.stderr
    for p in (sup, consumer):  # a crash of everything leaves a stale segment
        p.send_signal(signal.SIGKILL)
        wait_exit(p)
    assert Ring.exists(run.name)
    refused = run.supervisor()
    assert wait_exit(refused) == 2
    err = refused.stderr.read()
    assert "stale ring" in err and f"dflash-ring clean {run.name}" in err and "--reclaim-stale" in err
    out = run.cli("clean", "--config", str(run.config))
    assert segment_name(run.name) in out.stdout
    assert run.leftovers() == []


def test_reclaim_stale_starts_fresh(run):
    run.write_config(1, 1)
    sup = run.supervisor()

    def status() -> dict | None:
        """None while the segment exists but its header is not written yet (a supervisor creating it: status says
        so, exit 2), which a look between the two may meet."""
        out = run.cli("status", "--config", str(run.config), "--json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    first = wait_for(lambda: Ring.exists(run.name) and status(), what="the ring")
    sup.send_signal(signal.SIGKILL)
    wait_exit(sup)
    sup = run.supervisor("--reclaim-stale")
    wait_for(
        lambda: Ring.exists(run.name) and (now := status()) and now["created_ns"] != first["created_ns"],
        what="a fresh ring",
    )
    run.cli("stop", "--config", str(run.config), "--now")
    assert wait_exit(sup) == 0
    assert "reclaimed stale run" in sup.stderr.read()


def test_drafter_replicas_with_other_drafter_settings_are_refused_by_field_name(run):
    """Issue 14 item 5: replicas with block_size 8 and 10 attached to one ring and averaged their weights
    together silently. The drafter.* settings are part of the ring's fingerprint, checked at attach."""
    run.write_config(1, 2, drafter={"block_size": 8})
    sup = run.supervisor()
    with Ring.attach(ring_spec(cfg_for(run))) as ring:  # a replica with the run's settings attaches
        with pytest.raises(ConfigMismatchError) as e:
            Ring.attach(ring_spec(cfg_for(run, **{"drafter.block_size": 10})), timeout_s=5)
        msg = str(e.value)
        assert "drafter.block_size: ring has 8, this process has 10" in msg, msg
        assert "drafter.loss_gamma: ring has 4.0, this process has 5.0" in msg, msg
        assert "ring.slots" not in msg and "topology" not in msg
        with pytest.raises(ConfigMismatchError, match=r"drafter\.num_hidden_layers: ring has 1, this process has 2"):
            Ring.attach(
                ring_spec(cfg_for(run, **{"drafter.num_hidden_layers": 2, "drafter.block_size": 8})), timeout_s=5
            )
        # Same shape, another objective (issue 21): the recipe's resolved fields are named.
        with pytest.raises(ConfigMismatchError) as e:
            Ring.attach(
                ring_spec(
                    cfg_for(
                        run,
                        **{
                            "drafter.recipe": "dpace",
                            "drafter.num_hidden_layers": 1,
                            "drafter.block_size": 8,
                            "drafter.num_anchors": 512,
                        },
                    )
                ),
                timeout_s=5,
            )
        msg = str(e.value)
        assert "drafter.loss: ring has 'ce', this process has 'dpace'" in msg, msg
        assert "drafter.recipe: ring has None, this process has 'dpace'" in msg, msg
        del ring
    sup.send_signal(signal.SIGTERM)
    assert wait_exit(sup) == 0


def test_mismatched_config_is_refused_naming_the_fields(run):
    run.write_config(1, 2, slots=4)
    with Ring.create(ring_spec(cfg_for(run))) as ring:
        with pytest.raises(ConfigMismatchError) as e:
            Ring.attach(ring_spec(cfg_for(run, **{"ring.slots": 8, "topology.consumers": 3})), timeout_s=0)
        msg = str(e.value)
        assert "ring.slots: ring has 4, this process has 8" in msg
        assert "topology.consumers: ring has 2, this process has 3" in msg
        assert "ring.slot_bytes" not in msg
        del ring
    Ring.unlink(run.name)


def test_unknown_config_key_and_bad_override_are_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[ring]\nslotz = 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'slotz' in \\[ring\\]"):
        load_config(path)
    with pytest.raises(ConfigError, match="ring.slots = 'many': expected int"):
        load_config(None, ["ring.slots=many"])
    with pytest.raises(ConfigError, match="unknown config key 'nope'"):
        load_config(None, ["nope.x=1"])
    assert load_config(None, ["ring.slots=3", "run.name=abc"]).ring.slots == 3


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_ring_header_gives_a_clear_error(data):
    name = f"fuzzhdr{os.getpid()}"  # two suites on one box (or two xdist workers) never share it
    cfg = load_config(None, [f"run.name={name}", "ring.slots=2", "ring.slot_bytes=8192", "ring.slot_header_bytes=4096"])
    Ring.unlink(name)
    with Ring.create(ring_spec(cfg)) as ring:
        size = ring.segment.geometry.total_bytes
        del ring
    shm = posix_ipc.SharedMemory(segment_name(name))
    with mmap.mmap(shm.fd, shm.size) as mm:
        shm.close_fd()
        offset = data.draw(st.integers(0, 200), label="offset")
        junk = data.draw(st.binary(min_size=1, max_size=64), label="junk")
        mm[offset : offset + len(junk)] = junk[: max(0, HEADER_BYTES - offset)]
        original = bytes(mm[:HEADER_BYTES])
    try:
        ring = Ring.attach(ring_spec(cfg), timeout_s=0)
    except (RingHeaderError, ConfigMismatchError) as e:
        assert "dflash-ring clean" in str(e) or "ring has" in str(e) or "damaged" in str(e)
    else:
        ring.close()  # the junk landed in a field we do not need, or rewrote it to its own value
    finally:
        Ring.unlink(name)
    assert len(original) == HEADER_BYTES and size > HEADER_BYTES


@settings(max_examples=500, deadline=None)
@given(blob=st.binary(max_size=512))
def test_arbitrary_bytes_never_escape_as_anything_but_slot_format_error(blob):
    with pytest.raises(SlotFormatError):
        decode_header(b"DFS1" + struct.pack("<I", len(blob)) + blob, 1 << 20, 4096)


_entry = st.lists(
    st.one_of(
        st.text(max_size=8),
        st.integers(-(2**63), 2**64 - 1),
        st.lists(st.integers(-5, 2**45), max_size=10),
        st.sampled_from(["float32", "bfloat16", "int64", "complex", ""]),
        st.none(),
    ),
    min_size=0,
    max_size=5,
)


@settings(max_examples=500, deadline=None)
@given(
    entries=st.lists(_entry, max_size=4),
    meta=st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1), max_size=3),
)
def test_structurally_valid_msgpack_with_hostile_fields_is_bounded(entries, meta):
    body = msgpack.packb({"tensors": entries, "meta": meta})
    raw = b"DFS1" + struct.pack("<I", len(body)) + body
    slot_bytes = 1 << 16
    try:
        header = decode_header(raw, slot_bytes, 4096)
    except SlotFormatError:
        return
    for spec in header.tensors:  # anything accepted lies inside the slot, past the header
        assert 4096 <= spec.offset and spec.offset + spec.nbytes <= slot_bytes


def test_corrupted_slot_is_dropped_with_a_clear_error_and_the_reader_goes_on(run):
    run.write_config(1, 1, slots=2)
    cfg = cfg_for(run)
    with Ring.create(ring_spec(cfg)) as ring:
        producer, drafter = ring.producer(1), ring.consumer(2)
        w = producer.try_acquire()
        w.tensor("x", torch.float32, (4,)).fill_(1.0)
        producer.publish(w)
        w2 = producer.try_acquire()
        w2.tensor("x", torch.float32, (4,)).fill_(2.0)
        producer.publish(w2)
        # Damage the first slot's header so its tensor points past the slot.
        off = ring.segment.geometry.slot_offset(w.slot)
        bad = encode_header(SlotHeader([], {}), 4096)
        body = msgpack.packb({"tensors": [["x", "float32", [1 << 30], 4096]], "meta": {}})
        bad = b"DFS1" + struct.pack("<I", len(body)) + body
        ring.segment.mv[off : off + len(bad)] = bad
        with pytest.raises(SlotFormatError, match=f"item {w.item}.*runs past"):
            drafter.try_claim()
        r = drafter.try_claim()  # the next item is intact and still delivered
        assert r.item == w2.item and float(r.tensors["x"][0]) == 2.0
        drafter.release(r)
        assert ring.status().counters["corrupt"] == 1
        assert ring.slot_counts()["free"] == 2
        del w, w2, r
    Ring.unlink(run.name)


def test_slot_layout_refuses_what_does_not_fit():
    layout = SlotLayout(slot_bytes=8192, header_bytes=4096)
    layout.add("a", torch.float32, (1000,))
    with pytest.raises(ValueError, match="raise ring.slot_bytes"):
        layout.add("b", torch.float32, (1000,))


def test_identity_of_a_too_small_segment_is_an_error():
    with pytest.raises(RingHeaderError, match="smaller than a ring header"):
        read_identity(memoryview(bytearray(16)), 16, "/x", "x")


def test_an_unhashable_dtype_is_a_slot_format_error():
    """Found by the fuzz test above: a list where the dtype goes escaped as TypeError and killed the reader."""
    body = msgpack.packb({"tensors": [["0", [], "", ""]], "meta": {}})
    with pytest.raises(SlotFormatError, match="unknown dtype"):
        decode_header(b"DFS1" + struct.pack("<I", len(body)) + body, 1 << 16, 4096)
