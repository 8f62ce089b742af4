"""`ayumi tokenizer build | eval | sweep | export | expand`.

  build  [key=value ...]                     sample, train per domain, merge, export, evaluate
  eval   TOKENIZER_DIR --texts ja=F en=F ... [--compare NAME=PATH ...] [--json OUT]
  sweep  [key=a,b,c ...]                     build each combination, one comparison table
  export MODEL_FILE OUT_DIR                  exact HF files for a SentencePiece model
  expand BASE SOURCE --vocab N --out DIR     a base tokenizer plus new pieces, base ids kept

build/sweep take Hydra overrides over conf/tokenizer_build.yaml; `--cfg job` prints the resolved config.
Every verb answers -h/--help with its usage and the config it reads, and starts nothing. Bad input (a
config value, an argument, a missing or unusable file named) is one line and exit status 2 (common/status.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from common.conf import asks_for_help, command_help, composed_from, config_help, fields_help
from common.status import BAD_INPUT, DONE

USAGE = "usage: ayumi tokenizer build | eval | sweep | export | expand [ARGS]\n\n" + __doc__.split("\n", 2)[2]

VERB_HELP = {
    "build": ("ayumi tokenizer build [key=value ...] [--cfg job]",
              "Sample each domain's corpus, train one SentencePiece model per domain, merge them into one model\n"
              "of exactly tokenizer.total_vocab pieces, export the Hugging Face files and evaluate per domain."),
    "sweep": ("ayumi tokenizer sweep [key=a,b,c ...] [--cfg job]",
              "Build every combination of the comma-separated values (one shared sample) and print one\n"
              "comparison table (chars/token per domain, against a joint baseline); `--cfg job` lists the candidates."),
}
"""Help of the verbs that take Hydra overrides (eval and export have argparse parsers)."""

NO_CONFIG = "no config from conf/: only the files named on the command line"


class UsageError(ValueError):
    """An argument argparse cannot check itself (e.g. `--texts` without NAME=PATH); exit status 2."""


def verb_help(verb: str) -> str:
    """The help of a verb that composes conf/tokenizer_build.yaml: usage, what it does, the config and its fields."""
    from tokenizer.config import TokenizerBuildConfig

    usage, about = VERB_HELP[verb]
    return (command_help(usage, about, composed_from("tokenizer_build", "tokenizer")) + "\n\n"
            + fields_help(TokenizerBuildConfig, "tokenizer/config.py"))


def compose(overrides: list[str]):
    """The composed `tokenizer_build` config (a DictConfig) for these overrides."""
    from common.conf import compose as compose_conf
    from tokenizer.config import TokenizerBuildConfig, register_configs

    # One line with "did you mean" or the '+' a new key needs, as train's.
    return compose_conf("tokenizer_build", overrides, register_configs, schema=TokenizerBuildConfig)


def to_object(cfg):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


def _split_flags(argv: list[str]) -> tuple[list[str], bool]:
    show = False
    rest = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--cfg":
            show = True
            skip = i + 1 < len(argv) and argv[i + 1] in ("job", "all")
            continue
        rest.append(arg)
    return rest, show


def cmd_build(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    from tokenizer.build import build_tokenizer

    from tokenizer.config import check_tokenizer_config, enabled_domains

    overrides, show = _split_flags(argv)
    cfg = compose(overrides)
    job = to_object(cfg)
    # Before `--cfg job` prints: every value it shows is one a build accepts (inputs may still be unset).
    check_tokenizer_config(enabled_domains(job.tokenizer), inputs_required=not show)  # disabled domains need no inputs
    if show:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        return 0
    job.tokenizer = enabled_domains_logged(job.tokenizer)
    build_tokenizer(job.tokenizer, Path(job.output_dir), overwrite=job.overwrite, keep_work=job.keep_work)
    return 0


def enabled_domains_logged(tok):
    """tok without its disabled domains (tokenizer.domains.X.enabled=false), saying how the sizes moved."""
    from tokenizer.config import enabled_domains

    kept = enabled_domains(tok)
    if kept is not tok:
        dropped = sorted(set(tok.domains) - set(kept.domains))
        sizes = ", ".join(f"{d} {tok.domains[d].vocab_size}→{c.vocab_size}" for d, c in kept.domains.items())
        print(f"[config] without {', '.join(dropped)}: domain vocab sizes renormalised ({sizes}; "
              "sizes set on the command line are scaled too, see docs/tokenizer.md)")
    return kept


def sweep_candidates(overrides: list[str]) -> list[list[str]]:
    """Cartesian product of comma-separated override values (Hydra's sweep syntax)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


def cmd_sweep(argv: list[str]) -> int:
    from tokenizer.build import build_tokenizer, sample_all
    from tokenizer.config import check_tokenizer_config, enabled_domains

    overrides, show = _split_flags(argv)
    candidates = sweep_candidates(overrides)
    jobs = []
    for combo in candidates:
        job = to_object(compose(combo))
        check_tokenizer_config(enabled_domains(job.tokenizer), inputs_required=not show)  # every candidate, first
        job.tokenizer = enabled_domains_logged(job.tokenizer)
        label = ",".join(o for o in combo if o not in overrides) or "base"
        _scale_domain_vocab(job.tokenizer, compose([o for o in combo if "total_vocab" not in o]))
        job.tokenizer.name = f"{job.tokenizer.name}-{label.replace('=', '_').replace(',', '-').replace('/', '_')}"
        jobs.append((label, job))
    if show:
        for label, job in jobs:
            print(f"# {label}: total_vocab={job.tokenizer.total_vocab}, domains="
                  f"{ {d: c.vocab_size for d, c in job.tokenizer.domains.items()} }")
        return 0
    root = Path(jobs[0][1].output_dir).parent
    samples = sample_all(jobs[0][1].tokenizer, root / ".sweep-work")  # candidates share one sample
    rows = []
    for label, job in jobs:
        out = root / job.tokenizer.name
        meta = _build_filling(job.tokenizer, out, samples, build_tokenizer)
        results = json.loads((out / "eval.json").read_text())["results"]
        rows.append((label, meta["vocab_size"], results))
    print(format_sweep(rows))
    (root / "sweep.json").write_text(json.dumps([{"candidate": l, "vocab_size": v, "results": r} for l, v, r in rows], indent=2))
    return 0


def _build_filling(tok, out: Path, samples, build_tokenizer, attempts: int = 3):
    """Build one sweep candidate; if its domain models come up short of pieces after
    de-duplication, grow them by the shortfall (+10%) and retrain, so every candidate fills its size."""
    from tokenizer.merge import VocabShortfall

    for attempt in range(attempts):
        try:
            return build_tokenizer(tok, out, overwrite=True, samples=samples)
        except VocabShortfall as err:
            if attempt == attempts - 1:
                raise
            learned = sum(d.vocab_size for d in tok.domains.values())
            grow = 1.0 + err.missing / learned + 0.1
            print(f"[sweep] {tok.name}: {err.missing} pieces short after de-duplication; "
                  f"retraining the domain models {100 * (grow - 1):.0f}% larger")
            for dcfg in tok.domains.values():
                dcfg.vocab_size = round(dcfg.vocab_size * grow)


SWEEP_HEADROOM = 1.1
"""Extra learned pieces per candidate domain model: de-duplication across domains typically removes
5-10%, and the merge only takes what it needs, so spare pieces cost training time, not quality."""


def _scale_domain_vocab(tok, base_cfg) -> None:
    """When a sweep changes total_vocab, scale each domain's *learned* pieces with it (the 256 byte
    pieces and the specials are fixed in every model) so the shares stay as configured."""
    from tokenizer.config import fixed_pieces

    base_total = base_cfg.tokenizer.total_vocab
    if tok.total_vocab == base_total:
        return
    fixed = fixed_pieces(tok.specials)
    factor = (tok.total_vocab - fixed) / max(1, base_total - fixed)
    for dcfg in tok.domains.values():
        learned = max(16, dcfg.vocab_size - fixed)
        dcfg.vocab_size = fixed + round(learned * factor * SWEEP_HEADROOM)


def format_sweep(rows) -> str:
    domains = list(next(iter(rows[0][2].values()))["domains"])
    header = f"{'candidate':<36} {'vocab':>7} " + " ".join(f"{d:>9}" for d in domains + ["all"]) + "   (chars/token; baseline in brackets)"
    lines = [header]
    for label, vocab, results in rows:
        merged, base = results["merged"], results.get("joint_baseline")
        cells = []
        for d in domains + ["all"]:
            m = merged["all"] if d == "all" else merged["domains"][d]
            cell = f"{m['chars_per_token']:.3f}"
            if base:
                b = base["all"] if d == "all" else base["domains"][d]
                cell += f" [{b['chars_per_token']:.3f}]"
            cells.append(f"{cell:>9}")
        lines.append(f"{label:<36} {vocab:>7} " + " ".join(cells))
    return "\n".join(lines)


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for value in values or []:
        if "=" not in value:
            raise UsageError(f"{flag} takes NAME=PATH, got {value!r}")
        name, path = value.split("=", 1)
        pairs[name] = path
    return pairs


def cmd_eval(argv: list[str]) -> int:
    from tokenizer import evaluate as ev
    from tokenizer.info import load_tokenizer_info

    parser = argparse.ArgumentParser(prog="ayumi tokenizer eval", description="chars/token etc. per domain",
                                     epilog=config_help(NO_CONFIG, overrides=False))
    parser.add_argument("tokenizer_dir", help="a folder written by `ayumi tokenizer build` (or any .model / tokenizer.json)")
    parser.add_argument("--texts", nargs="+", required=True, metavar="DOMAIN=PATH", help="held-out text per domain")
    parser.add_argument("--compare", nargs="*", metavar="NAME=PATH", help="other tokenizers (.model or HF folder)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--json", type=Path, help="write the results here (default: <dir>/eval_<domains>.json)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    path = Path(args.tokenizer_dir)
    if path.is_dir():
        info = load_tokenizer_info(path)
        encoders = [ev.spm_encoder(path.name, info.model_path, args.threads)]
    else:
        encoders = [ev.load_encoder(path.stem, path, args.threads)]
    encoders += [ev.load_encoder(n, p, args.threads) for n, p in _pairs(args.compare, "--compare").items()]
    texts = ev.read_texts(_pairs(args.texts, "--texts"), args.text_field)
    results = ev.evaluate(encoders, texts)
    print(ev.format_table(results))
    out = args.json or ((path if path.is_dir() else path.parent) / "eval_cli.json")
    ev.write_json(results, out)
    print(f"[eval] wrote {out}")
    return 0


def cmd_export(argv: list[str]) -> int:
    from tokenizer.export_hf import export_hf

    parser = argparse.ArgumentParser(prog="ayumi tokenizer export", description="exact HF files for a SentencePiece model",
                                     epilog=config_help(NO_CONFIG, overrides=False))
    parser.add_argument("model", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    for path in export_hf(args.model, args.out_dir):
        print(path)
    return 0


def cmd_expand(argv: list[str]) -> int:
    from tokenizer.expand import expand

    parser = argparse.ArgumentParser(
        prog="ayumi tokenizer expand", epilog=config_help(NO_CONFIG, overrides=False),
        description="append a source model's best new pieces to a base SentencePiece tokenizer (every base id kept), "
                    "for continued pretraining; writes tokenizer.model, tokenizer_meta.json and the exact HF files")
    parser.add_argument("base", type=Path, help="the base tokenizer.model (Llama 2 / Mistral style), or a folder holding one")
    parser.add_argument("source", type=Path, help="SentencePiece model to take pieces from (e.g. an ayumi domain model)")
    parser.add_argument("--vocab", type=int, required=True, help="total size after expansion")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args(argv)
    result = expand(args.base, args.source, args.vocab, args.out)
    unreachable = f" ({result.skipped_unreachable} source pieces no merge could make were left out)" \
        if result.skipped_unreachable else ""
    print(f"{result.out_dir}: {result.base_size} base pieces (ids unchanged) + {result.added} new = "
          f"{result.base_size + result.added}{unreachable}")
    return 0


COMMANDS = {"build": cmd_build, "eval": cmd_eval, "sweep": cmd_sweep, "export": cmd_export, "expand": cmd_expand}


def main(argv: list[str] | None = None) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from tokenizer.build import BuildError
    from tokenizer.expand import ExpandError
    from common.conf import ConfigCompositionError, error_lines
    from tokenizer.config import TokenizerConfigError
    from tokenizer.export_hf import ExportParityError
    from tokenizer.merge import MergeError
    from tokenizer.sample import SampleError
    from common.corpus import CorpusError
    from tokenizer.train_spm import VocabTooLargeError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help") or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help", "help") else sys.stdout)
        return DONE if not argv or argv[0] in ("-h", "--help", "help") else BAD_INPUT
    if argv[0] in VERB_HELP and asks_for_help(argv[1:]):  # before Hydra, which reads --help as an override
        print(verb_help(argv[0]))
        return 0
    try:
        return COMMANDS[argv[0]](argv[1:])
    # Every error below is about what the user gave (config, corpus, files): fix the input and rerun.
    except (TokenizerConfigError, CorpusError, SampleError, VocabTooLargeError, MergeError, BuildError,
            ExpandError, ExportParityError, FileNotFoundError, UsageError) as err:
        print(f"ayumi tokenizer {argv[0]}: {err}", file=sys.stderr)
        return BAD_INPUT
    except (ConfigCompositionError, HydraException, OmegaConfBaseException) as err:
        # One line per mistake: compose names every typo of the command line.
        print(error_lines(f"ayumi tokenizer {argv[0]}: config error: ", err), file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
