"""downstream/tasks.py: task files read and checked. A task file with a missing field, an empty choice list, a sample
longer than the model's context or an unknown metric gets one line naming the file, the line (or llm-jp-eval's
`samples[i]`) and the field; with strict=False that task is left out and the others scored. llm-jp-eval's
preprocessed JSON brings its few-shot examples from the sibling train/ folder."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from downstream.config import DownstreamConfig, TaskConfig
from downstream.evaluate import prepare_tasks
from downstream.tasks import TaskError, load_task
from tests.downstream.conftest import FIXTURES

JCQA_TEST = FIXTURES / "evaluation" / "test" / "jcommonsenseqa.json"
JCQA_TRAIN = FIXTURES / "evaluation" / "train" / "jcommonsenseqa.json"
GOOD = {"context": "Question: Which city is the capital of Japan?\nAnswer:", "choices": ["Tokyo", "Kyoto"], "gold": 0}


def write_lines(path: Path, *lines: dict | str) -> Path:
    """A JSONL task file; a str is written as it is (a malformed line)."""
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n"
                            for line in lines), encoding="utf-8")
    return path


def write_llm_jp(path: Path, samples: list, metrics: list | None = None, output_length: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"instruction": "質問に答えてください。", "output_length": output_length,
            "metrics": ["exact_match"] if metrics is None else metrics, "samples": samples}
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def prepare(tokenizer, *tasks: TaskConfig, max_len: int = 512, **cfg):
    return prepare_tasks(DownstreamConfig(tasks=list(tasks), **cfg), tokenizer, max_len, tokenizer.bos_id,
                         tokenizer.eod_id)


# Each case: the file's lines (or llm-jp-eval samples), the task's settings, and the place and field the line names.
LONG = "これはとても長い文脈です。" * 40
BAD_FILES = {
    "missing field": ("jsonl", [GOOD, {"choices": ["a", "b"], "gold": 0}], {}, ":2: context: missing"),
    "missing gold": ("jsonl", [GOOD, {"context": "Q:", "choices": ["a", "b"]}], {}, ":2: gold: missing"),
    "gold out of range": ("jsonl", [{**GOOD, "gold": 2}], {}, ":1: gold: 2"),
    "empty choice list": ("jsonl", [GOOD, GOOD, {"context": "Q:", "choices": [], "gold": 0}], {},
                          ":3: choices: empty"),
    "empty choice": ("jsonl", [{**GOOD, "choices": ["Tokyo", ""]}], {}, ":1: choices: every choice"),
    "longer than the context": ("jsonl", [GOOD, {**GOOD, "context": LONG}], {}, ":2: context: needs"),
    "not JSON": ("jsonl", [GOOD, '{"context": "Q:", '], {}, ":2: not JSON"),
    "unknown metric": ("jsonl", [GOOD], {"metrics": ["f1"]}, ": metrics: 'f1'"),
    "unknown split": ("jsonl", [{**GOOD, "split": "dev"}], {}, ":1: split: 'dev'"),
    "llm-jp missing output": ("json", [{"input": "質問：a", "output": "1"}, {"input": "質問：b"}], {},
                              ": samples[1]: output: missing"),
    "llm-jp longer than the context": ("json", [{"input": LONG, "output": "1"}], {}, ": samples[0]: input: needs"),
    "llm-jp unknown metric": ("json", [{"input": "質問：a", "output": "1"}], {"file_metrics": ["bleu_ja"]},
                              ": metrics: 'bleu_ja'"),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_a_bad_task_file_gets_one_line_naming_the_file_the_line_and_the_field(tmp_path, tokenizer, case):
    form, lines, settings, place = BAD_FILES[case]
    settings = dict(settings)
    if form == "jsonl":
        path = write_lines(tmp_path / "task.jsonl", *lines)
    else:
        path = write_llm_jp(tmp_path / "task.json", lines, metrics=settings.pop("file_metrics", None))
    with pytest.raises(TaskError) as caught:
        prepare(tokenizer, TaskConfig(path=str(path), **settings), max_len=128)
    message = str(caught.value)
    assert message.startswith(f"{path}{place}")
    assert "\n" not in message


def test_strict_false_leaves_the_bad_task_out_with_its_line_and_scores_the_others(tmp_path, tokenizer):
    good = write_lines(tmp_path / "good.jsonl", GOOD)
    bad = write_lines(tmp_path / "bad.jsonl", GOOD, {"context": "Q:", "choices": [], "gold": 0})
    tasks = [TaskConfig(path=str(good)), TaskConfig(path=str(bad)), TaskConfig(path=str(JCQA_TEST))]
    errors: list[str] = []
    prepared = prepare_tasks(DownstreamConfig(tasks=tasks, strict=False), tokenizer, 1024, tokenizer.bos_id,
                             tokenizer.eod_id, on_error=errors.append)
    assert [p.task.name for p in prepared] == ["good", "jcommonsenseqa"]
    assert len(errors) == 1 and errors[0].startswith(f"{bad}:2: choices: empty")
    with pytest.raises(TaskError, match=f"^{bad}:2: choices: empty"):  # strict (the default): the run stops
        prepare_tasks(DownstreamConfig(tasks=tasks), tokenizer, 1024, tokenizer.bos_id, tokenizer.eod_id,
                      on_error=errors.append)


def test_two_tasks_of_one_name_are_a_mistake(tmp_path, tokenizer):
    (tmp_path / "a").mkdir()
    first, second = write_lines(tmp_path / "a" / "task.jsonl", GOOD), write_lines(tmp_path / "task.jsonl", GOOD)
    with pytest.raises(TaskError, match="task name 'task' is used twice"):
        prepare(tokenizer, TaskConfig(path=str(first)), TaskConfig(path=str(second)))
    assert [p.task.name for p in prepare(tokenizer, TaskConfig(path=str(first)),
                                         TaskConfig(path=str(second), name="task2"))] == ["task", "task2"]


@pytest.mark.parametrize("line, kind", [(GOOD, "multiple_choice"), ({"context": "吾輩は", "target": "猫"}, "cloze"),
                                        ({"context": "Q: 1+1?\nA:", "answer": "2"}, "qa")])
def test_auto_reads_the_kind_from_the_first_line(tmp_path, line, kind):
    task = load_task(TaskConfig(path=str(write_lines(tmp_path / "t.jsonl", line))))
    assert task.kind == kind
    # the cloze line is Japanese: no space before its answer (issue 48, papercut 2; below)
    assert task.delimiter == {"multiple_choice": " ", "cloze": "", "qa": "\n"}[kind]


def test_a_line_of_two_kinds_is_refused(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", {**GOOD, "answer": "Tokyo"})
    with pytest.raises(TaskError, match=f"^{path}:1: cannot tell the task kind"):
        load_task(TaskConfig(path=str(path)))


def test_train_split_lines_are_only_few_shot_examples_and_the_task_cap_wins(tmp_path):
    lines = [{**GOOD, "context": f"Q{i}:", "split": "train"} for i in range(3)]
    lines += [{**GOOD, "context": f"T{i}:"} for i in range(5)]
    path = write_lines(tmp_path / "t.jsonl", *lines)
    task = load_task(TaskConfig(path=str(path), num_fewshot=2, max_examples=2), max_examples=4)
    assert [e.context for e in task.examples] == ["T0:", "T1:"]
    assert [e.context for e in task.pool] == ["Q0:", "Q1:", "Q2:"]
    assert [e.context for e in load_task(TaskConfig(path=str(path)), max_examples=4).examples] == [
        "T0:", "T1:", "T2:", "T3:"]
    with pytest.raises(TaskError, match="num_fewshot=4 but its train split has 3 examples"):
        load_task(TaskConfig(path=str(path), num_fewshot=4))


def test_llm_jp_eval_json_is_qa_with_the_files_settings_and_its_sibling_train_split():
    task = load_task(TaskConfig(path=str(JCQA_TEST), num_fewshot=2))
    test, train = (json.loads(p.read_text(encoding="utf-8")) for p in (JCQA_TEST, JCQA_TRAIN))
    assert (task.name, task.kind, task.metrics, task.max_new_tokens, task.delimiter) == (
        "jcommonsenseqa", "qa", ["exact_match"], 1, "\n")
    assert task.instruction == test["instruction"]
    assert [(e.context, e.answer) for e in task.examples] == [(s["input"], s["output"]) for s in test["samples"]]
    assert [(e.context, e.answer) for e in task.pool] == [(s["input"], s["output"]) for s in train["samples"]]
    assert task.pool[2].where == f"{JCQA_TRAIN}: samples[2]"


def test_llm_jp_eval_json_without_a_train_folder_has_no_few_shot_pool(tmp_path):
    alone = tmp_path / "evaluation" / "test" / "jcommonsenseqa.json"
    alone.parent.mkdir(parents=True)
    shutil.copy(JCQA_TEST, alone)
    assert load_task(TaskConfig(path=str(alone))).pool == []
    with pytest.raises(TaskError, match=f"^{alone}: num_fewshot=2 but its train split has 0 examples"):
        load_task(TaskConfig(path=str(alone), num_fewshot=2))
    # train_path names another file instead of the sibling folder
    task = load_task(TaskConfig(path=str(alone), num_fewshot=2, train_path=str(JCQA_TRAIN)))
    assert len(task.pool) == 3


def test_naming_the_metrics_gets_past_an_llm_jp_metric_ayumi_does_not_compute(tmp_path):
    """A file whose metrics include one ayumi lacks (bleu_ja) is refused by name; the message says to set the task's
    metrics, and doing so loads it."""
    path = write_llm_jp(tmp_path / "mt.json", [{"input": "翻訳：cat", "output": "猫"}], ["exact_match", "bleu_ja"])
    with pytest.raises(TaskError, match="set the task's metrics"):
        load_task(TaskConfig(path=str(path)))
    assert load_task(TaskConfig(path=str(path), metrics=["char_f1"])).metrics == ["char_f1"]


README_CLOZE = [{"context": "吾輩は猫で", "target": "ある。"}, {"context": "名前はまだ", "target": "無い。"},
                {"context": "It is a truth universally", "target": " acknowledged"}]
"""The README's own-corpus cloze task (tests/test_readme_own_corpus.py writes the same file): mostly Japanese."""


def test_a_japanese_task_without_a_delimiter_gets_none_and_an_english_one_a_space(tmp_path, tokenizer):
    """Issue 48, papercut 2: the README's Japanese cloze task was scored with " " before each target (loglik -10.92;
    -7.40 with delimiter ""): Japanese has no spaces between words. An unset delimiter now follows the language."""
    japanese = write_lines(tmp_path / "cloze_ja.jsonl", *README_CLOZE)
    english = write_lines(tmp_path / "cloze_en.jsonl", {"context": "It is a truth universally", "target": "known"},
                          {"context": "吾輩は猫で", "target": "ある。"})
    choices = write_lines(tmp_path / "mc_ja.jsonl", {"context": "雨の日に使うものは", "choices": ["傘", "靴"], "gold": 0})
    assert load_task(TaskConfig(path=str(japanese))).delimiter == ""
    assert load_task(TaskConfig(path=str(choices))).delimiter == ""
    assert load_task(TaskConfig(path=str(english))).delimiter == " "  # one of two examples Japanese: not most
    assert load_task(TaskConfig(path=str(japanese), delimiter=" ")).delimiter == " "  # a delimiter set wins
    # what is scored: the target's own tokens after the context, no space piece before them
    [prepared] = prepare(tokenizer, TaskConfig(path=str(japanese)), prefix="none")
    continuations = [tokenizer.decode(requests[0].continuation) for requests in prepared.loglik]
    assert continuations == ["ある。", "無い。", " acknowledged"]
