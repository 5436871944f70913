"""The package layout: top-level folders mapped to sub-packages, stdlib `operator` never shadowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_top_level_operator_is_the_standard_library_from_the_repo_root() -> None:
    # -S: no site-packages, so nothing imports the stdlib `operator` before the checkout's folder
    # is found first on sys.path (the way a fresh venv's `python -m pip` failed before the shim).
    code = (
        "import collections, operator, sys;"
        "assert operator.eq(2, 2) and operator.__add__(1, 2) == 3;"
        "assert operator.itemgetter(1)('ab') == 'b';"
        "assert not hasattr(operator, 'planners')"
    )
    subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, check=True)


def test_code_folders_import_as_tessera_subpackages() -> None:
    import tessera.operator.controller
    import tessera.sim
    import tessera.worker

    # operator/ has no __init__.py (so it cannot shadow the standard library): a namespace package
    assert [Path(p) for p in tessera.operator.__path__] == [ROOT / "operator"]
    assert Path(tessera.operator.controller.__file__).parent == ROOT / "operator"
    assert Path(tessera.worker.__file__).parent == ROOT / "worker"
    assert Path(tessera.sim.__file__).parent == ROOT / "sim"
