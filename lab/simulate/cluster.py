"""The simulated cluster's shape: nodes, a rail-optimized leaf/spine fabric and the jobs on it.

Layout (deterministic for a given ``(nodes, gpus, nics, seed)``):

- Nodes ``node0000 .. node{N-1}``, four to a rack (``rack000``), sixteen to a pod (``p0``).
- Rail-optimized fabric: NIC ``mlx5_i`` of every node in pod ``p`` connects on port 1 to leaf
  ``leaf-p<p>-r<i>``; the leaf port is the node's index within its pod (0-based, as a string).
  Every leaf has one uplink to each spine ``spine-<s>`` (``nics`` spines, at least two).
- NIC ``mlx5_i``'s network interface is ``eth<i>`` (a ``netdev`` entity, as the node exporter
  records it from sysfs); its PFC counters are named ``eth<i>/prio3``, as ``ethtool -S`` does.
- NIC ``mlx5_i`` is affine to ``gpu<i>`` (rail ``i``); GPUs and NICs ``< n/2`` sit on NUMA 0,
  the rest on NUMA 1; the NVLink domain of a node's GPUs is the node itself.
- Jobs: ``job-101`` on the first ~60 % of the nodes (so it spans pods when there are more than
  sixteen), ``job-102`` on the next ~30 %, the rest idle. Ranks are ``node x gpu`` in node order.

Example::

    >>> c = Cluster.build(nodes=4, gpus=8, nics=8, seed=1)
    >>> c.leaf_of(2, 3), c.port_of(2)
    ('leaf-p0-r3', '2')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lab.simulate.gen import netdev_of
from schemas.records import EntityKind, JobPlacement, RankPlacement, TopologyEntity

POD_SIZE = 16
RACK_SIZE = 4


@dataclass(frozen=True)
class Job:
    """A job: its id and the indices of its nodes (ranks are node-major, ``gpus`` per node)."""

    job: str
    node_idx: tuple[int, ...]


@dataclass(frozen=True)
class Cluster:
    """Immutable cluster shape. Build with :meth:`build`; queries never block or raise."""

    n_nodes: int
    gpus: int
    nics: int
    cpus: int
    seed: int
    jobs_: tuple[Job, ...] = field(default=())

    @classmethod
    def build(
        cls, nodes: int, gpus: int = 8, nics: int = 8, seed: int = 0, cpus: int = 128
    ) -> Cluster:
        """A cluster of ``nodes`` nodes; raises ValueError on non-positive sizes."""
        if nodes < 1 or gpus < 1 or nics < 1 or cpus < 1:
            raise ValueError("nodes, gpus, nics and cpus must be positive")
        a = max(1, math.ceil(nodes * 0.6))
        jobs = [Job("job-101", tuple(range(a)))]
        b_end = min(nodes, a + max(1, math.ceil(nodes * 0.3)))
        if b_end > a:
            jobs.append(Job("job-102", tuple(range(a, b_end))))
        return cls(nodes, gpus, nics, cpus, seed, tuple(jobs))

    # -- names ------------------------------------------------------------------------------

    @property
    def node_names(self) -> list[str]:
        return [self.node_name(i) for i in range(self.n_nodes)]

    @staticmethod
    def node_name(i: int) -> str:
        return f"node{i:04d}"

    @property
    def n_pods(self) -> int:
        return (self.n_nodes + POD_SIZE - 1) // POD_SIZE

    @property
    def n_spines(self) -> int:
        return max(2, self.nics)

    @staticmethod
    def pod_of(i: int) -> int:
        return i // POD_SIZE

    def leaf_of(self, i: int, rail: int) -> str:
        """The leaf switch NIC ``rail`` of node ``i`` is cabled to."""
        return f"leaf-p{self.pod_of(i)}-r{rail}"

    @staticmethod
    def port_of(i: int) -> str:
        """The leaf port of node ``i`` (its index within the pod)."""
        return str(i % POD_SIZE)

    def leaves(self) -> list[str]:
        return [f"leaf-p{p}-r{r}" for p in range(self.n_pods) for r in range(self.nics)]

    def nodes_behind(self, leaf: str, port: str | None) -> list[int]:
        """Node indices cabled to ``leaf`` (all of them, or the one on ``port``)."""
        pod, rail = _parse_leaf(leaf)
        if rail >= self.nics:
            return []
        idx = [i for i in range(pod * POD_SIZE, min(self.n_nodes, (pod + 1) * POD_SIZE))]
        if port is not None:
            idx = [i for i in idx if self.port_of(i) == port]
        return idx

    # -- jobs -------------------------------------------------------------------------------

    @property
    def job_list(self) -> list[Job]:
        return list(self.jobs_)

    def job_of_node(self) -> list[int]:
        """For each node, the index of its job in :attr:`job_list`, or -1 when idle."""
        out = [-1] * self.n_nodes
        for j, job in enumerate(self.jobs_):
            for i in job.node_idx:
                out[i] = j
        return out

    def jobs(self, start_ns: int) -> list[JobPlacement]:
        """Job placements as published on the ``jobs`` topic; all start at ``start_ns``."""
        out = []
        for job in self.jobs_:
            names = [self.node_name(i) for i in job.node_idx]
            ranks = [
                RankPlacement(rank=k * self.gpus + g, node=n, gpu=f"gpu{g}")
                for k, n in enumerate(names)
                for g in range(self.gpus)
            ]
            out.append(
                JobPlacement(
                    job=job.job,
                    start_ns=start_ns,
                    user="sim",
                    name="train",
                    nodes=names,
                    ranks=ranks,
                )
            )
        return out

    # -- topology ---------------------------------------------------------------------------

    def topology(self) -> list[TopologyEntity]:
        """Every node, switch, link, NIC and GPU as topology entities (source ``sim``)."""
        out: list[TopologyEntity] = []
        half = max(1, self.gpus // 2)
        for s in range(self.n_spines):
            out.append(
                _ent(f"switch:spine-{s}", EntityKind.SWITCH, device=f"spine-{s}", role="spine")
            )
        for p in range(self.n_pods):
            for r in range(self.nics):
                leaf = f"leaf-p{p}-r{r}"
                out.append(
                    _ent(
                        f"switch:{leaf}",
                        EntityKind.SWITCH,
                        device=leaf,
                        role="leaf",
                        pod=f"p{p}",
                        rail=r,
                    )
                )
                for s in range(self.n_spines):
                    out.append(
                        _ent(
                            f"link:{leaf}:spine-{s}",
                            EntityKind.LINK,
                            switch=leaf,
                            switch_port=str(POD_SIZE + s),
                            peer=f"spine-{s}",
                            pod=f"p{p}",
                            rail=r,
                        )
                    )
        for i in range(self.n_nodes):
            node, pod, rack = self.node_name(i), f"p{self.pod_of(i)}", f"rack{i // RACK_SIZE:03d}"
            out.append(_ent(f"node:{node}", EntityKind.NODE, node=node, rack=rack, pod=pod))
            for r in range(self.nics):
                nic, gpu = f"mlx5_{r}", f"gpu{r}" if r < self.gpus else None
                numa = 0 if r < max(1, self.nics // 2) else 1
                out.append(
                    _ent(
                        f"nic:{node}:{nic}",
                        EntityKind.NIC,
                        node=node,
                        device=nic,
                        rack=rack,
                        pod=pod,
                        rail=r,
                        numa=numa,
                        gpu=gpu,
                    )
                )
                out.append(
                    _ent(
                        f"netdev:{node}/{netdev_of(r)}",
                        EntityKind.NETDEV,
                        node=node,
                        device=netdev_of(r),
                        nic=nic,
                        attrs={"port": 1, "link_layer": "Ethernet"},
                    )
                )
                out.append(
                    _ent(
                        f"link:{node}:{nic}/1",
                        EntityKind.LINK,
                        node=node,
                        device=f"{nic}/1",
                        rack=rack,
                        pod=pod,
                        switch=self.leaf_of(i, r),
                        switch_port=self.port_of(i),
                        rail=r,
                    )
                )
            for g in range(self.gpus):
                affine = f"mlx5_{g}" if g < self.nics else None
                out.append(
                    _ent(
                        f"gpu:{node}:gpu{g}",
                        EntityKind.GPU,
                        node=node,
                        device=f"gpu{g}",
                        rack=rack,
                        pod=pod,
                        numa=0 if g < half else 1,
                        nvlink_domain=node,
                        nic=affine,
                        rail=g if g < self.nics else None,
                    )
                )
        return out


def _ent(id_: str, kind: EntityKind, **kw: object) -> TopologyEntity:
    return TopologyEntity.model_validate({"id": id_, "kind": kind, "source": "sim", **kw})


def _parse_leaf(leaf: str) -> tuple[int, int]:
    """``leaf-p<pod>-r<rail>`` → ``(pod, rail)``; ValueError if it is not a leaf name."""
    parts = leaf.split("-")
    if len(parts) != 3 or parts[0] != "leaf" or parts[1][:1] != "p" or parts[2][:1] != "r":
        raise ValueError(f"not a leaf name: {leaf!r}")
    return int(parts[1][1:]), int(parts[2][1:])
