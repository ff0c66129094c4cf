"""Tagged point-to-point messages (partial reduce's transport): their bytes count when
they are posted, not when their completion is seen, which may be epochs later."""
from __future__ import annotations

import pytest
import torch
from harness import run_ranks

from fullgraph.comm.tagged import post_recv, post_send


def _posted_world(comm) -> None:
    phase = "partial-update"
    if comm.rank == 0:
        message = post_send(torch.ones(1000), 1, 91, comm, phase)
        posted = comm.counter.snapshot()[phase]
        assert (posted["sent"], posted["calls"]) == (4000, 0), posted
        message.wait()
        done = comm.counter.snapshot()[phase]
        assert (done["sent"], done["recv"], done["calls"]) == (4000, 0, 1), done
    else:
        message = post_recv((1000,), torch.float32, 0, 91, comm, phase)
        message.wait()
        done = comm.counter.snapshot()[phase]
        assert (done["sent"], done["recv"], done["calls"]) == (0, 4000, 1), done


@pytest.mark.dist
def test_a_tagged_send_counts_its_bytes_when_posted(tmp_path):
    run_ranks(_posted_world, 2, tmp_path)


def test_the_link_probe_is_not_run_where_messages_are_not_matched_by_tag(monkeypatch):
    """``--adapt adjust`` on 3+ NCCL workers posted the probe's receives, then its sends,
    one by one: a pattern NCCL deadlocks on. The probe refuses such a backend, and the
    adjuster prices every peer's link alike there instead."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from fullgraph.adapt.adjuster import OnlineAdjuster
    from fullgraph.comm import tagged
    from fullgraph.comm.group import Comm

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    comm = Comm(rank=0, world_size=3, group=object())
    assert not tagged.tagged_messages(comm)
    with pytest.raises(ValueError, match="probe_links needs messages matched by tag"):
        tagged.probe_links(comm, 1024)
    monkeypatch.setattr(tagged, "probe_links", lambda *a, **k: pytest.fail("probed"))
    adjuster = OnlineAdjuster.__new__(OnlineAdjuster)
    assert OnlineAdjuster.per_owner(adjuster, SimpleNamespace(comm=comm), 1e-9) is None
