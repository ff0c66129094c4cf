"""Communicator sub-groups: ``Comm.split`` / ``Comm.subgroup`` and their byte counters.

Task parallelism places some stages on one set of workers and others on another;
each set talks among itself through a child ``Comm`` made here::

    sub = world.split([[0], [1, 2, 3]], names=["T", "P"])  # every world rank calls it
    # world rank 0: sub.name == "T", world_size 1; ranks 1..3: "P", ranks 0..2

Rules:

- ``split`` is called on the world Comm by every world rank, with the same groups
  (lists of world ranks, pairwise disjoint) in the same order: torch.distributed
  creates a process group collectively over the whole world, members or not. The
  arguments are compared across ranks first (one small ``all_gather_object`` counted
  under the world's phase "comm-init"), so a mismatch is one ValueError on every rank
  instead of a hang. Sub-groups of sub-groups are refused: split the world instead.
- A rank in no group gets None; the others get a child whose ``rank`` is its position
  in its group's list (the list's order, not sorted), ``world_size`` the list's length,
  ``global_ranks`` the list itself, and the world's timeout, device, backend and
  ``p2p_all_to_all``. A group of one rank gets ``group=None``: like ``single_comm`` it
  never calls torch.distributed (no process group is made for it on any rank).
- Where the world exchanges through shared memory (``Comm.shm``), each child of two
  or more ranks opens its own (collective among its members only; its calls are
  counted under the world's "comm-init").
- Every primitive and placement pair takes a child as it takes the world: ranks,
  ``src`` and block indices are group ranks; p2p calls translate them to world ranks.
  A timeout or failure raises CommError "rank r of R in group 'P' (global rank g)".
- Bytes: the child's counter is a ``GroupCounter`` that records into the world's
  counter under "<name>/<phase>" (so a rank's profile still sees all its traffic) and
  reads back its own phases without the prefix (``sub.counter.snapshot()``).
- Default names are "g" and the ranks joined by "-" ("g1-2-3"); names are unique and
  contain no "/".
- ``destroy_comm(sub)`` frees one sub-group; destroying the world frees them all.

Moving tensors between two disjoint groups (the T -> P hand-off) needs no new
primitive: every world rank calls ``all_to_all_v`` on the world Comm, with non-empty
blocks only from members of one group to members of the other (index world blocks by
``sub.global_ranks``). With ``world.p2p_all_to_all`` set, only those pairs exchange
messages (isend/irecv between world ranks); otherwise the backend's all_to_all_single
also carries the empty blocks. Either way only the moved bytes are counted.

NCCL: a child keeps the world's device (buffers on ``comm.device``); NCCL requires
that collectives on overlapping groups be issued in the same order on every rank.
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, cast

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import ByteCounter, Comm, sum_phases


class GroupCounter:
    """A sub-group's view of the world's ``ByteCounter``.

    ``add`` and ``add_sent`` record into the world counter under ``prefix + phase``; ``snapshot``,
    ``total`` and ``reset`` see only this sub-group's phases, without the prefix.
    Anything else a ByteCounter offers is the world counter's own.
    """

    def __init__(self, parent: ByteCounter, prefix: str) -> None:
        self.parent = parent
        self.prefix = prefix

    def add(self, phase: str, sent: int, recv: int, seconds: float) -> None:
        """Record one call of ``phase`` in the world counter as ``prefix + phase``."""
        self.parent.add(self.prefix + phase, sent, recv, seconds)

    def add_sent(self, phase: str, sent: int) -> None:
        """Record bytes a send not yet complete handed over, as ``prefix + phase``."""
        self.parent.add_sent(self.prefix + phase, sent)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """This sub-group's phases (prefix removed) -> {"sent", "recv", "calls", "seconds"}."""
        n = len(self.prefix)
        return {phase[n:]: counts for phase, counts in self.parent.snapshot().items()
                if phase.startswith(self.prefix)}

    def total(self) -> dict[str, Any]:
        """The sum over this sub-group's phases."""
        return sum_phases(self.snapshot())

    def reset(self) -> None:
        """Forget this sub-group's phases (the world's other phases stay)."""
        self.parent.discard_prefix(self.prefix)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_") or attr in ("parent", "prefix"):
            raise AttributeError(attr)
        return getattr(self.parent, attr)

    def __repr__(self) -> str:
        return f"GroupCounter({self.prefix!r}, {self.snapshot()!r})"


def split_comm(comm: Comm, groups: Sequence[Sequence[int]],
               names: Sequence[str] | None = None) -> Comm | None:
    """This rank's Comm among disjoint ``groups`` of world ranks, or None (module docstring).

    Args:
        comm: the world Comm; every one of its ranks must call with the same arguments.
        groups: lists of world ranks, pairwise disjoint; list order sets group ranks.
        names: one unique name per group, without "/" (default: "g1-2-3" style).

    Raises:
        ValueError: ``comm`` is a sub-group, a group is empty, repeats a rank or names
            one outside the world, groups overlap, names are bad, or ranks disagree.
        CommError: the backend failed to create a group.
    """
    if comm.name:
        raise ValueError(f"split: called on sub-group {comm.name!r}; split the world Comm "
                         "(every worker calls it), sub-groups of sub-groups are not supported")
    ranks_of = _check_groups(groups, comm.world_size)
    labels = _check_names(names, ranks_of)
    _check_same_everywhere(comm, ranks_of, labels)
    mine = None
    for ranks, name in zip(ranks_of, labels):
        group = prim.new_group(ranks, comm) if len(ranks) > 1 else None
        if comm.rank in ranks:
            counter = cast(ByteCounter, GroupCounter(comm.counter, name + "/"))
            mine = Comm(rank=ranks.index(comm.rank), world_size=len(ranks), group=group,
                        timeout=comm.timeout, counter=counter,
                        device=comm.device, p2p_all_to_all=comm.p2p_all_to_all,
                        global_ranks=ranks, name=name)
    if mine is not None and comm.shm is not None and mine.world_size > 1:
        from fullgraph.comm.group import open_shm  # group imports this module

        # collective in the sub-group only, counted as the world's set-up
        mine.shm = open_shm(dataclasses.replace(mine, counter=comm.counter))
    return mine


def _check_groups(groups: Sequence[Sequence[int]], world_size: int) -> list[tuple[int, ...]]:
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ValueError(f"split: groups must be a non-empty list of lists of world ranks, "
                         f"got {groups!r}")
    out: list[tuple[int, ...]] = []
    seen: dict[int, int] = {}
    for i, group in enumerate(groups):
        try:
            ranks = tuple(operator.index(r) for r in group)
        except TypeError:
            raise ValueError(f"split: group {i} = {group!r} must be a list of integer world "
                             "ranks") from None
        if not ranks:
            raise ValueError(f"split: group {i} is empty")
        for r in ranks:
            if not 0 <= r < world_size:
                raise ValueError(f"split: group {i} = {list(ranks)} names rank {r}, outside "
                                 f"the world [0, {world_size})")
            if r in seen:
                where = "twice" if seen[r] == i else f"also in group {seen[r]}"
                raise ValueError(f"split: rank {r} of group {i} = {list(ranks)} is {where}; "
                                 "groups must be disjoint")
            seen[r] = i
        out.append(ranks)
    return out


def _check_names(names: Sequence[str] | None, groups: list[tuple[int, ...]]) -> list[str]:
    if names is None:
        return ["g" + "-".join(str(r) for r in ranks) for ranks in groups]
    if isinstance(names, str) or len(names) != len(groups):
        raise ValueError(f"split: need one name per group ({len(groups)}), got {names!r}")
    for name in names:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"split: group names must be non-empty strings without '/', "
                             f"got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"split: group names must be unique, got {list(names)}")
    return list(names)


def _check_same_everywhere(comm: Comm, groups: list[tuple[int, ...]],
                           names: list[str]) -> None:
    """Raise the same ValueError on every rank when ranks passed different arguments."""
    if comm.world_size == 1:
        return
    mine = [list(g) for g in groups], names
    everyone = prim.all_gather_object(mine, comm, "comm-init")
    differ = [p for p, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        p = differ[0]
        raise ValueError(f"split: every rank must pass the same groups and names; rank 0 "
                         f"passed {everyone[0]}, rank {p} passed {everyone[p]} "
                         f"(differing ranks: {differ})")
