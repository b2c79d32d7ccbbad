"""Per-rank wrapper used by ``terrapipe run``: run the command, record how it ended.

Records the command's exit code for the launcher as soon as it ends (``launch_env.record_exit``,
NOTE [rank status]), then exits with the same code.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from terrapipe import launch_env, settings


def _die_with_parent() -> None:
    # If the launcher kills this wrapper (it does when another rank fails), the rank goes too.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main() -> int:
    rank = launch_env.world()[0]
    # close_fds=False: the MPI launcher hands each rank its PMI connection as an inherited fd.
    proc = subprocess.Popen(sys.argv[1:], close_fds=False, preexec_fn=_die_with_parent)

    def forward(signum, _frame):
        proc.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, forward)
    rc = proc.wait()
    status_dir = settings.get("TERRAPIPE_RUN_STATUS")
    if status_dir:
        launch_env.record_exit(status_dir, rank, rc)  # NOTE [rank status] in launch_env.py
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
