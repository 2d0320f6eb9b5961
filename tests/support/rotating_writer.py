"""A trainer's checkpoint rotation, as a process: ``python -m tests.support.rotating_writer DIR COUNT``.

Every ``--period`` seconds it publishes ``step_<N>/`` the way trainers do (written under
``tmp-step_<N>``, then renamed), and it keeps only the newest: every older checkpoint is deleted
before the next one appears, so each lives between one and two periods (100-200 ms by default).
The content of each checkpoint is a function of its step (``expected_files``), so a test can
check what was shipped byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time


def expected_files(step: int, size: int = 64 * 1024) -> dict[str, bytes]:
    rng = random.Random(step)
    return {
        "model.bin": rng.randbytes(size),
        "trainer_state.json": json.dumps({"global_step": step}).encode(),
    }


def publish(directory: str, step: int, size: int) -> str:
    tmp = os.path.join(directory, f"tmp-step_{step}")
    os.makedirs(tmp)
    for name, data in expected_files(step, size).items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
    final = os.path.join(directory, f"step_{step}")
    os.rename(tmp, final)
    return final


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("count", type=int)
    parser.add_argument("--period", type=float, default=0.1)
    parser.add_argument("--size", type=int, default=64 * 1024)
    parser.add_argument("--first-step", type=int, default=100)
    args = parser.parse_args()
    newest = None
    for i in range(args.count):
        step = args.first_step + i * 100
        started = time.monotonic()
        # the rotation: everything but the newest goes before the next one is published
        for name in os.listdir(args.directory):
            if name.startswith("step_") and os.path.join(args.directory, name) != newest:
                shutil.rmtree(os.path.join(args.directory, name))
        newest = publish(args.directory, step, args.size)
        print(step, flush=True)
        time.sleep(max(0.0, args.period - (time.monotonic() - started)))
    time.sleep(args.period)
    for name in os.listdir(args.directory):  # the final rotation: only the newest is left
        if name.startswith("step_") and os.path.join(args.directory, name) != newest:
            shutil.rmtree(os.path.join(args.directory, name))


if __name__ == "__main__":
    main()
