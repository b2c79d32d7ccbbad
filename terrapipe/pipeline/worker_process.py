"""The loader's worker process: ``FastLoader(..., workers="process")`` runs its decode and
augmentation pool here, out of the training process, writing batches into shared slots.

Why one module: both ends of one protocol, the loader's (:class:`ProcessWorkers`) and the
worker's (``_main``), so each message is read where it is written.

NOTE [the loader's worker process]
    1. Why: a pool of threads in the training process takes the GIL for its per-sample Python
       work, and the thread that launches the model's kernels waits for it; with every core
       decoding it waits hundreds of times per step (docs/loader.md, "the loader beside the
       trainer"). In a process of its own the pool shares no GIL with the trainer, whose side is
       the host-to-device copy and a few microseconds of bookkeeping per batch.
    2. Start: always ``spawn`` (a fork of a process holding CUDA state or running threads is not
       safe), whatever start method the user's script set. The dataset and the transforms reach
       the worker by pickling, as with DataLoader's spawned workers: both must be picklable, and a
       script defining its dataset class needs the ``if __name__ == "__main__":`` guard. The
       loader pickles them itself and writes them to the pipe once the worker has started,
       watching it as it writes: multiprocessing writes a process's arguments to a pipe whose
       reading end it holds open itself until the write ends, so a worker that died before reading
       them all (its script run again without the guard, say) left the loader blocked for ever
       once they passed the pipe's 64 KiB. The worker imports torch only if the dataset needs
       it (a ``TorchDataset``, a tensor in it): the package, its sources and its transforms
       load without it (transforms keep dtypes by name), which saves the worker 3 s of its
       start on two cores. The worker maps the slots (pipeline/shared_slots.py),
       compiles the plan from the transforms, and says "ready"; the loader then unlinks the
       slots' name.
    3. Messages: each a JSON header (and, for a batch, the sample indices as int64 bytes) on one
       pipe; nothing is unpickled after the start. The loader sends ``batch`` (pass, batch, slot,
       seed, epoch, indices), ``slot`` (a slot moved to a mapping of its own, NOTE [batch buffer
       ownership] 3 in loader.py: its arrays' places, then the mapping's open descriptor over the
       pipe's socket, SCM_RIGHTS, so its name is unlinked at once), ``stop`` (pass) and
       ``exit``; the worker answers ``done`` or
       ``error`` per batch (the error names the sample as the threads' SampleError does, and
       skipped samples ride along), and ``stopped`` per stop. Only the thread iterating the
       loader reads the pipe, when it needs a batch: no thread of the trainer listens.
    4. Passes: every epoch iterator is a pass with its own number; answers for an older pass are
       dropped. ``stop`` cancels the pass's queued chunks, waits for running ones, then answers:
       once the loader has read ``stopped`` nothing writes a slot (the ring's rule holds as with
       threads, NOTE [batch buffer ownership] in loader.py).
    5. Ends: ``exit`` from ``close()``; the pipe's end of file when the loader's process is gone
       (and ``PR_SET_PDEATHSIG`` on Linux, for a parent killed while the worker is busy): the
       worker leaves at once. Ctrl-C reaches the whole foreground process group: the worker
       ignores SIGINT and the loader, whose iterator is interrupted, stops and closes it. A worker
       that dies is seen at the loader's next read of the pipe (end of file, or its exit code
       while polling) and raised naming its pid and exit code or signal, never waited for.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np

from ..launch_env import how_it_ended
from .samples import SampleError, SampleWriter
from .shared_slots import SharedSlots
from .workers import Workers, cancel_and_wait, submit_chunks, thread_pool

__all__ = ["ProcessWorkers"]

_START_TIMEOUT = 180.0  # imports and the kernels' cache load in a fresh process; a cold cache compiles later
_POLL = 0.2  # seconds between checks of the worker's life while waiting for an answer
_CHUNK = 1 << 20  # bytes per write of the start payload


def _send(conn, head: dict, payload: bytes = b"") -> None:
    conn.send_bytes(json.dumps(head).encode() + b"\0" + payload)


def _parse(data: bytes) -> tuple[dict, bytes]:
    head, _, payload = data.partition(b"\0")
    return json.loads(head), payload


class ProcessWorkers(Workers):
    """The parent's end of one worker process (NOTE [the loader's worker process]).

    slots: the shared mapping that ``images`` / ``labels`` (per slot, the feed's NumPy views)
    live in; mappings: per slot, the feed's list of the mapping the slot lives in now (``slots``
    until it moves; read at each submit); dataset, transforms, channels and out_hw rebuild the
    loader's plan in the worker; lut: the table its kernel writes through; skipped: the loader's
    list, extended with the samples the worker skipped under on_error="skip".
    """

    def __init__(self, dataset, transforms: Sequence, channels: int, out_hw: tuple[int, int],
                 slots: SharedSlots, images: list[np.ndarray], labels: list[np.ndarray],
                 mappings: list[SharedSlots], lut: np.ndarray,
                 on_error: str, num_threads: int, nice: bool, skipped: list) -> None:
        config = {"path": slots.path, "nbytes": slots.nbytes, "parent": os.getpid(),
                  "images": [slots.describe(a) for a in images],
                  "labels": [slots.describe(a) for a in labels],
                  "channels": channels, "out_hw": list(out_hw), "on_error": on_error,
                  "num_threads": num_threads, "nice": nice}
        self._skipped = skipped
        self._images, self._labels, self._mappings = images, labels, mappings
        self._told = list(mappings)  # per slot, the mapping the worker writes it in
        self._pass = 0
        self._results: dict[int, dict] = {}
        self._submitted: set[int] = set()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # clause 2: only the pipe's end and the config ride in the process's own arguments
        self._proc = ctx.Process(target=_main, args=(child, config), daemon=True,
                                 name="terrapipe-loader-worker")
        try:
            try:
                payload = pickle.dumps((dataset, list(transforms), np.asarray(lut)),
                                       protocol=pickle.HIGHEST_PROTOCOL)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                # What pickle raises for an object it refuses.
                raise TypeError(f"workers='process': the dataset and transforms go to the worker process by "
                                f"pickling, and that failed: {type(exc).__name__}: {exc}") from exc
            try:
                # Anything this raises (multiprocessing's own refusal to start a process while
                # the main module is being imported, say) goes up as it is, with its own advice.
                self._proc.start()
            finally:
                child.close()
            self._send_start(payload, _START_TIMEOUT)
            head = self._recv("its start", _START_TIMEOUT)
            if head["op"] != "ready":
                self._proc.join(5)
                raise RuntimeError(f"FastLoader's worker process could not start: {head.get('error')}")
        except BaseException:
            self.close()
            raise
        finally:
            slots.unlink()  # mapped by both (or the worker is gone): the name is no longer needed
        self.pid = self._proc.pid

    # -- the pipe ------------------------------------------------------------------------------
    def _recv(self, what: str, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = self._conn.poll(_POLL)
            if ready:
                try:
                    head, payload = _parse(self._conn.recv_bytes())
                except (EOFError, OSError):
                    self._proc.join(1)
                    raise self._died(what) from None
                return head
            if self._proc.exitcode is not None:
                raise self._died(what)
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"FastLoader's worker process (pid {self._proc.pid}) did not answer "
                                   f"within {timeout:.0f} s during {what}")

    def _post(self, what: str, head: dict, payload: bytes = b"", fd: int | None = None) -> None:
        """Send a message (and ``fd`` after it, clause 3); a worker that is gone is named, as
        :meth:`_recv` names it."""
        try:
            _send(self._conn, head, payload)
            if fd is not None:
                send_handle(self._conn, fd, self._proc.pid)
        except (BrokenPipeError, ConnectionResetError):  # the worker's end is closed; any other
            self._proc.join(1)                              # OSError is ours and goes up as it is
            raise self._died(what) from None

    def _send_start(self, payload: bytes, timeout: float) -> None:
        """Write the pickled dataset, transforms and table to the starting worker (clause 2):
        a header, then the bytes, without blocking, so a worker that dies or never reads is seen
        (Connection.send_bytes would wait on a full socket for ever)."""
        _send(self._conn, {"op": "start", "nbytes": len(payload)})
        fd = self._conn.fileno()
        view, sent = memoryview(payload), 0
        deadline = time.monotonic() + timeout
        os.set_blocking(fd, False)
        try:
            while sent < len(view):
                try:
                    sent += os.write(fd, view[sent:sent + _CHUNK])
                    continue
                except BlockingIOError:
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    self._proc.join(1)
                    raise self._died("its start") from None
                select.select([], [fd], [], _POLL)
                if self._proc.exitcode is not None:
                    raise self._died("its start")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"FastLoader's worker process (pid {self._proc.pid}) did not read "
                                       f"its dataset within {timeout:.0f} s of its start")
        finally:
            os.set_blocking(fd, True)

    def _died(self, what: str) -> RuntimeError:
        code = self._proc.exitcode
        hint = ""
        if what == "its start" and code == 1:  # a Python exception in the worker, before "ready"
            hint = ("; its traceback is on stderr above. The worker is a spawned process, which "
                    "imports the main module again: a script that makes FastLoader(workers='process') "
                    "at import time needs the `if __name__ == \"__main__\":` guard")
        return RuntimeError(f"FastLoader's worker process (pid {self._proc.pid}) died during {what}: "
                            f"{how_it_ended(code)}{hint}")

    def _take(self, head: dict) -> None:
        if head.get("skipped"):
            self._skipped.extend(tuple(s) for s in head["skipped"])
        if head["op"] in ("done", "error") and head["pass"] == self._pass:
            self._results[head["batch"]] = head

    # -- Workers ----------------------------------------------------------------------------------
    def start_pass(self) -> None:
        self._pass += 1
        self._results, self._submitted = {}, set()

    def submit(self, batch: int, slot: int, indices: np.ndarray, seed: int, epoch: int) -> None:
        if self._mappings[slot] is not self._told[slot]:
            self._move(slot, f"batch {batch}")
        head = {"op": "batch", "pass": self._pass, "batch": batch, "slot": slot, "seed": seed, "epoch": epoch}
        self._post(f"batch {batch}", head, np.ascontiguousarray(indices, np.int64).tobytes())
        self._submitted.add(batch)

    def _move(self, slot: int, what: str) -> None:
        """Tell the worker that ``slot`` moved to the feed's new mapping (clause 3), then unlink
        the mapping's name: it lives on in the two processes' mappings only."""
        moved = self._mappings[slot]
        try:
            fd = moved.open_fd()
            try:
                self._post(what, {"op": "slot", "slot": slot, "nbytes": moved.nbytes,
                                  "image": moved.describe(self._images[slot]),
                                  "label": moved.describe(self._labels[slot])}, fd=fd)
            finally:
                os.close(fd)
        finally:
            moved.unlink()
        self._told[slot] = moved

    def wait(self, batch: int) -> None:
        while batch not in self._results:
            self._take(self._recv(f"batch {batch}"))
        head = self._results.pop(batch)
        self._submitted.discard(batch)
        if head["op"] == "error":
            if head["index"] is not None:
                raise SampleError(head["index"], head["where"], head["text"])
            raise RuntimeError(f"FastLoader's worker process, batch {batch}: {head['text']}")

    def done(self, batch: int) -> bool:
        while self._conn.poll(0):
            try:
                self._take(_parse(self._conn.recv_bytes())[0])
            except (EOFError, OSError):
                return False  # the next wait() names the death
        head = self._results.get(batch)
        return head is not None and head["op"] == "done"

    def stop(self) -> None:
        if not self._submitted - set(self._results):
            self._results, self._submitted = {}, set()
            return
        try:
            _send(self._conn, {"op": "stop", "pass": self._pass})
            while True:
                head = self._recv("a stop")
                if head["op"] == "stopped" and head["pass"] == self._pass:
                    break
                self._take(head)
        except (RuntimeError, OSError):
            pass  # the worker is gone: nothing writes a slot any more
        self._results, self._submitted = {}, set()

    def close(self) -> None:
        proc = self._proc
        if proc.pid is not None and proc.exitcode is None:
            try:
                _send(self._conn, {"op": "exit"})
            except OSError:
                pass
            proc.join(10)
            if proc.exitcode is None:
                proc.kill()
                proc.join(10)
        self._conn.close()
        for mapping in self._mappings:  # one the worker was never told of still has its name
            mapping.unlink()


# -- the worker's side ------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent ends (Linux), and leave now if it already has."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


class _Batch:
    def __init__(self, futures: list) -> None:
        self.futures = futures
        self.remaining = len(futures)
        self.errors: dict[int, BaseException] = {}
        self.stopped = False


def _read_exactly(conn, nbytes: int) -> bytes:
    """``nbytes`` raw bytes from the pipe (the start payload after its header)."""
    out = bytearray(nbytes)
    view, got = memoryview(out), 0
    while got < nbytes:
        n = os.readv(conn.fileno(), [view[got:]])
        if n == 0:
            raise EOFError("the loader closed the pipe during the start")
        got += n
    return bytes(out)


def _main(conn, config: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # clause 5: the loader handles Ctrl-C
    _die_with_parent(config["parent"])
    # As DataLoader's workers: a dataset's torch ops stay on their thread. torch is imported
    # only if the dataset needs it (clause 2): its thread count is set now, for then.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        head, _ = _parse(conn.recv_bytes())
        # The loader's own objects, pickled by the loader for this process (clause 2).
        dataset, transforms, lut = pickle.loads(_read_exactly(conn, head["nbytes"]))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)
        from .transforms import compile_plan

        slots = SharedSlots.attach(config["path"], config["nbytes"])
        images = [slots.view(*d) for d in config["images"]]
        labels = [slots.view(*d) for d in config["labels"]]
        plan = compile_plan(list(transforms), config["channels"])
        if plan.out_hw is None:
            plan = plan.with_size(tuple(config["out_hw"]))
        writer = SampleWriter(dataset, plan, lut, config["on_error"])
        pool = thread_pool(config["num_threads"], config["nice"])
    except BaseException as exc:
        if isinstance(exc, (EOFError, BrokenPipeError, ConnectionResetError)):
            os._exit(0)  # the loader is gone before the start (clause 5)
        _send(conn, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        conn.close()
        return
    lock = threading.Lock()  # the pipe's sends, the batch table and the skipped count
    batches: dict[tuple[int, int], _Batch] = {}
    reported = 0  # skipped samples already sent

    def answer(key: tuple[int, int], entry: _Batch) -> None:  # under lock
        nonlocal reported
        skipped = writer.skipped[reported:]
        reported += len(skipped)
        head: dict = {"op": "done", "pass": key[0], "batch": key[1], "skipped": [list(s) for s in skipped]}
        if entry.errors:
            exc = entry.errors[min(entry.errors)]  # the first failing chunk, as the threads' order
            head["op"] = "error"
            if isinstance(exc, SampleError):
                head.update(index=exc.index, where=exc.where, text=exc.cause_text)
            else:
                head.update(index=None, where=None, text=f"{type(exc).__name__}: {exc}")
        _send(conn, head)

    def chunk_done(key: tuple[int, int], k: int, fut: concurrent.futures.Future) -> None:
        with lock:
            entry = batches.get(key)
            if entry is None:
                return
            if not fut.cancelled() and fut.exception() is not None:
                entry.errors[k] = fut.exception()
            entry.remaining -= 1
            if entry.remaining == 0:
                del batches[key]
                if not entry.stopped:
                    answer(key, entry)

    with lock:
        _send(conn, {"op": "ready"})
    try:
        while True:
            head, payload = _parse(conn.recv_bytes())
            op = head["op"]
            if op == "batch":
                key = (head["pass"], head["batch"])
                indices = np.frombuffer(payload, np.int64)
                futures = submit_chunks(pool, writer, images[head["slot"]], labels[head["slot"]], indices,
                                        head["seed"], head["epoch"])
                with lock:
                    batches[key] = _Batch(futures)
                for k, f in enumerate(futures):
                    f.add_done_callback(lambda f, key=key, k=k: chunk_done(key, k, f))
            elif op == "slot":  # clause 3: the slot's next batches go to a mapping of its own
                fd = recv_handle(conn)
                try:
                    moved = SharedSlots.from_fd(fd, head["nbytes"])
                finally:
                    os.close(fd)
                images[head["slot"]] = moved.view(*head["image"])
                labels[head["slot"]] = moved.view(*head["label"])
            elif op == "stop":
                with lock:
                    entries = [e for key, e in batches.items() if key[0] == head["pass"]]
                    for e in entries:
                        e.stopped = True
                cancel_and_wait([f for e in entries for f in e.futures])
                with lock:
                    _send(conn, {"op": "stopped", "pass": head["pass"]})
            elif op == "exit":
                break
    except (EOFError, OSError):  # the loader's process is gone: leave at once
        os._exit(0)
    pool.shutdown(wait=True, cancel_futures=True)
    conn.close()
