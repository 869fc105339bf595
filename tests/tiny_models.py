"""Tiny random Qwen2-style models for the tests that run a whole model: head_dim 128 (the HiF8
op's), 4 q / 2 kv heads, hidden = heads x 128 (vLLM's Qwen2 derives head_dim from it), and a
small byte-level BPE tokenizer trained on the test's text."""

from __future__ import annotations

from pathlib import Path


def save_tokenizer(folder: Path, text: str, vocab_size: int = 320) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


def save_qwen2(folder: Path, *, layers: int = 2, max_positions: int = 512, seed: int = 0) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=384, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                         max_position_embeddings=max_positions)
    Qwen2ForCausalLM(config).save_pretrained(folder)
