"""Drafters in the layouts engines and peers load: the export (config.json, weights, code) and the import of released
drafters."""
