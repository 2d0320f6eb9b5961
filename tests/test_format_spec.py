"""An independent reader written from docs/format.md restores a real vault, plain and encrypted.

The reader below was written from docs/format.md and docs/security.md alone (audit fs57), with blake3,
zstandard and cryptography, and imports nothing of ckptvault: the vaults are made by the real CLI in
subprocesses. It opens the config (an encrypted vault's key from the keyfile and passphrase, the key
verifier over the signed settings), merges the index objects, checks every pack's header against them,
decodes every codec (0 raw, 1 zstd, 2 byte groups, 3 deltas through their bases), checks every chunk
against its ID and every file against its whole-file BLAKE3, after three saves of a changing safetensors
checkpoint and odd files, after a prune that repacks, and after repair-index rebuilt a lost index. A
writer that drifts from the document (or a document that drifts from the writer) fails here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import blake3
import numpy as np
import pytest
import zstandard
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

HEX64 = re.compile(r"^[0-9a-f]{64}$")
CHUNK, PACK_HEADER, INDEX, TREE, SNAPSHOT = 1, 2, 3, 4, 5
PASS = "format spec passphrase"


class Damage(Exception):
    pass


def hkdf(master: bytes, purpose: str, length: int = 32) -> bytes:
    return HKDF(hashes.SHA256(), length, None, ("ckptvault v1 " + purpose).encode()).derive(master)


# ---- keys (docs/format.md "config" and "Keyfiles") ------------------------------------------


def unwrap_keyfile(keyfile: dict, passphrase: str) -> bytes:
    assert keyfile["format"] == "ckptvault-keyfile" and keyfile["version"] == 1 and keyfile["kdf"]["name"] == "scrypt"
    kdf = keyfile["kdf"]
    salt, wrapped = base64.b64decode(kdf["salt"]), base64.b64decode(keyfile["wrapped_key"])
    secret = passphrase.encode().rstrip(b"\r\n")
    kek = hashlib.scrypt(secret, salt=salt, n=kdf["n"], r=kdf["r"], p=kdf["p"], dklen=32, maxmem=2**31 - 1)
    master = AESGCM(kek).decrypt(wrapped[:12], wrapped[12:], b"ckptvault-keyfile v1")
    assert len(master) == 32 and hkdf(master, "fingerprint", 16).hex() == keyfile["fingerprint"]
    return master


def signed_settings(config: dict) -> bytes:
    comp = config["compression"]
    compression = {"codec": comp["codec"], "level": comp["level"], "bytegroup": comp.get("bytegroup", False)}
    if comp.get("delta") is True:
        compression["delta"] = True
    doc = {
        **{k: config[k] for k in ("format", "version", "id", "created", "pack_size")},
        "chunker": {k: config["chunker"][k] for k in ("algorithm", "min_size", "avg_size", "max_size")},
        "compression": compression,
        "encryption": {k: config["encryption"][k] for k in ("mode", "key_fingerprint")},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def unlock(config: dict, keyfile: dict, passphrase: str) -> bytes:
    enc = config["encryption"]
    assert config["version"] >= keyfile.get("min_vault_format", 1)
    assert keyfile["fingerprint"] == enc["key_fingerprint"]
    master = unwrap_keyfile(keyfile, passphrase)
    aad = signed_settings(config) if config["version"] >= 3 else config["id"].encode("ascii")
    sealed = base64.b64decode(enc["key_verifier"])
    assert AESGCM(hkdf(master, "verifier")).decrypt(sealed[:12], sealed[12:], aad) == b"ckptvault key verifier v1"
    return master


# ---- the blob envelope and the codecs ---------------------------------------------------------


def zstd_frame(data: bytes, size: int | None) -> bytes:
    declared = zstandard.frame_content_size(data)
    if declared < 0 or (size is not None and declared != size) or declared > 1 << 30:
        raise Damage(f"zstd frame declares {declared}, expected {size}")
    out = zstandard.ZstdDecompressor().decompressobj().decompress(data)  # the first frame only
    if len(out) != declared:
        raise Damage("zstd frame decodes to another size")
    return out


def ungroup(payload: bytes, raw_len: int) -> bytes:
    (n_segments,) = struct.unpack_from("<H", payload, 0)
    segments = [struct.unpack_from("<BI", payload, 2 + 5 * i) for i in range(n_segments)]
    pos = 2 + 5 * n_segments
    widths = sum(w for w, _ in segments)
    streams = [struct.unpack_from("<BI", payload, pos + 5 * i) for i in range(widths)]
    pos += 5 * widths
    if sum(n for _, n in segments) != raw_len or any(w not in (1, 2, 4, 8) or n % w for w, n in segments):
        raise Damage("bytegroup segments")
    out, it = bytearray(), iter(streams)
    for width, length in segments:
        segment = bytearray(length)
        for i in range(width):
            mode, stored = next(it)
            body, pos = payload[pos : pos + stored], pos + stored
            if mode == 1:
                body = zstd_frame(body, length // width)
            elif mode != 0 or len(body) != length // width:
                raise Damage("bytegroup stream")
            segment[i::width] = body
        out += segment
    if pos != len(payload):
        raise Damage("bytes after the last bytegroup stream")
    return bytes(out)


def decode(codec: int, payload: bytes, raw_len: int | None) -> bytes:
    if codec == 0:
        return payload
    if codec == 1:
        return zstd_frame(payload, raw_len)
    if codec == 2 and raw_len is not None:
        return ungroup(payload, raw_len)
    raise Damage(f"codec {codec}")


class Vault:
    def __init__(self, root: Path, keyfile: Path | None = None) -> None:
        self.root = root
        self.config = json.loads((root / "config").read_text())
        assert self.config["format"] == "ckptvault" and self.config["version"] in (1, 2, 3)
        self.master = None
        if self.config["encryption"]["mode"] == "aes-256-gcm":
            assert keyfile is not None
            self.master = unlock(self.config, json.loads(keyfile.read_text()), PASS)
            self.blob_key = AESGCM(hkdf(self.master, "blob aes-256-gcm"))
            self.id_key = hkdf(self.master, "chunk-id blake3")
        else:
            assert self.config["encryption"]["mode"] == "none" and self.config["version"] < 3
        self.index: dict[bytes, list[tuple[str, int, int, int, bytes | None]]] = {}
        self.codecs: set[str] = set()
        for name in self.names("index"):
            for pack, entries in parse_index(self.metadata(INDEX, self.root / "index" / name)).items():
                for chunk_id, *where in entries:
                    self.index.setdefault(chunk_id, []).append((pack, *where))
        for copies in self.index.values():  # a copy without a base first
            copies.sort(key=lambda c: c[4] is not None)

    def names(self, folder: str) -> list[str]:
        return sorted(n for n in os.listdir(self.root / folder) if HEX64.match(n))

    def open(self, blob: bytes, kind: int, object_id: bytes) -> tuple[int, bytes]:
        assert blob[0] == 1, "envelope version"
        aad = bytes([blob[0], blob[1], kind]) + object_id
        if self.master is None:
            assert blob[1] == 0
            inner = blob[2:-16]
            if blake3.blake3(aad + inner).digest()[:16] != blob[-16:]:
                raise Damage(f"checksum of {kind}/{object_id.hex()}")
        else:
            assert blob[1] == 1
            inner = self.blob_key.decrypt(blob[2:14], blob[14:], aad)
        return inner[0], inner[1:]

    def metadata(self, kind: int, path: Path) -> bytes:
        codec, payload = self.open(path.read_bytes(), kind, bytes.fromhex(path.name))
        return decode(codec, payload, None)

    def chunk_id(self, plain: bytes) -> bytes:
        return blake3.blake3(plain, key=self.id_key).digest() if self.master else blake3.blake3(plain).digest()

    def check_packs(self) -> None:
        """Each pack's header agrees with the index, and its blobs run back to back up to the header."""
        indexed = {(c[0], chunk_id): c[1:] for chunk_id, copies in self.index.items() for c in copies}
        for sub in os.listdir(self.root / "packs"):
            for name in (n for n in os.listdir(self.root / "packs" / sub) if HEX64.match(n) and n[:2] == sub):
                data = (self.root / "packs" / sub / name).read_bytes()
                magic, (length,) = data[-4:], struct.unpack("<I", data[-8:-4])
                assert magic in (b"CVP1", b"CVP2")
                header = data[len(data) - 8 - length : -8]
                plain = decode(*self.open(header, PACK_HEADER, bytes.fromhex(name)), None)
                end = 0
                for chunk_id, offset, stored, raw, base in entries(plain, magic == b"CVP2"):
                    assert offset == end and indexed[(name, chunk_id)] == (offset, stored, raw, base)
                    end = offset + stored
                assert end == len(data) - 8 - length

    def chunk(self, chunk_id: bytes, depth: int = 0) -> bytes:
        assert depth <= 16, "delta chain too deep"
        pack, offset, stored, raw_len, base = self.index[chunk_id][0]
        with open(self.root / "packs" / pack[:2] / pack, "rb") as f:
            f.seek(offset)
            codec, payload = self.open(f.read(stored), CHUNK, chunk_id)
        self.codecs.add(str(codec))
        if codec == 3:
            assert payload[:32] == base and payload[32] in (0, 1, 2), "delta base and inner codec"
            self.codecs.add(f"3/{payload[32]}")
            xored = np.frombuffer(decode(payload[32], payload[33:], raw_len), np.uint8)
            plain = (xored ^ np.frombuffer(self.chunk(base, depth + 1), np.uint8)).tobytes()
        else:
            assert base is None
            plain = decode(codec, payload, raw_len)
        if len(plain) != raw_len or self.chunk_id(plain) != chunk_id:
            raise Damage(f"chunk {chunk_id.hex()}")
        return plain

    def snapshots(self) -> dict[str, dict]:
        snaps = {}
        for name in self.names("snapshots"):
            snap = json.loads(self.metadata(SNAPSHOT, self.root / "snapshots" / name))
            assert snap["version"] == 1 and snap["id"] == name
            snaps[snap["tags"]["step"]] = snap
        return snaps

    def restore(self, snap: dict) -> dict[str, tuple]:
        """Every entry of the snapshot as ``listing`` gives the source: (type, mode, mtime, bytes or target)."""
        tree = json.loads(self.metadata(TREE, self.root / "trees" / snap["tree"]))
        assert tree["version"] == 1
        out = {}
        for e in tree["entries"]:
            assert not e["path"].startswith("/") and not {"", ".", ".."} & set(e["path"].split("/"))
            if e["type"] == "file":
                data = b"".join(self.chunk(bytes.fromhex(c)) for c in e["chunks"])
                assert len(data) == e["size"] and blake3.blake3(data).hexdigest() == e["blake3"], e["path"]
                out[e["path"]] = ("file", e["mode"], e["mtime_ns"], data)
            elif e["type"] == "symlink":
                out[e["path"]] = ("symlink", e["target"])
            else:
                assert e["type"] == "dir"
                out[e["path"]] = ("dir", e["mode"], e["mtime_ns"])
        return out


def entries(raw: bytes, wide: bool) -> list[tuple[bytes, int, int, int, bytes | None]]:
    size = 76 if wide else 44
    assert len(raw) % size == 0
    out = []
    for pos in range(0, len(raw), size):
        base = raw[pos + 44 : pos + 76] if wide else None
        out.append(
            (raw[pos : pos + 32], *struct.unpack_from("<III", raw, pos + 32), base if base != bytes(32) else None)
        )
    return out


def parse_index(raw: bytes) -> dict[str, list]:
    wide = raw[:4] == b"CVI2"
    pos = 4 if wide else 0
    (n_packs,), pos = struct.unpack_from("<I", raw, pos), pos + 4
    packs = {}
    for _ in range(n_packs):
        pack, (n,) = raw[pos : pos + 32].hex(), struct.unpack_from("<I", raw, pos + 32)
        size = n * (76 if wide else 44)
        packs[pack] = entries(raw[pos + 36 : pos + 36 + size], wide)
        pos += 36 + size
    assert pos == len(raw), "bytes after the last pack"
    return packs


# ---- the vaults, made by the real CLI ---------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header, offset, blobs = {}, 0, []
    for name, (dtype, arr) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        blobs.append(arr.tobytes())
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def save(src: Path, step: int, rng: np.random.Generator, weights: np.ndarray) -> None:
    """One checkpoint save: trained weights (F32 and BF16), a frozen tensor, and odd files."""
    weights += rng.normal(0, 1e-4, weights.shape).astype(np.float32)
    frozen = np.random.default_rng(7).normal(0, 0.02, (256, 512)).astype(np.float32)
    bf16 = (weights.view(np.uint32) >> 16).astype(np.uint16)
    write_safetensors(
        src / "model.safetensors", {"frozen": ("F32", frozen), "w": ("F32", weights), "h": ("BF16", bf16)}
    )
    (src / "odd" / "empty-dir").mkdir(parents=True, exist_ok=True)
    (src / "odd" / "empty").write_bytes(b"")
    (src / "odd" / "zeros").write_bytes(bytes(300_000))
    (src / "odd" / "one byte").write_bytes(b"x")
    (src / "odd" / "héllo ✓ 日本.txt").write_text(f"step {step}\n")
    (src / "odd" / "state.json").write_text(json.dumps({"step": step}))
    (src / "rng_state.bin").write_bytes(rng.bytes(600_000))  # new in every save: dead once a save is forgotten
    os.chmod(src / "odd" / "one byte", 0o600)
    with open(os.path.join(os.fsencode(src), b"odd", b"not-utf8-\xff"), "wb") as f:
        f.write(b"a name that is not UTF-8")
    if not (src / "odd" / "link").is_symlink():
        os.symlink("../nowhere/ü", src / "odd" / "link")


def listing(root: Path) -> dict[str, tuple]:
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel, st = os.path.relpath(path, root), os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("symlink", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_mtime_ns, Path(path).read_bytes())
    return out


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_an_independent_reader_restores_a_real_vault(tmp_path: Path, cli: Callable, encrypted: bool):
    repo, src, key = tmp_path / "vault", tmp_path / "src", tmp_path / "team.key"
    src.mkdir()
    args = ["--repo", str(repo)] + (["--keyfile", str(key)] if encrypted else [])
    if encrypted:
        cli("key", "generate", "-k", str(key), "--kdf-cost", "14", CKPTVAULT_PASSPHRASE=PASS)
        cli("init", str(repo), "--encrypt", "--keyfile", str(key), CKPTVAULT_PASSPHRASE=PASS)
    else:
        cli("init", str(repo))
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.02, (768, 512)).astype(np.float32)
    saves = {}
    for step in ("1", "2", "3"):
        save(src, int(step), rng, weights)
        saves[step] = listing(src)
        cli("backup", str(src), "--tag", f"step={step}", *args, CKPTVAULT_PASSPHRASE=PASS)

    def read_back(steps: tuple[str, ...]) -> set[str]:
        vault = Vault(repo, key if encrypted else None)
        vault.check_packs()
        snaps = vault.snapshots()
        assert sorted(snaps) == list(steps)
        for step in steps:
            assert vault.restore(snaps[step]) == saves[step], step
        return vault.codecs

    assert {"1", "2", "3/2"} <= read_back(("1", "2", "3"))  # zstd, byte groups, deltas of byte groups
    pruned = cli("prune", "--keep-latest", "2", *args, CKPTVAULT_PASSPHRASE=PASS).stdout.decode()
    assert re.search(r"repacked [1-9]", pruned), pruned  # blobs copied into new packs, read back below
    assert "3" in read_back(("2", "3"))  # deltas whose base the forgotten save stored
    shutil.rmtree(repo / "index")
    (repo / "index").mkdir()
    cli("repair-index", *args, CKPTVAULT_PASSPHRASE=PASS)
    read_back(("2", "3"))


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_the_ids_a_retag_and_a_copy_derive_are_those_the_document_gives(tmp_path: Path, cli: Callable, encrypted: bool):
    """docs/format.md "Snapshots": a retagged snapshot's ID is SHA-256 of a domain, the old ID and the new tags
    as JSON, spelled out there byte for byte (a non-ASCII value included); a copy's tree ID is the
    destination's chunk-ID function of a domain, the snapshot ID and the tree's stored JSON."""
    src, key = tmp_path / "src", tmp_path / "team.key"
    src.mkdir()
    (src / "w.bin").write_bytes(b"weights")
    keyed = ["--keyfile", str(key)] if encrypted else []
    dest = ["--repo", str(tmp_path / "dest"), *keyed]
    if encrypted:
        cli("key", "generate", "-k", str(key), "--kdf-cost", "14", CKPTVAULT_PASSPHRASE=PASS)
    cli("init", str(tmp_path / "src-vault"))
    cli("init", str(tmp_path / "dest"), *(["--encrypt", *keyed] if encrypted else []), CKPTVAULT_PASSPHRASE=PASS)
    cli("backup", str(src), "--repo", str(tmp_path / "src-vault"), "--tag", "run=x")
    tagged = json.loads(
        cli("tag", "latest", "--repo", str(tmp_path / "src-vault"), "--add", "note=über ✓", "--json").stdout
    )
    tags_json = '{"note": "über ✓", "run": "x"}'.encode()  # keys sorted, ", " and ": ", UTF-8 as itself
    expected = hashlib.sha256(b"ckptvault retag\0" + bytes.fromhex(tagged["previous_id"]) + tags_json).hexdigest()
    assert tagged["snapshot"]["id"] == expected

    cli("copy", "--from-repo", str(tmp_path / "src-vault"), *dest, CKPTVAULT_PASSPHRASE=PASS)
    vault = Vault(tmp_path / "dest", key if encrypted else None)
    (name,) = vault.names("snapshots")
    assert name == expected  # a copy keeps the ID
    snap = json.loads(vault.metadata(SNAPSHOT, tmp_path / "dest" / "snapshots" / name))
    tree = vault.metadata(TREE, tmp_path / "dest" / "trees" / snap["tree"])
    assert vault.chunk_id(b"ckptvault copy: tree of snapshot\0" + bytes.fromhex(name) + tree).hex() == snap["tree"]
