"""docs/telemetry.md lists exactly the series the plugin exports, with their types."""

from __future__ import annotations

import re

from testkit.paths import REPO

from topodra.plugin.telemetry import METRICS


def test_doc_table_is_the_metric_list() -> None:
    text = (REPO / "docs" / "telemetry.md").read_text()
    rows = dict(re.findall(r"^\| `(topodra_[a-z_]+)` \| ([a-z]+)", text, re.M))
    assert rows == {name: kind for name, (kind, _labels) in METRICS.items()}
