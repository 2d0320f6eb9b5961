#!/usr/bin/env python3
"""Where ckptvault's CPU goes, per stage, for a first backup and a verified restore.

Runs the real CLI under `perf record` (Linux perf; run as root or with perf_event_paranoid <= 1) on
save 1 of the shared workload (generate it with run_bench.py first), in a fresh repository, encrypted
with --encrypt, and groups the samples by the library or kernel routine they fall in:

  read        kernel: copying file and pack bytes to the process (page cache reads)
  write       kernel: copying bytes into the page cache, ext4 and block-layer work
  memory      kernel: page faults, zeroing and unmapping pages
  threads     kernel: waking and switching threads, futexes
  hash        BLAKE3 (chunk IDs, blob checksums, whole-file hashes)
  chunk       FastCDC
  group       numpy: byte grouping (codec 2) and XOR (codec 3)
  zstd        zstd compression or decompression
  aes         AES-256-GCM
  kdf         scrypt (unlocking the keyfile)
  memcpy      libc memcpy/memset (joining blobs, filling pack buffers)
  python      the interpreter (our code, start-up, imports)
  other       everything else

CPU seconds are samples / frequency, summed over every thread (two cores: wall >= CPU / 2).
Stdlib only. See README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

from run_bench import byte_compile_ckptvault

FREQ = 999
STAGES = [
    ("hash", r"blake3"),
    ("chunk", r"fastcdc"),
    ("zstd", r"backend_c|zstd|ZSTD|HUF_|HIST_|FSE_"),
    ("aes", r"aes|gcm|ghash|AES|GCM"),
    ("kdf", r"scrypt|salsa|Salsa|pbkdf|PBKDF"),
    ("group", r"_multiarray_umath|bitwise_xor|_contig_to_strided|_strided_to_contig|numpy|libscipy_openblas"),
    ("memcpy", r"__memmove|__memset|__memcpy"),
    ("python", r"libpython|python3"),
    ("read", r"_copy_to_iter|filemap_|copy_page_to_iter|folio_mark_accessed|touch_atime"),
    (
        "write",
        r"copy_folio_from_iter|ext4_|jbd2|block_|__block|mpage_|bio_|blk_|nvme|virtio|iomap|"
        r"generic_perform_write|balance_dirty|folio_batch|__es_|writeback|submit_",
    ),
    (
        "memory",
        r"page_fault|clear_page|do_anonymous|handle_mm_fault|unmap|__list_del|alloc_pages|free_pages|"
        r"folio_|lru_|memcg|tlb|zap_|rmqueue|get_page_from_freelist|slab|kmem_cache|mmap|munmap|gup_",
    ),
    ("threads", r"futex|schedule|switch|spin|wake|finish_task|irqrestore|_raw_spin|select_task|enqueue|dequeue"),
]


def perf_record(cmd: list[str], env: dict[str, str], data: str) -> None:
    subprocess.run(["perf", "record", "-q", "-F", str(FREQ), "-o", data, "--", *cmd], env=env, check=True)


def stage_seconds(data: str) -> dict[str, float]:
    report = subprocess.run(
        ["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym", "-g", "none", "-F", "sample,dso,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    totals: dict[str, float] = {}
    for line in report.splitlines():
        parts = line.split(None, 1)
        if not parts or line.startswith("#") or not parts[0].isdigit():
            continue
        samples, rest = int(parts[0]), parts[1]
        stage = next((name for name, pattern in STAGES if re.search(pattern, rest)), "other")
        if stage in ("read", "write", "memory", "threads") and "[k]" not in rest:
            stage = "other"
        totals[stage] = totals.get(stage, 0.0) + samples / FREQ
    return totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/ckptvault-bench", help="run_bench.py's work dir (holds workload/)")
    ap.add_argument("--save", default="step-1000", help="which save of the workload to back up and restore")
    ap.add_argument("--encrypt", action="store_true", help="profile an encrypted repository")
    a = ap.parse_args(argv)
    if shutil.which("perf") is None:
        print("perf is not installed (Debian: apt-get install linux-perf)", file=sys.stderr)
        return 2
    src = os.path.join(a.work, "workload", a.save)
    if not os.path.isdir(src):
        print(f"no workload at {src}; run benchmarks/run_bench.py --work {a.work} first", file=sys.stderr)
        return 2
    logical = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
    base = os.path.join(a.work, "profile")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    exe = os.path.join(os.path.dirname(sys.executable), "ckptvault")
    byte_compile_ckptvault()
    repo, out = os.path.join(base, "repo"), os.path.join(base, "restored")
    env = dict(os.environ, XDG_DATA_HOME=base, XDG_CACHE_HOME=base, CKPTVAULT_PASSPHRASE="profile-passphrase")
    init = [exe, "init", repo]
    if a.encrypt:
        env["CKPTVAULT_KEYFILE"] = os.path.join(base, "profile.key")
        subprocess.run([exe, "key", "generate"], env=env, check=True, capture_output=True)
        init.append("--encrypt")
    subprocess.run(init, env=env, check=True, capture_output=True)

    results = {}
    for phase, cmd in (
        ("backup", [exe, "backup", src, "--repo", repo, "--quiet"]),
        ("restore", [exe, "restore", "latest", out, "--repo", repo, "--quiet"]),
    ):
        subprocess.run(["sync"], check=True)
        data = os.path.join(base, f"{phase}.perf")
        perf_record(cmd, env, data)
        results[phase] = stage_seconds(data)

    names = [name for name, _ in STAGES] + ["other"]
    print(f"save {a.save}: {logical / 1e6:,.1f} MB, {'encrypted' if a.encrypt else 'unencrypted'} repository,")
    print(f"{os.cpu_count()} CPUs; CPU seconds per stage (perf, {FREQ} Hz, all threads)\n")
    print("| stage | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for name in names:
        cells = [f"{stages.get(name, 0.0):.2f}" for stages in results.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| **CPU total** | " + " | ".join(f"**{sum(s.values()):.2f}**" for s in results.values()) + " |")
    print("\n(wall seconds: run_bench.py; perf's own start-up and sampling make them meaningless here)")
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
