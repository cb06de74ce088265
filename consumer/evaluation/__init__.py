"""Offline evaluation: speculative decoding against the target (chain, draft tree, prompt lookup) and the confidence's
calibration."""
