"""Benchmarks of the worker on real vLLM (scenarios of `tessera bench`)."""
