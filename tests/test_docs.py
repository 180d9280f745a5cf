"""The docs cannot rot: every command in a ```bash block of README.md and docs/ runs here against the built-in
examples (each page's commands in order, in one fresh directory, with the exit code a trailing ``# exit N`` names,
0 otherwise); the commands that need Megatron-LM or a GPU cluster are checked as far as they can be without it (the
hook's flags parse, the patch exists and applies where a Megatron-LM tree is given); every relative link resolves;
the README stays a one-page read."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron_preflight.hook.flags import add_preflight_arguments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(REPO, "README.md"), *glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)])
_EXIT = re.compile(r"\s+#\s*exit\s+(\d+)\s*$")


def rel(page: str) -> str:
    return os.path.relpath(page, REPO)


def commands(page: str) -> list[str]:
    """The command lines of a page's ```bash blocks (continuations joined, comment lines dropped)."""
    out, block, pending = [], False, ""
    for line in open(page, encoding="utf-8").read().splitlines():
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        line = pending + line.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line and not line.startswith("#"):
            out.append(line)
    return out


def test_the_readme_is_a_one_page_read():
    assert os.path.getsize(os.path.join(REPO, "README.md")) <= 12 * 1024


def _anchors(page: str) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", open(page, encoding="utf-8").read(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    text = open(page, encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(full), f"{rel(page)}: link to {target}: no such file"
        if anchor and full.endswith(".md"):
            assert anchor in _anchors(full), f"{rel(page)}: link to {target}: no such heading"


def _hook_flags(line: str) -> None:
    """A launcher line: the script is one of Megatron-LM's and every --preflight flag parses as the hook adds it."""
    words = [w for w in shlex.split(line) if not w.startswith("<")]
    assert "megatron_preflight.run" in words, line
    script = words[words.index("megatron_preflight.run") + 1]
    assert script in ("pretrain_gpt.py", "pretrain_hybrid.py", "pretrain_mamba.py"), line
    flags = [w for i, w in enumerate(words) if w.startswith("--preflight")
             or (i and words[i - 1].startswith("--preflight") and not w.startswith("--"))]
    add_preflight_arguments(argparse.ArgumentParser()).parse_args(flags)


def _patch(line: str) -> None:
    """A patch line: the patch is in the repo; where a Megatron-LM tree is given, it applies there."""
    words = shlex.split(line)
    patch = next(w for w in words if w.endswith(".patch"))
    path = os.path.join(REPO, "patches", os.path.basename(patch))
    assert os.path.isfile(path), line
    root = os.environ.get("MEGATRON_LM_ROOT")
    if root and os.path.isdir(os.path.join(root, ".git")) or (root and os.path.exists(os.path.join(root, ".git"))):
        r = subprocess.run(["git", "-C", root, "apply", "--check", path], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _script(line: str) -> None:
    """A set-up script (it sets up a venv: CI runs test.sh itself, and test_the_demo_runs the demo's job)."""
    path = os.path.join(REPO, shlex.split(line)[0])
    assert os.path.isfile(path) and os.access(path, os.X_OK), line


def _run(line: str, cwd: str, expected: int) -> None:
    args = shlex.split(line)[1:]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    said = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == expected, f"`{line}` exited {r.returncode}, the docs say {expected}:\n{said}"
    assert "Traceback" not in r.stderr, said


@pytest.mark.parametrize("page", [p for p in PAGES if commands(p)], ids=rel)
def test_every_command_of_a_page_runs(page, tmp_path):
    for name in ("tests", "patches", "examples"):  # the built-in examples, under the paths the docs use
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    for line in commands(page):
        m = _EXIT.search(line)
        expected = int(m.group(1)) if m else 0
        line = line[:m.start()] if m else re.sub(r"\s+#.*$", "", line)
        first = shlex.split(line)[0]
        if first == "megatron-preflight":
            _run(line, str(tmp_path), expected)
        elif first == "torchrun" and " -m megatron_preflight reshard " in f" {line} ":
            _run("megatron-preflight " + line.split(" -m megatron_preflight ", 1)[1], str(tmp_path), expected)
        elif first == "torchrun":
            _hook_flags(line)
        elif first == "git" and " apply " in line:
            _patch(line)
        elif first.startswith("./scripts/"):
            _script(line)
        else:
            pytest.fail(f"{rel(page)}: `{line}` is a command this test cannot run: show it in a ```text block, or "
                        "teach tests/test_docs.py to check it")


def test_the_demo_runs():
    """The README's main job (`./scripts/demo.sh` = set-up + examples/demo.py): every step as expected."""
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "demo.py")], capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0 and "demo finished: OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "$ megatron-preflight reshard" in r.stdout  # every step ran (none skipped)
