"""EAGLE-3's named figures of a step, as speculators names them per TTT step k (0-based): `full_acc_<k>`, the share of
rows supervised at step k whose drafts 0..k are all the target's argmax (teacher-forced), and `cond_acc_<k>`, the
share of rows right through step k - 1 that step k keeps right (every row with a supervised step counts as right
before step 0). The per-step accuracy (EAGLE's and SpecForge's acc_k) is the shared accuracy_per_position."""

from __future__ import annotations

from dflash_ring.consumer.training.loss import DFlashLoss


def eagle3_figures(out: DFlashLoss) -> dict[str, float]:
    prefix = out.block_accept - 1  # each row's teacher-forced run of hits
    figures, before = {}, float(out.num_blocks)
    for k, valid in enumerate(out.valid_per_position.tolist()):
        reached = float((prefix > k).sum())
        figures[f"full_acc_{k}"] = round(reached / valid, 4) if valid else 0.0
        figures[f"cond_acc_{k}"] = round(reached / before, 4) if before else 0.0
        before = reached
    return figures
