"""Tessera's Kubernetes operator: kopf handlers, reconciliation and planners (``tessera.operator``).

DESIGN.md fixes this folder's name, ``operator/``, which is also the name of a standard-library
module. Python puts the current directory first on ``sys.path`` for ``python -m ...`` and
``python -c ...``, so from the repository root this folder would shadow the standard library and
break the interpreter (``collections`` imports ``operator``). When imported under the top-level
name, this file therefore becomes the standard library's ``operator`` module, by running that
module's own source: nothing of Tessera is importable as a top-level ``operator``.
"""

if __name__ == "operator":
    import os as _os  # always already imported at interpreter start

    __file__ = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    with open(__file__, encoding="utf-8") as _source:
        exec(compile(_source.read(), __file__, "exec"))
    del _os, _source
