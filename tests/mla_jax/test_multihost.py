"""Multi-host: two JAX processes on localhost (4 CPU devices each, gloo collectives) form one 8-device mesh
(tp=2 x dcp=2 x ep=2, devices interleaved so that DCP pairs and every all-reduce span both processes) and run
the same code as one process: the paged schedule's logits equal the one-device full forward within 1e-4 (see
test_parallel.py), the greedy tokens are identical, and both processes return the same results (replicated
outputs, bit for bit)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from tests.mla_jax.multihost_worker import (
    PROMPTS,
    full_logits,
    greedy_tokens,
    parallel_config,
    prompts,
    random_params,
    sequences,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 150  # each worker: start-up, 3 compiles (~5 s each on 2 busy cores), the runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.mla_jax.multihost_worker",
                "--process-id",
                str(i),
                "--num-processes",
                "2",
                "--port",
                str(port),
                "--local-devices",
                "4",
                "--out",
                str(outs[i]),
            ],
            cwd=ROOT,
            env=env,
            stdout=logs[i],
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        # The one-process reference, computed while the workers start up.
        cfg = parallel_config()
        params = random_params(cfg, 0, std=0.2)
        seqs = sequences(cfg)
        full = full_logits(params, cfg, seqs)
        want_tokens = greedy_tokens(random_params(cfg, 1, std=0.3), cfg, prompts(cfg), PROMPTS[1])
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    for i, p in enumerate(procs):
        log = (tmp_path / f"process{i}.log").read_text()
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-4000:]}"
    res = [json.loads(o.read_text()) for o in outs]
    assert [r["process_id"] for r in res] == [0, 1] and all(r["devices"] == 8 for r in res)
    assert res[0]["logits"] == res[1]["logits"] and res[0]["tokens"] == res[1]["tokens"]
    assert len(res[0]["logits"]) == 17
    for r, pos, got in res[0]["logits"]:
        np.testing.assert_allclose(
            np.asarray(got, np.float32), full[r][pos], atol=1e-4, rtol=0, err_msg=f"request {r} position {pos}"
        )
    assert res[0]["tokens"] == want_tokens
