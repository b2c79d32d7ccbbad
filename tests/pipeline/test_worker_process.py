"""FastLoader(workers="process"): the per-sample work in a worker process writing shared slots
(NOTE [the loader's worker process]). The same batches bit for bit as the threads, resume,
errors naming the sample, a worker that dies, Ctrl-C and a crashed trainer, and nothing left
behind: no process, no thread, no file in /dev/shm."""

import errno
import gc
import glob
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from terrapipe import FastLoader
from terrapipe.launch_env import alive
from terrapipe.pipeline import (
    ArrayDataset,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    SampleError,
    TorchDataset,
    shared_slots,
)
from tests.leftovers import left_behind, segments

from .sources_for_workers import FailsInTheWorker, Jpegs, Slow, Unpicklable
from .test_interrupt import as_at_a_terminal

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TRAIN = [RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(MEAN, STD)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ours() -> list[str]:
    return glob.glob(f"/dev/shm/{shared_slots.PREFIX}{os.getuid()}_{os.getpid()}_*")


def _leftovers() -> tuple:
    threads = [t.name for t in threading.enumerate() if t.name.startswith("terrapipe-loader")]
    return threads, multiprocessing.active_children(), _ours()


def _batches(loader, epochs=(0,)):
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out += [(x.clone(), y.clone()) for x, y in loader]
    return out


def _same(a, b) -> None:
    assert len(a) == len(b)
    for i, ((x, y), (u, v)) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == u.dtype and x.stride() == u.stride(), i
        assert torch.equal(x, u) and torch.equal(y, v), f"batch {i} differs"


@pytest.mark.parametrize("source, channels_last", [
    ("jpegs", True),
    pytest.param("arrays", False, marks=pytest.mark.full),
    pytest.param("jpegs", False, marks=pytest.mark.full),
    pytest.param("arrays", True, marks=pytest.mark.full)])
def test_same_batches_bit_for_bit_as_the_threads(source, channels_last):
    if source == "jpegs":
        ds, transforms = Jpegs(70), TRAIN
    else:
        g = np.random.default_rng(2)
        ds = ArrayDataset(g.integers(0, 256, (70, 30, 40, 3), dtype=np.uint8), np.arange(70))
        transforms = TRAIN[:2]
    kw = dict(batch_size=16, shuffle=True, seed=5, num_threads=3, channels_last=channels_last)
    with FastLoader(ds, transforms, **kw) as threads:
        want = _batches(threads, (0, 1))
    with FastLoader(ds, transforms, workers="process", **kw) as proc:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got = _batches(proc, (0, 1))
        assert proc._feed.replaced == 0  # a loop that lets go of its batches moves no slot
        assert alive(proc._workers.pid)
        pid = proc._workers.pid
    _same(want, got)
    assert not alive(pid) and _leftovers() == ([], [], [])


def _slot_mappings(pid: int) -> int:
    """How many distinct loader slot files process ``pid`` maps (unlinked: "(deleted)")."""
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[4] for line in f if shared_slots.PREFIX in line})


def test_kept_batches_stay_intact_and_their_memory_goes_when_let_go():
    # NOTE [batch buffer ownership] 3 with workers="process". Regression: shared slots were
    # refilled under batches the consumer kept (list(loader) gave later batches' data, with a
    # warning); a held slot now moves to a mapping of its own, handed to the worker.
    g = np.random.default_rng(3)
    ds = ArrayDataset(g.integers(0, 256, (70, 9, 7, 3), dtype=np.uint8), np.arange(70))
    kw = dict(batch_size=4, prefetch=1, num_threads=2, shuffle=True, seed=2)  # a ring of 3 slots, 18 batches
    with FastLoader(ds, TRAIN[1:], copy=True, **kw) as owned:
        want = _batches(owned, (0, 1, 2))
    with FastLoader(ds, TRAIN[1:], workers="process", **kw) as proc:
        worker = proc._workers.pid
        kept = []
        for epoch in range(3):  # slots move again and again, across passes
            proc.set_epoch(epoch)
            kept += list(proc)
        _same(want, kept)
        assert proc._feed.replaced >= 3 * 18 - 3
        # no name is left in /dev/shm while the batches are held: only mappings keep the memory
        assert _ours() == []
        # The worker keeps one mapping per slot at most (the first one and a moved slot's
        # newest), so its address space does not grow with the batches kept here.
        assert _slot_mappings(worker) <= 1 + 3
        held = _slot_mappings(os.getpid())
        assert held >= 3 * 18 - 3
        del kept
        gc.collect()
        # the kept batches' memory is unmapped once they are let go; the ring's is still there
        assert _slot_mappings(os.getpid()) <= 1 + 3
        more = [x.clone() for x, _ in proc]  # and the loader goes on in its moved slots
        assert len(more) == 18
    assert _leftovers() == ([], [], [])


@pytest.mark.full  # make test-full (CI time): CI keeps the bit-for-bit, death, Ctrl-C and crash tests
def test_kept_batches_hold_no_descriptor_each():
    # Regression: each moved slot's mapping kept a descriptor open (Python's mmap keeps a
    # duplicate), so list(loader) over more batches than the process's descriptor limit (often
    # 1024) failed, reported as the worker's death (NOTE [a mapping holds no descriptor] in
    # pipeline/shared_slots.py).
    ds = ArrayDataset(np.arange(300 * 4 * 4 * 3, dtype=np.uint8).reshape(300, 4, 4, 3), np.arange(300))
    with FastLoader(ds, batch_size=2, prefetch=1, num_threads=1, workers="process") as loader:
        before = len(os.listdir("/proc/self/fd"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(before + 64, hard), hard))
        try:
            kept = list(loader)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert len(os.listdir("/proc/self/fd")) <= before + 2
        assert loader._feed.replaced >= 150 - 3
        want = torch.from_numpy(ds.images).permute(0, 3, 1, 2)
        assert all(torch.equal(x, want[2 * i:2 * i + 2]) for i, (x, _) in enumerate(kept))
    del kept, loader
    gc.collect()
    assert _slot_mappings(os.getpid()) == 0 and _leftovers() == ([], [], [])


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch_cpu" in f.read()


def test_the_worker_loads_torch_only_for_a_dataset_that_needs_it():
    # NOTE [the loader's worker process] 2: the package, its sources and transforms load
    # without torch (3 s of the worker's start on two cores); a torch dataset brings it.
    pixels = np.random.default_rng(4).integers(0, 256, (24, 12, 12, 3), dtype=np.uint8)
    kw = dict(batch_size=8, num_threads=1, shuffle=True, seed=1)
    transforms = [RandomHorizontalFlip(), Normalize(MEAN, STD, torch.float16)]
    with FastLoader(ArrayDataset(pixels, np.arange(24)), transforms, **kw) as threads:
        want = _batches(threads)
    with FastLoader(ArrayDataset(pixels, np.arange(24)), transforms, workers="process", **kw) as proc:
        assert not _maps_torch(proc._workers.pid)
        _same(want, _batches(proc))
        assert not _maps_torch(proc._workers.pid)
    tensors = torch.utils.data.TensorDataset(torch.from_numpy(pixels).permute(0, 3, 1, 2), torch.arange(24))
    with FastLoader(TorchDataset(tensors), transforms, workers="process", **kw) as proc:
        _same(want, _batches(proc))
        assert _maps_torch(proc._workers.pid)


def test_a_dataset_the_worker_cannot_unpickle_is_named():
    # Regression: unpickled by multiprocessing's start, the dataset's error surfaced as "exit
    # code 1" with advice about the main guard, which was not the cause.
    ds = FailsInTheWorker(np.zeros((4000, 8, 8, 3), np.uint8), np.zeros(4000, np.int64))
    with pytest.raises(RuntimeError, match="could not start: ValueError: this dataset cannot be rebuilt"):
        FastLoader(ds, batch_size=4, workers="process")
    assert _leftovers() == ([], [], [])


def test_resume_mid_epoch_and_break_then_a_new_epoch():
    ds = Jpegs(90)
    kw = dict(batch_size=8, shuffle=True, seed=9, num_threads=2)
    with FastLoader(ds, TRAIN, **kw) as threads:
        want = _batches(threads)
    with FastLoader(ds, TRAIN, workers="process", **kw) as proc:
        first = []
        for i, (x, y) in enumerate(proc):  # break mid-epoch with batches queued in the worker
            first.append((x.clone(), y.clone()))
            if i == 4:
                break
        state = proc.state_dict()
        assert state["batch"] == 5
    with FastLoader(ds, TRAIN, workers="process", **kw) as again:
        again.load_state_dict(state)
        rest = [(x.clone(), y.clone()) for x, y in again]
        # After a break, the same loader runs a whole epoch again.
        whole = [(x.clone(), y.clone()) for x, y in again]
    _same(want, first + rest)
    _same(want, whole)
    assert _leftovers() == ([], [], [])


@pytest.mark.full  # make test-full (CI time): CI keeps the bit-for-bit, death, Ctrl-C and crash tests
def test_a_bad_sample_is_named_or_skipped_as_with_threads():
    ds = Jpegs(40, bad=13)
    with FastLoader(ds, TRAIN, batch_size=8, workers="process", num_threads=2) as loader:
        with pytest.raises(SampleError, match=r"sample 13 \(jpegs\[13\]\): ") as e:
            for _ in loader:
                pass
        assert e.value.index == 13 and e.value.where == "jpegs[13]"
        first = next(iter(loader))  # a new pass after the error: batches before the bad one come
        assert first[0].shape == (8, 3, 24, 24)
    kw = dict(batch_size=8, num_threads=2, on_error="skip")
    with FastLoader(ds, TRAIN, **kw) as threads:
        want = _batches(threads)
    with FastLoader(ds, TRAIN, workers="process", **kw) as proc:
        got = _batches(proc)
        assert [s[:2] for s in proc.skipped] == [s[:2] for s in threads.skipped] == [(13, "jpegs[13]")]
    _same(want, got)


def test_a_worker_process_that_dies_is_named_never_waited_for():
    ds = Slow(np.zeros((4000, 8, 8, 3), np.uint8), np.zeros(4000, np.int64), delay=0.002)
    loader = FastLoader(ds, batch_size=32, workers="process", num_threads=2)
    it = iter(loader)
    next(it)
    pid = loader._workers.pid
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    died = rf"worker process \(pid {pid}\) died during batch \d+: killed by SIGKILL"
    with pytest.raises(RuntimeError, match=died):
        for _ in it:
            pass
    assert time.monotonic() - start < 10
    loader.close()
    assert _leftovers() == ([], [], [])
    # Regression: a worker already gone when the loader sends it the next batch (or a moved
    # slot, clause 3) raised a bare BrokenPipeError that named nothing.
    for keep in (False, True):
        ds = ArrayDataset(np.zeros((400, 8, 8, 3), np.uint8), np.zeros(400, np.int64))
        with FastLoader(ds, batch_size=4, prefetch=1, workers="process", num_threads=1) as loader:
            it = iter(loader)
            kept = [next(it), next(it)]
            pid = loader._workers.pid
            os.kill(pid, signal.SIGKILL)
            while open(f"/proc/{pid}/stat").read().split()[2] != "Z":  # dead, not yet reaped
                time.sleep(0.01)
            died = rf"worker process \(pid {pid}\) died during batch \d+: killed"
            with pytest.raises(RuntimeError, match=died):
                for batch in it:
                    if keep:
                        kept.append(batch)
    assert _leftovers() == ([], [], [])


def test_refusals_name_the_argument_and_leave_nothing(monkeypatch):
    images, labels = np.zeros((10, 8, 8, 3), np.uint8), np.zeros(10, np.int64)
    with pytest.raises(ValueError, match="workers must be one of"):
        FastLoader(ArrayDataset(images, labels), batch_size=4, workers="processes")
    with pytest.raises(TypeError, match="by pickling"):
        FastLoader(Unpicklable(images, labels), batch_size=4, workers="process")
    assert _leftovers() == ([], [], [])

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    from terrapipe.pipeline import loader as loader_module

    def broken_feed(*args, **kwargs):
        raise MemoryError("no room for the feed")

    with monkeypatch.context() as m:  # a feed that fails after the slots exist leaves no file either
        m.setattr(loader_module, "HostFeed", broken_feed)
        with pytest.raises(MemoryError):
            FastLoader(ArrayDataset(images, labels), batch_size=4, workers="process")
    assert _ours() == []

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(RuntimeError, match=r"need 0\.\d MiB of /dev/shm.*workers='threads'"):
        FastLoader(ArrayDataset(images, labels), batch_size=4, workers="process")
    assert _ours() == []


@pytest.mark.full  # make test-full (CI time): CI keeps the bit-for-bit, death, Ctrl-C and crash tests
def test_a_stale_slot_file_of_a_dead_process_is_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    path = f"/dev/shm/{shared_slots.PREFIX}{os.getuid()}_{int(dead.stdout)}_0"
    with open(path, "wb") as f:
        f.write(b"x")
    with FastLoader(ArrayDataset(np.zeros((4, 8, 8, 3), np.uint8), np.zeros(4)), batch_size=2,
                    workers="process") as loader:
        assert len(list(loader)) == 2
    assert not os.path.exists(path)


SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, signal, sys, threading, time
    import numpy as np
    from terrapipe import FastLoader
    from tests.pipeline.sources_for_workers import Slow

    if __name__ == "__main__":
        how = sys.argv[1]
        if how == "crash":  # the user's own start method (fork here) does not change the worker's
            multiprocessing.set_start_method("fork", force=True)
        ds = Slow(np.zeros((20000, 8, 8, 3), np.uint8), np.zeros(20000, np.int64), delay=0.005)
        try:
            loader = FastLoader(ds, batch_size=32, num_threads=3, prefetch=4, workers="process")
            print("WORKER", loader._workers.pid, flush=True)
            for i, (x, y) in enumerate(loader):
                if i == 2:
                    print("ITERATING", flush=True)
                    if how == "crash":
                        os.kill(os.getpid(), signal.SIGKILL)
        except KeyboardInterrupt:
            loader.close()
            left = [t.name for t in threading.enumerate() if t.name.startswith("terrapipe-loader")]
            print("INTERRUPTED", len(left), len(multiprocessing.active_children()), flush=True)
    """
)


def _run_script(how: str, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, preexec_fn=as_at_a_terminal,
                            start_new_session=True)
    worker = None
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith("WORKER"):
            worker = int(line.split()[1])
        if line.startswith("ITERATING"):
            break
    assert worker is not None and lines[-1] == "ITERATING", (lines, proc.stderr.read() if proc.poll() else "")
    return proc, worker, lines


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not alive(pid) or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            return True
        time.sleep(0.05)
    return False


def _files_of(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/{shared_slots.PREFIX}{os.getuid()}_{pid}_*")


def test_ctrl_c_mid_epoch_stops_the_worker_and_leaves_nothing(tmp_path):
    proc, worker, _ = _run_script("interrupt", tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole foreground group
    out, err = proc.communicate(timeout=60)
    assert "INTERRUPTED 0 0" in out, (out, err)
    assert _gone(worker, 10) and _files_of(proc.pid) == []


def test_a_crashed_trainer_takes_its_worker_along(tmp_path):
    # Its script also set the fork start method: the worker is spawned all the same.
    proc, worker, _ = _run_script("crash", tmp_path)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert _gone(worker, 10), "the worker outlived its trainer"
    assert _files_of(proc.pid) == []


def _nice_values(pid: int) -> list[int]:
    """Nice values of every thread of process ``pid`` (from /proc; Python's thread names do not
    reach the kernel, so the pool's threads are told apart by their count)."""
    values = []
    for task in glob.glob(f"/proc/{pid}/task/*"):
        with open(f"{task}/stat") as f:
            stat = f.read()
        values.append(int(stat[stat.rindex(")") + 2:].split()[16]))  # field 19, nice
    return values


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")
@pytest.mark.parametrize("yield_cpu", [True, pytest.param(False, marks=pytest.mark.full)])
def test_the_worker_processs_threads_yield_the_cpu_when_asked(yield_cpu):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    # Slow reads keep every thread of the pool busy, so it has started all three.
    ds = Slow(np.zeros((64, 8, 8, 3), np.uint8), np.zeros(64, np.int64), delay=0.02)
    with FastLoader(ds, batch_size=8, num_threads=3, workers="process", yield_cpu=yield_cpu) as loader:
        next(iter(loader))  # the pool starts its threads on the first batch
        values = _nice_values(loader._workers.pid)
    lowered = [v for v in values if v == min(19, mine + 10)]
    assert len(lowered) == (3 if yield_cpu else 0) and len(values) - len(lowered) >= 1, values
    with pytest.raises(ValueError, match="yield_cpu"):
        FastLoader(ds, batch_size=8, yield_cpu="yes")


@pytest.mark.full  # about a minute on two cores: make test-full
def test_many_loaders_made_and_dropped_leave_no_descriptor_process_or_file():
    # A loader a job builds per epoch or per evaluation, closed or only dropped (the finalizer):
    # after the first, the count of open descriptors stays put, and nothing else is left.
    pixels = np.random.default_rng(0).integers(0, 256, (50, 20, 20, 3), dtype=np.uint8)
    ds = ArrayDataset(pixels, np.arange(50))

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    counts = []
    for k in range(16):
        loader = FastLoader(ds, [RandomResizedCrop(8)], batch_size=7, workers="process", num_threads=2,
                            prefetch=1, drop_last=k % 2 == 0, shuffle=True)
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert sum(1 for _ in loader) == (7 if k % 2 == 0 else 8)
        it = iter(loader)
        next(it)
        del it  # a pass stopped early, its batches queued in the worker
        if k % 3 == 0:
            del loader
            gc.collect()
        else:
            loader.close()
            del loader
        counts.append(descriptors())
    assert max(counts[1:]) <= counts[1], counts
    assert _leftovers() == ([], [], [])


UNGUARDED = textwrap.dedent(
    """
    import numpy as np
    from terrapipe import FastLoader
    from terrapipe.pipeline import ArrayDataset

    # No `if __name__ == "__main__":` guard: the spawned worker imports this file again. The
    # dataset pickles to more than a pipe holds (64 KiB).
    ds = ArrayDataset(np.zeros((4096, 8, 8, 3), np.uint8), np.zeros(4096, np.int64))
    loader = FastLoader(ds, batch_size=4, workers="process")
    print("BATCHES", len(list(loader)), flush=True)
    """
)


def test_a_script_without_the_main_guard_is_told_so(tmp_path):
    """Regression: the worker's own failure to start a nested worker was reported as a pickling
    failure of the dataset ("by pickling"), which sent the user after the wrong object. Now the
    parent names the guard, and the worker's traceback carries multiprocessing's own advice.
    Regression: with a dataset of more than 64 KiB pickled, the script hung for ever instead
    (NOTE [the loader's worker process] 2)."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = segments()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)
    assert proc.returncode != 0 and "BATCHES" not in proc.stdout
    assert "died during its start: exit code 1" in proc.stderr
    assert 'needs the `if __name__ == "__main__":` guard' in proc.stderr
    assert "by pickling" not in proc.stderr
    assert "bootstrapping phase" in proc.stderr  # the worker's traceback: multiprocessing's advice
    assert not left_behind(before)  # no slot file left behind (another lane's live ones aside)
