"""A run's configuration: the dataclasses (`schema`, one module per large section beside it), the reader
(`load`) and the writer (`dump`)."""
