"""The code examples of docs/training.md's Resume section, run as written: a restart resumes more than once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptvault import Vault
from tests.conftest import write_file

ROOT = Path(__file__).resolve().parents[1]
TRAINING_MD = (ROOT / "docs" / "training.md").read_text()


def block_after(words: str, lang: str) -> str:
    """The first ```lang block after ``words`` in docs/training.md."""
    start = TRAINING_MD.index(words)
    found = re.compile(rf"```{lang}\n(.*?)```", re.S).search(TRAINING_MD, start)
    assert found is not None, words
    return found.group(1)


class Trainer:
    """The user's trainer (not ckptvault's): what it was given to resume from."""

    def __init__(self) -> None:
        self.resumed_from: list[bytes] = []

    def train(self, resume_from_checkpoint: str) -> None:
        self.resumed_from.append((Path(resume_from_checkpoint) / "trainer_state.json").read_bytes())


def save(vault: Vault, tmp_path: Path, step: int) -> None:
    ckpt = tmp_path / "saves" / f"checkpoint-{step}"
    write_file(ckpt / "model.safetensors", os.urandom(2000))
    write_file(ckpt / "trainer_state.json", f'{{"global_step": {step}}}'.encode())
    vault.backup(ckpt, tags={"run": "exp-7", "step": str(step)})


@pytest.mark.parametrize("example", ["Hugging Face (each snapshot", "Ship them first, where the checkpoints"])
def test_the_python_resume_examples_resume_a_second_time_on_the_same_disk(tmp_path, vault, monkeypatch, example):
    """The Hugging Face resume and the same-disk restart restored into ./resume, which the previous resume
    on that disk had filled: the second restart raised RestoreConflictError (api57 #2)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    code = block_after(example, "python")
    trainer = Trainer()
    for step in (100, 200):  # a restart, training on, a second restart on the same disk
        save(vault, tmp_path, step)
        exec(code, {"vault": vault, "shutil": shutil, "trainer": trainer})
    if "trainer" in code:
        assert trainer.resumed_from == [b'{"global_step": 100}', b'{"global_step": 200}']
    assert (tmp_path / "resume" / "trainer_state.json").read_bytes() == b'{"global_step": 200}'


def test_the_restart_script_resumes_a_second_time_on_the_same_disk(tmp_path, vault):
    """Its `ckptvault restore latest ... ./resume` exited 22 at the second restart (api57 #2)."""
    (tmp_path / "out").mkdir()
    line = block_after("from a shell script that restarts training", "bash").strip()
    ckptvault = f"{sys.executable} -m ckptvault"
    script = line.replace("ckptvault ", f"{ckptvault} ").replace("python train.py", "cat ./resume/trainer_state.json")
    env = {**os.environ, "CKPTVAULT_REPO": vault.url, "PYTHONPATH": str(ROOT)}
    for step in (100, 200):
        save(vault, tmp_path, step)
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=99)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.endswith(f'{{"global_step": {step}}}'), proc.stdout
