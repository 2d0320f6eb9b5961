"""The Lightning callback ships every file a ModelCheckpoint writes, including those written after
all other callbacks ran: last.ckpt at the end of training, the exception checkpoint, and a
checkpoint saved just before training dies. Real Trainer runs on the CPU, a tiny model."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckptvault import Vault

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")
pl = pytest.importorskip("pytorch_lightning", reason="pip install ckptvault[lightning]")

ROOT = Path(__file__).resolve().parents[1]


class Tiny(pl.LightningModule):
    """training_step calls ``on_fail`` at global step ``fail_at``."""

    def __init__(self, fail_at=None, on_fail=None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at, self.on_fail = fail_at, on_fail

    def training_step(self, batch, _idx):
        if self.global_step == self.fail_at:
            self.on_fail()
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(model, ckpt_dir, callback, batches_per_epoch=None, max_steps=10, ckpt_path=None, **checkpointing):
    """``max_steps`` steps of 4 samples (16 per epoch), a ModelCheckpoint keeping every file, then ``callback``."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=max_steps,
        limit_train_batches=batches_per_epoch,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, **checkpointing), callback],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def shipped(vault: Vault) -> dict[str, str]:
    """The file each snapshot holds, by its step tag."""
    return {s.tags["step"]: Path(f.path).name for s in vault.snapshots() for f in vault.files(s) if f.type == "file"}


def test_last_ckpt_written_at_the_end_of_training_is_shipped(tmp_path, vault):
    from ckptvault.integrations.lightning import CkptVaultCallback

    callback = CkptVaultCallback(vault, run="pl")
    trainer = fit(Tiny(), tmp_path / "ckpts", callback, every_n_train_steps=100, save_last=True)

    assert trainer.global_step == 10 and (tmp_path / "ckpts" / "last.ckpt").exists()
    assert all(h.done() for h in callback.handles), "on_train_end waited for the upload"
    assert shipped(vault) == {"10": "last.ckpt"}
    # Lightning still sees exactly one checkpoint callback: ckpt_path="last" and checkpoint_callback work
    (checkpointing,) = trainer.checkpoint_callbacks
    assert trainer.checkpoint_callback is checkpointing and trainer.callbacks[-1] is callback


def test_the_exception_checkpoint_is_shipped(tmp_path, vault):
    from ckptvault.integrations.lightning import CkptVaultCallback

    def fail():
        raise RuntimeError("NCCL watchdog timeout (simulated)")

    callback = CkptVaultCallback(vault, run="pl")
    with pytest.raises(RuntimeError, match="simulated"):
        fit(
            Tiny(fail_at=6, on_fail=fail), tmp_path / "ckpts", callback, every_n_train_steps=100, save_on_exception=True
        )
    vault.flush(60)  # in a script, the interpreter's exit waits for it
    assert shipped(vault) == {"6": "epoch=0-step=6.ckpt"}


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from tests.test_lightning_shipping import Tiny, fit
    from ckptvault import Vault
    from ckptvault.integrations.lightning import CkptVaultCallback

    repo, ckpts, how, when = sys.argv[1:]
    vault = Vault.open(repo)
    callback = CkptVaultCallback(vault, run="pl")

    def crash():
        if how == "raise":
            raise RuntimeError("CUDA out of memory (simulated)")
        # a hard crash (OOM killer, segfault) runs no hook: only what was queued by now can ship;
        # the flush stands for the upload time that the steps before such a crash give it
        vault.flush(60)
        os._exit(3)

    if when == "step":  # saves at steps 2 and 4, dies in step 5
        fit(Tiny(fail_at=4, on_fail=crash), ckpts, callback, every_n_train_steps=2)
    else:  # epochs of 2 steps, saved at each epoch's end; dies in the first step of the third epoch
        fit(Tiny(fail_at=4, on_fail=crash), ckpts, callback, batches_per_epoch=2, every_n_epochs=1)
    """
)


@pytest.mark.parametrize("how, when", [("raise", "step"), ("exit", "step"), ("exit", "epoch")])
def test_a_checkpoint_saved_right_before_a_crash_is_shipped(tmp_path, repo_url, vault, how, when):
    # steps 2 and 4 are saved at their batch end, or at the end of the epochs that end there; the
    # very next training step dies (Lightning runs an epoch end's checkpoint callbacks after all others)
    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, repo_url, str(tmp_path / "ckpts"), how, when],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == (1 if how == "raise" else 3), proc.stderr[-3000:]
    with Vault.open(repo_url) as written:  # what the crashed process committed
        second = "epoch=0-step=4.ckpt" if when == "step" else "epoch=1-step=4.ckpt"
        assert shipped(written) == {"2": "epoch=0-step=2.ckpt", "4": second}, proc.stderr[-3000:]


def test_a_resumed_run_does_not_ship_again_what_the_first_run_shipped(tmp_path, vault):
    from ckptvault.integrations.lightning import CkptVaultCallback

    ckpts = tmp_path / "ckpts"  # on_full="block": no checkpoint is dropped for a newer one
    fit(Tiny(), ckpts, CkptVaultCallback(vault, run="pl", on_full="block"), every_n_train_steps=5, save_last=True)
    first = sorted((s.tags.get("step"), f.path) for s in vault.snapshots() for f in vault.files(s))
    # last.ckpt, saved with each top-k file, is that save again: one snapshot per save (train 37 T3)
    assert first == [("10", "epoch=0-step=10.ckpt"), ("5", "epoch=0-step=5.ckpt")]

    # a new process resumes from last.ckpt: ModelCheckpoint's restored state lists the first run's files
    fit(
        Tiny(),
        ckpts,
        CkptVaultCallback(vault, run="pl", on_full="block"),
        every_n_train_steps=5,
        save_last=True,
        max_steps=20,
        ckpt_path=str(ckpts / "last.ckpt"),
    )
    after = sorted((s.tags.get("step", ""), f.path) for s in vault.snapshots() for f in vault.files(s))
    assert after == sorted(
        [
            *first,
            ("15", "epoch=0-step=15.ckpt"),
            ("20", "epoch=1-step=20.ckpt"),
        ]
    )


@pytest.mark.parametrize("full_first", [False, True])
def test_another_callbacks_last_ckpt_of_the_same_step_is_another_save_and_ships(tmp_path, vault, full_first):
    """Weights-only top-k files beside a full, resumable last.ckpt of another ModelCheckpoint: the full one
    was taken for the top-k file's copy and never shipped; restore latest gave weights without optimizer
    (with the full callback listed first, also before: the weights-only file was the later upload)."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from ckptvault.integrations.lightning import CkptVaultCallback

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    weights = ModelCheckpoint(  # mode: Lightning refuses two callbacks of one state key
        tmp_path / "weights", save_top_k=-1, every_n_train_steps=5, save_weights_only=True, mode="max"
    )
    full = ModelCheckpoint(tmp_path / "full", save_top_k=0, save_last=True, every_n_train_steps=5)
    callback = CkptVaultCallback(vault, run="pl", on_full="block")
    trainer = pl.Trainer(
        max_steps=10,
        callbacks=[full, weights, callback] if full_first else [weights, full, callback],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), loader)
    files = sorted((s.tags["step"], f.path) for s in vault.snapshots() for f in vault.files(s))
    assert files == [
        ("10", "epoch=0-step=10.ckpt"),
        ("10", "last.ckpt"),
        ("5", "epoch=0-step=5.ckpt"),
        ("5", "last.ckpt"),
    ]
    vault.restore_latest(tmp_path / "resume", run="pl")
    assert [p.name for p in (tmp_path / "resume").iterdir()] == ["last.ckpt"]  # the full save, not weights
    assert "optimizer_states" in torch.load(tmp_path / "resume" / "last.ckpt", weights_only=False)


def test_a_last_ckpt_is_not_marked_shipped_while_its_top_k_file_failed_to_ship(tmp_path, vault):
    """last.ckpt sorted before step=5.ckpt was marked shipped (as that save's copy) before the top-k
    file's ship raised: the step reached the vault under neither name."""
    import types

    from ckptvault.errors import SourceError
    from ckptvault.integrations.lightning import CkptVaultCallback

    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for name in ("step=5.ckpt", "last.ckpt"):
        (ckpts / name).write_bytes(b"save 5" * 100)
    top_k, last = str(ckpts / "step=5.ckpt"), str(ckpts / "last.ckpt")
    checkpointing = types.SimpleNamespace(last_model_path=last, best_model_path=top_k, best_k_models={top_k: 0.1})
    trainer = types.SimpleNamespace(is_global_zero=True, checkpoint_callbacks=[checkpointing])
    failing = [True]

    class Failing(CkptVaultCallback):
        def ship(self, path, step):
            if failing[0] and path == top_k:
                raise SourceError(path, "simulated failure of this ship")
            return super().ship(path, step)

    callback = Failing(vault, run="pl")
    callback._saving_step = 5
    with pytest.raises(SourceError):
        callback._ship_new(trainer)
    assert callback._shipped == set() and vault.snapshots() == []
    failing[0] = False
    callback._ship_new(trainer)  # the next hook offers both again: the top-k file ships, its copy does not
    vault.flush(60)
    assert shipped(vault) == {"5": "step=5.ckpt"}
    assert {key[0] for key in callback._shipped} == {top_k, last}


def test_a_run_resumed_from_a_top_k_file_does_not_ship_the_earlier_last_ckpt_without_a_step(tmp_path, vault):
    """The earlier run's last.ckpt, a copy of its newest top-k file and so never shipped, was offered to the
    resumed run with no step known (neither saved nor loaded by it): a snapshot without a step tag, after
    which latest went by time for the whole run."""
    from ckptvault.integrations.lightning import CkptVaultCallback

    ckpts = tmp_path / "ckpts"
    steps = {"every_n_train_steps": 4, "save_last": True, "batches_per_epoch": 4}
    fit(Tiny(), ckpts, CkptVaultCallback(vault, run="pl", on_full="block"), max_steps=12, **steps)
    resumed = CkptVaultCallback(vault, run="pl", on_full="block")
    fit(Tiny(), ckpts, resumed, max_steps=16, ckpt_path=ckpts / "epoch=2-step=12.ckpt", **steps)
    snapshots = sorted((int(s.tags["step"]), f.path) for s in vault.snapshots() for f in vault.files(s))
    assert snapshots == [
        (4, "epoch=0-step=4.ckpt"),
        (8, "epoch=1-step=8.ckpt"),
        (12, "epoch=2-step=12.ckpt"),
        (16, "epoch=3-step=16.ckpt"),
    ]


def test_the_checkpoint_a_run_resumes_from_is_shipped_with_its_step(tmp_path, vault):
    # the first run's last.ckpt never reached this vault (it shipped elsewhere); the resumed run
    # offers it before saving anything: its step is the one the resume loaded, not none
    from ckptvault.integrations.lightning import CkptVaultCallback

    ckpts = tmp_path / "ckpts"
    with Vault.open(tmp_path / "elsewhere", create=True) as elsewhere:
        fit(Tiny(), ckpts, CkptVaultCallback(elsewhere, run="pl"), every_n_train_steps=100, save_last=True, max_steps=6)
    callback = CkptVaultCallback(vault, run="pl", on_full="block")
    last = str(ckpts / "last.ckpt")
    fit(Tiny(), ckpts, callback, every_n_train_steps=100, save_last=True, max_steps=8, ckpt_path=last)
    assert sorted(s.tags.get("step", "none") for s in vault.snapshots()) == ["6", "8"]


def test_the_on_exception_checkpoint_callbacks_file_is_shipped(tmp_path, vault):
    from pytorch_lightning.callbacks import OnExceptionCheckpoint

    from ckptvault.integrations.lightning import CkptVaultCallback

    def fail():
        raise RuntimeError("preempted (simulated)")

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4)), batch_size=4)
    trainer = pl.Trainer(
        max_steps=10,
        callbacks=[OnExceptionCheckpoint(tmp_path / "ckpts"), CkptVaultCallback(vault, run="pl")],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="preempted"):
        trainer.fit(Tiny(fail_at=3, on_fail=fail), loader)
    vault.flush(60)
    assert shipped(vault) == {"3": "on_exception.ckpt"}


def test_a_run_resumes_from_the_restored_checkpoint_as_if_never_interrupted(tmp_path, vault):
    """The path docs/training.md gives: the instance is lost, ``restore_latest`` brings back the
    newest .ckpt, ``fit(ckpt_path=...)`` goes on, and the weights end as an uninterrupted run's."""
    import shutil

    from ckptvault.integrations.lightning import CkptVaultCallback

    torch.manual_seed(1)
    uninterrupted = Tiny()
    fit(uninterrupted, tmp_path / "whole", pl.Callback(), batches_per_epoch=5, max_steps=20)

    torch.manual_seed(1)
    callback = CkptVaultCallback(vault, run="pl", on_full="block")
    fit(Tiny(), tmp_path / "ckpts", callback, batches_per_epoch=5, max_steps=10, every_n_train_steps=5)
    shutil.rmtree(tmp_path / "ckpts")  # the machine is gone

    vault.restore_latest(tmp_path / "resume", run="pl")
    (ckpt,) = (tmp_path / "resume").glob("*.ckpt")
    assert ckpt.name == "epoch=1-step=10.ckpt"
    resumed = Tiny()
    trainer = fit(
        resumed,
        tmp_path / "ckpts",
        CkptVaultCallback(vault, run="pl"),
        batches_per_epoch=5,
        max_steps=20,
        ckpt_path=str(ckpt),
    )
    assert trainer.global_step == 20
    assert torch.equal(resumed.layer.weight, uninterrupted.layer.weight)
    assert torch.equal(resumed.layer.bias, uninterrupted.layer.bias)


def test_checkpoints_saved_into_the_vault_are_refused_before_training(tmp_path, vault):
    from ckptvault.errors import UsageError
    from ckptvault.integrations.lightning import CkptVaultCallback

    inside = Path(vault.local_folder) / "ckpts"
    with pytest.raises(UsageError, match="inside the vault at"):
        fit(Tiny(), inside, CkptVaultCallback(vault, run="pl"), every_n_train_steps=1)
    assert not inside.exists(), "no checkpoint was written"
