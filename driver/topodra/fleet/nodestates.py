"""Every node's scoring state as a small integer, kept current from ``ClusterState``'s change journal. Pure.

Two nodes score alike for every pod when they have the same shape, the same unavailable devices and
(for CPU/memory-aware scoring) the same free CPU and memory: the scorer's memos are keyed by exactly
that. At 2,048 nodes the states are a few hundred, so the request path works per state, not per node;
what stays per node is one dict lookup. This table is derived from the one model of the fleet
(``fleet.state``) and follows it: after each update only the nodes the journal names are looked at
again, and a reader that fell behind the journal (or an "everything changed" update) rebuilds.

States are interned for the table's lifetime; when more states than ``max_states`` were ever seen the
table starts over (``epoch`` says so, for caches keyed by state ids).
"""

from __future__ import annotations

from dataclasses import dataclass

from topodra.fleet.hostres import Share
from topodra.fleet.state import ClusterState, NodeView


@dataclass(frozen=True, slots=True)
class NodeState:
    """One state: a node that has it (any of them: same shape), its unavailable devices and free room."""

    view: NodeView
    used: frozenset[int]
    room: tuple[int, int] | None  # (free CPU millicores, free memory bytes); None: allocatable unknown
    gpu_state: int  # the id of (shape, used) alone, for scoring without CPU/memory
    # The node's allocatable CPU and memory per GPU: the share a request class is judged with before pods of
    # its size were seen (issue 34, ``fleet.shares.share_for``); None: allocatable unknown.
    fair: Share | None = None


class NodeStates:
    """Node name -> state id, for the nodes that publish devices of the driver. Callers hold the cache lock."""

    def __init__(self, state: ClusterState, max_states: int = 50_000) -> None:
        self.state = state
        self.max_states = max_states
        self.epoch = 0  # bumped whenever ids are reassigned
        self.of: dict[str, int] = {}  # node -> id of (shape, used, room)
        self.gpu_of: dict[str, int] = {}  # node -> id of (shape, used)
        self.states: list[NodeState] = []
        self.gpu_rep: list[int] = []  # gpu state id -> the id of a state that has it
        self._ids: dict[tuple[int, frozenset[int], tuple[int, int] | None, Share | None], int] = {}
        self._gpu_ids: dict[tuple[int, frozenset[int]], int] = {}
        self._mark = -1

    def sync(self) -> None:
        """Catch up with the state's updates since the last call."""
        st = self.state
        changed = st.changed_since(self._mark) if self._mark >= 0 else None
        self._mark = st.changes
        if changed is None:
            self._rebuild()
            return
        for node in set(changed):
            self._refresh(node)
        if len(self.states) > self.max_states:
            self._rebuild()

    def _rebuild(self) -> None:
        self.epoch += 1
        self.of.clear()
        self.gpu_of.clear()
        self.states.clear()
        self._ids.clear()
        self._gpu_ids.clear()
        self.gpu_rep.clear()
        for node in self.state.nodes_with_devices():
            self._refresh(node)

    def _refresh(self, node: str) -> None:
        st = self.state
        view = st.node_view(node)
        if view is None:
            self.of.pop(node, None)
            self.gpu_of.pop(node, None)
            return
        self.of[node], self.gpu_of[node] = self._ids_for(node, view, st.unavailable_indices(view))

    def intern(self, node: str, used: frozenset[int], full: bool) -> int | None:
        """The id of the node's state with ``used`` as its unavailable devices instead of the ordinary ones (a
        pod with tolerations, ``ClusterState.tolerated_unavailable``): the full id, or the GPU-only one when not
        ``full``. Interned like any state (same key, same id), but the node's own entry stays the ordinary
        state: nothing a tolerating pod sees is cached under a node for the next pod."""
        view = self.state.node_view(node)
        if view is None:
            return None
        sid, gid = self._ids_for(node, view, used)
        return sid if full else gid

    def _ids_for(self, node: str, view: NodeView, used: frozenset[int]) -> tuple[int, int]:
        got = self.state.hosts.room(node)
        room = None if got is None else (got.cpu_free, got.memory_free)
        fair = None if got is None else Share.of(got.cpu_alloc, got.memory_alloc, view.gpus)
        gkey = (view.shape, used)
        gid = self._gpu_ids.get(gkey)
        if gid is None:
            gid = self._gpu_ids[gkey] = len(self.gpu_rep)
            self.gpu_rep.append(len(self.states))  # the state made just below, when it is new
        key = (view.shape, used, room, fair)
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = len(self.states)
            self.states.append(NodeState(view=view, used=used, room=room, gpu_state=gid, fair=fair))
        return sid, gid
