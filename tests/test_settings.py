"""terrapipe.settings: the one reader of TERRAPIPE_* variables (typed, validated, documented)."""

import ast
import re
from pathlib import Path

import pytest

from terrapipe import settings

ROOT = Path(__file__).resolve().parents[1]


def test_values_are_typed_and_defaults_apply():
    env = {"TERRAPIPE_WAIT": "Spin", "TERRAPIPE_CMA": "0", "TERRAPIPE_RING_BYTES": "4096",
           "TERRAPIPE_HOROVOD_TIMEOUT": "2.5", "TERRAPIPE_NODE_SIZE": "0", "TERRAPIPE_TIMELINE": " "}
    assert settings.get("TERRAPIPE_WAIT", env) == "spin"
    assert settings.get("TERRAPIPE_CMA", env) is False
    assert settings.get("TERRAPIPE_RING_BYTES", env) == 4096
    assert settings.get("TERRAPIPE_HOROVOD_TIMEOUT", env) == 2.5
    assert settings.get("TERRAPIPE_NODE_SIZE", env) == 0
    assert settings.get("TERRAPIPE_TIMELINE", env) == ""  # blank is unset
    assert settings.get("TERRAPIPE_HUGEPAGES", {}) is True
    assert settings.get("TERRAPIPE_COMM_BACKEND", {}) == "auto"
    assert settings.get("TERRAPIPE_SHM_ROW_BYTES", {}) is None


@pytest.mark.parametrize("name, raw, allowed", [
    ("TERRAPIPE_WAIT", "nap", "expected one of 'sleep', 'spin', got 'nap'"),
    ("TERRAPIPE_COMM_BACKEND", "nccl", "expected one of 'auto', 'mpi', 'shm', 'torch', got 'nccl'"),
    ("TERRAPIPE_CMA", "yes", "expected '0' or '1', got 'yes'"),
    ("TERRAPIPE_RING_BYTES", "0", "expected a positive integer, got '0'"),
    ("TERRAPIPE_SHM_ROW_BYTES", "1MiB", "expected a positive integer, got '1MiB'"),
    ("TERRAPIPE_NODE_SIZE", "-2", "expected an integer >= 0, got '-2'"),
    ("TERRAPIPE_HOROVOD_TIMEOUT", "soon", "expected a positive number of seconds, got 'soon'"),
])
def test_a_bad_value_names_the_variable_and_what_is_allowed(name, raw, allowed):
    with pytest.raises(ValueError, match=re.escape(f"{name}: {allowed}")):
        settings.get(name, {name: raw})


def test_an_unknown_name_is_refused():
    with pytest.raises(KeyError, match="TERRAPIPE_WAITING is not a terrapipe setting"):
        settings.get("TERRAPIPE_WAITING")


def _environment_reads(path: Path) -> set[str]:
    """TERRAPIPE_* names that ``path`` reads from the environment itself (os.environ[...],
    os.environ.get(...), os.getenv(...))."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            key = node.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
            key = node.args[0] if node.args else None
        if isinstance(key, ast.Constant) and str(key.value).startswith("TERRAPIPE_"):
            if not (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)):
                names.add(key.value)
    return names


def test_settings_is_the_only_reader_and_every_variable_is_a_setting():
    readers = {str(p.relative_to(ROOT)): _environment_reads(p) for p in (ROOT / "terrapipe").rglob("*.py")}
    readers = {p: n for p, n in readers.items() if n}
    assert readers == {}, f"TERRAPIPE_* read outside terrapipe/settings.py: {readers}"
    named = set()
    for p in (ROOT / "terrapipe").rglob("*.py"):
        named |= set(re.findall(r"TERRAPIPE_[A-Z0-9_]+", p.read_text()))
    assert named <= set(settings.SETTINGS), sorted(named - set(settings.SETTINGS))


def test_the_docs_page_shows_the_modules_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert settings.table() in page, "docs/settings.md is stale: regenerate with python -m terrapipe.settings"
