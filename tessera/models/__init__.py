"""Models Tessera can build offline into a local cache and serve by name (``tessera models``)."""
