"""`ayumi data prepare|inspect|verify|merge`: corpus files to token shards, a look at what was made, a full check,
many small shards into fewer large ones.

    ayumi data prepare data=NAME tokenizer_dir=DIR [key=value ...] [--cfg job]
    ayumi data prepare ... --tasks N [--task I | --local | --finish]
    ayumi data inspect DATA_ROOT [--samples N] [--chars N] [--tokenizer-dir DIR]
    ayumi data verify DATA_ROOT
    ayumi data merge DATA_ROOT [--domain D ...] [--shard-max-mb N]

`prepare` composes `conf/data_prepare.yaml` with Hydra's Compose API (overrides as in any ayumi
command; `--cfg job` prints the resolved config and exits). Exit statuses (common/status.py): bad input
(a config value, a data root or file that is missing or unreadable) is one line and 2; `verify` exits 1
when it read the shards and found damage.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from omegaconf import OmegaConf

from common.conf import asks_for_help, command_help, composed_from, config_help, fields_help
from common.status import BAD_INPUT, DONE, INTERRUPTED, REFUSED

USAGE = __doc__.split("\n\n")[1]
INSPECT_READS = "no config from conf/: DATA_ROOT's manifest.json and shards (and the tokenizer they name, to decode)"
VERIFY_READS = "no config from conf/: DATA_ROOT's manifest.json, domain records and every shard byte"
MERGE_READS = "no config from conf/: DATA_ROOT's manifest.json, domain records, shards and keys"


def prepare_help() -> str:
    """Usage, what prepare does, the config it reads and its fields (a domain's under data.domains.NAME)."""
    from data.config import DataPrepareConfig, DomainConfig

    about = command_help(
        "ayumi data prepare data=NAME tokenizer_dir=DIR [key=value ...] [--cfg job]",
        "Clean, tokenize and pack each domain's corpus files into .bin/.idx shards with a validation split and\n"
        "manifest.json (fields: data/config.py: DataPrepareConfig, DomainConfig, CleanConfig).\n"
        "--tasks N --task I runs task I of N (an array job's variable stands for --task: data/tasks.py);\n"
        "--tasks N --finish merges them; --tasks N --local runs all N here, then finishes (docs/data.md).",
        composed_from("data_prepare", "data"))
    # data.domains is dict[str, Any] in the schema (a domain is merged with DomainConfig when read): name it here.
    fields = fields_help(DataPrepareConfig, "data/config.py", entries={"data.domains": DomainConfig})
    return f"{about}\n\n{fields}"


def compose(overrides: list[str]):
    """The composed `data_prepare` config (a DictConfig) for these overrides."""
    from data.config import DataPrepareConfig, register_configs
    from common.conf import compose as compose_conf

    # One line with "did you mean" or the '+' a new key needs, as train's.
    return compose_conf("data_prepare", overrides, register_configs, schema=DataPrepareConfig)


def resolved_yaml(cfg) -> str:
    """The config as `--cfg job` prints it: interpolations resolved, each domain with its defaults filled in."""
    from data.config import DomainConfig

    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["data"]["domains"] = {
        name: OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(DomainConfig), node))
        for name, node in plain["data"]["domains"].items()
    }
    return OmegaConf.to_yaml(plain)


@contextlib.contextmanager
def _console_logging():
    """Show `ayumi.data` INFO lines on stderr while a command runs (removed after, for in-process callers)."""
    logger = logging.getLogger("ayumi.data")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[data] %(levelname)s %(message)s"))
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def _split_cfg_flag(argv: list[str]) -> tuple[bool, list[str]]:
    """(whether `--cfg job` was given, the remaining overrides); ConfigError for another `--cfg` value."""
    from data.config import ConfigError

    if "--cfg" not in argv:
        return False, list(argv)
    at = argv.index("--cfg")
    if argv[at + 1:at + 2] != ["job"]:
        raise ConfigError("only `--cfg job` is supported")
    return True, argv[:at] + argv[at + 2:]


def prepare_main(argv: list[str]) -> int:
    """`ayumi data prepare`: returns the exit status (BAD_INPUT with one clear line on a known error)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from data.config import ConfigError, prepare_config
    from data.manifest import ManifestError
    from data.prepare import PrepareError, prepare
    from data.shards import ShardFormatError
    from tokenizer import TokenizerNotFoundError
    from common.conf import ConfigCompositionError, error_lines
    from common.corpus import CorpusError

    from data.tasks import split_task_flags

    try:
        task_args, argv = split_task_flags(argv)
        show_cfg, overrides = _split_cfg_flag(argv)
        cfg = compose(overrides)
        # Checked before `--cfg job` prints: every value it shows is one prepare accepts (tokenizer_dir may be unset).
        job = prepare_config(cfg, tokenizer_required=not show_cfg)
        if show_cfg:
            print(resolved_yaml(cfg), end="")
            return 0
        with _console_logging():
            if task_args.given:
                return _prepare_tasks(task_args, job, argv)
            manifest = prepare(job)
    except (ConfigCompositionError, HydraException, OmegaConfBaseException, ConfigError, CorpusError, PrepareError,
            ManifestError, ShardFormatError, TokenizerNotFoundError) as err:
        # One line per mistake: compose names every typo of the command line.
        print(error_lines("ayumi data prepare: error: ", err), file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print("ayumi data prepare: interrupted; finished domains (and tasks' shares) are kept, re-run to continue",
              file=sys.stderr)
        return INTERRUPTED
    totals = manifest["totals"]
    count = len(manifest["domains"])
    print(f"prepared {count} domain{'s' * (count != 1)} under {cfg.data.root}: {totals['docs_kept']:,} docs, "
          f"{totals['tokens']:,} tokens, {totals['shards']} shards (see `ayumi data inspect {cfg.data.root}`)")
    return 0


def _prepare_tasks(task_args, job, overrides: list[str]) -> int:
    """`--tasks N` with `--task I` (or an array variable), `--local` or `--finish` (data/tasks.py, data/finish.py)."""
    import os

    from data.finish import finish, task_table
    from data.tasks import resolve_task, run_local, run_task

    index, tasks = resolve_task(task_args, dict(os.environ))
    if task_args.local:
        failed = run_local(overrides, tasks)
        if failed:
            print(f"ayumi data prepare: {len(failed)} of {tasks} tasks failed ({', '.join(map(str, failed[:20]))}; "
                  "their lines are above); nothing was finished. Fix the cause and run the same command again: "
                  "completed tasks are skipped", file=sys.stderr)
            return BAD_INPUT
    elif not task_args.finish:
        units = run_task(job, index, tasks)
        print(f"task {index} of {tasks} complete: {sum(unit['docs_kept'] for unit in units.values()):,} docs kept "
              f"in {len(units)} domain(s) under {job.data.root}/.tasks; when all tasks are, run it with --finish")
        return DONE
    manifest, summary = finish(job, tasks)
    print("\n".join(task_table(summary)))
    totals = manifest["totals"]
    print(f"finished {tasks} tasks into {job.data.root}: {totals['docs_kept']:,} docs, {totals['tokens']:,} tokens, "
          f"{totals['shards']} shards (see `ayumi data inspect {job.data.root}`)")
    return DONE


def inspect_main(argv: list[str]) -> int:
    """`ayumi data inspect DATA_ROOT`."""
    from data.inspect import inspect_root
    from data.manifest import ManifestError
    from data.shards import ShardFormatError
    from tokenizer import TokenizerNotFoundError

    parser = argparse.ArgumentParser(prog="ayumi data inspect", description="per-domain docs/tokens/shards and decoded samples",
                                     epilog=config_help(INSPECT_READS, overrides=False))
    parser.add_argument("root", help="DATA_ROOT written by `ayumi data prepare`")
    parser.add_argument("--samples", type=int, default=2, help="documents shown per domain and split (0 = none)")
    parser.add_argument("--chars", type=int, default=160, help="characters shown per sample")
    parser.add_argument("--tokenizer-dir", default=None, help="tokenizer folder to decode with (default: the manifest's)")
    args = parser.parse_args(argv)
    try:
        print(inspect_root(args.root, samples=args.samples, chars=args.chars, tokenizer_dir=args.tokenizer_dir))
    except (ManifestError, ShardFormatError, TokenizerNotFoundError) as err:
        print(f"ayumi data inspect: error: {err}", file=sys.stderr)
        return BAD_INPUT
    return DONE


def verify_main(argv: list[str]) -> int:
    """`ayumi data verify DATA_ROOT`: 0 when every shard matches its record, 1 (the verdict) with one line per
    problem, 2 when DATA_ROOT has no readable manifest (not a data root: nothing was verified)."""
    from data.integrity import unchecksummed_prefixes, verify_root
    from data.manifest import ManifestError, load_manifest
    from data.megatron import FULL_CHECK_BYTES

    parser = argparse.ArgumentParser(
        prog="ayumi data verify", epilog=config_help(VERIFY_READS, overrides=False),
        description="read every shard of a data root in full: files, sizes, counts, sha256 and every id below the vocabulary")
    parser.add_argument("root", help="DATA_ROOT written by `ayumi data prepare`")
    args = parser.parse_args(argv)
    try:
        manifest = load_manifest(args.root)
    except ManifestError as err:
        print(f"ayumi data verify: error: {err}", file=sys.stderr)
        return BAD_INPUT
    problems = verify_root(args.root, manifest)
    for problem in problems:
        print(f"ayumi data verify: {problem}", file=sys.stderr)
    unsummed = unchecksummed_prefixes(manifest)
    if unsummed:
        print(f"ayumi data verify: {len(unsummed)} Megatron prefix(es) checked by size, counts and ids only, not "
              f"by sha256 (over {FULL_CHECK_BYTES / 2**20:g} MiB when registered, so none was recorded; bytes "
              f"overwritten with other in-vocabulary ids go unseen): {', '.join(unsummed)}")
    shards = manifest["totals"]["shards"]
    if problems:
        print(f"{len(problems)} problem(s) in {args.root} ({shards} shards)", file=sys.stderr)
        return REFUSED
    print(f"{args.root}: all {shards} shards match their records ({manifest['totals']['tokens']:,} tokens checked)")
    return 0


def merge_main(argv: list[str]) -> int:
    """`ayumi data merge DATA_ROOT`: 0 when merged (or nothing to merge), 2 with one line on bad input."""
    from data.merge import MergeError, merge_root
    from data.manifest import ManifestError
    from data.shards import ShardFormatError

    parser = argparse.ArgumentParser(
        prog="ayumi data merge", epilog=config_help(MERGE_READS, overrides=False),
        description="rewrite a domain's many shards as fewer large ones: the same documents in the same order "
                    "(every training batch unchanged), published atomically (data/merge.py, docs/data.md)")
    parser.add_argument("root", help="DATA_ROOT written by `ayumi data prepare`")
    parser.add_argument("--domain", action="append", default=None, help="a domain to merge (repeat; default: all)")
    parser.add_argument("--shard-max-mb", type=float, default=256.0, help="largest merged shard in MiB (default 256)")
    args = parser.parse_args(argv)
    try:
        with _console_logging():
            done = merge_root(args.root, args.domain, args.shard_max_mb)
    except (MergeError, ManifestError, ShardFormatError) as err:
        print(f"ayumi data merge: error: {err}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        print("ayumi data merge: interrupted; the data root is as it was", file=sys.stderr)
        return INTERRUPTED
    for name, splits in done.items():
        print(f"{name}: " + ", ".join(f"{split} {before:,} -> {after:,} shards"
                                      for split, (before, after) in splits.items()))
    print(f"{args.root}: merged {len(done)} domain(s)" if done else f"{args.root}: nothing to merge")
    return DONE


def main(argv: list[str]) -> int:
    """Entry of `ayumi data ...` (called by pretrain/tools/cli.py)."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(f"usage: ayumi data prepare | inspect | verify | merge [ARGS]\n{USAGE}\n\nconfig: prepare reads "
              f"{composed_from('data_prepare', 'data')}; inspect, verify and merge read no config from conf/. "
              "`ayumi data VERB --help` says more.")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "prepare":
        if asks_for_help(rest):  # before Hydra, which reads --help as an override
            print(prepare_help())
            return 0
        return prepare_main(rest)
    if command == "inspect":
        return inspect_main(rest)
    if command == "verify":
        return verify_main(rest)
    if command == "merge":
        return merge_main(rest)
    print(f"ayumi data: unknown command {command!r}\nusage:\n{USAGE}", file=sys.stderr)
    return BAD_INPUT


if __name__ == "__main__":  # `python -m data.cli prepare ...`: how `--local` starts its tasks (data/tasks.py)
    sys.exit(main(sys.argv[1:]))
