"""tests/conftest.py marks a test by its tier directory (tests/cluster -> cluster, tests/node -> node), so a
test filed under a tier cannot run without the cluster lock because its author forgot the marker."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from testkit.paths import REPO


def test_tier_directory_sets_the_marker(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    for tier in ("unit/state", "cluster", "node"):
        (tests / tier).mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", tests / "conftest.py")
    (tests / "unit/state/test_u.py").write_text("def test_u() -> None:\n    pass\n")
    (tests / "cluster/test_c.py").write_text("def test_c() -> None:\n    pass\n")
    (tests / "node/test_n.py").write_text(
        "import pytest\n\n\n@pytest.mark.cluster\ndef test_n() -> None:\n    pass\n")  # explicit marker kept
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cluster: c\n    node: n\n")

    def collected(expr: str) -> list[str]:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                            "-m", expr, "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode in (0, 5), r.stdout + r.stderr  # 5: nothing selected
        return sorted(line.split("::")[1] for line in r.stdout.splitlines() if "::" in line)

    assert collected("not cluster and not node") == ["test_u"]
    assert collected("cluster and not node") == ["test_c"]
    assert collected("node") == ["test_n"]
    assert collected("node and cluster") == ["test_n"]
