"""The exhaustive remote crash sweep (a script, not a test: ~5 s a kill point, 85 points on S3 and ~250 on
SFTP): each command of SCENARIOS is run once cleanly to count its write calls to the store (killremote.py),
then once per K, SIGKILLed at its K-th write call, on a copy of the same starting vault; after each kill the
same command is run again and must exit 0 with no warning, then ``check --read-data`` must be clean, every
snapshot restore bit-exact, no lock be left, and a prune (every snapshot kept; leftovers' one-hour age limit
taken as passed) leave no temp file or multipart upload and the vault within PRUNED_SIZE_SLACK of a clean
run's. Not counted as failures: forget's warning naming the IDs its killed run removed already, tag's naming
the copy its killed run wrote (docs/usage.md), and a pack in no index whose header does not verify right
after the kill (SeaweedFS keeps the bytes a PUT cut by the kill had sent; check names it, the prune removes
it; counted as ``cut=``).

    python -m tests.support.remote_sweep s3 [SCENARIO...] [--when after] [--every N]   (SeaweedFS)
    python -m tests.support.remote_sweep sftp [SCENARIO...]                             (OpenSSH sshd)
    python -m tests.support.remote_sweep s3 backup-second-enc --part-mib 0.25           (multipart uploads)

With --part-mib 0.25 the 1 MiB packs go up in 256 KiB parts: SeaweedFS takes them but refuses to complete
such an upload (EntityTooSmall, under S3's 5 MiB), so the clean run fails and only the kill points before a
completion mean anything (the size comparison does not); the reruns upload whole packs.

One line per kill point (the call it was killed at) and its problems; a summary at the end.
tests/backends/test_remote_crash_sweep.py keeps a handful of points as regression tests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptvault import Vault
from ckptvault.ops import prune as prune_module

from . import servers

ROOT = Path(__file__).resolve().parents[2]
PASSPHRASE = "sweep passphrase"
PRUNED_SIZE_SLACK = 0.05


def checkpoint(step: int) -> dict[str, bytes]:
    """~2.3 MB: a part every step shares, a part each step changes, a small file."""
    return {
        "model/frozen.bin": random.Random("frozen").randbytes(1_200_000),
        "opt/optimizer.bin": random.Random(f"opt{step}").randbytes(1_100_000),
        "state.json": f'{{"step": {step}}}'.encode(),
    }


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    shutil.rmtree(root, ignore_errors=True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@dataclass
class Place:
    """Where trial vaults live on one server, and how to copy one (server side) to a new name."""

    backend: servers.Backend
    clone: Callable[[str, str], None]
    objects: Callable[[str], dict[str, int]]  # key -> size, temp files included, straight from the server
    uploads: Callable[[str], int]  # unfinished multipart uploads under the vault
    env: dict[str, str] = field(default_factory=dict)


def s3_place(srv: servers.RunningServer) -> Place:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **srv.backend.storage_options)

    def path(url: str) -> str:
        return url.removeprefix("s3://")

    def clone(src: str, dst: str) -> None:
        for key in fs.find(path(src)):
            fs.copy(key, path(dst) + key[len(path(src)) :])

    def objects(url: str) -> dict[str, int]:
        fs.invalidate_cache()
        return {k[len(path(url)) + 1 :]: v["size"] for k, v in fs.find(path(url), detail=True).items()}

    def uploads(url: str) -> int:
        bucket, _, prefix = path(url).partition("/")
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
        return len(page.get("Uploads", []) or [])

    return Place(srv.backend, clone, objects, uploads)


def sftp_place(srv: servers.RunningServer) -> Place:
    def local(url: str) -> Path:
        return Path("/" + url.split("/", 3)[3])

    def clone(src: str, dst: str) -> None:
        shutil.copytree(local(src), local(dst), symlinks=True)

    def objects(url: str) -> dict[str, int]:
        root = local(url)
        return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}

    # the server's key recorded, as a user would have it (else every command warns that it is unchecked)
    home = srv.log.parent / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    kind, blob = (srv.log.parent / "sshd" / "host_key.pub").read_text().split()[:2]
    (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{srv.port} {kind} {blob}\n")
    return Place(srv.backend, clone, objects, lambda url: 0, env={"HOME": str(home)})


@dataclass
class Scenario:
    command: str  # {v}: the vault, {src1}.. {src3}: checkpoints, {local}: a local vault, {s1}..: IDs
    base_steps: list[int]  # what the starting vault holds
    steps: list[int]  # what it must hold after the rerun (each step's snapshot once; a backup may add two)
    encrypted: bool = False
    damage: str = ""  # "index": one index object deleted from the starting vault
    base_local: bool = False  # copy: the steps are in a local vault, the remote one starts empty


SCENARIOS = {
    "backup-first": Scenario("backup {src1} --tag step=1 --repo {v}", [], [1]),
    "backup-second": Scenario("backup {src2} --tag step=2 --repo {v}", [1], [1, 2]),
    "backup-first-enc": Scenario("backup {src1} --tag step=1 --repo {v}", [], [1], encrypted=True),
    "backup-second-enc": Scenario("backup {src2} --tag step=2 --repo {v}", [1], [1, 2], encrypted=True),
    "forget-prune": Scenario("forget {s1} {s2} --prune --repo {v}", [1, 2, 3], [3]),
    "prune-repack": Scenario("prune --keep-latest 1 --repack-threshold 0.9 --repo {v}", [1, 2, 3], [3]),
    "tag": Scenario("tag {s2} --add keep=best --repo {v}", [1, 2, 3], [1, 2, 3]),
    "copy": Scenario("copy --from-repo {local} --repo {v}", [1, 2, 3], [1, 2, 3], base_local=True),
    "repair-index": Scenario("repair-index --repo {v}", [1, 2, 3], [1, 2, 3], damage="index"),
}


class Sweep:
    def __init__(self, place: Place, work: Path, when: str) -> None:
        self.place = place
        self.work = work
        self.when = when
        self.opts = place.backend.storage_options
        self.keyfile = work / "sweep.key"
        Vault.generate_keyfile(self.keyfile, passphrase=PASSPHRASE, kdf_cost=14)
        self.sources = {f"src{s}": str(write_tree(work / f"src{s}", checkpoint(s))) for s in (1, 2, 3)}

    def env(self, cache: Path, encrypted: bool) -> dict[str, str]:
        env = {**os.environ, **servers.CLIENT_ENV, **self.place.backend.env, **self.place.env}
        env.update(XDG_DATA_HOME=str(cache / "xdg"), CKPTVAULT_CACHE_DIR=str(cache), COLUMNS="200")
        for var in ("CKPTVAULT_REPO", "CKPTVAULT_KEYFILE", "CKPTVAULT_PASSPHRASE"):
            env.pop(var, None)
        if encrypted:
            env.update(CKPTVAULT_KEYFILE=str(self.keyfile), CKPTVAULT_PASSPHRASE=PASSPHRASE)
        return env

    def cli(self, args: list[str], env: dict[str, str], **kill: str) -> subprocess.CompletedProcess:
        module = "tests.support.killremote" if kill else "ckptvault"
        return subprocess.run(
            [sys.executable, "-m", module, *args, *self.place.backend.cli_options],
            cwd=ROOT,
            env={**env, **kill},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=300,
        )

    def open(self, url: str, encrypted: bool) -> Vault:
        keys: dict[str, Any] = {"keyfile": str(self.keyfile), "passphrase": PASSPHRASE} if encrypted else {}
        return Vault.open(url, storage_options=self.opts, **keys)

    def base(self, name: str, sc: Scenario) -> tuple[str, str | None, dict[str, str]]:
        """The starting vault of a scenario (made once), a local one for copy, and the snapshot IDs."""
        url = self.place.backend.new_url(f"base-{name}")
        keys: dict[str, Any] = {"keyfile": str(self.keyfile), "passphrase": PASSPHRASE} if sc.encrypted else {}
        local = str(self.work / f"local-{name}") if sc.base_local else None
        with Vault.init(url, storage_options=self.opts, pack_size=1 << 20, **keys) as v:
            target = Vault.init(local, pack_size=1 << 20) if local else v
            for step in sc.base_steps:
                target.backup(self.sources[f"src{step}"], tags={"step": str(step)})
            ids = {f"s{s.tags['step']}": s.id for s in target.snapshots()}
            if local:
                target.close()
        if sc.damage == "index":
            index = sorted(k for k in self.place.objects(url) if k.startswith("index/"))
            with self.open(url, sc.encrypted) as v:
                v._repo.store.delete(index[0])
        return url, local, ids

    def args(self, sc: Scenario, url: str, local: str | None, ids: dict[str, str]) -> list[str]:
        return sc.command.format(v=url, local=local or "", **self.sources, **ids).split()

    def trial(self, name: str, sc: Scenario, base: tuple[str, str | None, dict[str, str]], k: int) -> dict[str, Any]:
        """One kill point (k=0: the clean run, for the write count and the pruned size)."""
        base_url, base_local, ids = base
        url = self.place.backend.new_url(f"t-{name}-{k}")
        self.place.clone(base_url, url)
        local = None
        if base_local:
            local = str(self.work / f"trial-local-{k}")
            shutil.rmtree(local, ignore_errors=True)
            shutil.copytree(base_local, local, symlinks=True)
        cache = Path(tempfile.mkdtemp(dir=self.work, prefix="cache-"))
        env = self.env(cache, sc.encrypted)
        args = self.args(sc, url, local, ids)
        out: dict[str, Any] = {"k": k, "problems": []}
        log = self.work / "kill.log"
        count = self.work / "kill.count"
        count.unlink(missing_ok=True)
        killed = self.cli(
            args,
            env,
            KILLREMOTE_AT=str(k),
            KILLREMOTE_WHEN=self.when,
            KILLREMOTE_LOG=str(log),
            KILLREMOTE_COUNT=str(count),
        )
        out["log"] = log.read_text().splitlines()
        if k == 0 or killed.returncode != -9:
            out["count"] = int(count.read_text()) if count.exists() else -1
            out["killed_rc"] = killed.returncode
            if killed.returncode != 0:
                out["problems"].append(f"clean run exit {killed.returncode}: {killed.stderr.decode()[-800:]}")
            if k:
                return out
        else:
            out["at"] = out["log"][-1] if out["log"] else "?"
            again = self.cli(args, env)
            warnings = [line for line in again.stderr.decode().splitlines() if line.strip()]
            if again.returncode != 0:
                out["problems"].append(f"rerun exit {again.returncode}: {' | '.join(warnings)[-800:]}")
                return out
            # but forget's naming the IDs its killed run removed, and tag's naming the copy its killed run wrote
            told = ("(forgotten already, by an interrupted run", "was retagged already, as")
            warnings = [w for w in warnings if not any(t in w for t in told)]
            if warnings:
                out["problems"].append(f"rerun said: {' | '.join(warnings)[-600:]}")
        self.verify(sc, url, out, ids)
        shutil.rmtree(cache, ignore_errors=True)
        return out

    def verify(self, sc: Scenario, url: str, out: dict[str, Any], ids: dict[str, str]) -> None:
        problems = out["problems"]
        with self.open(url, sc.encrypted) as v:
            report = v.check(read_data=1.0)
            # SeaweedFS keeps what a PUT cut by the kill had sent (real S3 keeps nothing): a pack in no index
            # whose header does not verify, named by check and removed by the prune below
            cut = [w for w in report.warnings if "in no index" in w and "damaged header" in w]
            out["cut_puts"] = len(cut)
            if not report.ok or set(report.warnings) - set(cut):
                problems.append(f"check: {report.problems} {report.warnings}")
            snaps = v.snapshots()
            steps = sorted(int(s.tags["step"]) for s in snaps)
            if sorted(set(steps)) != sc.steps:
                problems.append(f"snapshots of steps {steps}, wanted {sc.steps}")
            out["duplicates"] = len(steps) - len(set(steps))
            for snap in snaps:
                target = self.work / "restored"
                shutil.rmtree(target, ignore_errors=True)
                v.restore(snap, target)
                if tree(target) != checkpoint(int(snap.tags["step"])):
                    problems.append(f"snapshot {snap.id[:8]} (step {snap.tags['step']}) restores wrong")
            if sc.command.startswith("tag"):
                tagged = [s for s in snaps if s.tags.get("step") == "2"]
                if len(tagged) != 1 or tagged[0].tags.get("keep") != "best":
                    problems.append(f"step 2's snapshots after tag: {[s.tags for s in tagged]}")
            if v.locks():
                problems.append(f"locks left: {v.locks()}")
            prune_module.STALE_TEMP_AGE_S = 0.0  # as if an hour had passed: no writer is live here
            v.prune()
        objects = self.place.objects(url)
        temps = [k for k in objects if "/.tmp" in k or k.startswith(".tmp") or "ckptvault-tmp" in k]
        out["temps_after_prune"] = len(temps)
        out["uploads_after_prune"] = self.place.uploads(url)
        if temps or out["uploads_after_prune"]:
            problems.append(f"left after prune: {temps}, {out['uploads_after_prune']} multipart upload(s)")
        out["size"] = sum(size for key, size in objects.items() if not key.startswith("locks/") and key not in temps)
        out["objects"] = sorted(k for k in objects if not k.startswith("locks/"))
        locks = [k for k in objects if k.startswith("locks/") and k not in temps]
        if locks:
            problems.append(f"lock objects after prune: {locks}")

    def sweep(self, name: str, every: int, first: int, last: int) -> dict[str, Any]:
        sc = SCENARIOS[name]
        base = self.base(name, sc)
        clean = self.trial(name, sc, base, 0)
        total = clean["count"]
        print(f"== {name}: {total} write calls in a clean run, pruned size {clean['size']}", flush=True)
        if clean["problems"]:
            print(f"   CLEAN RUN: {clean['problems']}", flush=True)
        results = []
        for k in range(first, min(total, last) + 1, every):
            t0 = time.monotonic()
            r = self.trial(name, sc, base, k)
            if "at" not in r:
                print(f"  K={k}: not killed (exit {r.get('killed_rc')})", flush=True)
                continue
            ratio = r["size"] / clean["size"] if "size" in r and clean["size"] else None
            if ratio is not None and abs(ratio - 1) > PRUNED_SIZE_SLACK:
                extra = sorted(set(r["objects"]) - set(clean["objects"]))
                r["problems"].append(f"pruned size {ratio:.3f}x a clean run's; objects beyond its count: {extra}")
            leftovers = f"temps {r.get('temps_after_prune')} uploads {r.get('uploads_after_prune')}"
            state = "OK" if not r["problems"] else "FAIL"
            print(
                f"  K={k:3d} {state} ({time.monotonic() - t0:4.1f}s) at [{r['at']}] dup={r.get('duplicates')} "
                f"size={ratio and round(ratio, 3)} {leftovers} cut={r.get('cut_puts')}",
                flush=True,
            )
            for p in r["problems"]:
                print(f"      ! {p}", flush=True)
            results.append(r)
        failed = [r for r in results if r["problems"]]
        return {"scenario": name, "writes": total, "points": len(results), "failed": len(failed)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["s3", "moto", "sftp"])
    parser.add_argument("scenarios", nargs="*")
    parser.add_argument("--when", default="before", choices=["before", "after"])
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--last", type=int, default=10_000)
    parser.add_argument("--work", default="")
    parser.add_argument("--part-mib", type=float, default=0, help="s3fs's multipart part size (killremote.py)")
    ns = parser.parse_args()
    os.environ.update(servers.CLIENT_ENV)
    if ns.part_mib:
        os.environ["KILLREMOTE_PART_MIB"] = str(ns.part_mib)
    work = Path(ns.work or tempfile.mkdtemp(prefix="remote-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    starter = {"s3": servers.start_seaweedfs, "moto": servers.start_moto, "sftp": servers.start_sshd}[ns.backend]
    (work / "server").mkdir(exist_ok=True)
    srv = starter(work / "server")
    try:
        place = s3_place(srv) if ns.backend in ("s3", "moto") else sftp_place(srv)
        os.environ.update({**place.backend.env, **place.env})
        sweep = Sweep(place, work, ns.when)
        summary = [sweep.sweep(name, ns.every, ns.first, ns.last) for name in ns.scenarios or SCENARIOS]
        print(json.dumps(summary, indent=1), flush=True)
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
