"""The plugin caps glibc's malloc arenas itself, unless the environment already chose (topodra.plugin.malloc)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from topodra.plugin import malloc


def test_an_explicit_environment_wins() -> None:
    assert malloc.cap_arenas({"MALLOC_ARENA_MAX": "4"}) is False


def test_capped_arenas_are_what_threads_get() -> None:
    """In a fresh process: 8 threads that malloc at once share at most the capped arenas (glibc's
    malloc_info lists one <heap> per arena), against one each without the cap."""
    probe = textwrap.dedent("""
        import ctypes, os, sys, threading
        from topodra.plugin import malloc
        os.environ.pop("MALLOC_ARENA_MAX", None)
        capped = sys.argv[1] == "cap" and malloc.cap_arenas({})
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        barrier = threading.Barrier(8)
        def work():
            barrier.wait()
            for _ in range(2000):
                libc.malloc(256)
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        libc.open_memstream.restype = ctypes.c_void_p
        buf, size = ctypes.c_char_p(), ctypes.c_size_t()
        f = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        libc.malloc_info(0, ctypes.c_void_p(f))
        libc.fclose(ctypes.c_void_p(f))
        print(capped, buf.value.decode().count("<heap nr="))
    """)

    def arenas(mode: str) -> tuple[str, int]:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
        out = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True,
                             env=env).stdout.split()
        return out[0], int(out[1])

    assert arenas("cap") == ("True", malloc.ARENAS)
    capped_not, n = arenas("none")
    assert capped_not == "False" and n > malloc.ARENAS
