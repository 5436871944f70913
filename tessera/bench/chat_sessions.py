"""Multi-turn chat sessions from real prompts and answers (the AlpacaEval set of the shared data).

A session is ``turns`` user questions, each an AlpacaEval prompt, answered by one model's recorded
response (cut to ``reply_chars`` at a word boundary). Turn ``k`` sends the whole conversation so far:
the earlier questions with their recorded answers, then question ``k``; so each turn's prompt extends
the previous turn's, and the history is the shared prefix an engine's prefix cache can reuse. The
recorded answers (not what the engine generates) make every replay of a session send the same
prompts, whatever the route.

Open loop: session ``s`` starts at ``s × session_gap_s`` and sends each next turn a think time after
the previous one, ``turn_gap_s`` × uniform(0.5, 1.5) (seeded), whatever the answers' timing, so every
route sees the same arrivals. The jitter matters: with fixed gaps the sessions' turns would arrive in
the same order every round, and round-robin over an instance count dividing the session count would
keep each session on one instance, as an affinity route does.

``sim_chat_requests`` turns sessions into simulator requests whose prefix blocks are hash chains of
the real prompts' tokens (``tessera bench routing --set workload=chat``).
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.bench.runner import SHARED_DATA
from tessera.core.prefix import token_block_hashes
from tessera.core.request import Request

ALPACA_TEXT = SHARED_DATA / "alpacaeval_responses_text.jsonl.gz"


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One request of a session: when it is sent and the conversation it sends."""

    session: str
    turn: int
    at: float  # seconds from the start of the replay
    messages: tuple[dict[str, str], ...]  # the conversation so far, ending with this turn's question
    reply: str  # the recorded answer (the next turn's history)


def _cut(text: str, chars: int) -> str:
    """``text`` cut to at most ``chars`` characters at a word boundary."""
    if len(text) <= chars:
        return text
    head = text[:chars]
    space = head.rfind(" ")
    return head[:space] if space > chars // 2 else head


def load_answers(path: Path = ALPACA_TEXT) -> dict[str, list[tuple[str, str]]]:
    """Prompt id -> the (prompt, response) pairs of every model that answered it, in file order."""
    from tessera.predictor.dataset import load_pairs

    by_prompt: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for pair in load_pairs(path):
        if pair.response.strip():
            by_prompt[pair.group].append((pair.prompt, pair.response))
    return dict(by_prompt)


def chat_sessions(
    answers: dict[str, list[tuple[str, str]]],
    sessions: int,
    turns: int,
    *,
    seed: int,
    reply_chars: int,
    session_gap_s: float,
    turn_gap_s: float,
    prefix: str = "s",
) -> list[ChatTurn]:
    """``sessions`` sessions of ``turns`` turns (no prompt twice in one session; sessions may share
    some), in arrival order; session names are ``prefix`` + its number. ValueError when the data has
    fewer prompts than ``turns`` or a setting is out of range."""
    if sessions < 1 or turns < 1 or reply_chars < 1 or session_gap_s < 0 or turn_gap_s < 0:
        raise ValueError(
            f"chat sessions need sessions >= 1, turns >= 1, reply_chars >= 1 and gaps >= 0 s; got "
            f"sessions={sessions}, turns={turns}, reply_chars={reply_chars}, session_gap_s={session_gap_s}, "
            f"turn_gap_s={turn_gap_s}"
        )
    ids = sorted(answers)
    if len(ids) < turns:
        raise ValueError(f"{turns} turns need {turns} prompts; the data has {len(ids)}")
    rng = random.Random(seed)
    out: list[ChatTurn] = []
    for s in range(sessions):
        history: list[dict[str, str]] = []
        at = s * session_gap_s
        for k, prompt_id in enumerate(rng.sample(ids, turns)):
            prompt, response = rng.choice(answers[prompt_id])
            reply = _cut(response, reply_chars)
            history.append({"role": "user", "content": prompt})
            out.append(ChatTurn(f"{prefix}{s}", k, at, tuple(history), reply))
            history.append({"role": "assistant", "content": reply})
            at += turn_gap_s * rng.uniform(0.5, 1.5)
    return sorted(out, key=lambda t: (t.at, t.session))


def chat_body(model: str, turn: ChatTurn, max_tokens: int) -> dict[str, Any]:
    """The OpenAI chat request of ``turn``: its session as the OpenAI ``user`` field, exactly
    ``max_tokens`` tokens generated."""
    return {"model": model, "messages": list(turn.messages), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "user": turn.session}  # fmt: skip


CHAT_BLOCK_TOKENS = 16  # vLLM's default KV block size on GPUs: the prefix blocks of simulated chat


def sim_chat_requests(n: int, turns: int, seed: int, reply_chars: int = 1500) -> list[Request]:
    """The first ``n`` requests of multi-turn sessions for the simulator (sessions start 1 s apart and
    send a turn about every 20 s; scenarios rescale arrivals to their load). Each prompt is the conversation
    as the router reads it (each message's role and text), tokenized by the default tokenizer of
    ``tessera.predictor.tokens``; its prefix blocks are vLLM's hash chain over those tokens in blocks
    of ``CHAT_BLOCK_TOKENS``, and its output length is the recorded answer's tokens."""
    from tessera.predictor.tokens import TokenCounter
    from tessera.router.payload import prompt_text

    if n < 1:
        raise ValueError(f"requests must be >= 1, got {n}")
    sessions = -(-n // turns)
    convs = chat_sessions(load_answers(), sessions, turns, seed=seed, reply_chars=reply_chars,
                          session_gap_s=1.0, turn_gap_s=20.0)[:n]  # fmt: skip
    counter = TokenCounter.from_path(None)
    texts = [prompt_text({"messages": list(t.messages)}) for t in convs]
    prompts = counter.ids_batch(texts)
    replies = counter.ids_batch([t.reply for t in convs])
    out = []
    for t, text, ids, reply in zip(convs, texts, prompts, replies, strict=True):
        tokens = max(1, len(reply))
        out.append(Request(f"{t.session}-{t.turn}", t.at, max(1, len(ids)), tokens, true_output_tokens=tokens,
                           prompt_text=text, response_text=t.reply,
                           prefix_blocks=tuple(token_block_hashes(ids, CHAT_BLOCK_TOKENS)),
                           prefix_block_tokens=CHAT_BLOCK_TOKENS))  # fmt: skip
    return out
