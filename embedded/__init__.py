"""The embedded default: a tiny target with its own tokenizer and a generated corpus, built and cached on CPU."""
