"""`ayumi plan`: the table, the arithmetic, and the refusals (repetition, disk, budgets) with their messages."""
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pretrain.tools.plan as plan_cli
from curriculum.config import CurriculumConfig, Stage
from data.packed import PackedSamples
from curriculum.plan import (
    CheckpointShape, PlanRefused, RunShape, available_samples, check_plan, checkpoint_count, checkpoint_size,
    format_plan, make_plan, plan_from_config, raise_if_refused,
)
from pretrain.config import compose_config, composed_from_args, to_object
from pretrain.model.flops import count_parameters
from tests.curriculum.helpers import three_stage, write_domains
from tests.helpers import REPO, tiny_overrides, write_tiny_corpus

SEQ = 16
GiB = 2**30


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return write_domains(tmp_path_factory.mktemp("data"), {"a": 16_000, "b": 6_400, "c": 9_600})


def run_shape(tokens=1000 * SEQ, **kw):
    return RunShape(train_tokens=tokens, seq_len=SEQ, global_batch=kw.pop("global_batch", 8), **kw)


def ckpt(tmp_path, **kw):
    return CheckpointShape(**{"num_parameters": 1_000_000, "interval": 25, "keep_last": 2, "dir": str(tmp_path / "run" / "ckpt"), **kw})


def test_a_feasible_plan_and_its_table(data_root, tmp_path):
    tokens, samples = available_samples(data_root, SEQ)
    assert samples == {"a": 999, "b": 399, "c": 599} and tokens["a"] == 16_000
    plan = make_plan(three_stage(SEQ), run_shape(), tokens, samples, ckpt(tmp_path), tokens_per_s=1600.0, free_bytes=GiB)
    assert plan.problems == []
    assert plan.run.total_steps == 125 and plan.run.tokens_per_step == 128
    assert [(s.name, s.first_sample, s.end_sample) for s in plan.stages] == [
        ("first", 0, 301), ("second", 301, 501), ("third", 501, 1000)]
    rows = {(r.stage, r.domain): r for r in plan.domains}
    assert rows[(0, "a")].tokens == 211 * SEQ and rows[(0, "b")].tokens == 90 * SEQ  # 0.7 / 0.3 of 301 samples
    assert rows[(2, "b")].epochs == (90 + 249) / 399  # cumulative across stages: stage 3 takes half of 499
    assert plan.disk.saves == 5  # steps 25, 50, 75, 100 and the final save
    assert plan.disk.needed == 3 * 14_000_000  # keep_last + 1 at peak, 14 bytes per parameter
    assert plan.wall_time_s == pytest.approx(10.0)
    text = format_plan(plan)
    for fragment in ("125 steps", "3 third", "0.85x", "50x  ok", "5 saves x 13.4 MiB each", "0h 0m 10s", "plan ok"):
        assert fragment in text, fragment


def test_the_recovery_ring_counts_toward_the_disk_peak(data_root, tmp_path):
    """125 steps, a ring checkpoint every 10 (ring_keep 3): at most 3 + the rollback target + the one
    being written sit beside the keep_last + 1 regular ones; a disk that holds only those is refused."""
    tokens, samples = available_samples(data_root, SEQ)
    shape = ckpt(tmp_path, ring_interval=10, ring_keep=3)
    plan = make_plan(three_stage(SEQ), run_shape(), tokens, samples, shape, free_bytes=GiB)
    assert plan.disk.ring == 5 and plan.disk.needed == (3 + 5) * 14_000_000
    assert "5 saves (+ up to 5 in the recovery ring) x 13.4 MiB each" in format_plan(plan)
    tight = make_plan(three_stage(SEQ), run_shape(), tokens, samples, shape, free_bytes=3 * 14_000_000)
    assert [p.kind for p in tight.problems] == ["disk"]
    assert "and 5 recovery-ring checkpoints" in tight.problems[0].message
    assert "stability.recovery.ring_keep" in tight.problems[0].message


def test_refuses_a_domain_beyond_its_max_repetition(data_root, tmp_path):
    tokens, samples = available_samples(data_root, SEQ)
    cfg = three_stage(SEQ)
    cfg.stages[0].max_repetition = {"b": 0.2}
    problems = check_plan(cfg, run_shape(), tokens, samples, ckpt(tmp_path), free_bytes=GiB)
    assert [p.kind for p in problems] == ["repetition"]
    assert ("domain 'b' would be read 0.23 times by the end of stage 1 ('first'), more than its limit of 0.2 "
            "(curriculum.stages.0.max_repetition.b): 90 samples wanted, 399 available. Fix one: prepare more b data "
            "(`ayumi data prepare`); train fewer tokens of it (curriculum.stages.0.tokens=4240 train.tokens=15435 fits, "
            "or lower b's weight in stage 1); or raise the limit on purpose (curriculum.stages.0.max_repetition.b=0.23)"
            ) == problems[0].message
    assert "OVER" in format_plan(make_plan(cfg, run_shape(), tokens, samples, ckpt(tmp_path), free_bytes=GiB))


def with_budget(cfg, stage, stage_tokens):
    """A copy of `cfg` whose stage `stage` has `stage_tokens`, and the train.tokens that matches."""
    out = copy.deepcopy(cfg)
    out.stages[stage].tokens = stage_tokens
    return out, sum(s.tokens for s in out.stages)


@pytest.mark.parametrize("stage", [0, 2])
def test_the_fewer_tokens_fix_is_the_largest_budget_that_fits(data_root, tmp_path, stage):
    """Applying the suggested stage budget makes the plan pass; one token more is refused again.

    Stage 3 is the last: the run ends on a whole step, so its budget is rounded down to steps.
    """
    tokens, samples = available_samples(data_root, SEQ)
    cfg = three_stage(SEQ)
    cfg.stages[stage].max_repetition = {"b": {0: 0.2, 2: 0.7}[stage]}  # b: 0.23 by stage 1, 0.85 by stage 3
    message = check_plan(cfg, run_shape(), tokens, samples, ckpt(tmp_path), free_bytes=GiB)[0].message
    found = re.search(rf"curriculum\.stages\.{stage}\.tokens=(\d+) train\.tokens=(\d+) fits", message)
    assert found, message
    fitting, total = int(found[1]), int(found[2])
    fixed, run_tokens = with_budget(cfg, stage, fitting)
    assert run_tokens == total and fitting < cfg.stages[stage].tokens
    assert check_plan(fixed, run_shape(tokens=run_tokens), tokens, samples, ckpt(tmp_path), free_bytes=GiB) == []
    step = 8 * SEQ if stage == 2 else 1  # the last stage can only grow by a whole step of the run
    over, run_tokens = with_budget(cfg, stage, fitting + step)
    refused = check_plan(over, run_shape(tokens=run_tokens), tokens, samples, ckpt(tmp_path), free_bytes=GiB)
    assert [p.kind for p in refused] == ["repetition"] and "domain 'b'" in refused[0].message


def test_a_limit_from_the_default_and_one_only_earlier_stages_can_meet(data_root, tmp_path):
    tokens, samples = available_samples(data_root, SEQ)
    cfg = three_stage(SEQ)
    cfg.default_max_repetition = 0.5  # b: 0.85 by the end of stage 3 (no stage names b)
    cfg.stages[1].max_repetition = {"b": 0.2}  # stage 2 reads no b, but stage 1 already read 0.23 of it
    problems = [p.message for p in check_plan(cfg, run_shape(), tokens, samples, ckpt(tmp_path), free_bytes=GiB)]
    assert len(problems) == 2
    assert problems[0].startswith("domain 'b' would be read 0.23 times by the end of stage 2 ('second'), more than its "
                                  "limit of 0.2 (curriculum.stages.1.max_repetition.b)")
    assert ("train fewer tokens of it (the stages before stage 2 already read it too often: lower its weight or "
            "their tokens)") in problems[0]
    assert problems[1].startswith("domain 'b' would be read 0.85 times by the end of stage 3 ('third'), more than its "
                                  "limit of 0.5 (curriculum.default_max_repetition)")
    assert problems[1].endswith("or raise the limit on purpose (curriculum.default_max_repetition=0.85, "
                                "or +curriculum.stages.2.max_repetition.b=0.85 for this stage alone)")


def test_refuses_when_checkpoints_would_fill_the_disk(data_root, tmp_path):
    tokens, samples = available_samples(data_root, SEQ)
    shape = ckpt(tmp_path, num_parameters=1_174_497_280, keep_last=3)  # the 1b preset
    plan = make_plan(three_stage(SEQ), run_shape(), tokens, samples, shape, free_bytes=40 * GiB)
    assert [p.kind for p in plan.problems] == ["disk"]
    assert plan.disk.each == 1_174_497_280 * 14
    assert "checkpoints need 61.3 GiB more on" in plan.problems[0].message
    assert "(4 x 15.3 GiB at peak with checkpoint.keep_last=3) but only 40.0 GiB is free" in plan.problems[0].message
    with pytest.raises(PlanRefused, match=r"\[disk\] checkpoints need"):
        raise_if_refused(plan)
    # existing checkpoints of a resumed run are part of the peak
    (tmp_path / "run" / "ckpt" / "step_0000025").mkdir(parents=True)
    (tmp_path / "run" / "ckpt" / "step_0000025" / "blob").write_bytes(b"x" * 1000)
    again = make_plan(three_stage(SEQ), run_shape(), tokens, samples, shape, free_bytes=40 * GiB)
    assert again.disk.needed == plan.disk.needed - 1000 and again.disk.existing == 1000


def test_refuses_budgets_that_disagree_with_the_run_length(data_root, tmp_path):
    tokens, samples = available_samples(data_root, SEQ)
    problems = check_plan(three_stage(SEQ), run_shape(tokens=900 * SEQ), tokens, samples, ckpt(tmp_path), free_bytes=GiB)
    assert [p.kind for p in problems] == ["budget"]
    assert problems[0].message == ("stage budgets add up to 16,000 tokens (4,805 + 3,200 + 7,995) but train.tokens=14,400; "
                                   "make them equal (change a stage's tokens or train.tokens)")


def test_refuses_unknown_domains_and_warns_about_max_steps(data_root, tmp_path):
    tokens, samples = available_samples(data_root, SEQ)
    cfg = CurriculumConfig(name="typo", stages=[Stage("s", 1000 * SEQ, {"a": 1.0, "jp": 1.0})])
    plan = make_plan(cfg, run_shape(max_steps=10), tokens, samples, ckpt(tmp_path), free_bytes=GiB)
    assert [p.kind for p in plan.problems] == ["config"] and "unknown domain(s) jp" in plan.problems[0].message
    assert plan.warnings == ["train.max_steps=10 stops the run at step 10 of 125, before the planned 16,000 tokens "
                             "(use it only for smoke tests)"]


def test_arithmetic():
    assert checkpoint_count(total_steps=125, interval=25, save_final=True) == 5
    assert checkpoint_count(total_steps=126, interval=25, save_final=False) == 5
    assert checkpoint_count(total_steps=125, interval=0, save_final=True) == 1
    # Bytes per parameter as DeepSpeed 0.19 writes them, measured per stage (curriculum/plan.py's doc).
    assert [checkpoint_size(1000, "bf16", stage) for stage in (0, 1, 2, 3)] == [14_000, 14_000, 14_000, 12_000]
    assert [checkpoint_size(1000, "fp32", stage) for stage in (0, 1, 2, 3)] == [12_000, 16_000, 16_000, 12_000]
    # auto is planned as bf16 (planned_precision), by the disk plan as by the memory plan.
    assert [checkpoint_size(1000, "auto", stage) for stage in (0, 1, 2, 3)] == [14_000, 14_000, 14_000, 12_000]


def test_no_curriculum_plan_reads_every_domain_in_proportion(data_root, tmp_path):
    tokens, samples = available_samples(data_root, SEQ)
    plan = make_plan(None, run_shape(tokens=1997 * SEQ), tokens, samples, ckpt(tmp_path), free_bytes=GiB)
    assert plan.problems == [] and len(plan.stages) == 1
    assert all(row.epochs == pytest.approx(2000 / 1997, abs=0.01) for row in plan.domains)
    assert {row.domain: row.weight for row in plan.domains} == pytest.approx({"a": 999 / 1997, "b": 399 / 1997,
                                                                               "c": 599 / 1997})
    assert all(row.max_epochs == 4 for row in plan.domains)  # the default limit applies without a curriculum too
    assert "1.00x     4x  ok" in format_plan(plan)


def test_no_curriculum_plan_refuses_reading_the_data_more_than_4_times(data_root, tmp_path):
    tokens, samples = available_samples(data_root, SEQ)
    run = run_shape(tokens=50 * 1997 * SEQ)  # 12,482 steps of 8 samples: 99,856 samples of 1,997 available
    plan = make_plan(CurriculumConfig(), run, tokens, samples, ckpt(tmp_path), free_bytes=GiB)
    assert [p.kind for p in plan.problems] == ["repetition"] * 3
    assert [r.domain for r in plan.domains if not r.ok] == ["a", "b", "c"]
    assert plan.problems[1].message == (
        "domain 'b' would be read 50.00 times by the end of the run, more than its limit of 4 "
        "(curriculum.default_max_repetition): 19,951 samples wanted, 399 available. Fix one: prepare more b data "
        "(`ayumi data prepare`); train fewer tokens (train.tokens=127744 fits: 998 steps); "
        "or raise the limit on purpose (curriculum.default_max_repetition=51)")
    text = format_plan(plan)
    assert "50.00x     4x  OVER" in text and "REFUSED:" in text
    with pytest.raises(PlanRefused, match=r"\[repetition\] domain 'a' would be read 50\.00 times"):
        raise_if_refused(plan)
    # the suggested train.tokens is the largest that fits: one more step is refused again
    assert check_plan(None, run_shape(tokens=127744), tokens, samples, ckpt(tmp_path), free_bytes=GiB) == []
    assert len(check_plan(None, run_shape(tokens=127744 + 1), tokens, samples, ckpt(tmp_path), free_bytes=GiB)) == 3
    # a higher limit, set on purpose, admits the run
    assert check_plan(CurriculumConfig(default_max_repetition=51), run, tokens, samples, ckpt(tmp_path),
                      free_bytes=GiB) == []


def tiny_config(tmp_path, *extra):
    """cpu_tiny with the tiny curriculum, composed as `pretrain.train` does."""
    root = write_tiny_corpus(tmp_path / "tiny")
    return to_object(composed_from_args(tiny_overrides(root, tmp_path / "runs", *extra, "curriculum=tiny"))[0])


def test_plan_from_a_composed_training_config(tmp_path):
    cfg = tiny_config(tmp_path)
    plan = plan_from_config(cfg, count_parameters(cfg.model), free_bytes=GiB)
    assert plan.problems == [] and [s.name for s in plan.stages] == ["ja_heavy", "en_heavy"]
    assert plan.stages[0].end_sample == 375 and plan.run.total_steps == 128
    assert {r.domain for r in plan.domains} == {"ja", "en"}
    opened = {name: PackedSamples.from_directory(Path(cfg.data.root) / name / "train", 64, name) for name in ("ja", "en")}
    assert plan_from_config(cfg, count_parameters(cfg.model), free_bytes=GiB, domains=opened).domains == plan.domains
    cfg.data.root = str(tmp_path / "missing")
    missing = plan_from_config(cfg, count_parameters(cfg.model), free_bytes=GiB)
    assert [p.kind for p in missing.problems] == ["data"] and "does not exist" in missing.problems[0].message
    assert len(missing.stages) == 2  # the stage table is still shown


def test_plan_cli_exit_codes(tmp_path, capsys):
    root = write_tiny_corpus(tmp_path / "tiny")
    args = [*tiny_overrides(root, tmp_path / "runs"), "curriculum=tiny"]
    assert plan_cli.main(args + ["--tokens-per-s", "65536"]) == 0
    out = capsys.readouterr().out
    assert "ja_heavy" in out and "128 steps" in out and "estimated wall time: 0h 0m 1s" in out and "plan ok" in out
    assert plan_cli.main(args + ["--free-bytes=1000"]) == 1
    captured = capsys.readouterr()
    assert "[disk] checkpoints need" in captured.out and "refused (1 problem(s)" in captured.err
    assert plan_cli.main(args + ["--tokens-per-s", "fast"]) == 2
    assert "--tokens-per-s takes a number" in capsys.readouterr().err
    assert plan_cli.main(["train.no_such_key=1"]) == 2


def test_plan_cli_takes_options_anywhere_and_says_what_a_stage_key_needs(tmp_path, capsys):
    """Issue 39: options before or after the overrides; in a stage a typo gets "did you mean" among the stage's own
    keys, and a key new to one of its mappings says it needs Hydra's '+' (both gave an empty `known keys: `)."""
    root = write_tiny_corpus(tmp_path / "tiny")
    args = [*tiny_overrides(root, tmp_path / "runs"), "curriculum=tiny"]
    assert plan_cli.main(["--tokens-per-s", "65536", *args, "--free-bytes", "1e12"]) == 0
    assert "plan ok" in capsys.readouterr().out
    assert plan_cli.main([*args, "--tokens-per-s", "65536", "curriculum.stages.1.tokns=5"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ayumi plan: curriculum.stages.1.tokns=5: curriculum.stages.1 has no key 'tokns'; did you mean "
        "curriculum.stages.1.tokens?"]
    rope = "curriculum.stages.1.rope_scaling={type:yarn,factor:4}"
    assert plan_cli.main([*args, rope]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ayumi plan: {rope}: curriculum.stages.1.rope_scaling has no key 'type': a new key needs Hydra's '+' "
        f"(+{rope})"]


def test_plan_cli_refuses_over_repetition_without_a_curriculum(tmp_path):
    """`ayumi plan` (the real CLI, a subprocess) on curriculum=none: exit 1 and the message; 0 once raised on purpose."""
    root = write_tiny_corpus(tmp_path / "tiny")  # ja 167 + en 234 samples of 64 tokens
    args = [*tiny_overrides(root, tmp_path / "runs"), "curriculum=none", "train.tokens=131072"]  # 2,048 samples

    def plan(*extra):
        return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "plan", *args, *extra], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    refused = plan()
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "ayumi plan: refused (2 problem(s), listed above)" in refused.stderr
    assert ("[repetition] domain 'ja' would be read 5.11 times by the end of the run, more than its limit of 4 "
            "(curriculum.default_max_repetition): 853 samples wanted, 167 available. Fix one: prepare more ja data "
            "(`ayumi data prepare`); train fewer tokens (train.tokens=102400 fits: 200 steps); "
            "or raise the limit on purpose (curriculum.default_max_repetition=6)") in refused.stdout
    assert "[repetition] domain 'en' would be read 5.11 times" in refused.stdout
    assert "5.11x     4x  OVER" in refused.stdout
    assert plan("train.tokens=102400").returncode == 0
    raised = plan("curriculum.default_max_repetition=6")
    assert raised.returncode == 0 and "5.11x     6x  ok" in raised.stdout and "plan ok" in raised.stdout


def test_tiny_experiments_raise_the_limit_without_clobbering_a_curriculum(tmp_path):
    """cpu_tiny repeats tiny data on purpose through its own curriculum file; curriculum=tiny keeps its 8."""
    assert tiny_config(tmp_path).curriculum.default_max_repetition == 8.0
    plain = to_object(compose_config(["experiment=cpu_tiny"]))
    assert plain.curriculum.stages == [] and plain.curriculum.default_max_repetition == 100.0
    assert to_object(compose_config(["experiment=cpu_tiny", "curriculum=none"])).curriculum.default_max_repetition == 4.0
    assert to_object(compose_config(["experiment=llama_1b_example"])).curriculum.default_max_repetition == 4.0


def test_four_stage_experiment_composes_and_plans(tmp_path, capsys, monkeypatch):
    """Refused for the missing data, but the memory of the 8-GPU node it is sized for is checked, not skipped."""
    import pretrain.plan.hardware as hardware

    monkeypatch.setattr(hardware, "visible_gpus", lambda: (0, None, ""))  # the login node: no GPU here
    assert plan_cli.main(["experiment=ja_en_4stage", f"data.root={tmp_path / 'none'}"]) == 1
    out = capsys.readouterr().out
    assert "47,684 steps" in out and "noisy_ja" in out and "[data]" in out
    assert "not checked" not in out and "[memory]" not in out
    assert "x 8 data-parallel rank(s), on 8 GPU(s)" in out
    required = next(line for line in out.splitlines() if line.lstrip().startswith("required"))
    assert required.endswith("of 80.0 GiB on each GPU (train.gpu_memory_gib=80): fits"), required
