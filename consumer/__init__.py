"""Drafter trainer: the DFlash drafter, its loss, training loop and checkpoints."""
