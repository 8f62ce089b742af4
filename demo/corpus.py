"""`ayumi demo corpus`: real Japanese, English, math and code text for the demo, built offline.

The demo trains on real text, never generated filler. Four openly licensed sources are fetched
from Debian's archive with `apt-get download` (never installed: `dpkg-deb -x` unpacks them into a
cache) or read from this machine (docs/demo-corpus.md has the figures behind the choices):

    domain    source                                   one document per
    ja_*      manpages-ja: troff man pages, groff     man page (symlinks and `.so` aliases skipped)
    en        r-cran-janeaustenr: R lazy-load database chapter of Jane Austen's six novels
    math      pari-doc: PARI/GP manual and tutorials   (sub)section, `$…$` formulas kept
    code      this Python's standard library           .py file (1 kB–500 kB, no tests)

Japanese comes in two domains, as a curation team would derive them from one crawl: `ja_raw` is
every rendered page, `ja_clean` the pages that pass a quality filter (share of kana/kanji among
the letters, length, symbol density; demo/manpages.py). The curriculum trains on the noisier
domain first and the cleaner one later. `ja_clean` is a subset of `ja_raw` with identical texts,
so data preparation's train/val overlap check sees shared documents (give both the same
val_fraction).

Output, under `${AYUMI_DATA_ROOT:-.cache}/demo_corpus` unless `--out` says otherwise:

    ja_raw.jsonl ja_clean.jsonl en.jsonl math.jsonl code.jsonl   {"text": ..., "source": ...} per line
    corpus_manifest.json                                          docs/chars per domain, versions, filter
    licenses/<package>.copyright                                  each source's licence, beside its text

The folder is written whole into a temporary sibling and renamed into place, so a reader never
sees half a corpus; a complete corpus is reused by the next call (`--force` rebuilds it).

Without apt-get (not Debian/Ubuntu) or when a download fails, the code domain is still built and
the message says how to bring your own text: `--use DOMAIN=FILE.jsonl` (a `text` field per line).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.files import replace_dir
from demo import austen, debian, manpages, pari, python_code
from demo.base import DemoCorpusError, Progress, SourceUnavailable

DOMAINS = ("ja_raw", "ja_clean", "en", "math", "code")
MANIFEST_NAME = "corpus_manifest.json"
FORMAT_VERSION = 1  # bump when the recipe changes so cached corpora are rebuilt

PACKAGES = (manpages.PACKAGE, austen.PACKAGE, pari.PACKAGE)
"""The Debian packages the built-in sources come from (python_code reads this machine's library)."""

__all__ = ["DOMAINS", "MANIFEST_NAME", "PACKAGES", "DemoCorpusError", "SourceUnavailable", "build_demo_corpus",
           "default_out_dir", "load_manifest", "main_corpus", "own_data_hint", "parse_use", "read_user_jsonl"]


def default_out_dir() -> Path:
    """`${AYUMI_DATA_ROOT:-.cache}/demo_corpus`: the data root the rest of ayumi uses."""
    return Path(os.environ.get("AYUMI_DATA_ROOT", ".cache")) / "demo_corpus"


# --------------------------------------------------------------------------------------------
# Your own text: --use DOMAIN=FILE.jsonl
# --------------------------------------------------------------------------------------------


def own_data_hint(out_dir: Path) -> str:
    """How to point the demo at your own text instead of the Debian packages."""
    return (
        "To use your own text instead, give one JSONL file per domain (one JSON object per line with a "
        "\"text\" field):\n"
        f"  ayumi demo corpus --out {out_dir} --use ja_raw=ja.jsonl --use en=en.jsonl --use math=math.jsonl\n"
        "(ja_clean is then filtered from ja_raw unless you give it too; code comes from this Python's "
        "standard library unless you give --use code=...)."
    )


def read_user_jsonl(domain: str, path: Path) -> list[dict]:
    """Documents of a user's JSONL file for `domain`; DemoCorpusError names the file, line and fix."""
    path = Path(path)
    if not path.is_file():
        raise DemoCorpusError(f"--use {domain}={path}: no such file")
    docs = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DemoCorpusError(f"--use {domain}={path}:{number}: not JSON ({err.msg}); "
                                      "one JSON object per line, e.g. {\"text\": \"...\"}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DemoCorpusError(f"--use {domain}={path}:{number}: needs a string \"text\" field")
            if record["text"].strip():
                docs.append({"text": record["text"], "source": f"user:{path.name}:{number}"})
    if not docs:
        raise DemoCorpusError(f"--use {domain}={path}: no non-empty \"text\" records")
    return docs


# --------------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------------

DOMAIN_SOURCES = {
    "ja_raw": (manpages.PACKAGE, "per page: GPL, BSD, Linux man-pages licences (licenses/manpages-ja.copyright)"),
    "ja_clean": (manpages.PACKAGE, "per page: GPL, BSD, Linux man-pages licences (licenses/manpages-ja.copyright)"),
    "en": (austen.PACKAGE, "texts public domain; package MIT (licenses/r-cran-janeaustenr.copyright)"),
    "math": (pari.PACKAGE, "GPL-2+ (licenses/pari-doc.copyright)"),
    "code": (python_code.SOURCE, "PSF-2.0 (licenses/python.LICENSE)"),
}


@dataclass
class BuildState:
    """What the build has so far: documents per domain, facts for the manifest, what is missing."""

    docs: dict[str, list[dict]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    packages: dict[str, dict] = field(default_factory=dict)
    licenses: dict[str, Path] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    ja_filter: dict = field(default_factory=dict)


def build_demo_corpus(out_dir: Path | None = None, force: bool = False, progress: Progress = print,
                      user_files: dict[str, Path] | None = None, cache_dir: Path | None = None) -> dict:
    """Build (or reuse) the demo corpus in out_dir and return its manifest.

    A complete corpus already in out_dir is returned at once unless `force`. `user_files` maps
    domains to the user's JSONL files, used instead of the built-in sources. Domains that cannot
    be built are listed in the manifest's `missing` (with the reason) and `complete` is False;
    such a corpus is rebuilt on the next call. Debian packages are cached in cache_dir (default:
    a `demo_packages` folder beside out_dir).
    """
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir()
    user_files = {domain: Path(path) for domain, path in (user_files or {}).items()}
    unknown = sorted(set(user_files) - set(DOMAINS))
    if unknown:
        raise DemoCorpusError(f"unknown domain(s) {unknown} in --use; the demo's domains are {', '.join(DOMAINS)}")
    cached = load_manifest(out_dir)
    if cached and cached.get("complete") and not force and not user_files:
        progress(f"demo corpus: {out_dir} (cached; --force rebuilds)")
        return cached
    started = time.perf_counter()
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir.parent / "demo_packages"
    state = BuildState()
    _collect_documents(state, cache_dir, user_files, progress)
    if state.missing and cached and cached.get("complete"):
        # A forced rebuild that cannot fetch its sources must not replace a complete corpus.
        reasons = "\n".join(sorted(set(state.missing.values())))
        progress(f"demo corpus: rebuild incomplete ({', '.join(sorted(state.missing))} unavailable); "
                 f"kept the existing complete corpus in {out_dir}:\n{reasons}")
        return cached
    manifest = _write_corpus(out_dir, state, time.perf_counter() - started)
    _report(manifest, out_dir, progress)
    return manifest


def load_manifest(out_dir: Path) -> dict | None:
    """The corpus manifest in out_dir, or None when absent, unreadable or of an older recipe."""
    try:
        manifest = json.loads((Path(out_dir) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format_version") != FORMAT_VERSION:
        return None
    if not all((Path(out_dir) / info["file"]).is_file() for info in manifest.get("domains", {}).values()):
        return None
    return manifest


def _collect_documents(state: BuildState, cache_dir: Path, user_files: dict[str, Path], progress: Progress) -> None:
    for domain, path in user_files.items():
        state.docs[domain] = read_user_jsonl(domain, path)
        state.sources[domain] = f"user file {path.resolve()}"
    needed = _packages_needed(user_files)
    packages = _fetch_or_note_missing(state, needed, cache_dir, progress)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        # groff runs as subprocesses on the pool while this thread converts the other sources.
        ja_pending = _start_japanese(packages[manpages.PACKAGE], pool, progress) if manpages.PACKAGE in packages else None
        if austen.PACKAGE in packages:
            progress("English: reading Jane Austen's novels from the R lazy-load database ...")
            state.docs["en"] = austen.austen_docs(packages[austen.PACKAGE])
        if pari.PACKAGE in packages:
            progress("math: splitting the PARI/GP manual into sections ...")
            state.docs["math"] = pari.pari_docs(packages[pari.PACKAGE])
        if "code" not in user_files:
            stdlib = python_code.stdlib_dir()
            progress(f"code: Python {sys.version.split()[0]} standard library ({stdlib}) ...")
            state.docs["code"] = python_code.code_docs(stdlib)
            state.sources["code"] = f"Python {sys.version.split()[0]} standard library, {stdlib}"
            license_file = python_code.python_license(stdlib)
            if license_file:
                state.licenses["python.LICENSE"] = license_file
        if ja_pending is not None:
            state.docs["ja_raw"] = [doc for doc in (future.result() for future in ja_pending) if doc]
    _derive_ja_clean(state, user_files)


def _packages_needed(user_files: dict[str, Path]) -> list[str]:
    """The Debian packages whose domains the user did not bring (a user's ja_raw replaces the man pages)."""
    replaced_by = {manpages.PACKAGE: "ja_raw", austen.PACKAGE: "en", pari.PACKAGE: "math"}
    return [name for name in PACKAGES if replaced_by[name] not in user_files]


def _fetch_or_note_missing(state: BuildState, names: list[str], cache_dir: Path, progress: Progress) -> dict[str, debian.Package]:
    """The packages that could be had; the domains of the others go to state.missing with the reason."""
    if not names:
        return {}
    try:
        if manpages.PACKAGE in names:
            manpages.ensure_groff(progress)
    except SourceUnavailable as err:
        _note_missing(state, [manpages.PACKAGE], str(err))
        names = [name for name in names if name != manpages.PACKAGE]
    try:
        packages = debian.fetch_packages(names, cache_dir, progress)
    except SourceUnavailable as err:
        _note_missing(state, names, str(err))
        return {}
    for package in packages.values():
        state.packages[package.name] = {"version": package.version, "deb": package.deb.name}
        state.licenses[f"{package.name}.copyright"] = package.copyright
    for domain, (source, _) in DOMAIN_SOURCES.items():
        if source in packages and domain not in state.docs:
            state.sources[domain] = f"Debian {source} {packages[source].version}"
    return packages


def _note_missing(state: BuildState, package_names: list[str], reason: str) -> None:
    for domain, (source, _) in DOMAIN_SOURCES.items():
        if source in package_names and domain not in state.docs:
            state.missing[domain] = reason


def _start_japanese(package: debian.Package, pool: ThreadPoolExecutor, progress: Progress) -> list[Future]:
    man_root = manpages.man_root(package)
    pages = manpages.man_page_files(man_root)
    progress(f"Japanese: rendering {len(pages)} man pages with groff ...")
    return [pool.submit(manpages.man_page_doc, path, man_root) for path in pages]


def _derive_ja_clean(state: BuildState, user_files: dict[str, Path]) -> None:
    if "ja_raw" not in state.docs:
        if "ja_clean" not in state.docs:
            state.missing.setdefault("ja_clean", state.missing.get("ja_raw", "no Japanese source"))
        return
    kept, dropped = manpages.split_by_quality(state.docs["ja_raw"])
    state.ja_filter = {"thresholds": asdict(manpages.JA_CLEAN_FILTER), "input_docs": len(state.docs["ja_raw"]),
                       "kept": len(kept), "dropped": dropped}
    if "ja_clean" not in user_files:
        state.docs["ja_clean"] = kept
        state.sources["ja_clean"] = state.sources.get("ja_raw", "ja_raw") + ", quality-filtered (ja_filter)"
    state.missing.pop("ja_clean", None)


def _write_corpus(out_dir: Path, state: BuildState, seconds_so_far: float) -> dict:
    """Write every domain, the licences and the manifest to a temporary sibling, then rename it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial.", dir=out_dir.parent))
    started = time.perf_counter()
    try:
        domains = {}
        for domain in DOMAINS:
            if domain in state.docs:
                domains[domain] = _write_domain(partial, domain, state)
        (partial / "licenses").mkdir()
        for name, path in state.licenses.items():
            shutil.copyfile(path, partial / "licenses" / name)
        manifest = {
            "format_version": FORMAT_VERSION,
            "complete": not state.missing,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "build_seconds": round(seconds_so_far + time.perf_counter() - started, 1),
            "domains": domains,
            "missing": state.missing,
            "packages": state.packages,
            "python": {"version": sys.version.split()[0], "stdlib": str(python_code.stdlib_dir())},
            "ja_filter": state.ja_filter,
            "licenses": sorted(state.licenses),
        }
        (partial / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        replace_dir(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _write_domain(folder: Path, domain: str, state: BuildState) -> dict:
    docs = state.docs[domain]
    with open(folder / f"{domain}.jsonl", "w", encoding="utf-8") as handle:
        for doc in docs:
            handle.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return {"file": f"{domain}.jsonl", "docs": len(docs), "chars": sum(len(doc["text"]) for doc in docs),
            "source": state.sources.get(domain, ""), "license": DOMAIN_SOURCES[domain][1]}


def _report(manifest: dict, out_dir: Path, progress: Progress) -> None:
    progress(f"demo corpus written to {out_dir} in {manifest['build_seconds']} s:")
    for domain, info in manifest["domains"].items():
        progress(f"  {domain:<9} {info['docs']:>6,} docs {info['chars']:>12,} chars   {info['source']}")
    if manifest["ja_filter"]:
        jf = manifest["ja_filter"]
        drops = ", ".join(f"{reason} {count}" for reason, count in jf["dropped"].items()) or "none"
        progress(f"  ja_clean keeps {jf['kept']} of {jf['input_docs']} ja_raw pages (dropped: {drops})")
    for domain, reason in manifest["missing"].items():
        progress(f"  {domain:<9} MISSING: {reason.splitlines()[0]}")
    if manifest["missing"]:
        progress("\n".join(sorted(set(manifest["missing"].values()))))
        progress(own_data_hint(out_dir))


# --------------------------------------------------------------------------------------------
# CLI: `ayumi demo corpus`
# --------------------------------------------------------------------------------------------


def parse_use(values: list[str]) -> dict[str, Path]:
    """`DOMAIN=FILE` pairs from --use."""
    files = {}
    for value in values:
        domain, sep, path = value.partition("=")
        if not sep or not path:
            raise DemoCorpusError(f"--use {value!r}: expected DOMAIN=FILE.jsonl with DOMAIN one of {', '.join(DOMAINS)}")
        files[domain] = Path(path)
    return files


def main_corpus(argv: list[str]) -> int:
    """`ayumi demo corpus [--out DIR] [--force] [--use DOMAIN=FILE ...]`; 0 when complete, 1 otherwise."""
    from common.conf import config_help

    parser = argparse.ArgumentParser(prog="ayumi demo corpus", description=__doc__,
                                     epilog=config_help("no config from conf/: only the options above", overrides=False),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: $AYUMI_DATA_ROOT/demo_corpus, "
                                                               "AYUMI_DATA_ROOT defaulting to .cache)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete corpus is there")
    parser.add_argument("--use", action="append", default=[], metavar="DOMAIN=FILE",
                        help=f"your own JSONL file (a \"text\" field per line) for a domain: {', '.join(DOMAINS)}")
    args = parser.parse_args(argv)
    try:
        manifest = build_demo_corpus(args.out, force=args.force, user_files=parse_use(args.use))
    except DemoCorpusError as err:
        print(f"ayumi demo corpus: {err}", file=sys.stderr)
        return 1
    return 0 if manifest.get("complete") else 1


if __name__ == "__main__":
    sys.exit(main_corpus(sys.argv[1:]))
