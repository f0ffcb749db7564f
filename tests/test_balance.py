"""Balancing at placement: tokens reordered once, positions carried along."""

import numpy as np

from shardkit.balance import balance_batch, zigzag_order


def test_packed_rows_without_positions_keep_the_positions_of_their_documents():
    # Two documents (3 and 4 tokens) and one padding token: positions 0 1 2 | 0 1 2 3 | 0,
    # by hand, wherever the zigzag moves the tokens.
    ids = np.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    tokens = np.arange(8)[None]
    order = zigzag_order(8, 2)
    out = balance_batch({"inputs": tokens, "targets": tokens, "segment_ids": ids}, order)
    assert (out["inputs"] == tokens[:, order]).all()
    assert (out["segment_ids"] == ids[:, order]).all()
    assert (out["positions"] == np.array([[0, 1, 2, 0, 1, 2, 3, 0]])[:, order]).all()


def test_one_document_per_row_gets_its_places_as_positions():
    tokens = np.arange(8)[None]
    order = zigzag_order(8, 2)
    out = balance_batch({"inputs": tokens, "targets": tokens}, order)
    assert (out["positions"] == order[None]).all() and (out["segment_ids"] == 1).all()
