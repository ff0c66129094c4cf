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
