"""The trimming rules, by hand: a completion's text tokens (stop token excluded), and the cut
to the first completion columns."""

import numpy as np

from jaxrl4llm.sampling import trim

STOP = 2


def test_text_token_ids_drop_the_stop_token_unless_truncated():
    tokens = np.array(
        [
            [5, 6, STOP, 0],  # stopped after two tokens
            [7, 8, 9, 3],  # truncated: no stop token, every token is text
            [STOP, 0, 0, 0],  # only the stop token: empty text
            [0, 0, 0, 0],
        ]
    )  # no completion (a dropped prompt)
    rows = trim.text_token_ids(
        tokens, np.array([3, 4, 1, 0]), np.array([False, True, False, False])
    )
    assert [None if r is None else r.tolist() for r in rows] == [[5, 6], [7, 8, 9, 3], [], None]


def test_cut_columns_keeps_the_first_columns_of_every_row():
    x = np.arange(24).reshape(2, 4, 3)
    np.testing.assert_array_equal(
        trim.cut_columns(x, 2), [[[0, 1, 2], [3, 4, 5]], [[12, 13, 14], [15, 16, 17]]]
    )
    assert trim.cut_columns(None, 2) is None
