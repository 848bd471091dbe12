"""Train the tiny reference byte-level Llama committed under `sparsepatch/assets/tiny_llm` (CPU, fixed seeds).

    PYTHONPATH=. python -m sparsepatch.recipes.train_tiny_llm             # the committed run (see training_info.json)
    PYTHONPATH=. python -m sparsepatch.recipes.train_tiny_llm --max-steps 5 --output-dir /tmp/tl   # smoke

A thin wrapper over `finetune_llm` (config none = transformers' own SDPA, the plain model): it builds a
LlamaForCausalLM of `TINY_LLM_CONFIG` (vocab 259 byte-level ids, head_dim 32, GQA 4:2) with a fixed seed, saves
it as the initial weights and runs `finetune_llm.main(["--model-path", init, ...])` on the Python sources of the
stdlib `email` package. The HELD-OUT text for the notebooks is a different package, `json` (`HELDOUT_CORPUS`),
never seen in training. max_position_embeddings is 4096 so prefill can be measured on sequences longer than the
training windows (RoPE extrapolation; the notebooks compare sparse vs dense on the same model, so that is fair).

`load_trained()` returns the committed model (eval mode, unpatched) and its training info.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_llm"
TINY_LLM_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=4096)
TRAIN_CORPUS = "email"
HELDOUT_CORPUS = "json"
SEQ_LEN = 256
SEED = 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepatch.recipes.train_tiny_llm", description=__doc__.split("\n")[0])
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus", default=TRAIN_CORPUS)
    p.add_argument("--output-dir", default=str(ASSET_DIR))
    p.add_argument("--log-every", type=int, default=25)
    return p


def build_initial(path: str):
    """Random initial weights of TINY_LLM_CONFIG from SEED, saved to `path` (save_pretrained)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .data import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                      tie_word_embeddings=False, attention_dropout=0.0, **TINY_LLM_CONFIG)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    from . import finetune_llm
    from .finetune_video import train_from_initial
    return train_from_initial(
        "sparsepatch.recipes.train_tiny_llm", argv, build_initial, finetune_llm.main,
        ["--config", "none", "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
         "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--seed", str(SEED), "--corpus", args.corpus,
         "--output-dir", args.output_dir, "--log-every", str(args.log_every)],
        args.output_dir, tail=25, train_corpus=args.corpus, heldout_corpus=HELDOUT_CORPUS, seq_len=args.seq_len)


def heldout_tokens(max_bytes: int | None = None):
    """The held-out byte stream (int64 1-D): the `json` package sources, BOS/EOS per file, as data.TextCorpus."""
    from .data import TextCorpus
    return TextCorpus(HELDOUT_CORPUS, seq_len=16, max_bytes=max_bytes).tokens


def load_trained(path: str | os.PathLike | None = None, dtype=None):
    """The committed tiny byte-level Llama (eval mode, unpatched, SDPA attention) and its training info."""
    import torch
    from transformers import LlamaForCausalLM
    path = Path(path) if path is not None else ASSET_DIR
    model = LlamaForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32).eval()
    info_file = path / "training_info.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    return model, info


if __name__ == "__main__":
    main()
