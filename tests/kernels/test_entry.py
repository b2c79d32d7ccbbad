"""kernels.entry: a kernel's entry point compiled for given types, by one process of a machine
at a time while the others wait and load it from Numba's cache (NOTE [one compiler per kernel])."""

import json
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
from numba import njit

from terrapipe.kernels import entry
from terrapipe.kernels import reduce as kreduce
from terrapipe.kernels.entry import entry_point

# Each of three processes counts its compiles of one kernel (Numba's compile event), waits
# for the go file, asks for the kernel, and reports whether it compiled it or loaded it from the
# cache.
_WATCHING = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from numba.core import event
    from terrapipe.kernels import reduce as kreduce
    from terrapipe.kernels.entry import entry_point
    compiled = []
    class Seen(event.Listener):
        def on_start(self, ev):
            if ev.data["dispatcher"] is kreduce.{kernel}:
                compiled.append(1)
        def on_end(self, ev):
            pass
    event.register("numba:compile", Seen())
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.005)
""")


def _at_once(tmp_path, kernel: str, body: str) -> list[dict]:
    """Three processes asking for ``kreduce.<kernel>`` together (``body``, after the go file),
    each one's last line of output read as JSON."""
    script = _WATCHING.format(kernel=kernel) + textwrap.dedent(body)
    go = tmp_path / "go"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        go.write_text("")
        reports = []
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return reports


def test_processes_asking_at_once_compile_a_kernel_once_and_load_it(tmp_path):
    # Regression (CI time): four ranks on two cores each compiled the same kernels at once from
    # an empty cache. Three processes ask for the same entry point together: exactly one compiles
    # it, the others load it from the cache it saved.
    reports = _at_once(tmp_path, "reduce_pair", """
        a = np.zeros(8, np.uint16)
        f = entry_point(kreduce.reduce_pair, (a, a, a, 0, 1))
        b = np.full(8, 0x3C00, np.uint16)  # float16 1.0
        kreduce.reduce_pair(b, b, b.copy(), 0, 1)
        print(json.dumps({"compiled": len(compiled), "sum": int(b[0])}))
    """)
    assert sorted(r["compiled"] for r in reports) == [0, 0, 1], reports
    assert all(r["sum"] == 0x4000 for r in reports), reports  # 1.0 + 1.0 = 2.0


def test_processes_calling_a_kernel_at_once_compile_it_once_and_load_it(tmp_path):
    # Regression (CI time): the lock covered entry_point only, so the two ranks of make test's
    # job each compiled every kernel comm calls straight from Python (127 s of compiles made by
    # more than one process, from an empty cache). Now a first call takes it too.
    assert entry.install()  # Numba's Dispatcher as expected (NOTE [one compiler per kernel] 2)
    reports = _at_once(tmp_path, "reduce_native", """
        a, b = np.arange(8, dtype=np.int16), np.full(8, 3, np.int16)
        kreduce.reduce_native(a, b, kreduce.SUM, 0, 8)
        print(json.dumps({"compiled": len(compiled), "sum": a.tolist()}))
    """)
    assert sorted(r["compiled"] for r in reports) == [0, 0, 1], reports
    assert all(r["sum"] == list(range(3, 11)) for r in reports), reports


def test_an_entry_point_runs_the_kernel_for_those_types():
    a = np.arange(6, dtype=np.float32)
    b = np.full(6, 2, np.float32)
    out = np.empty(6, np.float32)
    f = entry_point(kreduce.reduce_pair, (out, a, b, kreduce.PROD, 0))
    assert f is entry_point(kreduce.reduce_pair, (out, a, b, kreduce.PROD, 0))
    f(out, a, b, kreduce.PROD, 0)
    np.testing.assert_array_equal(out, a * b)


@njit(cache=True)
def _add(dst, src):
    """A kernel of this test's own: no other test compiles it in this process first."""
    for i in range(dst.shape[0]):
        dst[i] += src[i]


def test_a_compiler_that_never_finishes_is_waited_for_only_so_long(monkeypatch):
    # NOTE [one compiler per kernel] 4: a process stopped while it compiles (it holds the lock
    # and never lets go) must not hold the others forever: past the wait they compile.
    import fcntl
    import threading
    import time

    from terrapipe.kernels import entry

    a = np.zeros(5, np.int16)
    b = np.full(5, 3, np.int16)
    key = (numba.typeof(a), numba.typeof(b))
    assert key not in _add.overloads
    path = entry._lock_path(_add, key)
    assert path is not None
    monkeypatch.setattr(entry, "_WAIT_SECONDS", 0.5)
    monkeypatch.setattr(entry, "_PACKAGES", entry._PACKAGES | {"tests"})  # _add's, for this test
    held = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    fcntl.flock(held, fcntl.LOCK_EX)  # the stopped compiler
    got, began = [], time.monotonic()
    try:
        t = threading.Thread(target=lambda: got.append(entry_point(_add, (a, b))), daemon=True)
        t.start()
        t.join(120)
        assert got, "entry_point still waiting for a lock nobody will release"
    finally:
        os.close(held)
    assert time.monotonic() - began >= 0.5
    got[0](a, b)
    np.testing.assert_array_equal(a, b)
