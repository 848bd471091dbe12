"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over a patched tiny Wan in training mode, for tests/test_recipes.py.

    torchrun --nproc-per-node 2 tests/fsdp2_worker.py   # prints "FSDP2 <json losses>" on rank 0
    python tests/fsdp2_worker.py                         # prints "SINGLE <json losses>"

Same global batch of 2 clips per step either way (each rank takes its row); SkipConfig(backward=True) with a probe
forward per step, as the video recipe does; losses are averaged over ranks.
"""
import json
import os

import torch
import torch.distributed as dist

import sparsepatch as sp
from sparsepatch.recipes import finetune_video
from sparsepatch.recipes.data import ProceduralClips


def train(world: int, rank: int, steps: int = 3) -> list[float]:
    torch.manual_seed(1)
    model = finetune_video.build_model("tiny")
    handle = sp.patch(model, sp.SkipConfig(threshold=-1.0, warmup_steps=0, tile=(16, 16), backward=True))
    if world > 1:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = ProceduralClips(length=64, frames=5, size=16, channels=4, text_len=8, text_dim=model.config.text_dim,
                           seed=1)
    gen = torch.Generator().manual_seed(7)
    losses = []
    for step in range(steps):
        batch = [data[2 * step + i] for i in range(2)]
        x0 = torch.stack([b["latents"] for b in batch])
        text = torch.stack([b["text"] for b in batch])
        xt, timestep, target = finetune_video.flow_matching_inputs(x0, gen)
        if world > 1:
            rows = slice(rank, rank + 1)
            xt, timestep, target, text = xt[rows], timestep[rows], target[rows], text[rows]
        handle.reset()
        with torch.no_grad():
            model(hidden_states=xt, timestep=timestep, encoder_hidden_states=text, return_dict=False)
        pred = model(hidden_states=xt, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


if __name__ == "__main__":
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        losses = train(dist.get_world_size(), dist.get_rank())
        if dist.get_rank() == 0:
            print("FSDP2 " + json.dumps(losses), flush=True)
        dist.destroy_process_group()
    else:
        print("SINGLE " + json.dumps(train(1, 0)), flush=True)
