"""Ctrl-C mid-epoch: the loop stops promptly and no loader thread outlives the loader."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent(
    """
    import io, threading, time, sys
    import numpy as np
    from PIL import Image
    from terrapipe import FastLoader
    from terrapipe.pipeline import ArrayDataset, RandomResizedCrop

    class Slow(ArrayDataset):
        def read(self, i):
            time.sleep(0.01)  # a slow disk: the pool is busy when the signal lands
            return super().read(i)

    class SlowJpeg(Slow):
        # Encoded samples: the loader threads are inside the JPEG decoder when the signal lands.
        def read(self, i):
            _, label = super().read(i)
            return JPEG, label

    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(b, "JPEG")
    JPEG = b.getvalue()
    kind = sys.argv[1]
    ds = (SlowJpeg if kind == "jpeg" else Slow)(np.zeros((100000, 16, 16, 3), np.uint8),
                                                np.zeros(100000, np.int64))
    transforms = [RandomResizedCrop(16)] if kind == "jpeg" else []
    try:
        with FastLoader(ds, transforms, batch_size=64, num_threads=4, prefetch=4) as loader:
            for i, _ in enumerate(loader):
                if i == 1:
                    print("ITERATING", flush=True)
    except KeyboardInterrupt:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("terrapipe-loader")]
        print("INTERRUPTED", len(alive), flush=True)
        sys.exit(0)
    print("FINISHED", flush=True)
    """
)


def as_at_a_terminal() -> None:
    """In the child before it starts: SIGINT at its default, as for a program run at a terminal.
    A suite started in the background by a shell inherits SIGINT ignored (bash does that to
    asynchronous commands), and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("kind", ["arrays", "jpeg"])
def test_ctrl_c_mid_epoch_leaves_no_threads(kind):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_at_a_terminal,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ITERATING", proc.stderr.read()
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.strip() == "INTERRUPTED 0", (out, err)
