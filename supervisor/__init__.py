"""Supervisor: creates the ring, counts finished producers, broadcasts shutdown, reaps the dead."""
