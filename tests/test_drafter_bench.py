"""`bench drafter`: its memory estimate against the peaks measured on the H200, the samples it picks to fit
one, and the tiny run end to end on the CPU, every figure on stderr before the final JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from dflash_ring.bench.drafter import DEFAULT_SAMPLES, SAMPLE_TOKENS, bench_target
from dflash_ring.bench.drafter_memory import GiB, DoesNotFit, fit_samples, step_memory, trainable_parameters
from dflash_ring.common.config.drafter import DrafterConfig
from dflash_ring.consumer.families.build import build_drafter

H200_BYTES = 143771 * 2**20  # what nvidia-smi shows for one H200 (.library/device/KINDS.md)
PROGRESS = re.compile(r"^(\w+) (\w+): (\{.*\})$")


def _shape(shape: str, recipe: str) -> tuple[dict, DrafterConfig]:
    target = bench_target(shape, tiny=False)
    return target, DrafterConfig(recipe=recipe, mask_token_id=target["vocab_size"] - 1)


@pytest.mark.parametrize("shape,recipe", [("qwen3-8b", "paper"), ("qwen3.6-27b", "ddtree"), ("qwen3.6-27b", "dflash2")])
def test_the_estimate_counts_the_parameters_of_the_model_it_does_not_build(shape, recipe):
    target, drafter = _shape(shape, recipe)
    with torch.device("meta"):
        model = build_drafter(drafter, target)
    assert trainable_parameters(target, drafter) == sum(p.numel() for p in model.parameters())


def test_dflash2_flops_and_memory_count_the_convolutions_and_the_selector():
    """Against the DFlash drafter of the same geometry: the step's FLOPs grow by 3 x the convolutions' forward per
    layer and block token plus the selector's per supervised row; the kernel and hidden projections' matmuls are
    what torch's FLOP counter measures on the built modules; the memory grows by the extra parameters and the
    convolutions' and selector's activations."""
    from dataclasses import replace

    from torch.utils.flop_counter import FlopCounterMode

    from dflash_ring.bench.drafter import dflash2_conv_flops, selector_flops, step_flops
    from dflash_ring.bench.drafter_memory import dflash2_activation_bytes, dflash2_parameters
    from dflash_ring.consumer.families.dflash2.dflash2_blocks import CandidateSelector, GroupedDynamicCausalConv
    from dflash_ring.consumer.layouts.drafter_hf_config import drafter_geometry
    from dflash_ring.consumer.modeling.model import sample_anchors

    target, d2 = _shape("qwen3.6-27b", "dflash2")
    plain = DrafterConfig(
        num_hidden_layers=5,
        block_size=8,
        num_anchors=512,
        layer_types=d2.layer_types,
        sliding_window=2048,
        mask_token_id=d2.mask_token_id,
    )
    g = drafter_geometry(d2, target)
    h, k, groups, r, top_k = g["hidden_size"], 2, g["hidden_size"] // 16, 256, 16
    assert dflash2_conv_flops(target, d2) == 2 * (2 * h * 2 * k * groups + 4 * k * h)
    assert selector_flops(target, d2) == 3 * (2 * h * r + r + 2 * top_k * r) + 2 * top_k * h
    assert dflash2_conv_flops(target, plain) == selector_flops(target, plain) == 0
    anchors = sample_anchors(
        torch.ones(4096, dtype=torch.bool), torch.tensor([0, 4096]), 512, torch.Generator().manual_seed(0)
    )
    supervised = anchors.num_blocks * 7
    extra = step_flops(target, d2, 3, 4096, anchors, supervised, 0) - step_flops(
        target, plain, 3, 4096, anchors, supervised, 0
    )
    want = 3 * 5 * anchors.num_blocks * 8 * dflash2_conv_flops(target, d2) + supervised * selector_flops(target, d2)
    assert extra == pytest.approx(want, rel=1e-9)
    # the matmul parts, measured on small modules of the same formulas
    conv, selector = GroupedDynamicCausalConv(64, 2, 16), CandidateSelector(100, 64, 8, 4)
    x = torch.randn(3, 8, 64)
    with FlopCounterMode(display=False) as counter:
        conv.prepare(x)
    assert counter.get_total_flops() == 3 * 8 * 2 * 64 * (2 * 2 * 4)
    with FlopCounterMode(display=False) as counter:
        selector.hidden_projection(x)
    assert counter.get_total_flops() == 3 * 8 * 2 * 64 * 8
    with torch.device("meta"):
        assert dflash2_parameters(g, d2) == (
            sum(p.numel() for p in build_drafter(d2, target).parameters())
            - sum(p.numel() for p in build_drafter(plain, target).parameters())
        )
    for compiled in (True, False):
        conv_bytes, selector_bytes = dflash2_activation_bytes(g, d2, compiled)
        grown = (
            step_memory(target, d2, 1, 4096, compiled=compiled, check=False).step
            - step_memory(target, plain, 1, 4096, compiled=compiled, check=False).step
        )
        block_tokens = 512 * 8
        assert grown == pytest.approx(14 * dflash2_parameters(g, d2) + block_tokens * (5 * conv_bytes + selector_bytes))
    assert dflash2_activation_bytes(g, plain, True) == (0.0, 0.0)


# docs/benchmarks.md, "Drafter training step on the H200": peak GiB of (shape, recipe, seqs, seq_len, compiled
# layers, gradient check). Those runs predate the teacher logits kept per position, which the estimate adds.
MEASURED = [
    ("qwen3-8b", "paper", 4, 3072, True, False, 43.7),
    ("qwen3.6-27b", "ddtree", 1, 4096, True, False, 65.3),
    ("qwen3.6-27b", "ddtree", 2, 4096, True, False, 100.0),
    ("qwen3.6-27b", "paper", 1, 4096, True, False, 39.3),
    ("qwen3-8b", "paper", 4, 3072, True, True, 62.1),
    ("qwen3.6-27b", "ddtree", 1, 4096, True, True, 84.6),
    ("qwen3-8b", "paper", 4, 3072, False, False, 71.2),  # --attention sdpa: eager layers
    # issue 33 (docs/bench-drafter-h200-27b-dflash2*.json): the estimate counts DFlash2's convolutions and selector
    ("qwen3.6-27b", "dflash2", 1, 4096, True, False, 40.3),
    ("qwen3.6-27b", "dflash2", 4, 3072, True, True, 78.9),
]


@pytest.mark.parametrize("shape,recipe,seqs,seq_len,compiled,check,measured", MEASURED)
def test_the_estimate_reproduces_the_peaks_measured_on_the_h200(
    shape, recipe, seqs, seq_len, compiled, check, measured
):
    target, drafter = _shape(shape, recipe)
    memory = step_memory(target, drafter, seqs, seq_len, compiled=compiled, check=check)
    teacher_logits = 2 * seqs * seq_len * target["vocab_size"] if drafter.needs_target_logits else 0
    assert memory.peak / GiB == pytest.approx(measured, rel=0.10)
    assert (memory.peak - teacher_logits) / GiB == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize(
    "shape,recipe,check,expected",
    [
        ("qwen3-8b", "paper", True, (4, 3072)),  # the default, kept
        ("qwen3.6-27b", "paper", True, (4, 3072)),
        ("qwen3.6-27b", "ddtree", True, (1, 4096)),  # the eager gradient check needs ~149 GiB at 2 x 4096
        ("qwen3.6-27b", "ddtree", False, (2, 4096)),  # measured 100 GiB
    ],
)
def test_unset_samples_are_the_most_that_fit_one_h200(shape, recipe, check, expected):
    target, drafter = _shape(shape, recipe)
    seqs, seq_len, memory = fit_samples(
        target,
        drafter,
        None,
        None,
        H200_BYTES,
        compiled=True,
        check=check,
        default=DEFAULT_SAMPLES,
        fallback_len=SAMPLE_TOKENS.get(shape, 3072),
    )
    assert (seqs, seq_len) == expected and memory.peak <= 0.9 * H200_BYTES


def test_given_samples_are_kept_or_refused_with_what_fits():
    target, drafter = _shape("qwen3.6-27b", "ddtree")
    assert fit_samples(target, drafter, 2, None, H200_BYTES, compiled=True, check=False, fallback_len=4096)[:2] == (
        2,
        3072,
    )  # the default length first
    with pytest.raises(
        DoesNotFit,
        match=r"^--seqs 3 --seq-len 4096 does not fit: .* at most --seqs 2 --seq-len "
        r"4096 fits$",
    ):
        fit_samples(target, drafter, 3, 4096, H200_BYTES, compiled=True, check=False)
    with pytest.raises(
        DoesNotFit,
        match=r"at most --seqs 1 --seq-len 4096 fits; with --no-check .*: --seqs 2 "
        r"--seq-len 4096$",
    ):
        fit_samples(target, drafter, 2, 4096, H200_BYTES, compiled=True, check=True)


@pytest.mark.processes
def test_tiny_drafter_bench_prints_each_figure_before_the_json():
    """The CPU run of the 27B's ddtree bench, checked for one H200 first: each figure on stderr as it is measured
    (what a run cut off by a time limit keeps), the same figures in the final JSON."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ring",
            "bench",
            "drafter",
            "--shape",
            "qwen3.6-27b",
            "--recipe",
            "ddtree",
            "--gpu-memory-gib",
            str(H200_BYTES / GiB),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    lines = out.stdout.splitlines()
    start = lines.index("{")
    report = json.loads("\n".join(lines[start:]))
    figures = [(m[1], m[2], json.loads(m[3])) for m in map(PROGRESS.match, lines[:start]) if m]
    assert all(bench == "drafter" for bench, _, _ in figures)
    parts = [part for _, part, _ in figures]
    assert parts == ["memory", "warmup", "step", "step", "summary"], parts  # no gradient check on a CPU
    memory, warmup, *steps, summary = (f for _, _, f in figures)
    assert (memory["seqs"], memory["seq_len"]) == (1, 4096)  # chosen for the H200; the CPU runs its smoke size
    assert warmup["warmup_s"] == report["warmup_s"]
    assert [s["step"] for s in steps] == [1, 2]
    for phase, mean in report["step_split_s"].items():
        assert sum(s[phase] for s in steps) / len(steps) == pytest.approx(mean, abs=1e-4)
    assert summary == {k: report[k] for k in summary}
    assert set(summary) >= {"tokens_per_s", "mfu", "step_split_s", "peak_memory_gib"}


@pytest.mark.processes  # the report names the platform (uname)
def test_the_eagle3_bench_counts_its_own_flops_over_its_draft_vocabulary(capsys):
    """EAGLE-3 trains every row through ttt_steps steps, not blocks of anchors: its family counts the step's FLOPs
    (the block families' count gave 337.78 TFLOP for both of an H100 run's vocabularies), and a reduced draft
    vocabulary (--draft-vocab-size) takes its head rows out of the draft's and the teacher's products."""
    from dflash_ring.bench.drafter import _drafter_config, run_drafter_bench
    from dflash_ring.consumer.families import family
    from dflash_ring.consumer.layouts.drafter_hf_config import drafter_geometry
    from dflash_ring.consumer.modeling.model import Anchors, cu_seqlens_from_lengths

    target = bench_target("qwen3-8b", tiny=False)
    anchors = Anchors(torch.arange(10), None, cu_seqlens_from_lengths([3072] * 4))
    flops = {
        vocab: family("eagle3").step_flops(target, drafter_geometry(d, target), d, 3, 4 * 3072, anchors, 64512, 64512)
        for vocab in (0, 32000)
        for d in [_drafter_config(target, "eagle3", None, 1024, None, vocab)]
    }
    assert flops[0] - flops[32000] == pytest.approx(4 * 2 * 4096 * (151936 - 32000) * 64512)
    report = run_drafter_bench(tiny=True, steps=1, recipe="eagle3", draft_vocab_size=100)
    assert (report["shape"]["vocab"], report["shape"]["draft_vocab"]) == (512, 100)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--recipe", "paper", "--draft-vocab-size", "100"], "draft_vocab_size, draft_vocab are EAGLE-3-only"),
        (["--recipe", "eagle3", "--draft-vocab-size", "200000"], "exceeds the target's vocabulary of 151936"),
    ],
)
def test_a_draft_vocabulary_the_bench_cannot_build_is_refused_in_one_line(args, words, capsys):
    from dflash_ring.cli import main

    assert main(["bench", "drafter", "--gpu-memory-gib", "80", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
