"""Benchmark: reusing a complete demo corpus (the "cached rebuild") vs building it.

`build_demo_corpus` on a folder that already holds a complete corpus of the current recipe reads
its manifest, checks that the domain files are there and returns: nothing is fetched, extracted or
written. tests/demo/test_corpus.py asserts that behaviour; this script times it (a wall-clock
limit in a test was flaky on a loaded machine).

    ours     = median wall time of --repeats cached calls (`build_demo_corpus(out)` on a complete corpus)
    baseline = the first build of that corpus, in the same run, with the Debian packages already
               downloaded and unpacked (untimed): groff over ~920 man pages, the R reader, the TeX
               split, the standard-library scan, the atomic write
    target   = ours <= 1000 ms (the 1.0 s the test used to assert); the ratio ours/baseline is printed
               for scale, not judged

    python bench/demo_corpus.py [--work DIR] [--repeats 20] [--packages DIR]
    python bench/demo_corpus.py --corpus .cache/demo_corpus    # time an existing corpus instead (~1 s)

With --corpus the build is skipped and the baseline is the corpus's recorded `build_seconds`
(its manifest). Building needs Debian's apt-get (and groff, installed as root if missing); without
them the script says so and measures nothing.

Ends with: RESULT demo_corpus_cached ours=<ms>ms baseline=<ms>ms ratio=<r> target=<=1000ms ok=<true|false>
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line, target_met  # noqa: E402  (first: it reads the load at the start)
from demo import corpus, debian, manpages  # noqa: E402
from demo.base import SourceUnavailable  # noqa: E402

TARGET = "<=1000ms"


def file_stamps(folder: Path) -> dict[str, tuple[int, int]]:
    return {path.relative_to(folder).as_posix(): (path.stat().st_mtime_ns, path.stat().st_size)
            for path in sorted(folder.rglob("*")) if path.is_file()}


def quiet(_: str) -> None:
    pass


def first_build(out: Path, packages: Path) -> tuple[float, dict] | None:
    """(seconds, manifest) of a full build into `out` with the packages fetched beforehand; None if impossible."""
    try:
        manpages.ensure_groff()
        debian.fetch_packages(corpus.PACKAGES, packages)  # download + unpack: untimed
    except SourceUnavailable as err:
        print(f"[demo_corpus] the demo's sources are unavailable here: nothing measured\n{err}")
        return None
    started = time.perf_counter()
    manifest = corpus.build_demo_corpus(out, force=True, cache_dir=packages, progress=quiet)
    return time.perf_counter() - started, manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=None, help="where the corpus is built (default: a temporary folder, removed afterwards)")
    p.add_argument("--packages", type=Path, default=None,
                   help="Debian package cache (default: $AYUMI_DATA_ROOT/demo_packages, the demo's own, .cache if unset)")
    p.add_argument("--corpus", type=Path, default=None, help="time this existing complete corpus instead of building one")
    p.add_argument("--repeats", type=int, default=20, help="cached calls timed (median reported)")
    args = p.parse_args(argv)
    print(machine_line())

    if args.corpus is not None:
        out = args.corpus.resolve()
        manifest = corpus.load_manifest(out)
        if not manifest or not manifest.get("complete"):
            print(f"[demo_corpus] {out} holds no complete corpus of the current recipe: run ./ayumi demo corpus first",
                  file=sys.stderr)
            return 2
        return time_cached(out, manifest, float(manifest["build_seconds"]), "its recorded build_seconds", args.repeats)
    data_root = Path(os.environ.get("AYUMI_DATA_ROOT", REPO / ".cache"))
    packages = (args.packages or data_root / "demo_packages").resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="ayumi_demo_corpus_")).resolve()
    try:
        built = first_build(work / "demo_corpus", packages)
        if built is None:
            return 0
        baseline, manifest = built
        if not manifest.get("complete"):
            print(f"[demo_corpus] the build is incomplete ({', '.join(manifest['missing'])}): nothing measured")
            return 1
        return time_cached(work / "demo_corpus", manifest, baseline, "the first build, packages already unpacked",
                           args.repeats)
    finally:
        if args.work is None:  # a corpus built only to be timed: not left behind in the temporary folder
            shutil.rmtree(work, ignore_errors=True)


def time_cached(out: Path, manifest: dict, baseline: float, what: str, repeats: int) -> int:
    """Time `repeats` cached calls on the complete corpus in `out` and print the RESULT line."""
    docs = ", ".join(f"{domain} {info['docs']}" for domain, info in manifest["domains"].items())
    print(f"corpus {out}: {docs} documents")
    stamps = file_stamps(out)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        again = corpus.build_demo_corpus(out, progress=quiet)
        times.append(time.perf_counter() - started)
        assert again == manifest, "the cached call returned another manifest"
    untouched = file_stamps(out) == stamps
    ours_ms, base_ms = 1000 * statistics.median(times), 1000 * baseline
    print(f"cached call: median {ours_ms:.2f} ms over {repeats} (min {1000 * min(times):.2f}, "
          f"max {1000 * max(times):.2f}); files untouched: {untouched}")
    print(f"baseline: {baseline:.1f} s ({what}); target: ours {TARGET}")
    # A cached call that wrote a file is wrong however fast it was (the target judges ours: no ratio needed).
    ok = target_met(TARGET, ours_ms, float("nan")) and untouched
    print(result_line("demo_corpus_cached", ours_ms, base_ms, TARGET, unit="ms", ok=ok,
                      spread=[1000 * t for t in times]))
    return 0

if __name__ == "__main__":
    sys.exit(main())
