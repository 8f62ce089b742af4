"""`ayumi tokenizer build`: sample → per-domain models → merge + re-estimate → HF export → evaluate.

Everything is written into a temporary sibling folder that is renamed onto output_dir at the very
end, so an interrupted build never leaves a folder that looks complete.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from tokenizer.config import (TokenizerConfig, check_tokenizer_config, domain_patterns, enabled_domains,
                              fixed_pieces)
from common.files import replace_dir
from tokenizer.info import MODEL_FILE, META_FILE, tokenizer_sha256
from tokenizer.sample import DomainSample, domain_subsets, sample_domain, spm_memory_estimate

Log = Callable[[str], None]


class BuildError(ValueError):
    """The build cannot proceed; the message says why and what to change."""


def sample_all(cfg: TokenizerConfig, work: Path, log: Log = print) -> dict[str, DomainSample]:
    """Every domain's sample, with the memory SentencePiece will need said out loud."""
    samples = {}
    for domain, dcfg in cfg.domains.items():
        sample = sample_domain(domain, domain_patterns(cfg, domain), dcfg, cfg.sample, work / "samples", cfg.strict)
        samples[domain] = sample
        log(f"[sample] {domain}: {sample.train_docs} docs / {sample.train_lines} lines / {sample.train_bytes / 1e6:.1f} MB "
            f"for training, {sample.heldout_docs} docs held out; read {sample.stats.summary()}")
    lines = sum(s.train_lines for s in samples.values())
    need = spm_memory_estimate(lines)
    log(f"[sample] SentencePiece may need up to ~{need / 1e9:.1f} GB RAM for the joint baseline "
        f"({lines} lines; ~7 GB per 1M lines at worst). Lower tokenizer.sample.max_sentences if that is too much.")
    return samples


def pool_sizes(cfg: TokenizerConfig, samples: dict[str, DomainSample]) -> dict[str, int]:
    """The size each domain model is trained at. BPE: its share. Unigram: merge.pool_factor times the learned
    pieces the merge's objective gives the domain: its share, or its part of the mixture's characters (as
    merge.share_weight weighs them: domain_mass) where that is larger, since a domain whose text outweighs
    its share (math and code at the 50k preset's shares) is given pieces by the EM beyond it."""
    if cfg.model_type != "unigram":
        return {d: dcfg.vocab_size for d, dcfg in cfg.domains.items()}
    from tokenizer.merge import target_size
    from tokenizer.mixture import domain_mass

    fixed = fixed_pieces(cfg.specials)
    learned = learned_shares(cfg)
    mass = domain_mass({d: samples[d].train_chars for d in learned}, learned, cfg.merge.share_weight)
    # The shares usually overlap (they add up to more than the vocabulary); where they add up to less, the
    # vocabulary's learned pieces are what the domains divide.
    total = max(sum(learned.values()), target_size(cfg) - fixed)
    return {d: fixed + round(cfg.merge.pool_factor * max(learned[d], mass[d] * total)) for d in learned}


def learned_shares(cfg: TokenizerConfig) -> dict[str, int]:
    """Each domain's share of the learned pieces: its vocab_size less the pieces every model holds."""
    fixed = fixed_pieces(cfg.specials)
    return {d: max(1, dcfg.vocab_size - fixed) for d, dcfg in cfg.domains.items()}


def train_domains(cfg: TokenizerConfig, samples: dict[str, DomainSample], out: Path, sizes: dict[str, int],
                  log: Log = print) -> dict[str, Path]:
    """One SentencePiece model per domain in `sizes`, at that size or what its sample supports if less; a sample
    that supports fewer pieces than the domain's configured vocab_size is an error."""
    from tqdm import tqdm

    from tokenizer.train_spm import too_large, train_domain_model

    out.mkdir(parents=True, exist_ok=True)
    models = {}
    for domain, size in tqdm(sizes.items(), desc="train domain models", disable=None, leave=False):
        start = time.time()
        dcfg = cfg.domains[domain]
        label = f"domain {domain!r}"
        models[domain] = train_domain_model(cfg, dcfg, samples[domain], out / domain, label, size, candidates=True)
        trained = piece_count(models[domain])
        if trained < dcfg.vocab_size:
            raise too_large(label, dcfg.vocab_size, trained)
        log(f"[train] {domain}: {cfg.model_type} vocab {trained} (pool {size}, share {dcfg.vocab_size}) "
            f"in {time.time() - start:.1f}s")
    return models


def piece_count(model: Path) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(model)).get_piece_size()


def train_and_merge(cfg: TokenizerConfig, samples: dict[str, DomainSample], out: Path, timings: dict[str, float],
                    log: Log = print, attempts: int = 3):
    """Domain models, then the merge. If the pools hold too few distinct pieces (small samples whose domains
    share most of their pieces), the domains with room in their samples are retrained larger by the shortfall."""
    from tokenizer.merge import VocabShortfall

    sizes = pool_sizes(cfg, samples)
    timings["train_domains_s"] = timings["merge_s"] = 0.0
    todo = dict(sizes)
    models: dict[str, Path] = {}
    for attempt in range(1, attempts + 1):
        clock = time.time()
        models.update(train_domains(cfg, samples, out, todo, log))
        timings["train_domains_s"] += time.time() - clock
        clock = time.time()
        try:
            return merge_domains(cfg, samples, models, log)
        except VocabShortfall as err:
            room = {d: size for d, size in sizes.items() if piece_count(models[d]) >= size}
            if attempt == attempts or not room:
                raise
            fixed = fixed_pieces(cfg.specials)
            grow = 1.0 + err.missing / sum(size - fixed for size in room.values()) + 0.1
            todo = {d: fixed + round((size - fixed) * grow) for d, size in room.items()}
            sizes.update(todo)
            log(f"[merge] {err.missing} pieces short after de-duplication: retraining {', '.join(todo)} "
                f"{100 * (grow - 1):.0f}% larger")
        finally:
            timings["merge_s"] += time.time() - clock
    raise AssertionError("the last attempt returns or raises")


def train_baseline(cfg: TokenizerConfig, samples: dict[str, DomainSample], out: Path, log: Log = print) -> Path:
    """The joint baseline: one model on all samples, same total vocab and (common) options."""
    from tokenizer.merge import target_size
    from tokenizer.train_spm import baseline_domain_options, train_model, trainer_options

    start = time.time()
    options = trainer_options(cfg, baseline_domain_options(cfg), target_size(cfg))
    model = train_model([s.train_path for s in samples.values()], out / "joint_baseline", options, "joint baseline")
    log(f"[baseline] joint model, vocab {target_size(cfg)}, in {time.time() - start:.1f}s")
    return model


def merge_domains(cfg: TokenizerConfig, samples: dict[str, DomainSample], models: dict[str, Path], log: Log = print):
    """The merged ModelProto and how many learned pieces each domain uses most."""
    from tokenizer.merge import build_proto, domain_pieces, indentation_pieces, promote_runs, quantize_scores

    total = sum(s.train_bytes for s in samples.values())
    pieces = [domain_pieces(d, models[d], samples[d].train_bytes / total, cfg.domains[d].vocab_size) for d in models]
    template = next(iter(models.values()))
    if cfg.model_type == "unigram":
        proto, owners = _prune_mixture(cfg, samples, template, pieces, log)
        quantize_scores(proto, cfg.merge.score_quantum)
        # After the rounding, so the margin survives it (a run one quantum above its best split).
        promote_runs(proto, indentation_pieces(cfg.merge.indent_tabs, cfg.merge.indent_spaces),
                     cfg.merge.score_quantum or 0.125)
    else:
        proto, owners = build_proto(cfg, template, pieces)
    shares = {d: sum(1 for o in owners.values() if o == d) for d in models}
    log(f"[merge] {len(proto.pieces)} pieces; learned pieces by the domain that uses them most: {shares}")
    return proto, shares


def _prune_mixture(cfg: TokenizerConfig, samples: dict[str, DomainSample], template: Path, pieces, log: Log):
    """Unigram: the candidate pool cut to size by EM and pruning on the share-weighted mixture (mixture.py)."""
    from tokenizer.merge import candidate_proto, target_size
    from tokenizer.mixture import domain_weights, prune_to_size, word_counts

    proto, protected = candidate_proto(cfg, template, pieces)
    lines = {d: word_counts(ls, cfg.add_dummy_prefix, cfg.remove_extra_whitespaces)
             for d, ls in domain_subsets(samples, cfg.merge.em_sample_bytes).items()}
    weights = domain_weights({d: wc.chars for d, wc in lines.items()}, learned_shares(cfg), cfg.merge.share_weight)
    owners = prune_to_size(proto, lines, weights, target_size(cfg), protected, shrink=cfg.merge.shrink,
                           em_iterations=cfg.merge.em_iterations, smoothing=cfg.merge.smoothing,
                           num_threads=cfg.num_threads, log=log)
    return proto, owners


def _heldout_texts(samples: dict[str, DomainSample]) -> dict[str, list[str]]:
    from tokenizer.evaluate import read_texts

    return read_texts({domain: str(sample.heldout_path) for domain, sample in samples.items()})


def hf_parity(model_path: Path, hf_dir: Path, texts: dict[str, list[str]]) -> dict:
    """Docs whose HF ids differ from SentencePiece's, per domain and for PARITY_PROBES (the export's contract is zero)."""
    import sentencepiece as spm
    from tokenizers import Tokenizer

    from tokenizer.export_hf import PARITY_PROBES

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    report = {}
    for domain, docs in {**texts, "_probes": PARITY_PROBES}.items():
        hf_ids = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)] if docs else []
        bad = [i for i, (doc, ids) in enumerate(zip(docs, hf_ids)) if sp.encode(doc) != ids]
        report[domain] = {"docs": len(docs), "mismatches": len(bad)}
    return report


def build_tokenizer(
    cfg: TokenizerConfig,
    output_dir: str | Path,
    overwrite: bool = False,
    keep_work: bool = False,
    log: Log = print,
    samples: dict[str, DomainSample] | None = None,
) -> dict:
    """Build the tokenizer folder at output_dir; returns its tokenizer_meta.json content."""
    from tokenizer import evaluate as ev
    from tokenizer.export_hf import export_hf

    cfg = enabled_domains(cfg)
    check_tokenizer_config(cfg)
    output_dir = Path(output_dir)
    if output_dir.exists() and not overwrite:
        raise BuildError(f"{output_dir} already exists. Fix: set overwrite=true, or choose another output_dir.")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_dir.parent / f".{output_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    timings: dict[str, float] = {}
    try:
        clock = time.time()
        samples = samples or sample_all(cfg, tmp / "work", log)
        timings["sample_s"] = time.time() - clock

        proto, shares = train_and_merge(cfg, samples, tmp / "domains", timings, log)
        model_path = tmp / MODEL_FILE
        model_path.write_bytes(proto.SerializeToString())

        clock = time.time()
        export_hf(model_path, tmp, cfg)
        timings["export_s"] = time.time() - clock

        clock = time.time()
        texts = _heldout_texts(samples)
        encoders = [ev.spm_encoder("merged", model_path, cfg.num_threads)]
        if cfg.evaluate.baseline:
            base_clock = time.time()
            encoders.append(ev.spm_encoder("joint_baseline", train_baseline(cfg, samples, tmp / "baseline", log), cfg.num_threads))
            timings["baseline_train_s"] = time.time() - base_clock
        encoders += [ev.load_encoder(name, path, cfg.num_threads) for name, path in cfg.evaluate.compare.items()]
        results = ev.evaluate(encoders, texts)
        parity = hf_parity(model_path, tmp, texts)
        total = sum(x.train_bytes for x in samples.values())
        comparison = ev.comparison(results, mix={d: x.train_bytes / total for d, x in samples.items()})
        timings["evaluate_s"] = time.time() - clock - timings.get("baseline_train_s", 0.0)
        log(ev.format_table(results))
        if comparison:
            log(f"[eval] merged/baseline total tokens: {comparison['total_tokens_ratio']:.4f} on the held-out text, "
                f"{comparison['total_tokens_ratio_mix']:.4f} mixed in sample proportions; chars/token ratio per "
                f"domain: {', '.join(f'{d} {r:.3f}' for d, r in comparison['chars_per_token_ratio'].items())}")
        loss = merge_loss_line(cfg, results, samples)
        if loss:
            log(loss)
        log(f"[eval] HF ids identical to SentencePiece: "
            f"{all(r['mismatches'] == 0 for r in parity.values())} ({parity})")

        meta = _meta(cfg, proto, model_path, samples, shares, timings, parity, comparison)
        ev.write_json(results, tmp / "eval.json", {"comparison": comparison, "hf_parity": parity})
        (tmp / META_FILE).write_text(json.dumps(meta, ensure_ascii=False, indent=2), encoding="utf-8")
        _finish(tmp, output_dir, keep_work)
        log(f"[build] {output_dir} ({meta['vocab_size']} pieces, sha256 {meta['sha256'][:12]}…)")
        return meta
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


MERGE_LOSS_WARNING = 0.05
"""The merged model is said to lose when its chars/token, overall or in a domain, is this much below the joint
baseline's (docs/tokenizer.md: the presets stay within 1.5% of it on real text)."""


def merge_loss_line(cfg: TokenizerConfig, results: dict, samples: dict[str, DomainSample]) -> str | None:
    """A warning line when the merged model compresses the held-out text more than MERGE_LOSS_WARNING worse than
    the joint baseline the build trained (chars/token, overall or in a domain), naming the knob that helps; None
    when it does not, or when there is no baseline (tokenizer.evaluate.baseline=false)."""
    if "merged" not in results or "joint_baseline" not in results:
        return None
    merged, joint = results["merged"], results["joint_baseline"]
    ratios = {"all": merged["all"]["chars_per_token"] / max(1e-9, joint["all"]["chars_per_token"])}
    ratios |= {d: m["chars_per_token"] / max(1e-9, joint["domains"][d]["chars_per_token"])
               for d, m in merged["domains"].items()}
    losing = {name: ratio for name, ratio in ratios.items() if ratio < 1 - MERGE_LOSS_WARNING}
    if not losing:
        return None
    worst = min(losing.values())
    return (f"[eval] WARNING: the merged tokenizer compresses {100 * (1 - worst):.1f}% worse than the joint baseline "
            f"this build trained (merged/baseline chars per token: "
            f"{', '.join(f'{name} {ratio:.3f}' for name, ratio in losing.items())}). {merge_knob(cfg, samples)}")


def merge_knob(cfg: TokenizerConfig, samples: dict[str, DomainSample]) -> str:
    """The setting that helps a merge that loses to the joint baseline, by what held it back."""
    total = sum(sample.train_bytes for sample in samples.values())
    merge = cfg.merge
    if merge.em_sample_bytes < total:  # the EM re-estimated the pieces on part of the text the baseline learnt on
        return (f"Fix: raise tokenizer.merge.em_sample_bytes to {total} or more: the merge's EM read "
                f"{merge.em_sample_bytes:,} of the samples' {total:,} bytes.")
    if merge.share_weight > 0:  # a trade chosen on purpose: the configured shares over the text's proportions
        return (f"Fix: lower tokenizer.merge.share_weight (now {merge.share_weight}; 0 weighs the domains as the "
                "joint model does).")
    return (f"Fix: raise tokenizer.merge.pool_factor (now {merge.pool_factor}): each domain model then proposes "
            "more candidate pieces to the merge.")


def _meta(cfg, proto, model_path, samples, shares, timings, parity, comparison) -> dict:
    from omegaconf import OmegaConf

    s = proto.trainer_spec
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True) if not isinstance(cfg, dict) else cfg
    return {
        "name": cfg.name,
        "sha256": tokenizer_sha256(model_path),
        "vocab_size": len(proto.pieces),
        "unk_id": s.unk_id, "bos_id": s.bos_id, "eos_id": s.eos_id, "pad_id": s.pad_id,
        "model_type": cfg.model_type,
        "pieces_by_domain": shares,
        "samples": {d: sample.to_dict() for d, sample in samples.items()},
        "timings": timings,
        "hf_parity": parity,
        "comparison": comparison,
        "config": config,
    }


def _finish(tmp: Path, output_dir: Path, keep_work: bool) -> None:
    """Move the work folder aside (or delete it), then put the finished folder in place with one rename."""
    work = tmp / "work"
    if keep_work and work.exists():
        keep = output_dir.with_name(output_dir.name + ".work")
        shutil.rmtree(keep, ignore_errors=True)
        shutil.move(str(work), str(keep))
    shutil.rmtree(work, ignore_errors=True)
    replace_dir(tmp, output_dir)
