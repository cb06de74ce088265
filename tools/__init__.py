"""Operator tools above the roles: the one-host launcher (`dflash-ring run`), the chaos soak and its restarter."""
