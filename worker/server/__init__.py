"""The worker's HTTP layer: OpenAI-compatible API, health, metrics and admin endpoints."""
