"""Write a small Hugging Face Llama folder (config, random safetensors weights from seed 0, a BPE
tokenizer trained on a generated corpus) and the corpus as JSONL: what a user brings to
the README's three-command fine-tuning run, made locally, offline.

    python examples/tiny_hf_folder.py OUT_DIR   # writes OUT_DIR/llama/ and OUT_DIR/corpus.jsonl

Needs the ``hf`` extra (transformers, tokenizers)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "log",
    "big",
    "small",
    "red",
    "blue",
]


def main(out: Path) -> None:
    rng = random.Random(0)
    docs = [" ".join(rng.choices(WORDS, k=rng.randint(5, 40))) for _ in range(400)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<unk>", "<s>", "</s>"]
    bpe.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=64, special_tokens=special))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every run: the README's figures reproduce
    LlamaForCausalLM(config).save_pretrained(out / "llama")
    tokenizer.save_pretrained(out / "llama")
    print(f"wrote {out / 'llama'} and {out / 'corpus.jsonl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "ft"))
