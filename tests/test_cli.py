"""`python -m sparsepatch demo | validate | bench`: help texts, distinct commands, the benchmark list, exit codes,
the validate command on saved tiny models, and the demo's output (progress, labels, verdict)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparsepatch import cli

ROOT = Path(__file__).resolve().parent.parent


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _options(help_text: str) -> dict:
    """{"--option": its help text} from an argparse help screen (continuation lines joined)."""
    section = help_text.split("options:", 1)[1]
    out, current = {}, None
    for line in section.splitlines():
        m = re.match(r"^  (-\w, )?(--[\w-]+)( [A-Z_]+)?\s*(.*)$", line)
        if m:
            current = m.group(2)
            out[current] = m.group(4)
        elif current and line.startswith("      "):
            out[current] += " " + line.strip()
    return {k: re.sub(r"\s+", " ", v).strip() for k, v in out.items()}


@pytest.mark.parametrize("command", ["demo", "validate"])
def test_every_option_has_help_and_shows_its_default(capsys, command):
    opts = _options(_help(capsys, command))
    sub = cli.build_parser()._subparsers._group_actions[0].choices[command]
    actions = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(actions) >= 10
    for action in actions:
        name = action.option_strings[-1]
        assert opts.get(name), f"{command} {name} has no help"
        if action.default not in (None, False):
            assert f"(default: {action.default})" in opts[name], (name, opts[name])
        elif action.default is None and name not in ("--json", "--plot", "--call", "--negative-prompt"):
            # no argparse default: the help says what happens instead (a model-dependent value, "the config's")
            assert "default" in opts[name], (name, opts[name])


def test_demo_help_names_defaults_and_cpu(capsys):
    opts = _options(_help(capsys, "demo"))
    assert "(default: 100.0)" in opts["--attention-gain"]
    assert "CPU" in opts["--cpu"]
    tr = cli.DEMO_DEFAULTS["trained"]
    assert f"default {tr['steps']} ({cli.DEMO_CPU['trained']['steps']} on a CPU)" in opts["--steps"]
    assert f"default {tr['threshold']}" in opts["--threshold"] and "default 64" in opts["--tile"]


def test_demo_and_validate_are_distinct_commands(capsys):
    demo, validate = _help(capsys, "demo"), _help(capsys, "validate")
    assert "MODEL_DIR" in validate and "MODEL_DIR" not in demo
    assert "--config" in validate and "--config" not in demo
    parser = cli.build_parser()
    assert parser.parse_args(["demo"]).fn is cli.demo
    assert parser.parse_args(["validate", "somewhere"]).fn is cli.validate_cmd
    top = _help(capsys)
    lines = {c: next(l for l in top.splitlines() if l.strip().startswith(c + " ")) for c in ("demo", "validate")}
    assert lines["demo"].split(None, 1)[1] != lines["validate"].split(None, 1)[1]
    with pytest.raises(SystemExit) as exc:        # validate needs a model directory
        cli.main(["validate"])
    assert exc.value.code == 2
    assert "MODEL_DIR" in capsys.readouterr().err


def test_bench_table_matches_the_scripts():
    scripts = sorted(p.stem[len("bench_"):] for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert sorted(cli.BENCHES) == scripts
    for name, (line, need) in cli.BENCHES.items():
        assert 20 < len(line) < 110 and need in (None, "cuda", "sm_90", "torchrun"), name


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--help"], ["bench", "-h"]])
def test_bench_without_a_name_lists_the_benchmarks(capsys, argv):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for name, (line, _) in cli.BENCHES.items():
        assert re.search(rf"^  {name}\s+{re.escape(line)}", out, flags=re.M), name
    assert "bench <name> --help" in out


def test_bench_unknown_name_lists_and_fails(capsys):
    assert cli.main(["bench", "no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no_such_bench'" in err and "skip" in err


def test_bench_help_is_the_benchmarks_own_with_a_proper_prog():
    out = subprocess.run([sys.executable, "-m", "sparsepatch", "bench", "skip", "--help"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage: python -m sparsepatch bench skip [-h]")
    assert "--quick" in out.stdout and "__main__.py" not in out.stdout


def test_bench_help_in_process_restores_argv(capsys):
    argv0 = sys.argv[0]
    assert cli.main(["bench", "wan_step", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m sparsepatch bench wan_step")
    assert sys.argv[0] == argv0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA exit")
def test_bench_that_cannot_run_here_exits_nonzero_with_why(capsys, monkeypatch):
    assert cli.main(["bench", "skip", "--quick"]) == cli.EXIT_CANNOT_RUN_HERE != 0
    err = capsys.readouterr().err
    assert "cannot run here" in err and "CUDA" in err
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["bench", "parallel_step"]) == cli.EXIT_CANNOT_RUN_HERE
    assert "torchrun" in capsys.readouterr().err


def test_compile_notice_only_on_cuda(monkeypatch):
    import torch
    assert cli.compile_notice("cpu") is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/cache")
    notice = cli.compile_notice("cuda")
    assert notice.startswith("compiling sparsepatch kernels for sm_90, once per machine")
    assert "/somewhere/cache" in notice


def test_build_config():
    import sparsepatch as sp
    assert cli.build_config("auto") is None
    assert cli.build_config("skip", threshold=-5, tile=16) == sp.SkipConfig(threshold=-5.0, tile=(16, 16))
    assert cli.build_config('{"type": "nsa", "block_size": 16, "window": 32}') == sp.NSAConfig(block_size=16,
                                                                                                 window=32)
    assert cli.build_config('{"type": "skip", "tile": [32, 32]}', threshold=-2) == sp.SkipConfig(-2.0, tile=(32, 32))
    with pytest.raises(ValueError, match="--threshold / --warmup / --tile apply to --config skip"):
        cli.build_config("dense", threshold=-5)
    with pytest.raises(ValueError, match="--config"):
        cli.build_config("sparse-please")
    with pytest.raises(ValueError, match="type"):
        cli.build_config('{"threshold": -5}')
    with pytest.raises(ValueError, match="--config skip"):
        cli.build_config('{"type": "skip", "thresh": -5}')


def test_validate_cli_on_a_saved_pipeline(tmp_path, capsys):
    """A tiny WanPipeline saved with save_pretrained, validated from its directory: report JSON + plot, SSIM in
    pixel space (the pipeline decodes), density below 1 once the lists are read."""
    from sparsepatch.testing import tiny_wan_pipeline
    tiny_wan_pipeline(head_dim=32, attention_gain=100.0).save_pretrained(tmp_path / "pipe")
    out = tmp_path / "report"
    rc = cli.main(["validate", str(tmp_path / "pipe"), "--config", "skip", "--threshold", "-3", "--tile", "16",
                   "--warmup", "0", "--steps", "2", "--height", "96", "--width", "96", "--frames", "9", "--no-speed",
                   "--call", '{"max_sequence_length": 16}', "--out", str(out), "--cpu"])
    text = capsys.readouterr().out
    assert rc == 0
    data = json.loads((out / "report.json").read_text())
    assert "threshold=-3.0" in data["config"] and "tile=(16, 16)" in data["config"]
    dens = [r["density"] for r in data["per_step"]]
    assert len(dens) == 2 and dens[0] == 1.0 and dens[-1] < 0.95      # step 0 builds the lists, step 1 reads them
    assert data["ssim_space"] == "pixel" and 0.0 < data["output_ssim"] <= 1.0
    assert data["speedup"] is None and data["device"] == "cpu"
    assert (out / "report.png").stat().st_size > 1000
    assert text.count("[run ") == 2 * 2                     # one progress line per step, 2 runs without timing
    assert "verdict: density" in text and "SSIM" in text


def test_validate_cli_on_a_saved_llm_with_a_json_config(tmp_path, capsys):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
                     ).save_pretrained(tmp_path / "llm")
    cfg = tmp_path / "nsa.json"
    cfg.write_text(json.dumps({"type": "nsa", "block_size": 16, "num_selected": 2, "window": 32,
                               "compress_block": 16, "compress_stride": 8}))
    rc = cli.main(["validate", str(tmp_path / "llm"), "--config", str(cfg), "--seq-len", "128", "--no-speed",
                   "--out", str(tmp_path / "out"), "--cpu"])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["config"].startswith("NSAConfig(block_size=16")
    assert data["output_ssim"] is None and data["ssim_space"] is None          # logits are not images
    assert 0.9 < data["output_cos"] <= 1.0 and math.isfinite(data["output_psnr_db"])
    assert set(data["density"]) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert "transformers" in data["backends"]["dense"]


def test_validate_cli_rejects_what_it_cannot_load(tmp_path, capsys):
    assert cli.main(["validate", str(tmp_path), "--cpu"]) == 2
    assert "model_index.json" in capsys.readouterr().err
    assert cli.main(["validate", str(tmp_path), "--config", "dense", "--threshold", "-5"]) == 2
    assert "--config skip" in capsys.readouterr().err


def test_demo_prints_progress_labels_and_a_verdict():
    """The trained tiny model at a small size: a progress line per step of each of the 4 runs, warm-up steps
    "identical", timings labelled with device and backends, no speed ratio on CPU, and the verdict line."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-m", "sparsepatch", "demo", "--steps", "4", "--size", "64", "--cpu"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    progress = [l for l in lines if l.startswith("  [run ")]
    assert len(progress) == 4 * 4
    assert [int(re.search(r"step +(\d+)/4", l).group(1)) for l in progress] == [1, 2, 3, 4] * 4
    table = [l for l in lines if re.match(r"^ +\d+ +[01]\.\d{3} ", l)]
    assert len(table) == 4
    assert all("identical" in l for l in table[:2])            # the 2 dense warm-up steps
    assert re.search(r" \d+\.\d\d +[01]\.\d{4} ", table[3])     # a sparse step: PSNR dB and SSIM numbers
    timing = next(l for l in lines if l.startswith("time on cpu"))
    assert "[diffusers attention" in timing and "[sparsepatch" in timing and "x" not in timing.split("]")[-1]
    assert "quality check; speed is measured on a GPU: see BENCHMARKS.md" in lines
    verdict = next(l for l in lines if l.startswith("verdict: "))
    assert re.match(r"verdict: density 0\.\d\d after warm-up, output PSNR \d+\.\d\d dB, SSIM 0\.\d{4} \(latent\), "
                    r"speed not measured on cpu$", verdict), verdict
