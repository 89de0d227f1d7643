"""Cluster topology and replica placement.

The cluster is a networkx graph: one vertex per device (rank) and one per node switch; intra-node links
carry ``intra_node_gbps``, node uplinks ``inter_node_gbps``. A strategy's replicas are placed on contiguous,
node-aligned ranks by the planner (``passes.plan.placement``; ``ReplicaPlan.ranks`` is the one placement every
layer reads); :func:`check_placement` checks a plan's placement against the cluster: every TP group lies
inside one node or spans whole nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import networkx as nx

from passes.plan.ir import PlanError, ReplicaPlan

__all__ = ["Cluster", "check_placement"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """Devices grouped into nodes, with link bandwidths."""

    world_size: int
    """Ranks (devices) in the job."""
    gpus_per_node: int = 8
    """Devices per node."""
    intra_node_gbps: float = 400.0
    """Bandwidth of a link inside a node (GB/s)."""
    inter_node_gbps: float = 25.0
    """Bandwidth of a node's uplink (GB/s)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node:
            raise PlanError(f"world_size {self.world_size} is not a whole number of nodes of {self.gpus_per_node}")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, name) > 0:
                raise PlanError(f"{name} must be positive, got {getattr(self, name)!r}")

    @classmethod
    def local(cls, world_size: int, gpus_per_node: int | None = None) -> "Cluster":
        """The job as its launcher started it: ``gpus_per_node`` ranks per node, by default env
        ``LOCAL_WORLD_SIZE`` (torchrun and ``hcompile launch`` set it: the ranks started on each node), and
        without it every rank on this one machine. A value that is not a positive integer, or does not divide
        a job of several nodes, is a PlanError naming it."""
        if gpus_per_node is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is None:
                gpus_per_node = world_size
            else:
                try:
                    gpus_per_node = int(env)
                except ValueError:
                    gpus_per_node = 0
                if gpus_per_node < 1 or (world_size > gpus_per_node and world_size % gpus_per_node):
                    raise PlanError(f"LOCAL_WORLD_SIZE must be a positive integer (ranks per node) that divides "
                                    f"the job's {world_size} ranks, got {env!r}")
        return cls(world_size=world_size, gpus_per_node=gpus_per_node)

    @property
    def nodes(self) -> int:
        """Nodes in the cluster."""
        return max(1, self.world_size // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank``."""
        return rank // self.gpus_per_node

    def graph(self) -> nx.Graph:
        """Devices ``("gpu", r)`` linked to their node's switch ``("node", n)``; switches linked together."""
        g = nx.Graph()
        for n in range(self.nodes):
            g.add_node(("node", n))
        for r in range(self.world_size):
            g.add_edge(("gpu", r), ("node", self.node_of(r)), gbps=self.intra_node_gbps)
        for a in range(self.nodes):
            for b in range(a + 1, self.nodes):
                g.add_edge(("node", a), ("node", b), gbps=self.inter_node_gbps)
        return g

    def slowest_link_gbps(self, ranks: tuple[int, ...]) -> float:
        """The bottleneck bandwidth of a group: the slowest link on the paths between its members."""
        g = self.graph()
        worst = float("inf")
        for r in ranks[1:]:
            path = nx.shortest_path(g, ("gpu", ranks[0]), ("gpu", r))
            worst = min(worst, min(g.edges[u, v]["gbps"] for u, v in zip(path, path[1:])))
        return worst


def check_placement(replicas: Sequence[ReplicaPlan], cluster: Cluster, regrouped: bool = False) -> None:
    """The planner's placement (``ReplicaPlan.ranks``) on this cluster: every rank once (at least once when the
    plan is ``regrouped``: its groups share ranks one after another), and no TP group across a node boundary it
    does not fill; otherwise a PlanError naming the group."""
    ranks = sorted(r for replica in replicas for r in replica.ranks)
    if regrouped:
        ranks = sorted(set(ranks))
    if ranks != list(range(cluster.world_size)):
        raise PlanError(f"the plan places its replicas on ranks {ranks}, the job has ranks 0..{cluster.world_size - 1}"
                        + (" (a regrouped plan: each at least once)" if regrouped else ""))
    for replica in replicas:
        for group in replica.tp_groups:
            nodes = {cluster.node_of(r) for r in group}
            if len(nodes) > 1 and len(group) % cluster.gpus_per_node:
                raise PlanError(f"TP group {group} of a {replica.scheme.describe()} replica crosses a node boundary "
                                f"(nodes of {cluster.gpus_per_node} ranks)")
