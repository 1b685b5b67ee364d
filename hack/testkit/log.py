"""The harness's progress lines on stderr (stdout stays for what a caller parses, e.g. ``export KUBECONFIG``)."""

from __future__ import annotations

import sys
import time


def log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
