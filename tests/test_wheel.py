"""The user's path: build the sdist and, from it, the wheel; install the wheel into a fresh virtualenv; run the
demo and a patched tiny-LLM generate from a directory outside the source tree, importing the INSTALLED package.

CPU-only and offline-friendly (CI budget: well under 90 s): the build runs without isolation (setuptools from this
interpreter), the venv sees this interpreter's packages (torch, diffusers, transformers are not reinstalled) and
the wheel is installed with --no-deps. The source tree is copied first so the build leaves nothing in it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# every file of the package that is not Python: the tiny models, the shipped dispatcher cost tables, ...
DATA = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "sparsepatch").rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts)
EXTRAS = ("train", "notebooks", "test")

pytest.importorskip("setuptools", minversion="70.1",
                    reason="the wheel is built without isolation: needs setuptools >= 70.1 (the Makefile installs it)")


def _env() -> dict:
    """The subprocess environment: no PYTHONPATH (it would put a source tree on sys.path)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def _run(argv, cwd, timeout=240) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in argv], cwd=cwd, env=_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{argv}: rc {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist path, wheel path): the sdist through setuptools' PEP 517 hook (what `python -m build --sdist
    --no-isolation` calls), then the wheel built FROM the sdist by pip, as `python -m build` does, so a file
    missing from the sdist fails here."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "sparsepatch", src / "sparsepatch", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp / "dist"
    _run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(dist)!r})"], src)
    sdist = next(dist.glob("sparsepatch-*.tar.gz"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, sdist], tmp)
    return sdist, next(dist.glob("sparsepatch-*-py3-none-any.whl"))


def test_sdist_and_wheel_carry_the_package_data_and_extras(built):
    sdist, wheel = built
    assert sum(a.startswith("sparsepatch/assets/") for a in DATA) >= 7
    assert any(a.endswith(".safetensors") for a in DATA) and "sparsepatch/kernels/cost_tables/sm90.json" in DATA
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    with zipfile.ZipFile(wheel) as whl:
        files = set(whl.namelist())
        metadata = whl.read(next(n for n in files if n.endswith(".dist-info/METADATA"))).decode()
    for name in DATA:
        assert name in members, f"sdist lacks {name}"
        assert name in files, f"wheel lacks {name}"
        assert whl_size(wheel, name) == (ROOT / name).stat().st_size, name      # not an LFS pointer
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "sparsepatch").rglob("*.py")}
    assert sources <= files, sorted(sources - files)
    assert not any(f.startswith(("tests/", "benchmarks/")) for f in files)
    for extra in EXTRAS:
        assert f"Provides-Extra: {extra}" in metadata, extra
    assert 'Requires-Dist: torchmetrics; extra == "test"' in metadata


def whl_size(wheel, name) -> int:
    with zipfile.ZipFile(wheel) as whl:
        return whl.getinfo(name).file_size


def test_installed_wheel_runs_the_demo_and_a_patched_generate(built, tmp_path):
    _, wheel = built
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path)
                   .stdout.strip())
    # --system-site-packages reaches the BASE interpreter's packages; when this interpreter is itself a venv (the
    # Makefile's), its packages are reached through a .pth line. A plain path line does not run that directory's
    # own .pth files, so an editable install of the source tree there stays invisible.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_sparsepatch_test_parent.pth").write_text("\n".join(sorted(ours)) + "\n")
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index", wheel], tmp_path)

    work = tmp_path / "elsewhere"          # outside the source tree: nothing to import sparsepatch from but the venv
    work.mkdir()
    # the demo reduced to 2 steps at 64 x 64 (128 video tokens): the wiring, not the numbers (tests/test_cli.py)
    demo = _run([py, "-m", "sparsepatch", "demo", "--steps", "2", "--size", "64", "--cpu"], work, timeout=300).stdout
    assert "sparsepatch demo: trained tiny Wan denoiser" in demo
    assert sum(l.startswith("  [run ") for l in demo.splitlines()) == 4 * 2
    assert any(l.startswith("verdict: density") for l in demo.splitlines())

    script = textwrap.dedent("""
        import json, sys
        import torch
        import sparsepatch as sp
        from sparsepatch import cli
        from sparsepatch.recipes import train_tiny_llm

        model, info = train_tiny_llm.load_trained()            # the tiny LLM shipped in the wheel
        ids = torch.tensor([[256] + list(b"def load(path):\\n    with open(")])
        with torch.no_grad():
            dense_logits = model(input_ids=ids).logits
        handle = sp.patch(model, sp.DenseConfig())
        with torch.no_grad():
            patched_logits = model(input_ids=ids).logits
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
        calls = handle.stats()["calls"]
        sp.unpatch(model)
        bench_list, bench_run = cli.main(["bench"]), cli.main(["bench", "skip"])
        print(json.dumps(dict(
            file=sp.__file__, cli=cli.__file__, asset_dir=str(train_tiny_llm.ASSET_DIR), steps=info.get("steps"),
            max_diff=(patched_logits - dense_logits).abs().max().item(), scale=dense_logits.abs().max().item(),
            new_tokens=out.shape[1] - ids.shape[1], vocab_ok=bool(((out >= 0) & (out < 259)).all()), calls=calls,
            bench_list=bench_list, bench_run=bench_run)))
    """)
    res = _run([py, "-c", script], work, timeout=240)
    info = json.loads(res.stdout.strip().splitlines()[-1])
    site = str(purelib.resolve())
    for key in ("file", "cli", "asset_dir"):
        assert str(Path(info[key]).resolve()).startswith(site), (key, info[key], site)
        assert not str(Path(info[key]).resolve()).startswith(str(ROOT)), (key, info[key])
    assert info["steps"] == 200
    # fp32, the same dense attention through another kernel: reordered sums over <= 24 keys, 2 layers; 1e-5 of the
    # logit scale is ~100 eps_fp32 of margin over that rounding
    assert info["max_diff"] <= 1e-5 * info["scale"], info
    assert info["new_tokens"] == 8 and info["vocab_ok"] and info["calls"] > 0
    assert info["bench_list"] == 0                       # the list works from the wheel
    assert info["bench_run"] == 2                        # the scripts ship with the source checkout only
    assert "ship with the source checkout" in res.stderr
