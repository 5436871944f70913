"""Real LoRA adapters built offline with ``peft``: one trained briefly on CPU for a real base model, and a
random one for the tiny test model.

vLLM serves an adapter folder as PEFT writes it (``adapter_config.json`` + ``adapter_model.safetensors``).
The trained adapter learns, from a few prompts of the shared AlpacaEval set and reference answers each
opened with ``STYLE_MARKER``, to open its own answers with that marker: its greedy answers then differ
from its base's in a way a test can read. The tokenizer of the base is saved beside the weights, so
the folder answers a chat by itself (``tessera.models.check`` loads base + adapter through
transformers' PEFT integration). The same seed gives the same adapter.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The modules of a Llama layer the adapters adapt (vLLM's LoRA serves each of them).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# What the trained adapter opens each answer with; its answer check looks for it.
STYLE_MARKER = "Tessera here!"
# The shared data folder beside the repository holds the AlpacaEval prompts and answers it learns from.
SHARED_RESPONSES = (
    Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "alpacaeval_responses_text.jsonl.gz"
)


@dataclass(frozen=True, slots=True)
class TrainingSettings:
    """How the trained adapter is made: ``examples`` prompts (the first of the AlpacaEval prompt set)
    with the answers of ``reference_model`` cut to ``answer_tokens``, ``steps`` optimiser steps of
    ``batch`` examples at learning rate ``lr``, rank ``rank`` and scale ``alpha``, from ``seed``."""

    rank: int = 8
    alpha: int = 16
    examples: int = 16
    reference_model: str = "gpt4"
    answer_tokens: int = 12
    steps: int = 12
    batch: int = 4
    lr: float = 2e-3
    seed: int = 0


class AdapterDataError(ValueError):
    """The training data cannot be read; the message says where it was looked for."""


def training_pairs(responses: Path, settings: TrainingSettings = TrainingSettings()) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: the first ``settings.examples`` prompts that ``settings.reference_model``
    answered in the AlpacaEval responses file, each answer opened with ``STYLE_MARKER``."""
    if not responses.is_file():
        raise AdapterDataError(
            f"the adapter's training prompts are read from {responses}, which is missing: the shared "
            "data folder (alpacaeval_responses_text.jsonl.gz) must sit beside the repository"
        )
    pairs: list[tuple[str, str]] = []
    with gzip.open(responses, "rt", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("model") == settings.reference_model and row.get("response"):
                pairs.append((str(row["prompt"]), f"{STYLE_MARKER} {row['response']}"))
                if len(pairs) == settings.examples:
                    break
    if len(pairs) < settings.examples:
        raise AdapterDataError(
            f"{responses} holds {len(pairs)} answers of {settings.reference_model!r}, fewer than the "
            f"{settings.examples} the adapter trains on"
        )
    return pairs


def _lora_config(rank: int, alpha: int) -> object:
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TARGET_MODULES), lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")  # fmt: skip


def _encode(tokenizer: object, prompt: str, answer: str, answer_tokens: int) -> tuple[list[int], int]:
    """The ids of the chat (the user's prompt, the assistant's answer cut to ``answer_tokens``) and
    where the answer starts: the loss is taken on the answer only."""
    head = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    head = list(head["input_ids"] if isinstance(head, dict) else head)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)[:answer_tokens]  # type: ignore[attr-defined]
    return head + list(answer_ids), len(head)


def train_adapter(base_dir: Path, out_dir: Path, pairs: Sequence[tuple[str, str]],
                  settings: TrainingSettings = TrainingSettings()) -> list[float]:  # fmt: skip
    """Train a LoRA adapter of the model in ``base_dir`` on ``pairs`` (CPU, float32) and save it with the
    base's tokenizer into ``out_dir``; the mean loss of each step."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, _lora_config(settings.rank, settings.alpha))
    encoded = [_encode(tokenizer, p, a, settings.answer_tokens) for p, a in pairs]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optimiser = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=settings.lr)
    order = torch.Generator().manual_seed(settings.seed)
    losses: list[float] = []
    peft_model.train()
    for _ in range(settings.steps):
        picks = torch.randperm(len(encoded), generator=order)[: settings.batch].tolist()
        rows = [encoded[i] for i in picks]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (seq, start) in enumerate(rows):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, start : len(seq)] = torch.tensor(seq[start:])
            mask[i, : len(seq)] = 1
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
    peft_model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return losses


def build_random_adapter(base_dir: Path | str, out_dir: Path | str, *, rank: int = 8, seed: int = 0,
                         scale: float = 0.5) -> Path:  # fmt: skip
    """A LoRA adapter of the model in ``base_dir`` with seeded random weights (B normal with std
    ``scale``, so that it changes the answers: PEFT starts B at zero), saved with the base's tokenizer
    into ``out_dir``; for the tiny random model, which has nothing to learn."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, _lora_config(rank, 2 * rank))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out
