"""dflash-ring: train DFlash drafters from a frozen target's hidden states over a shared-memory ring."""

__version__ = "0.1.0"
