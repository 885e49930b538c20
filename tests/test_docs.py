"""The documentation belongs to the repository.

A reader of a clone sees only the clone: Markdown files and docstrings must not send them to
a path of one particular machine, nor to a design file outside the repository (the design
lives in docs/design.md). Every relative link in the Markdown files must lead to a file that
exists. Each check is also run once on planted bad input, so it is known to be able to fail.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MACHINE_PATHS = ("/work/", "/tmp/", "/root/", "/home/")
"""Absolute path prefixes that only mean something on one machine."""

OUTSIDE_DESIGN = re.compile(r"\bDESIGN\.md\b")
"""The upper-case design file of a shared folder (the repository's own is docs/design.md)."""

# Folders never part of the documentation when the tree is walked without git.
SKIPPED_DIRS = {".git", ".venv", "outputs", "build", "dist", "__pycache__", "node_modules"}

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def repository_files(root: Path = ROOT) -> list[Path]:
    """Files of the repository: git's tracked and not-ignored files when git is available
    (new files count before they are committed), else a walk that skips build outputs."""
    if (root / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout.decode()
        paths = [root / name for name in listed.split("\0") if name]
    else:
        paths = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
            paths += [Path(folder) / f for f in files]
    return sorted(p for p in paths if p.is_file())


def forbidden_mentions(text: str) -> list[str]:
    """The machine paths and outside design references that ``text`` names."""
    found = [prefix for prefix in MACHINE_PATHS if prefix in text]
    if OUTSIDE_DESIGN.search(text):
        found.append("DESIGN.md")
    return found


def docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring of a module: module, class and function docstrings and
    the string statements under fields (attribute docstrings, as the configs use)."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node.lineno, node.value.value


def relative_links(markdown: str) -> list[str]:
    """Link targets of a Markdown text that point into the repository (no scheme, not a
    fragment of the same page), without their fragment. Code is not Markdown: fenced
    blocks and inline code are skipped."""
    text = INLINE_CODE.sub("", FENCE.sub("", markdown))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    out = []
    for target in targets:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # https:, mailto:, ... or an anchor on the same page
        out.append(target.split("#", 1)[0].split("?", 1)[0])
    return out


def broken_links(markdown_file: Path, root: Path = ROOT) -> list[str]:
    """Relative link targets of ``markdown_file`` that lead to no file or folder."""
    broken = []
    for target in relative_links(markdown_file.read_text(encoding="utf-8")):
        base = root if target.startswith("/") else markdown_file.parent
        if not (base / target.lstrip("/")).exists():
            broken.append(target)
    return broken


def markdown_problems(files: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: names X`` for every forbidden mention in the Markdown files."""
    problems = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for found in forbidden_mentions(line):
                problems.append(f"{path.relative_to(root)}:{number}: names {found}")
    return problems


def docstring_problems(files: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: names X`` for every forbidden mention in the Python docstrings."""
    problems = []
    for path in files:
        for number, text in docstrings(path.read_text(encoding="utf-8")):
            for found in forbidden_mentions(text):
                problems.append(f"{path.relative_to(root)}:{number}: docstring names {found}")
    return problems


def _with_suffix(files: list[Path], suffix: str) -> list[Path]:
    return [p for p in files if p.suffix == suffix]


# ---- the repository ------------------------------------------------------------------------


def test_markdown_names_no_machine_path_or_outside_design():
    files = _with_suffix(repository_files(), ".md")
    assert ROOT / "README.md" in files and ROOT / "docs" / "design.md" in files
    assert markdown_problems(files) == []


def test_docstrings_name_no_machine_path_or_outside_design():
    files = _with_suffix(repository_files(), ".py")
    assert Path(__file__).resolve() in files
    assert docstring_problems(files) == []


def test_relative_links_in_markdown_resolve():
    files = _with_suffix(repository_files(), ".md")
    broken = {str(p.relative_to(ROOT)): broken_links(p) for p in files}
    assert {path: links for path, links in broken.items() if links} == {}


def test_readme_points_at_the_design_and_the_contracts():
    links = relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "docs/design.md" in links and "docs/contracts.md" in links
    design_links = relative_links((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    assert "contracts.md" in design_links


# ---- the checks can fail -------------------------------------------------------------------


def _machine_path() -> str:
    # Assembled at run time so that this file's own text stays clean.
    return "/" + "work" + "/shared/notes.txt"


def test_checks_catch_planted_problems(tmp_path):
    doc = tmp_path / "guide.md"
    doc.write_text(
        "# Guide\n\n"
        f"See {_machine_path()} and the {'DESIGN'}.md of the team.\n"
        "[ok](guide.md) [anchor](#guide) [web](https://example.org/x.md) [gone](missing.md)\n"
        "```\n[in code](not-a-link.md)\n```\n",
        encoding="utf-8",
    )
    module = tmp_path / "mod.py"
    module.write_text(
        f'"""Module: read {_machine_path()}."""\n\n'
        "class Config:\n"
        "    path: str = ''\n"
        f'    """Where the {"DESIGN"}.md is."""\n\n'
        "def f():\n"
        f"    return '{_machine_path()}'  # a value, not a docstring\n",
        encoding="utf-8",
    )
    assert markdown_problems([doc], tmp_path) == [
        "guide.md:3: names /work/",
        "guide.md:3: names DESIGN.md",
    ]
    assert docstring_problems([module], tmp_path) == [
        "mod.py:1: docstring names /work/",
        "mod.py:5: docstring names DESIGN.md",
    ]
    assert broken_links(doc, tmp_path) == ["missing.md"]


def test_lowercase_design_doc_is_allowed():
    assert forbidden_mentions("see docs/design.md and [design](design.md)") == []


# ---- the README's commands are the product's ---------------------------------------------

README_COMMAND = re.compile(
    r"^(?:[A-Z_]+=\S+\s+)*"  # environment assignments (NGPU=4 ...)
    r"(?:\S*/)?(?:titan (?P<command>train|sft|rl|dpo|kto|reward)|\./tools/run_train\.sh|python tools/convert_hf\.py)"
    r"\b(?P<args>.*)$"
)


def readme_commands(text: str) -> list[tuple[str, list[str], str]]:
    """(command, arguments, the line) of every `titan train|sft|rl|dpo|kto|reward`, `tools/run_train.sh`
    (which runs `titan train`) and `tools/convert_hf.py` line in the code blocks of
    ``text``; continued lines joined, comments dropped."""
    import shlex

    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s#.*$", "", line.strip())
            match = README_COMMAND.match(line)
            if match:
                command = "convert_hf" if "convert_hf.py" in line else match.group("command") or "train"
                found.append((command, shlex.split(match.group("args")), line))
    return found


def check_readme_command(command: str, args: list[str]) -> str | None:
    """Why ``args`` would be refused before any work (a flag, value or recipe the command
    does not know), or None: the train/sft/rl commands parse them as the CLI does; for
    convert_hf.py the direction and family are checked."""
    import contextlib
    import io

    if command == "convert_hf":
        import importlib.util

        spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)  # defines its parser's families; runs nothing
        FAMILIES = tool.FAMILIES  # noqa: N806 - the tool's own table
        model = args[args.index("--model") + 1] if "--model" in args else None
        if args[0] not in ("to-hf", "from-hf") or model not in FAMILIES:
            return f"convert_hf.py: direction {args[0]!r}, --model {model!r} (families: {sorted(FAMILIES)})"
        return None
    from titan.recipes.cli import parse_train_args

    if "--help" in args:
        return None
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            parse_train_args(args, command=command)
    except (SystemExit, Exception) as err:  # noqa: BLE001 - any refusal is the finding
        return f"{type(err).__name__}: {err} {out.getvalue()[-500:]}"
    return None


def test_every_readme_command_parses():
    """Every training command the README shows is accepted by the CLI as written: recipes,
    flags and values exist (docs drift when a flag is renamed; nothing here runs)."""
    commands = readme_commands((ROOT / "README.md").read_text())
    assert len(commands) >= 30
    assert {c for c, _, _ in commands} == {"train", "sft", "rl", "dpo", "kto", "reward", "convert_hf"}
    refused = {line: why for command, args, line in commands if (why := check_readme_command(command, args))}
    assert not refused, refused


def test_a_stale_readme_command_is_caught():
    planted = "```bash\ntitan train --config llama3_debug --training.stepz 5   # a renamed flag\n" \
              "NGPU=2 ./tools/run_train.sh --config no_such_recipe\n" \
              "python tools/convert_hf.py from-hf a b --model gpt2\n```\n"
    commands = readme_commands(planted)
    assert [c for c, _, _ in commands] == ["train", "train", "convert_hf"]
    assert all(check_readme_command(command, args) for command, args, _ in commands)


POST_TRAINING_FLAG = re.compile(
    r"--((?:rl|rl_data|sft_data|sampling|generator|dpo|dpo_data|kto|kto_data|reward|reward_data)\.[a-z0-9_]+)")


def post_training_flags_in_docs() -> dict[str, set[str]]:
    """Every ``--rl.*``, ``--rl_data.*``, ``--sft_data.*``, ``--sampling.*`` and
    ``--generator.*`` flag the READMEs and docs name (prose included), by file."""
    files = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md")), *sorted(ROOT.glob("docs/*.md"))]
    found: dict[str, set[str]] = {}
    for path in files:
        for flag in POST_TRAINING_FLAG.findall(path.read_text()):
            found.setdefault(flag, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_every_post_training_flag_the_docs_name_exists():
    """The docs name only flags `titan sft`, `titan rl` or `titan dpo` accept (their --help lists each,
    with tyro's ``no_`` form for switches): a renamed or never-existing flag in prose (the
    README once said --rl.no_normalize_std, which tyro does not make for an optional bool)
    fails here."""
    import contextlib
    import io

    from titan.recipes.cli import parse_train_args

    out = io.StringIO()
    for command in ("sft", "rl", "dpo", "kto", "reward"):
        with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            parse_train_args(["--help"], command=command)
    accepted = set(POST_TRAINING_FLAG.findall(out.getvalue()))
    assert {"rl.padding_free", "rl.no_drop_zero_variance", "sft_data.no_packing", "dpo.rpo_alpha",
            "dpo_data.no_packing", "kto.undesirable_weight", "kto_data.label_field",
            "reward.center_rewards_coefficient", "reward_data.eval_path"} <= accepted
    unknown = {flag: files for flag, files in post_training_flags_in_docs().items() if flag not in accepted}
    assert not unknown, unknown
