"""The Python API at its entry points: a wrong argument fails at once with a UsageError that says
what was expected (never a bare TypeError/AttributeError from deep inside, never half-understood),
nothing is deleted or left pinned by a refused call, a closed Vault refuses work, and ranks that
open a new vault together all get it."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from datetime import date, datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest

import ckptvault
from ckptvault import Vault
from ckptvault.chunking import ChunkerParams
from ckptvault.codec import CompressionSettings
from ckptvault.errors import (
    BackupTimeoutError,
    CkptVaultError,
    FlushTimeoutError,
    SnapshotNotFoundError,
    UsageError,
)
from ckptvault.ops.async_backup import AsyncShipper, BackupJob, make_job
from tests.conftest import write_file

CLOSED = "this Vault is closed"


def make_checkpoint(path: Path, step: int) -> Path:
    write_file(path / "model" / "weights.bin", os.urandom(20_000) + str(step).encode())
    write_file(path / "config.json", f'{{"step": {step}}}'.encode())
    return path


def ids(vault: Vault) -> list[str]:
    return [s.id for s in vault.snapshots()]


def pin_folders(root: Path) -> list[Path]:
    """Every ``.ckptvault-pins`` folder under ``root`` that still holds a pin."""
    return [p for p in root.rglob(".ckptvault-pins") if any(p.iterdir())]


@pytest.fixture
def three(vault: Vault, tmp_path: Path) -> list:
    """Three snapshots of one run, steps 1..3; the first is a milestone."""
    snaps = []
    for step in (1, 2, 3):
        tags = {"run": "r", "step": str(step)} | ({"milestone": "yes"} if step == 1 else {})
        snaps.append(vault.backup(make_checkpoint(tmp_path / "src" / f"step_{step}", step), tags=tags))
    return snaps


# ---- 1. a bare string where a list of strings is expected ------------------------------------


def test_prune_refuses_a_bare_string_keep_tags_and_keeps_the_milestone(vault, three):
    before = ids(vault)
    with pytest.raises(UsageError, match=r"keep_tags must be a list of strings, e\.g\. \['milestone'\]"):
        vault.prune(keep_latest=1, keep_tags="milestone")
    assert ids(vault) == before, "nothing was pruned"
    with pytest.raises(UsageError, match="keep_tags"):
        vault.prune(keep_latest=1, keep_tags=b"milestone")  # type: ignore[arg-type]
    # the list form protects it
    result = vault.prune(keep_latest=1, keep_tags=["milestone"], dry_run=True)
    assert {s.id for s in result.retention.keep} == {three[0].id, three[2].id}


def test_forget_refuses_a_bare_string_instead_of_forgetting_one_snapshot_per_character(vault, tmp_path):
    # snapshots until two of them have an ID whose first hex digit no other ID starts with:
    # forget("xy") iterated per character would then forget exactly those two
    unique: list[str] = []
    for step in range(40):
        vault.backup(make_checkpoint(tmp_path / "src" / f"step_{step}", step), tags={"step": str(step)})
        firsts = [i[0] for i in ids(vault)]
        unique = [c for c in dict.fromkeys(firsts) if firsts.count(c) == 1]
        if len(unique) >= 2:
            break
    assert len(unique) >= 2
    before = ids(vault)
    for spec in ("".join(unique[:2]), "".join(unique[:2]).encode()):
        with pytest.raises(UsageError, match=r"snapshots must be a list of snapshot IDs"):
            vault.forget(spec)  # type: ignore[arg-type]
        assert ids(vault) == before, "no snapshot was forgotten"
    with pytest.raises(UsageError, match="snapshot"):
        vault.forget([before[0][:8], None])  # type: ignore[list-item]
    assert ids(vault) == before


def test_restore_and_watch_refuse_a_bare_string_include(vault, three, tmp_path):
    target = tmp_path / "restored"
    with pytest.raises(UsageError, match=r"include must be a list of strings, e\.g\. \['model/\*'\]"):
        vault.restore(three[0], target, include="model/*")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="include must be a list of strings"):
        vault.restore_latest(target, run="r", include="model/*")  # type: ignore[arg-type]
    assert not target.exists(), "nothing was written"
    watched = make_checkpoint(tmp_path / "watched" / "step_9", 9).parent
    with pytest.raises(UsageError, match=r"include must be a list of strings, e\.g\. \['step_\*'\]"):
        vault.watch(watched, include="step_*", once=True, settle=0)  # type: ignore[arg-type]
    assert len(vault.snapshots()) == 3, "nothing was shipped"
    # the list forms work
    vault.restore(three[0], target, include=["model/*"])
    assert sorted(p.name for p in target.iterdir()) == ["model"]


# ---- 2. backup_async leaves no pin behind when it refuses --------------------------------------


def test_backup_async_refusing_a_bad_on_full_leaves_no_pin(vault, tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpts" / "step_1", 1)
    with pytest.raises(UsageError, match="on_full"):
        vault.backup_async(ckpt, on_full="bogus")  # type: ignore[arg-type]
    assert pin_folders(tmp_path) == []


def test_backup_async_after_close_leaves_no_pin_and_starts_no_worker(repo_url, tmp_path):
    v = Vault.init(repo_url)
    v.close()
    ckpt = make_checkpoint(tmp_path / "ckpts" / "step_1", 1)
    workers = sum(t.name == "ckptvault-async" for t in threading.enumerate())
    with pytest.raises(UsageError, match=CLOSED):
        v.backup_async(ckpt)
    assert pin_folders(tmp_path) == []
    assert sum(t.name == "ckptvault-async" for t in threading.enumerate()) == workers


def test_a_job_the_queue_refuses_has_its_pins_released(tmp_path):
    shipper = AsyncShipper(lambda job: pytest.fail("nothing runs"))
    ckpt = make_checkpoint(tmp_path / "ckpts" / "step_1", 1)
    job = make_job([str(ckpt)], vault_id="0" * 32, tags={}, description="", hostname=None, pin=True)
    assert pin_folders(tmp_path), "pinned"
    with pytest.raises(UsageError):
        shipper.submit(job, on_full="bogus")  # type: ignore[arg-type]
    assert pin_folders(tmp_path) == []
    shipper.close()
    job = make_job([str(ckpt)], vault_id="0" * 32, tags={}, description="", hostname=None, pin=True)
    with pytest.raises(UsageError, match="closed"):
        shipper.submit(job)
    assert pin_folders(tmp_path) == []


# ---- 3. ranks opening a new vault together ----------------------------------------------------


def _open_in_child(url: str, barrier, results) -> None:  # run in a spawned process
    from ckptvault import Vault

    barrier.wait()
    try:
        vault = Vault.open(url, create=True)
        results.put(("ok", vault.created))
        vault.close()
    except Exception as exc:
        results.put((type(exc).__name__, str(exc)))


@pytest.mark.parametrize("attempt", range(3))
def test_four_processes_opening_a_new_vault_with_create_all_get_it(tmp_path, attempt):
    ctx = multiprocessing.get_context("spawn")
    url = str(tmp_path / "new-vault")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_open_in_child, args=(url, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [o[0] for o in outcomes] == ["ok"] * 4, outcomes
    assert sum(created for _, created in outcomes) == 1, "exactly one of them created it"
    with Vault.open(url) as vault:
        assert vault.snapshots() == []


# ---- 4. the framework callbacks ---------------------------------------------------------------


def test_callback_refuses_a_bad_on_full_at_construction_before_opening_the_vault(tmp_path):
    from ckptvault.integrations.shipping import Shipping

    url = tmp_path / "never-made"
    with pytest.raises(UsageError, match="on_full"):
        Shipping(str(url), on_full="bogus")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="tags must be a dict"):
        Shipping(str(url), tags=["run=x"])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"tag key 'lr=0\.1' is invalid"):
        Shipping(str(url), tags={"lr=0.1": "yes"})  # the first save would have failed, mid-training
    with pytest.raises(UsageError, match="control character"):
        Shipping(str(url), run="exp-7\n")  # a run name read from a file, newline and all
    with pytest.raises(UsageError, match="raise_on_error must be True or False; got str 'no'"):
        Shipping(str(url), raise_on_error="no")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="CompressionSettings delta must be True or False; got 'no'"):
        Vault.init(url, compression=CompressionSettings(delta="no"))  # type: ignore[arg-type]
    assert not url.exists(), "no vault was created for a callback that cannot work"
    pytest.importorskip("transformers")
    from ckptvault.integrations.hf import CkptVaultCallback

    with pytest.raises(UsageError, match="on_full"):
        CkptVaultCallback(str(url), on_full="bogus")  # type: ignore[arg-type]


def test_lightning_records_a_file_as_shipped_only_after_it_was_handed_over(vault, tmp_path):
    pytest.importorskip("pytorch_lightning")
    from ckptvault.integrations.lightning import CkptVaultCallback

    ckpt = write_file(tmp_path / "ckpts" / "epoch=0-step=5.ckpt", b"weights")
    checkpoint_cb = SimpleNamespace(last_model_path=str(ckpt), best_model_path="", best_k_models={})
    trainer = SimpleNamespace(is_global_zero=True, checkpoint_callbacks=[checkpoint_cb], global_step=5)
    callback = CkptVaultCallback(vault, run="l")
    real_ship, calls = callback.ship, []

    def ship_failing_once(path: str, step: int | None) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise CkptVaultError("the queue refused it")
        real_ship(path, step)

    callback.ship = ship_failing_once
    with pytest.raises(CkptVaultError):
        callback._ship_new(trainer)
    callback._ship_new(trainer)  # the next hook tries again
    callback.finish_shipping()
    assert len(calls) == 2
    assert [s.tags for s in vault.snapshots()] == [{"run": "l", "step": "5"}]


def test_finish_shipping_without_raising_logs_a_flush_timeout(vault, caplog, monkeypatch):
    from ckptvault.integrations.shipping import Shipping

    def flush(timeout=None):
        raise FlushTimeoutError("1 queued backup(s) still unfinished after 5 s")

    monkeypatch.setattr(vault, "flush", flush)
    shipping = Shipping(vault, flush_timeout=5, raise_on_error=False)
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        shipping.finish_shipping()  # does not raise
    assert any(r.levelno >= logging.WARNING and "still unfinished" in r.getMessage() for r in caplog.records)
    with pytest.raises(FlushTimeoutError):
        Shipping(vault, flush_timeout=5).finish_shipping()


@pytest.mark.parametrize("failing", ["older", "newest"])
def test_finish_shipping_raises_only_when_the_newest_checkpoint_is_not_in_the_vault(
    vault, tmp_path, monkeypatch, caplog, failing
):
    """A storage blip early in a run failed the script at its end (after training, before the code
    after train() ran), though the newest checkpoint, the one a resume takes, had shipped."""
    from ckptvault.errors import StorageError
    from ckptvault.integrations.shipping import Shipping

    run_job, failing_step = vault._run_job, {"older": "1", "newest": "2"}[failing]

    def run_failing(job):
        if job.tags["step"] == failing_step:
            raise StorageError("PUT", "locks/x", vault.url, "the vault's folder is gone (simulated)")
        return run_job(job)

    monkeypatch.setattr(vault, "_run_job", run_failing)
    shipping = Shipping(vault, run="r")
    for step in (1, 2):
        shipping.ship(str(write_file(tmp_path / f"checkpoint-{step}" / "w.bin", os.urandom(1000)).parent), step)
    if failing == "newest":
        with pytest.raises(StorageError, match="simulated") as caught:
            shipping.finish_shipping()
        assert caught.value is shipping.handles[-1].exception(timeout=0)  # its own, not the first failure
        return
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        shipping.finish_shipping()  # does not raise
    assert [s.tags["step"] for s in vault.snapshots()] == ["2"]
    assert any(
        "the newest checkpoint (" in r.getMessage() and "checkpoint-2) is in the vault" in r.getMessage()
        for r in caplog.records
    ), caplog.text


# ---- 5. a closed Vault ------------------------------------------------------------------------


def test_a_closed_vault_refuses_every_call_and_closes_again_quietly(repo_url, tmp_path):
    v = Vault.init(repo_url)
    ckpt = make_checkpoint(tmp_path / "src", 1)
    snap = v.backup(ckpt)
    v.close()
    v.close()  # idempotent
    calls = [
        lambda: v.snapshots(),
        lambda: v.snapshot(snap.id),
        lambda: v.latest(),
        lambda: v.files(snap),
        lambda: v.backup(ckpt),
        lambda: v.restore(snap, tmp_path / "out"),
        lambda: v.read_file(snap, "config.json"),
        lambda: v.open_file(snap, "config.json"),
        lambda: v.check(),
        lambda: v.prune(keep_latest=1),
        lambda: v.forget([snap.id]),
        lambda: v.stats(),
        lambda: v.locks(),
        lambda: v.unlock(),
        lambda: v.flush(),
        lambda: v.configure_async(max_pending=3),
        lambda: v.ship_leftover_pins(tmp_path),
        lambda: v.is_backed_up(ckpt),
        lambda: v.restore_latest(tmp_path / "out"),
        lambda: v.diff(snap, snap),
        lambda: v.watch(tmp_path / "src", once=True),
    ]
    for call in calls:
        with pytest.raises(UsageError, match=CLOSED):
            call()
    with pytest.raises(UsageError, match=CLOSED), v:
        pass
    assert not (tmp_path / "out").exists()


# ---- 6. wrong types ---------------------------------------------------------------------------


def test_a_pathlib_path_is_accepted_for_the_url_and_for_paths_inside_a_snapshot(tmp_path, caplog):
    np = pytest.importorskip("numpy")
    src = tmp_path / "src"
    write_file(src / "config.json", b'{"a": 1}')
    src.mkdir(exist_ok=True)
    np.save(src / "w.npy", np.arange(6, dtype=np.float32))
    Vault.init(tmp_path / "repo").close()
    with Vault.open(tmp_path / "repo") as v:
        snap = v.backup(src)
        assert b"".join(v.read_file(snap, Path("config.json"))) == b'{"a": 1}'
        with v.open_file(snap, Path("config.json")) as f:
            assert f.read() == b'{"a": 1}'
        assert [t.name for t in v.show(snap, Path("w.npy")).tensors] != []
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        with Vault.open(tmp_path / "repo2", create=True) as v:
            assert v.created
        with Vault.open(tmp_path / "repo2", create=True) as v:  # there now: opened without a word
            assert not v.created
    # a callback's mistyped URL made a new vault silently; the checkpoints went there
    assert [r.getMessage() for r in caplog.records] == [
        f"ckptvault: created a new vault at {tmp_path / 'repo2'} (none was there, and create=True); if that URL is "
        "mistyped, fix it: the checkpoints are going to this new vault"
    ]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda v, s, t: v.snapshot(None), "snapshot must be a snapshot ID"),
        (lambda v, s, t: v.files(None), "snapshot must be"),
        (lambda v, s, t: v.restore(None, t / "out"), "snapshot must be"),
        (lambda v, s, t: v.restore(s, None), "target must be a path"),
        (lambda v, s, t: v.restore_latest(None), "target must be a path"),
        (lambda v, s, t: v.forget([None]), "each item of snapshots"),
        (lambda v, s, t: v.forget(s), "snapshots must be a list"),
        (lambda v, s, t: v.read_file(s, None), "path must be a path"),
        (lambda v, s, t: v.open_file(s, 3), "path must be a path"),
        (lambda v, s, t: v.show(s, None), "path must be a path"),
        (lambda v, s, t: v.backup(None), "paths must be a path or a list of paths"),
        (lambda v, s, t: v.backup([t / "src", None]), "paths must be a path"),
        (lambda v, s, t: v.backup(t / "src", tags=["run=x"]), r'tags must be a dict like \{"run": "x"\}'),
        (lambda v, s, t: v.backup(t / "src", tags={"step": 3}), "keys and values must be strings"),
        (lambda v, s, t: v.backup(t / "src", description=3), "description must be a string"),
        (lambda v, s, t: v.backup(t / "src", hostname=7), "hostname must be a string"),
        (lambda v, s, t: v.backup_async(t / "src", tags={"step": 3}), "keys and values must be strings"),
        (lambda v, s, t: v.snapshots(tags=["run=x"]), "tags must be a dict"),
        (lambda v, s, t: v.latest(tags={"step": 3}), "keys and values must be strings"),
        (lambda v, s, t: v.prune(keep_latest="5"), "keep_latest must be an int"),
        (lambda v, s, t: v.prune(keep_latest=True), "keep_latest must be an int"),
        (lambda v, s, t: v.prune(before="14d"), "before must be a timezone-aware datetime or an age as a timedelta"),
        (lambda v, s, t: v.prune(before=date(2020, 1, 1)), "before must be"),
        (lambda v, s, t: v.prune(before=14), "before must be"),
        (lambda v, s, t: v.prune(before=-timedelta(days=14)), "negative age"),
        (lambda v, s, t: v.prune(keep_latest=1, tags=["run=x"]), "tags must be a dict"),
        (lambda v, s, t: v.prune(keep_latest=1, group_by=["run"]), "group_by must be a string"),
        (lambda v, s, t: v.prune(keep_latest=1, repack_threshold="0.1"), "repack_threshold must be a number"),
        (lambda v, s, t: v.check(read_data="10%"), "read_data must be a number from 0 to 1"),
        # a float step (f"{step}" of 1200.0) took the run's latest back to going by time (cli49 #2)
        (lambda v, s, t: v.backup(t / "src", tags={"step": "1200.0"}), "'step': '1200.0' is a number but not a whole"),
        (lambda v, s, t: v.tag(s, add={"step": "12.5"}), "add: 'step': '12.5' is a number but not a whole one"),
        (lambda v, s, t: v.flush(timeout="5"), "timeout must be a number of seconds"),
        (lambda v, s, t: v.configure_async(max_pending="4"), "max_pending must be an int"),
        (lambda v, s, t: v.backup_status(None), "path must be a path"),
        (lambda v, s, t: v.watch(t / "src", settle="2"), "settle must be a number of seconds; got str '2'"),
        (lambda v, s, t: v.watch(t / "src", interval=None), "interval must be a number of seconds; got None"),
        (lambda v, s, t: v.watch(t / "src", grace="30"), "grace must be a number of seconds; got str '30'"),
        (lambda v, s, t: v.watch(t / "src", grace=-1), "grace -1 must be a number of seconds from 0"),
        (lambda v, s, t: v.watch(t / "src", once=True, grace=5), "grace is for a watch that is stopped"),
        (lambda v, s, t: v.watch(t / "src", stop=True), "stop must be a threading.Event"),
        (lambda v, s, t: v.watch(t / "src", once=True, settle=0, on_shipped=5), "on_shipped must be a function"),
        (lambda v, s, t: v.watch(t / "src", on_warning="log"), "on_warning must be a function to call, or None"),
        (lambda v, s, t: v.watch(t / "src", on_start=1), "on_start must be a function"),
        (lambda v, s, t: v.watch(t / "src", include=["step_*", ""]), "include pattern '' is empty"),
        (lambda v, s, t: v.watch(t / "src", include=[" "], once=True), "include pattern ' ' is empty"),
        (lambda v, s, t: v.backup(t / "src", on_warning=3), "on_warning must be a function"),
        (lambda v, s, t: v.flush(timeout=float("nan")), "timeout must be a number of seconds"),
        (lambda v, s, t: v.configure_async(exit_timeout=float("nan")), "exit_timeout must be a number of seconds"),
        (lambda v, s, t: v.drill(workdir=""), "workdir is empty"),
        (lambda v, s, t: v.watch(t / "src", once=True, state_dir=""), "state_dir is empty; give a folder for watch"),
        (lambda v, s, t: v.drill(None), "snapshot must be"),
        (lambda v, s, t: v.diff(s, None), "snapshot must be"),
        (lambda v, s, t: v.restore(s, t / "out", on_progress=5), "on_progress must be None or an object with"),
        (lambda v, s, t: v.backup(t / "src", on_progress=print), "on_progress must be None or an object with"),
        (lambda v, s, t: v.restore(s, str(t / "out") + "\0x"), "target must be a path .*without NUL"),
        (lambda v, s, t: v.restore_latest(t / "out", run="a", tags={"run": "b"}), "name two runs; give one"),
        # a flag is True or False: "no" is truthy, and overwrite="no" would overwrite
        (lambda v, s, t: v.restore(s, t / "out", overwrite="no"), "overwrite must be True or False; got str 'no'"),
        (lambda v, s, t: v.restore_latest(t / "out", overwrite="no"), "overwrite must be True or False"),
        (lambda v, s, t: v.prune(keep_latest=1, dry_run="false"), "dry_run must be True or False"),
        (lambda v, s, t: v.forget([s], dry_run="yes"), "dry_run must be True or False"),
        (lambda v, s, t: v.backup(t / "src", force_read=1), "force_read must be True or False; got int 1"),
        (lambda v, s, t: v.backup_async(t / "src", pin="yes"), "pin must be True or False"),
        (lambda v, s, t: v.drill(load="yes"), "load must be True or False"),
        (lambda v, s, t: v.show(s, "config.json", stats=None), "stats must be True or False; got None"),
        (lambda v, s, t: Vault.open(v.url, create="no"), "create must be True or False"),
        # a path not in the snapshot is named when read_file is called, not at its first next()
        (lambda v, s, t: v.read_file(s, "nope.bin"), "'nope.bin' is not in snapshot"),
        # api audit 39 M3/M10: each escaped as a TypeError or AttributeError, or made a vault no backup could use
        (lambda v, s, t: Vault.init(t / "v2", pack_size=16e6), "pack_size must be an int; got float"),
        (lambda v, s, t: Vault.init(t / "v2", pack_size="big"), "pack_size must be an int"),
        (lambda v, s, t: Vault.init(t / "v2", chunker="fastcdc"), "chunker must be a ChunkerParams"),
        (lambda v, s, t: Vault.init(t / "v2", compression="zstd"), "compression must be a CompressionSettings"),
        (lambda v, s, t: Vault.init(t / "v2", compression=CompressionSettings(level=2.0)), "level must be an int"),
        (lambda v, s, t: Vault.init(t / "v2", compression=CompressionSettings(level=True)), "level must be an int"),
        (lambda v, s, t: ChunkerParams(min_size=262144.0), "chunker min_size must be a whole number of bytes"),
        (lambda v, s, t: Vault.open(v.url, keyfile=123), "keyfile must be a keyfile's path"),
        (lambda v, s, t: Vault.open(v.url, storage_options="anon=true"), "storage_options must be a dict of fsspec"),
        (lambda v, s, t: Vault.init(t / "v2", storage_options=["x"]), "storage_options must be a dict .*; got list$"),
        (lambda v, s, t: v.open_file(s, "config.json", cache_chunks=-1), "cache_chunks -1 is negative"),
    ],
)
def test_a_wrong_type_is_a_usage_error_saying_what_was_expected(vault, tmp_path, call, match):
    snap = vault.backup(make_checkpoint(tmp_path / "src", 1), tags={"run": "r", "step": "1"})
    before = ids(vault)
    with pytest.raises(CkptVaultError, match=match) as info:
        call(vault, snap, tmp_path)
    assert isinstance(info.value, UsageError) or "not in snapshot" in match
    assert "\n" not in str(info.value)
    assert ids(vault) == before
    assert not (tmp_path / "out").exists()
    assert pin_folders(tmp_path) == []


def test_a_negative_age_would_have_put_the_cutoff_in_the_future(vault, three):
    before = ids(vault)
    with pytest.raises(UsageError, match="negative age"):
        vault.prune(keep_latest=1, before=-timedelta(days=14))
    assert ids(vault) == before
    # the accepted forms
    now = datetime.now(timezone.utc)
    assert vault.prune(keep_latest=1, before=timedelta(days=14), dry_run=True).retention.forget == []
    assert len(vault.prune(keep_latest=1, before=now + timedelta(seconds=1), dry_run=True).retention.forget) == 2
    # a mistyped year is no cutoff: every snapshot but the newest would go
    with pytest.raises(UsageError, match="more than a day in the future, so every snapshot is older than it"):
        vault.prune(before=datetime(2099, 1, 1, tzinfo=timezone.utc), dry_run=True)
    with pytest.raises(UsageError, match="now must be a timezone-aware datetime"):
        vault.prune(before=timedelta(days=1), now=datetime(2026, 1, 10))


def test_an_empty_url_is_refused_not_taken_for_the_default_vault(tmp_path):
    for make in (lambda: Vault.open(""), lambda: Vault.open("  ", create=True), lambda: Vault.init("")):
        with pytest.raises(UsageError, match="the vault URL is empty"):
            make()
    assert not (tmp_path / "xdg-data").exists(), "the default vault was not created"
    with pytest.raises(UsageError, match="url must be a path or URL"):
        Vault.open(42)  # type: ignore[arg-type]


# ---- 7. the exit wait says so --------------------------------------------------------------------


def test_the_exit_wait_is_announced_at_warning_naming_the_count_and_the_bound(caplog):
    release = threading.Event()

    def run(job: BackupJob):
        release.wait(30)
        raise CkptVaultError("not really shipped")

    shipper = AsyncShipper(run, exit_timeout=0.2)
    shipper.submit(BackupJob(sources=[], tags={"step": "1"}, label="ckpt"))
    try:
        with caplog.at_level(logging.WARNING, logger="ckptvault"):
            shipper.flush_at_exit(time.monotonic())
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("1 queued backup(s)" in m and "0.2 s" in m for m in warnings), warnings
    finally:
        release.set()
        shipper.close()


# ---- 8. small things ---------------------------------------------------------------------------


def test_handle_result_timeout_has_a_message(tmp_path):
    release = threading.Event()
    shipper = AsyncShipper(lambda job: release.wait(30))
    handle = shipper.submit(BackupJob(sources=[], tags={"step": "4"}, label="ckpt"))
    try:
        # a handle's wait is no flush: its own name, still a FlushTimeoutError as before (train 37 T6)
        with pytest.raises(BackupTimeoutError, match=r"ckpt \(step 4\) is still (queued|running) after 0 s") as info:
            handle.result(0)
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, FlushTimeoutError)
        with pytest.raises(BackupTimeoutError, match="still"):
            handle.exception(0)
    finally:
        release.set()
        shipper.close()


def test_result_types_of_public_methods_are_exported(vault, tmp_path):
    vault.backup(make_checkpoint(tmp_path / "src", 1))
    assert isinstance(vault.check(), ckptvault.CheckReport)
    assert isinstance(vault.prune(keep_latest=1, dry_run=True), ckptvault.PruneResult)
    assert {"CheckReport", "PruneResult", "LockInfo"} <= set(ckptvault.__all__)
    assert ckptvault.LockInfo.__name__ == "LockInfo"


def test_numpy_numbers_and_bools_and_a_none_description_are_accepted(vault: Vault, tmp_path: Path):
    import numpy as np

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"data")
    snap = vault.backup(tmp_path / "src", description=None)
    assert snap.description == ""
    assert vault.prune(keep_latest=np.int64(1), dry_run=np.bool_(True)).forgotten == []
    assert vault.check(read_data=np.float32(0.5), seed=np.int64(3)).ok


def test_every_error_class_is_importable_from_the_package():
    import ckptvault.errors as errors

    public = [
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, CkptVaultError) and value.__module__ == errors.__name__
    ]
    for name in public:  # the storage layer's own too: docs/usage.md names ObjectNotFoundError in the hierarchy
        assert getattr(ckptvault, name) is getattr(errors, name) and name in ckptvault.__all__, name
    # and the types a public signature or result holds, for a user's own annotations (api audit 39 M7)
    for name in ("Keyfile", "Progress", "RepoConfig", "SnapshotFile", "RetentionPlan", "Decision", "GcPlan"):
        assert name in ckptvault.__all__ and getattr(ckptvault, name).__name__ == name
    for name in ("Problem", "TensorStats", "LoadCheck"):
        assert name in ckptvault.__all__ and getattr(ckptvault, name).__name__ == name


def test_an_ambiguous_id_prefix_lists_the_candidates(vault: Vault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("ckptvault.arguments.ID_PREFIX_MIN", 1)  # 17 snapshots share a first digit, not four
    src = tmp_path / "src"
    src.mkdir()
    ids = []
    for i in range(17):  # 17 IDs over 16 first hex digits: two share one
        (src / "f").write_text(str(i))
        ids.append(vault.backup(src).id)
    digit = next(d for d in "0123456789abcdef" if sum(i.startswith(d) for i in ids) > 1)
    with pytest.raises(ckptvault.SnapshotNotFoundError, match="is ambiguous: ") as info:
        vault.snapshot(digit)
    listed = [i for i in ids if i[:12] in str(info.value)]
    matching = [i for i in ids if i.startswith(digit)]
    assert set(listed) <= set(matching) and len(listed) == min(5, len(matching)), str(info.value)
    # each with its time to the second (saves within one minute looked alike: "(2026-12-07 10:16)")
    times = {s.id: s.time for s in vault.snapshots()}
    for snapshot_id in listed:
        assert f"{snapshot_id[:12]} ({times[snapshot_id]:%Y-%m-%d %H:%M:%S})" in str(info.value), str(info.value)


@pytest.mark.parametrize("below", ["", "vault"])
@pytest.mark.parametrize("create", [False, True])
def test_a_vault_path_that_is_a_file_is_named_as_such(tmp_path, below, create):
    from ckptvault.errors import VaultNotFoundError

    write_file(tmp_path / "afile", b"not a vault")
    url = str(tmp_path / "afile" / below) if below else str(tmp_path / "afile")
    expected = UsageError if create else VaultNotFoundError
    with pytest.raises(expected, match=f"{tmp_path / 'afile'} is a file, not a folder"):
        Vault.open(url, create=create)
    assert (tmp_path / "afile").read_bytes() == b"not a vault"


def test_an_id_without_the_given_tags_is_named_as_such_not_as_missing(vault: Vault, three):
    from ckptvault.errors import SnapshotNotFoundError

    carry = r"does not carry run=other \(its tags: run=r, step=2\); leave out tags"
    with pytest.raises(SnapshotNotFoundError, match=carry):
        vault.snapshot(three[1].id[:8], tags={"run": "other"})
    assert vault.snapshot(three[1].id[:8], tags={"run": "r"}) == three[1]
    with pytest.raises(SnapshotNotFoundError, match="no snapshot 0000000000"):
        vault.snapshot("0000000000", tags={"run": "r"})


def test_messages_name_the_api_and_its_parameters(vault: Vault, three, tmp_path: Path):
    with pytest.raises(UsageError, match=r"keep_latest must be at least 1 \(.* use: Vault\.forget\(\[\.\.\.\]\)\)"):
        vault.prune(keep_latest=0)
    with pytest.raises(UsageError, match=r"the before time needs a time zone"):
        vault.prune(keep_latest=1, before=datetime(2020, 1, 1))
    with pytest.raises(UsageError, match=r"include 'nope/\*' matched no path.*: Vault\.files\(snapshot\)"):
        vault.restore(three[0], tmp_path / "out", include=["nope/*"])
    # a glob written as a shell would (./, a leading /) means the path as stored
    result = vault.restore(three[0], tmp_path / "out", include=["./model/*", "/config.json"])
    assert result.files == 2 and result.unmatched_globs == ()
    (tmp_path / "links").mkdir()
    os.symlink(tmp_path / "out", tmp_path / "links" / "out")
    with pytest.raises(CkptVaultError, match=r"only symlinks .*\(name the folders they point to\)") as info:
        vault.backup_status(tmp_path / "links")  # status's own hint is for unreadable files only
    assert "make it readable" not in str(info.value)


def test_a_snapshot_of_another_vault_is_named_as_such(vault: Vault, tmp_path: Path):
    other = Vault.init(tmp_path / "other")
    snap = other.backup(make_checkpoint(tmp_path / "src", 1))
    with pytest.raises(SnapshotNotFoundError, match="or it is a Snapshot of another vault"):
        vault.restore(snap, tmp_path / "out")


def test_stored_tags_and_hostnames_are_held_to_the_clis_rules_at_call_time(vault: Vault, tmp_path: Path):
    """The API took tags the CLI refuses (never selectable again with --tag; a 1000-character value
    wrecked the tables), and backup_async took a blank hostname that then failed every queued backup."""
    src = make_checkpoint(tmp_path / "src", 1)
    for tags, says in (
        ({"k": "a\nb"}, "control character"),
        ({"k": "x" * 1000}, "1000 characters; the limit is 256"),
        ({" ": "x"}, "is blank"),
        ({"run ": "x"}, "has spaces around it"),
        ({"run": " x"}, r"tags: 'run': the value ' x' has spaces around it; write it without, e.g. \{'run': 'x'\}"),
        ({"run": ""}, r"tags: 'run' has an empty value \(is a variable unset\?\); give one, e.g. \{'run': 'x'\}"),
    ):
        for call in (vault.backup, vault.backup_async):
            with pytest.raises(UsageError, match=says):
                call(src, tags=tags)
    with pytest.raises(UsageError, match="hostname '' is blank"):
        vault.backup_async(src, hostname="")
    assert vault.snapshots() == [] and pin_folders(tmp_path) == []
    snap = vault.backup(src, tags={"run": "r"})
    with pytest.raises(UsageError, match="control character"):
        vault.tag(snap, add={"note": "a\tb"})
    assert vault.snapshots(tags={"k": "x" * 1000}) == []  # a filter is only compared, never stored


def test_forgetting_a_snapshot_object_that_is_gone_says_so(vault: Vault, tmp_path: Path):
    snap = vault.backup(make_checkpoint(tmp_path / "src", 1), tags={"run": "r"})
    vault.tag(snap, add={"keep": "best"})  # a new ID: the object in hand names a snapshot no longer there
    with pytest.raises(SnapshotNotFoundError):
        vault.forget([snap])
    assert len(vault.snapshots()) == 1


def test_api_errors_name_api_calls_not_cli_commands(vault: Vault, tmp_path: Path):
    """A Python caller was told to run `ckptvault snapshots` or `ckptvault ls ID`."""
    snap = vault.backup(make_checkpoint(tmp_path / "src", 1), tags={"run": "r"})
    for call, says in (
        (lambda: vault.restore_latest(tmp_path / "out", run="nosuch"), "list them with: Vault.snapshots()"),
        (lambda: vault.snapshot("abcdef12"), "no snapshot abcdef12; list them with: Vault.snapshots()"),
        (lambda: vault.read_file(snap, "nope.bin"), "list its files with: Vault.files(snapshot)"),
    ):
        with pytest.raises(CkptVaultError) as caught:
            call()
        assert says in str(caught.value) and "ckptvault " not in str(caught.value), str(caught.value)


def test_a_caller_editing_a_listed_snapshot_changes_nothing_the_vault_sees(tmp_path: Path):
    """Snapshot is frozen, but its tags dict was the vault's own: display code that popped a bookkeeping tag
    before printing made prune(keep_tags=["milestone"]) forget the snapshot whose stored tags said to keep it."""
    src = make_checkpoint(tmp_path / "ckpt", 0)
    with Vault.init(str(tmp_path / "vault")) as vault:
        vault.backup(src, tags={"run": "x", "step": "0", "milestone": "yes"})
        for step in (1, 2, 3):
            vault.backup(src, tags={"run": "x", "step": str(step)})
        for snap in vault.snapshots():
            snap.tags.pop("milestone", None)
            snap.paths.append("/elsewhere")
        vault.stats().per_snapshot[0].tags["run"] = "other"
        vault.snapshot(vault.snapshots()[0].id[:8]).tags.clear()
        vault.latest({"run": "x"}).tags["step"] = "99"
        vault.backup(src, tags={"run": "x", "step": "3"}, skip_if_unchanged=True).tags["step"] = "77"  # the twin
        (milestone,) = vault.snapshots({"milestone": "yes"})
        assert milestone.paths == [str(src)] and vault.latest({"run": "x"}).tags["step"] == "3"
        result = vault.prune(keep_latest=1, keep_tags=["milestone"])
        assert [s.tags["step"] for s in result.forgotten] == ["1", "2"]
    with Vault.open(str(tmp_path / "vault")) as again:
        assert [s.tags for s in again.snapshots()] == [
            {"run": "x", "step": "0", "milestone": "yes"},
            {"run": "x", "step": "3"},
        ]


def test_a_file_read_after_its_vault_closed_raises_instead_of_ending_short(tmp_path: Path):
    """close() ends read_file's iterators (their shared locks); reading one afterwards gave b"" (or the part
    read before), no error and no file hash checked."""
    src = make_checkpoint(tmp_path / "ckpt", 0)
    # over the largest chunk (4 MiB): two chunks at least, so a part read (3 MiB of random bytes was one chunk
    # ~1 run in 80, and the first piece the whole file)
    write_file(src / "big.bin", os.urandom(6 << 20))
    with Vault.init(str(tmp_path / "vault")) as vault:
        snap = vault.backup(src)
        unread = vault.read_file(snap, "big.bin")
        part_read = vault.read_file(snap, "big.bin")
        first = next(part_read)
        whole = b"".join(vault.read_file(snap, "big.bin"))
        whole_then_next = vault.read_file(snap, "config.json")
        assert b"".join(whole_then_next) == b'{"step": 0}'
    assert len(first) < len(whole) == 6 << 20
    for reader in (unread, part_read):
        with pytest.raises(UsageError, match=r"read_file\('big.bin'\) was read after its Vault was closed"):
            b"".join(reader)
    assert list(whole_then_next) == []  # read whole before: ended, as any iterator


def test_numpy_integers_make_a_vault_that_opens_and_backs_up(tmp_path: Path):
    """A numpy int for the pack size or a compression level ended in a bare JSON TypeError; a float
    one made a config every later open called damaged."""
    import numpy as np

    url = str(tmp_path / "vault")
    settings = CompressionSettings(level=np.int64(3))
    chunker = ChunkerParams(min_size=np.int64(128 << 10))
    with Vault.init(url, pack_size=np.int64(8 << 20), compression=settings, chunker=chunker) as vault:
        vault.backup(make_checkpoint(tmp_path / "src", 1))
    with Vault.open(url) as vault:
        assert (vault.config.pack_size, vault.config.compression.level, vault.config.chunker.min_size) == (
            8 << 20,
            3,
            128 << 10,
        )
        assert len(vault.snapshots()) == 1


@pytest.mark.parametrize(
    ("passphrase", "match"),
    [
        (b"correct horse", r"the passphrase must be text \(a str\), not bytes; decode it first"),
        (lambda: b"correct horse", "not a function that returned bytes; decode it first"),
        (123, r"the passphrase must be text \(a str\), not int$"),
    ],
)
def test_a_passphrase_that_is_not_text_is_a_usage_error_that_does_not_show_it(tmp_path: Path, passphrase, match):
    from ckptvault.crypto.keyfile import Keyfile

    keyfile = tmp_path / "key.json"
    Keyfile.create("correct horse", scrypt_n=2**10)[0].save(str(keyfile))
    Vault.init(str(tmp_path / "vault"), keyfile=str(keyfile), passphrase="correct horse").close()
    with pytest.raises(UsageError, match=match) as caught:
        Vault.open(str(tmp_path / "vault"), keyfile=str(keyfile), passphrase=passphrase)
    assert "horse" not in str(caught.value)


def test_a_backup_handle_refuses_a_wrong_timeout_or_callback_at_once(vault, tmp_path: Path):
    """result(timeout="5") raised a bare TypeError while the backup ran; add_done_callback("x") was taken
    and failed later on the worker thread."""
    handle = vault.backup_async(make_checkpoint(tmp_path / "src", 1))
    for bad in ("5", True, float("nan"), -1):  # NaN and -1 returned at once: "still running after nan s"
        for call in (handle.result, handle.exception):
            with pytest.raises(UsageError, match="timeout must be a number of seconds from 0, or None"):
                call(timeout=bad)
    import numpy as np

    assert handle.exception(timeout=np.float32(60)) is None  # was a TypeError
    assert handle.exception(timeout=float("inf")) is None  # was an OverflowError
    with pytest.raises(UsageError, match="add_done_callback takes a function of the handle; got str"):
        handle.add_done_callback("x")  # type: ignore[arg-type]
    assert handle.result(timeout=60).tags == {}


def test_tags_given_with_a_snapshot_object_are_checked_as_with_its_id(vault: Vault, tmp_path: Path):
    snap = vault.backup(make_checkpoint(tmp_path / "src", 1), tags={"run": "a"})
    for spec in (snap.id[:8], snap):
        with pytest.raises(SnapshotNotFoundError, match=r"does not carry run=other \(its tags: run=a\)"):
            vault.snapshot(spec, tags={"run": "other"})
        assert vault.snapshot(spec, tags={"run": "a"}).id == snap.id


def test_a_vault_whose_config_holds_an_odd_compression_level_still_opens(tmp_path: Path):
    """Vaults made before levels were checked for kind (a level of None or 1.5 under codec "none", True under
    zstd) were refused as damaged once they were: every copy of the config holds the same (review 39 H1)."""
    import json

    for codec, level in (("none", None), ("none", 1.5), ("zstd", True)):
        url = tmp_path / f"{codec}-{level}"
        Vault.init(str(url)).close()
        config = json.loads((url / "config").read_text())
        config["compression"].update(codec=codec, level=level)
        (url / "config").write_text(json.dumps(config))
        with Vault.open(str(url)) as vault:
            vault.backup(make_checkpoint(tmp_path / "src", 1))
            assert vault.config.compression.level == level


def test_a_vault_closed_while_another_thread_reads_a_file_still_closes(tmp_path: Path):
    """close() raised "generator already executing" while another thread was inside read_file's next(), and
    the repository was never closed (review 39)."""
    src = make_checkpoint(tmp_path / "ckpt", 0)
    write_file(src / "big.bin", os.urandom(6 << 20))
    vault = Vault.init(str(tmp_path / "vault"))
    snap = vault.backup(src)
    reader = vault.read_file(snap, "big.bin")
    inside, release = threading.Event(), threading.Event()
    original = vault._repo.read_chunk

    def slow_read(chunk_id, **kwargs):
        inside.set()
        release.wait(30)
        return original(chunk_id, **kwargs)

    vault._repo.read_chunk = slow_read  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def read() -> None:
        try:
            b"".join(reader)
        except BaseException as exc:  # what the reading thread saw
            errors.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    assert inside.wait(30)
    closing: list[BaseException] = []

    def close() -> None:
        try:
            vault.close()
        except BaseException as exc:
            closing.append(exc)

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(30)  # it does not wait for the reading thread
    release.set()
    thread.join(30)
    assert not closer.is_alive() and not thread.is_alive()
    assert closing == []
    assert errors and isinstance(errors[0], CkptVaultError), errors


def test_check_read_data_true_reads_every_pack_as_repair_index_read_data_true_does(vault, tmp_path):
    """api49 #7: `check(read_data=True)` was refused ("must be a number from 0 to 1") where `repair_index` takes
    `read_data=True` and the CLI's `check --read-data` is a flag."""
    vault.backup(make_checkpoint(tmp_path / "src", 1), tags={"run": "r", "step": "1"})
    everything, nothing = vault.check(read_data=True), vault.check(read_data=False)
    assert everything.packs_read == everything.packs > 0 and nothing.packs_read == 0


def test_a_missing_vault_opened_through_the_api_says_how_the_api_creates_one(tmp_path):
    """api49 #6: `Vault.open` of a folder with no vault said "create one with: ckptvault init ..." to a script."""
    from ckptvault.errors import VaultNotFoundError

    url = str(tmp_path / "nope")
    with pytest.raises(VaultNotFoundError) as info:
        Vault.open(url)
    assert str(info.value).endswith(f"create one with: Vault.init({url!r}), or Vault.open({url!r}, create=True)")


def test_a_vault_sent_to_a_spawned_process_says_to_open_one_there(vault):
    """A Vault given to a spawned worker (a DataLoader's dataset, a multiprocessing pool) failed in pickle with
    "cannot pickle '_thread.lock' object", naming neither the Vault nor what to do."""
    import copy
    import pickle

    for send in (pickle.dumps, copy.copy):
        with pytest.raises(TypeError, match=r"a Vault cannot be pickled or copied .* open one there: Vault\.open\("):
            send(vault)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool, pytest.raises(TypeError, match=r"Vault\.open\("):
        pool.apply(len, ([vault],))


def test_writing_is_true_while_a_backup_or_copy_runs_on_any_thread(vault, tmp_path):
    """``Vault.writing`` (what watch's second signal tells an abandoned upload by) as docs/usage.md gives it:
    True inside a backup and a copy, seen from their own thread and from another one."""
    seen: list[tuple[bool, bool]] = []

    class Look:
        def __init__(self, into: Vault) -> None:
            self.into = into

        def start(self, total_bytes: int, total_files: int) -> None:
            elsewhere: list[bool] = []
            other = threading.Thread(target=lambda: elsewhere.append(self.into.writing))
            other.start()
            other.join()
            seen.append((self.into.writing, elsewhere[0]))

        def advance(self, nbytes: int) -> None:
            pass

        def finish(self) -> None:
            pass

    assert vault.writing is False
    vault.backup(make_checkpoint(tmp_path / "a", 1), on_progress=Look(vault))
    assert seen == [(True, True)] and vault.writing is False
    with Vault.init(str(tmp_path / "copy")) as other:
        other.copy_from(vault, on_progress=Look(other))
        assert seen[1:] == [(True, True)] and other.writing is False
