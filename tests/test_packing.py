import torch

from dataio.packing import Packer, collate, cu_seqlens
from modeling.model import document_mask


def docs_source(docs):
    it = iter(docs)
    return lambda: list(next(it))


def test_rows_keep_every_token_once_and_reset_positions():
    docs = [list(range(100 + i * 10, 100 + i * 10 + n)) for i, n in enumerate([3, 7, 1, 12, 5, 9, 2, 30, 4])]
    packer = Packer(seq_len=8, eos_id=0)
    next_doc = docs_source(docs)
    rows = [packer.next_row(next_doc) for _ in range(10)]
    stream = [t for ids, _ in rows for t in ids]
    expected = [t for d in docs for t in d + [0]]
    consumed = len(stream) - len(packer.carry) if packer.carry else len(stream)
    assert stream[:consumed] == expected[:consumed]  # order kept, nothing lost or duplicated
    for ids, pos in rows:
        assert len(ids) == len(pos) == 8
        assert pos[0] == 0
        for t in range(1, 8):  # positions count up inside a document and restart after EOS
            assert pos[t] == (0 if ids[t - 1] == 0 else pos[t - 1] + 1)


def test_labels_mask_document_starts_and_cu_seqlens():
    packer = Packer(seq_len=6, eos_id=9)
    next_doc = docs_source([[1, 2], [3, 4, 5], [6, 7, 8, 1, 2, 3]])
    batch = collate([packer.next_row(next_doc), packer.next_row(next_doc)])
    assert batch["input_ids"].tolist() == [[1, 2, 9, 3, 4, 5], [9, 6, 7, 8, 1, 2]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4]]
    assert batch["labels"].tolist() == [[-100, 2, 9, -100, 4, 5], [-100, -100, 7, 8, 1, 2]]
    cu, max_len = cu_seqlens(batch["position_ids"])
    assert cu.tolist() == [0, 3, 6, 7, 12] and max_len == 5


def test_document_mask_is_block_diagonal_causal():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    m = document_mask(pos)[0, 0]
    assert m[2, 0] and m[4, 3] and not m[3, 2] and not m[4, 0] and not m[0, 1]


def test_packer_state_round_trip():
    docs = [[i] * (i % 11 + 1) for i in range(1, 200)]
    served = []

    def next_doc():
        served.append(len(served))
        return list(docs[served[-1]])

    a = Packer(seq_len=7, eos_id=0)
    for _ in range(5):
        a.next_row(next_doc)
    state, n_served = a.state_dict(), len(served)
    expected = [a.next_row(next_doc) for _ in range(5)]
    b = Packer(seq_len=7, eos_id=0)
    b.load_state_dict(state)
    rest = iter(docs[n_served:])
    assert [b.next_row(lambda: list(next(rest))) for _ in range(5)] == expected
