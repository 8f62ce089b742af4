"""Downstream tasks scored inside real training jobs (`eval.downstream`), and by `ayumi eval` afterwards.

The same job (a real SentencePiece tokenizer, real shards, a multiple-choice, a cloze and a qa task) runs on
1 rank (ZeRO-0), on 2 ranks under ZeRO-3 and on 2 ranks with parallel.tensor=2: the in-loop scores at every
evaluation must not depend on the rank count or the layout (accuracies and exact matches equal, log-likelihoods
to fp32 rounding of the trained weights). `ayumi eval --all` on the ZeRO-3 run's checkpoints gives the scores
the run logged at those steps. A task file with a mistake stops a strict run before training (exit 2, one line);
with strict=false the run leaves that task out and scores the others.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data.config import DomainConfig
from data.prepare import prepare
from tests.data.helpers import JA_PARAGRAPHS, english_texts, make_config, write_jsonl, write_tokenizer
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides

pytestmark = pytest.mark.slow

STEPS = 12
INTERVAL = 6
MC = [
    {"context": "The capital of Japan is", "choices": ["Tokyo", "a small cat", "blue"], "gold": 0},
    {"context": "吾輩は", "choices": ["猫である。", "犬だった。"], "gold": 0},
    {"context": "It is a truth universally", "choices": ["acknowledged", "denied", "forgotten"], "gold": 0},
    {"context": "Return the number of", "choices": ["items", "cats", "mountains"], "gold": 0},
    {"context": "東京は日本の", "choices": ["首都であり", "猫であり"], "gold": 0},
]
CLOZE = [{"context": "Return a new", "target": "list"}, {"context": "吾輩は猫で", "target": "ある"},
         {"context": "If the argument is", "target": "omitted"}]
QA = [{"context": "Q: Where do people live?\nA:", "answer": "Tokyo"},
      {"context": "質問：名前は？\n答え：", "answer": "まだ無い"}]


def write_tasks(folder: Path) -> list[str]:
    """The three task files; returns the eval.downstream overrides naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("mc", MC), ("cloze", CLOZE), ("qa", QA)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                              encoding="utf-8")
    tasks = (f"[{{path:{folder / 'mc.jsonl'}}},{{path:{folder / 'cloze.jsonl'}}},"
             f"{{path:{folder / 'qa.jsonl'},max_new_tokens:4}}]")
    return [f"eval.downstream.tasks={tasks}", f"eval.downstream.interval={INTERVAL}", "eval.downstream.batch_size=2"]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """Tokenizer, shards and task files for the runs."""
    root = tmp_path_factory.mktemp("downstream")
    english = english_texts()[:300]
    tokenizer = write_tokenizer(root / "tok", english + JA_PARAGRAPHS * 3)
    inputs = {"en": write_jsonl(root / "in" / "en.jsonl", english),
              "ja": write_jsonl(root / "in" / "ja.jsonl", JA_PARAGRAPHS * 4)}
    prepare(make_config(root / "data", tokenizer, {name: DomainConfig(inputs=[str(path)], val_count=2)
                                                    for name, path in inputs.items()}))
    return {"root": root, "tokenizer": tokenizer, "tasks": write_tasks(root / "tasks")}


def overrides(job: dict, name: str, *extra: str, checkpoint_every: int = 0) -> list[str]:
    return tiny_overrides(job["root"] / "data", job["root"] / "runs", f"name={name}", "model.vocab_size=640",
                          f"data.tokenizer_dir={job['tokenizer']}", "deepspeed.precision=fp32",
                          f"train.max_steps={STEPS}", "train.eval_interval=0", f"checkpoint.interval={checkpoint_every}",
                          *job["tasks"], *extra)


def scores(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> eval/<task>/<metric> of the run's downstream records."""
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/") and k.count("/") == 2}
            for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/downstream_seconds" in r}


def examples(run_dir: Path, step: int) -> dict:
    """What each example got at `step` (RUN_DIR/eval/downstream/step_NNNNNNN.json)."""
    return json.loads((run_dir / "eval" / "downstream" / f"step_{step:07d}.json").read_text(encoding="utf-8"))["tasks"]


def assert_same_examples(a: dict, b: dict) -> None:
    """Every choice's and target's log-likelihood to fp32 rounding, every generated answer equal."""
    for x, y in zip(a["mc"]["examples"], b["mc"]["examples"]):
        assert y["logliks"] == pytest.approx(x["logliks"], abs=1e-4)
    assert [e["loglik"] for e in b["cloze"]["examples"]] == pytest.approx([e["loglik"] for e in a["cloze"]["examples"]],
                                                                           abs=1e-4)
    assert [e["generated"] for e in b["qa"]["examples"]] == [e["generated"] for e in a["qa"]["examples"]]
    assert all(e["generated"] for e in a["qa"]["examples"])  # something was generated (a stop string at least)


def assert_same_scores(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key.endswith("/loglik"):  # a sum over the target's tokens: fp32 rounding of differently reduced weights
            assert b[key] == pytest.approx(a[key], abs=1e-3), key
        else:  # decisions: the same answer chosen or generated
            assert b[key] == a[key], key


@pytest.fixture(scope="module")
def runs(job) -> dict[str, Path]:
    out = {}
    for name, nproc, extra in (("one", 1, ["deepspeed=zero0"]), ("zero3", 2, ["deepspeed=zero3"]),
                               ("tp2", 2, ["deepspeed=zero1", "parallel.tensor=2"])):
        # The ZeRO-3 run keeps a checkpoint at every scoring, for `ayumi eval --all`.
        proc = run_training(overrides(job, name, *extra, checkpoint_every=INTERVAL if name == "zero3" else 0), nproc=nproc,
                            launcher="fork")
        assert proc.returncode == 0, proc.stdout[-6000:]
        out[name] = job["root"] / "runs" / name
        out[name + "_log"] = proc.stdout
    return out


def test_in_loop_scores_do_not_depend_on_ranks_zero_stage_or_tensor_parallelism(runs):
    one = scores(runs["one"])
    assert sorted(one) == [0, INTERVAL, STEPS]  # before the first step, every interval, and after the last step
    assert set(one[STEPS]) == {"eval/mc/acc", "eval/mc/acc_norm", "eval/cloze/exact_match", "eval/cloze/loglik",
                               "eval/qa/exact_match", "eval/qa/char_f1"}
    assert len({one[step]["eval/cloze/loglik"] for step in one}) == 3  # the model changed in between
    for other in ("zero3", "tp2"):
        theirs = scores(runs[other])
        assert sorted(theirs) == sorted(one)
        for step in one:
            assert_same_scores(one[step], theirs[step])
            assert_same_examples(examples(runs["one"], step), examples(runs[other], step))
    records = [r for r in read_jsonl(runs["zero3"] / "metrics.jsonl") if "eval/downstream_seconds" in r]
    assert "eval/time_share" not in records[0]  # step 0: no training time to compare with
    record = records[-1]
    assert record["tokens"] == STEPS * 8 * 64 and 0 < record["eval/time_share"] < 1
    assert record["eval/downstream_seconds"] > 0
    assert "downstream @ step 12: mc acc" in runs["zero3_log"]


def test_compiled_blocks_score_eagerly_without_recompiling(job, runs):
    """model.compile=blocks compiles each block for the training shape only: the downstream batches (other lengths)
    run eagerly, so nothing recompiles, and the scores are the eager run's."""
    proc = run_training(overrides(job, "compiled", "deepspeed=zero0", "model.compile=blocks"), nproc=1,
                        launcher="python", env=cpu_env(TORCH_LOGS="recompiles"))
    assert proc.returncode == 0, proc.stdout[-6000:]
    # The validation loss (no_grad) compiles one more variant of each block, for the grad mode; shapes never do.
    reasons = [m.group(1).strip() for m in re.finditer(r"\[__recompiles\]\s+- \d+/\d+: (.*)", proc.stdout)]
    assert reasons and all(reason.startswith("GLOBAL_STATE changed: grad_mode") for reason in reasons), reasons
    compiled, eager = scores(job["root"] / "runs" / "compiled"), scores(runs["one"])
    assert sorted(compiled) == sorted(eager)
    for step in eager:
        assert_same_scores(eager[step], compiled[step])


def test_ayumi_eval_on_every_checkpoint_equals_the_in_loop_scores(runs, tmp_path):
    """`ayumi eval RUN_DIR --all`: one process, no DeepSpeed, each checkpoint's consolidated weights; the scores
    the 2-rank ZeRO-3 run logged at the same steps."""
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "eval", str(runs["zero3"]), "--all",
                           "--out", str(out)], cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].split()[3:] == ["step_0000006", "step_0000012"]  # the table: one column each
    results = json.loads(out.read_text(encoding="utf-8"))["scores"]
    assert [r["step"] for r in results] == [INTERVAL, STEPS]
    for result in results:
        after = {f"eval/{task}/{metric}": value for task, body in result["tasks"].items()
                 for metric, value in body["metrics"].items()}
        assert_same_scores(scores(runs["zero3"])[result["step"]], after)
        assert_same_examples(examples(runs["zero3"], result["step"]), result["tasks"])
    assert len(results[0]["tasks"]["mc"]["examples"][0]["logliks"]) == 3


def ayumi_eval(*args: object) -> subprocess.CompletedProcess:
    """`ayumi eval ARGS` through the real entry, in its own process (as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "eval", *map(str, args)], cwd=REPO,
                          env=cpu_env(), capture_output=True, text=True, timeout=300)


def copy_run(run_dir: Path, to: Path) -> Path:
    """A copy of a run (4 MB) that a test may add files to or damage; the module's run stays as other tests read it."""
    return Path(shutil.copytree(run_dir, to / run_dir.name))


@pytest.fixture(scope="module")
def curve(runs, tmp_path_factory) -> dict:
    """`ayumi eval COPY --all` with no --out on a copy of the ZeRO-3 run: the run's curve at its default place."""
    run = copy_run(runs["zero3"], tmp_path_factory.mktemp("curve"))
    proc = ayumi_eval(run, "--all")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads((run / "eval" / "downstream.json").read_text(encoding="utf-8"))
    return {"run": run, "proc": proc, "json": written}


def test_options_go_before_or_after_the_overrides(runs, job, tmp_path):
    """B1: --all between the target and the overrides, --dtype and --out after them (argparse's intermixed parsing)."""
    out = tmp_path / "eval.json"
    mc = job["root"] / "tasks" / "mc.jsonl"
    proc = ayumi_eval(runs["zero3"], "--all", f"tasks={mc}", "--dtype", "fp32", "max_examples=3", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(out.read_text(encoding="utf-8"))
    assert written["settings"]["max_examples"] == 3 and [t["path"] for t in written["settings"]["tasks"]] == [str(mc)]
    assert [list(r["tasks"]) for r in written["scores"]] == [["mc"], ["mc"]]  # --all: both checkpoints
    assert all(len(r["tasks"]["mc"]["examples"]) == 3 for r in written["scores"])


def test_the_full_task_form_is_read_as_train_reads_it(runs, job, tmp_path):
    """B2: tasks in Hydra's grammar (unquoted keys, "" for an empty delimiter), the form `ayumi train` takes."""
    out = tmp_path / "eval.json"
    mc, cloze = job["root"] / "tasks" / "mc.jsonl", job["root"] / "tasks" / "cloze.jsonl"
    proc = ayumi_eval(runs["zero3"] / "checkpoints" / "step_0000012",
                      f'tasks=[{{path:{mc},delimiter:""}},{{path:{cloze},name:fill,max_examples:2}}]', "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(out.read_text(encoding="utf-8"))
    first, second = written["settings"]["tasks"]
    assert (first["path"], first["delimiter"]) == (str(mc), "")
    assert (second["path"], second["name"], second["max_examples"]) == (str(cloze), "fill", 2)
    assert second["delimiter"] is None  # unset: the kind's default
    assert {task: len(body["examples"]) for task, body in written["scores"][0]["tasks"].items()} == {
        "mc": len(MC), "fill": 2}


def test_an_eval_typo_is_one_line_with_a_suggestion(runs):
    proc = ayumi_eval(runs["zero3"], "max_example=5", "--all")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "ayumi eval: max_example=5: eval.downstream has no key 'max_example'; did you mean max_examples?"]
    assert proc.stdout == ""


def test_one_checkpoints_scores_never_replace_the_runs_curve(curve):
    """B3: `--all` writes RUN_DIR/eval/downstream.json; one checkpoint (named, or a run's newest) writes beside it,
    under the checkpoint's name, and the curve stays as it was."""
    run, folder = curve["run"], curve["run"] / "eval"
    assert [r["step"] for r in curve["json"]["scores"]] == [INTERVAL, STEPS]
    before = (folder / "downstream.json").read_bytes()
    one = ayumi_eval(run / "checkpoints" / "step_0000006")
    assert one.returncode == 0, one.stderr[-3000:]
    assert one.stdout.splitlines()[-1] == f"wrote {folder / 'downstream.step_0000006.json'}"
    newest = ayumi_eval(run)
    assert newest.returncode == 0, newest.stderr[-3000:]
    assert newest.stdout.splitlines()[-1] == f"wrote {folder / 'downstream.step_0000012.json'}"
    assert (folder / "downstream.json").read_bytes() == before
    single = json.loads((folder / "downstream.step_0000006.json").read_text(encoding="utf-8"))["scores"]
    assert [r["step"] for r in single] == [INTERVAL]
    assert single[0]["tasks"] == curve["json"]["scores"][0]["tasks"]


def test_ayumi_report_shows_the_curve_ayumi_eval_all_wrote(curve):
    """Issue 48, papercut: the report showed the in-loop scores only. Through the real CLI, on the curve of a real
    run: a row per checkpoint with each metric's value ± stderr as the curve holds it, a plot per task."""
    run = curve["run"]
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "report", str(run)], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (run / "report" / "summary.md").read_text(encoding="utf-8")
    assert "## Downstream evaluation of the checkpoints" in summary and "## Downstream evaluation\n" in summary
    for result in curve["json"]["scores"]:
        [row] = [line for line in summary.splitlines() if line.startswith(f"| {result['label']} | {result['step']} |")]
        for task, body in result["tasks"].items():
            for metric, value in body["metrics"].items():
                stderr = body["stderr"][metric]
                assert f"| {value:.4f} ± {'N/A' if stderr is None else f'{stderr:.4f}'} |" in row, (task, metric)
    for task in ("mc", "cloze", "qa"):
        assert (run / "report" / f"eval_curve_{task}.png").read_bytes()[:4] == b"\x89PNG"


def test_each_row_has_n_and_lm_evals_standard_error(curve):
    """Item 4: n (examples scored) and the standard error of the mean, as lm-eval's mean_stderr: the sample standard
    deviation (n - 1) over sqrt(n); for accuracies sqrt(p (1 - p) / (n - 1)). In the JSON and in the table."""
    for result in curve["json"]["scores"]:
        for task, body in result["tasks"].items():
            n = len(body["examples"])
            assert body["n"] == n and n >= 2
            for metric, value in body["metrics"].items():
                values = [row[metric] for row in body["examples"]]
                mean = sum(values) / n
                stderr = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)
                assert body["stderr"][metric] == pytest.approx(stderr, rel=1e-12), (task, metric)
                if metric in ("acc", "acc_norm", "exact_match"):
                    assert body["stderr"][metric] == pytest.approx(math.sqrt(mean * (1 - mean) / (n - 1)), abs=1e-12)
    lines = curve["proc"].stdout.splitlines()
    assert lines[0].split() == ["task", "metric", "n", "step_0000006", "step_0000012"]
    row = next(line.split() for line in lines if line.startswith("mc ") and " acc " in line)
    body = curve["json"]["scores"][1]["tasks"]["mc"]
    assert row[:3] == ["mc", "acc", str(len(MC))]
    assert row[-3:] == [f"{body['metrics']['acc']:.4f}", "±", f"{body['stderr']['acc']:.4f}"]


def test_all_marks_a_damaged_checkpoint_and_scores_the_others(curve, tmp_path):
    """`--all` on a run whose step 6 is damaged: that column says so, step 12 is scored as before, the JSON records
    why, and the exit status is 1 (a verdict to read: the curve has a hole)."""
    run = copy_run(curve["run"], tmp_path)
    damaged = run / "checkpoints" / "step_0000006" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    proc = ayumi_eval(run, "--all")
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["task", "metric", "n", "step_0000006", "step_0000012"]
    assert all(" damaged " in line for line in lines[1:] if line.startswith(("mc ", "cloze ", "qa ")))
    assert any("step_0000006" in line and "optim_states.pt does not match the xxh3_128 checksum" in line
               for line in proc.stderr.splitlines())
    scores = json.loads((run / "eval" / "downstream.json").read_text(encoding="utf-8"))["scores"]
    assert [r["step"] for r in scores] == [INTERVAL, STEPS]
    assert "does not match the xxh3_128 checksum" in scores[0]["error"] and "tasks" not in scores[0]
    assert scores[1]["tasks"] == curve["json"]["scores"][1]["tasks"]


def test_a_broken_task_file_stops_a_strict_run_before_training_and_is_left_out_otherwise(job):
    broken = job["root"] / "tasks" / "broken.jsonl"
    broken.write_text(json.dumps({"context": "x", "choices": [], "gold": 0}) + "\n", encoding="utf-8")
    tasks = f"eval.downstream.tasks=[{{path:{job['root'] / 'tasks' / 'mc.jsonl'}}},{{path:{broken}}}]"
    strict = run_training(overrides(job, "strict", tasks), nproc=1, launcher="python")
    assert strict.returncode == 2, strict.stdout[-3000:]
    assert f"{broken}:1: choices: empty or not a list" in strict.stdout
    assert "Traceback" not in strict.stdout and not (job["root"] / "runs" / "strict" / "metrics.jsonl").exists()

    lenient = run_training(overrides(job, "lenient", tasks, "eval.downstream.strict=false", "train.max_steps=2"),
                           nproc=1, launcher="fork")
    assert lenient.returncode == 0, lenient.stdout[-3000:]
    assert f"task left out (strict=false): {broken}:1: choices" in lenient.stdout
    final = scores(job["root"] / "runs" / "lenient")
    assert sorted(final) == [0, 2] and set(final[2]) == {"eval/mc/acc", "eval/mc/acc_norm"}
