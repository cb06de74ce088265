"""The drafter's objectives as components beside one chunked head loss (head_loss.py).

A step's loss is a sum of per-row terms of the draft's distribution q over the vocabulary, each with its own
module (its value and its gradient w.r.t. the logits), weighted per row by a position weighting, plus block-level
terms:

    loss = sum_rows w (ce_weight CE + kl_weight KL + tv_weight L1) / S  -  CAP  +  confidence_weight BCE

- terms, per row, fused into one pass over a chunk of [rows, vocab] logits (fused.py):
  cross_entropy.py (CE of the label), soft_kl.py (KL from the target's distribution p), total_variation.py
  (DSpark's L1 = ||q - p||_1 and the analytic acceptance 1 - L1 / 2);
- weightings (w and S): position_decay.py (the paper's exp(-(k-1)/gamma), also DSpark's), dpace.py (D-PACE: from
  the CE, so only after the chunk's first pass);
- block terms: cap.py (CAP: the expected accepted length, through the CE's products), confidence.py (DSpark's
  confidence head against the detached analytic acceptance: outside the vocabulary, on the head's own logits).

`dflash_loss` (consumer/training/loss.py) turns a recipe into these components; the chunk loop (head_loss.py) asks them
for weights and gradient coefficients and never reads the config's objective names.
"""
