"""bench/gpu_documents.py in its CPU self-test mode, so the GPU check of the document mask
never rots: every variant steps (the masked ones with document ids) and both target lines
print."""

from dataclasses import replace

import torch

from bench import gpu_documents
from minigpt.model import GPTConfig


def test_document_mask_gpu_bench_self_test_prints_its_table():
    torch.set_num_threads(1)
    lines = gpu_documents.run(torch.device("cpu"), repeats=1)
    for start in ("T=32 causal SDPA ", "T=32 document mask ", "T=128 causal SDPA (dense) ",
                  "T=128 document mask ", "T=128 document mask, window 16 ",
                  "target masked step within 1.2x of causal at T=32: ",
                  "target masked + window 16 faster than dense causal at T=128: "):
        assert any(line.startswith(start) for line in lines), (start, lines)


def test_the_masked_variants_step_with_document_ids():
    labels = [(label, fields) for label, _, fields in gpu_documents.cases(1024, 8192, 1024)]
    assert labels[-1] == ("T=8192 document mask, window 1024",
                          {"document_mask": True, "window": 1024})
    masked = [replace(GPTConfig(), **fields).document_mask for _, fields in labels]
    assert masked == [False, True, False, True, True]
