"""Models by their hub id (``owner/name``) from a local Hugging Face cache: the same embeddings
as the folder itself, revisions (refs, commit hashes), the layout huggingface_hub itself reads,
and a missing model or revision named with the cache path, offline and through the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from factories.encoders import make_encoder
from factories.hub_cache import cache_model
from factories.st_folders import save_sentence_transformer
from factories.texts import PROSE

from cenote import LLM
from cenote.engine_args import EngineArgs
from cenote.models.formats.hub_cache import hub_cache_dir, is_hub_id

HUB_ID = "BAAI/bge-tiny-en"  # main: model A; v2 (and its commit hash): model B
COMMIT_A, COMMIT_B = "a" * 40, "0123456789abcdef0123456789abcdef01234567"
TEXTS = PROSE[:4]
OPTIONS = dict(dtype="float32", num_threads=2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Two sentence-transformers folders (modules.json, 1_Pooling, 2_Normalize) on different
    tiny random BERTs and poolings."""
    root = tmp_path_factory.mktemp("folders")
    make_encoder(root / "raw_a", "bert", seed=0)
    make_encoder(root / "raw_b", "bert", seed=1)
    return {
        "a": save_sentence_transformer(root / "raw_a", root / "st_a", pooling="mean"),
        "b": save_sentence_transformer(root / "raw_b", root / "st_b", pooling="cls"),
    }


@pytest.fixture(scope="module")
def hub_cache(folders, tmp_path_factory):
    """A cache holding ``HUB_ID`` at main (A) and v2 (B), found through ``HF_HUB_CACHE``."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    cache_model(cache, HUB_ID, folders["a"], COMMIT_A)
    cache_model(cache, HUB_ID, folders["b"], COMMIT_B, revisions=("v2",))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def expected(folders) -> dict[str, np.ndarray]:
    """Each folder's embeddings of ``TEXTS``, loaded from its plain path."""
    return {name: _embed(LLM(str(path), **OPTIONS)) for name, path in folders.items()}


def _embed(llm: LLM) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])


@pytest.mark.parametrize(
    ("revision", "folder"), [(None, "a"), ("main", "a"), ("v2", "b"), (COMMIT_B, "b")]
)
def test_a_hub_id_embeds_bit_identically_to_its_folder(hub_cache, expected, revision, folder):
    llm = LLM(HUB_ID, revision=revision, **OPTIONS)
    commit = COMMIT_A if folder == "a" else COMMIT_B
    assert llm.config.model.path == hub_cache / "models--BAAI--bge-tiny-en" / "snapshots" / commit
    assert llm.config.model.served_model_name == HUB_ID
    np.testing.assert_array_equal(_embed(llm), expected[folder])


def test_the_layout_is_the_one_huggingface_hub_reads(hub_cache, folders):
    """huggingface_hub's own cache readers find every file where cenote does."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    for revision, name in [("main", "a"), ("v2", "b"), (COMMIT_B, "b")]:
        snapshot = EngineArgs(HUB_ID, revision=revision).create_engine_config().model.path
        for file in ("config.json", "modules.json", "1_Pooling/config.json"):
            found = try_to_load_from_cache(HUB_ID, file, cache_dir=hub_cache, revision=revision)
            assert found == str(snapshot / file)
            assert Path(found).read_bytes() == (folders[name] / file).read_bytes()
    report = scan_cache_dir(hub_cache)
    assert not report.warnings
    (repo,) = report.repos
    assert repo.repo_id == HUB_ID and repo.repo_type == "model"
    assert set(repo.refs) == {"main", "v2"}
    assert {r.commit_hash for r in repo.revisions} == {COMMIT_A, COMMIT_B}


def test_the_cache_path_follows_huggingface_hubs_rule(tmp_path, monkeypatch):
    """``hub_cache_dir()`` equals huggingface_hub.constants.HF_HUB_CACHE under each setting."""
    names = ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"]
    settings = [
        {},
        {"XDG_CACHE_HOME": str(tmp_path / "xdg")},
        {"HF_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg")},
        {"HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy"), "HF_HOME": str(tmp_path / "home")},
        {"HF_HUB_CACHE": str(tmp_path / "hub"), "HUGGINGFACE_HUB_CACHE": str(tmp_path / "x")},
        {"HF_HOME": "~/hf"},
    ]
    reference = """
import importlib, json, os, sys
import huggingface_hub.constants as constants
for setting in json.loads(sys.argv[1]):
    for name in sys.argv[2:]:
        os.environ.pop(name, None)
    os.environ.update(setting)
    print(importlib.reload(constants).HF_HUB_CACHE)
"""
    done = subprocess.run(
        [sys.executable, "-c", reference, json.dumps(settings), *names],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    theirs = done.stdout.split()
    ours = []
    for setting in settings:
        for name in names:
            monkeypatch.delenv(name, raising=False)
        for name, value in setting.items():
            monkeypatch.setenv(name, value)
        ours.append(str(hub_cache_dir()))
    assert ours == theirs and len(set(ours)) == len(settings)  # each place, as theirs


def test_a_missing_model_or_revision_names_the_cache_path(hub_cache):
    with pytest.raises(FileNotFoundError) as missing:
        LLM("nobody/nothing", **OPTIONS)
    text = str(missing.value)
    assert (
        "nobody/nothing is no local path, and hub model 'nobody/nothing' (revision 'main')" in text
    )
    assert f"Hugging Face cache {hub_cache}: no {hub_cache / 'models--nobody--nothing'}" in text
    assert "cenote never downloads" in text and "`hf download nobody/nothing`" in text

    with pytest.raises(FileNotFoundError) as revision:
        EngineArgs(HUB_ID, revision="v9").create_engine_config()
    text = str(revision.value)
    repo = hub_cache / "models--BAAI--bge-tiny-en"
    assert f"(revision 'v9') is not in the Hugging Face cache {hub_cache}: " in text
    assert f": no {repo / 'refs' / 'v9'}; cached revisions: " in text
    assert f"refs ['main', 'v2'], snapshots ['{COMMIT_B}', '{COMMIT_A}']" in text
    assert f"`hf download {HUB_ID} --revision v9`" in text

    (repo / "refs" / "gone").write_text("f" * 40)  # a ref whose snapshot was deleted
    try:
        with pytest.raises(FileNotFoundError, match=f"names commit {'f' * 40}, but no {repo}/"):
            EngineArgs(HUB_ID, revision="gone").create_engine_config()
    finally:
        (repo / "refs" / "gone").unlink()
    with pytest.raises(FileNotFoundError, match=f"no {repo}/refs/{'e' * 40} nor {repo}/snap"):
        EngineArgs(HUB_ID, revision="e" * 40).create_engine_config()
    with pytest.raises(ValueError, match="revision must be a branch, tag or commit hash"):
        EngineArgs(HUB_ID, revision="../../main").create_engine_config()


def test_local_paths_stay_paths(folders):
    """An existing folder is never looked up; a revision with it (or with no model) is refused;
    a name that cannot be a hub id keeps the plain path error."""
    with pytest.raises(ValueError, match="revision 'v2' applies to hub ids; .* is a local path"):
        EngineArgs(str(folders["a"]), revision="v2").create_engine_config()
    with pytest.raises(ValueError, match="revision 'v2' needs a hub id; no model was given"):
        EngineArgs(revision="v2").create_engine_config()
    with pytest.raises(FileNotFoundError, match="is not a model folder"):
        EngineArgs("./nobody/nothing").create_engine_config()
    assert is_hub_id("intfloat/e5-small-v2") and is_hub_id("BAAI/bge-m3")
    for text in ("e5-small-v2", "./a/b", "a/b/c", "/a/b", "a--b/c", "a/..b", "a/b.", "-a/b"):
        assert not is_hub_id(text), text


def test_serve_exits_2_naming_the_cache_for_a_missing_id(hub_cache):
    from tests.server_fixture import free_port

    done = subprocess.run(
        [sys.executable, "-m", "cenote", "serve", "nobody/nothing", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"'nobody/nothing' (revision 'main') is not in the Hugging Face cache {hub_cache}" in (
        done.stderr
    )


def test_serve_a_hub_id_under_its_name(hub_cache, expected):
    from tests.server_fixture import ServerProcess

    server = ServerProcess(HUB_ID, "--revision", "v2", "--dtype", "float32", "--num-threads", "2")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            models = client.get("/v1/models").json()
            body = {"model": HUB_ID, "input": TEXTS}
            answer = client.post("/v1/embeddings", json=body)
    finally:
        server.stop()
    assert [m["id"] for m in models["data"]] == [HUB_ID]
    assert answer.status_code == 200, answer.text
    embeddings = np.array([d["embedding"] for d in answer.json()["data"]])
    np.testing.assert_allclose(embeddings, expected["b"], rtol=0, atol=1e-6)


def test_cenote_embed_reads_a_hub_id_at_a_revision(hub_cache, expected, tmp_path):
    from factories.corpus import read_output

    (tmp_path / "c.txt").write_text("".join(t + "\n" for t in TEXTS))
    done = subprocess.run(
        [sys.executable, "-m", "cenote", "embed", str(tmp_path / "c.txt"), "-o",
         str(tmp_path / "out"), "--model", HUB_ID, "--revision", COMMIT_B, "--dtype", "float32",
         "--num-threads", "2", "--no-progress"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(read_output(tmp_path / "out")[1], expected["b"], atol=1e-6)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["job"]["model"] == HUB_ID and manifest["job"]["revision"] == COMMIT_B
