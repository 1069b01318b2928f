"""Calibration prompts of several kinds of text: named sources, `KIND=SOURCE` options, captures.

A config calibrated on one kind of text (code) can miss on another (prose): some heads
are local on code and diffuse on prose. `sparseprefill calibrate --prompts KIND=SOURCE
...` takes prompts of several kinds; each head must then reach its target on every kind,
with a margin from the spread of its recall across them (`sparseprefill.margins`).

A SOURCE is one of

* a capture file (`*.pt`, from `sparseprefill eval capture`): used as it is;
* a named text source (`SOURCES`), or a UTF-8 text file: the prompt is its first tokens,
  captured with the model (`capture_prompts`) into a capture file that is reused on the
  next run.

The named sources, each a different kind of text:

| source | kind | text | where it comes from |
| --- | --- | --- | --- |
| `stdlib` | code | this Python's standard-library sources | Python itself |
| `pydoc` | manual | the `pydoc` topics (the language reference, English technical prose) | Python's `pydoc_data` |
| `austen` | novel | Jane Austen's novels, Pride and Prejudice first (narrative prose and dialogue) | Debian `r-cran-janeaustenr` (read with its `Rscript`) |
| `fortunes` | quotes | fortune cookies: quotations, jokes, riddles, short dialogues | Debian `fortunes`, `fortunes-min` |
| `debian-faq` | faq | the Debian FAQ (questions and answers, technical prose) | Debian `debian-faq` |

The defaults: `DEFAULT_PROMPTS` (code, manual, novel) to calibrate on, `DEFAULT_HELDOUT`
(quotes: a kind none of them is) to check a config on (`calibrate --eval`).
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROMPTS: dict[str, str] = {"code": "stdlib", "manual": "pydoc", "novel": "austen"}
DEFAULT_HELDOUT: dict[str, str] = {"quotes": "fortunes"}
# Pride and Prejudice first; the others follow when a prompt needs more text.
AUSTEN_BOOKS = ("prideprejudice", "sensesensibility", "emma", "persuasion", "mansfieldpark", "northangerabbey")
# Fortune files in a fixed order: literature and riddles (fortunes-min) first, then fortunes'.
FORTUNE_FILES = ("literature", "riddles", "fortunes", "people", "humorists", "wisdom", "love", "startrek",
                 "songs-poems", "education", "science", "work", "men-women", "food", "pets", "kids",
                 "platitudes", "politics", "magic", "miscellaneous", "computers", "cookie")
FORTUNE_DIR = "usr/share/games/fortunes"
DEBIAN_FAQ = "usr/share/doc/debian/FAQ/debian-faq.en.txt.gz"
_KIND = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass(frozen=True)
class TextSource:
    """A named source of prompt text.

    Attributes:
        name: what `--prompts KIND=NAME` calls it.
        kind: the kind of text it is (the default KIND).
        what: one line: the text and where it comes from.
        install: how to get it where it is not installed (empty: always there).
        read: `(min_chars, root) -> text`: whole units (files, books) until at least
            `min_chars` characters, or all of it when the source holds fewer; `root` is
            the filesystem root its package's files are under ("/" normally).
    """

    name: str
    kind: str
    what: str
    install: str
    read: Callable[[int, Path], str]


def _read_stdlib(min_chars: int, root: Path) -> str:
    from .evaluate import stdlib_text

    del root  # this Python's own files (several MB: `stdlib_text` raises if ever too few)
    return stdlib_text(min_chars)


def _read_pydoc(min_chars: int, root: Path) -> str:
    from pydoc_data.topics import topics

    del root
    return "\n\n".join(topics[key] for key in sorted(topics))


def _read_austen(min_chars: int, root: Path) -> str:
    """The novels of `r-cran-janeaustenr`, whole books in `AUSTEN_BOOKS` order until long enough.

    The package keeps each book as an R character vector (one element per line) in R's
    lazy-load database; its own dependency, R, reads it.
    """
    library = root / "usr/lib/R/site-library"
    if not (library / "janeaustenr").is_dir():
        raise FileNotFoundError(f"text source 'austen' needs the Debian package r-cran-janeaustenr "
                                f"(apt-get install r-cran-janeaustenr); not found under {library}")
    rscript = shutil.which("Rscript")
    if rscript is None:
        raise FileNotFoundError("text source 'austen' needs Rscript (Debian r-base-core, a dependency of "
                                "r-cran-janeaustenr) on PATH")
    parts: list[str] = []
    size = 0
    for book in AUSTEN_BOOKS:
        code = (f'.libPaths(c("{library}", .libPaths())); e <- new.env(); '
                f'data("{book}", package = "janeaustenr", envir = e); '
                f'cat(get("{book}", envir = e), sep = "\\n")')
        done = subprocess.run([rscript, "--vanilla", "-e", code], capture_output=True, text=True, timeout=120,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"Rscript could not read janeaustenr's {book}: {done.stderr.strip()[-400:]}")
        parts.append(done.stdout.strip() + "\n\n")
        size += len(parts[-1])
        if size >= min_chars:
            break
    return "".join(parts)


def _read_fortunes(min_chars: int, root: Path) -> str:
    """Fortune cookies, files in `FORTUNE_FILES` order, the `%` separators as blank lines."""
    folder = root / FORTUNE_DIR
    present = [folder / name for name in FORTUNE_FILES if (folder / name).is_file()]
    if not present:
        raise FileNotFoundError(f"text source 'fortunes' needs the Debian package fortunes (or fortunes-min): "
                                f"apt-get install fortunes; no fortune file under {folder}")
    parts: list[str] = []
    size = 0
    for path in present:
        cookies = [c.strip("\n") for c in path.read_text(encoding="utf-8", errors="replace").split("\n%\n")]
        parts.append("\n\n".join(c for c in cookies if c.strip() and c.strip() != "%") + "\n\n")
        size += len(parts[-1])
        if size >= min_chars:
            break
    return "".join(parts)


def _read_debian_faq(min_chars: int, root: Path) -> str:
    path = root / DEBIAN_FAQ
    if not path.is_file():
        raise FileNotFoundError(f"text source 'debian-faq' needs the Debian package debian-faq "
                                f"(apt-get install debian-faq); {path} not found")
    return gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace")


SOURCES: dict[str, TextSource] = {s.name: s for s in (
    TextSource("stdlib", "code", "this Python's standard-library sources", "", _read_stdlib),
    TextSource("pydoc", "manual", "Python's pydoc topics (the language reference, technical prose)", "",
               _read_pydoc),
    TextSource("austen", "novel", "Jane Austen's novels, Pride and Prejudice first (prose and dialogue)",
               "apt-get install r-cran-janeaustenr", _read_austen),
    TextSource("fortunes", "quotes", "fortune cookies: quotations, jokes, riddles, short dialogues",
               "apt-get install fortunes", _read_fortunes),
    TextSource("debian-faq", "faq", "the Debian FAQ (questions and answers, technical prose)",
               "apt-get install debian-faq", _read_debian_faq),
)}


@dataclass(frozen=True)
class Prompt:
    """One calibration (or held-out) prompt.

    Attributes:
        kind: the kind of text (what the per-head margin compares across).
        source: a `SOURCES` name, a text file or a capture file, as given.
    """

    kind: str
    source: str

    @property
    def is_capture(self) -> bool:
        """Whether the source is a capture file (used as it is, no model needed)."""
        return self.source.endswith(".pt")


def parse_prompts(items: Sequence[str] | None, *, defaults: Mapping[str, str] = DEFAULT_PROMPTS) -> list[Prompt]:
    """The prompts of `--prompts KIND=SOURCE ...`.

    Args:
        items: the option's values; `KIND=SOURCE`, or a bare `SOURCE` (a `SOURCES` name:
            its own kind). An empty list: `defaults`.
        defaults: `{kind: source}` used for an empty list.

    Returns:
        One `Prompt` per item, in order.

    Raises:
        ValueError: a kind that is not a lower-case word, a bare source that is not a
            named source, an unknown name that is not a file path, a source given twice.
    """
    if items is None:
        return []
    if not items:
        items = [f"{kind}={source}" for kind, source in defaults.items()]
    out: list[Prompt] = []
    for item in items:
        kind, sep, source = item.partition("=")
        if not sep:
            if item not in SOURCES:
                raise ValueError(f"--prompts {item!r}: expected KIND=SOURCE, or the name of a text source "
                                 f"({', '.join(SOURCES)})")
            kind, source = SOURCES[item].kind, item
        if not _KIND.match(kind):
            raise ValueError(f"--prompts {item!r}: the kind must be a lower-case word (letters, digits, - or _), "
                             f"got {kind!r}")
        if not source:
            raise ValueError(f"--prompts {item!r}: empty SOURCE")
        if source not in SOURCES and not (source.endswith(".pt") or Path(source).is_file()):
            raise ValueError(f"--prompts {item!r}: {source!r} is neither a text source ({', '.join(SOURCES)}) "
                             "nor a file (a text file, or a capture *.pt)")
        out.append(Prompt(kind, source))
    seen = [p.source for p in out]
    twice = sorted({s for s in seen if seen.count(s) > 1})
    if twice:
        raise ValueError(f"--prompts: source given twice: {', '.join(twice)}")
    return out


def read_text(source: str, min_chars: int = 0, *, root: Path | None = None) -> str:
    """The text of a named source or a text file: whole units until `min_chars` characters,
    or all of it when the source holds fewer.

    Args:
        source: a `SOURCES` name or a UTF-8 text file.
        min_chars: the characters wanted.
        root: where the Debian packages' files are (default `$SPARSEPREFILL_TEXT_ROOT`,
            else "/"): a folder a `.deb` was unpacked into (`dpkg-deb -x`) works too.

    Raises:
        FileNotFoundError: the source's package is not installed (the message says how).
    """
    if root is None:
        root = Path(os.environ.get("SPARSEPREFILL_TEXT_ROOT", "/"))
    if source in SOURCES:
        return SOURCES[source].read(min_chars, root)
    return Path(source).read_text(encoding="utf-8")


def prompt_text(source: str, tokenizer: Any, n_tokens: int, *, root: Path | None = None) -> str:
    """The shortest text of a source (in its whole units, doubling) that holds `n_tokens` tokens.

    For `stdlib` this is `evaluate.stdlib_prompt`'s text (the same doubling from 6
    characters a token), so a `code=stdlib` capture equals `eval capture`'s default.

    Raises:
        ValueError: the whole source holds fewer tokens.
    """
    chars = 6 * n_tokens
    while True:
        text = read_text(source, chars, root=root)
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if count >= n_tokens:
            return text
        if len(text) < chars:
            raise ValueError(f"text source {source!r} holds {count} tokens, fewer than {n_tokens}")
        chars *= 2


def capture_name(model: str, seqlen: int, prompt: Prompt) -> str:
    """The capture file's name for a text prompt: model, length, kind and source."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(prompt.source).stem if prompt.source not in SOURCES
                  else prompt.source).strip("-")
    return f"qkv-{model}-{seqlen}-{prompt.kind}-{stem}.pt"


def capture_prompts(prompts: Sequence[Prompt], *, model: str, seqlen: int, layers: Sequence[int],
                    folder: Path, device: str = "cpu", log: Any = None,
                    load: Callable[[str, str], tuple[Any, Any]] | None = None) -> list[Path]:
    """The capture file of every prompt: a capture source as it is, a text captured once.

    A text prompt's capture (`capture_name` in `folder`) is reused when it exists and
    holds `layers` at `seqlen`; else the model is loaded (once) and the first `seqlen`
    tokens of the text are run through it (`evaluate.capture`).

    Args:
        prompts: from `parse_prompts`.
        model: "smollm2" or "gemma3-270m".
        seqlen: prompt tokens.
        layers: the attention layers to capture.
        folder: where captures are written.
        device: where the model runs.
        log: a stream for progress lines (default stderr).
        load: `(model, device) -> (model, tokenizer)` (default: the `evaluate` loaders).

    Returns:
        One capture path per prompt, in order.

    Raises:
        FileNotFoundError: a capture source or a text source's package is missing.
        ValueError: `seqlen` or `layers` out of range.
    """
    import torch

    from . import evaluate

    if seqlen < 1:
        raise ValueError(f"seqlen must be >= 1, got {seqlen}")
    if not layers or any(layer < 0 for layer in layers):
        raise ValueError(f"layers must be a non-empty list of indices >= 0, got {list(layers)}")
    log = sys.stderr if log is None else log
    loaded: tuple[Any, Any] | None = None
    out: list[Path] = []
    for prompt in prompts:
        if prompt.is_capture:
            if not Path(prompt.source).is_file():
                raise FileNotFoundError(f"capture {prompt.source} (kind {prompt.kind}) not found")
            out.append(Path(prompt.source))
            continue
        path = folder / capture_name(model, seqlen, prompt)
        if path.is_file():
            held = torch.load(path, map_location="cpu")
            if set(layers) <= set(held.get("layers", [])) and int(held["q"][0].shape[2]) >= seqlen:
                print(f"  {prompt.kind}: reusing {path}", file=log, flush=True)
                out.append(path)
                continue
        if loaded is None:
            loaded = (load or _load_model)(model, device)
        lm, tokenizer = loaded
        text = prompt_text(prompt.source, tokenizer, seqlen)
        name = evaluate.MODEL_FILE if model == "smollm2" else "gemma-3-270m-q4_k_m.gguf"
        what = SOURCES[prompt.source].what if prompt.source in SOURCES else prompt.source
        print(f"  {prompt.kind}: capturing {seqlen} tokens of {what} (layers {list(layers)})", file=log, flush=True)
        evaluate.capture(lm, tokenizer, seqlen=seqlen, layers=layers, path=path, model_name=name,
                         text=text, text_name=f"{prompt.kind}: {what}")
        out.append(path)
    return out


def _load_model(model: str, device: str) -> tuple[Any, Any]:
    from . import evaluate

    if model == "gemma3-270m":
        return evaluate.load_gemma3(device=device)
    if model == "smollm2":
        return evaluate.load_smollm2(device=device)
    raise ValueError(f"model must be 'smollm2' or 'gemma3-270m', got {model!r}")


__all__ = [
    "DEFAULT_HELDOUT",
    "DEFAULT_PROMPTS",
    "SOURCES",
    "Prompt",
    "TextSource",
    "capture_name",
    "capture_prompts",
    "parse_prompts",
    "prompt_text",
    "read_text",
]
