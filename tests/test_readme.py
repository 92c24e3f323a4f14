"""The README's and docs/' code runs as written: every ``annot`` command they
show exits 0 from the repository root, and every Python block that names its
own run line (``# torchrun --nproc-per-node N FILE``) runs that way from a
fresh directory. Every relative link in them points at a file."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from annot.cli.main import main
from annot.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = "\n".join(p.read_text() for p in PAGES)


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def _commands() -> list[str]:
    return [c for c in re.findall(r"`(annot [^`]+)`", README) if len(shlex.split(c)) > 2]


def _programs() -> list[tuple[int, str, str]]:
    out = []
    for block in _blocks("python"):
        m = re.match(r"# torchrun --nproc-per-node (\d+) (\S+\.py)\n", block)
        if m:
            out.append((int(m.group(1)), m.group(2), block))
    return out


def test_the_readme_shows_commands_and_programs():
    assert len(_commands()) >= 2
    assert len(_programs()) >= 2
    names = [p[1] for p in _programs()]
    assert len(names) == len(set(names)), "two programs share a file name"


def test_the_readme_is_a_quick_start_and_its_links_resolve():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


@pytest.mark.parametrize("command", _commands())
def test_annot_command_runs_as_written(command, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("ANNOT_CACHE_DIR", str(tmp_path))
    rc = main(shlex.split(command)[1:])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out


@pytest.mark.slow
@pytest.mark.parametrize("nproc, name, source", _programs(), ids=[p[1] for p in _programs()])
def test_python_program_runs_as_written(nproc, name, source, tmp_path):
    (tmp_path / name).write_text(source)
    env = {
        **os.environ,
        "ANNOT_CACHE_DIR": str(tmp_path / "cache"),
        "ANNOT_BACKEND": "gloo",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PET_MASTER_PORT": str(free_port()),  # torchrun's --master-port, so runs can overlap
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), name]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
