"""GPUs on unschedulable nodes are counted and explained apart: free, yet no claim lands there now.

The operator-facing contradiction this guards against (issue 18): after ``topodra simulate --once`` on
enterprise-400 the header said "400 GPUs: 400 free" while the H100 line said "largest claim now 0",
because 40 of 50 nodes were not Ready yet; the picture greyed them "(x)" and nothing said why.
Here: three DGX H100 nodes, ``up`` Ready, ``cordoned`` cordoned, ``new`` not Ready yet; one GPU of
``cordoned`` is allocated (it stays allocated, not "free on an unschedulable node").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testkit.views import claim, device_classes, gpus, node_slices

from topodra.clusterview.exporter import families
from topodra.clusterview.model import Sources, build_view
from topodra.clusterview.picture import UNSCHEDULABLE_MARK, render_png, title_lines
from topodra.clusterview.table import UNSCHEDULABLE_NOTE, render_table

Obj = dict[str, Any]
READY = {"type": "Ready", "status": "True"}
NOT_READY = {"type": "Ready", "status": "False"}


def scenario() -> Sources:
    nodes = ({"metadata": {"name": "up"}, "spec": {}, "status": {"conditions": [READY]}},
             {"metadata": {"name": "cordoned"}, "spec": {"unschedulable": True}, "status": {"conditions": [READY]}},
             {"metadata": {"name": "new"}, "spec": {}, "status": {"conditions": [NOT_READY]}})
    slices = [s for n in ("up", "cordoned", "new") for s in node_slices(n, "dgx-h100")]
    held = claim("old", gpus(1), namespace="team", allocated=[("cordoned", "gpu-0")])
    return Sources(slices=tuple(slices), claims=(held,), classes=device_classes(), nodes=nodes)


def test_counts_per_model_and_for_the_cluster() -> None:
    view = build_view(scenario())
    [m] = view.models
    assert (m.total, m.free, m.allocated, m.nodes) == (24, 23, 1, 3)
    assert (m.unschedulable_nodes, m.free_unschedulable) == (2, 15)
    assert m.largest.count == 8  # only "up" can take a claim now
    assert (view.free_unschedulable, view.unschedulable_nodes) == (15, 2)
    reasons = {n.name: n.unschedulable_reason for n in view.nodes}
    assert reasons == {"up": "", "cordoned": "cordoned", "new": "not Ready"}


def test_table_and_json_say_where_the_free_gpus_are() -> None:
    view = build_view(scenario())
    text = render_table(view)
    assert "Cluster: 24 GPUs: 23 free (15 of them on 2 unschedulable nodes), 1 allocated, 0 tainted;" in text, text
    assert UNSCHEDULABLE_NOTE in text
    model_line = next(line for line in text.splitlines() if line.startswith("H100-SXM5-80GB "))
    assert model_line.endswith("15 on 2 nodes"), model_line
    data = json.loads(json.dumps(view.to_dict()))
    assert (data["summary"]["free_unschedulable"], data["summary"]["unschedulable_nodes"]) == (15, 2)
    assert (data["models"][0]["free_unschedulable"], data["models"][0]["unschedulable_nodes"]) == (15, 2)
    assert {n["name"]: n["unschedulable_reason"] for n in data["nodes"]}["new"] == "not Ready"


def test_without_unschedulable_nodes_nothing_extra_is_said() -> None:
    src = scenario()
    ready = tuple({"metadata": n["metadata"], "spec": {}, "status": {"conditions": [READY]}} for n in src.nodes)
    view = build_view(Sources(**{**src.__dict__, "nodes": ready}))
    text = render_table(view)
    assert "Cluster: 24 GPUs: 23 free, 1 allocated, 0 tainted;" in text, text
    assert UNSCHEDULABLE_NOTE not in text
    assert not any("unschedulable" in line for line in title_lines(view))


def test_png_header_and_gauges() -> None:
    view = build_view(scenario())
    lines = title_lines(view)
    assert "23 free (15 of them on 2 unschedulable nodes)" in lines[0], lines[0]
    assert lines[1].startswith("H100-SXM5-80GB: 23/24 free on 3 nodes (15 of them on 2 unschedulable nodes); "
                               "largest claim now 8"), lines[1]
    fams = {f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in families(view)}
    assert fams["topodra_inventory_gpus_free_unschedulable"] == {("H100-SXM5-80GB",): 15}
    assert fams["topodra_inventory_nodes_unschedulable"] == {("H100-SXM5-80GB",): 2}


def test_png_legend_explains_the_mark(tmp_path: Path) -> None:
    import matplotlib.figure

    seen: list[list[str]] = []
    original = matplotlib.figure.Figure.legend

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append([h.get_label() for h in kwargs.get("handles", [])])
        return original(self, *args, **kwargs)

    matplotlib.figure.Figure.legend = spy  # type: ignore[method-assign]
    try:
        render_png(build_view(scenario()), tmp_path / "inv.png")
    finally:
        matplotlib.figure.Figure.legend = original  # type: ignore[method-assign]
    [labels] = seen
    assert labels[:2] == ["free", "tainted"] and labels[-1] == UNSCHEDULABLE_MARK
