"""The worker protocol: results in order, a slow candidate given up, the rest go on."""

from shardkit.autoplanner import worker


def test_a_timed_out_candidate_is_reported_and_a_new_worker_takes_the_rest(monkeypatch):
    started = []

    def fake_run(job, timeout_s):
        started.append(list(job["candidates"]))
        for i, c in enumerate(job["candidates"]):
            if c == "slow":
                yield {"index": i, "timeout": True, "pruned": "too slow"}
                return
            yield {"index": i, "evidence": c}

    monkeypatch.setattr(worker, "_run", fake_run)
    got = list(
        worker.compile_elsewhere({"candidates": ["a", "slow", "b", "slow", "c"]}, timeout_s=1)
    )
    assert [(g["index"], g.get("evidence", g.get("pruned"))) for g in got] == [
        (0, "a"),
        (1, "too slow"),
        (2, "b"),
        (3, "too slow"),
        (4, "c"),
    ]
    assert started == [["a", "slow", "b", "slow", "c"], ["b", "slow", "c"], ["c"]]


def test_a_real_worker_past_its_time_is_stopped():
    # Importing JAX alone takes longer than 10 ms: every candidate times out, each in a
    # worker of its own that is killed.
    job = {
        "model": "gpt-tiny",
        "batch": 16,
        "seq": 32,
        "devices": 16,
        "candidates": [
            {
                "recipe": "dp",
                "mesh": {"data": 16},
                "remat": "none",
                "microbatches": None,
                "precision": "f32",
            }
        ]
        * 2,
    }
    got = list(worker.compile_elsewhere(job, timeout_s=0.01))
    assert [g["index"] for g in got] == [0, 1]
    assert all(g["timeout"] and "longer than 0.01 s" in g["pruned"] for g in got)


def test_a_worker_that_dies_gives_up_that_candidate_only(monkeypatch):
    # A model that cannot be built kills every worker at its first candidate.
    job = {
        "model": "no_such_module:factory",
        "batch": 16,
        "seq": 32,
        "devices": 16,
        "candidates": [
            {
                "recipe": "dp",
                "mesh": {"data": 16},
                "remat": "none",
                "microbatches": None,
                "precision": "f32",
            }
        ]
        * 2,
    }
    got = list(worker.compile_elsewhere(job, timeout_s=120))
    assert [g["index"] for g in got] == [0, 1]
    assert all("compiling process stopped (exit status 1" in g["pruned"] for g in got)


def test_a_worker_compiles_at_llvm_level_0_whatever_the_callers_flags(monkeypatch):
    # Workers compile and never run: LLVM level 0 (tests/test_devices.py shows it leaves
    # memory and collectives as they are), next to the flags the caller already set.
    import subprocess

    seen = {}

    class Stop(Exception):
        pass

    def popen(cmd, env, **kw):
        seen.update(env)
        raise Stop

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/nowhere")
    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        next(worker._run({"candidates": ["a"]}, None))
    except Stop:
        pass
    assert seen["XLA_FLAGS"].split() == [
        "--xla_dump_to=/tmp/nowhere",
        "--xla_backend_optimization_level=0",
    ]
    assert seen["JAX_PLATFORMS"] == "cpu"


def test_a_worker_that_writes_much_to_stderr_is_not_blocked(monkeypatch):
    # XLA's warnings go to stderr. Read only at the end, a pipe full of them (64 KiB on
    # Linux) blocked the worker on its next write, and every candidate after timed out.
    import subprocess
    import sys

    script = (
        "import sys, json; sys.stdin.read(); sys.stderr.write('warning\\n' * 200_000); "
        "sys.stderr.flush(); print(json.dumps({'index': 0, 'evidence': 'ok'}), flush=True)"
    )
    real = subprocess.Popen
    monkeypatch.setattr(
        subprocess, "Popen", lambda cmd, **kw: real([sys.executable, "-c", script], **kw)
    )
    got = list(worker._run({"candidates": ["a"]}, timeout_s=20))
    assert got == [{"index": 0, "evidence": "ok"}]
