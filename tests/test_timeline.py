"""terrapipe.timeline: recording, bounds, files, clock alignment, and the step summary."""

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from terrapipe import timeline
from terrapipe.timeline_summary import as_dict, format_summary, summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def recording(tmp_path, monkeypatch):
    """Record into tmp_path/t.json for the test; stopped (and not written) afterwards."""
    path = tmp_path / "t.json"
    timeline.start(str(path))
    yield path
    timeline.stop(write=False)


def check_nesting(events):
    """Complete events of one row nest (Chrome's rule); returns the number checked."""
    rows = {}
    for e in events:
        if e.get("ph") == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], -e["dur"], e["name"]))
    for row, spans in rows.items():
        spans.sort()
        stack = []
        for ts, neg, name in spans:
            end = ts - neg
            while stack and stack[-1][0] <= ts + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1][0] + 1e-3, f"row {row}: {name} crosses {stack[-1][1]}"
            stack.append((end, name))
    return sum(len(s) for s in rows.values())


def test_off_records_nothing_and_writes_no_file(tmp_path):
    assert not timeline.enabled()
    with timeline.span("comm", "x") as s:
        pass
    assert s is timeline.span("loader", "y")  # one shared no-op
    timeline.record("comm", "x", 0, 1)
    timeline.instant("comm", "x")
    assert timeline.stop() == []
    assert list(tmp_path.iterdir()) == []


def test_spans_from_threads_nest_in_named_rows_and_merge(recording):
    def work(k):
        with timeline.span("loader", "sample", args={"k": k}):
            with timeline.span("loader", "decode"):
                pass
            with timeline.span("loader", "kernel"):
                pass

    threads = [threading.Thread(target=work, args=(k,), name=f"worker-{k}") for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with pytest.raises(KeyError), timeline.span("engine", "fails"):
        raise KeyError("boom")
    timeline.async_begin("comm", "allreduce", 7)
    timeline.async_end("comm", "allreduce", 7)
    timeline.flush()
    events = timeline.stop()  # written: the part stays
    part = Path(f"{recording}.rank0")
    assert part.exists()
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {f"worker-{k}" for k in range(4)} <= names and "MainThread" in names
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 13 and check_nesting(events) == 13
    failed = [e for e in spans if e["name"] == "fails"]
    assert failed[0]["args"]["error"] == "KeyError: 'boom'"
    assert [e["ph"] for e in events if e["name"] == "allreduce"] == ["b", "e"]
    assert timeline.merge(str(recording)) == len(events)
    assert json.loads(recording.read_text()) == events and not part.exists()


def test_merge_joins_parts_in_rank_order_and_removes_them(tmp_path):
    path = tmp_path / "job.json"
    for r in (1, 0, 10, 2):
        lines = [{"ph": "X", "cat": "comm", "name": f"r{r}", "pid": r, "tid": 0, "ts": r, "dur": 1}]
        Path(f"{path}.rank{r}").write_text("\n".join(json.dumps(e) for e in lines) + "\n")
    Path(f"{path}.rank3.tmp").write_text("not a part")
    assert timeline.merge(str(path)) == 4
    assert [e["pid"] for e in json.loads(path.read_text())] == [0, 1, 2, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.json", "job.json.rank3.tmp"]
    with pytest.raises(ValueError, match="no parts"):
        timeline.merge(str(tmp_path / "none.json"))


def test_a_part_cut_mid_line_loads_but_damage_is_named(tmp_path):
    path = tmp_path / "job.json"
    good = json.dumps({"ph": "i", "cat": "engine", "name": "epoch 0", "pid": 0, "tid": 0, "ts": 1})
    Path(f"{path}.rank0").write_text(good + "\n" + good[:20])  # a rank killed mid-write
    assert len(timeline.load(str(path))) == 1
    Path(f"{path}.rank1").write_text(good[:20] + "\n" + good + "\n")
    with pytest.raises(ValueError, match=r"job.json.rank1: line 1"):
        timeline.load(str(path))


def test_a_full_ring_drops_and_counts_and_memory_stays_bounded(recording, monkeypatch):
    monkeypatch.setattr(timeline, "CAPACITY", 100)
    timeline.flush()
    writer = timeline._writer
    with writer.lock:  # the writer cannot drain meanwhile: the ring fills
        for k in range(1000):
            timeline.instant("engine", f"e{k}")
        ring = timeline._local.ring
        assert len(ring.events) == 100 and timeline.dropped() == 900
    timeline.flush()
    events = timeline.stop()
    kept = [e for e in events if e.get("cat") == "engine"]
    assert [e["name"] for e in kept] == [f"e{k}" for k in range(100)]  # the newest were refused
    lost = [e for e in events if e["name"] == "events dropped"]
    assert lost[-1]["args"]["dropped"] == 900


def test_a_live_trace_is_whole_json_whenever_it_is_read_and_leaves_no_parts(tmp_path):
    """NOTE [one trace per job] 5-6: a reader racing the writer parses the file (a rare read that
    overlaps a drain's write parses when read again) and sees every event in order, none lost."""
    import time

    path = tmp_path / "live.json"
    timeline.start(str(path), live=True)
    assert timeline.live()
    stop = threading.Event()

    def record():
        k = 0
        while not stop.is_set():
            timeline.record("comm", f"span{k}", timeline.now(), timeline.now() + 1000, lane=f"lane{k % 3}")
            k += 1
            time.sleep(0.0005)

    t = threading.Thread(target=record)
    t.start()
    try:
        reads, seen, torn = 0, 0, 0
        deadline = time.monotonic() + 60
        while reads < 200 and time.monotonic() < deadline:
            if path.exists():
                try:
                    events = json.loads(path.read_text())
                except json.JSONDecodeError:  # the read overlapped a drain's copy: read again
                    torn += 1
                    time.sleep(0.001)
                    events = json.loads(path.read_text())
                spans = [e["name"] for e in events if e["ph"] == "X"]
                assert spans == [f"span{k}" for k in range(len(spans))]  # in order, none lost
                assert len(spans) >= seen
                seen, reads = len(spans), reads + 1
            time.sleep(0.002)
        assert reads == 200 and seen > 0 and torn <= reads // 10, (reads, seen, torn)
    finally:
        stop.set()
        t.join()
    events = timeline.stop()
    assert not timeline.enabled() and not timeline.live()
    assert json.loads(path.read_text()) == events
    spans = [e["name"] for e in events if e["ph"] == "X"]
    assert spans == [f"span{k}" for k in range(len(spans))] and len(spans) >= seen
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {"lane0", "lane1", "lane2"}
    meta = next(e for e in events if e["name"] == "process_name")
    epoch_us = meta["args"]["start_time_since_epoch_in_micros"]
    first = min(e["ts"] for e in events if e["ph"] == "X")
    assert abs(epoch_us + first - time.time() * 1e6) < 120e6  # the span's wall time, within the test
    timeline._at_exit()  # a live trace is not a part: nothing to mark or merge
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.json"]


def test_a_trace_whose_file_was_removed_stops_quietly(tmp_path):
    # Regression: Horovod's test_timeline removes its temporary folder before hvd.shutdown, and
    # stopping the live trace raised FileNotFoundError at exit.
    for live in (True, False):
        folder = tmp_path / f"gone{int(live)}"
        folder.mkdir()
        timeline.start(str(folder / "t.json"), live=live)
        timeline.instant("engine", "x")
        timeline.flush()
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
        assert timeline.stop() == [] and not timeline.enabled()


def test_start_refuses_a_folder_it_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="path"):
        timeline.start("")
    with pytest.raises(OSError, match="cannot write .*nowhere"):
        timeline.start(str(tmp_path / "nowhere" / "t.json"))
    assert not timeline.enabled()


@pytest.mark.parametrize("skew_s", [0.0, 5.0, -1234.5])
def test_offset_estimate_is_within_its_bound_under_asymmetric_delays(skew_s):
    rnd = random.Random(int(skew_s * 10))
    clock = {"t": 10**12}

    def local():
        return clock["t"]

    def exchange(t):  # the reference reads its clock after a random delay, answers after another
        clock["t"] += rnd.randrange(20_000, 400_000)
        ref = clock["t"] + int(skew_s * 1e9)
        clock["t"] += rnd.randrange(20_000, 400_000)
        return ref

    offset, bound = timeline.estimate_offset(exchange, rounds=12, clock=local)
    assert abs(offset - int(skew_s * 1e9)) <= bound
    assert bound <= 400_000


def _steps_trace():
    """Two ranks, three steps each, with known data / comm / compute times (microseconds)."""
    ev = [{"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "MainThread"}}
          for r in (0, 1)]

    def x(pid, cat, name, ts, dur, tid=0):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur})

    for r, (data, compute) in enumerate([(10, 50), (30, 60)]):
        t = 0
        for _ in range(3):
            step = data + compute + 20
            x(r, "loader", "wait batch", t, data)
            x(r, "loader", "next batch", t, data)  # nested in the same wait: counted once
            x(r, "engine", "forward", t + data, compute / 2)
            x(r, "engine", "backward", t + data + compute / 2, compute / 2)
            x(r, "engine", "optimizer step", t + data + compute, 20)
            x(r, "comm", "wait gradients", t + data + compute, 15)
            x(r, "comm", "allreduce", t + data + 5, 40, tid=1)  # on the comm thread: overlapped
            t += step
    return ev


def test_summary_splits_step_time_and_names_the_slowest_rank(tmp_path):
    ranks = summarize(_steps_trace())
    assert ranks[0].total == [80, 80, 80] and ranks[0].data == [10] * 3 and ranks[0].comm == [15] * 3
    assert ranks[1].total == [110] * 3 and ranks[1].compute == [65] * 3
    d = as_dict(ranks, skip=1)
    assert d["ranks"][0]["data"] == pytest.approx(10 / 80)
    assert d["ranks"][0]["comm"] == pytest.approx(15 / 80)
    assert d["slowest_per_step"] == [1, 1, 1] and d["ranks"][1]["slowest_steps"] == 2
    assert "exposed comm" in format_summary(ranks)
    with pytest.raises(ValueError, match="optimizer step"):
        summarize([e for e in _steps_trace() if e["name"] != "optimizer step"])


def test_summary_command_prints_and_plots(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(_steps_trace()))
    png = tmp_path / "s.png"
    r = subprocess.run([sys.executable, "-m", "terrapipe.cli", "timeline", "summary", str(path), "--png",
                        str(png)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "exposed comm" in r.stdout and png.stat().st_size > 1000
    r = subprocess.run([sys.executable, "-m", "terrapipe.cli", "timeline", "summary", str(path), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert json.loads(r.stdout)["slowest_per_step"] == [1, 1, 1]
