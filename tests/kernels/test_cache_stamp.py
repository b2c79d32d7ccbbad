"""NOTE [a cached caller of a changed callee] (terrapipe/kernels/cache_stamp.py): a compiled
function cached on disk runs a changed callee of another module, not the old one it was cached
with; an unchanged one still loads from the cache; every compiled function of terrapipe is
judged that way."""

import os
import subprocess
import sys
import textwrap

import numba

import terrapipe.comm  # noqa: F401 (every compiled module of comm, imported)
import terrapipe.pipeline  # noqa: F401
from terrapipe.kernels import cache_stamp

RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from terrapipe.kernels import cache_stamp
    assert cache_stamp.install(("stampdemo",))
    from stampdemo import caller
    print(caller.g(), caller.g.stats.cache_hits.total(), caller.g.stats.cache_misses.total())
""")


def _callee(value: int) -> str:
    return f"from numba import njit\n\n\n@njit(cache=True)\ndef f():\n    return {value}\n"


def _run(root) -> tuple[int, int, int]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(root / "cache")}
    out = subprocess.run([sys.executable, "-c", RUN, str(root)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return tuple(int(v) for v in out.stdout.split())


def test_a_changed_callee_in_another_module_is_not_run_from_the_callers_cache(tmp_path):
    pkg = tmp_path / "stampdemo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "callee.py").write_text(_callee(1))
    (pkg / "caller.py").write_text("from numba import njit\n\nfrom . import callee\n\n\n"
                                   "@njit(cache=True)\ndef g():\n    return callee.f() + 10\n")
    value, hits, misses = _run(tmp_path)
    assert (value, hits, misses) == (11, 0, 1)  # compiled, and cached
    value, hits, misses = _run(tmp_path)
    assert (value, hits, misses) == (11, 1, 0)  # nothing changed: loaded from the cache
    (pkg / "callee.py").write_text(_callee(2))  # only the callee's file changes
    value, hits, misses = _run(tmp_path)
    assert (value, misses) == (12, 1), "the caller ran its cached copy of the old callee"
    value, hits, misses = _run(tmp_path)
    assert (value, hits, misses) == (12, 1, 0)


def test_a_module_reaches_what_it_imports_and_not_what_imports_it():
    reached = cache_stamp.modules_reached("terrapipe.comm.algorithms.oneshot_nodes")
    assert "terrapipe.comm.transports.tcp_native" in reached  # through `from ..transports import`
    assert "terrapipe.kernels.reduce" in reached  # through `from ...kernels import reduce`
    kernel = cache_stamp.modules_reached("terrapipe.kernels.reduce")
    assert "terrapipe.kernels.reduce" in kernel and all(m.startswith("terrapipe.kernels") for m in kernel)
    assert "terrapipe.kernels" not in kernel  # `from . import floats` reads floats, not the __init__


def test_every_cached_compiled_function_of_terrapipe_carries_the_stamp():
    # install() ran before the first decorated function (clause 3) and took (clause 4)
    checked = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("terrapipe.") or module is None:
            continue
        for obj in vars(module).values():
            if not isinstance(obj, numba.core.registry.CPUDispatcher) or obj.py_func.__module__ != name:
                continue
            cache = obj._cache
            if type(cache).__name__ == "NullCache":
                continue
            stamp = cache._impl.locator.get_source_stamp()
            assert isinstance(stamp, tuple) and stamp[1] == cache_stamp.stamp_of(name), obj
            checked += 1
    assert checked > 50, checked


def test_a_source_that_cannot_be_parsed_keeps_numbas_stamp_and_still_imports(tmp_path):
    # clause 4: the stamp never stops a module importing. The caller imports a module whose
    # file is not Python (the stamp cannot parse it) through a loader that does not need it.
    pkg = tmp_path / "stampdemo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "callee.py").write_text(_callee(5))
    (pkg / "broken.py").write_text("def (:\n")  # not Python: never imported, only named
    (pkg / "caller.py").write_text("from numba import njit\n\nfrom . import callee\n\n"
                                   "if False:\n    from . import broken  # noqa\n\n\n"
                                   "@njit(cache=True)\ndef g():\n    return callee.f() + 10\n")
    value, hits, misses = _run(tmp_path)
    assert (value, misses) == (15, 1)
    value, hits, misses = _run(tmp_path)
    assert (value, hits, misses) == (15, 1, 0)  # Numba's own stamp, cached as before


def test_each_files_import_statements_are_kept_by_its_hash_and_read_back(tmp_path, monkeypatch):
    """Clause 5: a file's import statements, parsed once, are kept under the hash of its bytes
    and read back instead of parsing it again; a file whose bytes changed is parsed again; a
    kept file that cannot be read, or holds something else, is parsed again too."""
    pkg = tmp_path / "src" / "scandemo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("")
    (pkg / "b.py").write_text("")
    user = "import os\n\nfrom . import a\n\n\ndef f():\n    from .b import x  # noqa\n"
    (pkg / "user.py").write_text(user)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    import scandemo  # noqa: F401 (the top package, which cache_stamp finds files from)

    kept = tmp_path / "kept"
    monkeypatch.setattr(cache_stamp, "_SCANS", [kept])
    parsed = []
    parse = cache_stamp._statements
    monkeypatch.setattr(cache_stamp, "_statements", lambda source: parsed.append(source) or parse(source))

    def imported():
        cache_stamp._imported.cache_clear()  # a new process's view: nothing held in memory
        cache_stamp._file_hash.cache_clear()
        return cache_stamp._imported("scandemo.user")

    try:
        assert imported() == {"scandemo.a", "scandemo.b"} and len(parsed) == 1
        files = sorted(kept.glob("*.imports.json"))
        assert len(files) == 1 and not list(kept.glob("*.tmp"))
        assert imported() == {"scandemo.a", "scandemo.b"} and len(parsed) == 1  # read back
        (pkg / "user.py").write_text("from . import b\n")  # new bytes: parsed again
        assert imported() == {"scandemo.b"} and len(parsed) == 2
        assert len(list(kept.glob("*.imports.json"))) == 2
        files[0].write_text("{not json")  # the first version's, unreadable: parsed again
        (pkg / "user.py").write_text(user)
        assert imported() == {"scandemo.a", "scandemo.b"} and len(parsed) == 3
        assert imported() == {"scandemo.a", "scandemo.b"} and len(parsed) == 3  # and kept again
        files[0].write_text('[["from", 1, "x"]]')  # JSON, but not statements: parsed again
        assert imported() == {"scandemo.a", "scandemo.b"} and len(parsed) == 4
    finally:
        cache_stamp._imported.cache_clear()
        cache_stamp._file_hash.cache_clear()
        sys.modules.pop("scandemo", None)
