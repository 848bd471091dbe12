"""Causal-LM fine-tune of a (tiny) Llama through sparsepatch attention, on a local byte-level corpus.

    python -m sparsepatch.recipes.finetune_llm --config dense --max-steps 100
    accelerate launch --cpu --num_processes 1 -m sparsepatch.recipes.finetune_llm --max-steps 2
    accelerate launch --multi_gpu --num_processes 2 -m sparsepatch.recipes.finetune_llm --model-size small
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m sparsepatch.recipes.finetune_llm   # DDP on CPU (gloo)

Model: `LlamaForCausalLM` built from a config (`--model-size tiny|small`, random weights, vocab 259 = 256 bytes +
BOS/EOS/PAD) or loaded from a local `save_pretrained` directory with `--model-path` (its vocabulary must cover
the 259 byte-level ids). Attention dropout is forced to 0 (the sparsepatch kernels have none).

Data: `data.TextCorpus` — by default the Python sources of the stdlib `json` package (`--corpus` takes another
package name or a directory), tokenised as raw UTF-8 bytes: nothing to download, no tokenizer file, and every
installed Python has it. Windows of `--seq-len` tokens; labels = inputs (the model shifts them).

Configs: dense = `sp.DenseConfig()` patched (the bundled dense kernel, in forward and backward); none = the model
unpatched (transformers' SDPA), the baseline; nsa = Native Sparse Attention with learned gates, scaled to short
sequences (see `sparse_config`); its gate parameters are trained with the model and removed again by `sp.unpatch`
before saving.

Returns (from `main`) and prints: final loss, losses, step times (seconds, batch on device -> optimizer step done),
attention calls served by sparsepatch.
"""
from __future__ import annotations

import argparse
import time

import torch

from .finetune_video import finish, optimizer_step, progress, report_step, summarize, sync

MODEL_SIZES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}
CONFIGS = ("dense", "none", "nsa")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sparsepatch.recipes.finetune_llm", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=CONFIGS, default="dense")
    p.add_argument("--nsa-selection", choices=("token", "tile"), default="token",
                   help="--config nsa: NSAConfig.selection (per query token, or per selection tile)")
    p.add_argument("--nsa-selected", type=int, default=2,
                   help="--config nsa: NSAConfig.num_selected (2 = just the forced first and local blocks)")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="tiny")
    p.add_argument("--model-path", default=None, help="a local LlamaForCausalLM save_pretrained directory")
    p.add_argument("--corpus", default=None, help="package name or directory of text files (default: json)")
    p.add_argument("--corpus-suffix", default=".py", help="file suffix to read from the corpus directory")
    p.add_argument("--output-dir", default=None, help="save the unpatched model here (save_pretrained)")
    p.add_argument("--log-every", type=int, default=10)
    return p


def build_model(size: str = "tiny", model_path: str | None = None, seq_len: int = 128):
    """A LlamaForCausalLM in train mode with attention dropout 0: from `model_path`, else random `MODEL_SIZES[size]`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .data import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
    if model_path:
        model = LlamaForCausalLM.from_pretrained(model_path)
        if model.config.vocab_size < VOCAB_SIZE:
            raise ValueError(f"--model-path: vocab_size {model.config.vocab_size} < {VOCAB_SIZE} byte-level ids")
    else:
        cfg = LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=max(512, seq_len), bos_token_id=BOS_ID,
                          eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False,
                          **MODEL_SIZES[size])
        model = LlamaForCausalLM(cfg)
    model.config.attention_dropout = 0.0
    for module in model.modules():          # layers copy the dropout at init
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.0
    return model.train()


def sparse_config(name: str, seq_len: int = 128, nsa_selection: str = "token", nsa_selected: int = 2):
    """The sparsepatch config for --config (None for 'none').

    nsa: NSA scaled to the recipe's short sequences (the NSAConfig defaults are for 32K+ contexts, where a 512-token
    window alone would cover these sequences): 16-token selection blocks, `nsa_selected` selected (default 2: the
    forced first and local blocks), a seq_len/4 window, compression blocks of 16 every 8 tokens, learned gates
    (trainable parameters added to each attention module), selection per query token or per tile.
    """
    import sparsepatch as sp
    if name == "nsa":
        return sp.NSAConfig(block_size=16, num_selected=nsa_selected, window=max(16, seq_len // 4), compress_block=16,
                            compress_stride=8, gates="learned", selection=nsa_selection)
    return {"dense": sp.DenseConfig, "none": lambda: None}[name]()


def main(argv=None) -> dict:
    """Run the fine-tune; returns {"final_loss", "losses", "step_times", "attention_calls", "config",
    "output_dir", "model" (the trained model, unpatched, unwrapped)}. losses are process-mean cross-entropy."""
    args = build_parser().parse_args(argv)
    if args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {args.max_steps}")
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    import sparsepatch as sp
    from .data import TextCorpus, default_corpus

    accelerator = Accelerator()
    set_seed(args.seed)
    model = build_model(args.model_size, args.model_path, args.seq_len)
    handle = None
    config = sparse_config(args.config, args.seq_len, args.nsa_selection, args.nsa_selected)
    if config is not None:
        try:
            handle = sp.patch(model, config)
        except NotImplementedError as exc:
            raise NotImplementedError(f"finetune_llm --config {args.config}: {exc}") from exc

    data = TextCorpus(args.corpus or default_corpus(), seq_len=args.seq_len, suffix=args.corpus_suffix)
    if len(data) < args.batch_size * accelerator.num_processes:
        raise ValueError(f"corpus: {len(data)} windows of {args.seq_len} tokens < one global batch")
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    raw = accelerator.unwrap_model(model)

    losses, step_times = [], []
    bar = progress(args.max_steps, accelerator.is_local_main_process, f"finetune_llm[{args.config}]")
    batches = iter(loader)
    model.train()
    for step in range(args.max_steps):
        try:
            batch = next(batches)
        except StopIteration:                 # epoch over: a fresh shuffle
            batches = iter(loader)
            batch = next(batches)
        sync(accelerator.device)
        t0 = time.perf_counter()
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss_value = optimizer_step(accelerator, model, optimizer, loss, args.max_grad_norm, step)
        sync(accelerator.device)
        step_times.append(time.perf_counter() - t0)
        losses.append(loss_value)
        report_step(accelerator, bar, step, args.max_steps, args.log_every, loss_value, step_times[-1])
    if bar is not None:
        bar.close()
    calls = finish(accelerator, handle, raw, args.output_dir, save_function=accelerator.save)
    result = {"config": args.config, "final_loss": losses[-1], "losses": losses, "step_times": step_times,
              "attention_calls": calls, "output_dir": args.output_dir, "num_processes": accelerator.num_processes,
              "model": raw}
    summarize(accelerator, "finetune_llm", result)
    accelerator.end_training()
    return result


if __name__ == "__main__":
    try:
        main()
    except NotImplementedError as exc:   # e.g. an NSA path without a GPU backward yet: a message, not a traceback
        raise SystemExit(f"error: {exc}")
