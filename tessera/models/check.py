"""The answer check of a freshly built model: a fixed prompt, answered greedily by transformers on CPU."""

from __future__ import annotations

from pathlib import Path

from tessera.models.cache import ModelCacheError
from tessera.models.registry import KnownModel

MAX_NEW_TOKENS = 32


def greedy_answer(folder: Path, prompt: str, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """The model's greedy answer to ``prompt`` as a chat message (text only, special tokens dropped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)  # fmt: skip
    return tokenizer.decode(out[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def check_answer(folder: Path, model: KnownModel) -> str | None:
    """Ask the model's check prompt; the answer, or ModelCacheError when it lacks the expected text."""
    if model.check_prompt is None:
        return None
    answer = greedy_answer(folder, model.check_prompt)
    if model.check_expect is not None and model.check_expect.lower() not in answer.lower():
        raise ModelCacheError(
            f"model {model.name!r} built in {folder} answered {answer!r} to {model.check_prompt!r}, "
            f"which lacks {model.check_expect!r}: the build is wrong (check the installed packages)"
        )
    return answer
