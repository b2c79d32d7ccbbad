"""Numba's on-disk cache made to see changes in the modules a compiled function calls into.

NOTE [a cached caller of a changed callee]
    1. Numba keeps a compiled function with the code of every compiled function it calls, and
       judges the entry fresh from a hash of the caller's own file alone. So a change to a
       callee in another module left its callers in other files running the old code from the
       cache, silently, until their own file changed (Numba documents the limit; numba issue
       1833). Found on 2026-12-04: ``comm/algorithms/oneshot_nodes._fused_tcp`` went on running
       the ``tcp_native.advance`` of before a change, while ``advance`` called from Python ran
       the new one. An install upgraded in place keeps the old entries beside the new sources.
    2. What. For the functions of the packages given to :func:`install` (terrapipe), the stamp
       an entry is judged by also holds :func:`stamp_of` the function's module: a hash of that
       module's file and of the file of every module of those packages it imports, directly or
       through others, read from their import statements (``ast``, nothing executed). A change
       to any of them makes the entry stale and the function compiles again, once; an entry
       whose modules did not change still loads.
    3. How. Numba asks a function's cache locator for the stamp when it sets up the function's
       cache, at decoration; :func:`install` wraps the constructor of Numba's cache
       implementation so a matching function's locator answers Numba's stamp and ours, and
       must run before the first decorated function of those packages is made: from the top
       of ``terrapipe.kernels``, which every compiled module of terrapipe imports first.
    4. Where Numba's classes are not as expected (another version's internals), nothing is
       wrapped and Numba's own judgement stands: :func:`install` returns False and
       ``tests/kernels/test_cache_stamp.py`` fails, saying so. A module whose sources cannot be
       read or parsed keeps Numba's stamp alone: the stamp never stops a module importing.
    5. Cost. Parsing the 30-odd modules a compiled function of terrapipe reaches took 0.2-0.4 s
       of CPU in every process that set one up (each rank, loader worker and launched script,
       before it ran anything). So each file's import statements, as :func:`_statements` reads
       them, are kept on disk beside Numba's own cache (the folder its locator chose for the
       first function set up), named by the hash of the file's bytes: a file whose bytes
       changed has another name and is parsed again, and nothing there is ever stale. Where
       that folder cannot be read or written, the file is parsed as before. The statements are
       kept, not the modules they resolve to: which names are submodules is decided in the
       process, from the files there.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import sys
from pathlib import Path

__all__ = ["install", "stamp_of", "modules_reached"]

_PACKAGES: set[str] = set()
_SCANS: list[Path] = []  # clause 5: the folder the import statements are kept in, once known
_SCAN_FORMAT = 1  # in the kept files' names: a change to _statements' output makes new ones


@functools.cache
def _file_of(module: str) -> Path | None:
    """The source file of ``module`` (imported or not), found from its top package's folder."""
    top = sys.modules.get(module.split(".")[0])
    if top is None or not getattr(top, "__file__", None):
        return None
    base = Path(top.__file__).parent.joinpath(*module.split(".")[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _statements(source: bytes) -> list[list]:
    """The import statements of a module's source, in order: ``["import", [names]]`` and
    ``["from", level, module or "", [names]]`` (every one in the file, nested ones too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.append(["import", [a.name for a in node.names]])
        elif isinstance(node, ast.ImportFrom):
            found.append(["from", node.level, node.module or "", [a.name for a in node.names]])
    return found


def _well_formed(statements) -> bool:
    """Whether ``statements`` has the shape :func:`_statements` gives (a kept file read back)."""
    def names(x):
        return isinstance(x, list) and all(isinstance(n, str) for n in x)
    return isinstance(statements, list) and all(
        isinstance(s, list) and (
            (len(s) == 2 and s[0] == "import" and names(s[1]))
            or (len(s) == 4 and s[0] == "from" and type(s[1]) is int and isinstance(s[2], str)
                and names(s[3])))
        for s in statements)


def _kept_statements(module: str) -> list[list]:
    """:func:`_statements` of ``module``'s file, from the folder of clause 5 where they were
    kept (by the hash of the file's bytes), else parsed now and kept there."""
    if not _SCANS:
        return _statements(_file_of(module).read_bytes())
    # the hash the stamp takes of the file anyway: a kept file found, the source is not read
    kept = _SCANS[0] / f"{_file_hash(module).hex()[:40]}.v{_SCAN_FORMAT}.imports.json"
    try:
        statements = json.loads(kept.read_text())
        if _well_formed(statements):
            return statements
    except (OSError, ValueError):
        pass
    statements = _statements(_file_of(module).read_bytes())
    try:  # written whole, then renamed: a process reading at once sees all of it or nothing
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(statements))
        os.replace(partial, kept)
    except OSError:
        pass
    return statements


@functools.cache
def _imported(module: str) -> frozenset[str]:
    """The modules of ``module``'s top package that its file imports, absolute or relative.
    ``from package import submodule`` reads the submodule, not the package's ``__init__``
    (which imports every submodule, so every module would reach every other); ``from package
    import name`` of anything else reads the ``__init__``. ``module`` has a file."""
    path = _file_of(module)
    top = module.split(".")[0]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for statement in _kept_statements(module):
        if statement[0] == "import":
            found.update(name for name in statement[1] if name.split(".")[0] == top)
            continue
        _, level, target, names = statement
        if level:
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - level + 1])
            target = f"{base}.{target}" if target else base
        if target.split(".")[0] != top:
            continue
        subs = {f"{target}.{name}" for name in names}
        modules = {m for m in subs if _file_of(m) is not None}
        found.update(modules)
        if len(modules) < len(subs):  # names of the package's own: its __init__ is read too
            found.add(target)
    return frozenset(m for m in found if _file_of(m) is not None)


@functools.cache
def modules_reached(module: str) -> tuple[str, ...]:
    """``module`` and every module of its top package it imports, directly or through others,
    sorted (clause 2); empty where ``module`` has no source file."""
    if _file_of(module) is None:
        return ()
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(_imported(m) - seen)  # every one with a file
    return tuple(sorted(seen))


@functools.cache
def stamp_of(module: str) -> str:
    """A hash of the files of :func:`modules_reached` from ``module`` (clause 2), hex."""
    h = hashlib.sha256()
    for m in modules_reached(module):
        h.update(m.encode() + b"\0" + _file_hash(m))
    return h.hexdigest()


@functools.cache
def _file_hash(module: str) -> bytes:
    return hashlib.sha256(_file_of(module).read_bytes()).digest()


def install(packages: tuple[str, ...] = ("terrapipe",)) -> bool:
    """Make the on-disk cache of every compiled function of ``packages`` set up from now on
    judge its entries by :func:`stamp_of` its module too (NOTE [a cached caller of a changed
    callee]). Idempotent; False where Numba's internals are not as expected (clause 4)."""
    from numba.core import caching

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    if impl is None:
        return False
    _PACKAGES.update(packages)
    if getattr(impl.__init__, "_terrapipe_stamped", False):
        return True
    original = impl.__init__

    @functools.wraps(original)
    def init(self, py_func):
        original(self, py_func)
        module = getattr(py_func, "__module__", None) or ""
        locator = getattr(self, "_locator", None)
        if module.split(".")[0] not in _PACKAGES or locator is None:
            return
        if not _SCANS:  # clause 5: beside Numba's cache, in the folder it chose (and can write)
            try:
                _SCANS.append(Path(locator.get_cache_path()) / "terrapipe-imports")
            except (AttributeError, OSError):
                pass
        try:
            ours = stamp_of(module)
        except (OSError, SyntaxError, ValueError):  # an unreadable source: Numba's stamp alone
            return
        numba_stamp = locator.get_source_stamp
        locator.get_source_stamp = lambda: (numba_stamp(), ours)

    init._terrapipe_stamped = True
    impl.__init__ = init
    return True
