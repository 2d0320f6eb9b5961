"""The framework callbacks, with the real libraries: a tiny model trained on the CPU, checkpoints
saved under a rotation that keeps only the newest, every one of them shipped."""

from __future__ import annotations

import copyreg
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptvault import Vault
from ckptvault.errors import UsageError
from ckptvault.integrations.shipping import Shipping

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")

ROOT = Path(__file__).resolve().parents[1]


def test_transformers_trainer_callback_ships_every_save_despite_save_total_limit(tmp_path, vault):
    transformers = pytest.importorskip("transformers", reason="pip install ckptvault[hf]")
    pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate")
    from ckptvault.integrations.hf import CkptVaultCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 32, (8,)), "labels": torch.randint(0, 32, (8,))} for _ in range(32)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        save_steps=2,
        save_total_limit=1,  # the Trainer deletes every older checkpoint as it saves a new one
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = CkptVaultCallback(vault, run="hf")
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()

    assert all(h.done() for h in callback.handles), "on_train_end waited for the uploads"
    snaps = vault.snapshots({"run": "hf"})
    assert sorted(int(s.tags["step"]) for s in snaps) == [2, 4, 6]
    assert os.listdir(tmp_path / "out") == ["checkpoint-6"], "the Trainer's rotation ran"
    vault.restore_latest(tmp_path / "resume", run="hf")
    restored = {p.name for p in (tmp_path / "resume").iterdir()}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= restored
    # a Trainer resumes from what the vault gave back
    resumed_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out2"), max_steps=8, save_steps=100, report_to=[], use_cpu=True, disable_tqdm=True
    )
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=resumed_args, train_dataset=data)
    trainer.train(resume_from_checkpoint=str(tmp_path / "resume"))
    assert trainer.state.global_step == 8


def test_the_callbacks_leave_out_what_exclude_names(tmp_path, vault):
    pytest.importorskip("transformers", reason="pip install ckptvault[hf]")
    from ckptvault.integrations.hf import CkptVaultCallback

    with pytest.raises(UsageError, match="is absolute"):
        CkptVaultCallback(vault, exclude=["/out/checkpoint-2/optimizer.pt"])  # before training starts
    ckpt = tmp_path / "out" / "checkpoint-2"
    ckpt.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "events.out.tfevents.1"):
        (ckpt / name).write_bytes(name.encode() * 100)
    callback = CkptVaultCallback(vault, run="hf", exclude=["events.out.tfevents.*"])
    callback.ship(str(ckpt), 2)
    vault.flush(timeout=120)
    assert {e.path for e in vault.files(vault.latest({"run": "hf"}))} == {"model.safetensors", "optimizer.pt"}


def test_a_trainer_saving_into_the_vault_is_refused_before_training(tmp_path):
    # a vault made where the trainer writes: each save would be refused mid-training
    transformers = pytest.importorskip("transformers", reason="pip install ckptvault[hf]")
    pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate")
    from ckptvault.integrations.hf import CkptVaultCallback

    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    data = [{"input_ids": torch.randint(0, 32, (8,)), "labels": torch.randint(0, 32, (8,))} for _ in range(8)]
    out = str(tmp_path / "out")
    args = transformers.TrainingArguments(output_dir=out, max_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
    callback = CkptVaultCallback(out, run="hf")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with pytest.raises(UsageError, match=r"saves its checkpoints in .*/out, inside the vault at"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_lightning_callback_ships_every_checkpoint_despite_save_top_k(tmp_path, vault):
    pl = pytest.importorskip("pytorch_lightning", reason="pip install ckptvault[lightning]")
    from pytorch_lightning.callbacks import ModelCheckpoint

    from ckptvault.integrations.lightning import CkptVaultCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    ckpt_dir = tmp_path / "ckpts"
    checkpointing = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=1)  # keeps only the newest
    callback = CkptVaultCallback(vault, run="pl")
    trainer = pl.Trainer(
        max_steps=6,
        callbacks=[checkpointing, callback],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), loader)

    snaps = vault.snapshots({"run": "pl"})
    assert sorted(int(s.tags["step"]) for s in snaps) == [2, 4, 6]
    assert [p.name for p in ckpt_dir.iterdir() if p.suffix == ".ckpt"] == ["epoch=0-step=6.ckpt"]
    vault.restore_latest(tmp_path / "resume", run="pl")
    (restored,) = Path(tmp_path / "resume").iterdir()
    assert restored.name == "epoch=0-step=6.ckpt"
    state = torch.load(restored, weights_only=False)
    assert state["global_step"] == 6


def test_the_callbacks_open_a_vault_by_url(tmp_path):
    pytest.importorskip("transformers")
    from ckptvault.integrations.hf import CkptVaultCallback

    callback = CkptVaultCallback(str(tmp_path / "new-vault"), run="x")
    assert isinstance(callback.vault, Vault) and callback.tags == {"run": "x"}
    callback.vault.close()


def test_a_callback_given_a_url_uses_the_keyfile_the_cli_would(tmp_path, monkeypatch):
    # a job exporting CKPTVAULT_KEYFILE for `ckptvault restore` must not get an unencrypted vault
    pytest.importorskip("transformers")
    from ckptvault.crypto.keyfile import Keyfile
    from ckptvault.errors import KeyfileNotFoundError
    from ckptvault.integrations.hf import CkptVaultCallback

    key, _ = Keyfile.create("job passphrase", scrypt_n=2**14)
    key = key.save(tmp_path / "job.key")
    monkeypatch.setenv("CKPTVAULT_KEYFILE", key.path)
    monkeypatch.setenv("CKPTVAULT_PASSPHRASE", "job passphrase")
    url = str(tmp_path / "new-vault")
    CkptVaultCallback(url, run="x").vault.close()
    with pytest.raises(KeyfileNotFoundError):  # encrypted: no key, no vault
        Vault.open(url).close()
    Vault.open(url, keyfile=key.path, passphrase="job passphrase").close()
    # an existing vault in the clear: refused when the callback is made, not at the first checkpoint (whose every
    # ship a keyfile given for a plain vault refuses)
    Vault.init(str(tmp_path / "plain")).close()
    with pytest.raises(UsageError, match="is not encrypted but a keyfile was given"):
        CkptVaultCallback(str(tmp_path / "plain"), run="x")
    plain = Vault.open(str(tmp_path / "plain"), keyfile=key.path)  # an open one, too
    with plain, pytest.raises(UsageError, match="is not encrypted but a keyfile was given"):
        CkptVaultCallback(plain, run="x")


def test_vault_open_creating_an_unencrypted_vault_while_a_keyfile_is_in_the_environment_warns(
    tmp_path, monkeypatch, caplog
):
    """The API reads no key from the environment (the CLI and the callbacks do): in a job set up for
    encrypted vaults, ``Vault.open(url, create=True)`` made a vault in the clear without a word."""
    monkeypatch.setenv("CKPTVAULT_KEYFILE", str(tmp_path / "job.key"))
    with caplog.at_level("WARNING", logger="ckptvault"):
        Vault.open(tmp_path / "clear", create=True).close()
        Vault.open(tmp_path / "clear", create=True).close()  # opened, not created: said once
    warnings = [r.getMessage() for r in caplog.records if "CKPTVAULT_KEYFILE is set" in r.getMessage()]
    assert len(warnings) == 1 and "created" in warnings[0] and "unencrypted" in warnings[0], caplog.text


def torchrun() -> list[str]:
    with socket.socket() as s:  # a free port for the rendezvous (port 0 there never meets)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]


@pytest.mark.slow
def test_hf_under_ddp_ships_a_checkpoint_only_once_every_rank_wrote_its_files(tmp_path):
    """Each rank writes its own rng_state_<rank>.pth into checkpoint-<step>; rank 0's on_save came
    first and shipped the folder without the slower rank's file (a resume lost rank 1's RNG state)."""
    pytest.importorskip("transformers", reason="pip install ckptvault[hf]")
    pytest.importorskip("accelerate", reason="the transformers Trainer needs accelerate")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTVAULT_")}
    for attempt in range(2):
        vault_url = str(tmp_path / f"vault{attempt}")
        Vault.init(vault_url).close()
        proc = subprocess.run(
            [
                *torchrun(),
                str(ROOT / "tests" / "support" / "ddp_trainer.py"),
                str(tmp_path / f"out{attempt}"),
                vault_url,
            ],
            cwd=ROOT,
            env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        # once in CI, under load, a rank died in its first step in torch's C++ (gloo), before any save
        if "terminate called without an active exception" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    with Vault.open(vault_url) as vault:
        snaps = vault.snapshots({"run": "ddp"})
        assert sorted(int(s.tags["step"]) for s in snaps) == [2, 4]
        for snap in snaps:
            names = {e.path for e in vault.files(snap)}
            assert {"rng_state_0.pth", "rng_state_1.pth"} <= names, (snap.tags["step"], sorted(names))


SIGTERMED_TRAINER = """
import sys, time
import tests.support.slowfs
from ckptvault import Vault
from ckptvault.errors import UsageError
from ckptvault.integrations.shipping import Shipping
from ckptvault.integrations.shipping import Shipping
from tests.test_async_backup import make_checkpoint
from pathlib import Path
vault = Vault.open("slowfile://" + sys.argv[1], storage_options={"delay": "0.1"})
shipping = Shipping(vault, run="pre")  # what the callbacks are made of
for step in (1, 2, 3):
    shipping.ship(str(make_checkpoint(Path(sys.argv[2]) / f"step_{step}", step)), step)
print("queued", flush=True)
# training goes on until the preemption notice: Python code between steps, where a handler runs (a signal
# that lands in the instant before one long sleep starts waits for its end, a CPython race: docs/training.md)
for _ in range(1200):
    time.sleep(0.1)
"""


@pytest.mark.parametrize("delivered", [1, 2])
def test_a_sigterm_to_a_trainer_ships_the_queued_checkpoints_before_it_exits(tmp_path, delivered: int):
    """SIGTERM is the preemption notice (spot, Kubernetes, SLURM): left to its default it ended the
    process at once and every queued checkpoint was lost, without a word. GNU ``timeout`` delivers it
    twice (to the process, then to its process group): the second copy ended the process at once."""
    Vault.init(str(tmp_path / "repo")).close()
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERMED_TRAINER, str(tmp_path / "repo"), str(tmp_path / "ckpts")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "queued"
    proc.send_signal(signal.SIGTERM)
    if delivered == 2:
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "SIGTERM: shipping the queued checkpoints" in err
    with Vault.open(str(tmp_path / "repo")) as vault:
        assert sorted(int(s.tags["step"]) for s in vault.snapshots({"run": "pre"})) == [1, 2, 3]


def test_a_callback_sent_to_another_process_reopens_its_vault_there(tmp_path):
    """Lightning's ddp_spawn pickles its callbacks into the processes it spawns: an open Vault (its
    locks, threads and queue) cannot travel; the copy reopens the vault by URL where it ships."""
    pytest.importorskip("pytorch_lightning", reason="pip install ckptvault[lightning]")
    import pickle

    from ckptvault.integrations.lightning import CkptVaultCallback

    with Vault.init(str(tmp_path / "vault")) as vault:
        callback = CkptVaultCallback(vault, run="spawned")
        copy = pickle.loads(pickle.dumps(callback))
        assert copy._vault == vault.url and callback.vault is vault
        (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"weights")
        copy.ship(str(tmp_path / "epoch=0-step=2.ckpt"), 2)
        copy.finish_shipping()
        copy.vault.close()
        assert [s.tags["step"] for s in vault.snapshots({"run": "spawned"})] == ["2"]


class _QuietShipping(Shipping):
    """A plain Shipping callback (module level: pickled by reference), leaving SIGTERM alone."""

    ship_on_sigterm = False


class _PickledBefore:
    """Pickles as a _QuietShipping whose state is ``state``: what an older ckptvault wrote."""

    def __init__(self, state: dict[str, object]) -> None:
        self.state = state

    def __reduce__(self) -> tuple[object, ...]:
        return (copyreg._reconstructor, (_QuietShipping, object, None), self.state)  # as protocol 0-1 pickle


def test_a_callback_pickled_by_an_older_ckptvault_unpickles_and_ships(tmp_path):
    """rv49 #6: the vault became a property over ``_vault``; an older ckptvault pickled the URL under
    "vault", so the copy failed ("'Shipping' object has no attribute '_vault'") where it shipped."""
    with Vault.init(str(tmp_path / "vault")) as vault:
        state = _QuietShipping(vault, run="old").__getstate__()
        state["vault"] = state.pop("_vault")
        del state["hostname"]  # (newer than the rename)
        old = pickle.dumps(_PickledBefore(state))
        copy = pickle.loads(old)
        assert type(copy) is _QuietShipping and "vault" not in copy.__dict__
        (tmp_path / "step-3").write_bytes(b"weights")
        copy.ship(tmp_path / "step-3", 3)
        copy.finish_shipping()
        copy.vault.close()
        assert [s.tags["step"] for s in vault.snapshots({"run": "old"})] == ["3"]


def test_a_callbacks_vault_can_be_replaced_when_nothing_is_queued(tmp_path):
    """rv49 #6: ``callback.vault = other`` (a plain attribute once) raised "property has no setter"."""
    with Vault.init(str(tmp_path / "a")) as first, Vault.init(str(tmp_path / "b")) as second:
        callback = _QuietShipping(first, run="r")
        callback.vault = second
        assert callback.vault is second
        (tmp_path / "step-1").write_bytes(b"weights")
        callback.ship(tmp_path / "step-1", 1)
        with pytest.raises(UsageError, match=r"still queued: call flush\(\) on its current vault first"):
            callback.handles.append(type("Queued", (), {"done": lambda self: False})())
            callback.vault = first
        callback.handles.pop()
        callback.finish_shipping()
        callback.vault = str(tmp_path / "a")  # a URL, opened as __init__ opens one
        assert callback.vault is not first and callback.vault.url == first.url
        callback.vault.close()
        assert [s.tags["step"] for s in second.snapshots()] == ["1"] and first.snapshots() == []


def test_a_callback_records_the_host_it_is_given(tmp_path):
    """h5 #2: the callbacks took no hostname; a node's saves shipped from a spot instance that came back under a
    new machine name were not found by `--host nodeB`."""
    with Vault.init(str(tmp_path / "vault")) as vault:
        with pytest.raises(UsageError, match="has spaces at its ends"):
            _QuietShipping(vault, run="h", hostname="nodeB ")
        callback = _QuietShipping(vault, run="h", hostname="nodeB")
        (tmp_path / "step-1").write_bytes(b"weights")
        callback.ship(tmp_path / "step-1", 1)
        callback.finish_shipping()
        assert [s.hostname for s in vault.snapshots(hosts=["nodeB"])] == ["nodeB"]
