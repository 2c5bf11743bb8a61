"""The shipped assets (mtp/assets: adapter, heads, drafter, datastore, evaluation hashes) are never an
output: every command that writes refuses an output path inside them (symlinks followed) in one line,
before any work, and the shipped files stay byte for byte as they were (issue 47, D2)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import mtp
from mtp.cli import main
from mtp.core.runtime import artifacts

ASSETS = Path(mtp.__file__).resolve().parent / "assets"  # where the package ships them, whoever computes it
SHIPPED = ASSETS / "smollm2-135m"


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root` (hidden ones too): a file's sha256, a folder's marker."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def shipped_unchanged():
    before = snapshot(ASSETS)
    yield
    assert snapshot(ASSETS) == before


def writers(target: Path, tmp: Path) -> dict[str, list[str]]:
    """One command line per output option of every command that writes, each aimed at `target`
    (the other options only need to parse: the refusal comes first)."""
    t, ex, cfg = str(target), str(tmp / "examples.jsonl"), tmp / "tune.json"
    cfg.write_text('{"data": "prompts:p.jsonl", "tolerance": 0.02, "out": "%s"}' % t)
    return {
        "train --out": ["train", "--examples", ex, "--out", t],
        "train --export": ["train", "--examples", ex, "--out", str(tmp / "run"), "--export", t],
        "train-heads --out": ["train-heads", "--examples", ex, "--out", t],
        "train-heads --cache-dir": ["train-heads", "--examples", ex, "--out", str(tmp / "h"), "--cache-dir", t],
        "train-eagle3 --out": ["train-eagle3", "--examples", ex, "--out", t],
        "train-eagle3 --cache-dir": ["train-eagle3", "--examples", ex, "--out", str(tmp / "d"), "--cache-dir", t],
        "data --out": ["data", "--prompts", ex, "--out", t],
        "data --card": ["data", "--card", "--out", t],
        "datastore --out": ["datastore", "build", "--data", ex, "--out", t],
        "export --out": ["export", "--format", "vllm-eagle3", "--drafter", "shipped", "--out", t],
        "bench --out": ["bench", "--data", "prompts:p.jsonl", "--out", t],
        "tune --out": ["tune", "--data", "prompts:p.jsonl", "--tolerance", "0.02", "--out", t],
        "tune --config": ["tune", "--config", str(cfg)],
        "serve --shadow-log": ["serve", "--shadow-log", str(Path(t) / "shadow.jsonl")],
    }


@pytest.mark.parametrize("target", [SHIPPED / "adapter", SHIPPED / "datastore", SHIPPED / "new", ASSETS])
def test_every_writer_refuses_the_shipped_assets(tmp_path, capsys, shipped_unchanged, target):
    for name, argv in writers(target, tmp_path).items():
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        assert err.startswith("mtp: error:") and err.count("\n") == 1, (name, err)
        assert "shipped assets" in err, (name, err)
    assert not (SHIPPED / "new").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "tune.json"]  # nothing else was made either


def test_a_link_into_the_assets_is_followed(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "pkg" / "assets"  # a stand-in assets root: this test would write if the guard failed
    (fake / "m" / "datastore").mkdir(parents=True)
    (fake / "m" / "datastore" / "config.json").write_text("{}")
    monkeypatch.setattr(artifacts, "ASSETS", fake, raising=False)
    (tmp_path / "link").symlink_to(fake / "m")
    (tmp_path / "examples.jsonl").write_text('{"prompt_ids": [1, 2], "response_ids": [3, 4]}\n')
    before = snapshot(fake)
    code = main(
        [
            "datastore",
            "build",
            "--data",
            str(tmp_path / "examples.jsonl"),
            "--model",
            "/nowhere",
            "--out",
            str(tmp_path / "link" / "datastore"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "shipped assets" in err and str(fake / "m" / "datastore") in err, err
    assert snapshot(fake) == before


def test_paths_beside_the_assets_are_not_refused(tmp_path):
    artifacts.check_not_shipped(tmp_path / "out", "--out")  # anywhere else: no error
    artifacts.check_not_shipped(ASSETS.parent, "--out")  # around the assets (e.g. `--out .` in a checkout)
    artifacts.check_not_shipped(ASSETS.parent / "assets-copy", "--out")
    with pytest.raises(artifacts.ArtifactError, match="--out .* inside mtp's shipped assets"):
        artifacts.check_not_shipped(ASSETS / "eval_prompts.json", "--out")
