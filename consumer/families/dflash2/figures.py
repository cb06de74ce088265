"""DFlash2's named figures of a step (its candidate selector, consumer/objectives/selector.py), as the step record's
keys, over the step's supervised drafts: `selector_loss` (its weighted K-way CE, before selector_weight),
`selector/unary_top1` (the backbone's own top-1), `selector/top_k_recall`, `selector/top_k_mass` (the draft's mass on
its top-K), `selector/accuracy` (teacher-forced; a gold outside the top-K is a miss), and the mean accepted lengths
over blocks of the greedy serving walk through the selector (`selector/accept_len`) and of the top-K oracle
(`selector/oracle_accept_len`)."""

from __future__ import annotations

from dflash_ring.consumer.training.loss import DFlashLoss


def dflash2_figures(out: DFlashLoss) -> dict[str, float]:
    s = out.selector
    if s is None:  # selector_weight 0
        return {}
    rows, blocks = max(int(s.rows), 1), max(out.num_blocks, 1)
    return {
        "selector_loss": float(s.loss),
        "selector/unary_top1": float(out.correct_per_position.sum()) / rows,
        "selector/top_k_recall": float(s.in_top_k) / rows,
        "selector/top_k_mass": float(s.top_k_mass) / rows,
        "selector/accuracy": float(s.correct) / rows,
        "selector/accept_len": float(s.block_accept.sum()) / blocks,
        "selector/oracle_accept_len": float(s.block_oracle.sum()) / blocks,
    }
