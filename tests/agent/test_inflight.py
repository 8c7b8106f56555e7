"""What a final dump reads of a periodic commit in flight: its end at its rate so far, and what it saw change."""

from __future__ import annotations

import pytest
from spotcr_agent.deadline import GiB, MiB
from spotcr_agent.inflight import MEASURED_BYTES, Commit

PARENT = "1700000000000-g1-s1-periodic"
FROZEN = "1700000030000-g1-s2-periodic"  # 30 s after its parent


def test_a_commit_ends_at_its_rate_since_its_first_figures_once_it_has_cut_enough():
    # Given a commit of 4 GiB whose first figures came 1 s in (its parent's chunks listed), at 100 MiB
    def at(seconds: float, done: int) -> Commit:
        return Commit(FROZEN, PARENT, 1000.0, 100 * MiB, 1000.0 + seconds, done, 4 * GiB, done // 2)

    # Then before it has cut MEASURED_BYTES more, nothing is said of its end or of what changed
    early = at(0.5, 100 * MiB + MEASURED_BYTES - 1)
    assert early.ends_at() is None
    # And after 2 s more at 512 MiB a second, it ends when the rest is cut at that rate
    later = at(2.0, 100 * MiB + 1024 * MiB)
    rest = 4 * GiB - later.done
    assert later.ends_at() == pytest.approx(1002.0 + rest / (512 * MiB))
    # And half of what it hashed changed in the 30 s since its parent: 1/60 of the job a second
    assert later.dirty_per_s() == pytest.approx(0.5 / 30)
    # And a commit with no parent says nothing of the job's dirtying
    assert Commit(FROZEN, None, 1000.0, 0, 1002.0, GiB, GiB, GiB).dirty_per_s() is None
