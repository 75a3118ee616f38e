"""Training and held-out text of the demo model: the running interpreter's own standard library source.

Every Python ships it, so training needs no download. The module list is pinned to names present in Python 3.10,
3.11 and 3.12 and in every distribution's core package (packages contribute every .py file below them, test folders
excluded); a given Python minor version yields the same text, and `manifest()` records a digest of it so two runs can
be compared.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Top-level stdlib modules and packages present in Python 3.10-3.12, sorted; a `name.py` entry also finds the package
# `name/` where a later version turned the module into one. Removed in 3.12 (distutils, imp,
# asynchat, asyncore, smtpd), added after 3.10 (tomllib), platform-specific files, and what Linux distributions ship
# in separate packages (tkinter, turtle, idlelib, lib2to3, venv, ensurepip) are left out.
MODULES = (
    "__future__.py", "_collections_abc.py", "_compat_pickle.py", "_compression.py", "_markupbase.py", "_py_abc.py",
    "_pydecimal.py", "_pyio.py", "_sitebuiltins.py", "_strptime.py", "_threading_local.py", "_weakrefset.py",
    "abc.py", "aifc.py", "ast.py", "asyncio", "base64.py", "bdb.py", "bisect.py", "bz2.py", "cProfile.py",
    "calendar.py", "cgi.py", "cgitb.py", "chunk.py", "cmd.py", "code.py", "codecs.py", "codeop.py", "collections",
    "colorsys.py", "compileall.py", "concurrent", "configparser.py", "contextlib.py", "contextvars.py", "copy.py",
    "copyreg.py", "crypt.py", "csv.py", "ctypes", "curses", "dataclasses.py", "datetime.py", "dbm", "decimal.py",
    "dis.py", "doctest.py", "email", "enum.py", "filecmp.py", "fileinput.py", "fnmatch.py", "ftplib.py",
    "functools.py", "genericpath.py", "getopt.py", "getpass.py", "gettext.py", "glob.py", "graphlib.py", "gzip.py",
    "hashlib.py", "hmac.py", "html", "http", "imaplib.py", "imghdr.py", "importlib", "inspect.py",
    "io.py", "ipaddress.py", "keyword.py", "linecache.py", "locale.py", "logging", "lzma.py",
    "mailbox.py", "mailcap.py", "mimetypes.py", "modulefinder.py", "multiprocessing", "netrc.py", "nntplib.py",
    "ntpath.py", "nturl2path.py", "numbers.py", "opcode.py", "operator.py", "optparse.py", "os.py", "pathlib.py",
    "pdb.py", "pickle.py", "pickletools.py", "pipes.py", "pkgutil.py", "platform.py", "plistlib.py", "poplib.py",
    "posixpath.py", "pprint.py", "profile.py", "pstats.py", "pty.py", "py_compile.py", "pyclbr.py", "pydoc.py",
    "pydoc_data",
    "queue.py", "quopri.py", "random.py", "re", "reprlib.py", "rlcompleter.py", "runpy.py", "sched.py",
    "secrets.py", "selectors.py", "shelve.py", "shutil.py", "signal.py", "site.py", "smtplib.py", "sndhdr.py",
    "socket.py", "socketserver.py", "sqlite3", "sre_compile.py", "sre_constants.py", "sre_parse.py", "ssl.py",
    "stat.py", "statistics.py", "string.py", "stringprep.py", "struct.py", "subprocess.py", "sunau.py",
    "symtable.py", "sysconfig.py", "tabnanny.py", "tarfile.py", "telnetlib.py", "tempfile.py", "threading.py",
    "timeit.py", "token.py", "tokenize.py", "trace.py", "traceback.py", "tracemalloc.py", "tty.py",
    "types.py", "typing.py", "unittest", "urllib", "uu.py", "uuid.py", "warnings.py", "wave.py",
    "weakref.py", "webbrowser.py", "wsgiref", "xdrlib.py", "xml", "xmlrpc", "zipapp.py", "zipfile.py",
    "zipimport.py", "zoneinfo",
)  # fmt: skip
# Never trained on: acceptance is measured on these.
HELDOUT = ("argparse.py", "difflib.py", "fractions.py", "heapq.py", "json", "shlex.py", "textwrap.py")

# Installed packages whose Python source joins the standard library's as training text: transformers is a dependency
# of the server, so every install has it, and its ~50 MB of code keep a model of this size from memorising the
# standard library's ~9 MB (held-out loss rises after a few epochs of it alone).
EXTRA_PACKAGES = ("transformers",)

_SKIP_DIRS = ("test", "tests", "idle_test", "__pycache__")


@dataclass(frozen=True)
class Document:
    """One source file: its path relative to the stdlib root and its text."""

    name: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path, entry: str) -> list[Path]:
    path = root / entry
    if path.is_file():
        return [path]
    if not path.exists() and entry.endswith(".py"):
        path = root / entry.removesuffix(".py")  # a module that became a package (zipfile in 3.12)
    if not path.is_dir():
        raise FileNotFoundError(f"stdlib entry {entry!r} not found under {root}: this Python lacks it")
    return sorted(p for p in path.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & set(_SKIP_DIRS))


def documents(entries: tuple[str, ...], root: Path | None = None) -> list[Document]:
    """The files of `entries` in a fixed order (entry order, then sorted paths), decoded as UTF-8."""
    root = root or stdlib_root()
    docs = []
    for entry in entries:
        for path in _files(root, entry):
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                docs.append(Document(path.relative_to(root).as_posix(), text))
    return docs


def training_documents(root: Path | None = None) -> list[Document]:
    return documents(MODULES, root)


def package_documents(names: tuple[str, ...]) -> list[Document]:
    """The `.py` files of the installed packages `names` (test folders excluded), named from their site folder."""
    docs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"training text: package {name!r} is not installed")
        package = Path(next(iter(spec.submodule_search_locations)))
        docs.extend(documents((package.name,), package.parent))
    return docs


def package_versions(names: tuple[str, ...]) -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in names}


def heldout_documents(root: Path | None = None) -> list[Document]:
    return documents(HELDOUT, root)


def manifest(docs: list[Document]) -> dict:
    """What the text was: file count, characters and one digest over names and contents."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.name.encode() + b"\0" + doc.text.encode() + b"\0")
    return {"num_files": len(docs), "num_chars": sum(len(d.text) for d in docs), "sha256": h.hexdigest()}
