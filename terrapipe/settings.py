"""Every ``TERRAPIPE_*`` environment variable, read in one place: typed, validated, documented.

A layer asks ``settings.get("TERRAPIPE_WAIT")`` and gets a value of the setting's type; a value
that does not parse raises ``ValueError`` naming the variable and the values allowed. Values are
read when asked for (a test's ``monkeypatch.setenv`` takes effect at the next read; each caller
says in its own docs when it reads). This module is a leaf: standard library only, importing no
terrapipe layer, so every layer may use it. ``python -m terrapipe.settings`` prints the table the
docs show (docs/settings.md, checked against this module by tests/test_settings.py).

Variables that terrapipe writes for its own child processes (``terrapipe run``'s status folder)
are settings too: the launcher sets them, the ranks read them here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Setting", "SETTINGS", "get", "table"]


@dataclass(frozen=True)
class Setting:
    """One variable: ``kind`` is ``"choice"`` (one of ``choices``, case-insensitive, returned
    lower-case), ``"flag"`` (``0``/``1``: bool), ``"bytes"`` (a positive integer), ``"seconds"``
    (a positive number: float), ``"count"`` (an integer >= 0), ``"text"`` or ``"path"`` (a
    string; empty is unset). ``default`` is what an unset (or empty) variable reads as;
    ``doc``: one line for the table; ``layer``: who reads it."""

    name: str
    kind: str
    default: object
    doc: str
    layer: str
    choices: tuple[str, ...] = ()

    def read(self, env: Mapping[str, str] = os.environ):
        raw = env.get(self.name, "").strip()
        if not raw:
            return self.default
        if self.kind == "choice":
            value = raw.lower()
            if value not in self.choices:
                allowed = ", ".join(repr(c) for c in self.choices)
                raise ValueError(f"{self.name}: expected one of {allowed}, got {raw!r}")
            return value
        if self.kind == "flag":
            if raw not in ("0", "1"):
                raise ValueError(f"{self.name}: expected '0' or '1', got {raw!r}")
            return raw == "1"
        if self.kind in ("bytes", "count"):
            try:
                value = int(raw)
            except ValueError:
                value = -1
            low = 1 if self.kind == "bytes" else 0
            if value < low:
                what = "a positive integer" if low else "an integer >= 0"
                raise ValueError(f"{self.name}: expected {what}, got {raw!r}")
            return value
        if self.kind == "seconds":
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not value > 0:
                raise ValueError(f"{self.name}: expected a positive number of seconds, got {raw!r}")
            return value
        return raw  # text, path


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    # comm
    Setting("TERRAPIPE_COMM_BACKEND", "choice", "auto",
            "Force every collective through MPI (`mpi`), keep large one-node allreduces in shared "
            "memory (`shm`), or join over torch.distributed (`torch`); `comm.init(backend=)` wins",
            "comm", ("auto", "mpi", "shm", "torch")),
    Setting("TERRAPIPE_NODE_SIZE", "count", 0,
            "Group ranks k per node to emulate several nodes on one machine (0: by host)", "comm"),
    Setting("TERRAPIPE_WAIT", "choice", "sleep",
            "How a rank waits for late peers: `sleep` (after a short spin: on a futex in a node, in "
            "`poll` on a TCP stream between machines) or `spin`", "comm",
            ("sleep", "spin")),
    Setting("TERRAPIPE_SHM_ROW_BYTES", "bytes", None,
            "Bytes of each rank's row of the node segment (default: 8 MiB / ranks, at least 1 MiB)",
            "comm"),
    Setting("TERRAPIPE_RING_BYTES", "bytes", 1 << 20,
            "Allreduces of at least this many bytes take the ring over MPI (the autotuner moves it)",
            "comm"),
    Setting("TERRAPIPE_TCP_RING_BYTES", "bytes", 32 << 10,
            "Between machines of a group without MPI (torchrun across nodes), allreduce parts of at least "
            "this many bytes take the ring over TCP; smaller ones an allgather of the whole part",
            "comm"),
    Setting("TERRAPIPE_BULK_TRANSPORT", "choice", "auto",
            "Between nodes of an MPI job, what carries the parts of large hierarchical allreduces: `tcp` "
            "(streams of terrapipe's own, each part crossing while the node works on the next), `mpi` "
            "(MPI's point-to-point, the node waiting), `auto` (`tcp` unless the node has RDMA devices)",
            "comm", ("auto", "tcp", "mpi")),
    Setting("TERRAPIPE_CMA", "flag", True,
            "`0`: never read peers' memory directly (single-copy collectives off)", "comm"),
    Setting("TERRAPIPE_MPI_NATIVE", "flag", True,
            "`0`: the agreement's exchange between nodes through mpi4py, not MPI's C API from "
            "compiled code", "comm"),
    Setting("TERRAPIPE_HALVING_BYTES", "count", None,
            "Among a power of two of four or more nodes, payloads of at least this many bytes cross "
            "by reduce-scatter and allgather, smaller ones by recursive doubling (0: never; default: "
            "measured on the group's links when it is made)", "comm"),
    Setting("TERRAPIPE_HUGEPAGES", "flag", True,
            "`0`: never advise huge pages for buffers collectives read again and again", "comm"),
    Setting("TERRAPIPE_CUDA_COMM", "choice", "auto",
            "CUDA tensors over NCCL (`nccl`), staged through the host (`staged`), or NCCL where "
            "every rank has a GPU of its own (`auto`)", "comm", ("auto", "nccl", "staged")),
    Setting("TERRAPIPE_SOCKET_IFNAME", "text", "",
            "The network interface whose address this rank's own TCP connections between nodes "
            "use (the parameter server's); default: every interface's, loopback first on one host",
            "comm"),
    Setting("TERRAPIPE_ELASTIC", "text", "",
            "Set by the elastic launcher for its workers: `host:port` of the job's rendezvous store "
            "(the world comes from it, a generation at a time)", "comm"),
    Setting("TERRAPIPE_ELASTIC_WORKER", "text", "",
            "Set by the elastic launcher: this worker's id in the job (`host:n`, n counting the "
            "workers started)", "comm"),
    Setting("TERRAPIPE_ELASTIC_FIRST", "count", 1,
            "Set by the elastic launcher: the first generation this worker was started for", "comm"),
    Setting("TERRAPIPE_ELASTIC_TIMEOUT", "seconds", 600.0,
            "Seconds a worker waits for its elastic launcher to form the next generation", "comm"),
    # pipeline
    Setting("TERRAPIPE_JPEG", "choice", "turbo",
            "`pillow`: decode every JPEG with Pillow instead of the libjpeg-turbo region decoder",
            "pipeline", ("turbo", "pillow")),
    Setting("TERRAPIPE_COMPILED_FILL", "flag", True,
            "`0`: loader threads read, decode and resample sample by sample in Python, not a chunk "
            "of files in one compiled call (to compare, or to rule it out)", "pipeline"),
    Setting("TERRAPIPE_CACHE", "path", "",
            "Folder for terrapipe's caches (tar shard indexes); default `$XDG_CACHE_HOME/terrapipe`",
            "pipeline"),
    # engine
    Setting("TERRAPIPE_AUTOTUNE", "flag", False,
            "`1`: DistributedOptimizer searches its communication knobs in the first steps", "engine"),
    Setting("TERRAPIPE_AUTOTUNE_LOG", "path", "", "CSV file for the autotuner's trials (rank 0)",
            "engine"),
    Setting("TERRAPIPE_AUTOTUNE_CACHE", "path", "",
            "JSON file of tuned configurations; default `~/.cache/terrapipe/autotune.json`", "engine"),
    Setting("TERRAPIPE_RUN_STATUS", "path", "",
            "Set by `terrapipe run` for its ranks: the folder where each records how it ended",
            "engine"),
    Setting("TERRAPIPE_RUN_REPORT", "path", "",
            "`terrapipe run` writes how the job ended here (JSON: its exit code, the rank that failed "
            "first, that rank's exit code and error), for the program that launched it", "engine"),
    Setting("TERRAPIPE_RUN_FUNC", "text", "",
            "Set by `horovod.run` for its ranks: `host:port` of the call that sends them the function",
            "engine"),
    Setting("TERRAPIPE_RUN_FUNC_KEY", "text", "",
            "Set by `horovod.run` for its ranks: the key (hex) that call's socket authenticates them by",
            "engine"),
    Setting("TERRAPIPE_RUN_FUNC_OUTPUT", "path", "",
            "Set by `horovod.run(output_filename=...)`: each rank's stdout and stderr go under this folder",
            "engine"),
    # horovod
    Setting("TERRAPIPE_HOROVOD_TIMEOUT", "seconds", None,
            "Seconds a named hvd collective waits for ranks that have not issued it (else "
            "`HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`, else 300)", "horovod"),
    # timeline
    Setting("TERRAPIPE_TIMELINE", "path", "",
            "Record one Chrome trace of the job at this path (`terrapipe run --timeline` sets it)",
            "timeline"),
)}


def get(name: str, env: Mapping[str, str] = os.environ):
    """The value of setting ``name`` (a ``TERRAPIPE_*`` variable) in ``env``, typed; ValueError
    naming the variable and the values allowed when it does not parse; KeyError for a name that
    is not a setting."""
    try:
        setting = SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a terrapipe setting (known: {', '.join(SETTINGS)})") from None
    return setting.read(env)


def table() -> str:
    """The settings as a Markdown table (what docs/settings.md shows)."""
    rows = ["| variable | values | default | read by | what |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        values = {"choice": " / ".join(f"`{c}`" for c in s.choices), "flag": "`0` / `1`",
                  "bytes": "bytes", "count": "integer", "seconds": "seconds", "path": "path",
                  "text": "text"}[s.kind]
        if s.default is None or s.default == "":
            default = "unset"
        elif s.kind == "flag":
            default = f"`{int(bool(s.default))}`"
        else:
            default = f"`{s.default}`"
        rows.append(f"| `{s.name}` | {values} | {default} | {s.layer} | {s.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
