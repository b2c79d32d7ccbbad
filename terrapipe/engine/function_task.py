"""A rank of a function job (NOTE [a function as a job] 3 in engine/function_job.py): connect to
the call, take the function, run it, send back its result or its traceback.

    python -m terrapipe.engine.function_task      (started by run_function, via terrapipe run)
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import traceback

from .. import launch_env, settings
from .function_job import OUTPUT, connect


def _redirect_output(folder: str, rank: int, size: int) -> None:
    """This process's stdout and stderr (and its children's) to ``<folder>/rank.<r>/`` (Horovod's
    ``output_filename`` layout: r padded to the width of the largest rank)."""
    where = os.path.join(folder, f"rank.{rank:0{len(str(size - 1))}d}")
    os.makedirs(where, exist_ok=True)
    for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
        stream.flush()
        out = os.open(os.path.join(where, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, stream.fileno())
        os.close(out)


def main() -> int:
    rank, size = launch_env.world()
    output = settings.get(OUTPUT)
    if output:
        _redirect_output(output, rank, size)
    with connect() as conn:
        conn.send_bytes(json.dumps({"rank": rank}).encode())
        # The call's own payload, from a peer that proved it holds this job's key (clause 2).
        func, args, kwargs = pickle.loads(conn.recv_bytes())
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            text = traceback.format_exc()
            conn.send_bytes(json.dumps({"kind": "error"}).encode())
            conn.send_bytes(text.encode())
            sys.stderr.write(f"User function raise error: {exc}\n")  # as Horovod's run_task says
            status = settings.get("TERRAPIPE_RUN_STATUS")
            if status:  # NOTE [rank status]: the launcher names this rank and its exception
                launch_env.record_exit(status, rank, 1, text.strip().splitlines()[-1])
            raise  # uncaught, as in a script (clause 3)
        import cloudpickle

        try:
            body, kind = cloudpickle.dumps(result), "result"
        except Exception:  # noqa: BLE001 (whatever pickling raises: the call is told why)
            why = f"its result ({type(result).__name__}) could not be pickled:\n{traceback.format_exc()}"
            body, kind = why.encode(), "error"
        conn.send_bytes(json.dumps({"kind": kind}).encode())
        conn.send_bytes(body)
        if kind == "error":
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
