#!/usr/bin/env python3
"""Benchmark ckptvault against restic and borg on the shared synthetic checkpoint workload.

Phases per tool, each in a fresh repository, each timed with `/usr/bin/time -v`
(wall seconds, peak RSS) after an untimed `sync`:
  backup1_first     back up the first save (step-1000)
  backup2_incr      back up the second save (step-2000)
  backup2_nochange  back up the second save again, untouched
  restore_latest    restore the latest snapshot into an empty dir with the repository
                    evicted from the page cache first, as on a machine that replaces a
                    lost one (then, untimed, compare every byte with the source; the
                    same after restore_cached)
  restore_cached    the same restore again into the emptied dir, the repository now
                    in the page cache as far as the tool's first restore left it there
                    (restic's and borg's reads fill it; ckptvault reads and writes packs
                    with O_DIRECT on a local disk, so it reads them from the disk again)
Prints a markdown table, then each ckptvault tool's speed ratios against restic in
the same run. --quick: a small workload in WORK/quick (under 3 minutes on 2 cores).
Stdlib only (numpy is needed by make_workload.py). See README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
TIME_BIN = "/usr/bin/time"
APT_PACKAGES = {"restic": "restic", "borg": "borgbackup"}
PASSWORD = "bench-passphrase"
# make_workload flags: the anchor run, and what --quick changes (same tensor shapes, fewer layers and saves)
FULL = {"model_mb": 600.0, "saves": 3, "hidden": 1024}
QUICK = {"model_mb": 200.0, "saves": 2}
RATIO_PHASES = {
    "backup1": "backup1_first",
    "incr": "backup2_incr",
    "no-change": "backup2_nochange",
    "restore": "restore_latest",
    "restore cached": "restore_cached",
}


@dataclass
class Phase:
    wall_s: float
    max_rss_kb: int | None  # None: unknown
    rc: int
    logical_bytes: int  # bytes of the checkpoint dir this phase backs up / restores


@dataclass
class ToolResult:
    tool: str
    version: str = ""
    phases: dict[str, Phase] = field(default_factory=dict)
    repo_bytes: dict[str, int] = field(default_factory=dict)  # du -sb after each backup phase
    verified: bool | None = None
    verify_detail: str = ""
    key: str = ""  # how the tool derives its key from the passphrase (its parameters are set at init)
    unlock_s: float | None = None  # fastest of three runs of unlock_cmd: start-up plus key derivation
    error: str | None = None  # phase failure or "skipped: ..."


@dataclass
class Tool:
    """How to drive one backup program; built by the per-tool functions below."""

    name: str
    env: dict[str, str]
    version_cmd: list[str]
    init_cmd: list[str]
    backup_cmd: Callable[[str, str, int], list[str]]  # (src, phase name, step) -> argv
    restore_cmd: Callable[[str], tuple[list[str], str | None]]  # dest -> (argv, cwd)
    restored_root: Callable[[str, str], str]  # (dest, src) -> where the src tree ends up
    unlock_cmd: list[str]  # opens the repository (derives the key) and reads next to nothing
    key: Callable[[], str]  # after init: the key derivation's parameters, read from the key file


# ------------------------------------------------------------------ tools
def byte_compile_ckptvault() -> None:
    """Write ckptvault's .pyc files, as a regular `pip install` does, so that no timed process spends
    ~0.1 s compiling its sources: an editable install writes them on first import, unless
    PYTHONDONTWRITEBYTECODE is set (it is on some CI and sandbox machines)."""
    found = subprocess.run(
        [sys.executable, "-c", "import ckptvault, os; print(os.path.dirname(ckptvault.__file__))"],
        capture_output=True,
        text=True,
    )
    if found.returncode == 0:
        subprocess.run([sys.executable, "-m", "compileall", "-q", found.stdout.strip()], capture_output=True)


def ckptvault_tool(repo: str, state: str, encrypted: bool = False, delta: bool = True) -> Tool:
    byte_compile_ckptvault()
    exe = os.path.join(os.path.dirname(sys.executable), "ckptvault")
    exe = exe if os.path.exists(exe) else (shutil.which("ckptvault") or "ckptvault")
    # point every default location into the work dir so no user repo is touched
    env = dict(os.environ, CKPTVAULT_REPO=repo, XDG_DATA_HOME=state, XDG_CACHE_HOME=state)
    init = [exe, "init", repo] + ([] if delta else ["--no-delta"])
    keyfile = os.path.join(state, "bench.key")
    if encrypted:  # AES-256-GCM under a keyfile with the default scrypt cost, like a real user's
        env.update(CKPTVAULT_PASSPHRASE=PASSWORD, CKPTVAULT_KEYFILE=keyfile)
        sh([exe, "key", "generate", "--keyfile", keyfile], env=env, check=True)
        init += ["--encrypt"]
    return Tool(
        ("ckptvault-enc" if encrypted else "ckptvault") + ("" if delta else "-nodelta"),
        env,
        [exe, "--version"],
        init,
        lambda src, name, step: [
            exe,
            "backup",
            src,
            "--repo",
            repo,
            "--tag",
            "run=bench",
            "--tag",
            f"step={step}",
            "--quiet",
        ],
        lambda dest: ([exe, "restore", "latest", dest, "--repo", repo, "--tag", "run=bench", "--quiet"], None),
        lambda dest, src: dest,  # restores the directory's contents into dest
        [exe, "snapshots", "--repo", repo, "--quiet"],
        lambda: scrypt_params(json.load(open(keyfile))["kdf"]) if encrypted else "none (unencrypted)",
    )


def restic_tool(repo: str, state: str) -> Tool:
    env = dict(os.environ, RESTIC_PASSWORD=PASSWORD, RESTIC_CACHE_DIR=os.path.join(state, "cache"))
    return Tool(
        "restic",
        env,
        ["restic", "version"],
        # repository v2: compressed (compression "auto" is the default)
        ["restic", "init", "--repo", repo, "--repository-version", "2"],
        lambda src, name, step: ["restic", "--repo", repo, "backup", "--host", "bench", "--tag", "run=bench", src],
        lambda dest: (["restic", "--repo", repo, "restore", "latest", "--target", dest], None),
        lambda dest, src: os.path.join(dest, os.path.abspath(src).lstrip("/")),  # absolute path under target
        ["restic", "--repo", repo, "cat", "config"],
        # restic calibrates scrypt on each `init` (~0.5 s on the machine as busy as it is then), so its
        # key, and with it every phase's fixed cost, differs between runs
        lambda: scrypt_params(json.load(open(next(iter(glob.glob(os.path.join(repo, "keys", "*"))))))),
    )


def borg_tool(repo: str, state: str) -> Tool:
    env = dict(
        os.environ,
        BORG_PASSPHRASE=PASSWORD,
        BORG_BASE_DIR=state,
        BORG_DISPLAY_PASSPHRASE="no",
        BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK="yes",
        BORG_RELOCATED_REPO_ACCESS_IS_OK="yes",
    )

    def restore(dest: str) -> tuple[list[str], str | None]:
        # borg 1.x has no "latest" alias: resolve the newest archive (untimed, cheap)
        last = (
            subprocess.run(
                ["borg", "list", "--last", "1", "--short", repo],
                env=env,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
            ).stdout.strip()
            or "missing-archive"
        )
        return ["borg", "extract", f"{repo}::{last}"], dest  # extracts relative paths into cwd

    return Tool(
        "borg",
        env,
        ["borg", "--version"],
        ["borg", "init", "--encryption=repokey-blake2", repo],
        lambda src, name, step: ["borg", "create", "--compression", "zstd,3", f"{repo}::{name}", src],
        restore,
        lambda dest, src: os.path.join(dest, os.path.abspath(src).lstrip("/")),
        ["borg", "list", "--last", "1", "--short", repo],
        lambda: "PBKDF2-HMAC-SHA256, 100,000 rounds (borg 1.x repokey)",
    )


TOOLS = {
    "ckptvault": ckptvault_tool,
    "ckptvault-enc": lambda repo, state: ckptvault_tool(repo, state, encrypted=True),
    # the same build with delta coding off (repository format 1): the baseline the delta goals compare with
    "ckptvault-nodelta": lambda repo, state: ckptvault_tool(repo, state, delta=False),
    "restic": restic_tool,
    "borg": borg_tool,
}


# ------------------------------------------------------------------ helpers
def scrypt_params(kdf: dict) -> str:
    """restic's key files and ckptvault's keyfiles both keep scrypt's N, r and p (any key case)."""
    low = {k.lower(): v for k, v in kdf.items()}
    return f"scrypt N=2^{int(low['n']).bit_length() - 1} r={low['r']} p={low['p']}"


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kw)


def ensure_installed(tools: list[str]) -> None:
    """apt-get install restic/borgbackup/time if missing; never fatal."""
    pkgs = [APT_PACKAGES[t] for t in tools if t in APT_PACKAGES and not shutil.which(t)]
    if not os.access(TIME_BIN, os.X_OK):
        pkgs.append("time")
    if not pkgs:
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        print(f"note: cannot install {pkgs} (need apt-get as root); missing tools are skipped", file=sys.stderr)
        return
    print(f"installing {' '.join(pkgs)} ...", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *pkgs]):
        p = sh(cmd, env=env)
        if p.returncode != 0:
            print(f"note: {' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-500:]}", file=sys.stderr)
            return


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it, with what moves the ratios between runs on "the same" VM: the
    host's generation (a vCPU without AVX-512 hashes BLAKE3 at about half the speed) is not chosen here."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first CPU is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "CPU unknown"
    flags = fields.get("flags", "").split()
    return (
        f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}), "
        f"AVX-512: {'yes' if 'avx512f' in flags else 'no'}"
    )


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def du_bytes(path: str) -> int:
    return int(sh(["du", "-sb", path]).stdout.split()[0])


def run_timed(cmd: list[str], env: dict, log: str, logical: int, cwd: str | None = None) -> Phase:
    """sync (untimed), then run cmd under /usr/bin/time -v; output goes to log."""
    subprocess.run(["sync"])
    use_time = os.access(TIME_BIN, os.X_OK)
    argv = [TIME_BIN, "-v", "-o", log + ".time", *cmd] if use_time else cmd
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        rc = subprocess.run(
            argv, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        ).returncode
    wall = time.perf_counter() - t0
    if use_time:
        with open(log + ".time") as f:
            m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", f.read())
        rss = int(m.group(1)) if m else None
    else:  # max over all children so far: an upper bound for this phase
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return Phase(round(wall, 3), rss, rc, logical)


def evict_from_page_cache(root: str) -> None:
    """Drop a repository's pages from the page cache (written back first), so that a restore reads
    it from the disk whichever way the tool wrote it. Needs no root; a no-op without posix_fadvise."""
    subprocess.run(["sync"])
    if not hasattr(os, "posix_fadvise"):
        return
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def compare_trees(src: str, dst: str) -> tuple[bool, str]:
    """Every file of src must exist in dst with identical bytes, and dst has no extra files."""
    if not os.path.isdir(dst):
        return False, f"restored tree not found at {dst}"

    def files(root: str) -> set[str]:
        return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}

    a, b = files(src), files(dst)
    if a != b:
        return False, f"file sets differ: missing {sorted(a - b)[:5]}, extra {sorted(b - a)[:5]}"
    for rel in sorted(a):
        with open(os.path.join(src, rel), "rb") as fa, open(os.path.join(dst, rel), "rb") as fb:
            while True:
                x, y = fa.read(8 << 20), fb.read(8 << 20)
                if x != y:
                    return False, f"{rel} differs"
                if not x:
                    break
    return True, f"{len(a)} files identical"


def warm_page_cache(src: str) -> None:
    """Read the source tree once, untimed: every tool then reads it from memory, not only the tools
    that happen to run after another read it (the first tool of a run would pay the disk)."""
    for root, _dirs, names in os.walk(src):
        for n in names:
            with open(os.path.join(root, n), "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass


# ------------------------------------------------------------------ benchmark
def bench_tool(name: str, work: str, saves: list[tuple[str, int]], keep: bool) -> ToolResult:
    repo, state, dest = (os.path.join(work, d, name) for d in ("repos", "state", "restore"))
    logs = os.path.join(work, "logs")
    for d in (repo, state, dest):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(state)
    os.makedirs(logs, exist_ok=True)
    os.makedirs(os.path.dirname(repo), exist_ok=True)
    tool = TOOLS[name](repo, state)
    res = ToolResult(name)
    try:
        v = sh(tool.version_cmd, env=tool.env)
        res.version = (v.stdout or v.stderr).strip().splitlines()[0] if v.returncode == 0 else "?"
        p = sh(tool.init_cmd, env=tool.env)
        if p.returncode != 0:
            res.error = f"init failed: {p.stderr.strip()[-300:]}"
            return res
        res.key = tool.key()
        unlocks = [run_timed(tool.unlock_cmd, tool.env, os.path.join(logs, f"{name}-unlock.log"), 0) for _ in range(3)]
        res.unlock_s = min(u.wall_s for u in unlocks) if all(u.rc == 0 for u in unlocks) else None
        (src1, step1), (src2, step2) = saves[0], saves[1]
        for phase, src, step in (
            ("backup1_first", src1, step1),
            ("backup2_incr", src2, step2),
            ("backup2_nochange", src2, step2),
        ):
            print(f"  {name}: {phase} ...", file=sys.stderr)
            warm_page_cache(src)
            ph = run_timed(
                tool.backup_cmd(src, phase, step), tool.env, os.path.join(logs, f"{name}-{phase}.log"), tree_bytes(src)
            )
            res.phases[phase] = ph
            res.repo_bytes[phase] = du_bytes(repo)
            # restic exits 3 when some files could not be read: still a failure here
            if ph.rc != 0:
                res.error = f"{phase} exited {ph.rc}; see {logs}/{name}-{phase}.log"
                return res
        for phase in ("restore_latest", "restore_cached"):
            print(f"  {name}: {phase} ...", file=sys.stderr)
            shutil.rmtree(dest, ignore_errors=True)
            os.makedirs(dest)
            cmd, cwd = tool.restore_cmd(dest)  # before the eviction: borg's reads the repository to find its archive
            if phase == "restore_latest":
                for d in (repo, state):  # the repository, and the tool's own cache and keys
                    evict_from_page_cache(d)
            ph = run_timed(cmd, tool.env, os.path.join(logs, f"{name}-{phase}.log"), tree_bytes(src2), cwd)
            res.phases[phase] = ph
            if ph.rc != 0:
                res.error = f"{phase} exited {ph.rc}; see {logs}/{name}-{phase}.log"
                return res
            res.verified, res.verify_detail = compare_trees(src2, tool.restored_root(dest, src2))
            if not res.verified:
                res.verify_detail = f"{phase}: {res.verify_detail}"
                return res
        return res
    except Exception as exc:  # never crash the whole benchmark on one tool
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    finally:
        if not keep:
            for d in (repo, state, dest):
                shutil.rmtree(d, ignore_errors=True)


def phase_s(r: ToolResult, ph: str) -> float | None:
    """Wall seconds of a phase that succeeded, else None."""
    p = r.phases.get(ph)
    return p.wall_s if p and p.rc == 0 and p.wall_s > 0 else None


def mbps(r: ToolResult, ph: str) -> float | None:
    s = phase_s(r, ph)
    return r.phases[ph].logical_bytes / 1e6 / s if s else None


def ratios_vs_restic(results: list[ToolResult]) -> dict[str, dict[str, float | None]]:
    """Per ckptvault tool: restic seconds / its seconds per phase (>1: faster than restic).
    Both tools back up the same trees, so for the MB/s columns this is the MB/s ratio."""
    restic = next(r for r in results if r.tool == "restic")
    out: dict[str, dict[str, float | None]] = {}
    for r in results:
        if r.tool.startswith("ckptvault"):
            out[r.tool] = {}
            for col, ph in RATIO_PHASES.items():
                mine, theirs = phase_s(r, ph), phase_s(restic, ph)
                out[r.tool][col] = round(theirs / mine, 3) if mine and theirs else None
    return out


def ratio_table(ratios: dict[str, dict[str, float | None]]) -> str:
    cols = ["tool", *(f"{c} x" for c in RATIO_PHASES)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for tool, rs in ratios.items():
        lines.append("| " + " | ".join([tool, *(f"{x:.2f}x" if x else "-" for x in rs.values())]) + " |")
    return "\n".join(lines)


def table(results: list[ToolResult]) -> str:
    cols = [
        "tool",
        "backup1 MB/s",
        "incr MB/s",
        "no-change s",
        "restore MB/s",
        "restore cached MB/s",
        "peak RSS MB",
        "repo MB after save 1",
        "repo MB after save 2",
        "restore verified",
    ]

    def rate(r: ToolResult, ph: str) -> str:
        v = mbps(r, ph)
        return f"{v:.0f}" if v else "-"

    def mb(n: int | None) -> str:
        return f"{n / 1e6:.1f}" if n is not None else "-"

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in results:
        nc = r.phases.get("backup2_nochange")
        rss = [p.max_rss_kb for p in r.phases.values() if p.max_rss_kb is not None]
        row = [
            r.tool,
            rate(r, "backup1_first"),
            rate(r, "backup2_incr"),
            f"{nc.wall_s:.2f}" if nc and nc.rc == 0 else "-",
            rate(r, "restore_latest"),
            rate(r, "restore_cached"),
            mb(max(rss) * 1024) if rss else "-",
            mb(r.repo_bytes.get("backup1_first")),
            mb(r.repo_bytes.get("backup2_incr")),
            "yes" if r.verified else "no",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/ckptvault-bench", help="work dir (workload, repos, logs)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"small workload ({QUICK['model_mb']:g} MB model, {QUICK['saves']} saves) in WORK/quick, "
        "same phases: under 3 minutes on 2 cores",
    )
    ap.add_argument("--model-mb", type=float, help=f"make_workload --model-mb (default {FULL['model_mb']:g})")
    ap.add_argument("--saves", type=int, help=f"make_workload --saves, >= 2 (default {FULL['saves']})")
    ap.add_argument("--hidden", type=int, help=f"make_workload --hidden (default {FULL['hidden']})")
    ap.add_argument("--tools", default="ckptvault,ckptvault-enc,restic,borg", help="comma-separated subset")
    ap.add_argument("--keep", action="store_true", help="keep repos, tool state and restored trees")
    ap.add_argument("--out", default=None, help="results JSON (default WORK/results.json)")
    a = ap.parse_args(argv)
    for k, v in ({**FULL, **QUICK} if a.quick else FULL).items():  # explicit flags win
        if getattr(a, k) is None:
            setattr(a, k, v)
    tools = [t.strip() for t in a.tools.split(",") if t.strip()]
    if unknown := [t for t in tools if t not in TOOLS]:
        ap.error(f"unknown tools {unknown}; choose from {list(TOOLS)}")
    if a.saves < 2:
        ap.error("--saves must be >= 2")
    work = os.path.abspath(a.work)
    work = os.path.join(work, "quick") if a.quick else work  # never clobbers the full workload
    wl = os.path.join(work, "workload")
    os.makedirs(work, exist_ok=True)

    gen = [
        sys.executable,
        os.path.join(HERE, "make_workload.py"),
        "--out",
        wl,
        "--saves",
        str(a.saves),
        "--model-mb",
        str(a.model_mb),
        "--hidden",
        str(a.hidden),
    ]
    if subprocess.run(gen).returncode != 0:  # returns 0 at once if the same workload exists
        print("workload generation failed", file=sys.stderr)
        return 1
    with open(os.path.join(wl, "workload.json")) as f:
        manifest = json.load(f)
    saves = [(os.path.join(wl, s["dir"]), s["step"]) for s in manifest["saves"][:2]]

    ensure_installed(tools)
    results = []
    for name in tools:
        if not name.startswith("ckptvault") and not shutil.which(name):
            print(f"note: {name} not available; skipped", file=sys.stderr)
            results.append(ToolResult(name, error="skipped: not installed"))
            continue
        print(f"benchmarking {name} ...", file=sys.stderr)
        results.append(bench_tool(name, work, saves, a.keep))

    print(f"\nrun: {'QUICK (--quick: small workload, indicative only)' if a.quick else 'full'}")
    print(
        f"workload: {manifest['params']['model_mb']:g} MB model, {len(manifest['saves'])} saves; "
        f"save 1 = {saves[0][0]} ({tree_bytes(saves[0][0]) / 1e6:.1f} MB), "
        f"save 2 = {saves[1][0]} ({tree_bytes(saves[1][0]) / 1e6:.1f} MB)"
    )
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {cpu_model()}")
    for r in results:
        print(
            f"{r.tool}: {r.version or '-'}"
            + (f"  [{r.error}]" if r.error else "")
            + (f"  verify: {r.verify_detail}" if r.verify_detail else "")
            + (f"  key: {r.key}, unlock {r.unlock_s:.2f} s" if r.unlock_s is not None else "")
        )
    print()
    print(table(results))
    restic = next((r for r in results if r.tool == "restic"), None)
    ratios = ratios_vs_restic(results) if restic and restic.phases else None
    print("\nratios vs restic (same run; restic seconds / ckptvault seconds, >1 = faster):")
    if ratios is None:
        print(f"restic absent ({restic.error if restic else 'not in --tools'}): no ratios")
    else:
        print(ratio_table(ratios) if ratios else "no ckptvault tool in this run")

    out = a.out or os.path.join(work, "results.json")
    doc = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": cpu_model()},
        "workload": manifest,
        "timer": TIME_BIN if os.access(TIME_BIN, os.X_OK) else "getrusage",
        "quick": a.quick,
        "results": [dataclasses.asdict(r) for r in results],
        "ratios_vs_restic": ratios,  # null: no restic result in this run
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nraw results: {out}")
    return 0 if all(r.verified for r in results if not (r.error or "").startswith("skipped")) else 1


if __name__ == "__main__":
    sys.exit(main())
