"""Ctrl-C mid-epoch: the loop stops promptly and no loader thread outlives the loader."""

import os
import signal
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent(
    """
    import threading, time, sys
    import numpy as np
    from terrapipe import FastLoader
    from terrapipe.pipeline import ArrayDataset

    class Slow(ArrayDataset):
        def read(self, i):
            time.sleep(0.01)  # a slow disk: the pool is busy when the signal lands
            return super().read(i)

    ds = Slow(np.zeros((100000, 16, 16, 3), np.uint8), np.zeros(100000, np.int64))
    try:
        with FastLoader(ds, batch_size=64, num_threads=4, prefetch=4) as loader:
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


def test_ctrl_c_mid_epoch_leaves_no_threads():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
