"""The throughput benchmark's CPU sampler: a process's CPU, its main thread's, the machine's."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lab.bench.harness import CpuSampler, machine_busy_s

pytestmark = pytest.mark.skipif(machine_busy_s() is None, reason="needs Linux /proc")

# once told to, burns 0.6 CPU-s (counted on the CPU clock, not the wall's) in the main thread
# or in another thread, then waits to be killed
BURN = """
import sys, threading, time
sys.stdin.readline()
def burn():
    t = time.thread_time()
    while time.thread_time() - t < 0.6:
        pass
    print("done", flush=True)
if sys.argv[1] == "main":
    burn()
else:
    threading.Thread(target=burn).start()
time.sleep(60)
"""


def _sampled(where: str) -> tuple[float, float, float]:
    p = subprocess.Popen([sys.executable, "-c", BURN, where], stdout=subprocess.PIPE, text=True)
    try:
        with CpuSampler(p.pid, every_s=0.05) as cpu:
            t0 = time.time()
            assert p.stdout is not None and p.stdout.readline().strip() == "done"
            time.sleep(0.2)  # a sample after the burn
            t1 = time.time()
        return (
            cpu.cpu_between(t0, t1),
            cpu.main_thread_between(t0, t1),
            cpu.machine_busy_between(t0, t1),
        )
    finally:
        p.kill()
        p.wait()


def test_the_main_thread_is_counted_apart_from_the_process() -> None:
    proc, main, box = _sampled("main")
    assert proc >= 0.5 and main >= 0.5  # the burn, less the clock tick's rounding
    assert main <= proc + 0.02
    assert box >= main - 0.02  # the machine was busy at least that much


def test_work_on_another_thread_is_not_the_main_threads() -> None:
    proc, main, _ = _sampled("thread")
    assert proc >= 0.5
    assert main < 0.2  # the burn ran elsewhere
