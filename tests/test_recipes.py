"""Fine-tuning recipes on CPU: a few steps in-process (loss, patched calls, checkpoint round trip) and one
`accelerate launch` subprocess."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparsepatch as sp
from kernel_checks import check_bound, denoiser_bound
from sparsepatch.recipes import data, finetune_llm, finetune_video

ROOT = Path(__file__).resolve().parents[1]


def _wan_inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 4, 5, 16, 16, generator=g), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 8, model.config.text_dim, generator=g), return_dict=False)


def loss_bound(loss, step, tokens, layers=2):
    """Two fp32 trainings of a `layers`-block model (one sharded, one not) on the same data: the loss after `step`
    updates is bounded like a (step + 1)-stage computation with attention over `tokens` keys, at its magnitude."""
    return 2 * denoiser_bound(torch.float32, tokens, step + 1, layers, magnitude=abs(loss))


def _assert_losses(result, steps):
    assert len(result["losses"]) == steps and len(result["step_times"]) == steps
    assert all(math.isfinite(x) for x in result["losses"])
    assert math.isfinite(result["final_loss"]) and result["final_loss"] == result["losses"][-1]
    assert all(t > 0 for t in result["step_times"])


def test_procedural_clips_deterministic_and_distinct():
    ds = data.ProceduralClips(length=100, seed=3)
    a, b = ds[7], data.ProceduralClips(length=100, seed=3)[7]
    assert a["latents"].shape == (4, 5, 16, 16) and a["text"].shape == (8, 16)
    assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["text"], b["text"])
    assert not torch.equal(ds[7]["latents"], ds[8]["latents"])
    x = a["latents"]
    assert 0.5 < float(x.std()) < 2.0 and not torch.equal(x[:, 0], x[:, -1])   # unit scale, frames move
    seen = {int(ds[i]["class_id"]) for i in range(100)}
    assert seen == set(range(data.NUM_CLASSES))
    # same class -> same text embedding, other class -> another one
    emb = data.class_text_embeddings(seed=3)
    assert torch.equal(a["text"], emb[int(a["class_id"])])


def test_text_corpus_byte_roundtrip():
    corpus = data.TextCorpus("json", seq_len=64)
    assert len(corpus) > 10 and corpus.tokens.max() < data.VOCAB_SIZE
    item = corpus[1]
    assert item["input_ids"].shape == (64,) and torch.equal(item["input_ids"], item["labels"])
    assert data.decode_bytes(data.encode_bytes("def f(x): return 'é'")) == "def f(x): return 'é'"
    with pytest.raises(ValueError, match="corpus"):
        data.TextCorpus("no_such_package_xyz")


def test_video_dense_and_skip_train_checkpoint(tmp_path):
    steps = 3
    common = ["--max-steps", str(steps), "--batch-size", "2", "--lr", "1e-3", "--log-every", "0", "--seed", "1"]
    dense = finetune_video.main(common + ["--config", "dense"])
    _assert_losses(dense, steps)
    assert dense["attention_calls"] == 0 and dense["density"] == []

    out = tmp_path / "wan"
    skip = finetune_video.main(common + ["--config", "skip-train", "--threshold", "-1", "--output-dir", str(out)])
    _assert_losses(skip, steps)
    layers = finetune_video.MODEL_SIZES["tiny"]["num_layers"]
    # probe policy: per step one no-grad probe forward + one gradient forward through every patched layer
    assert skip["attention_calls"] == steps * layers * 2
    assert len(skip["density"]) == steps and all(0 < d <= 1 for d in skip["density"])
    # step 0 sees the same data and weights in both runs, and a list of density 1 is exactly dense attention
    if skip["density"][0] == 1.0:
        check_bound(abs(skip["losses"][0] - dense["losses"][0]), loss_bound(dense["losses"][0], 0, 5 * 8 * 8),
                    "step-0 loss")

    trained = skip["model"]
    assert sp.handle_of(trained) is None                      # returned (and saved) unpatched
    from diffusers import WanTransformer3DModel
    loaded = WanTransformer3DModel.from_pretrained(out).eval()
    trained.eval()
    with torch.no_grad():
        a = trained(**_wan_inputs(trained))[0]
        b = loaded(**_wan_inputs(loaded))[0]
    assert torch.equal(a, b)
    for (n1, p1), (n2, p2) in zip(trained.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_video_list_refresh_every_step_is_dense_lists():
    # --list-refresh 1 resets before every gradient forward: each one reads full lists (density exactly 1)
    res = finetune_video.main(["--config", "skip", "--max-steps", "2", "--threshold", "-0.5", "--list-refresh",
                               "1", "--log-every", "0"])
    _assert_losses(res, 2)
    assert res["density"] == [1.0, 1.0] and res["attention_calls"] == 2 * 2


def test_llm_dense_checkpoint(tmp_path):
    out = tmp_path / "llama"
    res = finetune_llm.main(["--config", "dense", "--max-steps", "3", "--seq-len", "64", "--lr", "3e-3",
                             "--log-every", "0", "--output-dir", str(out)])
    _assert_losses(res, 3)
    assert res["losses"][-1] < res["losses"][0]
    layers = finetune_llm.MODEL_SIZES["tiny"]["num_hidden_layers"]
    assert res["attention_calls"] == 3 * layers
    trained = res["model"]
    assert sp.handle_of(trained) is None
    from transformers import LlamaForCausalLM
    loaded = LlamaForCausalLM.from_pretrained(out).eval()
    trained.eval()
    ids = data.TextCorpus("json", seq_len=48)[2]["input_ids"][None]
    with torch.no_grad():
        assert torch.equal(trained(ids).logits, loaded(ids).logits)


def test_llm_nsa_trains_learned_gates_and_saves_a_plain_model(tmp_path):
    res = finetune_llm.main(["--config", "nsa", "--max-steps", "3", "--log-every", "0", "--seq-len", "64",
                             "--output-dir", str(tmp_path / "nsa")])
    assert all(math.isfinite(x) for x in res["losses"]) and res["attention_calls"] > 0
    trained = res["model"]
    assert not any("nsa_gate" in n for n, _ in trained.named_parameters())   # gates removed on unpatch


def test_accelerate_launch_video(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), ACCELERATE_DISABLE_RICH="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "2",
           "-m", "sparsepatch.recipes.finetune_video", "--max-steps", "2", "--config", "skip-train",
           "--log-every", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1, proc.stdout[-3000:]
    result = json.loads(summary[0][len("SUMMARY "):])
    assert len(result["losses"]) == 2 and math.isfinite(result["final_loss"])
    assert result["attention_calls"] > 0 and result["num_processes"] == 1


@pytest.mark.parametrize("recipe, config", [(finetune_video, ["--config", "skip-train", "--threshold", "-1"]),
                                            (finetune_llm, ["--config", "nsa"])], ids=["video-skip-train", "llm-nsa"])
def test_ddp_two_processes_match_one_process_with_the_same_global_batch(recipe, config, tmp_path):
    """torchrun x2 (gloo, DDP through accelerate), batch 1 per process == 1 process, batch 2: the data loader shards
    batches (and the video recipe draws its noise for the global batch), so the sparse losses agree step by step."""
    common = config + ["--max-steps", "3", "--lr", "1e-3", "--seed", "1", "--log-every", "0"]
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), ACCELERATE_DISABLE_RICH="1", ACCELERATE_USE_CPU="1",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", recipe.__name__, *common, "--batch-size", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(summary) == 1, proc.stdout[-3000:]
    two = json.loads(summary[0][len("SUMMARY "):])
    one = recipe.main(common + ["--batch-size", "2"])
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert one["attention_calls"] > 0
    if recipe is finetune_video:
        assert min(one["density"]) < 1.0          # the lists really skip tiles
    tokens = 5 * 8 * 8 if recipe is finetune_video else 128          # latents (5, 16, 16) in 2x2 patches / seq-len
    for step, (a, b) in enumerate(zip(two["losses"], one["losses"], strict=True)):
        check_bound(abs(a - b), loss_bound(b, step, tokens), "ddp loss")


def test_fsdp2_two_processes_match_one_process(tmp_path):
    """A patched model in training mode (skip-train) sharded with FSDP2 over 2 CPU processes (gloo) trains exactly
    like one process on the same global batch (accelerate ignores FSDP on CPU, so this uses fully_shard directly)."""
    import importlib.util
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "tests" / "fsdp2_worker.py")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FSDP2 ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    sharded = json.loads(lines[0][len("FSDP2 "):])
    spec = importlib.util.spec_from_file_location("fsdp2_worker", ROOT / "tests" / "fsdp2_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    single = worker.train(1, 0)
    assert len(sharded) == len(single) == 3
    for step, (a, b) in enumerate(zip(sharded, single)):
        check_bound(abs(a - b), loss_bound(b, step, 5 * 8 * 8), "fsdp2 loss")


@pytest.mark.parametrize("name", ["train_tiny_video", "train_tiny_llm"])
def test_tiny_model_training_scripts_record_how_they_ran(name, tmp_path):
    """The scripts that made the committed reference models: 2 steps into tmp_path, the weights load back through
    load_trained and training_info.json records the command, the steps and the losses."""
    import importlib
    script = importlib.import_module(f"sparsepatch.recipes.{name}")
    argv = ["--max-steps", "2", "--batch-size", "2", "--output-dir", str(tmp_path), "--log-every", "0"]
    result = script.main(argv)
    model, info = script.load_trained(tmp_path)
    assert info == json.loads((tmp_path / "training_info.json").read_text()) == result["info"]
    assert info["command"].endswith(" ".join(argv)) and name in info["command"]
    assert info["steps"] == 2 and info["final_loss"] == result["losses"][-1]
    assert math.isfinite(info["final_loss"]) and info["wall_seconds"] > 0
    trained = result["model"]
    for (n1, p1), (n2, p2) in zip(trained.state_dict().items(), model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2.to(p1.dtype))
