"""Every family of bench/target_shapes.FAMILIES, tiny, through both probes on one device; JSON out.

`python -m dflash_ring.bench.family_probe [cuda|cpu] [family,family,...]`: each family is built tiny from its
config class, saved, loaded by the producer's own loader (`TargetModel.load`, bf16 on CUDA) and judged by
`choose_packing("auto")`, as a target process does at start; then the drafter's head probe derives and
verifies its head (consumer/modeling/head_probe.py), as a drafter does at its first start. It is how the GPU path (the
varlen kernel) and the installed transformers' modeling code are checked on a GPU machine whose transformers
is not CI's.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

from dflash_ring.bench.target_shapes import FAMILIES, PADDED_ONLY, model_class, tiny_config
from dflash_ring.common.config.target import TargetConfig
from dflash_ring.consumer.modeling.head_loader import probe_target_head
from dflash_ring.producer.conformance import choose_packing
from dflash_ring.producer.target import TargetModel


def probe_family(family: str, device: torch.device) -> dict:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as where:
        torch.manual_seed(0)
        config = tiny_config(family, vocab_size=300, pad_token_id=0, bos_token_id=None, eos_token_id=None)
        model_class(family)(config).save_pretrained(where)
        target = TargetModel.load(
            TargetConfig(path=where, num_draft_layers=3), device, packed=family not in PADDED_ONLY
        )
        report = choose_packing(target, "auto")
        spec, errors = probe_target_head(where)
    return dict(
        packed=bool(target.packed),
        passed=None if report is None else bool(report.passed),
        max_error=None if report is None else report.max_error,
        dtype=None if report is None else report.dtype,
        head=spec.describe(),
        head_errors=[errors.embedding, errors.logits],
        seconds=round(time.perf_counter() - start, 1),
    )


def main(argv: list[str]) -> int:
    device = torch.device(argv[0] if argv else ("cuda" if torch.cuda.is_available() else "cpu"))
    families = argv[1].split(",") if len(argv) > 1 else list(FAMILIES)
    out = {}
    for family in families:
        try:
            out[family] = probe_family(family, device)
        except Exception as e:  # one family's failure is its row, not the end of the survey
            out[family] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        print(family, out[family], file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
