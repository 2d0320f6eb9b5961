"""The Lightning callback in the unified ``lightning`` package's Trainer (``lightning.pytorch``), with
``pytorch_lightning`` installed beside it and without it, and in ``pytorch_lightning``'s without the
unified package; a real Trainer in a child process (one that cannot import a package stands for a
machine without it), a tiny model on the CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptvault import Vault

pytest.importorskip("torch", reason="pip install torch==2.13.0")
pytest.importorskip("lightning", reason="pip install lightning")

ROOT = Path(__file__).resolve().parents[1]

TRAIN = textwrap.dedent(
    """
    import sys
    repo, ckpts, packages = sys.argv[1:]
    if packages == "unified only":
        sys.modules["pytorch_lightning"] = None  # import pytorch_lightning raises ImportError
    if packages == "classic only":
        sys.modules["lightning"] = None

    import torch
    if packages == "classic only":
        import pytorch_lightning as L
        from pytorch_lightning.callbacks import ModelCheckpoint
    else:
        import lightning.pytorch as L
        from lightning.pytorch.callbacks import ModelCheckpoint
    from ckptvault.integrations.lightning import CkptVaultCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _idx):
            (x,) = batch
            return self.layer(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    callback = CkptVaultCallback(repo, run="unified")
    assert isinstance(callback, L.Callback)
    trainer = L.Trainer(
        max_steps=6,
        callbacks=[ModelCheckpoint(dirpath=ckpts, every_n_train_steps=2, save_top_k=1), callback],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), loader)
    print("bases:", [c.__module__ for c in type(callback).__mro__ if c.__name__ == "Callback"])
    """
)


@pytest.mark.parametrize("packages", ["both", "unified only", "classic only"])
def test_either_packages_trainer_ships_every_checkpoint(tmp_path, repo_url, vault, packages):
    ckpts = tmp_path / "ckpts"
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN, repo_url, str(ckpts), packages],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = {
        "both": ["pytorch_lightning.callbacks.callback", "lightning.pytorch.callbacks.callback"],
        "unified only": ["lightning.pytorch.callbacks.callback"],
        "classic only": ["pytorch_lightning.callbacks.callback"],
    }[packages]
    assert f"bases: {expected}" in proc.stdout

    # save_top_k=1 deleted the saves of steps 2 and 4: each was pinned and shipped before that
    assert [p.name for p in ckpts.iterdir()] == ["epoch=0-step=6.ckpt"]
    with Vault.open(repo_url) as written:
        snaps = written.snapshots({"run": "unified"})
        assert sorted(int(s.tags["step"]) for s in snaps) == [2, 4, 6]
        written.restore_latest(tmp_path / "resume", run="unified")
    import torch

    (restored,) = (tmp_path / "resume").iterdir()
    assert torch.load(restored, weights_only=False)["global_step"] == 6


def test_without_any_lightning_the_import_says_what_to_install():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['pytorch_lightning'] = sys.modules['lightning'] = None\n"
            "import ckptvault.integrations.lightning",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 1
    needs = "ImportError: ckptvault's Lightning callback needs PyTorch Lightning: pip install 'ckptvault[lightning]'"
    assert needs in proc.stderr
