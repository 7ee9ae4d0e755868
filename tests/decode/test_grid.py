"""The grid of a call's slots: right-aligned columns, holes, the device mask, reordering."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from continuous.decode.grid import Grid
from continuous.layout import Rows, interior_holes

PAD = 0


def _rows(ids, mask):
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    n = ids.shape[0]
    return Rows(token_ids=ids, attention_mask=mask, cache=None, texts=("",) * n, ends=((),) * n, logits=None,
                logits_ok=(False,) * n, pad=PAD)


def _check_device_mask(grid):
    _, real = grid.layout()
    assert torch.equal(grid.attention_mask, real)  # the device copy follows the host grid


def test_chunks_are_right_aligned_and_shorter_ones_leave_holes():
    grid = Grid(_rows([[5, 6], [0, 7]], [[1, 1], [0, 1]]), torch.device("cpu"))
    assert not grid.all_real and not grid.holes  # left padding is no hole
    slots, ids = grid.append([[10, 11, 12], [20]], plain=False, rewound=False)
    assert ids == [[10, 11, 12], [PAD, PAD, 20]]
    assert [list(s) for s in slots] == [[0, 1, 2], [2]]
    token_ids, real = grid.layout()
    assert token_ids.tolist() == [[5, 6, 10, 11, 12], [0, 7, PAD, PAD, 20]]
    assert real.tolist() == [[1, 1, 1, 1, 1], [0, 1, 0, 0, 1]]
    assert grid.holes and interior_holes(real)
    assert grid.last_real.tolist() == [[True] * 3, [False, False, True]]
    _check_device_mask(grid)


def test_a_row_with_no_token_ends_in_a_trailing_hole_only():
    grid = Grid(_rows([[5, 6], [7, 8]], [[1, 1], [1, 1]]), torch.device("cpu"))
    assert grid.all_real
    grid.append([[10], []], plain=False, rewound=False)
    _, real = grid.layout()
    assert real.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert not grid.all_real and not grid.holes
    _check_device_mask(grid)


def test_a_plain_step_keeps_the_grid_all_real():
    grid = Grid(_rows([[5], [6]], [[1], [1]]), torch.device("cpu"))
    for step in range(3):
        slots, _ = grid.append([[10 + step], [20 + step]], plain=True, rewound=False)
        assert [list(s) for s in slots] == [[step], [step]]
    assert grid.all_real and not grid.holes
    assert grid.layout()[0].tolist() == [[5, 10, 11, 12], [6, 20, 21, 22]]
    _check_device_mask(grid)


def test_a_rewound_slot_becomes_a_hole_everywhere():
    grid = Grid(_rows([[5], [6]], [[1], [1]]), torch.device("cpu"))
    grid.append([[10, 11], [20, 21]], plain=False, rewound=False)
    grid.hole_at(0, 1)
    grid.append([[12], [22]], plain=False, rewound=True)
    token_ids, real = grid.layout()
    assert token_ids[0].tolist() == [5, 10, PAD, 12]
    assert real.tolist() == [[1, 1, 0, 1], [1, 1, 1, 1]]
    assert grid.holes and not grid.all_real
    _check_device_mask(grid)


def test_a_frozen_grid_keeps_its_slots_whatever_the_grid_does_after():
    grid = Grid(_rows([[5], [6]], [[1], [1]]), torch.device("cpu"))
    grid.append([[10, 11], [20, 21]], plain=False, rewound=False)
    frozen = grid.frozen()
    before = [t.tolist() for t in frozen.layout()]
    grid.hole_at(0, 1)  # a rewind after the freeze
    grid.append([[12], [22]], plain=False, rewound=True)
    grid.drop_empty_tail()
    assert [t.tolist() for t in frozen.layout()] == before == [[[5, 10, 11], [6, 20, 21]], [[1, 1, 1], [1, 1, 1]]]
    assert grid.layout()[0][0].tolist() == [5, 10, PAD, 12]


def test_reorder_moves_every_row_of_the_grid():
    grid = Grid(_rows([[5, 6], [0, 7]], [[1, 1], [0, 1]]), torch.device("cpu"))
    grid.append([[10, 11], [20]], plain=False, rewound=False)
    before_ids, before_real = grid.layout()
    order = [1, 1, 0]
    grid.select(order, torch.tensor(order))
    ids, real = grid.layout()
    assert torch.equal(ids, before_ids[order]) and torch.equal(real, before_real[order])
    _check_device_mask(grid)


def test_a_token_after_a_trailing_hole_makes_the_hole_interior():
    grid = Grid(_rows([[5, 6], [7, 8]], [[1, 1], [1, 1]]), torch.device("cpu"))
    grid.append([[10], []], plain=False, rewound=False)  # row 1 now ends in a hole
    assert not grid.holes
    grid.append([[11], [20]], plain=False, rewound=False)
    assert grid.holes and interior_holes(grid.layout()[1])


def test_a_row_cut_shorter_before_the_call_ends_in_a_hole():
    grid = Grid(_rows([[5, 6, 7], [8, 0, 0]], [[1, 1, 1], [1, 0, 0]]), torch.device("cpu"))
    assert not grid.holes
    grid.append([[10], [20]], plain=True, rewound=False)
    assert grid.holes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.lists(st.integers(1, 99), max_size=2), min_size=3, max_size=3), min_size=1, max_size=6),
       st.lists(st.booleans(), min_size=3, max_size=3))
def test_any_run_of_appends_keeps_the_device_mask_and_the_flags_true_to_the_host_grid(steps, padded):
    """Steps of one token per row take their own path: it must agree with the general one."""
    grid = Grid(_rows([[0 if p else 5, 6] for p in padded], [[0 if p else 1, 1] for p in padded]),
                torch.device("cpu"))
    expected = [[] for _ in range(3)]
    for chunks in steps:
        n = len(grid.columns)
        width = max(map(len, chunks))
        slots, ids = grid.append(chunks, plain=False, rewound=False)
        assert [list(s) for s in slots] == [list(range(n + width - len(c), n + width)) for c in chunks]
        assert ids == [[PAD] * (width - len(c)) + c for c in chunks]
        for row, own in zip(expected, ids):
            row.extend(own)
        token_ids, real = grid.layout()
        assert token_ids[:, 2:].tolist() == expected
        assert grid.all_real == bool(real.all())
        assert grid.holes == interior_holes(real)
        assert grid.trailing == [not r[-1] for r in real.tolist()]
        _check_device_mask(grid)
