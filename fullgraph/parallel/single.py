"""The single-process executor: the reference every other strategy must reproduce.

It places the whole graph and all features on one device and runs the stage program
in order (``StageProgram.forward``). Keep it simple and obviously right.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset
from fullgraph.models.stages import StageContext, StageProgram, propagation_inputs
from fullgraph.models.walk import has_edge_stage
from fullgraph.parallel.base import LocalResult, Plan, Strategy, feature_rows, register

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm


@dataclass
class SinglePlan(Plan):
    """Everything on one device.

    Attributes:
        graph: the propagation graph (self-loops as the program wants).
        norms: its fixed edge weights per norm name.
        features: (N, F) float32 input features.
        gids: (N,) arange, the rows' global ids.
        eids: (E,) arange, the edges' global ids, when the program has an E stage
            (attention dropout keys by them); None otherwise (E x 8 bytes saved).
    """

    graph: Graph
    norms: dict[str, Tensor]
    features: Tensor
    gids: Tensor
    eids: Tensor | None


@register
class SingleProcess(Strategy[SinglePlan]):
    """Reference executor on one device."""

    name = "single"
    distributed = False

    def check_launch(self, program: StageProgram, num_nodes: int, workers: int) -> None:
        if workers > 1:
            raise ValueError(f"strategy 'single' runs on one worker, not {workers}; choose a "
                             "distributed strategy: data, tensor, p2p, task, or auto (the "
                             "planner's choice)")

    def setup(self, dataset: Dataset, program: StageProgram, device: torch.device,
              comm: Comm | None = None, dtype: torch.dtype = torch.float32) -> SinglePlan:
        self.check_launch(program, dataset.graph.num_nodes,
                          1 if comm is None else comm.world_size)
        graph, norms = propagation_inputs(program, dataset.graph, dtype)
        graph = graph.to(device)
        graph.transpose()  # build the backward CSR once, outside the timed epochs
        data = dataset.data
        masks = {"train": data.train_mask, "val": data.val_mask, "test": data.test_mask}
        return SinglePlan(
            device=device, labels=data.labels.to(device),
            masks={k: v.to(device) for k, v in masks.items()},
            num_train_global=int(data.train_mask.sum()),
            graph=graph, norms={k: v.to(device) for k, v in norms.items()},
            features=feature_rows(data.features, None, program, dtype, device),
            gids=torch.arange(graph.num_nodes, device=device),
            eids=torch.arange(graph.num_edges, device=device) if has_edge_stage(program)
            else None)

    def forward(self, model: StageProgram, plan: SinglePlan, *, training: bool,
                seed: int) -> LocalResult:
        ctx = StageContext(plan.gids, seed, training, plan.eids)
        return LocalResult(model(plan.graph, plan.norms, plan.features, ctx), plan.gids)
