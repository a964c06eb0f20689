"""The Markdown a user reads agrees with the code: every repository path it names exists, and every
command line that runs one of the package's or the tools' programs names a program that exists
and passes only flags that program's argument parser accepts.

Read: README.md, docs/*.md, tools/README.md, csrc/README.md, dev/README.md and the shipped drafts'
model cards. A failure names the file, the line and what to fix there; all of them at once.

A path is a token that starts with one of the repository's top-level folders (``ssdlib/``,
``tools/``, ``docs/`` ...), a Markdown link to a local file, or an entry of a folder tree drawn in a
code block (docs/ARCHITECTURE.md). Placeholders and outputs (``DIR/t8b``, ``chat24.jsonl``,
``gpu-out/...``) start with no such folder and are not paths; a path with ``...`` in it is elided
and a ``*`` in it is a glob.

A command is ``python``/``python3``/``torchrun`` followed by ``-m ssdlib.X`` / ``-m tools.X`` /
``-m dev.X`` or a script ``tools/X.py`` / ``dev/X.py``, in a code block (lines joined at a trailing
backslash, and a synopsis's indented ``--flag`` lines joined to the command above) or in inline
code (which may wrap onto the next line). Its ``--flags`` (bracketed ones too, ``--a/--no-a``
both, the name before ``=``) must be option strings of the program's parser, by their full name;
a bare ``--`` ends them (what follows belongs to another program). The parser is read without
running the program: the package's and tools' programs build theirs in ``build_parser()``; a
program with no argument parser takes no flags; the scripts of dev/ (measurement scaffolding,
their parsers built inside ``main``) are read statically: every literal option string of their
``add_argument`` calls, and of the dev/ modules they import.
"""

import argparse
import ast
import glob
import importlib
import os
import re
import shlex
from dataclasses import dataclass

from tests.package_modules import OPTIONAL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOCS = ("README.md", "docs/*.md", "tools/README.md", "csrc/README.md", "dev/README.md",
        "ssdlib/assets/*/MODEL_CARD.md")

# top-level folders that are build outputs (.gitignore), never named as sources
BUILD_OUTPUTS = ("build", "dist", "runs", "__pycache__")

# paths the docs name that an install writes (gitignored): absent from a fresh checkout
INSTALL_OUTPUTS = (
    "ssdlib/_C*.so",  # the compiled extension (csrc/README.md), built by a GPU install
    "ssdlib/_build_status.json",  # setup.py's record of the last install's build
)

INTERPRETERS = re.compile(r"^(python3?(\.\d+)?|torchrun)$")
SCRIPT = re.compile(r"^(tools|dev)/[\w/]+\.py$")
PROJECT_MODULES = ("ssdlib.", "tools.", "dev.")


def doc_paths() -> list[str]:
    out = []
    for pattern in DOCS:
        found = sorted(glob.glob(os.path.join(ROOT, pattern)))
        assert found, f"no file matches {pattern}: update DOCS in tests/test_docs.py"
        out += [os.path.relpath(f, ROOT) for f in found]
    return out


def top_dirs() -> tuple[str, ...]:
    return tuple(sorted(d for d in os.listdir(ROOT)
                        if os.path.isdir(os.path.join(ROOT, d)) and not d.startswith(".")
                        and d not in BUILD_OUTPUTS and not d.endswith(".egg-info")))


# --- reading a Markdown file -----------------------------------------------------------------


@dataclass
class Doc:
    name: str  # repository-relative, for messages and relative links
    lines: list[str]

    @classmethod
    def read(cls, name: str) -> "Doc":
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            return cls(name, f.read().split("\n"))

    def blocks(self) -> list[tuple[int, list[str]]]:
        """Fenced code blocks: (index of their first content line, their lines)."""
        out, start = [], None
        for i, line in enumerate(self.lines):
            if line.lstrip().startswith(("```", "~~~")):
                if start is None:
                    start = i + 1
                else:
                    out.append((start, self.lines[start:i]))
                    start = None
        return out

    def prose(self) -> list[str]:
        """The lines with every fenced block's lines blanked (line numbers kept)."""
        lines = list(self.lines)
        for start, block in self.blocks():
            for i in range(start - 1, start + len(block) + 1):
                if i < len(lines):
                    lines[i] = ""
        return lines

    def inline_code(self) -> list[tuple[int, str]]:
        """Inline code spans outside code blocks, (line index, text); a span may wrap onto the
        next line of its paragraph (joined with a space)."""
        out, lines = [], self.prose()
        i = 0
        while i < len(lines):
            if not lines[i].strip():
                i += 1
                continue
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            para = "\n".join(lines[i:j])
            for m in re.finditer(r"(`+)(.+?)\1", para, re.S):
                out.append((i + para.count("\n", 0, m.start()), m.group(2).replace("\n", " ")))
            i = j
        return out


# --- paths ---------------------------------------------------------------------------------


def path_tokens(line: str, tops: tuple[str, ...]) -> list[str]:
    """The repository paths a line names: tokens that start with a top-level folder."""
    pattern = (r"(?<![\w./~$@:-])((?:" + "|".join(map(re.escape, tops)) +
               r")/[\w./*+-]*)(?![\w{<$])")
    out = []
    for m in re.finditer(pattern, line):
        tok = m.group(1).rstrip(".,:;")
        if "..." not in tok:
            out.append(tok)
    return out


def exists(path: str) -> bool:
    if path in INSTALL_OUTPUTS:
        return True
    if "*" in path:
        return bool(glob.glob(os.path.join(ROOT, path)))
    return os.path.exists(os.path.join(ROOT, path))


def tree_paths(block: list[str]) -> list[tuple[int, str]]:
    """The entries of a folder tree drawn in a code block whose first line is a top-level
    folder (``ssdlib/``): (line offset in the block, repository path). An entry is a name ending
    in ``/`` or with an extension at the start of a line, two spaces deeper than its folder;
    deeper lines continue the text of the entry above."""
    out, stack = [], [block[0].strip()]
    for n, line in enumerate(block[1:], start=1):
        m = re.match(r"^( *)([\w.-]+(?:/[\w.-]+)*(?:/|\.\w+))(?: |$)", line)
        if not m or len(m.group(1)) % 2 or len(m.group(1)) // 2 > len(stack):
            continue
        level = len(m.group(1)) // 2
        stack = stack[:level] + [m.group(2)]
        out.append((n, "".join(stack)))
    return out


def link_targets(line: str) -> list[str]:
    """Markdown links' local targets, anchors dropped."""
    out = []
    for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
        target = m.group(1).split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            out.append(target)
    return out


def table_files(line: str) -> list[str]:
    """The file names in the first cell of a table row (``| `bench.py` | ... |``)."""
    if not line.startswith("|"):
        return []
    cell = line.split("|")[1]
    names = re.findall(r"`([^`]+)`", cell)
    return [m for m in names if re.fullmatch(r"[\w.-]+(/[\w.-]+)*(/|\.\w+)", m)]


def path_failures(doc: Doc, tops: tuple[str, ...]) -> list[str]:
    failures = []
    folder = os.path.dirname(doc.name)
    for i, line in enumerate(doc.lines):
        if doc.name.endswith("/README.md"):  # a folder's README lists that folder's files
            failures += [f"{doc.name}:{i + 1}: no such file {name} in {folder}/"
                         for name in table_files(line) if not exists(os.path.join(folder, name))]
        for tok in path_tokens(line, tops):
            if not exists(tok):
                failures.append(f"{doc.name}:{i + 1}: no such path {tok}")
        for target in link_targets(line):
            path = os.path.normpath(os.path.join(folder, target))
            if not exists(path):
                failures.append(f"{doc.name}:{i + 1}: link to a missing file {target}")
    for start, block in doc.blocks():
        if block and block[0].strip().rstrip("/") in tops and block[0].strip().endswith("/"):
            for n, path in tree_paths(block):
                if not exists(path):
                    failures.append(f"{doc.name}:{start + n + 1}: tree entry {path} is missing")
    return failures


# --- commands ------------------------------------------------------------------------------


@dataclass
class Command:
    program: str  # "ssdlib.generate", "tools/bench.py", ...
    args: list[str]


def block_commands(block: list[str]) -> list[tuple[int, str]]:
    """A code block's command lines: (line offset, text), continuation lines joined (a trailing
    backslash; an indented line starting with ``--`` under a command, as a synopsis writes it),
    shell comments left out."""
    out: list[tuple[int, str]] = []
    joining = False
    for n, line in enumerate(block):
        stripped = re.sub(r"(^|\s)#.*$", "", line).strip()
        if joining or (out and line[:1].isspace() and stripped.startswith(("--", "[--"))):
            out[-1] = (out[-1][0], out[-1][1] + " " + stripped.rstrip("\\"))
        else:
            out.append((n, stripped.rstrip("\\")))
        joining = stripped.endswith("\\")
    return out


def split_words(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote (a span cut short): words are enough
        return text.split("#")[0].split()


def commands(text: str) -> list[Command]:
    """The project commands in one command line (several where ``&&``, ``;`` or ``|`` chain
    them, or where prose names two); a line may also start with the script itself
    (``tools/inflate.py SRC OUT --like ...``)."""
    out: list[Command] = []
    for part in re.split(r"\s*(?:&&|\|\|)\s*|;\s|\s\|\s", text):
        words = [w.lstrip("(") for w in split_words(part)]
        starts = [i for i, w in enumerate(words) if INTERPRETERS.match(os.path.basename(w))]
        if words and SCRIPT.match(words[0]):
            starts = [-1] + starts
        for a, b in zip(starts, starts[1:] + [len(words)]):
            cmd = program(words[a] if a >= 0 else "", words[a + 1:b])
            if cmd is not None:
                out.append(cmd)
    return out


def program(interpreter: str, words: list[str]) -> Command | None:
    """The project program a ``python``/``torchrun`` invocation runs, with its arguments; None
    for any other (pip, pytest, ``-c``)."""
    for i, w in enumerate(words):
        if w == "-m" and i + 1 < len(words):
            name = words[i + 1].rstrip(").,;:")
            return Command(name, words[i + 2:]) if name.startswith(PROJECT_MODULES) else None
        if w.endswith(".py"):
            top = w.split("/")[0]
            return Command(w, words[i + 1:]) if top in ("tools", "dev") else None
        if not w.startswith("-") and not os.path.basename(interpreter).startswith("torchrun"):
            return None  # python SOMETHING: not a program of this repository
    return None


def flags(args: list[str]) -> list[str]:
    """The long options among a command's arguments, up to a bare ``--``."""
    out = []
    for a in args:
        if a == "--":
            break
        for part in a.strip("[](){},").rstrip(".").split("/"):
            part = part.strip("[](){},")
            if part.startswith("--") and len(part) > 2:
                out.append(part.split("=")[0])
    return out


# --- the programs' parsers -------------------------------------------------------------------


def source_file(name: str) -> str | None:
    """The file a program name runs: ``tools/bench.py`` itself, ``ssdlib.serve``'s
    ``__main__.py``, ``tools.distill.evaluate``'s ``.py``."""
    if name.endswith(".py"):
        return name if os.path.isfile(os.path.join(ROOT, name)) else None
    base = name.replace(".", "/")
    for candidate in (base + ".py", base + "/__main__.py"):
        if os.path.isfile(os.path.join(ROOT, candidate)):
            return candidate
    return None


def literal_options(path: str, seen: set[str] | None = None) -> set[str]:
    """Every literal option string of ``add_argument`` calls in a dev/ script and in the dev/
    modules it imports (``--help`` included)."""
    seen = set() if seen is None else seen
    seen.add(path)
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = {"-h", "--help"}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            out |= {a.value for a in node.args
                    if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for mod in names:
            dep = mod.replace(".", "/") + ".py"
            if mod.startswith("dev.") and dep not in seen and os.path.isfile(
                    os.path.join(ROOT, dep)):
                out |= literal_options(dep, seen)
    return out


@dataclass
class Options:
    main: set[str]
    sub: dict[str, set[str]]  # subcommand -> its own option strings


def parser_options(p: argparse.ArgumentParser) -> Options:
    sub: dict[str, set[str]] = {}
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                sub[name] = set(child._option_string_actions)
    return Options(set(p._option_string_actions), sub)


def options_of(path: str) -> Options | str | None:
    """A program's option strings, or why they cannot be read; None for a program that needs
    an optional dependency that is not installed (the serve extra): not checked here."""
    if path.startswith("dev/"):
        return Options(literal_options(path), {})
    module = path[:-3].replace("/", ".")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in OPTIONAL:
            return None
        raise
    build = getattr(mod, "build_parser", None)
    if build is not None:
        return parser_options(build())
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        if "ArgumentParser" in f.read():
            return f"{path} builds its parser inside the program: move it into build_parser()"
    return Options(set(), {})  # no argument parser: it takes no flags


def row_flags(line: str) -> list[str]:
    """The flags a table row's inline code names outside its commands (a folder README's row
    describes the program of its first cell: ``--passes auto``)."""
    rest = "|".join(line.split("|")[2:])
    return [f for span in re.findall(r"`([^`]+)`", rest) if not commands(span)
            for f in flags(split_words(span))]


def check(cmd: Command, where: str, cache: dict, any_subcommand: bool = False) -> list[str]:
    """What is wrong with one command: its program, its subcommand, its flags."""
    where = f"{where}: {cmd.program}"
    path = source_file(cmd.program)
    if path is None:
        return [f"{where}: no such program"]
    if cmd.program not in cache:
        cache[cmd.program] = options_of(path)
    opts = cache[cmd.program]
    if opts is None:
        return []
    if isinstance(opts, str):
        return [f"{where}: {opts}"]
    accepted = set(opts.main)
    if opts.sub:
        chosen = [a for a in cmd.args if a in opts.sub][:1]
        if any_subcommand:
            chosen = list(opts.sub)
        elif not chosen:
            return [f"{where}: names none of its subcommands ({', '.join(sorted(opts.sub))})"]
        for name in chosen:
            accepted |= opts.sub[name]
    return ([f"{where}: unknown flag {f}" for f in flags(cmd.args) if f not in accepted]
            + mode_failures(cmd, where))


def mode_failures(cmd: Command, where: str) -> list[str]:
    """The bench's ``--modes`` list, each mode through ``tools/bench.py``'s own parser (a
    placeholder in capitals, such as MODES, is left alone)."""
    if cmd.program != "tools/bench.py" or "--modes" not in cmd.args[:-1]:
        return []
    from tools.bench import parse_mode

    value = cmd.args[cmd.args.index("--modes") + 1].strip("\"'")
    failures = []
    for spec in value.split(","):
        if not spec or spec.isupper() or "..." in spec:
            continue
        try:
            parse_mode(spec)
        except ValueError as e:
            failures.append(f"{where}: {e}")
    return failures


def command_failures(doc: Doc, cache: dict) -> list[str]:
    found: list[tuple[int, str]] = list(doc.inline_code())
    for start, block in doc.blocks():
        found += [(start + n, text) for n, text in block_commands(block)]
    failures = []
    for line, text in sorted(found):
        for cmd in commands(text):
            failures += check(cmd, f"{doc.name}:{line + 1}", cache)
    if doc.name.endswith("/README.md"):
        folder = os.path.dirname(doc.name)
        prose = doc.prose()
        for i, line in enumerate(prose):
            names = [n for n in table_files(line) if n.endswith(".py")]
            row = row_flags(line) if len(names) == 1 else []
            if row:
                cmd = Command(os.path.join(folder, names[0]), row)
                failures += check(cmd, f"{doc.name}:{i + 1}", cache, any_subcommand=True)
    return failures


# --- the checks ----------------------------------------------------------------------------


def report(failures: list[str]) -> str:
    return f"{len(failures)} out-of-date place(s) in the docs:\n  " + "\n  ".join(failures)


def test_every_path_the_docs_name_exists():
    tops = top_dirs()
    failures = [f for name in doc_paths() for f in path_failures(Doc.read(name), tops)]
    assert not failures, report(failures)


def test_every_command_the_docs_show_runs_a_program_with_its_flags():
    cache: dict = {}
    failures = [f for name in doc_paths() for f in command_failures(Doc.read(name), cache)]
    assert not failures, report(failures)


# --- the readers themselves: a bad path or flag is caught ----------------------------------


def doc(text: str, name: str = "docs/X.md") -> Doc:
    return Doc(name, text.split("\n"))


def test_a_missing_path_a_bad_link_and_a_missing_tree_entry_are_reported():
    text = ("See `ssdlib/engine/leader/verifier.py` and `ssdlib/nope.py`, [a](../tools/gone.md),\n"
            "DIR/t8b, gpu-out/..., tests/...py and ssdlib/assets/*/MODEL_CARD.md.\n"
            "```\nssdlib/\n  generate.py   CLI\n  engine/       shared\n    absent.py   x\n"
            "                continued.py text\n```")
    failures = path_failures(doc(text), top_dirs())
    assert failures == ["docs/X.md:1: no such path ssdlib/nope.py",
                        "docs/X.md:1: link to a missing file ../tools/gone.md",
                        "docs/X.md:7: tree entry ssdlib/engine/absent.py is missing"]


def test_a_folder_readme_table_names_files_of_that_folder():
    text = ("| script | what |\n|---|---|\n| `bench.py` | x |\n| `distill/`, `gone.py` | y |\n"
            "| `a message, not a file` | z |")
    failures = path_failures(doc(text, "tools/README.md"), top_dirs())
    assert failures == ["tools/README.md:4: no such file gone.py in tools/"]


def test_a_bad_flag_in_a_block_or_in_wrapped_inline_code_is_reported():
    text = ("Run `python3 tools/bench.py --device cuda\n--no-such-flag` or:\n\n"
            "```bash\nSSDLIB_X=1 python -m ssdlib.generate [--prompt TEXT]... --chat \\\n"
            "    --bogus 1  # --commented-out\n    --adaptive-k/--no-adaptive-kk\n"
            "python tools/distill_data.py merge --out a b && python -m pip install --nope\n"
            "torchrun --nproc_per_node 2 -m ssdlib.generate --tp 2 --tpp 2\n"
            "python tools/distill_data.py --seed 1\n"
            "python dev/op_count.py --k 3 --json x --fan-out-budget 6 --kk\n"
            "python dev/startup_probe.py --json r --log s -- --mode sd\n"
            "python -m tools.missing --x\n```\n\n"
            "`tools/inflate.py SRC OUT --like llama-3.1-8b --liek x`")
    failures = command_failures(doc(text), {})
    assert failures == [
        "docs/X.md:1: tools/bench.py: unknown flag --no-such-flag",
        "docs/X.md:5: ssdlib.generate: unknown flag --bogus",
        "docs/X.md:5: ssdlib.generate: unknown flag --no-adaptive-kk",
        "docs/X.md:9: ssdlib.generate: unknown flag --tpp",
        "docs/X.md:10: tools/distill_data.py: names none of its subcommands (gen, merge, vocab)",
        "docs/X.md:11: dev/op_count.py: unknown flag --kk",
        "docs/X.md:13: tools.missing: no such program",
        "docs/X.md:16: tools/inflate.py: unknown flag --liek"]


def test_a_folder_readme_row_names_flags_of_its_program():
    text = ("| `bench.py` | passes (`--passes auto`, `--passes N`, `--pases 3`) | "
            "`python tools/bench.py --k 3` |\n"
            "| `distill_data.py` | shards (`gen`, `--seed`), merged (`merge`, `--sed`) | |")
    failures = command_failures(doc(text, "tools/README.md"), {})
    assert failures == ["tools/README.md:1: tools/bench.py: unknown flag --pases",
                        "tools/README.md:2: tools/distill_data.py: unknown flag --sed"]


def test_a_bad_bench_mode_is_reported():
    text = ("```\npython3 tools/bench.py --device cuda --modes ar,sd:draft=EAGLE,ssd:kk=3 \\\n"
            "    --k 3\npython3 tools/bench.py --modes MODES\n"
            "python3 tools/bench.py --modes \"ar,ssd:fan_out_budget=many,xd\"\n```")
    failures = command_failures(doc(text), {})
    assert [f.split(": mode")[0] for f in failures] == [
        "docs/X.md:2: tools/bench.py", "docs/X.md:5: tools/bench.py", "docs/X.md:5: tools/bench.py"]
    assert "'kk=3'" in failures[0] and "fan_out_budget takes a int" in failures[1]
    assert "the engine modes are" in failures[2]


def test_the_docs_show_bench_modes_that_are_checked():
    """The mode check reads real commands: the docs hold bench commands with --modes lists."""
    specs = [c for name in doc_paths() for _, text in Doc.read(name).inline_code()
             for c in commands(text) if c.program == "tools/bench.py" and "--modes" in c.args]
    assert len(specs) >= 5
