"""The batch component (``tessera batch``): OpenAI's Files and Batch APIs over Tessera's online capacity.

``store`` keeps files and job state durable (SQLite in WAL mode plus files under a state directory),
``rules`` checks an input file and a batch request (pure), ``feeder`` sends every line through the
router as a request of the batch class, ``app`` serves the API behind the router.
"""
