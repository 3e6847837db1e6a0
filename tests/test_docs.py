"""The documentation does not rot: README.md, docs/*.md and kernels/README.md.

(a) Every relative link resolves: the file exists and, where the link has a #anchor into a
    Markdown file, a heading of that file produces the anchor (GitHub's rule: lowercase, drop
    punctuation but '-', '_' and spaces, spaces to '-', repeated headings get -1, -2, ...).
    External http(s) and mailto links are left alone.
(b) Every `fa_verify ...` command line the pages quote is accepted by today's argument parser
    (`fa_verify.cli.main.build_parser()`): the lines of ```bash, ```sh, ```console and unlabelled
    ``` blocks (continuations with a trailing backslash joined, ` # comments` dropped, chains
    split at `&&`, `||` and `;`), and inline `code` spans that start with `fa_verify ` or
    `python3 -m fa_verify `. `python3 -m fa_verify` counts as `fa_verify`, and leading
    `NAME=value` environment assignments are dropped. Skipped, as placeholders that no parser
    takes: see PLACEHOLDER below. An inline span of just `fa_verify COMMAND` names a command:
    only COMMAND is checked.

The parse runs with the working directory in a temporary folder, since option types that
validate paths (`--results FILE`, `--out DIR`) look at the filesystem.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels" / "README.md"]

#: Code blocks whose lines are shell command lines (by the fence's info string).
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}

#: A command line that is a template, not a command: an ellipsis ("check all ... --json"), an
#: optional part in brackets ("[--json]", "[options]") or an alternation ("quick|default").
PLACEHOLDER = re.compile(r"\.\.\.|…|\[[^\]]*\]|\|")

FENCE = re.compile(r"^ {0,3}(```+|~~~+)\s*([^`\s]*)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^(?:https?:|mailto:)", re.IGNORECASE)


@dataclass
class Doc:
    path: Path
    code: list[tuple[str, int, str]]  # (fence info, line number, line) of fenced blocks
    prose: str                        # the text outside fenced blocks, code-block lines blanked

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


def read_doc(path: Path) -> Doc:
    code, prose, fence, info = [], [], None, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, info = match.group(1), match.group(2).lower()
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) \
                and not line.strip().strip(fence[0]):
            fence = None
            prose.append("")
        elif fence is not None:
            code.append((info, number, line))
            prose.append("")
        else:
            prose.append(line)
    return Doc(path, code, "\n".join(prose))


def inline_spans(text: str):
    """(line number, content) of every inline code span, a span's line breaks as spaces."""
    pos = 0
    while True:
        start = text.find("`", pos)
        if start < 0:
            return
        run = len(text[start:]) - len(text[start:].lstrip("`"))
        close = re.compile(r"(?<!`)" + "`" * run + r"(?!`)").search(text, start + run)
        if close is None:
            pos = start + run
            continue
        content = text[start + run:close.start()].replace("\n", " ")
        yield text.count("\n", 0, start) + 1, content.strip()
        pos = close.end()


def without_code_spans(text: str) -> str:
    """The text with inline code spans blanked (same length, line breaks kept)."""
    out, pos = [], 0
    for match in re.finditer(r"(`+)(.+?)(?<!`)\1(?!`)", text, flags=re.DOTALL):
        out.append(text[pos:match.start()])
        out.append(re.sub(r"[^\n]", " ", match.group(0)))
        pos = match.end()
    out.append(text[pos:])
    return "".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link's text stays
    text = re.sub(r"<[^>]+>", "", text).lower()                  # inline HTML goes
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in read_doc(path).prose.split("\n"):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def test_the_docs_are_the_ones_expected():
    names = [doc.relative_to(ROOT).as_posix() for doc in DOC_FILES]
    assert all(doc.exists() for doc in DOC_FILES), names
    assert "docs/README.md" in names and len(names) >= 8, names


def test_every_relative_link_resolves():
    failures, checked, anchored = [], 0, 0
    anchor_cache: dict[Path, set[str]] = {}
    for path in DOC_FILES:
        doc = read_doc(path)
        text = without_code_spans(doc.prose)
        for match in LINK.finditer(text):
            target = match.group(1)
            line = text.count("\n", 0, match.start()) + 1
            if EXTERNAL.match(target):
                continue
            checked += 1
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{doc.name}:{line}: link {target!r}"
            if not resolved.exists():
                failures.append(f"{where}: {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved} "
                                "does not exist")
                continue
            if anchor and resolved.suffix == ".md":
                anchored += 1
                if resolved not in anchor_cache:
                    anchor_cache[resolved] = anchors(resolved)
                if anchor not in anchor_cache[resolved]:
                    near = difflib.get_close_matches(anchor, anchor_cache[resolved], n=3, cutoff=0.5)
                    failures.append(f"{where}: no heading of {resolved.relative_to(ROOT)} has the anchor "
                                    f"#{anchor} (nearest: {near or 'none'})")
    print(f"test_docs: {checked} relative links checked ({anchored} with an anchor) "
          f"in {len(DOC_FILES)} files")
    assert not failures, f"{len(failures)} of {checked} links are broken:\n" + "\n".join(failures)
    assert checked > 50 and anchored > 30, f"only {checked} links ({anchored} with anchors) were found"


# ----------------------------------------------------------------------------- command lines

def strip_comment(line: str) -> str:
    """The line without a trailing ` # comment` (a # outside quotes, after whitespace)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def logical_lines(code):
    """(fence info, first line number, text) with backslash continuations joined."""
    pending, start = None, 0
    for info, number, line in code:
        if pending is None:
            start = number
        text = line if pending is None else pending + " " + line.strip()
        if text.rstrip().endswith("\\"):
            pending = text.rstrip()[:-1].rstrip()
            continue
        pending = None
        yield info, start, text
    if pending is not None:
        yield code[-1][0], start, pending


def fa_verify_segments(text: str):
    """The `fa_verify ...` commands of a command line: (raw segment, argv) pairs."""
    for segment in re.split(r"\s*(?:&&|\|\||;)\s*", strip_comment(text).strip()):
        words = segment.split()
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words[:3] in (["python3", "-m", "fa_verify"], ["python", "-m", "fa_verify"]):
            words = words[2:]
        if words[:1] == ["fa_verify"]:
            yield " ".join(words)


@dataclass
class Quoted:
    where: str
    line: str
    name_only: bool = False


def quoted_commands():
    """Every quoted `fa_verify` command line, and the placeholder lines that were skipped."""
    commands, skipped = [], []
    for path in DOC_FILES:
        doc = read_doc(path)
        for info, number, text in logical_lines(doc.code):
            if info not in SHELL_FENCES:
                continue
            for segment in fa_verify_segments(text):
                (skipped if PLACEHOLDER.search(segment) else commands).append(
                    Quoted(f"{doc.name}:{number}", segment))
        for number, content in inline_spans(doc.prose):
            if not re.match(r"^(?:python3? -m )?fa_verify ", content):
                continue
            for segment in fa_verify_segments(content):
                quoted = Quoted(f"{doc.name}:{number} (inline)", segment,
                                name_only=len(segment.split()) == 2)
                (skipped if PLACEHOLDER.search(segment) else commands).append(quoted)
    return commands, skipped


def parse(parser: argparse.ArgumentParser, line: str) -> str | None:
    """None if the parser accepts the line, else its message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(shlex.split(line)[1:])
        except SystemExit as exc:
            if exc.code not in (0, None):
                lines = [l for l in err.getvalue().strip().split("\n") if l]
                return lines[-1] if lines else f"exit {exc.code}"
    return None


def test_every_quoted_command_line_is_accepted_by_the_parser(tmp_path, monkeypatch):
    from fa_verify.cli.main import build_parser

    monkeypatch.chdir(tmp_path)  # path-validating option types must not look at (or touch) the repo
    parser = build_parser()
    command_names = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    commands, skipped = quoted_commands()
    failures, parsed, named = [], 0, 0
    for quoted in commands:
        if quoted.name_only:
            named += 1
            if quoted.line.split()[1] not in command_names:
                failures.append(f"{quoted.where}: `{quoted.line}`: no such command "
                                f"(commands: {', '.join(command_names)})")
            continue
        parsed += 1
        message = parse(parser, quoted.line)
        if message is not None:
            failures.append(f"{quoted.where}: `{quoted.line}`: {message}")
    print(f"test_docs: {parsed} fa_verify command lines parsed, {named} command names checked, "
          f"{len(skipped)} placeholder lines skipped: " + "; ".join(q.line for q in skipped))
    assert not failures, f"{len(failures)} of {parsed + named} quoted command lines are refused:\n" + \
        "\n".join(failures)
    assert parsed > 20, f"only {parsed} command lines were found: is the extraction still working?"
    assert len(skipped) <= 12, f"{len(skipped)} lines skipped as placeholders: {[q.line for q in skipped]}"
    assert not list(tmp_path.iterdir()), "parsing the command lines wrote files"


def test_the_extraction_itself():
    """The pieces the two tests rely on, on small inputs."""
    assert slug("`fa_verify check`") == "fa_verify-check"
    assert slug("Split-KV decode: `kernels/split_kv.cu`") == "split-kv-decode-kernelssplit_kvcu"
    assert slug("torch's CPU SDPA under the property suite") == "torchs-cpu-sdpa-under-the-property-suite"
    assert slug("FlashAttention-3 Table 3 under `--sweep fa3`") == "flashattention-3-table-3-under---sweep-fa3"
    assert list(fa_verify_segments("pip install -e '.[x]' && fa_verify report   # main job")) == ["fa_verify report"]
    assert list(fa_verify_segments("TRITON_INTERPRET=1 python3 -m fa_verify check m:f --array torch")) == \
        ["fa_verify check m:f --array torch"]
    assert strip_comment("fa_verify check a --seed 1  # the 'seed'") == "fa_verify check a --seed 1"
    code = [("bash", 1, "fa_verify check x \\"), ("bash", 2, "    --dtype fp16"), ("bash", 3, "fa_verify backends")]
    assert list(logical_lines(code)) == [("bash", 1, "fa_verify check x --dtype fp16"),
                                         ("bash", 3, "fa_verify backends")]
    assert list(inline_spans("a `fa_verify\ncheck all` b ``x `y` z``")) == [(1, "fa_verify check all"),
                                                                            (2, "x `y` z")]
    assert PLACEHOLDER.search("fa_verify report [--sweep quick|default]")
    assert not PLACEHOLDER.search("fa_verify check fa2-cpu --property races")
