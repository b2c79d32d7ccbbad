"""The layers meet only at their public faces (DESIGN.md, "Import direction"): read from the
package's source, every import that leaves a layer goes the allowed way, to the other layer's
package (never one of its modules), for names that package exports, and not to private names.
Also the comm layer's shape: one allreduce goes collectives -> select -> algorithm -> transport."""

import ast
import importlib
from pathlib import Path

import pytest

import terrapipe

ROOT = Path(terrapipe.__file__).parent
LAYERS = ("kernels", "pipeline", "comm", "ps", "engine", "horovod", "distributed", "testing")
# Modules any layer may import: they read the environment or record events and import no layer.
LEAVES = ("settings", "timeline", "launch_env", "torch_backend", "cuda_host")
ALLOWED = {
    "kernels": set(),
    "pipeline": {"kernels"},
    "comm": {"kernels"},
    "ps": {"comm", "kernels"},
    "engine": {"pipeline", "comm", "ps", "kernels"},
    "horovod": {"engine", "comm"},
    "distributed": {"comm"},
    "testing": set(),  # runs jobs from outside; imports only the leaves
}


def _imports(layer: str):
    """(file, line, target module path as a tuple, imported names) of every import in ``layer``
    that leaves it, resolved against the package."""
    for path in sorted((ROOT / layer).rglob("*.py")):
        here = path.relative_to(ROOT.parent).with_suffix("").parts  # ("terrapipe", layer, ...)
        package = here[:-1] if path.name != "__init__.py" else here[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - node.level + 1]
                target = base + tuple(node.module.split(".")) if node.module else base
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = tuple(alias.name.split("."))
                    if parts[0] == "terrapipe":
                        yield path, node.lineno, parts, []
                continue
            else:
                continue
            if target[:2] != ("terrapipe", layer):
                yield path, node.lineno, target, names


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_what_it_may_and_only_from_package_exports(layer):
    wrong = []
    for path, line, target, names in _imports(layer):
        where = f"{path.relative_to(ROOT.parent)}:{line}"
        if target == ("terrapipe",):  # from .. import comm, timeline
            for name in names:
                if name not in LEAVES and name not in ALLOWED[layer]:
                    wrong.append(f"{where}: {layer} may not import {name}")
            continue
        other = target[1]
        if other in LEAVES:
            if len(target) > 2:
                wrong.append(f"{where}: {'.'.join(target)} is not a module")
            continue
        if other not in ALLOWED[layer]:
            wrong.append(f"{where}: {layer} may not import {other}")
            continue
        if len(target) > 2:
            wrong.append(f"{where}: imports the module {'.'.join(target)}, not the package {other}")
            continue
        exported = set(getattr(importlib.import_module(f"terrapipe.{other}"), "__all__", ()))
        for name in names:
            if name.startswith("_") or name not in exported:
                wrong.append(f"{where}: {name} is not in terrapipe.{other}.__all__")
    assert not wrong, "\n".join(wrong)


def _calls(path: Path) -> set[str]:
    """Dotted names of the modules ``path``'s functions call into (``module.function(...)``)."""
    tree = ast.parse(path.read_text())
    modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return {n.func.value.id for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id in modules}


def test_an_allreduce_goes_from_the_public_call_through_select_to_an_algorithm():
    # collectives.py hands every collective to select.py; select.py calls the algorithms, which
    # are written over transports; no collective body in collectives.py or group.py touches a
    # transport's data path.
    assert "select" in _calls(ROOT / "comm" / "collectives.py")
    algorithms = {"oneshot", "segment", "shared", "single_copy", "ring", "native"}
    assert algorithms <= _calls(ROOT / "comm" / "select.py")
    for module in ("collectives.py", "group.py"):
        text = (ROOT / "comm" / module).read_text()
        for algorithm in ("segment.", "single_copy.", "oneshot.", "ring."):
            assert f" {algorithm}" not in text and f"({algorithm}" not in text, (module, algorithm)


def test_a_long_module_says_why_at_its_top():
    # A reader finds a piece by its module's name; a module past ~400 lines states at its top
    # why it is one module (issue: "no module over ~400 lines without a reason stated").
    unexplained = []
    for p in sorted(ROOT.rglob("*.py")):
        text = p.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > 420 and "Why one module" not in doc:
            unexplained.append(f"{p.relative_to(ROOT)}: {len(text.splitlines())} lines")
    assert not unexplained, "\n".join(unexplained)
