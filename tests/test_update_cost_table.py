"""benchmarks/update_cost_table.py: re-measured cells replace a table's ms backend by backend."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from update_cost_table import merge  # noqa: E402


def _entry(Sq, ms, causal=True):
    return dict(op="attention", causal=causal, D=128, group=1, dtype="bfloat16", B=1, Sq=Sq, Sk=Sq, Hq=32, ms=ms)


def test_merge_replaces_measured_backends_keeps_the_rest_and_adds_new_cells():
    table = {"entries": [_entry(4096, {"flash_triton": 1.0, "sdpa_cudnn": 0.9, "splitd_triton": 2.0})]}
    changed = merge(table, [_entry(4096, {"flash_triton": 0.8, "sdpa_cudnn": 0.95}), _entry(8192, {"sdpa": 3.0})])
    assert table["entries"][0]["ms"] == {"flash_triton": 0.8, "sdpa_cudnn": 0.95, "splitd_triton": 2.0}
    assert table["entries"][1]["Sq"] == 8192 and table["entries"][1]["ms"] == {"sdpa": 3.0}
    cells = [c for c, _, _ in changed]
    assert [(c[5], b, a) for c, b, a in changed] == [(1, "sdpa_cudnn", "flash_triton"), (1, None, "sdpa")]
    assert len(cells) == 2
    assert merge(table, [_entry(4096, {"flash_triton": 0.7})]) == []        # fastest unchanged: nothing reported


def test_merge_keeps_head_major_cells_apart():
    """An entry's layout ("seq" when absent, "head") is part of its cell: a head-major measurement never overwrites
    the sequence-major one of the same shape, and a new head-major cell keeps its layout."""
    table = {"entries": [_entry(4096, {"flash_triton": 1.0, "sdpa_cudnn": 0.9})]}
    merge(table, [dict(_entry(4096, {"flash_triton": 0.8, "sdpa_cudnn": 0.95}), layout="head")])
    assert table["entries"][0]["ms"] == {"flash_triton": 1.0, "sdpa_cudnn": 0.9}
    assert table["entries"][1]["layout"] == "head" and table["entries"][1]["ms"]["flash_triton"] == 0.8
    merge(table, [dict(_entry(4096, {"sdpa": 0.5}), layout="head")])
    assert len(table["entries"]) == 2 and table["entries"][1]["ms"]["sdpa"] == 0.5
