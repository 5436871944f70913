"""Write the real-model demo's trace: real prompts, a batch job and a stream of people chatting.

The prompts are AlpacaEval's 805 instructions (``alpacaeval_prompts.jsonl.gz``, see README.md). The
chat requests are short questions that the model answers within the chat cap (checked here with a
greedy answer from transformers, so the demo prints whole answers), arriving as a Poisson stream; the
batch job is submitted at once at the start, its answers capped. ``output_tokens`` is each request's
cap. Prompt tokens are counted with the served model's tokenizer and chat template.

    .venv/bin/python examples/traces/demo_trace.py .../alpacaeval_prompts.jsonl.gz \
        ~/.cache/tessera/models/smollm2 examples/traces/demo-real.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path
from typing import Any


def answers_end(model: Any, tokenizer: Any, prompts: list[str], cap: int) -> list[bool]:
    """Whether the model's greedy answer to each prompt ends by itself within ``cap`` tokens."""
    import torch

    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": p}] for p in prompts]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=cap, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    answers = out[:, batch["input_ids"].shape[1] :]
    return [bool((row == tokenizer.eos_token_id).any()) for row in answers]


def main() -> None:
    """Parse the arguments and write the trace."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", type=Path, help="alpacaeval_prompts.jsonl.gz")
    parser.add_argument("model_dir", type=Path, help="Folder of the served model (for its tokenizer).")
    parser.add_argument("out", type=Path, help="Trace to write (JSONL).")
    parser.add_argument("--chat", type=int, default=12, help="Chat requests.")
    parser.add_argument("--chat-rate", type=float, default=0.3, help="Chat arrivals per second.")
    parser.add_argument("--chat-start", type=float, default=1.0, help="First chat arrival not before (s).")
    parser.add_argument("--chat-max-tokens", type=int, default=64, help="Cap of a chat answer.")
    parser.add_argument("--screen-batch", type=int, default=16, help="Questions answered at once.")
    parser.add_argument("--batch", type=int, default=14, help="Requests of the batch job.")
    parser.add_argument("--batch-max-tokens", type=int, default=64, help="Cap of a batch answer.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    with gzip.open(args.prompts, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    rng = random.Random(args.seed)
    questions = [r for r in rows if r["prompt_words"] <= 14 and "\n" not in r["prompt"]
                 and r["source"] != "alpaca_eval/selfinstruct"]  # fmt: skip
    rng.shuffle(questions)
    chat: list[dict] = []
    for start in range(0, len(questions), args.screen_batch):
        group = questions[start : start + args.screen_batch]
        ends = answers_end(model, tokenizer, [r["prompt"] for r in group], args.chat_max_tokens)
        chat += [r for r, ended in zip(group, ends, strict=True) if ended]
        if len(chat) >= args.chat:
            break
    chat = chat[: args.chat]
    used = {r["prompt_id"] for r in chat}
    tasks = [r for r in rows if r["prompt_id"] not in used and r["prompt_words"] <= 60]
    batch = rng.sample(tasks, args.batch)

    def tokens(prompt: str) -> int:
        messages = [{"role": "user", "content": prompt}]
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])  # fmt: skip

    out = []
    for i, r in enumerate(batch):
        out.append({"arrival_s": round(0.05 * i, 3), "class": "batch", "prompt": r["prompt"],
                    "prompt_id": r["prompt_id"], "input_tokens": tokens(r["prompt"]),
                    "output_tokens": args.batch_max_tokens})  # fmt: skip
    t = args.chat_start
    for r in chat:
        out.append({"arrival_s": round(t, 3), "class": "chat", "prompt": r["prompt"],
                    "prompt_id": r["prompt_id"], "input_tokens": tokens(r["prompt"]),
                    "output_tokens": args.chat_max_tokens})  # fmt: skip
        t += rng.expovariate(args.chat_rate)
    out.sort(key=lambda x: x["arrival_s"])
    args.out.write_text("".join(json.dumps(x) + "\n" for x in out))
    print(f"wrote {len(out)} requests to {args.out}")


if __name__ == "__main__":
    main()
