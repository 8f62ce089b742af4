"""Benchmark: `ayumi tokenizer build` vs bare sentencepiece training of the same per-domain models.

Real text only (see docs/demo-corpus.md): Japanese from Debian's manpages-ja, English from
Jane Austen (r-cran-janeaustenr) and the Linux man-pages (manpages, manpages-dev), math from the PARI/GP manual (pari-doc), code from the Python
standard library. The Debian packages are fetched with `apt-get download` (no install) when
available; a domain whose package cannot be had is left out with a note (code always works).

Measured in one run, on the same samples:
  ours     = the whole builder: read + sample, train per-domain models, train the joint baseline
             is *not* counted (--no-baseline build), merge + re-estimate, evaluate, export HF;
  baseline = bare `sentencepiece` training of the same per-domain models (at the sizes the builder
             trained them: each domain's candidate pool) on the same files, with SentencePiece's
             default schedule (the builder trains its candidates with merge.pool_options);
  joint    = one joint SentencePiece training of the merged vocabulary's size on all samples (the
             second figure: ours / joint, target <= 2).
Also printed: the merged-vs-joint quality targets (chars/token per domain, total tokens), peak RSS.

    python bench/tokenizer_build.py [--scale 1.0] [--work DIR] [--threads 2]

Ends with: RESULT tokenizer_build_vs_joint ours=<s>s baseline=<s>s ratio=<r> target=<=2 ok=<true|false>
           RESULT tokenizer_build ours=<s>s baseline=<s>s ratio=<r> target=<=1.3 ok=<true|false>
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import time
import unicodedata
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

DEBS = {"ja": "manpages-ja", "en": "r-cran-janeaustenr", "math": "pari-doc"}
EN_MAN_DEBS = ("manpages", "manpages-dev")
"""English technical prose beside Austen's novels: the Linux man-pages (sections 1-8), so the English domain
holds enough distinct text for 20k+ pieces (Austen alone supports ~13k) and is not only 1810s fiction."""


# ----------------------------------------------------------------------------------------------
# Real corpora (the recipes of docs/demo-corpus.md), cached as one jsonl per domain
# ----------------------------------------------------------------------------------------------


def fetch_deb(name: str, work: Path) -> Path | None:
    """Unpack Debian package `name` under work/pkgs/name (download only, no install); None if unavailable."""
    target = work / "pkgs" / name
    if (target / ".done").exists():
        return target
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        print(f"[corpora] apt-get/dpkg-deb not found: skipping {name}", file=sys.stderr)
        return None
    debs = work / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = list(debs.glob(f"{name}_*.deb"))
    if not found:
        run = subprocess.run(["apt-get", "download", name], cwd=debs, capture_output=True, text=True)
        found = list(debs.glob(f"{name}_*.deb"))
        if not found:
            print(f"[corpora] apt-get download {name} failed: {run.stderr.strip()[-300:]}", file=sys.stderr)
            return None
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(found[0]), str(target)], check=True)
    (target / ".done").write_text(found[0].name)
    return target


def japanese_docs(pkg: Path) -> list[str]:
    """Japanese man pages (manpages-ja) as plain text."""
    return man_docs(pkg / "usr/share/man/ja")


def man_docs(root: Path) -> list[str]:
    """Man pages under root/man*/ rendered to plain text with groff, headers/footers dropped, NFC-normalised."""
    if shutil.which("groff") is None:
        print(f"[corpora] groff not found: skipping the man pages of {root}", file=sys.stderr)
        return []
    docs = []
    for page in sorted(root.glob("man*/*.gz")):
        if page.is_symlink():
            continue
        source = gzip.decompress(page.read_bytes()).decode("utf-8", "replace")
        if source.lstrip().startswith(".so "):
            continue  # an alias page
        run = subprocess.run(["groff", "-t", "-k", "-Tutf8", "-man", "-dAD=l", "-rLL=1000n", "-rcR=1", "-P-cbou"],
                             input=source.encode(), capture_output=True)
        lines = run.stdout.decode("utf-8", "replace").splitlines()[1:-1]  # header and footer lines
        text = unicodedata.normalize("NFC", "\n".join(line.rstrip() for line in lines).strip())
        # Joined source lines leave a single space between Japanese characters.
        text = re.sub(r"(?<=[\u3040-\u30ff\u4e00-\u9fff、。]) (?=[\u3040-\u30ff\u4e00-\u9fff、。])", "", text)
        if len(text) > 200:
            docs.append(text)
    return docs


class _RReader:
    """Just enough of R's XDR serialization to read character vectors and lists."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []
        assert data[:2] == b"X\n", "not an XDR R serialization"
        self.pos = 2
        version = self._int()
        self._int(), self._int()
        if version == 3:
            length = self._int()  # then the native encoding's name, not needed here
            self.pos += length

    def _int(self) -> int:
        (value,) = struct.unpack(">i", self.data[self.pos:self.pos + 4])
        self.pos += 4
        return value

    def item(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 242, 253, 251):
            return None
        if kind == 255:
            return self.refs[(flags >> 8) - 1]
        if kind == 1:
            symbol = self.item()
            self.refs.append(symbol)
            return symbol
        if kind == 9:
            n = self._int()
            if n == -1:
                return None
            text = self.data[self.pos:self.pos + n].decode("utf-8", "replace")
            self.pos += n
            return text
        if kind == 2:
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            car, cdr = self.item(), self.item()
            return [(tag, car)] + (cdr or [])
        if kind in (16, 19, 20):
            value = [self.item() for _ in range(self._int())]
        elif kind in (10, 13):
            n = self._int()
            value = list(struct.unpack(f">{n}i", self.data[self.pos:self.pos + 4 * n]))
            self.pos += 4 * n
        elif kind == 14:
            n = self._int()
            value = list(struct.unpack(f">{n}d", self.data[self.pos:self.pos + 8 * n]))
            self.pos += 8 * n
        else:
            raise ValueError(f"R type {kind} not supported")
        if has_attr:
            self.item()
        return value


def english_docs(pkg: Path) -> list[str]:
    """Jane Austen's six novels, one document per chapter, paragraphs joined into single lines."""
    base = next((pkg / "usr/lib/R/site-library/janeaustenr/data").glob("Rdata.rdx")).with_suffix("")
    index = _RReader(gzip.decompress(base.with_suffix(".rdx").read_bytes())).item()
    rdb = base.with_suffix(".rdb").read_bytes()
    docs = []
    for offset, length in index[0]:
        chunk = rdb[offset:offset + length]
        lines = _RReader(zlib.decompress(chunk[4:])).item()
        chapter: list[str] = []
        paragraph: list[str] = []
        for line in lines + [""]:
            line = (line or "").strip()
            if re.match(r"^(CHAPTER|Chapter) ", line) and chapter:
                docs.append("\n".join(chapter))
                chapter = []
            if line:
                paragraph.append(line)
            elif paragraph:
                chapter.append(" ".join(paragraph))
                paragraph = []
        if chapter:
            docs.append("\n".join(chapter))
    return [d for d in docs if len(d) > 200]


def math_docs(pkg: Path) -> list[str]:
    """PARI/GP manual and tutorials split at \\section / \\subsec headings."""
    root = pkg / "usr/share/pari/doc"
    names = [f"usersch{i}.tex" for i in range(1, 9)] + ["tutorial.tex", "tutorial-mf.tex"]
    docs = []
    for name in names:
        if (root / name).exists():
            text = (root / name).read_text("utf-8", "replace")
            docs += [part.strip() for part in re.split(r"\n(?=\\(?:section|subsec|subsubsec)\b)", text)]
    return [d for d in docs if len(d) > 200]


def code_docs() -> list[str]:
    """Python standard-library modules (no site-packages, tests or caches)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        parts = set(path.relative_to(stdlib).parts)
        if parts & {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}:
            continue
        text = path.read_text("utf-8", "replace")
        if 1000 <= len(text) <= 500_000:
            docs.append(text)
    return docs


CORPUS_VERSION = {"en": "_austen_man"}
"""A suffix per domain whose recipe changed, so a cache from an older recipe is not reused."""


def prepare_corpora(work: Path) -> dict[str, Path]:
    """One jsonl per domain under work/corpora (cached); a domain whose source is missing is left out."""
    out = work / "corpora"
    out.mkdir(parents=True, exist_ok=True)
    makers = {
        "ja": lambda: japanese_docs(pkg) if (pkg := fetch_deb(DEBS["ja"], work)) else [],
        "en": lambda: (english_docs(pkg) if (pkg := fetch_deb(DEBS["en"], work)) else []) + [
            doc for name in EN_MAN_DEBS if (man := fetch_deb(name, work)) for doc in man_docs(man / "usr/share/man")],
        "math": lambda: math_docs(pkg) if (pkg := fetch_deb(DEBS["math"], work)) else [],
        "code": code_docs,
    }
    paths = {}
    for domain, make in makers.items():
        path = out / f"{domain}{CORPUS_VERSION.get(domain, '')}.jsonl"
        if not path.exists():
            docs = make()
            if not docs:
                continue
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for doc in docs:
                    f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            tmp.rename(path)
        paths[domain] = path
    return paths


# ----------------------------------------------------------------------------------------------
# The measurement
# ----------------------------------------------------------------------------------------------

# The shipped ~50k preset scaled down: the same domain shares (ja 30 : en 20 : code 6 : math 4, summing to
# 1.2 × total) and the same sample proportions (40 / 40 / 10 / 10 % of the bytes), small enough for minutes.
def bench_overrides(corpora: dict[str, Path], scale: float, threads: int) -> list[str]:
    total = int(12000 * scale)
    sizes = {"ja": 0.6, "en": 0.4, "code": 0.12, "math": 0.08}
    sample = {"ja": 0.4, "en": 0.4, "code": 0.1, "math": 0.1}
    sample_total = int(5_000_000 * scale)
    overrides = ["tokenizer=ja_en_math_code_50k", f"tokenizer.total_vocab={total}", "tokenizer.pad_to_multiple_of=0",
                 f"tokenizer.num_threads={threads}", "tokenizer.sample.heldout_fraction=0.1",
                 "tokenizer.sample.heldout_max_bytes=400000", "tokenizer.merge.em_sample_bytes=100000000",
                 "tokenizer.evaluate.baseline=false"]
    for domain in ("ja", "en", "code", "math"):
        if domain in corpora:
            overrides += [f"tokenizer.inputs.{domain}={corpora[domain]}",
                          f"tokenizer.domains.{domain}.vocab_size={int(total * sizes[domain])}",
                          f"tokenizer.domains.{domain}.sample_bytes={int(sample_total * sample[domain])}"]
        else:
            overrides.append(f"~tokenizer.domains.{domain}")
            overrides.append(f"~tokenizer.inputs.{domain}")
    return overrides


def bare_training(cfg, samples, sizes: dict[str, int], out: Path) -> float:
    """Seconds for plain SentencePieceTrainer runs of the same per-domain models (the sizes the builder
    trained them at: its candidate pools) on the same sample files."""
    from tokenizer.train_spm import train_model, trainer_options

    start = time.time()
    for domain, dcfg in cfg.domains.items():
        train_model([samples[domain].train_path], out / domain, trainer_options(cfg, dcfg, sizes[domain]), domain)
    return time.time() - start


def trained_sizes(tokenizer_dir: Path) -> dict[str, int]:
    """The vocab size of each domain model the build wrote (domains/<d>.model)."""
    import sentencepiece as spm

    return {path.stem: spm.SentencePieceProcessor(model_file=str(path)).get_piece_size()
            for path in sorted((tokenizer_dir / "domains").glob("*.model"))}


def naive_union(model_path: Path, first_domain_model: Path) -> bytes:
    """The common shortcut for comparison: the first domain's scores kept, every other piece at score 0."""
    from tokenizer.merge import load_proto

    first = {p.piece: p.score for p in load_proto(first_domain_model).pieces}
    proto = load_proto(model_path)
    for piece in proto.pieces:
        if piece.type == piece.NORMAL:
            piece.score = first.get(piece.piece, 0.0)
    return proto.SerializeToString()


def main() -> int:
    import resource

    from tokenizer import evaluate as ev
    from tokenizer.build import _heldout_texts, build_tokenizer, hf_parity, sample_all, train_baseline
    from tokenizer.cli import compose, to_object

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "bench" / "tokenizer_build")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies vocab sizes and sample bytes")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(machine_line())

    corpora = prepare_corpora(args.work)
    print(f"[bench] corpora: { {d: f'{p.stat().st_size / 1e6:.1f} MB' for d, p in corpora.items()} }")
    job = to_object(compose(bench_overrides(corpora, args.scale, args.threads) + [f"output_dir={args.work / 'tok'}",
                                                                                    "overwrite=true"]))
    cfg = job.tokenizer
    quiet = lambda _: None  # noqa: E731

    start = time.time()
    samples = sample_all(cfg, args.work / "samples", print)
    sample_s = time.time() - start
    start = time.time()
    meta = build_tokenizer(cfg, Path(job.output_dir), overwrite=True, samples=samples, log=print)
    ours = sample_s + time.time() - start
    baseline = bare_training(cfg, samples, trained_sizes(Path(job.output_dir)), args.work / "bare")
    print(f"[bench] builder steps: sample {sample_s:.1f}s, " + ", ".join(f"{k} {v:.1f}s" for k, v in meta["timings"].items()))

    # Quality on the same samples: the joint baseline and the naive union, evaluated beside the merged model.
    out = Path(job.output_dir)
    texts = _heldout_texts(samples)
    start = time.time()
    joint = train_baseline(cfg, samples, args.work / "joint", quiet)
    joint_s = time.time() - start
    first = next(iter(cfg.domains))
    encoders = [ev.spm_encoder("merged", out / "tokenizer.model", cfg.num_threads),
                ev.spm_encoder("joint_baseline", joint, cfg.num_threads),
                ev.spm_encoder("naive_union", naive_union(out / "tokenizer.model", out / "domains" / f"{first}.model"),
                               cfg.num_threads)]
    results = ev.evaluate(encoders, texts)
    print(ev.format_table(results))
    total_bytes = sum(s.train_bytes for s in samples.values())
    mix = {d: s.train_bytes / total_bytes for d, s in samples.items()}
    for other in ("joint_baseline",):
        cmp = ev.comparison(results, "merged", other, mix=mix)
        print(f"[bench] merged vs {other}: total tokens ×{cmp['total_tokens_ratio']:.4f} (held-out as is), "
              f"×{cmp['total_tokens_ratio_mix']:.4f} (mixed in sample proportions {', '.join(f'{d} {w:.2f}' for d, w in mix.items())}); "
              f"chars/token ratio: {', '.join(f'{d} {r:.3f}' for d, r in cmp['chars_per_token_ratio'].items())}")
    cmp = ev.comparison(results, "naive_union", "merged", mix=mix)
    print(f"[bench] naive union vs merged: chars/token ratio "
          f"{', '.join(f'{d} {r:.3f}' for d, r in cmp['chars_per_token_ratio'].items())}")
    parity = hf_parity(out / "tokenizer.model", out, texts)
    print(f"[bench] HF ids vs sentencepiece, mismatching docs: {parity}")
    print(f"[bench] round-trip exact on all held-out: {all(m['roundtrip_ok'] for m in results['merged']['domains'].values())}")
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"[bench] peak RSS {rss_mb:.0f} MB; sentencepiece {__import__('sentencepiece').__version__}")
    # One timed build of each (minutes apiece): n=1, so the load fields are what to read beside them.
    print(result_line("tokenizer_build_vs_joint", ours, joint_s, "<=2", unit="s"))
    print(result_line("tokenizer_build", ours, baseline, "<=1.3", unit="s"))
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--corpora-only":
    for d, p in prepare_corpora(Path(sys.argv[2])).items():
        print(d, p, p.stat().st_size)
    sys.exit(0)

if __name__ == "__main__":
    sys.exit(main())
