"""Run by Python at the start of every process of a vLLM server the worker starts: the worker's fixes
to vLLM (``vllm_fixes``), before vLLM is imported."""

from tessera.worker.engines.vllm_fixes import install

install()
