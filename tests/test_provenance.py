"""What a run records of the code it ran (job/provenance.py, `software.jsonl`): the git checkout
that tracks the package, its uncommitted changes whatever their bytes, and why not where git
cannot say; never a reason for a run not to start."""

import subprocess

from hpcvla.job import provenance


def _repo(folder, files: dict):
    """A git checkout in `folder` with `files` (name: bytes) committed."""
    def git(*args):
        subprocess.run(["git", "-C", folder, "-c", "user.name=t", "-c", "user.email=t@t",
                        *args], check=True, capture_output=True)
    folder.mkdir(parents=True)
    git("init", "-q")
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    git("add", ".")
    git("commit", "-q", "-m", "x")
    return subprocess.run(["git", "-C", folder, "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_checkouts_commit_and_changes_are_recorded_whatever_their_bytes(tmp_path):
    """The package's own checkout: its commit; a tracked file changed in Latin-1 (no UTF-8)
    is listed and its diff hashed, not a UnicodeDecodeError that stopped every start; a new
    module of the package's that git does not track yet is named."""
    package = tmp_path / "repo" / "src" / "pkg"
    head = _repo(tmp_path / "repo", {"src/pkg/__init__.py": b"x = 1\n",
                                     "notes.txt": b"caf\xe9\n"})
    assert provenance._git(package) == {"commit": head, "changed": [], "diff_sha256": None,
                                        "untracked": []}
    (tmp_path / "repo" / "notes.txt").write_bytes(b"caf\xe9 cr\xe8me\n")
    (package / "new_module.py").write_text("y = 2\n")  # imported, never added
    (tmp_path / "repo" / "elsewhere.txt").write_text("not the package's\n")
    found = provenance._git(package)
    assert found["commit"] == head and found["changed"] == ["notes.txt"]
    assert found["untracked"] == ["new_module.py"]
    assert len(found["diff_sha256"]) == 64 and "git_error" not in found


def test_a_package_no_checkout_tracks_records_why_not_the_enclosing_ones_commit(tmp_path):
    """A package installed into a folder inside some other checkout (a venv inside the
    repository, a home kept in git) is not that checkout's code: no commit, git's reason;
    and a folder in no checkout at all says so too."""
    _repo(tmp_path / "home", {"dotfile": b"x\n"})
    installed = tmp_path / "home" / ".venv" / "site-packages" / "pkg"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("x = 1\n")
    found = provenance._git(installed)
    assert found["commit"] is None and "did not match any file(s) known to git" in \
        found["git_error"], found
    alone = tmp_path / "alone"
    alone.mkdir()
    assert "not a git repository" in provenance._git(alone)["git_error"]


def test_a_resume_says_no_package_changed_that_only_changed_its_spelling(tmp_path):
    """A run started by a release of hpcvla that recorded `mani_skill` and resumed by one that
    asks for `mani-skill` (one distribution, PEP 503) lists no change of it."""
    import json
    now = provenance.software()
    assert "mani-skill" in now["packages"]
    old = {**now, "packages": {("mani_skill" if name == "mani-skill" else name): version
                               for name, version in now["packages"].items()}}
    (tmp_path / provenance.SOFTWARE).write_text(json.dumps(old) + "\n")
    assert not [line for line in provenance.record_start(tmp_path) if "mani" in line]
