"""A real, tiny, random-weight Llama model built offline for tests and CPU benchmarks.

No model can be downloaded on the machines this project is tested on, but vLLM needs a real
Hugging Face model directory. This module trains a small byte-level BPE tokenizer on text shipped
with the package, builds a 2-layer Llama (hidden 256, 4 heads of 64: the CPU attention kernel
rejects head_dim 16) with seeded random weights in float32, and saves both with a chat template so
``/v1/chat/completions`` works. The same seed gives byte-identical weights and tokenizer.

Usage::

    from tessera.models.tiny import build_tiny_model
    model_dir = build_tiny_model(tmp_path / "tiny-llama")
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

CORPUS_FILE = Path(__file__).with_name("tiny_corpus.txt")
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
# A minimal chat template: one line per message, then the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
MARKER = "tessera-tiny-model.json"  # written last: a directory without it is incomplete


def build_tiny_model(
    out_dir: Path | str,
    *,
    vocab_size: int = 1024,
    max_position: int = 2048,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_layers: int = 2,
    intermediate_size: int = 512,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
) -> Path:
    """Build the tiny model into ``out_dir`` (created) and return it.

    ``vocab_size`` is an upper bound: BPE stops merging when the corpus has no more pairs, and the
    model's vocabulary is the tokenizer's actual size. ``corpus`` replaces the shipped text.
    Re-running on a completed directory returns it unchanged.
    """
    import json

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(
            f"hidden_size {hidden_size} / num_heads {num_heads} must give a head_dim >= 32 "
            "(vLLM's CPU attention kernel rejects smaller heads; use hidden 256 with 4 heads)"
        )
    out = Path(out_dir)
    settings = {
        "vocab_size": vocab_size,
        "max_position": max_position,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_layers": num_layers,
        "intermediate_size": intermediate_size,
        "seed": seed,
        "custom_corpus": corpus is not None,
    }
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return out
    out.mkdir(parents=True, exist_ok=True)

    texts = list(corpus) if corpus is not None else CORPUS_FILE.read_text().splitlines()
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = max_position
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position,
        bos_token_id=bos_id,
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        tie_word_embeddings=False,
    )
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    marker.write_text(json.dumps(settings))
    return out
