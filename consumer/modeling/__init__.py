"""The drafter's model side: the DFlash backbone and its Qwen3 pieces, the target's frozen head (read, probed, cached),
FP8, and one drafting round."""
