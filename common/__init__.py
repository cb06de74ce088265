"""Shared by every role: the ring, the slot format, config and liveness."""
