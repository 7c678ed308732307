"""bench/document_mask.py in its self-test mode, so the benchmark never rots: both tables print
every variant, and the per-document kernel it measures is correct (an oracle of its own)."""

import pytest
import torch

from bench import document_mask as bench
from minigpt.documents import document_attention, document_ids_of

pytestmark = pytest.mark.usefixtures("one_thread")


def test_self_test_prints_both_tables(capsys):
    bench.main(["--self-test", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    for start in ("causal ", "dense mask ", "per document ", "flex compiled ", "document_mask "):
        assert any(line.startswith(start) for line in lines), (start, lines)


def test_per_document_kernel_matches_the_dense_mask():
    idx = bench.packed_rows(2, 40, 7)
    ids = document_ids_of(idx, bench.BOS)
    q, k, v = (torch.randn(2, 2, 40, 8) for _ in range(3))
    dense = document_attention(q, k, v, ids, None, None, 0.0,
                               torch.nn.functional.scaled_dot_product_attention)
    torch.testing.assert_close(bench.per_document_attention(q, k, v, ids), dense)


def test_bos_crop_bench_prints_its_table(tmp_path, capsys):
    from bench import bos_crop
    from minigpt.data.prepare import prepare_dataset

    (tmp_path / "a.txt").write_text("one two three\n\nfour five\n\nsix seven eight nine ten\n")
    config = {"name": "tiny", "source": "files", "paths": [str(tmp_path / "a.txt")],
              "tokenizer": "char", "sample_by": "paragraph", "val_split": "document",
              "val_fraction": 0.34, "cache_dir": str(tmp_path / "hf")}
    prepare_dataset(config, tmp_path / "data", progress=False)
    bos_crop.main([str(tmp_path / "data" / "tiny"), "--context", "4", "8"])
    lines = capsys.readouterr().out.splitlines()
    assert "documents" in lines[0]
    rows = [line.split() for line in lines[-4:]]
    assert [(r[0], r[2]) for r in rows] == [("4", "in_order"), ("4", "best_fit"),
                                            ("8", "in_order"), ("8", "best_fit")]
    assert all(r[5] == "0.0%" for r in rows)  # neither packing pads
