"""``freeze_startup_objects`` (what ``tessera router`` does once started): the garbage is collected,
then what is left is out of the garbage collector's reach, so a full collection under load walks only
what requests made."""

from __future__ import annotations

import gc
import weakref

from tessera.router.app import RouterState, freeze_startup_objects


class _Node:
    """An object in a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_startup_garbage_is_collected_and_the_rest_frozen() -> None:
    gc.unfreeze()
    gc.disable()  # only the collection under test runs
    try:
        state = RouterState([])
        garbage = weakref.ref(_Node())
        assert garbage() is not None
        freeze_startup_objects()
        assert garbage() is None  # collected, not frozen
        assert gc.get_freeze_count() > 10_000  # the modules, not a handful
        assert id(state) not in {id(o) for o in gc.get_objects()}  # out of the collector's reach
    finally:
        gc.enable()
        gc.unfreeze()  # this test process goes on collecting as before
