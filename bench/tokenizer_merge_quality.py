"""Benchmark: the merged tokenizer vs one joint SentencePiece model of the same size, at several sizes.

The same real corpora as bench/tokenizer_build.py (Debian's manpages-ja, Jane Austen, the PARI/GP
manual, the Python standard library). Per size, through the product's own commands:

    ayumi tokenizer build <preset> tokenizer.total_vocab=N ... tokenizer.evaluate.baseline=true keep_work=true
    ayumi tokenizer eval OUT --texts ja=OUT.work/samples/ja.heldout.jsonl ... --compare joint=OUT/baseline/joint_baseline.model

8k uses the demo_8k preset's shares; 16k/32k/50k the ja_en_math_code_50k preset's shares (domain sizes
scaled with the total). Both models train on the same samples with the same options; the ratios are
measured on the held-out documents (never trained on). `--share-weight` sets tokenizer.merge.share_weight.

    python bench/tokenizer_merge_quality.py [--sizes 8000,16000,32000,50000] [--share-weight 0.5]

Prints, per size, merged ÷ joint total held-out tokens, and ends with one RESULT line per size and domain:
RESULT tokenizer_merge_quality_<size>_<domain> ours=<merged chars/token> baseline=<joint chars/token>
       ratio=<merged ÷ joint> target=>=0.99 ok=<true|false>
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

TARGET = ">=0.99"
"""Merged ÷ joint chars/token, per domain (bench/README.md)."""

SHARES_50K = {"ja": 30000, "en": 20000, "code": 6000, "math": 4000}
"""The 50k preset's domain sizes, scaled to other totals."""
SAMPLE_BYTES = {"ja": 8_000_000, "en": 8_000_000, "code": 2_000_000, "math": 2_000_000}
"""The 50k preset's sample proportions (40/40/10/10 %), as much as the corpora hold."""


def overrides(size: int, corpora: dict[str, Path], out: Path, share_weight: float | None) -> list[str]:
    common = [f"output_dir={out}", "overwrite=true", "keep_work=true", "tokenizer.pad_to_multiple_of=0",
              "tokenizer.evaluate.baseline=true", "tokenizer.sample.heldout_fraction=0.1",
              "tokenizer.sample.heldout_max_bytes=400000", "tokenizer.merge.em_sample_bytes=100000000"]
    common += [f"tokenizer.inputs.{d}={p}" for d, p in corpora.items()]
    if share_weight is not None:
        common.append(f"tokenizer.merge.share_weight={share_weight}")
    if size == 8000:
        return ["tokenizer=demo_8k"] + common
    scaled = [f"tokenizer.domains.{d}.vocab_size={round(v * size / 50000)}" for d, v in SHARES_50K.items()]
    scaled += [f"tokenizer.domains.{d}.sample_bytes={v}" for d, v in SAMPLE_BYTES.items()]
    return ["tokenizer=ja_en_math_code_50k", f"tokenizer.total_vocab={size}", "tokenizer.num_threads=2"] + common + scaled


def ayumi(*args: str) -> str:
    cli = Path(sys.executable).with_name("ayumi")  # the venv's console script, as a user runs it
    run = subprocess.run([str(cli), *args], cwd=REPO, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"ayumi {' '.join(args[:2])} failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    return run.stdout


def measure(size: int, corpora: dict[str, Path], work: Path, share_weight: float | None) -> dict:
    out = work / f"merged_{size}"
    ayumi("tokenizer", "build", *overrides(size, corpora, out, share_weight))
    samples = Path(str(out) + ".work") / "samples"
    texts = [f"{d}={samples / f'{d}.heldout.jsonl'}" for d in corpora]
    report = work / f"eval_{size}.json"
    ayumi("tokenizer", "eval", str(out), "--texts", *texts, "--compare",
          f"joint={out / 'baseline' / 'joint_baseline.model'}", "--json", str(report))
    results = json.loads(report.read_text())["results"]
    merged, joint = results[out.name], results["joint"]
    chars_per_token = {d: (merged["domains"][d]["chars_per_token"], joint["domains"][d]["chars_per_token"]) for d in corpora}
    meta = json.loads((out / "tokenizer_meta.json").read_text())
    return {"chars_per_token": chars_per_token, "tokens": merged["all"]["tokens"] / joint["all"]["tokens"],
            "pieces_by_domain": meta["pieces_by_domain"], "timings": meta["timings"]}


def main() -> int:
    from tokenizer_build import prepare_corpora

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "bench" / "tokenizer_build")
    parser.add_argument("--sizes", default="8000,16000,32000,50000")
    parser.add_argument("--share-weight", type=float, default=None, help="tokenizer.merge.share_weight (default: the preset's)")
    args = parser.parse_args()
    print(machine_line())
    corpora = prepare_corpora(args.work)
    print(f"[bench] corpora: { {d: f'{p.stat().st_size / 1e6:.1f} MB' for d, p in corpora.items()} }")
    work = args.work / "merge_quality"
    work.mkdir(parents=True, exist_ok=True)
    lines = []
    for size in (int(s) for s in args.sizes.split(",")):
        found = measure(size, corpora, work, args.share_weight)
        print(f"[bench] {size}: learned pieces by the domain that uses them most {found['pieces_by_domain']}; "
              f"timings {', '.join(f'{k} {v:.0f}s' for k, v in found['timings'].items())}; merged ÷ joint total "
              f"held-out tokens {found['tokens']:.3f}", flush=True)
        # Chars/token of fixed models on fixed held-out text: one measurement (n=1) per domain.
        lines += [result_line(f"tokenizer_merge_quality_{size}_{d}", merged, joint, TARGET, unit="chars/tok")
                  for d, (merged, joint) in found["chars_per_token"].items()]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
