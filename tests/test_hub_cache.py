"""Models in the local Hugging Face hub cache (fusec.hubcache, fusec.modelfiles): a hub id
(``org/name``) resolves through the cache (HF_HUB_CACHE, HF_HOME), never the network; a snapshot
directory, made of links into its repository's ``blobs/``, is read; a link that leads outside the
repository's cache directory stays refused, in a checkpoint as for a GGUF file, and a linked GGUF
file outside any hub cache is refused as a model directory's links are.

The hub layouts are built in a temporary directory with the cache's own structure."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_hf_dir_hostile import pristine  # noqa: E402, F401 (a fixture)

import fusec  # noqa: E402
from fusec.cli import main  # noqa: E402
from fusec.errors import ModelError  # noqa: E402

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def checkpoint(pristine: Path) -> Path:  # noqa: F811
    """test_hf_dir_hostile's tiny Llama checkpoint (plain files)."""
    return pristine


def hub_copy(src_files: list[Path], hub: Path, org: str = "acme", name: str = "tiny-llama", rev: str = REV,
             refs: bool = True) -> Path:
    """The files as ``huggingface_hub`` caches them: contents in blobs/<sha256>, the snapshot made of
    relative links to them, refs/main naming the revision. Returns the snapshot directory."""
    repo = hub / f"models--{org}--{name}"
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    if refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    for f in src_files:
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(f"../../blobs/{digest}")
    return snap


@pytest.fixture
def hub(tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "hf" / "hub"
    hub_copy(sorted(checkpoint.iterdir()), root)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.delenv("HF_HOME", raising=False)
    return root


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)


def _ids(model: object) -> list[list[int]]:
    return fusec.generate(model, [[1, 2, 3]], max_new_tokens=4).new_ids


def test_a_snapshot_made_of_links_generates_as_its_plain_copy(hub: Path, checkpoint: Path, cpu: None) -> None:
    snap = hub / "models--acme--tiny-llama" / "snapshots" / REV
    assert all(p.is_symlink() for p in snap.iterdir())
    assert _ids(snap) == _ids(checkpoint)


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_resolves_through_the_local_cache(hub: Path, checkpoint: Path, cpu: None, env: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if env == "HF_HOME":
        monkeypatch.delenv("HF_HUB_CACHE")
        monkeypatch.setenv("HF_HOME", str(hub.parent))  # HF_HOME/hub
    assert _ids("acme/tiny-llama") == _ids(checkpoint)


def test_the_cli_generates_from_a_hub_id(hub: Path, cpu: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "acme/tiny-llama", "--prompt", "hi", "--max-new-tokens", "3", "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["new_ids"][0]) == 3 and isinstance(res["text"][0], str)


def test_a_hub_id_without_refs_uses_its_only_snapshot(tmp_path: Path, checkpoint: Path, cpu: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    hub_copy(sorted(checkpoint.iterdir()), tmp_path / "hub", refs=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert _ids("acme/tiny-llama") == _ids(checkpoint)


def test_a_hub_id_not_in_the_cache_is_one_line_never_a_download(hub: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "acme/not-there", "--prompt-ids", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert "Hugging Face cache" in err[0] and str(hub) in err[0] and "never downloads" in err[0]


@pytest.mark.parametrize("name, target", [
    ("tokenizer.json", "../../../../outside.json"),  # above the repository's directory
    ("tokenizer.json", "../../../models--other--repo/blobs/x"),  # another repository of the same cache
    ("model.safetensors", "ABSOLUTE"),  # an absolute link outside
    ("config.json", "/dev/zero"),
])
def test_a_link_leading_outside_the_repository_stays_refused(hub: Path, checkpoint: Path, name: str, target: str,
                                                             cpu: None) -> None:
    snap = hub / "models--acme--tiny-llama" / "snapshots" / REV
    outside = hub.parent / "outside.json"
    shutil.copyfile(checkpoint / name, outside)
    other = hub / "models--other--repo" / "blobs"
    other.mkdir(parents=True)
    shutil.copyfile(checkpoint / name, other / "x")
    (snap / name).unlink()
    (snap / name).symlink_to(str(outside) if target == "ABSOLUTE" else target)
    with pytest.raises(ModelError) as e:
        _ids(snap)
    assert "leading outside its Hugging Face cache repository 'models--acme--tiny-llama'" in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_links_inside_the_repository_are_followed_hop_by_hop(hub: Path, checkpoint: Path, cpu: None) -> None:
    repo = hub / "models--acme--tiny-llama"
    snap = repo / "snapshots" / REV
    link = os.readlink(snap / "config.json")
    (repo / "blobs" / "alias").symlink_to(os.path.basename(link))  # a link to a link, inside the repository
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(str((repo / "blobs" / "alias").absolute()))  # absolute, inside
    assert _ids(snap) == _ids(checkpoint)


# ---- GGUF files ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    from test_gguf import write_gguf

    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_gguf_file_in_a_hub_snapshot_loads_and_a_link_elsewhere_is_refused(tmp_path: Path, tiny_gguf: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from fusec.models.gguf import load_gguf

    want = load_gguf(tiny_gguf).config
    snap = hub_copy([tiny_gguf], tmp_path / "hub", org="acme", name="tiny-GGUF")
    assert load_gguf(snap / "tiny.gguf").config == want
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from fusec.genmodel import load_generation_model

    assert load_generation_model("acme/tiny-GGUF").config == want  # the snapshot's one .gguf file

    (tmp_path / "linked.gguf").symlink_to(tiny_gguf)  # a link outside any hub cache: as in a model directory
    with pytest.raises(ModelError, match="symbolic link"):
        load_gguf(tmp_path / "linked.gguf")
    (snap / "escape.gguf").symlink_to("../../../../linked.gguf")
    with pytest.raises(ModelError, match="leading outside its Hugging Face cache repository"):
        load_gguf(snap / "escape.gguf")
