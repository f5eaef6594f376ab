"""Tiny random models and a tiny tokenizer, built in memory in well under a second.

Exactness is a property of the cache plumbing, not of the weights, so these tests
use small random models of four cache shapes:

- ``llama``  GQA (4 query heads, 2 KV heads), the default model's architecture
- ``qwen2``  GQA with attention biases (the second real model's architecture)
- ``neox``   MHA (GPT-NeoX: 4 KV heads, partial rotary)
- ``gemma3`` sliding-window layers (window 8) mixed with full layers, 1 KV head
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

ARCHS = ("llama", "qwen2", "neox", "gemma3")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The analyst reads the code and lists the bugs. The fixer suggests a fix for each bug.",
    "Summarize the document in three sentences. List the key numbers and who owns each action.",
    "def export(rows, totals={}): return sum(r[2] for r in rows) / len(rows)",
    "Incident report: checkout failed for 2 hours; 18,420 of 23,950 attempts failed.",
    "system user assistant You are the reviewer. Point out what is wrong or missing.",
]


def tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (~``vocab_size`` tokens) with ChatML-style special tokens.

    Another ``vocab_size`` gives another tokenization of the same texts (a second model's)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def model(arch: str, vocab_size: int, eos_token_id: int, seed: int = 0) -> torch.nn.Module:
    """A random model of one of :data:`ARCHS`, fp32, in eval mode."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  max_position_embeddings=1024, eos_token_id=eos_token_id, bos_token_id=1, pad_token_id=0,
                  initializer_range=0.1)
    torch.manual_seed(seed)
    if arch == "llama":
        net = LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, num_key_value_heads=2, **common))
    elif arch == "qwen2":
        net = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=3, num_key_value_heads=2, **common))
    elif arch == "neox":
        net = GPTNeoXForCausalLM(GPTNeoXConfig(num_hidden_layers=3, rotary_pct=0.25, **common))
    elif arch == "gemma3":
        net = Gemma3ForCausalLM(Gemma3TextConfig(
            num_hidden_layers=4, num_key_value_heads=1, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            **common))
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}")
    net.generation_config.eos_token_id = eos_token_id
    return net.eval()
