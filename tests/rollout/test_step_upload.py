"""StepUpload: parts added on the host land in one copy, each handed its own slice in order."""

from __future__ import annotations

import pytest
import torch

from tlt.bench.transfer_count import count_transfers
from tlt.rollout.step_upload import StepUpload


def test_parts_travel_in_one_copy_and_land_in_order():
    up, got = StepUpload("cpu"), []
    up.add([1, 2, 3, 4, 5, 6], (2, 3), lambda t: got.append(("table", t.clone())))
    up.add([7, 8], (2,), lambda t: got.append(("rows", t.clone())))
    assert up.pending
    with count_transfers() as c:
        up.flush()
        up.flush()  # nothing pending: no copy
    assert (c.uploads, c.total, up.flushes, up.pending) == (1, 1, 1, False)
    assert [name for name, _ in got] == ["table", "rows"]
    assert got[0][1].tolist() == [[1, 2, 3], [4, 5, 6]] and got[1][1].tolist() == [7, 8]
    assert got[0][1].dtype == torch.long


def test_a_part_must_fill_its_shape():
    with pytest.raises(ValueError, match="do not fill the shape"):
        StepUpload("cpu").add([1, 2, 3], (2, 2), lambda t: None)
