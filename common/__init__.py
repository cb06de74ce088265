"""Shared by every role: the ring (`ring/`), config (`config/`), a role process's life and what outlives it
(`lifecycle/`), and the small parts beside them (the slot format and contract, metrics, ownership, refusals)."""
