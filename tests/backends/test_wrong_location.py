"""A vault URL that points somewhere wrong, on real servers: what the user is told, how fast, and that
nothing is left half made (audit bk57)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from ckptvault.store.backends import filesystem_class

from ..support import servers
from .conftest import make_checkpoint, one_line_error


def _restic_repository(where: Path) -> Path:
    """A restic repository holding one snapshot: made by restic where it is installed, else laid out as
    restic lays it out (a binary config; keys/, data/, index/, snapshots/ of 64-hex names)."""
    restic = shutil.which("restic")
    if restic:
        env = {**os.environ, "RESTIC_PASSWORD": "x", "RESTIC_CACHE_DIR": str(where / "restic-cache")}
        (where / "src").mkdir(parents=True)
        (where / "src" / "weights.bin").write_bytes(random.randbytes(50_000))
        for args in (["init"], ["backup", str(where / "src")]):
            subprocess.run([restic, "-q", "-r", str(where / "repo"), *args], env=env, check=True)
        return where / "repo"
    repo = where / "repo"
    name = lambda: random.randbytes(32).hex()  # noqa: E731
    (repo / "keys").mkdir(parents=True)
    (repo / "config").write_bytes(b"\x02" + random.randbytes(200))
    (repo / "keys" / name()).write_text(json.dumps({"kdf": "scrypt", "N": 32768, "r": 8, "p": 1, "data": "..."}))
    for folder in ("index", "snapshots"):
        (repo / folder).mkdir()
        (repo / folder / name()).write_bytes(random.randbytes(300))
    pack = name()
    (repo / "data" / pack[:2]).mkdir(parents=True)
    (repo / "data" / pack[:2] / pack).write_bytes(random.randbytes(5000))
    return repo


def _fs(backend: servers.Backend, url: str) -> tuple[Any, str]:
    """The filesystem of ``url`` and its path there, as ckptvault makes it (gcsfs's plain class on an emulator)."""
    protocol = url.split("://", 1)[0]
    cls = filesystem_class(fsspec.get_filesystem_class(protocol), protocol, backend.storage_options)
    fs = cls(skip_instance_cache=True, **{**cls._get_kwargs_from_urls(url), **backend.storage_options})
    return fs, cls._strip_protocol(url)


def _upload(backend: servers.Backend, local: Path, url: str) -> None:
    fs, path = _fs(backend, url)
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        target = f"{path}/{file.relative_to(local).as_posix()}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(target, file.read_bytes())


def _listing(backend: servers.Backend, url: str) -> list[str]:
    fs, path = _fs(backend, url)
    return sorted(fs.find(path))


@pytest.mark.parametrize(
    "backend_name", ["local", "s3-moto", "gcs-fake-gcs-server", "azure-azurite", "sftp-openssh", "webdav-wsgidav"]
)
def test_a_restic_repository_is_named_not_called_a_damaged_vault(server, remote_cli, tmp_path: Path, backend_name):
    """restic keeps snapshots/ and index/ of 64-hex names beside a binary config: every command took its
    repository for a ckptvault vault whose config is damaged ("put the config back from a copy", exit 30),
    init included. It is named for what it is, exit 10, and nothing is written into it."""
    repo = _restic_repository(tmp_path / "restic")
    if backend_name == "local":
        backend, url = None, str(tmp_path / "restic" / "repo")
    else:
        backend = server(backend_name).backend
        url = backend.new_url("restic")
        _upload(backend, repo, url)
    before = _listing(backend, url) if backend else sorted(str(p) for p in repo.rglob("*"))
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=0.1)
    for command in (["init", url], ["snapshots", "--repo", url], ["backup", str(src), "--repo", url]):
        proc = remote_cli(backend, *command, check=False, CKPTVAULT_RETRIES="0")
        line = one_line_error(proc)
        assert proc.returncode == 10, line
        assert f"{url} holds a restic repository" in line and "not a ckptvault vault" in line, line
        assert "damaged" not in line and "from a copy" not in line, line
    after = _listing(backend, url) if backend else sorted(str(p) for p in repo.rglob("*"))
    assert after == before


def _borg_repository(where: Path) -> Path:
    """A borg 1.x repository holding one archive: made by borg where it is installed, else laid out as borg's
    docs describe it (an INI config opening with [repository], a README, data/0/ segments, hints/index/integrity)."""
    repo = where / "repo"
    borg = shutil.which("borg")
    if borg:
        env = {**os.environ, "BORG_BASE_DIR": str(where / "borg-home"), "BORG_PASSPHRASE": ""}
        (where / "src").mkdir(parents=True)
        (where / "src" / "weights.bin").write_bytes(random.randbytes(50_000))
        subprocess.run([borg, "init", "-e", "none", str(repo)], env=env, check=True, capture_output=True)
        subprocess.run([borg, "create", f"{repo}::one", str(where / "src")], env=env, check=True, capture_output=True)
        return repo
    (repo / "data" / "0").mkdir(parents=True)
    (repo / "config").write_text(
        f"[repository]\nversion = 1\nsegments_per_dir = 1000\nmax_segment_size = 524288000\nappend_only = 0\n"
        f"storage_quota = 0\nadditional_free_space = 0\nid = {random.randbytes(32).hex()}\n"
    )
    (repo / "README").write_text("This is a Borg Backup repository.\nSee https://borgbackup.readthedocs.io/\n")
    (repo / "data" / "0" / "1").write_bytes(b"BORG_SEG" + random.randbytes(5000))
    for name in ("hints.1", "index.1", "integrity.1"):
        (repo / name).write_bytes(random.randbytes(100))
    return repo


def _borg2_repository(where: Path) -> Path:
    """A borg 2 repository as borgstore lays it out (borg 2 is not packaged here; internals/data-structures of
    2.0.0b24): config/ a folder of objects (readme, version, id, manifest), archives/ of 64-hex names, packs/ in
    folders of their first two digits, index/, keys/repokey, cache/, locks/."""
    repo = where / "repo"
    name = lambda: random.randbytes(32).hex()  # noqa: E731
    pack = name()
    for folder in ("config", "archives", "index", "keys", "cache", "locks", f"packs/{pack[:2]}"):
        (repo / folder).mkdir(parents=True)
    (repo / "config" / "readme").write_text(
        "This is a Borg Backup repository.\nSee https://borgbackup.readthedocs.io/\n"
    )
    (repo / "config" / "version").write_text("4")
    (repo / "config" / "id").write_text(name())
    (repo / "config" / "manifest").write_bytes(random.randbytes(436))
    (repo / "archives" / name()).write_bytes(random.randbytes(100))
    (repo / "packs" / pack[:2] / pack).write_bytes(random.randbytes(5000))
    (repo / "index" / name()).write_bytes(random.randbytes(300))
    (repo / "keys" / "repokey").write_text("BORG_KEY " + name())
    (repo / "cache" / "checked-packs").write_bytes(random.randbytes(64))
    return repo


def _kopia_repository(where: Path, object_store: bool) -> Path:
    """A kopia repository as kopia lays it out (kopia is not packaged here): its format blob (JSON naming the
    tool), its blob config, content blobs; ``.f`` at the end of each name on a filesystem, none in a bucket."""
    repo = where / "repo"
    suffix = "" if object_store else ".f"
    fmt = {"tool": "https://github.com/kopia/kopia", "buildVersion": "0.17.0", "uniqueID": "eA==", "version": "1"}
    (repo / "p0a" / "1b2").mkdir(parents=True)
    (repo / f"kopia.repository{suffix}").write_text(json.dumps({**fmt, "keyAlgo": "scrypt-65536-8-1"}))
    (repo / f"kopia.blobcfg{suffix}").write_text("{}")
    (repo / "p0a" / "1b2" / f"p0a1b2{random.randbytes(14).hex()}{suffix}").write_bytes(random.randbytes(4000))
    (repo / f"xn0_{random.randbytes(16).hex()}{suffix}").write_bytes(random.randbytes(300))
    return repo


def _other_programs_json(where: Path) -> Path:
    """A folder of some other program whose settings file happens to be named config (JSON)."""
    (where / "repo").mkdir(parents=True)
    (where / "repo" / "config").write_text(json.dumps({"name": "my-app", "version": 3, "debug": False}))
    return where / "repo"


@pytest.mark.parametrize("backend_name", ["local", "s3-moto", "azure-azurite"])
@pytest.mark.parametrize("kind", ["borg", "borg2", "kopia", "json"])
def test_another_tools_repository_is_named_and_never_written_into(
    server, remote_cli, tmp_path: Path, backend_name: str, kind: str
):
    """restic's was named (above); borg's INI config read as "not valid JSON; is this a ckptvault repository?"
    (exit 30, init too), another program's JSON config as "holds a config that is not a ckptvault repository's"
    (exit 30, no way on), and a kopia repository, which holds no config, got "no vault; create one with: ckptvault
    init" while init made a vault beside it in a bucket. A borg 2 repository, whose config is a folder of objects,
    failed on a disk as "storage failed: GET config: IsADirectoryError" (exit 20; init: "a vault already exists"),
    and in a bucket its keys/ made it "a restic repository". Each is named (exit 10) and nothing is written into it."""
    object_store = backend_name != "local"
    made = {"borg": _borg_repository, "borg2": _borg2_repository, "json": _other_programs_json}
    repo = made[kind](tmp_path / kind) if kind in made else _kopia_repository(tmp_path / kind, object_store)
    if object_store:
        backend = server(backend_name).backend
        url = backend.new_url(kind)
        _upload(backend, repo, url)
    else:
        backend, url = None, str(repo)
    before = _listing(backend, url) if backend else sorted(str(p) for p in repo.rglob("*"))
    said = {
        "borg": "a borg repository",
        "borg2": "a borg 2 repository",
        "kopia": "a kopia repository",
        "json": "another program's file named config",
    }
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=0.1)
    for command in (["init", url], ["snapshots", "--repo", url], ["backup", str(src), "--repo", url]):
        proc = remote_cli(backend, *command, check=False, CKPTVAULT_RETRIES="0")
        line = one_line_error(proc)
        assert proc.returncode == 10, line
        assert f"{url} holds {said[kind]}" in line and "not a ckptvault vault" in line, line
        assert "damaged" not in line and "create one with" not in line, line
    after = _listing(backend, url) if backend else sorted(str(p) for p in repo.rglob("*"))
    assert after == before


@pytest.mark.parametrize("backend_name", ["sftp-openssh", "webdav-wsgidav"])
@pytest.mark.parametrize("under", [False, True])
def test_init_where_a_file_stands_in_the_path_says_so_at_once(server, remote_cli, backend_name: str, under: bool):
    """OpenSSH answers "No such file" to a folder made where a file is (and webdav4 "File exists" or 409):
    init was retried ~13 s, then said "the folder it goes into is missing (the vault moved, deleted, or its
    disk unmounted?)", or on WebDAV "a vault already exists". It names the file, at once, and writes nothing."""
    backend = server(backend_name).backend
    base = backend.new_url("file")
    fs, path = _fs(backend, base)
    fs.pipe_file(path, b"not a folder")
    url = f"{base}/vault" if under else base
    proc = remote_cli(backend, "init", url, check=False, CKPTVAULT_RETRIES="5", CKPTVAULT_RETRY_DELAY="2")
    line = one_line_error(proc)
    assert proc.returncode == 20 and f"{path} is a file, not a folder" in line, line
    assert "warning: storage failed" not in proc.stderr.decode(), proc.stderr.decode()
    assert fs.cat_file(path) == b"not a folder"


def test_init_in_a_folder_the_sftp_server_makes_none_in_says_so(server, remote_cli):
    """A folder the server will not make (procfs, as root: "No such file" again) is named, not retried."""
    running = server("sftp-openssh")
    user_host = running.backend.base_url.split("/")[2]
    url = f"sftp://{user_host}/proc/ckptvault-vault"
    proc = remote_cli(running.backend, "init", url, check=False, CKPTVAULT_RETRIES="5", CKPTVAULT_RETRY_DELAY="2")
    line = one_line_error(proc)
    assert proc.returncode == 20 and "the server makes no folder /proc/ckptvault-vault in /proc" in line, line
    assert "warning: storage failed" not in proc.stderr.decode(), proc.stderr.decode()


NO_SUCH_HOST = "no-such-host.invalid"  # RFC 2606: never resolves


def _with_unknown_host(backend: servers.Backend, port: int) -> tuple[servers.Backend, str]:
    """The backend and a vault URL whose host (in the URL, endpoint or connection string) DNS does not know."""
    url = backend.new_url("dns")
    swap = lambda text: text.replace(f"127.0.0.1:{port}", f"{NO_SUCH_HOST}:{port}")  # noqa: E731
    env = {k: swap(v) for k, v in backend.env.items()}
    options = [swap(o) for o in backend.cli_options]
    return dataclasses.replace(backend, env=env, cli_options=options), swap(url)


@pytest.mark.parametrize(
    "backend_name", ["s3-moto", "gcs-fake-gcs-server", "azure-azurite", "sftp-openssh", "webdav-wsgidav"]
)
def test_a_host_name_dns_does_not_know_fails_at_once_and_says_so(server, remote_cli, backend_name: str):
    """A typo in the host was taken for an outage: retried for CKPTVAULT_RETRY_FOR (init and snapshots took
    133 s on S3, GCS and Azure), or on WebDAV not retried at all, never saying the name does not resolve. Before
    anything answered it fails at once, by the default settings, naming DNS."""
    running = server(backend_name)
    backend, url = _with_unknown_host(running.backend, running.port)
    for command in (["init", url], ["snapshots", "--repo", url]):
        started = time.monotonic()
        proc = remote_cli(backend, *command, check=False, timeout=60)
        took = time.monotonic() - started
        line = one_line_error(proc)
        assert proc.returncode == 20 and "is not known to DNS" in line, line
        assert "warning: storage failed" not in proc.stderr.decode() and "attempts" not in line, proc.stderr.decode()
        assert took < 20, f"{command[0]} took {took:.1f} s"


@pytest.mark.parametrize(
    ("backend_name", "option", "said"),
    [
        ("gcs-fake-gcs-server", "anon=true", "gs:// takes no storage option 'anon' (did you mean token=anon?)"),
        ("gcs-fake-gcs-server", "credentials=/tmp/key.json", "gs:// takes no storage option 'credentials'"),
        ("s3-moto", "frobnicate=1", "s3:// takes no storage option 'frobnicate'"),
        ("s3-moto", "anon=maybe", "storage option anon must be true or false, not 'maybe'"),
        ("s3-moto", "use_ssl=no-thanks", "storage option use_ssl must be true or false"),
        ("azure-azurite", "anon=maybe", "storage option anon must be true or false, not 'maybe'"),
        ("sftp-openssh", "compress=maybe", "storage option compress must be true or false"),
    ],
)
def test_a_storage_option_the_backend_would_drop_or_misread_is_refused(
    server, remote_cli, backend_name: str, option: str, said: str
):
    """gcsfs drops a name it does not take (-o anon=true, S3's spelling, went on with the default credentials;
    so did -o credentials=...); s3fs hands one to its SDK session, which refused it inside the first call (exit
    20); a yes/no option given another word (-o anon=maybe) was a true one, as any non-empty text is. Each is
    refused before anything connects (exit 2)."""
    backend = server(backend_name).backend
    proc = remote_cli(backend, "snapshots", "--repo", backend.new_url("opt"), "-o", option, check=False)
    line = one_line_error(proc)
    assert proc.returncode == 2 and said in line, line


def test_a_ca_bundle_that_is_no_file_is_named_at_once(server, remote_cli, tmp_path: Path):
    """AWS_CA_BUNDLE (or -o client_kwargs.verify) naming no file failed every request inside botocore,
    "HTTPClientError: An HTTP Client raised an unhandled exception: [Errno 2] No such file or directory",
    which was retried as an outage for 2 minutes (127 s) and named neither the setting nor the file."""
    backend = server("s3-moto").backend
    url = backend.new_url("ca")
    missing = str(tmp_path / "no-such-ca.pem")
    for extra, env, named in (
        ([], {"AWS_CA_BUNDLE": missing}, "AWS_CA_BUNDLE"),
        (["-o", f"client_kwargs.verify={missing}"], {}, "client_kwargs.verify"),
    ):
        started = time.monotonic()
        proc = remote_cli(backend, "snapshots", "--repo", url, *extra, check=False, timeout=60, **env)
        line = one_line_error(proc)
        assert proc.returncode == 2 and f"{named}={missing}: no such file" in line, line
        assert time.monotonic() - started < 20 and "warning" not in proc.stderr.decode(), proc.stderr.decode()


def _bad_settings(backend_name: str, port: int) -> list[tuple[list[str], dict[str, str], str]]:
    """(options, environment, the setting the refusal names): an S3 endpoint botocore cannot use, an Azure
    account key that is not base64 (in each place adlfs reads one)."""
    if backend_name == "s3-moto":
        return [
            (["-o", "endpoint_url="], {}, "storage option endpoint_url is empty"),
            (["-o", f"endpoint_url=127.0.0.1:{port}"], {}, "endpoint_url '127.0.0.1:" + f"{port}' is not a URL"),
        ]
    bad = servers.azurite_connection_string(port, key="not-base64!")
    account = {"AZURE_STORAGE_ACCOUNT_NAME": servers.AZURITE_ACCOUNT, "AZURE_STORAGE_CONNECTION_STRING": ""}
    return [
        (["-o", f"connection_string={bad}"], {}, "the AccountKey in -o connection_string is not base64"),
        ([], {"AZURE_STORAGE_CONNECTION_STRING": bad}, "AccountKey in AZURE_STORAGE_CONNECTION_STRING is not base64"),
        (["-o", "account_key=abc"], account, "-o account_key is not base64"),
        ([], {**account, "AZURE_STORAGE_ACCOUNT_KEY": "abc%%"}, "AZURE_STORAGE_ACCOUNT_KEY is not base64"),
    ]


@pytest.mark.parametrize("backend_name", ["s3-moto", "azure-azurite"])
def test_an_endpoint_or_account_key_the_sdk_cannot_use_is_named_at_once(server, remote_cli, backend_name: str):
    """-o endpoint_url= left empty (or a host without http://) failed inside botocore as "storage failed: GET
    config on s3://...: ValueError: Invalid endpoint: "; an Azure account key that is not base64 as
    "AzureSigningError: Invalid base64-encoded string": exit 20, naming no setting. Each is named, exit 2,
    before anything connects, and init writes nothing."""
    running = server(backend_name)
    url = running.backend.new_url("setting")
    for options, env, named in _bad_settings(backend_name, running.port):
        backend = dataclasses.replace(running.backend, cli_options=[])
        for command in (["init", url, *options], ["snapshots", "--repo", url, *options]):
            started = time.monotonic()
            proc = remote_cli(backend, *command, check=False, timeout=60, CKPTVAULT_RETRIES="3", **env)
            line = one_line_error(proc)
            assert proc.returncode == 2 and named in line, line
            assert "not-base64" not in line and "abc%%" not in line, line  # a key, even a wrong one, is not shown
            assert time.monotonic() - started < 20 and "warning" not in proc.stderr.decode(), proc.stderr.decode()
    assert _listing(running.backend, url) == []


@pytest.mark.parametrize("content", [None, "not json\n", '{"type": "service_account"}\n'])
def test_google_application_credentials_that_cannot_be_used_are_named(server, remote_cli, tmp_path: Path, content):
    """gcsfs tries the environment's credentials, then others, and falls back to anonymous access without a
    word: a GOOGLE_APPLICATION_CREDENTIALS naming a missing file, or one that is no key, went on anonymously
    (against GCS: "access denied", naming no variable; against the emulator it worked). It is named at once."""
    backend = server("gcs-fake-gcs-server").backend
    endpoint = backend.storage_options["endpoint_url"]
    key = tmp_path / "key.json"
    if content is not None:
        key.write_text(content)
    url = backend.new_url("gac")
    proc = remote_cli(
        None, "init", url, "-o", f"endpoint_url={endpoint}", check=False, GOOGLE_APPLICATION_CREDENTIALS=str(key)
    )
    line = one_line_error(proc)
    assert proc.returncode == 2 and f"GOOGLE_APPLICATION_CREDENTIALS={key}" in line, line
    fs, path = _fs(backend, url)
    assert not fs.exists(f"{path}/config")


@pytest.fixture
def dav_with_a_user(tmp_path: Path) -> Iterator[str]:
    """A WsgiDAV server that lets in user alice with password s3cret-pw (HTTP basic); yields its base URL."""
    pytest.importorskip("wsgidav", reason="BACKEND NOT TESTED: webdav-wsgidav: wsgidav is not installed")
    root = tmp_path / "dav"
    (root / servers.BUCKET).mkdir(parents=True)
    port = servers.free_port()
    config = tmp_path / "wsgidav.json"
    users = {"*": {"alice": {"password": "s3cret-pw"}}}
    auth = {"domain_controller": None, "accept_basic": True, "accept_digest": False, "default_to_digest": False}
    settings = {"host": "127.0.0.1", "port": port, "provider_mapping": {"/": str(root)}, "verbose": 0}
    config.write_text(json.dumps({**settings, "http_authenticator": auth, "simple_dc": {"user_mapping": users}}))
    log = tmp_path / "wsgidav.log"
    proc = servers.spawn([sys.executable, "-m", "wsgidav.server.server_cli", "-c", str(config)], log)
    try:
        servers.wait_until(lambda: servers.port_open(port), proc, log, "wsgidav")
        yield f"http://127.0.0.1:{port}"
    finally:
        servers.stop_process(proc)


def test_webdav_credentials_given_as_options_work_and_a_wrong_password_is_never_shown(
    dav_with_a_user, remote_cli, tmp_path: Path
):
    """-o 'auth=["user","password"]' (the only -o way to webdav4's credentials) reached httpx as a list, which it
    refused: every command failed with "a storage option has a value of the wrong kind (Invalid "auth" argument:
    ['alice', 's3cret-pw'])", the password on the screen. The pair works, and a wrong one is access denied,
    hidden."""
    url = f"webdav://{servers.BUCKET}/vault"
    src = make_checkpoint(tmp_path / "ckpt", step=1, mb=0.1)
    base = ["-o", f"base_url={dav_with_a_user}"]
    right = [*base, "-o", 'auth=["alice","s3cret-pw"]']
    remote_cli(None, "init", url, *right)
    remote_cli(None, "backup", str(src), "--repo", url, *right, "-q")
    remote_cli(None, "restore", "latest", str(tmp_path / "out"), "--repo", url, *right, "-q")
    assert (tmp_path / "out" / "trainer_state.json").read_bytes() == (src / "trainer_state.json").read_bytes()
    wrong = [*base, "-o", 'auth=["alice","not-the-pw"]']
    proc = remote_cli(None, "snapshots", "--repo", url, *wrong, check=False, CKPTVAULT_RETRIES="0")
    line = one_line_error(proc)
    assert proc.returncode == 20 and "access denied" in line, line
    assert "not-the-pw" not in proc.stderr.decode()


def _odd_spellings(base: str, name: str) -> list[str]:
    """The vault ``{base}/{name}`` with a doubled '/', a '.' and a '..' in its path."""
    return [f"{base}//{name}", f"{base}/./{name}", f"{base}/other/../{name}", f"{base}/{name}/."]


def _odd_path_outcome(backend_name: str, odd: str) -> str:
    """What ``snapshots`` says of an odd spelling of a vault's URL: "refused" (no vault can be at such a path
    there: exit 2), or "no vault" (exit 10, naming the URL meant)."""
    doubled = "//" in odd.partition("://")[2]
    if backend_name.startswith("s3-") or (backend_name.startswith("azure") and not doubled):
        return "refused"
    return "no vault"


@pytest.mark.parametrize("backend_name", ["s3-moto", "s3-seaweedfs", "gcs-fake-gcs-server", "azure-azurite"])
def test_a_doubled_slash_or_dot_in_an_object_store_path_names_the_vault_meant(
    server, remote_cli, tmp_path: Path, backend_name: str
):
    """S3, GCS and Azure keep a path's '//', '.' and '..' in the objects' names: ``snapshots --repo
    s3://bucket//vault`` said "no vault ...; create one with: ckptvault init s3://bucket//vault", and that init made
    a second, empty vault beside s3://bucket/vault, whose backups then listed "no snapshots" (s3fs lists such a
    path as if its '//' were not there); on SeaweedFS, whose filer resolves '//', it was the vault, listing "no
    snapshots", and a '.' failed "Invalid Request"; Azure answered a '.' with "access denied"; s3:///bucket/vault
    found the vault's config but listed "no snapshots" (gcsfs too). Now no vault is made at such a path (exit 2),
    one is refused at once where no vault can be (S3; a '.' on Azure: exit 2), "no vault" elsewhere names the URL
    meant (exit 10), and s3:///bucket/vault is the vault, as a trailing '/' is."""
    backend = server(backend_name).backend
    url = backend.new_url("slash")
    base, name = url.rsplit("/", 1)
    remote_cli(backend, "init", url)
    remote_cli(backend, "backup", str(make_checkpoint(tmp_path / "ckpt", step=1, mb=0.1)), "--repo", url)
    before = _listing(backend, backend.base_url)
    for odd in _odd_spellings(base, name):
        for command in (["snapshots", "--json", "--repo", odd], ["init", odd]):
            proc = remote_cli(backend, *command, check=False, CKPTVAULT_RETRIES="0")
            outcome = "refused" if command[0] == "init" else _odd_path_outcome(backend_name, odd)
            line = one_line_error(proc)
            assert proc.returncode == (10 if outcome == "no vault" else 2), line
            said = f"so it is not {url}: write {url}" if outcome == "no vault" else f": write {url}"
            assert line.endswith(said), line
    assert _listing(backend, backend.base_url) == before  # no second vault, nor anything else
    scheme, _, path = url.partition("://")
    for same in (f"{scheme}:///{path}", f"{url}/", f"{url}//"):
        proc = remote_cli(backend, "snapshots", "--json", "--repo", same)
        assert len(json.loads(proc.stdout)) == 1, (same, proc.stdout)


@pytest.mark.parametrize("backend_name", ["gcs-fake-gcs-server", "azure-azurite"])
def test_a_vault_made_at_a_doubled_slash_before_still_opens(server, remote_cli, tmp_path: Path, backend_name: str):
    """A vault an earlier version made at gs://bucket//vault (``gs://bucket/$PREFIX/vault`` with an empty PREFIX,
    the same in every job) is where its objects are, which GCS and Azure list as written: it still opens there,
    for reading and for backups."""
    backend = server(backend_name).backend
    made = backend.new_url("made")
    remote_cli(backend, "init", made)
    remote_cli(backend, "backup", str(make_checkpoint(tmp_path / "ckpt1", step=1, mb=0.1)), "--repo", made)
    base, name = made.rsplit("/", 1)
    old = f"{base}//{name}"
    fs, path = _fs(backend, made)
    _, old_path = _fs(backend, old)
    for key in fs.find(path):
        fs.pipe_file(old_path + key[len(path) :], fs.cat_file(key))
    remote_cli(backend, "backup", str(make_checkpoint(tmp_path / "ckpt2", step=2, mb=0.1)), "--repo", old)
    assert len(json.loads(remote_cli(backend, "snapshots", "--json", "--repo", old).stdout)) == 2
    assert len(json.loads(remote_cli(backend, "snapshots", "--json", "--repo", made).stdout)) == 1
