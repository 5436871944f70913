"""Tessera's scheduling policies beyond the baselines (ELIS, Andes, QLM, SeaLLM)."""
