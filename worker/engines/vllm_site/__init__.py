"""A folder that ``VLLMServer`` puts first on a vLLM server's ``PYTHONPATH``: its ``sitecustomize``
runs in every Python process of the server (vLLM's CPU backend spawns its engine processes)."""
