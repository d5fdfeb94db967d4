import numpy as np
import torch

from zerotrain.dataio.format.packing import Packer, best_fit_efficiency, to_torch
from zerotrain.modeling.model import cu_seqlens, document_mask


def docs_source(docs):
    it = iter(docs)

    def next_documents(need):
        out, got = [], 0
        while got < need:
            d = next(it)
            out.append(np.asarray(d, np.int64))
            got += len(d) + 1
        return out
    return next_documents


def test_rows_keep_every_token_once_and_reset_positions():
    docs = [list(range(100 + i * 10, 100 + i * 10 + n)) for i, n in enumerate([3, 7, 1, 12, 5, 9, 2, 30, 4] * 3)]
    packer = Packer(seq_len=8, eos_id=0, micro_batch=2)
    next_doc = docs_source(docs)
    batches = [packer.next_batch(next_doc) for _ in range(5)]
    stream = np.concatenate([b["input_ids"].ravel() for b in batches])
    expected = [t for d in docs for t in d + [0]]
    assert stream.tolist() == expected[:len(stream)]  # order kept, nothing lost or duplicated
    for b in batches:
        for ids, pos in zip(b["input_ids"], b["position_ids"]):
            assert len(ids) == len(pos) == 8 and pos[0] == 0
            for t in range(1, 8):  # positions count up inside a document and restart after EOS
                assert pos[t] == (0 if ids[t - 1] == 0 else pos[t - 1] + 1)


def test_labels_mask_document_starts_and_cu_seqlens():
    packer = Packer(seq_len=6, eos_id=9, micro_batch=2)
    batch = to_torch(packer.next_batch(docs_source([[1, 2], [3, 4, 5], [6, 7, 8, 1, 2, 3]])))
    assert batch["input_ids"].tolist() == [[1, 2, 9, 3, 4, 5], [9, 6, 7, 8, 1, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[-100, 2, 9, -100, 4, 5], [-100, -100, 7, 8, 1, 2]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 6, 7, 12] and batch["max_seqlen"] == 5
    cu, max_len = cu_seqlens(batch["position_ids"])  # derived from positions alone: the same
    assert cu.tolist() == batch["cu_seqlens"].tolist() and max_len == batch["max_seqlen"]
    assert packer.carry.tolist() == [3, 9]  # the rest of the split document comes next


def test_document_mask_is_block_diagonal_causal():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    m = document_mask(pos)[0, 0]
    assert m[2, 0] and m[4, 3] and not m[3, 2] and not m[4, 0] and not m[0, 1]


def test_best_fit_reference_packs_whole_documents():
    eff, rows = best_fit_efficiency([4, 4, 8, 3, 5], seq_len=8)
    assert rows == 3 and eff == 1.0  # [4,4] [8] [3,5]
    eff, rows = best_fit_efficiency([5, 5, 5], seq_len=8, open_rows=1)
    assert rows == 3 and abs(eff - 15 / 24) < 1e-9
