"""The online learner's refit process: ``python -m tessera.predictor.refit_main FD`` fits the samples
sent over the connected socket FD (``tessera.predictor.online.RefitProcess`` starts it)."""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from tessera.predictor.online import serve_refits

if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m tessera.predictor.refit_main FD (a connected socket's descriptor)")
    serve_refits(Connection(int(sys.argv[1])))
