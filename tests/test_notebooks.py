"""The quality-vs-speed notebooks run headless (nbclient) with small parameters, show their figures inline
(image/png outputs: no backend forced, so Jupyter's inline backend renders them) and their results as tables
(text/markdown), save their figures and report finite numbers. Parameters are injected by replacing the source
of the cell tagged "parameters"."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install nbclient nbformat ipykernel)")
nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install nbformat)")
pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install ipykernel)")
pytest.importorskip("matplotlib", reason="matplotlib not installed")
pytest.importorskip("diffusers", reason="diffusers not installed")
pytest.importorskip("transformers", reason="transformers not installed")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

VIDEO_PARAMS = """
import os
MODEL = "tiny-trained"
MODEL_PATH = os.environ.get("SPARSEPATCH_NB_VIDEO_MODEL")   # None: the committed assets
THRESHOLDS = [-2.0, -6.0]
STEPS = 4
WARMUP_STEPS = 1
TILE = (32, 32)
BATCH = 1
FRAMES = 3
LATENT_SIZE = 16
PROMPT = ""
SEED = 0
PROFILE_STEP = 2
GPU_RESULTS = None
OUT_DIR = os.environ["SPARSEPATCH_NB_OUT"]
"""

LLM_PARAMS = """
import os
MODEL_PATH = None
SEQ_LEN = 128
BATCH = 1
NUM_BATCHES = 1
CONFIGS = [dict(block_size=16, num_selected=2, window=32, compress_block=16, compress_stride=8)]
REPEATS = 1
SEED = 0
OUT_DIR = os.environ["SPARSEPATCH_NB_OUT"]
"""


def _run(name: str, params: str, out_dir: Path, monkeypatch) -> dict:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{name} is committed with outputs"
    # a backend forced inside a notebook (matplotlib.use("Agg")) stops Jupyter from showing figures inline
    assert not any(re.search(r"matplotlib\.use\(|switch_backend|MPLBACKEND", c.source) for c in nb.cells), name
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{name}: expected one cell tagged 'parameters'"
    # every name the notebook's own parameter cell sets is set by the test too (a renamed parameter fails here)
    names = set(re.findall(r"^([A-Z_]+) =", cells[0].source, flags=re.M))
    assert names <= set(re.findall(r"^([A-Z_]+) =", params, flags=re.M)), names
    cells[0].source = params
    monkeypatch.setenv("SPARSEPATCH_NB_OUT", str(out_dir))
    # as in Jupyter: the kernel picks matplotlib's inline backend itself unless MPLBACKEND overrides it
    monkeypatch.delenv("MPLBACKEND", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(out_dir)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{name}: no figure shown inline (no image/png output)"
    tables = [o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert any(t.startswith("| ") and "\n|---|" in t for t in tables), f"{name}: no results table (text/markdown)"
    return json.loads((out_dir / "results.json").read_text()), len(images)


def _finite(*values):
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_video_notebook(tmp_path, monkeypatch):
    res, images = _run("quality_vs_speed_video.ipynb", VIDEO_PARAMS, tmp_path, monkeypatch)
    assert images == 6                  # the plots cell's 4 figures, the GPU curve, the attention distances
    for png in ("density_vs_step.png", "psnr_pareto.png", "per_layer_cos.png", "validate_report.png",
                "gpu_curve.png", "attention_distance.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
    rows = res["rows"]
    assert [r["threshold"] for r in rows] == [-2.0, -6.0]
    for r in rows:
        assert len(r["density_per_step"]) == 4
        assert all(0 < d <= 1 for d in r["density_per_step"])
        assert r["density_per_step"][0] == 1.0            # warmup step: dense
        assert _finite(r["output_cos"], r["dense_ms_per_step"], r["patched_ms_per_step"], r["attn_cos_min"])
        assert r["psnr_db"] > 0 and not math.isnan(r["psnr_db"])     # +inf only if bit-identical
        assert r["output_cos"] > 0.9
        assert r["ssim_space"] == "latent" and 0 < r["ssim"] <= 1     # the trained sampler returns latents
    # a lower threshold keeps more tiles
    assert rows[1]["density_mean"] >= rows[0]["density_mean"] - 1e-9
    assert isinstance(res["verdict"]["met"], bool)
    # the GPU rows come from a committed JSON (the sweep, else the probe), whatever machine runs the notebook
    assert res["gpu_rows"] and {r["tile"][0] for r in res["gpu_rows"]} >= {64, 128}
    # the distance profiles of the model's 4 layers and of video_like_qkv, on the notebook's 3 x 8 x 8 token grid
    assert len(res["profiles"]) == 5 and "video_like_qkv" in res["profiles"]
    for prof in res["profiles"].values():
        assert len(prof["temporal"]["mass"]) == 3
        assert abs(sum(prof["temporal"]["mass"]) - 1) < 4 * 2.0 ** -23            # fp32 softmax rows, 4 eps
    assert all(0 < c["32"]["density"][1] <= 1 for c in res["coverage"].values())


def test_llm_notebook(tmp_path, monkeypatch):
    res, images = _run("quality_vs_speed_llm.ipynb", LLM_PARAMS, tmp_path, monkeypatch)
    assert images == 2
    for png in ("ppl_vs_speed.png", "loss_gap.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
    rows = res["rows"]
    assert len(rows) == 2 and rows[0]["name"].startswith("dense")
    for r in rows:
        assert _finite(r["loss"], r["ppl"], r["ms_per_prefill"], r["logit_cos"], r["attended_fraction"])
        assert 0 < r["loss"] < 6 and r["ms_per_prefill"] > 0
    assert rows[1]["logit_cos"] > 0.9
