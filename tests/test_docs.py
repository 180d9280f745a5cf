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
import shutil
import subprocess
import sys

import pytest

from megatron_preflight.cli.main import build_parser
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


def _run(line: str, cwd: str, expected: int, env_extra: dict | None = None) -> None:
    args = shlex.split(line)[1:]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    r = subprocess.run([sys.executable, "-m", "megatron_preflight", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    said = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == expected, f"`{line}` exited {r.returncode}, the docs say {expected}:\n{said}"
    assert "Traceback" not in r.stderr, said


@pytest.mark.parametrize("page", [p for p in PAGES if commands(p)], ids=rel)
def test_every_command_of_a_page_runs(page, tmp_path):
    for name in ("patches", "examples"):  # the built-in examples, under the paths the docs use
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    # the fixtures as real dirs of linked files: a command that writes beside a checkpoint (`fingerprint`) writes
    # into this copy, never into the repo's fixtures
    shutil.copytree(os.path.join(REPO, "tests"), tmp_path / "tests", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__", "hf"))
    # (Hugging Face model dirs as copies: a model dir's files are read only from inside it, layout/hf/files.py)
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "hf"), tmp_path / "tests" / "fixtures" / "hf")
    env = _object_storage(page)
    for line in commands(page):
        m = _EXIT.search(line)
        expected = int(m.group(1)) if m else 0
        line = line[:m.start()] if m else re.sub(r"\s+#.*$", "", line)
        first = shlex.split(line)[0]
        if first == "megatron-preflight":
            _run(line, str(tmp_path), expected, env)
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


def _object_storage(page: str) -> dict:
    """A page whose commands read ``msc://store/...``: a real S3-compatible server (tests/helpers/s3_server.py) with
    the built-in tp2_torch_dist under ``msc://store/gpt`` and nothing else under the prefixes the page writes; the
    MSC config naming it (profile ``store``)."""
    if not any("msc://" in line for line in commands(page)):
        return {}
    from tests.helpers import s3_server

    store = s3_server.for_tests()
    c = store.client()
    for o in c.list_objects_v2(Bucket=s3_server.BUCKET, Prefix="gpt_tp1/").get("Contents", []):  # the page writes it
        c.delete_object(Bucket=s3_server.BUCKET, Key=o["Key"])
    store.upload_dir(os.path.join(REPO, "tests", "fixtures", "megatron-lm", "tp2_torch_dist"), "gpt")
    return {"MSC_CONFIG": store.config("docs.yaml")}


def test_the_demo_runs():
    """The README's main job (`./scripts/demo.sh` = set-up + examples/demo.py): every step as expected."""
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "demo.py")], capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0 and "demo finished: OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "$ megatron-preflight reshard" in r.stdout  # every step ran (none skipped)


# Commands quoted inline in prose (`megatron-preflight reshard SRC DST ... --dry-run`, `python benchmarks/x.py --parts
# F`): they name placeholders or run for minutes, so they are checked, not run whole: the CLI's own parser knows the
# subcommand and every flag, a benchmark's parser takes its flags (`--help` runs the script's argument
# parsing), a benchmark without flags compiles, a script exists and is executable.
_INLINE = re.compile(r"`((?:megatron-preflight|python3? benchmarks/|torchrun |\./scripts/)[^`]*)`")


def inline_commands(page: str) -> list[str]:
    text = re.sub(r"```.*?```", "", open(page, encoding="utf-8").read(), flags=re.S)
    return _INLINE.findall(text)


def _words(line: str) -> list[str]:
    """The command's words without the optional brackets and the ``...`` that stand for the rest."""
    return [w for w in shlex.split(line.replace("[", " ").replace("]", " ")) if w not in ("...", "|")]


def _cli_parses(words: list[str]) -> None:
    """``megatron-preflight SUB ...``: SUB is a subcommand and every ``--flag`` is one of its flags (those after ``--``
    are the run's Megatron flags)."""
    words = words[:words.index("--")] if "--" in words else words
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert words[0] in sub.choices, f"no subcommand {words[0]!r}"
    known = {o for a in sub.choices[words[0]]._actions for o in a.option_strings}
    unknown = [w.split("=")[0] for w in words[1:] if w.startswith("--") and w.split("=")[0] not in known]
    assert not unknown, f"`megatron-preflight {words[0]}` has no flag {unknown}"


def _benchmark_parses(words: list[str]) -> None:
    script = os.path.join(REPO, words[0])
    assert os.path.isfile(script), f"no benchmark {words[0]}"
    flags = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
    source = open(script, encoding="utf-8").read()
    if "argparse" not in source:
        assert not flags, f"{words[0]} takes no flags, the docs give {flags}"
        compile(source, script, "exec")
        return
    r = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-2000:]
    missing = [f for f in flags if f not in r.stdout]
    assert not missing, f"{words[0]} has no flag {missing}"


@pytest.mark.parametrize("page", [p for p in PAGES if inline_commands(p)], ids=rel)
def test_every_command_quoted_in_prose_parses(page):
    for line in inline_commands(page):
        words = _words(line)
        if words[0] == "megatron-preflight":
            if len(words) > 1:  # a bare name (`megatron-preflight fingerprint`) is checked with its flags below
                _cli_parses(words[1:])
        elif words[0] in ("python", "python3"):
            _benchmark_parses(words[1:])
        elif words[0] == "torchrun":
            if len(words) == 1:  # the launcher's name
                continue
            assert "megatron_preflight" in words, line
            _cli_parses(words[words.index("megatron_preflight") + 1:])
        else:
            _script(line)
