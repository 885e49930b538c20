"""Hub repository ids where a model folder goes (`titan.ckpt.hub`): which paths are ids, the
snapshot folder huggingface_hub's cache gives for one (offline, from a cache laid out as it
writes them), and one-line errors naming the flag for what the Hub refuses."""

from pathlib import Path

import pytest
from titan.ckpt.hub import MODEL_FILES, TOKENIZER_FILES, is_hub_repo_id, resolve_hub_folder

huggingface_hub = pytest.importorskip("huggingface_hub")
hub_constants = pytest.importorskip("huggingface_hub.constants")
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache that huggingface_hub reads offline (no machine's network or cache)."""
    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def cached_repo(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """`repo_id` in `cache` as huggingface_hub lays a download out; returns its snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_which_paths_are_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local" / "model").mkdir(parents=True)
    assert all(is_hub_repo_id(p) for p in ("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B", "HuggingFaceTB/SmolLM2-135M"))
    assert not any(is_hub_repo_id(p) for p in (
        "local/model",  # a folder that exists is read as it is
        "./org/name", "/abs/org/name", "org/name/extra", "org", "org/model.safetensors", "org/tokenizer.json",
        "../name", "org/..", "-org/name",
    ))


def test_a_cached_repository_resolves_to_its_snapshot_offline(offline_cache, tmp_path):
    snapshot = cached_repo(offline_cache, "tiny-org/tiny", {"config.json": "{}", "tokenizer.json": "{}"})
    assert resolve_hub_folder("tiny-org/tiny", flag="--checkpoint.initial_load_path") == str(snapshot)
    assert resolve_hub_folder("tiny-org/tiny", flag="--tokenizer.path", patterns=TOKENIZER_FILES) == str(snapshot)
    local = tmp_path / "folder"
    local.mkdir()
    assert resolve_hub_folder(str(local), flag="--tokenizer.path") == str(local)  # never looked up


def test_a_revision_reads_its_own_snapshot(offline_cache, tmp_path):
    """A tag (or a commit) picks its snapshot, as transformers' `revision` does; main stays the
    default; a revision for a local path is refused rather than ignored."""
    main_snapshot = cached_repo(offline_cache, "tiny-org/tiny", {"config.json": '{"v": 2}'})
    repo = offline_cache / "models--tiny-org--tiny"
    tagged = "fedcba9876543210fedcba9876543210fedcba98"
    (repo / "snapshots" / tagged).mkdir()
    (repo / "snapshots" / tagged / "config.json").write_text('{"v": 1}')
    (repo / "refs" / "v1").write_text(tagged)
    flag = "--checkpoint.initial_load_path"
    assert resolve_hub_folder("tiny-org/tiny", flag=flag) == str(main_snapshot)
    for revision in ("v1", tagged):
        assert resolve_hub_folder("tiny-org/tiny", flag=flag, revision=revision) == str(repo / "snapshots" / tagged)
    with pytest.raises(ValueError, match="--tokenizer.revision 'v1' picks a revision of a Hub repository, and "
                                         "--tokenizer.path .* is a local path"):
        resolve_hub_folder(str(tmp_path), flag="--tokenizer.path", revision="v1", revision_flag="--tokenizer.revision")


def test_nothing_cached_offline_is_one_line_naming_the_flag(offline_cache):
    with pytest.raises(ValueError, match=r"--tokenizer.path 'tiny-org/absent' is no local folder, so it is read "
                                         r"from the Hugging Face Hub, which could not be reached .* download it "
                                         r"beforehand \(`hf download tiny-org/absent`\)"):
        resolve_hub_folder("tiny-org/absent", flag="--tokenizer.path")


@pytest.mark.parametrize("status, error, message", [
    (404, "RepositoryNotFoundError", "is no local folder, nor a model repository the Hugging Face Hub serves"),
    (403, "GatedRepoError", "is a gated Hub repository: accept its terms on the Hub and log in"),
])
def test_what_the_hub_refuses_is_one_line_naming_the_flag(monkeypatch, status, error, message):
    import httpx
    from huggingface_hub import errors as hub_errors

    calls = []

    def refuse(repo_id, **kwargs):  # what huggingface_hub raises for a missing or gated repository
        calls.append(kwargs)
        response = httpx.Response(status, request=httpx.Request("GET", f"https://huggingface.co/api/models/{repo_id}"))
        raise getattr(hub_errors, error)(f"{status} Client Error for {repo_id}", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ValueError, match=f"--checkpoint.initial_load_path 'org/name' {message}"):
        resolve_hub_folder("org/name", flag="--checkpoint.initial_load_path")
    # Only the files titan reads are asked for: no *.bin or original/*.pth copies of the weights.
    assert calls == [{"allow_patterns": list(MODEL_FILES), "revision": None}]
