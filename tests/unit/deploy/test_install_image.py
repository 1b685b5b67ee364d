"""The topodra image's locks (hack/images): parsing, drift, and pins equal to pyproject's.

Building the image and running it needs root: tests/node/test_install_image_node.py.

Split by tier; the rest: tests/node/test_install_image_node.py.
"""

from __future__ import annotations

from images import topodra_image as ti


def test_lock_parsing_and_drift_are_exact() -> None:
    assert ti.parse_deb_lock("# c\npython3 3.11.2-1+b1\nzlib1g 1:1.2.13\n") == {
        "python3": "3.11.2-1+b1", "zlib1g": "1:1.2.13"}
    assert ti.parse_py_lock("PyYAML==6.0.3 --hash=sha256:ab\nTyping_Extensions==4.16.0 --hash=sha256:cd\n") == {
        "pyyaml": "6.0.3", "typing-extensions": "4.16.0"}
    assert ti.lock_drift({"a": "1", "b": "2"}, {"a": "1", "b": "2"}) == []
    assert ti.lock_drift({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "1"}) == ["- b 2", "+ b 3", "+ c 1"]


def test_python_lock_pins_exactly_the_pyproject_versions() -> None:
    ti.check_py_lock()  # raises BuildError on disagreement
    lines = [x for x in ti.PY_LOCK.read_text().splitlines() if x and not x.startswith("#")]
    assert all(" --hash=sha256:" in x and "==" in x for x in lines), "every line pinned and hashed"
    assert len(ti.parse_deb_lock(ti.DEB_LOCK.read_text())) > 50
